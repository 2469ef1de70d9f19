//! region-node over HTTP against a real redis-server: exactness under
//! concurrency for every algorithm, all-or-nothing across tiers, refunds,
//! cost > 1, odd windows, Redis failure modes, bad input, config reload.
//!
//! Kafka is pointed at a closed port here: the node and region tiers must
//! not depend on it (the global tier has its own suite).

use std::sync::Arc;
use std::time::Duration;

use harness::{temp_dir, wait_for, wait_until, write_config, Redis, RegionNode};
use serde_json::{json, Value};

const ALGORITHMS: [&str; 4] = [
    "fixed_window",
    "sliding_window",
    "token_bucket",
    "sliding_log",
];

/// Two nodes expected in the region (the `local` fail mode's share).
fn config(redis: &Redis, extra: &str) -> String {
    harness::config::one_region(&redis.url(), 2, extra)
}

async fn check(node: &RegionNode, tenant: &str, cost: u64) -> (u16, Value) {
    let r = node
        .http
        .post(node.url("/v1/check"))
        .json(&json!({ "tenant": tenant, "cost": cost }))
        .send()
        .await
        .expect("check request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn usage(node: &RegionNode, tenant: &str) -> Value {
    harness::get_json(&node.http, &node.url(&format!("/v1/tenants/{tenant}"))).await
}

fn remaining(v: &Value, tier: &str) -> u64 {
    v["tiers"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["tier"] == tier))
        .and_then(|t| t["remaining"].as_u64())
        .unwrap_or_else(|| panic!("no {tier} tier in {v}"))
}

/// 16 concurrent clients fire `total` checks spread over `nodes`; returns how
/// many were allowed.
async fn hammer(nodes: &[Arc<RegionNode>], tenant: &str, total: usize) -> usize {
    let clients = 16;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let node = Arc::clone(&nodes[c % nodes.len()]);
        let tenant = tenant.to_string();
        let n = total / clients;
        tasks.push(tokio::spawn(async move {
            let mut allowed = 0;
            for _ in 0..n {
                let (status, _) = check(&node, &tenant, 1).await;
                assert!(status == 200 || status == 429, "unexpected status {status}");
                allowed += usize::from(status == 200);
            }
            allowed
        }));
    }
    let mut sum = 0;
    for t in tasks {
        sum += t.await.unwrap();
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exact_under_concurrency_for_every_algorithm_and_both_tiers() {
    let redis = Redis::start();
    let dir = temp_dir();
    let mut plans = String::new();
    for alg in ALGORITHMS {
        // One window long enough that the test never crosses it.
        plans += &format!(
            "[plans.region-{alg}]\nregion = {{ limit = 100, window = \"1h\", algorithm = \"{alg}\" }}\n\
             [plans.node-{alg}]\nnode = {{ limit = 100, window = \"1h\", algorithm = \"{alg}\" }}\n\
             [tenants.r-{alg}]\nplan = \"region-{alg}\"\n[tenants.n-{alg}]\nplan = \"node-{alg}\"\n"
        );
    }
    let cfg = write_config(dir.path(), &config(&redis, &plans));
    let a = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    let b = Arc::new(RegionNode::start(&cfg, "eu", "b").await);
    for alg in ALGORITHMS {
        // Region tier: two nodes share it through Redis.
        let allowed = hammer(&[Arc::clone(&a), Arc::clone(&b)], &format!("r-{alg}"), 2000).await;
        assert_eq!(allowed, 100, "region tier, {alg}");
        // Node tier: each node has its own 100.
        let allowed = hammer(&[Arc::clone(&a)], &format!("n-{alg}"), 2000).await;
        assert_eq!(allowed, 100, "node tier on node a, {alg}");
        let allowed = hammer(&[Arc::clone(&b)], &format!("n-{alg}"), 400).await;
        assert_eq!(allowed, 100, "node tier on node b, {alg}");
    }
}

#[tokio::test]
async fn all_or_nothing_across_node_and_region_tiers() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.p]
node = { limit = 5, window = "1h", algorithm = "fixed_window" }
region = { limit = 8, window = "1h", algorithm = "fixed_window" }
[tenants.t]
plan = "p"
"#,
        ),
    );
    let a = RegionNode::start(&cfg, "eu", "a").await;
    let b = RegionNode::start(&cfg, "eu", "b").await;
    for _ in 0..5 {
        assert_eq!(check(&a, "t", 1).await.0, 200);
    }
    // Denied by node a's tier: the region tier must not be charged.
    let (s, body) = check(&a, "t", 1).await;
    assert_eq!(s, 429);
    assert_eq!(body["violated-policy"], "node");
    assert_eq!(remaining(&usage(&a, "t").await, "region"), 3);
    // Node b takes the region's last 3, then the region denies.
    for _ in 0..3 {
        assert_eq!(check(&b, "t", 1).await.0, 200);
    }
    let (s, body) = check(&b, "t", 1).await;
    assert_eq!(s, 429);
    assert_eq!(body["violated-policy"], "region");
    // Denied by the region: node b's own tier kept its 2 units.
    for _ in 0..3 {
        assert_eq!(check(&b, "t", 1).await.0, 429);
    }
    assert_eq!(remaining(&usage(&b, "t").await, "node"), 2);
}

/// The time region-node adds around its Redis call is exported apart
/// (issue 37 item 2: BENCHMARKS §2 judges it from the server, not from two
/// loaded client runs): every check decided by one script call adds one
/// observation of (its decision time − that call's round trip), so the
/// three histograms' sums add up, and a lease's or the view's decision,
/// which calls no script, adds none.
#[tokio::test]
async fn the_time_around_the_redis_call_is_exported_apart() {
    let redis = Redis::start();
    let dir = temp_dir();
    // A region tier only (no node-tier reservation), no lease: one script
    // call per check, and no other decide call (no usage read) until the
    // metrics are read.
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.p]
region = { limit = 30, window = "1h" }
lease_max = 0
[tenants.t]
plan = "p"
"#,
        ),
    );
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let checks = 40;
    for i in 0..checks {
        let (s, body) = check(&n, "t", 1).await;
        assert_eq!(s, if i < 30 { 200 } else { 429 }, "{body}");
        assert_eq!(body["mode"], "redis", "{body}");
    }
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    let sample = |name: &str| harness::metric_sample(&m, name).unwrap_or(f64::NAN);
    let decisions = sample("tierlimit_decision_seconds_count");
    let calls = sample("tierlimit_redis_seconds_count{op=\"decide\"}");
    let around = sample("tierlimit_decision_overhead_seconds_count");
    assert_eq!((decisions, calls, around), (40.0, 40.0, 40.0), "{m}");
    // Σ(decision − call) = Σ decision − Σ call, each call once: a missing
    // or zero round trip would make the rest equal the decisions' sum.
    let (took, call, rest) = (
        sample("tierlimit_decision_seconds_sum"),
        sample("tierlimit_redis_seconds_sum{op=\"decide\"}"),
        sample("tierlimit_decision_overhead_seconds_sum"),
    );
    assert!(call > 0.0 && rest > 0.0, "{m}");
    assert!(
        (took - call - rest).abs() < 1e-6,
        "decision {took} s = call {call} s + around it {rest} s"
    );
    assert!(rest < took, "{m}");
}

#[tokio::test]
async fn refunds_cost_and_unusual_windows() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.p]
region = { limit = 10, window = "7s", algorithm = "fixed_window" }
node = { limit = 10, window = "90m", algorithm = "sliding_window" }
global = { limit = 1000 }
[tenants.t]
plan = "p"
"#,
        ),
    );
    let n = RegionNode::start(&cfg, "eu", "a").await;
    // cost > 1: 4 + 4 fit in 10, a third 4 does not, 2 does.
    assert_eq!(check(&n, "t", 4).await.0, 200);
    let (s, body) = check(&n, "t", 4).await;
    assert_eq!(s, 200);
    assert_eq!(remaining(&body, "region"), 2);
    let region = body["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "region")
        .unwrap()
        .clone();
    assert!(
        region["reset_ms"].as_u64().unwrap() <= 7000,
        "a 7s window resets within 7s: {region}"
    );
    assert_eq!(region["window_ms"], 7000);
    let node = body["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "node")
        .unwrap()
        .clone();
    assert_eq!(node["window_ms"], 90 * 60 * 1000);
    // The 7s window may roll over between requests; only check while inside it.
    let (s, _) = check(&n, "t", 4).await;
    let u = usage(&n, "t").await;
    if remaining(&u, "region") == 2 {
        assert_eq!(s, 429);
    }
    // Refund 3 units: the 90m sliding window gets them back.
    let before = remaining(&usage(&n, "t").await, "node");
    let r = n
        .http
        .post(n.url("/v1/refund"))
        .json(&json!({ "tenant": "t", "cost": 3 }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let u = usage(&n, "t").await;
    assert_eq!(remaining(&u, "node"), before + 3);
    assert_eq!(u["region_n"], 3);
    // A refund larger than what was spent never goes below zero.
    for _ in 0..3 {
        n.http
            .post(n.url("/v1/refund"))
            .json(&json!({ "tenant": "t", "cost": 100 }))
            .send()
            .await
            .unwrap();
    }
    let u = usage(&n, "t").await;
    assert_eq!(remaining(&u, "node"), 10, "refunds cap at the limit");
    assert_eq!(u["region_n"], u["region_p"], "N never exceeds P");
}

#[tokio::test]
async fn bad_input_is_4xx_problem_json_and_charges_nothing() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.p]
region = { limit = 10, window = "1h" }
[tenants.t]
plan = "p"
"#,
        ),
    );
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let long = "x".repeat(65);
    let cases: Vec<(&str, String, &str, u16)> = vec![
        (
            "missing tenant",
            r#"{"cost":1}"#.into(),
            "application/json",
            400,
        ),
        (
            "oversize tenant",
            format!(r#"{{"tenant":"{long}"}}"#),
            "application/json",
            400,
        ),
        (
            "malformed tenant",
            r#"{"tenant":"t:x"}"#.into(),
            "application/json",
            400,
        ),
        (
            "hash-tag tenant",
            r#"{"tenant":"t}x{"}"#.into(),
            "application/json",
            400,
        ),
        (
            "bad key",
            r#"{"tenant":"t","key":"a b"}"#.into(),
            "application/json",
            400,
        ),
        (
            "cost 0",
            r#"{"tenant":"t","cost":0}"#.into(),
            "application/json",
            400,
        ),
        (
            "negative cost",
            r#"{"tenant":"t","cost":-1}"#.into(),
            "application/json",
            400,
        ),
        (
            "fractional cost",
            r#"{"tenant":"t","cost":1.5}"#.into(),
            "application/json",
            400,
        ),
        (
            "huge cost",
            r#"{"tenant":"t","cost":99999999999999999999}"#.into(),
            "application/json",
            400,
        ),
        (
            "over max cost",
            r#"{"tenant":"t","cost":1000000000001}"#.into(),
            "application/json",
            400,
        ),
        (
            "invalid JSON",
            r#"{"tenant":"#.into(),
            "application/json",
            400,
        ),
        (
            "unknown field",
            r#"{"tenant":"t","cots":1}"#.into(),
            "application/json",
            400,
        ),
        (
            "wrong content type",
            r#"{"tenant":"t"}"#.into(),
            "text/plain",
            415,
        ),
        (
            "unknown tenant",
            r#"{"tenant":"nobody"}"#.into(),
            "application/json",
            403,
        ),
    ];
    for (what, body, ct, want) in &cases {
        let r = n
            .http
            .post(n.url("/v1/check"))
            .header("content-type", *ct)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), *want, "{what}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
        let p: Value = r.json().await.unwrap();
        assert_eq!(p["status"], *want, "{what}: {p}");
        assert!(
            p["type"].as_str().unwrap().starts_with("https://"),
            "{what}: {p}"
        );
        assert!(!p["detail"].as_str().unwrap().is_empty(), "{what}");
    }
    // Field named for field errors.
    let r = n
        .http
        .get(n.url("/v1/check?tenant=t&cost=abc"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "cost");
    let r = n.http.get(n.url("/v1/check?cost=1")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    // A parameter given twice is refused, not "the last one wins".
    let r = n
        .http
        .get(n.url("/v1/check?tenant=a:b&tenant=t"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["field"], "tenant", "{p}");
    // A body past the limit: 413 as problem+json, on check and refund.
    let big = format!(r#"{{"tenant":"t","pad":"{}"}}"#, "x".repeat(100 * 1024));
    for path in ["/v1/check", "/v1/refund"] {
        let r = n
            .http
            .post(n.url(path))
            .header("content-type", "application/json")
            .body(big.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413, "{path}");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        let p: Value = r.json().await.unwrap();
        assert_eq!(p["status"], 413, "{p}");
    }
    // Nothing was charged by any of it.
    assert_eq!(remaining(&usage(&n, "t").await, "region"), 10);
    // The forward-auth form works for a good request.
    let r = n
        .http
        .get(n.url("/v1/check?tenant=t&cost=2"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("ratelimit-policy"));
    assert_eq!(remaining(&usage(&n, "t").await, "region"), 8);
}

#[tokio::test]
async fn rate_limit_headers_and_retry_after() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.p]
node = { limit = 2, window = "1h", algorithm = "fixed_window" }
region = { limit = 600, window = "1m" }
[tenants.t]
plan = "p"
"#,
        ),
    );
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let r = n
        .http
        .post(n.url("/v1/check"))
        .json(&json!({"tenant":"t"}))
        .send()
        .await
        .unwrap();
    let h = r.headers();
    assert_eq!(
        h["ratelimit-policy"],
        "\"node\";q=2;w=3600, \"region\";q=600;w=60"
    );
    assert!(h["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with("\"node\";r=1;t="));
    assert_eq!(h["x-ratelimit-limit"], "2");
    assert_eq!(h["x-ratelimit-remaining"], "1");
    check(&n, "t", 1).await;
    let r = n
        .http
        .post(n.url("/v1/check"))
        .json(&json!({"tenant":"t"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry > 0 && retry <= 3600);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["violated-policy"], "node");
    // A cost that can never fit: 429 without Retry-After.
    let r = n
        .http
        .post(n.url("/v1/check"))
        .json(&json!({"tenant":"t","cost":3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(!r.headers().contains_key("retry-after"));
}

#[tokio::test]
async fn redis_killed_each_fail_mode_then_recovery() {
    let mut redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.open]
region = { limit = 4, window = "1h", algorithm = "fixed_window" }
on_store_error = "open"
[plans.closed]
region = { limit = 4, window = "1h", algorithm = "fixed_window" }
on_store_error = "closed"
[plans.local]
node = { limit = 100, window = "1h", algorithm = "fixed_window" }
region = { limit = 10, window = "1h", algorithm = "fixed_window" }
on_store_error = "local"
[tenants.o]
plan = "open"
[tenants.c]
plan = "closed"
[tenants.l]
plan = "local"
"#,
        ),
    );
    let n = RegionNode::start(&cfg, "eu", "a").await;
    for t in ["o", "c", "l"] {
        let (s, body) = check(&n, t, 1).await;
        assert_eq!(s, 200);
        assert_eq!(body["mode"], "redis");
    }
    redis.kill();
    // open: allowed, unchecked, even past the region limit.
    for _ in 0..6 {
        let (s, body) = check(&n, "o", 1).await;
        assert_eq!(s, 200);
        assert_eq!(body["mode"], "open");
    }
    // closed: 503 problem+json naming the store.
    let r = n
        .http
        .post(n.url("/v1/check"))
        .json(&json!({"tenant":"c"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    // local: region limit 10 / 2 expected nodes = 5 on this node.
    let mut allowed = 0;
    for _ in 0..12 {
        let (s, body) = check(&n, "l", 1).await;
        assert_eq!(body["mode"], "local", "{body}");
        allowed += usize::from(s == 200);
    }
    assert_eq!(
        allowed, 5,
        "local mode enforces the node's share of the region limit"
    );
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    assert!(m.contains("tierlimit_store_up 0"), "store_up gauge drops");
    assert!(m.contains("tierlimit_fail_mode_decisions_total{mode=\"local\"}"));
    let r: Value = harness::get_json(&n.http, &n.url("/readyz")).await;
    assert_eq!(r["redis"], false, "readiness reports Redis: {r}");
    // Redis comes back (empty): the node returns to it by itself.
    redis.restart_empty();
    wait_until(
        "the node decides with Redis again",
        Duration::from_secs(10),
        || async { check(&n, "c", 1).await.1["mode"] == "redis" },
    )
    .await;
    let (s, body) = check(&n, "l", 1).await;
    assert_eq!((s, body["mode"].as_str()), (200, Some("redis")));
}

#[tokio::test]
async fn sighup_reload_good_and_bad() {
    let redis = Redis::start();
    let dir = temp_dir();
    let plan = |limit: u64| {
        format!("[plans.p]\nregion = {{ limit = {limit}, window = \"1h\" }}\n[tenants.t]\nplan = \"p\"\n")
    };
    let cfg = write_config(dir.path(), &config(&redis, &plan(5)));
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let limit = |v: &Value| {
        v["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == "region")
            .unwrap()["limit"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(limit(&usage(&n, "t").await), 5);
    write_config(dir.path(), &config(&redis, &plan(7)));
    n.proc.hup();
    wait_until("the new limit applies", Duration::from_secs(5), || async {
        limit(&usage(&n, "t").await) == 7
    })
    .await;
    // An invalid file: the old configuration stays, the process lives on.
    write_config(
        dir.path(),
        &config(
            &redis,
            "[plans.p]\nregion = { limit = 0, window = \"1h\" }\n[tenants.t]\nplan = \"p\"\n",
        ),
    );
    n.proc.hup();
    let m = wait_for(
        "the refused reload is counted",
        Duration::from_secs(5),
        || async {
            let m = harness::try_text(&n.http, &n.admin_url("/metrics")).await?;
            m.contains("tierlimit_config_reloads_total{result=\"refused\"} 1")
                .then_some(m)
        },
    )
    .await;
    assert!(m.contains("tierlimit_config_reloads_total{result=\"ok\"} 1"));
    assert_eq!(limit(&usage(&n, "t").await), 7);
    assert!(
        n.proc.log().contains("plans.p.region.limit"),
        "the log names the bad key"
    );
}

/// One slow Redis call takes the fail mode for that request only; the
/// breaker opens once Redis has answered nothing for
/// `node.store_unavailable_after` (250 ms by default) while calls waited.
#[tokio::test]
async fn one_slow_call_does_not_open_the_breaker_three_do() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = config(
        &redis,
        r#"
[plans.p]
region = { limit = 1000, window = "1h" }
on_store_error = "open"
# Every check in Redis: the breaker is what is tested (a plan switches
# leasing off with its own lease_max = 0).
lease_max = 0
[tenants.t]
plan = "p"
"#,
    )
    .replace(r#"store_timeout = "2s""#, r#"store_timeout = "100ms""#);
    let cfg = write_config(dir.path(), &cfg);
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let mut admin = redis.client().await;
    let store_up = || async {
        let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
        m.lines()
            .find(|l| l.starts_with("tierlimit_store_up "))
            .unwrap()
            .to_string()
    };
    assert_eq!(check(&n, "t", 1).await.1["mode"], "redis");
    // Redis stalls for 500 ms: one request times out and is answered open.
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(500)
        .arg("ALL")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert_eq!(check(&n, "t", 1).await.1["mode"], "open");
    assert_eq!(
        store_up().await,
        "tierlimit_store_up 1",
        "a single timeout keeps the breaker closed"
    );
    wait_until("Redis answers again", Duration::from_secs(5), || async {
        check(&n, "t", 1).await.1["mode"] == "redis"
    })
    .await;
    // A longer stall: by the third timeout Redis has been silent for 300 ms,
    // past the threshold, and the breaker opens.
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .arg("ALL")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    for _ in 0..3 {
        assert_eq!(check(&n, "t", 1).await.1["mode"], "open");
    }
    assert_eq!(store_up().await, "tierlimit_store_up 0");
    // The pause ends by itself (an UNPAUSE would be paused too).
    wait_until(
        "the probe closes the breaker",
        Duration::from_secs(10),
        || async { store_up().await == "tierlimit_store_up 1" },
    )
    .await;
}

/// The breaker's probe asks `ROLE`, not PING: a node pointed at a replica
/// (a failover behind a fixed URL) stays in its fail mode instead of
/// flapping back to a server that refuses its writes, and returns to Redis
/// once that server is a master again.
#[tokio::test]
async fn a_replica_is_not_taken_for_the_master() {
    let master = Redis::start();
    let replica = Redis::start();
    let mut admin = replica.client().await;
    redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(master.port())
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let dir = temp_dir();
    let cfg = config(
        &replica,
        r#"
[plans.p]
region = { limit = 1000, window = "1h" }
on_store_error = "open"
[tenants.t]
plan = "p"
"#,
    );
    let cfg = write_config(dir.path(), &cfg);
    let n = RegionNode::start(&cfg, "eu", "a").await;
    for _ in 0..3 {
        let (status, body) = check(&n, "t", 1).await;
        assert_eq!(
            (status, body["mode"].as_str()),
            (200, Some("open")),
            "{body}"
        );
    }
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    assert!(
        m.contains("tierlimit_store_up 0"),
        "a replica is not a store"
    );
    // Promoted: the probe sees a master and the node uses it.
    redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    wait_until(
        "the node decides in Redis again",
        Duration::from_secs(10),
        || async { check(&n, "t", 1).await.1["mode"] == "redis" },
    )
    .await;
}

/// A Redis that may evict counters is refused at start with an error that
/// names the setting; `--allow-eviction` accepts it and says so in a metric.
#[tokio::test]
async fn an_evicting_redis_is_refused_unless_allowed() {
    let redis = Redis::start();
    let mut admin = redis.client().await;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-lru")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let dir = temp_dir();
    let plans = "[plans.p]\nregion = { limit = 10, window = \"1h\" }\n[tenants.t]\nplan = \"p\"\n";
    let cfg = write_config(dir.path(), &config(&redis, plans));
    let mut refused = harness::Cmd::new(harness::bin_path("region-node"))
        .args(["--config"])
        .arg(&cfg)
        .args(["--region", "eu", "--node-id", "a", "--listen"])
        .arg(format!("127.0.0.1:{}", harness::free_port()))
        .spawn();
    let status = refused
        .wait_exit(Duration::from_secs(30))
        .expect("region-node exits at start");
    assert!(!status.success());
    let log = refused.log();
    assert!(
        log.contains("maxmemory-policy is volatile-lru") && log.contains("--allow-eviction"),
        "the error names the setting and the way out:\n{log}"
    );
    let n =
        RegionNode::start_with_env(&cfg, "eu", "a", &[("TIERLIMIT_ALLOW_EVICTION", "true")]).await;
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    assert!(m.contains("tierlimit_redis_eviction_allowed 1"), "{m}");
}

/// Refund handles (issue 13): an allowed check answers a handle signed with
/// the region's secret; a refund by handle gives the charge back once, never
/// more than it, and only into windows the charge was in. A forged handle,
/// or a handle beside a tenant, is refused; free-form refunds can be turned
/// off.
#[tokio::test]
async fn refund_handles_give_back_once_and_only_into_the_charges_window() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.p]
region = { limit = 10, window = "2s", algorithm = "fixed_window" }
node = { limit = 100, window = "1h", algorithm = "sliding_window" }
global = { limit = 1000 }
[tenants.t]
plan = "p"
"#,
        ),
    );
    let env = [
        (
            "TIERLIMIT__NODE__REFUND_SECRET",
            "0123456789abcdef0123456789abcdef-test",
        ),
        ("TIERLIMIT__NODE__FREE_FORM_REFUNDS", "false"),
    ];
    let n = RegionNode::start_with_env(&cfg, "eu", "a", &env).await;
    let refund = |body: Value| {
        let n = &n;
        async move {
            let r = n
                .http
                .post(n.url("/v1/refund"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let spent = |u: &Value| u["region_p"].as_u64().unwrap() - u["region_n"].as_u64().unwrap();

    // Wait for a fresh 2 s window with most of it left, so that the first
    // charges and their refunds share it.
    wait_until("a fresh region window", Duration::from_secs(5), || async {
        let u = usage(&n, "t").await;
        let region = u["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == "region")
            .cloned()
            .unwrap();
        region["reset_ms"].as_u64().unwrap() > 1500
    })
    .await;
    let (s, body) = check(&n, "t", 3).await;
    assert_eq!(s, 200);
    let h1 = body["refund_handle"]
        .as_str()
        .expect("a handle")
        .to_string();
    assert_eq!(remaining(&body, "region"), 7);

    // Given back once, all of it.
    let (s, r) = refund(json!({ "handle": h1 })).await;
    assert_eq!(
        (s, r["refunded"].as_u64(), r["duplicate"].as_bool()),
        (200, Some(3), Some(false)),
        "{r}"
    );
    let u = usage(&n, "t").await;
    assert_eq!(remaining(&u, "node"), 100);
    assert_eq!(spent(&u), 0);
    // A retried refund gives nothing more: refused as used (issue 29).
    let (s, r) = refund(json!({ "handle": h1 })).await;
    assert_eq!((s, r["duplicate"].as_bool()), (409, Some(true)), "{r}");
    assert_eq!(spent(&usage(&n, "t").await), 0);

    // Forged: one character of the signature changed (a changed payload
    // is refused the same way: see region-node's refund tests).
    let forged = {
        let mut chars: Vec<char> = h1.chars().collect();
        let last = chars.len() - 1;
        chars[last] = if chars[last] == 'A' { 'B' } else { 'A' };
        chars.into_iter().collect::<String>()
    };
    let (s, r) = refund(json!({ "handle": forged })).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(r["field"], "handle", "{r}");
    let (s, _) = refund(json!({ "handle": h1, "tenant": "t" })).await;
    assert_eq!(s, 400);
    // Free-form refunds are off here.
    let (s, r) = refund(json!({ "tenant": "t", "cost": 1 })).await;
    assert_eq!(s, 403, "{r}");

    // A charge refunded after its region window rolled over: the node tier
    // (1 h) and the day's count get it back, the new region window does not.
    let (s, body) = check(&n, "t", 2).await;
    assert_eq!(s, 200);
    let h2 = body["refund_handle"].as_str().unwrap().to_string();
    let node_before = remaining(&body, "node");
    wait_until(
        "the region window rolls over",
        Duration::from_secs(5),
        || async { remaining(&usage(&n, "t").await, "region") == 10 },
    )
    .await;
    assert_eq!(check(&n, "t", 1).await.0, 200);
    let (s, r) = refund(json!({ "handle": h2 })).await;
    assert_eq!((s, r["refunded"].as_u64()), (200, Some(2)), "{r}");
    let u = usage(&n, "t").await;
    assert_eq!(
        remaining(&u, "region"),
        9,
        "nothing given back to a window the charge was not in"
    );
    assert_eq!(remaining(&u, "node"), node_before + 2 - 1);
    assert_eq!(spent(&u), 1);
}

/// Checks `ids` fresh tenant ids over `nodes` from 16 clients; returns the
/// ids that were allowed and the refusals' `violated-policy` values.
async fn flood(nodes: &[Arc<RegionNode>], prefix: &str, ids: usize) -> (Vec<String>, Vec<String>) {
    let clients = 16;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let node = Arc::clone(&nodes[c % nodes.len()]);
        let prefix = prefix.to_string();
        tasks.push(tokio::spawn(async move {
            let (mut allowed, mut refused) = (Vec::new(), Vec::new());
            for i in (c..ids).step_by(clients) {
                let tenant = format!("{prefix}-{i}");
                let r = node
                    .http
                    .post(node.url("/v1/check"))
                    .json(&json!({ "tenant": tenant, "cost": 1 }))
                    .send()
                    .await
                    .expect("check request");
                match r.status().as_u16() {
                    200 => allowed.push(tenant),
                    429 => {
                        let retry: u64 = r.headers()["retry-after"]
                            .to_str()
                            .unwrap()
                            .parse()
                            .unwrap();
                        assert!(retry >= 1, "Retry-After {retry}");
                        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
                        assert_eq!(ct, "application/problem+json");
                        let body: Value = r.json().await.unwrap();
                        assert!(
                            body["type"]
                                .as_str()
                                .unwrap()
                                .ends_with("/newcomer-refused"),
                            "{body}"
                        );
                        refused.push(body["violated-policy"].as_str().unwrap().to_string());
                    }
                    s => panic!("unexpected status {s}"),
                }
            }
            (allowed, refused)
        }));
    }
    let (mut allowed, mut refused) = (Vec::new(), Vec::new());
    for t in tasks {
        let (a, r) = t.await.unwrap();
        allowed.extend(a);
        refused.extend(r);
    }
    (allowed, refused)
}

/// A region whose unknown tenants get plan `free` under the newcomer
/// limits `gate`, and one configured tenant, `known`.
fn newcomer_config(redis: &Redis, gate: &str) -> String {
    config(redis, "").replace(
        "[unknown_tenants]\npolicy = \"deny\"",
        &format!(
            "[plans.free]\nregion = {{ limit = 5, window = \"1h\" }}\n\
             [tenants.known]\nplan = \"free\"\n\
             [unknown_tenants]\npolicy = \"plan\"\nplan = \"free\"\n{gate}"
        ),
    )
}

/// Keys of tenant hashes in the region's Redis (`tl:{bucket}:t:<tenant>`).
async fn tenant_hashes(redis: &Redis) -> usize {
    let mut c = redis.client().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tl:*:t:*")
        .query_async(&mut c)
        .await
        .unwrap();
    keys.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_invented_tenants_is_bounded_per_region() {
    let redis = Redis::start();
    let dir = temp_dir();
    // The day's quota (60) is shared by both nodes; the rate quota is out
    // of the way here.
    let cfg = write_config(
        dir.path(),
        &newcomer_config(&redis, "max_new_per_second = 100000\nmax_per_day = 60"),
    );
    let a = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    let b = Arc::new(RegionNode::start(&cfg, "eu", "b").await);
    let rss_before = harness::rss_kib(a.proc.pid()).unwrap();

    let known_before = check(&a, "known", 1).await.0;
    let (allowed, refused) = flood(&[Arc::clone(&a), Arc::clone(&b)], "inv", 3000).await;
    assert_eq!(
        allowed.len(),
        60,
        "exactly the region's day quota, across both nodes"
    );
    assert_eq!(refused.len(), 3000 - 60);
    assert!(
        refused.iter().all(|r| r == "refused_day"),
        "{:?}",
        &refused[..3]
    );
    // What the flood left in Redis: one hash per admitted tenant, no more.
    assert_eq!(tenant_hashes(&redis).await, 60 + 1);
    let mut c = redis.client().await;
    let today = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 86_400) as u32;
    let admitted: usize = redis::cmd("SCARD")
        .arg(tierlimit_shared::keys::newcomers(today))
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(admitted, 60);
    // What one admitted newcomer costs Redis (README states the bound).
    let hash = tierlimit_shared::keys::tenant_hash(&allowed[0]);
    let bytes: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&hash)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(bytes <= 512, "{hash} takes {bytes} bytes");

    // Known tenants never meet the gate; admitted newcomers keep working
    // on the node that did not admit them.
    assert_eq!(known_before, 200);
    assert_eq!(check(&b, "known", 1).await.0, 200);
    for t in allowed.iter().take(5) {
        assert_eq!(check(&a, t, 1).await.0, 200, "{t} on a");
        assert_eq!(check(&b, t, 1).await.0, 200, "{t} on b");
    }
    let ta = harness::get_text(&a.http, &a.admin_url("/metrics")).await;
    let tb = harness::get_text(&b.http, &b.admin_url("/metrics")).await;
    let admitted_metric = |t: &str| {
        harness::metric_sample(t, "tierlimit_newcomers_total{outcome=\"admitted\"}").unwrap_or(0.0)
    };
    assert_eq!(admitted_metric(&ta) + admitted_metric(&tb), 60.0);
    // Once a node found the day full it holds the region's whole set and
    // refuses fresh ids from memory: the 2 940 refusals cost far fewer
    // gate calls than requests.
    for t in [&ta, &tb] {
        assert_eq!(harness::metric_value(t, "tierlimit_newcomers_cached"), 60.0);
    }
    let calls = |t: &str| {
        harness::metric_sample(t, "tierlimit_redis_seconds_count{op=\"newcomer\"}").unwrap_or(0.0)
    };
    let gate_calls = calls(&ta) + calls(&tb);
    assert!(
        gate_calls < 400.0,
        "{gate_calls} gate calls for 3000 newcomers"
    );
    // Each node copied the full day once, although every check in flight
    // when the day filled heard "full" (8 clients a node): copies made by
    // each of them, of 100 000 ids at the default day, timed out and were
    // made again by the next refusals (BENCHMARKS §6d).
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    let copies: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_sscan:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0);
    assert_eq!(copies, 2, "one copy of the 60 ids a node: {stats}");
    let rss_after = harness::rss_kib(a.proc.pid()).unwrap();
    assert!(
        rss_after < rss_before + 16 * 1024,
        "node RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn new_tenants_are_admitted_at_most_max_new_per_second() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &newcomer_config(&redis, "max_new_per_second = 20"),
    );
    let a = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    let b = Arc::new(RegionNode::start(&cfg, "eu", "b").await);
    let started = std::time::Instant::now();
    let (allowed, refused) = flood(&[Arc::clone(&a), Arc::clone(&b)], "rate", 1500).await;
    let secs = started.elapsed().as_secs_f64();
    // Each 1 s window of the region admits at most 20, whichever node asks.
    let windows = secs.ceil() + 1.0;
    assert!(
        allowed.len() as f64 <= 20.0 * windows,
        "{} admitted in {secs:.1} s",
        allowed.len()
    );
    assert!(allowed.len() >= 20, "the first window admits its 20");
    assert!(refused.iter().all(|r| r == "refused_rate"));
    // A tenant refused for the rate gets in once the second is over.
    let late = "rate-late";
    wait_until(
        "a new second admits newcomers again",
        Duration::from_secs(5),
        || async { check(&a, late, 1).await.0 == 200 },
    )
    .await;
}

/// A region of three nodes with leases of up to `lease_max` units.
fn lease_config(redis: &Redis, lease_max: u64, plans: &str) -> String {
    config(redis, plans).replace("[node]\n", &format!("[node]\nlease_max = {lease_max}\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_stay_strict_with_three_nodes_racing_for_one_tenant() {
    use harness::history::{self, Client, History};
    let redis = Redis::start();
    let dir = temp_dir();
    // A fixed window: each one starts with the whole limit, where leases
    // are worth taking (a sliding window lives near its limit from the
    // first one on, where leases are refused).
    let plans =
        "[plans.hot]\nregion = { limit = 150, window = \"1s\", algorithm = \"fixed_window\" }\n\
                 node = { limit = 100000, window = \"1h\", algorithm = \"sliding_window\" }\n\
                 [tenants.hot]\nplan = \"hot\"\n";
    let cfg = write_config(dir.path(), &lease_config(&redis, 20, plans));
    let mut nodes = Vec::new();
    for id in ["a", "b", "c"] {
        nodes.push(RegionNode::start(&cfg, "eu", id).await);
    }
    let h = History::new();
    let deadline = std::time::Instant::now() + Duration::from_millis(3500);
    let mut tasks = Vec::new();
    for c in 0..12 {
        let n = &nodes[c % nodes.len()];
        let client = Client::new(h.clone(), "eu", &n.node_id, &n.url(""));
        tasks.push(tokio::spawn(async move {
            while std::time::Instant::now() < deadline {
                client.check("hot", 1).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let ev = h.events();
    let modes = ["redis", "lease"];
    let r = history::check_fixed_window_tier(&ev, "hot", "region", 150, 1000, &modes, false, &[]);
    println!("{}: {:?}", r.describe(), r.usage);
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert!(r.unplaced.is_empty(), "{:?}", &r.unplaced[..1]);
    // Leases are given back before their window ends: the windows the run
    // covered whole are filled (99 %: a unit may be placed in the next
    // window by the checker when its call straddled the edge).
    let windows: Vec<u64> = r.usage.values().copied().collect();
    assert!(windows.len() >= 3, "{windows:?}");
    for used in &windows[1..windows.len() - 1] {
        assert!(*used >= 148, "window filled to {used}: {windows:?}");
    }
    let denied = ev
        .iter()
        .filter(|e| matches!(&e.outcome, history::Outcome::Denied { tier, .. } if tier == "region"))
        .count();
    assert!(
        denied > 0,
        "the region tier never denied: the test did not exercise it"
    );
    let leased = ev
        .iter()
        .filter(|e| e.allowed() && e.mode() == Some("lease"))
        .count();
    let allowed = ev.iter().filter(|e| e.allowed()).count();
    // Leases are taken at each window's start, far from the limit, and
    // refused near it: some decisions leased, not most.
    assert!(
        leased >= 20 && leased < allowed,
        "{leased} of {allowed} allowed decisions came from leases"
    );
    assert!(ev.iter().all(|e| !e.unknown()), "every check was answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_unused_part_of_a_lease_goes_back_to_the_days_count() {
    let redis = Redis::start();
    let dir = temp_dir();
    let plans =
        "[plans.g]\nregion = { limit = 100000, window = \"1s\" }\nglobal = { limit = 1000000 }\n\
                 [tenants.t]\nplan = \"g\"\n";
    let cfg = write_config(dir.path(), &lease_config(&redis, 50, plans));
    let n = RegionNode::start(&cfg, "eu", "a").await;
    // A busy tenant, one client back to back: once its rate is measured
    // its checks ask for leases, and then most come from them. Leases of a
    // 1 s window live 125 ms and are never granted in its last 375 ms.
    let (mut allowed, mut leased, mut modes) = (0u64, 0u64, Vec::new());
    let until = std::time::Instant::now() + Duration::from_secs(4);
    while leased < 200 && std::time::Instant::now() < until {
        let (s, body) = check(&n, "t", 1).await;
        assert_eq!(s, 200, "{body}");
        allowed += 1;
        let mode = body["mode"].as_str().unwrap().to_string();
        leased += u64::from(mode == "lease");
        modes.push(mode);
    }
    assert!(leased >= 200, "{leased} of {allowed} leased");
    assert_eq!(modes[0], "redis", "a tenant not seen before takes no lease");
    // Every lease's unused units go back: the day's count is what was
    // allowed, and none came back after its window ended.
    wait_until(
        "the leases' rest is given back",
        Duration::from_secs(5),
        || async {
            let u = usage(&n, "t").await;
            u["region_p"].as_u64().unwrap() - u["region_n"].as_u64().unwrap() == allowed
        },
    )
    .await;
    let text = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    let metric = |name: &str| harness::metric_sample(&text, name).unwrap_or(0.0) as u64;
    let units = |e: &str| metric(&format!("tierlimit_lease_units_total{{event=\"{e}\"}}"));
    assert_eq!(metric("tierlimit_lease_checks_total"), leased);
    let (granted, returned, lost) = (units("granted"), units("returned"), units("lost"));
    println!("granted {granted}, spent {leased}, returned {returned}, lost {lost}");
    assert_eq!(
        granted,
        leased + returned + lost,
        "granted = spent + given back"
    );
    // A lease is sized to be spent before its window ends at the rate
    // measured: only the one held when the client stopped outlives it
    // (its units stay in that window, and go back to the day's count).
    assert!(lost <= 50, "{lost} of {granted} outlived their window");
    assert!(
        units("granted") <= 50 * (allowed - leased),
        "capped by lease_max"
    );
}

/// Checks of `tenant` on `n` back to back until one is answered from a
/// lease (the node has measured the tenant's rate and holds one); returns
/// how many were allowed.
async fn until_leased(n: &RegionNode, tenant: &str) -> u64 {
    let until = std::time::Instant::now() + Duration::from_secs(5);
    let mut allowed = 0;
    loop {
        let (s, body) = check(n, tenant, 1).await;
        assert_eq!(s, 200, "{body}");
        allowed += 1;
        if body["mode"] == "lease" {
            return allowed;
        }
        assert!(
            std::time::Instant::now() < until,
            "no lease after {allowed} checks"
        );
    }
}

/// Issue 29 item 6: a free-form refund, tied to no charge, floors the
/// window at zero. The units this node holds in a lease are charged there
/// too: the refund withdraws the lease and gives it back with itself, so
/// after refunding everything the window admits its limit and no more
/// (before: the limit plus what the lease still held).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_free_form_refund_withdraws_the_nodes_lease() {
    let redis = Redis::start();
    let dir = temp_dir();
    let plans = "[plans.p]\nregion = { limit = 300, window = \"1h\" }\n\
                 [tenants.t]\nplan = \"p\"\n";
    let cfg = write_config(dir.path(), &lease_config(&redis, 40, plans));
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let allowed = until_leased(&n, "t").await;
    // Redis counts what was allowed and what the lease still holds.
    let counted = 300 - remaining(&usage(&n, "t").await, "region");
    assert!(
        counted > allowed,
        "the node holds a lease: {counted} counted, {allowed} allowed"
    );
    let r = n
        .http
        .post(n.url("/v1/refund"))
        .json(&json!({ "tenant": "t", "cost": counted }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The window is empty: from here it admits 300 and not one more.
    let mut after = 0;
    for _ in 0..400 {
        let (s, _) = check(&n, "t", 1).await;
        if s == 200 {
            after += 1;
        }
    }
    assert_eq!(after, 300, "admitted after refunding the whole window");
}

/// Issue 29 item 8: a check whose client disconnects while its script call
/// is in flight (its handler future dropped) must not leave the lease
/// table's "asking" flag set (leasing for that key would stop for good),
/// and what Redis charged for it after the client left (lease included) is
/// given back, as for a reply later than the store timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn checks_dropped_mid_call_leave_no_flag_and_no_charge() {
    let redis = Redis::start();
    let dir = temp_dir();
    let plans = "[plans.p]\nregion = { limit = 100000, window = \"1h\" }\n\
                 global = { limit = 1000000 }\n[tenants.t]\nplan = \"p\"\n";
    let cfg = write_config(dir.path(), &lease_config(&redis, 30, plans));
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let mut allowed = until_leased(&n, "t").await;
    // Redis stops answering for a while; 100 checks at once, whose clients
    // give up after 100 ms: the first spend the lease, one asks for the
    // next, the others go to Redis. The calls stay queued and run when
    // Redis answers again, after every client has left.
    let mut con = redis.client().await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(700)
        .arg("ALL")
        .query_async(&mut con)
        .await
        .unwrap();
    let mut burst = Vec::new();
    for _ in 0..100 {
        let q = n.http.clone();
        let url = n.url("/v1/check");
        burst.push(tokio::spawn(async move {
            let r = q
                .post(url)
                .timeout(Duration::from_millis(100))
                .json(&json!({ "tenant": "t", "cost": 1 }))
                .send()
                .await;
            // (allowed, left mid-call). A 503 `overloaded` (admission
            // control: no slot freed while Redis was paused) charged
            // nothing and is neither.
            match r {
                Ok(r) if r.status() == 200 => (1u64, 0u64),
                Ok(r) if r.status() == 503 => {
                    let body = r.text().await.unwrap_or_default();
                    assert!(body.contains("overloaded"), "503 {body}");
                    (0, 0)
                }
                Ok(r) => panic!("{} {}", r.status(), r.text().await.unwrap_or_default()),
                Err(e) => {
                    assert!(e.is_timeout(), "{e:?}");
                    (0, 1)
                }
            }
        }));
    }
    let mut left = 0;
    for b in burst {
        let (ok, gone) = b.await.unwrap();
        allowed += ok;
        left += gone;
    }
    assert!(left > 0, "some clients left mid-call");
    // Leasing goes on for the key: a later check is answered from a lease.
    allowed += until_leased(&n, "t").await;
    // Every charge of a check whose client left mid-call is given back:
    // once the leases are returned, the day's count is what the node
    // decided allowed (a check decided just as its client gave up counts
    // there, not in `allowed`).
    let decided = || async {
        let text = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
        ["lease", "redis"]
            .iter()
            .map(|m| {
                let name = format!(
                    "tierlimit_decisions_total{{mode=\"{m}\",outcome=\"allowed\",tier=\"none\"}}"
                );
                harness::metric_sample(&text, &name).unwrap_or(0.0) as u64
            })
            .sum::<u64>()
    };
    wait_until(
        "the day's count is what was decided allowed",
        Duration::from_secs(10),
        || async {
            let u = usage(&n, "t").await;
            let spent = u["region_p"].as_u64().unwrap() - u["region_n"].as_u64().unwrap();
            spent == decided().await
        },
    )
    .await;
    assert!(
        decided().await >= allowed,
        "the node decided what the clients saw"
    );
    let text = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    let abandoned = harness::metric_sample(&text, "tierlimit_abandoned_calls_total").unwrap_or(0.0);
    assert!(abandoned >= 1.0, "calls of dropped checks: {abandoned}");
}

/// The bound on early denials (`lease.rs`), end to end: four nodes of a
/// region drive one tenant at rates 1:2:3:4, twice its limit of 600 per
/// 5 s, with leases on by default. Each window the run covers whole admits
/// at least 99 % of the limit, and no window more than it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_nodes_at_unequal_rates_fill_the_limit_and_never_pass_it() {
    use harness::history::{self, Client, History};
    let redis = Redis::start();
    let dir = temp_dir();
    let plans = "[plans.hot]\nregion = { limit = 600, window = \"5s\" }\n\
                 [tenants.hot]\nplan = \"hot\"\n";
    let cfg = write_config(
        dir.path(),
        &harness::config::one_region(&redis.url(), 4, plans),
    );
    let mut nodes = Vec::new();
    for id in ["a", "b", "c", "d"] {
        nodes.push(RegionNode::start(&cfg, "eu", id).await);
    }
    // Start just after a window starts (the windows follow Redis' clock,
    // this machine's), for two whole windows and a bit.
    let now = history::now_us() / 1000;
    tokio::time::sleep(Duration::from_millis(5000 - now % 5000 + 20)).await;
    let h = History::new();
    let deadline = std::time::Instant::now() + Duration::from_millis(10_600);
    let mut pacers = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let client = Client::new(h.clone(), "eu", &n.node_id, &n.url(""));
        // 24, 48, 72, 96 checks/s: 240/s against a limit of 120/s.
        let every = Duration::from_micros(1_000_000 / (24 * (i as u64 + 1)));
        pacers.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            let mut inflight = Vec::new();
            while std::time::Instant::now() < deadline {
                tick.tick().await;
                let c = client.clone();
                inflight.push(tokio::spawn(async move { c.check("hot", 1).await }));
            }
            for t in inflight {
                t.await.unwrap();
            }
        }));
    }
    for p in pacers {
        p.await.unwrap();
    }
    let ev = h.events();
    let r = history::check_fixed_window_tier(
        &ev,
        "hot",
        "region",
        600,
        5000,
        &["redis", "lease"],
        false,
        &[],
    );
    println!("{}: {:?}", r.describe(), r.usage);
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert!(r.unplaced.is_empty(), "{:?}", &r.unplaced[..1]);
    let leased = ev
        .iter()
        .filter(|e| e.allowed() && e.mode() == Some("lease"))
        .count();
    let allowed = ev.iter().filter(|e| e.allowed()).count();
    println!("{leased} of {allowed} allowed checks answered from leases");
    let mut lost = 0.0;
    for n in &nodes {
        let text = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
        lost += harness::metric_sample(&text, r#"tierlimit_lease_units_total{event="lost"}"#)
            .unwrap_or(0.0);
    }
    println!("{lost} leased units outlived their window");
    assert!(leased > 250, "leases on by default: {leased} leased");
    let windows: Vec<u64> = r.usage.values().copied().collect();
    assert!(windows.len() >= 3, "{windows:?}");
    // The first window lacks the run's first 20 ms, the last most of it.
    for used in &windows[..2] {
        assert!(
            *used >= 594,
            "a whole window admitted {used} of 600: {windows:?}"
        );
    }
    assert!(ev.iter().all(|e| !e.unknown()), "every check was answered");
}

/// Node-tier reservations (`region-node/src/reserve.rs`): most checks are
/// decided without the node tier in the script, the node tier stays exact
/// (no unit over its limit, none lost while the node runs), and a node
/// killed mid-window strands at most one reservation (under-admission,
/// never over-admission) when it comes back with the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_tier_reservations_are_strict_and_a_crash_strands_at_most_one() {
    const LIMIT: usize = 800;
    // node.reserve_fraction's default: 1/8 of the limit at a time.
    const CHUNK: usize = LIMIT / 8;
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            &format!(
                r#"
[plans.p]
node = {{ limit = {LIMIT}, window = "1h", algorithm = "fixed_window" }}
region = {{ limit = 100000, window = "1h", algorithm = "sliding_window" }}
# Reservations serve plans that do not lease.
lease_max = 0
[tenants.t]
plan = "p"
[tenants.u]
plan = "p"
[plans.q]
node = {{ limit = {LIMIT}, window = "1h", algorithm = "sliding_window" }}
region = {{ limit = 100, window = "1h", algorithm = "fixed_window" }}
lease_max = 0
[tenants.v]
plan = "q"
"#
            ),
        ),
    );
    let mut a = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    // Exact under 16 racing clients: every unit of the limit, none more.
    assert_eq!(hammer(&[Arc::clone(&a)], "t", 1200).await, LIMIT);
    let metrics = harness::get_text(&a.http, &a.admin_url("/metrics")).await;
    let covered =
        harness::metric_sample(&metrics, r#"tierlimit_node_reserve_total{event="covered"}"#)
            .unwrap_or(0.0);
    assert!(
        covered >= (LIMIT - 2 * LIMIT / CHUNK * 16) as f64,
        "most allowed checks should be decided from a reservation, got {covered} of {LIMIT}"
    );
    // The region tier was charged once per allowed check, not per reserved unit.
    assert_eq!(
        remaining(&usage(&a, "t").await, "region"),
        100_000 - LIMIT as u64
    );
    assert_eq!(remaining(&usage(&a, "t").await, "node"), 0);

    // All-or-nothing: checks the region tier denies give their node-tier
    // unit back to the reservation.
    assert_eq!(hammer(&[Arc::clone(&a)], "v", 400).await, 100);
    assert_eq!(
        remaining(&usage(&a, "v").await, "node"),
        (LIMIT - 100) as u64
    );

    // Tenant u: some checks, then SIGKILL with a reservation held.
    assert_eq!(hammer(&[Arc::clone(&a)], "u", 304).await, 304);
    let held = remaining(&usage(&a, "u").await, "node");
    assert_eq!(
        held,
        (LIMIT - 304) as u64,
        "usage counts a reservation as unspent"
    );
    Arc::get_mut(&mut a).expect("one owner").proc.kill9();
    drop(a);
    let a = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    let after = hammer(&[Arc::clone(&a)], "u", 1200).await;
    assert!(
        304 + after <= LIMIT,
        "the node tier admitted {} of {LIMIT} across the crash",
        304 + after
    );
    assert!(
        304 + after >= LIMIT - CHUNK,
        "a crash strands at most one reservation ({CHUNK}), yet only {} of {LIMIT} were admitted",
        304 + after
    );
    // The restarted node found the stranded reservation charged and asked
    // again without one: checks were never denied while the tier had room.
    let metrics = harness::get_text(&a.http, &a.admin_url("/metrics")).await;
    assert!(
        harness::metric_value(&metrics, "tierlimit_node_reserve_total") > 0.0,
        "the restarted node reserves again"
    );
}

/// A node whose broadcast view has not been read since it started
/// (here: Kafka unreachable) holds the decisions of tenants with a global
/// tier for `node.view_wait`: each waits up to `store_timeout` and is then
/// shed with 503 `view-not-ready` and `Retry-After`, nothing charged, while
/// tenants without a global tier are decided at once. Past `view_wait` the
/// global tier is decided without the view, and counted as blind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn global_tier_decisions_wait_for_the_view_then_go_blind_after_view_wait() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.g]
region = { limit = 100, window = "1h" }
global = { limit = 1000 }
[tenants.g]
plan = "g"
[plans.r]
region = { limit = 100, window = "1h" }
[tenants.r]
plan = "r"
"#,
        ),
    );
    // Long enough that the node's start (before /healthz answers) never
    // uses it up on a loaded machine.
    const WAIT: Duration = Duration::from_secs(5);
    let wait = format!("{}s", WAIT.as_secs());
    let node = RegionNode::start_with_env(
        &cfg,
        "eu",
        "a",
        &[
            ("TIERLIMIT__NODE__VIEW_WAIT", wait.as_str()),
            ("TIERLIMIT__NODE__STORE_TIMEOUT", "200ms"),
        ],
    )
    .await;
    let started = std::time::Instant::now();
    let r = node
        .http
        .post(node.url("/v1/check"))
        .json(&json!({ "tenant": "g", "cost": 1 }))
        .send()
        .await
        .expect("check request");
    let status = r.status().as_u16();
    let retry_after = r.headers().get("retry-after").cloned();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 503, "{body}");
    assert!(
        body["type"]
            .as_str()
            .unwrap_or("")
            .ends_with("view-not-ready"),
        "{body}"
    );
    assert!(retry_after.is_some(), "a 503 says when to retry");
    // Nothing was charged: the region tier is whole.
    assert_eq!(remaining(&usage(&node, "g").await, "region"), 100);
    // A tenant without a global tier does not wait for the view.
    assert_eq!(check(&node, "r", 1).await.0, 200);
    // Past view_wait the global tier is decided without the view.
    wait_until(
        "a global-tier check decided blind",
        Duration::from_secs(20),
        || async { check(&node, "g", 1).await.0 == 200 },
    )
    .await;
    assert!(started.elapsed() >= WAIT - Duration::from_secs(2));
    let metrics = harness::get_text(&node.http, &node.admin_url("/metrics")).await;
    let sample = |outcome: &str| {
        harness::metric_sample(
            &metrics,
            &format!(r#"tierlimit_view_not_ready_total{{outcome="{outcome}"}}"#),
        )
        .unwrap_or(0.0)
    };
    assert!(sample("shed") >= 1.0, "{metrics}");
    assert!(sample("blind") >= 1.0, "{metrics}");
    assert_eq!(remaining(&usage(&node, "g").await, "region"), 99);
}

// --- Issue 29, items 1 and 2: refund handles and one clock for the day ---

const SECRET: &str = "0123456789abcdef0123456789abcdef-test";
const DAY_MS: i64 = 86_400_000;

async fn post_refund(node: &RegionNode, body: Value) -> (u16, Value) {
    let r = node
        .http
        .post(node.url("/v1/refund"))
        .json(&body)
        .send()
        .await
        .expect("refund request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `tierlimit_refund_refusals_total{reason}` of a node.
async fn refusals(node: &RegionNode, reason: &str) -> f64 {
    let m = harness::get_text(&node.http, &node.admin_url("/metrics")).await;
    harness::metric_sample(
        &m,
        &format!("tierlimit_refund_refusals_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or_else(|| panic!("no refusals sample for {reason} in {m}"))
}

/// Redis' clock (`TIME`), ms.
/// Waits (at most `secs`) until Redis' clock reads at least `at_ms`.
async fn wait_redis_clock(redis: &Redis, at_ms: i64, what: &str, secs: u64) {
    wait_until(what, Duration::from_secs(secs), || async {
        redis_ms(redis) >= at_ms
    })
    .await;
}

fn redis_ms(redis: &Redis) -> i64 {
    let (s, us): (i64, i64) = harness::query(redis.port(), &redis::cmd("TIME")).expect("TIME");
    s * 1000 + us / 1000
}

/// The offset, in whole seconds, that puts a clock `before_s` seconds
/// before the real clock's next UTC midnight.
fn offset_to_midnight_minus(before_s: i64) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    (now / 86_400 + 1) * 86_400 - before_s - now
}

fn problem_type(p: &Value) -> &str {
    p["type"]
        .as_str()
        .unwrap_or("")
        .rsplit('/')
        .next()
        .unwrap_or("")
}

/// Issue 29 item 1: a handle names its region, its node and its windows.
/// Refunded in another region (the secret is the deployment's, and each
/// region keeps its own record of used handles) it is refused, 403
/// `refund-handle-other-region`, and counted. Refunded through another node
/// of its region, it gives back to the CHARGING node's node tier (a client
/// behind a load balancer cannot pick the node; the charging node is the one
/// that holds the charge). Once used it is refused, 409 `refund-handle-used`.
/// The record of used handles lives as long as the longest window the
/// charge touched (a 7-day log here, past retention + 1 = 3 days). A
/// previous release's handle is accepted for 15 minutes after its charge,
/// then refused, 410 `refund-handle-outdated`.
#[tokio::test]
async fn refund_handles_are_bound_to_their_region_node_and_windows() {
    let eu = Redis::start();
    let us = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &eu,
            &format!(
                r#"
[regions.us]
redis_url = "{}"
expected_nodes = 1
[plans.p]
node = {{ limit = 5, window = "1h", algorithm = "fixed_window" }}
region = {{ limit = 100, window = "7d", algorithm = "sliding_log" }}
[tenants.t]
plan = "p"
"#,
                us.url()
            ),
        ),
    );
    let env = [("TIERLIMIT__NODE__REFUND_SECRET", SECRET)];
    let a = RegionNode::start_with_env(&cfg, "eu", "a", &env).await;
    let b = RegionNode::start_with_env(&cfg, "eu", "b", &env).await;
    let x = RegionNode::start_with_env(&cfg, "us", "x", &env).await;

    let (s, body) = check(&a, "t", 2).await;
    assert_eq!(s, 200, "{body}");
    let h = body["refund_handle"]
        .as_str()
        .expect("a handle")
        .to_string();
    let day = (redis_ms(&eu) / DAY_MS) as u32;

    // Another region: refused, named, counted; nothing given back there.
    let (s, r) = post_refund(&x, json!({ "handle": h })).await;
    assert_eq!(
        (s, problem_type(&r)),
        (403, "refund-handle-other-region"),
        "{r}"
    );
    assert_eq!(r["region"], "eu", "{r}");
    assert_eq!(refusals(&x, "other_region").await, 1.0);

    // Through node b: node a's node tier gets the 2 units back.
    assert_eq!(remaining(&usage(&a, "t").await, "node"), 3);
    let (s, r) = post_refund(&b, json!({ "handle": h })).await;
    assert_eq!((s, r["refunded"].as_u64()), (200, Some(2)), "{r}");
    assert_eq!(
        remaining(&usage(&a, "t").await, "node"),
        5,
        "the charging node's node tier got the charge back"
    );
    assert_eq!(remaining(&usage(&b, "t").await, "node"), 5);
    assert_eq!(remaining(&usage(&a, "t").await, "region"), 100);

    // Used: refused on every node of the region, counted.
    for n in [&a, &b] {
        let (s, r) = post_refund(n, json!({ "handle": h })).await;
        assert_eq!((s, problem_type(&r)), (409, "refund-handle-used"), "{r}");
    }
    assert_eq!(refusals(&a, "used").await + refusals(&b, "used").await, 2.0);
    assert_eq!(remaining(&usage(&a, "t").await, "node"), 5);

    // The record lives as long as the 7-day window the charge touched.
    let record = tierlimit_shared::keys::refund_record("t", day);
    let pttl: i64 = harness::query(eu.port(), redis::cmd("PTTL").arg(&record)).unwrap();
    assert!(
        pttl > 7 * DAY_MS - 60_000,
        "the used-handle record {record} expires in {pttl} ms, before the 7-day window it guards"
    );

    // A previous release's handle: accepted within its grace (its old
    // meaning: this node's tiers), refused past it.
    let signer = region_node::refund::Signer::new(SECRET.as_bytes());
    let (s, _) = check(&a, "t", 1).await;
    assert_eq!(s, 200);
    let now = redis_ms(&eu) as u64;
    let previous = |id: &str, charged_at_ms: u64| {
        signer.sign_previous(&region_node::refund::PreviousHandle {
            tenant: "t".into(),
            key: tierlimit_shared::keys::WHOLE_TENANT.into(),
            cost: 1,
            charged_at_ms,
            id: id.into(),
        })
    };
    let (s, r) = post_refund(&a, json!({ "handle": previous("old-1", now) })).await;
    assert_eq!((s, r["refunded"].as_u64()), (200, Some(1)), "{r}");
    assert_eq!(remaining(&usage(&a, "t").await, "node"), 5);
    let stale = previous("old-2", now - 16 * 60 * 1000);
    let (s, r) = post_refund(&a, json!({ "handle": stale })).await;
    assert_eq!(
        (s, problem_type(&r)),
        (410, "refund-handle-outdated"),
        "{r}"
    );
    assert_eq!(refusals(&a, "outdated").await, 1.0);
}

/// Issue 29 item 1: a handle is refused, 410 `refund-handle-expired`, once
/// every window its charge touched has ended (its tiers' 2 s windows and
/// the day's global count), in Redis' clock; and a used handle whose record
/// expired (deleted here, as its TTL would) does not count again. Redis runs
/// under libfaketime a few seconds before its midnight.
#[tokio::test]
async fn a_refund_handle_is_refused_once_every_window_it_touched_has_ended() {
    let redis = Redis::start_with_clock_offset(offset_to_midnight_minus(8));
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.p]
node = { limit = 5, window = "2s", algorithm = "fixed_window" }
region = { limit = 10, window = "2s", algorithm = "sliding_log" }
[tenants.t]
plan = "p"
"#,
        ),
    );
    let env = [("TIERLIMIT__NODE__REFUND_SECRET", SECRET)];
    let n = RegionNode::start_with_env(&cfg, "eu", "a", &env).await;
    let midnight = (redis_ms(&redis) / DAY_MS + 1) * DAY_MS;
    let day = (midnight / DAY_MS - 1) as u32;

    let mut handles = Vec::new();
    for _ in 0..2 {
        let (s, body) = check(&n, "t", 1).await;
        assert_eq!(s, 200, "{body}");
        handles.push(body["refund_handle"].as_str().unwrap().to_string());
    }
    let (s, r) = post_refund(&n, json!({ "handle": handles[0] })).await;
    assert_eq!((s, r["refunded"].as_u64()), (200, Some(1)), "{r}");
    assert!(
        redis_ms(&redis) < midnight,
        "the charges and the first refund must fall before Redis' midnight (the setup was slow)"
    );

    // Redis' day ended and so did every 2 s window of the charges.
    wait_redis_clock(
        &redis,
        midnight + 2500,
        "Redis' clock 2.5 s past its midnight",
        20,
    )
    .await;
    let (s, r) = post_refund(&n, json!({ "handle": handles[1] })).await;
    assert_eq!((s, problem_type(&r)), (410, "refund-handle-expired"), "{r}");
    assert_eq!(refusals(&n, "expired").await, 1.0);

    // The used handle after its record is gone: still refused.
    let record = tierlimit_shared::keys::refund_record("t", day);
    let deleted: i64 = harness::query(redis.port(), redis::cmd("DEL").arg(&record)).unwrap();
    assert_eq!(deleted, 1, "the record {record} existed");
    let (s, r) = post_refund(&n, json!({ "handle": handles[0] })).await;
    assert_eq!((s, problem_type(&r)), (410, "refund-handle-expired"), "{r}");
}

/// Issue 29 item 2: one clock decides the day, Redis'. The node runs under
/// libfaketime 7 s ahead of its Redis, which is itself just before its
/// midnight: the node's midnight comes 7 s early. A tenant denied by its
/// global tier stays denied through those 7 s (before the fix the script
/// read the day mismatch as "nobody else spent" and admitted L − own more),
/// and is admitted again once Redis' own day begins. The node reports its
/// offset (`tierlimit_clock_offset_ms`, `/readyz`'s `clock`).
#[tokio::test]
async fn a_fast_node_clock_keeps_a_tenant_denied_through_its_early_midnight() {
    const AHEAD_S: i64 = 7;
    let offset = offset_to_midnight_minus(16);
    let redis = Redis::start_with_clock_offset(offset);
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.g]
region = { limit = 1000, window = "1h", algorithm = "fixed_window" }
global = { limit = 100 }
[tenants.g]
plan = "g"
"#,
        ),
    );
    let faked = harness::faketime_env(offset + AHEAD_S, &[]);
    let env: Vec<(&str, &str)> = faked
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let n = RegionNode::start_with_env(&cfg, "eu", "a", &env).await;
    let midnight = (redis_ms(&redis) / DAY_MS + 1) * DAY_MS;
    let node_midnight = midnight - AHEAD_S * 1000;

    // Spend until the global tier denies (the view holds no entry: the
    // others' spend is taken to be the broadcast threshold).
    let mut allowed = 0;
    loop {
        let (s, body) = check(&n, "g", 1).await;
        if s == 429 {
            assert_eq!(body["violated-policy"], "global", "{body}");
            break;
        }
        assert_eq!(s, 200, "{body}");
        allowed += 1;
        assert!(allowed < 100, "never denied");
    }
    assert!(
        redis_ms(&redis) < node_midnight - 300,
        "the spending must end before the node's midnight (the setup was slow)"
    );

    // The node's clock is past its midnight, Redis' is not: still denied.
    wait_redis_clock(
        &redis,
        node_midnight + 300,
        "the node's clock past its midnight",
        20,
    )
    .await;
    let mut checks = 0;
    while redis_ms(&redis) < midnight - 500 {
        let (s, body) = check(&n, "g", 1).await;
        assert_eq!(
            s, 429,
            "admitted after the node's early midnight with {allowed} spent of 100: {body}"
        );
        let reset = body["tiers"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["tier"] == "global"))
            .and_then(|t| t["reset_ms"].as_i64())
            .unwrap_or_else(|| panic!("a global tier in {body}"));
        assert!(
            reset <= midnight - redis_ms(&redis) + 1000,
            "the global tier resets at Redis' midnight, not a day after the node's: {body}"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        checks >= 5,
        "only {checks} checks between the two midnights"
    );

    // The node says how far off its clock is.
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    let off = harness::metric_value(&m, "tierlimit_clock_offset_ms");
    assert!(
        (off - (AHEAD_S * 1000) as f64).abs() < 1000.0,
        "clock offset {off} ms, expected about {} ms",
        AHEAD_S * 1000
    );
    let ready = harness::get_json(&n.http, &n.admin_url("/readyz")).await;
    assert_eq!(ready["clock"]["within_bound"], false, "{ready}");
    // The node picked Redis' day itself (its estimate of Redis' clock): the
    // script never had to refuse a check built for the node's own day.
    assert_eq!(
        harness::metric_value(&m, "tierlimit_day_retries_total"),
        0.0,
        "checks built for the node's day instead of Redis'"
    );

    // Redis' new day: the global count starts again.
    wait_redis_clock(&redis, midnight + 200, "Redis' clock past its midnight", 20).await;
    let (s, body) = check(&n, "g", 1).await;
    assert_eq!(s, 200, "a new day of Redis' clock: {body}");
}

/// Issue 35 item 1: a plan counting in Europe/Berlin starts its day at
/// Berlin's midnight (22:00 or 23:00 UTC), by Redis' clock. Redis runs
/// under libfaketime a few seconds before that midnight. A Berlin tenant
/// and a UTC tenant spend their day's 5 units and are denied; past Berlin's
/// midnight the Berlin tenant is admitted again (a new day, whose Redis
/// field is the zone's: `g:<local day>@Europe/Berlin:`) while the UTC
/// tenant, whose day goes on, stays denied. Each denial's reset is its own
/// midnight. Fails if the zone is ignored (both stay denied, or the Berlin
/// reset points at UTC's midnight).
#[tokio::test]
async fn a_berlin_day_ends_at_berlin_midnight_while_the_utc_day_goes_on() {
    use tierlimit_shared::period::PeriodKind;
    use tierlimit_shared::zone::Zone;
    let berlin = Zone::named("Europe/Berlin").unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut day = PeriodKind::Day.at_in(berlin, now);
    // Berlin's midnight is never UTC's: keep at least a minute before UTC's
    // own midnight so that only Berlin's day ends in the test.
    if (day.end_ms() as u64) - now < 60_000 {
        day = day.next();
    }
    let berlin_midnight = day.end_ms();
    assert_ne!(berlin_midnight % DAY_MS, 0);
    let offset = (berlin_midnight - now as i64) / 1000 - 10;
    let redis = Redis::start_with_clock_offset(offset);
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.berlin]
region = { limit = 1000, window = "1h", algorithm = "fixed_window" }
global = { day = 5 }
time_zone = "Europe/Berlin"
[plans.utc]
region = { limit = 1000, window = "1h", algorithm = "fixed_window" }
global = { day = 5 }
[tenants.b]
plan = "berlin"
[tenants.u]
plan = "utc"
"#,
        ),
    );
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let day_tier = |body: &Value| {
        body["tiers"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["tier"] == "global").cloned())
            .unwrap_or_else(|| panic!("a global tier in {body}"))
    };
    for t in ["b", "u"] {
        // Spend until the day's tier denies (without a view, the others'
        // spend is taken to be the broadcast threshold: a few units).
        let mut allowed = 0;
        let body = loop {
            let (s, body) = check(&n, t, 1).await;
            if s == 429 {
                break body;
            }
            assert_eq!(s, 200, "{t}: {body}");
            allowed += 1;
            assert!(allowed <= 5, "{t}: more than the day's 5 allowed");
        };
        assert!(allowed >= 1, "{t}: nothing allowed");
        assert_eq!(body["violated-policy"], "global", "{body}");
        let tier = day_tier(&body);
        let reset = tier["reset_ms"].as_i64().unwrap();
        let midnight = if t == "b" {
            assert_eq!(tier["algorithm"], "zoned_day", "{body}");
            berlin_midnight
        } else {
            assert_eq!(tier["algorithm"], "utc_day", "{body}");
            (redis_ms(&redis) / DAY_MS + 1) * DAY_MS
        };
        let expected = midnight - redis_ms(&redis);
        assert!(
            (reset - expected).abs() < 2_000,
            "{t}: reset in {reset} ms, its midnight is {expected} ms away: {body}"
        );
    }
    assert!(
        redis_ms(&redis) < berlin_midnight - 500,
        "the spending must end before Berlin's midnight (the setup was slow)"
    );
    // The count is in the zone's field, beside the UTC day's every tenant
    // has.
    let hash = tierlimit_shared::keys::tenant_hash("b");
    let fields: Vec<String> = harness::query(redis.port(), redis::cmd("HKEYS").arg(&hash)).unwrap();
    let label = day.label();
    assert!(
        fields.iter().any(|f| f.contains(&format!("g:{label}:"))),
        "no field of {label} in {fields:?}"
    );

    wait_redis_clock(
        &redis,
        berlin_midnight + 300,
        "Redis' clock past Berlin's midnight",
        30,
    )
    .await;
    let (s, body) = check(&n, "b", 1).await;
    assert_eq!(s, 200, "Berlin's new day: {body}");
    let (s, body) = check(&n, "u", 1).await;
    assert_eq!(s, 429, "the UTC day goes on: {body}");
}

/// One of `name`'s samples in the node's `/metrics` (label set included in
/// `name`, e.g. `x_total{reason="oom"}`); 0 when absent.
async fn metric(n: &RegionNode, name: &str) -> f64 {
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    harness::metric_sample(&m, name).unwrap_or(0.0)
}

/// Redis at `maxmemory` under `noeviction` refuses every write with OOM,
/// and with MISCONF once an RDB save failed (issue 29, item 9). That is a
/// capacity alarm, not an outage: it answers. Before, each refused check
/// went to its plan's fail mode, so an `open` plan admitted uncounted past
/// its limit for as long as memory stayed full. Now the breaker stays
/// closed, `open` and `local` plans are decided by the node's local limiter
/// (counted: the region limit's share of this node), `closed` ones get 503,
/// each refusal is counted by reason, and once writes are accepted again
/// the next check is decided in Redis.
#[tokio::test]
async fn a_redis_refusing_writes_is_decided_locally_never_open() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            r#"
[plans.open]
region = { limit = 6, window = "1h", algorithm = "fixed_window" }
on_store_error = "open"
[plans.closed]
region = { limit = 6, window = "1h", algorithm = "fixed_window" }
on_store_error = "closed"
[plans.local]
region = { limit = 6, window = "1h", algorithm = "token_bucket" }
on_store_error = "local"
[tenants.o]
plan = "open"
[tenants.c]
plan = "closed"
[tenants.l]
plan = "local"
"#,
        ),
    );
    let n = RegionNode::start(&cfg, "eu", "a").await;
    for t in ["o", "c", "l"] {
        let (s, body) = check(&n, t, 1).await;
        assert_eq!((s, body["mode"].as_str()), (200, Some("redis")), "{body}");
    }
    let mut con = redis.client().await;
    let cmd = |args: &[&str]| {
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c
    };
    // Filled: a megabyte of data, then maxmemory below what is used.
    let blob = "x".repeat(1 << 20);
    cmd(&["SET", "ballast", &blob])
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    for c in [
        cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
        cmd(&["CONFIG", "SET", "maxmemory", "1mb"]),
    ] {
        c.query_async::<()>(&mut con).await.unwrap();
    }
    let refused = cmd(&["SET", "probe", "1"])
        .query_async::<()>(&mut con)
        .await;
    assert!(
        refused.as_ref().is_err_and(|e| e.code() == Some("OOM")),
        "Redis should refuse writes: {refused:?}"
    );

    // open: decided by the local limiter, never "open": 6 / 2 expected
    // nodes = 3 on this node, then 429.
    let mut allowed = 0;
    for _ in 0..6 {
        let (s, body) = check(&n, "o", 1).await;
        assert_eq!(body["mode"], "local", "{s} {body}");
        allowed += usize::from(s == 200);
    }
    assert_eq!(allowed, 3, "an open plan under OOM admits its local share");
    // closed: 503 problem+json, nothing decided.
    let (s, body) = check(&n, "c", 1).await;
    assert_eq!(s, 503, "{body}");
    // local: the local limiter, as for the fail mode.
    let (s, body) = check(&n, "l", 1).await;
    assert_eq!((s, body["mode"].as_str()), (200, Some("local")), "{body}");
    assert_eq!(
        metric(&n, "tierlimit_store_writes_refused_total{reason=\"oom\"}").await,
        8.0
    );
    assert_eq!(
        metric(&n, "tierlimit_store_up").await,
        1.0,
        "breaker closed"
    );
    assert_eq!(
        metric(&n, "tierlimit_fail_mode_decisions_total{mode=\"open\"}").await,
        0.0
    );

    // Memory freed: back to Redis at the next check, with what Redis held.
    cmd(&["CONFIG", "SET", "maxmemory", "0"])
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    let (s, body) = check(&n, "c", 1).await;
    assert_eq!((s, body["mode"].as_str()), (200, Some("redis")), "{body}");

    // MISCONF: a save point and a failed BGSAVE (its directory is gone)
    // stop writes (stop-writes-on-bgsave-error, the default).
    cmd(&["CONFIG", "SET", "save", "3600 1"])
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    std::fs::remove_dir_all(redis.dir()).unwrap();
    cmd(&["BGSAVE"]).query_async::<()>(&mut con).await.unwrap();
    wait_until("the RDB save fails", Duration::from_secs(10), || {
        let mut con = con.clone();
        async move {
            let info: String = redis::cmd("INFO")
                .arg("persistence")
                .query_async(&mut con)
                .await
                .unwrap();
            info.contains("rdb_last_bgsave_status:err")
                && !info.contains("rdb_bgsave_in_progress:1")
        }
    })
    .await;
    let (s, body) = check(&n, "o", 1).await;
    assert_eq!((s, body["mode"].as_str()), (429, Some("local")), "{body}");
    assert_eq!(
        metric(
            &n,
            "tierlimit_store_writes_refused_total{reason=\"misconf\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&n, "tierlimit_store_up").await,
        1.0,
        "breaker closed"
    );
    assert_eq!(
        metric(&n, "tierlimit_fail_mode_decisions_total{mode=\"open\"}").await,
        0.0
    );
}
