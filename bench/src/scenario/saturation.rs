//! Scenario 2b, saturation: an open loop at 1.5× the saturated rate against
//! a region-node with the production `store_timeout` (50 ms) and the
//! `local` fail mode, once with admission control effectively off
//! (`max_in_flight` 65 536, no queue: every request goes straight to Redis,
//! as before issue 15) and once with its defaults. Reported per run: the
//! decisions that fell into the fail mode (target 0 with admission), the
//! requests shed (503), breaker openings, late replies and what callers saw
//! (latency from the intended send time, loadgen's open loop).
//!
//! The saturated rate is measured here (closed loop, `BENCH_CONNECTIONS`),
//! on the same node configuration, so the scenario runs on its own
//! (`BENCH_ONLY=saturation`).

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::loadgen::{closed, Summary};
use crate::run::{strings, Run};
use crate::scenario::ceiling::WARMUP;
use crate::world::{metrics_text, start_node, Region};

/// Connections of the open loop: more than `max_in_flight` + `max_queue`
/// (64 + 512 by default), so the node's admission, not the generator's
/// pool, is what bounds the requests in flight.
pub const OPEN_CONNECTIONS: u64 = 800;

/// One open-loop run against a fresh node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Phase {
    pub label: String,
    pub max_in_flight: u64,
    pub max_queue: u64,
    pub run: Summary,
    /// Deltas of the node's counters over the run.
    pub fail_mode: u64,
    pub shed: u64,
    pub breaker_opens: u64,
    pub redis_decisions: u64,
    pub late_compensated: u64,
    pub late_refused: u64,
    pub uncompensated: u64,
    /// 503 answers seen by the generator.
    pub status_503: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Saturation {
    /// Closed loop, `probe_connections` callers: the saturated rate.
    pub probe: Summary,
    #[serde(default)]
    pub probe_connections: u64,
    pub saturated_rps: f64,
    /// 1.5 × saturated.
    pub rate: u64,
    pub seconds: u64,
    pub connections: u64,
    pub store_timeout_ms: u64,
    pub unbounded: Phase,
    pub admission: Phase,
}

/// The node's environment: Kafka detached (the decision path alone), the
/// production store timeout, and the bench plan failing `local`, as in the
/// measurement that opened issue 15.
fn env(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut e = vec![
        ("TIERLIMIT__KAFKA__BROKERS", "127.0.0.1:1"),
        ("TIERLIMIT__NODE__VIEW_WAIT", "0s"),
        ("TIERLIMIT__NODE__STORE_TIMEOUT", "50ms"),
        ("TIERLIMIT__PLANS__BENCH__ON_STORE_ERROR", "local"),
    ];
    e.extend_from_slice(extra);
    e
}

async fn counters(http: &reqwest::Client, base: &str) -> [u64; 7] {
    let text = metrics_text(http, base).await;
    let sum = |name: &str| testkit::metric_value(&text, name) as u64;
    let redis: f64 = text
        .lines()
        .filter(|l| l.starts_with("tierlimit_decisions_total{") && l.contains(r#"mode="redis""#))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let sample = |s: &str| testkit::metric_sample(&text, s).unwrap_or(0.0) as u64;
    [
        sum("tierlimit_fail_mode_decisions_total"),
        sum("tierlimit_shed_total"),
        sum("tierlimit_breaker_opens_total"),
        redis as u64,
        sample(r#"tierlimit_late_replies_total{outcome="compensated"}"#),
        sample(r#"tierlimit_late_replies_total{outcome="refused"}"#),
        sum("tierlimit_uncompensated_total"),
    ]
}

#[allow(clippy::too_many_arguments)]
async fn phase(
    run: &Run,
    k: &Knobs,
    cfg: &std::path::Path,
    label: &str,
    name: &str,
    extra: &[(&'static str, &'static str)],
    rate: u64,
    seconds: u64,
) -> anyhow::Result<Phase> {
    let node = start_node(run, cfg, "eu", "eu-sat", "/healthz", &env(extra)).await;
    let base = node.url("");
    let before = counters(&node.http, &base).await;
    let args = strings([
        "--url".to_string(),
        node.url("/v1/check"),
        "--mode".into(),
        "open".into(),
        "--rate".into(),
        rate.to_string(),
        "--connections".into(),
        OPEN_CONNECTIONS.to_string(),
        "--tenants".into(),
        k.tenants.to_string(),
        "--duration".into(),
        seconds.to_string(),
        "--warmup".into(),
        WARMUP.to_string(),
    ]);
    let summary = run.http(name, &args).await?;
    let after = counters(&node.http, &base).await;
    let d = |i: usize| after[i].saturating_sub(before[i]);
    let limits = |key: &str, default: u64| {
        extra
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(default)
    };
    Ok(Phase {
        label: label.into(),
        max_in_flight: limits("TIERLIMIT__NODE__MAX_IN_FLIGHT", 64),
        max_queue: limits("TIERLIMIT__NODE__MAX_QUEUE", 512),
        status_503: summary.error_kinds.get("status 503").copied().unwrap_or(0),
        run: summary,
        fail_mode: d(0),
        shed: d(1),
        breaker_opens: d(2),
        redis_decisions: d(3),
        late_compensated: d(4),
        late_refused: d(5),
        uncompensated: d(6),
    })
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<Saturation> {
    run.scenario("2b saturation: open loop at 1.5x the saturated rate, store_timeout 50 ms");
    let eu = Region::start(run).await?;
    let dir = run.tmp.join("saturation");
    std::fs::create_dir_all(&dir)?;
    let cfg = testkit::write_config(
        &dir,
        &crate::world::config(k, "127.0.0.1:1", [&eu, &eu, &eu]),
    );
    // The saturated rate of this node configuration, closed loop.
    let probe = {
        let node = start_node(run, &cfg, "eu", "eu-sat", "/healthz", &env(&[])).await;
        let mut a = strings(["--url".to_string(), node.url("/v1/check")]);
        a.extend(closed(k.connections, k.tenants, k.duration, WARMUP));
        run.http("s2b_probe", &a).await?
    };
    let saturated_rps = probe.throughput_rps;
    let rate = (saturated_rps * 1.5) as u64;
    let seconds = k.duration * 2;
    run.say(&format!(
        "saturated at {saturated_rps:.0} req/s; open loop at {rate} req/s for {seconds} s, {OPEN_CONNECTIONS} connections"
    ));
    let unbounded = phase(
        run,
        k,
        &cfg,
        "admission off (max_in_flight 65536, no queue)",
        "s2b_unbounded",
        &[
            ("TIERLIMIT__NODE__MAX_IN_FLIGHT", "65536"),
            ("TIERLIMIT__NODE__MAX_QUEUE", "0"),
        ],
        rate,
        seconds,
    )
    .await?;
    let admission = phase(
        run,
        k,
        &cfg,
        "admission defaults (64 in flight, 512 queued, 50 ms)",
        "s2b_admission",
        &[],
        rate,
        seconds,
    )
    .await?;
    let s = Saturation {
        probe,
        probe_connections: k.connections,
        saturated_rps,
        rate,
        seconds,
        connections: OPEN_CONNECTIONS,
        store_timeout_ms: 50,
        unbounded,
        admission,
    };
    run.save("s2b_saturation", &s)?;
    drop(eu);
    Ok(s)
}
