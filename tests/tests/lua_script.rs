//! The Lua scripts on their own, against a real redis-server: the decision
//! script's all-or-nothing charging, PN counter and epoch, day selection,
//! dirty-set marking, and the publisher's conditional acknowledgement.

use harness::Redis;
use redis::Value;
use region_node::storage::script::{
    encode, lease_grant, DecideCall, DecideReply, Denied, GlobalArgs, LeaseAsk, LeaseTier, Op,
    RefundOf, ReplyError, Scope, TierCall, DECIDE_LUA, MIN_GRANT,
};
use tierlimit_shared::config::{Algorithm, Limit};
use tierlimit_shared::keys;

const ACK: &str = include_str!("../../region-node/src/lua/ack.lua");

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::TokenBucket,
    Algorithm::SlidingLog,
];

fn today() -> u32 {
    tierlimit_shared::day::today()
}

fn limit(algorithm: Algorithm, limit: u64, window_ms: u64, burst: u64) -> Limit {
    Limit {
        algorithm,
        limit,
        window_ms,
        burst,
    }
}

/// A whole-tenant tier of the plan, charged `cost`.
fn tier(scope: Scope, limit: &Limit, cost: u64) -> TierCall<'_> {
    TierCall {
        scope,
        rule: keys::WHOLE_TENANT,
        key: keys::WHOLE_TENANT,
        limit,
        cost,
    }
}

/// A check of `cost` units by node `n1` on the whole tenant, with no tier
/// set: the tests add the tiers they exercise.
fn check(tenant: &str, cost: u64) -> DecideCall<'_> {
    DecideCall {
        op: Op::Check,
        tenant,
        node_id: "n1",
        cost,
        tiers: Vec::new(),
        expected_nodes: 1,
        global: None,
        periods: Vec::new(),
        epoch_candidate: "epochcand",
        day: today(),
        now_ms: tierlimit_shared::messages::now_ms(),
        counter_ttl_secs: 86400 * 3,
        relaxed_ms: 2000,
        refund: None,
        lease: None,
    }
}

/// Today's counter fields of `tenant`: (epoch, P, N, publish state).
async fn counter(
    con: &mut redis::aio::MultiplexedConnection,
    tenant: &str,
    day: u32,
) -> (Option<String>, Option<u64>, Option<u64>, Option<u64>) {
    let g = keys::day_prefix(day);
    redis::cmd("HMGET")
        .arg(keys::tenant_hash(tenant))
        .arg(format!("{g}e"))
        .arg(format!("{g}p"))
        .arg(format!("{g}n"))
        .arg(format!("{g}d"))
        .query_async(con)
        .await
        .unwrap()
}

/// The score of (tenant, today) in its bucket's dirty set.
async fn dirty_score(con: &mut redis::aio::MultiplexedConnection, tenant: &str) -> Option<f64> {
    redis::cmd("ZSCORE")
        .arg(keys::dirty(keys::bucket_of(tenant)))
        .arg(keys::dirty_member(tenant, today()))
        .query_async(con)
        .await
        .unwrap()
}

/// A global tier of `limit` units per day, no broadcast seen, no cap.
fn global(limit: u64) -> Option<GlobalArgs> {
    Some(GlobalArgs {
        limit,
        ..GlobalArgs::default()
    })
}

/// `EVALSHA` of the decision script (loaded on NOSCRIPT, as the node does),
/// with `deadline_ms` in Redis' clock (0 = none). The outer error is Redis'
/// (the script refused with an error reply); the inner one the parser's.
async fn run(
    con: &mut redis::aio::MultiplexedConnection,
    call: &DecideCall<'_>,
    deadline_ms: i64,
) -> redis::RedisResult<Result<DecideReply, ReplyError>> {
    let script = redis::Script::new(DECIDE_LUA);
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash());
    encode(&mut cmd, call, deadline_ms);
    let reply = match cmd.query_async::<Vec<Value>>(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            let sha: String = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(DECIDE_LUA)
                .query_async(con)
                .await?;
            assert_eq!(sha, script.get_hash(), "SCRIPT LOAD returned another hash");
            cmd.query_async::<Vec<Value>>(con).await
        }
        other => other,
    }?;
    Ok(DecideReply::parse(reply, call))
}

/// A call without deadline that must succeed and parse.
async fn decide(con: &mut redis::aio::MultiplexedConnection, call: &DecideCall<'_>) -> DecideReply {
    run(con, call, 0)
        .await
        .expect("the script answered with an error")
        .expect("the reply does not parse")
}

#[tokio::test]
async fn denial_by_one_tier_charges_no_tier() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    // node 5 per hour (fixed), region 3 per hour (sliding): region denies 4th.
    let node = limit(Algorithm::FixedWindow, 5, 3_600_000, 5);
    let region = limit(Algorithm::SlidingWindow, 3, 3_600_000, 3);
    let mut c = check("t", 1);
    c.tiers = vec![tier(Scope::Node, &node, 1), tier(Scope::Region, &region, 1)];
    for _ in 0..3 {
        assert!(decide(&mut con, &c).await.allowed);
    }
    let r = decide(&mut con, &c).await;
    assert!(!r.allowed, "4th must be denied");
    assert_eq!(r.denied, Some(Denied::Tier(1)), "denied by the region tier");
    // The node tier kept its 2 remaining units: nothing was charged.
    assert_eq!(r.tiers[0].remaining, 2);
    // P counted only the allowed three.
    assert_eq!(r.own_p, 3);
    let id = keys::node_tier_id("n1", "_", node.algorithm.code());
    let node_count: u64 = redis::cmd("HGET")
        .arg(keys::tenant_hash("t"))
        .arg(format!("{id}:c"))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(node_count, 3);
}

/// Several tiers in one call (a gateway's descriptors): two node tiers and
/// three region tiers, one key-scoped and one a sliding log, all checked
/// together; the first that denies is named, and nothing is charged.
#[tokio::test]
async fn many_tiers_in_one_call_are_all_or_nothing() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let node_a = limit(Algorithm::FixedWindow, 100, 3_600_000, 100);
    let node_b = limit(Algorithm::TokenBucket, 100, 3_600_000, 100);
    let region_a = limit(Algorithm::SlidingWindow, 100, 3_600_000, 100);
    let per_route = limit(Algorithm::FixedWindow, 4, 3_600_000, 4);
    let log = limit(Algorithm::SlidingLog, 100, 3_600_000, 100);
    let mut c = check("multi", 1);
    c.tiers = vec![
        tier(Scope::Node, &node_a, 1),
        TierCall {
            rule: "descriptor-b",
            ..tier(Scope::Node, &node_b, 2)
        },
        tier(Scope::Region, &region_a, 1),
        TierCall {
            rule: "per-route",
            key: "GET/orders",
            ..tier(Scope::Region, &per_route, 1)
        },
        TierCall {
            rule: "audit",
            ..tier(Scope::Region, &log, 3)
        },
    ];
    for _ in 0..4 {
        assert!(decide(&mut con, &c).await.allowed);
    }
    let r = decide(&mut con, &c).await;
    assert_eq!(r.denied, Some(Denied::Tier(3)), "the per-route tier denies");
    let remaining: Vec<u64> = r.tiers.iter().map(|t| t.remaining).collect();
    // Nothing charged by the denied call: each tier shows 4 calls' worth.
    assert_eq!(remaining, vec![96, 92, 96, 0, 88]);
    // Every key the calls wrote is in the tenant's bucket slot.
    let written: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut con)
        .await
        .unwrap();
    let slot = keys::bucket_slot(keys::bucket_of("multi"));
    assert!(written.len() >= 4, "{written:?}");
    for k in &written {
        assert_eq!(keys::cluster_slot(k.as_bytes()), slot, "{k}");
    }
}

#[tokio::test]
async fn pn_counter_epoch_and_lazy_dirty_marking() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = check("acme", 2);
    c.global = global(100);
    let r = decide(&mut con, &c).await;
    assert_eq!(
        r.epoch, "epochcand",
        "a new counter takes the candidate epoch"
    );
    let first = dirty_score(&mut con, "acme").await.expect("dirty");
    let r = decide(&mut con, &c).await;
    assert_eq!(r.own_p, 4);
    // Marked once: the second charge wrote no new score (never published,
    // so due at once: the score is the Redis time of the first charge).
    assert_eq!(dirty_score(&mut con, "acme").await, Some(first));
    assert_eq!(counter(&mut con, "acme", today()).await.3, Some(1));
    // Near the limit: urgent, score 0.
    c.global.as_mut().unwrap().urgent_at = Some(6);
    decide(&mut con, &c).await;
    assert_eq!(dirty_score(&mut con, "acme").await, Some(0.0));
    assert_eq!(counter(&mut con, "acme", today()).await.3, Some(2));
    // Refund: N grows, never past P.
    let mut rf = check("acme", 10);
    rf.op = Op::Refund;
    let r = decide(&mut con, &rf).await;
    assert_eq!((r.own_p, r.own_n), (6, 6), "refund is clamped at P");
    // Redis loses its data: the next charge starts a new epoch.
    // SCRIPT FLUSH as well: the next EVALSHA gets NOSCRIPT and is reloaded.
    redis::cmd("FLUSHALL")
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    c.epoch_candidate = "second";
    let r = decide(&mut con, &c).await;
    assert_eq!(r.own_p, 2);
    assert_eq!(r.epoch, "second");
}

#[tokio::test]
async fn global_budget_subtracts_only_other_actors() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = check("g", 1);
    c.global = global(10);
    // Create our actor with 3 units.
    for _ in 0..3 {
        assert!(decide(&mut con, &c).await.allowed);
    }
    // Broadcast says total 8, of which 3 are our current actor: others = 5.
    let g = c.global.as_mut().unwrap();
    g.broadcast_total = 8;
    g.own_parts = vec![("epochcand".into(), 3, 0)];
    // Budget: 10 - 5 - 3 = 2 more.
    assert!(decide(&mut con, &c).await.allowed);
    assert!(decide(&mut con, &c).await.allowed);
    let r = decide(&mut con, &c).await;
    assert_eq!(
        (r.allowed, r.denied),
        (false, Some(Denied::Global)),
        "denied by the global tier"
    );
    assert_eq!(r.own_p, 5);
    // An older epoch of this region counts as others.
    c.global.as_mut().unwrap().own_parts = vec![("oldepoch".into(), 3, 0)];
    let r = decide(&mut con, &c).await;
    assert!(!r.allowed);
    assert_eq!(r.raised, 0, "another epoch's part raises nothing");
    // A staleness cap below the current count denies too.
    let mut c2 = check("g", 1);
    c2.global = Some(GlobalArgs {
        limit: 1000,
        own_cap: Some(5),
        ..GlobalArgs::default()
    });
    let r = decide(&mut con, &c2).await;
    assert_eq!((r.allowed, r.denied), (false, Some(Denied::Global)));
}

/// A partial rollback: Redis holds P = 50 for the epoch whose broadcast part
/// is 100. The script raises P to 100 before it charges, so the global tier
/// sees what was really spent; a peek with the part persists the raise.
#[tokio::test]
async fn a_rolled_back_counter_is_raised_to_its_broadcast_part() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = check("rb", 1);
    c.global = global(150);
    decide(&mut con, &c).await;
    let [_, p, _] = keys::counter_fields(today());
    redis::cmd("HSET")
        .arg(keys::tenant_hash("rb"))
        .arg(&p)
        .arg(50)
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    let g = c.global.as_mut().unwrap();
    g.broadcast_total = 100;
    g.own_parts = vec![("epochcand".into(), 100, 0)];
    let r = decide(&mut con, &c).await;
    assert!(r.allowed);
    assert_eq!((r.own_p, r.raised), (101, 50));
    assert_eq!(r.global_remaining, Some(49));
    let mut allowed = 1;
    while decide(&mut con, &c).await.allowed {
        allowed += 1;
    }
    assert_eq!(allowed, 50, "150 − 100 already spent");
    // A peek carrying a higher part persists it.
    let mut peek = check("rb", 0);
    peek.op = Op::Peek;
    peek.global = Some(GlobalArgs {
        own_parts: vec![("epochcand".into(), 400, 10)],
        ..GlobalArgs::default()
    });
    let r = decide(&mut con, &peek).await;
    assert_eq!(r.raised, 250);
    let (_, p, n, _) = counter(&mut con, "rb", today()).await;
    assert_eq!((p, n), (Some(400), Some(10)));
}

/// One clock decides the day, Redis' (issue 29 item 2). A check the node
/// built for another day does nothing and says so (the node sends it again
/// with Redis' day): it is never decided with another day's broadcast, and
/// a mismatch never reads as "the others spent nothing" (before the fix,
/// this check was admitted with 99 of 100 spent by the others). A peek of
/// another day reads Redis' day, the whole broadcast counted as the others'.
#[tokio::test]
async fn the_day_is_redis_clocks_and_a_mismatch_is_never_others_zero() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    // The node believes it is yesterday.
    let mut c = check("d", 1);
    c.global = Some(GlobalArgs {
        limit: 100,
        broadcast_total: 99,
        ..GlobalArgs::default()
    });
    c.day = today() - 1;
    let r = run(&mut con, &c, 0).await.expect("the script answered");
    assert!(
        matches!(r, Err(ReplyError::OtherDay { sent, .. }) if sent == today() - 1),
        "a check of another day is refused for a retry: {r:?}"
    );
    assert_eq!(
        counter(&mut con, "d", today()).await.1,
        None,
        "nothing charged"
    );
    assert_eq!(counter(&mut con, "d", today() - 1).await.1, None);
    let mut peek = c.clone();
    peek.op = Op::Peek;
    peek.cost = 0;
    let r = decide(&mut con, &peek).await;
    assert_eq!(r.day, today());
    assert_eq!(
        r.global_remaining,
        Some(1),
        "another day's broadcast is the others' spend, never nothing"
    );
    // Sent again for Redis' day, it is decided: 99 + 1 fit in 100.
    c.day = today();
    assert!(decide(&mut con, &c).await.allowed);
    assert_eq!(counter(&mut con, "d", today()).await.1, Some(1));
    // More than a day off: refused with an error, nothing written.
    c.day = today() - 5;
    assert!(run(&mut con, &c, 0).await.is_err());
}

/// Midnight: the first counter of a new day of a tenant that counted on an
/// earlier day is due at a point of the relaxed interval fixed by the
/// tenant (so a region's publishes spread over it), a tenant never seen is
/// due at once, and the days past retention leave the hash whole.
#[tokio::test]
async fn a_new_days_first_publications_spread_over_the_relaxed_interval() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let (yesterday, old) = (today() - 1, today() - 10);
    let (now_s, now_us): (i64, i64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
    let now = now_s * 1000 + now_us / 1000;
    let tenants: Vec<String> = (0..20).map(|i| format!("t{i}")).collect();
    let mut scores = Vec::new();
    for t in &tenants {
        // Counted yesterday, and long ago (past the 3-day TTL).
        let o = keys::day_prefix(old);
        redis::cmd("HSET")
            .arg(keys::tenant_hash(t))
            .arg("gd")
            .arg(format!("{yesterday},{old}"))
            .arg(format!("{o}p"))
            .arg(1)
            .arg(format!("{o}s"))
            .arg(1)
            .query_async::<()>(&mut con)
            .await
            .unwrap();
        let mut c = check(t, 1);
        c.global = global(1_000_000);
        decide(&mut con, &c).await;
        let score = dirty_score(&mut con, t).await.expect("dirty") as i64;
        assert!(
            (now - 1000..now + 2000 + 1000).contains(&score),
            "{t}: due within the relaxed interval: {score} vs {now}"
        );
        let left: Vec<String> = redis::cmd("HKEYS")
            .arg(keys::tenant_hash(t))
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(
            !left.iter().any(|f| f.starts_with(&o)),
            "every field of a day past retention is dropped: {left:?}"
        );
        scores.push(score);
    }
    let spread = scores.iter().max().unwrap() - scores.iter().min().unwrap();
    assert!(
        spread >= 1000,
        "20 tenants spread over the 2 s interval, not due together: {scores:?}"
    );
    // A tenant never seen before is due at once.
    let mut c = check("fresh", 1);
    c.global = global(1_000_000);
    decide(&mut con, &c).await;
    let fresh = dirty_score(&mut con, "fresh").await.expect("dirty") as i64;
    assert!(
        (now - 1000..now + 1000).contains(&fresh),
        "{fresh} vs {now}"
    );
}

/// `ack.lua`: an unchanged counter leaves the dirty set (and its publish
/// state), one charged since stays and is due a relaxed interval later, a
/// gone one leaves; every published counter is stamped; a charge after the
/// ack marks the entry again, due a relaxed interval after the stamp.
#[tokio::test]
async fn ack_removes_only_unchanged_entries_and_reschedules_the_rest() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = check("a", 5);
    decide(&mut con, &c).await;
    c.tenant = "b";
    decide(&mut con, &c).await;
    let script = redis::Script::new(ACK);
    let ack = |list: Vec<(&'static str, u64)>, bucket_of: &'static str| {
        let mut inv = script.prepare_invoke();
        inv.key(keys::dirty(keys::bucket_of(bucket_of)));
        for (t, _) in &list {
            inv.key(keys::tenant_hash(t));
        }
        inv.arg(2000);
        for (t, pn) in &list {
            inv.arg(keys::dirty_member(t, today()))
                .arg(today())
                .arg(*pn);
        }
        inv
    };
    // a published at 5 (unchanged); b published at 3 (charged to 5 since).
    let mut removed = 0i64;
    for (t, pn) in [("a", 5u64), ("b", 3)] {
        removed += ack(vec![(t, pn)], t)
            .invoke_async::<i64>(&mut con)
            .await
            .unwrap();
    }
    assert_eq!(removed, 1);
    let (now_s, _): (i64, i64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
    assert_eq!(dirty_score(&mut con, "a").await, None);
    assert_eq!(
        counter(&mut con, "a", today()).await.3,
        None,
        "publish state cleared"
    );
    let b = dirty_score(&mut con, "b").await.expect("b stays dirty");
    assert!(
        (b as i64 - (now_s * 1000 + 2000)).abs() < 2000,
        "b is due a relaxed interval from now: {b}"
    );
    // A charge after the ack: dirty again, due a relaxed interval after the
    // publication.
    c.tenant = "a";
    decide(&mut con, &c).await;
    let a = dirty_score(&mut con, "a").await.expect("a dirty again");
    assert!(a as i64 >= now_s * 1000 + 1000, "{a}");
    // A counter that is gone just leaves.
    redis::cmd("DEL")
        .arg(keys::tenant_hash("a"))
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    let removed: i64 = ack(vec![("a", u64::MAX)], "a")
        .invoke_async(&mut con)
        .await
        .unwrap();
    assert_eq!(removed, 1);
}

#[tokio::test]
async fn every_algorithm_allows_exactly_its_limit_in_a_burst() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    for algorithm in ALGORITHMS {
        let code = algorithm.code();
        let tenant = format!("alg{code}");
        let region = limit(algorithm, 25, 3_600_000, 25);
        let mut c = check(&tenant, 1);
        c.tiers = vec![tier(Scope::Region, &region, 1)];
        let mut allowed = 0;
        for _ in 0..60 {
            allowed += u32::from(decide(&mut con, &c).await.allowed);
        }
        assert_eq!(allowed, 25, "algorithm {code}");
        // A denial reports a positive retry-after.
        let r = decide(&mut con, &c).await;
        assert!(
            r.retry_ms.is_some_and(|ms| ms > 0),
            "algorithm {code} retry {:?}",
            r.retry_ms
        );
        // Refund 5 → exactly 5 more pass (never more than refunded).
        let mut rf = check(&tenant, 5);
        rf.op = Op::Refund;
        rf.tiers = vec![tier(Scope::Region, &region, 5)];
        decide(&mut con, &rf).await;
        let mut again = 0;
        for _ in 0..10 {
            again += u32::from(decide(&mut con, &c).await.allowed);
        }
        assert_eq!(again, 5, "algorithm {code} after refund");
    }
}

/// A refund by handle: once per handle id, into the charge's windows and
/// day only.
#[tokio::test]
async fn a_refund_by_handle_counts_once() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let region = limit(Algorithm::FixedWindow, 10, 3_600_000, 10);
    let mut c = check("h", 4);
    c.tiers = vec![tier(Scope::Region, &region, 4)];
    c.global = global(100);
    let charged = decide(&mut con, &c).await;
    let mut rf = check("h", 4);
    rf.op = Op::Refund;
    rf.tiers = vec![tier(Scope::Region, &region, 4)];
    rf.refund = Some(RefundOf {
        id: "charge-1".into(),
        charged_at_ms: charged.now_ms as u64,
        expires_at_ms: 0,
    });
    let r = decide(&mut con, &rf).await;
    assert_eq!((r.refunded, r.duplicate, r.own_n), (4, false, 4));
    // (A refund's reply shows the tiers as they were before it.)
    let mut peek = check("h", 0);
    peek.op = Op::Peek;
    peek.tiers = vec![tier(Scope::Region, &region, 0)];
    assert_eq!(decide(&mut con, &peek).await.tiers[0].remaining, 10);
    let r = decide(&mut con, &rf).await;
    assert_eq!((r.refunded, r.duplicate, r.own_n), (0, true, 4));
    // A charge of yesterday: nothing back to today's count or this window.
    decide(&mut con, &c).await;
    rf.refund = Some(RefundOf {
        id: "charge-0".into(),
        charged_at_ms: charged.now_ms as u64 - 86_400_000,
        expires_at_ms: 0,
    });
    let r = decide(&mut con, &rf).await;
    assert_eq!((r.refunded, r.own_n), (0, 4));
    assert_eq!(decide(&mut con, &peek).await.tiers[0].remaining, 6);
    // The record lives in the tenant's slot, with a TTL.
    let rec = keys::refund_record("h", today());
    let ttl: i64 = redis::cmd("TTL")
        .arg(&rec)
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(ttl > 0, "{rec}: {ttl}");

    // A handle past its expiry (every window of its charge ended, in
    // Redis' clock) gives nothing back, records nothing, and says so.
    rf.refund = Some(RefundOf {
        id: "charge-2".into(),
        charged_at_ms: charged.now_ms as u64,
        expires_at_ms: charged.now_ms as u64,
    });
    let r = decide(&mut con, &rf).await;
    assert_eq!(
        (r.refunded, r.expired, r.duplicate, r.own_n),
        (0, true, false, 4)
    );
    let used: bool = redis::cmd("SISMEMBER")
        .arg(&rec)
        .arg("charge-2")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(!used, "an expired handle is not recorded");
    // One whose charge touched a window longer than the record's TTL keeps
    // the record past it.
    let later = charged.now_ms as u64 + 9 * 86_400_000;
    rf.refund = Some(RefundOf {
        id: "charge-3".into(),
        charged_at_ms: charged.now_ms as u64,
        expires_at_ms: later,
    });
    decide(&mut con, &rf).await;
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&rec)
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(
        pttl > 8 * 86_400_000,
        "{rec} lives until the longest window it guards ends: {pttl} ms"
    );
}

#[tokio::test]
async fn token_bucket_full_burst_passes_when_the_interval_is_fractional() {
    // 3 per second, burst 2: e = 333 333.33 µs. A cost of 2 on an empty
    // bucket must pass (absolute-time doubles used to lose it to rounding).
    let redis = Redis::start();
    let mut con = redis.client().await;
    let region = limit(Algorithm::TokenBucket, 3, 1000, 2);
    for i in 0..50 {
        let tenant = format!("gcra{i}");
        let mut c = check(&tenant, 2);
        c.tiers = vec![tier(Scope::Region, &region, 2)];
        let r = decide(&mut con, &c).await;
        assert!(r.allowed, "attempt {i}");
    }
}

#[tokio::test]
async fn sliding_log_takes_a_large_cost_atomically() {
    // Lua's unpack() caps at ~8000 values: 5000 units are added in chunks.
    let redis = Redis::start();
    let mut con = redis.client().await;
    let region = limit(Algorithm::SlidingLog, 10_000, 3_600_000, 10_000);
    let mut c = check("log", 5000);
    c.tiers = vec![tier(Scope::Region, &region, 5000)];
    assert!(decide(&mut con, &c).await.allowed);
    assert!(decide(&mut con, &c).await.allowed);
    let id = keys::region_tier_id("_", region.algorithm.code());
    let n: u64 = redis::cmd("ZCARD")
        .arg(keys::tier_key("log", &id, keys::WHOLE_TENANT))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(n, 10_000);
    c.cost = 1;
    c.tiers = vec![tier(Scope::Region, &region, 1)];
    let r = decide(&mut con, &c).await;
    assert!(!r.allowed);
}

#[tokio::test]
async fn a_cost_above_the_limit_is_never_retryable() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    for algorithm in ALGORITHMS {
        let code = algorithm.code();
        let tenant = format!("big{code}");
        let region = limit(algorithm, 10, 60_000, 10);
        let mut c = check(&tenant, 11);
        c.tiers = vec![tier(Scope::Region, &region, 11)];
        let r = decide(&mut con, &c).await;
        assert_eq!(
            (r.allowed, r.retry_ms),
            (false, None),
            "algorithm {code}: retry None means never"
        );
    }
}

#[tokio::test]
async fn a_call_past_its_deadline_charges_nothing() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let region = limit(Algorithm::FixedWindow, 10, 3_600_000, 10);
    let mut c = check("late", 1);
    c.tiers = vec![tier(Scope::Region, &region, 1)];
    c.global = global(100);
    // A deadline already passed in Redis' clock: refused, nothing written.
    let r = run(&mut con, &c, 1).await.unwrap();
    assert!(
        matches!(r, Err(ReplyError::Expired { .. })),
        "expired: {r:?}"
    );
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(keys.is_empty(), "nothing written: {keys:?}");
    // A deadline in the future: charged as usual.
    let r = run(&mut con, &c, i64::MAX / 2).await.unwrap().unwrap();
    assert!(r.allowed);
}

/// `CMD key` (a read such as PTTL, HGETALL or HKEYS), as `T`.
async fn on_key<T: redis::FromRedisValue>(
    con: &mut redis::aio::MultiplexedConnection,
    cmd: &str,
    key: &str,
) -> T {
    redis::cmd(cmd).arg(key).query_async(con).await.unwrap()
}

/// A new day drops the days past retention from the tenant hash and gives
/// the hash its TTL (from the tenant's first charge on); the tier states in
/// it stay. When the day's counter reaches `BUSY_DAY` units the hash is
/// rewritten with the day's counter first, then the region's tiers, then
/// the rest, values and TTL unchanged: in a listpack every decision walks
/// whatever precedes the fields it reads.
#[tokio::test]
async fn a_new_day_forgets_days_past_retention() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    // Loaded once: FLUSHDB between scenarios keeps the script cache.
    let sha = harness::lua::load_with_fake_clock(&mut con).await;
    let node = limit(Algorithm::FixedWindow, 100, 60_000, 100);
    let d0 = 20_000u32;
    let hash = keys::tenant_hash("days");
    let con2 = con.clone();
    let charge = |node_id: &'static str, cost: u64, d: u32| {
        let mut c = check("days", cost);
        c.node_id = node_id;
        c.day = d;
        // TTL 2 days: a day's counter is kept while it is at most 2 days old.
        c.counter_ttl_secs = 2 * 86_400;
        c.tiers = vec![
            tier(Scope::Node, &node, cost),
            tier(Scope::Region, &node, cost),
        ];
        let (mut con, sha) = (con2.clone(), sha.clone());
        async move {
            let r = harness::lua::decide_by(&mut con, &sha, &c).await;
            assert!(r.allowed, "{} charges {cost} on day {d}", c.node_id);
            r.own_p
        }
    };
    let day_of = |f: &str| {
        f.strip_prefix("g:")
            .map(|rest| rest.split(':').next().unwrap().to_owned())
    };
    for d in d0..d0 + 4 {
        harness::lua::set_fake_day(&mut con, d).await;
        assert_eq!(charge("n1", 1, d).await, 1);
        let pttl: i64 = on_key(&mut con, "PTTL", &hash).await;
        assert!(
            pttl > 86_400_000,
            "day {d}: the hash has its TTL from its first charge: {pttl}"
        );
        // Another node charges later in the day; then the day gets busy.
        assert_eq!(charge("n2", 1, d).await, 2);
        let before: Vec<(String, String)> = on_key(&mut con, "HGETALL", &hash).await;
        assert_eq!(charge("n1", 62, d).await, 64);
        let after: Vec<(String, String)> = on_key(&mut con, "HGETALL", &hash).await;
        let rank = |f: &str| match day_of(f) {
            Some(x) if x == d.to_string() => 0,
            _ if f.starts_with("r:") => 1,
            _ => 2,
        };
        let ranks: Vec<u8> = after.iter().map(|(f, _)| rank(f)).collect();
        assert!(
            ranks.windows(2).all(|w| w[0] <= w[1]) && ranks[..4] == [0; 4],
            "day {d}: the counter, the region tier, the rest: {after:?}"
        );
        for (f, v) in &before {
            if day_of(f).is_some_and(|x| x != d.to_string()) {
                assert!(
                    after.contains(&(f.clone(), v.clone())),
                    "day {d}: {f} = {v} kept as it was: {after:?}"
                );
            }
        }
        let again: i64 = on_key(&mut con, "PTTL", &hash).await;
        assert!(
            (pttl - 60_000..=pttl).contains(&again),
            "day {d}: the rewrite keeps the TTL: {pttl} then {again}"
        );
        // Past the threshold nothing is rewritten again.
        charge("n2", 1, d).await;
        let last: Vec<String> = on_key(&mut con, "HKEYS", &hash).await;
        assert_eq!(
            last,
            after.iter().map(|(f, _)| f.clone()).collect::<Vec<_>>(),
            "day {d}"
        );
    }
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(keys::tenant_hash("days"))
        .query_async(&mut con)
        .await
        .unwrap();
    let days: std::collections::BTreeSet<&str> = fields
        .iter()
        .filter_map(|f| f.strip_prefix("g:")?.split(':').next())
        .collect();
    let want: std::collections::BTreeSet<String> =
        (d0 + 1..d0 + 4).map(|d| d.to_string()).collect();
    assert_eq!(
        days,
        want.iter().map(String::as_str).collect(),
        "day {d0} dropped, the last three kept: {fields:?}"
    );
    let gd: String = redis::cmd("HGET")
        .arg(keys::tenant_hash("days"))
        .arg("gd")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(gd.split(',').count(), 3, "{gd}");
    let ttl: i64 = redis::cmd("TTL")
        .arg(keys::tenant_hash("days"))
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(ttl > 86_400, "the hash lives its TTL: {ttl}");
    assert!(
        fields.iter().any(|f| f.starts_with("n:n1:_:1:")),
        "{fields:?}"
    );
}

#[tokio::test]
async fn a_lease_takes_a_share_of_what_is_left_and_nothing_near_the_limit() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let region = limit(Algorithm::FixedWindow, 100, 3_600_000, 100);
    let node = limit(Algorithm::SlidingWindow, 1000, 3_600_000, 1000);
    let ask = Some(LeaseAsk {
        max: 30,
        share: 4,
        life_ms: 0,
    });
    let leased = |cost| {
        let mut c = check("t", cost);
        c.tiers = vec![
            tier(Scope::Node, &node, cost),
            tier(Scope::Region, &region, cost),
        ];
        c.global = global(1000);
        c.lease = ask;
        c
    };
    // 100 left: the request takes 1, the lease min(30, 99 / 4) = 24; every
    // tier and the day's count are charged 25.
    let r = decide(&mut con, &leased(1)).await;
    assert!(r.allowed);
    assert_eq!(r.granted, 24);
    assert_eq!((r.tiers[1].remaining, r.own_p), (75, 25));
    assert_eq!(r.tiers[0].remaining, 975);
    assert_eq!(r.global_remaining, Some(975));
    // 75 left → 18; 56 → 13; … the lease shrinks with what is left.
    let mut left = 75;
    while (left - 1) / 4 >= MIN_GRANT {
        let r = decide(&mut con, &leased(1)).await;
        let want = ((left - 1) / 4).min(30);
        assert_eq!(r.granted, want, "with {left} left");
        left -= 1 + want;
        assert_eq!(r.tiers[1].remaining, left);
    }
    // Near the limit (fewer than MIN_GRANT × `share` left after the
    // request): no lease, single decisions, until the tier denies and
    // nothing more is granted.
    while left > 0 {
        let r = decide(&mut con, &leased(1)).await;
        assert_eq!((r.allowed, r.granted), (true, 0), "with {left} left");
        left -= 1;
    }
    let r = decide(&mut con, &leased(1)).await;
    assert_eq!((r.allowed, r.granted), (false, 0));
    assert_eq!(counter(&mut con, "t", today()).await.1, Some(100));

    // The global budget bounds a lease as much as a tier does.
    let mut c = leased(1);
    c.tenant = "g";
    c.global = global(9);
    let r = decide(&mut con, &c).await;
    assert_eq!((r.granted, r.global_remaining), (2, Some(6)));

    // GCRA and the exact log keep no window a lease could die with.
    for alg in [Algorithm::TokenBucket, Algorithm::SlidingLog] {
        let l = limit(alg, 100, 3_600_000, 100);
        let mut c = check("other", 1);
        c.tiers = vec![tier(Scope::Region, &l, 1)];
        c.lease = ask;
        let r = decide(&mut con, &c).await;
        assert_eq!((r.allowed, r.granted), (true, 0), "{alg:?}");
    }
}

/// The script's lease arithmetic against its Rust twin
/// (`script::lease_grant`, what the bound on leased units is proved
/// against in `lease::bound`): random tiers (fixed and sliding windows, now
/// and then a GCRA or a log), what they have used, the global budget, the
/// node's want and share, and a tail that sometimes reaches past a
/// window's end. Each case is a fresh tenant, so a tier has left its limit
/// less what the case charged first.
#[tokio::test]
async fn the_scripts_lease_is_the_models() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut granted_some = 0;
    for case in 0..300 {
        let tenant = format!("m{case}");
        let k = 1 + rnd(2) as usize;
        let limits: Vec<Limit> = (0..k)
            .map(|_| {
                let alg = match rnd(10) {
                    0 => Algorithm::TokenBucket,
                    1 => Algorithm::SlidingLog,
                    2..=5 => Algorithm::SlidingWindow,
                    _ => Algorithm::FixedWindow,
                };
                let l = 1 + rnd(400);
                limit(alg, l, [10_000, 60_000, 3_600_000][rnd(3) as usize], l)
            })
            .collect();
        let used: Vec<u64> = limits.iter().map(|l| rnd(l.limit)).collect();
        let glimit = (rnd(3) > 0).then(|| 1 + rnd(600));
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
        let before = secs * 1000 + micros / 1000;
        // Charge each tier its `used` alone (a tier at a time, the others
        // left out), and the global count with the first.
        for (i, (l, u)) in limits.iter().zip(&used).enumerate() {
            if *u == 0 {
                continue;
            }
            let mut c = check(&tenant, *u);
            c.tiers = vec![tier(
                if i == 0 { Scope::Node } else { Scope::Region },
                l,
                *u,
            )];
            c.cost = if i == 0 { *u } else { 0 };
            let r = decide(&mut con, &c).await;
            assert!(r.allowed, "case {case}: setup");
        }
        let g_used = used[0];
        let cost = 1 + rnd(3);
        let ask = LeaseAsk {
            max: rnd(80),
            share: 1 + rnd(8),
            life_ms: [0, 500, 2_000, 20_000][rnd(4) as usize],
        };
        let mut c = check(&tenant, cost);
        c.tiers = limits
            .iter()
            .enumerate()
            .map(|(i, l)| tier(if i == 0 { Scope::Node } else { Scope::Region }, l, cost))
            .collect();
        c.global = glimit.and_then(global);
        c.lease = Some(ask);
        let r = decide(&mut con, &c).await;
        let now = r.now_ms as u64;
        if limits
            .iter()
            .any(|l| before / l.window_ms != now / l.window_ms)
        {
            continue; // a window ended during the case: its state is not `used`
        }
        let allowed = limits.iter().zip(&used).all(|(l, u)| u + cost <= l.limit)
            && glimit.is_none_or(|g| g_used + cost <= g);
        assert_eq!(r.allowed, allowed, "case {case}");
        if !allowed {
            assert_eq!(r.granted, 0, "case {case}: a denied check takes no lease");
            continue;
        }
        let tiers: Vec<LeaseTier> = limits
            .iter()
            .zip(&used)
            .map(|(l, u)| LeaseTier {
                windowed: matches!(
                    l.algorithm,
                    Algorithm::FixedWindow | Algorithm::SlidingWindow
                ),
                remaining: l.limit - u,
                cost,
                reset_ms: l.window_ms - now % l.window_ms,
            })
            .collect();
        let model = lease_grant(&ask, &tiers, glimit.map(|g| g - g_used), cost, now);
        assert_eq!(
            r.granted, model,
            "case {case}: {ask:?} {tiers:?} global {glimit:?}−{g_used}"
        );
        granted_some += u64::from(model > 0);
    }
    assert!(
        granted_some > 30,
        "the cases exercise grants: {granted_some}"
    );
}

/// Issue 29 item 7: a lease ends at the earlier of its window's end and
/// the day's end. The node expires it there (`lease.rs`); the script sizes
/// it to be spent before then: with less than the lease's life (2 s) left
/// in the day, the want shrinks in proportion, to nothing in the day's
/// last milliseconds, whatever the window (a week here). On a faked clock;
/// the Rust twin agrees.
#[tokio::test]
async fn no_lease_is_sized_past_its_day() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let sha = harness::lua::load_with_fake_clock(&mut con).await;
    let week = limit(Algorithm::FixedWindow, 100_000, 7 * 86_400_000, 100_000);
    let day = 20_003u32;
    let ask = LeaseAsk {
        max: 50,
        share: 4,
        life_ms: 2_000,
    };
    let mut used = 0;
    // (s before midnight, µs into that second, granted)
    for (before, us, granted) in [(10, 0, 50), (1, 0, 25), (1, 970_000, 0)] {
        let secs = u64::from(day + 1) * 86_400 - before;
        let _: () = redis::cmd("MSET")
            .arg("fake:s")
            .arg(secs)
            .arg("fake:us")
            .arg(us)
            .query_async(&mut con)
            .await
            .unwrap();
        let mut c = check("d", 1);
        c.day = day;
        c.tiers = vec![tier(Scope::Region, &week, 1)];
        c.lease = Some(ask);
        let r = harness::lua::decide_by(&mut con, &sha, &c).await;
        assert!(r.allowed);
        assert_eq!(r.granted, granted, "{before} s − {us} µs before midnight");
        let now = r.now_ms as u64;
        let tiers = [LeaseTier {
            windowed: true,
            remaining: 100_000 - used,
            cost: 1,
            reset_ms: 7 * 86_400_000 - now % (7 * 86_400_000),
        }];
        assert_eq!(
            lease_grant(&ask, &tiers, None, 0, now),
            granted,
            "the model agrees"
        );
        used += 1 + granted;
    }
}

/// The previous release's decision script (`bba1826`: the same arguments
/// and reply; a new tenant's hash without a TTL until its second day), kept as
/// it shipped: during a rolling upgrade its nodes and this release's share
/// one Redis.
const PREVIOUS_RELEASE: &str = include_str!("../fixtures/decide_previous_release.lua");

/// A rolling upgrade: nodes of the previous release and of this one charge
/// the same tenant in one region, taking turns, over three days of a faked
/// clock, each release starting a day in turn. The storage layout is what
/// they share (each runs its own script by its SHA and reads its own
/// reply), so each sees every charge the other made: the tiers' remaining
/// units and the region's PN counter count all of them, the region tier
/// denies at its limit whichever release asks, and each day's counter
/// stays as it was whichever release started the next.
#[tokio::test]
async fn nodes_of_the_previous_release_share_the_counts() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let new_sha = harness::lua::load_with_fake_clock(&mut con).await;
    let old_sha = harness::lua::load_source_with_fake_clock(&mut con, PREVIOUS_RELEASE).await;
    assert_ne!(new_sha, old_sha, "two releases of the script");
    let node = limit(Algorithm::FixedWindow, 1000, 3_600_000, 1000);
    let region = limit(Algorithm::SlidingWindow, 12, 3_600_000, 12);
    let d0 = 20_000u32;
    for d in d0..d0 + 3 {
        harness::lua::set_fake_day(&mut con, d).await;
        let mut c = check("upgrade", 1);
        c.tiers = vec![tier(Scope::Node, &node, 1), tier(Scope::Region, &region, 1)];
        c.global = global(100);
        c.day = d;
        // The previous release starts days d0 and d0 + 2, this one d0 + 1.
        let old_starts = (d - d0).is_multiple_of(2);
        let run_as = |old: bool| {
            let sha = if old { &old_sha } else { &new_sha }.clone();
            let (mut con, c) = (con.clone(), c.clone());
            async move {
                if old {
                    harness::lua::decide_by_previous(&mut con, &sha, &c).await
                } else {
                    harness::lua::decide_by(&mut con, &sha, &c).await
                }
            }
        };
        for i in 0..12u64 {
            let r = run_as(i.is_multiple_of(2) == old_starts).await;
            assert!(r.allowed, "day {d}, charge {i}");
            assert_eq!(r.epoch, "epochcand", "the first charge named the actor");
            assert_eq!(r.own_p, i + 1, "P counts both releases' charges");
            assert_eq!(
                r.tiers[0].remaining,
                1000 - (i + 1),
                "node tier after charge {i}"
            );
            assert_eq!(
                r.tiers[1].remaining,
                12 - (i + 1),
                "region tier after charge {i}"
            );
        }
        for old in [true, false] {
            let r = run_as(old).await;
            assert_eq!(
                r.denied,
                Some(Denied::Tier(1)),
                "the region tier is full (old: {old})"
            );
        }
        for e in d0..=d {
            assert_eq!(
                counter(&mut con, "upgrade", e).await.1,
                Some(12),
                "day {e} on day {d}"
            );
        }
    }
}

/// Sets the fake clock of a script loaded with `load_with_fake_clock` to
/// `ms` (Unix ms).
async fn set_fake_ms(con: &mut redis::aio::MultiplexedConnection, ms: u64) {
    redis::pipe()
        .cmd("SET")
        .arg("fake:s")
        .arg(ms / 1000)
        .ignore()
        .cmd("SET")
        .arg("fake:us")
        .arg(ms % 1000 * 1000)
        .ignore()
        .query_async::<()>(con)
        .await
        .unwrap();
}

/// A check of one unit by the script loaded as `sha` with the fake clock:
/// of `tenant`, with `id` as the call's id, at `ms`, on a region tier `log`.
async fn log_check(
    con: &mut redis::aio::MultiplexedConnection,
    sha: &str,
    log: &Limit,
    tenant: &str,
    id: &str,
    ms: u64,
) -> DecideReply {
    let mut call = check(tenant, 1);
    call.epoch_candidate = id;
    call.day = (ms / 86_400_000) as u32;
    call.now_ms = ms;
    call.tiers = vec![tier(Scope::Region, log, 1)];
    set_fake_ms(con, ms).await;
    harness::lua::decide_by(con, sha, &call).await
}

/// Issue 29, item 5, on the script itself at explicit times: limit 2 per
/// 60 s (sliding log), A at 0 s, B at 59 s; A refunded at 59.5 s; C at
/// 59.6 s is admitted; at 60.001 s D must be denied, since B and C are in
/// the window. Popping the newest member (B) for A's refund let D in: three
/// in one window. A refund by handle (the path of the late-reply
/// compensation too) removes the charge's own members; a free-form one the
/// oldest.
#[tokio::test]
async fn a_sliding_log_refund_gives_back_the_charges_own_units() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let sha = harness::lua::load_with_fake_clock(&mut con).await;
    let log = limit(Algorithm::SlidingLog, 2, 60_000, 2);
    let day = today();
    let t0 = u64::from(day) * 86_400_000 + 3_600_000;
    for by_handle in [true, false] {
        let tenant = if by_handle { "slh" } else { "slf" };
        let a = log_check(&mut con, &sha, &log, tenant, "chargeA", t0).await;
        assert!(a.allowed);
        let b = log_check(&mut con, &sha, &log, tenant, "chargeB", t0 + 59_000).await;
        assert!(b.allowed);
        // Refund A at 59.5 s.
        let mut rf = check(tenant, 1);
        rf.op = Op::Refund;
        rf.epoch_candidate = "refund1";
        rf.day = day;
        rf.now_ms = t0 + 59_500;
        rf.tiers = vec![tier(Scope::Region, &log, 1)];
        if by_handle {
            rf.refund = Some(RefundOf {
                id: "chargeA".into(),
                charged_at_ms: a.now_ms as u64,
                expires_at_ms: 0,
            });
        }
        set_fake_ms(&mut con, t0 + 59_500).await;
        harness::lua::decide_by(&mut con, &sha, &rf).await;
        let c = log_check(&mut con, &sha, &log, tenant, "chargeC", t0 + 59_600).await;
        assert!(c.allowed, "C (by handle: {by_handle})");
        let d = log_check(&mut con, &sha, &log, tenant, "chargeD", t0 + 60_001).await;
        assert!(
            !d.allowed,
            "D at 60.001 s: B and C fill the window (by handle: {by_handle})"
        );
        // What is left in the log: B and C.
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(keys::tier_key(
                tenant,
                &keys::region_tier_id(keys::WHOLE_TENANT, 4),
                keys::WHOLE_TENANT,
            ))
            .arg(0)
            .arg(-1)
            .query_async(&mut con)
            .await
            .unwrap();
        let ids: Vec<&str> = members.iter().filter_map(|m| m.split(':').nth(1)).collect();
        assert_eq!(ids, ["chargeB", "chargeC"], "by handle: {by_handle}");
    }
}

/// A global tier of `kind` with `limit`, at Redis' clock `at_ms`: no
/// broadcast seen, no cap.
fn period_tier(
    kind: tierlimit_shared::period::PeriodKind,
    limit: u64,
    at_ms: u64,
) -> region_node::storage::script::PeriodArgs {
    region_node::storage::script::PeriodArgs {
        period: kind.at(at_ms),
        limit,
        broadcast_total: 0,
        own_cap: None,
        own_parts: Vec::new(),
        urgent_at: None,
    }
}

/// The counter fields of (tenant, period): P and N.
async fn period_counter(
    con: &mut redis::aio::MultiplexedConnection,
    tenant: &str,
    period: tierlimit_shared::period::Period,
) -> (Option<u64>, Option<u64>) {
    let g = keys::period_prefix(period);
    redis::cmd("HMGET")
        .arg(keys::tenant_hash(tenant))
        .arg(format!("{g}p"))
        .arg(format!("{g}n"))
        .query_async(con)
        .await
        .unwrap()
}

/// Issue 35: periods in time zones are counters of their own zone: a
/// Berlin day's first counter forgets Berlin days before the previous one,
/// never another zone's day, although both labels are bare day numbers
/// (`<index>@<zone>`). At 23:30 UTC on 2027-01-11 Berlin is on the 12th
/// (its 10th goes) while New York is on the 11th (its 10th, the previous
/// day, stays). Fails if the script reads a zoned label's kind without its
/// zone.
#[tokio::test]
async fn zoned_periods_are_kept_and_forgotten_per_zone() {
    use tierlimit_shared::period::{days_from_civil, PeriodKind};
    use tierlimit_shared::zone::Zone;
    let redis = Redis::start();
    let mut con = redis.client().await;
    let sha = harness::lua::load_with_fake_clock(&mut con).await;
    let (berlin, ny) = (
        Zone::named("Europe/Berlin").unwrap(),
        Zone::named("America/New_York").unwrap(),
    );
    let call_at = |ms: u64| {
        let mut c = check("tz", 1);
        c.global = global(100);
        c.periods = [berlin, ny]
            .into_iter()
            .map(|z| region_node::storage::script::PeriodArgs {
                period: PeriodKind::Day.at_in(z, ms),
                ..period_tier(PeriodKind::Day, 100, ms)
            })
            .collect();
        c.day = (ms / 86_400_000) as u32;
        c.now_ms = ms;
        c
    };
    let jan = |d: u32, h: u64, m: u64| {
        (days_from_civil(2027, 1, d) as u64) * 86_400_000 + h * 3_600_000 + m * 60_000
    };
    let t0 = jan(10, 12, 0);
    harness::lua::set_fake_clock_us(&mut con, t0 * 1000).await;
    let c0 = call_at(t0);
    let (berlin10, ny10) = (c0.periods[0].period, c0.periods[1].period);
    assert_eq!(
        (berlin10.human(), ny10.human()),
        ("2027-01-10".into(), "2027-01-10".into())
    );
    assert!(harness::lua::decide_by(&mut con, &sha, &c0).await.allowed);
    let t1 = jan(11, 23, 30);
    harness::lua::set_fake_clock_us(&mut con, t1 * 1000).await;
    let c1 = call_at(t1);
    assert_eq!(c1.periods[0].period.human(), "2027-01-12");
    assert_eq!(c1.periods[1].period.human(), "2027-01-11");
    let r = harness::lua::decide_by(&mut con, &sha, &c1).await;
    assert!(r.allowed);
    assert_eq!(r.periods_remaining, vec![99, 99], "each zone's day is new");
    assert_eq!(period_counter(&mut con, "tz", berlin10).await, (None, None));
    assert_eq!(
        period_counter(&mut con, "tz", ny10).await,
        (Some(1), Some(0)),
        "New York's previous day is kept"
    );
    assert_eq!(
        period_counter(&mut con, "tz", c1.periods[0].period).await,
        (Some(1), Some(0))
    );
}

/// Issue 33: a tenant with a day, an hour and a month tier, decided in one
/// call on the script's clock across the end of an hour, a leap day and a
/// month (2028-02-29 → 2028-03-01): each tier denies alone, nothing is
/// charged when one denies, a check made for a period Redis' clock has left
/// does nothing, each period's counter is its own (fields and dirty-set
/// member by label), and a refund gives back only to periods still open.
#[tokio::test]
async fn global_tiers_of_several_periods_are_decided_together_across_their_ends() {
    use tierlimit_shared::period::{days_from_civil, Period, PeriodKind};
    let redis = Redis::start();
    let mut con = redis.client().await;
    let sha = harness::lua::load_with_fake_clock(&mut con).await;
    let at = |d: u32, h: u64, m: u64| {
        (days_from_civil(2028, 2, d) as u64) * 86_400_000 + h * 3_600_000 + m * 60_000
    };
    let call_at = |ms: u64| {
        let mut c = check("cal", 1);
        c.global = global(100);
        c.periods = vec![
            period_tier(PeriodKind::Hour, 5, ms),
            period_tier(PeriodKind::Month, 8, ms),
        ];
        c.day = (ms / 86_400_000) as u32;
        c.now_ms = ms;
        c
    };
    // 22:10 on the leap day: the hour allows 5, the sixth is denied by it
    // with a retry at 23:00, and nothing of it is charged anywhere.
    let t0 = at(29, 22, 10);
    harness::lua::set_fake_clock_us(&mut con, t0 * 1000).await;
    let c = call_at(t0);
    let (hour0, feb) = (c.periods[0].period, c.periods[1].period);
    assert_eq!(feb.human(), "2028-02");
    for i in 0..5 {
        let r = harness::lua::decide_by(&mut con, &sha, &c).await;
        assert!(r.allowed, "charge {i}");
        assert_eq!(r.periods_remaining, vec![4 - i, 7 - i]);
    }
    let r = harness::lua::decide_by(&mut con, &sha, &c).await;
    assert_eq!(r.denied, Some(Denied::Period(0)), "the hour denies");
    assert_eq!(r.retry_ms, Some(at(29, 23, 0) - t0));
    assert_eq!(
        period_counter(&mut con, "cal", hour0).await,
        (Some(5), Some(0))
    );
    assert_eq!(period_counter(&mut con, "cal", feb).await.0, Some(5));
    assert_eq!(r.own_p, 5, "the day's counter was not charged either");

    // 23:00: a new hour; the month allows 3 more, then denies until March.
    let t1 = at(29, 23, 0);
    harness::lua::set_fake_clock_us(&mut con, t1 * 1000).await;
    let c1 = call_at(t1);
    for i in 0..3 {
        assert!(
            harness::lua::decide_by(&mut con, &sha, &c1).await.allowed,
            "charge {i}"
        );
    }
    let r = harness::lua::decide_by(&mut con, &sha, &c1).await;
    assert_eq!(r.denied, Some(Denied::Period(1)), "the month denies");
    assert_eq!(r.retry_ms, Some(at(29, 23, 0) + 3_600_000 - t1));
    let feb_charge = t1;

    // Redis' clock passes into March: a check built for February's periods
    // (the node's clock behind) does nothing and is refused as another day.
    let t2 = (days_from_civil(2028, 3, 1) as u64) * 86_400_000 + 1_000;
    harness::lua::set_fake_clock_us(&mut con, t2 * 1000).await;
    let mut stale = call_at(t1);
    stale.day = (t2 / 86_400_000) as u32;
    let err = harness::lua::try_decide_by(&mut con, &sha, &stale).await;
    assert!(matches!(err, Err(ReplyError::OtherDay { .. })), "{err:?}");
    // Built for March, it passes: a new month counter, under a new label.
    let c2 = call_at(t2);
    let mar = c2.periods[1].period;
    assert_eq!(
        (mar.human(), mar.index),
        ("2028-03".to_string(), feb.index + 1)
    );
    let r = harness::lua::decide_by(&mut con, &sha, &c2).await;
    assert!(r.allowed);
    assert_eq!(r.periods_remaining, vec![4, 7]);
    assert_eq!(period_counter(&mut con, "cal", feb).await.0, Some(8));
    assert_eq!(period_counter(&mut con, "cal", mar).await.0, Some(1));
    // Each period's counter is dirty under its own label.
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(keys::dirty(keys::bucket_of("cal")))
        .arg(0)
        .arg(-1)
        .query_async(&mut con)
        .await
        .unwrap();
    for p in [
        mar,
        c2.periods[0].period,
        Period::day((t2 / 86_400_000) as u32),
    ] {
        assert!(
            members.contains(&keys::dirty_member_of("cal", p)),
            "{p} in {members:?}"
        );
    }
    // The hash lives at least until March ends (plus the day TTL).
    let pttl: i64 = redis::cmd("PTTL")
        .arg(keys::tenant_hash("cal"))
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(pttl as u64 >= mar.end_ms() as u64 - t2, "PTTL {pttl}");

    // A refund by handle of February's charge: February and its hour are
    // closed, nothing changes there; the open March counter is not the
    // charge's either.
    let mut rf = call_at(feb_charge);
    rf.op = Op::Refund;
    rf.day = (t2 / 86_400_000) as u32;
    rf.refund = Some(RefundOf {
        id: "feb".into(),
        charged_at_ms: feb_charge,
        expires_at_ms: 0,
    });
    harness::lua::decide_by(&mut con, &sha, &rf).await;
    assert_eq!(
        period_counter(&mut con, "cal", feb).await,
        (Some(8), Some(0))
    );
    assert_eq!(
        period_counter(&mut con, "cal", mar).await,
        (Some(1), Some(0))
    );
    // A refund by handle of March's charge gives back to March and its hour.
    let mut rf = call_at(t2);
    rf.op = Op::Refund;
    rf.refund = Some(RefundOf {
        id: "mar".into(),
        charged_at_ms: t2,
        expires_at_ms: 0,
    });
    harness::lua::decide_by(&mut con, &sha, &rf).await;
    assert_eq!(
        period_counter(&mut con, "cal", mar).await,
        (Some(1), Some(1))
    );
    assert_eq!(
        period_counter(&mut con, "cal", c2.periods[0].period).await,
        (Some(1), Some(1))
    );
}
