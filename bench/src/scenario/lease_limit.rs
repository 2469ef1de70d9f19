//! Scenario 9's second half, leases near the limit (issue 30), with the
//! defaults (adaptive leases, nothing configured about them):
//!
//! - **Accuracy.** Four region-nodes on one Redis drive one tenant whose
//!   region tier is 6 000 per minute (fixed window), at rates 1:2:3:4 that
//!   add up to twice the limit, for whole windows. Each allowed check is
//!   placed in its window from the reply's `reset_ms` and the client's time
//!   bracket (`testkit::windows_of`, as the tests' history checker does), so
//!   the count per window is the clients' own, not the node's metrics. The
//!   promise: every whole window admits at least 99 % of the limit (leased
//!   units that were never spent strand at most that) and none more than it.
//! - **Idle to burst.** Tenants that made one check and then sat idle for
//!   the length of the accuracy run turn to a closed-loop burst on one node:
//!   the time from the burst's first check until a reply says `mode: lease`,
//!   and the checks answered before it (each a script call).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use testkit::now_us;

use crate::knobs::Knobs;
use crate::run::Run;
use crate::scenario::median;
use crate::world::{start_node, VIEW_WAIT_DETACHED};

/// The region tier the four nodes share: 6 000 per minute.
pub const LIMIT: u64 = 6_000;
pub const WINDOW_MS: u64 = 60_000;
/// Checks per second of the slowest node; the others send 2×, 3×, 4×:
/// 200/s in all, twice the limit's 100/s.
const BASE_RATE: u64 = 20;
/// Tenants measured going from idle to a burst, and the burst's clients.
const BURST_TENANTS: usize = 5;
const BURST_CLIENTS: usize = 8;
/// A burst that has not been served from a lease by then failed.
const BURST_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct NearLimit {
    pub limit: u64,
    pub window_s: u64,
    /// Checks per second sent to each node.
    pub rates: Vec<u64>,
    /// Units admitted in each whole window of the run, in order.
    pub windows: Vec<u64>,
    /// The least of `windows` ÷ the limit.
    pub min_fraction: f64,
    /// Windows that admitted more than the limit (the promise: none).
    pub over: u64,
    /// Allowed checks whose request spanned a window edge, placed in the
    /// least used of their candidate windows (a violation is one no
    /// placement avoids).
    pub ambiguous: u64,
    /// Checks without an answer or a reply the placement could not read.
    pub errors: u64,
    /// Allowed checks answered from a lease ÷ allowed checks.
    pub leased_fraction: f64,
    /// `tierlimit_lease_units_total{event="lost"}` summed over the nodes:
    /// leased units whose window ended before they were spent.
    pub lost_units: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Burst {
    pub tenants: u64,
    pub clients: u64,
    /// How long each tenant had been idle after its one check.
    pub idle_s: f64,
    /// Per tenant: ms from the burst's first check to the first reply
    /// served from a lease, and the checks answered before it.
    pub ms_to_lease: Vec<f64>,
    pub checks_before_lease: Vec<u64>,
    pub median_ms: f64,
    pub median_checks: f64,
}

fn config(redis_url: &str) -> String {
    format!(
        r#"# Written by scripts/bench (scenario 9, near the limit).
cluster = "bench"
[kafka]
brokers = "127.0.0.1:1"
[node]
store_timeout = "500ms"
store_retry_interval = "100ms"
{VIEW_WAIT_DETACHED}
[regions.eu]
redis_url = "{redis_url}"
expected_nodes = 4
[unknown_tenants]
policy = "plan"
plan = "roomy"
max_new_per_second = 1000000
[plans.near]
region = {{ limit = {LIMIT}, window = "60s", algorithm = "fixed_window" }}
[plans.roomy]
region = {{ limit = 1000000, window = "60s", algorithm = "fixed_window" }}
[tenants.hot]
plan = "near"
"#
    )
}

/// One check's record: the client's time bracket and what the reply said.
#[derive(Debug, Clone)]
struct Seen {
    start_us: u64,
    end_us: u64,
    status: u16,
    mode: String,
    /// The region tier's (reset_ms, window_ms).
    region: Option<(u64, u64)>,
}

async fn check(http: &reqwest::Client, url: &str, tenant: &str) -> Option<Seen> {
    let start_us = now_us();
    let r = http
        .post(url)
        .json(&serde_json::json!({ "tenant": tenant, "cost": 1 }))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    let status = r.status().as_u16();
    let body: serde_json::Value = r.json().await.ok()?;
    let end_us = now_us();
    let region = body["tiers"].as_array().and_then(|tiers| {
        tiers
            .iter()
            .find(|t| t["tier"] == "region")
            .and_then(|t| Some((t["reset_ms"].as_u64()?, t["window_ms"].as_u64()?)))
    });
    Some(Seen {
        start_us,
        end_us,
        status,
        mode: body["mode"].as_str().unwrap_or("").to_string(),
        region,
    })
}

/// Per-window admitted units from the clients' records, and the counts
/// that could not be placed with certainty.
fn place(seen: &[Seen]) -> (BTreeMap<u64, u64>, u64, u64) {
    let mut usage: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut ambiguous, mut errors) = (Vec::new(), 0u64);
    for s in seen.iter().filter(|s| s.status == 200) {
        let Some((reset_ms, window_ms)) = s.region.filter(|r| r.1 == WINDOW_MS) else {
            errors += 1;
            continue;
        };
        match testkit::windows_of(s.start_us, s.end_us, reset_ms, window_ms) {
            Ok((a, b)) if a == b => *usage.entry(a).or_default() += 1,
            Ok((a, b)) => ambiguous.push((a, b)),
            Err(_) => errors += 1,
        }
    }
    let n = ambiguous.len() as u64;
    for (a, b) in ambiguous {
        let w = (a..=b)
            .min_by_key(|i| usage.get(i).copied().unwrap_or(0))
            .expect("a <= b");
        *usage.entry(w).or_default() += 1;
    }
    (usage, n, errors)
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<(NearLimit, Burst)> {
    let windows = if k.quick { 1 } else { 3 };
    run.say(&format!(
        "9 near the limit: 4 nodes at 1:2:3:4 against {LIMIT}/min for {windows} whole window(s), then {BURST_TENANTS} tenants from idle to a burst"
    ));
    let redis = testkit::Redis::start();
    run.record_spawned(&redis.proc);
    let dir = testkit::temp_dir();
    let cfg = testkit::write_config(dir.path(), &config(&redis.url()));
    run.record(format!("# scenario 9, near the limit: {}", cfg.display()));
    let mut nodes = Vec::new();
    for id in ["a", "b", "c", "d"] {
        nodes.push(start_node(run, &cfg, "eu", id, "/healthz", &[]).await);
    }
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    // The burst tenants' one check each, before they sit idle.
    let burst_url = nodes[0].url("/v1/check");
    for i in 0..BURST_TENANTS {
        let s = check(&http, &burst_url, &format!("burst-{i}"))
            .await
            .context("a burst tenant's first check went unanswered")?;
        if s.status != 200 {
            bail!("a burst tenant's first check was refused: {}", s.status);
        }
    }
    let idle_from = Instant::now();

    // Start just after a window edge (the windows follow Redis' clock, this
    // machine's), run whole windows and a little more.
    let now_ms = now_us() / 1000;
    tokio::time::sleep(Duration::from_millis(WINDOW_MS - now_ms % WINDOW_MS + 20)).await;
    let first_window = now_us() / 1000 / WINDOW_MS;
    let deadline = Instant::now() + Duration::from_millis(windows * WINDOW_MS + 500);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut pacers = Vec::new();
    let rates: Vec<u64> = (1..=4).map(|i| BASE_RATE * i).collect();
    for (n, rate) in nodes.iter().zip(&rates) {
        let (http, url, seen) = (http.clone(), n.url("/v1/check"), Arc::clone(&seen));
        let every = Duration::from_micros(1_000_000 / rate);
        pacers.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            let mut inflight = Vec::new();
            while Instant::now() < deadline {
                tick.tick().await;
                let (http, url, seen) = (http.clone(), url.clone(), Arc::clone(&seen));
                inflight.push(tokio::spawn(async move {
                    let s = check(&http, &url, "hot").await;
                    seen.lock().expect("not poisoned").push(s);
                }));
            }
            for t in inflight {
                let _ = t.await;
            }
        }));
    }
    for p in pacers {
        p.await?;
    }
    let seen: Vec<Option<Seen>> = std::mem::take(&mut *seen.lock().expect("not poisoned"));
    let unanswered = seen.iter().filter(|s| s.is_none()).count() as u64;
    let seen: Vec<Seen> = seen.into_iter().flatten().collect();
    let (usage, ambiguous, errors) = place(&seen);
    let whole: Vec<u64> = (first_window..first_window + windows)
        .map(|w| usage.get(&w).copied().unwrap_or(0))
        .collect();
    let allowed = seen.iter().filter(|s| s.status == 200).count();
    let leased = seen
        .iter()
        .filter(|s| s.status == 200 && s.mode == "lease")
        .count();
    let mut lost_units = 0.0;
    for n in &nodes {
        let text = testkit::get_text(&n.http, &n.admin_url("/metrics")).await;
        lost_units += testkit::metric_sample(&text, r#"tierlimit_lease_units_total{event="lost"}"#)
            .unwrap_or(0.0);
    }
    let near = NearLimit {
        limit: LIMIT,
        window_s: WINDOW_MS / 1000,
        rates,
        min_fraction: whole.iter().copied().min().unwrap_or(0) as f64 / LIMIT as f64,
        over: usage.values().filter(|u| **u > LIMIT).count() as u64,
        windows: whole,
        ambiguous,
        errors: errors + unanswered,
        leased_fraction: leased as f64 / (allowed as f64).max(1.0),
        lost_units,
    };
    run.say(&format!(
        "9 near the limit: whole windows admitted {:?} of {LIMIT}, {} over, {:.0} % from leases",
        near.windows,
        near.over,
        near.leased_fraction * 100.0
    ));

    // From idle to a burst, one tenant at a time.
    let idle_s = idle_from.elapsed().as_secs_f64();
    let (mut ms, mut checks) = (Vec::new(), Vec::new());
    for i in 0..BURST_TENANTS {
        let tenant = format!("burst-{i}");
        let started = Instant::now();
        let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let first_lease: Arc<Mutex<Option<(Duration, u64)>>> = Arc::new(Mutex::new(None));
        let mut clients = Vec::new();
        for _ in 0..BURST_CLIENTS {
            let (http, url, tenant) = (http.clone(), burst_url.clone(), tenant.clone());
            let (answered, first_lease) = (Arc::clone(&answered), Arc::clone(&first_lease));
            clients.push(tokio::spawn(async move {
                while first_lease.lock().expect("not poisoned").is_none()
                    && started.elapsed() < BURST_MAX
                {
                    let Some(s) = check(&http, &url, &tenant).await else {
                        continue;
                    };
                    let before = answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if s.status == 200 && s.mode == "lease" {
                        let mut f = first_lease.lock().expect("not poisoned");
                        if f.is_none() {
                            *f = Some((started.elapsed(), before));
                        }
                    }
                }
            }));
        }
        for c in clients {
            c.await?;
        }
        let Some((t, n)) = *first_lease.lock().expect("not poisoned") else {
            bail!("{tenant}: no check of a {BURST_MAX:?} burst was served from a lease");
        };
        ms.push(t.as_secs_f64() * 1000.0);
        checks.push(n);
    }
    let burst = Burst {
        tenants: BURST_TENANTS as u64,
        clients: BURST_CLIENTS as u64,
        idle_s,
        median_ms: median(ms.clone()),
        median_checks: median(checks.iter().map(|c| *c as f64).collect()),
        ms_to_lease: ms,
        checks_before_lease: checks,
    };
    run.say(&format!(
        "9 idle to burst: first check from a lease after {:.1} ms, {} checks (medians of {BURST_TENANTS})",
        burst.median_ms, burst.median_checks
    ));
    Ok((near, burst))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(start_ms: u64, end_ms: u64, reset_ms: u64) -> Seen {
        Seen {
            start_us: start_ms * 1000,
            end_us: end_ms * 1000,
            status: 200,
            mode: "redis".into(),
            region: Some((reset_ms, WINDOW_MS)),
        }
    }

    #[test]
    fn checks_are_counted_in_the_window_their_reply_names() {
        // Window 10 is [600 000, 660 000) ms.
        let s = vec![
            seen(600_010, 600_012, 59_990),
            seen(659_990, 659_995, 10),
            // A request slower than a window: either; the less used (11) wins.
            seen(600_500, 661_000, 59_000),
            seen(660_001, 660_002, 59_999),
        ];
        let (usage, ambiguous, errors) = place(&s);
        assert_eq!((ambiguous, errors), (1, 0));
        assert_eq!(usage.get(&10), Some(&2));
        assert_eq!(usage.get(&11), Some(&2));
    }

    #[test]
    fn the_configuration_is_valid() {
        // testkit::write_config adds the wire keys when it writes the file.
        let toml = format!(
            "{}\n[wire]\naccept_unsigned = true\n",
            config("redis://127.0.0.1:1")
        );
        let loaded =
            tierlimit_shared::Config::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
        assert_eq!(loaded.config.regions["eu"].expected_nodes, 4);
    }
}
