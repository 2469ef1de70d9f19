//! The aggregator's HTTP API: the global view of a tenant, the over-limit
//! list, metrics and health.
//!
//! The tenant view shows the day's tier (today and yesterday) and the
//! current period of each other tier the tenant has (`periods`); every
//! limit shown is the one the nodes' deltas carried, else the
//! configuration's (`limits_version` 0). `/v1/over-limit` lists one entry
//! per tenant and tier (`kind`) at or over its limit in the current period.
//!
//! An aggregator only holds the tenants of the partitions assigned to it, so
//! the tenant view says whether this instance owns the tenant (and whether it
//! has finished rebuilding); zeros from a non-owner mean "ask another
//! instance", not "no traffic". `GET /` is the HTML dashboard
//! ([`crate::dashboard`]). A refusal (an invalid tenant id) is the shared
//! problem+json [`Problem`].
//!
//! Two routers: [`router`] is the API (`/v1/…`, needing the `read` scope,
//! tenant-restricted keys see only their tenants) with a concurrency limit
//! that sheds load; [`admin_router`] is the dashboard and `/metrics`, on the
//! admin listener. `/healthz` and `/readyz` are open on both.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Extension, Path, State as AxumState};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use tierlimit_shared::auth::{Principal, Scope};
use tierlimit_shared::config::HttpSettings;
use tierlimit_shared::day;
use tierlimit_shared::messages::{now_ms, partition_of, ActorPart};
use tierlimit_shared::period::{Period, PeriodKind};
use tierlimit_shared::problem::Problem;

use crate::merge::{Carried, Snapshot};
use crate::progress::{Membership, PartitionProgress, Readiness};
use crate::state::State;

type AppState = Arc<State>;

/// The API routes, ready to be served on the main listener.
pub fn router(state: Arc<State>, http: &HttpSettings) -> Router {
    let api = Router::new()
        .route("/v1/global/{tenant}", get(tenant_view))
        .route("/v1/over-limit", get(over_limit))
        .route("/v1/usage/export", get(crate::usage::export))
        .route("/v1/usage/{tenant}", get(crate::usage::tenant_usage))
        .route("/v1/limits/status", get(limits_status))
        .merge(crate::limits_api::routes(Arc::clone(&state)));
    let api = tierlimit_shared::auth::require_auth(
        api,
        tierlimit_shared::auth::Authn {
            live: state.live().clone(),
            on_reject: on_reject(&state),
        },
    );
    // The shared admission gate (shared/src/admission.rs), with no queue:
    // reads are served from memory, so past `max_concurrent_requests` a
    // request is refused at once. It covers the API only: the probes below
    // still answer when the API is saturated.
    let gate = tierlimit_shared::admission::Admission::new(
        tierlimit_shared::admission::Limits {
            max_in_flight: http.max_concurrent_requests,
            max_queue: 0,
            queue_timeout: std::time::Duration::ZERO,
        },
        Arc::new(Rejections(Arc::clone(&state))),
    );
    let api = tierlimit_shared::admission::layer(api, gate);
    let router = api
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    let router = tierlimit_shared::serve::problem_fallbacks(router, on_reject(&state))
        .with_state(Arc::clone(&state));
    tierlimit_shared::serve::harden(
        router,
        tierlimit_shared::serve::Limits::new(http, on_reject(&state)),
    )
}

/// The admin listener's routes: the dashboard, `/metrics` and the probes.
pub fn admin_router(state: Arc<State>, http: &HttpSettings) -> Router {
    let router = Router::new()
        .route("/", get(crate::dashboard::page))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    let router = tierlimit_shared::serve::problem_fallbacks(router, on_reject(&state))
        .with_state(Arc::clone(&state));
    tierlimit_shared::serve::harden(
        router,
        tierlimit_shared::serve::Limits::new(http, on_reject(&state)),
    )
}

/// The admission gate's shed requests, counted as `overloaded` refusals.
struct Rejections(Arc<State>);

impl tierlimit_shared::admission::Meter for Rejections {
    fn shed(&self, _reason: &'static str) {
        self.0
            .metrics
            .http_rejections
            .with_label_values(&["overloaded"])
            .inc();
    }
}

/// Counts a refusal in `tierlimit_aggregator_http_rejections_total`.
fn on_reject(state: &Arc<State>) -> tierlimit_shared::serve::OnReject {
    let s = Arc::clone(state);
    Arc::new(move |slug| s.metrics.http_rejections.with_label_values(&[slug]).inc())
}

/// A counted problem response.
/// Refuses a principal restricted to some tenants what reads `what` of
/// every tenant (an export): 403 problem+json.
#[allow(clippy::result_large_err)]
pub(crate) fn require_every_tenant(who: &Principal, what: &str) -> Result<(), Problem> {
    match who.tenants {
        None => Ok(()),
        Some(_) => Err(Problem::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "Not allowed",
            format!(
                "{} is restricted to some tenants: it cannot {what} of all of them",
                who.name
            ),
        )),
    }
}

pub(crate) fn refuse(state: &State, p: Problem) -> Response {
    state
        .metrics
        .http_rejections
        .with_label_values(&[p.slug()])
        .inc();
    p.into_response()
}

/// One day of a tenant's global counter.
#[derive(Debug, Serialize)]
pub struct DayView {
    pub day: u32,
    pub date: String,
    pub total: u64,
    /// The limit the counter is judged under: the one the nodes' deltas
    /// carried, else the aggregator's configuration's.
    pub limit: Option<u64>,
    /// The limits version of `limit` (0: the aggregator's configuration).
    pub limits_version: u64,
    pub remaining: Option<u64>,
    pub over_limit: bool,
    pub parts: Vec<ActorPart>,
    /// Net count per region (all epochs of a region together).
    pub regions: BTreeMap<String, u64>,
}

impl DayView {
    fn new(day: u32, counter: Option<Snapshot>, configured: Option<u64>) -> Self {
        let p = PeriodView::new(Period::day(day), counter, configured);
        DayView {
            day,
            date: day::to_iso(day),
            total: p.total,
            limit: p.limit,
            limits_version: p.limits_version,
            remaining: p.remaining,
            over_limit: p.over_limit,
            parts: p.parts,
            regions: p.regions,
        }
    }
}

/// The current period of one of a tenant's other global tiers (hour, week,
/// month).
#[derive(Debug, Serialize)]
pub struct PeriodView {
    pub kind: PeriodKind,
    /// The period's label (`m682`, `w2868`, `h490335`: kind and index).
    pub period: String,
    /// Its human name (`2026-11`, `2026-W48`, `2026-11-27T15`).
    pub name: String,
    pub start_ms: i64,
    pub end_ms: i64,
    pub total: u64,
    pub limit: Option<u64>,
    pub limits_version: u64,
    pub remaining: Option<u64>,
    pub over_limit: bool,
    pub parts: Vec<ActorPart>,
    pub regions: BTreeMap<String, u64>,
}

impl PeriodView {
    fn new(period: Period, counter: Option<Snapshot>, configured: Option<u64>) -> Self {
        let total = counter.as_ref().map_or(0, |c| c.total);
        let judged = Carried::or_config(counter.as_ref().and_then(|c| c.carried), || configured);
        let limit = judged.limit;
        PeriodView {
            kind: period.kind,
            period: period.label(),
            name: period.human(),
            start_ms: period.start_ms(),
            end_ms: period.end_ms(),
            total,
            limit,
            limits_version: judged.limits_version,
            remaining: limit.map(|l| l.saturating_sub(total)),
            over_limit: limit.is_some_and(|l| total >= l),
            regions: counter.as_ref().map(Snapshot::regions).unwrap_or_default(),
            parts: counter.map(|c| c.parts).unwrap_or_default(),
        }
    }
}

/// `GET /v1/global/{tenant}`.
#[derive(Debug, Serialize)]
pub struct TenantView {
    pub tenant: String,
    /// The deltas partition the tenant lives on.
    pub partition: i32,
    /// Whether this instance is assigned that partition.
    pub owned: bool,
    /// Whether the partition has been rebuilt (the numbers are complete).
    pub caught_up: bool,
    pub today: DayView,
    pub yesterday: DayView,
    /// The current period of each other tier kind (hour, week, month) the
    /// tenant has a counter for or a configured limit in, hour first.
    pub periods: Vec<PeriodView>,
}

async fn tenant_view(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(tenant): Path<String>,
) -> Response {
    if let Err(e) = tierlimit_shared::validate::tenant(&tenant) {
        return refuse(
            &state,
            Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid-tenant",
                "Invalid tenant id",
                e.to_string(),
            ),
        );
    }
    if let Err(e) = who.require(Scope::Read, Some(&tenant)) {
        return refuse(&state, e.into());
    }
    let zone = state.zone_of(&tenant);
    // The UTC day's limit: none when the tenant's day is another zone's.
    let limit = state
        .limit_of(&tenant, PeriodKind::Day)
        .filter(|_| zone.is_utc());
    let now = now_ms();
    let today = day::today();
    let yesterday = today.saturating_sub(1);
    // In a zone other than UTC the day's tier is one of these, on the
    // zone's calendar; `today` stays the UTC day every tenant counts.
    let others: Vec<(Period, Option<u64>)> = PeriodKind::ALL
        .into_iter()
        .filter(|k| *k != PeriodKind::Day || !zone.is_utc())
        .map(|k| (k.at_in(zone, now), state.limit_of(&tenant, k)))
        .collect();
    let partition = partition_of(&tenant, state.kafka().partitions);
    let core = state.lock();
    let snapshot = |day| core.merged.snapshot(&tenant, Period::day(day));
    let periods = others
        .into_iter()
        .filter_map(|(period, configured)| {
            let counter = core.merged.snapshot(&tenant, period);
            (counter.is_some() || configured.is_some())
                .then(|| PeriodView::new(period, counter, configured))
        })
        .collect();
    let view = TenantView {
        partition,
        owned: core.progress.is_assigned(partition),
        caught_up: core.progress.is_caught_up(partition),
        today: DayView::new(today, snapshot(today), limit),
        yesterday: DayView::new(yesterday, snapshot(yesterday), limit),
        periods,
        tenant,
    };
    drop(core);
    Json(view).into_response()
}

#[derive(Debug, Serialize)]
pub struct OverLimitTenant {
    pub tenant: String,
    /// The tier: `day` (today), or `hour`, `week`, `month` (its current
    /// period).
    pub kind: PeriodKind,
    pub total: u64,
    pub limit: u64,
}

/// `GET /v1/over-limit`.
#[derive(Debug, Serialize)]
pub struct OverLimitView {
    pub day: u32,
    pub date: String,
    /// Tenants of this instance's partitions at or over the limit of one
    /// of their tiers in its current period (today for the day's), ordered
    /// by tenant id then tier (hour, day, week, month).
    pub tenants: Vec<OverLimitTenant>,
}

/// `?version=V` of `/v1/limits/status`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusQuery {
    version: Option<u64>,
}

/// Has limits version V (default: the newest this aggregator applied)
/// reached every region-node heard from recently? Which ones lag?
/// (`nodes.rs`). Needs `read`; 404 `limits-from-file` when tenants come
/// from the file.
async fn limits_status(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    query: Result<axum::extract::Query<StatusQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    if let Err(e) = who.require(Scope::Read, None) {
        return refuse(&state, e.into());
    }
    let axum::extract::Query(query) = match query {
        Ok(q) => q,
        Err(e) => {
            return refuse(
                &state,
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    "bad-query",
                    "Invalid query",
                    format!("{e} (expected ?version=<integer>)"),
                ),
            )
        }
    };
    let config = state.live().load();
    let Some(table) = config.limits() else {
        return refuse(
            &state,
            Problem::new(
                StatusCode::NOT_FOUND,
                "limits-from-file",
                "Limits come from the configuration file",
                "limits.source is \"file\": no limits topic is followed, so there is no version to report",
            ),
        );
    };
    let mut report = state.nodes.report(
        query.version,
        config.config.limits.lag_alert_after,
        now_ms(),
    );
    report.newest = report.newest.max(table.applied_version());
    Json(serde_json::json!({
        "version": report.version,
        "newest": report.newest,
        "reached": report.reached,
        "aggregator": {
            "applied_version": table.applied_version(),
            "ready": table.is_ready(),
            "tenants": table.len(),
            "pending_tenants": table.pending(),
        },
        "nodes": report.nodes,
        "behind": report.behind,
        "lagging": report.lagging,
        "gone": report.gone,
    }))
    .into_response()
}

/// A key limited to some tenants sees only those.
async fn over_limit(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
) -> Response {
    if let Err(e) = who.require(Scope::Read, None) {
        return refuse(&state, e.into());
    }
    let now = now_ms();
    let today = day::today();
    let config = state.live().load();
    let mut tenants: Vec<OverLimitTenant> = {
        // Only the visible counters of the current periods: every tenant at
        // its limit passed the broadcast threshold and was broadcast (at
        // most one broadcast interval ago), so this never walks every
        // counter under the lock.
        let core = state.lock();
        core.merged
            .current(now)
            .into_iter()
            .flat_map(|period| {
                let core = &core;
                let config = &config;
                let who = &who;
                core.merged
                    .on(period)
                    .into_iter()
                    .flat_map(|d| d.visible())
                    .filter(move |(tenant, _)| who.may_see(tenant))
                    .filter_map(move |(tenant, c)| {
                        let key = crate::merge::TenantPeriod::new(tenant, period);
                        let limit = crate::state::judged(config, &key, c).limit?;
                        let total = c.total();
                        (total >= limit).then(|| OverLimitTenant {
                            tenant: tenant.to_owned(),
                            kind: period.kind,
                            total,
                            limit,
                        })
                    })
            })
            .collect()
    };
    tenants.sort_by(|a, b| (&a.tenant, a.kind).cmp(&(&b.tenant, b.kind)));
    Json(OverLimitView {
        day: today,
        date: day::to_iso(today),
        tenants,
    })
    .into_response()
}

async fn metrics(AxumState(state): AxumState<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

#[derive(Debug, Serialize)]
struct ReadyView {
    ready: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    membership: Membership,
    partitions: Vec<PartitionProgress>,
}

async fn readyz(AxumState(state): AxumState<AppState>) -> Response {
    let (readiness, membership, partitions) = {
        let core = state.lock();
        (
            core.progress.readiness(),
            core.progress.membership(),
            core.progress.partitions().cloned().collect(),
        )
    };
    let (status, ready, reason) = match readiness {
        Readiness::Ready => (StatusCode::OK, true, None),
        Readiness::NotReady(reason) => (StatusCode::SERVICE_UNAVAILABLE, false, Some(reason)),
    };
    (
        status,
        Json(ReadyView {
            ready,
            reason,
            membership,
            partitions,
        }),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tierlimit_shared::messages::{actor, Delta};
    use tower::ServiceExt;

    use crate::state::tests::state;

    /// The API with `read` open (as `auth.open_scopes` would), the admin
    /// routes beside it.
    fn router(s: Arc<State>) -> Router {
        let mut config = s.live().load().config.clone();
        config.auth.open_scopes.insert(Scope::Read);
        s.live().store(Arc::new(config.validate().unwrap()));
        admin(s)
    }

    fn api(s: Arc<State>) -> Router {
        super::router(s, &HttpSettings::default())
    }

    fn admin(s: Arc<State>) -> Router {
        let a = admin_router(s.clone(), &HttpSettings::default());
        // The API's /v1 routes, the admin listener's others: the tests
        // read both through one router.
        let api = api(s);
        Router::new().fallback(move |req: Request<Body>| {
            let target = if req.uri().path().starts_with("/v1/") {
                api.clone()
            } else {
                a.clone()
            };
            async move { target.oneshot(req).await.unwrap() }
        })
    }

    async fn get(router: &Router, uri: &str) -> (StatusCode, String, serde_json::Value) {
        let response = router
            .clone()
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (status, content_type, json)
    }

    fn rebuilt_state() -> Arc<State> {
        let s = state();
        let g = s.on_assign(&[0, 1, 2, 3]);
        for p in 0..4 {
            s.on_watermarks(p, g, 0, 0);
        }
        s
    }

    #[tokio::test]
    async fn tenant_view_sums_regions_and_parts() {
        let s = rebuilt_state();
        let today = day::today();
        let p = partition_of("acme", 4);
        s.on_delta(
            p,
            0,
            &Delta::new("acme", today, actor("eu", "a"), 70, 5, now_ms()),
        );
        s.on_delta(
            p,
            1,
            &Delta::new("acme", today, actor("eu", "b"), 10, 0, now_ms()),
        );
        s.on_delta(
            p,
            2,
            &Delta::new("acme", today, actor("us", "c"), 30, 0, now_ms()),
        );
        s.on_delta(
            p,
            3,
            &Delta::new("acme", today - 1, actor("us", "c"), 7, 0, now_ms()),
        );
        let router = router(s.clone());
        let (status, _, v) = get(&router, "/v1/global/acme").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["tenant"], "acme");
        assert_eq!(v["owned"], true);
        assert_eq!(v["today"]["total"], 105);
        assert_eq!(v["today"]["limit"], 100);
        assert_eq!(v["today"]["remaining"], 0);
        assert_eq!(v["today"]["over_limit"], true);
        assert_eq!(v["today"]["date"], day::to_iso(today));
        assert_eq!(v["today"]["regions"]["eu"], 75);
        assert_eq!(v["today"]["regions"]["us"], 30);
        assert_eq!(v["today"]["parts"].as_array().unwrap().len(), 3);
        assert_eq!(v["yesterday"]["total"], 7);
        assert_eq!(v["yesterday"]["over_limit"], false);

        // What the broadcaster makes visible is what the page lists.
        crate::state::tests::broadcasts(&s);
        let (status, _, v) = get(&router, "/v1/over-limit").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["tenants"][0]["tenant"], "acme");
        assert_eq!(v["tenants"].as_array().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn tenant_view_lists_the_current_period_of_other_tiers() {
        let s = rebuilt_state();
        let p = partition_of("acme", 4);
        let month = PeriodKind::Month.at(now_ms());
        let mut d = Delta::of("acme", month, actor("eu", "a"), 900, 0, now_ms());
        d.limit = Some(800);
        d.limits_version = 2;
        s.on_delta(p, 0, &d);
        let router = router(s.clone());
        let (_, _, v) = get(&router, "/v1/global/acme").await;
        let periods = v["periods"].as_array().unwrap();
        assert_eq!(periods.len(), 1, "{v}");
        assert_eq!(periods[0]["kind"], "month");
        assert_eq!(periods[0]["name"], month.human());
        assert_eq!(periods[0]["period"], month.label());
        assert_eq!(periods[0]["total"], 900);
        // The limit the node carried, not the configuration's (none).
        assert_eq!(periods[0]["limit"], 800);
        assert_eq!(periods[0]["limits_version"], 2);
        assert_eq!(periods[0]["over_limit"], true);
        // The day's tier is untouched, judged under the configuration.
        assert_eq!(v["today"]["total"], 0);
        assert_eq!(v["today"]["limit"], 100);
        assert_eq!(v["today"]["limits_version"], 0);
        crate::state::tests::broadcasts(&s);
        let (_, _, v) = get(&router, "/v1/over-limit").await;
        assert_eq!(v["tenants"][0]["kind"], "month");
        assert_eq!(v["tenants"][0]["limit"], 800);
    }

    #[tokio::test]
    async fn the_api_needs_a_key_and_keys_see_their_tenants() {
        let s = rebuilt_state();
        let p = partition_of("acme", 4);
        let today = day::today();
        s.on_delta(
            p,
            0,
            &Delta::new("acme", today, actor("eu", "a"), 700, 0, now_ms()),
        );
        let p = partition_of("globex", 4);
        s.on_delta(
            p,
            1,
            &Delta::new("globex", today, actor("eu", "a"), 700, 0, now_ms()),
        );
        let mut config = s.live().load().config.clone();
        let key: tierlimit_shared::auth::KeyConfig = serde_json::from_value(serde_json::json!({
            "sha256": tierlimit_shared::auth::KeyDigest::of(b"k-acme").to_hex(),
            "scopes": ["read"],
            "tenants": ["acme"],
        }))
        .unwrap();
        config.auth.keys.insert("acme".into(), key);
        s.live().store(Arc::new(config.validate().unwrap()));
        let router = api(s.clone());
        let (status, ct, v) = get(&router, "/v1/global/acme").await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(ct, "application/problem+json");
        assert!(v["type"].as_str().unwrap().ends_with("/unauthorized"));
        let with_key = |uri: &str| {
            Request::get(uri)
                .header("authorization", "Bearer k-acme")
                .body(Body::empty())
                .unwrap()
        };
        let resp = router
            .clone()
            .oneshot(with_key("/v1/global/acme"))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let resp = router
            .clone()
            .oneshot(with_key("/v1/global/globex"))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        crate::state::tests::broadcasts(&s);
        let resp = router
            .clone()
            .oneshot(with_key("/v1/over-limit"))
            .await
            .unwrap();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let listed: Vec<_> = v["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["tenant"].clone())
            .collect();
        assert_eq!(
            listed,
            vec![serde_json::json!("acme")],
            "globex is over too, but not this key's"
        );
        // Probes stay open; the dashboard is not on the API listener.
        assert_eq!(get(&router, "/healthz").await.0, StatusCode::OK);
        assert_eq!(get(&router, "/metrics").await.0, StatusCode::NOT_FOUND);
        let rejected = s
            .metrics
            .http_rejections
            .with_label_values(&["unauthorized"])
            .get();
        assert_eq!(rejected, 1);
        assert_eq!(
            s.metrics
                .http_rejections
                .with_label_values(&["forbidden"])
                .get(),
            1
        );
    }

    #[tokio::test]
    async fn unknown_tenant_is_zero() {
        let router = router(rebuilt_state());
        let (status, _, v) = get(&router, "/v1/global/nobody").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["today"]["total"], 0);
        assert_eq!(v["today"]["over_limit"], false);
        assert_eq!(v["today"]["parts"], serde_json::json!([]));
    }

    #[tokio::test]
    async fn invalid_tenant_is_a_problem() {
        let router = router(state());
        let (status, content_type, v) = get(&router, "/v1/global/a:b").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(content_type, "application/problem+json");
        assert_eq!(v["status"], 400);
        assert!(v["type"].as_str().unwrap().ends_with("invalid-tenant"));
        assert!(v["title"].is_string());
        assert!(v["detail"].as_str().unwrap().contains(':'));
    }

    #[tokio::test]
    async fn readiness_follows_the_rebuild() {
        let s = state();
        let router = admin(s.clone());
        let (status, _, v) = get(&router, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(v["ready"], false);
        assert!(v["reason"].as_str().unwrap().contains("assignment"));
        let g = s.on_assign(&[1]);
        let (status, _, v) = get(&router, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(v["reason"].as_str().unwrap().contains("partition 1"));
        s.on_watermarks(1, g, 0, 0);
        let (status, _, v) = get(&router, "/readyz").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["partitions"][0]["caught_up"], true);
        let (status, _, _) = get(&router, "/healthz").await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_are_prometheus_text() {
        let router = router(state());
        let response = router
            .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        assert!(text.contains("# TYPE tierlimit_aggregator_deltas_consumed_total counter"));
    }

    #[tokio::test]
    async fn root_is_the_dashboard() {
        let router = router(rebuilt_state());
        let response = router
            .oneshot(Request::get("/?refresh=0").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let html = String::from_utf8(bytes.to_vec()).unwrap();
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(!html.contains("http-equiv=\"refresh\""));
    }
}
