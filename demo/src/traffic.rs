//! Client traffic: streams of checks at a fixed rate for one tenant in one
//! region, and the tally of what the clients saw. A check goes to a
//! region-node's HTTP API, or through the region's Envoy, whose ratelimit
//! filter asks a region-node over gRPC ([`Via`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// What the clients of one (tenant, region) saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Cell {
    pub allowed: u64,
    pub denied_node: u64,
    pub denied_region: u64,
    pub denied_global: u64,
    /// Global denials decided from the broadcast view alone (subset of
    /// `denied_global`).
    pub denied_global_view: u64,
    /// 503, other statuses, transport errors.
    pub errors: u64,
    /// Units given back with `POST /v1/refund` (answered 200).
    pub refunded: u64,
    /// Allowed decisions not taken in Redis (`mode` local or open).
    pub fail_mode: u64,
}

impl Cell {
    pub fn denied(&self) -> u64 {
        self.denied_node + self.denied_region + self.denied_global
    }

    pub fn add(&mut self, o: &Cell) {
        self.allowed += o.allowed;
        self.denied_node += o.denied_node;
        self.denied_region += o.denied_region;
        self.denied_global += o.denied_global;
        self.denied_global_view += o.denied_global_view;
        self.errors += o.errors;
        self.refunded += o.refunded;
        self.fail_mode += o.fail_mode;
    }

    pub fn minus(&self, o: &Cell) -> Cell {
        Cell {
            allowed: self.allowed - o.allowed,
            denied_node: self.denied_node - o.denied_node,
            denied_region: self.denied_region - o.denied_region,
            denied_global: self.denied_global - o.denied_global,
            denied_global_view: self.denied_global_view - o.denied_global_view,
            errors: self.errors - o.errors,
            refunded: self.refunded - o.refunded,
            fail_mode: self.fail_mode - o.fail_mode,
        }
    }
}

/// Every cell, keyed by (tenant, region), plus the first time each region
/// denied each tenant from the broadcast view.
#[derive(Default)]
pub struct Tally {
    cells: Mutex<BTreeMap<(String, String), Cell>>,
    first_view_denial: Mutex<BTreeMap<(String, String), Instant>>,
    first_global_denial: Mutex<Option<Instant>>,
    last_error: Mutex<Option<String>>,
    slowest: Mutex<(Duration, String)>,
}

impl Tally {
    pub fn snapshot(&self) -> BTreeMap<(String, String), Cell> {
        self.cells.lock().unwrap().clone()
    }

    /// The sum of the cells of `tenant` (every tenant if `None`) in
    /// `region` (every region if `None`).
    pub fn totals(&self, tenant: Option<&str>, region: Option<&str>) -> Cell {
        let mut c = Cell::default();
        for ((t, r), cell) in self.snapshot() {
            if tenant.is_none_or(|x| x == t) && region.is_none_or(|x| x == r) {
                c.add(&cell);
            }
        }
        c
    }

    pub fn cell(&self, tenant: &str, region: &str) -> Cell {
        self.cells
            .lock()
            .unwrap()
            .get(&(tenant.to_string(), region.to_string()))
            .copied()
            .unwrap_or_default()
    }

    pub fn first_view_denial(&self, tenant: &str, region: &str) -> Option<Instant> {
        self.first_view_denial
            .lock()
            .unwrap()
            .get(&(tenant.to_string(), region.to_string()))
            .copied()
    }

    pub fn first_global_denial(&self) -> Option<Instant> {
        *self.first_global_denial.lock().unwrap()
    }

    /// The slowest check or refund answered so far, and where.
    pub fn slowest(&self) -> (Duration, String) {
        self.slowest.lock().unwrap().clone()
    }

    fn timed(&self, started: Instant, what: impl FnOnce() -> String) {
        let took = started.elapsed();
        let mut s = self.slowest.lock().unwrap();
        if took > s.0 {
            *s = (took, what());
        }
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap().clone()
    }

    /// A denial by `tier` (`""` when unknown: an error); `from_view` when
    /// the broadcast view decided it without Redis.
    fn denied(&self, tenant: &str, region: &str, tier: &str, from_view: bool) {
        self.update(tenant, region, |c| match tier {
            "node" => c.denied_node += 1,
            "region" => c.denied_region += 1,
            "global" => {
                c.denied_global += 1;
                if from_view {
                    c.denied_global_view += 1;
                }
            }
            _ => c.errors += 1,
        });
        if tier == "global" {
            let now = Instant::now();
            self.first_global_denial.lock().unwrap().get_or_insert(now);
            if from_view {
                self.first_view_denial
                    .lock()
                    .unwrap()
                    .entry((tenant.to_string(), region.to_string()))
                    .or_insert(now);
            }
        }
    }

    fn update(&self, tenant: &str, region: &str, f: impl FnOnce(&mut Cell)) {
        let mut cells = self.cells.lock().unwrap();
        f(cells
            .entry((tenant.to_string(), region.to_string()))
            .or_default());
    }
}

/// Where a client sends a check.
#[derive(Debug, Clone)]
pub enum Via {
    /// `POST {base}/v1/check` on a region-node (JSON, tier and mode in the
    /// answer).
    Node(String),
    /// `GET {base}/` on the region's Envoy with the tenant in `x-tenant`:
    /// 200 or 429, the tiers' state in the `RateLimit` header region-node's
    /// RLS answered.
    Envoy(String),
}

/// A running stream; stops (and waits for its in-flight requests) on
/// [`Stream::stop`].
pub struct Stream {
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Starts `rate` checks per second of `tenant`, spread evenly over `vias`
/// (one per node of the region). With `refund_every = Some(k)`, every k-th
/// allowed request of a via is followed by a refund of 1 unit on the node
/// of the same index in `nodes` (Envoy's RLS has no refund: a service
/// behind it gives units back through region-node's API).
#[allow(clippy::too_many_arguments)]
pub fn start(
    http: &reqwest::Client,
    tally: &Arc<Tally>,
    tenant: &str,
    region: &str,
    vias: &[Via],
    nodes: &[String],
    rate: f64,
    refund_every: Option<u64>,
) -> Stream {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let per_node = rate / vias.len() as f64;
    // Two workers per node, so one slow answer does not stall the stream.
    let workers = 2usize;
    let period = Duration::from_secs_f64(workers as f64 / per_node);
    let mut tasks = Vec::new();
    for (n, via) in vias.iter().enumerate() {
        for w in 0..workers {
            let (http, tally, mut stopped) = (http.clone(), Arc::clone(tally), stopped.clone());
            let (tenant, region, via) = (tenant.to_string(), region.to_string(), via.clone());
            let node = nodes[n % nodes.len()].clone();
            // Stagger the workers over one period.
            let offset = period.mul_f64((n * workers + w) as f64 / (vias.len() * workers) as f64);
            tasks.push(tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut allowed = 0u64;
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stopped.wait_for(|s| *s) => break,
                    }
                    let ok = match &via {
                        Via::Node(base) => check(&http, &tally, base, &tenant, &region).await,
                        Via::Envoy(base) => {
                            check_envoy(&http, &tally, base, &tenant, &region).await
                        }
                    };
                    if ok {
                        allowed += 1;
                        if refund_every.is_some_and(|k| allowed.is_multiple_of(k)) {
                            refund(&http, &tally, &node, &tenant, &region).await;
                        }
                    }
                }
            }));
        }
    }
    Stream { stop, tasks }
}

impl Stream {
    /// Stops the stream; returns once its in-flight requests are answered.
    pub async fn stop(self) {
        stop_all(vec![self]).await
    }
}

/// Stops every stream at once, then waits for their in-flight requests.
pub async fn stop_all(streams: Vec<Stream>) {
    for s in &streams {
        let _ = s.stop.send(true);
    }
    for s in streams {
        for t in s.tasks {
            let _ = t.await;
        }
    }
}

/// One `POST /v1/check`; true if allowed.
async fn check(
    http: &reqwest::Client,
    tally: &Tally,
    base: &str,
    tenant: &str,
    region: &str,
) -> bool {
    let started = Instant::now();
    let sent = http
        .post(format!("{base}/v1/check"))
        .json(&json!({ "tenant": tenant, "key": "demo" }))
        .send()
        .await;
    let (status, body) = match sent {
        Ok(r) => {
            let s = r.status().as_u16();
            (s, r.json::<Value>().await.unwrap_or(Value::Null))
        }
        Err(e) => {
            *tally.last_error.lock().unwrap() = Some(format!("{region}: {e}"));
            tally.update(tenant, region, |c| c.errors += 1);
            return false;
        }
    };
    tally.timed(started, || {
        format!("check {tenant} on {base} ({region}): {status}")
    });
    let mode = body["mode"].as_str().unwrap_or("");
    match status {
        200 => {
            tally.update(tenant, region, |c| {
                c.allowed += 1;
                if mode == "local" || mode == "open" {
                    c.fail_mode += 1;
                }
            });
            true
        }
        429 => {
            let tier = body["violated-policy"].as_str().unwrap_or("");
            tally.denied(tenant, region, tier, mode == "view");
            false
        }
        other => {
            *tally.last_error.lock().unwrap() = Some(format!("{region}: HTTP {other}: {body}"));
            tally.update(tenant, region, |c| c.errors += 1);
            false
        }
    }
}

/// One `GET /` through the region's Envoy, the tenant in `x-tenant`; true
/// if allowed. Envoy's 429 has no body: the tier that denied is read from
/// the `RateLimit` header region-node's RLS answered ([`denying_tier`]).
async fn check_envoy(
    http: &reqwest::Client,
    tally: &Tally,
    base: &str,
    tenant: &str,
    region: &str,
) -> bool {
    let started = Instant::now();
    let sent = http
        .get(format!("{base}/"))
        .header("x-tenant", tenant)
        .send()
        .await;
    let r = match sent {
        Ok(r) => r,
        Err(e) => {
            *tally.last_error.lock().unwrap() = Some(format!("{region} (Envoy): {e}"));
            tally.update(tenant, region, |c| c.errors += 1);
            return false;
        }
    };
    let status = r.status().as_u16();
    let state = r
        .headers()
        .get("ratelimit")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let _ = r.bytes().await;
    tally.timed(started, || {
        format!("check {tenant} through Envoy {base} ({region}): {status}")
    });
    match status {
        200 => {
            tally.update(tenant, region, |c| c.allowed += 1);
            true
        }
        429 => {
            let (tier, from_view) = denying_tier(&state).unwrap_or(("", false));
            tally.denied(tenant, region, tier, from_view);
            if tier.is_empty() {
                *tally.last_error.lock().unwrap() =
                    Some(format!("{region} (Envoy): 429 with RateLimit {state:?}"));
            }
            false
        }
        other => {
            *tally.last_error.lock().unwrap() = Some(format!("{region} (Envoy): HTTP {other}"));
            tally.update(tenant, region, |c| c.errors += 1);
            false
        }
    }
}

/// The tier that denied a check of cost 1, from the draft-10 `RateLimit`
/// header of region-node's answer (`"node";r=0;t=1, "region";r=5;t=40,
/// …`): the first of node, region, global with nothing left (a denial
/// reports every tier as before the request). A denial decided from the
/// broadcast view alone, without Redis, reports the global tier only: the
/// second value is then true.
pub fn denying_tier(state: &str) -> Option<(&'static str, bool)> {
    let mut tiers = Vec::new();
    for item in state.split(',') {
        let mut parts = item.trim().split(';');
        let name = parts.next()?.trim().trim_matches('"');
        let remaining = parts
            .find_map(|p| p.trim().strip_prefix("r="))
            .and_then(|r| r.parse::<u64>().ok())?;
        tiers.push((name, remaining));
    }
    let from_view = matches!(tiers.as_slice(), [("global", _)]);
    ["node", "region", "global"]
        .into_iter()
        .find(|t| tiers.iter().any(|(n, r)| n == t && *r == 0))
        .map(|t| (t, from_view))
}

async fn refund(http: &reqwest::Client, tally: &Tally, base: &str, tenant: &str, region: &str) {
    let r = http
        .post(format!("{base}/v1/refund"))
        .json(&json!({ "tenant": tenant, "key": "demo", "cost": 1 }))
        .send()
        .await;
    match r {
        Ok(r) if r.status().is_success() => tally.update(tenant, region, |c| c.refunded += 1),
        Ok(r) => {
            let s = r.status();
            *tally.last_error.lock().unwrap() = Some(format!(
                "{region}: refund HTTP {s}: {}",
                r.text().await.unwrap_or_default()
            ));
            tally.update(tenant, region, |c| c.errors += 1);
        }
        Err(e) => {
            *tally.last_error.lock().unwrap() = Some(format!("{region}: refund: {e}"));
            tally.update(tenant, region, |c| c.errors += 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::denying_tier;

    #[test]
    fn the_denying_tier_is_read_from_the_ratelimit_header() {
        assert_eq!(
            denying_tier(r#""node";r=12;t=1, "region";r=0;t=41, "global";r=997;t=3600"#),
            Some(("region", false))
        );
        assert_eq!(
            denying_tier(r#""node";r=0;t=1, "region";r=0;t=41, "global";r=5;t=9"#),
            Some(("node", false))
        );
        // The script's global budget, with every window left.
        assert_eq!(
            denying_tier(r#""node";r=3;t=1, "region";r=90;t=41, "global";r=0;t=9"#),
            Some(("global", false))
        );
        // The broadcast view alone: only the global tier is reported.
        assert_eq!(
            denying_tier(r#""global";r=0;t=40556"#),
            Some(("global", true))
        );
        assert_eq!(denying_tier(r#""node";r=3;t=1"#), None);
        assert_eq!(denying_tier(""), None);
    }
}
