//! The runner's options: every `BENCH_*` environment knob of
//! `scripts/bench` (and the `ROLLOVER_*` ones of scenario 6b), also
//! accepted as command-line options.

use std::path::PathBuf;

use clap::Parser;
use serde::{Deserialize, Serialize};

/// The scenarios, in the order they run.
pub const SCENARIOS: &[&str] = &[
    "ceiling",
    "latency",
    "saturation",
    "fast_path",
    "kafka",
    "accuracy",
    "crossings",
    "scale",
    "regions20",
    "flood",
    "periods",
    "limits",
    "rollover",
    "peer",
    "cluster",
    "leases",
    "baseline",
    "envoy",
];

/// Every benchmark scenario of tierlimit on this machine, in one run: its
/// typed results go to benchmarks/results.json, and BENCHMARKS.md is
/// rendered from that file and bench/BENCHMARKS.md.j2, SVG charts in
/// benchmarks/. A partial run (--only, BENCH_ONLY) or a --quick one writes
/// benchmarks/runs/DATE-NAMES.{json,md} instead and leaves BENCHMARKS.md
/// alone.
///
/// Run it through `scripts/bench` (which runs `scripts/setup --bench` and
/// builds the release binaries first). It starts its own redis-servers,
/// Tansu broker, aggregator, region-nodes and throttlecrab-server on
/// loopback ports, drives them with `loadgen`, and
/// stops everything when done. Budget on 2 cores: 60 minutes for the full
/// profile (plus the baseline's one-off build), 15 for --quick.
///
/// Scenarios (BENCHMARKS.md says what each measures):
///   ceiling    1: EVALSHA decide.lua alone (1 and 16 in flight a connection) vs
///                 region-node checks over HTTP, same concurrency
///   latency    2: p50/p99/p99.9 at 25, 50, 75 and 90% of the saturated rate,
///                 region-node's own histograms beside them (runs ceiling)
///   saturation 2b: open loop at 1.5x the saturated rate: fail-mode
///                 decisions, shed requests, caller latency, admission off/on
///   fast_path  3: decisions/s for a tenant the broadcast marked over its limit
///   kafka      4: deltas produced per 1000 allowed decisions
///   accuracy   5: three regions push one tenant past its daily limit
///   crossings 5b: many staggered tenants past a small daily limit
///   scale      6: many distinct tenants: Redis bytes/tenant, RSS
///   regions20 6c: N tenants, 1 % near their global limit in 20 regions
///                 (19 simulated by `loadgen deltas`): region-node and
///                 aggregator RSS, what the node reads from the global topic
///   flood     6d: invented tenant ids fill the newcomer gate's day, then
///                 as many more are refused: RSS, Redis bytes and commands
///                 per id
///   periods   14: hour, day and month tiers vs the day tier alone: the
///                 script's µs and instructions per call, deltas per decision, aggregator
///                 and Redis bytes per tenant, the aggregator's restart
///   limits    13: limits as data: a region-node's and an aggregator's start
///                 and RSS at many tenants on the limits topic vs from the
///                 file; a change applied on every node of 3 regions
///   rollover  6b: the same across a (faked) UTC midnight (libfaketime)
///   peer       7: throttlecrab-server under the same load generator
///                 (its rounds alternate with ceiling's)
///   cluster    8: standalone vs 3-master Redis Cluster; failovers
///   leases     9: node.lease_max = 0 vs the defaults (adaptive leases)
///                 vs the previous release's defaults, uniform and Zipf
///                 tenants; the defaults near a limit over 4 nodes and
///                 from idle to a burst
///   baseline   9b: region-node before the hot-path issue
///                 (BENCH_BASELINE_REV, built once) vs today's, leases off
///                 and on: CPU per decision and decisions/s
///   envoy     10: Envoy without the filter, Envoy + region-node's RLS over
///                 gRPC, region-node's HTTP check: same concurrency
#[derive(Debug, Clone, Parser, Serialize, Deserialize)]
#[command(name = "bench", verbatim_doc_comment)]
pub struct Knobs {
    /// Seconds per throughput run.
    #[arg(long, env = "BENCH_DURATION", default_value_t = 5)]
    pub duration: u64,
    /// Alternating rounds of the compared runs (scenarios 1 and 7).
    #[arg(long, env = "BENCH_ROUNDS", default_value_t = 3)]
    pub rounds: u64,
    /// Connections of the closed-loop runs.
    #[arg(long, env = "BENCH_CONNECTIONS", default_value_t = 50)]
    pub connections: u64,
    /// Tenants of the throughput runs.
    #[arg(long, env = "BENCH_TENANTS", default_value_t = 1000)]
    pub tenants: u64,
    /// Distinct tenants of scenario 6.
    #[arg(long, env = "BENCH_SCALE_TENANTS", default_value_t = 1_000_000)]
    pub scale_tenants: u64,
    /// 6d: invented ids of each phase, and the gate's
    /// `unknown_tenants.max_per_day` (its default, 100 000: the size
    /// README's bounds are stated at).
    #[arg(long, env = "BENCH_FLOOD_TENANTS", default_value_t = 100_000)]
    #[serde(default)]
    pub flood_tenants: u64,
    /// Tenants of scenario 6c (1 % near their global limit, in 20
    /// regions); one size per run.
    #[arg(long, env = "BENCH_R20_TENANTS", default_value_t = 100_000)]
    pub r20_tenants: u64,
    /// 14: tenants of each of the two plans (one day tier; hour, day and
    /// month tiers), one check each, for the bytes per tenant.
    #[arg(long, env = "BENCH_PERIODS_TENANTS", default_value_t = 100_000)]
    #[serde(default)]
    pub periods_tenants: u64,
    /// 6c: rounds of deltas from the 19 simulated regions for the near
    /// tenants (each round one delta per near tenant and region).
    #[arg(long, env = "BENCH_R20_ROUNDS", default_value_t = 3)]
    pub r20_rounds: u64,
    /// 6c: deltas/s the simulated regions publish (all of them together).
    #[arg(long, env = "BENCH_R20_RATE", default_value_t = 3000)]
    pub r20_rate: u64,
    /// 6c: `aggregator.broadcast_fraction` of the run (default: the
    /// configuration's, 0.25); 0 broadcasts every tenant, as before issue
    /// 10, for the comparison of what a region-node reads.
    #[arg(long, env = "BENCH_R20_FRACTION")]
    pub r20_fraction: Option<f64>,
    /// 13: registered tenants of the starts on the limits topic (1 % with
    /// an override), comma-separated; the topic is filled up to each in
    /// turn. Not 3 M by default: that point alone took 28 of a partial
    /// run's 36 minutes (Tansu's SQLite reads 3 M records back in ~10 min,
    /// and each process reads them at start), beyond the full run's
    /// 60-minute budget; `BENCH_ONLY=limits
    /// BENCH_LIMITS_TENANTS=100000,1000000,3000000` measures it.
    #[arg(long, env = "BENCH_LIMITS_TENANTS", value_delimiter = ',',
          default_values_t = [100_000u64, 1_000_000])]
    #[serde(default)]
    pub limits_tenants: Vec<u64>,
    /// 13: the same from the file (`[tenants.<id>]` tables).
    #[arg(long, env = "BENCH_LIMITS_FILE_TENANTS", value_delimiter = ',',
          default_values_t = [100_000u64, 1_000_000])]
    #[serde(default)]
    pub limits_file_tenants: Vec<u64>,
    /// 13: changes watched per propagation phase (idle, then loaded).
    #[arg(long, env = "BENCH_LIMITS_PROBES", default_value_t = 50)]
    #[serde(default)]
    pub limits_probes: u64,
    /// 13: other changes a second during the loaded phase (0: idle only).
    #[arg(long, env = "BENCH_LIMITS_RATE", default_value_t = 1000)]
    #[serde(default)]
    pub limits_rate: u64,
    /// Daily limit of scenario 5's tenant.
    #[arg(long, env = "BENCH_ACC_LIMIT", default_value_t = 100_000)]
    pub acc_limit: u64,
    /// Requests/s over the three regions (scenarios 5 and 5b).
    #[arg(long, env = "BENCH_ACC_RATE", default_value_t = 3000)]
    pub acc_rate: u64,
    /// Tenants crossing their limit one after the other in scenario 5b
    /// (the run lasts about 1.5 s per tenant).
    #[arg(long, env = "BENCH_CROSS_TENANTS", default_value_t = 60)]
    pub cross_tenants: u64,
    /// Their daily limit.
    #[arg(long, env = "BENCH_CROSS_LIMIT", default_value_t = 1500)]
    pub cross_limit: u64,
    /// Distinct tenants per phase of scenario 6b.
    #[arg(long, env = "BENCH_ROLLOVER_TENANTS", default_value_t = 200_000)]
    pub rollover_tenants: u64,
    /// 6b: expected duration of phase A (populate, then publish, merge and
    /// broadcast back); the fake midnight falls this plus the margin after
    /// the faked processes start.
    #[arg(long, env = "ROLLOVER_PHASE_A_SECONDS", default_value_t = 150)]
    pub rollover_phase_a_seconds: u64,
    /// 6b: extra lead before the fake midnight (the stack's start, slack).
    #[arg(long, env = "ROLLOVER_MARGIN_SECONDS", default_value_t = 60)]
    pub rollover_margin_seconds: u64,
    /// 6b: loadgen connections.
    #[arg(long, env = "ROLLOVER_CONNECTIONS", default_value_t = 50)]
    pub rollover_connections: u64,
    /// 6b: bound on each phase's drain wait, seconds.
    #[arg(long, env = "ROLLOVER_DRAIN_SECONDS", default_value_t = 600)]
    pub rollover_drain_seconds: u64,
    /// 6b: 1 also records b_settled, once phase B's window keys expired
    /// (about 2 minutes more); 0 skips it.
    #[arg(long, env = "ROLLOVER_SETTLE", default_value_t = 1)]
    pub rollover_settle: u8,
    /// 6b: 1 passes FAKETIME_NO_CACHE=1 to the faked processes (not needed
    /// with a relative offset).
    #[arg(long, env = "ROLLOVER_FAKETIME_NO_CACHE", default_value_t = 0)]
    pub rollover_faketime_no_cache: u8,
    /// 6b: RUST_LOG of the faked region-node and aggregator.
    #[arg(long, env = "ROLLOVER_LOG", default_value = "warn")]
    pub rollover_log: String,
    /// 9b: the commit whose region-node is "before" (built once into
    /// ~/.cache/tierlimit/baseline).
    #[arg(long, env = "BENCH_BASELINE_REV", default_value = crate::scenario::baseline::DEFAULT_REV)]
    pub baseline_rev: String,
    /// Only these scenarios, comma-separated (names above); `latency` runs
    /// `ceiling` too, whose saturated rate it halves.
    #[arg(long, env = "BENCH_ONLY", value_delimiter = ',')]
    pub only: Vec<String>,
    /// Keep the temporary directory (logs, JSON results); it is always kept
    /// when the run fails.
    #[arg(long, env = "BENCH_KEEP", value_parser = clap::builder::FalseyValueParser::new())]
    pub keep: bool,
    /// The Markdown file a full run rewrites; the charts go to benchmarks/
    /// beside it.
    #[arg(long, env = "BENCH_OUT", default_value = "BENCHMARKS.md")]
    pub out: PathBuf,
    /// The results file a full run rewrites (and `--render` reads); partial
    /// runs write beside it, under runs/.
    #[arg(long, env = "BENCH_RESULTS", default_value = "benchmarks/results.json")]
    pub results: PathBuf,
    /// Every scenario smaller (the quick profile, about a quarter of an
    /// hour): shorter and fewer rounds, fewer tenants. Knobs set explicitly
    /// keep their value. Its results go under runs/, never to
    /// BENCHMARKS.md.
    #[arg(long, env = "BENCH_QUICK", value_parser = clap::builder::FalseyValueParser::new())]
    pub quick: bool,
    /// No run: BENCHMARKS.md rendered again from the results file.
    #[arg(long)]
    #[serde(skip)]
    pub render: bool,
    /// Render the report again from a kept run's directory (no run).
    #[arg(long, env = "BENCH_REPORT_FROM")]
    #[serde(skip)]
    pub report_from: Option<PathBuf>,
    /// Where the release binaries are (region-node, aggregator, loadgen);
    /// default: this executable's directory.
    #[arg(long)]
    #[serde(skip)]
    pub bin_dir: Option<PathBuf>,
}

/// The scenarios that need the Kafka side (Tansu, the aggregator).
pub const KAFKA_SIDE: &[&str] = &["fast_path", "kafka", "accuracy", "crossings", "scale"];

impl Knobs {
    /// The knobs from the command line and the environment, the quick
    /// profile's sizes applied to every knob left at its default.
    pub fn from_env() -> Knobs {
        Knobs::from_matches(&<Knobs as clap::CommandFactory>::command().get_matches())
    }

    fn from_matches(matches: &clap::ArgMatches) -> Knobs {
        use clap::FromArgMatches;
        let mut k = Knobs::from_arg_matches(matches).unwrap_or_else(|e| e.exit());
        if k.quick {
            let default = |id: &str| {
                matches.value_source(id) == Some(clap::parser::ValueSource::DefaultValue)
            };
            k.apply_quick(default);
        }
        k
    }

    /// The quick profile: each scenario a fraction of its full size, so
    /// that every section still runs (and its figures land in the same
    /// typed fields) within the quick budget. `default(id)`: whether knob
    /// `id` was left at its default (only those shrink).
    pub fn apply_quick(&mut self, default: impl Fn(&str) -> bool) {
        let set = |id: &str, field: &mut u64, quick: u64| {
            if default(id) {
                *field = quick;
            }
        };
        set("duration", &mut self.duration, 2);
        set("rounds", &mut self.rounds, 1);
        set("scale_tenants", &mut self.scale_tenants, 100_000);
        set("r20_tenants", &mut self.r20_tenants, 20_000);
        set("flood_tenants", &mut self.flood_tenants, 20_000);
        set("periods_tenants", &mut self.periods_tenants, 20_000);
        set("r20_rounds", &mut self.r20_rounds, 1);
        set("acc_limit", &mut self.acc_limit, 30_000);
        set("cross_tenants", &mut self.cross_tenants, 20);
        set("rollover_tenants", &mut self.rollover_tenants, 20_000);
        set("limits_probes", &mut self.limits_probes, 10);
        if default("limits_tenants") {
            self.limits_tenants = vec![100_000];
        }
        if default("limits_file_tenants") {
            self.limits_file_tenants = vec![100_000];
        }
        set(
            "rollover_phase_a_seconds",
            &mut self.rollover_phase_a_seconds,
            45,
        );
        set(
            "rollover_margin_seconds",
            &mut self.rollover_margin_seconds,
            30,
        );
        set(
            "rollover_drain_seconds",
            &mut self.rollover_drain_seconds,
            180,
        );
        if default("rollover_settle") {
            self.rollover_settle = 0;
        }
    }

    pub fn profile(&self) -> crate::results::Profile {
        if self.quick {
            crate::results::Profile::Quick
        } else {
            crate::results::Profile::Full
        }
    }

    /// Whether scenario `name` runs.
    pub fn runs(&self, name: &str) -> bool {
        self.only.is_empty()
            || self.only.iter().any(|o| o == name)
            || (name == "ceiling" && self.only.iter().any(|o| o == "latency" || o == "peer"))
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        for o in &self.only {
            anyhow::ensure!(
                SCENARIOS.contains(&o.as_str()),
                "unknown scenario {o:?} (one of {})",
                SCENARIOS.join(", ")
            );
        }
        anyhow::ensure!(self.rounds >= 1, "BENCH_ROUNDS must be at least 1");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn knobs(args: &[&str]) -> Knobs {
        let matches = <Knobs as clap::CommandFactory>::command().get_matches_from(args);
        Knobs::from_matches(&matches)
    }

    #[test]
    fn the_quick_profile_shrinks_only_the_knobs_left_at_their_default() {
        let full = knobs(&["bench"]);
        assert_eq!((full.duration, full.rounds, full.quick), (5, 3, false));
        let quick = knobs(&["bench", "--quick", "--duration", "7"]);
        assert_eq!(quick.profile(), crate::results::Profile::Quick);
        assert_eq!(quick.duration, 7, "set explicitly: kept");
        assert_eq!(quick.rounds, 1);
        assert_eq!(quick.scale_tenants, 100_000);
        assert_eq!(quick.rollover_settle, 0);
        assert_eq!(full.limits_tenants, [100_000, 1_000_000]);
        assert_eq!(quick.limits_tenants, [100_000]);
        let some = knobs(&["bench", "--quick", "--limits-tenants", "1000,2000"]);
        assert_eq!(some.limits_tenants, [1000, 2000]);
    }
}
