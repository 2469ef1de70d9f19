//! What the limits-as-data suites (`limits.rs`, `limits_api.rs`) ask of
//! the processes: is a node ready, what does a check answer, has a limits
//! version reached every node.

use std::time::Duration;

use serde_json::{json, Value};
use testkit::{wait_for, wait_until, Aggregator, RegionNode};

const DEADLINE: Duration = Duration::from_secs(30);

/// Waits until `n` answers `/readyz` with 200.
pub async fn ready(n: &RegionNode) {
    let url = n.url("/readyz");
    wait_until(&format!("{} ready", n.node_id), DEADLINE, || {
        let url = url.clone();
        async move {
            reqwest::get(url)
                .await
                .map(|r| r.status() == 200)
                .unwrap_or(false)
        }
    })
    .await;
}

/// The status of one check of `tenant` (0: no answer).
pub async fn check(n: &RegionNode, tenant: &str) -> u16 {
    n.http
        .post(n.url("/v1/check"))
        .json(&json!({ "tenant": tenant }))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// How many checks of `tenant` pass before the first refusal (at most
/// `max`), and the refusal's status.
pub async fn allowed_until_refused(n: &RegionNode, tenant: &str, max: u32) -> (u32, u16) {
    for i in 0..max {
        let s = check(n, tenant).await;
        if s != 200 {
            return (i, s);
        }
    }
    (max, 200)
}

/// Waits until the aggregator says every node (`nodes` of them) applied
/// `version`; its status answer.
pub async fn reached(agg: &Aggregator, version: u64, nodes: usize) -> Value {
    let url = agg.url(&format!("/v1/limits/status?version={version}"));
    wait_for(
        &format!("version {version} on {nodes} nodes"),
        DEADLINE,
        || {
            let (http, url) = (agg.http.clone(), url.clone());
            async move {
                let v: Value = http.get(url).send().await.ok()?.json().await.ok()?;
                (v["reached"] == true && v["nodes"].as_array()?.len() == nodes).then_some(v)
            }
        },
    )
    .await
}
