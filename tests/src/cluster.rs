//! A whole tierlimit deployment on a [`Topology`]: a `core` host running the
//! Tansu broker and the aggregator, and three region hosts (`eu`, `us`,
//! `ap`), each with its own `redis-server` and two region-nodes. Every
//! process runs inside its host's network namespace; the test process (root
//! namespace) drives per-region traffic through the bridge and records a
//! [`History`].
//!
//! Ports are fixed (each host has its own network stack): Kafka 9092 and
//! the aggregator 9100 on core; Redis 6379 and nodes 9000/9001 on each
//! region host.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;
use testkit::tempfile::TempDir;

use crate::history::History;
use crate::topology::Topology;
use crate::{
    bin_path, metric_value, tansu_bin, temp_dir, try_text, write_config, Proc, START_DEADLINE,
};

pub const REGIONS: [&str; 3] = ["eu", "us", "ap"];
pub const NODE_IDS: [&str; 2] = ["a", "b"];
pub const NODE_PORTS: [u16; 2] = [9000, 9001];
/// The nodes' admin listeners (`/metrics`).
pub const NODE_ADMIN_PORTS: [u16; 2] = [9010, 9011];
pub const REDIS_PORT: u16 = 6379;
pub const KAFKA_PORT: u16 = 9092;
pub const AGG_PORT: u16 = 9100;
/// The aggregator's admin listener (`/metrics`, dashboard).
pub const AGG_ADMIN_PORT: u16 = 9110;
pub const PARTITIONS: i32 = 4;
pub const DELTAS: &str = "tierlimit.deltas";
/// `node.flush_interval` of the deployment: how often a node publishes.
pub const FLUSH_INTERVAL_MS: u64 = 100;
/// `aggregator.broadcast_interval`: how often the aggregator broadcasts.
pub const BROADCAST_INTERVAL_MS: u64 = 100;
/// The follower's `fetch.wait.max.ms` (region-node's `follower.rs`): the
/// longest a fetch waits for a broadcast that is already there.
pub const FOLLOWER_FETCH_WAIT_MS: u64 = 50;
pub const GLOBAL: &str = "tierlimit.global";
/// The test's own topic: the sampler's broker probe (see
/// [`Cluster::sample_metrics_and_view`]) times one produce → fetch hop
/// through the real broker with it, beside the system under test.
pub const PROBE: &str = "tierlimit.test.probe";
/// Deadline for convergence and readiness waits.
pub const DEADLINE: Duration = Duration::from_secs(45);

/// The region-node metrics the fault checks watch. `publish_lag_seconds`
/// is derived: sample time minus `tierlimit_last_publish_timestamp_ms` (the
/// wall clock of the last flush Kafka fully acknowledged).
pub const WATCHED: [&str; 6] = [
    "tierlimit_deltas_failed_total",
    "tierlimit_view_age_seconds",
    "tierlimit_dirty_entries",
    "publish_lag_seconds",
    "tierlimit_store_up",
    "tierlimit_epoch_changes_total",
];

/// One test at a time per process: a cluster is 13 processes on 2 cores,
/// and the overshoot bounds assume the machine is not shared with another
/// cluster of the same suite.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A region-node process.
#[derive(Debug)]
pub struct Node {
    pub region: String,
    pub id: String,
    pub proc: Proc,
    /// `http://ip:port`
    pub base: String,
    /// `http://ip:admin_port`: `/metrics`.
    pub admin: String,
}

impl Node {
    /// `region/id`
    pub fn name(&self) -> String {
        format!("{}/{}", self.region, self.id)
    }
}

/// What a test can vary.
#[derive(Debug, Clone)]
pub struct Spec {
    /// `[plans.*]` and `[tenants.*]` tables.
    pub plans: String,
    /// Extra lines of the `[node]` table (e.g. `max_staleness = "1s"`).
    pub node_extra: String,
    /// Extra lines of the `[kafka.client]` table (librdkafka settings).
    pub kafka_extra: String,
    /// `TIERLIMIT__…` overrides every node and the aggregator start with
    /// (a release's settings in a rolling upgrade).
    pub env: Vec<(String, String)>,
    /// The directory every node and the aggregator start from (the
    /// previous release's, [`testkit::previous_release::dir`], in an upgrade
    /// test); `None`: this tree's binaries ([`bin_path`]).
    pub bin_dir: Option<PathBuf>,
    /// Seconds every clock of the deployment that decides anything runs
    /// ahead of the real one (each region's `redis-server`, every node, the
    /// aggregator), under libfaketime ([`testkit::faketime_env`]); 0: the
    /// real clock. Tansu and the test process keep the real clock.
    pub clock_offset_s: i64,
    /// `Some(tables)`: `limits.source = "topic"`, and these `[tenants.*]`
    /// (and `[plans.*]`) tables written to the limits topic with the real
    /// `aggregator limits import` before any process starts (`plans` then
    /// holds the file's plans only). `None`: everything from the file.
    pub limits: Option<String>,
}

/// The limits topic (`Spec::limits`).
pub const LIMITS: &str = "tierlimit.limits";

/// The deployment. Fields drop in order: processes first, then the network.
pub struct Cluster {
    pub aggregators: Vec<Proc>,
    pub nodes: Vec<Node>,
    pub redis: Vec<(String, Proc)>,
    pub tansu: Proc,
    pub topo: Topology,
    pub config: PathBuf,
    pub history: History,
    pub dir: TempDir,
    pub started: Instant,
    /// Keep the log directory when dropped (set by a failing check).
    pub keep_logs: bool,
    pub(crate) http: reqwest::Client,
    /// [`Spec::env`].
    env: Vec<(String, String)>,
    /// Where processes started from now on take their binaries
    /// ([`Spec::bin_dir`]); an upgrade test sets it to `None` before it
    /// restarts each process as this tree's release.
    pub bin_dir: Option<PathBuf>,
    /// [`Spec::clock_offset_s`], in ms.
    pub clock_offset_ms: i64,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

/// Polls `f` until true or `deadline`; panics naming `what`.
pub async fn wait(what: &str, deadline: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    loop {
        if f().await {
            return;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Cluster {
    /// Builds the network, starts every process and waits until every node
    /// and the aggregator are ready.
    pub async fn start(spec: Spec) -> Cluster {
        let serial = SERIAL.lock().await;
        let mut hosts = vec!["core"];
        hosts.extend(REGIONS);
        let topo = Topology::new(&hosts);
        let dir = temp_dir();
        let core = topo.host("core").clone();
        let brokers = core.addr(KAFKA_PORT);

        let mut toml = format!(
            r#"cluster = "partitions"
[kafka]
brokers = "{brokers}"
partitions = {PARTITIONS}
[kafka.client]
"reconnect.backoff.ms" = "50"
"reconnect.backoff.max.ms" = "500"
{kafka_extra}
[node]
flush_interval = "{FLUSH_INTERVAL_MS}ms"
store_timeout = "250ms"
store_retry_interval = "200ms"
# Leases are on by default; these suites check each decision's accounting
# in mode "redis" against the broadcast (a lease counts its units in P when
# charged, not when spent). Leases have their own suites (region_node's
# lease tests, lua_script's, lease.rs' bound).
lease_max = 0
{node_extra}
[aggregator]
broadcast_interval = "{BROADCAST_INTERVAL_MS}ms"
group_id = "tierlimit-aggregator"
session_timeout = "2s"
[unknown_tenants]
policy = "deny"
"#,
            node_extra = spec.node_extra,
            kafka_extra = spec.kafka_extra,
        );
        for r in REGIONS {
            toml += &format!(
                "[regions.{r}]\nredis_url = \"redis://{}/\"\nexpected_nodes = 2\n",
                topo.host(r).addr(REDIS_PORT)
            );
        }
        if spec.limits.is_some() {
            toml += "[limits]\nsource = \"topic\"\nstatus_interval = \"200ms\"\nlag_alert_after = \"2s\"\n";
        }
        toml += &spec.plans;
        let config = write_config(dir.path(), &toml);

        // Broker.
        let tansu_dir = dir.path().join("tansu");
        std::fs::create_dir_all(&tansu_dir).unwrap();
        let tansu = testkit::tansu::broker_args(
            topo.cmd("core", tansu_bin()),
            &brokers,
            "tierlimit-partitions",
            &tansu_dir,
            dir.path().join("tansu.log"),
        )
        .spawn();
        // Redis per region.
        let mut redis = Vec::new();
        for r in REGIONS {
            let rdir = dir.path().join(format!("redis-{r}"));
            std::fs::create_dir_all(&rdir).unwrap();
            let cmd = testkit::redis_server::server_args(
                topo.cmd(r, testkit::redis_server::redis_server_bin()),
                REDIS_PORT,
                "0.0.0.0",
                &rdir,
            )
            .log_file(dir.path().join(format!("redis-{r}.log")));
            let p = faked_clock(cmd, spec.clock_offset_s, true).spawn();
            redis.push((r.to_string(), p));
        }
        let mut cluster = Cluster {
            aggregators: Vec::new(),
            nodes: Vec::new(),
            redis,
            tansu,
            topo,
            config,
            history: History::new(),
            dir,
            started: Instant::now(),
            keep_logs: false,
            http: reqwest::Client::builder()
                .no_proxy()
                .default_headers(testkit::harness_headers())
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
            env: spec.env.clone(),
            bin_dir: spec.bin_dir.clone(),
            clock_offset_ms: spec.clock_offset_s * 1000,
            _serial: serial,
        };
        let b = brokers.clone();
        wait(
            "Tansu answers metadata on the core address",
            START_DEADLINE,
            async || {
                let b = b.clone();
                tokio::task::spawn_blocking(move || testkit::tansu::answers_metadata(&b))
                    .await
                    .unwrap_or(false)
            },
        )
        .await;
        testkit::tansu::create_topics(&brokers, &[DELTAS, GLOBAL], PARTITIONS, &[]).await;
        testkit::tansu::create_topics(&brokers, &[PROBE], 1, &[]).await;
        if let Some(tables) = &spec.limits {
            testkit::tansu::create_topics(&brokers, &[LIMITS], 1, &[("cleanup.policy", "compact")])
                .await;
            cluster.import_limits("initial", tables);
        }
        for r in REGIONS {
            let url = cluster.redis_url(r);
            wait(
                &format!("redis of {r} answers"),
                START_DEADLINE,
                async || ping(&url).await,
            )
            .await;
        }
        cluster.aggregators.push(cluster.aggregator_cmd().spawn());
        for r in REGIONS {
            for i in 0..NODE_IDS.len() {
                let p = cluster.node_cmd(r, i).spawn();
                cluster.nodes.push(Node {
                    region: r.to_string(),
                    id: NODE_IDS[i].to_string(),
                    proc: p,
                    base: format!("http://{}", cluster.topo.host(r).addr(NODE_PORTS[i])),
                    admin: format!("http://{}", cluster.topo.host(r).addr(NODE_ADMIN_PORTS[i])),
                });
            }
        }
        cluster.wait_all_ready().await;
        cluster.started = Instant::now();
        cluster
    }

    /// The binary `name` processes start from now: [`Cluster::bin_dir`]'s,
    /// else this tree's.
    fn bin(&self, name: &str) -> PathBuf {
        match &self.bin_dir {
            Some(dir) => {
                let path = dir.join(name);
                assert!(path.is_file(), "{} does not exist", path.display());
                path
            }
            None => bin_path(name),
        }
    }

    fn aggregator_cmd(&self) -> crate::Cmd {
        let listen = self.topo.host("core").addr(AGG_PORT);
        let admin = self.topo.host("core").addr(AGG_ADMIN_PORT);
        let cmd = with_harness_key(self.topo.cmd("core", self.bin("aggregator")))
            .arg("--config")
            .arg(&self.config)
            .args(["--listen", &listen, "--admin-listen", &admin])
            .env("RUST_LOG", "info")
            .log_file(self.dir.path().join("aggregator.log"));
        let cmd = faked_clock(cmd, self.clock_offset_ms / 1000, false);
        self.env.iter().fold(cmd, |c, (k, v)| c.env(k, v))
    }

    fn node_cmd(&self, region: &str, i: usize) -> crate::Cmd {
        let listen = self.topo.host(region).addr(NODE_PORTS[i]);
        let admin = self.topo.host(region).addr(NODE_ADMIN_PORTS[i]);
        let cmd = with_harness_key(self.topo.cmd(region, self.bin("region-node")))
            .arg("--config")
            .arg(&self.config)
            .args([
                "--region",
                region,
                "--node-id",
                NODE_IDS[i],
                "--listen",
                &listen,
                "--admin-listen",
                &admin,
            ])
            .env(
                "RUST_LOG",
                std::env::var("TIERLIMIT_NODE_LOG").unwrap_or_else(|_| "info".into()),
            )
            .label(format!("region-node[{region}/{}]", NODE_IDS[i]))
            .log_file(
                self.dir
                    .path()
                    .join(format!("node-{region}-{}.log", NODE_IDS[i])),
            );
        let cmd = faked_clock(cmd, self.clock_offset_ms / 1000, false);
        self.env.iter().fold(cmd, |c, (k, v)| c.env(k, v))
    }

    /// The aggregator's admin listener: `/metrics`, the dashboard.
    /// Writes `tables` to the limits topic with the real `aggregator
    /// limits import` (from the test's own namespace, which reaches the
    /// broker's address); returns the last version written.
    pub fn import_limits(&self, name: &str, tables: &str) -> u64 {
        let file = self.dir.path().join(format!("limits-{name}.toml"));
        std::fs::write(&file, tables).unwrap();
        let out = std::process::Command::new(bin_path("aggregator"))
            .args(["limits", "import", "--writer", "partitions", "--config"])
            .arg(&self.config)
            .arg("--file")
            .arg(&file)
            .output()
            .expect("aggregator limits import runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "aggregator limits import failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .rsplit("..=")
            .next()
            .and_then(|v| v.trim().trim_end_matches(')').parse().ok())
            .unwrap_or_else(|| panic!("no versions in {stdout:?}"))
    }

    pub fn agg_admin_url(&self, path: &str) -> String {
        format!(
            "http://{}{path}",
            self.topo.host("core").addr(AGG_ADMIN_PORT)
        )
    }

    pub fn agg_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.topo.host("core").addr(AGG_PORT))
    }

    pub fn redis_url(&self, region: &str) -> String {
        format!("redis://{}/", self.topo.host(region).addr(REDIS_PORT))
    }

    pub fn node(&self, region: &str, id: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.region == region && n.id == id)
            .unwrap_or_else(|| panic!("no node {region}/{id}"))
    }

    pub fn node_mut(&mut self, region: &str, id: &str) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.region == region && n.id == id)
            .unwrap_or_else(|| panic!("no node {region}/{id}"))
    }

    /// Seconds since the cluster was ready (for log lines).
    pub fn t(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    pub fn log(&self, what: &str) {
        println!("[{:7.2}s] {what}", self.t());
    }

    async fn get_status(&self, url: &str) -> Option<u16> {
        self.http
            .get(url)
            .send()
            .await
            .ok()
            .map(|r| r.status().as_u16())
    }

    pub async fn get_json(&self, url: &str) -> Option<Value> {
        crate::try_json(&self.http, url).await
    }

    /// Waits until every node and the aggregator answer `/readyz` 200.
    pub async fn wait_all_ready(&self) {
        for n in &self.nodes {
            let url = format!("{}/readyz", n.base);
            wait(&format!("{} ready", n.name()), DEADLINE, async || {
                self.get_status(&url).await == Some(200)
            })
            .await;
        }
        self.wait_aggregator_ready().await;
    }

    pub async fn wait_aggregator_ready(&self) {
        let url = self.agg_url("/readyz");
        wait("the aggregator ready", DEADLINE, async || {
            self.get_status(&url).await == Some(200)
        })
        .await;
    }

    /// Waits up to `deadline` for `/readyz` 200; the error gives its last answer.
    pub async fn try_wait_node_ready(
        &self,
        region: &str,
        id: &str,
        deadline: Duration,
    ) -> Result<Duration, String> {
        let url = format!("{}/readyz", self.node(region, id).base);
        let start = Instant::now();
        loop {
            let r = self.http.get(&url).send().await;
            let (status, body) = match r {
                Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                Err(e) => (0, e.to_string()),
            };
            if status == 200 {
                return Ok(start.elapsed());
            }
            if start.elapsed() > deadline {
                return Err(format!(
                    "GET /readyz still {status} {body} after {deadline:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn wait_node_ready(&self, region: &str, id: &str) {
        let url = format!("{}/readyz", self.node(region, id).base);
        wait(&format!("{region}/{id} ready"), DEADLINE, async || {
            self.get_status(&url).await == Some(200)
        })
        .await;
    }

    // -----------------------------------------------------------------
    // Faults on processes
    // -----------------------------------------------------------------

    pub fn kill_aggregator(&mut self) {
        self.aggregators[0].kill9();
    }

    /// Starts the aggregator again (same command, same log).
    pub fn restart_aggregator(&mut self) {
        self.aggregators[0].respawn();
    }

    /// The first byte of every record on `topic` (its wire version: `{`
    /// for v1's JSON, 2 for v2), read from the start to the end of each
    /// partition.
    pub async fn first_bytes(&self, topic: &str) -> std::collections::HashSet<u8> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::{Message, Offset, TopicPartitionList};
        let brokers = self.topo.host("core").addr(KAFKA_PORT);
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", "partitions-wire-reader")
                .set("enable.partition.eof", "true")
                .create()
                .expect("a Kafka reader");
            let mut tpl = TopicPartitionList::new();
            for p in 0..PARTITIONS {
                tpl.add_partition_offset(&topic, p, Offset::Beginning)
                    .unwrap();
            }
            reader.assign(&tpl).unwrap();
            let mut firsts = std::collections::HashSet::new();
            let mut eof = std::collections::HashSet::new();
            let start = Instant::now();
            while eof.len() < PARTITIONS as usize {
                assert!(start.elapsed() < DEADLINE, "reading {topic} back");
                match reader.poll(Duration::from_millis(100)) {
                    Some(Ok(m)) => {
                        if let Some(b) = m.payload().and_then(|p| p.first()) {
                            firsts.insert(*b);
                        }
                    }
                    Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                        eof.insert(p);
                    }
                    _ => {}
                }
            }
            firsts
        })
        .await
        .expect("the Kafka reader")
    }

    /// kill -9 the aggregator and start it with `env` added (a new
    /// release's settings), same log.
    pub fn restart_aggregator_with(&mut self, env: &[(&str, &str)]) {
        let cmd = env
            .iter()
            .fold(self.aggregator_cmd(), |c, (k, v)| c.env(k, v));
        self.aggregators[0].kill9();
        self.aggregators[0] = cmd.spawn();
    }

    /// kill -9 `region/id` and start it with `env` added, same log.
    pub fn restart_node_with(&mut self, region: &str, id: &str, env: &[(&str, &str)]) {
        let i = NODE_IDS.iter().position(|n| *n == id).expect("a node id");
        let cmd = env
            .iter()
            .fold(self.node_cmd(region, i), |c, (k, v)| c.env(k, v));
        let node = self.node_mut(region, id);
        node.proc.kill9();
        node.proc = cmd.spawn();
    }

    pub fn kill_node(&mut self, region: &str, id: &str) {
        self.node_mut(region, id).proc.kill9();
    }

    pub fn restart_node(&mut self, region: &str, id: &str) {
        self.node_mut(region, id).proc.respawn();
    }

    /// kill -9 the region's Redis and start it again with no data.
    pub async fn restart_redis_empty(&mut self, region: &str) {
        let url = self.redis_url(region);
        let p = &mut self.redis.iter_mut().find(|(r, _)| r == region).unwrap().1;
        p.kill9();
        p.respawn();
        wait(
            &format!("redis of {region} back"),
            START_DEADLINE,
            async || ping(&url).await,
        )
        .await;
    }

    // -----------------------------------------------------------------
    // Observations
    // -----------------------------------------------------------------

    /// The aggregator's total for `tenant` today, if it owns the tenant's
    /// partition and has rebuilt it.
    pub async fn aggregator_total(&self, tenant: &str) -> Option<u64> {
        let v = self
            .get_json(&self.agg_url(&format!("/v1/global/{tenant}")))
            .await?;
        if v["owned"] == false || v["caught_up"] == false {
            return None;
        }
        v["today"]["total"].as_u64()
    }

    pub async fn aggregator_view(&self, tenant: &str) -> Value {
        self.get_json(&self.agg_url(&format!("/v1/global/{tenant}")))
            .await
            .unwrap_or(Value::Null)
    }

    /// Waits until the aggregator's total for `tenant` is `want`.
    pub async fn wait_global(&self, tenant: &str, want: u64) {
        let start = Instant::now();
        let mut last = None;
        while start.elapsed() < DEADLINE {
            last = self.aggregator_total(tenant).await;
            if last == Some(want) {
                self.log(&format!(
                    "aggregator total of {tenant} = {want} (converged in {:?})",
                    start.elapsed()
                ));
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "aggregator total for {tenant} should converge to {want}, last seen {last:?}; view: {}",
            self.aggregator_view(tenant).await
        );
    }

    /// Today's `(epoch, p, n)` of `tenant` in `region`'s Redis.
    pub async fn redis_counter(&self, region: &str, tenant: &str) -> Option<(String, u64, u64)> {
        let mut con = redis_con(&self.redis_url(region)).await?;
        let key = tierlimit_shared::keys::tenant_hash(tenant);
        let (e, p, n): (Option<String>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(&key)
            .arg(&tierlimit_shared::keys::counter_fields(
                tierlimit_shared::day::today(),
            ))
            .query_async(&mut con)
            .await
            .ok()?;
        Some((e?, p.unwrap_or(0), n.unwrap_or(0)))
    }

    /// The deployment's clock (the real one plus [`Cluster::clock_offset_ms`]),
    /// in µs since the epoch.
    pub fn clock_now_us(&self) -> u64 {
        crate::history::now_us().saturating_add_signed(self.clock_offset_ms * 1000)
    }

    /// `region`'s Redis clock (`TIME`), in ms since the epoch.
    pub async fn redis_time_ms(&self, region: &str) -> Option<u64> {
        let mut con = redis_con(&self.redis_url(region)).await?;
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut con).await.ok()?;
        Some(s * 1000 + us / 1000)
    }

    /// `(p, n)` of `tenant`'s PN counter of `period` in `region`'s Redis
    /// (the current epoch's), `None` when the region holds no counter.
    pub async fn redis_period_counter(
        &self,
        region: &str,
        tenant: &str,
        period: tierlimit_shared::period::Period,
    ) -> Option<(u64, u64)> {
        let mut con = redis_con(&self.redis_url(region)).await?;
        let g = tierlimit_shared::keys::period_prefix(period);
        let (p, n): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(tierlimit_shared::keys::tenant_hash(tenant))
            .arg(format!("{g}p"))
            .arg(format!("{g}n"))
            .query_async(&mut con)
            .await
            .ok()?;
        Some((p?, n.unwrap_or(0)))
    }

    /// The last total the aggregator broadcast for each period of `tenant`
    /// (by [`Period::label`](tierlimit_shared::period::Period::label)), read
    /// from the start of the global topic to its end. Unlike
    /// `GET /v1/global/{tenant}`, which shows the current period of each
    /// kind (and yesterday), this reaches a closed period too.
    pub async fn broadcast_totals(&self, tenant: &str) -> std::collections::BTreeMap<String, u64> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::{Message, Offset, TopicPartitionList};
        let brokers = self.topo.host("core").addr(KAFKA_PORT);
        let tenant = tenant.to_string();
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", "partitions-broadcast-reader")
                .set("enable.partition.eof", "true")
                .create()
                .expect("a Kafka reader");
            let mut tpl = TopicPartitionList::new();
            for p in 0..PARTITIONS {
                tpl.add_partition_offset(GLOBAL, p, Offset::Beginning)
                    .unwrap();
            }
            reader.assign(&tpl).unwrap();
            let mut last = std::collections::BTreeMap::new();
            let mut eof = std::collections::HashSet::new();
            let start = Instant::now();
            while eof.len() < PARTITIONS as usize {
                assert!(start.elapsed() < DEADLINE, "reading {GLOBAL} back");
                match reader.poll(Duration::from_millis(100)) {
                    Some(Ok(m)) => {
                        // Heartbeats and other kinds do not decode as updates.
                        let Some(u) = m.payload().and_then(|b| {
                            tierlimit_shared::wire::codec::decode_global(b)
                                .ok()
                                .map(|f| f.message)
                        }) else {
                            continue;
                        };
                        if u.tenant == tenant {
                            // One key per (tenant, period): one partition,
                            // in order; the last is the newest.
                            last.insert(u.period.label(), u.total);
                        }
                    }
                    Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                        eof.insert(p);
                    }
                    _ => {}
                }
            }
            last
        })
        .await
        .expect("the Kafka reader")
    }

    /// The units the aggregator holds in each of `periods`, over every
    /// tenant, from its dashboard's "Counters per period" table (`None`
    /// for a period it does not list, or no answer).
    pub async fn aggregator_period_units(
        &self,
        periods: &[tierlimit_shared::period::Period],
    ) -> Vec<Option<u64>> {
        let page = try_text(&self.http, &self.agg_admin_url("/"))
            .await
            .unwrap_or_default();
        periods
            .iter()
            .map(|p| {
                let row = page
                    .split(&format!("data-period=\"{}\"", p.label()))
                    .nth(1)?;
                let row = &row[..row.find("</tr>")?];
                let cell = row.rsplit("<td class=\"n\">").next()?;
                let units: String = cell[..cell.find("</td>")?]
                    .chars()
                    .filter(char::is_ascii_digit)
                    .collect();
                units.parse().ok()
            })
            .collect()
    }

    /// Σ over regions of today's P − N in Redis: what the regions charged
    /// (current epochs only).
    pub async fn redis_truth(&self, tenant: &str) -> u64 {
        let mut sum = 0;
        for r in REGIONS {
            if let Some((_, p, n)) = self.redis_counter(r, tenant).await {
                sum += p - n;
            }
        }
        sum
    }

    /// A fixed-window tier state in a region's Redis: (window index, count).
    /// `(window index, count)` of a whole-tenant window tier (`tier_id`,
    /// see `keys`) of `tenant` in `region`'s Redis.
    pub async fn redis_window(
        &self,
        region: &str,
        tenant: &str,
        tier_id: &str,
    ) -> Option<(u64, u64)> {
        let mut con = redis_con(&self.redis_url(region)).await?;
        let (w, c): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(tierlimit_shared::keys::tenant_hash(tenant))
            .arg(&tierlimit_shared::keys::window_fields(tier_id))
            .query_async(&mut con)
            .await
            .ok()?;
        Some((w?, c.unwrap_or(0)))
    }

    /// Sum of every series of `name` in the node's `/metrics`.
    pub async fn node_metric(&self, node: &Node, name: &str) -> Option<f64> {
        let text = self.node_metrics_text(node).await?;
        Some(metric_value(&text, name))
    }

    pub async fn node_metrics_text(&self, node: &Node) -> Option<String> {
        try_text(&self.http, &format!("{}/metrics", node.admin)).await
    }

    pub async fn aggregator_metric(&self, name: &str) -> Option<f64> {
        let text = try_text(&self.http, &self.agg_admin_url("/metrics")).await?;
        Some(metric_value(&text, name))
    }

    /// Every process log that mentions a panic, as "label: line".
    pub fn panics(&self) -> Vec<String> {
        let mut out = Vec::new();
        let procs = self
            .aggregators
            .iter()
            .chain(self.nodes.iter().map(|n| &n.proc))
            .chain(self.redis.iter().map(|(_, p)| p))
            .chain(std::iter::once(&self.tansu));
        for p in procs {
            for line in p.log().lines() {
                if line.contains("panicked") {
                    out.push(format!("{}: {line}", p.label()));
                }
            }
        }
        out
    }

    pub fn assert_no_panics(&self) {
        let p = self.panics();
        assert!(p.is_empty(), "processes panicked:\n{}", p.join("\n"));
    }
}

impl Drop for Cluster {
    /// Keeps the logs of a failed test (or of every test with
    /// `TIERLIMIT_KEEP_LOGS=1`) and says where they are.
    fn drop(&mut self) {
        let keep = self.keep_logs
            || std::env::var_os("TIERLIMIT_KEEP_LOGS").is_some_and(|v| !v.is_empty() && v != "0");
        if keep || std::thread::panicking() {
            let dir = std::mem::replace(&mut self.dir, temp_dir());
            let path = dir.keep();
            eprintln!("cluster: logs kept in {}", path.display());
        }
    }
}

async fn redis_con(url: &str) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url).ok()?;
    tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()
}

async fn ping(url: &str) -> bool {
    let Some(mut c) = redis_con(url).await else {
        return false;
    };
    redis::cmd("PING")
        .query_async::<String>(&mut c)
        .await
        .is_ok()
}

/// `cmd` under libfaketime `offset_s` seconds ahead: a `redis-server` if
/// `redis` ([`testkit::redis_faketime_env`]), else a process using
/// librdkafka ([`testkit::faketime_env_for_librdkafka`]); unchanged for 0.
fn faked_clock(cmd: crate::Cmd, offset_s: i64, redis: bool) -> crate::Cmd {
    if offset_s == 0 {
        return cmd;
    }
    let env = if redis {
        testkit::redis_faketime_env(offset_s)
    } else {
        testkit::faketime_env_for_librdkafka(offset_s)
    };
    env.into_iter().fold(cmd, |c, (k, v)| c.env(k, v))
}

/// A process of the deployment, accepting the harness key
/// ([`testkit::HARNESS_KEY`]) that the cluster's clients send.
fn with_harness_key(cmd: crate::Cmd) -> crate::Cmd {
    testkit::harness_env()
        .into_iter()
        .fold(cmd, |c, (k, v)| c.env(k, v))
}
