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

/// Pushes before the view must hold over0 at its limit.
const PUSHES: u32 = 5;

pub async fn run(
    run: &Run,
    k: &Knobs,
    node: &RegionNode,
    redis_path_rps: Option<f64>,
) -> anyhow::Result<FastPath> {
    run.scenario("3/7 over-limit fast path");
    let url = node.url("/v1/check");
    let view = node.url("/v1/tenants/over0");
    let http = node.http.clone();
    // Until the aggregator broadcasts over0, the node counts the most an
    // unbroadcast counter may hold (θ − 1, `aggregator.broadcast_fraction`)
    // as other regions' and denies there, short of the limit; the region's
    // own spend reaches the limit once the broadcast shows it. So the push
    // is repeated after each broadcast, until the view holds the tenant at
    // its limit.
    let view_total = || async {
        testkit::try_json(&http, &view)
            .await
            .and_then(|v| v["global_total"].as_f64())
            .unwrap_or(0.0)
    };
    let (mut pushes, mut allowed) = (0, 0);
    loop {
        let total = view_total().await;
        if total >= 100.0 {
            break;
        }
        anyhow::ensure!(
            pushes < PUSHES,
            "over0 is not over its limit of 100 in the view after {PUSHES} pushes \
             ({allowed} allowed; view total {total})"
        );
        let push = run
            .http(
                &format!("s3_push_{pushes}"),
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
        pushes += 1;
        allowed += push.allowed;
        // The broadcast of what the pushes charged (every 250 ms).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while view_total().await < allowed as f64 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
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
