//! The processes of the main run and how the bench reads them: the three
//! regions' Redis, the configuration, region-nodes, the Kafka side (Tansu,
//! the aggregator), Redis' own counters and Prometheus metrics.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use redis::aio::MultiplexedConnection;
use testkit::{Aggregator, Redis, RegionNode, Tansu};

use crate::knobs::Knobs;
use crate::run::Run;

/// region-node's own script: what scenario 1 runs alone.
pub const DECIDE_LUA: &str = include_str!("../../region-node/src/lua/decide.lua");

/// A plain Redis connection for reading what the bench measures.
#[derive(Clone)]
pub struct RedisConn {
    pub conn: MultiplexedConnection,
}

impl RedisConn {
    pub async fn open(url: &str) -> anyhow::Result<RedisConn> {
        let conn = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("connect to {url}"))?;
        Ok(RedisConn { conn })
    }

    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> anyhow::Result<T> {
        let mut c = self.conn.clone();
        Ok(cmd.query_async(&mut c).await?)
    }

    /// One `field:value` of `INFO section`, as text.
    pub async fn info_field(&self, section: &str, field: &str) -> anyhow::Result<String> {
        let info: String = self.query(redis::cmd("INFO").arg(section)).await?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .unwrap_or("0")
            .trim()
            .to_string())
    }

    pub async fn info_u64(&self, section: &str, field: &str) -> anyhow::Result<u64> {
        Ok(self.info_field(section, field).await?.parse().unwrap_or(0))
    }

    /// Entries in every bucket's dirty set: what the region has not
    /// published yet.
    pub async fn dirty_total(&self) -> anyhow::Result<u64> {
        let mut sum = 0;
        for key in tierlimit_shared::keys::all_dirty() {
            sum += self.zcard(&key).await?;
        }
        Ok(sum)
    }

    pub async fn zcard(&self, key: &str) -> anyhow::Result<u64> {
        self.query(redis::cmd("ZCARD").arg(key)).await
    }

    pub async fn dbsize(&self) -> anyhow::Result<u64> {
        self.query(&mut redis::cmd("DBSIZE")).await
    }

    pub async fn exists(&self, key: &str) -> anyhow::Result<bool> {
        let n: u64 = self.query(redis::cmd("EXISTS").arg(key)).await?;
        Ok(n > 0)
    }

    /// `MEMORY USAGE key SAMPLES 0`: `None` once the key is gone.
    pub async fn memory_usage(&self, key: &str) -> anyhow::Result<Option<u64>> {
        self.query(
            redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(key)
                .arg("SAMPLES")
                .arg(0),
        )
        .await
    }

    pub async fn script_load(&self, script: &str) -> anyhow::Result<String> {
        self.query(redis::cmd("SCRIPT").arg("LOAD").arg(script))
            .await
    }

    /// Redis' clock (`TIME`), whole seconds.
    pub async fn time(&self) -> anyhow::Result<u64> {
        let (s, _us): (String, String) = self.query(&mut redis::cmd("TIME")).await?;
        Ok(s.parse()?)
    }

    /// Every key matching `pattern`, by `SCAN` (which also deletes the
    /// expired keys it meets).
    pub async fn scan(&self, pattern: &str) -> anyhow::Result<Vec<String>> {
        let mut keys = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = self
                .query(
                    redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(1000),
                )
                .await?;
            keys.extend(batch);
            if next == 0 {
                return Ok(keys);
            }
            cursor = next;
        }
    }

    /// (read system calls that carried commands, EVALSHA calls, µs inside
    /// EVALSHA) from `INFO stats` and `INFO commandstats`.
    pub async fn counts(&self) -> anyhow::Result<RedisCounts> {
        let reads = self.info_u64("stats", "total_reads_processed").await?;
        let stats = self.info_field("commandstats", "cmdstat_evalsha").await?;
        let field = |k: &str| -> u64 {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Ok(RedisCounts {
            reads,
            evalsha: field("calls"),
            evalsha_usec: field("usec"),
        })
    }
}

#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct RedisCounts {
    pub reads: u64,
    pub evalsha: u64,
    pub evalsha_usec: u64,
}

impl RedisCounts {
    pub fn plus(self, other: RedisCounts) -> RedisCounts {
        RedisCounts {
            reads: self.reads + other.reads,
            evalsha: self.evalsha + other.evalsha,
            evalsha_usec: self.evalsha_usec + other.evalsha_usec,
        }
    }

    pub fn since(self, before: RedisCounts) -> RedisCounts {
        RedisCounts {
            reads: self.reads - before.reads,
            evalsha: self.evalsha - before.evalsha,
            evalsha_usec: self.evalsha_usec - before.evalsha_usec,
        }
    }
}

/// A started redis-server and a connection to it.
pub struct Region {
    pub redis: Redis,
    pub conn: RedisConn,
}

impl Region {
    pub async fn start(run: &Run) -> anyhow::Result<Region> {
        let redis = Redis::start();
        run.record_spawned(&redis.proc);
        let conn = RedisConn::open(&redis.url()).await?;
        Ok(Region { redis, conn })
    }

    pub fn pid(&self) -> u32 {
        self.redis.proc.pid()
    }
}

/// The text of `base/metrics`, empty on failure.
pub async fn metrics_text(http: &reqwest::Client, base: &str) -> String {
    match http
        .get(format!("{}/metrics", testkit::admin_base(base)))
        .timeout(Duration::from_secs(10))
        .send()
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// One sample of `base/metrics` (`None` if absent).
pub async fn metric(http: &reqwest::Client, base: &str, sample: &str) -> Option<f64> {
    testkit::metric_sample(&metrics_text(http, base).await, sample)
}

/// The sum over every label set of `name` at `base/metrics` (0 if absent).
pub async fn metric_sum(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    testkit::metric_value(&metrics_text(http, base).await, name)
}

/// Waits until `GET url` answers 200 (`/readyz`: Kafka attached).
pub async fn wait_ok(http: &reqwest::Client, what: &str, url: &str, deadline: Duration) {
    let url = url.to_string();
    testkit::wait_until(what, deadline, || {
        let req = http.get(&url).timeout(Duration::from_secs(2)).send();
        async move { req.await.is_ok_and(|r| r.status().is_success()) }
    })
    .await
}

/// `auth.open_scopes` of the benchmark's region-nodes (loadgen sends no
/// API key; the bench measures the decision path, not authentication).
pub const BENCH_OPEN_SCOPES: (&str, &str) =
    ("TIERLIMIT__AUTH__OPEN_SCOPES", r#"["check", "refund"]"#);

/// A region-node started (recorded) with `env` on top of `RUST_LOG=warn`,
/// and, unless `ready` is `/healthz`, waited for on `ready` too.
pub async fn start_node(
    run: &Run,
    config: &Path,
    region: &str,
    node_id: &str,
    ready: &str,
    env: &[(&str, &str)],
) -> RegionNode {
    let node = start_node_from(
        run,
        &testkit::bin_path("region-node"),
        config,
        region,
        node_id,
        env,
    )
    .await;
    if ready != "/healthz" {
        wait_ok(
            &node.http,
            &format!("region-node {node_id} ready on {ready}"),
            &node.url(ready),
            Duration::from_secs(60),
        )
        .await;
    }
    node
}

/// [`start_node`]'s region-node from the binary `bin` (the previous
/// release's, in scenario 9), ready on `/healthz`, recorded.
pub async fn start_node_from(
    run: &Run,
    bin: &Path,
    config: &Path,
    region: &str,
    node_id: &str,
    env: &[(&str, &str)],
) -> RegionNode {
    // loadgen and redis-free clients send no key: the benchmark's nodes
    // leave check and refund open, as a trusted loopback deployment may.
    let mut all: Vec<(&str, &str)> = vec![("RUST_LOG", "warn"), BENCH_OPEN_SCOPES];
    all.extend_from_slice(env);
    let node = RegionNode::start_from(bin, config, region, node_id, &all).await;
    run.record_spawned(&node.proc);
    node
}

/// `N` Redis servers of their own (recorded), with a connection to each:
/// scenarios 9 and 9b put each node they compare on one.
pub async fn redis_servers<const N: usize>(
    run: &Run,
) -> anyhow::Result<([Redis; N], Vec<RedisConn>)> {
    let redis: [Redis; N] = std::array::from_fn(|_| Redis::start());
    let mut conns = Vec::new();
    for r in &redis {
        run.record_spawned(&r.proc);
        conns.push(RedisConn::open(&r.url()).await?);
    }
    Ok((redis, conns))
}

/// `toml` written as `<dir>/<name>/tierlimit.toml` by
/// `testkit::write_config` (which adds the `[wire]` keys).
pub fn write_config_in(dir: &Path, name: &str, toml: &str) -> anyhow::Result<PathBuf> {
    let d = dir.join(name);
    std::fs::create_dir_all(&d)?;
    Ok(testkit::write_config(&d, toml))
}

/// The aggregator (recorded), ready on `/readyz`.
pub async fn start_aggregator(run: &Run, config: &Path, env: &[(&str, &str)]) -> Aggregator {
    let mut all: Vec<(&str, &str)> = vec![("RUST_LOG", "warn")];
    all.extend_from_slice(env);
    let agg = Aggregator::start_with_env(config, &all).await;
    run.record_spawned(&agg.proc);
    wait_ok(
        &agg.http,
        "the aggregator ready on /readyz",
        &agg.url("/readyz"),
        Duration::from_secs(60),
    )
    .await;
    agg
}

/// A Tansu broker (recorded) with the two compacted topics of 8 partitions.
pub async fn start_tansu(run: &Run) -> Tansu {
    let tansu = Tansu::start();
    run.record_spawned(&tansu.proc);
    run.record(format!(
        "# topics tierlimit.deltas and tierlimit.global created on {} with 8 partitions, cleanup.policy=compact",
        tansu.brokers()
    ));
    tansu
        .create_topics_with_config(
            &["tierlimit.deltas", "tierlimit.global"],
            8,
            &[("cleanup.policy", "compact")],
        )
        .await;
    tansu
}

/// The throughput plan `bench` (scenarios 1, 2, 6, 6b and unknown
/// tenants), its region tier's sliding window `region_window` long.
pub fn bench_plan(region_window: &str) -> String {
    format!(
        r#"# Throughput runs: limits high enough that every check is allowed, so every
# check runs the script's full write path (every tier charged, PN counter,
# dirty mark).
[plans.bench]
on_store_error = "closed"
global = {{ limit = 1000000000000 }}
[plans.bench.node]
limit = 1000000
window = "1s"
algorithm = "fixed_window"
[plans.bench.region]
limit = 100000000
window = "{region_window}"
algorithm = "sliding_window"
"#
    )
}

/// `[node]`'s line for a node whose Kafka is detached: no view will come,
/// so the global tier is decided without one from the start.
pub const VIEW_WAIT_DETACHED: &str = "view_wait = \"0s\"\n";

/// The configuration of a one-region scenario (8, 9, 10): region `eu` on
/// `redis_url`, Kafka detached, the `bench` plan for unknown tenants with
/// the newcomer gate raised (its default, 100 new tenants a second, would
/// refuse most of the first seconds' tenants), `node_extra` added to
/// `[node]` and `rest` at the end.
pub fn solo_config(scenario: &str, redis_url: &str, node_extra: &str, rest: &str) -> String {
    format!(
        r#"# Written by scripts/bench (scenario {scenario}).
cluster = "bench"
[kafka]
brokers = "127.0.0.1:1"
[node]
store_timeout = "500ms"
store_retry_interval = "100ms"
{VIEW_WAIT_DETACHED}{node_extra}
[regions.eu]
redis_url = "{redis_url}"
[unknown_tenants]
policy = "plan"
plan = "bench"
max_new_per_second = 1000000
{plan}{rest}"#,
        plan = bench_plan("60s")
    )
}

/// The configuration of the main run (`$TMP/tierlimit.toml`): three
/// regions, the throughput, accuracy, fast-path and crossings plans, and
/// tenants `x0` … for scenario 5b.
pub fn config(k: &Knobs, brokers: &str, redis: [&Region; 3]) -> String {
    let mut s = format!(
        r#"# Written by scripts/bench.
cluster = "bench"
[kafka]
brokers = "{brokers}"
partitions = 8
[node]
flush_interval = "250ms"
# Generous: a timeout under load would switch decisions to the fail mode
# and the bench would measure that instead.
store_timeout = "500ms"
[aggregator]
broadcast_interval = "250ms"
[regions.eu]
redis_url = "{eu}"
[regions.us]
redis_url = "{us}"
[regions.ap]
redis_url = "{ap}"

{bench_plan}
# Accuracy: the design's daily limit, no other tier in the way.
[plans.daily]
on_store_error = "closed"
global = {{ limit = {acc} }}

# Fast path: a tiny daily limit, quickly exceeded.
[plans.tiny]
on_store_error = "closed"
global = {{ limit = 100 }}

# Many crossings (5b): a small daily limit, no other tier in the way; the
# tenants x0 ... are listed at the end.
[plans.cross]
on_store_error = "closed"
global = {{ limit = {cross} }}

[tenants.acc0]
plan = "daily"
[tenants.over0]
plan = "tiny"

[unknown_tenants]
policy = "plan"
plan = "bench"
# Scenario 6 brings a million new tenants in a few minutes: the newcomer
# gate's defaults (100 new tenants/s, 100 000 a day) would refuse most.
max_new_per_second = 1000000
max_per_day = 100000000
"#,
        eu = redis[0].redis.url(),
        us = redis[1].redis.url(),
        ap = redis[2].redis.url(),
        acc = k.acc_limit,
        cross = k.cross_limit,
        bench_plan = bench_plan("1m"),
    );
    for i in 0..k.cross_tenants {
        s.push_str(&format!("\n[tenants.x{i}]\nplan = \"cross\"\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_region_configs_are_valid() {
        for toml in [
            solo_config("8", "redis://127.0.0.1:1", "", ""),
            solo_config("9", "redis://127.0.0.1:1", "lease_max = 64", ""),
            solo_config(
                "10",
                "redis://127.0.0.1:1",
                "",
                "[[rls.domains]]\ndomain = \"d\"\ntenant_entry = \"tenant\"\n",
            ),
        ] {
            // testkit::write_config adds the wire keys when it writes the file.
            let toml = format!("{toml}\n[wire]\naccept_unsigned = true\n");
            let loaded = tierlimit_shared::Config::from_toml(&toml)
                .unwrap_or_else(|e| panic!("{e}\n{toml}"));
            assert_eq!(loaded.config.unknown_tenants.max_new_per_second, 1_000_000);
        }
    }
}
