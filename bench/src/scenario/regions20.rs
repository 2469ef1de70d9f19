//! Scenario 6c, regions20: N tenants seen today, 1 % of them near their
//! global limit and active in 20 regions. One real region (`eu`: its
//! Redis, region-node eu-1) and 19 simulated ones (`r01` … `r19`), whose
//! deltas `loadgen deltas` publishes straight to `tierlimit.deltas`, signed
//! with the keys the configuration lists for them. Its own stack (Redis,
//! Tansu, aggregator, region-node), so nothing of the main run's is in the
//! figures.
//!
//! 1. far phase: every far tenant checked once through eu-1 (closed loop,
//!    each once) and, at the same time, one delta from one simulated region
//!    each; then the pipeline drained (eu-1's dirty set empty, the
//!    aggregator holding every far counter).
//! 2. near phase: every near tenant checked once through eu-1, then
//!    `rounds` rounds of deltas from all 19 simulated regions (each round
//!    every part one unit more, the regions together holding 40 % of the
//!    limit) while eu-1 keeps checking them (open loop); then drained
//!    until eu-1's view holds them.
//!
//! 3. restart and catch-up: the aggregator stopped (SIGTERM) and started
//!    again, timed until `/readyz` (it rebuilds every retained counter from
//!    the deltas topic); then a second region-node, eu-2, started fresh and
//!    timed until `/readyz` (its follower reads the global topic).
//!
//! Readings at the start and after each phase: region-node and aggregator
//! RSS, the view, the aggregator's counters and broadcasts, and what
//! `tierlimit.global` carried (read back: every region-node's follower
//! reads all of it).

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{secs, strings, Run};
use crate::topic::{self, Traffic};
use crate::world::{self, metric, metric_sum, start_node, RedisConn, Region};

/// Simulated regions besides the real one.
pub const SIMULATED: usize = 19;
/// Share of tenants near their global limit.
pub const NEAR_FRACTION: f64 = 0.01;
/// The near tenants' daily global limit (the plan of every tenant).
pub const GLOBAL_LIMIT: u64 = 10_000_000;
/// Requests/s eu-1 gets for near tenants during the near phase.
pub const NEAR_CHECK_RATE: u64 = 200;
/// Bounds: the far populate run, and each wait for the pipeline.
pub const POPULATE_BOUND_S: u64 = 240;
pub const PIPELINE_BOUND_S: u64 = 300;
/// Partitions of both topics (`world::start_tansu`).
pub const PARTITIONS: i32 = 8;

/// The simulated regions' names.
pub fn simulated() -> Vec<String> {
    (1..=SIMULATED).map(|i| format!("r{i:02}")).collect()
}

/// (near, far) tenants of `n`: as `loadgen deltas` splits them.
pub fn split(n: u64) -> (u64, u64) {
    let near = ((n as f64) * NEAR_FRACTION).round().max(1.0) as u64;
    let near = near.min(n);
    (near, n - near)
}

/// Region parts the aggregator holds once both phases are merged: a far
/// counter has eu-1's and one simulated region's, a near one all 20.
pub fn parts(near: u64, far: u64) -> (u64, u64) {
    (far * 2, near * (SIMULATED as u64 + 1))
}

/// One reading of both processes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Reading {
    pub at_s: u64,
    pub node_rss_kib: u64,
    pub agg_rss_kib: u64,
    pub view_entries: Option<f64>,
    pub view_age_s: Option<f64>,
    pub node_broadcasts_received: Option<f64>,
    pub node_heartbeats_received: Option<f64>,
    pub node_deltas_produced: Option<f64>,
    pub agg_tracked: Option<f64>,
    pub agg_broadcasts: Option<f64>,
    pub agg_withheld: Option<f64>,
    pub agg_heartbeats: Option<f64>,
    pub agg_deltas_consumed: Option<f64>,
    pub agg_deltas_rejected: f64,
    pub dirty: u64,
    /// End offsets of `tierlimit.global`.
    pub global_offsets: Vec<i64>,
}

/// `loadgen deltas`' summary.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DeltaRun {
    pub phase: String,
    pub tenants: u64,
    pub near: u64,
    pub far: u64,
    pub rounds: u64,
    pub near_p0: u64,
    pub limit: Option<u64>,
    pub broadcast_threshold: u64,
    pub planned: u64,
    pub sent: u64,
    pub delivered: u64,
    pub failed: u64,
    pub bytes: u64,
    pub elapsed_s: f64,
    pub rate_asked: f64,
    pub rate_achieved: f64,
    pub completed: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Regions20 {
    pub tenants: u64,
    pub near: u64,
    pub far: u64,
    pub regions: u64,
    pub rounds: u64,
    pub rate: u64,
    /// `aggregator.broadcast_fraction` of the run (0 broadcasts every
    /// tenant, as before issue 10).
    pub broadcast_fraction: f64,
    pub global_limit: u64,
    pub start: Reading,
    pub after_far: Reading,
    pub after_near: Reading,
    pub far_populate: Summary,
    pub far_deltas: DeltaRun,
    pub near_populate: Summary,
    pub near_checks: Summary,
    pub near_deltas: DeltaRun,
    pub far_s: u64,
    pub near_s: u64,
    /// Whether each phase's pipeline drained within its bound.
    pub far_drained: bool,
    pub near_drained: bool,
    /// What `tierlimit.global` carried during each phase.
    pub global_far: Traffic,
    pub global_near: Traffic,
    // Derived.
    pub global_total: Traffic,
    pub global_bytes_per_s: f64,
    pub global_near_bytes_per_s: f64,
    /// Crude estimate of the bytes had every changed counter been
    /// broadcast: (produced + withheld) × the mean broadcast's size.
    pub all_broadcast_bytes_estimate: Option<f64>,
    pub far_parts: u64,
    pub near_parts: u64,
    /// Aggregator RSS growth per region part: far phase (2-part counters),
    /// near phase (20-part counters), both.
    pub agg_b_per_part_far: f64,
    pub agg_b_per_part_near: f64,
    pub agg_b_per_part: f64,
    pub node_growth_far_kib: i64,
    pub node_growth_near_kib: i64,
    /// Seconds from the aggregator's SIGTERM to its `/readyz` after a
    /// restart against everything the run retained (`None`: not ready
    /// within [`RESTART_BOUND_S`]).
    #[serde(default)]
    pub agg_restart_ready_s: Option<f64>,
    /// Of which the rebuild: from the restarted process' start.
    #[serde(default)]
    pub agg_rebuild_s: Option<f64>,
    /// Seconds from a fresh region-node's start to its `/readyz` (its view
    /// read to the topic's end).
    #[serde(default)]
    pub node_catch_up_s: Option<f64>,
}

/// Bound on each restart measurement.
pub const RESTART_BOUND_S: u64 = 600;

/// Polls `url` every 100 ms until it answers 200; the seconds it took, or
/// `None` past `bound`.
async fn ready_within(http: &reqwest::Client, url: &str, bound: Duration) -> Option<f64> {
    let t = Instant::now();
    while t.elapsed() < bound {
        if let Ok(r) = http.get(url).send().await {
            if r.status().is_success() {
                return Some(t.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The scenario's configuration: region `eu` on `redis_url` and the 19
/// simulated regions (no Redis: only their keys matter, which
/// `testkit::write_config` adds for every region), every tenant under plan
/// `r20` (global limit [`GLOBAL_LIMIT`]) through the newcomer gate, raised.
pub fn config(redis_url: &str, brokers: &str, fraction: Option<f64>) -> String {
    let mut s = format!(
        r#"# Written by scripts/bench (scenario regions20).
cluster = "bench"
[kafka]
brokers = "{brokers}"
partitions = {PARTITIONS}
[node]
flush_interval = "250ms"
store_timeout = "500ms"
[aggregator]
broadcast_interval = "250ms"
# Tansu on SQLite stalls for several seconds under this write load on a
# shared 2-core machine; with the default 6 s the aggregator's group
# session timed out, its partitions were revoked and (Tansu 0.6.0) not
# handed back within minutes. The scenario measures memory and bytes, not
# failover.
session_timeout = "30s"
{fraction}
[regions.eu]
redis_url = "{redis_url}"
"#,
        fraction = fraction.map_or(String::new(), |f| format!("broadcast_fraction = {f}")),
    );
    for r in simulated() {
        s.push_str(&format!(
            "[regions.{r}]\n# Simulated: loadgen deltas publishes its deltas.\nredis_url = \"redis://127.0.0.1:1\"\n"
        ));
    }
    s.push_str(&format!(
        r#"
[plans.r20]
on_store_error = "closed"
global = {{ limit = {GLOBAL_LIMIT} }}
[plans.r20.node]
limit = 1000000
window = "1s"
algorithm = "fixed_window"
[plans.r20.region]
limit = 100000000
window = "1m"
algorithm = "sliding_window"

[unknown_tenants]
policy = "plan"
plan = "r20"
max_new_per_second = 1000000
max_per_day = 100000000
"#
    ));
    s
}

/// A Tansu broker (recorded) with both topics of [`PARTITIONS`]
/// partitions and the broker's default cleanup (delete, 7 days): unlike the
/// main run's compacted topics, nothing the run writes can be compacted
/// away before the scenario reads the global topic back (Tansu compacts in
/// a maintenance pass every 10 minutes, and the 1 M run lasts longer). A
/// follower that keeps up reads every record anyway, compacted or not.
async fn start_tansu(run: &Run) -> testkit::Tansu {
    let tansu = testkit::Tansu::start();
    run.record_spawned(&tansu.proc);
    run.record(format!(
        "# topics tierlimit.deltas and tierlimit.global created on {} with {PARTITIONS} partitions, the broker's default cleanup",
        tansu.brokers()
    ));
    tansu
        .create_topics(&["tierlimit.deltas", "tierlimit.global"], PARTITIONS)
        .await;
    tansu
}

struct Stack<'a> {
    run: &'a Run,
    node: &'a testkit::RegionNode,
    agg: &'a testkit::Aggregator,
    redis: &'a RedisConn,
    brokers: String,
    started: Instant,
}

impl Stack<'_> {
    async fn read(&self) -> anyhow::Result<Reading> {
        let (nb, ab) = (self.node.url(""), self.agg.url(""));
        let http = &self.node.http;
        let brokers = self.brokers.clone();
        let global_offsets = tokio::task::spawn_blocking(move || {
            topic::end_offsets(&brokers, "tierlimit.global", PARTITIONS)
        })
        .await??;
        Ok(Reading {
            at_s: secs(self.started),
            node_rss_kib: testkit::rss_kib(self.node.proc.pid()).unwrap_or(0),
            agg_rss_kib: testkit::rss_kib(self.agg.proc.pid()).unwrap_or(0),
            view_entries: metric(http, &nb, "tierlimit_view_entries").await,
            view_age_s: metric(http, &nb, "tierlimit_view_age_seconds").await,
            node_broadcasts_received: metric(http, &nb, "tierlimit_broadcasts_received_total")
                .await,
            node_heartbeats_received: metric(http, &nb, "tierlimit_heartbeats_received_total")
                .await,
            node_deltas_produced: metric(http, &nb, "tierlimit_deltas_produced_total").await,
            agg_tracked: metric(http, &ab, "tierlimit_aggregator_tracked_counters").await,
            agg_broadcasts: metric(http, &ab, "tierlimit_aggregator_broadcasts_produced_total")
                .await,
            agg_withheld: metric(http, &ab, "tierlimit_aggregator_broadcasts_withheld_total").await,
            agg_heartbeats: metric(http, &ab, "tierlimit_aggregator_heartbeats_produced_total")
                .await,
            agg_deltas_consumed: metric(http, &ab, "tierlimit_aggregator_deltas_consumed_total")
                .await,
            agg_deltas_rejected: metric_sum(
                http,
                &ab,
                "tierlimit_aggregator_deltas_rejected_total",
            )
            .await,
            dirty: self.redis.dirty_total().await?,
            global_offsets,
        })
    }

    /// Polls (every second, up to `bound`) until eu-1's dirty set is empty
    /// and `done` holds of the metrics; whether it did.
    async fn drain(
        &self,
        what: &str,
        bound: Duration,
        done: impl Fn(f64, f64) -> bool,
    ) -> anyhow::Result<bool> {
        let (nb, ab) = (self.node.url(""), self.agg.url(""));
        let http = &self.node.http;
        let deadline = Instant::now() + bound;
        loop {
            let dirty = self.redis.dirty_total().await?;
            let tracked = metric(http, &ab, "tierlimit_aggregator_tracked_counters")
                .await
                .unwrap_or(0.0);
            let view = metric(http, &nb, "tierlimit_view_entries")
                .await
                .unwrap_or(0.0);
            if dirty == 0 && done(tracked, view) {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                self.run.say(&format!(
                    "{what}: not drained within {bound:?} (dirty {dirty}, tracked {tracked}, view {view})"
                ));
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// `loadgen deltas ARGS` (recorded), its summary parsed.
    async fn deltas(&self, name: &str, args: Vec<String>) -> anyhow::Result<DeltaRun> {
        let out = self.run.res.join(format!("{name}.json"));
        let mut all = strings(["deltas", "--out"]);
        all.push(out.display().to_string());
        all.extend(strings(["--label", name]));
        all.extend(args);
        self.run
            .exec(name, &self.run.loadgen, &all, Duration::from_secs(1800))
            .await?;
        let text =
            std::fs::read_to_string(&out).with_context(|| format!("read {}", out.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parse {}", out.display()))
    }
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<Regions20> {
    let n = k.r20_tenants;
    let (near, far) = split(n);
    run.scenario(&format!(
        "6c regions20: {n} tenants, {near} near their global limit in 20 regions (19 simulated), broadcast_fraction {}",
        k.r20_fraction.map_or("0.25 (default)".into(), |f| f.to_string())
    ));
    let eu = Region::start(run).await?;
    let tansu = start_tansu(run).await;
    let dir = run.tmp.join("regions20");
    std::fs::create_dir_all(&dir)?;
    let cfg = testkit::write_config(
        &dir,
        &config(&eu.redis.url(), &tansu.brokers(), k.r20_fraction),
    );
    let mut agg = world::start_aggregator(run, &cfg, &[]).await;
    let node = start_node(run, &cfg, "eu", "eu-1", "/readyz", &[]).await;
    let stack = Stack {
        run,
        node: &node,
        agg: &agg,
        redis: &eu.conn,
        brokers: tansu.brokers(),
        started: Instant::now(),
    };
    let fraction = tierlimit_shared::Config::load(&cfg)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .config
        .aggregator
        .broadcast_fraction;
    let regions = simulated().join(",");
    let common = |phase: &str, rounds: u64| {
        let mut a = strings([
            "--config".to_string(),
            cfg.display().to_string(),
            "--regions".into(),
            regions.clone(),
            "--tenants".into(),
            n.to_string(),
            "--near-fraction".into(),
            NEAR_FRACTION.to_string(),
            "--phase".into(),
            phase.into(),
            "--rounds".into(),
            rounds.to_string(),
            "--rate".into(),
            k.r20_rate.to_string(),
        ]);
        a.extend(strings(["--max-seconds", "600"]));
        a
    };
    let start = stack.read().await?;

    // 1. Far tenants: eu-1 sees each once, one simulated region each.
    let t = Instant::now();
    let populate_args = |prefix: &str, count: u64, bound: u64| {
        strings([
            "--url".to_string(),
            node.url("/v1/check"),
            "--connections".into(),
            k.connections.to_string(),
            "--tenants".into(),
            count.to_string(),
            "--dist".into(),
            "seq".into(),
            "--tenant-prefix".into(),
            prefix.into(),
            "--max-requests".into(),
            count.to_string(),
            "--duration".into(),
            bound.to_string(),
            "--warmup".into(),
            "0".into(),
        ])
    };
    let far_args = populate_args("f", far, POPULATE_BOUND_S);
    let (far_populate, far_deltas) = tokio::join!(
        run.http("r20_far_populate", &far_args),
        stack.deltas("r20_far_deltas", common("far", 1)),
    );
    let (far_populate, far_deltas) = (far_populate?, far_deltas?);
    let far_drained = stack
        .drain(
            "far phase",
            Duration::from_secs(PIPELINE_BOUND_S),
            |tracked, _| tracked >= far as f64,
        )
        .await?;
    let far_s = secs(t);
    let after_far = stack.read().await?;

    // 2. Near tenants: eu-1 sees each once, then 19 simulated regions
    // publish them round after round while eu-1 keeps checking them.
    let t = Instant::now();
    let near_populate = run
        .http("r20_near_populate", &populate_args("n", near, 60))
        .await?;
    let per_round = near * SIMULATED as u64;
    let deltas_s = (per_round * k.r20_rounds) as f64 / k.r20_rate.max(1) as f64;
    let near_check_args = strings([
        "--url".to_string(),
        node.url("/v1/check"),
        "--mode".into(),
        "open".into(),
        "--rate".into(),
        NEAR_CHECK_RATE.to_string(),
        "--connections".into(),
        "8".into(),
        "--tenants".into(),
        near.to_string(),
        "--tenant-prefix".into(),
        "n".into(),
        "--duration".into(),
        format!("{:.0}", deltas_s.ceil().max(5.0)),
        "--warmup".into(),
        "0".into(),
    ]);
    let (near_checks, near_deltas) = tokio::join!(
        run.http("r20_near_checks", &near_check_args),
        stack.deltas("r20_near_deltas", common("near", k.r20_rounds)),
    );
    let (near_checks, near_deltas) = (near_checks?, near_deltas?);
    let near_drained = stack
        .drain(
            "near phase",
            Duration::from_secs(PIPELINE_BOUND_S),
            |tracked, view| tracked >= n as f64 && view >= near as f64,
        )
        .await?;
    let near_s = secs(t);
    let after_near = stack.read().await?;

    // What the global topic carried, read back once.
    let (brokers, from, split_at, to) = (
        stack.brokers.clone(),
        start.global_offsets.clone(),
        after_far.global_offsets.clone(),
        after_near.global_offsets.clone(),
    );
    let (global_far, global_near) = tokio::task::spawn_blocking(move || {
        topic::read_stretches(
            &brokers,
            "tierlimit.global",
            &from,
            &split_at,
            &to,
            Duration::from_secs(300),
        )
    })
    .await??;

    let global_total = global_far.plus(global_near);
    let whole_s = (after_near.at_s - start.at_s).max(1) as f64;
    let (far_parts, near_parts) = parts(near, far);
    let kib = |a: u64, b: u64| b as i64 - a as i64;
    let per_part = |growth_kib: i64, parts: u64| growth_kib as f64 * 1024.0 / parts.max(1) as f64;
    let agg_far = kib(start.agg_rss_kib, after_far.agg_rss_kib);
    let agg_near = kib(after_far.agg_rss_kib, after_near.agg_rss_kib);
    let changed = after_near
        .agg_broadcasts
        .zip(after_near.agg_withheld)
        .map(|(b, w)| {
            b - start.agg_broadcasts.unwrap_or(0.0) + w - start.agg_withheld.unwrap_or(0.0)
        });
    let mean_broadcast =
        global_total.broadcast_bytes as f64 / global_total.broadcasts.max(1) as f64;
    let mut r = Regions20 {
        tenants: n,
        near,
        far,
        regions: SIMULATED as u64 + 1,
        rounds: k.r20_rounds,
        rate: k.r20_rate,
        broadcast_fraction: fraction,
        global_limit: GLOBAL_LIMIT,
        far_populate,
        far_deltas,
        near_populate,
        near_checks,
        near_deltas,
        far_s,
        near_s,
        far_drained,
        near_drained,
        global_far,
        global_near,
        global_total,
        global_bytes_per_s: global_total.bytes as f64 / whole_s,
        global_near_bytes_per_s: global_near.bytes as f64
            / (after_near.at_s - after_far.at_s).max(1) as f64,
        all_broadcast_bytes_estimate: changed
            .filter(|_| global_total.broadcasts > 0)
            .map(|c| c * mean_broadcast),
        far_parts,
        near_parts,
        agg_b_per_part_far: per_part(agg_far, far_parts),
        agg_b_per_part_near: per_part(agg_near, near_parts),
        agg_b_per_part: per_part(agg_far + agg_near, far_parts + near_parts),
        node_growth_far_kib: kib(start.node_rss_kib, after_far.node_rss_kib),
        node_growth_near_kib: kib(after_far.node_rss_kib, after_near.node_rss_kib),
        start,
        after_far,
        after_near,
        agg_restart_ready_s: None,
        agg_rebuild_s: None,
        node_catch_up_s: None,
    };
    // 3. Restart and catch-up, against everything the run retained.
    let stopped = Instant::now();
    agg.proc.terminate(Duration::from_secs(30));
    agg.proc.respawn();
    let bound = Duration::from_secs(RESTART_BOUND_S);
    r.agg_rebuild_s = ready_within(&agg.http, &agg.url("/readyz"), bound).await;
    if r.agg_rebuild_s.is_none() {
        // Where the rebuild stood: its lag and what it consumed.
        let text = world::metrics_text(&agg.http, &agg.url("")).await;
        let progress: Vec<&str> = text
            .lines()
            .filter(|l| {
                !l.starts_with('#')
                    && (l.contains("consumer_lag")
                        || l.contains("deltas_consumed")
                        || l.contains("_ready")
                        || l.contains("tracked_counters"))
            })
            .collect();
        run.say(&format!(
            "6c restart: the aggregator not ready within {bound:?}: {}",
            progress.join("; ")
        ));
    }
    r.agg_restart_ready_s = r.agg_rebuild_s.map(|_| stopped.elapsed().as_secs_f64());
    let fresh = Instant::now();
    let node2 = start_node(run, &cfg, "eu", "eu-2", "/healthz", &[]).await;
    r.node_catch_up_s = ready_within(&node2.http, &node2.url("/readyz"), bound)
        .await
        .map(|_| fresh.elapsed().as_secs_f64());
    run.say(&format!(
        "6c restart: aggregator ready {:?} s after its SIGTERM (rebuild {:?} s); a fresh region-node ready {:?} s after its start",
        r.agg_restart_ready_s, r.agg_rebuild_s, r.node_catch_up_s
    ));
    run.save("r20_regions20", &r)?;
    drop(node2);
    drop(node);
    drop(agg);
    drop(tansu);
    drop(eu);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_percent_near_and_their_parts() {
        assert_eq!(split(100_000), (1_000, 99_000));
        assert_eq!(split(1_000_000), (10_000, 990_000));
        assert_eq!(split(10), (1, 9));
        assert_eq!(parts(1_000, 99_000), (198_000, 20_000));
        assert_eq!(simulated().len(), 19);
        assert_eq!(simulated()[0], "r01");
        assert_eq!(simulated()[18], "r19");
    }

    #[test]
    fn the_config_loads_with_every_region_keyed() {
        for fraction in [None, Some(0.0), Some(0.25)] {
            let text = testkit::with_wire_keys(&config(
                "redis://127.0.0.1:6379",
                "127.0.0.1:9092",
                fraction,
            ));
            let loaded = tierlimit_shared::Config::from_toml(&text)
                .unwrap_or_else(|e| panic!("{e}\n{text}"));
            let c = &loaded.config;
            assert_eq!(c.regions.len(), 20);
            assert_eq!(c.wire.delta_keys.len(), 20);
            assert_eq!(
                c.aggregator.broadcast_fraction,
                fraction.unwrap_or(0.25),
                "{text}"
            );
            // Every tenant, unknown to the configuration, has the limit.
            let p = loaded.policy("n0").expect("unknown tenants have a plan");
            assert_eq!(p.global, Some(GLOBAL_LIMIT));
            // loadgen deltas' near tenants are broadcast from round 0.
            let threshold = c.aggregator.broadcast_threshold(GLOBAL_LIMIT);
            assert!((0.4 * GLOBAL_LIMIT as f64) as u64 >= threshold);
        }
    }
}
