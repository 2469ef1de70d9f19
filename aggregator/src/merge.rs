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
//! Actor names (`region/epoch`, some 40 bytes) are interned once per
//! instance in [`Actors`]; a counter's CRDT and parts hold 4-byte
//! [`ActorId`]s, so a name is stored once however many counters it has a
//! part in (it was three times per counter: the CRDT's P and N maps and the
//! parts). The parts are a sorted `Vec`, not a map: a handful of entries,
//! read whole.
//!
//! This module is pure state: no I/O, no clock (callers pass `today`), no
//! locking. The consumer feeds it, the broadcaster drains its dirty set, the
//! HTTP layer reads it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crdts::pncounter::{Dir, Op};
use crdts::{CmRDT, Dot, PNCounter};
use num_traits::{Signed, ToPrimitive};
use tierlimit_shared::messages::{actor_region, ActorPart, Delta};

/// Identifies one counter: a tenant on one UTC day. Ordered by day first,
/// so a set of them drops whole days with one `split_off`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantDay {
    pub day: u32,
    pub tenant: String,
}

impl TenantDay {
    pub fn new(tenant: impl Into<String>, day: u32) -> Self {
        TenantDay {
            tenant: tenant.into(),
            day,
        }
    }
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

/// The merged counter of one (tenant, day).
#[derive(Debug, Clone)]
pub struct Counter {
    crdt: PNCounter<ActorId>,
    /// Max-merged cumulative (actor, P, N), sorted by actor id, mirroring
    /// the CRDT's private entries so the broadcast can carry them.
    parts: Vec<(ActorId, u64, u64)>,
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
            Err(i) => self.parts.insert(i, merged),
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

/// One day's counters, with what the HTTP pages and the gauges need kept
/// up to date as deltas merge, so no reader walks every counter.
#[derive(Debug, Default)]
pub struct DayCounters {
    counters: HashMap<String, Counter>,
    /// Σ of the counters' totals (each saturated into u64).
    units: i128,
    /// The counters broadcast since they were rebuilt: the tenants at or
    /// past the broadcast threshold of their limit (every over-limit one
    /// among them), and the few broadcast for a rollback.
    visible: BTreeSet<String>,
}

impl DayCounters {
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// Σ of the day's totals.
    pub fn units(&self) -> u64 {
        self.units.clamp(0, i128::from(u64::MAX)) as u64
    }

    /// The day's visible counters (see [`DayCounters::visible`]), by tenant.
    pub fn visible(&self) -> impl Iterator<Item = (&str, &Counter)> {
        self.visible
            .iter()
            .filter_map(|t| Some((t.as_str(), self.counters.get(t)?)))
    }

    fn make_visible(&mut self, tenant: &str) {
        if let Some(c) = self.counters.get_mut(tenant) {
            if !c.visible {
                c.visible = true;
                self.visible.insert(tenant.to_owned());
            }
        }
    }
}

/// What [`Merged::expire`] took out: freed when dropped, which the caller
/// does after releasing the state lock.
#[derive(Debug, Default)]
pub struct Expired {
    days: Vec<DayCounters>,
    // Held only to be freed with the rest.
    _dirty: BTreeSet<TenantDay>,
    _urgent: BTreeSet<TenantDay>,
}

impl Expired {
    /// Counters taken out.
    pub fn counters(&self) -> usize {
        self.days.iter().map(DayCounters::len).sum()
    }
}

/// Every counter this instance holds, plus which of them still need to be
/// broadcast.
///
/// Kept per day: dropping a day past the retention is a map split under
/// the lock, its freeing happens after (see [`Expired`]).
#[derive(Debug)]
pub struct Merged {
    days: BTreeMap<u32, DayCounters>,
    actors: Actors,
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
            days: BTreeMap::new(),
            actors: Actors::default(),
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
        let actor = self.actors.intern(&delta.actor);
        let day = self.days.entry(delta.day).or_default();
        let counter = match day.counters.get_mut(delta.tenant.as_str()) {
            Some(c) => c,
            None => day
                .counters
                .entry(delta.tenant.clone())
                .or_insert_with(|| Counter::new(partition)),
        };
        let before = counter.total();
        // A Redis epoch's first part beside another of the same region: the
        // region's Redis lost this counter (a new day or tenant starts with
        // no part of its region at all). Local fail-mode actors are not
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
        let merge = counter.apply(actor, delta.p, delta.n);
        if !merge.changed {
            return Applied::Unchanged { stale: merge.stale };
        }
        let after = counter.total();
        day.units += i128::from(after) - i128::from(before);
        self.dirty
            .insert(TenantDay::new(delta.tenant.as_str(), delta.day));
        Applied::Changed {
            before,
            after,
            stale: merge.stale,
            new_epoch,
        }
    }

    pub fn get(&self, tenant: &str, day: u32) -> Option<&Counter> {
        self.days.get(&day)?.counters.get(tenant)
    }

    /// The interned actor names (to read a [`Counter`]'s parts).
    pub fn actors(&self) -> &Actors {
        &self.actors
    }

    /// What a broadcast or an HTTP answer needs of one counter.
    pub fn snapshot(&self, tenant: &str, day: u32) -> Option<Snapshot> {
        self.get(tenant, day).map(|c| c.snapshot(&self.actors))
    }

    /// One day's counters, if any.
    pub fn on(&self, day: u32) -> Option<&DayCounters> {
        self.days.get(&day)
    }

    /// Every counter of `day`, in no particular order.
    pub fn day(&self, day: u32) -> impl Iterator<Item = (&str, &Counter)> {
        self.days
            .get(&day)
            .into_iter()
            .flat_map(|d| d.counters.iter().map(|(t, c)| (t.as_str(), c)))
    }

    /// Number of (tenant, day) counters held.
    pub fn len(&self) -> usize {
        self.days.values().map(DayCounters::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.days.values().all(DayCounters::is_empty)
    }

    /// Forgets every counter rebuilt from one of `partitions` (they were
    /// revoked, or are about to be re-read from the beginning). Returns how
    /// many were dropped. Linear in the counters held: a rebalance, not a
    /// decision, pays it.
    pub fn drop_partitions(&mut self, partitions: &[i32]) -> usize {
        let mut dropped = 0;
        for d in self.days.values_mut() {
            let before = d.counters.len();
            d.counters.retain(|_, c| !partitions.contains(&c.partition));
            dropped += before - d.counters.len();
            let counters = &d.counters;
            d.visible.retain(|t| counters.contains_key(t));
            d.units = counters.values().map(|c| i128::from(c.total())).sum();
        }
        self.days.retain(|_, d| !d.is_empty());
        let days = &self.days;
        let held = |k: &TenantDay| {
            days.get(&k.day)
                .is_some_and(|d| d.counters.contains_key(&k.tenant))
        };
        self.dirty.retain(held);
        self.urgent.retain(held);
        dropped
    }

    /// Takes out the days that fell out of the retention window, in time
    /// logarithmic in what is held; the caller drops what it returns after
    /// releasing its lock.
    pub fn expire(&mut self, today: u32) -> Expired {
        let oldest = self.oldest_kept(today);
        let first = TenantDay::new("", oldest);
        let kept = self.days.split_off(&oldest);
        let gone = std::mem::replace(&mut self.days, kept);
        let dirty = self.dirty.split_off(&first);
        let urgent = self.urgent.split_off(&first);
        Expired {
            days: gone.into_values().collect(),
            _dirty: std::mem::replace(&mut self.dirty, dirty),
            _urgent: std::mem::replace(&mut self.urgent, urgent),
        }
    }

    /// Marks a counter for broadcast (no-op if it is not held). Returns
    /// whether it is held.
    pub fn mark_dirty(&mut self, key: &TenantDay) -> bool {
        let held = self.get(&key.tenant, key.day).is_some();
        if held {
            self.dirty.insert(key.clone());
        }
        held
    }

    /// Marks every counter of `day` whose tenant passes `concerned` dirty
    /// (a reload changed the unknown-tenant limit). Returns how many.
    pub fn mark_day_dirty_where(&mut self, day: u32, concerned: impl Fn(&str) -> bool) -> usize {
        let mut n = 0;
        if let Some(d) = self.days.get(&day) {
            for t in d.counters.keys() {
                if concerned(t) {
                    self.dirty.insert(TenantDay::new(t.as_str(), day));
                    n += 1;
                }
            }
        }
        n
    }

    /// Marks a dirty counter for immediate broadcast.
    pub fn mark_urgent(&mut self, key: &TenantDay) {
        if self.get(&key.tenant, key.day).is_some() {
            self.dirty.insert(key.clone());
            self.urgent.insert(key.clone());
        }
    }

    /// Marks a counter for broadcast whatever its total: an actor published
    /// less than it had before (a partial rollback of its Redis), and only
    /// the broadcast of its merged part lets the region raise its counter
    /// back (ARCHITECTURE.md, "A counter never stays below what its actor
    /// published"), limited tenant or not.
    pub fn mark_visible(&mut self, key: &TenantDay) {
        if let Some(d) = self.days.get_mut(&key.day) {
            if d.counters.contains_key(&key.tenant) {
                d.make_visible(&key.tenant);
                self.dirty.insert(key.clone());
            }
        }
    }

    /// Marks every counter of `day` read from one of `partitions` dirty (a
    /// partition just caught up, or the limits changed).
    pub fn mark_day_dirty(&mut self, day: u32, partitions: Option<&[i32]>) -> usize {
        let mut n = 0;
        if let Some(d) = self.days.get(&day) {
            for (t, c) in &d.counters {
                if partitions.is_none_or(|ps| ps.contains(&c.partition)) {
                    self.dirty.insert(TenantDay::new(t.as_str(), day));
                    n += 1;
                }
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
    pub fn forget_dirty(&mut self, key: &TenantDay) {
        self.dirty.remove(key);
        self.urgent.remove(key);
    }

    /// Marks every counter read from `partition`, on every day held, dirty
    /// (the partition has just caught up); returns how many.
    pub fn mark_partition_dirty(&mut self, partition: i32) -> usize {
        let days: Vec<u32> = self.days.keys().copied().collect();
        days.into_iter()
            .map(|day| self.mark_day_dirty(day, Some(&[partition])))
            .sum()
    }

    /// Whether any counter waits for an immediate broadcast.
    pub fn has_urgent(&self) -> bool {
        !self.urgent.is_empty()
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
        wanted: impl Fn(&TenantDay, &Counter) -> bool,
    ) -> (Vec<(TenantDay, Snapshot)>, usize) {
        let source = if urgent_only {
            &self.urgent
        } else {
            &self.dirty
        };
        let keys: Vec<TenantDay> = source
            .iter()
            .filter(|k| {
                self.get(&k.tenant, k.day)
                    .is_some_and(|c| eligible(c.partition))
            })
            .cloned()
            .collect();
        let mut taken = Vec::with_capacity(keys.len());
        let mut withheld = 0;
        for k in keys {
            self.dirty.remove(&k);
            self.urgent.remove(&k);
            let Some(d) = self.days.get_mut(&k.day) else {
                continue;
            };
            let Some(c) = d.counters.get(&k.tenant) else {
                continue;
            };
            if c.visible || wanted(&k, c) {
                let snapshot = c.snapshot(&self.actors);
                d.make_visible(&k.tenant);
                taken.push((k, snapshot));
            } else {
                withheld += 1;
            }
        }
        (taken, withheld)
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
                stale: false,
                new_epoch: false
            }
        );
        assert_eq!(
            m.apply(0, &delta("acme", TODAY, &us, 5, 0), TODAY),
            Applied::Changed {
                before: 8,
                after: 13,
                stale: false,
                new_epoch: false
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
                stale: false,
                new_epoch: false
            }
        );
        let c = m.get("acme", TODAY).unwrap();
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
        m.apply(0, &delta("acme", TODAY, &actor("eu", "old"), 40, 0), TODAY);
        // A first part of a region, and a node's local fail-mode actor, are
        // no new epoch; a second epoch of the region is.
        let new_epoch = |a| matches!(a, Applied::Changed { new_epoch, .. } if new_epoch);
        assert!(!new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("us", "x"), 1, 0),
            TODAY
        )));
        assert!(!new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("eu", "local-a-1"), 1, 0),
            TODAY
        )));
        assert!(new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("eu", "new"), 3, 1),
            TODAY
        )));
        assert!(!new_epoch(m.apply(
            0,
            &delta("acme", TODAY, &actor("eu", "new"), 4, 1),
            TODAY
        )));
        let c = m.get("acme", TODAY).unwrap();
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
            m.apply(0, &delta("acme", TODAY, &actor("eu", "e"), 0, 0), TODAY),
            Applied::Unchanged { stale: false }
        );
        assert!(m.snapshot("acme", TODAY).unwrap().parts.is_empty());
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
                stale: true,
                new_epoch: false
            }
        );
        assert_eq!(
            m.snapshot("acme", TODAY).unwrap().parts[0],
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
        assert_eq!(m.expire(TODAY + 1).counters(), 1);
        assert!(m.get("a", TODAY - 1).is_none());
        assert_eq!(m.len(), 2);
        assert!(m
            .take_dirty(false, |_| true, |_, _| true)
            .0
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
        let dirty = m.take_dirty(false, |_| true, |_, _| true).0;
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
        let taken = m.take_dirty(false, |p| p == 0, |_, _| true).0;
        assert_eq!(taken.len(), 1);
        assert_eq!(m.dirty_len(), 1);
        // Nothing changed, nothing to take; a failed broadcast is put back.
        assert!(m.take_dirty(false, |p| p == 0, |_, _| true).0.is_empty());
        m.mark_dirty(&taken[0].0);
        assert_eq!(m.take_dirty(false, |p| p == 0, |_, _| true).0.len(), 1);
        // Unknown keys are not resurrected.
        m.mark_dirty(&TenantDay::new("zzz", TODAY));
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
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY);
        m.apply(0, &delta("b", TODAY, &eu, 1, 0), TODAY);
        m.mark_urgent(&TenantDay::new("b", TODAY));
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
        let wanted = |_: &TenantDay, c: &Counter| c.total() >= 10;
        m.apply(0, &delta("far", TODAY, &eu, 3, 0), TODAY);
        m.apply(0, &delta("near", TODAY, &eu, 12, 0), TODAY);
        let (taken, withheld) = m.take_dirty(false, |_| true, wanted);
        assert_eq!(withheld, 1);
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].0.tenant, "near");
        assert!(m.get("near", TODAY).unwrap().is_visible());
        assert!(!m.get("far", TODAY).unwrap().is_visible());
        // A withheld counter leaves the dirty set; it comes back when it
        // changes, and is taken once wanted.
        assert_eq!(m.dirty_len(), 0);
        m.apply(0, &delta("far", TODAY, &eu, 10, 0), TODAY);
        assert_eq!(m.take_dirty(false, |_| true, wanted).0.len(), 1);
        // A visible counter is taken on every change, wanted or not (the
        // regions hold an entry that must not freeze).
        m.apply(0, &delta("near", TODAY, &eu, 13, 0), TODAY);
        let (taken, _) = m.take_dirty(false, |_| true, |_, _| false);
        assert_eq!(taken.len(), 1);
        // A stale delta (a rolled-back actor) makes a counter visible.
        m.apply(0, &delta("low", TODAY, &eu, 5, 0), TODAY);
        m.take_dirty(false, |_| true, wanted);
        m.mark_visible(&TenantDay::new("low", TODAY));
        let (taken, withheld) = m.take_dirty(false, |_| true, |_, _| false);
        assert_eq!((taken.len(), withheld), (1, 0));
        assert_eq!(taken[0].0.tenant, "low");
    }

    #[test]
    fn each_day_keeps_its_units_and_visible_tenants() {
        let mut m = Merged::new(2);
        let (eu, us) = (actor("eu", "e"), actor("us", "e"));
        m.apply(0, &delta("a", TODAY, &eu, 10, 0), TODAY);
        m.apply(0, &delta("a", TODAY, &us, 5, 0), TODAY);
        m.apply(1, &delta("b", TODAY, &eu, 7, 2), TODAY);
        m.apply(0, &delta("a", TODAY - 1, &eu, 100, 0), TODAY);
        let d = m.on(TODAY).unwrap();
        assert_eq!((d.len(), d.units()), (2, 20));
        assert_eq!(d.visible().count(), 0);
        // N grew: the units follow the totals down.
        m.apply(1, &delta("b", TODAY, &eu, 7, 7), TODAY);
        assert_eq!(m.on(TODAY).unwrap().units(), 15);
        // What the broadcaster takes becomes visible.
        m.take_dirty(false, |_| true, |k, _| k.tenant == "a");
        let visible: Vec<&str> = m.on(TODAY).unwrap().visible().map(|(t, _)| t).collect();
        assert_eq!(visible, ["a"]);
        // Revoking a partition takes its counters out of the summaries.
        m.drop_partitions(&[0]);
        let d = m.on(TODAY).unwrap();
        assert_eq!((d.len(), d.units(), d.visible().count()), (1, 0, 0));
        assert!(m.on(TODAY - 1).is_none());
        // Expiry hands whole days back, dirty entries included.
        m.apply(0, &delta("c", TODAY, &eu, 1, 0), TODAY);
        let gone = m.expire(TODAY + 2);
        assert_eq!(gone.counters(), 2);
        assert!(m.is_empty());
        assert_eq!(m.dirty_len(), 0);
    }

    #[test]
    fn mark_day_dirty_for_caught_up_partitions() {
        let mut m = Merged::new(2);
        let eu = actor("eu", "e");
        m.apply(0, &delta("a", TODAY, &eu, 1, 0), TODAY);
        m.apply(1, &delta("b", TODAY, &eu, 1, 0), TODAY);
        m.apply(1, &delta("b", TODAY - 1, &eu, 1, 0), TODAY);
        m.take_dirty(false, |_| true, |_, _| true);
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
        assert_eq!(m.snapshot("b", TODAY).unwrap().regions()["eu"], u64::MAX);
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
            prop_assert_eq!(c.snapshot(m.actors()).regions().get("eu").copied().unwrap_or(0), expected);
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
            let parts = m.snapshot("acme", TODAY).map(|s| s.parts).unwrap_or_default();
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
