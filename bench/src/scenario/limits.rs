//! Scenario 13, limits: limits as data (`limits.source = "topic"`) against
//! today's file (`[tenants]` in the TOML), at many registered tenants, 1 %
//! of them with an override (`region = { limit = N }`), the rest a plain
//! `plan = "…"`. Its own stack (three Redis, Tansu, the aggregator and
//! region-nodes), so nothing of the main run's is in the figures.
//!
//! 1. starts: for every count, one process at a time, from its spawn to
//!    ready: a region-node (`/readyz` 200: the broadcast view and, on the
//!    topic, every limits record read) and an aggregator (`/readyz` 200
//!    and, on the topic, its limits table read to the end, as
//!    `/v1/limits/status` says). The topic is filled by the library's
//!    writer (`Standalone::publish`, what `aggregator limits import` calls
//!    after parsing its file), from one count to the next, timed; the file
//!    side is a configuration with `[tenants.<id>]` tables. Each node starts
//!    on an empty Redis (FLUSHALL): the topic's first start, which writes
//!    the region's copy; that copy's bytes are measured once it is
//!    complete (its mark at the topic's last offset), and the node is
//!    started again over it (a restart, from the copy). RSS at ready and
//!    two seconds after (the node: after the copy is written), the peak
//!    (`VmHWM`), CPU to ready. A start with one tenant ([`BASE`]), per
//!    source and process, is the fixed part each per-tenant figure is
//!    taken from.
//! 2. propagation: a topic of its own (`tierlimit.limits.prop`,
//!    [`PROP_TENANTS`] tenants), one region-node in each of the three
//!    regions and an aggregator; a change is written every
//!    [`IDLE_EVERY`] (idle), then every [`LOADED_EVERY`] among `rate`
//!    other changes a second, from one writer (one writer at a time is the
//!    design's rule). From the writer's call to every node's applied
//!    version at or past the change's (`/readyz`'s
//!    `limits.applied_version`, the gauge `tierlimit_limits_applied_version`
//!    reads the same table), and to the aggregator's
//!    `/v1/limits/status?version=V` answering `reached`.
//!
//! The file side is not run at the topic's largest count: at 1 M it
//! already holds its tenants in memory several times over (the TOML tree,
//! then a policy each), which is what the comparison shows.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::bail;
use serde::{Deserialize, Serialize};
use testkit::{Cmd, Proc};
use tierlimit_shared::config::{LimitOverride, TenantConfig};
use tierlimit_shared::limits::write::Standalone;
use tierlimit_shared::limits::{Body, Subject};

use crate::knobs::Knobs;
use crate::run::Run;
use crate::topic;
use crate::world::{self, start_node, RedisConn, Region, BENCH_OPEN_SCOPES};

/// The limits topic of the starts, and the propagation's own three: the
/// nodes of the starts reported their applied versions (of the other
/// topic) on the deltas topic, and an aggregator reading those would count
/// them as behind for a minute.
pub const TOPIC: &str = "tierlimit.limits";
pub const PROP_TOPIC: &str = "tierlimit.limits.prop";
pub const PROP_DELTAS: &str = "tierlimit.deltas.prop";
pub const PROP_GLOBAL: &str = "tierlimit.global.prop";
/// One tenant in this many has an override.
pub const OVERRIDE_EVERY: u64 = 100;
/// Bounds: a start to ready, the region's copy complete, reading the topic
/// back.
pub const START_BOUND_S: u64 = 900;
pub const COPY_BOUND_S: u64 = 900;
pub const READ_BOUND_S: u64 = 900;
/// The start every per-tenant figure is taken from: one tenant, not none,
/// so that the topic is never empty (its end is where a follower is ready)
/// and the region's copy has a mark.
pub const BASE: u64 = 1;
/// How long after ready (or after the copy) RSS is read again.
pub const SETTLE: Duration = Duration::from_secs(2);
/// Records per `Standalone::publish` call of an import (the writer acknowledges
/// them 4096 at a time; this bounds what the bench holds).
pub const IMPORT_CALL: u64 = 65_536;
/// The propagation topic's tenants; the background changes cycle over them.
pub const PROP_TENANTS: u64 = 10_000;
/// A change every IDLE_EVERY when idle, every LOADED_EVERY under load.
pub const IDLE_EVERY: Duration = Duration::from_millis(1000);
pub const LOADED_EVERY: Duration = Duration::from_millis(500);
/// How often the nodes' applied versions and the aggregator's status are
/// read while changes are outstanding (the resolution of the figures).
pub const NODE_POLL: Duration = Duration::from_millis(10);
pub const STATUS_POLL: Duration = Duration::from_millis(50);
/// A change not seen everywhere within this is counted as missing.
pub const PROBE_BOUND: Duration = Duration::from_secs(30);

/// One process started once.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Start {
    /// `region-node` or `aggregator`.
    pub process: String,
    /// `topic` or `file`.
    pub source: String,
    pub tenants: u64,
    pub overrides: u64,
    /// Spawn → ready, s (`None`: not ready within [`START_BOUND_S`]).
    pub ready_s: Option<f64>,
    /// CPU (user + system) the process used to get there, s.
    pub cpu_s: f64,
    /// Tenants the process said it applied (topic: `/readyz`, the status).
    pub applied_tenants: Option<u64>,
    pub rss_ready_kib: u64,
    /// [`SETTLE`] after ready (a node on the topic: after its copy).
    pub rss_kib: u64,
    /// `VmHWM`: the most it was resident, start included.
    pub peak_kib: u64,
    /// The configuration file's size (the file side holds the tenants).
    pub config_bytes: u64,
    /// A node on the topic: spawn → the region's copy complete, s.
    pub copy_s: Option<f64>,
    /// Its Redis: `used_memory` after the copy minus after FLUSHALL, and
    /// `MEMORY USAGE` summed over the copy's keys (`tl:{*}:lim:*`).
    pub redis_used_bytes: Option<i64>,
    pub redis_copy_bytes: Option<u64>,
    pub redis_copy_keys: Option<u64>,
    /// The same node started again over the copy: spawn → ready, s; RSS.
    pub restart_s: Option<f64>,
    pub restart_rss_kib: Option<u64>,
    // Derived against the start with no tenant of the same process and
    // source.
    pub start_us_per_tenant: Option<f64>,
    pub rss_b_per_tenant: Option<f64>,
    pub redis_b_per_tenant: Option<f64>,
    /// RSS growth plus the Redis copy (`MEMORY USAGE`), per tenant.
    pub total_b_per_tenant: Option<f64>,
}

/// Filling the topic from one count to the next.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Import {
    pub from: u64,
    pub to: u64,
    pub seconds: f64,
    pub records_per_s: f64,
    pub first_version: u64,
    pub last_version: u64,
    /// The topic once filled: records and key + value bytes read back by a
    /// plain consumer (and how long that read took), Tansu's SQLite file.
    pub topic_records: u64,
    pub topic_bytes: u64,
    pub read_s: Option<f64>,
    pub broker_db_bytes: u64,
}

/// A distribution of times, ms.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Dist {
    pub n: u64,
    /// Changes not seen within [`PROBE_BOUND`].
    pub missing: u64,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
    pub all: Vec<f64>,
}

impl Dist {
    pub fn of(values: Vec<Option<f64>>) -> Dist {
        let missing = values.iter().filter(|v| v.is_none()).count() as u64;
        let mut all: Vec<f64> = values.into_iter().flatten().collect();
        all.sort_by(f64::total_cmp);
        let rank = |q: f64| -> Option<f64> {
            let n = all.len();
            (n > 0).then(|| all[((q * n as f64).ceil() as usize).clamp(1, n) - 1])
        };
        Dist {
            n: all.len() as u64,
            missing,
            p50: rank(0.5),
            p99: rank(0.99),
            max: all.last().copied(),
            all,
        }
    }
}

/// One propagation phase.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Propagation {
    /// Other changes a second asked (0: idle) and written.
    pub rate: u64,
    pub achieved_rate: f64,
    pub background: u64,
    pub seconds: f64,
    pub probes: u64,
    /// The writer's call → acknowledged, ms.
    pub ack_ms: Dist,
    /// The writer's call → every node applied it.
    pub nodes_ms: Dist,
    /// The writer's call → the aggregator's status says `reached`.
    pub reached_ms: Dist,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LimitsBench {
    pub topic_counts: Vec<u64>,
    pub file_counts: Vec<u64>,
    /// Bytes of a tenant id (`t` and 7 digits).
    pub id_bytes: u64,
    pub imports: Vec<Import>,
    pub starts: Vec<Start>,
    pub status_interval_ms: u64,
    pub prop_tenants: u64,
    pub idle: Option<Propagation>,
    pub loaded: Option<Propagation>,
    /// Why the starts stopped early (those before stay).
    pub starts_error: Option<String>,
    pub propagation_error: Option<String>,
    // Derived (the target rows).
    /// The largest count both sources ran, and the node's start there,
    /// topic ÷ file.
    pub compared_at: Option<u64>,
    pub node_start_ratio: Option<f64>,
    /// At the topic's largest count.
    pub largest: Option<u64>,
    pub node_total_b_per_tenant: Option<f64>,
    pub agg_rss_b_per_tenant: Option<f64>,
    /// The rows behind them: the node's starts at `compared_at`, its
    /// figures and the aggregator's at `largest`.
    pub node_topic_compared: Option<Start>,
    pub node_file_compared: Option<Start>,
    pub node_topic_largest: Option<Start>,
    pub agg_topic_largest: Option<Start>,
}

impl LimitsBench {
    pub fn start(&self, process: &str, source: &str, tenants: u64) -> Option<&Start> {
        self.starts
            .iter()
            .find(|s| s.process == process && s.source == source && s.tenants == tenants)
    }
}

/// Tenant `i`: its id and table (every [`OVERRIDE_EVERY`]th with a region
/// override; the plans alternate).
pub fn tenant(i: u64) -> (String, TenantConfig) {
    let plan = if i.is_multiple_of(2) { "pro" } else { "team" };
    let region = i.is_multiple_of(OVERRIDE_EVERY).then(|| LimitOverride {
        limit: Some(50_000 + i % 1000),
        ..Default::default()
    });
    (
        format!("t{i:07}"),
        TenantConfig {
            time_zone: Default::default(),
            plan: plan.into(),
            node: None,
            region,
            global: None,
            on_store_error: None,
            grants: Vec::new(),
        },
    )
}

/// Tenants `0..n` with an override.
pub fn overrides(n: u64) -> u64 {
    n.div_ceil(OVERRIDE_EVERY)
}

/// `[tenants.<id>]` tables of tenants `0..n`, as an operator writes them.
pub fn tenant_tables(n: u64) -> String {
    let mut s = String::with_capacity(n as usize * 32);
    for i in 0..n {
        let (id, t) = tenant(i);
        s.push_str(&format!("[tenants.{id}]\nplan = \"{}\"\n", t.plan));
        if let Some(r) = t.region.and_then(|r| r.limit) {
            s.push_str(&format!("region = {{ limit = {r} }}\n"));
        }
    }
    s
}

/// The scenario's configuration: three regions, two plans in the file
/// (both sources keep them there), tenants from `source`, unknown tenants
/// refused; with `prop`, the propagation's topics.
pub fn config(source: &str, prop: bool, brokers: &str, redis: [&str; 3]) -> String {
    let topics = if prop {
        format!(
            "limits_topic = \"{PROP_TOPIC}\"\ndeltas_topic = \"{PROP_DELTAS}\"\nglobal_topic = \"{PROP_GLOBAL}\"\n"
        )
    } else {
        format!("limits_topic = \"{TOPIC}\"\n")
    };
    format!(
        r#"# Written by scripts/bench (scenario limits).
cluster = "bench"
[kafka]
brokers = "{brokers}"
partitions = 8
{topics}[node]
flush_interval = "250ms"
store_timeout = "500ms"
[aggregator]
broadcast_interval = "250ms"
[limits]
source = "{source}"
[regions.eu]
redis_url = "{eu}"
[regions.us]
redis_url = "{us}"
[regions.ap]
redis_url = "{ap}"
[unknown_tenants]
policy = "deny"

[plans.pro]
on_store_error = "closed"
global = {{ limit = 10000000 }}
[plans.pro.node]
limit = 1000
window = "1s"
algorithm = "fixed_window"
[plans.pro.region]
limit = 100000
window = "1m"
algorithm = "sliding_window"

[plans.team]
on_store_error = "closed"
global = {{ limit = 50000000 }}
[plans.team.node]
limit = 5000
window = "1s"
algorithm = "fixed_window"
[plans.team.region]
limit = 500000
window = "1m"
algorithm = "sliding_window"
"#,
        eu = redis[0],
        us = redis[1],
        ap = redis[2],
    )
}

/// Writes `dir/tierlimit.toml` (the test keys added), then `tables` after
/// them: the tenants of the file side, appended as text, so that 1 M of
/// them are not parsed here first.
fn write_config(dir: &Path, toml: &str, tables: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = testkit::write_config(dir, toml);
    if !tables.is_empty() {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(&path)?;
        f.write_all(b"\n# The tenants, one table each.\n")?;
        f.write_all(tables.as_bytes())?;
    }
    Ok(path)
}

/// `VmHWM` of `/proc/PID/status`, KiB.
fn peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn cpu_s(pid: u32) -> f64 {
    testkit::cpu_ticks(pid).unwrap_or(0) as f64 / 100.0
}

/// A process spawned here rather than through testkit's starters: the
/// start is timed from the spawn, and a start longer than testkit's 60 s
/// (the file side at 1 M) is measured, not a panic.
struct Spawned {
    proc: Proc,
    port: u16,
    started: Instant,
}

impl Spawned {
    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}

/// `region-node` or `aggregator` on free ports, recorded, with the
/// harness key (the aggregator's status needs `read`).
fn spawn(run: &Run, program: &str, args: &[String], env: &[(&str, &str)]) -> Spawned {
    let port = testkit::free_port();
    let admin = testkit::free_port();
    let mut all: Vec<String> = args.to_vec();
    all.extend([
        "--listen".to_string(),
        format!("127.0.0.1:{port}"),
        "--admin-listen".to_string(),
        format!("127.0.0.1:{admin}"),
    ]);
    let mut cmd = Cmd::new(testkit::bin_path(program))
        .label(format!("{program}:{port}"))
        .args(&all)
        .env("RUST_LOG", "warn");
    for (k, v) in testkit::harness_env() {
        cmd = cmd.env(&k, &v);
    }
    for (k, v) in env {
        cmd = cmd.env(k, v);
    }
    let started = Instant::now();
    let proc = cmd.spawn();
    run.record_spawned(&proc);
    testkit::register_admin_base(
        &format!("http://127.0.0.1:{port}"),
        &format!("http://127.0.0.1:{admin}"),
    );
    Spawned {
        proc,
        port,
        started,
    }
}

fn node_args(cfg: &Path, node_id: &str) -> Vec<String> {
    vec![
        "--config".into(),
        cfg.display().to_string(),
        "--region".into(),
        "eu".into(),
        "--node-id".into(),
        node_id.into(),
    ]
}

/// Polls `ready` every [`testkit::POLL`] until it holds; seconds since the
/// spawn, `None` past [`START_BOUND_S`]. Fails if the process exits.
async fn ready_after<F, Fut>(p: &mut Spawned, mut ready: F) -> anyhow::Result<Option<f64>>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let bound = Duration::from_secs(START_BOUND_S);
    while p.started.elapsed() < bound {
        if let Some(status) = p.proc.poll_exit() {
            bail!(
                "{} exited before it was ready ({status}):\n{}",
                p.proc.label(),
                p.proc.log_tail(20)
            );
        }
        if ready(p.url("")).await {
            return Ok(Some(p.started.elapsed().as_secs_f64()));
        }
        tokio::time::sleep(testkit::POLL).await;
    }
    Ok(None)
}

/// A node's `/readyz`: 200, and its `limits` object.
async fn node_readyz(http: &reqwest::Client, base: &str) -> Option<serde_json::Value> {
    let r = http
        .get(format!("{base}/readyz"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json::<serde_json::Value>()
        .await
        .ok()
        .map(|v| v["limits"].clone())
}

/// The aggregator's `/v1/limits/status` (any status), as JSON.
async fn agg_status(
    http: &reqwest::Client,
    base: &str,
    version: Option<u64>,
) -> Option<serde_json::Value> {
    let q = version.map_or(String::new(), |v| format!("?version={v}"));
    http.get(format!("{base}/v1/limits/status{q}"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

/// The copy's mark (the last topic offset it holds), `None` without one.
async fn copy_mark(redis: &RedisConn) -> Option<i64> {
    let key = format!("tl:{{{}}}:lim:mark", tierlimit_shared::keys::bucket_tag(0));
    let v: Option<String> = redis
        .query(redis::cmd("HGET").arg(key).arg("mark"))
        .await
        .ok()?;
    v?.split('|').next()?.parse().ok()
}

/// `MEMORY USAGE` summed over the copy's keys, and how many there are.
async fn copy_bytes(redis: &RedisConn) -> anyhow::Result<(u64, u64)> {
    let keys = redis.scan("tl:{*}:lim:*").await?;
    let mut sum = 0;
    for k in &keys {
        sum += redis.memory_usage(k).await?.unwrap_or(0);
    }
    Ok((sum, keys.len() as u64))
}

struct Stack<'a> {
    run: &'a Run,
    eu: &'a Region,
    http: reqwest::Client,
    topic_cfg: PathBuf,
    /// The topic's end offset (records written so far).
    topic_end: i64,
    seq: u32,
}

impl Stack<'_> {
    /// A region-node started on an empty Redis, to ready, measured.
    async fn node(&mut self, cfg: &Path, source: &str, tenants: u64) -> anyhow::Result<Start> {
        self.seq += 1;
        let redis = &self.eu.conn;
        let _: () = redis.query(&mut redis::cmd("FLUSHALL")).await?;
        let used0 = redis.info_u64("memory", "used_memory").await?;
        let env = [BENCH_OPEN_SCOPES];
        let mut p = spawn(
            self.run,
            "region-node",
            &node_args(cfg, &format!("eu-{}", self.seq)),
            &env,
        );
        let http = self.http.clone();
        let ready_s = ready_after(&mut p, |base| {
            let http = http.clone();
            async move { node_readyz(&http, &base).await.is_some() }
        })
        .await?;
        let pid = p.proc.pid();
        let mut s = Start {
            process: "region-node".into(),
            source: source.into(),
            tenants,
            overrides: overrides(tenants),
            ready_s,
            cpu_s: cpu_s(pid),
            rss_ready_kib: testkit::rss_kib(pid).unwrap_or(0),
            config_bytes: std::fs::metadata(cfg).map_or(0, |m| m.len()),
            ..Default::default()
        };
        if source == "topic" {
            s.applied_tenants = node_readyz(&self.http, &p.url(""))
                .await
                .and_then(|l| l["tenants"].as_u64());
            if self.topic_end > 0 {
                let deadline = p.started + Duration::from_secs(COPY_BOUND_S);
                while Instant::now() < deadline {
                    if copy_mark(redis)
                        .await
                        .is_some_and(|m| m >= self.topic_end - 1)
                    {
                        s.copy_s = Some(p.started.elapsed().as_secs_f64());
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            let used = redis.info_u64("memory", "used_memory").await?;
            s.redis_used_bytes = Some(used as i64 - used0 as i64);
            let (bytes, keys) = copy_bytes(redis).await?;
            s.redis_copy_bytes = Some(bytes);
            s.redis_copy_keys = Some(keys);
        }
        tokio::time::sleep(SETTLE).await;
        s.rss_kib = testkit::rss_kib(pid).unwrap_or(0);
        s.peak_kib = peak_kib(pid);
        drop(p);
        if source == "topic" && s.copy_s.is_some() {
            // Again over the copy: loaded from Redis, then the topic from
            // the copy's mark on.
            self.seq += 1;
            let mut p = spawn(
                self.run,
                "region-node",
                &node_args(cfg, &format!("eu-{}", self.seq)),
                &env,
            );
            let http = self.http.clone();
            s.restart_s = ready_after(&mut p, |base| {
                let http = http.clone();
                async move { node_readyz(&http, &base).await.is_some() }
            })
            .await?;
            s.restart_rss_kib = testkit::rss_kib(p.proc.pid());
        }
        self.run.say(&format!(
            "limits: region-node, {source}, {tenants} tenants: ready {:?} s, RSS {} MiB (peak {} MiB), copy {:?} s, {:?} B in Redis, restart {:?} s",
            s.ready_s.map(|x| (x * 100.0).round() / 100.0),
            s.rss_kib / 1024,
            s.peak_kib / 1024,
            s.copy_s.map(|x| (x * 10.0).round() / 10.0),
            s.redis_copy_bytes,
            s.restart_s.map(|x| (x * 100.0).round() / 100.0),
        ));
        Ok(s)
    }

    /// An aggregator (a consumer group of its own, so no earlier one's
    /// session holds its partitions), to ready, measured.
    async fn aggregator(
        &mut self,
        cfg: &Path,
        source: &str,
        tenants: u64,
    ) -> anyhow::Result<Start> {
        self.seq += 1;
        let group = format!("bench-limits-{}", self.seq);
        let env = [("TIERLIMIT__AGGREGATOR__GROUP_ID", group.as_str())];
        let args = vec!["--config".to_string(), cfg.display().to_string()];
        let mut p = spawn(self.run, "aggregator", &args, &env);
        let http = self.http.clone();
        let topic = source == "topic";
        let ready_s = ready_after(&mut p, |base| {
            let http = http.clone();
            async move {
                let up = http
                    .get(format!("{base}/readyz"))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if !up || !topic {
                    return up;
                }
                agg_status(&http, &base, None)
                    .await
                    .is_some_and(|s| s["aggregator"]["ready"].as_bool() == Some(true))
            }
        })
        .await?;
        let pid = p.proc.pid();
        let mut s = Start {
            process: "aggregator".into(),
            source: source.into(),
            tenants,
            overrides: overrides(tenants),
            ready_s,
            cpu_s: cpu_s(pid),
            rss_ready_kib: testkit::rss_kib(pid).unwrap_or(0),
            config_bytes: std::fs::metadata(cfg).map_or(0, |m| m.len()),
            ..Default::default()
        };
        if topic {
            s.applied_tenants = agg_status(&self.http, &p.url(""), None)
                .await
                .and_then(|st| st["aggregator"]["tenants"].as_u64());
        }
        tokio::time::sleep(SETTLE).await;
        s.rss_kib = testkit::rss_kib(pid).unwrap_or(0);
        s.peak_kib = peak_kib(pid);
        self.run.say(&format!(
            "limits: aggregator, {source}, {tenants} tenants: ready {:?} s, RSS {} MiB (peak {} MiB)",
            s.ready_s.map(|x| (x * 100.0).round() / 100.0),
            s.rss_kib / 1024,
            s.peak_kib / 1024,
        ));
        Ok(s)
    }
}

/// Writes tenants `from..to` to the topic of `cfg`, timed, then reads the
/// topic back.
async fn import(
    run: &Run,
    cfg: &Path,
    brokers: &str,
    db: &Path,
    from: u64,
    to: u64,
) -> anyhow::Result<Import> {
    let config = tierlimit_shared::Config::load(cfg)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .config;
    run.record(format!(
        "# limits: tenants t{from:07}..t{:07} written to {TOPIC} by tierlimit_shared::limits::write::Standalone ({IMPORT_CALL} a call)",
        to.saturating_sub(1)
    ));
    let started = Instant::now();
    let mut w = Standalone::connect(&config, "bench")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (mut first, mut last) = (0, 0);
    let mut at = from;
    while at < to {
        let end = (at + IMPORT_CALL).min(to);
        let changes: Vec<(Subject, Body)> = (at..end)
            .map(|i| {
                let (id, t) = tenant(i);
                (Subject::Tenant(id), Body::Tenant(t))
            })
            .collect();
        let written = w
            .publish(changes)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if first == 0 {
            first = written.records.first().map_or(0, |r| r.version);
        }
        last = written.records.last().map_or(last, |r| r.version);
        at = end;
    }
    let seconds = started.elapsed().as_secs_f64();
    let brokers = brokers.to_string();
    let end = {
        let b = brokers.clone();
        tokio::task::spawn_blocking(move || topic::end_offsets(&b, TOPIC, 1)).await??[0]
    };
    let read_started = Instant::now();
    let read = tokio::task::spawn_blocking(move || {
        topic::read_stretches(
            &brokers,
            TOPIC,
            &[0],
            &[end],
            &[end],
            Duration::from_secs(READ_BOUND_S),
        )
    })
    .await?;
    let (read_s, traffic) = match read {
        Ok((t, _)) => (Some(read_started.elapsed().as_secs_f64()), t),
        Err(e) => {
            run.say(&format!("limits: the topic not read back: {e:#}"));
            (None, Default::default())
        }
    };
    let db_bytes: u64 = ["", "-wal"]
        .iter()
        .map(|s| std::fs::metadata(format!("{}{s}", db.display())).map_or(0, |m| m.len()))
        .sum();
    let i = Import {
        from,
        to,
        seconds,
        records_per_s: (to - from) as f64 / seconds.max(1e-9),
        first_version: first,
        last_version: last,
        topic_records: end as u64,
        topic_bytes: traffic.bytes,
        read_s,
        broker_db_bytes: db_bytes,
    };
    run.say(&format!(
        "limits: {} tenants written in {:.1} s ({:.0}/s); the topic: {} records, {} bytes, read back in {:?} s",
        to - from,
        i.seconds,
        i.records_per_s,
        i.topic_records,
        i.topic_bytes,
        i.read_s.map(|x| (x * 10.0).round() / 10.0)
    ));
    Ok(i)
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<LimitsBench> {
    let mut topic_counts: Vec<u64> = k.limits_tenants.clone();
    topic_counts.sort_unstable();
    topic_counts.dedup();
    let mut file_counts: Vec<u64> = k.limits_file_tenants.clone();
    file_counts.sort_unstable();
    file_counts.dedup();
    run.scenario(&format!(
        "13 limits: start and RSS on the topic at {topic_counts:?} tenants, from the file at {file_counts:?}; propagation to 3 regions, idle and at {} changes/s",
        k.limits_rate
    ));
    let eu = Region::start(run).await?;
    let us = Region::start(run).await?;
    let ap = Region::start(run).await?;
    let tansu = world::start_tansu(run).await;
    run.record(format!(
        "# topics {TOPIC} and {PROP_TOPIC} created on {} with 1 partition, {PROP_DELTAS} and {PROP_GLOBAL} with 8, cleanup.policy=compact",
        tansu.brokers()
    ));
    tansu
        .create_topics_with_config(&[TOPIC, PROP_TOPIC], 1, &[("cleanup.policy", "compact")])
        .await;
    tansu
        .create_topics_with_config(
            &[PROP_DELTAS, PROP_GLOBAL],
            8,
            &[("cleanup.policy", "compact")],
        )
        .await;
    let brokers = tansu.brokers();
    let urls = [eu.redis.url(), us.redis.url(), ap.redis.url()];
    let redis = [urls[0].as_str(), urls[1].as_str(), urls[2].as_str()];
    let dir = run.tmp.join("limits");
    let topic_cfg = write_config(
        &dir.join("topic"),
        &config("topic", false, &brokers, redis),
        "",
    )?;
    let mut r = LimitsBench {
        topic_counts: topic_counts.clone(),
        file_counts: file_counts.clone(),
        id_bytes: tenant(0).0.len() as u64,
        prop_tenants: PROP_TENANTS,
        ..Default::default()
    };
    let mut stack = Stack {
        run,
        eu: &eu,
        http: testkit::http_client(),
        topic_cfg: topic_cfg.clone(),
        topic_end: 0,
        seq: 0,
    };

    // 1. Starts.
    let points: BTreeSet<u64> = std::iter::once(BASE)
        .chain(topic_counts.iter().copied())
        .chain(file_counts.iter().copied())
        .collect();
    if let Err(e) = sweep(&mut stack, &mut r, points, &brokers, &tansu, redis, &dir).await {
        run.say(&format!("limits: the starts stopped: {e:#}"));
        r.starts_error = Some(format!("{e:#}"));
    }
    derive(&mut r);
    run.save("limits_starts", &r)?;

    // 2. Propagation to the three regions.
    match propagation(run, k, &brokers, [&eu, &us, &ap], &dir).await {
        Ok((status_interval_ms, idle, loaded)) => {
            r.status_interval_ms = status_interval_ms;
            r.idle = Some(idle);
            r.loaded = loaded;
        }
        Err(e) => {
            run.say(&format!("limits: the propagation run failed: {e:#}"));
            r.propagation_error = Some(format!("{e:#}"));
        }
    }
    run.save("limits", &r)?;
    drop(tansu);
    drop((eu, us, ap));
    Ok(r)
}

/// The starts at every count, from no tenant up, the topic filled as the
/// counts grow; stops at the first failure (the starts so far stay).
async fn sweep(
    stack: &mut Stack<'_>,
    r: &mut LimitsBench,
    points: BTreeSet<u64>,
    brokers: &str,
    tansu: &testkit::Tansu,
    redis: [&str; 3],
    dir: &Path,
) -> anyhow::Result<()> {
    let run = stack.run;
    let topic_cfg = stack.topic_cfg.clone();
    let (topic_counts, file_counts) = (r.topic_counts.clone(), r.file_counts.clone());
    let mut written = 0;
    for n in points {
        let on_topic = n == BASE || topic_counts.contains(&n);
        let on_file = n == BASE || file_counts.contains(&n);
        if on_topic {
            if n > written {
                let i = import(run, &topic_cfg, brokers, &tansu.db_path(), written, n).await?;
                stack.topic_end = i.topic_records as i64;
                r.imports.push(i);
                written = n;
            }
            let cfg = stack.topic_cfg.clone();
            r.starts.push(stack.node(&cfg, "topic", n).await?);
            r.starts.push(stack.aggregator(&cfg, "topic", n).await?);
        }
        if on_file {
            let cfg = write_config(
                &dir.join(format!("file-{n}")),
                &config("file", false, brokers, redis),
                &tenant_tables(n),
            )?;
            r.starts.push(stack.node(&cfg, "file", n).await?);
            r.starts.push(stack.aggregator(&cfg, "file", n).await?);
            // 1 M tables are tens of MB: not kept.
            if n > BASE {
                let _ = std::fs::remove_file(&cfg);
            }
        }
        run.save("limits_starts", &*r)?;
    }
    Ok(())
}

/// Every start's per-tenant figures, against the start with [`BASE`]
/// tenants of the same process and source (the Redis copy: all of it per
/// tenant); the target rows' figures.
pub fn derive(r: &mut LimitsBench) {
    let base: Vec<Start> = r
        .starts
        .iter()
        .filter(|s| s.tenants == BASE)
        .cloned()
        .collect();
    for s in r.starts.iter_mut().filter(|s| s.tenants > BASE) {
        let Some(b) = base
            .iter()
            .find(|b| b.process == s.process && b.source == s.source)
        else {
            continue;
        };
        let n = (s.tenants - BASE) as f64;
        s.start_us_per_tenant = s.ready_s.zip(b.ready_s).map(|(x, y)| (x - y) * 1e6 / n);
        s.rss_b_per_tenant = Some((s.rss_kib as f64 - b.rss_kib as f64) * 1024.0 / n);
        s.redis_b_per_tenant = s.redis_copy_bytes.map(|x| x as f64 / s.tenants as f64);
        s.total_b_per_tenant = s
            .rss_b_per_tenant
            .map(|rss| rss + s.redis_b_per_tenant.unwrap_or(0.0));
    }
    r.compared_at = r
        .topic_counts
        .iter()
        .rev()
        .find(|n| r.file_counts.contains(n))
        .copied();
    r.largest = r.topic_counts.last().copied().filter(|n| *n > BASE);
    let at = |process: &str, source: &str, n: Option<u64>| {
        n.and_then(|n| r.start(process, source, n)).cloned()
    };
    let rows = (
        at("region-node", "topic", r.compared_at),
        at("region-node", "file", r.compared_at),
        at("region-node", "topic", r.largest),
        at("aggregator", "topic", r.largest),
    );
    (
        r.node_topic_compared,
        r.node_file_compared,
        r.node_topic_largest,
        r.agg_topic_largest,
    ) = rows;
    r.node_start_ratio = r
        .node_topic_compared
        .as_ref()
        .and_then(|t| t.ready_s)
        .zip(r.node_file_compared.as_ref().and_then(|f| f.ready_s))
        .map(|(t, f)| t / f);
    r.node_total_b_per_tenant = r
        .node_topic_largest
        .as_ref()
        .and_then(|s| s.total_b_per_tenant);
    r.agg_rss_b_per_tenant = r
        .agg_topic_largest
        .as_ref()
        .and_then(|s| s.rss_b_per_tenant);
}

/// One change to watch: its version, when the writer was called, and how
/// long the acknowledgement took.
struct Probe {
    version: u64,
    t0: Instant,
    ack_ms: f64,
    nodes_ms: Option<f64>,
    reached_ms: Option<f64>,
}

/// The propagation phases: (the status interval, idle, under load).
async fn propagation(
    run: &Run,
    k: &Knobs,
    brokers: &str,
    regions: [&Region; 3],
    dir: &Path,
) -> anyhow::Result<(u64, Propagation, Option<Propagation>)> {
    for r in regions {
        let _: () = r.conn.query(&mut redis::cmd("FLUSHALL")).await?;
    }
    let urls: Vec<String> = regions.iter().map(|r| r.redis.url()).collect();
    let cfg = write_config(
        &dir.join("prop"),
        &config(
            "topic",
            true,
            brokers,
            [urls[0].as_str(), urls[1].as_str(), urls[2].as_str()],
        ),
        "",
    )?;
    let config = tierlimit_shared::Config::load(&cfg)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .config;
    let status_interval_ms = config.limits.status_interval.as_millis() as u64;
    run.record(format!(
        "# limits: tenants t0000000..t{:07} written to {PROP_TOPIC} by tierlimit_shared::limits::write::Standalone",
        PROP_TENANTS - 1
    ));
    let mut w = Standalone::connect(&config, "bench")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let written = w
        .publish(
            (0..PROP_TENANTS)
                .map(|i| {
                    let (id, t) = tenant(i);
                    (Subject::Tenant(id), Body::Tenant(t))
                })
                .collect(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let last = written.records.last().map_or(0, |r| r.version);
    let agg = world::start_aggregator(run, &cfg, &[]).await;
    let nodes = [
        start_node(run, &cfg, "eu", "eu-1", "/readyz", &[]).await,
        start_node(run, &cfg, "us", "us-1", "/readyz", &[]).await,
        start_node(run, &cfg, "ap", "ap-1", "/readyz", &[]).await,
    ];
    // Every node heard by the aggregator at the import's version.
    let http = agg.http.clone();
    let base = agg.url("");
    testkit::wait_until(
        "the aggregator's status: the import reached all three nodes",
        Duration::from_secs(60),
        || {
            let (http, base) = (http.clone(), base.clone());
            async move {
                agg_status(&http, &base, Some(last)).await.is_some_and(|s| {
                    s["reached"].as_bool() == Some(true)
                        && s["nodes"].as_array().is_some_and(|n| n.len() >= 3)
                })
            }
        },
    )
    .await;
    let bases: Vec<String> = nodes.iter().map(|n| n.url("")).collect();
    let watch = Watch {
        http: agg.http.clone(),
        nodes: bases,
        agg: agg.url(""),
    };
    run.say(&format!(
        "limits: propagation, idle: {} changes, one every {IDLE_EVERY:?}",
        k.limits_probes
    ));
    let idle = phase(&mut w, &watch, 0, k.limits_probes, IDLE_EVERY).await?;
    report(run, "idle", &idle);
    let loaded = if k.limits_rate > 0 {
        run.say(&format!(
            "limits: propagation under {} changes/s: {} changes watched, one every {LOADED_EVERY:?}",
            k.limits_rate, k.limits_probes
        ));
        let p = phase(&mut w, &watch, k.limits_rate, k.limits_probes, LOADED_EVERY).await?;
        report(run, "loaded", &p);
        Some(p)
    } else {
        None
    };
    drop(nodes);
    drop(agg);
    Ok((status_interval_ms, idle, loaded))
}

fn report(run: &Run, what: &str, p: &Propagation) {
    run.say(&format!(
        "limits: propagation {what}: every node p50 {:?} / p99 {:?} ms ({} missing); reached p50 {:?} / p99 {:?} ms; {} other changes at {:.0}/s",
        p.nodes_ms.p50, p.nodes_ms.p99, p.nodes_ms.missing, p.reached_ms.p50, p.reached_ms.p99,
        p.background, p.achieved_rate
    ));
}

/// Where a change is looked for.
struct Watch {
    http: reqwest::Client,
    nodes: Vec<String>,
    agg: String,
}

impl Watch {
    /// The lowest applied version over the nodes (0 if one does not
    /// answer).
    async fn min_applied(&self) -> u64 {
        let mut min = u64::MAX;
        for base in &self.nodes {
            let v = node_readyz(&self.http, base)
                .await
                .and_then(|l| l["applied_version"].as_u64())
                .unwrap_or(0);
            min = min.min(v);
        }
        min
    }
}

/// One phase: `probes` watched changes, one every `every`, among `rate`
/// other changes a second, all from one writer; the watcher reads the
/// nodes every [`NODE_POLL`] and the aggregator every [`STATUS_POLL`]
/// while a change is outstanding.
async fn phase(
    w: &mut Standalone,
    watch: &Watch,
    rate: u64,
    probes: u64,
    every: Duration,
) -> anyhow::Result<Propagation> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Probe>();
    let writer = async move {
        let started = Instant::now();
        let (mut sent, mut done, mut k) = (0u64, 0u64, 0u64);
        let mut next = started + every;
        while done < probes {
            let now = Instant::now();
            let due = (rate as f64 * (now - started).as_secs_f64()) as u64;
            let owed = due.saturating_sub(sent).min(4096);
            let probe = now >= next;
            if owed == 0 && !probe {
                let wait = next.saturating_duration_since(now);
                tokio::time::sleep(wait.min(Duration::from_millis(5))).await;
                continue;
            }
            let mut changes: Vec<(Subject, Body)> = (0..owed)
                .map(|_| {
                    k += 1;
                    let (id, mut t) = tenant(k % PROP_TENANTS);
                    t.region = Some(LimitOverride {
                        limit: Some(20_000 + k % 7),
                        ..Default::default()
                    });
                    (Subject::Tenant(id), Body::Tenant(t))
                })
                .collect();
            if probe {
                // Its own tenants, so the watched change is never one the
                // background just made.
                let (_, mut t) = tenant(done);
                t.region = Some(LimitOverride {
                    limit: Some(30_000 + done),
                    ..Default::default()
                });
                changes.push((
                    Subject::Tenant(format!("probe{}", done % 10)),
                    Body::Tenant(t),
                ));
            }
            let t0 = Instant::now();
            let written = w
                .publish(changes)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            sent += owed;
            if probe {
                let version = written.records.last().map_or(0, |r| r.version);
                let _ = tx.send(Probe {
                    version,
                    t0,
                    ack_ms: t0.elapsed().as_secs_f64() * 1000.0,
                    nodes_ms: None,
                    reached_ms: None,
                });
                done += 1;
                next += every;
            }
        }
        drop(tx);
        anyhow::Ok((sent, started.elapsed().as_secs_f64()))
    };
    let watcher = async {
        let mut open: Vec<Probe> = Vec::new();
        let mut finished: Vec<Probe> = Vec::new();
        let mut closed = false;
        let mut last_status = Instant::now() - STATUS_POLL;
        loop {
            loop {
                match rx.try_recv() {
                    Ok(p) => open.push(p),
                    Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                    Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            }
            if open.iter().any(|p| p.nodes_ms.is_none()) {
                let min = watch.min_applied().await;
                for p in open.iter_mut().filter(|p| p.nodes_ms.is_none()) {
                    if min >= p.version {
                        p.nodes_ms = Some(p.t0.elapsed().as_secs_f64() * 1000.0);
                    }
                }
            }
            if last_status.elapsed() >= STATUS_POLL && open.iter().any(|p| p.reached_ms.is_none()) {
                last_status = Instant::now();
                // Oldest first: a version reached means every older one is.
                open.sort_by_key(|p| p.version);
                for i in 0..open.len() {
                    if open[i].reached_ms.is_some() {
                        continue;
                    }
                    let reached = agg_status(&watch.http, &watch.agg, Some(open[i].version))
                        .await
                        .is_some_and(|s| s["reached"].as_bool() == Some(true));
                    if !reached {
                        break;
                    }
                    let ms = open[i].t0.elapsed().as_secs_f64() * 1000.0;
                    for p in open[..=i].iter_mut().filter(|p| p.reached_ms.is_none()) {
                        p.reached_ms = Some(ms);
                    }
                }
            }
            let (done, still): (Vec<Probe>, Vec<Probe>) = open.into_iter().partition(|p| {
                (p.nodes_ms.is_some() && p.reached_ms.is_some()) || p.t0.elapsed() > PROBE_BOUND
            });
            finished.extend(done);
            open = still;
            if closed && open.is_empty() {
                return finished;
            }
            tokio::time::sleep(NODE_POLL).await;
        }
    };
    let (written, probes_seen) = tokio::join!(writer, watcher);
    let (background, seconds) = written?;
    Ok(Propagation {
        rate,
        achieved_rate: background as f64 / seconds.max(1e-9),
        background,
        seconds,
        probes,
        ack_ms: Dist::of(probes_seen.iter().map(|p| Some(p.ack_ms)).collect()),
        nodes_ms: Dist::of(probes_seen.iter().map(|p| p.nodes_ms).collect()),
        reached_ms: Dist::of(probes_seen.iter().map(|p| p.reached_ms).collect()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_tenant_in_a_hundred_has_an_override_and_the_tables_load() {
        assert_eq!(overrides(100_000), 1_000);
        assert_eq!(overrides(1), 1);
        assert!(tenant(0).1.region.is_some() && tenant(1).1.region.is_none());
        assert_eq!(tenant(42).0, "t0000042");
        let cfg = config("file", false, "127.0.0.1:9092", ["redis://127.0.0.1:1"; 3]);
        let text = testkit::with_wire_keys(&cfg) + &tenant_tables(300);
        let loaded =
            tierlimit_shared::Config::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(loaded.config.tenants.len(), 300);
        let p = loaded
            .policy("t0000200")
            .expect("a tenant with an override");
        assert_eq!(p.region.as_ref().map(|r| r.limit), Some(50_200));
        let topic = config("topic", true, "127.0.0.1:9092", ["redis://127.0.0.1:1"; 3]);
        let loaded = tierlimit_shared::Config::from_toml(&testkit::with_wire_keys(&topic)).unwrap();
        assert_eq!(loaded.config.kafka.deltas_topic, PROP_DELTAS);
    }

    #[test]
    fn percentiles_are_nearest_rank_and_missing_ones_counted() {
        let d = Dist::of((1..=100).map(|x| Some(x as f64)).chain([None]).collect());
        assert_eq!((d.n, d.missing), (100, 1));
        assert_eq!((d.p50, d.p99, d.max), (Some(50.0), Some(99.0), Some(100.0)));
        assert_eq!(Dist::of(vec![]).p99, None);
    }
}
