//! Scenario 6d, flood: a caller inventing tenant ids against the newcomer
//! gate at its default day (`unknown_tenants.max_per_day` = 100 000), so
//! that README's bounds are figures of a run rather than of a table's
//! capacity. One region-node on a Redis of its own, Kafka detached (as in
//! scenarios 8–10): first `max_per_day` distinct unknown ids, each checked
//! once (all admitted: the rate gate is raised so that the day, not the
//! second, is what the flood meets), then as many again that the full day
//! must refuse. Per id of each phase: region-node RSS growth, Redis
//! `used_memory` growth, keys and commands; what the refused ids charged
//! (nothing, by design) is a target of the summary.

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::world::{metric, solo_config, start_node, RedisConn};

/// The populate runs are bounded in time (the report says so when a run
/// stopped short).
pub const PHASE_BOUND_S: u64 = 240;

/// What one phase moved.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Phase {
    pub run: Summary,
    pub node_rss_kib_before: u64,
    pub node_rss_kib_after: u64,
    pub redis_used_before: u64,
    pub redis_used_after: u64,
    pub keys_before: u64,
    pub keys_after: u64,
    /// Redis `total_commands_processed` during the phase (this bench's own
    /// `INFO` calls, a handful, counted in).
    pub commands: u64,
    /// `tierlimit_newcomers_cached` at the phase's end.
    pub cached: Option<f64>,
    /// Derived, per id the phase sent.
    pub node_b_per_id: f64,
    pub redis_b_per_id: f64,
    pub commands_per_id: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Flood {
    pub max_per_day: u64,
    pub connections: u64,
    /// The first `max_per_day` ids: admitted.
    pub admitted: Phase,
    /// As many again once the day is full: refused.
    pub invented: Phase,
    /// As many others again: what refusals cost once the process has
    /// warmed to the refusing load (a growth per id here would be memory
    /// that invented ids hold).
    pub again: Phase,
    /// `tierlimit_newcomers_total` by outcome at the end.
    pub outcome_admitted: Option<f64>,
    pub outcome_refused_day: Option<f64>,
    pub outcome_refused_rate: Option<f64>,
}

/// The solo configuration (which raises the rate gate to a million a
/// second) with the gate's day at `day`.
fn config(redis_url: &str, day: u64) -> String {
    solo_config("6d", redis_url, "", "").replace(
        "max_new_per_second = 1000000\n",
        &format!("max_new_per_second = 1000000\nmax_per_day = {day}\n"),
    )
}

/// One phase: `ids` distinct tenants `<prefix>0…`, one check each.
async fn phase(
    run: &Run,
    k: &Knobs,
    name: &str,
    node: &testkit::RegionNode,
    conn: &RedisConn,
    prefix: &str,
    ids: u64,
) -> anyhow::Result<Phase> {
    let (url, admin) = (node.url("/v1/check"), node.url(""));
    let rss = || testkit::rss_kib(node.proc.pid()).unwrap_or(0);
    let used = || async { conn.info_u64("memory", "used_memory").await };
    let commands = || async { conn.info_u64("stats", "total_commands_processed").await };
    let (node_rss_kib_before, redis_used_before, keys_before, c0) = (
        rss(),
        used().await?,
        conn.dbsize().await?,
        commands().await?,
    );
    let summary = run
        .http(
            name,
            &strings([
                "--url".to_string(),
                url.to_string(),
                "--connections".into(),
                k.connections.to_string(),
                "--tenants".into(),
                ids.to_string(),
                "--dist".into(),
                "seq".into(),
                "--tenant-prefix".into(),
                prefix.into(),
                "--max-requests".into(),
                ids.to_string(),
                "--duration".into(),
                PHASE_BOUND_S.to_string(),
                "--warmup".into(),
                "0".into(),
            ]),
        )
        .await?;
    let c1 = commands().await?;
    let (node_rss_kib_after, redis_used_after, keys_after) =
        (rss(), used().await?, conn.dbsize().await?);
    let sent = summary.completed_total.max(1) as f64;
    Ok(Phase {
        node_rss_kib_before,
        node_rss_kib_after,
        redis_used_before,
        redis_used_after,
        keys_before,
        keys_after,
        commands: c1.saturating_sub(c0),
        cached: metric(&node.http, &admin, "tierlimit_newcomers_cached").await,
        node_b_per_id: (node_rss_kib_after as f64 - node_rss_kib_before as f64) * 1024.0 / sent,
        redis_b_per_id: (redis_used_after as f64 - redis_used_before as f64) / sent,
        commands_per_id: c1.saturating_sub(c0) as f64 / sent,
        run: summary,
    })
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<Flood> {
    let day = k.flood_tenants;
    run.scenario(&format!(
        "6d flood: {day} invented tenant ids fill the newcomer gate's day (max_per_day = {day}), then {day} more are refused"
    ));
    let dir = testkit::temp_dir();
    let redis = testkit::Redis::start();
    run.record_spawned(&redis.proc);
    let conn = RedisConn::open(&redis.url()).await?;
    let cfg = testkit::write_config(dir.path(), &config(&redis.url(), day));
    run.record(format!("# scenario 6d: {}", cfg.display()));
    let node = start_node(run, &cfg, "eu", "eu-1", "/healthz", &[]).await;
    let admitted = phase(run, k, "s6d_admitted", &node, &conn, "n", day).await?;
    let invented = phase(run, k, "s6d_invented", &node, &conn, "v", day).await?;
    let again = phase(run, k, "s6d_again", &node, &conn, "w", day).await?;
    let admin = node.url("");
    let text = crate::world::metrics_text(&node.http, &admin).await;
    let outcome = |o: &str| {
        testkit::metric_sample(
            &text,
            &format!("tierlimit_newcomers_total{{outcome=\"{o}\"}}"),
        )
    };
    let f = Flood {
        max_per_day: day,
        connections: k.connections,
        outcome_admitted: outcome("admitted"),
        outcome_refused_day: outcome("refused_day"),
        outcome_refused_rate: outcome("refused_rate"),
        admitted,
        invented,
        again,
    };
    run.save("s6d_flood", &f)?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_gate_keeps_its_raised_rate_and_gets_the_runs_day() {
        // testkit::write_config adds the wire keys when it writes the file.
        let toml = format!(
            "{}\n[wire]\naccept_unsigned = true\n",
            super::config("redis://127.0.0.1:1", 12_345)
        );
        let loaded =
            tierlimit_shared::Config::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
        let gate = &loaded.config.unknown_tenants;
        assert_eq!(
            (gate.max_new_per_second, gate.max_per_day),
            (1_000_000, 12_345)
        );
    }
}
