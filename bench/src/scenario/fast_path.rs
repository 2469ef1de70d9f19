//! Scenario 3, the over-limit fast path: tenant `over0` (daily limit 100)
//! is pushed past its limit; once the aggregator's broadcast reached
//! region-node's view, every check of it is a 429 from the view, without
//! Redis.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use testkit::RegionNode;

use crate::knobs::Knobs;
use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::scenario::ceiling::WARMUP;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FastPath {
    pub connections: u64,
    pub duration: u64,
    pub run: Summary,
    /// This run's throughput ÷ scenario 1's region-node (Redis path).
    pub ratio: Option<f64>,
    /// Scenario 1's region-node median round of the same run (the Redis
    /// path the ratio divides by).
    #[serde(default)]
    pub redis_path: Option<Summary>,
}

pub async fn run(
    run: &Run,
    k: &Knobs,
    node: &RegionNode,
    redis_path_rps: Option<f64>,
) -> anyhow::Result<FastPath> {
    run.scenario("3/7 over-limit fast path");
    let url = node.url("/v1/check");
    run.http(
        "s3_push",
        &strings([
            "--url",
            &url,
            "--connections",
            "4",
            "--tenants",
            "1",
            "--tenant-prefix",
            "over",
            "--max-requests",
            "150",
            "--duration",
            "30",
            "--warmup",
            "0",
        ]),
    )
    .await?;
    let view = node.url("/v1/tenants/over0");
    let http = node.http.clone();
    testkit::wait_until(
        "the broadcast to mark over0 over its limit",
        Duration::from_secs(30),
        || {
            let (http, view) = (http.clone(), view.clone());
            async move {
                let v = testkit::try_json(&http, &view).await.unwrap_or_default();
                v["global_total"].as_f64().unwrap_or(0.0) >= 100.0
            }
        },
    )
    .await;
    let r = run
        .http(
            "s3_fastpath",
            &strings([
                "--url".to_string(),
                url,
                "--connections".into(),
                k.connections.to_string(),
                "--tenants".into(),
                "1".into(),
                "--tenant-prefix".into(),
                "over".into(),
                "--duration".into(),
                k.duration.to_string(),
                "--warmup".into(),
                WARMUP.to_string(),
            ]),
        )
        .await?;
    let f = FastPath {
        connections: k.connections,
        duration: k.duration,
        ratio: redis_path_rps.map(|n| r.throughput_rps / n),
        run: r,
        redis_path: None,
    };
    run.save("s3_fast_path", &f)?;
    Ok(f)
}
