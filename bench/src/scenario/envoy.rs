//! Scenario 10, Envoy: the same closed loop (connections, tenants, every
//! check allowed, Kafka detached) through three front ends of one
//! region-node on one Redis, in alternating rounds:
//!
//! - **ceiling**: a real Envoy without the ratelimit filter, its route
//!   forwarding to its own `direct_response` listener (what the filtered
//!   Envoy does too: the filter skips routes without a route entry), so it
//!   differs from the next row by the filter alone;
//! - **rls**: the same Envoy with `envoy.filters.http.ratelimit` calling
//!   region-node's `--grpc-listen` (RLS v3), one descriptor per request,
//!   `[tenant]` from the `x-tenant` header;
//! - **http**: region-node's own `POST /v1/check`;
//! - **http at the RLS rate**: the same, open loop at the decisions/s the
//!   RLS row reached in the same round. CPU per decision falls as the rate
//!   grows (more replies per Redis read, fewer wake-ups per request), so
//!   the closed-loop rows, whose rates differ, compare the paths and their
//!   rates together; this row compares the paths alone.
//!
//! The RLS domain has a `tenant_entry` and no descriptor rule, so a
//! request through Envoy is the tenant's plan, decided by the same script
//! call with the same tiers as the HTTP check: like is compared with like
//! (`node.lease_max = 0`: the RLS path does not lease, so the HTTP check
//! must not either; every decision is one script call on both paths). For each row: decisions/s, p50, p99, and process
//! CPU (`/proc`) of region-node and Redis per decision (`INFO
//! commandstats` EVALSHA calls) and of Envoy per request.

use std::path::Path;

use serde::{Deserialize, Serialize};
use testkit::{Envoy, EnvoyOptions, RegionNode};

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::scenario::ceiling::WARMUP;
use crate::scenario::median;
use crate::world::{solo_config, start_node, RedisConn};

/// The RLS domain Envoy sends.
const DOMAIN: &str = "bench";

/// One throughput round of one row.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Round {
    pub summary: Summary,
    /// Requests answered in the whole round, warm-up included.
    pub requests: u64,
    /// Decision-script calls (EVALSHA) in the round: the decisions.
    pub decisions: u64,
    pub node_cpu_us: Option<f64>,
    pub redis_cpu_us: Option<f64>,
    pub envoy_cpu_us: Option<f64>,
}

/// Medians of one row's rounds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Row {
    pub rounds: Vec<Round>,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// region-node CPU µs per decision (none for the ceiling).
    pub node_cpu_us: Option<f64>,
    /// Redis CPU µs per decision (none for the ceiling).
    pub redis_cpu_us: Option<f64>,
    /// Envoy CPU µs per request (none for region-node's HTTP API).
    pub envoy_cpu_us: Option<f64>,
    /// Denied and failed requests over every round (0 expected).
    pub denied: u64,
    pub errors: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct EnvoyBench {
    pub envoy_version: String,
    pub rounds: u64,
    pub duration: u64,
    pub connections: u64,
    pub tenants: u64,
    pub ceiling: Row,
    pub rls: Row,
    pub http: Row,
    #[serde(default)]
    pub http_at_rls_rate: Row,
    /// region-node CPU per decision, gRPC (through Envoy) ÷ HTTP.
    pub node_cpu_ratio: f64,
    /// The same at the same decision rate (÷ the open-loop HTTP row).
    #[serde(default)]
    pub node_cpu_ratio_same_rate: f64,
    /// (region-node + Redis) CPU per decision, gRPC ÷ HTTP.
    pub node_redis_cpu_ratio: f64,
    /// Decisions/s through Envoy with the filter ÷ without it.
    pub rls_of_ceiling: f64,
    /// Decisions/s through Envoy with the filter ÷ region-node's HTTP API.
    pub rls_of_http: f64,
}

fn config(redis_url: &str) -> String {
    solo_config(
        "10",
        redis_url,
        "lease_max = 0",
        &format!(
            r#"# Envoy's descriptor [tenant] names the tenant; no descriptor rule, so the
# tenant's plan decides, as on the HTTP check.
[[rls.domains]]
domain = "{DOMAIN}"
tenant_entry = "tenant"
"#
        ),
    )
}

fn row(rounds: Vec<Round>) -> Row {
    let med = |f: fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    let opt = |f: fn(&Round) -> Option<f64>| {
        let v: Vec<f64> = rounds.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(v))
    };
    Row {
        rps: med(|r| r.summary.throughput_rps),
        p50_ms: med(|r| r.summary.latency_us.as_ref().map_or(0.0, |p| p.p50)) / 1000.0,
        p99_ms: med(|r| r.summary.latency_us.as_ref().map_or(0.0, |p| p.p99)) / 1000.0,
        node_cpu_us: opt(|r| r.node_cpu_us),
        redis_cpu_us: opt(|r| r.redis_cpu_us),
        envoy_cpu_us: opt(|r| r.envoy_cpu_us),
        denied: rounds.iter().map(|r| r.summary.denied).sum(),
        errors: rounds.iter().map(|r| r.summary.errors).sum(),
        rounds,
    }
}

/// What one round runs and watches.
struct Front<'a> {
    name: &'static str,
    /// loadgen's target and protocol options.
    args: Vec<String>,
    /// The Envoy in the path, if any.
    envoy: Option<&'a Envoy>,
    /// Whether region-node decides (not the ceiling).
    decides: bool,
    /// More loadgen options (the open loop's).
    extra: Vec<String>,
}

async fn round(
    run: &Run,
    k: &Knobs,
    front: &Front<'_>,
    i: u64,
    node: &RegionNode,
    redis_pid: u32,
    conn: &RedisConn,
) -> anyhow::Result<Round> {
    let ticks = |p| testkit::cpu_ticks(p).unwrap_or(0);
    let envoy_pid = front.envoy.map(|e| e.proc.pid());
    let (n0, r0, e0, c0) = (
        ticks(node.proc.pid()),
        ticks(redis_pid),
        envoy_pid.map(ticks),
        conn.counts().await?,
    );
    let mut args = front.args.clone();
    args.extend(crate::loadgen::closed(
        k.connections,
        k.tenants,
        k.duration,
        WARMUP,
    ));
    args.extend(front.extra.iter().cloned());
    let summary = run.http(&format!("s10_{}_{i}", front.name), &args).await?;
    let (n1, r1, e1) = (
        ticks(node.proc.pid()),
        ticks(redis_pid),
        envoy_pid.map(ticks),
    );
    let decisions = conn.counts().await?.since(c0).evalsha;
    // Ticks are 1/100 s and cover the warm-up too, as `requests` does.
    let requests = summary.completed_total.max(1);
    let per = |t: u64, n: u64| t as f64 * 10_000.0 / n.max(1) as f64;
    Ok(Round {
        node_cpu_us: front.decides.then(|| per(n1 - n0, decisions)),
        redis_cpu_us: front.decides.then(|| per(r1 - r0, decisions)),
        envoy_cpu_us: e0.zip(e1).map(|(a, b)| per(b - a, requests)),
        requests,
        decisions,
        summary,
    })
}

/// Waits until region-node's gRPC listener accepts connections.
async fn grpc_ready(port: u16) {
    testkit::wait_until(
        "region-node's --grpc-listen accepts connections",
        std::time::Duration::from_secs(30),
        || async move { testkit::start::accepts(port) },
    )
    .await
}

fn write(dir: &Path, toml: &str) -> std::path::PathBuf {
    testkit::write_config(dir, toml)
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<EnvoyBench> {
    let version = testkit::envoy::version(&testkit::envoy_bin());
    run.scenario(&format!(
        "10 envoy: Envoy {version} without the filter, Envoy + RLS over gRPC, region-node HTTP ({} rounds, {} connections, {} tenants)",
        k.rounds, k.connections, k.tenants
    ));
    let dir = testkit::temp_dir();
    let redis = testkit::Redis::start();
    run.record_spawned(&redis.proc);
    let conn = RedisConn::open(&redis.url()).await?;
    let cfg = write(dir.path(), &config(&redis.url()));
    run.record(format!("# scenario 10: {}", cfg.display()));
    let grpc = testkit::free_port();
    let listen = format!("127.0.0.1:{grpc}");
    let node = start_node(
        run,
        &cfg,
        "eu",
        "eu-1",
        "/healthz",
        &[("TIERLIMIT_GRPC_LISTEN", &listen)],
    )
    .await;
    grpc_ready(grpc).await;

    let plain = Envoy::start(dir.path(), &EnvoyOptions::without_filter());
    let mut with_rls = EnvoyOptions::new(DOMAIN, grpc);
    with_rls.rate_limits = EnvoyOptions::tenant_only_rate_limits();
    // An RLS failure is a 500, never an uncounted 200.
    with_rls.failure_mode_deny = true;
    let limited = Envoy::start(dir.path(), &with_rls);
    for (what, e) in [
        ("without the filter", &plain),
        ("with the filter", &limited),
    ] {
        run.record(format!("# Envoy {what}:"));
        run.record_spawned(&e.proc);
    }

    let gateway = |e: &Envoy| {
        strings([
            "--proto".to_string(),
            "gateway".into(),
            "--tenant-header".into(),
            "x-tenant".into(),
            "--url".into(),
            e.url("/"),
        ])
    };
    let fronts = [
        Front {
            name: "ceiling",
            args: gateway(&plain),
            envoy: Some(&plain),
            decides: false,
            extra: Vec::new(),
        },
        Front {
            name: "rls",
            args: gateway(&limited),
            envoy: Some(&limited),
            decides: true,
            extra: Vec::new(),
        },
        Front {
            name: "http",
            args: strings(["--url".to_string(), node.url("/v1/check")]),
            envoy: None,
            decides: true,
            extra: Vec::new(),
        },
    ];
    let mut rounds: [Vec<Round>; 4] = Default::default();
    for i in 0..k.rounds {
        for (f, out) in fronts.iter().zip(rounds.iter_mut()) {
            out.push(round(run, k, f, i, &node, redis.proc.pid(), &conn).await?);
        }
        // The HTTP check again, at the rate the RLS row just reached.
        let rate = rounds[1]
            .last()
            .map_or(1.0, |r| r.summary.throughput_rps.max(1.0));
        let at_rate = Front {
            name: "http_at_rls_rate",
            args: fronts[2].args.clone(),
            envoy: None,
            decides: true,
            extra: strings([
                "--mode".to_string(),
                "open".into(),
                "--rate".into(),
                rate.to_string(),
            ]),
        };
        rounds[3].push(round(run, k, &at_rate, i, &node, redis.proc.pid(), &conn).await?);
    }
    let [ceiling, rls, http, http_at_rls_rate] = rounds.map(row);
    let cpu = |r: &Row| r.node_cpu_us.unwrap_or(0.0);
    let both = |r: &Row| cpu(r) + r.redis_cpu_us.unwrap_or(0.0);
    let r = EnvoyBench {
        envoy_version: version,
        rounds: k.rounds,
        duration: k.duration,
        connections: k.connections,
        tenants: k.tenants,
        node_cpu_ratio: cpu(&rls) / cpu(&http).max(0.001),
        node_cpu_ratio_same_rate: cpu(&rls) / cpu(&http_at_rls_rate).max(0.001),
        node_redis_cpu_ratio: both(&rls) / both(&http).max(0.001),
        rls_of_ceiling: rls.rps / ceiling.rps.max(1.0),
        rls_of_http: rls.rps / http.rps.max(1.0),
        ceiling,
        rls,
        http,
        http_at_rls_rate,
    };
    run.save("s10_envoy", &r)?;
    drop((plain, limited, node, redis));
    Ok(r)
}
