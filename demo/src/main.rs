//! `demo`: three regions of tierlimit on loopback and a scripted story, run
//! by `scripts/demo`.
//!
//! It starts a Tansu broker (SQLite in the state directory), the aggregator,
//! and three regions (eu-west, us-east, ap-south), each with its own
//! `redis-server` and two region-nodes, on free loopback ports. Each region
//! reaches Kafka through its own link (a Kafka-aware proxy, see
//! [`proxy`]), so one region can be cut off from Kafka while everything
//! else keeps running. Then:
//!
//! 1. **steady**: acme, globex and initech send steady traffic in every
//!    region (acme refunds one unit in ten); nobody is denied;
//! 2. **region limit**: bursty floods eu-west past its region limit (300 per
//!    minute, sliding log): exactly 300 are allowed there, the rest denied by
//!    the region tier, while us-east keeps serving bursty normally;
//! 3. **global limit**: hot pushes in all three regions past its daily limit
//!    of 2500: every region starts denying it from the broadcast view;
//! 4. **cut**: ap-south's link to Kafka is blackholed for 10 s: it keeps
//!    serving (node and region tiers are local), the aggregator stops hearing
//!    from it; then the link heals;
//! 5. **converge**: traffic stops; the aggregator's global count of every
//!    tenant must equal exactly what the clients were allowed minus what they
//!    refunded, and the regions' Redis truth.
//!
//! It prints progress while it runs and a report at the end, stops every
//! process it started (also on Ctrl-C), and exits 1 if any promise failed.

mod procs;
mod proxy;
mod traffic;

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::Parser;
use serde_json::Value;

use crate::procs::{Procs, Spec};
use crate::proxy::KafkaProxy;
use crate::traffic::{Cell, Stream, Tally};

const REGIONS: [&str; 3] = ["eu-west", "us-east", "ap-south"];
const NODES_PER_REGION: usize = 2;
const STEADY: [&str; 3] = ["acme", "globex", "initech"];
const BURSTY: &str = "bursty";
const HOT: &str = "hot";
const TENANTS: [&str; 5] = ["acme", "globex", "initech", BURSTY, HOT];
const BURST_REGION: &str = "eu-west";
const CUT_REGION: &str = "ap-south";

const BURSTY_REGION_LIMIT: u64 = 300;
const HOT_DAILY_LIMIT: u64 = 2500;

/// Requests per second of each steady tenant in each region.
const STEADY_RATE: f64 = 10.0;
/// bursty's flood in eu-west, and its normal traffic in us-east.
const BURST_RATE: f64 = 120.0;
const BURSTY_NORMAL_RATE: f64 = 5.0;
/// hot's push in each region, and its probing rate once denied.
const HOT_RATE: f64 = 80.0;
const HOT_PROBE_RATE: f64 = 5.0;

const PHASE_STEADY: Duration = Duration::from_secs(8);
const PHASE_BURST: Duration = Duration::from_secs(8);
const START_DEADLINE: Duration = Duration::from_secs(60);
const DENY_DEADLINE: Duration = Duration::from_secs(60);
const CONVERGE_DEADLINE: Duration = Duration::from_secs(60);

/// tierlimit's local demo: Tansu, the aggregator and three regions (own
/// redis-server each, two region-nodes each) on loopback ports, driven
/// through a scripted story, then a report. Run it with scripts/demo, which
/// installs what is missing and builds the release binaries first.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// Directory holding the region-node and aggregator binaries [default:
    /// the directory of this binary].
    #[arg(long, env = "DEMO_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// State directory: configuration, logs, Tansu's SQLite database.
    /// Emptied at start and kept at the end for inspection.
    #[arg(long, env = "DEMO_STATE_DIR", default_value = ".tierlimit/demo")]
    state_dir: PathBuf,
    /// The tansu binary [default: $TANSU_BIN, else tansu on PATH, else
    /// ~/.cargo/bin/tansu].
    #[arg(long, env = "TANSU_BIN")]
    tansu: Option<PathBuf>,
    /// The redis-server binary.
    #[arg(long, env = "REDIS_SERVER_BIN", default_value = "redis-server")]
    redis_server: PathBuf,
    /// Seconds the cut region stays cut off from Kafka.
    #[arg(long, env = "DEMO_CUT_SECONDS", default_value_t = 10)]
    cut_seconds: u64,
    /// After the report, keep everything running (the aggregator's dashboard
    /// stays up) until Ctrl-C.
    #[arg(long, env = "DEMO_KEEP_RUNNING")]
    keep_running: bool,
}

/// With --keep-running: the verdict of the story (1 held, 2 failed), so that
/// the Ctrl-C ending it still exits with the story's result.
static VERDICT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

#[derive(Debug)]
struct Interrupted(&'static str);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", self.0)
    }
}

impl std::error::Error for Interrupted {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The main future runs on this thread, which starts every child: their
    // PR_SET_PDEATHSIG is tied to it and it lives as long as the demo.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let mut procs = Procs::default();
    let started = Instant::now();
    let result = runtime.block_on(async {
        let signals = signals();
        tokio::select! {
            r = run(&cli, &mut procs) => r,
            s = signals => Err(anyhow!(Interrupted(s))),
        }
    });
    let interrupted = result
        .as_ref()
        .err()
        .is_some_and(|e| e.downcast_ref::<Interrupted>().is_some());
    if let Err(e) = &result {
        if !interrupted {
            eprintln!("\ndemo: error: {e:#}");
            for (name, log) in procs.logs() {
                let tail = procs::tail(log, 8);
                if !tail.is_empty() {
                    eprintln!(
                        "----- last lines of {name} ({}) -----\n{tail}",
                        log.display()
                    );
                }
            }
        }
    }
    let result = match (VERDICT.load(std::sync::atomic::Ordering::SeqCst), result) {
        (1, Err(_)) => Ok(true),
        (2, Err(_)) => Ok(false),
        (_, r) => r,
    };
    let stopped = procs.stop_all(Duration::from_secs(5));
    println!(
        "\ndemo: stopped {stopped} processes; state and logs kept in {} ({:.0} s in all)",
        cli.state_dir.display(),
        started.elapsed().as_secs_f64()
    );
    runtime.shutdown_timeout(Duration::from_millis(200));
    match result {
        Ok(true) => {
            println!("demo: every promise held");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("demo: FAILED: at least one promise did not hold (see the report above)");
            ExitCode::FAILURE
        }
        Err(_) if interrupted => {
            println!("demo: interrupted");
            ExitCode::from(130)
        }
        Err(_) => ExitCode::from(2),
    }
}

async fn signals() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    tokio::select! {
        _ = int.recv() => "Ctrl-C",
        _ = term.recv() => "SIGTERM",
        _ = hup.recv() => "SIGHUP",
    }
}

fn say(msg: impl AsRef<str>) {
    println!("demo: {}", msg.as_ref());
}

// ---------------------------------------------------------------------------
// Starting the world
// ---------------------------------------------------------------------------

fn free_port() -> u16 {
    static HANDED: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = l.local_addr().expect("local addr").port();
        if HANDED
            .lock()
            .unwrap()
            .get_or_insert_with(HashSet::new)
            .insert(port)
        {
            return port;
        }
    }
}

fn find_tansu(cli: &Cli) -> anyhow::Result<PathBuf> {
    if let Some(p) = &cli.tansu {
        return Ok(p.clone());
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("tansu");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"));
    let p = home.join("bin/tansu");
    if p.is_file() {
        Ok(p)
    } else {
        bail!(
            "tansu not found (--tansu, $TANSU_BIN, PATH, {}): run scripts/setup",
            p.display()
        )
    }
}

async fn wait_until<F, Fut>(
    what: &str,
    deadline: Duration,
    procs: &mut Procs,
    mut f: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if f().await {
            return Ok(());
        }
        let dead = procs.dead();
        if !dead.is_empty() {
            bail!("while waiting until {what}: exited: {}", dead.join(", "));
        }
        if start.elapsed() > deadline {
            bail!("timed out after {deadline:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn tcp_open(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(300),
    )
    .is_ok()
}

async fn http_ok(http: &reqwest::Client, url: &str) -> bool {
    http.get(url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

struct Region {
    name: &'static str,
    redis_url: String,
    proxy: KafkaProxy,
    /// `http://127.0.0.1:PORT` of each node.
    nodes: Vec<String>,
}

struct World {
    config: PathBuf,
    aggregator: String,
    regions: Vec<Region>,
    http: reqwest::Client,
    flush: Duration,
    broadcast: Duration,
}

impl World {
    fn region(&self, name: &str) -> &Region {
        self.regions
            .iter()
            .find(|r| r.name == name)
            .expect("known region")
    }
}

fn config_text(tansu: u16, redis: &[(String, String)]) -> String {
    let mut t = format!(
        r#"# Written by the demo (demo/src/main.rs). regions.example.toml documents every key.
cluster = "demo"

[kafka]
# The aggregator's broker. Each region-node reaches Kafka through its
# region's link instead: TIERLIMIT__KAFKA__BROKERS overrides this per node.
brokers = "127.0.0.1:{tansu}"
partitions = 8

[node]
flush_interval = "250ms"
# Generous, so a busy 2-core laptop does not push decisions into a fail mode.
store_timeout = "500ms"
max_staleness = "30s"

[aggregator]
group_id = "tierlimit-demo"
broadcast_interval = "250ms"
"#
    );
    for (name, url) in redis {
        let _ = write!(
            t,
            "\n[regions.{name}]\nredis_url = \"{url}\"\nexpected_nodes = {NODES_PER_REGION}\n"
        );
    }
    let _ = write!(
        t,
        r#"
# acme, globex, initech: steady traffic, far below every limit.
[plans.standard]
on_store_error = "local"
global = {{ limit = 100000 }}
node = {{ limit = 20, window = "1s", algorithm = "fixed_window" }}
region = {{ limit = 1200, window = "1m", algorithm = "sliding_window" }}

# bursty: an exact region limit of {BURSTY_REGION_LIMIT} per minute.
[plans.metered]
on_store_error = "closed"
global = {{ limit = 1000000 }}
node = {{ limit = 100, window = "1s", algorithm = "fixed_window" }}
region = {{ limit = {BURSTY_REGION_LIMIT}, window = "1m", algorithm = "sliding_log" }}

# hot: a small daily budget shared by every region.
[plans.capped]
on_store_error = "local"
global = {{ limit = {HOT_DAILY_LIMIT} }}
node = {{ limit = 200, window = "1s", algorithm = "token_bucket", burst = 50 }}
region = {{ limit = 100000, window = "1m" }}

[tenants.acme]
plan = "standard"
[tenants.globex]
plan = "standard"
[tenants.initech]
plan = "standard"
[tenants.bursty]
plan = "metered"
[tenants.hot]
plan = "capped"

[unknown_tenants]
policy = "deny"
"#
    );
    t
}

async fn start_world(cli: &Cli, procs: &mut Procs) -> anyhow::Result<World> {
    let bin_dir = match &cli.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .to_path_buf(),
    };
    let region_node = bin_dir.join("region-node");
    let aggregator = bin_dir.join("aggregator");
    for b in [&region_node, &aggregator] {
        if !b.is_file() {
            bail!(
                "{} not found: build with `cargo build --release` (scripts/demo does)",
                b.display()
            );
        }
    }
    let tansu = find_tansu(cli)?;

    let state = &cli.state_dir;
    if state.exists() {
        std::fs::remove_dir_all(state).with_context(|| format!("emptying {}", state.display()))?;
    }
    let logs = state.join("logs");
    let tansu_dir = state.join("tansu");
    std::fs::create_dir_all(&logs)?;
    std::fs::create_dir_all(&tansu_dir)?;
    let state = std::fs::canonicalize(state)?;
    let logs = state.join("logs");
    let tansu_dir = state.join("tansu");
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;

    // Broker: Tansu with SQLite storage, explicit 127.0.0.1 listener.
    let tansu_port = free_port();
    let url = format!("tcp://127.0.0.1:{tansu_port}");
    procs.spawn(Spec {
        name: "tansu".into(),
        program: &tansu,
        args: [
            "broker",
            "--kafka-cluster-id",
            "tierlimit-demo",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--storage-engine",
            "sqlite://tansu.db",
        ]
        .map(OsString::from)
        .to_vec(),
        env: vec![("RUST_LOG".into(), "warn".into())],
        cwd: Some(&tansu_dir),
        log_dir: &logs,
    })?;

    // One redis-server per region, keeping nothing on disk.
    let mut redis = Vec::new();
    for name in REGIONS {
        let port = free_port();
        let dir = state.join(format!("redis-{name}"));
        std::fs::create_dir_all(&dir)?;
        procs.spawn(Spec {
            name: format!("redis-{name}"),
            program: &cli.redis_server,
            args: vec![
                "--port".into(),
                port.to_string().into(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                "".into(),
                "--appendonly".into(),
                "no".into(),
                "--dir".into(),
                dir.into(),
            ],
            env: vec![],
            cwd: None,
            log_dir: &logs,
        })?;
        redis.push((name.to_string(), port));
    }
    for (name, port) in &redis {
        let url = format!("redis://127.0.0.1:{port}/");
        wait_until(
            &format!("redis-{name} answers PING"),
            START_DEADLINE,
            procs,
            || {
                let url = url.clone();
                async move { redis_ping(&url).await }
            },
        )
        .await?;
    }
    wait_until("tansu listens", START_DEADLINE, procs, || async move {
        tcp_open(tansu_port)
    })
    .await?;
    say(format!(
        "Tansu broker on 127.0.0.1:{tansu_port}; redis-server per region on {}",
        redis
            .iter()
            .map(|(n, p)| format!("{n} :{p}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));

    let redis_urls: Vec<(String, String)> = redis
        .iter()
        .map(|(n, p)| (n.clone(), format!("redis://127.0.0.1:{p}/")))
        .collect();
    let text = config_text(tansu_port, &redis_urls);
    let loaded =
        tierlimit_shared::Config::from_toml(&text).map_err(|e| anyhow!("demo config: {e}"))?;
    let config = state.join("tierlimit.toml");
    std::fs::write(&config, &text)?;

    // Topics (the broker may need a moment before it accepts CreateTopics).
    let start = Instant::now();
    loop {
        let out = std::process::Command::new(&aggregator)
            .args(["create-topics", "--config"])
            .arg(&config)
            .env("RUST_LOG", "warn")
            .output()
            .context("running aggregator create-topics")?;
        if out.status.success() {
            break;
        }
        if start.elapsed() > START_DEADLINE {
            bail!(
                "aggregator create-topics kept failing: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    say(format!(
        "topics {} and {} created ({} partitions): aggregator create-topics --config {}",
        loaded.config.kafka.deltas_topic,
        loaded.config.kafka.global_topic,
        loaded.config.kafka.partitions,
        config.display()
    ));

    let agg_port = free_port();
    procs.spawn(Spec {
        name: "aggregator".into(),
        program: &aggregator,
        args: vec![
            "--config".into(),
            config.clone().into(),
            "--listen".into(),
            format!("127.0.0.1:{agg_port}").into(),
        ],
        env: vec![("RUST_LOG".into(), "info".into())],
        cwd: None,
        log_dir: &logs,
    })?;
    let aggregator_url = format!("http://127.0.0.1:{agg_port}");

    let tansu_addr = SocketAddr::from(([127, 0, 0, 1], tansu_port));
    let mut regions = Vec::new();
    for (name, url) in &redis_urls {
        let name: &'static str = REGIONS.iter().find(|r| *r == name).expect("region");
        let proxy = KafkaProxy::start(tansu_addr).await?;
        let mut nodes = Vec::new();
        for i in 1..=NODES_PER_REGION {
            let port = free_port();
            let node_id = format!("{name}-{i}");
            procs.spawn(Spec {
                name: format!("region-node-{node_id}"),
                program: &region_node,
                args: vec![
                    "--config".into(),
                    config.clone().into(),
                    "--region".into(),
                    name.into(),
                    "--node-id".into(),
                    node_id.into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}").into(),
                ],
                env: vec![
                    ("RUST_LOG".into(), "info".into()),
                    ("TIERLIMIT__KAFKA__BROKERS".into(), proxy.addr.to_string()),
                ],
                cwd: None,
                log_dir: &logs,
            })?;
            nodes.push(format!("http://127.0.0.1:{port}"));
        }
        regions.push(Region {
            name,
            redis_url: url.clone(),
            proxy,
            nodes,
        });
    }
    let mut ready_urls = vec![format!("{aggregator_url}/readyz")];
    for r in &regions {
        ready_urls.extend(r.nodes.iter().map(|n| format!("{n}/readyz")));
    }
    for url in &ready_urls {
        let h = http.clone();
        wait_until(&format!("{url} answers 200"), START_DEADLINE, procs, || {
            let (h, url) = (h.clone(), url.clone());
            async move { http_ok(&h, &url).await }
        })
        .await?;
    }
    say(format!(
        "aggregator on {aggregator_url} (dashboard: {aggregator_url}/)"
    ));
    for r in &regions {
        say(format!(
            "{:<9} region-nodes {} ; its link to Kafka: 127.0.0.1:{}",
            r.name,
            r.nodes.join(" "),
            r.proxy.addr.port()
        ));
    }
    say(format!(
        "config: {} ; logs: {}",
        config.display(),
        logs.display()
    ));
    Ok(World {
        config,
        aggregator: aggregator_url,
        regions,
        http,
        flush: loaded.config.node.flush_interval,
        broadcast: loaded.config.aggregator.broadcast_interval,
    })
}

async fn redis_ping(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(Ok(mut con)) = tokio::time::timeout(
        Duration::from_secs(1),
        client.get_multiplexed_async_connection(),
    )
    .await
    else {
        return false;
    };
    redis::cmd("PING")
        .query_async::<String>(&mut con)
        .await
        .is_ok_and(|s| s == "PONG")
}

// ---------------------------------------------------------------------------
// Reading the aggregator and the regions
// ---------------------------------------------------------------------------

/// The aggregator's view of `tenant` today: total and net per region.
async fn agg_view(w: &World, tenant: &str) -> Option<(u64, BTreeMap<String, u64>)> {
    let v: Value = w
        .http
        .get(format!("{}/v1/global/{tenant}", w.aggregator))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let total = v["today"]["total"].as_u64()?;
    let regions = v["today"]["regions"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_u64()?)))
                .collect()
        })
        .unwrap_or_default();
    Some((total, regions))
}

/// Σ metric samples named exactly `name` (any labels) in a Prometheus text.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn metrics_text(w: &World, base: &str) -> String {
    match w.http.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Unix seconds of the newest delta the aggregator has seen from `region`.
async fn last_delta(w: &World, region: &str) -> Option<f64> {
    let text = metrics_text(w, &w.aggregator).await;
    let prefix =
        format!("tierlimit_aggregator_region_last_delta_timestamp_seconds{{region=\"{region}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.parse::<f64>().ok())
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Σ P − N of `tenant` today over every region's Redis: the truth.
async fn redis_truth(w: &World, tenant: &str, day: u32) -> anyhow::Result<u64> {
    let mut sum = 0;
    for r in &w.regions {
        let client = redis::Client::open(r.redis_url.as_str())?;
        let mut con = client.get_multiplexed_async_connection().await?;
        let (p, n): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(tierlimit_shared::keys::pn_counter(tenant, day))
            .arg("p")
            .arg("n")
            .query_async(&mut con)
            .await?;
        sum += p.unwrap_or(0).saturating_sub(n.unwrap_or(0));
    }
    Ok(sum)
}

// ---------------------------------------------------------------------------
// The story
// ---------------------------------------------------------------------------

/// Shared with the progress printer.
struct Progress {
    phase: Mutex<&'static str>,
    start: Instant,
}

fn totals(tally: &Tally, tenant: Option<&str>, region: Option<&str>) -> Cell {
    let mut c = Cell::default();
    for ((t, r), cell) in tally.snapshot() {
        if tenant.is_none_or(|x| x == t) && region.is_none_or(|x| x == r) {
            c.add(&cell);
        }
    }
    c
}

async fn progress_line(w: &World, tally: &Tally, p: &Progress) -> String {
    let mut line = format!(
        "[{:>5.1}s] {:<12} | allowed/denied",
        p.start.elapsed().as_secs_f64(),
        *p.phase.lock().unwrap()
    );
    for r in REGIONS {
        let c = totals(tally, None, Some(r));
        let _ = write!(line, " {r} {}/{}", c.allowed, c.denied());
        if c.errors > 0 {
            let _ = write!(line, " ({} errors)", c.errors);
        }
    }
    line.push_str(" | global");
    for t in [HOT, "acme"] {
        if let Some((total, _)) = agg_view(w, t).await {
            let _ = write!(line, " {t} {total}");
            if t == HOT {
                let _ = write!(line, "/{HOT_DAILY_LIMIT}");
            }
        }
    }
    let now = unix_now();
    line.push_str(" | last delta");
    for r in REGIONS {
        match last_delta(w, r).await {
            Some(ts) => {
                let _ = write!(line, " {r} {:.1}s ago", (now - ts).max(0.0));
            }
            None => {
                let _ = write!(line, " {r} -");
            }
        }
    }
    line
}

fn spawn_progress(
    w: Arc<World>,
    tally: Arc<Tally>,
    p: Arc<Progress>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        tick.tick().await;
        loop {
            tick.tick().await;
            println!("{}", progress_line(&w, &tally, &p).await);
        }
    })
}

struct Promise {
    ok: bool,
    text: String,
}

fn promise(ok: bool, text: impl Into<String>) -> Promise {
    Promise {
        ok,
        text: text.into(),
    }
}

async fn run(cli: &Cli, procs: &mut Procs) -> anyhow::Result<bool> {
    let day = tierlimit_shared::day::today();
    let w = Arc::new(start_world(cli, procs).await?);
    let tally = Arc::new(Tally::default());
    let progress = Arc::new(Progress {
        phase: Mutex::new("steady"),
        start: Instant::now(),
    });
    let printer = spawn_progress(Arc::clone(&w), Arc::clone(&tally), Arc::clone(&progress));
    let set_phase = |name: &'static str, what: &str| {
        *progress.phase.lock().unwrap() = name;
        println!(
            "\n[{:>5.1}s] ==> {what}",
            progress.start.elapsed().as_secs_f64()
        );
    };
    let mut streams: Vec<Stream> = Vec::new();
    let start_stream = |tenant: &str, region: &str, rate: f64, refund: Option<u64>| {
        traffic::start(
            &w.http,
            &tally,
            tenant,
            region,
            &w.region(region).nodes,
            rate,
            refund,
        )
    };

    // 1. Steady multi-tenant traffic everywhere.
    set_phase(
        "steady",
        &format!(
            "steady traffic: acme, globex, initech at {STEADY_RATE} req/s in each region \
             (acme refunds 1 unit in 10); bursty at {BURSTY_NORMAL_RATE} req/s in us-east"
        ),
    );
    for t in STEADY {
        for r in REGIONS {
            let refund = (t == "acme").then_some(10);
            streams.push(start_stream(t, r, STEADY_RATE, refund));
        }
    }
    streams.push(start_stream(BURSTY, "us-east", BURSTY_NORMAL_RATE, None));
    tokio::time::sleep(PHASE_STEADY).await;

    // 2. One tenant over its region limit in one region.
    set_phase(
        "region limit",
        &format!(
            "bursty floods {BURST_REGION} at {BURST_RATE} req/s for {}s; its region limit is \
             {BURSTY_REGION_LIMIT}/min (sliding log, exact)",
            PHASE_BURST.as_secs()
        ),
    );
    let burst = start_stream(BURSTY, BURST_REGION, BURST_RATE, None);
    tokio::time::sleep(PHASE_BURST).await;
    burst.stop().await;
    let bursty_eu = tally.cell(BURSTY, BURST_REGION);
    say(format!(
        "bursty in {BURST_REGION}: {} allowed, {} denied by the region tier, {} by others",
        bursty_eu.allowed,
        bursty_eu.denied_region,
        bursty_eu.denied() - bursty_eu.denied_region
    ));

    // 3. One tenant over its global daily limit: every region denies it.
    set_phase(
        "global limit",
        &format!(
            "hot pushes at {HOT_RATE} req/s in each of the 3 regions; its daily limit is \
             {HOT_DAILY_LIMIT} for all regions together"
        ),
    );
    let hot_push: Vec<Stream> = REGIONS
        .iter()
        .map(|r| start_stream(HOT, r, HOT_RATE, None))
        .collect();
    let push_started = Instant::now();
    let all_deny = loop {
        if REGIONS
            .iter()
            .all(|r| tally.first_view_denial(HOT, r).is_some())
        {
            break true;
        }
        if push_started.elapsed() > DENY_DEADLINE {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    traffic::stop_all(hot_push).await;
    let hot_allowed_at_crossing = totals(&tally, Some(HOT), None).allowed;
    let crossing_spread = tally.first_global_denial().and_then(|first| {
        REGIONS
            .iter()
            .map(|r| tally.first_view_denial(HOT, r))
            .collect::<Option<Vec<_>>>()
            .and_then(|v| v.into_iter().max())
            .map(|last| last.saturating_duration_since(first))
    });
    if all_deny {
        say(format!(
            "hot: every region denies it from the broadcast view, {:.2} s after the first global denial; \
             allowed {hot_allowed_at_crossing} in all",
            crossing_spread.unwrap_or_default().as_secs_f64()
        ));
    } else {
        say("hot: NOT every region denied it from the broadcast view in time");
    }
    for r in REGIONS {
        streams.push(start_stream(HOT, r, HOT_PROBE_RATE, None));
    }

    // 4. One region cut off from Kafka, then healed.
    let cut = Duration::from_secs(cli.cut_seconds);
    set_phase(
        "cut",
        &format!(
            "{CUT_REGION} cut off from Kafka for {} s: its link to the broker is blackholed \
             (no byte moves either way, like a partition that drops packets); traffic goes on everywhere, \
             and stops just before the heal",
            cut.as_secs()
        ),
    );
    let cut_region = w.region(CUT_REGION);
    let before_cut = tally.snapshot();
    let acme_before = agg_view(&w, "acme")
        .await
        .map(|v| v.1.get(CUT_REGION).copied().unwrap_or(0));
    cut_region.proxy.cut();
    let cut_at = Instant::now();
    // Deltas already in flight when the link went down may still land.
    let settle = Duration::from_millis(1500).min(cut / 2);
    tokio::time::sleep(settle).await;
    let frozen_from = last_delta(&w, CUT_REGION).await;
    let acme_frozen_from = agg_view(&w, "acme")
        .await
        .map(|v| v.1.get(CUT_REGION).copied().unwrap_or(0));
    tokio::time::sleep(cut.saturating_sub(settle)).await;
    let frozen_to = last_delta(&w, CUT_REGION).await;
    let acme_frozen_to = agg_view(&w, "acme")
        .await
        .map(|v| v.1.get(CUT_REGION).copied().unwrap_or(0));
    // Traffic stops just before the heal, so the heal → exact time below
    // measures the backlog only, against final client counts.
    traffic::stop_all(std::mem::take(&mut streams)).await;
    // The broadcast view's age: the cut region's nodes against the others'.
    let (mut view_age_cut, mut view_age_others): (f64, f64) = (0.0, 0.0);
    for r in &w.regions {
        for n in &r.nodes {
            let age = metric_sum(&metrics_text(&w, n).await, "tierlimit_view_age_seconds");
            if r.name == CUT_REGION {
                view_age_cut = view_age_cut.max(age);
            } else {
                view_age_others = view_age_others.max(age);
            }
        }
    }
    let during_cut: Cell = {
        let now = tally.snapshot();
        let mut c = Cell::default();
        for ((t, r), cell) in &now {
            if r == CUT_REGION {
                let before = before_cut
                    .get(&(t.clone(), r.clone()))
                    .copied()
                    .unwrap_or_default();
                c.add(&cell.minus(&before));
            }
        }
        c
    };
    let acme_cut = tally.cell("acme", CUT_REGION);
    let acme_cut_clients = acme_cut.allowed - acme_cut.refunded;
    cut_region.proxy.heal();
    let healed_at = Instant::now();
    let cut_for = healed_at.duration_since(cut_at);
    set_phase(
        "converge",
        &format!(
            "traffic stopped; {CUT_REGION}'s link healed after {:.1} s; waiting for the global count to be exact",
            cut_for.as_secs_f64()
        ),
    );
    say(format!(
        "during the cut {CUT_REGION} answered {} checks ({} allowed, {} denied, {} errors); \
         the aggregator's {CUT_REGION} part of acme stayed at {} while {CUT_REGION}'s clients had {acme_cut_clients}; \
         tierlimit_view_age_seconds at the heal: {view_age_cut:.1} s in {CUT_REGION}, at most {view_age_others:.1} s elsewhere",
        during_cut.allowed + during_cut.denied() + during_cut.errors,
        during_cut.allowed,
        during_cut.denied(),
        during_cut.errors,
        acme_frozen_to.map_or("?".into(), |v| v.to_string()),
    ));

    // 5. Convergence: aggregator == clients' allowed − refunded == Redis truth.
    let mut want = BTreeMap::new();
    for t in TENANTS {
        let c = totals(&tally, Some(t), None);
        want.insert(t, c.allowed - c.refunded);
    }
    let mut truth = BTreeMap::new();
    for t in TENANTS {
        truth.insert(t, redis_truth(&w, t, day).await?);
    }
    let mut seen: BTreeMap<&str, Option<u64>> = BTreeMap::new();
    let mut first_delta_after_heal = None;
    let converged = loop {
        if first_delta_after_heal.is_none()
            && last_delta(&w, CUT_REGION)
                .await
                .zip(frozen_to)
                .is_some_and(|(now, then)| now > then)
        {
            first_delta_after_heal = Some(healed_at.elapsed());
        }
        for t in TENANTS {
            seen.insert(t, agg_view(&w, t).await.map(|v| v.0));
        }
        if TENANTS.iter().all(|t| seen[t] == Some(want[t])) {
            break Some(healed_at.elapsed());
        }
        if healed_at.elapsed() > CONVERGE_DEADLINE {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    printer.abort();
    match converged {
        Some(d) => say(format!(
            "global count exact for every tenant {:.2} s after the heal",
            d.as_secs_f64()
        )),
        None => say(format!(
            "global count NOT exact {CONVERGE_DEADLINE:?} after the heal"
        )),
    }
    if tierlimit_shared::day::today() != day {
        bail!("the demo crossed midnight UTC, where daily counters start again: run it once more");
    }

    // Node metrics: decisions taken without Redis, deltas Kafka refused.
    let mut fail_mode = 0.0;
    let mut deltas_failed = 0.0;
    for r in &w.regions {
        for n in &r.nodes {
            let text = metrics_text(&w, n).await;
            fail_mode += metric_sum(&text, "tierlimit_fail_mode_decisions_total");
            deltas_failed += metric_sum(&text, "tierlimit_deltas_failed_total");
        }
    }
    let dead = procs.dead();

    // ---- Report --------------------------------------------------------
    let mut promises = Vec::new();
    let steady =
        STEADY
            .iter()
            .map(|t| totals(&tally, Some(t), None))
            .fold(Cell::default(), |mut a, c| {
                a.add(&c);
                a
            });
    promises.push(promise(
        steady.denied() == 0 && steady.errors == 0 && steady.allowed > 0,
        format!(
            "steady tenants (acme, globex, initech): {} allowed, {} denied, {} errors, {} refunded",
            steady.allowed,
            steady.denied(),
            steady.errors,
            steady.refunded
        ),
    ));
    let bursty_us = tally.cell(BURSTY, "us-east");
    promises.push(promise(
        bursty_eu.allowed == BURSTY_REGION_LIMIT
            && bursty_eu.denied_region == bursty_eu.denied()
            && bursty_eu.denied_region > 0
            && bursty_eu.errors == 0,
        format!(
            "bursty in {BURST_REGION}: exactly {} allowed (region limit {BURSTY_REGION_LIMIT}/min), \
             {} denied, all by the region tier",
            bursty_eu.allowed, bursty_eu.denied_region
        ),
    ));
    promises.push(promise(
        bursty_us.denied() == 0 && bursty_us.errors == 0 && bursty_us.allowed > 0,
        format!(
            "bursty in us-east is not affected by eu-west's region limit: {} allowed, {} denied",
            bursty_us.allowed,
            bursty_us.denied()
        ),
    ));
    promises.push(promise(
        all_deny,
        format!(
            "hot over its daily limit: every region denies it from the broadcast view ({})",
            crossing_spread.map_or("not reached".into(), |d| format!(
                "{:.2} s from the first global denial to the last region",
                d.as_secs_f64()
            ))
        ),
    ));
    let hot_allowed = totals(&tally, Some(HOT), None).allowed;
    let overshoot = hot_allowed.saturating_sub(HOT_DAILY_LIMIT);
    // DESIGN: overshoot ≈ Σ other regions' rate × (flush + broadcast + transport).
    let others_rate = HOT_RATE * (REGIONS.len() - 1) as f64;
    let expected = others_rate * (w.flush + w.broadcast).as_secs_f64();
    // Checked with 2 s of slack for the transport: a busy 2-core machine.
    let bound =
        (others_rate * (w.flush + w.broadcast + Duration::from_secs(2)).as_secs_f64()) as u64;
    promises.push(promise(
        hot_allowed >= HOT_DAILY_LIMIT && overshoot <= bound,
        format!(
            "hot allowed {hot_allowed} for a limit of {HOT_DAILY_LIMIT}: overshoot {overshoot} \
             (expected about others' rate × (flush + broadcast) = {expected:.0}; bound checked: {bound})"
        ),
    ));
    let frozen = matches!((frozen_from, frozen_to), (Some(a), Some(b)) if a == b)
        && acme_frozen_from.is_some()
        && acme_frozen_from == acme_frozen_to;
    promises.push(promise(
        during_cut.allowed > 0 && during_cut.errors == 0 && frozen,
        format!(
            "{CUT_REGION} cut off from Kafka for {} s kept serving ({} allowed, {} errors) while the aggregator \
             heard nothing from it (its part of acme: {} before the cut, {} at the heal)",
            cut_for.as_secs(),
            during_cut.allowed,
            during_cut.errors,
            acme_before.map_or("?".into(), |v| v.to_string()),
            acme_frozen_to.map_or("?".into(), |v| v.to_string()),
        ),
    ));
    let exact = TENANTS
        .iter()
        .all(|t| seen[t] == Some(want[t]) && truth[t] == want[t]);
    promises.push(promise(
        exact && converged.is_some(),
        format!(
            "after the heal the global count is exact for every tenant: aggregator = clients' allowed − refunded \
             = Redis truth ({})",
            converged.map_or("did not converge".into(), |d| format!("converged {:.2} s after the heal", d.as_secs_f64()))
        ),
    ));
    promises.push(promise(
        dead.is_empty(),
        if dead.is_empty() {
            "no process died".to_string()
        } else {
            format!("processes died: {}", dead.join(", "))
        },
    ));
    if fail_mode > 0.0 {
        say(format!(
            "note: {fail_mode} decisions were taken in a fail mode (Redis slower than store_timeout); \
             they are counted under a node actor, not in Redis"
        ));
    }

    println!("\n================================ REPORT ================================");
    println!("\nDecisions the clients saw, per region and tier (allowed / denied by tier):");
    println!(
        "  {:<10} {:>8} {:>9} {:>12} {:>14} {:>14} {:>7}",
        "region", "allowed", "refunded", "denied:node", "denied:region", "denied:global", "errors"
    );
    let mut all = Cell::default();
    for r in REGIONS {
        let c = totals(&tally, None, Some(r));
        all.add(&c);
        println!(
            "  {:<10} {:>8} {:>9} {:>12} {:>14} {:>14} {:>7}",
            r, c.allowed, c.refunded, c.denied_node, c.denied_region, c.denied_global, c.errors
        );
    }
    println!(
        "  {:<10} {:>8} {:>9} {:>12} {:>14} {:>14} {:>7}",
        "all",
        all.allowed,
        all.refunded,
        all.denied_node,
        all.denied_region,
        all.denied_global,
        all.errors
    );
    println!("\nPer tenant and region (allowed / denied):");
    print!("  {:<8}", "tenant");
    for r in REGIONS {
        print!(" {r:>15}");
    }
    println!();
    for t in TENANTS {
        print!("  {t:<8}");
        for r in REGIONS {
            let c = tally.cell(t, r);
            print!(" {:>15}", format!("{} / {}", c.allowed, c.denied()));
        }
        println!();
    }
    println!("\nGlobal count per tenant, today (UTC):");
    println!(
        "  {:<8} {:>8} {:>22} {:>11} {:>12} {:>6}",
        "tenant", "limit", "clients: allowed−ref.", "aggregator", "Redis truth", "exact"
    );
    let limits: BTreeMap<&str, u64> = [
        ("acme", 100_000),
        ("globex", 100_000),
        ("initech", 100_000),
        (BURSTY, 1_000_000),
        (HOT, HOT_DAILY_LIMIT),
    ]
    .into_iter()
    .collect();
    for t in TENANTS {
        let agg = seen[t];
        let ok = agg == Some(want[t]) && truth[t] == want[t];
        println!(
            "  {:<8} {:>8} {:>22} {:>11} {:>12} {:>6}",
            t,
            limits[t],
            want[t],
            agg.map_or("?".into(), |v| v.to_string()),
            truth[t],
            if ok { "yes" } else { "NO" }
        );
    }
    println!("\nTimings:");
    println!(
        "  hot: first global denial → every region denies from the broadcast view: {}",
        crossing_spread.map_or("—".into(), |d| format!("{:.2} s", d.as_secs_f64()))
    );
    println!(
        "  {CUT_REGION}: cut off from Kafka {:.1} s; heal → first {CUT_REGION} delta at the aggregator: {}; \
         heal → global count exact: {}",
        cut_for.as_secs_f64(),
        first_delta_after_heal.map_or("—".into(), |d| format!("{:.2} s", d.as_secs_f64())),
        converged.map_or("did not converge".into(), |d| format!("{:.2} s", d.as_secs_f64()))
    );
    let (slowest, slowest_what) = tally.slowest();
    println!(
        "  slowest answer a client saw: {:.0} ms ({slowest_what})",
        slowest.as_secs_f64() * 1000.0
    );
    println!(
        "  region-node metrics: {fail_mode} fail-mode decisions, {deltas_failed} deltas refused by Kafka"
    );
    println!("\nPromises:");
    for p in &promises {
        println!("  [{}] {}", if p.ok { "PASS" } else { "FAIL" }, p.text);
    }
    if let Some(e) = tally.last_error() {
        println!("\n  last client error: {e}");
    }
    println!("========================================================================");
    let ok = promises.iter().all(|p| p.ok);

    if cli.keep_running {
        VERDICT.store(if ok { 1 } else { 2 }, std::sync::atomic::Ordering::SeqCst);
        say(format!(
            "everything keeps running: dashboard {}/ , config {} ; Ctrl-C to stop",
            w.aggregator,
            w.config.display()
        ));
        std::future::pending::<()>().await;
    }
    Ok(ok)
}
