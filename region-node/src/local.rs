//! The `local` fail mode: node-local, in-memory limits while the region's
//! Redis is unreachable.
//!
//! The node tier is enforced as configured; the region tier becomes this
//! node's share of it (`limit / expected_nodes`), so a region of N nodes in
//! local mode together stay near the region limit without talking. Units
//! allowed here are counted per (tenant, day) under a node-local actor
//! (`"{region}/local-{node}-{random}"`) and published like any other
//! actor's, so the global count stays exact: nothing allowed goes uncounted,
//! and because the actor is new, nothing is counted twice.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::storage::{
    BoxFuture, CounterStore, DecideCall, DecideReply, Denied, Op, StoreError, TierReply,
};

use tierlimit_shared::algorithm::{Evaluation, TierState};
use tierlimit_shared::config::Limit;

/// (tenant, key, tier) → the limit a state was last used with, and the state.
type TierStates = HashMap<(String, String, u8), (Limit, TierState)>;

/// The limits local mode enforces: the node tier as configured, and this
/// node's share of the region tier.
fn local_limits(
    node: Option<&Limit>,
    region: Option<&Limit>,
    expected_nodes: u32,
) -> [Option<Limit>; 2] {
    [node.cloned(), region.map(|r| r.share(expected_nodes))]
}

/// Per-process limiter used when Redis is down.
pub struct Local {
    tiers: Mutex<TierStates>,
    counts: Mutex<HashMap<(String, u32), (u64, u64)>>,
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

    /// Evaluates node and region-share tiers and charges both only if both
    /// pass. Returns `(allowed, node, region)`.
    fn check(&self, call: &DecideCall<'_>) -> (bool, Option<LocalTier>, Option<LocalTier>) {
        let (tenant, key, cost, now_us) = (call.tenant, call.key, call.cost, call.now_ms * 1000);
        let limits = local_limits(call.node, call.region, call.expected_nodes);
        let mut tiers = self.tiers.lock().expect("local limiter poisoned");
        let mut out: [Option<LocalTier>; 2] = [None, None];
        for (i, limit) in limits.iter().enumerate() {
            if let Some(limit) = limit {
                let (last, state) = tiers
                    .entry((tenant.to_string(), key.to_string(), i as u8))
                    .or_insert_with(|| (limit.clone(), TierState::new(limit)));
                *last = limit.clone();
                out[i] = Some(LocalTier {
                    limit: limit.clone(),
                    eval: state.evaluate(limit, now_us, cost),
                });
            }
        }
        let allowed = out.iter().flatten().all(|t| t.eval.allowed);
        if allowed {
            for (i, limit) in limits.iter().enumerate() {
                if let Some(limit) = limit {
                    if let Some((_, s)) =
                        tiers.get_mut(&(tenant.to_string(), key.to_string(), i as u8))
                    {
                        s.commit(limit, now_us, cost);
                    }
                }
            }
            let mut counts = self.counts.lock().expect("local counts poisoned");
            counts.entry((tenant.to_string(), call.day)).or_default().0 += cost;
        }
        let [node, region] = out;
        (allowed, node, region)
    }

    /// Gives back units charged in local mode (never below zero).
    fn refund(&self, call: &DecideCall<'_>) {
        let (tenant, key, cost, now_us) = (call.tenant, call.key, call.cost, call.now_ms * 1000);
        let limits = local_limits(call.node, call.region, call.expected_nodes);
        let mut tiers = self.tiers.lock().expect("local limiter poisoned");
        for (i, limit) in limits.iter().enumerate() {
            if let (Some(limit), Some((_, s))) = (
                limit,
                tiers.get_mut(&(tenant.to_string(), key.to_string(), i as u8)),
            ) {
                s.refund(limit, now_us, cost);
            }
        }
        let mut counts = self.counts.lock().expect("local counts poisoned");
        if let Some(c) = counts.get_mut(&(tenant.to_string(), call.day)) {
            c.1 = (c.1 + cost).min(c.0);
        }
    }

    /// Snapshot of the cumulative local-mode counts, for the publisher.
    pub fn counts(&self) -> Vec<(String, u32, u64, u64)> {
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
            .retain(|(_, d), _| *d >= oldest_day);
    }
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
            .map(|g| g.limit.saturating_sub(g.broadcast_total));
        let base = DecideReply {
            allowed: true,
            denied: None,
            retry_ms: Some(0),
            now_ms: call.now_ms as i64,
            node: None,
            region: None,
            own_p: 0,
            own_n: 0,
            epoch: self.actor.clone(),
            day: call.day,
            global_remaining,
        };
        match call.op {
            Op::Refund => {
                self.refund(call);
                base
            }
            // In local mode nothing is read without charging: a peek shows
            // no windowed tier (as before this interface).
            Op::Peek => base,
            Op::Check => {
                let (allowed, node, region) = self.check(call);
                let mut denied = None;
                let mut retry: Option<u64> = Some(0);
                let mut tier = |t: Denied, lt: Option<LocalTier>| {
                    let LocalTier { eval, .. } = lt?;
                    if !eval.allowed {
                        denied.get_or_insert(t);
                        retry = match (retry, eval.retry_ms) {
                            (Some(a), Some(b)) => Some(a.max(b)),
                            _ => None,
                        };
                    }
                    // A tier that passed reports units after this request;
                    // nothing was charged if another tier denied.
                    let remaining = if eval.allowed && !allowed {
                        eval.remaining + call.cost
                    } else {
                        eval.remaining
                    };
                    Some(TierReply {
                        remaining,
                        reset_ms: eval.reset_ms,
                    })
                };
                let node = tier(Denied::Node, node);
                let region = tier(Denied::Region, region);
                DecideReply {
                    allowed,
                    denied,
                    retry_ms: if allowed { Some(0) } else { retry },
                    node,
                    region,
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
