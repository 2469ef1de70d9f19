//! Histories of client operations and the checker that judges them, in the
//! manner of Jepsen: every client records what it asked and what it was
//! told; after the run the checker verifies the system's promises against
//! that record (and against the regions' Redis, the ground truth of what was
//! charged), exactly, not approximately.
//!
//! An operation whose answer never arrived (connection reset by a killed
//! node, timeout) is recorded as [`Outcome::Unknown`]: it may or may not have
//! been applied, and every check treats it as either, bounding the result by
//! the number of such operations instead of guessing.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tierlimit_shared::period::{Period, PeriodKind};

pub use testkit::now_us;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Check,
    Refund,
}

/// What the client was told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// 200. `mode` is how the node decided: `redis`, `local`, `open`.
    Ok { mode: String },
    /// 429, with the tier that denied and the mode (`redis`, `view`, `local`).
    Denied { tier: String, mode: String },
    /// 503: the region's Redis is down and the plan fails closed.
    Unavailable,
    /// No answer (connection error, timeout) or an unexpected status: the
    /// operation may or may not have taken effect.
    Unknown(String),
}

/// One tier as reported in a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierInfo {
    pub tier: String,
    pub limit: u64,
    pub remaining: u64,
    pub reset_ms: u64,
    pub window_ms: u64,
    /// A global tier's period kind (`day`, `hour`, `week`, `month`).
    pub period: Option<String>,
}

/// One client operation.
#[derive(Debug, Clone)]
pub struct Event {
    /// When the request was sent and when the answer arrived (µs since the
    /// epoch): the decision happened somewhere in between.
    pub start_us: u64,
    pub end_us: u64,
    pub region: String,
    pub node: String,
    pub tenant: String,
    pub cost: u64,
    pub op: Op,
    pub outcome: Outcome,
    pub tiers: Vec<TierInfo>,
    /// A refund answered 200: the units the node says it gave back to the
    /// day's count (`refunded`; without Redis, only what it had charged in
    /// local mode).
    pub refunded: Option<u64>,
}

impl Event {
    pub fn allowed(&self) -> bool {
        matches!(self.outcome, Outcome::Ok { .. })
    }

    pub fn unknown(&self) -> bool {
        matches!(self.outcome, Outcome::Unknown(_))
    }

    pub fn mode(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Ok { mode } | Outcome::Denied { mode, .. } => Some(mode),
            _ => None,
        }
    }

    /// Allowed and counted in the global tier (by the decision script, or
    /// by a node's local actor). `open` mode allows without counting.
    pub fn counted(&self) -> bool {
        matches!(&self.outcome, Outcome::Ok { mode } if mode == "redis" || mode == "local")
    }

    /// Answered from a fail mode (`open`, `local`, 503) after waiting at
    /// least `slow_us`: the node gave up on a Redis call whose outcome it
    /// does not know.
    pub fn answered_after_store_timeout(&self, slow_us: u64) -> bool {
        let fail_mode = matches!(&self.outcome, Outcome::Ok { mode } if mode == "open" || mode == "local")
            || self.outcome == Outcome::Unavailable;
        fail_mode && self.end_us - self.start_us >= slow_us
    }

    pub fn tier(&self, name: &str) -> Option<&TierInfo> {
        self.tiers.iter().find(|t| t.tier == name)
    }
}

/// A shared, append-only history.
#[derive(Debug, Clone, Default)]
pub struct History(Arc<Mutex<Vec<Event>>>);

impl History {
    pub fn new() -> History {
        History::default()
    }

    pub fn push(&self, e: Event) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(e);
    }

    /// A copy of every event so far, in completion order.
    pub fn events(&self) -> Vec<Event> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sum of costs of checks of `tenant` allowed so far.
    pub fn allowed(&self, tenant: &str) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|e| e.op == Op::Check && e.tenant == tenant && e.allowed())
            .map(|e| e.cost)
            .sum()
    }
}

/// A client of one region-node that records every operation.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    history: History,
    pub region: String,
    pub node: String,
    /// `http://ip:port`
    pub base: String,
}

impl Client {
    pub fn new(history: History, region: &str, node: &str, base: &str) -> Client {
        Client {
            http: reqwest::Client::builder()
                .no_proxy()
                .default_headers(testkit::harness_headers())
                .timeout(Duration::from_secs(3))
                .pool_max_idle_per_host(4)
                .build()
                .expect("reqwest client"),
            history,
            region: region.into(),
            node: node.into(),
            base: base.into(),
        }
    }

    pub async fn check(&self, tenant: &str, cost: u64) -> Outcome {
        self.call(Op::Check, tenant, cost).await
    }

    pub async fn refund(&self, tenant: &str, cost: u64) -> Outcome {
        self.call(Op::Refund, tenant, cost).await
    }

    async fn call(&self, op: Op, tenant: &str, cost: u64) -> Outcome {
        let path = match op {
            Op::Check => "/v1/check",
            Op::Refund => "/v1/refund",
        };
        let start_us = now_us();
        let mut refunded = None;
        let res = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&serde_json::json!({ "tenant": tenant, "cost": cost }))
            .send()
            .await;
        let (outcome, tiers) = match res {
            Err(e) => (Outcome::Unknown(e.to_string()), Vec::new()),
            Ok(r) => {
                let status = r.status().as_u16();
                match r.json::<Value>().await {
                    Err(e) => (
                        Outcome::Unknown(format!("status {status}, body: {e}")),
                        Vec::new(),
                    ),
                    Ok(body) => {
                        if op == Op::Refund && status == 200 {
                            refunded = body["refunded"].as_u64();
                        }
                        let tiers = parse_tiers(&body);
                        let mode = body["mode"].as_str().unwrap_or("").to_string();
                        let outcome = match status {
                            200 => Outcome::Ok { mode },
                            429 => Outcome::Denied {
                                tier: body["violated-policy"].as_str().unwrap_or("").to_string(),
                                mode,
                            },
                            503 => Outcome::Unavailable,
                            s => Outcome::Unknown(format!("status {s}: {body}")),
                        };
                        (outcome, tiers)
                    }
                }
            }
        };
        let end_us = now_us();
        self.history.push(Event {
            start_us,
            end_us,
            region: self.region.clone(),
            node: self.node.clone(),
            tenant: tenant.into(),
            cost,
            op,
            outcome: outcome.clone(),
            tiers,
            refunded,
        });
        outcome
    }
}

fn parse_tiers(body: &Value) -> Vec<TierInfo> {
    body["tiers"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| TierInfo {
                    tier: t["tier"].as_str().unwrap_or("").into(),
                    limit: t["limit"].as_u64().unwrap_or(0),
                    remaining: t["remaining"].as_u64().unwrap_or(0),
                    reset_ms: t["reset_ms"].as_u64().unwrap_or(0),
                    window_ms: t["window_ms"].as_u64().unwrap_or(0),
                    period: t["period"].as_str().map(str::to_string),
                })
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------

/// Counts per (region, node, outcome) of `tenant`'s checks, for the log.
pub fn summary(events: &[Event], tenant: &str) -> String {
    let mut m: BTreeMap<(String, String), BTreeMap<String, u64>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.tenant == tenant) {
        let k = match (&e.op, &e.outcome) {
            (Op::Refund, Outcome::Ok { mode }) => format!("refund-{mode}"),
            (Op::Refund, _) => "refund-other".into(),
            (Op::Check, Outcome::Ok { mode }) => format!("ok-{mode}"),
            (Op::Check, Outcome::Denied { tier, mode }) => format!("denied-{tier}-{mode}"),
            (Op::Check, Outcome::Unavailable) => "503".into(),
            (Op::Check, Outcome::Unknown(_)) => "unknown".into(),
        };
        *m.entry((e.region.clone(), e.node.clone()))
            .or_default()
            .entry(k)
            .or_default() += e.cost;
    }
    let mut s = format!("history of tenant {tenant}:\n");
    for ((r, n), counts) in m {
        let parts: Vec<String> = counts.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(s, "  {r}/{n}: {}", parts.join(" "));
    }
    s
}

// ---------------------------------------------------------------------------
// Check 1: node and region tiers never exceed their limit in any window
// ---------------------------------------------------------------------------

/// Which fixed window of length `w` ms a decision fell in, from the client's
/// time bracket and the `reset_ms` the server reported: the window ends
/// `reset_ms` after the decision, so its end is a multiple of `w` within
/// `[start + reset, end + reset]`. An error if that bracket holds no
/// multiple or several (only when a request took longer than a window).
pub fn window_of(start_us: u64, end_us: u64, reset_ms: u64, w: u64) -> Result<u64, String> {
    match windows_of(start_us, end_us, reset_ms, w)? {
        (a, b) if a == b => Ok(a),
        (a, b) => Err(format!("{} candidate windows", b - a + 1)),
    }
}

pub use testkit::windows_of;

/// What one tier did, per scope and window.
#[derive(Debug, Default)]
pub struct TierReport {
    pub tier: String,
    pub limit: u64,
    /// (scope, window index) → units allowed there.
    pub usage: BTreeMap<(String, u64), u64>,
    /// Allowed operations that could not be placed in any window.
    pub unplaced: Vec<String>,
    /// Allowed operations that took longer than a window, so that two
    /// windows are possible: each is counted in the one of its candidates
    /// that was least used (a violation is one no placement avoids).
    pub ambiguous: u64,
    /// Windows where more than `limit` was allowed: the violations.
    pub violations: Vec<String>,
    /// Allowed units not checked because their window overlaps a skipped
    /// time range (e.g. the region's Redis lost its counters then).
    pub skipped: u64,
}

impl TierReport {
    pub fn max_usage(&self) -> u64 {
        self.usage.values().copied().max().unwrap_or(0)
    }

    /// Windows that were filled to the limit (proof the tier really bit).
    pub fn full_windows(&self) -> usize {
        self.usage.values().filter(|u| **u >= self.limit).count()
    }

    pub fn describe(&self) -> String {
        format!(
            "{} tier (limit {} per window): {} (scope, window) pairs, max usage {}, {} full, {} unplaced, {} slower than a window, {} skipped, {} violations",
            self.tier,
            self.limit,
            self.usage.len(),
            self.max_usage(),
            self.full_windows(),
            self.unplaced.len(),
            self.ambiguous,
            self.skipped,
            self.violations.len()
        )
    }
}

/// Checks that the `tier` ("node" or "region") of `tenant`, a fixed window
/// of `limit` per `window_ms`, never allowed more than `limit` in one window
/// of one scope (a node for the node tier, a region for the region tier),
/// counting only decisions made in the given modes (`redis`: the shared
/// tiers; `local`: each node on its own, where the region tier is the
/// node's share, so pass the share as `limit` and "node" scoping via
/// `per_node`). Windows overlapping one of the `skip` ranges (µs) are not
/// checked.
#[allow(clippy::too_many_arguments)]
pub fn check_fixed_window_tier(
    events: &[Event],
    tenant: &str,
    tier: &str,
    limit: u64,
    window_ms: u64,
    modes: &[&str],
    per_node: bool,
    skip: &[(u64, u64)],
) -> TierReport {
    let mut r = TierReport {
        tier: format!("{tier} ({})", modes.join("/")),
        limit,
        ..TierReport::default()
    };
    let mut ambiguous = Vec::new();
    for e in events {
        if e.tenant != tenant || e.op != Op::Check || !e.allowed() {
            continue;
        }
        if !e.mode().is_some_and(|m| modes.contains(&m)) {
            continue;
        }
        let Some(t) = e.tier(tier) else {
            r.unplaced
                .push(format!("{e:?}: no {tier} tier in the reply"));
            continue;
        };
        assert_eq!(
            t.window_ms, window_ms,
            "{tier} tier window in the reply: {e:?}"
        );
        let (first, last) = match windows_of(e.start_us, e.end_us, t.reset_ms, window_ms) {
            Ok(w) => w,
            Err(why) => {
                r.unplaced.push(format!("{why}: {e:?}"));
                continue;
            }
        };
        let (ws, we) = (first * window_ms * 1000, (last + 1) * window_ms * 1000);
        if skip.iter().any(|(a, b)| *a < we && *b >= ws) {
            r.skipped += e.cost;
            continue;
        }
        let scope = if per_node || tier == "node" {
            format!("{}/{}", e.region, e.node)
        } else {
            e.region.clone()
        };
        if first == last {
            *r.usage.entry((scope, first)).or_default() += e.cost;
        } else {
            ambiguous.push((scope, first, last, e.cost));
        }
    }
    // Decisions slower than a window, placed after every certain one.
    for (scope, first, last, cost) in ambiguous {
        let idx = (first..=last)
            .min_by_key(|i| r.usage.get(&(scope.clone(), *i)).copied().unwrap_or(0))
            .expect("first <= last");
        *r.usage.entry((scope, idx)).or_default() += cost;
        r.ambiguous += 1;
    }
    for ((scope, idx), used) in &r.usage {
        if *used > limit {
            r.violations.push(format!(
                "{tier} tier of {scope}: {used} allowed in window {idx} (limit {limit})"
            ));
        }
    }
    r
}

/// Units of `tenant` allowed by Redis in window `idx` of the `tier` within
/// `scope`, and the units of operations that may have been charged there
/// without the client being told so: no answer, or a fail-mode answer after
/// a store timeout of `slow` (overlapping the window).
pub fn usage_in_window(
    events: &[Event],
    tenant: &str,
    tier: &str,
    window_ms: u64,
    idx: u64,
    slow: Duration,
    scope: impl Fn(&Event) -> bool,
) -> (u64, u64) {
    let slow_us = slow.as_micros() as u64;
    let (w_start, w_end) = (idx * window_ms * 1000, (idx + 1) * window_ms * 1000);
    let mut used = 0;
    let mut unknown = 0;
    for e in events
        .iter()
        .filter(|e| e.tenant == tenant && e.op == Op::Check && scope(e))
    {
        if e.allowed() && e.mode() == Some("redis") {
            if let Some(t) = e.tier(tier) {
                if window_of(e.start_us, e.end_us, t.reset_ms, window_ms) == Ok(idx) {
                    used += e.cost;
                }
            }
        } else if (e.unknown() || e.answered_after_store_timeout(slow_us))
            && e.start_us < w_end
            && e.end_us >= w_start
        {
            unknown += e.cost;
        }
    }
    (used, unknown)
}

// ---------------------------------------------------------------------------
// Check 2: the global count is exact
// ---------------------------------------------------------------------------

/// What the history says the global count of a tenant must be.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GlobalExpectation {
    /// Units allowed and counted (modes `redis` and `local`).
    pub counted: u64,
    /// Units refunded (answered refunds in modes `redis` and `local`).
    pub refunded: u64,
    /// Units allowed in `open` mode (not counted by design).
    pub open: u64,
    /// Checks without an answer: each may have been charged.
    pub unknown_checks: u64,
    /// Refunds without an answer: each may have been applied.
    pub unknown_refunds: u64,
    /// Checks answered from a fail mode (`open`, `local`, 503) after
    /// waiting for the store timeout: their `EVALSHA` was sent and its
    /// outcome is unknown to the node, so Redis may have charged them too.
    pub indeterminate: u64,
    /// Refunds whose effect the answer does not tell: answered `open` (a
    /// no-op for an `open` plan, but applied to the node's local actor for a
    /// `local` plan, which also answers `"mode": "open"`), or answered from
    /// a fail mode after a store timeout (Redis may have applied it).
    pub maybe_refunded: u64,
}

impl GlobalExpectation {
    /// The exact expected count when nothing is unknown.
    pub fn net(&self) -> u64 {
        self.counted - self.refunded
    }

    /// The range the true count must lie in.
    pub fn range(&self) -> (u64, u64) {
        (
            self.net()
                .saturating_sub(self.unknown_refunds + self.maybe_refunded),
            self.net() + self.unknown_checks + self.indeterminate,
        )
    }

    /// True when the history pins the count to one value.
    pub fn is_exact(&self) -> bool {
        self.unknown_checks == 0
            && self.unknown_refunds == 0
            && self.indeterminate == 0
            && self.maybe_refunded == 0
    }
}

/// What the history of `tenant` says its global count must be. A check
/// answered from a fail mode that took at least `store_timeout` waited for
/// a Redis answer that never came: it counts as [`GlobalExpectation::indeterminate`].
pub fn global_expectation(
    events: &[Event],
    tenant: &str,
    store_timeout: Duration,
) -> GlobalExpectation {
    let mut g = GlobalExpectation::default();
    let slow = store_timeout.as_micros() as u64;
    for e in events.iter().filter(|e| e.tenant == tenant) {
        if e.op == Op::Check && e.answered_after_store_timeout(slow) {
            g.indeterminate += e.cost;
        }
        if e.op == Op::Refund
            && (matches!(&e.outcome, Outcome::Ok { mode } if mode == "open")
                || e.answered_after_store_timeout(slow))
        {
            g.maybe_refunded += e.cost;
            continue;
        }
        match (e.op, &e.outcome) {
            (Op::Check, Outcome::Ok { mode }) if mode == "open" => g.open += e.cost,
            (Op::Check, _) if e.counted() => g.counted += e.cost,
            (Op::Check, Outcome::Unknown(_)) => g.unknown_checks += e.cost,
            (Op::Refund, Outcome::Ok { mode }) if mode == "redis" || mode == "local" => {
                g.refunded += e.refunded.unwrap_or(e.cost)
            }
            (Op::Refund, Outcome::Unknown(_)) => g.unknown_refunds += e.cost,
            _ => {}
        }
    }
    g
}

// ---------------------------------------------------------------------------
// Check 3: global overshoot within the design's bound
// ---------------------------------------------------------------------------

/// The global overshoot of a run and the bound the design gives for it.
///
/// The argument: a region enforces `own exact count + others as last seen
/// ≤ limit`. Take region r's last allowed check, decided at τ_r. Nothing of
/// r was allowed after it, so the final total is r's count at τ_r plus the
/// others' final count, and
/// `total − limit ≤ others(final) − others_seen_by_r(τ_r)`.
/// r's view at τ_r holds every unit the others allowed before `τ_r − S`,
/// where S is the staleness of that view (flush, aggregation, broadcast and
/// transport, plus the length of any fault that stopped it). So the
/// overshoot is at most what the other regions allowed after `τ_r − S`: the
/// design's "others' traffic × staleness". This holds for every region that
/// allowed anything, so the bound is the smallest of them.
#[derive(Debug, Clone)]
pub struct Overshoot {
    pub limit: u64,
    pub allowed: u64,
    pub overshoot: u64,
    /// (region, staleness S of its view, last allowed at (ms since the first
    /// event), others' units allowed at or after `last − S` = the bound this
    /// region gives).
    pub per_region: Vec<(String, Duration, u64, u64)>,
    pub bound: u64,
}

impl Overshoot {
    pub fn describe(&self) -> String {
        let mut s = format!(
            "global overshoot: allowed {} of limit {} => overshoot {}; bound = others' traffic within the staleness = {}\n",
            self.allowed, self.limit, self.overshoot, self.bound
        );
        for (r, st, at, b) in &self.per_region {
            let _ = writeln!(
                s,
                "  {r}: staleness {:.2}s, last allowed at +{:.2}s, others allowed since (last - staleness): {b}",
                st.as_secs_f64(),
                *at as f64 / 1000.0
            );
        }
        s
    }

    pub fn within_bound(&self) -> bool {
        self.overshoot <= self.bound
    }
}

/// Computes [`Overshoot`] for `tenant` (no refunds on it), given the
/// staleness of each region's view of the others at the moment of its last
/// allowed check (`staleness(region, τ_r)`, τ_r in µs as [`now_us`]): a
/// fault makes a view stale only while it lasts and until it has caught up.
pub fn overshoot(
    events: &[Event],
    tenant: &str,
    limit: u64,
    staleness: impl Fn(&str, u64) -> Duration,
) -> Overshoot {
    let checks: Vec<&Event> = events
        .iter()
        .filter(|e| e.tenant == tenant && e.op == Op::Check)
        .collect();
    let t0 = checks.iter().map(|e| e.start_us).min().unwrap_or(0);
    let allowed: u64 = checks.iter().filter(|e| e.counted()).map(|e| e.cost).sum();
    let mut regions: Vec<String> = checks.iter().map(|e| e.region.clone()).collect();
    regions.sort();
    regions.dedup();
    let mut per_region = Vec::new();
    for r in &regions {
        let Some(last) = checks
            .iter()
            .filter(|e| &e.region == r && e.counted())
            .map(|e| e.start_us)
            .max()
        else {
            continue;
        };
        let st = staleness(r, last);
        let s_us = st.as_micros() as u64;
        let since = last.saturating_sub(s_us);
        // Others' units that r's view may have missed: allowed (or maybe
        // allowed) at or after `since`; plus r's own unanswered checks after
        // its last known allowed one.
        let others: u64 = checks
            .iter()
            .filter(|e| &e.region != r && (e.counted() || e.unknown()) && e.end_us >= since)
            .map(|e| e.cost)
            .sum();
        let own_unknown: u64 = checks
            .iter()
            .filter(|e| &e.region == r && e.unknown() && e.end_us >= last)
            .map(|e| e.cost)
            .sum();
        per_region.push((r.clone(), st, (last - t0) / 1000, others + own_unknown));
    }
    let bound = per_region.iter().map(|(_, _, _, b)| *b).min().unwrap_or(0);
    Overshoot {
        limit,
        allowed,
        overshoot: allowed.saturating_sub(limit),
        per_region,
        bound,
    }
}

// ---------------------------------------------------------------------------
// Check 2 and 3 per calendar period
// ---------------------------------------------------------------------------

/// The period of `kind` whose global tier decided `e`, from its reply: that
/// tier reports `reset_ms` until its period's end, in the clock that
/// decided, which runs `offset_ms` ahead of this machine's. The decision
/// came between the request and its answer, so `start + offset + reset`
/// lies within the time bracket before the period's end, hence in the
/// period (a bracket is far shorter than any period). `Err` when the reply
/// names no such tier, or one whose length is not its period's.
pub fn period_of(e: &Event, kind: PeriodKind, offset_ms: i64) -> Result<Period, String> {
    let t = e
        .tiers
        .iter()
        .find(|t| t.tier == "global" && t.period.as_deref() == Some(kind.name()))
        .ok_or_else(|| format!("no global {} tier in the reply", kind.name()))?;
    let end_est = (e.start_us / 1000).saturating_add_signed(offset_ms) + t.reset_ms;
    let p = kind.at(end_est.saturating_sub(1));
    if p.len_ms() != t.window_ms {
        return Err(format!(
            "the {} tier's window_ms {} is not the length of {} ({} ms)",
            kind.name(),
            t.window_ms,
            p.human(),
            p.len_ms()
        ));
    }
    Ok(p)
}

/// The operations of `tenant` that belong to `period`: each answered
/// operation by the period its reply names ([`period_of`]), the others
/// (no answer, 503, a denial without tiers) wherever their time bracket, in
/// the deciding clock (`offset_ms` ahead), overlaps `period`, since they
/// may have been decided anywhere in it. Second: operations whose effect
/// cannot be placed (an allowed check or a refund whose reply names no
/// period of that kind), each with why.
pub fn events_in_period(
    events: &[Event],
    tenant: &str,
    period: Period,
    offset_ms: i64,
) -> (Vec<Event>, Vec<String>) {
    let mut inside = Vec::new();
    let mut unplaced = Vec::new();
    for e in events.iter().filter(|e| e.tenant == tenant) {
        match period_of(e, period.kind, offset_ms) {
            Ok(p) => {
                if p == period {
                    inside.push(e.clone());
                }
            }
            Err(why) if e.allowed() => unplaced.push(format!("{why}: {e:?}")),
            Err(_) => {
                let at = |us: u64| (us / 1000).saturating_add_signed(offset_ms);
                let (from, to) = (at(e.start_us), at(e.end_us));
                if (from as i64) < period.end_ms() && (to as i64) >= period.start_ms() {
                    inside.push(e.clone());
                }
            }
        }
    }
    (inside, unplaced)
}

// ---------------------------------------------------------------------------
// How far behind a node's view of the global count was
// ---------------------------------------------------------------------------

/// How far behind the clients' record a node's view of `tenant`'s global
/// total was when it was asked at `t_us` and answered `view_total`: the
/// time since the first unit the view does not hold was certainly allowed
/// (its answer had arrived), 0 when the view holds every unit answered by
/// then. Measured against the history, not the node's own age metric, so
/// a slow publisher, aggregator or follower shows whatever the node
/// believes about its view.
pub fn view_lag_us(events: &[Event], tenant: &str, t_us: u64, view_total: u64) -> u64 {
    let mut ends: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| e.tenant == tenant && e.op == Op::Check && e.counted() && e.end_us <= t_us)
        .map(|e| (e.end_us, e.cost))
        .collect();
    ends.sort_unstable();
    let mut held = 0;
    for (end, cost) in ends {
        held += cost;
        if held > view_total {
            return t_us - end;
        }
    }
    0
}

// ---------------------------------------------------------------------------
// Check 4: a partial rollback loses at most what was not yet published
// ---------------------------------------------------------------------------

/// What a partial rollback of a region's Redis (an older snapshot coming
/// back under the same epoch) did to one tenant, judged from the clients'
/// record alone.
///
/// The promise (README, failure table): the counter is raised back to what
/// the region already published before the next charge, so nothing
/// published is lost and nothing is re-admitted against the global limit
/// beyond what was erased unpublished. The loss it accepts is, from what
/// the clients saw:
///
/// - `unpublished`: units allowed after the last publication the test saw
///   acknowledged (the aggregator's total equal to everything allowed so
///   far) and before the rollback: erased before any publication;
/// - `before_raise`: units allowed after the rollback and before the test
///   saw the region's view hold the counter again (only for a tenant the
///   view did not hold: the script cannot raise what it is not given, so
///   those charges land inside the erased range and the max-merge absorbs
///   them);
/// - `unknown`: checks without an answer in either span (maybe charged).
///
/// Nothing beyond that may be lost (`allowed − total ≤ bound`), nothing may
/// be counted that no client was allowed (`total ≤ allowed + unknown`), and
/// the global tier may re-admit only the erased units
/// (`allowed ≤ limit + bound`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RollbackLoss {
    pub tenant: String,
    /// Units allowed and counted, in the whole history.
    pub allowed: u64,
    pub unpublished: u64,
    pub before_raise: u64,
    pub unknown: u64,
    /// The aggregator's total once drained.
    pub total: u64,
    /// The tenant's global limit, if it has one.
    pub limit: Option<u64>,
}

impl RollbackLoss {
    /// The loss the design accepts.
    pub fn bound(&self) -> u64 {
        self.unpublished + self.before_raise + self.unknown
    }

    /// Units the clients were allowed that the global count does not hold.
    pub fn lost(&self) -> u64 {
        self.allowed.saturating_sub(self.total)
    }

    /// Every broken promise, empty when the rollback stayed within bounds.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.total > self.allowed + self.unknown {
            v.push(format!(
                "{}: total {} counts more than the {} allowed (+{} unknown)",
                self.tenant, self.total, self.allowed, self.unknown
            ));
        }
        if self.lost() > self.bound() {
            v.push(format!(
                "{}: lost {} > accepted loss {} (unpublished {}, before the raise {}, unknown {})",
                self.tenant,
                self.lost(),
                self.bound(),
                self.unpublished,
                self.before_raise,
                self.unknown
            ));
        }
        if let Some(l) = self.limit {
            if self.allowed > l + self.bound() {
                v.push(format!(
                    "{}: {} allowed > limit {l} + accepted loss {}: re-admitted beyond the erased units",
                    self.tenant,
                    self.allowed,
                    self.bound()
                ));
            }
        }
        v
    }

    pub fn describe(&self) -> String {
        format!(
            "{}: allowed {}, total {} => lost {}; accepted loss {} = unpublished {} + before the raise {} + unknown {}; limit {:?}",
            self.tenant,
            self.allowed,
            self.total,
            self.lost(),
            self.bound(),
            self.unpublished,
            self.before_raise,
            self.unknown,
            self.limit
        )
    }
}

/// Judges a partial rollback of `tenant` (see [`RollbackLoss`]).
/// `published_us`: when the test saw the aggregator hold everything allowed
/// so far; `rollback_us`: when the older snapshot was back in place;
/// `raise_seen_us`: when the test saw the node's view hold the tenant's
/// published part again, `None` when the view held it throughout (the
/// script raises before the first charge). An operation whose time bracket
/// overlaps a span counts in it.
pub fn rollback_loss(
    events: &[Event],
    tenant: &str,
    published_us: u64,
    rollback_us: u64,
    raise_seen_us: Option<u64>,
    total: u64,
    limit: Option<u64>,
) -> RollbackLoss {
    let mut r = RollbackLoss {
        tenant: tenant.into(),
        total,
        limit,
        ..RollbackLoss::default()
    };
    let in_span = |e: &Event, from: u64, to: u64| e.end_us > from && e.start_us < to;
    for e in events
        .iter()
        .filter(|e| e.tenant == tenant && e.op == Op::Check)
    {
        let unpublished = in_span(e, published_us, rollback_us);
        let before_raise = raise_seen_us.is_some_and(|to| in_span(e, rollback_us, to));
        if e.counted() {
            r.allowed += e.cost;
            if unpublished {
                r.unpublished += e.cost;
            } else if before_raise {
                r.before_raise += e.cost;
            }
        } else if e.unknown() && (unpublished || before_raise) {
            r.unknown += e.cost;
        }
    }
    r
}

/// A failover to a replica that lacks the last writes its master
/// acknowledged (replication is asynchronous) is a partial rollback of the
/// tenant's keys, judged the same way ([`rollback_loss`]): `synced_us` is
/// the last moment the replication offsets showed the replica holding
/// everything the master had acknowledged (the role the last publication
/// plays there), `killed_us` when the master was killed. Units the clients
/// were allowed between the two are the acknowledged-not-replicated writes:
/// a windowed tier (`limit`) may re-admit at most them, and the global
/// count may lose at most them (plus, for a tenant its view does not hold,
/// what was charged before the raise, `raise_seen_us`).
pub fn failover_loss(
    events: &[Event],
    tenant: &str,
    synced_us: u64,
    killed_us: u64,
    raise_seen_us: Option<u64>,
    total: u64,
    limit: Option<u64>,
) -> RollbackLoss {
    rollback_loss(
        events,
        tenant,
        synced_us,
        killed_us,
        raise_seen_us,
        total,
        limit,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_of_places_exactly() {
        // Decision at 10_500 ms, window 1000: reset 500, window 10.
        assert_eq!(window_of(10_499_000, 10_501_000, 500, 1000), Ok(10));
        // Bracket spanning a boundary, resolved by reset.
        assert_eq!(window_of(10_999_500, 11_000_700, 1, 1000), Ok(10));
        assert_eq!(window_of(10_999_500, 11_000_700, 1000, 1000), Ok(11));
        assert!(window_of(10_000_000, 13_000_000, 500, 1000).is_err());
        assert_eq!(windows_of(10_000_000, 11_200_000, 900, 1000), Ok((10, 11)));
    }

    #[test]
    fn a_decision_slower_than_a_window_goes_where_it_fits() {
        let allowed = |at_ms: u64, took_ms: u64, reset_ms: u64| {
            let mut e = ev(
                "eu",
                at_ms,
                Outcome::Ok {
                    mode: "redis".into(),
                },
            );
            e.tenant = "x".into();
            e.end_us = (at_ms + took_ms) * 1000;
            e.tiers = vec![TierInfo {
                tier: "region".into(),
                limit: 2,
                remaining: 0,
                reset_ms,
                window_ms: 1000,
                period: None,
            }];
            e
        };
        // Window 10 full (2 of 2); one decision sent at 10.4 s took 1.2 s
        // and says 600 ms remained of its window: window 10 or 11.
        let mut h = vec![allowed(10_100, 1, 899), allowed(10_200, 1, 799)];
        h.push(allowed(10_400, 1200, 600));
        let r = check_fixed_window_tier(&h, "x", "region", 2, 1000, &["redis"], false, &[]);
        assert_eq!((r.ambiguous, r.unplaced.len()), (1, 0));
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert_eq!(r.usage.get(&("eu".to_string(), 11)), Some(&1));
        // With window 11 full too, no placement fits: a violation.
        h.push(allowed(11_100, 1, 899));
        h.push(allowed(11_200, 1, 799));
        let r = check_fixed_window_tier(&h, "x", "region", 2, 1000, &["redis"], false, &[]);
        assert_eq!(r.violations.len(), 1, "{:?}", r.violations);
    }

    fn ev(region: &str, at_ms: u64, outcome: Outcome) -> Event {
        Event {
            start_us: at_ms * 1000,
            end_us: at_ms * 1000 + 1000,
            region: region.into(),
            node: "a".into(),
            tenant: "g".into(),
            cost: 1,
            op: Op::Check,
            outcome,
            tiers: Vec::new(),
            refunded: None,
        }
    }

    #[test]
    fn expectation_widens_only_for_ambiguous_operations() {
        let ok = |mode: &str| Outcome::Ok { mode: mode.into() };
        let mut h = vec![
            ev("eu", 0, ok("redis")),
            ev("eu", 10, ok("local")),
            ev("eu", 20, ok("open")),
        ];
        let mut refund = ev("eu", 30, ok("redis"));
        refund.op = Op::Refund;
        h.push(refund);
        let g = global_expectation(&h, "g", Duration::from_millis(250));
        assert_eq!((g.counted, g.refunded, g.open), (2, 1, 1));
        assert!(g.is_exact());
        assert_eq!(g.range(), (1, 1));
        // A local answer after a store timeout may also be charged in Redis;
        // a refund answered `open` may have been applied locally.
        let mut slow = ev("eu", 40, ok("local"));
        slow.end_us = slow.start_us + 300_000;
        let mut open_refund = ev("eu", 50, ok("open"));
        open_refund.op = Op::Refund;
        h.extend([slow, open_refund]);
        let g = global_expectation(&h, "g", Duration::from_millis(250));
        assert_eq!((g.indeterminate, g.maybe_refunded), (1, 1));
        assert_eq!(g.range(), (1, 3));
    }

    /// eu allowed at 0, 100, … 900 ms, us at 50, 150, … 950 ms.
    fn eu_and_us_alternating() -> Vec<Event> {
        let ok = || Outcome::Ok {
            mode: "redis".into(),
        };
        (0..10)
            .flat_map(|t| [ev("eu", t * 100, ok()), ev("us", t * 100 + 50, ok())])
            .collect()
    }

    #[test]
    fn overshoot_bound_is_others_traffic_within_staleness() {
        let h = eu_and_us_alternating();
        let s = Duration::from_millis(300);
        let o = overshoot(&h, "g", 15, |_, _| s);
        assert_eq!(o.allowed, 20);
        assert_eq!(o.overshoot, 5);
        // eu's last at 900: us allowed at 650, 750, 850, 950 (end ≥ 600).
        assert_eq!(o.per_region[0], ("eu".to_string(), s, 900, 4));
        // us's last at 950: eu allowed at 700, 800, 900 (end ≥ 650).
        assert_eq!(o.per_region[1], ("us".to_string(), s, 950, 3));
        assert_eq!(o.bound, 3);
        assert!(!o.within_bound());
    }

    #[test]
    fn staleness_is_asked_at_each_regions_last_allowed_check() {
        let h = eu_and_us_alternating();
        // A fault that makes only views asked after 920 ms staler: eu's
        // last check (900 ms) is judged without it, us's (950 ms) with it.
        let asked = std::sync::Mutex::new(Vec::new());
        let o = overshoot(&h, "g", 15, |r, at| {
            asked.lock().unwrap().push((r.to_string(), at));
            Duration::from_millis(if at > 920_000 { 600 } else { 300 })
        });
        assert_eq!(
            asked.into_inner().unwrap(),
            [("eu".to_string(), 900_000), ("us".to_string(), 950_000)]
        );
        // eu: us's units ending at or after 600 (650..950: 4).
        assert_eq!(o.per_region[0].3, 4);
        // us: eu's units ending at or after 350 (400..900: 6).
        assert_eq!(o.per_region[1].3, 6);
    }

    #[test]
    fn rollback_loss_is_what_was_unpublished_or_charged_before_the_raise() {
        let ok = || Outcome::Ok {
            mode: "redis".into(),
        };
        // 10 before the publication at 100 ms, 3 after it, rollback at 200,
        // 1 before the raise seen at 300, 4 after.
        let mut h: Vec<Event> = (0..10).map(|t| ev("eu", t * 5, ok())).collect();
        h.extend((0..3).map(|t| ev("eu", 120 + t * 5, ok())));
        h.push(ev("eu", 250, ok()));
        h.extend((0..4).map(|t| ev("eu", 400 + t * 5, ok())));
        let r = rollback_loss(&h, "g", 100_000, 200_000, Some(300_000), 14, Some(14));
        assert_eq!((r.allowed, r.unpublished, r.before_raise), (18, 3, 1));
        assert_eq!((r.lost(), r.bound()), (4, 4));
        assert!(r.violations().is_empty(), "{:?}", r.violations());
        // One more lost than accepted; one counted that nobody was allowed;
        // a limit re-admitted beyond the erased units.
        assert_eq!(
            rollback_loss(&h, "g", 100_000, 200_000, Some(300_000), 13, None)
                .violations()
                .len(),
            1
        );
        assert_eq!(
            rollback_loss(&h, "g", 100_000, 200_000, Some(300_000), 19, None)
                .violations()
                .len(),
            1
        );
        assert_eq!(
            rollback_loss(&h, "g", 100_000, 200_000, None, 14, Some(13))
                .violations()
                .len(),
            2
        );
    }

    #[test]
    fn an_answer_belongs_to_the_period_its_reply_names() {
        // The deciding clock runs 1000 s ahead; November 2026 ends at
        // `end` in it. A decision 300 ms before the end (bracket 10 ms)
        // and one 200 ms after it.
        let offset_ms = 1_000_000;
        let nov = PeriodKind::Month.at(1_795_000_000_000);
        let end = nov.end_ms() as u64;
        let month = |at_ms: u64, period: Period| TierInfo {
            tier: "global".into(),
            limit: 300,
            remaining: 1,
            reset_ms: period.end_ms() as u64 - at_ms,
            window_ms: period.len_ms(),
            period: Some("month".into()),
        };
        let decided = |at_ms: u64, period: Period| {
            let mut e = ev(
                "eu",
                at_ms - offset_ms as u64 - 5,
                Outcome::Ok {
                    mode: "redis".into(),
                },
            );
            e.end_us += 9_000;
            e.tiers = vec![month(at_ms, period)];
            e
        };
        let before = decided(end - 300, nov);
        let after = decided(end + 200, nov.next());
        assert_eq!(period_of(&before, PeriodKind::Month, offset_ms), Ok(nov));
        assert_eq!(
            period_of(&after, PeriodKind::Month, offset_ms),
            Ok(nov.next())
        );
        assert!(period_of(&before, PeriodKind::Day, offset_ms).is_err());
        // A reply whose window is not its period's length is not placed.
        let mut wrong = before.clone();
        wrong.tiers[0].window_ms += 1;
        assert!(period_of(&wrong, PeriodKind::Month, offset_ms).is_err());
        // Without an answer: wherever the bracket overlaps.
        let mut lost = ev(
            "eu",
            end - offset_ms as u64 - 1,
            Outcome::Unknown("reset".into()),
        );
        lost.end_us += 5_000;
        let h = vec![before, after, lost, wrong];
        let (old, unplaced) = events_in_period(&h, "g", nov, offset_ms);
        let (new, _) = events_in_period(&h, "g", nov.next(), offset_ms);
        assert_eq!((old.len(), new.len(), unplaced.len()), (2, 2, 1));
    }

    #[test]
    fn view_lag_is_the_age_of_the_oldest_unit_the_view_misses() {
        let ok = || Outcome::Ok {
            mode: "redis".into(),
        };
        // Units answered at 1, 2, ... 10 ms (ev ends 1 ms after its start).
        let h: Vec<Event> = (0..10).map(|t| ev("eu", t, ok())).collect();
        assert_eq!(view_lag_us(&h, "g", 10_000, 10), 0);
        assert_eq!(view_lag_us(&h, "g", 10_000, 9), 0);
        assert_eq!(view_lag_us(&h, "g", 12_000, 7), 12_000 - 8_000);
        assert_eq!(view_lag_us(&h, "g", 12_000, 0), 12_000 - 1_000);
        // Units answered after the question are not missed.
        assert_eq!(view_lag_us(&h, "g", 5_000, 5), 0);
    }
}
