//! Scenario 6, scale: many distinct tenants, each checked once through
//! region-node eu-1, then published and merged (far from their global
//! limit, so not broadcast back); Redis bytes per tenant, region-node and
//! aggregator RSS, the view.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use testkit::{Aggregator, RegionNode};

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{secs, strings, Run};
use crate::world::{metric, RedisConn};

/// The populate run is bounded in time, and so is the wait for the
/// pipeline (the report says both).
pub const POPULATE_BOUND_S: u64 = 240;
pub const PIPELINE_BOUND_S: u64 = 420;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Scale {
    /// Tenants really charged (the populate run is bounded at 240 s).
    pub tenants: u64,
    pub asked: u64,
    /// The populate run's connections.
    #[serde(default)]
    pub connections: u64,
    pub populate_s: u64,
    pub pipeline_s: u64,
    pub redis_used_before: u64,
    pub redis_used_with_dirty: u64,
    pub redis_used_after: u64,
    pub dirty_peak: u64,
    pub dirty_left: u64,
    pub keys_before: u64,
    pub keys_after: u64,
    pub sample_tenant: String,
    pub mu_node: Option<u64>,
    pub mu_region: Option<u64>,
    pub mu_pn: Option<u64>,
    pub node_rss_before_kib: u64,
    pub node_rss_after_kib: u64,
    pub agg_rss_before_kib: u64,
    pub agg_rss_after_kib: u64,
    pub view_entries_before: f64,
    pub view_entries_after: Option<f64>,
    pub view_age_s: Option<f64>,
    pub agg_tracked: Option<f64>,
    pub agg_broadcasts: Option<f64>,
    /// Changed counters the aggregator did not broadcast (below the
    /// broadcast threshold of their limit).
    #[serde(default)]
    pub agg_withheld: Option<f64>,
    pub deltas_produced: Option<f64>,
    pub populate: Summary,
    /// Derived: Redis bytes per tenant after publishing and while dirty.
    pub bytes_per_tenant: f64,
    pub bytes_per_tenant_dirty: f64,
}

pub async fn run(
    run: &Run,
    k: &Knobs,
    node: &RegionNode,
    agg: &Aggregator,
    redis: &RedisConn,
) -> anyhow::Result<Scale> {
    run.scenario(&format!(
        "6/7 scale: {} distinct tenants through region-node eu-1",
        k.scale_tenants
    ));
    super::drained(redis, "the dirty set to drain", 60).await;
    let (node_pid, agg_pid) = (node.proc.pid(), agg.proc.pid());
    let (nb, ab) = (node.url(""), agg.url(""));
    let http = node.http.clone();
    let rss = |pid| testkit::rss_kib(pid).unwrap_or(0);
    let used = || async { redis.info_u64("memory", "used_memory").await };
    let redis_used_before = used().await?;
    let keys_before = redis.dbsize().await?;
    let node_rss_before_kib = rss(node_pid);
    let agg_rss_before_kib = rss(agg_pid);
    let view_entries_before = metric(&http, &nb, "tierlimit_view_entries")
        .await
        .unwrap_or(0.0);
    let tracked_before = metric(&http, &ab, "tierlimit_aggregator_tracked_counters")
        .await
        .unwrap_or(0.0);
    let started = Instant::now();
    let populate = run
        .http(
            "s6_populate",
            &strings([
                "--url".to_string(),
                node.url("/v1/check"),
                "--connections".into(),
                k.connections.to_string(),
                "--tenants".into(),
                k.scale_tenants.to_string(),
                "--dist".into(),
                "seq".into(),
                "--tenant-prefix".into(),
                "s".into(),
                "--max-requests".into(),
                k.scale_tenants.to_string(),
                "--duration".into(),
                POPULATE_BOUND_S.to_string(),
                "--warmup".into(),
                "0".into(),
            ]),
        )
        .await?;
    let populate_s = secs(started);
    // The populate run is bounded in time: count what it really charged.
    let populated = populate.allowed;
    let redis_used_with_dirty = used().await?;
    let dirty_peak = redis.dirty_total().await?;
    // Publishing and merging: a bounded wait that does not fail (the
    // report shows how far it got), polled every 2 s. These tenants are far
    // from their global limit, so none is broadcast back: the view must not
    // grow (the report shows it).
    let deadline = Instant::now() + Duration::from_secs(PIPELINE_BOUND_S);
    while Instant::now() < deadline {
        let d = redis.dirty_total().await?;
        let merged = metric(&http, &ab, "tierlimit_aggregator_tracked_counters")
            .await
            .unwrap_or(0.0);
        if d == 0 && merged - tracked_before >= populated as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let pipeline_s = secs(started);
    let sample = populated / 2;
    // Key scheme 2: a tenant's windows and days share one hash.
    let node_key = tierlimit_shared::keys::tenant_hash(&format!("s{sample}"));
    let redis_used_after = used().await?;
    let s = Scale {
        tenants: populated,
        asked: k.scale_tenants,
        connections: k.connections,
        populate_s,
        pipeline_s,
        redis_used_before,
        redis_used_with_dirty,
        redis_used_after,
        dirty_peak,
        dirty_left: redis.dirty_total().await?,
        keys_before,
        keys_after: redis.dbsize().await?,
        sample_tenant: format!("s{sample}"),
        mu_node: redis.memory_usage(&node_key).await?,
        mu_region: None,
        mu_pn: None,
        node_rss_before_kib,
        node_rss_after_kib: rss(node_pid),
        agg_rss_before_kib,
        agg_rss_after_kib: rss(agg_pid),
        view_entries_before,
        view_entries_after: metric(&http, &nb, "tierlimit_view_entries").await,
        view_age_s: metric(&http, &nb, "tierlimit_view_age_seconds").await,
        agg_tracked: metric(&http, &ab, "tierlimit_aggregator_tracked_counters").await,
        agg_broadcasts: metric(&http, &ab, "tierlimit_aggregator_broadcasts_produced_total").await,
        agg_withheld: metric(&http, &ab, "tierlimit_aggregator_broadcasts_withheld_total").await,
        deltas_produced: metric(&http, &nb, "tierlimit_deltas_produced_total").await,
        bytes_per_tenant: (redis_used_after as f64 - redis_used_before as f64)
            / populated.max(1) as f64,
        bytes_per_tenant_dirty: (redis_used_with_dirty as f64 - redis_used_before as f64)
            / populated.max(1) as f64,
        populate,
    };
    run.save("s6_scale", &s)?;
    Ok(s)
}
