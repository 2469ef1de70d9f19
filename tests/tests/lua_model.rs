//! Differential test: the decision script in a real redis-server against the
//! Rust model (`tierlimit_shared::algorithm::TierState`), over random
//! sequences of checks, refunds (free-form, and by handle: a past charge's
//! id and time, given back once, only into the charge's window, and for
//! the sliding log the charge's own units) and peeks for every algorithm.
//!
//! The script reads its clock from Redis `TIME`; here that one call is
//! replaced (in the test only) by two keys the test sets, so both sides see
//! the same microsecond. Any difference in allowed, retry-after, remaining or
//! reset fails the test with the scenario that produced it.

use harness::Redis;
use region_node::storage::script::{DecideCall, Op, RefundOf, Scope, TierCall};
use tierlimit_shared::algorithm::TierState;
use tierlimit_shared::config::{Algorithm, Limit};

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::TokenBucket,
    Algorithm::SlidingLog,
];

/// xorshift64: a seeded, reproducible sequence (the seed is printed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

#[tokio::test]
async fn script_matches_the_model() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    // Loaded once: FLUSHDB between scenarios keeps the script cache.
    let sha = harness::lua::load_with_fake_clock(&mut con).await;

    let seed: u64 = std::env::var("LUA_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9E37_79B9_7F4A_7C15);
    let scenarios: u64 = std::env::var("LUA_MODEL_SCENARIOS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    println!("seed {seed}, {scenarios} scenarios (LUA_MODEL_SEED / LUA_MODEL_SCENARIOS)");
    let mut rng = Rng(seed);
    let mut ops = 0u64;
    let mut by_handle_refunds = 0u64;
    let mut mismatches = Vec::new();

    for sc in 0..scenarios {
        redis::cmd("FLUSHDB")
            .query_async::<()>(&mut con)
            .await
            .unwrap();
        let algorithm = ALGORITHMS[rng.below(4) as usize];
        let window_ms = match rng.below(4) {
            0 => rng.range(1, 50),
            1 => rng.range(50, 3000),
            2 => [1000, 7000, 60_000, 5_400_000][rng.below(4) as usize],
            _ => rng.range(1, 100_000),
        };
        let limit = match rng.below(3) {
            0 => rng.range(1, 5),
            1 => rng.range(1, 50),
            _ => rng.range(1, 1000),
        };
        let (limit, burst) = if algorithm == Algorithm::TokenBucket {
            let limit = limit.min(window_ms * 1000);
            (limit, rng.range(1, limit * 2 + 3))
        } else {
            (limit, limit)
        };
        let l = Limit {
            limit,
            window_ms,
            algorithm,
            burst,
        };
        // The tier's state in the tenant hash or in a key of its own (a
        // descriptor's key): the script writes the two differently.
        let key = if rng.below(2) == 0 { "_" } else { "GET/x" };
        let mut model = TierState::new(&l);
        let mut now_us: u64 = 1_700_000_000_000_000 + rng.below(1_000_000_000_000);
        // Allowed charges of this scenario: (id, Redis ms, cost, refunded).
        let mut charges: Vec<(String, u64, u64, bool)> = Vec::new();
        for _ in 0..rng.range(1, 80) {
            ops += 1;
            let scale = match rng.below(4) {
                0 => 1,
                1 => 1000,
                2 => window_ms * 1000 / 10 + 1,
                _ => window_ms * 1000,
            };
            now_us += 1 + rng.below(scale * 2);
            let op = match rng.below(10) {
                0..=6 => Op::Check,
                7..=8 => Op::Refund,
                _ => Op::Peek,
            };
            let mut cost = match (op, rng.below(3)) {
                (Op::Peek, _) => 0,
                (_, 0) => 1,
                (_, 1) => rng.range(1, limit.max(burst) + 1),
                _ => rng.range(1, 4),
            };
            // Half the refunds name a past charge (maybe one refunded
            // already): exactly its cost, as a handle carries it.
            // (The model keeps a log's units per millisecond, not per
            // charge: a charge sharing its millisecond with another is not
            // named, since a free-form refund may have taken some of its
            // units and the model could not tell whose are left.)
            let handle = if op == Op::Refund && !charges.is_empty() && rng.below(2) == 0 {
                let i = rng.below(charges.len() as u64) as usize;
                let shared = charges.iter().filter(|c| c.1 == charges[i].1).count() > 1;
                (!shared).then(|| {
                    cost = charges[i].2;
                    i
                })
            } else {
                None
            };
            redis::pipe()
                .cmd("SET")
                .arg("fake:s")
                .arg(now_us / 1_000_000)
                .ignore()
                .cmd("SET")
                .arg("fake:us")
                .arg(now_us % 1_000_000)
                .ignore()
                .query_async::<()>(&mut con)
                .await
                .unwrap();
            let day = now_us / 1000 / 86_400_000;
            let epoch_candidate = format!("ep{ops}");
            let call = DecideCall {
                op,
                tenant: "t",
                node_id: "n1",
                cost,
                // One node tier; no global tier, no broadcast, no cap.
                tiers: vec![TierCall {
                    scope: Scope::Node,
                    rule: "_",
                    key,
                    limit: &l,
                    cost,
                }],
                expected_nodes: 1,
                global: None,
                epoch_candidate: &epoch_candidate,
                day: day as u32,
                now_ms: now_us / 1000,
                counter_ttl_secs: 100_000,
                relaxed_ms: 2000,
                refund: handle.map(|i| RefundOf {
                    id: charges[i].0.clone(),
                    charged_at_ms: charges[i].1,
                    // Never expires here: the model has no handle expiry
                    // (lua_script.rs tests it).
                    expires_at_ms: 0,
                }),
                lease: None,
            };
            let reply = harness::lua::decide_by(&mut con, &sha, &call).await;
            if let Some(i) = handle {
                by_handle_refunds += 1;
                if reply.duplicate != charges[i].3 && mismatches.len() < 10 {
                    mismatches.push(format!(
                        "scenario {sc} {l:?}: handle {} refunded before: {}, script says duplicate: {}",
                        charges[i].0, charges[i].3, reply.duplicate
                    ));
                }
            }
            let ev = model.evaluate(&l, now_us, cost);
            let node = *reply.tiers.first().expect("the reply has no node tier");
            let (allowed, retry, remaining, reset) =
                (reply.allowed, reply.retry_ms, node.remaining, node.reset_ms);
            let mut bad = Vec::new();
            if op == Op::Check {
                if allowed != ev.allowed {
                    bad.push("allowed");
                }
                if retry != ev.retry_ms {
                    bad.push("retry");
                }
            }
            let model_remaining = if op == Op::Check {
                ev.remaining
            } else {
                model.evaluate(&l, now_us, 0).remaining
            };
            if remaining != model_remaining {
                bad.push("remaining");
            }
            if reset != ev.reset_ms {
                bad.push("reset");
            }
            if !bad.is_empty() && mismatches.len() < 10 {
                let op = op.name();
                mismatches.push(format!(
                    "scenario {sc} {l:?} key {key} {op} cost {cost} at {now_us}: {bad:?}; script allowed={allowed} retry={retry:?} remaining={remaining} reset={reset}; model {ev:?}"
                ));
            }
            match (op, handle) {
                (Op::Check, _) if ev.allowed => {
                    model.commit(&l, now_us, cost);
                    charges.push((epoch_candidate.clone(), now_us / 1000, cost, false));
                }
                (Op::Refund, Some(i)) if !charges[i].3 => {
                    model.refund_charge(&l, now_us, cost, charges[i].1);
                    charges[i].3 = true;
                }
                (Op::Refund, None) => model.refund(&l, now_us, cost),
                _ => {}
            }
        }
    }
    println!("{ops} operations compared, {by_handle_refunds} of them refunds by handle");
    assert!(
        mismatches.is_empty(),
        "script and model disagree:\n{}",
        mismatches.join("\n")
    );
}
