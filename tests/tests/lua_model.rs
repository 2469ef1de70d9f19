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
use region_node::storage::script::{
    DecideCall, Denied, GlobalArgs, Op, RefundOf, ReplyError, Scope, TierCall,
};
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

/// What every family starts from: a redis-server (kept alive by the
/// caller), a connection to it with the script loaded on a fake clock
/// (once: FLUSHDB between scenarios keeps the script cache), its SHA, the
/// number of scenarios (`LUA_MODEL_SCENARIOS`, else the family's default)
/// and the family's own stream of the seed (`LUA_MODEL_SEED`), both
/// printed so a failure can be replayed.
type Family = (Redis, redis::aio::MultiplexedConnection, String, u64, Rng);

async fn family(default_scenarios: u64, stream: u64) -> Family {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let sha = harness::lua::load_with_fake_clock(&mut con).await;
    let seed = env_u64("LUA_MODEL_SEED", 0x9E37_79B9_7F4A_7C15);
    let scenarios = env_u64("LUA_MODEL_SCENARIOS", default_scenarios);
    println!("seed {seed}, {scenarios} scenarios (LUA_MODEL_SEED / LUA_MODEL_SCENARIOS)");
    (redis, con, sha, scenarios, Rng(seed ^ stream))
}

#[tokio::test]
async fn script_matches_the_model() {
    let (_redis, mut con, sha, scenarios, mut rng) = family(400, 0).await;
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
            harness::lua::set_fake_clock_us(&mut con, now_us).await;
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
                periods: Vec::new(),
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

const DAY_MS: u64 = 86_400_000;

/// A number from the environment, or `default`.
fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A node's clock offset from Redis', ms: none, small drift, minutes, an
/// hour, or most of a day (either side; always under a day, as the script
/// refuses a node more than a day off).
fn clock_offset(rng: &mut Rng) -> i64 {
    let magnitude = match rng.below(5) {
        0 => 0,
        1 => rng.range(1, 1000),
        2 => rng.range(1000, 120_000),
        3 => rng.range(120_000, 3_600_000),
        _ => rng.range(1, DAY_MS - 1),
    } as i64;
    if rng.below(2) == 0 {
        magnitude
    } else {
        -magnitude
    }
}

/// The region's PN counter per Redis day, as the script should keep it:
/// P and N of each day, and the epoch that names the day's actor once the
/// day has a counter.
#[derive(Default)]
struct DayCounts {
    p: std::collections::HashMap<u32, u64>,
    n: std::collections::HashMap<u32, u64>,
    epoch: std::collections::HashMap<u32, String>,
}

impl DayCounts {
    fn own(&self, day: u32) -> u64 {
        self.p.get(&day).copied().unwrap_or(0) - self.n.get(&day).copied().unwrap_or(0)
    }
}

/// The script against the model across UTC midnights of Redis' clock,
/// with nodes whose clocks are off Redis' (so the day a node builds its
/// call for is one behind or ahead of Redis' around midnight), a region
/// tier of any algorithm and window (windows that straddle midnight, up to
/// a week) and a global tier fed by a broadcast that other regions' spend
/// and this region's published part make up.
///
/// The model: Redis' clock decides the day. A check built for another day
/// is refused (−3) and changes nothing; the node then sends it again with
/// Redis' day and that day's broadcast, and is decided on it: a tenant over
/// its global limit on day D stays over until Redis' midnight, whatever the
/// node's day. The global count of day D+1 starts from zero (plus what D+1
/// charged), while the windowed tier goes on by its windows. A refund or a
/// peek built for another day goes ahead on Redis' day; a refund by handle
/// of a charge of day D made on D+1 gives the windows what the charge was
/// in, and nothing to the global count of D+1.
#[tokio::test]
async fn script_matches_the_model_across_days() {
    // Fewer than the family above by default (each operation may be two
    // calls, and the suite's time is shared): a few seconds. Another
    // stream than `script_matches_the_model`'s from the same seed.
    let (_redis, mut con, sha, scenarios, mut rng) = family(150, 0xD1B5_4A32_D192_ED03).await;
    let (mut ops, mut midnights, mut other_day_checks, mut other_day_rest) =
        (0u64, 0u64, 0u64, 0u64);
    let (mut global_denials, mut cross_day_handles) = (0u64, 0u64);
    // Checks from a node already past midnight, denied by the global tier
    // on Redis' day (still over it): the case a fast clock used to open.
    let mut ahead_still_over = 0u64;
    let mut mismatches = Vec::new();

    for sc in 0..scenarios {
        redis::cmd("FLUSHDB")
            .query_async::<()>(&mut con)
            .await
            .unwrap();
        let algorithm = ALGORITHMS[rng.below(4) as usize];
        let window_ms = match rng.below(4) {
            0 => rng.range(1, 3000),
            1 => [1000, 7000, 60_000, 5_400_000, 7 * DAY_MS][rng.below(5) as usize],
            2 => rng.range(60_000, 2 * DAY_MS),
            _ => rng.range(1, 100_000),
        };
        let limit = match rng.below(3) {
            0 => rng.range(1, 5),
            1 => rng.range(1, 50),
            _ => rng.range(1, 300),
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
        let key = if rng.below(2) == 0 { "_" } else { "GET/x" };
        let glimit = match rng.below(3) {
            0 => rng.range(1, 5),
            1 => rng.range(1, 30),
            _ => rng.range(1, 300),
        };
        // Two nodes of the region, each with its clock offset; they share
        // the region tier and the region's PN counter.
        let offsets = [clock_offset(&mut rng), clock_offset(&mut rng)];
        let near = offsets.iter().map(|o| o.unsigned_abs()).max().unwrap() + 2000;
        let mut model = TierState::new(&l);
        let mut counts = DayCounts::default();
        // Other regions' spend per day, as the aggregator's broadcast
        // carries it, and this region's part in it (epoch, P, N) as last
        // published.
        let mut others: std::collections::HashMap<u32, u64> = Default::default();
        let mut published: std::collections::HashMap<u32, (String, u64, u64)> = Default::default();
        let first_midnight = (19_000 + rng.below(2000)) * DAY_MS;
        let mut now_us = (first_midnight - rng.range(1, 2 * near)) * 1000 + rng.below(1000);
        let mut charges: Vec<(String, u64, u64, bool)> = Vec::new();
        for _ in 0..rng.range(1, 80) {
            ops += 1;
            let before = now_us / 1000 / DAY_MS;
            now_us += match rng.below(6) {
                0 => 1 + rng.below(2000),
                1 => 1 + rng.below(2_000_000),
                2 => 1 + rng.below(window_ms * 1000 / 5 + 1),
                3 => 1 + rng.below((window_ms * 2000).min(DAY_MS * 1000)),
                4 => 1 + rng.below(near * 2000),
                _ => {
                    // Towards the next midnight, within the nodes' offsets.
                    let next = (now_us / 1000 / DAY_MS + 1) * DAY_MS;
                    let to = (next - rng.range(0, 2 * near)) * 1000;
                    to.saturating_sub(now_us).max(1)
                }
            };
            let now_ms = now_us / 1000;
            let rday = (now_ms / DAY_MS) as u32;
            midnights += now_ms / DAY_MS - before;
            let node = rng.below(2) as usize;
            let node_id = ["n1", "n2"][node];
            let nday = ((now_ms as i64 + offsets[node]) as u64 / DAY_MS) as u32;
            // Other regions spend, and this region publishes, now and then.
            let seen = others.entry(rday).or_insert(0);
            if rng.below(5) == 0 {
                *seen += rng.below(glimit / 3 + 2);
            }
            if rng.below(4) == 0 {
                if let Some(e) = counts.epoch.get(&rday) {
                    let p = counts.p.get(&rday).copied().unwrap_or(0);
                    let n = counts.n.get(&rday).copied().unwrap_or(0);
                    published.insert(rday, (e.clone(), p, n));
                }
            }
            let op = match rng.below(10) {
                0..=6 => Op::Check,
                7..=8 => Op::Refund,
                _ => Op::Peek,
            };
            let mut cost = match (op, rng.below(3)) {
                (Op::Peek, _) => 0,
                (_, 0) => 1,
                (_, 1) => rng.range(1, limit.max(burst).max(glimit) + 1),
                _ => rng.range(1, 4),
            };
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
            harness::lua::set_fake_clock_us(&mut con, now_us).await;
            // The global tier's inputs as a node sees them for `day`: the
            // broadcast total (others' spend and our published part) and
            // our part in it.
            let global_for = |day: u32| {
                let part = published.get(&day).cloned();
                let ours = part.as_ref().map_or(0, |(_, p, n)| p - n);
                GlobalArgs {
                    limit: glimit,
                    broadcast_total: others.get(&day).copied().unwrap_or(0) + ours,
                    own_cap: None,
                    own_parts: part.into_iter().collect(),
                    urgent_at: None,
                }
            };
            let epoch_candidate = format!("ep{ops}");
            let mut call = DecideCall {
                op,
                tenant: "t",
                node_id,
                cost,
                tiers: vec![TierCall {
                    scope: Scope::Region,
                    rule: "_",
                    key,
                    limit: &l,
                    cost,
                }],
                expected_nodes: 2,
                global: Some(global_for(nday)),
                periods: Vec::new(),
                epoch_candidate: &epoch_candidate,
                day: nday,
                now_ms,
                counter_ttl_secs: 100_000,
                relaxed_ms: 2000,
                refund: handle.map(|i| RefundOf {
                    id: charges[i].0.clone(),
                    charged_at_ms: charges[i].1,
                    expires_at_ms: 0,
                }),
                lease: None,
            };
            let what = format!(
                "scenario {sc} {l:?} key {key} global {glimit} offsets {offsets:?} {} cost {cost} at {now_us} (Redis day {rday}, node {node_id} day {nday})",
                op.name()
            );
            let mut reply = harness::lua::try_decide_by(&mut con, &sha, &call).await;
            if nday != rday {
                if op == Op::Check {
                    other_day_checks += 1;
                    // Refused, nothing done: the node sends it again for
                    // Redis' day with that day's broadcast (the model's
                    // state is untouched, so what follows checks that the
                    // refusal wrote nothing).
                    match reply {
                        Err(ReplyError::OtherDay { now_ms: at, .. }) if at as u64 == now_ms => {}
                        other => {
                            mismatches.push(format!(
                                "{what}: a check for another day must be refused (-3), script answered {other:?}"
                            ));
                            continue;
                        }
                    }
                    call.day = rday;
                    call.global = Some(global_for(rday));
                    reply = harness::lua::try_decide_by(&mut con, &sha, &call).await;
                } else {
                    other_day_rest += 1;
                }
            }
            let reply = match reply {
                Ok(r) => r,
                Err(e) => {
                    mismatches.push(format!("{what}: script answered {e}"));
                    continue;
                }
            };

            // The model's decision, on Redis' day.
            let ev = model.evaluate(&l, now_us, cost);
            let now_left = model.evaluate(&l, now_us, 0).remaining;
            let others_spent = others.get(&rday).copied().unwrap_or(0);
            let global_left = glimit.saturating_sub(others_spent + counts.own(rday));
            let global_ok = cost <= global_left;
            let to_midnight = DAY_MS - now_ms % DAY_MS;
            let mut bad = Vec::new();
            let mut expect_refunded = 0;
            let mut expect_duplicate = false;
            let allowed = op == Op::Check && ev.allowed && global_ok;
            if op == Op::Check {
                let (denied, retry) = if allowed {
                    (None, Some(0))
                } else if !ev.allowed {
                    let retry = match ev.retry_ms {
                        Some(r) if !global_ok => Some(r.max(to_midnight)),
                        r => r,
                    };
                    (Some(Denied::Tier(0)), retry)
                } else {
                    global_denials += 1;
                    if nday > rday {
                        ahead_still_over += 1;
                    }
                    (Some(Denied::Global), Some(to_midnight))
                };
                if reply.denied != denied {
                    bad.push(format!("denied {:?}, model {denied:?}", reply.denied));
                }
                if reply.retry_ms != retry {
                    bad.push(format!("retry {:?}, model {retry:?}", reply.retry_ms));
                }
            }
            let tier = *reply.tiers.first().expect("the reply has no tier");
            let remaining = if allowed { ev.remaining } else { now_left };
            if tier.remaining != remaining {
                bad.push(format!("remaining {}, model {remaining}", tier.remaining));
            }
            if tier.reset_ms != ev.reset_ms {
                bad.push(format!("reset {}, model {}", tier.reset_ms, ev.reset_ms));
            }
            match (op, handle) {
                (Op::Check, _) if allowed => {
                    model.commit(&l, now_us, cost);
                    *counts.p.entry(rday).or_insert(0) += cost;
                    counts
                        .epoch
                        .entry(rday)
                        .or_insert_with(|| reply.epoch.clone());
                    charges.push((epoch_candidate.clone(), now_ms, cost, false));
                }
                (Op::Refund, Some(i)) if charges[i].3 => expect_duplicate = true,
                (Op::Refund, Some(i)) => {
                    model.refund_charge(&l, now_us, cost, charges[i].1);
                    charges[i].3 = true;
                    // The global count gets back only a charge of its day.
                    if charges[i].1 / DAY_MS == u64::from(rday) {
                        expect_refunded = cost.min(counts.own(rday));
                    } else {
                        cross_day_handles += 1;
                    }
                }
                (Op::Refund, None) => {
                    model.refund(&l, now_us, cost);
                    expect_refunded = cost.min(counts.own(rday));
                }
                _ => {}
            }
            *counts.n.entry(rday).or_insert(0) += expect_refunded;
            let (p, n) = (
                counts.p.get(&rday).copied().unwrap_or(0),
                counts.n.get(&rday).copied().unwrap_or(0),
            );
            if reply.day != rday {
                bad.push(format!("day {}, Redis' {rday}", reply.day));
            }
            if (reply.own_p, reply.own_n) != (p, n) {
                bad.push(format!(
                    "day's counter P {} N {}, model P {p} N {n}",
                    reply.own_p, reply.own_n
                ));
            }
            if reply.raised != 0 {
                bad.push(format!("raised {}", reply.raised));
            }
            if reply.refunded != expect_refunded {
                bad.push(format!(
                    "refunded {}, model {expect_refunded}",
                    reply.refunded
                ));
            }
            if reply.duplicate != expect_duplicate {
                bad.push(format!(
                    "duplicate {}, model {expect_duplicate}",
                    reply.duplicate
                ));
            }
            if !bad.is_empty() && mismatches.len() < 10 {
                mismatches.push(format!("{what}: {}", bad.join("; ")));
            }
            if mismatches.len() >= 10 {
                break;
            }
        }
        if mismatches.len() >= 10 {
            break;
        }
    }
    println!(
        "{ops} operations compared: {midnights} Redis midnights, {other_day_checks} checks for another day refused and sent again, {other_day_rest} refunds and peeks for another day, {global_denials} global denials ({ahead_still_over} of a node already past midnight), {cross_day_handles} refunds by handle of another day's charge"
    );
    assert!(
        mismatches.is_empty(),
        "script and model disagree across days:\n{}",
        mismatches.join("\n")
    );
}

/// Issue 33: several global tiers (an hour, the day, an ISO week and a
/// calendar month) against a model of one PN counter per period, over
/// random checks, free-form refunds, refunds by handle and peeks at random
/// instants that cross hours, midnights, Mondays and month ends (leap
/// February 2028 and December → January among them). A check is allowed
/// iff it fits every tier (the model's arithmetic on `Period`s, the
/// script's on the bounds the node sends); a refund by handle gives back
/// only to the periods the charge was in that are still open. Any
/// difference in outcome, which tier denied, retry or remaining fails.
#[tokio::test]
async fn script_matches_the_model_with_several_global_tiers() {
    use std::collections::HashMap;
    use tierlimit_shared::period::{days_from_civil, Period, PeriodKind};
    let (_redis, mut con, sha, scenarios, mut rng) = family(150, 0x5851_F42D_4C95_7F2D).await;
    // Instants just before an hour, a day, a week and a month end.
    let starts: Vec<u64> = [
        (2028, 2, 28),
        (2028, 2, 29),
        (2026, 12, 31),
        (2027, 2, 28),
        (2026, 11, 30),
        (2027, 1, 3),
    ]
    .iter()
    .map(|&(y, m, d)| days_from_civil(y, m, d) as u64 * 86_400_000 + 23 * 3_600_000)
    .collect();
    let mut mismatches = Vec::new();
    let (mut checks, mut denied_by_period, mut crossings) = (0u64, 0u64, 0u64);
    for sc in 0..scenarios {
        redis::cmd("FLUSHDB")
            .query_async::<()>(&mut con)
            .await
            .unwrap();
        let kinds = [PeriodKind::Hour, PeriodKind::Week, PeriodKind::Month];
        let mut limits: Vec<(PeriodKind, u64)> = Vec::new();
        for k in kinds {
            if rng.below(3) > 0 {
                limits.push((k, rng.range(3, 40)));
            }
        }
        let day_limit = rng.range(5, 60);
        let mut now_ms = starts[rng.below(starts.len() as u64) as usize] + rng.range(0, 3_500_000);
        // The model: P and N per period, the charges (time, cost, id).
        let mut model: HashMap<Period, (u64, u64)> = HashMap::new();
        let mut charges: Vec<(u64, u64, String)> = Vec::new();
        let mut used = std::collections::HashSet::new();
        for op_i in 0..rng.range(20, 60) {
            let before = now_ms;
            now_ms += match rng.below(10) {
                0 => rng.range(600_000, 2 * 3_600_000),
                1..=3 => rng.range(10_000, 600_000),
                _ => rng.range(1, 5_000),
            };
            if Period::day((before / 86_400_000) as u32)
                != Period::day((now_ms / 86_400_000) as u32)
                || PeriodKind::Hour.at(before) != PeriodKind::Hour.at(now_ms)
            {
                crossings += 1;
            }
            harness::lua::set_fake_clock_us(&mut con, now_ms * 1000).await;
            let cost = rng.range(1, 4);
            let op = match rng.below(10) {
                0..=6 => Op::Check,
                7 | 8 => Op::Refund,
                _ => Op::Peek,
            };
            let handle = (op == Op::Refund && !charges.is_empty() && rng.below(2) == 0)
                .then(|| rng.below(charges.len() as u64) as usize);
            // The periods of the call: a refund by handle names its charge's.
            let at = handle.map_or(now_ms, |i| charges[i].0);
            let periods: Vec<_> = limits
                .iter()
                .map(|(k, l)| region_node::storage::script::PeriodArgs {
                    period: k.at(at),
                    limit: *l,
                    broadcast_total: 0,
                    own_cap: None,
                    own_parts: Vec::new(),
                    urgent_at: None,
                })
                .collect();
            let day = (now_ms / 86_400_000) as u32;
            let id = format!("c{sc}x{op_i}");
            let (cost, refund) = match handle {
                Some(i) => (
                    charges[i].1,
                    Some(RefundOf {
                        id: charges[i].2.clone(),
                        charged_at_ms: charges[i].0,
                        expires_at_ms: 0,
                    }),
                ),
                None => (if op == Op::Peek { 0 } else { cost }, None),
            };
            let call = DecideCall {
                op,
                tenant: "t",
                node_id: "n1",
                cost,
                tiers: Vec::new(),
                expected_nodes: 1,
                global: Some(GlobalArgs {
                    limit: day_limit,
                    ..GlobalArgs::default()
                }),
                periods,
                epoch_candidate: &id,
                day,
                now_ms,
                counter_ttl_secs: 3 * 86_400,
                relaxed_ms: 2000,
                refund,
                lease: None,
            };
            let what = format!(
                "scenario {sc} op {op_i} {} cost {cost} at {now_ms} limits {limits:?} day {day_limit}",
                op.name()
            );
            let reply = match harness::lua::try_decide_by(&mut con, &sha, &call).await {
                Ok(r) => r,
                Err(e) => {
                    mismatches.push(format!("{what}: {e}"));
                    continue;
                }
            };
            // The model's view of every tier at now.
            let today = Period::day(day);
            let own =
                |m: &HashMap<Period, (u64, u64)>, p: Period| m.get(&p).map_or(0, |(p, n)| p - n);
            let mut tiers: Vec<(Period, u64)> = vec![(today, day_limit)];
            tiers.extend(limits.iter().map(|(k, l)| (k.at(now_ms), *l)));
            match op {
                Op::Check => {
                    checks += 1;
                    let denying = tiers
                        .iter()
                        .position(|(p, l)| cost > l.saturating_sub(own(&model, *p)));
                    let expected = match denying {
                        None => None,
                        Some(0) => Some(Denied::Global),
                        Some(j) => Some(Denied::Period(j - 1)),
                    };
                    if expected.is_some_and(|d| d != Denied::Global) {
                        denied_by_period += 1;
                    }
                    if reply.denied != expected {
                        mismatches.push(format!(
                            "{what}: denied {:?}, model {expected:?}",
                            reply.denied
                        ));
                        continue;
                    }
                    if expected.is_none() {
                        for (p, _) in &tiers {
                            model.entry(*p).or_default().0 += cost;
                        }
                        charges.push((now_ms, cost, id.clone()));
                    } else {
                        // Retry: the latest end among the denying tiers (a
                        // global tier's is its period's end, as the day's
                        // always was, even for a cost above its limit).
                        let retry = tiers
                            .iter()
                            .filter(|(p, l)| cost > l.saturating_sub(own(&model, *p)))
                            .map(|(p, _)| p.left_ms(now_ms))
                            .max()
                            .unwrap();
                        let got = reply.retry_ms.unwrap_or(u64::MAX);
                        if got != retry {
                            mismatches.push(format!("{what}: retry {got}, model {retry}"));
                        }
                    }
                }
                Op::Refund => {
                    let fresh = match &call.refund {
                        Some(r) => used.insert(r.id.clone()),
                        None => true,
                    };
                    if fresh {
                        for (p, _) in &tiers {
                            let open_for_charge = call
                                .refund
                                .as_ref()
                                .is_none_or(|r| p.contains(r.charged_at_ms));
                            if open_for_charge {
                                let e = model.entry(*p).or_default();
                                e.1 += cost.min(e.0 - e.1);
                            }
                        }
                    }
                }
                Op::Peek => {}
            }
            // Remaining of each other period after the call.
            let expected: Vec<u64> = limits
                .iter()
                .map(|(k, l)| l.saturating_sub(own(&model, k.at(now_ms))))
                .collect();
            // A refund by handle names the charge's periods: for a closed
            // one the script reports what is left of it (nothing moves).
            if (op != Op::Refund || call.refund.is_none()) && reply.periods_remaining != expected {
                mismatches.push(format!(
                    "{what}: periods remaining {:?}, model {expected:?}",
                    reply.periods_remaining
                ));
            }
            if reply.own_p - reply.own_n != own(&model, today) {
                mismatches.push(format!(
                    "{what}: day count {}, model {}",
                    reply.own_p - reply.own_n,
                    own(&model, today)
                ));
            }
        }
    }
    println!(
        "{checks} checks, {denied_by_period} denied by an hour, week or month tier, {crossings} hour or day crossings"
    );
    assert!(
        denied_by_period > 0 && crossings > 0,
        "the scenarios must cross periods and deny"
    );
    assert!(
        mismatches.is_empty(),
        "{} mismatches, first: {:#?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(5)]
    );
}
