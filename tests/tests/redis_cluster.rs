//! The node's Redis Cluster routing (`region_node::storage::cluster`)
//! against a real six-process cluster (three masters, one replica each):
//! commands reach the master of their slot, MOVED and ASK during a slot
//! migration under traffic lose and double nothing, and after a master is
//! killed a command that may have run is never re-sent.
//!
//! The decision script itself does not run on a cluster yet (its dirty set
//! is outside the tenant's slot); these tests use `INCR`, which, like the
//! script, must run exactly once per call that succeeded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::{wait_until, Budget, RedisCluster};
use region_node::storage::cluster::ClusterRouter;
use region_node::storage::StoreError;
use tierlimit_shared::keys::cluster_slot;

const TIMEOUT: Duration = Duration::from_millis(500);
/// Each test's share of the suite's time (a run takes about 10 s).
const BUDGET: Duration = Duration::from_secs(90);

fn seeds(c: &RedisCluster) -> Vec<String> {
    c.seed_addrs()
}

fn incr(key: &str) -> redis::Cmd {
    let mut c = redis::cmd("INCR");
    c.arg(key);
    c
}

/// Reads `key` straight from the master that serves its slot now.
fn read_at_master(c: &RedisCluster, key: &str) -> u64 {
    let port = c.master_of_slot(cluster_slot(key.as_bytes()));
    let mut get = redis::cmd("GET");
    get.arg(key);
    harness::query::<Option<u64>>(port, &get)
        .expect("GET at the master")
        .unwrap_or(0)
}

/// INCRs of `key` through the router until stopped: (succeeded, failed).
fn hammer(
    router: &Arc<ClusterRouter>,
    key: &'static str,
    stop: &Arc<AtomicBool>,
) -> (tokio::task::JoinHandle<()>, Arc<AtomicU64>, Arc<AtomicU64>) {
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (r, s, o, f) = (
        Arc::clone(router),
        Arc::clone(stop),
        Arc::clone(&ok),
        Arc::clone(&failed),
    );
    let slot = cluster_slot(key.as_bytes());
    let task = tokio::spawn(async move {
        while !s.load(Ordering::Relaxed) {
            match r.query::<u64>(slot, &incr(key)).await {
                Ok(_) => o.fetch_add(1, Ordering::Relaxed),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    f.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
    });
    (task, ok, failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_reach_the_master_of_their_slot() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3, 1));
    let router = ClusterRouter::connect(seeds(&cluster), TIMEOUT)
        .await
        .unwrap();
    assert_eq!(router.masters().len(), 3);
    for i in 0..200 {
        let key = format!("tl:{{t{i}}}:x");
        let slot = cluster_slot(key.as_bytes());
        let v: u64 = router.query(slot, &incr(&key)).await.unwrap();
        assert_eq!(v, 1);
        assert_eq!(
            router.master_of(slot),
            Some(format!("127.0.0.1:{}", cluster.master_of_slot(slot)))
        );
    }
    // A command whose keys span slots is refused, never half-run.
    let mut mset = redis::cmd("MSET");
    mset.arg("{a}x").arg(1).arg("{b}x").arg(1);
    let e = router
        .query::<()>(cluster_slot(b"{a}x"), &mset)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Redis(_)), "{e}");
}

/// The hot key's slot moves to another master while INCRs run: MOVED and
/// ASK are followed, and the count is exactly the successes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migration_under_traffic_loses_and_doubles_nothing() {
    let budget = Budget::start("redis_cluster", BUDGET);
    const KEY: &str = "tl:{hot}:x";
    let cluster = Arc::new(tokio::task::block_in_place(|| RedisCluster::start(3, 1)));
    let router = ClusterRouter::connect(seeds(&cluster), TIMEOUT)
        .await
        .unwrap();
    let slot = cluster_slot(KEY.as_bytes());
    let from = cluster.master_of_slot(slot);
    let to = *cluster.masters().iter().find(|p| **p != from).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (task, ok, failed) = hammer(&router, KEY, &stop);
    wait_until(
        "traffic before the move",
        budget.cap(Duration::from_secs(10)),
        || {
            let ok = Arc::clone(&ok);
            async move { ok.load(Ordering::Relaxed) >= 200 }
        },
    )
    .await;
    let c = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || c.move_slot(slot, to))
        .await
        .unwrap();
    let at_move = ok.load(Ordering::Relaxed);
    wait_until(
        "traffic after the move",
        budget.cap(Duration::from_secs(10)),
        || {
            let ok = Arc::clone(&ok);
            async move { ok.load(Ordering::Relaxed) >= at_move + 200 }
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    task.await.unwrap();
    assert_eq!(router.master_of(slot), Some(format!("127.0.0.1:{to}")));
    let value = tokio::task::block_in_place(|| read_at_master(&cluster, KEY));
    assert_eq!(
        value,
        ok.load(Ordering::Relaxed),
        "every success counted once ({} failed)",
        failed.load(Ordering::Relaxed)
    );
}

/// The hot key's master is killed (-9) while INCRs run: calls in flight
/// fail and are not re-sent (each may or may not have run), the replica is
/// promoted, and the router finds it without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_followed_and_nothing_is_re_sent() {
    let budget = Budget::start("redis_cluster", BUDGET);
    const KEY: &str = "tl:{hot}:y";
    let mut cluster = tokio::task::block_in_place(|| RedisCluster::start(3, 1));
    let router = ClusterRouter::connect(seeds(&cluster), TIMEOUT)
        .await
        .unwrap();
    let slot = cluster_slot(KEY.as_bytes());
    let stop = Arc::new(AtomicBool::new(false));
    let (task, ok, failed) = hammer(&router, KEY, &stop);
    wait_until(
        "traffic before the kill",
        budget.cap(Duration::from_secs(10)),
        || {
            let ok = Arc::clone(&ok);
            async move { ok.load(Ordering::Relaxed) >= 200 }
        },
    )
    .await;
    tokio::task::block_in_place(|| cluster.wait_replicated());
    let old = tokio::task::block_in_place(|| cluster.kill_master_of_slot(slot));
    let at_kill = ok.load(Ordering::Relaxed);
    let new = tokio::task::block_in_place(|| cluster.wait_failover(slot, old));
    wait_until(
        "the router writes to the promoted replica",
        budget.cap(Duration::from_secs(20)),
        || {
            let ok = Arc::clone(&ok);
            async move { ok.load(Ordering::Relaxed) >= at_kill + 200 }
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    task.await.unwrap();
    assert_eq!(router.master_of(slot), Some(format!("127.0.0.1:{new}")));
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert!(failed > 0, "the kill was seen");
    let value = tokio::task::block_in_place(|| read_at_master(&cluster, KEY));
    // Replication is asynchronous: an INCR the old master acknowledged just
    // before dying may be lost (at most those in flight then), and one that
    // failed may have run. Nothing ran twice: never more than every attempt.
    assert!(
        value <= ok + failed,
        "value {value} ≤ succeeded {ok} + failed {failed}: nothing re-sent"
    );
    assert!(
        value + failed >= ok,
        "value {value}, succeeded {ok}, failed {failed}"
    );
}
