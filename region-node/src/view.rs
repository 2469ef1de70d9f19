//! The broadcast view: the aggregator's latest global totals per
//! (tenant, period), as read by the follower from the global topic. A
//! period is a UTC day for every tenant with a global tier (the day tier),
//! and an hour, ISO week or calendar month for the tenants whose plans have
//! tiers of those periods (`shared/src/period.rs`).
//!
//! Updates are merged per actor by max (the same CRDT rule as the
//! aggregator's), so a broadcast that arrives late or twice — e.g. from two
//! aggregator instances around a rebalance — can never move the view back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use tierlimit_shared::messages::{actor_region, GlobalUpdate};
use tierlimit_shared::period::{Period, PeriodKind};

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

/// Shards of one day's map: a decision locks one of them, for reading,
/// for as long as it looks at one entry; the follower locks one for
/// writing only to swap a value it built outside the lock.
const SHARDS: usize = 64;

/// One shard of a day: tenant → entry.
type Shard = RwLock<HashMap<Box<str>, Entry>>;

/// One period of the view (a UTC day, or an hour, week or month), sharded
/// by tenant.
struct DayView {
    period: Period,
    shards: Box<[Shard]>,
    /// Entries in this day (the sum of the shards' lengths).
    entries: AtomicUsize,
}

impl DayView {
    fn new(period: Period) -> DayView {
        DayView {
            period,
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            entries: AtomicUsize::new(0),
        }
    }

    fn shard(&self, tenant: &str) -> &Shard {
        // FNV-1a: cheap, and only spreads tenants over shards (each
        // shard's HashMap keeps its own DoS-resistant hasher).
        let h = tenant.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        &self.shards[(h % SHARDS as u64) as usize]
    }
}

/// The broadcast view, as the decision path reads it.
///
/// Why this shape (issue 10, item 4): the decision path reads the view on
/// every check, and the follower writes it for every broadcast and drops
/// yesterday at midnight. With one `RwLock<HashMap>`, a write (and its
/// allocations, and a prune walking every entry) stalled every decision
/// for its whole length. Now:
/// - days are separate maps behind a small list (`days`, at most a few
///   entries) whose lock is held for nanoseconds, written only when a day
///   appears or is dropped; dropping a day is O(1) under that lock and the
///   day's entries are freed after it is released;
/// - a day is 64 shards; a decision read-locks one shard, so a writer
///   blocks at most the decisions of one 64th of the tenants, for as long
///   as an insert takes;
/// - the follower (the only writer) builds the merged entry outside any
///   write lock (cloning the old one under a read lock, which blocks no
///   decision) and takes the shard's write lock only to put it in place;
///   the value it replaces is dropped after the lock is released. The one
///   allocation left under a write lock is a shard's table growing for a
///   new tenant (amortised, and 1/64 of the map).
///
/// Sharded std locks rather than a concurrent-map crate: the access pattern
/// is one writer and many readers of single entries, which this serves
/// with no new dependency, and it makes the O(1) day drop explicit.
pub struct View {
    /// The days held, oldest first.
    days: RwLock<Vec<Arc<DayView>>>,
    /// Wall-clock ms when the follower last confirmed it had read everything
    /// the broker holds (0 = never).
    fresh_at_ms: AtomicU64,
    caught_up: AtomicBool,
    /// Turns true with `caught_up`: what a decision held for the first
    /// catch-up waits on ([`View::wait_caught_up`]).
    ready: tokio::sync::watch::Sender<bool>,
}

impl Default for View {
    fn default() -> View {
        View {
            days: RwLock::default(),
            fresh_at_ms: AtomicU64::new(0),
            caught_up: AtomicBool::new(false),
            ready: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl View {
    pub fn new() -> View {
        View::default()
    }

    fn day(&self, period: Period) -> Option<Arc<DayView>> {
        let days = self.days.read().expect("view lock poisoned");
        days.iter().find(|d| d.period == period).cloned()
    }

    /// The period's map, created (outside the lock) if it is new.
    fn day_or_new(&self, period: Period) -> Arc<DayView> {
        if let Some(d) = self.day(period) {
            return d;
        }
        let fresh = Arc::new(DayView::new(period));
        let mut days = self.days.write().expect("view lock poisoned");
        if let Some(d) = days.iter().find(|d| d.period == period) {
            return Arc::clone(d);
        }
        let at = days.partition_point(|d| d.period < period);
        days.insert(at, Arc::clone(&fresh));
        fresh
    }

    /// Merges one broadcast; returns whether it changed the view.
    ///
    /// The follower is the only writer, so the entry read here is the one
    /// replaced below.
    pub fn apply(&self, u: &GlobalUpdate) -> bool {
        let day = self.day_or_new(u.period);
        let shard = day.shard(&u.tenant);
        let old = shard
            .read()
            .expect("view lock poisoned")
            .get(u.tenant.as_str())
            .cloned();
        let is_new = old.is_none();
        let mut e = old.clone().unwrap_or_default();
        for part in &u.parts {
            let slot = e.parts.entry(part.actor.clone()).or_insert((0, 0));
            slot.0 = slot.0.max(part.p);
            slot.1 = slot.1.max(part.n);
        }
        if u.ts_ms >= e.ts_ms {
            e.over_limit = u.over_limit;
            e.ts_ms = u.ts_ms;
        }
        if old.as_ref() == Some(&e) {
            return false;
        }
        let key: Box<str> = u.tenant.as_str().into();
        let replaced = shard.write().expect("view lock poisoned").insert(key, e);
        drop(replaced);
        if is_new {
            day.entries.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    pub fn get(&self, tenant: &str, day: u32) -> Option<Entry> {
        self.with(tenant, day, |e| e.cloned())
    }

    pub fn get_period(&self, tenant: &str, period: Period) -> Option<Entry> {
        self.with_period(tenant, period, |e| e.cloned())
    }

    /// Calls `f` with the day's entry without cloning it (hot path): two
    /// read locks, the period list's for an instant, one shard's while `f`
    /// runs.
    pub fn with<R>(&self, tenant: &str, day: u32, f: impl FnOnce(Option<&Entry>) -> R) -> R {
        self.with_period(tenant, Period::day(day), f)
    }

    /// [`View::with`] for any period.
    pub fn with_period<R>(
        &self,
        tenant: &str,
        period: Period,
        f: impl FnOnce(Option<&Entry>) -> R,
    ) -> R {
        let Some(d) = self.day(period) else {
            return f(None);
        };
        let shard = d.shard(tenant).read().expect("view lock poisoned");
        f(shard.get(tenant))
    }

    /// Drops days before `oldest`, and every other kind's periods before
    /// the one holding the start of `oldest` (a decision reads only the
    /// current period of each kind; the previous one stays while it holds
    /// the oldest day kept, for a node whose clock lags Redis'): O(periods)
    /// under the lock, the entries freed after it is released.
    pub fn prune(&self, oldest: u32) {
        let from = u64::from(oldest) * 86_400_000;
        let keep = |p: Period| match p.kind {
            PeriodKind::Day if p.zone.is_utc() => p.index >= oldest,
            kind => p.index >= kind.at_in(p.zone, from).index,
        };
        let dropped: Vec<Arc<DayView>> = {
            let mut days = self.days.write().expect("view lock poisoned");
            let (kept, dropped): (Vec<_>, Vec<_>) = days.drain(..).partition(|d| keep(d.period));
            *days = kept;
            dropped
        };
        drop(dropped);
    }

    /// Number of (tenant, day) entries.
    pub fn len(&self) -> usize {
        let days = self.days.read().expect("view lock poisoned");
        days.iter().map(|d| d.entries.load(Ordering::Relaxed)).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn mark_fresh(&self, now_ms: u64) {
        // Never backwards: a confirmation as of an older moment (a
        // partition that reached an older watermark) says nothing newer.
        self.fresh_at_ms.fetch_max(now_ms, Ordering::Relaxed);
        self.mark_caught_up();
    }

    /// Read to the end once (readiness), without confirming freshness.
    pub fn mark_caught_up(&self) {
        if !self.caught_up.swap(true, Ordering::Release) {
            self.ready.send_replace(true);
        }
    }

    pub fn caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire)
    }

    /// Waits up to `limit` for the first catch-up; whether it happened.
    pub async fn wait_caught_up(&self, limit: std::time::Duration) -> bool {
        if self.caught_up() {
            return true;
        }
        let mut ready = self.ready.subscribe();
        let waited = tokio::time::timeout(limit, ready.wait_for(|r| *r)).await;
        matches!(waited, Ok(Ok(_)))
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
            period: Period::day(1),
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
            limits_version: 0,
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

    fn for_tenant(tenant: &str, day: u32, p: u64) -> GlobalUpdate {
        GlobalUpdate {
            tenant: tenant.into(),
            period: Period::day(day),
            ..update(&[("eu/a", p, 0)], 1)
        }
    }

    #[test]
    fn days_are_dropped_whole_and_counted() {
        let v = View::new();
        for t in 0..500 {
            let name = format!("t{t}");
            assert!(v.apply(&for_tenant(&name, 10, 1)));
            assert!(v.apply(&for_tenant(&name, 11, 2)));
        }
        // The same broadcast again changes nothing and counts nothing.
        assert!(!v.apply(&for_tenant("t7", 11, 2)));
        assert_eq!(v.len(), 1000);
        v.prune(11);
        assert_eq!(v.len(), 500);
        assert_eq!(v.get("t7", 10), None);
        assert_eq!(v.get("t7", 11).unwrap().total(), 2);
        // A day older than every held one, arriving late, is kept in order
        // and dropped by the next prune.
        assert!(v.apply(&for_tenant("late", 9, 1)));
        assert_eq!(v.get("late", 9).unwrap().total(), 1);
        v.prune(11);
        assert_eq!(v.get("late", 9), None);
        assert_eq!(v.len(), 500);
    }

    #[test]
    fn periods_are_held_apart_and_pruned_by_kind() {
        let v = View::new();
        let day = |d: u32| u64::from(d) * 86_400_000;
        // 2027-01-31 and 2027-02-01 (days 20849 and 20850).
        let (jan31, feb1) = (20_849, 20_850);
        let jan = PeriodKind::Month.at(day(jan31));
        let feb = PeriodKind::Month.at(day(feb1));
        assert_eq!(
            (jan.human(), feb.human()),
            ("2027-01".into(), "2027-02".into())
        );
        let at = |period, p| GlobalUpdate {
            period,
            ..update(&[("eu/a", p, 0)], 1)
        };
        v.apply(&at(Period::day(jan31), 5));
        v.apply(&at(jan, 500));
        v.apply(&at(feb, 7));
        assert_eq!(v.get("t", jan31).unwrap().total(), 5);
        assert_eq!(v.get_period("t", jan).unwrap().total(), 500);
        assert_eq!(v.get_period("t", feb).unwrap().total(), 7);
        // On Feb 1st, yesterday (Jan 31st) is kept, and with it January.
        v.prune(jan31);
        assert!(v.get_period("t", jan).is_some());
        // From Feb 2nd, January is gone, February stays.
        v.prune(feb1);
        assert_eq!(v.get("t", jan31), None);
        assert_eq!(v.get_period("t", jan), None);
        assert_eq!(v.get_period("t", feb).unwrap().total(), 7);
    }

    #[test]
    fn readers_see_whole_entries_while_the_writer_applies() {
        let v = std::sync::Arc::new(View::new());
        let w = std::sync::Arc::clone(&v);
        let writer = std::thread::spawn(move || {
            for p in 1..=2_000u64 {
                w.apply(&for_tenant(&format!("t{}", p % 50), 1, p));
            }
        });
        // Totals only ever grow, for every tenant a reader looks at.
        let mut last = vec![0u64; 50];
        while !writer.is_finished() {
            for (t, seen) in last.iter_mut().enumerate() {
                let now = v.with(&format!("t{t}"), 1, |e| e.map_or(0, Entry::total));
                assert!(now >= *seen, "t{t} went back from {seen} to {now}");
                *seen = now;
            }
        }
        writer.join().unwrap();
        assert_eq!(v.get("t0", 1).unwrap().total(), 2_000);
        assert_eq!(v.len(), 50);
    }
}
