//! Scenario 2, latency at 50 % of the saturated rate: open loop at half of
//! scenario 1's region-node throughput, latency from the intended send
//! time, region-node's check against the bare `EVALSHA` (same KEYS/ARGV,
//! one redis-rs multiplexed connection) on the same Redis.

use serde::{Deserialize, Serialize};
use testkit::RegionNode;

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::scenario::ceiling::{script_opts, WARMUP};
use crate::world::{metrics_text, Region};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Latency {
    /// Requests/s: half the saturated rate.
    pub rate: u64,
    pub seconds: u64,
    pub warmup: u64,
    pub check: Summary,
    pub evalsha: Summary,
    /// check − EVALSHA, ms.
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    pub added_p99_9_ms: f64,
    /// Service time (sent → answered) check − EVALSHA at p50, ms.
    pub added_service_p50_ms: f64,
    /// region-node's own histograms over the check run: time measured
    /// where it is made, which the two client-side runs above cannot give
    /// (they differ by a process and a TCP hop on 2 shared cores).
    pub server: Option<ServerSide>,
    /// Every load level, 25 % to 90 % of the saturated rate.
    pub levels: Vec<Level>,
}

/// Quantiles of a Prometheus histogram's increase over a run, each the
/// upper bound (`le`) of the bucket it falls in: bounds at the buckets'
/// resolution, not interpolated values.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct BucketQuantiles {
    pub count: u64,
    /// `None`: above the largest finite bucket, or no observation.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub p99_9_ms: Option<f64>,
    /// The lower bound of the bucket the p99 falls in (0 for the first):
    /// the p99 is above it, so a ratio against it is never flattering.
    pub p99_above_ms: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerSide {
    /// `tierlimit_decision_seconds`: one check decided, HTTP excluded.
    pub decision: BucketQuantiles,
    /// `tierlimit_redis_seconds{op="decide"}`: its decision-script call.
    pub redis_call: BucketQuantiles,
    /// `tierlimit_decision_overhead_seconds`: of each check decided by a
    /// script call, its time minus that call's round trip, i.e. what
    /// region-node adds around the call (absent in runs before it existed).
    pub overhead: BucketQuantiles,
}

impl ServerSide {
    /// Issue 37's ratio: the p99 of what region-node adds around its Redis
    /// call over the p99 of that call, each read as a bucket bound on the
    /// side that does not flatter: the overhead's upper bound over the
    /// call's lower bound. `None` when either is unknown.
    pub fn overhead_ratio(&self) -> Option<f64> {
        let above = self.overhead.p99_ms?;
        let call = self.redis_call.p99_above_ms.filter(|c| *c > 0.0)?;
        (self.overhead.count > 0).then_some(above / call)
    }
}

/// The cumulative buckets `(le, count)` of histogram `name` whose labels
/// (besides `le`) include `label`, in the order exposed.
pub fn buckets(text: &str, name: &str, label: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .filter(|l| label.is_empty() || l.contains(label))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once(' ')?;
            let le = labels.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, value.parse().ok()?))
        })
        .collect()
}

/// The quantiles of what was observed between two readings of the same
/// histogram's buckets.
pub fn quantiles(before: &[(f64, f64)], after: &[(f64, f64)]) -> BucketQuantiles {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            let was = before
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0.0, |(_, n)| *n);
            (*le, n - was)
        })
        .collect();
    let total = delta.last().map_or(0.0, |(_, n)| *n);
    let at = |q: f64| -> Option<usize> {
        if total <= 0.0 {
            return None;
        }
        delta.iter().position(|(_, n)| *n >= q * total)
    };
    let q = |q: f64| -> Option<f64> {
        let le = delta[at(q)?].0;
        le.is_finite().then_some(le * 1000.0)
    };
    BucketQuantiles {
        count: total as u64,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        p99_9_ms: q(0.999),
        p99_above_ms: at(0.99).map(|i| i.checked_sub(1).map_or(0.0, |b| delta[b].0 * 1000.0)),
    }
}

/// The fractions of the saturated rate the scenario runs at; the one at
/// 50 % also fills [`Latency`]'s own fields (its first rows, its
/// differences), as before the other levels were added.
pub const LEVELS: [f64; 4] = [0.25, 0.5, 0.75, 0.9];

/// One load level: the check and the bare `EVALSHA` at the same open-loop
/// rate, and region-node's histograms over the check.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Level {
    /// Of the saturated rate (scenario 1's region-node throughput).
    pub fraction: f64,
    pub rate: u64,
    pub check: Summary,
    pub evalsha: Summary,
    pub server: Option<ServerSide>,
}

async fn level(
    run: &Run,
    k: &Knobs,
    fraction: f64,
    saturated: f64,
    solo: &RegionNode,
    eu: &Region,
) -> anyhow::Result<Level> {
    let rate = (saturated * fraction) as u64;
    let pct = (fraction * 100.0).round() as u64;
    let seconds = k.duration * 3;
    let lat = strings([
        "--mode".to_string(),
        "open".into(),
        "--rate".into(),
        rate.to_string(),
        "--connections".into(),
        "64".into(),
        "--tenants".into(),
        k.tenants.to_string(),
        "--duration".into(),
        seconds.to_string(),
        "--warmup".into(),
        WARMUP.to_string(),
    ]);
    let mut a = strings(["--url".to_string(), solo.url("/v1/check")]);
    a.extend(lat.iter().cloned());
    let base = solo.url("");
    let hist = |text: &str| {
        (
            buckets(text, "tierlimit_decision_seconds", ""),
            buckets(text, "tierlimit_redis_seconds", r#"op="decide""#),
            buckets(text, "tierlimit_decision_overhead_seconds", ""),
        )
    };
    let before = hist(&metrics_text(&solo.http, &base).await);
    let check = run.http(&format!("s2_check_{pct}"), &a).await?;
    let after = hist(&metrics_text(&solo.http, &base).await);
    let server = (!after.0.is_empty()).then(|| ServerSide {
        decision: quantiles(&before.0, &after.0),
        redis_call: quantiles(&before.1, &after.1),
        overhead: quantiles(&before.2, &after.2),
    });
    let mut a = strings(["--redis-url".to_string(), eu.redis.url()]);
    a.extend(script_opts());
    a.extend(lat.iter().cloned());
    let evalsha = run.redis(&format!("s2_evalsha_{pct}"), &a).await?;
    Ok(Level {
        fraction,
        rate,
        check,
        evalsha,
        server,
    })
}

pub async fn run(
    run: &Run,
    k: &Knobs,
    saturated: f64,
    solo: &RegionNode,
    eu: &Region,
) -> anyhow::Result<Latency> {
    run.scenario(&format!(
        "2/7 latency at 25, 50, 75 and 90% of saturation ({saturated:.0} req/s), open loop"
    ));
    let mut levels = Vec::new();
    for fraction in LEVELS {
        levels.push(level(run, k, fraction, saturated, solo, eu).await?);
    }
    let half = levels
        .iter()
        .find(|l| l.fraction == 0.5)
        .cloned()
        .unwrap_or_default();
    let lat_of = |s: &Summary, f: fn(&crate::loadgen::Percentiles) -> f64| {
        s.latency_us.as_ref().map(f).unwrap_or(0.0)
    };
    let svc_p50 = |s: &Summary| s.service_us.as_ref().map(|p| p.p50).unwrap_or(0.0);
    let (check, evalsha) = (&half.check, &half.evalsha);
    let l = Latency {
        rate: half.rate,
        seconds: k.duration * 3,
        warmup: WARMUP,
        added_p50_ms: (lat_of(check, |p| p.p50) - lat_of(evalsha, |p| p.p50)) / 1000.0,
        added_p99_ms: (lat_of(check, |p| p.p99) - lat_of(evalsha, |p| p.p99)) / 1000.0,
        added_p99_9_ms: (lat_of(check, |p| p.p99_9) - lat_of(evalsha, |p| p.p99_9)) / 1000.0,
        added_service_p50_ms: (svc_p50(check) - svc_p50(evalsha)) / 1000.0,
        server: half.server.clone(),
        check: half.check.clone(),
        evalsha: half.evalsha.clone(),
        levels,
    };
    run.save("s2_latency", &l)?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_bucket_bounds_of_the_increase() {
        let text = |n: [u64; 4]| {
            format!(
                "tierlimit_redis_seconds_bucket{{op=\"decide\",le=\"0.0005\"}} {}\n\
                 tierlimit_redis_seconds_bucket{{op=\"decide\",le=\"0.001\"}} {}\n\
                 tierlimit_redis_seconds_bucket{{op=\"decide\",le=\"0.0025\"}} {}\n\
                 tierlimit_redis_seconds_bucket{{op=\"decide\",le=\"+Inf\"}} {}\n\
                 tierlimit_redis_seconds_bucket{{op=\"refund\",le=\"+Inf\"}} 7\n",
                n[0], n[1], n[2], n[3]
            )
        };
        let name = "tierlimit_redis_seconds";
        let label = r#"op="decide""#;
        let before = buckets(&text([10, 10, 10, 10]), name, label);
        assert_eq!(before.len(), 4);
        // 1000 more: 900 ≤ 0.5 ms, 95 more ≤ 1 ms, 4 more ≤ 2.5 ms, 1 above.
        let after = buckets(&text([910, 1005, 1009, 1010]), name, label);
        let q = quantiles(&before, &after);
        assert_eq!(q.count, 1000);
        assert_eq!(q.p50_ms, Some(0.5));
        assert_eq!(q.p99_ms, Some(1.0));
        assert_eq!(q.p99_9_ms, Some(2.5));
        assert_eq!(
            q.p99_above_ms,
            Some(0.5),
            "the p99's bucket starts at 0.5 ms"
        );
        let none = quantiles(&after, &after);
        assert_eq!((none.count, none.p99_ms), (0, None));
    }

    #[test]
    fn the_overhead_ratio_reads_both_bounds_against_the_target() {
        let q = |p99: f64, above: f64| BucketQuantiles {
            count: 10,
            p99_ms: Some(p99),
            p99_above_ms: Some(above),
            ..Default::default()
        };
        // Overhead p99 ≤ 0.25 ms, call p99 in (2.5, 3.5] ms: 0.25 / 2.5.
        let s = ServerSide {
            overhead: q(0.25, 0.1),
            redis_call: q(3.5, 2.5),
            ..Default::default()
        };
        assert_eq!(s.overhead_ratio(), Some(0.1));
        // A call p99 in the first bucket has no lower bound: not judged.
        let first = ServerSide {
            redis_call: q(0.1, 0.0),
            ..s.clone()
        };
        assert_eq!(first.overhead_ratio(), None);
        // A run from before the histogram existed: not judged.
        let old = ServerSide {
            overhead: BucketQuantiles::default(),
            ..s
        };
        assert_eq!(old.overhead_ratio(), None);
    }
}
