//! Scenario 8, a region on more than one Redis: the same closed-loop load
//! through region-node against a standalone Redis and against a 3-master
//! Redis Cluster (key scheme 2), in alternating rounds: decisions/s and CPU
//! per decision of region-node and of Redis (every redis-server process of
//! the deployment). On 2 cores both runs are CPU-bound, so the comparable
//! figures are CPU per decision; the Redis-side ceiling per master is one
//! core's worth of it. Then failover under a steady load, cluster and
//! Sentinel: time from the master's kill to the first decision served by
//! its replacement, and the answers the fail mode gave meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use testkit::{RedisCluster, RegionNode, SentinelGroup};
use tierlimit_shared::keys;

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::scenario::ceiling::WARMUP;
use crate::scenario::median;
use crate::world::{solo_config, start_node};

/// One throughput round.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Round {
    pub summary: Summary,
    pub node_cpu_us: f64,
    pub redis_cpu_us: f64,
}

/// A failover under load.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Failover {
    pub kind: String,
    /// Kill → first decision answered by Redis again, ms.
    pub to_first_decision_ms: u64,
    /// Answers from the fail mode (`closed`: 503) between the two.
    pub fail_mode_answers: u64,
    pub requests: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterBench {
    pub rounds: u64,
    pub duration: u64,
    pub connections: u64,
    pub tenants: u64,
    pub standalone: Vec<Round>,
    pub cluster: Vec<Round>,
    /// Medians.
    pub standalone_rps: f64,
    pub cluster_rps: f64,
    pub standalone_node_cpu_us: f64,
    pub cluster_node_cpu_us: f64,
    pub standalone_redis_cpu_us: f64,
    pub cluster_redis_cpu_us: f64,
    /// 10⁶ ÷ the cluster's Redis CPU µs per decision: what one more master
    /// (one more core) adds at most.
    pub per_master_ceiling_rps: f64,
    pub failovers: Vec<Failover>,
}

/// Leases off: the scenario compares the stores, so every check is a
/// decision-script call (as before leases were on by default).
fn config(redis_url: &str) -> String {
    solo_config("8", redis_url, "lease_max = 0", "")
}

/// The configuration file of one deployment, in a directory of its own.
fn write(dir: &std::path::Path, name: &str, toml: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir)?;
    Ok(testkit::write_config(&dir, toml))
}

/// The failover runs' node log: what the store did, without the detached
/// Kafka side's complaints.
const LOG: &str = "warn,rdkafka=off,librdkafka=off,region_node::storage=debug";

fn ticks(pids: &[u32]) -> u64 {
    pids.iter()
        .map(|p| testkit::cpu_ticks(*p).unwrap_or(0))
        .sum()
}

async fn round(
    run: &Run,
    k: &Knobs,
    name: &str,
    node: &RegionNode,
    redis_pids: &[u32],
) -> anyhow::Result<Round> {
    let (n0, r0) = (ticks(&[node.proc.pid()]), ticks(redis_pids));
    let summary = run
        .http(
            name,
            &[
                strings(["--url".to_string(), node.url("/v1/check")]),
                crate::loadgen::closed(k.connections, k.tenants, k.duration, WARMUP),
            ]
            .concat(),
        )
        .await?;
    let (n1, r1) = (ticks(&[node.proc.pid()]), ticks(redis_pids));
    // Ticks are 1/100 s; the warm-up's requests are in the ticks too.
    let decisions = (summary.throughput_rps * (k.duration + WARMUP) as f64).max(1.0);
    Ok(Round {
        node_cpu_us: (n1 - n0) as f64 * 10_000.0 / decisions,
        redis_cpu_us: (r1 - r0) as f64 * 10_000.0 / decisions,
        summary,
    })
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<ClusterBench> {
    run.scenario("8 a region on a standalone Redis and on a 3-master Redis Cluster");
    let dir = testkit::temp_dir();
    let standalone = testkit::Redis::start();
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3, 0));
    let cfg_s = write(dir.path(), "standalone", &config(&standalone.url()))?;
    let cfg_c = write(dir.path(), "cluster", &config(&cluster.cluster_url()))?;
    run.record("# scenario 8: a standalone redis-server and a 3-master cluster".to_string());
    run.record_spawned(&standalone.proc);
    for pid in cluster.pids() {
        run.record_spawned_pid(pid);
    }
    run.record(format!("# scenario 8: {}", cfg_c.display()));
    let node_s = start_node(run, &cfg_s, "eu", "eu-1", "/healthz", &[]).await;
    let node_c = start_node(run, &cfg_c, "eu", "eu-1", "/healthz", &[]).await;
    let mut r = ClusterBench {
        rounds: k.rounds,
        duration: k.duration,
        connections: k.connections,
        tenants: k.tenants,
        ..ClusterBench::default()
    };
    for i in 0..k.rounds {
        r.standalone.push(
            round(
                run,
                k,
                &format!("s8_standalone_{i}"),
                &node_s,
                &[standalone.proc.pid()],
            )
            .await?,
        );
        r.cluster
            .push(round(run, k, &format!("s8_cluster_{i}"), &node_c, &cluster.pids()).await?);
    }
    let med = |v: &[Round], f: fn(&Round) -> f64| median(v.iter().map(f).collect());
    r.standalone_rps = med(&r.standalone, |x| x.summary.throughput_rps);
    r.cluster_rps = med(&r.cluster, |x| x.summary.throughput_rps);
    r.standalone_node_cpu_us = med(&r.standalone, |x| x.node_cpu_us);
    r.cluster_node_cpu_us = med(&r.cluster, |x| x.node_cpu_us);
    r.standalone_redis_cpu_us = med(&r.standalone, |x| x.redis_cpu_us);
    r.cluster_redis_cpu_us = med(&r.cluster, |x| x.redis_cpu_us);
    r.per_master_ceiling_rps = 1e6 / r.cluster_redis_cpu_us.max(0.001);
    drop((node_s, node_c, cluster, standalone));

    // Failovers under a steady 200 req/s on one tenant.
    let mut c = tokio::task::block_in_place(|| RedisCluster::start(3, 1));
    run.record("# scenario 8: the failover cluster (3 masters, 1 replica each)".to_string());
    for pid in c.pids() {
        run.record_spawned_pid(pid);
    }
    let cfg = write(dir.path(), "failover-cluster", &config(&c.cluster_url()))?;
    let node = start_node(run, &cfg, "eu", "eu-1", "/healthz", &[("RUST_LOG", LOG)]).await;
    let slot = keys::bucket_slot(keys::bucket_of("hot"));
    r.failovers.push(
        failover(
            &node,
            "cluster (kill -9 of the hot tenant's master)",
            || {
                let old = c.kill_master_of_slot(slot);
                c.wait_failover(slot, old);
            },
        )
        .await?,
    );
    drop(node);
    let mut g = tokio::task::block_in_place(SentinelGroup::start);
    // testkit does not expose the group's processes: named, not recorded.
    run.record(
        "# scenario 8: a Sentinel group started by testkit::SentinelGroup (1 master, 1 replica, 3 sentinels; their command lines not recorded)"
            .to_string(),
    );
    let cfg = write(dir.path(), "failover-sentinel", &config(&g.sentinel_url()))?;
    let node = start_node(run, &cfg, "eu", "eu-1", "/healthz", &[("RUST_LOG", LOG)]).await;
    r.failovers.push(
        failover(&node, "Sentinel (kill -9 of the master)", || {
            let old = g.kill_master();
            g.wait_failover(old);
        })
        .await?,
    );
    Ok(r)
}

/// Steady checks of tenant `hot` every 5 ms; `kill` kills the master at
/// once and waits for the failover. Measures kill → first decision in
/// Redis again. (One closure: the deployment it borrows must outlive it.)
async fn failover(node: &RegionNode, kind: &str, kill: impl FnOnce()) -> anyhow::Result<Failover> {
    run_say(kind);
    let http = node.http.clone();
    let url = node.url("/v1/check");
    // Warm: the node decides in Redis.
    testkit::wait_until("the node decides in Redis", Duration::from_secs(30), || {
        let (http, url) = (http.clone(), url.clone());
        async move { answer(&http, &url).await.1 }
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<Vec<(Instant, u16, bool)>>> = Arc::default();
    let task = {
        let (stop, seen, http, url) = (
            Arc::clone(&stop),
            Arc::clone(&seen),
            http.clone(),
            url.clone(),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(5));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let (status, redis) = answer(&http, &url).await;
                seen.lock().unwrap().push((Instant::now(), status, redis));
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = Instant::now();
    tokio::task::block_in_place(kill);
    testkit::wait_until(
        "a decision in Redis after the failover",
        Duration::from_secs(60),
        || {
            let seen = Arc::clone(&seen);
            async move {
                let seen = seen.lock().unwrap();
                let after: Vec<_> = seen.iter().filter(|(t, _, _)| *t > killed).collect();
                match after.iter().position(|(_, status, _)| *status == 503) {
                    Some(i) => after[i..].iter().any(|(_, _, redis)| *redis),
                    None => false,
                }
            }
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    task.await?;
    let seen = seen.lock().unwrap();
    // Requests in flight at the kill may still be answered by the old
    // master: the failover is over at the first decision in Redis after the
    // first answer the fail mode gave.
    let after: Vec<&(Instant, u16, bool)> = seen.iter().filter(|(t, _, _)| *t > killed).collect();
    let first_fail = after.iter().position(|(_, status, _)| *status == 503);
    let back = match first_fail {
        Some(i) => after[i..].iter().find(|(_, _, redis)| *redis),
        None => after.iter().find(|(_, _, redis)| *redis),
    };
    let first = back
        .map(|(t, _, _)| t.duration_since(killed))
        .unwrap_or_default();
    Ok(Failover {
        kind: kind.to_string(),
        to_first_decision_ms: first.as_millis() as u64,
        fail_mode_answers: after.iter().filter(|(_, status, _)| *status == 503).count() as u64,
        requests: seen.len() as u64,
    })
}

fn run_say(kind: &str) {
    eprintln!("bench: failover under load: {kind}");
}

/// One check: (status, decided in Redis).
async fn answer(http: &reqwest::Client, url: &str) -> (u16, bool) {
    match http
        .post(url)
        .json(&serde_json::json!({ "tenant": "hot" }))
        .timeout(Duration::from_secs(2))
        .send()
        .await
    {
        Ok(r) => {
            let status = r.status().as_u16();
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            (status, v["mode"] == "redis")
        }
        Err(_) => (0, false),
    }
}
