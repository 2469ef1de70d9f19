//! Saturation is not an outage, and a lost reply is not a lost count: a
//! real region-node against a real redis-server.
//!
//! - A load well above what Redis serves is shed (503 problem+json with
//!   `Retry-After`, nothing charged), and no decision falls into the fail
//!   mode while Redis is merely busy.
//! - Without the admission bound, calls that wait past `store_timeout`
//!   behind others while Redis keeps answering are shed too
//!   (`store_backlog`), not failed over, and what Redis charged for them
//!   is undone.
//! - Redis silent past `node.store_unavailable_after` opens the breaker: the
//!   fail mode engages, and the node returns to Redis by itself.
//! - A check Redis charged after the node gave up on it is refunded when its
//!   late reply arrives; one that reached Redis after its deadline was
//!   refused by the script. Either way the counters end up as if it had
//!   never been sent, and the metrics say which.
//!
//! Redis is made slow or silent deterministically: `CLIENT PAUSE … WRITE`
//! cycles (each one ended by Redis itself, observed through a blocked
//! write), SIGSTOP/SIGCONT, and a TCP proxy that holds Redis' replies.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{get_text, metric_sample, temp_dir, wait_for, write_config, Redis, RegionNode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

fn config(redis_url: &str, node: &str, plans: &str) -> String {
    format!(
        r#"
cluster = "test"
[kafka]
brokers = "127.0.0.1:1"
[node]
# This suite checks the Redis path decision by decision: no leases.
lease_max = 0
store_retry_interval = "50ms"
# Kafka is detached: no view to wait for (node.view_wait).
view_wait = "0s"
{node}
[regions.eu]
redis_url = "{redis_url}"
[unknown_tenants]
policy = "deny"
{plans}
"#
    )
}

/// Tenant `t` on plan `p`: a region tier of `limit` per hour (fixed
/// window) and the given `on_store_error`.
fn plan_t(limit: u64, on_store_error: &str) -> String {
    format!(
        r#"
[plans.p]
region = {{ limit = {limit}, window = "1h", algorithm = "fixed_window" }}
on_store_error = "{on_store_error}"
[tenants.t]
plan = "p"
"#
    )
}

async fn check(node: &RegionNode, tenant: &str) -> (u16, Value) {
    let r = node
        .http
        .post(node.url("/v1/check"))
        .json(&json!({ "tenant": tenant }))
        .send()
        .await
        .expect("check request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn metrics(node: &RegionNode) -> String {
    get_text(&node.http, &node.admin_url("/metrics")).await
}

fn sample(text: &str, name: &str) -> f64 {
    metric_sample(text, name).unwrap_or_else(|| panic!("no sample {name} in /metrics"))
}

/// The region tier's remaining units and this region's P − N for `tenant`.
async fn region_count(node: &RegionNode, tenant: &str) -> (u64, u64) {
    let u = harness::get_json(&node.http, &node.url(&format!("/v1/tenants/{tenant}"))).await;
    read_count(&u).unwrap_or_else(|| panic!("no region tier in {u}"))
}

/// The same, `None` when the node could not read Redis in time (its
/// answer then has no tiers).
async fn try_region_count(node: &RegionNode, tenant: &str) -> Option<(u64, u64)> {
    let u = harness::get_json(&node.http, &node.url(&format!("/v1/tenants/{tenant}"))).await;
    read_count(&u)
}

fn read_count(u: &Value) -> Option<(u64, u64)> {
    let remaining = u["tiers"]
        .as_array()?
        .iter()
        .find(|t| t["tier"] == "region")?["remaining"]
        .as_u64()?;
    let p = u["region_p"].as_u64()?;
    let n = u["region_n"].as_u64()?;
    Some((remaining, p - n))
}

/// What one request of the open-loop load saw.
#[derive(Debug)]
struct Seen {
    status: u16,
    retry_after: Option<String>,
    content_type: Option<String>,
    body: Value,
}

/// Open loop: `rate` checks a second for `duration`, each sent at its
/// intended time whatever the earlier ones are waiting for.
async fn open_loop(
    node: &Arc<RegionNode>,
    tenant: &str,
    rate: u32,
    duration: Duration,
) -> Vec<Seen> {
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut tasks = Vec::new();
    while started.elapsed() < duration {
        tick.tick().await;
        let (node, tenant) = (Arc::clone(node), tenant.to_string());
        tasks.push(tokio::spawn(async move {
            let r = node
                .http
                .post(node.url("/v1/check"))
                .json(&json!({ "tenant": tenant }))
                .timeout(Duration::from_secs(20))
                .send()
                .await
                .expect("check request");
            let header = |h: &str| {
                r.headers()
                    .get(h)
                    .map(|v| v.to_str().unwrap_or_default().to_string())
            };
            let (retry_after, content_type) = (header("retry-after"), header("content-type"));
            let status = r.status().as_u16();
            Seen {
                status,
                retry_after,
                content_type,
                body: r.json().await.unwrap_or(Value::Null),
            }
        }));
    }
    let mut seen = Vec::with_capacity(tasks.len());
    for t in tasks {
        seen.push(t.await.expect("load task"));
    }
    seen
}

/// Redis serving only a few calls at a time: write commands are paused for
/// `pause`, again and again. Each pause ends by itself; a write sent during
/// it is answered when it ends, which starts the next one at once. Redis
/// runs what queued up in between, then is paused again: busy, never
/// silent for longer than `pause`.
fn pace_redis(
    mut admin: redis::aio::MultiplexedConnection,
    pause: Duration,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<u32>) {
    let stop = Arc::new(AtomicBool::new(false));
    let s = Arc::clone(&stop);
    let task = tokio::spawn(async move {
        let mut cycles = 0;
        while !s.load(Ordering::Relaxed) {
            redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(pause.as_millis() as u64)
                .arg("WRITE")
                .query_async::<()>(&mut admin)
                .await
                .expect("CLIENT PAUSE");
            redis::cmd("SET")
                .arg("pacer")
                .arg(cycles)
                .query_async::<()>(&mut admin)
                .await
                .expect("a write after the pause");
            cycles += 1;
        }
        cycles
    });
    (stop, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturation_is_shed_and_never_taken_for_an_outage() {
    let redis = Redis::start();
    let dir = temp_dir();
    // A busy Redis answers every admitted call well within store_timeout;
    // the queue holds what a pause cycle can serve, and no more.
    let node_cfg = r#"
store_timeout = "1s"
store_unavailable_after = "2s"
max_in_flight = 4
max_queue = 16
queue_timeout = "100ms"
"#;
    let plans = plan_t(1_000_000, "local");
    let cfg = write_config(dir.path(), &config(&redis.url(), node_cfg, &plans));
    let node = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    assert_eq!(check(&node, "t").await.0, 200);

    let (stop, pacer) = pace_redis(redis.client().await, Duration::from_millis(40));
    // Paused 40 ms at a time, Redis serves about max_in_flight calls per
    // cycle (~100/s): 400/s is four times that.
    let seen = open_loop(&node, "t", 400, Duration::from_millis(2500)).await;
    stop.store(true, Ordering::Relaxed);
    let cycles = pacer.await.unwrap();
    assert!(cycles > 20, "Redis was paused {cycles} times");

    let allowed: Vec<&Seen> = seen.iter().filter(|s| s.status == 200).collect();
    let shed: Vec<&Seen> = seen.iter().filter(|s| s.status == 503).collect();
    let other: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.status != 200 && s.status != 503)
        .collect();
    println!(
        "{} requests: {} allowed, {} shed, {} other; {cycles} pause cycles",
        seen.len(),
        allowed.len(),
        shed.len(),
        other.len()
    );
    assert!(other.is_empty(), "only 200 or 503: {:?}", other.first());
    assert!(
        shed.len() > seen.len() / 3,
        "a load four times the capacity is mostly shed ({} of {})",
        shed.len(),
        seen.len()
    );
    assert!(!allowed.is_empty(), "what can be served is served");
    for s in &shed {
        assert_eq!(s.retry_after.as_deref(), Some("1"), "{:?}", s.body);
        assert_eq!(s.content_type.as_deref(), Some("application/problem+json"));
        assert_eq!(
            s.body["type"], "https://tierlimit.dev/problems/overloaded",
            "shed, not a store failure: {}",
            s.body
        );
    }
    for a in &allowed {
        assert_eq!(a.body["mode"], "redis", "{}", a.body);
    }

    let m = metrics(&node).await;
    for mode in ["open", "closed", "local"] {
        assert_eq!(
            sample(
                &m,
                &format!("tierlimit_fail_mode_decisions_total{{mode=\"{mode}\"}}")
            ),
            0.0,
            "no fail-mode decision while Redis is busy ({mode})"
        );
    }
    for reason in ["connection", "stalled", "readonly"] {
        assert_eq!(
            sample(
                &m,
                &format!("tierlimit_breaker_opens_total{{reason=\"{reason}\"}}")
            ),
            0.0,
            "the breaker stays closed ({reason})"
        );
    }
    assert_eq!(sample(&m, "tierlimit_store_up"), 1.0);
    let shed_total = sample(&m, "tierlimit_shed_total{reason=\"queue_full\"}")
        + sample(&m, "tierlimit_shed_total{reason=\"queue_timeout\"}")
        + sample(&m, "tierlimit_shed_total{reason=\"store_backlog\"}");
    assert_eq!(
        shed_total as usize,
        shed.len(),
        "every shed request is counted"
    );
    // Nothing shed was charged: Redis counted exactly the allowed ones
    // (and the first check).
    let (remaining, pn) = region_count(&node, "t").await;
    assert_eq!(pn as usize, allowed.len() + 1);
    assert_eq!(remaining as usize, 1_000_000 - allowed.len() - 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_silent_past_the_threshold_engages_the_fail_mode() {
    let redis = Redis::start();
    let dir = temp_dir();
    let node_cfg = r#"
store_timeout = "100ms"
store_unavailable_after = "400ms"
"#;
    let plans = plan_t(1000, "open");
    let cfg = write_config(dir.path(), &config(&redis.url(), node_cfg, &plans));
    let node = RegionNode::start(&cfg, "eu", "a").await;
    assert_eq!(check(&node, "t").await.1["mode"], "redis");

    redis.proc.stop();
    let stopped = Instant::now();
    // Each check waits store_timeout and takes the fail mode alone; the
    // breaker opens only once Redis has been silent for the threshold.
    // The first may be shed instead: a reply Redis sent just before it
    // stopped (to one of the node's background calls) can be read after
    // the check was sent, and a reply after a call was sent means a
    // backlog (`RedisStore::timed_out`). Shed charges nothing; from the
    // second on, nothing comes back at all.
    let (status, body) = check(&node, "t").await;
    if status == 503 {
        assert_eq!(body["reason"], "store_backlog", "{body}");
        let (status, body) = check(&node, "t").await;
        assert_eq!(
            (status, body["mode"].as_str()),
            (200, Some("open")),
            "{body}"
        );
    } else {
        assert_eq!(
            (status, body["mode"].as_str()),
            (200, Some("open")),
            "{body}"
        );
    }
    let up_early = sample(&metrics(&node).await, "tierlimit_store_up");
    if stopped.elapsed() < Duration::from_millis(350) {
        assert_eq!(up_early, 1.0, "one timeout does not open the breaker");
    }
    let opened_after = wait_for("the breaker opens", Duration::from_secs(10), || async {
        let (_, body) = check(&node, "t").await;
        assert_eq!(body["mode"], "open", "{body}");
        let m = metrics(&node).await;
        (sample(&m, "tierlimit_store_up") == 0.0).then(|| stopped.elapsed())
    })
    .await;
    assert!(
        opened_after >= Duration::from_millis(400),
        "not before the threshold: {opened_after:?}"
    );
    let m = metrics(&node).await;
    assert_eq!(
        sample(&m, "tierlimit_breaker_opens_total{reason=\"stalled\"}"),
        1.0
    );
    // Open: the fail mode answers without waiting for Redis: no decision
    // is sent to it, so none times out. (Counted rather than timed: the
    // wait it avoids is store_timeout, 100 ms, which a busy 2-core machine
    // can add to any HTTP round trip on its own.)
    let timeouts = r#"tierlimit_redis_errors_total{kind="timeout",op="decide"}"#;
    let before = sample(&metrics(&node).await, timeouts);
    let t = Instant::now();
    assert_eq!(check(&node, "t").await.1["mode"], "open");
    let answered_in = t.elapsed();
    assert_eq!(
        sample(&metrics(&node).await, timeouts),
        before,
        "a decision waited for the stopped Redis with the breaker open (answered in {answered_in:?})"
    );

    redis.proc.cont();
    wait_for(
        "the node decides in Redis again",
        Duration::from_secs(10),
        || async { (check(&node, "t").await.1["mode"] == "redis").then_some(()) },
    )
    .await;
    // The calls given up on reached Redis after their deadline: refused by
    // the script, nothing to compensate.
    let m = wait_for(
        "the late replies are accounted",
        Duration::from_secs(10),
        || async {
            let m = metrics(&node).await;
            (sample(&m, "tierlimit_late_replies_total{outcome=\"refused\"}") >= 1.0).then_some(m)
        },
    )
    .await;
    assert_eq!(
        sample(&m, "tierlimit_late_replies_total{outcome=\"compensated\"}"),
        0.0
    );
    assert_eq!(
        sample(&m, "tierlimit_uncompensated_total{reason=\"no_reply\"}"),
        0.0
    );
    let redis_allowed: f64 = m
        .lines()
        .filter(|l| {
            l.starts_with("tierlimit_decisions_total{")
                && l.contains(r#"outcome="allowed""#)
                && l.contains(r#"mode="redis""#)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let (_, pn) = region_count(&node, "t").await;
    assert_eq!(
        pn as f64, redis_allowed,
        "Redis counted what it allowed, nothing more"
    );
}

/// A TCP proxy to Redis whose replies can be held (the script runs, and
/// charges, at once; its reply waits in the proxy until released) or
/// throttled (replies keep coming, at most `throttle` bytes every
/// [`HeldReplies::TICK`]: a Redis that serves, slower than the load).
struct HeldReplies {
    port: u16,
    open: watch::Sender<bool>,
    throttle: Arc<AtomicUsize>,
}

impl HeldReplies {
    const TICK: Duration = Duration::from_millis(10);

    async fn start(upstream: u16) -> HeldReplies {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (open, gate) = watch::channel(true);
        let throttle = Arc::new(AtomicUsize::new(0));
        let limit = Arc::clone(&throttle);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
                let mut gate = gate.clone();
                let limit = Arc::clone(&limit);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        // Bytes read while held are written only once released.
                        if gate.wait_for(|open| *open).await.is_err() {
                            break;
                        }
                        let throttled = limit.load(Ordering::Relaxed);
                        let per_tick = if throttled == 0 { n } else { throttled };
                        let mut failed = false;
                        for chunk in buf[..n].chunks(per_tick) {
                            failed = cw.write_all(chunk).await.is_err();
                            if failed {
                                break;
                            }
                            if throttled > 0 {
                                tokio::time::sleep(HeldReplies::TICK).await;
                            }
                        }
                        if failed {
                            break;
                        }
                    }
                });
            }
        });
        HeldReplies {
            port,
            open,
            throttle,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn hold(&self) {
        self.open.send_replace(false);
    }

    fn release(&self) {
        self.open.send_replace(true);
    }

    /// At most `bytes` of replies per tick from now on (0: no limit).
    fn throttle(&self, bytes: usize) {
        self.throttle.store(bytes, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_charged_after_the_node_gave_up_is_undone() {
    let redis = Redis::start();
    let proxy = HeldReplies::start(redis.port()).await;
    let dir = temp_dir();
    // The breaker stays closed throughout: this is about single calls.
    let node_cfg = r#"
store_timeout = "400ms"
store_unavailable_after = "30s"
"#;
    let plans = plan_t(10, "closed");
    let cfg = write_config(dir.path(), &config(&proxy.url(), node_cfg, &plans));
    let node = RegionNode::start(&cfg, "eu", "a").await;
    assert_eq!(check(&node, "t").await.0, 200);
    assert_eq!(region_count(&node, "t").await, (9, 1));

    // 1. Redis runs the check at once (well before its deadline, half the
    //    store timeout) and charges it; the reply is held past the store
    //    timeout, so the node answers from its fail mode (closed: 503).
    proxy.hold();
    let (status, body) = check(&node, "t").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["violated-policy"], "store", "{body}");
    proxy.release();
    let m = wait_for(
        "the late reply is compensated",
        Duration::from_secs(10),
        || async {
            let m = metrics(&node).await;
            (sample(&m, "tierlimit_late_replies_total{outcome=\"compensated\"}") == 1.0)
                .then_some(m)
        },
    )
    .await;
    assert_eq!(
        sample(&m, "tierlimit_uncompensated_total{reason=\"no_reply\"}"),
        0.0
    );
    assert_eq!(
        sample(
            &m,
            "tierlimit_uncompensated_total{reason=\"refund_failed\"}"
        ),
        0.0
    );
    assert_eq!(
        region_count(&node, "t").await,
        (9, 1),
        "the window and the day's count as if the check had never been sent"
    );

    // 2. Redis frozen past the store timeout: the call reaches the script
    //    after its deadline and the script refuses it.
    redis.proc.stop();
    let (status, _) = check(&node, "t").await;
    assert_eq!(status, 503);
    redis.proc.cont();
    let m = wait_for(
        "the late reply is seen refused",
        Duration::from_secs(10),
        || async {
            let m = metrics(&node).await;
            (sample(&m, "tierlimit_late_replies_total{outcome=\"refused\"}") == 1.0).then_some(m)
        },
    )
    .await;
    assert_eq!(
        sample(&m, "tierlimit_late_replies_total{outcome=\"compensated\"}"),
        1.0
    );
    assert_eq!(region_count(&node, "t").await, (9, 1));
    assert_eq!(sample(&m, "tierlimit_store_up"), 1.0);

    // And the node goes on charging normally.
    let (status, body) = check(&node, "t").await;
    assert_eq!(
        (status, body["mode"].as_str()),
        (200, Some("redis")),
        "{body}"
    );
    assert_eq!(region_count(&node, "t").await, (8, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_behind_a_backlog_is_shed_not_failed_over() {
    let redis = Redis::start();
    let proxy = HeldReplies::start(redis.port()).await;
    let dir = temp_dir();
    // No admission bound to speak of: every request's call goes to Redis,
    // so the backlog builds in the connection and in Redis, not in the
    // node's queue.
    let node_cfg = r#"
store_timeout = "100ms"
store_unavailable_after = "2s"
max_in_flight = 10000
max_queue = 0
"#;
    let plans = plan_t(1_000_000, "local");
    let cfg = write_config(dir.path(), &config(&proxy.url(), node_cfg, &plans));
    let node = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    // The first call also loads the script (NOSCRIPT, SCRIPT LOAD, again):
    // wait until one is decided by Redis.
    wait_for(
        "a check decided by Redis",
        Duration::from_secs(10),
        || async {
            let (status, body) = check(&node, "t").await;
            (status == 200 && body["mode"] == "redis").then_some(())
        },
    )
    .await;
    let (_, before) = region_count(&node, "t").await;
    // On a loaded machine the first check (which loads the script) may
    // itself have waited past store_timeout and been shed.
    let shed_before = sample(
        &metrics(&node).await,
        "tierlimit_shed_total{reason=\"store_backlog\"}",
    ) as usize;

    // About 100 bytes per reply: Redis' answers come back at about 200 a
    // second, one every few ms, against a load of 400 a second.
    proxy.throttle(200);
    let seen = open_loop(&node, "t", 400, Duration::from_millis(1500)).await;
    proxy.throttle(0);

    let allowed = seen.iter().filter(|s| s.status == 200).count();
    let shed: Vec<&Seen> = seen.iter().filter(|s| s.status == 503).collect();
    let mut modes = std::collections::BTreeMap::<String, usize>::new();
    for s in &seen {
        *modes.entry(s.body["mode"].to_string()).or_default() += 1;
    }
    println!(
        "{} requests: {allowed} allowed, {} shed; modes {modes:?}",
        seen.len(),
        shed.len()
    );
    assert_eq!(allowed + shed.len(), seen.len(), "only 200 or 503");
    assert!(allowed > 0, "what Redis answers in time is served");
    assert!(
        shed.len() > seen.len() / 4,
        "the backlog made calls wait past store_timeout ({} of {} shed)",
        shed.len(),
        seen.len()
    );
    for s in &shed {
        assert_eq!(s.retry_after.as_deref(), Some("1"), "{:?}", s.body);
        assert_eq!(
            (s.body["type"].as_str(), s.body["reason"].as_str()),
            (
                Some("https://tierlimit.dev/problems/overloaded"),
                Some("store_backlog")
            ),
            "shed behind the backlog, not a store failure: {}",
            s.body
        );
    }
    let m = metrics(&node).await;
    for mode in ["open", "closed", "local"] {
        assert_eq!(
            sample(
                &m,
                &format!("tierlimit_fail_mode_decisions_total{{mode=\"{mode}\"}}")
            ),
            0.0,
            "no fail-mode decision while Redis answers ({mode})"
        );
    }
    assert_eq!(
        sample(&m, "tierlimit_shed_total{reason=\"store_backlog\"}") as usize - shed_before,
        shed.len()
    );
    assert_eq!(sample(&m, "tierlimit_store_up"), 1.0);

    // What Redis charged for the shed calls is refunded as their replies
    // arrive: the region's count ends at exactly what was allowed.
    let counted = wait_for(
        "the late charges of shed calls are undone",
        Duration::from_secs(40),
        || async {
            let (_, pn) = try_region_count(&node, "t").await?;
            (pn as usize == allowed + before as usize).then_some(pn)
        },
    )
    .await;
    assert_eq!(counted as usize, allowed + before as usize);
    let m = metrics(&node).await;
    assert_eq!(
        sample(&m, "tierlimit_uncompensated_total{reason=\"no_reply\"}")
            + sample(
                &m,
                "tierlimit_uncompensated_total{reason=\"refund_failed\"}"
            ),
        0.0
    );
}
