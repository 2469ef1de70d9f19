//! Scenario 5b, many crossings: the same three regions push many tenants
//! past a small daily limit one after the other (`--dist phased`), so the
//! crossing → every-region-denying time is a distribution, not one sample.

use serde::{Deserialize, Serialize};
use testkit::RegionNode;

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::world::RedisConn;

/// A new tenant every PHASE s, each for WIDTH phases.
pub const PHASE: f64 = 1.5;
pub const WIDTH: u64 = 4;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Crossings {
    pub tenants: u64,
    pub limit: u64,
    pub rate: u64,
    pub phase: f64,
    pub width: u64,
    /// (N + W − 1) · X + 2 s: the run ends when the last tenant's phases do.
    pub seconds: f64,
    /// rate ÷ W: a tenant's rate while W share the load.
    pub tenant_rate: f64,
    /// limit · W ÷ rate: when a tenant reaches its limit, s into its phases.
    pub secs_to_limit: f64,
    /// X · W: how long each tenant is asked.
    pub active_s: f64,
    pub run: Summary,
}

pub async fn run(
    run: &Run,
    k: &Knobs,
    nodes: [&RegionNode; 3],
    eu_redis: &RedisConn,
) -> anyhow::Result<Crossings> {
    run.scenario(&format!(
        "5b/7 crossings: {} staggered tenants past {}/day, three regions at {} req/s in all",
        k.cross_tenants, k.cross_limit, k.acc_rate
    ));
    super::drained(eu_redis, "the dirty set to drain", 60).await;
    let seconds = (k.cross_tenants + WIDTH - 1) as f64 * PHASE + 2.0;
    let mut a =
        super::accuracy::three_regions(&nodes, k.acc_rate, k.cross_tenants, "x", k.cross_limit);
    a.extend(strings([
        "--dist".to_string(),
        "phased".into(),
        "--phase-seconds".into(),
        crate::run::g(PHASE),
        "--phase-width".into(),
        WIDTH.to_string(),
        "--duration".into(),
        crate::run::g(seconds),
    ]));
    let r = run.http("s5b_crossings", &a).await?;
    let c = Crossings {
        tenants: k.cross_tenants,
        limit: k.cross_limit,
        rate: k.acc_rate,
        phase: PHASE,
        width: WIDTH,
        seconds,
        tenant_rate: k.acc_rate as f64 / WIDTH as f64,
        secs_to_limit: k.cross_limit as f64 * WIDTH as f64 / k.acc_rate as f64,
        active_s: PHASE * WIDTH as f64,
        run: r,
    };
    run.save("s5b_crossings", &c)?;
    Ok(c)
}
