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
use crate::world::Region;

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
}

pub async fn run(
    run: &Run,
    k: &Knobs,
    saturated: f64,
    solo: &RegionNode,
    eu: &Region,
) -> anyhow::Result<Latency> {
    let rate = (saturated / 2.0) as u64;
    run.scenario(&format!(
        "2/7 latency at 50% of saturation: {rate} req/s, open loop"
    ));
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
    let check = run.http("s2_check", &a).await?;
    let mut a = strings(["--redis-url".to_string(), eu.redis.url()]);
    a.extend(script_opts());
    a.extend(lat.iter().cloned());
    let evalsha = run.redis("s2_evalsha", &a).await?;
    let lat_of = |s: &Summary, f: fn(&crate::loadgen::Percentiles) -> f64| {
        s.latency_us.as_ref().map(f).unwrap_or(0.0)
    };
    let svc_p50 = |s: &Summary| s.service_us.as_ref().map(|p| p.p50).unwrap_or(0.0);
    let l = Latency {
        rate,
        seconds,
        warmup: WARMUP,
        added_p50_ms: (lat_of(&check, |p| p.p50) - lat_of(&evalsha, |p| p.p50)) / 1000.0,
        added_p99_ms: (lat_of(&check, |p| p.p99) - lat_of(&evalsha, |p| p.p99)) / 1000.0,
        added_p99_9_ms: (lat_of(&check, |p| p.p99_9) - lat_of(&evalsha, |p| p.p99_9)) / 1000.0,
        added_service_p50_ms: (svc_p50(&check) - svc_p50(&evalsha)) / 1000.0,
        check,
        evalsha,
    };
    run.save("s2_latency", &l)?;
    Ok(l)
}
