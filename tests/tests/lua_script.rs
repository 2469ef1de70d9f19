//! The Lua scripts on their own, against a real redis-server: the decision
//! script's all-or-nothing charging, PN counter and epoch, day selection,
//! dirty-set marking, and the publisher's conditional acknowledgement.

use harness::Redis;
use redis::Value;

const DECIDE: &str = include_str!("../../region-node/src/lua/decide.lua");
const ACK: &str = include_str!("../../region-node/src/lua/ack.lua");

fn today() -> u32 {
    tierlimit_shared::day::today()
}

/// One tier: (algorithm code, limit, window_ms, burst); code 0 = no tier.
type TierArgs = (u8, u64, u64, u64);

struct Call<'a> {
    op: &'a str,
    cost: u64,
    node: TierArgs,
    region: TierArgs,
    global: u64,
    bc_total: u64,
    cap: i64,
    node_day: u32,
    deadline: i64,
    mine: Vec<(&'a str, u64)>,
}

impl<'a> Call<'a> {
    fn check(cost: u64) -> Call<'a> {
        Call {
            op: "check",
            cost,
            node: (0, 0, 0, 0),
            region: (0, 0, 0, 0),
            global: 0,
            bc_total: 0,
            cap: -1,
            node_day: today(),
            deadline: 0,
            mine: vec![],
        }
    }
}

async fn run(
    con: &mut redis::aio::MultiplexedConnection,
    tenant: &str,
    c: &Call<'_>,
) -> redis::RedisResult<Vec<Value>> {
    let s = redis::Script::new(DECIDE);
    let mut inv = s.prepare_invoke();
    let d = c.node_day;
    inv.key(format!("tl:{{{tenant}}}:n:n1:_"))
        .key(format!("tl:{{{tenant}}}:r:_"))
        .key("tl:dirty")
        .key(format!("tl:{{{tenant}}}:g:{}", d - 1))
        .key(format!("tl:{{{tenant}}}:g:{d}"))
        .key(format!("tl:{{{tenant}}}:g:{}", d + 1));
    inv.arg(c.op).arg(c.cost);
    for t in [c.node, c.region] {
        inv.arg(t.0).arg(t.1).arg(t.2).arg(t.3);
    }
    inv.arg(c.global)
        .arg(c.bc_total)
        .arg(c.cap)
        .arg("epochcand")
        .arg(tenant)
        .arg(d)
        .arg(86400 * 3)
        .arg(c.deadline);
    for (e, p) in &c.mine {
        inv.arg(*e).arg(*p);
    }
    inv.invoke_async(con).await
}

fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        other => panic!("expected an integer, got {other:?}"),
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => panic!("expected a string, got {other:?}"),
    }
}

#[tokio::test]
async fn denial_by_one_tier_charges_no_tier() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    // node 5 per hour (fixed), region 3 per hour (sliding): region denies 4th.
    let mut c = Call::check(1);
    c.node = (1, 5, 3_600_000, 5);
    c.region = (2, 3, 3_600_000, 3);
    for _ in 0..3 {
        assert_eq!(int(&run(&mut con, "t", &c).await.unwrap()[0]), 1);
    }
    let r = run(&mut con, "t", &c).await.unwrap();
    assert_eq!(int(&r[0]), 0, "4th must be denied");
    assert_eq!(int(&r[1]), 2, "denied by the region tier");
    // The node tier kept its 2 remaining units: nothing was charged.
    assert_eq!(int(&r[4]), 2);
    // P counted only the allowed three.
    assert_eq!(int(&r[8]), 3);
    let node_count: u64 = redis::cmd("HGET")
        .arg("tl:{t}:n:n1:_")
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
    let mut c = Call::check(2);
    c.global = 100;
    let r = run(&mut con, "acme", &c).await.unwrap();
    assert_eq!(
        text(&r[10]),
        "epochcand",
        "a new counter takes the candidate epoch"
    );
    let r = run(&mut con, "acme", &c).await.unwrap();
    assert_eq!(int(&r[8]), 4);
    let score: f64 = redis::cmd("ZSCORE")
        .arg("tl:dirty")
        .arg(format!("acme|{}", today()))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(score, 4.0, "dirty score is p + n");
    // Refund: N grows, never past P.
    let mut rf = Call::check(10);
    rf.op = "refund";
    let r = run(&mut con, "acme", &rf).await.unwrap();
    assert_eq!((int(&r[8]), int(&r[9])), (4, 4), "refund is clamped at P");
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
    let r = run(&mut con, "acme", &c).await.unwrap();
    assert_eq!(int(&r[8]), 2);
    assert_eq!(text(&r[10]), "epochcand");
}

#[tokio::test]
async fn global_budget_subtracts_only_other_actors() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = Call::check(1);
    c.global = 10;
    // Create our actor with 3 units.
    for _ in 0..3 {
        assert_eq!(int(&run(&mut con, "g", &c).await.unwrap()[0]), 1);
    }
    // Broadcast says total 8, of which 3 are our current actor: others = 5.
    c.bc_total = 8;
    c.mine = vec![("epochcand", 3)];
    // Budget: 10 - 5 - 3 = 2 more.
    assert_eq!(int(&run(&mut con, "g", &c).await.unwrap()[0]), 1);
    assert_eq!(int(&run(&mut con, "g", &c).await.unwrap()[0]), 1);
    let r = run(&mut con, "g", &c).await.unwrap();
    assert_eq!(
        (int(&r[0]), int(&r[1])),
        (0, 3),
        "denied by the global tier"
    );
    assert_eq!(int(&r[8]), 5);
    // An older epoch of this region counts as others.
    c.mine = vec![("oldepoch", 3)];
    let r = run(&mut con, "g", &c).await.unwrap();
    assert_eq!(int(&r[0]), 0);
    // A staleness cap below the current count denies too.
    let mut c2 = Call::check(1);
    c2.global = 1000;
    c2.cap = 5;
    let r = run(&mut con, "g", &c2).await.unwrap();
    assert_eq!((int(&r[0]), int(&r[1])), (0, 3));
}

#[tokio::test]
async fn charges_the_day_of_redis_clock() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    // The node believes it is yesterday: the script charges today's key.
    let mut c = Call::check(1);
    c.global = 100;
    c.node_day = today() - 1;
    c.bc_total = 99; // a broadcast for the node's day must be ignored
    let r = run(&mut con, "d", &c).await.unwrap();
    assert_eq!(int(&r[0]), 1, "broadcast of another day is not applied");
    assert_eq!(int(&r[11]), i64::from(today()));
    let p: u64 = redis::cmd("HGET")
        .arg(format!("tl:{{d}}:g:{}", today()))
        .arg("p")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(p, 1);
    // More than a day off: refused with an error, nothing written.
    c.node_day = today() - 5;
    assert!(run(&mut con, "d", &c).await.is_err());
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
    for code in 1..=4u8 {
        let tenant = format!("alg{code}");
        let mut c = Call::check(1);
        c.region = (code, 25, 3_600_000, 25);
        let mut allowed = 0;
        for _ in 0..60 {
            allowed += int(&run(&mut con, &tenant, &c).await.unwrap()[0]);
        }
        assert_eq!(allowed, 25, "algorithm {code}");
        // A denial reports a positive retry-after.
        let r = run(&mut con, &tenant, &c).await.unwrap();
        assert!(int(&r[2]) > 0, "algorithm {code} retry {}", int(&r[2]));
        // Refund 5 → exactly 5 more pass (never more than refunded).
        let mut rf = Call::check(5);
        rf.op = "refund";
        rf.region = c.region;
        run(&mut con, &tenant, &rf).await.unwrap();
        let mut again = 0;
        for _ in 0..10 {
            again += int(&run(&mut con, &tenant, &c).await.unwrap()[0]);
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
    for i in 0..50 {
        let mut c = Call::check(2);
        c.region = (3, 3, 1000, 2);
        let r = run(&mut con, &format!("gcra{i}"), &c).await.unwrap();
        assert_eq!(int(&r[0]), 1, "attempt {i}");
    }
}

#[tokio::test]
async fn sliding_log_takes_a_large_cost_atomically() {
    // Lua's unpack() caps at ~8000 values: 5000 units are added in chunks.
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = Call::check(5000);
    c.region = (4, 10_000, 3_600_000, 10_000);
    assert_eq!(int(&run(&mut con, "log", &c).await.unwrap()[0]), 1);
    assert_eq!(int(&run(&mut con, "log", &c).await.unwrap()[0]), 1);
    let n: u64 = redis::cmd("ZCARD")
        .arg("tl:{log}:r:_")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(n, 10_000);
    let r = run(&mut con, "log", &Call { cost: 1, ..c }).await.unwrap();
    assert_eq!(int(&r[0]), 0);
}

#[tokio::test]
async fn a_cost_above_the_limit_is_never_retryable() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    for code in 1..=4u8 {
        let mut c = Call::check(11);
        c.region = (code, 10, 60_000, 10);
        let r = run(&mut con, &format!("big{code}"), &c).await.unwrap();
        assert_eq!(
            (int(&r[0]), int(&r[2])),
            (0, -1),
            "algorithm {code}: retry -1 means never"
        );
    }
}

#[tokio::test]
async fn a_call_past_its_deadline_charges_nothing() {
    let redis = Redis::start();
    let mut con = redis.client().await;
    let mut c = Call::check(1);
    c.region = (1, 10, 3_600_000, 10);
    c.global = 100;
    // A deadline already passed in Redis' clock: refused, nothing written.
    c.deadline = 1;
    let r = run(&mut con, "late", &c).await.unwrap();
    assert_eq!((int(&r[0]), int(&r[1])), (0, 4), "expired");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(keys.is_empty(), "nothing written: {keys:?}");
    // A deadline in the future: charged as usual.
    c.deadline = i64::MAX / 2;
    assert_eq!(int(&run(&mut con, "late", &c).await.unwrap()[0]), 1);
}
