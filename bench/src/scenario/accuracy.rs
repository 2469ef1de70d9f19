//! Scenario 5, accuracy: three regions (one region-node and one Redis
//! each, one aggregator, Tansu) push tenant `acc0` past its daily limit at
//! equal rates; the overshoot and the time from the crossing to every
//! region denying, and where the lag sits (delta age at the aggregator,
//! the gap between the aggregator's total and each region's view).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use testkit::{Aggregator, RegionNode};

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::world::metric;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Accuracy {
    pub limit: u64,
    pub rate: u64,
    pub seconds: u64,
    /// limit ÷ rate: about when the limit is reached, s.
    pub secs_to_limit: f64,
    pub run: Summary,
    pub delta_age: DeltaAge,
    pub view_gap: ViewGap,
    /// The aggregator's `/v1/global/acc0` at the end.
    pub aggregator: serde_json::Value,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DeltaAge {
    pub deltas: u64,
    /// Mean publish → merge age of the deltas merged during the run, ms
    /// (−1 if none).
    pub mean_age_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ViewGap {
    pub max_view_gap: u64,
    pub max_view_gap_s: f64,
    pub samples: u64,
}

/// loadgen's options for the three regions' checks (eu, us, ap) in open
/// loop at `rate` in all, 16 connections, `tenants` tenants named
/// `prefix`N, with the accuracy figures for `limit` (scenarios 5 and 5b).
pub fn three_regions(
    nodes: &[&RegionNode; 3],
    rate: u64,
    tenants: u64,
    prefix: &str,
    limit: u64,
) -> Vec<String> {
    let mut a: Vec<String> = nodes
        .iter()
        .flat_map(|n| ["--url".to_string(), n.url("/v1/check")])
        .collect();
    a.extend(strings([
        "--mode".to_string(),
        "open".into(),
        "--rate".into(),
        rate.to_string(),
        "--connections".into(),
        "16".into(),
        "--tenants".into(),
        tenants.to_string(),
        "--tenant-prefix".into(),
        prefix.into(),
        "--warmup".into(),
        "0".into(),
        "--accuracy-limit".into(),
        limit.to_string(),
    ]));
    a
}

pub async fn run(
    run: &Run,
    k: &Knobs,
    nodes: [&RegionNode; 3],
    agg: &Aggregator,
) -> anyhow::Result<Accuracy> {
    let seconds = (k.acc_limit as f64 / k.acc_rate as f64 + 8.0) as u64;
    let http = agg.http.clone();
    let agg_base = agg.url("");
    let age = |name: &'static str| {
        let (http, base) = (http.clone(), agg_base.clone());
        async move { metric(&http, &base, name).await.unwrap_or(0.0) }
    };
    let age0_sum = age("tierlimit_aggregator_delta_age_seconds_sum").await;
    let age0_n = age("tierlimit_aggregator_delta_age_seconds_count").await;

    // Where the lag sits: every 0.5 s, the aggregator's total for acc0
    // beside each region-node's view of it.
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let view_urls: Vec<String> = nodes.iter().map(|n| n.url("/v1/tenants/acc0")).collect();
    let agg_url = agg.url("/v1/global/acc0");
    let sampler_http = http.clone();
    let sampler = tokio::spawn(async move {
        let mut samples: Vec<(f64, [f64; 3])> = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop_rx.changed() => {}
            }
            let a = testkit::try_json(&sampler_http, &agg_url)
                .await
                .unwrap_or_default()["today"]["total"]
                .as_f64()
                .unwrap_or(0.0);
            // A view without an entry (acc0 below the broadcast threshold,
            // by design not broadcast) counts as current: the node bounds the
            // others by the threshold then, not by a lagging total.
            let mut v = [a; 3];
            for (i, u) in view_urls.iter().enumerate() {
                if let Some(t) = testkit::try_json(&sampler_http, u)
                    .await
                    .unwrap_or_default()["global_total"]
                    .as_f64()
                {
                    v[i] = t;
                }
            }
            samples.push((a, v));
            // After the load, sample until every view caught up.
            if *stop_rx.borrow() && v.iter().all(|x| *x >= a) {
                return samples;
            }
        }
    });
    let mut a = three_regions(&nodes, k.acc_rate, 1, "acc", k.acc_limit);
    a.extend(strings(["--duration".to_string(), seconds.to_string()]));
    let r = run.http("s5_accuracy", &a).await?;
    let _ = stop_tx.send(true);
    let samples = tokio::time::timeout(Duration::from_secs(30), sampler)
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "the region-nodes' views did not catch up with the aggregator within 30 s"
            )
        })??;
    // The largest gap between the aggregator's total and a region's view
    // while the load ran (in decisions, and in seconds of the run's traffic).
    let max = samples
        .iter()
        .flat_map(|(a, v)| v.iter().map(move |x| a - x))
        .fold(0.0f64, f64::max);
    let view_gap = ViewGap {
        max_view_gap: max as u64,
        max_view_gap_s: (max / k.acc_rate as f64 * 100.0).round() / 100.0,
        samples: samples.len() as u64,
    };
    let aggregator = testkit::try_json(&http, &agg.url("/v1/global/acc0"))
        .await
        .unwrap_or_default();
    let age1_sum = age("tierlimit_aggregator_delta_age_seconds_sum").await;
    let age1_n = age("tierlimit_aggregator_delta_age_seconds_count").await;
    let n = age1_n - age0_n;
    let delta_age = DeltaAge {
        deltas: n.max(0.0) as u64,
        mean_age_ms: if n > 0.0 {
            ((age1_sum - age0_sum) * 1000.0 / n * 10.0).round() / 10.0
        } else {
            -1.0
        },
    };
    let acc = Accuracy {
        limit: k.acc_limit,
        rate: k.acc_rate,
        seconds,
        secs_to_limit: k.acc_limit as f64 / k.acc_rate as f64,
        run: r,
        delta_age,
        view_gap,
        aggregator,
    };
    run.save("s5_accuracy", &acc)?;
    Ok(acc)
}
