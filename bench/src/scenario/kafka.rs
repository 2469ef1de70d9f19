//! Scenario 4, the Kafka economy: open loop at 10 000 req/s over 10 tenants
//! for 20 s against region-node eu-1 (Kafka attached, flush 250 ms); deltas
//! produced per 1 000 allowed decisions.

use serde::{Deserialize, Serialize};
use testkit::RegionNode;

use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::world::{metric, RedisConn};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Kafka {
    /// `tierlimit_deltas_produced_total` before and after.
    pub before: f64,
    pub after: f64,
    pub msgs: f64,
    pub run: Summary,
    pub per_1000: f64,
    pub decisions_per_msg: f64,
}

pub async fn run(run: &Run, node: &RegionNode, redis: &RedisConn) -> anyhow::Result<Kafka> {
    run.scenario("4/7 Kafka economy: 10000 req/s over 10 tenants, flush 250ms");
    // The publisher counts a delta as produced before it acknowledges the
    // dirty entry (publisher.rs), so once the dirty set is empty the
    // counter is final.
    super::drained(redis, "the dirty set to drain", 60).await;
    let base = node.url("");
    let before = metric(&node.http, &base, "tierlimit_deltas_produced_total")
        .await
        .unwrap_or(0.0);
    let r = run
        .http(
            "s4_kafka",
            &strings([
                "--url",
                &node.url("/v1/check"),
                "--mode",
                "open",
                "--rate",
                "10000",
                "--connections",
                "32",
                "--tenants",
                "10",
                "--tenant-prefix",
                "k",
                "--duration",
                "20",
                "--warmup",
                "0",
            ]),
        )
        .await?;
    super::drained(redis, "the last deltas to be published", 30).await;
    let after = metric(&node.http, &base, "tierlimit_deltas_produced_total")
        .await
        .unwrap_or(0.0);
    let msgs = after - before;
    let allowed = r.allowed as f64;
    let k = Kafka {
        before,
        after,
        msgs,
        per_1000: msgs * 1000.0 / if allowed > 0.0 { allowed } else { 1.0 },
        decisions_per_msg: allowed / if msgs > 0.0 { msgs } else { 1.0 },
        run: r,
    };
    run.save("s4_kafka", &k)?;
    Ok(k)
}
