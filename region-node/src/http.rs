//! The HTTP API of a region-node (axum).
//!
//! Every refusal is an RFC 9457 `application/problem+json` body that names
//! what was wrong (the field, or the violated policy), and nothing is charged
//! for a request that fails validation: validation happens before the
//! decision script runs.
//!
//! Two routers: [`router`] is the API (check, refund, usage), every route
//! behind authentication ([`tierlimit_shared::auth`]) except `/healthz` and
//! `/readyz`; [`admin_router`] is `/metrics` (and health), served on the
//! separate admin listener. A request is authorised (scope, tenant) after
//! its body is parsed and before anything is charged, so a 401 or 403
//! never costs the tenant a unit.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use serde_json::json;
use tierlimit_shared::auth::{Principal, Scope};
use tierlimit_shared::check;
use tierlimit_shared::problem::Problem;
use tierlimit_shared::reload::Live;

use crate::decision::{DecideError, Decider, Decision, Request, Tier, TierStatus};
use crate::metrics::Metrics;
use crate::view::View;

/// Shared state of every handler.
pub struct AppState {
    pub decider: Decider,
    pub metrics: Arc<Metrics>,
    pub view: Arc<View>,
    /// The live configuration: API keys are read from it per request.
    pub live: Live,
}

/// Largest request body accepted. A check or refund is a few hundred bytes;
/// anything near this is not one, and axum's implicit 2 MB would let every
/// caller make the node buffer megabytes per request.
pub const MAX_BODY: usize = 64 * 1024;

/// The API: every route but the probes needs credentials; decisions are
/// never cached; size limits and timeouts from `[http]`.
pub fn router(state: Arc<AppState>, http: &tierlimit_shared::config::HttpSettings) -> Router {
    let api = Router::new()
        .route("/v1/check", post(check_post).get(check_get))
        .route("/v1/refund", post(refund))
        .route("/v1/tenants/{tenant}", get(tenant_usage))
        // A decision is about this moment: no cache may answer it later.
        .route_layer(axum::middleware::map_response(no_store));
    let api = tierlimit_shared::auth::require_auth(
        api,
        tierlimit_shared::auth::Authn {
            live: Arc::clone(&state.live),
            on_reject: state.on_reject(),
        },
    );
    // Admission control (concurrency limit and load shedding of checks),
    // the outermost layer of `api`: a shed request costs no key check, no
    // parsing and no charge (shared/src/admission.rs).
    let api = tierlimit_shared::admission::layer(api, state.decider.admission());
    let router = api
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY));
    let router = tierlimit_shared::serve::problem_fallbacks(router, state.on_reject())
        .with_state(Arc::clone(&state));
    tierlimit_shared::serve::harden(
        router,
        tierlimit_shared::serve::Limits::new(http, state.on_reject()),
    )
}

/// The admin listener's routes: `/metrics` and the probes, no API. It is
/// kept off the API listener so that an API caller never reaches it; its
/// protection is its address (loopback by default, see `--admin-listen`).
pub fn admin_router(state: Arc<AppState>, http: &tierlimit_shared::config::HttpSettings) -> Router {
    let router = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz));
    let router = tierlimit_shared::serve::problem_fallbacks(router, state.on_reject())
        .with_state(Arc::clone(&state));
    tierlimit_shared::serve::harden(
        router,
        tierlimit_shared::serve::Limits::new(http, state.on_reject()),
    )
}

async fn no_store(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The body, or the problem of a body that could not be read (413 past
/// [`MAX_BODY`]), as problem+json like every other refusal.
#[allow(clippy::result_large_err)]
fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, Problem> {
    body.map_err(|e| {
        let status = e.status();
        let (slug, title) = if status == StatusCode::PAYLOAD_TOO_LARGE {
            ("body-too-large", "Request body too large")
        } else {
            ("unreadable-body", "Request body could not be read")
        };
        Problem::new(
            status,
            slug,
            title,
            format!("{} (at most {MAX_BODY} bytes)", e.body_text()),
        )
    })
}

impl From<DecideError> for Problem {
    fn from(e: DecideError) -> Problem {
        match &e {
            DecideError::Invalid(inv) => {
                let field = match inv {
                    tierlimit_shared::validate::InvalidId::Empty { field }
                    | tierlimit_shared::validate::InvalidId::TooLong { field, .. }
                    | tierlimit_shared::validate::InvalidId::BadChar { field, .. } => *field,
                };
                Problem::bad_field(field, e.to_string())
            }
            DecideError::Cost(_) => Problem::bad_field("cost", e.to_string()),
            DecideError::UnknownTenant(t) => Problem::new(
                StatusCode::FORBIDDEN,
                "unknown-tenant",
                "Unknown tenant",
                e.to_string(),
            )
            .with("tenant", t.clone()),
            DecideError::Newcomer(r) => {
                let secs = r.retry_after_ms.div_ceil(1000).max(1);
                Problem::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "newcomer-refused",
                    "The region admits no more new tenants for now",
                    e.to_string(),
                )
                .with("violated-policy", r.reason.name())
                .with_header(header::RETRY_AFTER, HeaderValue::from(secs))
            }
            DecideError::Shed(shed) => shed.problem(),
            DecideError::ViewNotReady => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "view-not-ready",
                "The node has not read the global view yet",
                e.to_string(),
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            DecideError::LimitsNotReady => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "limits-not-ready",
                "The node has not read the tenants' limits yet",
                e.to_string(),
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            DecideError::Unavailable => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Rate limit store unavailable",
                e.to_string(),
            )
            .with("violated-policy", "store")
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            DecideError::Handle(crate::refund::HandleError::Disabled) => Problem::new(
                StatusCode::BAD_REQUEST,
                "refund-handles-disabled",
                "Refund handles are not enabled",
                e.to_string(),
            ),
            DecideError::Handle(crate::refund::HandleError::OtherRegion { issued, .. }) => {
                Problem::new(
                    StatusCode::FORBIDDEN,
                    "refund-handle-other-region",
                    "The refund handle was issued by another region",
                    e.to_string(),
                )
                .with("region", issued.clone())
            }
            DecideError::Handle(crate::refund::HandleError::Used) => Problem::new(
                StatusCode::CONFLICT,
                "refund-handle-used",
                "The refund handle was used already",
                e.to_string(),
            )
            .with("duplicate", true),
            DecideError::Handle(crate::refund::HandleError::Expired) => Problem::new(
                StatusCode::GONE,
                "refund-handle-expired",
                "Every window of the refund handle's charge has ended",
                e.to_string(),
            ),
            DecideError::Handle(crate::refund::HandleError::Outdated) => Problem::new(
                StatusCode::GONE,
                "refund-handle-outdated",
                "The refund handle is of the previous release and past its grace",
                e.to_string(),
            ),
            DecideError::Handle(_) => Problem::bad_field("handle", e.to_string()),
            DecideError::FreeFormRefund => Problem::new(
                StatusCode::FORBIDDEN,
                "refund-needs-handle",
                "A refund must name a refund handle",
                e.to_string(),
            ),
        }
    }
}

/// The request's `Content-Type` as text (`None` when absent or not visible
/// ASCII), extracted without cloning the whole header map (axum's
/// `HeaderMap` extractor copies every header).
struct ContentType(Option<HeaderValue>);

impl<S: Send + Sync> FromRequestParts<S> for ContentType {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(ContentType(
            parts.headers.get(header::CONTENT_TYPE).cloned(),
        ))
    }
}

impl ContentType {
    fn as_str(&self) -> Option<&str> {
        self.0.as_ref().and_then(|v| v.to_str().ok())
    }
}

async fn check_post(
    State(s): State<Arc<AppState>>,
    Extension(who): Extension<Principal>,
    ct: ContentType,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(p) => return s.refused(p),
    };
    match check::from_body(ct.as_str(), &body) {
        Ok(c) => match who.require(Scope::Check, Some(&c.tenant)) {
            Ok(()) => decide(&s, &c.tenant, c.key.as_deref(), c.cost).await,
            Err(e) => s.refused(e.into()),
        },
        Err(e) => s.refused(e.into()),
    }
}

/// Forward-auth form (nginx `auth_request`, Traefik ForwardAuth, Envoy
/// ext_authz HTTP): 200 allows, 429 denies.
async fn check_get(
    State(s): State<Arc<AppState>>,
    Extension(who): Extension<Principal>,
    Query(q): Query<Vec<(String, String)>>,
) -> Response {
    match check::from_query(q) {
        Ok(c) => match who.require(Scope::Check, Some(&c.tenant)) {
            Ok(()) => decide(&s, &c.tenant, c.key.as_deref(), c.cost).await,
            Err(e) => s.refused(e.into()),
        },
        Err(e) => s.refused(e.into()),
    }
}

async fn decide(s: &AppState, tenant: &str, key: Option<&str>, cost: u64) -> Response {
    let req = Request { tenant, key, cost };
    match s.decider.check(req).await {
        Ok(d) => decision_response(d),
        Err(e) => s.refused(e.into()),
    }
}

/// `{"handle": "…"}` (optionally `"cost"`, at most the charge's) gives a
/// charge back; `{"tenant", "key", "cost"}` is a free-form refund, tied to no
/// charge (see `node.free_form_refunds`).
async fn refund(
    State(s): State<Arc<AppState>>,
    Extension(who): Extension<Principal>,
    ct: ContentType,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(p) => return s.refused(p),
    };
    let refund = match check::refund_from_body(ct.as_str(), &body) {
        Ok(r) => r,
        Err(e) => return s.refused(e.into()),
    };
    let result = match refund {
        check::Refund::Handle { handle, cost } => {
            // Authorised on the tenant the handle claims; the decider
            // then verifies the claim (its signature) before giving back.
            let tenant = check::handle_tenant(&handle);
            if let Err(e) = who.require(Scope::Refund, Some(tenant.as_deref().unwrap_or(""))) {
                return s.refused(e.into());
            }
            s.decider.refund_handle(&handle, cost).await
        }
        check::Refund::FreeForm(c) => {
            // Tied to no charge: an operator's act, never a client's.
            if let Err(e) = who.require(Scope::Admin, Some(&c.tenant)) {
                return s.refused(e.into());
            }
            tracing::info!(who = %who.name, tenant = %c.tenant, cost = c.cost, "free-form refund requested");
            let req = Request {
                tenant: &c.tenant,
                key: c.key.as_deref(),
                cost: c.cost,
            };
            s.decider.refund(req).await
        }
    };
    match result {
        Ok(r) => {
            let d = &r.decision;
            let mut resp = axum::Json(json!({
                "refunded": r.refunded,
                "duplicate": r.duplicate,
                "tenant": d.tenant,
                "key": d.key,
                "mode": d.mode,
                "tiers": d.tiers,
            }))
            .into_response();
            rate_limit_headers(resp.headers_mut(), &d.tiers);
            resp
        }
        Err(e) => s.refused(e.into()),
    }
}

async fn tenant_usage(
    State(s): State<Arc<AppState>>,
    Extension(who): Extension<Principal>,
    Path(tenant): Path<String>,
    Query(q): Query<Vec<(String, String)>>,
) -> Response {
    if let Err(e) = who.require(Scope::Read, Some(&tenant)) {
        return s.refused(e.into());
    }
    let q = match check::unique_query(q) {
        Ok(q) => q,
        Err(e) => return s.refused(e.into()),
    };
    match s
        .decider
        .peek(&tenant, q.get("key").map(String::as_str))
        .await
    {
        Ok(u) => axum::Json(u).into_response(),
        Err(e) => s.refused(e.into()),
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let now = tierlimit_shared::messages::now_ms();
    if let Some(age) = s.view.age_ms(now) {
        s.metrics.view_age_seconds.set(age as f64 / 1000.0);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// Ready once the broadcast view has been read to the end (DESIGN). Redis is
/// reported but does not gate readiness: while it is down a node still
/// serves, by its plans' `on_store_error`, and taking every node of a region
/// out of its load balancer would defeat `open` and `local`. Redis health is
/// alerted on through `tierlimit_store_up`.
async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    let store = s.decider.store().is_up();
    let view = s.view.caught_up();
    // The node's clock against Redis': reported, never gating (decisions
    // take Redis' day; an offset past node.max_clock_offset is for the
    // operator to fix, and is alerted on).
    let clock = s.decider.clock_status();
    // With limits on the topic: read to the end once (or the region's copy
    // loaded), else every registered tenant would look unknown.
    let limits = s.live.load().limits().map(|t| {
        json!({
            "ready": t.is_ready(),
            "applied_version": t.applied_version(),
            "tenants": t.len(),
            "from_region_copy": s.metrics.limits_from_copy.get() == 1,
        })
    });
    let limits_ready = s.live.load().limits().is_none_or(|t| t.is_ready());
    let body = json!({
        "redis": store,
        "broadcast_view_caught_up": view,
        "clock": clock,
        "limits": limits,
    });
    let status = if view && limits_ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

impl AppState {
    /// Counts a refusal of the listener layers (auth, limits) under its
    /// problem slug, like the handlers' own refusals.
    fn on_reject(&self) -> tierlimit_shared::serve::OnReject {
        let m = Arc::clone(&self.metrics);
        Arc::new(move |slug| m.bad_requests.with_label_values(&[slug]).inc())
    }

    fn refused(&self, p: Problem) -> Response {
        if p.status() != StatusCode::SERVICE_UNAVAILABLE {
            self.metrics
                .bad_requests
                .with_label_values(&[p.slug()])
                .inc();
        }
        p.into_response()
    }
}

fn decision_response(d: Decision) -> Response {
    if d.allowed {
        // One right-sized buffer for the body (axum::Json starts at 128
        // bytes and grows), handed to the response without a copy.
        let mut body = Vec::with_capacity(640);
        if serde_json::to_writer(&mut body, &d).is_err() {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
        let mut resp = Response::new(axum::body::Body::from(body));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        rate_limit_headers(resp.headers_mut(), &d.tiers);
        return resp;
    }
    let tier = d.denied_by.unwrap_or(Tier::Global);
    let violated = d
        .tiers
        .iter()
        .find(|t| t.tier == tier && (tier != Tier::Global || t.period == d.denied_period));
    let name = crate::decision::policy_name(tier, d.denied_period);
    let detail = match (violated, d.retry_after_ms) {
        (Some(t), Some(_)) => format!(
            "tenant {:?} exceeded the {} policy ({} per {})",
            d.tenant,
            name,
            t.limit,
            tierlimit_shared::duration::format(std::time::Duration::from_millis(t.window_ms))
        ),
        (Some(t), None) => format!(
            "cost {} can never fit the {} policy ({} per {})",
            d.cost,
            name,
            t.limit,
            tierlimit_shared::duration::format(std::time::Duration::from_millis(t.window_ms))
        ),
        (None, _) => format!("tenant {:?} exceeded the {} policy", d.tenant, name),
    };
    // The problem body, serialized straight from the decision. It is what
    // `Problem` would build (same members, in the same sorted order), without
    // an intermediate `serde_json::Map`: denials are the hot path of a
    // tenant over its limit.
    let body = RateLimited {
        cost: d.cost,
        detail: &detail,
        key: &d.key,
        mode: d.mode.name(),
        plan: &d.plan,
        retry_after_ms: d.retry_after_ms,
        status: StatusCode::TOO_MANY_REQUESTS.as_u16(),
        tenant: &d.tenant,
        tiers: SortedTiers(&d.tiers),
        title: "Rate limit exceeded",
        kind: RATE_LIMITED_TYPE,
        violated: name,
    };
    let mut buf = Vec::with_capacity(768);
    if serde_json::to_writer(&mut buf, &body).is_err() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    let mut resp = Response::new(axum::body::Body::from(buf));
    *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let h = resp.headers_mut();
    if let Some(ms) = d.retry_after_ms {
        h.insert(
            header::RETRY_AFTER,
            HeaderValue::from(ms.div_ceil(1000).max(1)),
        );
    }
    rate_limit_headers(h, &d.tiers);
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

/// `PROBLEM_BASE` + `rate-limited`, as a constant for the hot path.
const RATE_LIMITED_TYPE: &str = "https://tierlimit.dev/problems/rate-limited";

/// The 429 problem body (RFC 9457). Members are in the sorted order a
/// `serde_json::Map` produces, so the bytes match the generic builder's.
#[derive(Serialize)]
struct RateLimited<'a> {
    cost: u64,
    detail: &'a str,
    key: &'a str,
    mode: &'static str,
    plan: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
    status: u16,
    tenant: &'a str,
    tiers: SortedTiers<'a>,
    title: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(rename = "violated-policy")]
    violated: &'static str,
}

/// Tiers with their members in sorted order (as `serde_json::to_value`
/// would give them).
struct SortedTiers<'a>(&'a [TierStatus]);

impl Serialize for SortedTiers<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Sorted {
            algorithm: &'static str,
            limit: u64,
            #[serde(skip_serializing_if = "Option::is_none")]
            period: Option<tierlimit_shared::period::PeriodKind>,
            remaining: u64,
            reset_ms: u64,
            tier: Tier,
            window_ms: u64,
        }
        s.collect_seq(self.0.iter().map(|t| Sorted {
            algorithm: t.algorithm,
            limit: t.limit,
            period: t.period,
            remaining: t.remaining,
            reset_ms: t.reset_ms,
            tier: t.tier,
            window_ms: t.window_ms,
        }))
    }
}

/// `RateLimit-Policy` / `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10,
/// one policy per tier) and the legacy `X-RateLimit-*` trio, which reports
/// the tier with the fewest units remaining.
fn rate_limit_headers(h: &mut HeaderMap, tiers: &[TierStatus]) {
    const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
    const STATE: HeaderName = HeaderName::from_static("ratelimit");
    const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
    const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
    const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
    if tiers.is_empty() {
        return;
    }
    let secs = |ms: u64| ms.div_ceil(1000);
    // Written in place (no per-tier strings), handed over without a copy.
    let mut policy = String::with_capacity(32 * tiers.len());
    let mut state = String::with_capacity(32 * tiers.len());
    for (i, t) in tiers.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        let name = t.name();
        let _ = write!(
            policy,
            "\"{name}\";q={};w={}",
            t.limit,
            secs(t.window_ms).max(1)
        );
        let _ = write!(state, "\"{name}\";r={};t={}", t.remaining, secs(t.reset_ms));
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(policy)) {
        h.insert(POLICY, v);
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(state)) {
        h.insert(STATE, v);
    }
    let tightest = tiers.iter().min_by_key(|t| t.remaining).expect("non-empty");
    h.insert(LIMIT, HeaderValue::from(tightest.limit));
    h.insert(REMAINING, HeaderValue::from(tightest.remaining));
    h.insert(RESET, HeaderValue::from(secs(tightest.reset_ms)));
}

#[cfg(test)]
mod tests {
    use tierlimit_shared::problem::PROBLEM_BASE;

    use super::*;

    #[test]
    fn the_tenant_of_a_handle_is_read_without_the_secret() {
        let signer = crate::refund::Signer::new(b"a region secret of at least 32 bytes!");
        let h = signer.sign(&crate::refund::Handle {
            region: "eu".into(),
            node: "a".into(),
            tenant: "acme".into(),
            key: "k".into(),
            cost: 1,
            charged_at_ms: 1,
            id: "x".into(),
            windows: Vec::new(),
        });
        assert_eq!(check::handle_tenant(&h).as_deref(), Some("acme"));
        let old = signer.sign_previous(&crate::refund::PreviousHandle {
            tenant: "acme".into(),
            key: "k".into(),
            cost: 1,
            charged_at_ms: 1,
            id: "x".into(),
        });
        assert_eq!(check::handle_tenant(&old).as_deref(), Some("acme"));
        assert_eq!(check::handle_tenant("garbage"), None);
    }

    #[test]
    fn rate_limited_type_is_under_the_problem_base() {
        assert_eq!(RATE_LIMITED_TYPE, format!("{PROBLEM_BASE}rate-limited"));
    }
}
