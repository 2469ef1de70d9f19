//! Scenario 14, calendar periods (issue 33's figures): what a plan with
//! three global tiers (hour, day and month) costs against the same plan
//! with the one UTC-day tier, measured side by side in one stack (one
//! Redis, one region-node, one aggregator, Tansu): `d…` tenants are on the
//! day-only plan, `t…` tenants on the three-tier plan, both with the bench
//! plan's node and region tiers and leases off, so that every check is one
//! script call.
//!
//! - **Populate**: `periods_tenants` tenants of each plan, one check each,
//!   the day plan first: Redis `used_memory` and the aggregator's RSS
//!   growth per tenant once it has merged every counter, and the deltas the
//!   node produced per tenant.
//! - **The script alone**: decide.lua called by `loadgen redis` on a Redis
//!   of its own (nothing else runs there), with the call region-node sends
//!   for each plan, alternating rounds: Redis µs inside `EVALSHA` per call
//!   (`INFO commandstats`: the script's own time, which noise moves least).
//!   Through the node the same counter would mix in the publisher's
//!   `ack.lua` calls, three times as many for three tiers.
//! - **Through the node**: the same open-loop rate over 1 000 tenants of
//!   each plan, alternating rounds: deltas produced per 1 000 decisions
//!   (flush 250 ms; at equal traffic, since a closed loop would give the
//!   slower plan fewer decisions per flush) and Redis CPU per decision
//!   (everything Redis does for it: script, acks, the publisher's reads).
//! - **Restart**: the aggregator is stopped and started again after each
//!   populate: its time to `/readyz` and the deltas it read back, holding
//!   the day tenants only, then both.
//! - **Instructions**: decide.lua's instructions per call for each plan's
//!   call, counted by callgrind (`scripts/script-profile`, a count that the
//!   shared machine's noise does not move): the issue's target is on this
//!   figure; the µs above say what it costs in time.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::world::{self, metric, metric_sum, start_node, RedisConn, Region};

/// Tenants of each plan in the steady rounds.
pub const STEADY_TENANTS: u64 = 1000;
/// Checks/s of each round through the node: well under what either plan
/// sustains on 2 shared cores, so both get the same traffic.
pub const STEADY_RATE: u64 = 4000;
/// The hour and month tiers beside the day's, as loadgen takes them.
const OTHER_PERIODS: &str = "hour:1000000000000,month:1000000000000";
/// Bound on each populate run and on each wait.
pub const BOUND_S: u64 = 300;

/// The two plans' tiers: the bench plan's node and region tiers, and the
/// global tiers under comparison (limits far above what the run spends:
/// every check runs the script's full write path).
pub fn config(redis_url: &str, brokers: &str, tenants: u64) -> String {
    let tiers = |name: &str, global: &str| {
        format!(
            r#"[plans.{name}]
on_store_error = "closed"
lease_max = 0
global = {{ {global} }}
[plans.{name}.node]
limit = 1000000
window = "1s"
algorithm = "fixed_window"
[plans.{name}.region]
limit = 100000000
window = "1m"
algorithm = "sliding_window"
"#
        )
    };
    let mut s = format!(
        r#"# Written by scripts/bench (scenario 14, calendar periods).
cluster = "bench"
[kafka]
brokers = "{brokers}"
partitions = 8
[node]
flush_interval = "250ms"
store_timeout = "500ms"
[aggregator]
broadcast_interval = "250ms"
session_timeout = "30s"
[regions.eu]
redis_url = "{redis_url}"

{day}
{three}
"#,
        day = tiers("day", "limit = 1000000000000"),
        three = tiers(
            "three",
            "hour = 1000000000000, day = 1000000000000, month = 1000000000000"
        ),
    );
    let tenants = tenants.max(STEADY_TENANTS);
    for (prefix, plan) in [("d", "day"), ("t", "three")] {
        for i in 0..tenants {
            s.push_str(&format!("[tenants.{prefix}{i}]\nplan = \"{plan}\"\n"));
        }
    }
    s
}

/// What populating one plan's tenants moved.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Populate {
    pub run: Summary,
    pub redis_b_per_tenant: f64,
    pub agg_b_per_tenant: f64,
    /// Deltas the node produced per tenant (one check each).
    pub deltas_per_tenant: f64,
    /// `tierlimit_aggregator_tracked_counters` growth.
    pub agg_counters: f64,
    /// The aggregator's restart after this populate.
    pub restart_ready_s: Option<f64>,
    /// Deltas it consumed from its start to `/readyz`.
    pub restart_deltas_read: Option<f64>,
}

/// One round of one plan: the script alone, then the node at the same
/// rate for both plans.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Round {
    /// `loadgen redis` on the script's own Redis.
    pub script: Summary,
    pub evalsha: u64,
    pub evalsha_usec: u64,
    pub usec_per_call: f64,
    /// Checks through region-node, open loop at [`STEADY_RATE`].
    pub run: Summary,
    pub deltas: f64,
    pub deltas_per_1000: f64,
    /// The stack's Redis, CPU ticks (1/100 s) over the node's round.
    pub redis_ticks: u64,
    pub redis_cpu_us_per_decision: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Periods {
    pub tenants: u64,
    pub steady_tenants: u64,
    pub day: Populate,
    pub three: Populate,
    pub day_rounds: Vec<Round>,
    pub three_rounds: Vec<Round>,
    /// Medians of the rounds.
    pub day_usec_per_call: f64,
    pub three_usec_per_call: f64,
    pub day_deltas_per_1000: f64,
    pub three_deltas_per_1000: f64,
    pub day_rps: f64,
    pub three_rps: f64,
    pub steady_rate: u64,
    pub day_redis_cpu_us: f64,
    pub three_redis_cpu_us: f64,
    /// three ÷ day.
    pub script_ratio: f64,
    /// decide.lua's instructions per call (callgrind), each plan's call,
    /// and the floor (`return 1` with the day plan's arguments); `None`:
    /// not counted (the run's log says why).
    pub day_instructions: Option<f64>,
    pub three_instructions: Option<f64>,
    pub floor_instructions: Option<f64>,
    /// three ÷ day instructions per call.
    pub instructions_ratio: Option<f64>,
    pub deltas_ratio: f64,
    pub agg_bytes_ratio: f64,
    pub redis_bytes_ratio: f64,
}

struct Stack<'a> {
    run: &'a Run,
    redis: &'a RedisConn,
    redis_pid: u32,
    /// The script's own Redis, for the rounds without the node.
    script_redis: &'a Region,
    node: &'a testkit::RegionNode,
    agg: &'a mut testkit::Aggregator,
}

impl Stack<'_> {
    async fn produced(&self) -> f64 {
        metric(
            &self.node.http,
            &self.node.url(""),
            "tierlimit_deltas_produced_total",
        )
        .await
        .unwrap_or(0.0)
    }

    async fn agg_metric(&self, name: &str) -> f64 {
        metric_sum(&self.agg.http, &self.agg.url(""), name).await
    }

    /// Every charge published, and the aggregator tracking at least
    /// `counters` counters with nothing left to read.
    async fn settled(&self, counters: f64) -> anyhow::Result<()> {
        super::drained(self.redis, "14: the dirty sets to drain", BOUND_S).await;
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(BOUND_S) {
            let tracked = self
                .agg_metric("tierlimit_aggregator_tracked_counters")
                .await;
            let lag = self.agg_metric("tierlimit_aggregator_consumer_lag").await;
            if tracked >= counters && lag == 0.0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        anyhow::bail!("14: the aggregator did not track {counters} counters within {BOUND_S} s")
    }

    /// Populates `n` tenants `<prefix>…` of a plan with `periods` global
    /// tiers, the aggregator holding `held` counters before (after its
    /// restart it must have rebuilt them first, or its growth would count
    /// the rebuild).
    async fn populate(
        &mut self,
        prefix: &str,
        n: u64,
        periods: f64,
        held: f64,
    ) -> anyhow::Result<Populate> {
        let rss = |pid| testkit::rss_kib(pid).unwrap_or(0) as f64 * 1024.0;
        let used = || async { self.redis.info_u64("memory", "used_memory").await };
        self.settled(held).await?;
        let tracked0 = self
            .agg_metric("tierlimit_aggregator_tracked_counters")
            .await;
        let (redis0, agg0, produced0) = (
            used().await?,
            rss(self.agg.proc.pid()),
            self.produced().await,
        );
        let run = self
            .run
            .http(
                &format!("s14_populate_{prefix}"),
                &strings([
                    "--url".to_string(),
                    self.node.url("/v1/check"),
                    "--connections".into(),
                    "50".into(),
                    "--tenants".into(),
                    n.to_string(),
                    "--dist".into(),
                    "seq".into(),
                    "--tenant-prefix".into(),
                    prefix.into(),
                    "--max-requests".into(),
                    n.to_string(),
                    "--duration".into(),
                    BOUND_S.to_string(),
                    "--warmup".into(),
                    "0".into(),
                ]),
            )
            .await?;
        let sent = run.completed_total.max(1) as f64;
        self.settled(tracked0 + sent * periods).await?;
        let (redis1, agg1, produced1) = (
            used().await?,
            rss(self.agg.proc.pid()),
            self.produced().await,
        );
        let tracked1 = self
            .agg_metric("tierlimit_aggregator_tracked_counters")
            .await;
        // The restart, holding what the run wrote so far.
        self.agg.proc.terminate(Duration::from_secs(30));
        let started = Instant::now();
        self.agg.proc.respawn();
        let mut restart_ready_s = None;
        while started.elapsed() < Duration::from_secs(BOUND_S) {
            if let Ok(r) = self.agg.http.get(self.agg.url("/readyz")).send().await {
                if r.status().is_success() {
                    restart_ready_s = Some(started.elapsed().as_secs_f64());
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let restart_deltas_read = match restart_ready_s {
            Some(_) => Some(
                self.agg_metric("tierlimit_aggregator_deltas_consumed_total")
                    .await,
            ),
            None => None,
        };
        Ok(Populate {
            redis_b_per_tenant: (redis1 as f64 - redis0 as f64) / sent,
            agg_b_per_tenant: (agg1 - agg0) / sent,
            deltas_per_tenant: (produced1 - produced0) / sent,
            agg_counters: tracked1 - tracked0,
            restart_ready_s,
            restart_deltas_read,
            run,
        })
    }

    async fn round(&self, prefix: &str, k: &Knobs, i: u64) -> anyhow::Result<Round> {
        // 1. The script alone, with the call the node sends for the plan.
        let mut a = strings([
            "--redis-url".to_string(),
            self.script_redis.redis.url(),
            "--redis-conns".into(),
            k.connections.to_string(),
            "--tenant-prefix".into(),
            prefix.into(),
        ]);
        a.extend(super::ceiling::script_opts());
        if prefix == "t" {
            a.extend(strings(["--global-periods", OTHER_PERIODS]));
        }
        a.extend(crate::loadgen::closed(
            k.connections,
            STEADY_TENANTS,
            k.duration,
            1,
        ));
        let s0 = self.script_redis.conn.counts().await?;
        let script = self
            .run
            .redis(&format!("s14_script_{prefix}_{i}"), &a)
            .await?;
        let sc = self.script_redis.conn.counts().await?.since(s0);
        // 2. Through the node, the same rate for both plans.
        super::drained(self.redis, "14: the dirty sets to drain", BOUND_S).await;
        let ticks = || testkit::cpu_ticks(self.redis_pid).unwrap_or(0);
        let (t0, p0) = (ticks(), self.produced().await);
        let run = self
            .run
            .http(
                &format!("s14_node_{prefix}_{i}"),
                &strings([
                    "--url".to_string(),
                    self.node.url("/v1/check"),
                    "--mode".into(),
                    "open".into(),
                    "--rate".into(),
                    STEADY_RATE.to_string(),
                    "--connections".into(),
                    k.connections.to_string(),
                    "--tenants".into(),
                    STEADY_TENANTS.to_string(),
                    "--tenant-prefix".into(),
                    prefix.into(),
                    "--duration".into(),
                    k.duration.to_string(),
                    "--warmup".into(),
                    "0".into(),
                ]),
            )
            .await?;
        super::drained(
            self.redis,
            "14: the round's deltas to be published",
            BOUND_S,
        )
        .await;
        let redis_ticks = ticks().saturating_sub(t0);
        let deltas = self.produced().await - p0;
        let decisions = run.completed_total.max(1) as f64;
        Ok(Round {
            evalsha: sc.evalsha,
            evalsha_usec: sc.evalsha_usec,
            usec_per_call: sc.evalsha_usec as f64 / sc.evalsha.max(1) as f64,
            script,
            deltas,
            deltas_per_1000: deltas * 1000.0 / decisions,
            redis_ticks,
            redis_cpu_us_per_decision: redis_ticks as f64 * 10_000.0 / decisions,
            run,
        })
    }
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<Periods> {
    let n = k.periods_tenants;
    run.scenario(&format!(
        "14 calendar periods: {n} tenants with one day tier and {n} with hour, day and month tiers; steady rounds over {STEADY_TENANTS} of each"
    ));
    let eu = Region::start(run).await?;
    let tansu = world::start_tansu(run).await;
    let dir = run.tmp.join("periods");
    std::fs::create_dir_all(&dir)?;
    let cfg = testkit::write_config(&dir, &config(&eu.redis.url(), &tansu.brokers(), n));
    run.record(format!("# scenario 14: {}", cfg.display()));
    let script_redis = Region::start(run).await?;
    script_redis.conn.script_load(world::DECIDE_LUA).await?;
    let mut agg = world::start_aggregator(run, &cfg, &[]).await;
    let node = start_node(run, &cfg, "eu", "eu-1", "/readyz", &[]).await;
    let mut stack = Stack {
        run,
        redis: &eu.conn,
        redis_pid: eu.pid(),
        script_redis: &script_redis,
        node: &node,
        agg: &mut agg,
    };
    let day = stack.populate("d", n, 1.0, 0.0).await?;
    let three = stack.populate("t", n, 3.0, day.agg_counters).await?;
    let (mut day_rounds, mut three_rounds) = (Vec::new(), Vec::new());
    for i in 0..k.rounds.max(1) {
        day_rounds.push(stack.round("d", k, i).await?);
        three_rounds.push(stack.round("t", k, i).await?);
    }
    let med = |rs: &[Round], f: fn(&Round) -> f64| super::median(rs.iter().map(f).collect());
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let p = Periods {
        tenants: n,
        steady_tenants: STEADY_TENANTS,
        day_rps: med(&day_rounds, |r| r.script.throughput_rps),
        three_rps: med(&three_rounds, |r| r.script.throughput_rps),
        steady_rate: STEADY_RATE,
        day_redis_cpu_us: med(&day_rounds, |r| r.redis_cpu_us_per_decision),
        three_redis_cpu_us: med(&three_rounds, |r| r.redis_cpu_us_per_decision),
        day_usec_per_call: med(&day_rounds, |r| r.usec_per_call),
        three_usec_per_call: med(&three_rounds, |r| r.usec_per_call),
        day_deltas_per_1000: med(&day_rounds, |r| r.deltas_per_1000),
        three_deltas_per_1000: med(&three_rounds, |r| r.deltas_per_1000),
        agg_bytes_ratio: ratio(three.agg_b_per_tenant, day.agg_b_per_tenant),
        redis_bytes_ratio: ratio(three.redis_b_per_tenant, day.redis_b_per_tenant),
        day,
        three,
        day_rounds,
        three_rounds,
        ..Default::default()
    };
    // Counted with nothing else of this scenario running.
    drop(node);
    drop(agg);
    drop(tansu);
    drop(script_redis);
    drop(eu);
    let (mut day_instructions, mut three_instructions, mut floor_instructions) = (None, None, None);
    for (args, out) in [
        (None, &mut day_instructions),
        (Some(OTHER_PERIODS), &mut three_instructions),
    ] {
        run.record(format!(
            "ROUNDS=0 LOADGEN_ARGS=\"{}\" scripts/script-profile",
            args.map_or(String::new(), |a| format!("--global-periods {a}"))
        ));
        match tokio::task::spawn_blocking(move || instructions(args)).await? {
            Ok((script, floor)) => {
                *out = Some(script);
                if args.is_none() {
                    floor_instructions = Some(floor);
                }
            }
            Err(e) => run.say(&format!(
                "14: counting the script's instructions failed: {e:#}"
            )),
        }
    }
    let p = Periods {
        instructions_ratio: three_instructions
            .zip(day_instructions)
            .map(|(a, b)| ratio(a, b)),
        day_instructions,
        three_instructions,
        floor_instructions,
        script_ratio: ratio(p.three_usec_per_call, p.day_usec_per_call),
        deltas_ratio: ratio(p.three_deltas_per_1000, p.day_deltas_per_1000),
        ..p
    };
    run.say(&format!(
        "14: script {:.2} vs {:.2} µs/call ({:.2}×), deltas {:.1} vs {:.1} per 1000 ({:.2}×), aggregator {:.0} vs {:.0} B/tenant ({:.2}×), Redis {:.0} vs {:.0} B/tenant",
        p.three_usec_per_call,
        p.day_usec_per_call,
        p.script_ratio,
        p.three_deltas_per_1000,
        p.day_deltas_per_1000,
        p.deltas_ratio,
        p.three.agg_b_per_tenant,
        p.day.agg_b_per_tenant,
        p.agg_bytes_ratio,
        p.three.redis_b_per_tenant,
        p.day.redis_b_per_tenant,
    ));
    if let Some(r) = p.instructions_ratio {
        run.say(&format!(
            "14: decide.lua {:.0} vs {:.0} instructions per call ({r:.2}×)",
            p.three_instructions.unwrap_or(0.0),
            p.day_instructions.unwrap_or(0.0)
        ));
    }
    run.save("s14_periods", &p)?;
    Ok(p)
}

/// decide.lua's and the floor's instructions per call, counted by
/// `scripts/script-profile` (callgrind; `ROUNDS=0`: no timed rounds) for the
/// bench plan's call with `periods` as loadgen's `--global-periods`.
fn instructions(periods: Option<&str>) -> anyhow::Result<(f64, f64)> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cmd = Command::new(repo.join("scripts/script-profile"));
    cmd.current_dir(&repo).env("ROUNDS", "0");
    match periods {
        Some(p) => cmd.env("LOADGEN_ARGS", format!("--global-periods {p}")),
        None => cmd.env_remove("LOADGEN_ARGS"),
    };
    let out = cmd.output().context("running scripts/script-profile")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "scripts/script-profile exited with {}: {}{}",
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_instructions(&stdout).with_context(|| format!("no counts in {stdout:?}"))
}

/// (script, floor) from script-profile's `<label> <n> instructions per
/// call` lines, the floor's label starting with `floor`.
fn parse_instructions(text: &str) -> Option<(f64, f64)> {
    let (mut script, mut floor) = (None, None);
    for line in text.lines() {
        let Some(head) = line.strip_suffix(" instructions per call") else {
            continue;
        };
        let n: f64 = head.split_whitespace().next_back()?.parse().ok()?;
        if head.starts_with("floor") {
            floor = Some(n);
        } else {
            script = Some(n);
        }
    }
    Some((script?, floor?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn script_profile_counts_are_read_from_its_output() {
        let out = "floor (return 1, same arguments)                 25387 instructions per call\n\
                   region-node/src/lua/decide.lua                  145011 instructions per call\n";
        assert_eq!(super::parse_instructions(out), Some((145011.0, 25387.0)));
        assert_eq!(super::parse_instructions("nothing\n"), None);
    }

    #[test]
    fn both_plans_and_every_tenant_are_in_a_valid_configuration() {
        // testkit::write_config adds the wire keys when it writes the file.
        let toml = format!(
            "{}\n[wire]\naccept_unsigned = true\n",
            super::config("redis://127.0.0.1:1", "127.0.0.1:1", 5)
        );
        let loaded =
            tierlimit_shared::Config::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
        let day = loaded.policy("d3").expect("d3 is registered");
        let three = loaded.policy("t999").expect("t999 is registered");
        assert_eq!(day.global_tiers().count(), 1, "{day:?}");
        assert_eq!(three.global_tiers().count(), 3, "{three:?}");
        assert_eq!((day.lease_max, three.lease_max), (Some(0), Some(0)));
    }
}
