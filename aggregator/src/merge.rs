//! The merged global state: one PN-counter CRDT per (tenant, day).
//!
//! Every region actor (`"{region}/{epoch}"`) publishes its **cumulative** P and
//! N for a (tenant, day). Applying such a delta is a max per actor, which the
//! `crdts` crate gives us through its op semantics: a [`Dot`] with counter `p`
//! for actor `a` raises `a`'s P entry to `p` if it was lower and does nothing
//! otherwise. That is why duplicates, reordering, replays after a restart and
//! several nodes of one region publishing the same actor are all harmless:
//! whatever order the deltas arrive in, the counter ends at Σ max(P) − Σ max(N).
//!
//! `PNCounter` keeps its per-actor entries private, but the broadcast must
//! carry them (a region subtracts its own current actor from the total), so
//! [`Counter`] keeps a small max-merged copy of the per-actor parts next to the
//! CRDT. Debug builds assert after every apply that the two agree.
//!
//! This module is pure state: no I/O, no clock (callers pass `today`), no
//! locking. The consumer feeds it, the broadcaster drains its dirty set, the
//! HTTP layer reads it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crdts::pncounter::{Dir, Op};
use crdts::{CmRDT, Dot, PNCounter};
use num_traits::{Signed, ToPrimitive};
use tierlimit_shared::messages::{ActorPart, Delta};

/// Identifies one counter: a tenant on one UTC day.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantDay {
    pub tenant: String,
    pub day: u32,
}

impl TenantDay {
    pub fn new(tenant: impl Into<String>, day: u32) -> Self {
        TenantDay {
            tenant: tenant.into(),
            day,
        }
    }
}

/// The merged counter of one (tenant, day).
#[derive(Debug, Clone)]
pub struct Counter {
    crdt: PNCounter<String>,
    /// Max-merged cumulative (P, N) per actor, mirroring the CRDT's private
    /// entries so the broadcast can carry them.
    parts: BTreeMap<String, (u64, u64)>,
    /// The deltas partition this counter was rebuilt from: when that
    /// partition is revoked, the counter goes with it.
    partition: i32,
}

impl Counter {
    fn new(partition: i32) -> Self {
        Counter {
            crdt: PNCounter::new(),
            parts: BTreeMap::new(),
            partition,
        }
    }

    /// Merges one actor's cumulative `(p, n)`.
    pub fn apply(&mut self, actor: &str, p: u64, n: u64) -> Merge {
        let entry = self.parts.get(actor).copied().unwrap_or((0, 0));
        let merge = Merge {
            changed: p > entry.0 || n > entry.1,
            stale: p < entry.0 || n < entry.1,
        };
        // An all-zero delta carries no information; recording it would only
        // add an empty part that the CRDT itself does not have.
        if !merge.changed {
            return merge;
        }
        self.parts
            .insert(actor.to_owned(), (entry.0.max(p), entry.1.max(n)));
        self.crdt.apply(Op {
            dot: Dot::new(actor.to_owned(), p),
            dir: Dir::Pos,
        });
        self.crdt.apply(Op {
            dot: Dot::new(actor.to_owned(), n),
            dir: Dir::Neg,
        });
        debug_assert_eq!(
            self.parts_sum(),
            self.crdt
                .read()
                .to_i128()
                .expect("Σ of u64 parts fits in i128"),
            "per-actor parts disagree with the PN counter"
        );
        merge
    }

    fn parts_sum(&self) -> i128 {
        self.parts
            .values()
            .map(|&(p, n)| i128::from(p) - i128::from(n))
            .sum()
    }

    /// Σ P − Σ N, saturated into `u64`.
    ///
    /// It cannot go negative: every delta has `n <= p` (checked at decode), so
    /// each actor's max N is at most its max P. Saturation only guards against
    /// absurd inputs whose sum overflows `u64`.
    pub fn total(&self) -> u64 {
        let v = self.crdt.read();
        if v.is_negative() {
            0
        } else {
            v.to_u64().unwrap_or(u64::MAX)
        }
    }

    /// Per-actor parts, ordered by actor.
    pub fn parts(&self) -> Vec<ActorPart> {
        self.parts
            .iter()
            .map(|(actor, &(p, n))| ActorPart {
                actor: actor.clone(),
                p,
                n,
            })
            .collect()
    }

    /// Net count per region (all epochs of a region summed), ordered by region.
    pub fn regions(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for part in self.parts() {
            let sum: &mut u64 = out.entry(part.region().to_owned()).or_default();
            *sum = sum.saturating_add(part.net());
        }
        out
    }

    pub fn partition(&self) -> i32 {
        self.partition
    }
}

/// What merging one actor's cumulative counts did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Merge {
    /// P or N grew.
    pub changed: bool,
    /// P or N is below what the actor already published: two publishers of
    /// the actor reached Kafka out of order. Harmless for the merge (max),
    /// but on a compacted topic the key's latest message now understates
    /// the actor until it publishes again.
    pub stale: bool,
}

/// What [`Merged::apply`] did with a delta.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The counter grew from `before` to `after`.
    Changed {
        before: u64,
        after: u64,
        stale: bool,
    },
    /// Nothing new: a duplicate, a replay or an older delta of the actor.
    Unchanged { stale: bool },
    /// The day is past the retention window; dropped.
    Expired,
    /// The day is more than one day ahead of ours; dropped, since no
    /// correct region clock can produce it and keeping it would hold memory
    /// past any retention.
    Future,
}

/// Every counter this instance holds, plus which of them still need to be
/// broadcast.
#[derive(Debug)]
pub struct Merged {
    counters: HashMap<TenantDay, Counter>,
    /// Days kept: `today - retention_days < day <= today + 1`.
    retention_days: u32,
    /// Changed since their last broadcast.
    dirty: BTreeSet<TenantDay>,
    /// Subset of `dirty` that crossed the limit: broadcast without waiting
    /// for the next interval.
    urgent: BTreeSet<TenantDay>,
}

impl Merged {
    pub fn new(retention_days: u32) -> Self {
        Merged {
            counters: HashMap::new(),
            retention_days: retention_days.max(1),
            dirty: BTreeSet::new(),
            urgent: BTreeSet::new(),
        }
    }

    /// Applies a new retention (from a reloaded configuration); takes effect
    /// at the next [`Merged::expire`].
    pub fn set_retention(&mut self, retention_days: u32) {
        self.retention_days = retention_days.max(1);
    }

    fn oldest_kept(&self, today: u32) -> u32 {
        today.saturating_sub(self.retention_days - 1)
    }

    /// Merges a delta read from `partition`. Changed counters become dirty.
    pub fn apply(&mut self, partition: i32, delta: &Delta, today: u32) -> Applied {
        if delta.day < self.oldest_kept(today) {
            return Applied::Expired;
        }
        if delta.day > today.saturating_add(1) {
            return Applied::Future;
        }
        let key = TenantDay::new(delta.tenant.as_str(), delta.day);
        let counter = self
            .counters
            .entry(key.clone())
            .or_insert_with(|| Counter::new(partition));
        let before = counter.total();
        let merge = counter.apply(&delta.actor, delta.p, delta.n);
        if !merge.changed {
            return Applied::Unchanged { stale: merge.stale };
        }
        let after = counter.total();
        self.dirty.insert(key);
        Applied::Changed {
            before,
            after,
            stale: merge.stale,
        }
    }

    pub fn get(&self, tenant: &str, day: u32) -> Option<&Counter> {
        // A borrowed lookup would need a custom Borrow impl; the allocation
        // is negligible next to an HTTP request.
        self.counters.get(&TenantDay::new(tenant, day))
    }

    /// Every counter of `day`, in no particular order.
    pub fn day(&self, day: u32) -> impl Iterator<Item = (&str, &Counter)> {
        self.counters
            .iter()
            .filter(move |(k, _)| k.day == day)
            .map(|(k, c)| (k.tenant.as_str(), c))
    }

    /// Number of (tenant, day) counters held.
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// Forgets every counter rebuilt from one of `partitions` (they were
    /// revoked, or are about to be re-read from the beginning). Returns how
    /// many were dropped.
    pub fn drop_partitions(&mut self, partitions: &[i32]) -> usize {
        let before = self.counters.len();
        self.counters
            .retain(|_, c| !partitions.contains(&c.partition));
        let counters = &self.counters;
        self.dirty.retain(|k| counters.contains_key(k));
        self.urgent.retain(|k| counters.contains_key(k));
        before - self.counters.len()
    }

    /// Drops days that fell out of the retention window. Returns how many
    /// counters were dropped.
    pub fn expire(&mut self, today: u32) -> usize {
        let oldest = self.oldest_kept(today);
        let before = self.counters.len();
        self.counters.retain(|k, _| k.day >= oldest);
        self.dirty.retain(|k| k.day >= oldest);
        self.urgent.retain(|k| k.day >= oldest);
        before - self.counters.len()
    }

    /// Marks a counter for broadcast (no-op if it is not held). Returns
    /// whether it is held.
    pub fn mark_dirty(&mut self, key: &TenantDay) -> bool {
        let held = self.counters.contains_key(key);
        if held {
            self.dirty.insert(key.clone());
        }
        held
    }

    /// Marks every counter of `day` whose tenant passes `concerned` dirty
    /// (a reload changed the unknown-tenant limit). Returns how many.
    pub fn mark_day_dirty_where(&mut self, day: u32, concerned: impl Fn(&str) -> bool) -> usize {
        let mut n = 0;
        for k in self.counters.keys() {
            if k.day == day && concerned(&k.tenant) {
                self.dirty.insert(k.clone());
                n += 1;
            }
        }
        n
    }

    /// Marks a dirty counter for immediate broadcast.
    pub fn mark_urgent(&mut self, key: &TenantDay) {
        if self.counters.contains_key(key) {
            self.dirty.insert(key.clone());
            self.urgent.insert(key.clone());
        }
    }

    /// Marks every counter of `day` read from one of `partitions` dirty (a
    /// partition just caught up, or the limits changed).
    pub fn mark_day_dirty(&mut self, day: u32, partitions: Option<&[i32]>) -> usize {
        let mut n = 0;
        for (k, c) in &self.counters {
            if k.day == day && partitions.is_none_or(|ps| ps.contains(&c.partition)) {
                self.dirty.insert(k.clone());
                n += 1;
            }
        }
        n
    }

    /// Whether any counter waits for an immediate broadcast.
    pub fn has_urgent(&self) -> bool {
        !self.urgent.is_empty()
    }

    /// Takes the dirty counters whose partition passes `eligible` (urgent
    /// ones only when `urgent_only`), leaving the others dirty. The caller
    /// broadcasts them and puts back the ones that failed with
    /// [`Merged::mark_dirty`].
    pub fn take_dirty(
        &mut self,
        urgent_only: bool,
        eligible: impl Fn(i32) -> bool,
    ) -> Vec<(TenantDay, Counter)> {
        let source = if urgent_only {
            &self.urgent
        } else {
            &self.dirty
        };
        let taken: Vec<TenantDay> = source
            .iter()
            .filter(|k| self.counters.get(*k).is_some_and(|c| eligible(c.partition)))
            .cloned()
            .collect();
        taken
            .into_iter()
            .filter_map(|k| {
                self.dirty.remove(&k);
                self.urgent.remove(&k);
                let c = self.counters.get(&k)?.clone();
                Some((k, c))
            })
            .collect()
    }

    /// Number of counters waiting for a broadcast.
    pub fn dirty_len(&self) -> usize {
        self.dirty.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tierlimit_shared::messages::actor;

    const TODAY: u32 = 20_000;

    fn delta(tenant: &str, day: u32, actor: &str, p: u64, n: u64) -> Delta {
        Delta::new(tenant, day, actor.to_owned(), p, n, 0)
    }

    #[test]
    fn max_per_actor_sum_over_actors() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e1");
        let us = actor("us", "u1");
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 10, 2), TODAY),
            Applied::Changed {
                before: 0,
                after: 8,
                stale: false
            }
        );
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &us, 5, 0), TODAY),
            Applied::Changed {
                before: 8,
                after: 13,
                stale: false
            }
        );
        // An older delta of eu and a duplicate change nothing.
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 7, 1), TODAY),
            Applied::Unchanged { stale: true }
        );
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &us, 5, 0), TODAY),
            Applied::Unchanged { stale: false }
        );
        // Only N grew.
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 10, 4), TODAY),
            Applied::Changed {
                before: 13,
                after: 11,
                stale: false
            }
        );
        let c = m.get("acme", TODAY).unwrap();
        assert_eq!(c.total(), 11);
        assert_eq!(
            c.parts(),
            vec![
                ActorPart {
                    actor: eu.clone(),
                    p: 10,
                    n: 4
                },
                ActorPart {
                    actor: us.clone(),
                    p: 5,
                    n: 0
                },
            ]
        );
        assert_eq!(
            c.regions(),
            BTreeMap::from([("eu".into(), 6), ("us".into(), 5)])
        );
    }

    #[test]
    fn epochs_of_one_region_add_up() {
        let mut m = Merged::new(2);
        m.apply(0, &delta("acme", TODAY, &actor("eu", "old"), 40, 0), TODAY);
        m.apply(0, &delta("acme", TODAY, &actor("eu", "new"), 3, 1), TODAY);
        let c = m.get("acme", TODAY).unwrap();
        assert_eq!(c.total(), 42);
        assert_eq!(c.regions(), BTreeMap::from([("eu".into(), 42)]));
    }

    #[test]
    fn zero_delta_is_no_part() {
        let mut m = Merged::new(2);
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &actor("eu", "e"), 0, 0), TODAY),
            Applied::Unchanged { stale: false }
        );
        assert!(m.get("acme", TODAY).unwrap().parts().is_empty());
    }

    #[test]
    fn out_of_order_publishers_are_stale() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("acme", TODAY, &eu, 50, 5), TODAY);
        // Higher P but lower N: merged, and still flagged.
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 55, 3), TODAY),
            Applied::Changed {
                before: 45,
                after: 50,
                stale: true
            }
        );
        assert_eq!(
            m.get("acme", TODAY).unwrap().parts()[0],
            ActorPart {
                actor: eu,
                p: 55,
                n: 5
            }
        );
    }

    #[test]
    fn tenants_and_days_are_separate() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY);
        m.apply(1, &delta("b", TODAY, &eu, 2, 0), TODAY);
        m.apply(0, &delta("a", TODAY - 1, &eu, 3, 0), TODAY);
        assert_eq!(m.get("a", TODAY).unwrap().total(), 1);
        assert_eq!(m.get("b", TODAY).unwrap().total(), 2);
        assert_eq!(m.get("a", TODAY - 1).unwrap().total(), 3);
        assert_eq!(m.len(), 3);
        assert_eq!(m.day(TODAY).count(), 2);
    }

    #[test]
    fn retention_window() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        assert_eq!(
            m.apply(0, &delta("a", TODAY - 2, &eu, 1, 0), TODAY),
            Applied::Expired
        );
        assert!(matches!(
            m.apply(0, &delta("a", TODAY - 1, &eu, 1, 0), TODAY),
            Applied::Changed { .. }
        ));
        assert!(matches!(
            m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY),
            Applied::Changed { .. }
        ));
        // A region whose clock is just past midnight.
        assert!(matches!(
            m.apply(0, &delta("a", TODAY + 1, &eu, 1, 0), TODAY),
            Applied::Changed { .. }
        ));
        assert_eq!(
            m.apply(0, &delta("a", TODAY + 2, &eu, 1, 0), TODAY),
            Applied::Future
        );
        assert_eq!(m.len(), 3);
        // The next day, yesterday becomes too old.
        assert_eq!(m.expire(TODAY + 1), 1);
        assert!(m.get("a", TODAY - 1).is_none());
        assert_eq!(m.len(), 2);
        assert!(m
            .take_dirty(false, |_| true)
            .iter()
            .all(|(k, _)| k.day >= TODAY));
    }

    #[test]
    fn drop_revoked_partitions() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY);
        m.apply(1, &delta("b", TODAY, &eu, 1, 0), TODAY);
        m.apply(2, &delta("c", TODAY, &eu, 1, 0), TODAY);
        assert_eq!(m.drop_partitions(&[0, 2]), 2);
        assert!(m.get("a", TODAY).is_none());
        assert_eq!(m.get("b", TODAY).unwrap().partition(), 1);
        let dirty = m.take_dirty(false, |_| true);
        assert_eq!(dirty.len(), 1);
        assert_eq!(dirty[0].0, TenantDay::new("b", TODAY));
    }

    #[test]
    fn dirty_set_is_taken_per_eligible_partition() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY);
        m.apply(1, &delta("b", TODAY, &eu, 1, 0), TODAY);
        assert_eq!(m.dirty_len(), 2);
        // Partition 1 is still catching up: its counter stays dirty.
        let taken = m.take_dirty(false, |p| p == 0);
        assert_eq!(taken.len(), 1);
        assert_eq!(m.dirty_len(), 1);
        // Nothing changed, nothing to take; a failed broadcast is put back.
        assert!(m.take_dirty(false, |p| p == 0).is_empty());
        m.mark_dirty(&taken[0].0);
        assert_eq!(m.take_dirty(false, |p| p == 0).len(), 1);
        // Unknown keys are not resurrected.
        m.mark_dirty(&TenantDay::new("zzz", TODAY));
        assert!(m
            .take_dirty(false, |_| true)
            .iter()
            .all(|(k, _)| k.tenant != "zzz"));
    }

    #[test]
    fn urgent_is_taken_alone() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY);
        m.apply(0, &delta("b", TODAY, &eu, 1, 0), TODAY);
        m.mark_urgent(&TenantDay::new("b", TODAY));
        assert!(m.has_urgent());
        let urgent = m.take_dirty(true, |_| true);
        assert_eq!(urgent.len(), 1);
        assert_eq!(urgent[0].0.tenant, "b");
        assert!(!m.has_urgent());
        assert_eq!(m.dirty_len(), 1);
    }

    #[test]
    fn mark_day_dirty_for_caught_up_partitions() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY);
        m.apply(1, &delta("b", TODAY, &eu, 1, 0), TODAY);
        m.apply(1, &delta("b", TODAY - 1, &eu, 1, 0), TODAY);
        m.take_dirty(false, |_| true);
        assert_eq!(m.mark_day_dirty(TODAY, Some(&[1])), 1);
        assert_eq!(m.mark_day_dirty(TODAY, None), 2);
        assert_eq!(m.dirty_len(), 2);
    }

    #[test]
    fn absurd_totals_saturate() {
        let mut m = Merged::new(2);
        m.apply(0, &delta("a", TODAY, &actor("eu", "1"), u64::MAX, 0), TODAY);
        m.apply(0, &delta("a", TODAY, &actor("us", "1"), u64::MAX, 0), TODAY);
        assert_eq!(m.get("a", TODAY).unwrap().total(), u64::MAX);
        // Two parts summing to 2^64 + 1: wrapping would say 1.
        m.apply(0, &delta("b", TODAY, &actor("eu", "1"), u64::MAX, 0), TODAY);
        m.apply(0, &delta("b", TODAY, &actor("us", "1"), 2, 0), TODAY);
        assert_eq!(m.get("b", TODAY).unwrap().total(), u64::MAX);
        assert_eq!(m.get("b", TODAY).unwrap().regions()["eu"], u64::MAX);
    }

    /// One actor's history: cumulative (p, n) pairs, monotone in both.
    fn history() -> impl Strategy<Value = Vec<(u64, u64)>> {
        prop::collection::vec((0u64..1_000, 0u64..1_000), 1..12).prop_map(|steps| {
            let (mut p, mut n) = (0u64, 0u64);
            steps
                .into_iter()
                .map(|(dp, dn)| {
                    p += dp;
                    // Refunds never exceed what was allowed.
                    n = (n + dn).min(p);
                    (p, n)
                })
                .collect()
        })
    }

    /// An actor id and its history.
    type Actor = (String, Vec<(u64, u64)>);

    /// Actors with monotone histories, and every one of their deltas plus
    /// arbitrary duplicates, in an arbitrary order.
    fn scenario() -> impl Strategy<Value = (Vec<Actor>, Vec<Delta>)> {
        prop::collection::vec(history(), 1..6)
            .prop_flat_map(|histories| {
                let actors: Vec<Actor> = histories
                    .into_iter()
                    .enumerate()
                    .map(|(i, h)| (actor(["eu", "us", "ap"][i % 3], &format!("e{i}")), h))
                    .collect();
                let deltas: Vec<Delta> = actors
                    .iter()
                    .flat_map(|(a, h)| h.iter().map(|&(p, n)| delta("acme", TODAY, a, p, n)))
                    .collect();
                let len = deltas.len();
                (
                    Just(actors),
                    Just(deltas),
                    prop::collection::vec(0..len, 0..2 * len),
                )
            })
            .prop_flat_map(|(actors, mut deltas, dups)| {
                let copies: Vec<Delta> = dups.iter().map(|&i| deltas[i].clone()).collect();
                deltas.extend(copies);
                (Just(actors), Just(deltas).prop_shuffle())
            })
    }

    proptest! {
        /// Whatever the parts (forged ones included), the total is the
        /// exact Σ (p − n) when it fits in u64 and u64::MAX when it does
        /// not: never wrapped to a small number. So is each region's sum.
        #[test]
        fn totals_saturate_never_wrap(parts in prop::collection::vec((any::<u64>(), any::<u64>()), 1..6)) {
            let mut m = Merged::new(2);
            let mut exact = 0u128;
            for (i, &(a, b)) in parts.iter().enumerate() {
                let (p, n) = (a.max(b), a.min(b));
                exact += u128::from(p - n);
                m.apply(0, &delta("acme", TODAY, &actor("eu", &format!("e{i}")), p, n), TODAY);
            }
            let c = m.get("acme", TODAY).unwrap();
            let expected = exact.min(u128::from(u64::MAX)) as u64;
            prop_assert_eq!(c.total(), expected);
            prop_assert_eq!(c.regions().get("eu").copied().unwrap_or(0), expected);
        }

        /// Any interleaving, duplication and reordering of the deltas of any
        /// set of actors merges to exactly Σ final(p) − Σ final(n), with each
        /// actor's part at its final (p, n).
        #[test]
        fn any_order_merges_to_final_sum((actors, deltas) in scenario()) {
            let mut m = Merged::new(2);
            for d in &deltas {
                m.apply(0, d, TODAY);
            }
            let expected: u64 = actors
                .iter()
                .map(|(_, h)| { let (p, n) = *h.last().unwrap(); p - n })
                .sum();
            let total = m.get("acme", TODAY).map(Counter::total).unwrap_or(0);
            prop_assert_eq!(total, expected);
            let parts = m.get("acme", TODAY).map(Counter::parts).unwrap_or_default();
            for (a, h) in &actors {
                let last = *h.last().unwrap();
                match parts.iter().find(|p| &p.actor == a) {
                    Some(part) => prop_assert_eq!((part.p, part.n), last),
                    // Only an actor that never counted anything has no part.
                    None => prop_assert_eq!(last, (0, 0)),
                }
            }
        }

        /// Applying the same deltas twice in a row is the same as once.
        #[test]
        fn replay_is_idempotent(histories in prop::collection::vec(history(), 1..4)) {
            let mut m = Merged::new(2);
            let all: Vec<Delta> = histories
                .iter()
                .enumerate()
                .flat_map(|(i, h)| {
                    let a = actor("eu", &format!("e{i}"));
                    h.iter().map(move |&(p, n)| delta("acme", TODAY, &a, p, n)).collect::<Vec<_>>()
                })
                .collect();
            for d in &all { m.apply(0, d, TODAY); }
            let once = m.get("acme", TODAY).map(Counter::total);
            for d in &all {
                let again = m.apply(0, d, TODAY);
                // Earlier deltas of an actor are stale now, but change nothing.
                let unchanged = matches!(again, Applied::Unchanged { .. });
                prop_assert!(unchanged);
            }
            prop_assert_eq!(m.get("acme", TODAY).map(Counter::total), once);
        }
    }
}
