//! Leases: a slice of a tenant's remaining budget, charged in Redis by one
//! decision and then spent in process.
//!
//! A check that is allowed may also charge up to `node.lease_max` more
//! units in the same script call (`decide.lua`, "Leases"); the node keeps
//! them here and answers the tenant's next checks from them without a Redis
//! round trip. What keeps it strict:
//!
//! - leased units are charged like any other unit, to every tier and to
//!   the region's PN counter, so the sum of outstanding leases never exceeds
//!   what the limits leave;
//! - the script grants at most 1/`share` of what every tier and the global
//!   budget leave (`share` = 2 × the region's expected nodes), so near the
//!   limit leases shrink to nothing and every decision goes to Redis;
//! - a lease belongs to the windows it was charged in and dies with the
//!   first of them to end: it expires at the earliest window end, measured
//!   from when the call was *sent* (Redis ran it later, so its window ends
//!   no earlier than that) less a millisecond (the script's clock is
//!   floored to it: `script::window_end_lower_bound`);
//! - only fixed and sliding windows lease (the script grants nothing to a
//!   call with a GCRA or sliding-log tier).
//!
//! For the global tier a leased unit counts when the lease is charged: the
//! region's P includes it at once, so the broadcast total can only be early,
//! never late. The unused part of an expired (or replaced) lease is given
//! back by a refund naming the lease's charge, which returns it to the day's
//! count if the day has not changed, and to the windows it was charged in
//! only if they are still current (never into a later window).
//!
//! A node that crashes loses its outstanding leases: at most `lease_max`
//! units per (tenant, key) it held a lease for stay charged and unused, in
//! their windows until those end, and in the day's global count for good.
//! That is under-admission, never over-admission.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::storage::{script, DecideReply};

/// Shards of the lease table: the hot path locks one, briefly.
pub(crate) const SHARDS: usize = 32;

/// One outstanding lease.
#[derive(Debug, Clone)]
pub struct Lease {
    /// Units left to spend.
    pub units: u64,
    /// When the first of its windows ends (this node's clock, from the
    /// moment the call was sent: conservative).
    pub expires: Instant,
    /// When each tier's window ends, in Redis' clock (ms): the reply's
    /// `now_ms` plus the tier's `reset_ms`. Leased decisions report their
    /// resets from it (exact when the clocks agree; the expiry above does
    /// not depend on clocks).
    pub ends_at_ms: Vec<u64>,
    /// The charge that took it, for the return of its unused part: Redis'
    /// clock and a unique id.
    pub charged_at_ms: u64,
    pub id: String,
    /// The reply of the charge: tiers' remaining after it (lease included),
    /// the region's counter, the global budget left.
    pub reply: DecideReply,
}

/// What a check gets from the lease table.
pub enum Take {
    /// Spent from a lease: the reply to answer with, adjusted for now.
    Leased(Box<DecideReply>, LeaseRef),
    /// No usable lease: go to Redis, asking for one if `ask`.
    Redis { ask: bool },
}

/// Which lease a leased decision came from (for its refund handle).
pub struct LeaseRef {
    pub charged_at_ms: u64,
}

/// An expired or replaced lease with units left.
pub struct Leftover {
    pub tenant: String,
    pub key: String,
    pub units: u64,
    pub charged_at_ms: u64,
    pub id: String,
}

#[derive(Default)]
struct Slot {
    lease: Option<Lease>,
    /// A check is asking Redis for a lease: others go to Redis without
    /// asking, so one node does not take several leases at once.
    asking: bool,
}

/// Which of [`SHARDS`] a table key falls in (FNV-1a); shared with
/// `reserve.rs`'s table.
pub(crate) fn shard_of(k: &str) -> usize {
    let h = k.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (h % SHARDS as u64) as usize
}

/// The node's outstanding leases, by (tenant, key).
pub struct Leases {
    shards: Vec<Mutex<HashMap<String, Slot>>>,
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

/// The table key of (tenant, key); shared with `reserve.rs`'s table.
pub(crate) fn slot_key(tenant: &str, key: &str) -> String {
    // `|` cannot appear in a tenant id (validate.rs), so keys never collide.
    let mut s = String::with_capacity(tenant.len() + key.len() + 1);
    s.push_str(tenant);
    s.push('|');
    s.push_str(key);
    s
}

impl Leases {
    fn shard(&self, k: &str) -> &Mutex<HashMap<String, Slot>> {
        &self.shards[shard_of(k)]
    }

    /// Spends `cost` from the (tenant, key) lease if one is live and holds
    /// enough; otherwise says whether this check should ask for one.
    /// `now_ms` is the node's wall clock, for the resets it reports.
    pub fn take(&self, tenant: &str, key: &str, cost: u64, now: Instant, now_ms: u64) -> Take {
        let k = slot_key(tenant, key);
        let mut shard = self.shard(&k).lock().expect("lease shard");
        let slot = shard.entry(k).or_default();
        if let Some(l) = slot.lease.as_mut() {
            if now < l.expires && l.units >= cost {
                l.units -= cost;
                let mut r = l.reply.clone();
                // What the tiers have left from this node's view: what Redis
                // left after the lease, plus what the lease still holds.
                for (t, end) in r.tiers.iter_mut().zip(&l.ends_at_ms) {
                    t.remaining += l.units;
                    t.reset_ms = end.saturating_sub(now_ms).max(1);
                }
                if let Some(g) = r.global_remaining.as_mut() {
                    *g += l.units;
                }
                return Take::Leased(
                    Box::new(r),
                    LeaseRef {
                        charged_at_ms: l.charged_at_ms,
                    },
                );
            }
        }
        if slot.asking {
            Take::Redis { ask: false }
        } else {
            slot.asking = true;
            Take::Redis { ask: true }
        }
    }

    /// After a check that asked: keeps the lease it was granted (if any),
    /// and hands back the unused part of the lease it replaces.
    #[allow(clippy::too_many_arguments)]
    pub fn settle(
        &self,
        tenant: &str,
        key: &str,
        reply: Option<&DecideReply>,
        sent: Instant,
        id: &str,
    ) -> Option<Leftover> {
        let k = slot_key(tenant, key);
        let mut shard = self.shard(&k).lock().expect("lease shard");
        let slot = shard.entry(k).or_default();
        slot.asking = false;
        let r = reply.filter(|r| r.allowed && r.granted > 0)?;
        let first_end = r.tiers.iter().map(|t| t.reset_ms).min().unwrap_or(0);
        let new = Lease {
            units: r.granted,
            expires: script::window_end_lower_bound(sent, first_end),
            ends_at_ms: r
                .tiers
                .iter()
                .map(|t| r.now_ms.max(0) as u64 + t.reset_ms)
                .collect(),
            charged_at_ms: r.now_ms.max(0) as u64,
            id: id.to_string(),
            reply: r.clone(),
        };
        let old = slot.lease.replace(new)?;
        (old.units > 0).then(|| Leftover {
            tenant: tenant.to_string(),
            key: key.to_string(),
            units: old.units,
            charged_at_ms: old.charged_at_ms,
            id: old.id,
        })
    }

    /// Removes expired leases; returns those with units left.
    pub fn expire(&self, now: Instant) -> Vec<Leftover> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock().expect("lease shard");
            shard.retain(|k, slot| {
                let expired = slot.lease.as_ref().is_some_and(|l| now >= l.expires);
                if expired {
                    let l = slot.lease.take().expect("checked");
                    if l.units > 0 {
                        let (tenant, key) = k.split_once('|').expect("slot keys hold a |");
                        out.push(Leftover {
                            tenant: tenant.to_string(),
                            key: key.to_string(),
                            units: l.units,
                            charged_at_ms: l.charged_at_ms,
                            id: l.id,
                        });
                    }
                }
                slot.lease.is_some() || slot.asking
            });
        }
        out
    }

    /// Units held in live leases (a gauge).
    pub fn outstanding(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .expect("lease shard")
                    .values()
                    .filter_map(|s| s.lease.as_ref())
                    .map(|l| l.units)
                    .sum::<u64>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::TierReply;
    use std::time::Duration;

    fn reply(granted: u64, resets: &[u64]) -> DecideReply {
        DecideReply {
            allowed: true,
            denied: None,
            retry_ms: Some(0),
            now_ms: 1_000,
            tiers: resets
                .iter()
                .map(|r| TierReply {
                    remaining: 10,
                    reset_ms: *r,
                })
                .collect(),
            own_p: 0,
            own_n: 0,
            epoch: "e".into(),
            day: 0,
            global_remaining: None,
            raised: 0,
            refunded: 0,
            duplicate: false,
            expired: false,
            granted,
        }
    }

    #[test]
    fn a_lease_is_spent_until_empty_then_redis_is_asked_once() {
        let leases = Leases::default();
        let t0 = Instant::now();
        assert!(matches!(
            leases.take("t", "_", 1, t0, 0),
            Take::Redis { ask: true }
        ));
        // A second check while the first is asking: plain Redis call.
        assert!(matches!(
            leases.take("t", "_", 1, t0, 0),
            Take::Redis { ask: false }
        ));
        assert!(leases
            .settle("t", "_", Some(&reply(3, &[5_000, 60_000])), t0, "a")
            .is_none());
        for left in [2, 1, 0] {
            match leases.take("t", "_", 1, t0, 0) {
                Take::Leased(r, _) => assert_eq!(r.tiers[0].remaining, 10 + left),
                Take::Redis { .. } => panic!("the lease holds {left} more"),
            }
        }
        assert!(matches!(
            leases.take("t", "_", 1, t0, 0),
            Take::Redis { ask: true }
        ));
        assert_eq!(leases.outstanding(), 0);
    }

    #[test]
    fn a_lease_dies_with_its_first_window_and_its_rest_is_handed_back() {
        let leases = Leases::default();
        let t0 = Instant::now();
        let _ = leases.take("t", "k", 1, t0, 0);
        leases.settle("t", "k", Some(&reply(5, &[200, 60_000])), t0, "a");
        assert!(matches!(
            leases.take("t", "k", 1, t0 + Duration::from_millis(100), 0),
            Take::Leased(..)
        ));
        // At the end of the 200 ms window the lease is no good any more,
        // even with units left.
        let late = t0 + Duration::from_millis(200);
        assert!(matches!(
            leases.take("t", "k", 1, late, 0),
            Take::Redis { .. }
        ));
        let back = leases.expire(late);
        assert_eq!(back.len(), 1);
        assert_eq!((back[0].tenant.as_str(), back[0].key.as_str()), ("t", "k"));
        assert_eq!(back[0].units, 4);
        assert_eq!(back[0].charged_at_ms, 1_000);
    }

    #[test]
    fn a_lease_never_lends_more_than_it_holds() {
        let leases = Leases::default();
        let t0 = Instant::now();
        let _ = leases.take("t", "_", 1, t0, 0);
        leases.settle("t", "_", Some(&reply(2, &[5_000])), t0, "a");
        // A cost of 3 does not fit in 2: Redis decides it.
        assert!(matches!(
            leases.take("t", "_", 3, t0, 0),
            Take::Redis { .. }
        ));
        // A replaced lease hands its rest back.
        let back = leases.settle("t", "_", Some(&reply(4, &[5_000])), t0, "b");
        assert_eq!(back.map(|b| (b.units, b.id)), Some((2, "a".to_string())));
    }
}
