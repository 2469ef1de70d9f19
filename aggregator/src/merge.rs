//! The merged global state: one PN-counter CRDT per (tenant, period).
//!
//! A period is a UTC hour, day, ISO week or calendar month
//! ([`tierlimit_shared::period`]): a tenant has one counter per global tier
//! it is limited by (the day's counter every tenant has), each merged on its
//! own. Every region actor (`"{region}/{epoch}"`) publishes its
//! **cumulative** P and N for a (tenant, period). Applying such a delta is a
//! max per actor, which the `crdts` crate gives us through its op semantics:
//! a [`Dot`] with counter `p` for actor `a` raises `a`'s P entry to `p` if it
//! was lower and does nothing otherwise. That is why duplicates, reordering,
//! replays after a restart and several nodes of one region publishing the
//! same actor are all harmless: whatever order the deltas arrive in, the
//! counter ends at Σ max(P) − Σ max(N).
//!
//! `PNCounter` keeps its per-actor entries private, but the broadcast must
//! carry them (a region subtracts its own current actor from the total), so
//! [`Counter`] keeps a small max-merged copy of the per-actor parts next to the
//! CRDT. Debug builds assert after every apply that the two agree.
//!
//! Actor names (`region/epoch`, some 40 bytes) are interned once per
//! instance in [`Actors`]; a counter's CRDT and parts hold 4-byte
//! [`ActorId`]s, so a name is stored once however many counters it has a
//! part in (it was three times per counter: the CRDT's P and N maps and the
//! parts). The parts are a sorted `Vec`, not a map: a handful of entries,
//! read whole.
//!
//! **Limits come from the deltas** (wire v3): each delta carries the limit
//! of its period's tier the node enforced and the limits version it
//! enforced under, and a counter keeps the one of the highest version (ties:
//! the latest `ts_ms`), see [`Carried`]. So the aggregator needs no tenant
//! table to know when a tenant is near or over a limit (a plan a gateway
//! names, a tenant it never heard of), and it judges a counter under the
//! limit the nodes actually enforce, not under its own copy of the
//! configuration, which may lag a reload. Only a counter no delta carried a
//! limit for (v2 writers during a rolling upgrade) falls back to the
//! configuration, and that fallback is the caller's ([`Carried::or_config`]).
//!
//! **Retention per kind** ([`kept`]): each period kind keeps its current and
//! previous period (a day: `aggregator.retention_days`, as before periods
//! existed; an hour: one more, as margin), so a month tier never makes the
//! daily counters live a month. Counters are grouped per period
//! ([`PeriodCounters`], dirty sets included), so expiry takes whole periods
//! out with no walk over their counters.
//!
//! This module is pure state: no I/O, no clock (callers pass `now_ms`), no
//! locking, no configuration. The consumer feeds it, the broadcaster drains
//! its dirty sets, the HTTP layer reads it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crdts::pncounter::{Dir, Op};
use crdts::{CmRDT, Dot, PNCounter};
use num_traits::{Signed, ToPrimitive};
use tierlimit_shared::messages::{actor_region, ActorPart, Delta};
use tierlimit_shared::period::{Period, PeriodKind};
use tierlimit_shared::zone::Zone;

/// Identifies one counter: a tenant in one period. Ordered by period
/// (kind, then index) first, as the groups of [`Merged`] are.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantPeriod {
    pub period: Period,
    pub tenant: String,
}

impl TenantPeriod {
    pub fn new(tenant: impl Into<String>, period: Period) -> Self {
        TenantPeriod {
            tenant: tenant.into(),
            period,
        }
    }

    /// The tenant's counter of UTC day `day`.
    pub fn day(tenant: impl Into<String>, day: u32) -> Self {
        TenantPeriod::new(tenant, Period::day(day))
    }
}

/// The periods of `kind` a [`Merged`] keeps at `now_ms`: `(oldest, newest)`
/// indexes, both included.
///
/// - Day: `today − retention_days < day ≤ today + 1`, exactly as before
///   periods existed (`retention_days` ≥ 1; the default 2 is today and
///   yesterday).
/// - Hour: the current and previous hour plus one hour of margin (a
///   delta of the previous hour may be late: a node publishes on an interval
///   and Kafka may lag), and the next hour (a region clock just past the
///   hour).
/// - Week, month: the current and previous period (the previous one ends
///   when its successor ends: the deltas of its last minutes may arrive
///   after it closed), and the next one (a region clock just past the
///   boundary).
///
/// A delta of an older period is dropped as expired, one of a later period
/// as future (no correct clock produces it; keeping it would hold memory
/// past any retention).
pub fn kept(kind: PeriodKind, zone: Zone, now_ms: u64, retention_days: u32) -> (u32, u32) {
    let current = kind.at_in(zone, now_ms).index;
    let back = match kind {
        PeriodKind::Day => retention_days.max(1) - 1,
        PeriodKind::Hour => 2,
        PeriodKind::Week | PeriodKind::Month => 1,
    };
    (current.saturating_sub(back), current.saturating_add(1))
}

/// An interned actor name (index into [`Actors`]).
pub type ActorId = u32;

/// Every actor name this instance has merged a part of, each stored once.
///
/// Grows with the actors ever seen (regions × epochs), never with tenants;
/// only verified deltas reach it, so a producer cannot grow it at will
/// beyond the actors of its own region.
#[derive(Debug, Default)]
pub struct Actors {
    names: Vec<Arc<str>>,
    ids: HashMap<Arc<str>, ActorId>,
}

impl Actors {
    /// The id of `actor`, interning it on first sight.
    pub fn intern(&mut self, actor: &str) -> ActorId {
        if let Some(&id) = self.ids.get(actor) {
            return id;
        }
        let id = ActorId::try_from(self.names.len()).expect("fewer than 2^32 actors");
        let name: Arc<str> = Arc::from(actor);
        self.names.push(Arc::clone(&name));
        self.ids.insert(name, id);
        id
    }

    /// The name of an interned actor.
    pub fn name(&self, id: ActorId) -> &str {
        &self.names[id as usize]
    }

    /// Number of distinct actors.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// The limit a counter is judged under, as the deltas carried it: the
/// enforced limit of the delta of the highest limits version (ties: the
/// latest `ts_ms`). `limit: None` with a version is a node saying "no tier
/// of this kind for this tenant under these limits" (the tier was removed,
/// or the tenant has none: every tenant publishes a day counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carried {
    pub limit: Option<u64>,
    pub limits_version: u64,
}

impl Carried {
    /// The limit `carried` says, or else (no delta carried one: v2 writers
    /// during a rolling upgrade) the aggregator's configuration's, judged
    /// under limits version 0.
    pub fn or_config(carried: Option<Carried>, config: impl FnOnce() -> Option<u64>) -> Carried {
        carried.unwrap_or_else(|| Carried {
            limit: config(),
            limits_version: 0,
        })
    }
}

/// `Counter::limit` when no delta carried a limit (v2 writers).
const NOT_CARRIED: u64 = u64::MAX;
/// `Counter::limit` when the winning delta carried "no tier" (`None` with a
/// limits version).
const NO_TIER: u64 = u64::MAX - 1;

/// The merged counter of one (tenant, period).
///
/// Small on purpose (issue 10, BENCHMARKS §12): the carried limit is three
/// plain words (sentinels instead of `Option`s, which would cost a tag word
/// each), not a boxed record.
#[derive(Debug, Clone)]
pub struct Counter {
    crdt: PNCounter<ActorId>,
    /// Max-merged cumulative (actor, P, N), sorted by actor id, mirroring
    /// the CRDT's private entries so the broadcast can carry them.
    parts: Vec<(ActorId, u64, u64)>,
    /// The carried limit ([`Carried`]): [`NOT_CARRIED`], [`NO_TIER`], or the
    /// limit (a carried limit at or above `NO_TIER` is clamped below it: no
    /// total reaches it anyway).
    limit: u64,
    /// The limits version and `ts_ms` of the delta `limit` came from: a
    /// delta replaces it only with a higher version, or the same version
    /// and a later `ts_ms`.
    limits_version: u64,
    limit_ts_ms: u64,
    /// The deltas partition this counter was rebuilt from: when that
    /// partition is revoked, the counter goes with it.
    partition: i32,
    /// Broadcast at least once by this instance: the regions hold an entry
    /// for it, so every later change is broadcast too, whatever the
    /// threshold says (see [`Merged::take_dirty`]).
    visible: bool,
}

impl Counter {
    fn new(partition: i32) -> Self {
        Counter {
            crdt: PNCounter::new(),
            parts: Vec::new(),
            limit: NOT_CARRIED,
            limits_version: 0,
            limit_ts_ms: 0,
            partition,
            visible: false,
        }
    }

    /// Merges one actor's cumulative `(p, n)`.
    pub fn apply(&mut self, actor: ActorId, p: u64, n: u64) -> Merge {
        let at = self.parts.binary_search_by_key(&actor, |&(a, _, _)| a);
        let entry = match at {
            Ok(i) => (self.parts[i].1, self.parts[i].2),
            Err(_) => (0, 0),
        };
        let merge = Merge {
            changed: p > entry.0 || n > entry.1,
            stale: p < entry.0 || n < entry.1,
        };
        // An all-zero delta carries no information; recording it would only
        // add an empty part that the CRDT itself does not have.
        if !merge.changed {
            return merge;
        }
        let merged = (actor, entry.0.max(p), entry.1.max(n));
        match at {
            Ok(i) => self.parts[i] = merged,
            Err(i) => {
                // Grown one part at a time: a counter has one part per
                // region actor, gained once each, and the default doubling
                // (4 at the first part) left most counters' parts 3/4 empty
                // (72 B of a one-region counter), which every period tier
                // pays again.
                self.parts.reserve_exact(1);
                self.parts.insert(i, merged)
            }
        }
        self.crdt.apply(Op {
            dot: Dot::new(actor, p),
            dir: Dir::Pos,
        });
        self.crdt.apply(Op {
            dot: Dot::new(actor, n),
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

    /// Takes the limit `delta` carries if it wins over the one held (see
    /// [`Carried`]); returns whether the limit judged changed.
    ///
    /// A delta carries a limit when it has one, or when it says "no tier"
    /// under a limits version (`None` and a version above 0). A `None` of
    /// version 0 is a v2 writer's (or a writer that knows no limits
    /// version) and carries nothing: the configuration decides then.
    fn take_limit(&mut self, limit: Option<u64>, limits_version: u64, ts_ms: u64) -> bool {
        let encoded = match limit {
            Some(l) => l.min(NO_TIER - 1),
            None if limits_version > 0 => NO_TIER,
            None => return false,
        };
        let wins = self.limit == NOT_CARRIED
            || (limits_version, ts_ms) > (self.limits_version, self.limit_ts_ms);
        if !wins {
            return false;
        }
        let changed = encoded != self.limit;
        self.limit = encoded;
        self.limits_version = limits_version;
        self.limit_ts_ms = ts_ms;
        changed
    }

    /// The limit the deltas carried, if any did.
    pub fn carried(&self) -> Option<Carried> {
        let limit = match self.limit {
            NOT_CARRIED => return None,
            NO_TIER => None,
            l => Some(l),
        };
        Some(Carried {
            limit,
            limits_version: self.limits_version,
        })
    }

    fn parts_sum(&self) -> i128 {
        self.parts
            .iter()
            .map(|&(_, p, n)| i128::from(p) - i128::from(n))
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

    /// Per-actor parts, ordered by actor name.
    pub fn parts(&self, actors: &Actors) -> Vec<ActorPart> {
        let mut parts: Vec<ActorPart> = self
            .parts
            .iter()
            .map(|&(a, p, n)| ActorPart {
                actor: actors.name(a).to_owned(),
                p,
                n,
            })
            .collect();
        parts.sort_by(|a, b| a.actor.cmp(&b.actor));
        parts
    }

    /// What a broadcast or an HTTP answer needs of it.
    pub fn snapshot(&self, actors: &Actors) -> Snapshot {
        Snapshot {
            total: self.total(),
            parts: self.parts(actors),
            carried: self.carried(),
        }
    }

    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// Whether this instance broadcast the counter since it rebuilt it.
    pub fn is_visible(&self) -> bool {
        self.visible
    }
}

/// What a broadcast or an HTTP answer needs of a counter, read under the
/// state lock (actor names resolved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub total: u64,
    pub parts: Vec<ActorPart>,
    /// The limit the deltas carried (`None`: judge it under the
    /// configuration, see [`Carried::or_config`]).
    pub carried: Option<Carried>,
}

impl Snapshot {
    /// Net count per region (all epochs of a region summed), ordered by region.
    pub fn regions(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for part in &self.parts {
            let sum: &mut u64 = out.entry(part.region().to_owned()).or_default();
            *sum = sum.saturating_add(part.net());
        }
        out
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
        /// The delta's actor is a new epoch of a region that already had
        /// one in this counter: that region's Redis lost the counter.
        new_epoch: bool,
        /// The limit the counter is judged under changed (a delta of a
        /// newer limits version): the counter is dirty for that alone.
        limit_changed: bool,
    },
    /// Nothing new: a duplicate, a replay or an older delta of the actor.
    Unchanged { stale: bool, limit_changed: bool },
    /// The period is past the retention of its kind ([`kept`]); dropped.
    Expired,
    /// The period is more than one period ahead of the current one;
    /// dropped, since no correct region clock can produce it and keeping it
    /// would hold memory past any retention.
    Future,
}

/// One period's counters, with what the HTTP pages and the gauges need kept
/// up to date as deltas merge, so no reader walks every counter, and the
/// period's dirty sets, so that dropping the period drops them too.
#[derive(Debug, Default)]
pub struct PeriodCounters {
    counters: HashMap<String, Counter>,
    /// Σ of the counters' totals (each saturated into u64).
    units: i128,
    /// The counters broadcast since they were rebuilt: the tenants at or
    /// past the broadcast threshold of their limit (every over-limit one
    /// among them), and the few broadcast for a rollback.
    visible: BTreeSet<String>,
    /// Changed since their last broadcast.
    dirty: BTreeSet<String>,
    /// Subset of `dirty` that crossed the limit: broadcast without waiting
    /// for the next interval.
    urgent: BTreeSet<String>,
}

impl PeriodCounters {
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// Σ of the period's totals.
    pub fn units(&self) -> u64 {
        self.units.clamp(0, i128::from(u64::MAX)) as u64
    }

    /// The period's visible counters (see [`PeriodCounters::visible`]), by
    /// tenant.
    pub fn visible(&self) -> impl Iterator<Item = (&str, &Counter)> {
        self.visible
            .iter()
            .filter_map(|t| Some((t.as_str(), self.counters.get(t)?)))
    }

    /// Every counter of the period, in no particular order.
    pub fn counters(&self) -> impl Iterator<Item = (&str, &Counter)> {
        self.counters.iter().map(|(t, c)| (t.as_str(), c))
    }

    fn make_visible(&mut self, tenant: &str) {
        if let Some(c) = self.counters.get_mut(tenant) {
            if !c.visible {
                c.visible = true;
                self.visible.insert(tenant.to_owned());
            }
        }
    }

    fn mark(&mut self, tenant: &str) {
        if !self.dirty.contains(tenant) {
            self.dirty.insert(tenant.to_owned());
        }
    }
}

/// What [`Merged::expire`] took out: freed when dropped, which the caller
/// does after releasing the state lock.
#[derive(Debug, Default)]
pub struct Expired {
    periods: Vec<(Period, PeriodCounters)>,
}

impl Expired {
    /// Counters taken out.
    pub fn counters(&self) -> usize {
        self.periods.iter().map(|(_, p)| p.len()).sum()
    }

    /// The periods taken out.
    pub fn periods(&self) -> impl Iterator<Item = Period> + '_ {
        self.periods.iter().map(|(p, _)| *p)
    }
}

/// Every counter this instance holds, plus which of them still need to be
/// broadcast.
///
/// Kept per period: dropping a period past its kind's retention is a map
/// removal under the lock (a handful of periods are held: about two per
/// kind), its freeing happens after (see [`Expired`]).
#[derive(Debug)]
pub struct Merged {
    periods: BTreeMap<Period, PeriodCounters>,
    actors: Actors,
    /// Days kept (see [`kept`]); the other kinds' retention is fixed.
    retention_days: u32,
    /// Closed periods' counters as late deltas would have made them
    /// (`usage.rs`: a closed figure never changes). Only counters that got
    /// a late delta are here.
    late: HashMap<TenantPeriod, Counter>,
}

impl Merged {
    pub fn new(retention_days: u32) -> Self {
        Merged {
            periods: BTreeMap::new(),
            actors: Actors::default(),
            retention_days: retention_days.max(1),
            late: HashMap::new(),
        }
    }

    /// Merges a delta of a **closed** period beside its counter instead of
    /// into it (`usage.rs`): the closed figure stays final, and what late
    /// deltas would have added is kept apart. Returns the counter's late
    /// units now (0: the delta added nothing, e.g. a duplicate).
    pub fn apply_late(&mut self, partition: i32, delta: &Delta) -> u64 {
        let actor = self.actors.intern(&delta.actor);
        let held = self.get(&delta.tenant, delta.period).cloned();
        let base = held.as_ref().map_or(0, Counter::total);
        let key = TenantPeriod::new(delta.tenant.as_str(), delta.period);
        let shadow = self
            .late
            .entry(key)
            .or_insert_with(|| held.unwrap_or_else(|| Counter::new(partition)));
        shadow.apply(actor, delta.p, delta.n.min(delta.p));
        shadow.total().saturating_sub(base)
    }

    /// Units late deltas tried to add to (tenant, period) after it closed.
    pub fn late_units(&self, tenant: &str, period: Period) -> u64 {
        let key = TenantPeriod::new(tenant, period);
        let Some(shadow) = self.late.get(&key) else {
            return 0;
        };
        let base = self.get(tenant, period).map_or(0, Counter::total);
        shadow.total().saturating_sub(base)
    }

    /// Applies a new retention (from a reloaded configuration); takes effect
    /// at the next [`Merged::expire`].
    pub fn set_retention(&mut self, retention_days: u32) {
        self.retention_days = retention_days.max(1);
    }

    /// The periods of `kind` on `zone`'s calendar kept at `now_ms` (see
    /// [`kept`]).
    pub fn kept(&self, kind: PeriodKind, zone: Zone, now_ms: u64) -> (u32, u32) {
        kept(kind, zone, now_ms, self.retention_days)
    }

    /// Merges a delta read from `partition`, at wall-clock `now_ms` (which
    /// only decides the retention). Changed counters become dirty.
    pub fn apply(&mut self, partition: i32, delta: &Delta, now_ms: u64) -> Applied {
        let (oldest, newest) = self.kept(delta.period.kind, delta.period.zone, now_ms);
        if delta.period.index < oldest {
            return Applied::Expired;
        }
        if delta.period.index > newest {
            return Applied::Future;
        }
        let actor = self.actors.intern(&delta.actor);
        let group = self.periods.entry(delta.period).or_default();
        let counter = match group.counters.get_mut(delta.tenant.as_str()) {
            Some(c) => c,
            None => group
                .counters
                .entry(delta.tenant.clone())
                .or_insert_with(|| Counter::new(partition)),
        };
        let before = counter.total();
        // A Redis epoch's first part beside another of the same region: the
        // region's Redis lost this counter (a new period or tenant starts
        // with no part of its region at all). Local fail-mode actors are not
        // epochs.
        let new_epoch = !delta.actor.contains("/local-")
            && counter
                .parts
                .binary_search_by_key(&actor, |&(a, _, _)| a)
                .is_err()
            && counter.parts.iter().any(|&(a, _, _)| {
                let name = self.actors.name(a);
                actor_region(name) == actor_region(&delta.actor) && !name.contains("/local-")
            });
        let limit_changed = counter.take_limit(delta.limit, delta.limits_version, delta.ts_ms);
        let merge = counter.apply(actor, delta.p, delta.n);
        if !merge.changed {
            if limit_changed {
                group.mark(&delta.tenant);
            }
            return Applied::Unchanged {
                stale: merge.stale,
                limit_changed,
            };
        }
        let after = counter.total();
        group.units += i128::from(after) - i128::from(before);
        group.mark(&delta.tenant);
        Applied::Changed {
            before,
            after,
            stale: merge.stale,
            new_epoch,
            limit_changed,
        }
    }

    pub fn get(&self, tenant: &str, period: Period) -> Option<&Counter> {
        self.periods.get(&period)?.counters.get(tenant)
    }

    /// The interned actor names (to read a [`Counter`]'s parts).
    pub fn actors(&self) -> &Actors {
        &self.actors
    }

    /// What a broadcast or an HTTP answer needs of one counter.
    pub fn snapshot(&self, tenant: &str, period: Period) -> Option<Snapshot> {
        self.get(tenant, period).map(|c| c.snapshot(&self.actors))
    }

    /// One period's counters, if any.
    pub fn on(&self, period: Period) -> Option<&PeriodCounters> {
        self.periods.get(&period)
    }

    /// The periods held that `now_ms` falls in: of every kind, and of
    /// every zone some tenant counts in (a handful; `kind.at(now)` alone
    /// would miss the zones).
    pub fn current(&self, now_ms: u64) -> Vec<Period> {
        self.periods
            .keys()
            .filter(|p| p.contains(now_ms))
            .copied()
            .collect()
    }

    /// The periods held, oldest first within each kind (hour, day, week,
    /// month), with their counters.
    pub fn periods(&self) -> impl Iterator<Item = (Period, &PeriodCounters)> {
        self.periods.iter().map(|(p, c)| (*p, c))
    }

    /// Every counter of `period`, in no particular order.
    pub fn period(&self, period: Period) -> impl Iterator<Item = (&str, &Counter)> {
        self.periods
            .get(&period)
            .into_iter()
            .flat_map(PeriodCounters::counters)
    }

    /// Number of (tenant, period) counters held.
    pub fn len(&self) -> usize {
        self.periods.values().map(PeriodCounters::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.periods.values().all(PeriodCounters::is_empty)
    }

    /// Forgets every counter rebuilt from one of `partitions` (they were
    /// revoked, or are about to be re-read from the beginning). Returns how
    /// many were dropped. Linear in the counters held: a rebalance, not a
    /// decision, pays it.
    pub fn drop_partitions(&mut self, partitions: &[i32]) -> usize {
        let mut dropped = 0;
        for g in self.periods.values_mut() {
            let before = g.counters.len();
            g.counters.retain(|_, c| !partitions.contains(&c.partition));
            dropped += before - g.counters.len();
            let counters = &g.counters;
            g.visible.retain(|t| counters.contains_key(t));
            g.dirty.retain(|t| counters.contains_key(t));
            g.urgent.retain(|t| counters.contains_key(t));
            g.units = counters.values().map(|c| i128::from(c.total())).sum();
        }
        self.periods.retain(|_, g| !g.is_empty());
        self.late.retain(|_, c| !partitions.contains(&c.partition));
        dropped
    }

    /// Takes out the periods that fell out of their kind's retention
    /// ([`kept`]), each kind on its own: a day ending drops that day's
    /// counters and leaves the month's. Time linear in the periods held (a
    /// handful), never in the counters; the caller drops what it returns
    /// after releasing its lock.
    pub fn expire(&mut self, now_ms: u64) -> Expired {
        let retention_days = self.retention_days;
        let gone: Vec<Period> = self
            .periods
            .keys()
            .filter(|p| p.index < kept(p.kind, p.zone, now_ms, retention_days).0)
            .copied()
            .collect();
        // Few (only counters that got a late delta): walked whole.
        self.late.retain(|k, _| {
            k.period.index >= kept(k.period.kind, k.period.zone, now_ms, retention_days).0
        });
        Expired {
            periods: gone
                .into_iter()
                .filter_map(|p| Some((p, self.periods.remove(&p)?)))
                .collect(),
        }
    }

    /// Marks a counter for broadcast (no-op if it is not held). Returns
    /// whether it is held.
    pub fn mark_dirty(&mut self, key: &TenantPeriod) -> bool {
        match self.periods.get_mut(&key.period) {
            Some(g) if g.counters.contains_key(&key.tenant) => {
                g.mark(&key.tenant);
                true
            }
            _ => false,
        }
    }

    /// Marks every counter of `period` whose tenant passes `concerned` dirty
    /// (a reload changed the unknown-tenant limit). Returns how many.
    pub fn mark_period_dirty_where(
        &mut self,
        period: Period,
        concerned: impl Fn(&str) -> bool,
    ) -> usize {
        let Some(g) = self.periods.get_mut(&period) else {
            return 0;
        };
        let PeriodCounters {
            counters, dirty, ..
        } = g;
        let mut n = 0;
        for t in counters.keys() {
            if concerned(t) {
                if !dirty.contains(t) {
                    dirty.insert(t.clone());
                }
                n += 1;
            }
        }
        n
    }

    /// Marks a dirty counter for immediate broadcast.
    pub fn mark_urgent(&mut self, key: &TenantPeriod) {
        if let Some(g) = self.periods.get_mut(&key.period) {
            if g.counters.contains_key(&key.tenant) {
                g.mark(&key.tenant);
                g.urgent.insert(key.tenant.clone());
            }
        }
    }

    /// Marks a counter for broadcast whatever its total: an actor published
    /// less than it had before (a partial rollback of its Redis), and only
    /// the broadcast of its merged part lets the region raise its counter
    /// back (ARCHITECTURE.md, "A counter never stays below what its actor
    /// published"), limited tenant or not.
    pub fn mark_visible(&mut self, key: &TenantPeriod) {
        if let Some(g) = self.periods.get_mut(&key.period) {
            if g.counters.contains_key(&key.tenant) {
                g.make_visible(&key.tenant);
                g.mark(&key.tenant);
            }
        }
    }

    /// Marks every counter of `period` read from one of `partitions` dirty
    /// (a partition just caught up, or the limits changed).
    pub fn mark_period_dirty(&mut self, period: Period, partitions: Option<&[i32]>) -> usize {
        let Some(g) = self.periods.get_mut(&period) else {
            return 0;
        };
        let PeriodCounters {
            counters, dirty, ..
        } = g;
        let mut n = 0;
        for (t, c) in counters.iter() {
            if partitions.is_none_or(|ps| ps.contains(&c.partition)) {
                if !dirty.contains(t) {
                    dirty.insert(t.clone());
                }
                n += 1;
            }
        }
        n
    }

    /// Takes `key` out of the dirty sets: a delta replayed while its
    /// partition rebuilds. Its partition's counters are all marked when it
    /// has caught up ([`Merged::mark_partition_dirty`]), so the dirty set
    /// the broadcaster walks on every tick holds only caught-up partitions'
    /// changes instead of every counter replayed so far (at 1 M counters
    /// that walk, under the state lock four times a second, starved the
    /// rebuild: not ready within 600 s, where 300 k took 20 s).
    pub fn forget_dirty(&mut self, key: &TenantPeriod) {
        if let Some(g) = self.periods.get_mut(&key.period) {
            g.dirty.remove(&key.tenant);
            g.urgent.remove(&key.tenant);
        }
    }

    /// Marks every counter read from `partition`, in every period held,
    /// dirty (the partition has just caught up); returns how many.
    pub fn mark_partition_dirty(&mut self, partition: i32) -> usize {
        let periods: Vec<Period> = self.periods.keys().copied().collect();
        periods
            .into_iter()
            .map(|p| self.mark_period_dirty(p, Some(&[partition])))
            .sum()
    }

    /// Whether any counter waits for an immediate broadcast.
    pub fn has_urgent(&self) -> bool {
        self.periods.values().any(|g| !g.urgent.is_empty())
    }

    /// Takes the dirty counters whose partition passes `eligible` (urgent
    /// ones only when `urgent_only`), leaving the others dirty. Of those, it
    /// returns the ones the regions need: already [visible](Counter::is_visible),
    /// or `wanted` now (the caller's broadcast threshold), and makes them
    /// visible; the rest are dropped from the dirty set and counted in the
    /// second value (a later change that makes them wanted marks them
    /// again). The caller broadcasts what it got and puts back the ones that
    /// failed with [`Merged::mark_dirty`].
    pub fn take_dirty(
        &mut self,
        urgent_only: bool,
        eligible: impl Fn(i32) -> bool,
        wanted: impl Fn(&TenantPeriod, &Counter) -> bool,
    ) -> (Vec<(TenantPeriod, Snapshot)>, usize) {
        let mut taken = Vec::new();
        let mut withheld = 0;
        for (&period, g) in self.periods.iter_mut() {
            let source = if urgent_only { &g.urgent } else { &g.dirty };
            let keys: Vec<String> = source
                .iter()
                .filter(|t| g.counters.get(*t).is_some_and(|c| eligible(c.partition)))
                .cloned()
                .collect();
            for tenant in keys {
                g.dirty.remove(&tenant);
                g.urgent.remove(&tenant);
                let Some(c) = g.counters.get(&tenant) else {
                    continue;
                };
                let key = TenantPeriod { period, tenant };
                if c.visible || wanted(&key, c) {
                    let snapshot = c.snapshot(&self.actors);
                    g.make_visible(&key.tenant);
                    taken.push((key, snapshot));
                } else {
                    withheld += 1;
                }
            }
        }
        (taken, withheld)
    }

    /// Number of counters waiting for a broadcast.
    pub fn dirty_len(&self) -> usize {
        self.periods.values().map(|g| g.dirty.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tierlimit_shared::messages::actor;

    const TODAY: u32 = 20_000;
    /// Noon of TODAY.
    const NOW: u64 = TODAY as u64 * DAY_MS + DAY_MS / 2;
    const DAY_MS: u64 = 86_400_000;

    /// Noon of `day`.
    fn at(day: u32) -> u64 {
        day as u64 * DAY_MS + DAY_MS / 2
    }

    fn delta(tenant: &str, day: u32, actor: &str, p: u64, n: u64) -> Delta {
        Delta::new(tenant, day, actor.to_owned(), p, n, 0)
    }

    #[test]
    fn max_per_actor_sum_over_actors() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e1");
        let us = actor("us", "u1");
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 10, 2), NOW),
            Applied::Changed {
                before: 0,
                after: 8,
                stale: false,
                new_epoch: false,
                limit_changed: false
            }
        );
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &us, 5, 0), NOW),
            Applied::Changed {
                before: 8,
                after: 13,
                stale: false,
                new_epoch: false,
                limit_changed: false
            }
        );
        // An older delta of eu and a duplicate change nothing.
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 7, 1), NOW),
            Applied::Unchanged {
                stale: true,
                limit_changed: false
            }
        );
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &us, 5, 0), NOW),
            Applied::Unchanged {
                stale: false,
                limit_changed: false
            }
        );
        // Only N grew.
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 10, 4), NOW),
            Applied::Changed {
                before: 13,
                after: 11,
                stale: false,
                new_epoch: false,
                limit_changed: false
            }
        );
        let c = m.get("acme", Period::day(TODAY)).unwrap();
        assert_eq!(c.total(), 11);
        assert_eq!(
            c.parts(m.actors()),
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
            c.snapshot(m.actors()).regions(),
            BTreeMap::from([("eu".into(), 6), ("us".into(), 5)])
        );
    }

    #[test]
    fn epochs_of_one_region_add_up() {
        let mut m = Merged::new(2);
        m.apply(0, &delta("acme", TODAY, &actor("eu", "old"), 40, 0), NOW);
        // A first part of a region, and a node's local fail-mode actor, are
        // no new epoch; a second epoch of the region is.
        let new_epoch = |a| matches!(a, Applied::Changed { new_epoch, .. } if new_epoch);
        assert!(!new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("us", "x"), 1, 0),
            NOW
        )));
        assert!(!new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("eu", "local-a-1"), 1, 0),
            NOW
        )));
        assert!(new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("eu", "new"), 3, 1),
            NOW
        )));
        assert!(!new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("eu", "new"), 4, 1),
            NOW
        )));
        let c = m.get("acme", Period::day(TODAY)).unwrap();
        assert_eq!(c.total(), 45);
        assert_eq!(
            c.snapshot(m.actors()).regions(),
            BTreeMap::from([("eu".into(), 44), ("us".into(), 1)])
        );
    }

    #[test]
    fn zero_delta_is_no_part() {
        let mut m = Merged::new(2);
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &actor("eu", "e"), 0, 0), NOW),
            Applied::Unchanged {
                stale: false,
                limit_changed: false
            }
        );
        assert!(m
            .snapshot("acme", Period::day(TODAY))
            .unwrap()
            .parts
            .is_empty());
    }

    #[test]
    fn out_of_order_publishers_are_stale() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("acme", TODAY, &eu, 50, 5), NOW);
        // Higher P but lower N: merged, and still flagged.
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &eu, 55, 3), NOW),
            Applied::Changed {
                before: 45,
                after: 50,
                stale: true,
                new_epoch: false,
                limit_changed: false
            }
        );
        assert_eq!(
            m.snapshot("acme", Period::day(TODAY)).unwrap().parts[0],
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
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), NOW);
        m.apply(1, &delta("b", TODAY, &eu, 2, 0), NOW);
        m.apply(0, &delta("a", TODAY - 1, &eu, 3, 0), NOW);
        assert_eq!(m.get("a", Period::day(TODAY)).unwrap().total(), 1);
        assert_eq!(m.get("b", Period::day(TODAY)).unwrap().total(), 2);
        assert_eq!(m.get("a", Period::day(TODAY - 1)).unwrap().total(), 3);
        assert_eq!(m.len(), 3);
        assert_eq!(m.period(Period::day(TODAY)).count(), 2);
    }

    #[test]
    fn retention_window() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        assert_eq!(
            m.apply(0, &delta("a", TODAY - 2, &eu, 1, 0), NOW),
            Applied::Expired
        );
        assert!(matches!(
            m.apply(0, &delta("a", TODAY - 1, &eu, 1, 0), NOW),
            Applied::Changed { .. }
        ));
        assert!(matches!(
            m.apply(0, &delta("a", TODAY, &eu, 1, 0), NOW),
            Applied::Changed { .. }
        ));
        // A region whose clock is just past midnight.
        assert!(matches!(
            m.apply(0, &delta("a", TODAY + 1, &eu, 1, 0), NOW),
            Applied::Changed { .. }
        ));
        assert_eq!(
            m.apply(0, &delta("a", TODAY + 2, &eu, 1, 0), NOW),
            Applied::Future
        );
        assert_eq!(m.len(), 3);
        // The next day, yesterday becomes too old.
        assert_eq!(m.expire(at(TODAY + 1)).counters(), 1);
        assert!(m.get("a", Period::day(TODAY - 1)).is_none());
        assert_eq!(m.len(), 2);
        assert!(m
            .take_dirty(false, |_| true, |_, _| true)
            .0
            .iter()
            .all(|(k, _)| k.period.index >= TODAY));
    }

    #[test]
    fn drop_revoked_partitions() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), NOW);
        m.apply(1, &delta("b", TODAY, &eu, 1, 0), NOW);
        m.apply(2, &delta("c", TODAY, &eu, 1, 0), NOW);
        assert_eq!(m.drop_partitions(&[0, 2]), 2);
        assert!(m.get("a", Period::day(TODAY)).is_none());
        assert_eq!(m.get("b", Period::day(TODAY)).unwrap().partition(), 1);
        let dirty = m.take_dirty(false, |_| true, |_, _| true).0;
        assert_eq!(dirty.len(), 1);
        assert_eq!(dirty[0].0, TenantPeriod::day("b", TODAY));
    }

    #[test]
    fn dirty_set_is_taken_per_eligible_partition() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), NOW);
        m.apply(1, &delta("b", TODAY, &eu, 1, 0), NOW);
        assert_eq!(m.dirty_len(), 2);
        // Partition 1 is still catching up: its counter stays dirty.
        let taken = m.take_dirty(false, |p| p == 0, |_, _| true).0;
        assert_eq!(taken.len(), 1);
        assert_eq!(m.dirty_len(), 1);
        // Nothing changed, nothing to take; a failed broadcast is put back.
        assert!(m.take_dirty(false, |p| p == 0, |_, _| true).0.is_empty());
        m.mark_dirty(&taken[0].0);
        assert_eq!(m.take_dirty(false, |p| p == 0, |_, _| true).0.len(), 1);
        // Unknown keys are not resurrected.
        m.mark_dirty(&TenantPeriod::day("zzz", TODAY));
        assert!(m
            .take_dirty(false, |_| true, |_, _| true)
            .0
            .iter()
            .all(|(k, _)| k.tenant != "zzz"));
    }

    #[test]
    fn urgent_is_taken_alone() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), NOW);
        m.apply(0, &delta("b", TODAY, &eu, 1, 0), NOW);
        m.mark_urgent(&TenantPeriod::day("b", TODAY));
        assert!(m.has_urgent());
        let urgent = m.take_dirty(true, |_| true, |_, _| true).0;
        assert_eq!(urgent.len(), 1);
        assert_eq!(urgent[0].0.tenant, "b");
        assert!(!m.has_urgent());
        assert_eq!(m.dirty_len(), 1);
    }

    #[test]
    fn only_wanted_or_visible_counters_are_taken() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        // Wanted: total at least 10.
        let wanted = |_: &TenantPeriod, c: &Counter| c.total() >= 10;
        m.apply(0, &delta("far", TODAY, &eu, 3, 0), NOW);
        m.apply(0, &delta("near", TODAY, &eu, 12, 0), NOW);
        let (taken, withheld) = m.take_dirty(false, |_| true, wanted);
        assert_eq!(withheld, 1);
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].0.tenant, "near");
        assert!(m.get("near", Period::day(TODAY)).unwrap().is_visible());
        assert!(!m.get("far", Period::day(TODAY)).unwrap().is_visible());
        // A withheld counter leaves the dirty set; it comes back when it
        // changes, and is taken once wanted.
        assert_eq!(m.dirty_len(), 0);
        m.apply(0, &delta("far", TODAY, &eu, 10, 0), NOW);
        assert_eq!(m.take_dirty(false, |_| true, wanted).0.len(), 1);
        // A visible counter is taken on every change, wanted or not (the
        // regions hold an entry that must not freeze).
        m.apply(0, &delta("near", TODAY, &eu, 13, 0), NOW);
        let (taken, _) = m.take_dirty(false, |_| true, |_, _| false);
        assert_eq!(taken.len(), 1);
        // A stale delta (a rolled-back actor) makes a counter visible.
        m.apply(0, &delta("low", TODAY, &eu, 5, 0), NOW);
        m.take_dirty(false, |_| true, wanted);
        m.mark_visible(&TenantPeriod::day("low", TODAY));
        let (taken, withheld) = m.take_dirty(false, |_| true, |_, _| false);
        assert_eq!((taken.len(), withheld), (1, 0));
        assert_eq!(taken[0].0.tenant, "low");
    }

    #[test]
    fn each_day_keeps_its_units_and_visible_tenants() {
        let mut m = Merged::new(2);
        let (eu, us) = (actor("eu", "e"), actor("us", "e"));
        m.apply(0, &delta("a", TODAY, &eu, 10, 0), NOW);
        m.apply(0, &delta("a", TODAY, &us, 5, 0), NOW);
        m.apply(1, &delta("b", TODAY, &eu, 7, 2), NOW);
        m.apply(0, &delta("a", TODAY - 1, &eu, 100, 0), NOW);
        let d = m.on(Period::day(TODAY)).unwrap();
        assert_eq!((d.len(), d.units()), (2, 20));
        assert_eq!(d.visible().count(), 0);
        // N grew: the units follow the totals down.
        m.apply(1, &delta("b", TODAY, &eu, 7, 7), NOW);
        assert_eq!(m.on(Period::day(TODAY)).unwrap().units(), 15);
        // What the broadcaster takes becomes visible.
        m.take_dirty(false, |_| true, |k, _| k.tenant == "a");
        let visible: Vec<&str> = m
            .on(Period::day(TODAY))
            .unwrap()
            .visible()
            .map(|(t, _)| t)
            .collect();
        assert_eq!(visible, ["a"]);
        // Revoking a partition takes its counters out of the summaries.
        m.drop_partitions(&[0]);
        let d = m.on(Period::day(TODAY)).unwrap();
        assert_eq!((d.len(), d.units(), d.visible().count()), (1, 0, 0));
        assert!(m.on(Period::day(TODAY - 1)).is_none());
        // Expiry hands whole days back, dirty entries included.
        m.apply(0, &delta("c", TODAY, &eu, 1, 0), NOW);
        let gone = m.expire(at(TODAY + 2));
        assert_eq!(gone.counters(), 2);
        assert!(m.is_empty());
        assert_eq!(m.dirty_len(), 0);
    }

    #[test]
    fn mark_day_dirty_for_caught_up_partitions() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), NOW);
        m.apply(1, &delta("b", TODAY, &eu, 1, 0), NOW);
        m.apply(1, &delta("b", TODAY - 1, &eu, 1, 0), NOW);
        m.take_dirty(false, |_| true, |_, _| true);
        assert_eq!(m.mark_period_dirty(Period::day(TODAY), Some(&[1])), 1);
        assert_eq!(m.mark_period_dirty(Period::day(TODAY), None), 2);
        assert_eq!(m.dirty_len(), 2);
    }

    #[test]
    fn absurd_totals_saturate() {
        let mut m = Merged::new(2);
        m.apply(0, &delta("a", TODAY, &actor("eu", "1"), u64::MAX, 0), NOW);
        m.apply(0, &delta("a", TODAY, &actor("us", "1"), u64::MAX, 0), NOW);
        assert_eq!(m.get("a", Period::day(TODAY)).unwrap().total(), u64::MAX);
        // Two parts summing to 2^64 + 1: wrapping would say 1.
        m.apply(0, &delta("b", TODAY, &actor("eu", "1"), u64::MAX, 0), NOW);
        m.apply(0, &delta("b", TODAY, &actor("us", "1"), 2, 0), NOW);
        assert_eq!(m.get("b", Period::day(TODAY)).unwrap().total(), u64::MAX);
        assert_eq!(
            m.snapshot("b", Period::day(TODAY)).unwrap().regions()["eu"],
            u64::MAX
        );
    }

    /// Unix ms of (y, m, d, h) UTC.
    fn ms(y: i64, m: u32, d: u32, h: u64) -> u64 {
        tierlimit_shared::period::days_from_civil(y, m, d) as u64 * DAY_MS + h * 3_600_000
    }

    fn of(tenant: &str, period: Period, actor: &str, p: u64) -> Delta {
        Delta::of(tenant, period, actor.to_owned(), p, 0, 0)
    }

    #[test]
    fn each_period_kind_merges_on_its_own() {
        let mut m = Merged::new(2);
        let now = ms(2026, 11, 27, 15);
        let eu = actor("eu", "e");
        let periods = PeriodKind::ALL.map(|k| k.at(now));
        for (i, p) in periods.iter().enumerate() {
            assert!(matches!(
                m.apply(0, &of("acme", *p, &eu, 10 * (i as u64 + 1)), now),
                Applied::Changed { .. }
            ));
        }
        for (i, p) in periods.iter().enumerate() {
            assert_eq!(m.get("acme", *p).unwrap().total(), 10 * (i as u64 + 1));
            assert_eq!(m.on(*p).unwrap().units(), 10 * (i as u64 + 1));
        }
        assert_eq!(m.len(), 4);
        // One dirty counter per period, each taken with its period.
        let (taken, _) = m.take_dirty(false, |_| true, |_, _| true);
        let mut got: Vec<Period> = taken.iter().map(|(k, _)| k.period).collect();
        got.sort();
        assert_eq!(got, periods.to_vec());
        // A month label is not a day: "m682" and day 682 are two counters.
        let day = Period::day(periods[3].index);
        assert_eq!(m.apply(0, &of("acme", day, &eu, 1), now), Applied::Expired);
    }

    #[test]
    fn a_day_expiring_leaves_the_month_which_expires_after_its_successor() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        // 2026-11-27 15:00.
        let now = ms(2026, 11, 27, 15);
        let (day, month, hour, week) = (
            PeriodKind::Day.at(now),
            PeriodKind::Month.at(now),
            PeriodKind::Hour.at(now),
            PeriodKind::Week.at(now),
        );
        for p in [day, month, hour, week] {
            m.apply(0, &of("acme", p, &eu, 5), now);
        }
        // Two days on: the day is gone, the month, its week... stays.
        let later = ms(2026, 11, 29, 15);
        let gone = m.expire(later);
        let mut kinds: Vec<PeriodKind> = gone.periods().map(|p| p.kind).collect();
        kinds.sort();
        assert_eq!(kinds, [PeriodKind::Hour, PeriodKind::Day]);
        assert!(m.get("acme", day).is_none());
        assert_eq!(m.get("acme", month).unwrap().total(), 5);
        assert_eq!(m.get("acme", week).unwrap().total(), 5);
        // A late delta of the day is expired; one of the month still merges.
        assert_eq!(
            m.apply(0, &of("acme", day, &eu, 9), later),
            Applied::Expired
        );
        assert!(matches!(
            m.apply(0, &of("acme", month, &eu, 9), later),
            Applied::Changed { .. }
        ));
        // All of December: November is the previous month, still kept.
        assert_eq!(m.expire(ms(2026, 12, 31, 23)).counters(), 1, "the week");
        assert_eq!(m.get("acme", month).unwrap().total(), 9);
        assert_eq!(
            m.apply(0, &of("acme", month, &eu, 10), ms(2026, 12, 31, 23)),
            Applied::Changed {
                before: 9,
                after: 10,
                stale: false,
                new_epoch: false,
                limit_changed: false
            }
        );
        // November's successor ended: November goes.
        assert_eq!(m.expire(ms(2027, 1, 1, 0)).counters(), 1);
        assert!(m.is_empty());
        assert_eq!(m.dirty_len(), 0);
        assert_eq!(
            m.apply(0, &of("acme", month, &eu, 11), ms(2027, 1, 1, 0)),
            Applied::Expired
        );
    }

    #[test]
    fn retention_per_kind() {
        let now = ms(2026, 11, 27, 15);
        let h = PeriodKind::Hour.at(now).index;
        assert_eq!(kept(PeriodKind::Hour, Zone::UTC, now, 2), (h - 2, h + 1));
        let d = PeriodKind::Day.at(now).index;
        assert_eq!(kept(PeriodKind::Day, Zone::UTC, now, 2), (d - 1, d + 1));
        assert_eq!(kept(PeriodKind::Day, Zone::UTC, now, 7), (d - 6, d + 1));
        let w = PeriodKind::Week.at(now).index;
        assert_eq!(kept(PeriodKind::Week, Zone::UTC, now, 7), (w - 1, w + 1));
        let mo = PeriodKind::Month.at(now).index;
        assert_eq!(kept(PeriodKind::Month, Zone::UTC, now, 2), (mo - 1, mo + 1));
        // A month two ahead is no clock's.
        let mut m = Merged::new(2);
        let p = Period {
            zone: tierlimit_shared::zone::Zone::UTC,
            kind: PeriodKind::Month,
            index: mo + 2,
        };
        assert_eq!(
            m.apply(0, &of("a", p, &actor("eu", "e"), 1), now),
            Applied::Future
        );
    }

    #[test]
    fn a_late_delta_leaves_the_closed_figure_and_is_kept_apart() {
        let mut m = Merged::new(2);
        let now = ms(2026, 11, 27, 15);
        let hour = PeriodKind::Hour.at(now);
        let (eu, us) = (actor("eu", "e"), actor("us", "u"));
        m.apply(0, &of("a", hour, &eu, 10), now);
        // Closed: a higher P from eu and a first one from us are late.
        assert_eq!(m.apply_late(0, &of("a", hour, &eu, 14)), 4);
        assert_eq!(m.apply_late(0, &of("a", hour, &us, 3)), 7);
        // A duplicate adds nothing; the figure never moved.
        assert_eq!(m.apply_late(0, &of("a", hour, &eu, 14)), 7);
        assert_eq!(m.get("a", hour).unwrap().total(), 10);
        assert_eq!(m.late_units("a", hour), 7);
        assert_eq!(m.late_units("b", hour), 0);
        // They go with their partition and with their period.
        m.drop_partitions(&[0]);
        assert_eq!(m.late_units("a", hour), 0);
        m.apply_late(0, &of("a", hour, &eu, 1));
        m.expire(now + 10 * 3_600_000);
        assert!(m.late.is_empty());
    }

    fn limited(period: Period, p: u64, limit: Option<u64>, version: u64, ts_ms: u64) -> Delta {
        let mut d = Delta::of("acme", period, actor("eu", "e"), p, 0, ts_ms);
        d.limit = limit;
        d.limits_version = version;
        d
    }

    #[test]
    fn the_limit_comes_from_the_deltas_highest_version_then_latest() {
        let mut m = Merged::new(2);
        let month = PeriodKind::Month.at(NOW);
        let carried = |m: &Merged| m.get("acme", month).unwrap().carried();
        // A v2 writer carries none: the configuration decides.
        m.apply(0, &limited(month, 1, None, 0, 10), NOW);
        assert_eq!(carried(&m), None);
        let judged = Carried::or_config(carried(&m), || Some(500));
        assert_eq!((judged.limit, judged.limits_version), (Some(500), 0));
        // A v3 delta's limit wins over the configuration.
        assert_eq!(
            m.apply(0, &limited(month, 2, Some(1_000), 3, 20), NOW),
            Applied::Changed {
                before: 1,
                after: 2,
                stale: false,
                new_epoch: false,
                limit_changed: true
            }
        );
        let c = |limit, limits_version| {
            Some(Carried {
                limit,
                limits_version,
            })
        };
        assert_eq!(carried(&m), c(Some(1_000), 3));
        assert_eq!(
            Carried::or_config(carried(&m), || Some(500)).limit,
            Some(1_000)
        );
        // An older version never replaces it, however late it arrives.
        m.apply(0, &limited(month, 3, Some(10), 2, 99), NOW);
        assert_eq!(carried(&m), c(Some(1_000), 3));
        // Nor does a later v2 writer's None.
        m.apply(0, &limited(month, 4, None, 0, 100), NOW);
        assert_eq!(carried(&m), c(Some(1_000), 3));
        // Same version: the latest ts wins, an earlier one does not. A
        // duplicate (no count change) still brings its limit, and makes the
        // counter dirty to re-broadcast it.
        m.take_dirty(false, |_| true, |_, _| true);
        assert_eq!(
            m.apply(0, &limited(month, 4, Some(2_000), 3, 30), NOW),
            Applied::Unchanged {
                stale: false,
                limit_changed: true
            }
        );
        assert_eq!(m.dirty_len(), 1);
        m.apply(0, &limited(month, 4, Some(7), 3, 25), NOW);
        assert_eq!(carried(&m), c(Some(2_000), 3));
        // A newer version without the tier: no limit, whatever the
        // configuration says.
        m.apply(0, &limited(month, 4, None, 4, 1), NOW);
        assert_eq!(carried(&m), c(None, 4));
        assert_eq!(Carried::or_config(carried(&m), || Some(500)).limit, None);
        // Each period has its own: the day's counter carries none yet.
        m.apply(0, &limited(Period::day(TODAY), 1, None, 0, 0), NOW);
        assert_eq!(m.get("acme", Period::day(TODAY)).unwrap().carried(), None);
        // The snapshot carries it to the broadcast.
        assert_eq!(m.snapshot("acme", month).unwrap().carried, c(None, 4));
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
                m.apply(0, &delta("acme", TODAY, &actor("eu", &format!("e{i}")), p, n), NOW);
            }
            let c = m.get("acme", Period::day(TODAY)).unwrap();
            let expected = exact.min(u128::from(u64::MAX)) as u64;
            prop_assert_eq!(c.total(), expected);
            prop_assert_eq!(c.snapshot(m.actors()).regions().get("eu").copied().unwrap_or(0), expected);
        }

        /// Any interleaving, duplication and reordering of the deltas of any
        /// set of actors merges to exactly Σ final(p) − Σ final(n), with each
        /// actor's part at its final (p, n).
        #[test]
        fn any_order_merges_to_final_sum((actors, deltas) in scenario()) {
            let mut m = Merged::new(2);
            for d in &deltas {
                m.apply(0, d, NOW);
            }
            let expected: u64 = actors
                .iter()
                .map(|(_, h)| { let (p, n) = *h.last().unwrap(); p - n })
                .sum();
            let total = m.get("acme", Period::day(TODAY)).map(Counter::total).unwrap_or(0);
            prop_assert_eq!(total, expected);
            let parts = m.snapshot("acme", Period::day(TODAY)).map(|s| s.parts).unwrap_or_default();
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
            for d in &all { m.apply(0, d, NOW); }
            let once = m.get("acme", Period::day(TODAY)).map(Counter::total);
            for d in &all {
                let again = m.apply(0, d, NOW);
                // Earlier deltas of an actor are stale now, but change nothing.
                let unchanged = matches!(again, Applied::Unchanged { .. });
                prop_assert!(unchanged);
            }
            prop_assert_eq!(m.get("acme", Period::day(TODAY)).map(Counter::total), once);
        }
    }
}
