//! A region behind Redis Sentinel, against the real thing: one master, one
//! replica and three `redis-sentinel` processes (testkit's
//! [`SentinelGroup`]), and a real region-node whose `redis_url` is
//! `redis+sentinel://…/<master>`.
//!
//! What is promised (README, "Redis"): a node follows a failover to the
//! promoted replica without a restart; a demoted master's READONLY makes it
//! ask the sentinels again instead of opening its breaker; and because the
//! test waits for replication before the fault, the region tier stays exact
//! across the failover (Redis' replication is asynchronous: writes the old
//! master acknowledged but had not yet sent are lost on failover, and would
//! show as spend given back — that is the bound the tiers keep, and this
//! test removes it to check exactness).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::redis_sentinel::SentinelGroup;
use harness::{temp_dir, wait_until, write_config, Budget, RegionNode};
use serde_json::{json, Value};

/// The region limit of the test tenant: fixed window of an hour, so the
/// whole test is in one window.
const REGION_LIMIT: u64 = 300;

fn config(url: &str) -> String {
    format!(
        r#"
cluster = "test"
[kafka]
brokers = "127.0.0.1:1"
[node]
# This suite checks the Redis path decision by decision: no leases.
lease_max = 0
store_timeout = "500ms"
store_retry_interval = "100ms"
[regions.eu]
redis_url = "{url}"
[plans.p]
region = {{ limit = {REGION_LIMIT}, window = "1h", algorithm = "fixed_window" }}
on_store_error = "closed"
[tenants.t]
plan = "p"
[unknown_tenants]
policy = "deny"
"#
    )
}

async fn check(n: &RegionNode) -> (u16, Value) {
    match n
        .http
        .post(n.url("/v1/check"))
        .json(&json!({ "tenant": "t" }))
        .timeout(Duration::from_secs(5))
        .send()
        .await
    {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.json().await.unwrap_or(Value::Null))
        }
        Err(_) => (0, Value::Null),
    }
}

/// Checks at a steady pace until stopped; every answer with its time.
struct Traffic {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(Instant, u16, Value)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Traffic {
    fn start(n: &Arc<RegionNode>) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Vec<(Instant, u16, Value)>>> = Arc::default();
        let (n, s, v) = (Arc::clone(n), Arc::clone(&stop), Arc::clone(&seen));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            while !s.load(Ordering::Relaxed) {
                tick.tick().await;
                let (status, body) = check(&n).await;
                v.lock().unwrap().push((Instant::now(), status, body));
            }
        });
        Traffic { stop, seen, task }
    }

    async fn stop(self) -> Vec<(Instant, u16, Value)> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        Arc::try_unwrap(self.seen).unwrap().into_inner().unwrap()
    }
}

fn allowed(seen: &[(Instant, u16, Value)]) -> u64 {
    seen.iter().filter(|(_, s, _)| *s == 200).count() as u64
}

fn metric(text: &str, name: &str) -> f64 {
    harness::metric_value(text, name)
}

/// How the master goes away.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// kill -9: the node's connection drops and Sentinel promotes the
    /// replica after `down-after-milliseconds`.
    Kill,
    /// `SENTINEL FAILOVER`: the master is demoted while it runs (Sentinel
    /// kills its clients' connections so they look the master up again).
    Graceful,
}

/// The master goes away under traffic: the node answers by its fail mode
/// (`closed`: 503) until it finds the promoted replica through the
/// sentinels, then decides there without a restart, and the region tier
/// admits exactly its limit across the two masters.
async fn failover_under_traffic(fault: Fault) {
    // This suite's share of the test time (a run takes about 4 s).
    let budget = Budget::start("sentinel", Duration::from_secs(90));
    let mut group = tokio::task::block_in_place(SentinelGroup::start);
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&group.sentinel_url()));
    let n = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    let traffic = Traffic::start(&n);
    wait_until(
        "100 allowed before the fault",
        budget.cap(Duration::from_secs(30)),
        || {
            let seen = Arc::clone(&traffic.seen);
            async move { allowed(&seen.lock().unwrap()) >= 100 }
        },
    )
    .await;
    // Stop, let the replica catch up, then fail over: nothing acknowledged
    // is lost, so the region tier must be exact.
    let before = traffic.stop().await;
    tokio::task::block_in_place(|| group.wait_replicated());
    let old = tokio::task::block_in_place(|| group.master_port());
    let traffic = Traffic::start(&n);
    let fault_at = Instant::now();
    match fault {
        Fault::Kill => {
            tokio::task::block_in_place(|| group.kill_master());
        }
        Fault::Graceful => {
            let mut con = redis::Client::open(group.sentinel_urls()[0].clone())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(group.master_name())
                .query_async::<()>(&mut con)
                .await
                .unwrap();
        }
    }
    let new = tokio::task::block_in_place(|| group.wait_failover(old));
    assert_ne!(new, old);
    wait_until(
        "the node decides in the new master",
        budget.cap(Duration::from_secs(30)),
        || {
            let seen = Arc::clone(&traffic.seen);
            async move {
                // Two in a row: one lucky answer could still come from the old one.
                let seen = seen.lock().unwrap();
                let after: Vec<_> = seen.iter().filter(|(t, _, _)| *t > fault_at).collect();
                after.len() >= 2
                    && after[after.len() - 2..]
                        .iter()
                        .all(|(_, _, b)| b["mode"] == "redis")
            }
        },
    )
    .await;
    let during = traffic.stop().await;
    assert!(
        during.iter().all(|(_, s, _)| matches!(s, 200 | 503)),
        "only decisions or the fail mode's 503"
    );
    let unavailable: Vec<Instant> = during
        .iter()
        .filter(|(_, s, _)| *s == 503)
        .map(|(t, _, _)| *t)
        .collect();
    let last_503 = unavailable.last().map(|t| t.duration_since(fault_at));
    eprintln!(
        "sentinel {fault:?}: {} answered 503 by the fail mode, the last {last_503:?} after the fault",
        unavailable.len()
    );

    // The region tier goes on where the old master left it.
    let mut total = allowed(&before) + allowed(&during);
    assert!(total <= REGION_LIMIT, "{total} allowed");
    while total < REGION_LIMIT {
        let (status, body) = check(&n).await;
        assert_eq!(
            status, 200,
            "allowed up to the limit ({total} so far): {body}"
        );
        total += 1;
    }
    let (status, body) = check(&n).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["violated-policy"], "region", "{body}");
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    assert_eq!(metric(&m, "tierlimit_store_up"), 1.0);
    eprintln!(
        "sentinel {fault:?}: {} master look-ups after READONLY, breaker opened {} times",
        metric(&m, "tierlimit_redis_master_resolutions_total"),
        n.proc.log().matches("Redis unavailable").count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_followed_to_the_promoted_replica() {
    failover_under_traffic(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_failover_is_followed_without_a_restart() {
    failover_under_traffic(Fault::Graceful).await;
}
