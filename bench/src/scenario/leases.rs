//! Scenario 9, leases: the same closed loop through two region-nodes of the
//! bench plan, one with leases off (`node.lease_max = 0`: one decision
//! script call per check) and one with the defaults (adaptive leases,
//! `node.lease_max` = [`LEASE_MAX`]), each on a
//! Redis of its own, in alternating rounds, uniform and Zipf (s = 1.1)
//! tenants: decisions/s, CPU per decision of region-node and of Redis, and
//! decision-script calls per decision (`INFO commandstats`). Both variants
//! are measured in the one run, so their ratio is what leases bought.
//!
//! A third node in the same rounds runs the previous release
//! (`testkit/PREVIOUS_RELEASE`, whose defaults had leases off), built in
//! release mode once per commit like scenario 9b's baseline: what a user who
//! upgrades and changes nothing gets. Then [`lease_limit`] measures the
//! defaults near a limit and from idle to a burst.
//!
//! [`lease_limit`]: crate::scenario::lease_limit

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::scenario::baseline;
use crate::scenario::ceiling::WARMUP;
use crate::scenario::lease_limit::{self, Burst, NearLimit};
use crate::scenario::median;
use crate::world::{
    redis_servers, solo_config, start_node, start_node_from, write_config_in, RedisConn,
};

/// Units a lease may take in the `on` variant: `node.lease_max`'s default
/// (the `on` variant runs the defaults; a test checks they agree).
pub const LEASE_MAX: u64 = 256;

/// One throughput round.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Round {
    pub summary: Summary,
    pub node_cpu_us: f64,
    pub redis_cpu_us: f64,
    /// Decision-script calls (EVALSHA) per decision.
    pub calls_per_decision: f64,
}

/// Medians of one variant's rounds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Variant {
    pub rounds: Vec<Round>,
    pub rps: f64,
    pub node_cpu_us: f64,
    pub redis_cpu_us: f64,
    pub calls_per_decision: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LeaseBench {
    pub rounds: u64,
    pub duration: u64,
    pub connections: u64,
    pub tenants: u64,
    pub lease_max: u64,
    pub off: Variant,
    pub on: Variant,
    pub off_zipf: Variant,
    pub on_zipf: Variant,
    /// The previous release's commit, and its defaults in the same rounds.
    pub prev_commit: String,
    pub prev: Variant,
    pub prev_zipf: Variant,
    /// Today's defaults ÷ the previous release's: decisions/s and
    /// (node + Redis CPU per decision), uniform and Zipf.
    pub prev_rps_ratio: f64,
    pub prev_cpu_ratio: f64,
    pub prev_zipf_rps_ratio: f64,
    pub prev_zipf_cpu_ratio: f64,
    /// The defaults near a limit shared by four nodes, and from idle to a
    /// burst (`None`: that part failed, see the run's log).
    pub near_limit: Option<NearLimit>,
    pub burst: Option<Burst>,
    /// on ÷ off.
    pub rps_ratio: f64,
    /// (node + Redis CPU per decision) on ÷ off.
    pub cpu_ratio: f64,
    /// Zipf ÷ uniform, each variant.
    pub off_zipf_ratio: f64,
    pub on_zipf_ratio: f64,
}

/// `Some(0)`: leases off; `None`: the defaults (leases on).
fn config(redis_url: &str, lease_max: Option<u64>) -> String {
    let extra = lease_max.map_or(String::new(), |m| format!("lease_max = {m}"));
    solo_config("9", redis_url, &extra, "")
}

pub fn variant(rounds: Vec<Round>) -> Variant {
    let med = |f: fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    let pct = |f: fn(&Round) -> f64| med(f) / 1000.0;
    Variant {
        rps: med(|r| r.summary.throughput_rps),
        node_cpu_us: med(|r| r.node_cpu_us),
        redis_cpu_us: med(|r| r.redis_cpu_us),
        calls_per_decision: med(|r| r.calls_per_decision),
        p50_ms: pct(|r| r.summary.latency_us.as_ref().map_or(0.0, |p| p.p50)),
        p99_ms: pct(|r| r.summary.latency_us.as_ref().map_or(0.0, |p| p.p99)),
        rounds,
    }
}

/// One closed-loop round against the check at `url`, served by the
/// process `node_pid` on the Redis `redis_pid`.
#[allow(clippy::too_many_arguments)]
pub async fn round(
    run: &Run,
    k: &Knobs,
    name: &str,
    url: &str,
    node_pid: u32,
    redis_pid: u32,
    conn: &RedisConn,
    zipf: bool,
) -> anyhow::Result<Round> {
    let ticks = |p| testkit::cpu_ticks(p).unwrap_or(0);
    let (n0, r0, c0) = (ticks(node_pid), ticks(redis_pid), conn.counts().await?);
    let mut args = strings(["--url".to_string(), url.to_string()]);
    args.extend(crate::loadgen::closed(
        k.connections,
        k.tenants,
        k.duration,
        WARMUP,
    ));
    if zipf {
        args.extend(strings([
            "--dist", "zipf", "--zipf-s", "1.1", "--seed", "2",
        ]));
    }
    let summary = run.http(name, &args).await?;
    let (n1, r1) = (ticks(node_pid), ticks(redis_pid));
    let calls = conn.counts().await?.since(c0).evalsha;
    // Ticks are 1/100 s; the warm-up's requests are in the ticks too.
    let decisions = (summary.throughput_rps * (k.duration + WARMUP) as f64).max(1.0);
    Ok(Round {
        node_cpu_us: (n1 - n0) as f64 * 10_000.0 / decisions,
        redis_cpu_us: (r1 - r0) as f64 * 10_000.0 / decisions,
        calls_per_decision: calls as f64 / decisions,
        summary,
    })
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<LeaseBench> {
    run.scenario(&format!(
        "9 leases: region-node with node.lease_max = 0 and with the defaults (adaptive leases, lease_max = {LEASE_MAX}), uniform and Zipf, beside the previous release's defaults"
    ));
    let prev_rev = testkit::previous_release::commit();
    run.say(&format!(
        "building the previous release's region-node at {} (release, once per commit)",
        &prev_rev[..7]
    ));
    let (prev_commit, prev_bin) =
        tokio::task::spawn_blocking(move || baseline::build(prev_rev)).await??;
    let dir = testkit::temp_dir();
    let (redis, conns) = redis_servers::<3>(run).await?;
    let write = |name: &str, toml: String| write_config_in(dir.path(), name, &toml);
    let cfg_off = write("off", config(&redis[0].url(), Some(0)))?;
    let cfg_on = write("on", config(&redis[1].url(), None))?;
    // The previous release reads today's bench configuration (the upgrade
    // tests run it on the tests' configurations too), with its own defaults.
    let cfg_prev = write("prev", config(&redis[2].url(), None))?;
    run.record(format!("# scenario 9: {}", cfg_on.display()));
    let off = start_node(run, &cfg_off, "eu", "eu-1", "/healthz", &[]).await;
    let on = start_node(run, &cfg_on, "eu", "eu-1", "/healthz", &[]).await;
    run.record("# the previous release's region-node:");
    let prev = start_node_from(run, &prev_bin, &cfg_prev, "eu", "eu-1", &[]).await;
    let nodes = [&off, &on, &prev];
    // [variant][uniform, zipf] → rounds.
    let mut rounds: [[Vec<Round>; 2]; 3] = Default::default();
    for i in 0..k.rounds {
        for (d, zipf) in [false, true].into_iter().enumerate() {
            let tag = if zipf { "zipf" } else { "uniform" };
            for (j, name) in ["off", "on", "prev"].into_iter().enumerate() {
                let r = round(
                    run,
                    k,
                    &format!("s9_{name}_{tag}_{i}"),
                    &nodes[j].url("/v1/check"),
                    nodes[j].proc.pid(),
                    redis[j].proc.pid(),
                    &conns[j],
                    zipf,
                )
                .await?;
                rounds[j][d].push(r);
            }
        }
    }
    let [[r_off, z_off], [r_on, z_on], [r_prev, z_prev]] = rounds;
    let (off_v, on_v) = (variant(r_off), variant(r_on));
    let (off_z, on_z) = (variant(z_off), variant(z_on));
    let (prev_v, prev_z) = (variant(r_prev), variant(z_prev));
    if prev_v.calls_per_decision <= 0.0 {
        anyhow::bail!(
            "9: the previous release answered {} checks/s without one script call: it refused them, see its log",
            prev_v.rps
        );
    }
    drop((off, on, prev));
    let cpu = |v: &Variant| v.node_cpu_us + v.redis_cpu_us;
    let (near_limit, burst) = match lease_limit::run(run, k).await {
        Ok((n, b)) => (Some(n), Some(b)),
        Err(e) => {
            run.say(&format!("9 near the limit failed: {e:#}"));
            (None, None)
        }
    };
    let r = LeaseBench {
        prev_commit,
        prev_rps_ratio: on_v.rps / prev_v.rps.max(1.0),
        prev_cpu_ratio: cpu(&on_v) / cpu(&prev_v).max(0.001),
        prev_zipf_rps_ratio: on_z.rps / prev_z.rps.max(1.0),
        prev_zipf_cpu_ratio: cpu(&on_z) / cpu(&prev_z).max(0.001),
        prev: prev_v,
        prev_zipf: prev_z,
        near_limit,
        burst,
        rounds: k.rounds,
        duration: k.duration,
        connections: k.connections,
        tenants: k.tenants,
        lease_max: LEASE_MAX,
        rps_ratio: on_v.rps / off_v.rps.max(1.0),
        cpu_ratio: (on_v.node_cpu_us + on_v.redis_cpu_us)
            / (off_v.node_cpu_us + off_v.redis_cpu_us).max(0.001),
        off_zipf_ratio: off_z.rps / off_v.rps.max(1.0),
        on_zipf_ratio: on_z.rps / on_v.rps.max(1.0),
        off: off_v,
        on: on_v,
        off_zipf: off_z,
        on_zipf: on_z,
    };
    run.save("s9_leases", &r)?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_on_variant_is_the_default() {
        assert_eq!(
            super::LEASE_MAX,
            tierlimit_shared::config::NodeSettings::default().lease_max
        );
    }
}
