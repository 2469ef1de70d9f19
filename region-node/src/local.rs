//! The `local` fail mode: node-local, in-memory limits while the region's
//! Redis is unreachable.
//!
//! The node tier is enforced as configured; the region tier becomes this
//! node's share of it (`limit / expected_nodes`), so a region of N nodes in
//! local mode together stay near the region limit without talking. Units
//! allowed here are counted per (tenant, period) (the day, and each other
//! period the tenant has a global tier of) under a node-local actor
//! (`"{region}/local-{node}-{random}"`) and published like any other
//! actor's, so the global count stays exact: nothing allowed goes uncounted,
//! and because the actor is new, nothing is counted twice.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::storage::{
    BoxFuture, CounterStore, DecideCall, DecideReply, Denied, Op, Scope, StoreError, TierCall,
    TierReply,
};

use tierlimit_shared::algorithm::{Evaluation, TierState};
use tierlimit_shared::config::Limit;
use tierlimit_shared::period::Period;

/// (tenant, tier id, key) → the limit a state was last used with, and the
/// state.
type TierStates = HashMap<(String, String, String), (Limit, TierState)>;

/// The limit local mode enforces for a tier: a node tier as configured, and
/// this node's share of a region tier.
fn local_limit(tier: &TierCall<'_>, expected_nodes: u32) -> Limit {
    match tier.scope {
        Scope::Node => tier.limit.clone(),
        Scope::Region => tier.limit.share(expected_nodes),
    }
}

/// Per-process limiter used when Redis is down.
pub struct Local {
    tiers: Mutex<TierStates>,
    counts: Mutex<HashMap<(String, Period), (u64, u64)>>,
    /// Actor id of this process' local-mode counts.
    pub actor: String,
}

/// What local mode decided for one tier.
pub struct LocalTier {
    pub limit: Limit,
    pub eval: Evaluation,
}

impl Local {
    pub fn new(region: &str, node_id: &str) -> Local {
        let suffix: u32 = rand::random();
        Local {
            tiers: Mutex::new(HashMap::new()),
            counts: Mutex::new(HashMap::new()),
            actor: tierlimit_shared::messages::actor(
                region,
                &format!("local-{node_id}-{suffix:08x}"),
            ),
        }
    }

    /// Evaluates every tier (region tiers at this node's share) and charges
    /// all of them only if all pass. Returns whether it did, and each tier's
    /// evaluation in call order.
    fn check(&self, call: &DecideCall<'_>) -> (bool, Vec<LocalTier>) {
        let now_us = call.now_ms * 1000;
        let mut tiers = self.tiers.lock().expect("local limiter poisoned");
        let ids: Vec<(String, String, String)> = call
            .tiers
            .iter()
            .map(|t| {
                (
                    call.tenant.to_string(),
                    t.tier_id(call.node_id),
                    t.key.to_string(),
                )
            })
            .collect();
        let mut out = Vec::with_capacity(call.tiers.len());
        for (t, id) in call.tiers.iter().zip(&ids) {
            let limit = local_limit(t, call.expected_nodes);
            let (last, state) = tiers
                .entry(id.clone())
                .or_insert_with(|| (limit.clone(), TierState::new(&limit)));
            *last = limit.clone();
            let eval = state.evaluate(&limit, now_us, t.cost);
            out.push(LocalTier { limit, eval });
        }
        let allowed = out.iter().all(|t| t.eval.allowed);
        if allowed {
            for ((t, id), lt) in call.tiers.iter().zip(&ids).zip(&out) {
                if let Some((_, s)) = tiers.get_mut(id) {
                    s.commit(&lt.limit, now_us, t.cost);
                }
            }
            let mut counts = self.counts.lock().expect("local counts poisoned");
            for period in call_periods(call) {
                counts
                    .entry((call.tenant.to_string(), period))
                    .or_default()
                    .0 += call.cost;
            }
        }
        (allowed, out)
    }

    /// Gives back units charged in local mode (never below zero); returns
    /// the units given back to the day's count, which is all a refund
    /// reaches here: what was charged in Redis is out of its reach.
    fn refund(&self, call: &DecideCall<'_>) -> u64 {
        let now_us = call.now_ms * 1000;
        let mut tiers = self.tiers.lock().expect("local limiter poisoned");
        for t in &call.tiers {
            let id = (
                call.tenant.to_string(),
                t.tier_id(call.node_id),
                t.key.to_string(),
            );
            if let Some((_, s)) = tiers.get_mut(&id) {
                s.refund(&local_limit(t, call.expected_nodes), now_us, t.cost);
            }
        }
        let mut counts = self.counts.lock().expect("local counts poisoned");
        let mut day_back = 0;
        for period in call_periods(call) {
            if let Some(c) = counts.get_mut(&(call.tenant.to_string(), period)) {
                let back = call.cost.min(c.0 - c.1);
                c.1 += back;
                if period == Period::day(call.day) {
                    day_back = back;
                }
            }
        }
        day_back
    }

    /// Snapshot of the cumulative local-mode counts, for the publisher.
    pub fn counts(&self) -> Vec<(String, Period, u64, u64)> {
        self.counts
            .lock()
            .expect("local counts poisoned")
            .iter()
            .map(|((t, d), (p, n))| (t.clone(), *d, *p, *n))
            .collect()
    }

    /// Drops limiter state that no longer affects any decision, and counts
    /// of days before `oldest_day` (long published by then).
    pub fn prune(&self, oldest_day: u32, now_us: u64) {
        self.tiers
            .lock()
            .expect("local limiter poisoned")
            .retain(|_, (limit, state)| !state.is_idle(limit, now_us));
        self.counts
            .lock()
            .expect("local counts poisoned")
            .retain(|(_, p), _| p.end_ms() > i64::from(oldest_day) * 86_400_000);
    }
}

/// The periods a call counts in: its day and each other period's tier.
fn call_periods<'a>(call: &'a DecideCall<'_>) -> impl Iterator<Item = Period> + 'a {
    std::iter::once(Period::day(call.day)).chain(call.periods.iter().map(|x| x.period))
}

impl Local {
    /// One call of the decision script's interface, answered in process:
    /// the node tier as configured and this node's share of the region
    /// tier; the global tier is only reported (the view's fast path enforces
    /// it before the call). Remaining units follow the script's rule: after
    /// this request if it was charged, before it if not.
    pub fn decide_now(&self, call: &DecideCall<'_>) -> DecideReply {
        let global_remaining = call
            .global
            .as_ref()
            .filter(|g| g.limit > 0)
            .map(|g| g.limit.saturating_sub(g.broadcast_total));
        let base = DecideReply {
            allowed: true,
            denied: None,
            retry_ms: Some(0),
            now_ms: call.now_ms as i64,
            tiers: Vec::new(),
            own_p: 0,
            own_n: 0,
            epoch: self.actor.clone(),
            day: call.day,
            global_remaining,
            periods_remaining: call
                .periods
                .iter()
                .map(|x| x.limit.saturating_sub(x.broadcast_total))
                .collect(),
            periods_end_ms: crate::storage::script::periods_end_ms(call),
            raised: 0,
            refunded: 0,
            duplicate: false,
            expired: false,
            granted: 0,
            round_trip: std::time::Duration::ZERO,
        };
        match call.op {
            Op::Refund => DecideReply {
                refunded: self.refund(call),
                ..base
            },
            // In local mode nothing is read without charging: a peek shows
            // no windowed tier (as before this interface).
            Op::Peek => base,
            Op::Check => {
                let (allowed, evals) = self.check(call);
                let mut denied = None;
                let mut retry: Option<u64> = Some(0);
                let mut tiers = Vec::with_capacity(evals.len());
                for (i, (LocalTier { eval, .. }, t)) in
                    evals.into_iter().zip(&call.tiers).enumerate()
                {
                    if !eval.allowed {
                        denied.get_or_insert(Denied::Tier(i));
                        retry = match (retry, eval.retry_ms) {
                            (Some(a), Some(b)) => Some(a.max(b)),
                            _ => None,
                        };
                    }
                    // A tier that passed reports units after this request;
                    // nothing was charged if another tier denied.
                    let remaining = if eval.allowed && !allowed {
                        eval.remaining + t.cost
                    } else {
                        eval.remaining
                    };
                    tiers.push(TierReply {
                        remaining,
                        reset_ms: eval.reset_ms,
                    });
                }
                DecideReply {
                    allowed,
                    denied,
                    retry_ms: if allowed { Some(0) } else { retry },
                    tiers,
                    ..base
                }
            }
        }
    }
}

impl CounterStore for Local {
    fn kind(&self) -> &'static str {
        "local"
    }

    fn decide<'a>(
        &'a self,
        call: &'a DecideCall<'a>,
    ) -> BoxFuture<'a, Result<DecideReply, StoreError>> {
        Box::pin(std::future::ready(Ok(self.decide_now(call))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::script::Op;

    fn call(op: Op, cost: u64) -> DecideCall<'static> {
        DecideCall {
            op,
            tenant: "t",
            node_id: "a",
            cost,
            tiers: Vec::new(),
            expected_nodes: 1,
            global: None,
            periods: Vec::new(),
            epoch_candidate: "e",
            day: 7,
            now_ms: 7 * 86_400_000 + 1,
            counter_ttl_secs: 86_400,
            relaxed_ms: 2000,
            refund: None,
            lease: None,
        }
    }

    #[test]
    fn a_refund_gives_back_only_what_local_mode_charged_and_says_so() {
        let local = Local::new("eu", "a");
        // Nothing charged in local mode: nothing to give back.
        assert_eq!(local.decide_now(&call(Op::Refund, 2)).refunded, 0);
        for _ in 0..3 {
            assert!(local.decide_now(&call(Op::Check, 1)).allowed);
        }
        assert_eq!(local.decide_now(&call(Op::Refund, 2)).refunded, 2);
        // Never below zero: one unit was left.
        assert_eq!(local.decide_now(&call(Op::Refund, 2)).refunded, 1);
        assert_eq!(
            local.counts(),
            vec![("t".to_string(), Period::day(7), 3, 3)]
        );
    }
}
