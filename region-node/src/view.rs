//! The broadcast view: the aggregator's latest global totals per
//! (tenant, day), as read by the follower from the global topic.
//!
//! Updates are merged per actor by max (the same CRDT rule as the
//! aggregator's), so a broadcast that arrives late or twice — e.g. from two
//! aggregator instances around a rebalance — can never move the view back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;

use tierlimit_shared::messages::{actor_region, GlobalUpdate};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    /// actor → (p, n), max-merged.
    pub parts: std::collections::BTreeMap<String, (u64, u64)>,
    pub over_limit: bool,
    pub ts_ms: u64,
}

/// Σ (p − n) over `parts`, saturating at `u64::MAX`.
///
/// Never wrapping: two forged or absurd parts summing past 2^64 must read
/// as "over any limit", not as a small total that admits the tenant.
/// (Signed broadcasts keep forged parts out; this keeps a bug or a
/// compromised aggregator from turning a huge count into a small one.)
pub fn net_sum(parts: impl IntoIterator<Item = (u64, u64)>) -> u64 {
    parts
        .into_iter()
        .fold(0u64, |sum, (p, n)| sum.saturating_add(p.saturating_sub(n)))
}

impl Entry {
    /// The global total: Σ (p − n), saturating.
    pub fn total(&self) -> u64 {
        net_sum(self.parts.values().copied())
    }

    /// `(epoch, p − n)` of the given region's actors.
    pub fn region_parts<'a>(
        &'a self,
        region: &'a str,
    ) -> impl Iterator<Item = (&'a str, u64)> + 'a {
        self.parts
            .iter()
            .filter(move |(actor, _)| actor_region(actor) == region)
            .map(|(actor, (p, n))| {
                let epoch = actor.split_once('/').map_or("", |(_, e)| e);
                (epoch, p.saturating_sub(*n))
            })
    }
}

#[derive(Default)]
pub struct View {
    /// tenant → day → entry (keyed by tenant first so the hot path can look
    /// up with a borrowed `&str`).
    entries: RwLock<HashMap<String, HashMap<u32, Entry>>>,
    /// Wall-clock ms when the follower last confirmed it had read everything
    /// the broker holds (0 = never).
    fresh_at_ms: AtomicU64,
    caught_up: AtomicBool,
}

impl View {
    pub fn new() -> View {
        View::default()
    }

    /// Merges one broadcast; returns whether it changed the view.
    pub fn apply(&self, u: &GlobalUpdate) -> bool {
        let mut map = self.entries.write().expect("view lock poisoned");
        let e = map
            .entry(u.tenant.clone())
            .or_default()
            .entry(u.day)
            .or_default();
        let before = e.clone();
        for part in &u.parts {
            let slot = e.parts.entry(part.actor.clone()).or_insert((0, 0));
            slot.0 = slot.0.max(part.p);
            slot.1 = slot.1.max(part.n);
        }
        if u.ts_ms >= e.ts_ms {
            e.over_limit = u.over_limit;
            e.ts_ms = u.ts_ms;
        }
        *e != before
    }

    pub fn get(&self, tenant: &str, day: u32) -> Option<Entry> {
        self.with(tenant, day, |e| e.cloned())
    }

    /// Calls `f` with the entry without cloning it (hot path).
    pub fn with<R>(&self, tenant: &str, day: u32, f: impl FnOnce(Option<&Entry>) -> R) -> R {
        let map = self.entries.read().expect("view lock poisoned");
        f(map.get(tenant).and_then(|days| days.get(&day)))
    }

    /// Drops days before `oldest`.
    pub fn prune(&self, oldest: u32) {
        let mut map = self.entries.write().expect("view lock poisoned");
        map.retain(|_, days| {
            days.retain(|d, _| *d >= oldest);
            !days.is_empty()
        });
    }

    /// Number of (tenant, day) entries.
    pub fn len(&self) -> usize {
        self.entries
            .read()
            .expect("view lock poisoned")
            .values()
            .map(|d| d.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn mark_fresh(&self, now_ms: u64) {
        // Never backwards: a confirmation as of an older moment (a
        // partition that reached an older watermark) says nothing newer.
        self.fresh_at_ms.fetch_max(now_ms, Ordering::Relaxed);
        self.caught_up.store(true, Ordering::Relaxed);
    }

    /// Read to the end once (readiness), without confirming freshness.
    pub fn mark_caught_up(&self) {
        self.caught_up.store(true, Ordering::Relaxed);
    }

    pub fn caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Relaxed)
    }

    /// Milliseconds since the view was last known complete; `None` if never.
    pub fn age_ms(&self, now_ms: u64) -> Option<u64> {
        match self.fresh_at_ms.load(Ordering::Relaxed) {
            0 => None,
            t => Some(now_ms.saturating_sub(t)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierlimit_shared::messages::{ActorPart, VERSION};

    fn update(parts: &[(&str, u64, u64)], ts: u64) -> GlobalUpdate {
        GlobalUpdate {
            v: VERSION,
            tenant: "t".into(),
            day: 1,
            total: 0,
            parts: parts
                .iter()
                .map(|(a, p, n)| ActorPart {
                    actor: a.to_string(),
                    p: *p,
                    n: *n,
                })
                .collect(),
            limit: Some(100),
            over_limit: false,
            ts_ms: ts,
        }
    }

    #[test]
    fn forged_parts_past_2_pow_64_saturate_instead_of_wrapping() {
        let v = View::new();
        // Wrapping, these would sum to 1 and admit the tenant.
        v.apply(&update(&[("eu/a", u64::MAX, 0), ("us/b", 2, 0)], 1));
        assert_eq!(v.get("t", 1).unwrap().total(), u64::MAX);
        assert_eq!(net_sum([(u64::MAX, 0), (u64::MAX, 0), (5, 1)]), u64::MAX);
        assert_eq!(net_sum([(10, 3), (7, 7), (1, 5)]), 7);
    }

    proptest::proptest! {
        /// The saturating sum is the exact sum whenever that fits in u64,
        /// and u64::MAX otherwise.
        #[test]
        fn net_sum_is_exact_or_saturated(parts in proptest::collection::vec((proptest::prelude::any::<u64>(), proptest::prelude::any::<u64>()), 0..8)) {
            let exact: u128 = parts.iter().map(|&(p, n)| u128::from(p.saturating_sub(n))).sum();
            proptest::prop_assert_eq!(u128::from(net_sum(parts)), exact.min(u128::from(u64::MAX)));
        }
    }

    #[test]
    fn late_broadcast_never_moves_back() {
        let v = View::new();
        assert!(v.apply(&update(&[("eu/a", 10, 1), ("us/b", 5, 0)], 2)));
        assert!(!v.apply(&update(&[("eu/a", 7, 0)], 1)));
        let e = v.get("t", 1).unwrap();
        assert_eq!(e.total(), 14);
        let eu: Vec<_> = e.region_parts("eu").collect();
        assert_eq!(eu, vec![("a", 9)]);
    }
}
