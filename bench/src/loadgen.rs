//! `loadgen`'s JSON summary (see loadgen/src/main.rs, `summarize`), typed.
//! Only what the report reads; unknown members are ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Summary {
    pub label: String,
    pub requests: u64,
    /// Requests answered in the whole run, warm-up included.
    pub completed_total: u64,
    pub measured_s: f64,
    pub throughput_rps: f64,
    pub allowed: u64,
    pub denied: u64,
    pub errors: u64,
    pub latency_us: Option<Percentiles>,
    pub service_us: Option<Percentiles>,
    pub queue_us: Option<Percentiles>,
    pub denied_by: BTreeMap<String, u64>,
    pub modes: BTreeMap<String, u64>,
    pub error_kinds: BTreeMap<String, u64>,
    pub accuracy: Option<Accuracy>,
}

/// HDR percentiles in µs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Percentiles {
    pub count: u64,
    pub min: f64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
    pub p99_99: f64,
    pub max: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Accuracy {
    pub limit: u64,
    pub allowed_total: u64,
    pub overshoot: i64,
    pub overshoot_pct: f64,
    pub crossing_ms: Option<f64>,
    pub ms_from_crossing_to_all_denying: Option<f64>,
    pub per_target: Vec<TargetAccuracy>,
    pub per_tenant: PerTenant,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TargetAccuracy {
    pub allowed: u64,
    pub allowed_after_crossing: u64,
    pub denied_before_crossing: u64,
    pub ms_from_crossing_to_denying: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PerTenant {
    pub tenants: u64,
    pub crossed: u64,
    pub not_crossed: u64,
    pub not_all_seen_denying: u64,
    pub crossing_to_all_denying_ms: Crossings,
    pub overshoot: Overshoot,
    pub overshoot_pct_of_limit: OvershootPct,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Crossings {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
    pub n: u64,
    /// Every crossing's time, ascending.
    pub all: Vec<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Overshoot {
    pub total: u64,
    pub p50: Option<u64>,
    pub p99: Option<u64>,
    pub max: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct OvershootPct {
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

/// The common options of a closed-loop run: `--connections C --tenants T
/// --duration D --warmup W`.
pub fn closed(connections: u64, tenants: u64, duration: u64, warmup: u64) -> Vec<String> {
    crate::run::strings([
        "--connections".to_string(),
        connections.to_string(),
        "--tenants".into(),
        tenants.to_string(),
        "--duration".into(),
        duration.to_string(),
        "--warmup".into(),
        warmup.to_string(),
    ])
}
