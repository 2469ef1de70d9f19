//! A region behind Redis Sentinel, against the real thing: one master, one
//! replica and three `redis-sentinel` processes (testkit's
//! [`SentinelGroup`]), and a real region-node whose `redis_url` is
//! `redis+sentinel://…/<master>`.
//!
//! What is promised (README, "Redis"): a node follows a failover to the
//! promoted replica without a restart; a demoted master's READONLY makes it
//! ask the sentinels again instead of opening its breaker. Redis'
//! replication is asynchronous: writes the old master acknowledged but had
//! not yet sent are lost on failover and show as spend given back. After a
//! graceful failover (replication caught up first) the region tier is
//! exact; after a kill -9 without waiting (the replica paused so that the
//! loss really happens) it re-admits at most the writes acknowledged after
//! the last moment the replication offsets showed the replica in sync,
//! judged from the clients' history (`history::failover_loss`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::history::{self, now_us, History, Outcome};
use harness::redis_sentinel::SentinelGroup;
use harness::{temp_dir, wait_until, write_config, Budget, RegionNode};

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

/// Checks at a steady pace until stopped, recorded in a history.
struct Traffic {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Traffic {
    fn start(n: &Arc<RegionNode>, h: &History) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let client = history::Client::new(h.clone(), "eu", "a", &n.url(""));
        let s = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            while !s.load(Ordering::Relaxed) {
                tick.tick().await;
                client.check("t", 1).await;
            }
        });
        Traffic { stop, task }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
    }
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
/// sentinels, then decides there without a restart. After a graceful
/// failover (which the test lets replication catch up for) the region tier
/// admits exactly its limit across the two masters. After a kill -9 it does
/// not wait: the replica is paused (SIGSTOP, link dropped) so the master
/// acknowledges writes the promoted replica never gets, and the history
/// checker ([`history::failover_loss`]) bounds the region tier's
/// re-admission by the units allowed after the last moment the replication
/// offsets showed the replica in sync, until the kill.
async fn failover_under_traffic(fault: Fault) {
    // This suite's share of the test time (a run takes about 4 s).
    let budget = Budget::start("sentinel", Duration::from_secs(90));
    let mut group = tokio::task::block_in_place(SentinelGroup::start);
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&group.sentinel_url()));
    let n = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    let h = History::new();
    let allowed = |h: &History| h.allowed("t");
    let mut traffic = Some(Traffic::start(&n, &h));
    wait_until(
        "100 allowed before the fault",
        budget.cap(Duration::from_secs(30)),
        || {
            let a = allowed(&h);
            async move { a >= 100 }
        },
    )
    .await;
    let old = tokio::task::block_in_place(|| group.master_port());
    let (mut synced_us, mut killed_us) = (u64::MAX, u64::MAX);
    let fault_us = match fault {
        Fault::Kill => {
            let replica = *group.replicas().first().expect("a replica");
            let offset = harness::redis_server::repl_offset;
            // The last moment the offsets show the replica holding all the
            // master had acknowledged (master's offset read first).
            let (t, synced_offset) = tokio::task::block_in_place(|| {
                harness::wait_for_blocking(
                    "the replica reaches its master's offset",
                    budget.cap(Duration::from_secs(10)),
                    || {
                        let t = now_us();
                        let m = offset(old, "master_repl_offset")?;
                        let s = offset(replica, "slave_repl_offset")?;
                        (s >= m).then_some((t, m))
                    },
                )
            });
            synced_us = t;
            group.pause(replica);
            let mut kill_link = redis::cmd("CLIENT");
            kill_link.arg("KILL").arg("TYPE").arg("replica");
            harness::query::<u64>(old, &kill_link).expect("CLIENT KILL TYPE replica");
            let at_pause = allowed(&h);
            wait_until(
                "the master acknowledges writes its replica does not get",
                budget.cap(Duration::from_secs(20)),
                || {
                    let a = allowed(&h);
                    async move { a >= at_pause + 3 }
                },
            )
            .await;
            let offset_at_kill = offset(old, "master_repl_offset").expect("master offset");
            killed_us = now_us();
            group.kill(old);
            group.resume(replica);
            eprintln!(
                "replication offsets: replica in sync at {synced_offset}, master at the kill {offset_at_kill}"
            );
            killed_us
        }
        Fault::Graceful => {
            // Stop, let the replica catch up, then fail over: nothing
            // acknowledged is lost, so the region tier must be exact.
            if let Some(t) = traffic.take() {
                t.stop().await;
            }
            tokio::task::block_in_place(|| group.wait_replicated());
            let mut con = redis::Client::open(group.sentinel_urls()[0].clone())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let at = now_us();
            redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(group.master_name())
                .query_async::<()>(&mut con)
                .await
                .unwrap();
            at
        }
    };
    let traffic = traffic.unwrap_or_else(|| Traffic::start(&n, &h));
    let new = tokio::task::block_in_place(|| group.wait_failover(old));
    assert_ne!(new, old);
    wait_until(
        "the node decides in the new master",
        budget.cap(Duration::from_secs(30)),
        || {
            let ev = h.events();
            async move {
                // Two in a row: one lucky answer could still come from the old one.
                let after: Vec<_> = ev.iter().filter(|e| e.start_us > fault_us).collect();
                after.len() >= 2
                    && after[after.len() - 2..]
                        .iter()
                        .all(|e| e.mode() == Some("redis"))
            }
        },
    )
    .await;
    traffic.stop().await;
    let ev = h.events();
    assert!(
        ev.iter()
            .all(|e| e.allowed() || e.outcome == Outcome::Unavailable),
        "only decisions or the fail mode's 503: {}",
        history::summary(&ev, "t")
    );
    let unavailable: Vec<u64> = ev
        .iter()
        .filter(|e| e.outcome == Outcome::Unavailable)
        .map(|e| e.end_us)
        .collect();
    let last_503 = unavailable
        .last()
        .map(|t| Duration::from_micros(t.saturating_sub(fault_us)));
    eprintln!(
        "sentinel {fault:?}: {} answered 503 by the fail mode, the last {last_503:?} after the fault",
        unavailable.len()
    );

    // The region tier goes on where the new master has it: up to its
    // limit, then a region 429.
    let client = history::Client::new(h.clone(), "eu", "a", &n.url(""));
    loop {
        match client.check("t", 1).await {
            Outcome::Ok { .. } => {}
            Outcome::Denied { tier, .. } => {
                assert_eq!(tier, "region");
                break;
            }
            o => panic!("after the failover: {o:?}"),
        }
        assert!(
            allowed(&h) <= 2 * REGION_LIMIT,
            "the region tier never denies"
        );
    }
    // Judged from the record: the limit, plus at most what was
    // acknowledged and not replicated; with no global tier here, the
    // "total" is what the new master counts (the limit it reached).
    let report = history::failover_loss(
        &h.events(),
        "t",
        synced_us,
        killed_us,
        None,
        REGION_LIMIT,
        Some(REGION_LIMIT),
    );
    eprintln!("sentinel {fault:?}: {}", report.describe());
    assert!(report.violations().is_empty(), "{:?}", report.violations());
    assert!(
        report.allowed >= REGION_LIMIT,
        "the region tier admitted its limit: {}",
        report.describe()
    );
    if let Fault::Kill = fault {
        assert!(
            report.unpublished >= 3,
            "writes acknowledged after the replica stopped: {}",
            report.describe()
        );
    }
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    assert_eq!(metric(&m, "tierlimit_store_up"), 1.0);
    eprintln!(
        "sentinel {fault:?}: {} master look-ups after READONLY, breaker opened {} times",
        metric(&m, "tierlimit_redis_master_resolutions_total"),
        n.proc.log().matches("Redis unavailable").count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_followed_and_readmits_at_most_the_unreplicated_writes() {
    failover_under_traffic(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_failover_is_followed_without_a_restart_and_stays_exact() {
    failover_under_traffic(Fault::Graceful).await;
}
