//! The broadcast threshold and the bound a region-node takes for a tenant
//! it holds no broadcast entry for (issue 29, item 3), over every
//! (limit, fraction, regions): a region alone always reaches the threshold
//! and then its whole limit, the regions together never pass it, and a
//! deployment mixing the previous release's nodes with this one's stays
//! within the limit whichever upgrades first.
//!
//! The model is the decision rule of `region-node/src/decision.rs` (`call`)
//! and `decide.lua` (`others = max(T_view, bound) − mine_view`), with the
//! aggregator's rule of `aggregator/src/state.rs` (`wanted`: broadcast once
//! the merged total reaches θ, and every change after), every delta and
//! broadcast delivered before the next check. The real processes, with
//! their delays, are `tests/tests/global.rs`,
//! `small_and_odd_limits_reach_the_threshold_and_then_the_limit`.

use proptest::prelude::*;
use tierlimit_shared::config::AggregatorSettings;

fn settings(fraction: f64) -> AggregatorSettings {
    AggregatorSettings {
        broadcast_fraction: fraction,
        ..AggregatorSettings::default()
    }
}

/// The previous release's missing-entry bound: the threshold itself.
fn previous_release_bound(s: &AggregatorSettings, limit: u64) -> u64 {
    s.broadcast_threshold(limit)
}

/// Which release a region's nodes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    Previous,
    This,
}

/// Regions spending one unit per check: first in `order` (indices taken
/// modulo the number of regions), then round robin until a whole round
/// admits nothing; returns each region's admitted units.
fn spend(s: &AggregatorSettings, limit: u64, releases: &[Release], order: &[usize]) -> Vec<u64> {
    let theta = s.broadcast_threshold(limit);
    let regions = releases.len();
    let mut own = vec![0u64; regions];
    // Whether the aggregator has broadcast the counter (it stays broadcast).
    let mut broadcast = false;
    let mut check = |r: usize| -> bool {
        let total: u64 = own.iter().sum();
        let (view_total, mine_view) = if broadcast { (total, own[r]) } else { (0, 0) };
        let bound = match releases[r] {
            Release::Previous => previous_release_bound(s, limit),
            Release::This => s.unbroadcast_bound(limit),
        };
        let others = view_total.max(bound).saturating_sub(mine_view);
        if others + own[r] >= limit {
            return false;
        }
        own[r] += 1;
        if own.iter().sum::<u64>() >= theta {
            broadcast = true;
        }
        true
    };
    for &i in order {
        check(i % regions);
    }
    while (0..regions).fold(false, |any, r| check(r) | any) {}
    own
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// One region alone reaches θ (so its crossing is broadcast), then the
    /// whole limit; several regions together reach the limit exactly.
    #[test]
    fn every_limit_is_reached_exactly_alone_or_split(
        limit in prop_oneof![1u64..=12, 1u64..=100_000],
        fraction in prop_oneof![Just(0.0), Just(0.25), Just(0.5), 0.0f64..=0.5],
        regions in 1usize..=6,
        order in proptest::collection::vec(0usize..6, 1..12),
    ) {
        let s = settings(fraction);
        let theta = s.broadcast_threshold(limit);
        let bound = s.unbroadcast_bound(limit);
        // Alone, before any broadcast: θ is within reach.
        prop_assert!(limit - bound >= theta, "L {limit} f {fraction}: alone reaches {} < θ {theta}", limit - bound);
        if limit <= 2000 {
            let alone = spend(&s, limit, &[Release::This], &[0]);
            prop_assert_eq!(alone, vec![limit], "L {} f {}", limit, fraction);
            let split = spend(&s, limit, &vec![Release::This; regions], &order);
            prop_assert_eq!(split.iter().sum::<u64>(), limit, "L {} f {} {:?}", limit, fraction, split);
        }
    }

    /// The no-entry bound is sound. Regions spend, and publish what they
    /// spent at random moments; the aggregator merges what was published
    /// and broadcasts the counter from θ on. At every check, the others'
    /// spend a region assumes covers what the other regions had published
    /// (what is unpublished is the overshoot every view has, README
    /// "Global overshoot"), for nodes of either release.
    #[test]
    fn the_assumed_others_cover_what_the_aggregator_holds(
        limit in 1u64..=60,
        fraction in prop_oneof![Just(0.25), Just(0.5), 0.0f64..=0.5],
        regions in 1usize..=4,
        events in proptest::collection::vec((0usize..4, any::<bool>()), 1..200),
        previous in any::<bool>(),
    ) {
        let s = settings(fraction);
        let theta = s.broadcast_threshold(limit);
        let bound = if previous { previous_release_bound(&s, limit) } else { s.unbroadcast_bound(limit) };
        let (mut own, mut published) = (vec![0u64; regions], vec![0u64; regions]);
        // The view: the merged parts as last broadcast (None: no entry).
        let mut view: Option<Vec<u64>> = None;
        for (r, publish) in events {
            let r = r % regions;
            if publish {
                published[r] = own[r];
                let merged: u64 = published.iter().sum();
                if view.is_some() || merged >= theta {
                    view = Some(published.clone());
                }
                continue;
            }
            let (view_total, mine_view) = view
                .as_ref()
                .map_or((0, 0), |v| (v.iter().sum::<u64>(), v[r]));
            let others = view_total.max(bound).saturating_sub(mine_view);
            let held: u64 = (0..regions).filter(|&o| o != r).map(|o| published[o]).sum();
            prop_assert!(
                others >= held,
                "L {} f {} θ {}: region {} assumes {} of the others, the aggregator holds {}",
                limit, fraction, theta, r, others, held
            );
            if others + own[r] < limit {
                own[r] += 1;
            }
        }
    }

    /// A rolling upgrade: regions of the previous release (missing entry =
    /// θ) beside regions of this one (θ − 1), the aggregator's rule the
    /// same in both. Never more than the limit; once a region of this
    /// release is among them, the limit is reached exactly.
    #[test]
    fn mixed_releases_never_pass_the_limit(
        limit in 1u64..=500,
        fraction in 0.0f64..=0.5,
        releases in proptest::collection::vec(prop_oneof![Just(Release::Previous), Just(Release::This)], 1..=5),
        order in proptest::collection::vec(0usize..5, 1..12),
    ) {
        let s = settings(fraction);
        let spent = spend(&s, limit, &releases, &order);
        let total: u64 = spent.iter().sum();
        prop_assert!(total <= limit, "{releases:?} spent {spent:?} of {limit}");
        if releases.contains(&Release::This) {
            prop_assert_eq!(total, limit, "{:?} spent {:?}", releases, spent);
        }
    }
}

/// The issue's figures: L = 1 at the default fraction admits its first
/// request; L = 5 at ½ reaches 5 in one region (it stalled at 2).
#[test]
fn the_issues_limits_reach_their_limit_alone() {
    for (limit, fraction) in [(1, 0.25), (1, 0.5), (2, 0.5), (3, 0.5), (5, 0.5), (7, 0.5)] {
        let s = settings(fraction);
        assert_eq!(
            spend(&s, limit, &[Release::This], &[0]),
            vec![limit],
            "L {limit} f {fraction}"
        );
    }
    // The previous release's rule stalls them (what the issue saw).
    let s = settings(0.5);
    assert_eq!(spend(&s, 5, &[Release::Previous], &[0]), vec![2]);
    assert_eq!(
        spend(&settings(0.25), 1, &[Release::Previous], &[0]),
        vec![0]
    );
}
