//! Scenario 1, the ceiling: `EVALSHA` of decide.lua alone (loadgen over
//! as many connections as region-node's clients, one call in flight on
//! each as `redis-benchmark -c` runs; then 16 in flight on each, as its
//! `-P 16`) against region-node's checks over HTTP at the same concurrency,
//! in alternating rounds (with scenario 7's throttlecrab-server, see
//! [`super::peer`]); each figure is the median round. Then region-node with
//! Zipf tenants and the bare `EVALSHA` over one redis-rs multiplexed
//! connection.
//!
//! The script's calls come from loadgen, not `redis-benchmark`, since the
//! script's numbers became one binary argument (`storage/script.rs`) that a
//! command line cannot carry; loadgen sends exactly what region-node sends.

use serde::{Deserialize, Serialize};
use testkit::RegionNode;

use crate::knobs::Knobs;
use crate::loadgen::{closed, Summary};
use crate::run::{strings, Run};
use crate::scenario::peer::{self, Peer};
use crate::world::{RedisCounts, Region, DECIDE_LUA};

pub const WARMUP: u64 = 1;

/// A run of the script alone: calls per second and latency (ms, as text
/// with three decimals, as redis-benchmark printed them when it ran these).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RbRun {
    pub rps: f64,
    pub p50_ms: String,
    pub p99_ms: String,
}

impl RbRun {
    pub fn of(s: &Summary) -> RbRun {
        let ms = |us: Option<f64>| us.map_or("-".into(), |us| format!("{:.3}", us / 1000.0));
        RbRun {
            rps: s.throughput_rps,
            p50_ms: ms(s.latency_us.as_ref().map(|p| p.p50)),
            p99_ms: ms(s.latency_us.as_ref().map(|p| p.p99)),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Ceiling {
    pub connections: u64,
    pub tenants: u64,
    pub duration: u64,
    pub warmup: u64,
    pub rounds: u64,
    /// Median rounds.
    pub rb_plain: RbRun,
    pub node: Summary,
    pub rb_pipe16: RbRun,
    pub node_zipf: Summary,
    pub evalsha_mux: Summary,
    pub rb_rounds: Vec<f64>,
    pub node_rounds: Vec<f64>,
    /// Zipf rounds, each right after the round's uniform one.
    #[serde(default)]
    pub zipf_rounds: Vec<f64>,
    /// Redis' counters over every uniform region-node round (warm-ups
    /// included).
    pub node_redis: RedisCounts,
    pub rb_redis: RedisCounts,
    /// CPU ticks (1/100 s) over every region-node round.
    pub node_ticks: u64,
    pub redis_ticks: u64,
    /// Derived: CPU µs per decision, EVALSHAs per read, µs per EVALSHA.
    pub node_cpu_us: f64,
    pub redis_cpu_us: f64,
    pub node_per_read: f64,
    pub rb_per_read: f64,
    pub node_usec_per_call: f64,
    pub rb_usec_per_call: f64,
    pub ratio: f64,
}

/// Index of the median round (ties: the earlier round), as
/// `sort -g | awk NR == (n + 1) / 2` picked it.
pub fn median_index(values: &[f64]) -> usize {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|a, b| values[*a].total_cmp(&values[*b]).then(a.cmp(b)));
    idx[values.len().div_ceil(2) - 1]
}

/// decide.lua's KEYS/ARGV exactly as region-node eu-1 sends them for the
/// bench plan (loadgen's script options).
pub fn script_opts() -> Vec<String> {
    strings([
        "--node-id",
        "eu-1",
        "--node-algorithm",
        "1",
        "--node-limit",
        "1000000",
        "--node-window-ms",
        "1000",
        "--region-algorithm",
        "2",
        "--region-limit",
        "100000000",
        "--region-window-ms",
        "60000",
        "--global-limit",
        "1000000000000",
        "--ttl-s",
        &(3 * 86400).to_string(),
    ])
}

/// Runs scenario 1 (and 7's rounds when `with_peer`) against `solo`, a
/// region-node with its Kafka side detached whose Redis is `eu`.
pub async fn run(
    run: &Run,
    k: &Knobs,
    solo: &RegionNode,
    eu: &Region,
    with_peer: bool,
) -> anyhow::Result<(Ceiling, Option<Peer>)> {
    let tc_version = peer::version();
    run.scenario(&format!(
        "1/7 + 7/7 ceiling and peer: EVALSHA alone (loadgen), region-node, throttlecrab-server {tc_version} ({} rounds, {} connections, {} tenants)",
        k.rounds, k.connections, k.tenants
    ));
    let ceiling_redis = Region::start(run).await?;
    ceiling_redis.conn.script_load(DECIDE_LUA).await?;
    let tc = if with_peer {
        Some(peer::start(run).await)
    } else {
        None
    };

    // The script alone: `in_flight` calls on each of `connections`
    // connections (1: redis-benchmark -c's model; 16: its -P 16).
    let alone = |in_flight: u64| {
        let mut a = strings([
            "--redis-url".to_string(),
            ceiling_redis.redis.url(),
            "--redis-conns".into(),
            k.connections.to_string(),
        ]);
        a.extend(script_opts());
        a.extend(closed(
            k.connections * in_flight,
            k.tenants,
            k.duration,
            WARMUP,
        ));
        a
    };
    let common = closed(k.connections, k.tenants, k.duration, WARMUP);

    let mut node_redis = RedisCounts::default();
    let rb_redis0 = ceiling_redis.conn.counts().await?;
    let (mut node_ticks, mut redis_ticks) = (0u64, 0u64);
    let mut rb_runs = Vec::new();
    let mut node_runs = Vec::new();
    let mut zipf_runs = Vec::new();
    let mut tc_runs = Vec::new();
    let mut zipf = strings(["--url".to_string(), solo.url("/v1/check")]);
    zipf.extend(common.iter().cloned());
    zipf.extend(strings([
        "--dist", "zipf", "--zipf-s", "1.1", "--seed", "2",
    ]));
    for i in 1..=k.rounds {
        rb_runs.push(RbRun::of(
            &run.redis(&format!("s1_alone_{i}"), &alone(1)).await?,
        ));
        let c0 = testkit::cpu_ticks(solo.proc.pid()).unwrap_or(0);
        let r0 = testkit::cpu_ticks(eu.pid()).unwrap_or(0);
        let counts0 = eu.conn.counts().await?;
        let mut a = strings(["--url".to_string(), solo.url("/v1/check")]);
        a.extend(common.iter().cloned());
        node_runs.push(run.http(&format!("s1_node_{i}"), &a).await?);
        node_ticks += testkit::cpu_ticks(solo.proc.pid()).unwrap_or(0) - c0;
        redis_ticks += testkit::cpu_ticks(eu.pid()).unwrap_or(0) - r0;
        node_redis = node_redis.plus(eu.conn.counts().await?.since(counts0));
        // Zipf right after, so each pair shares the machine's state of
        // the moment (a single Zipf run after the rounds compared one
        // sample with a median).
        zipf_runs.push(run.http(&format!("s1_node_zipf_{i}"), &zipf).await?);
        if let Some(tc) = &tc {
            tc_runs.push(peer::round(run, tc, i, &common).await?);
        }
    }
    let rb_redis = ceiling_redis.conn.counts().await?.since(rb_redis0);
    drop(tc);
    let rb_pipe16 = RbRun::of(&run.redis("s1_alone_16", &alone(16)).await?);
    drop(ceiling_redis);

    let rb_rounds: Vec<f64> = rb_runs.iter().map(|r| r.rps).collect();
    let node_rounds: Vec<f64> = node_runs.iter().map(|r| r.throughput_rps).collect();
    let rb_plain = rb_runs[median_index(&rb_rounds)].clone();
    let node = node_runs[median_index(&node_rounds)].clone();
    let peer = (!tc_runs.is_empty()).then(|| Peer::from_rounds(tc_version, tc_runs));

    let zipf_rounds: Vec<f64> = zipf_runs.iter().map(|r| r.throughput_rps).collect();
    let node_zipf = zipf_runs[median_index(&zipf_rounds)].clone();
    let mut a = strings(["--redis-url".to_string(), eu.redis.url()]);
    a.extend(script_opts());
    a.extend(common.iter().cloned());
    let evalsha_mux = run.redis("s1_evalsha_mux", &a).await?;

    // Every check of the rounds (warm-ups included) is one EVALSHA in Redis.
    let n = node_redis.evalsha.max(1) as f64;
    let per = |c: RedisCounts| c.evalsha as f64 / c.reads.max(1) as f64;
    let usec = |c: RedisCounts| c.evalsha_usec as f64 / c.evalsha.max(1) as f64;
    let rb_plain_rps = rb_plain.rps.round();
    let c = Ceiling {
        connections: k.connections,
        tenants: k.tenants,
        duration: k.duration,
        warmup: WARMUP,
        rounds: k.rounds,
        ratio: node.throughput_rps / rb_plain_rps,
        rb_plain,
        node,
        rb_pipe16,
        node_zipf,
        evalsha_mux,
        rb_rounds,
        node_rounds,
        zipf_rounds,
        node_ticks,
        redis_ticks,
        node_cpu_us: node_ticks as f64 * 10000.0 / n,
        redis_cpu_us: redis_ticks as f64 * 10000.0 / n,
        node_per_read: per(node_redis),
        rb_per_read: per(rb_redis),
        node_usec_per_call: usec(node_redis),
        rb_usec_per_call: usec(rb_redis),
        node_redis,
        rb_redis,
    };
    run.save("s1_ceiling", &c)?;
    Ok((c, peer))
}

/// The full path of `program` on `PATH`, or an error naming
/// `scripts/setup --bench`.
pub fn which(program: &str) -> anyhow::Result<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow::anyhow!("{program} not found on PATH: run scripts/setup --bench"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_round() {
        assert_eq!(median_index(&[3.0, 1.0, 2.0]), 2);
        assert_eq!(median_index(&[5.0]), 0);
        assert_eq!(median_index(&[2.0, 1.0]), 1);
    }
}
