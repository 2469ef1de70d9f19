//! Targets: a figure, a bound and the comparison between them, so that a
//! summary row's "met" is computed by the generator from the figure it
//! prints, never written by hand next to it.

use serde::{Deserialize, Serialize};

use crate::report::num;

/// How the figure must compare with the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    #[default]
    AtMost,
    AtLeast,
    Equal,
}

impl Op {
    pub fn symbol(self) -> &'static str {
        match self {
            Op::AtMost => "≤",
            Op::AtLeast => "≥",
            Op::Equal => "=",
        }
    }
}

/// The outcome of a [`Target`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Met,
    Missed,
    /// The figure is absent: the run did not measure it.
    NotMeasured,
}

/// One target of a summary row.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Target {
    pub name: String,
    /// `None`: not measured.
    pub figure: Option<f64>,
    pub op: Op,
    pub bound: f64,
    /// Printed after the bound (`" ms"`, `"×"`, `" %"`).
    pub unit: String,
}

impl Target {
    pub fn new(name: &str, figure: Option<f64>, op: Op, bound: f64, unit: &str) -> Target {
        Target {
            name: name.into(),
            figure,
            op,
            bound,
            unit: unit.into(),
        }
    }

    /// The figure as measured against the bound, unrounded: a figure
    /// printed as 0.50× may still miss ≤ 0.5×, and then the row says so.
    pub fn verdict(&self) -> Verdict {
        let Some(x) = self.figure.filter(|x| x.is_finite()) else {
            return Verdict::NotMeasured;
        };
        let ok = match self.op {
            Op::AtMost => x <= self.bound,
            Op::AtLeast => x >= self.bound,
            Op::Equal => x == self.bound,
        };
        if ok {
            Verdict::Met
        } else {
            Verdict::Missed
        }
    }

    /// `≤ 0.5 ms`.
    pub fn bound_text(&self) -> String {
        format!("{} {}{}", self.op.symbol(), num(self.bound), self.unit)
    }
}

/// A target as the template sees it: with its verdict and bound text.
#[derive(Debug, Clone, Serialize)]
pub struct Judged {
    #[serde(flatten)]
    pub target: Target,
    pub verdict: Verdict,
    pub bound_text: String,
}

impl From<Target> for Judged {
    fn from(target: Target) -> Judged {
        Judged {
            verdict: target.verdict(),
            bound_text: target.bound_text(),
            target,
        }
    }
}

/// The full run's wall-time budget on 2 cores, s (`scripts/bench`'s header
/// states it): one hour, so that the run can be made once per round on the
/// round's final code.
pub const FULL_BUDGET_S: f64 = 3600.0;
/// The quick profile's: a fresh clone checks the pipeline in a quarter of an
/// hour.
pub const QUICK_BUDGET_S: f64 = 900.0;

/// Every target the summary shows, keyed by the name the template uses,
/// from the scenarios' typed results. A scenario that did not run gives no
/// target (its row is not printed).
pub fn of(r: &crate::report::Results) -> std::collections::BTreeMap<String, Judged> {
    let mut t: Vec<Target> = Vec::new();
    if let Some(c) = &r.ceiling {
        t.push(Target::new(
            "ceiling_ratio",
            Some(c.node.throughput_rps / c.rb_plain.rps),
            Op::AtLeast,
            1.0,
            "×",
        ));
    }
    if let Some(server) = r.latency.as_ref().and_then(|l| l.server.as_ref()) {
        t.push(Target::new(
            "latency_overhead",
            server.overhead_ratio(),
            Op::AtMost,
            0.1,
            "×",
        ));
    }
    if let Some(p) = &r.periods {
        t.push(Target::new(
            "periods_script",
            p.instructions_ratio,
            Op::AtMost,
            1.3,
            "×",
        ));
        t.push(Target::new(
            "periods_deltas",
            Some(p.deltas_ratio),
            Op::AtMost,
            1.2,
            "×",
        ));
        t.push(Target::new(
            "periods_agg_bytes",
            Some(p.agg_bytes_ratio),
            Op::AtMost,
            2.0,
            "×",
        ));
    }
    if let Some(s) = &r.saturation {
        t.push(Target::new(
            "saturation_fail_mode",
            Some(s.admission.fail_mode as f64),
            Op::Equal,
            0.0,
            "",
        ));
    }
    if let Some(k) = &r.kafka {
        t.push(Target::new(
            "kafka_decisions_per_msg",
            Some(k.decisions_per_msg),
            Op::AtLeast,
            1000.0,
            " decisions per message",
        ));
    }
    // Section 5's bound on the time to deny: two flushes (250 ms) and the
    // broadcast's tick, as DESIGN.md derives it.
    let deny_ms = 2.0 * 250.0 + 200.0;
    if let Some(a) = &r.accuracy {
        let acc = a.run.accuracy.as_ref();
        t.push(Target::new(
            "accuracy_overshoot",
            acc.map(|x| x.overshoot_pct),
            Op::AtMost,
            1.0,
            " %",
        ));
        t.push(Target::new(
            "accuracy_deny",
            acc.and_then(|x| x.ms_from_crossing_to_all_denying),
            Op::AtMost,
            deny_ms,
            " ms",
        ));
    }
    if let Some(x) = &r.crossings {
        t.push(Target::new(
            "crossings_deny_p99",
            x.run
                .accuracy
                .as_ref()
                .and_then(|a| a.per_tenant.crossing_to_all_denying_ms.p99),
            Op::AtMost,
            deny_ms,
            " ms",
        ));
    }
    if let Some(roll) = &r.rollover {
        let across = roll
            .growth
            .get("b - a (across the rollover)")
            .and_then(|g| g.as_ref());
        t.push(Target::new(
            "rollover_flat",
            across.map(|g| g.redis_bytes_per_tenant as f64),
            Op::AtMost,
            0.0,
            " B",
        ));
    }
    if let Some(r20) = &r.regions20 {
        t.push(Target::new(
            "r20_node_rss_far",
            Some(r20.after_far.node_rss_kib as f64 / 1024.0),
            Op::AtMost,
            64.0,
            " MiB",
        ));
        t.push(Target::new(
            "r20_agg_b_per_part",
            Some(r20.agg_b_per_part_near),
            Op::AtMost,
            150.0,
            " B",
        ));
    }
    if let Some(f) = &r.flood {
        // README: once the region's day is full, invented ids are refused
        // with nothing charged or written, from the node's copy of the
        // day's set: after that copy they ask Redis nothing and the node
        // holds nothing for them.
        let refused = [&f.invented, &f.again];
        t.push(Target::new(
            "flood_keys_written",
            Some(
                refused
                    .iter()
                    .map(|p| p.keys_after as f64 - p.keys_before as f64 + p.run.allowed as f64)
                    .sum(),
            ),
            Op::Equal,
            0.0,
            "",
        ));
        t.push(Target::new(
            "flood_commands_after_copy",
            Some(f.again.commands_per_id),
            Op::AtMost,
            0.001,
            "",
        ));
        t.push(Target::new(
            "flood_node_bytes_after_copy",
            Some(f.again.node_b_per_id),
            Op::AtMost,
            16.0,
            " B",
        ));
    }
    if let Some(l) = &r.limits {
        t.push(Target::new(
            "limits_node_start",
            l.node_start_ratio,
            Op::AtMost,
            0.5,
            "×",
        ));
        // Every start of a node but its region's first (or one after the
        // region's Redis lost its data) reads the region's copy first and
        // the topic only after its mark: judged apart from the cold start.
        let restart = l
            .node_topic_compared
            .as_ref()
            .and_then(|t| t.restart_s)
            .zip(l.node_file_compared.as_ref().and_then(|f| f.ready_s))
            .map(|(t, f)| t / f);
        t.push(Target::new(
            "limits_node_restart",
            restart,
            Op::AtMost,
            0.5,
            "×",
        ));
        t.push(Target::new(
            "limits_node_bytes",
            l.node_total_b_per_tenant,
            Op::AtMost,
            64.0,
            " B",
        ));
        t.push(Target::new(
            "limits_agg_bytes",
            l.agg_rss_b_per_tenant,
            Op::AtMost,
            64.0,
            " B",
        ));
        // A change everywhere no slower than a crossing everywhere: only
        // judged against the crossings of the same run (same machine, same
        // load).
        let cross = r
            .crossings
            .as_ref()
            .and_then(|x| x.run.accuracy.as_ref())
            .and_then(|a| a.per_tenant.crossing_to_all_denying_ms.p99);
        if let Some(bound) = cross {
            for (name, p) in [
                ("limits_idle_p99", &l.idle),
                ("limits_loaded_p99", &l.loaded),
            ] {
                t.push(Target::new(
                    name,
                    p.as_ref().and_then(|p| p.nodes_ms.p99),
                    Op::AtMost,
                    bound,
                    " ms",
                ));
            }
        }
    }
    if let Some(b) = &r.baseline {
        t.push(Target::new(
            "baseline_cpu_leases",
            Some(b.cpu_ratio_leases),
            Op::AtMost,
            0.5,
            "×",
        ));
        t.push(Target::new(
            "baseline_rps_leases",
            Some(b.rps_ratio_leases),
            Op::AtLeast,
            1.5,
            "×",
        ));
        t.push(Target::new(
            "baseline_cpu",
            Some(b.cpu_ratio),
            Op::AtMost,
            0.5,
            "×",
        ));
        t.push(Target::new(
            "baseline_rps",
            Some(b.rps_ratio),
            Op::AtLeast,
            1.5,
            "×",
        ));
    }
    if let Some(l) = &r.leases {
        // Issue 30: leases on by default make the common case (far from
        // the limits) fast without a knob.
        t.push(Target::new(
            "leases_rps",
            Some(l.rps_ratio),
            Op::AtLeast,
            1.8,
            "×",
        ));
        t.push(Target::new(
            "leases_cpu",
            Some(l.cpu_ratio),
            Op::AtMost,
            0.5,
            "×",
        ));
        t.push(Target::new(
            "leases_zipf",
            Some(l.on_zipf_ratio),
            Op::AtLeast,
            0.95,
            "×",
        ));
        // Near the limit: every whole window fills to 99 % and none passes.
        let near = l.near_limit.as_ref();
        t.push(Target::new(
            "leases_near_min",
            near.map(|n| n.min_fraction * 100.0),
            Op::AtLeast,
            99.0,
            " %",
        ));
        t.push(Target::new(
            "leases_near_over",
            near.map(|n| n.over as f64),
            Op::Equal,
            0.0,
            " windows over",
        ));
    }
    if let Some(e) = &r.envoy {
        t.push(Target::new(
            "envoy_cpu_ratio",
            Some(e.node_cpu_ratio),
            Op::AtMost,
            1.0,
            "×",
        ));
    }
    let bench_runs = r.provenance.measuring_runs();
    if let [run] = bench_runs.as_slice() {
        if run.only.is_empty() && run.kind != Some(crate::results::RunKind::Manual) {
            let budget = match run.profile {
                crate::results::Profile::Full => FULL_BUDGET_S,
                crate::results::Profile::Quick => QUICK_BUDGET_S,
            };
            t.push(Target::new(
                "wall_time",
                run.elapsed_s.map(|s| s as f64),
                Op::AtMost,
                budget,
                " s",
            ));
        }
    }
    t.into_iter()
        .map(|t| (t.name.clone(), Judged::from(t)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_follows_the_unrounded_figure() {
        let t = |x: Option<f64>, op| Target::new("t", x, op, 0.5, "×").verdict();
        assert_eq!(t(Some(0.5), Op::AtMost), Verdict::Met);
        assert_eq!(t(Some(0.503), Op::AtMost), Verdict::Missed);
        assert_eq!(t(Some(0.503), Op::AtLeast), Verdict::Met);
        assert_eq!(t(None, Op::AtLeast), Verdict::NotMeasured);
        assert_eq!(t(Some(f64::NAN), Op::AtLeast), Verdict::NotMeasured);
        assert_eq!(
            Target::new("t", Some(0.0), Op::Equal, 0.0, "").verdict(),
            Verdict::Met
        );
        assert_eq!(
            Target::new("t", None, Op::AtMost, 700.0, " ms").bound_text(),
            "≤ 700 ms"
        );
    }
}
