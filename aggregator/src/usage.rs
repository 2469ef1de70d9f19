//! Usage a billing system can invoice from: each tenant's count per global
//! tier and period (allowed − refunded, per region and in total), and
//! whether the period is **closed**.
//!
//! **Closed** means every configured region has reported past the period's
//! end: each region's **watermark** (`publisher.rs`: every unit charged in
//! the region before it is in an acknowledged delta) is at or after the
//! end. Nodes carry their watermark in their status records, written to
//! every partition after the deltas it covers, so when this aggregator has
//! read a status on a partition it has merged every delta that status
//! vouches for. A region's watermark on a partition is the least of its
//! live nodes' (each node vouches for the region's Redis and for its own
//! local fail-mode counts); a node is live while its latest status is no
//! more than [`LIVE_WITHIN_MS`] older than its region's newest, so a node
//! gone for good does not hold every period open, while a region that is
//! cut off (all its nodes silent) keeps it open until it reports again.
//!
//! **Final.** Once closed, a period's figure does not change: a delta that
//! would still raise it (a region that republished after its Redis lost
//! acknowledged writes, a node that was counted gone) is kept beside it as
//! `late_units` (`Merged::apply_late`), reported with the figure, and
//! counted in `tierlimit_aggregator_late_deltas_total`. Closure is decided
//! at the same offsets on every replay (statuses and deltas share the
//! partition's order), so a rebuilt aggregator reports the same figures.
//!
//! Each aggregator answers for the partitions it owns (`owned`,
//! `caught_up` in every answer); an export lists the partition of every
//! line so that a pipeline can join the exports of several aggregators.

// Handlers answer `Problem`s, as the limits API's do.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::{Path, Query, State as AxumState};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};

use tierlimit_shared::auth::{Principal, Scope};
use tierlimit_shared::messages::partition_of;
use tierlimit_shared::period::{Period, PeriodKind};
use tierlimit_shared::problem::Problem;
use tierlimit_shared::wire::NodeStatus;

use crate::merge::{Merged, Snapshot};
use crate::state::State;

/// A node whose latest status is older than its region's newest by more
/// than this is gone: its watermark no longer holds the region back.
pub const LIVE_WITHIN_MS: u64 = 60_000;

/// A region's nodes: node → (watermark, the node's clock at its status).
type RegionNodes = BTreeMap<String, (u64, u64)>;

/// Each partition's watermarks, as read from the statuses on it.
#[derive(Debug, Default)]
pub struct Watermarks {
    /// partition → region → its nodes.
    seen: HashMap<i32, BTreeMap<String, RegionNodes>>,
    /// partition → the least region watermark over the configured regions
    /// (0: some region has not reported on it).
    closed_before: HashMap<i32, u64>,
}

impl Watermarks {
    /// A status read on `partition`; `regions` are the configured ones
    /// (statuses of others are ignored).
    pub fn heard<'a>(
        &mut self,
        partition: i32,
        s: &NodeStatus,
        regions: impl IntoIterator<Item = &'a str> + Clone,
    ) {
        if !regions.clone().into_iter().any(|r| r == s.region) {
            return;
        }
        let node = self
            .seen
            .entry(partition)
            .or_default()
            .entry(s.region.clone())
            .or_default()
            .entry(s.node.clone())
            .or_insert((0, 0));
        node.0 = node.0.max(s.published_before_ms);
        node.1 = node.1.max(s.ts_ms);
        let least = regions
            .into_iter()
            .map(|r| self.region(partition, r).unwrap_or(0))
            .min()
            .unwrap_or(0);
        // Monotone: a node joining a region (watermark 0 until its first
        // flush) holds the next periods back, never reopens a closed one.
        let closed = self.closed_before.entry(partition).or_insert(0);
        *closed = (*closed).max(least);
    }

    /// `region`'s watermark on `partition`: the least of its live nodes'.
    pub fn region(&self, partition: i32, region: &str) -> Option<u64> {
        let nodes = self.seen.get(&partition)?.get(region)?;
        let newest = nodes.values().map(|n| n.1).max()?;
        nodes
            .values()
            .filter(|n| n.1.saturating_add(LIVE_WITHIN_MS) >= newest)
            .map(|n| n.0)
            .min()
    }

    /// Every period of `partition` that ended at or before this is closed.
    pub fn closed_before(&self, partition: i32) -> u64 {
        self.closed_before.get(&partition).copied().unwrap_or(0)
    }

    /// Whether `period` is closed on `partition`.
    pub fn is_closed(&self, partition: i32, period: Period) -> bool {
        let end = period.end_ms();
        end > 0 && end as u64 <= self.closed_before(partition)
    }

    /// A revoked partition's statuses go with its counters.
    pub fn forget(&mut self, partitions: &[i32]) {
        for p in partitions {
            self.seen.remove(p);
            self.closed_before.remove(p);
        }
    }
}

/// One period of a tenant's usage.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PeriodUsage {
    pub tenant: String,
    pub kind: PeriodKind,
    /// The IANA zone of the period's calendar (`UTC` by default).
    pub zone: String,
    /// The period's human name on its calendar (`2026-11-28`, `2026-W48`).
    pub name: String,
    /// Its local start and end (RFC 9557: offset and zone): a period's id
    /// is its local start.
    pub start: String,
    pub end: String,
    pub start_ms: i64,
    pub end_ms: i64,
    /// Allowed − refunded, every region.
    pub total: u64,
    /// Allowed − refunded per region.
    pub regions: BTreeMap<String, u64>,
    /// Every region reported past its end: the figure is final.
    pub closed: bool,
    /// Units deltas tried to add after the period closed (not in `total`).
    pub late_units: u64,
    pub partition: i32,
}

impl PeriodUsage {
    fn new(
        tenant: &str,
        period: Period,
        s: &Snapshot,
        closed: bool,
        late: u64,
        partition: i32,
    ) -> Self {
        let (start_ms, end_ms) = (period.start_ms(), period.end_ms());
        PeriodUsage {
            tenant: tenant.to_string(),
            kind: period.kind,
            zone: period.zone.name().to_string(),
            name: period.human(),
            start: period.zone.rfc9557(start_ms),
            end: period.zone.rfc9557(end_ms),
            start_ms,
            end_ms,
            total: s.total,
            regions: s.regions(),
            closed,
            late_units: late,
            partition,
        }
    }

    /// One CSV row (see [`CSV_HEADER`]); regions as `eu=3;us=2`.
    fn csv(&self) -> String {
        let regions: Vec<String> = self
            .regions
            .iter()
            .map(|(r, n)| format!("{r}={n}"))
            .collect();
        format!(
            "{},{},{},{},{},{},{},{},{},{},{}\n",
            self.tenant,
            self.kind,
            self.zone,
            self.start,
            self.end,
            self.start_ms,
            self.end_ms,
            self.total,
            regions.join(";"),
            self.late_units,
            self.partition
        )
    }
}

/// The CSV export's header. Tenant ids, zones and region names hold no
/// comma or quote (`validate.rs`), so no field needs quoting.
pub const CSV_HEADER: &str =
    "tenant,kind,zone,start,end,start_ms,end_ms,total,regions,late_units,partition\n";

/// Every period `tenant` has a counter in, oldest first within each kind.
pub fn of_tenant(
    merged: &Merged,
    marks: &Watermarks,
    tenant: &str,
    partition: i32,
) -> Vec<PeriodUsage> {
    merged
        .periods()
        .filter_map(|(period, _)| {
            let s = merged.snapshot(tenant, period)?;
            let closed = marks.is_closed(partition, period);
            Some(PeriodUsage::new(
                tenant,
                period,
                &s,
                closed,
                merged.late_units(tenant, period),
                partition,
            ))
        })
        .collect()
}

/// Every closed period of every tenant of `owned` partitions, ordered by
/// period (kind, zone, index) then tenant: the same lines in the same
/// order on every call, so an export can be repeated.
pub fn closed(
    merged: &Merged,
    marks: &Watermarks,
    owned: impl Fn(i32) -> bool,
    kind: Option<PeriodKind>,
) -> Vec<PeriodUsage> {
    let mut out = Vec::new();
    for (period, counters) in merged.periods() {
        if kind.is_some_and(|k| k != period.kind) {
            continue;
        }
        let mut rows: Vec<PeriodUsage> = counters
            .counters()
            .filter(|(_, c)| owned(c.partition()) && marks.is_closed(c.partition(), period))
            .map(|(t, c)| {
                let s = c.snapshot(merged.actors());
                PeriodUsage::new(
                    t,
                    period,
                    &s,
                    true,
                    merged.late_units(t, period),
                    c.partition(),
                )
            })
            .collect();
        rows.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        out.extend(rows);
    }
    out
}

/// `GET /v1/usage/{tenant}`.
#[derive(Debug, Serialize)]
pub struct TenantUsage {
    pub tenant: String,
    pub partition: i32,
    /// This instance owns the partition and has rebuilt it: the figures
    /// are complete (another instance answers for it otherwise).
    pub owned: bool,
    pub caught_up: bool,
    /// Each configured region's watermark on the partition (Redis ms;
    /// absent: not reported yet).
    pub watermarks: BTreeMap<String, Option<u64>>,
    pub periods: Vec<PeriodUsage>,
}

#[derive(Debug, Deserialize)]
pub struct UsageQuery {
    kind: Option<String>,
    format: Option<String>,
}

fn kind_of(q: &Option<Query<UsageQuery>>) -> Result<Option<PeriodKind>, Problem> {
    match q.as_ref().and_then(|q| q.0.kind.as_deref()) {
        None => Ok(None),
        Some(k) => PeriodKind::parse(k).map(Some).ok_or_else(|| {
            Problem::bad_field("kind", format!("{k:?} is not hour, day, week or month"))
        }),
    }
}

pub async fn tenant_usage(
    AxumState(state): AxumState<Arc<State>>,
    Extension(who): Extension<Principal>,
    Path(tenant): Path<String>,
    query: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let run = || -> Result<Response, Problem> {
        tierlimit_shared::validate::tenant(&tenant)
            .map_err(|e| Problem::bad_field("tenant", e.to_string()))?;
        who.require(Scope::Read, Some(&tenant))?;
        let kind = kind_of(&query.ok())?;
        let partition = partition_of(&tenant, state.kafka().partitions);
        let regions: Vec<String> = state.live().load().config.regions.keys().cloned().collect();
        let core = state.lock();
        let owned = core.progress.is_assigned(partition);
        let caught_up = core.progress.is_caught_up(partition);
        let mut periods = of_tenant(&core.merged, &core.watermarks, &tenant, partition);
        periods.retain(|p| kind.is_none_or(|k| p.kind == k));
        for p in &mut periods {
            p.closed &= owned && caught_up;
        }
        let watermarks = regions
            .iter()
            .map(|r| (r.clone(), core.watermarks.region(partition, r)))
            .collect();
        drop(core);
        Ok(Json(TenantUsage {
            tenant: tenant.clone(),
            partition,
            owned,
            caught_up,
            watermarks,
            periods,
        })
        .into_response())
    };
    run().unwrap_or_else(|p| crate::http::refuse(&state, p))
}

/// `GET /v1/usage/export?format=jsonl|csv&kind=`: the closed periods of
/// every tenant of the partitions this instance owns and has rebuilt.
pub async fn export(
    AxumState(state): AxumState<Arc<State>>,
    Extension(who): Extension<Principal>,
    query: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let run = || -> Result<Response, Problem> {
        who.require(Scope::Read, None)?;
        crate::http::require_every_tenant(&who, "export the usage")?;
        let query = query.ok();
        let kind = kind_of(&query)?;
        let csv = match query.as_ref().and_then(|q| q.0.format.as_deref()) {
            None | Some("jsonl") => false,
            Some("csv") => true,
            Some(other) => {
                return Err(Problem::bad_field(
                    "format",
                    format!("{other:?} is not jsonl or csv"),
                ))
            }
        };
        let core = state.lock();
        let rows = closed(
            &core.merged,
            &core.watermarks,
            |p| core.progress.is_assigned(p) && core.progress.is_caught_up(p),
            kind,
        );
        drop(core);
        let mut body = String::new();
        if csv {
            body.push_str(CSV_HEADER);
        }
        for r in &rows {
            if csv {
                body.push_str(&r.csv());
            } else {
                let _ = writeln!(
                    body,
                    "{}",
                    serde_json::to_string(r).expect("a row serialises")
                );
            }
        }
        let ctype = if csv {
            "text/csv"
        } else {
            "application/x-ndjson"
        };
        Ok(([(header::CONTENT_TYPE, ctype)], body).into_response())
    };
    run().unwrap_or_else(|p| crate::http::refuse(&state, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(region: &str, node: &str, w: u64, ts: u64) -> NodeStatus {
        NodeStatus {
            region: region.into(),
            node: node.into(),
            limits_version: 0,
            following: false,
            ts_ms: ts,
            published_before_ms: w,
        }
    }

    const REGIONS: [&str; 2] = ["eu", "us"];

    #[test]
    fn a_period_closes_when_every_region_passed_its_end() {
        let mut m = Watermarks::default();
        let hour = PeriodKind::Hour.at(1_800_000_000_000);
        let end = hour.end_ms() as u64;
        m.heard(0, &status("eu", "a", end + 5, 1), REGIONS);
        // One region only: open.
        assert!(!m.is_closed(0, hour));
        m.heard(0, &status("us", "a", end - 1, 1), REGIONS);
        assert!(!m.is_closed(0, hour), "us is not past the end");
        m.heard(0, &status("us", "a", end, 2), REGIONS);
        assert!(m.is_closed(0, hour));
        // Per partition: another partition has heard nothing.
        assert!(!m.is_closed(1, hour));
        // A watermark never goes back (a status reordered behind a newer).
        m.heard(0, &status("us", "a", 5, 3), REGIONS);
        assert!(m.is_closed(0, hour));
        // Regions not configured are ignored.
        m.heard(1, &status("mars", "a", end, 1), REGIONS);
        assert_eq!(m.region(1, "mars"), None);
    }

    #[test]
    fn a_region_waits_for_its_slowest_live_node_not_for_a_gone_one() {
        let mut m = Watermarks::default();
        m.heard(0, &status("eu", "a", 1_000, 10_000), REGIONS);
        m.heard(0, &status("eu", "b", 500, 10_000), REGIONS);
        assert_eq!(m.region(0, "eu"), Some(500), "the least live node");
        // b stops reporting; a goes on past the liveness window.
        m.heard(
            0,
            &status("eu", "a", 90_000, 10_000 + LIVE_WITHIN_MS + 1),
            REGIONS,
        );
        assert_eq!(m.region(0, "eu"), Some(90_000), "b is gone");
        // A region whose only node is silent keeps its old watermark.
        m.heard(0, &status("us", "a", 700, 11_000), REGIONS);
        assert_eq!(m.closed_before(0), 700);
        // A node joining us reports 0 until its first flush: what is
        // closed stays closed.
        m.heard(0, &status("us", "b", 0, 11_000), REGIONS);
        assert_eq!(m.region(0, "us"), Some(0));
        assert_eq!(m.closed_before(0), 700);
        m.forget(&[0]);
        assert_eq!(m.closed_before(0), 0);
    }
}
