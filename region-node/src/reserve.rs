//! Node-tier reservations: the node tier decided in process, against units
//! charged in Redis ahead.
//!
//! Only its own node reads or writes a node tier (its key names the node),
//! so nothing is gained by asking Redis about it on every decision: the
//! node can charge a slice of the tier's window ahead (a *reservation*,
//! piggybacked on a decision that calls the script anyway) and spend it in
//! process. The decisions it covers call the script with the region tier
//! and the global budget only: about a fifth fewer Redis instructions per
//! decision (BENCHMARKS.md, "Hot path").
//!
//! What keeps the node tier strict, across crashes too:
//!
//! - a reserved unit is charged in Redis *before* it is spent, in the
//!   window it is spent in: Redis stays the record, so a restarted node
//!   finds every unit it reserved already counted;
//! - a reservation belongs to its window and dies with it: it is spent only
//!   until the window's end measured from when its charge was *sent* (Redis
//!   ran it later, so its window ends no earlier), as a lease is. The node
//!   tier's decision is made then, in that window; the covered check's own
//!   script call (region tier, global budget) may run a few ms later. (The
//!   decider passes no `margin`: one of `store_timeout` would idle the last
//!   half of a 1 s window under the bench's 500 ms, measured: every check
//!   of that half charged a reservation it could not spend);
//! - a decision that another tier denies, or that Redis does not answer,
//!   puts its unit back ([`Reserves::give_back`]): all-or-nothing holds;
//! - only fixed and sliding windows reserve (a GCRA or sliding-log node
//!   tier is decided in the script on every call).
//!
//! What it costs: a node that crashes strands what it had reserved and not
//! spent, at most `node.reserve_fraction` of the node tier's limit per
//! (tenant, key), for the rest of that window: under-admission on that node
//! only, never over-admission. Nothing of the region tier or the global
//! count is reserved, so no other node and no other region pays for it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::storage::{script, TierReply};

use crate::lease::{shard_of, slot_key, SHARDS};

/// One (tenant, key)'s node-tier reservation.
#[derive(Debug, Default)]
struct Slot {
    /// Units charged in Redis for this window and not yet spent.
    unspent: u64,
    /// The node tier's remaining in Redis after the last charge this node
    /// saw (reservations included), for sizing the next one.
    redis_remaining: u64,
    /// When the window ends in Redis' clock (ms): identifies the window.
    ends_at_ms: u64,
    /// When this node stops spending the reservation (its clock).
    expires: Option<Instant>,
    /// Bumped when a new window replaces the reservation, so a unit taken
    /// from an old one is never put back into a new one.
    generation: u64,
    /// A decision is charging a reservation now: others do not ask for
    /// one too.
    charging: bool,
}

/// What a check gets from the table.
#[derive(Debug, PartialEq, Eq)]
pub enum Take {
    /// The node tier is decided: `cost` came out of the reservation. The
    /// script call leaves the node tier out; `tier` is what to report for it.
    Covered { ticket: Ticket, tier: TierReply },
    /// Decide the node tier in the script, charging `reserve` more units
    /// for later decisions (0: none).
    Charge { reserve: u64 },
}

/// Where a covered decision's unit came from, to put it back.
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket {
    generation: u64,
    cost: u64,
}

/// A [`Take`] whose check is in flight. Dropped before it is settled (the
/// check's future dropped: a client that disconnected), it undoes itself:
/// a covered unit goes back to the reservation and a pending charge's
/// `charging` flag is cleared (what the script may have charged meanwhile
/// is given back by the store's late-reply path), so a cancelled check
/// cannot stop reserving for its key or pin its slot.
pub struct Pending<'a> {
    reserves: &'a Reserves,
    at: (&'a str, &'a str),
    take: Option<Take>,
}

impl Pending<'_> {
    pub fn get(&self) -> &Take {
        self.take.as_ref().expect("unsettled")
    }

    /// The take, to settle: the guard is disarmed.
    pub fn into_take(mut self) -> Take {
        self.take.take().expect("unsettled")
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        match self.take.take() {
            Some(Take::Covered { ticket, .. }) => self.reserves.give_back(self.at, ticket),
            Some(Take::Charge { reserve }) if reserve > 0 => {
                self.reserves.settle(self.at, reserve, None, Instant::now());
            }
            _ => {}
        }
    }
}

/// The node's reservations, by (tenant, key).
pub struct Reserves {
    shards: Vec<Mutex<HashMap<String, Slot>>>,
}

impl Default for Reserves {
    fn default() -> Self {
        Reserves {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

impl Reserves {
    fn shard(&self, k: &str) -> &Mutex<HashMap<String, Slot>> {
        &self.shards[shard_of(k)]
    }

    /// Guards `take` (of `at`) until its check settles it.
    pub fn pending<'a>(&'a self, at: (&'a str, &'a str), take: Take) -> Pending<'a> {
        Pending {
            reserves: self,
            at,
            take: Some(take),
        }
    }

    /// Decides the node tier of a check of `cost` from the reservation if
    /// it holds enough and is live `margin` from now; otherwise says how
    /// much the script call should reserve: up to `chunk`, never more than
    /// the tier was last seen to leave beyond `cost`, and nothing while
    /// another decision is charging one. `now_ms` is the node's wall clock,
    /// for the reset it reports.
    pub fn take(
        &self,
        (tenant, key): (&str, &str),
        cost: u64,
        (limit, chunk): (u64, u64),
        (now, now_ms, margin): (Instant, u64, Duration),
    ) -> Take {
        let k = slot_key(tenant, key);
        let mut shard = self.shard(&k).lock().expect("reserve shard");
        let slot = shard.entry(k).or_default();
        let live = slot.expires.is_some_and(|e| now + margin < e);
        if live && slot.unspent >= cost {
            slot.unspent -= cost;
            return Take::Covered {
                ticket: Ticket {
                    generation: slot.generation,
                    cost,
                },
                tier: TierReply {
                    remaining: slot.redis_remaining.saturating_add(slot.unspent).min(limit),
                    reset_ms: slot.ends_at_ms.saturating_sub(now_ms).max(1),
                },
            };
        }
        if slot.charging {
            return Take::Charge { reserve: 0 };
        }
        let left = if live { slot.redis_remaining } else { limit };
        let reserve = chunk.min(left.saturating_sub(cost));
        slot.charging = reserve > 0;
        Take::Charge { reserve }
    }

    /// After a check that asked to reserve `reserve` units: keeps them if
    /// the script charged them (`tier` is the node tier's reply, `now_ms`
    /// Redis' clock, `sent` when the call went out). Returns the node
    /// tier's remaining to report (what Redis left plus the reservation).
    pub fn settle(
        &self,
        (tenant, key): (&str, &str),
        reserve: u64,
        charged: Option<(&TierReply, i64)>,
        sent: Instant,
    ) -> Option<u64> {
        let k = slot_key(tenant, key);
        let mut shard = self.shard(&k).lock().expect("reserve shard");
        let slot = shard.entry(k).or_default();
        if reserve > 0 {
            slot.charging = false;
        }
        let (tier, now_ms) = charged?;
        let ends_at_ms = (now_ms.max(0) as u64).saturating_add(tier.reset_ms);
        let expires = script::window_end_lower_bound(sent, tier.reset_ms);
        if ends_at_ms == slot.ends_at_ms && slot.expires.is_some() {
            slot.unspent += reserve;
            // Replies of one window can come back out of order.
            slot.redis_remaining = slot.redis_remaining.min(tier.remaining);
            // Each reply gives a lower bound of the window's end in this
            // node's clock: the latest is the tightest.
            slot.expires = slot.expires.max(Some(expires));
        } else {
            // A new window: what was left of the old one died with it.
            slot.generation += 1;
            slot.unspent = reserve;
            slot.redis_remaining = tier.remaining;
            slot.ends_at_ms = ends_at_ms;
            slot.expires = Some(expires);
        }
        Some(tier.remaining.saturating_add(slot.unspent))
    }

    /// Puts a covered decision's unit back: the script denied it or never
    /// answered. Dropped if its window was replaced meanwhile.
    pub fn give_back(&self, (tenant, key): (&str, &str), ticket: Ticket) {
        let k = slot_key(tenant, key);
        let mut shard = self.shard(&k).lock().expect("reserve shard");
        if let Some(slot) = shard.get_mut(&k) {
            if slot.generation == ticket.generation {
                slot.unspent += ticket.cost;
            }
        }
    }

    /// Takes the whole unspent reservation out, to be given back to Redis
    /// by a refund tied to no charge (which gives back to the current
    /// window, never below zero: returning the reservation with it keeps
    /// that floor where it was without reservations). Only a reservation
    /// live `margin` from now: a refund made later could reach the next
    /// window, where these units were never charged.
    pub fn withdraw(&self, (tenant, key): (&str, &str), now: Instant, margin: Duration) -> u64 {
        let k = slot_key(tenant, key);
        let mut shard = self.shard(&k).lock().expect("reserve shard");
        let Some(slot) = shard.get_mut(&k) else {
            return 0;
        };
        let units = std::mem::take(&mut slot.unspent);
        if slot.expires.is_some_and(|e| now + margin < e) {
            units
        } else {
            0
        }
    }

    /// What another call (a refund) saw of the node tier: refunds raise
    /// what Redis leaves, which sizes the next reservation.
    pub fn observe(&self, (tenant, key): (&str, &str), tier: &TierReply, now_ms: i64) {
        let k = slot_key(tenant, key);
        let mut shard = self.shard(&k).lock().expect("reserve shard");
        if let Some(slot) = shard.get_mut(&k) {
            if (now_ms.max(0) as u64).saturating_add(tier.reset_ms) == slot.ends_at_ms {
                slot.redis_remaining = tier.remaining;
            }
        }
    }

    /// What the node holds for (tenant, key) now, for usage reads: the
    /// unspent units of a live reservation.
    pub fn unspent(&self, (tenant, key): (&str, &str), now: Instant) -> u64 {
        let k = slot_key(tenant, key);
        let shard = self.shard(&k).lock().expect("reserve shard");
        shard
            .get(&k)
            .filter(|s| s.expires.is_some_and(|e| now < e))
            .map_or(0, |s| s.unspent)
    }

    /// Forgets the reservations of the tenants `which` picks (their limits
    /// changed): the next check reserves under the new limit. Units
    /// reserved and not spent stay charged to the node tier until its
    /// window ends, as when a reservation expires: never a unit more.
    pub fn forget_where(&self, which: impl Fn(&str) -> bool) {
        for shard in &self.shards {
            let mut shard = shard.lock().expect("reserve shard");
            shard.retain(|k, s| {
                let tenant = k.split_once('|').map_or(k.as_str(), |(t, _)| t);
                s.charging || !which(tenant)
            });
        }
    }

    /// Forgets reservations whose window is over, one shard at a time; the
    /// removed entries are freed after the shard's lock is released.
    /// Returns the units held in live ones (a gauge).
    pub fn expire(&self, now: Instant) -> u64 {
        let mut held = 0;
        for shard in &self.shards {
            let dead: Vec<(String, Slot)> = {
                let mut shard = shard.lock().expect("reserve shard");
                let dead = shard
                    .extract_if(|_, s| !(s.charging || s.expires.is_some_and(|e| now < e)))
                    .collect();
                held += shard.values().map(|s| s.unspent).sum::<u64>();
                dead
            };
            drop(dead);
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: (&str, &str) = ("t", "_");
    const NO_MARGIN: Duration = Duration::ZERO;

    fn tier(remaining: u64, reset_ms: u64) -> TierReply {
        TierReply {
            remaining,
            reset_ms,
        }
    }

    #[test]
    fn a_reservation_is_charged_then_spent_in_process_until_empty() {
        let r = Reserves::default();
        let t0 = Instant::now();
        // Nothing known: reserve up to the chunk.
        assert_eq!(
            r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN)),
            Take::Charge { reserve: 10 }
        );
        // While that charge is in flight, others reserve nothing.
        assert_eq!(
            r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN)),
            Take::Charge { reserve: 0 }
        );
        // The script charged 1 + 10 (and the other call 1): 88 left.
        assert_eq!(
            r.settle(T, 10, Some((&tier(88, 1_000), 5_000)), t0),
            Some(98)
        );
        for left in (0..10).rev() {
            match r.take(T, 1, (100, 10), (t0, 5_000, NO_MARGIN)) {
                Take::Covered { tier, .. } => {
                    assert_eq!(tier.remaining, 88 + left);
                    assert_eq!(tier.reset_ms, 1_000);
                }
                other => panic!("{left} units are reserved, got {other:?}"),
            }
        }
        // Spent: the next one reserves again, sized by what Redis left.
        assert_eq!(
            r.take(T, 1, (100, 10), (t0, 5_000, NO_MARGIN)),
            Take::Charge { reserve: 10 }
        );
    }

    /// Issue 29 item 8: a check dropped mid-call (its client disconnected)
    /// drops its guard: a pending charge's flag is cleared (else no check
    /// of the key would reserve again, and `expire` would keep its slot for
    /// good) and a covered unit goes back.
    #[test]
    fn a_dropped_check_clears_its_charging_flag_and_puts_its_unit_back() {
        let r = Reserves::default();
        let t0 = Instant::now();
        let p = r.pending(T, r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN)));
        assert_eq!(p.get(), &Take::Charge { reserve: 10 });
        drop(p);
        assert_eq!(
            r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN)),
            Take::Charge { reserve: 10 },
            "the dropped charge left no flag"
        );
        r.settle(T, 10, Some((&tier(89, 1_000), 5_000)), t0);
        let p = r.pending(T, r.take(T, 1, (100, 10), (t0, 5_000, NO_MARGIN)));
        assert!(matches!(p.get(), Take::Covered { .. }));
        assert_eq!(r.unspent(T, t0), 9);
        drop(p);
        assert_eq!(r.unspent(T, t0), 10, "the covered unit is back");
        // Settled normally, nothing is undone.
        let p = r.pending(T, r.take(T, 1, (100, 10), (t0, 5_000, NO_MARGIN)));
        let _ = p.into_take();
        assert_eq!(r.unspent(T, t0), 9);
    }

    #[test]
    fn a_limits_change_forgets_the_changed_tenants_reservations_only() {
        let r = Reserves::default();
        let t0 = Instant::now();
        let other = ("o", "_");
        for k in [T, other] {
            let _ = r.take(k, 1, (100, 10), (t0, 0, NO_MARGIN));
            r.settle(k, 10, Some((&tier(89, 1_000), 5_000)), t0);
            assert_eq!(r.unspent(k, t0), 10);
        }
        r.forget_where(|t| t == "t");
        assert_eq!(
            r.unspent(T, t0),
            0,
            "forgotten: the next check reserves anew"
        );
        assert_eq!(
            r.take(T, 1, (20, 2), (t0, 5_000, NO_MARGIN)),
            Take::Charge { reserve: 2 },
            "under the new limit's chunk"
        );
        assert_eq!(r.unspent(other, t0), 10, "another tenant keeps its own");
    }

    #[test]
    fn near_the_limit_a_reservation_shrinks_to_what_is_left() {
        let r = Reserves::default();
        let t0 = Instant::now();
        let _ = r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN));
        r.settle(T, 10, Some((&tier(4, 1_000), 0)), t0);
        for _ in 0..10 {
            let _ = r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN));
        }
        // 4 left in Redis, cost 2: reserve at most 2 more.
        assert_eq!(
            r.take(T, 2, (100, 10), (t0, 0, NO_MARGIN)),
            Take::Charge { reserve: 2 }
        );
        r.settle(T, 2, Some((&tier(0, 900), 100)), t0);
        // Nothing left beyond the cost: no reservation, the script decides.
        let _ = r.take(T, 2, (100, 10), (t0, 0, NO_MARGIN));
        assert_eq!(
            r.take(T, 2, (100, 10), (t0, 0, NO_MARGIN)),
            Take::Charge { reserve: 0 }
        );
    }

    #[test]
    fn a_reservation_dies_with_its_window_and_a_margin_before_it() {
        let r = Reserves::default();
        let t0 = Instant::now();
        let _ = r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN));
        r.settle(T, 10, Some((&tier(89, 200), 0)), t0);
        let margin = Duration::from_millis(50);
        assert!(matches!(
            r.take(
                T,
                1,
                (100, 10),
                (t0 + Duration::from_millis(100), 0, margin)
            ),
            Take::Covered { .. }
        ));
        // 160 ms + 50 ms margin is past the 200 ms window: the script decides,
        // and the unit left over is not spent.
        let Take::Charge { reserve } = r.take(
            T,
            1,
            (100, 10),
            (t0 + Duration::from_millis(160), 0, margin),
        ) else {
            panic!("past the margin the script decides")
        };
        // That call is not answered; the ended window's entry is forgotten.
        r.settle(T, reserve, None, t0);
        assert_eq!(r.expire(t0 + Duration::from_millis(200)), 0);
        assert_eq!(r.unspent(T, t0), 0, "the expired entry is gone");
    }

    #[test]
    fn the_latest_reply_of_a_window_bounds_its_end() {
        let r = Reserves::default();
        let t0 = Instant::now();
        let _ = r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN));
        r.settle(T, 10, Some((&tier(89, 1_000), 0)), t0);
        // A later charge of the same window (Redis clock 300 + 700 = 1 000)
        // sent 300 ms later: the window ends no earlier than t0 + 999 ms
        // (1 000 less the millisecond Redis' clock was floored to),
        // whichever reply says so, and both bounds agree here...
        let t1 = t0 + Duration::from_millis(300);
        let _ = r.take(T, 20, (100, 10), (t1, 300, NO_MARGIN));
        r.settle(T, 10, Some((&tier(59, 700), 300)), t1);
        assert_eq!(r.unspent(T, t0 + Duration::from_millis(998)), 20);
        // ...and a reply that came back late (sent at t1, run 50 ms later)
        // does not cut the reservation short.
        let _ = r.take(T, 25, (100, 10), (t1, 300, NO_MARGIN));
        r.settle(T, 0, Some((&tier(34, 650), 350)), t1);
        assert_eq!(r.unspent(T, t0 + Duration::from_millis(998)), 20);
        // Past the bound, nothing is spent: Redis may have run the first call
        // up to a millisecond after its floored clock said, so its window
        // may have ended at t0 + 999 ms already.
        assert_eq!(r.unspent(T, t0 + Duration::from_millis(999)), 0);
    }

    #[test]
    fn a_unit_goes_back_only_into_the_window_it_came_from() {
        let r = Reserves::default();
        let t0 = Instant::now();
        let _ = r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN));
        r.settle(T, 10, Some((&tier(89, 1_000), 0)), t0);
        let Take::Covered { ticket, .. } = r.take(T, 3, (100, 10), (t0, 0, NO_MARGIN)) else {
            panic!("covered")
        };
        r.give_back(T, ticket);
        assert_eq!(r.unspent(T, t0), 10);
        let Take::Covered { ticket, .. } = r.take(T, 3, (100, 10), (t0, 0, NO_MARGIN)) else {
            panic!("covered")
        };
        // A new window's charge replaces the reservation...
        r.settle(T, 0, Some((&tier(99, 1_000), 1_000)), t0);
        assert_eq!(r.unspent(T, t0), 0);
        // ...and the old window's unit is not put into it.
        r.give_back(T, ticket);
        assert_eq!(r.unspent(T, t0), 0);
    }

    #[test]
    fn an_unanswered_charge_reserves_nothing_and_a_withdrawn_one_is_gone() {
        let r = Reserves::default();
        let t0 = Instant::now();
        let _ = r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN));
        assert_eq!(r.settle(T, 10, None, t0), None);
        assert_eq!(
            r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN)),
            Take::Charge { reserve: 10 }
        );
        // A withdrawn reservation is never spent; near its window's end
        // it is not handed out either (a refund could reach the next one).
        r.settle(T, 10, Some((&tier(89, 1_000), 0)), t0);
        assert_eq!(r.withdraw(T, t0, NO_MARGIN), 10);
        assert_eq!(r.unspent(T, t0), 0);
        let _ = r.take(T, 1, (100, 10), (t0, 0, NO_MARGIN));
        r.settle(T, 10, Some((&tier(78, 1_000), 0)), t0);
        let late = t0 + Duration::from_millis(990);
        assert_eq!(r.withdraw(T, late, Duration::from_millis(50)), 0);
        assert_eq!(r.unspent(T, t0), 0);
    }
}
