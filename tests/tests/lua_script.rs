//! The Lua scripts on their own, against a real redis-server: the decision
//! script's all-or-nothing charging, PN counter and epoch, day selection,
//! dirty-set marking, and the publisher's conditional acknowledgement.

use harness::Redis;
use redis::Value;
use region_node::storage::script::{
    encode, DecideCall, DecideReply, Denied, GlobalArgs, Op, ReplyError, DECIDE_LUA,
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

/// A check of `cost` units by node `n1` on the whole tenant, with no tier
/// set: the tests add the tiers they exercise.
fn check(tenant: &str, cost: u64) -> DecideCall<'_> {
    DecideCall {
        op: Op::Check,
        tenant,
        key: keys::WHOLE_TENANT,
        node_id: "n1",
        cost,
        node: None,
        region: None,
        expected_nodes: 1,
        global: None,
        epoch_candidate: "epochcand",
        day: today(),
        now_ms: tierlimit_shared::messages::now_ms(),
        counter_ttl_secs: 86400 * 3,
    }
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
    Ok(DecideReply::parse(reply))
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
    c.node = Some(&node);
    c.region = Some(&region);
    for _ in 0..3 {
        assert!(decide(&mut con, &c).await.allowed);
    }
    let r = decide(&mut con, &c).await;
    assert!(!r.allowed, "4th must be denied");
    assert_eq!(r.denied, Some(Denied::Region), "denied by the region tier");
    // The node tier kept its 2 remaining units: nothing was charged.
    assert_eq!(r.node.map(|t| t.remaining), Some(2));
    // P counted only the allowed three.
    assert_eq!(r.own_p, 3);
    let node_count: u64 = redis::cmd("HGET")
        .arg(keys::node_tier("t", "n1", "_", node.algorithm.code()))
        .arg("c")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(node_count, 3);
}

#[tokio::test]
async fn pn_counter_epoch_and_dirty_set() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = check("acme", 2);
    c.global = global(100);
    let r = decide(&mut con, &c).await;
    assert_eq!(
        r.epoch, "epochcand",
        "a new counter takes the candidate epoch"
    );
    let r = decide(&mut con, &c).await;
    assert_eq!(r.own_p, 4);
    let score: f64 = redis::cmd("ZSCORE")
        .arg(keys::DIRTY)
        .arg(keys::dirty_member("acme", today()))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(score, 4.0, "dirty score is p + n");
    // Refund: N grows, never past P.
    let mut rf = check("acme", 10);
    rf.op = Op::Refund;
    let r = decide(&mut con, &rf).await;
    assert_eq!((r.own_p, r.own_n), (4, 4), "refund is clamped at P");
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
    let r = decide(&mut con, &c).await;
    assert_eq!(r.own_p, 2);
    assert_eq!(r.epoch, "epochcand");
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
    g.own_parts = vec![("epochcand".into(), 3)];
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
    c.global.as_mut().unwrap().own_parts = vec![("oldepoch".into(), 3)];
    let r = decide(&mut con, &c).await;
    assert!(!r.allowed);
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

#[tokio::test]
async fn charges_the_day_of_redis_clock() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    // The node believes it is yesterday: the script charges today's key.
    let mut c = check("d", 1);
    c.global = Some(GlobalArgs {
        limit: 100,
        // a broadcast for the node's day must be ignored
        broadcast_total: 99,
        ..GlobalArgs::default()
    });
    c.day = today() - 1;
    let r = decide(&mut con, &c).await;
    assert!(r.allowed, "broadcast of another day is not applied");
    assert_eq!(r.day, today());
    let p: u64 = redis::cmd("HGET")
        .arg(keys::pn_counter("d", today()))
        .arg("p")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(p, 1);
    // More than a day off: refused with an error, nothing written.
    c.day = today() - 5;
    assert!(run(&mut con, &c, 0).await.is_err());
}

#[tokio::test]
async fn ack_removes_only_unchanged_entries_and_stamps_every_published_one() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let (now_s, _): (i64, i64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
    let now_ms = now_s * 1000;
    redis::cmd("ZADD")
        .arg("tl:dirty")
        .arg(5)
        .arg("a|1")
        .arg(9)
        .arg("b|1")
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    // c|1 was published 10 s ago: older than the 2 s to remember, so the ack
    // forgets it; d|1 a moment ago stays.
    redis::cmd("ZADD")
        .arg("tl:published")
        .arg(now_ms - 10_000)
        .arg("c|1")
        .arg(now_ms - 500)
        .arg("d|1")
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    // Published a at 5 (unchanged) and b at 7 (a charge raised it to 9 since).
    let removed: i64 = redis::Script::new(ACK)
        .key("tl:dirty")
        .key("tl:published")
        .arg(2000)
        .arg("a|1")
        .arg(5)
        .arg("b|1")
        .arg(7)
        .invoke_async(&mut con)
        .await
        .unwrap();
    assert_eq!(removed, 1);
    let left: Vec<String> = redis::cmd("ZRANGE")
        .arg("tl:dirty")
        .arg(0)
        .arg(-1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(left, vec!["b|1".to_string()]);
    // Both published members are stamped with Redis' time, b although it
    // stayed dirty: it was published, so it is not due again before the
    // relaxed interval unless urgent.
    let stamped: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg("tl:published")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut con)
        .await
        .unwrap();
    let names: Vec<&str> = stamped.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(names, vec!["d|1", "a|1", "b|1"], "{stamped:?}");
    for (m, t) in &stamped[1..] {
        assert!(
            (*t as i64 - now_ms).abs() < 5_000,
            "{m} stamped at {t}, Redis time {now_ms}"
        );
    }
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
        c.region = Some(&region);
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
        rf.region = c.region;
        decide(&mut con, &rf).await;
        let mut again = 0;
        for _ in 0..10 {
            again += u32::from(decide(&mut con, &c).await.allowed);
        }
        assert_eq!(again, 5, "algorithm {code} after refund");
    }
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
        c.region = Some(&region);
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
    c.region = Some(&region);
    assert!(decide(&mut con, &c).await.allowed);
    assert!(decide(&mut con, &c).await.allowed);
    let n: u64 = redis::cmd("ZCARD")
        .arg(keys::region_tier("log", "_", region.algorithm.code()))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(n, 10_000);
    let r = decide(&mut con, &DecideCall { cost: 1, ..c }).await;
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
        c.region = Some(&region);
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
    c.region = Some(&region);
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
