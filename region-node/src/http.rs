//! The HTTP API of a region-node (axum).
//!
//! Every refusal is an RFC 9457 `application/problem+json` body that names
//! what was wrong (the field, or the violated policy), and nothing is charged
//! for a request that fails validation: validation happens before the
//! decision script runs.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::decision::{DecideError, Decider, Decision, Request, Tier, TierStatus};
use crate::metrics::Metrics;
use crate::view::View;

/// Shared state of every handler.
pub struct AppState {
    pub decider: Decider,
    pub metrics: Arc<Metrics>,
    pub view: Arc<View>,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/check", post(check_post).get(check_get))
        .route("/v1/refund", post(refund))
        .route("/v1/tenants/{tenant}", get(tenant_usage))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

const PROBLEM_BASE: &str = "https://tierlimit.dev/problems/";

/// An RFC 9457 problem response.
pub struct Problem {
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    detail: String,
    extra: serde_json::Map<String, Value>,
    headers: HeaderMap,
}

impl Problem {
    fn new(status: StatusCode, slug: &'static str, title: &'static str, detail: impl Into<String>) -> Problem {
        Problem {
            status,
            slug,
            title,
            detail: detail.into(),
            extra: serde_json::Map::new(),
            headers: HeaderMap::new(),
        }
    }

    fn with(mut self, k: &str, v: impl Into<Value>) -> Problem {
        self.extra.insert(k.into(), v.into());
        self
    }

    fn bad_field(field: &str, detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, "invalid-field", "Invalid request field", detail).with("field", field)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = serde_json::Map::new();
        body.insert("type".into(), format!("{PROBLEM_BASE}{}", self.slug).into());
        body.insert("title".into(), self.title.into());
        body.insert("status".into(), self.status.as_u16().into());
        body.insert("detail".into(), self.detail.into());
        body.extend(self.extra);
        let mut resp = (self.status, serde_json::to_string(&body).unwrap_or_default()).into_response();
        resp.headers_mut().extend(self.headers);
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        resp
    }
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
            DecideError::Unavailable => {
                let mut p = Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store-unavailable",
                    "Rate limit store unavailable",
                    e.to_string(),
                )
                .with("violated-policy", "store");
                p.headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                p
            }
        }
    }
}

/// The JSON body of check and refund.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    tenant: Option<String>,
    key: Option<String>,
    cost: Option<u64>,
}

fn parse_body(headers: &HeaderMap, body: &[u8]) -> Result<(String, Option<String>, u64), Problem> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = ct.split(';').next().unwrap_or("").trim();
    if !mime.eq_ignore_ascii_case("application/json") {
        return Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
            format!("expected Content-Type: application/json, got {ct:?}"),
        ));
    }
    let b: Body = serde_json::from_slice(body).map_err(|e| {
        Problem::new(StatusCode::BAD_REQUEST, "invalid-json", "Invalid JSON body", e.to_string())
    })?;
    let tenant = b.tenant.ok_or_else(|| Problem::bad_field("tenant", "tenant is required"))?;
    Ok((tenant, b.key, b.cost.unwrap_or(1)))
}

fn parse_query(q: &HashMap<String, String>) -> Result<(String, Option<String>, u64), Problem> {
    if let Some(unknown) = q.keys().find(|k| !["tenant", "key", "cost"].contains(&k.as_str())) {
        return Err(Problem::bad_field(unknown, format!("unknown query parameter {unknown:?}")));
    }
    let tenant = q
        .get("tenant")
        .cloned()
        .ok_or_else(|| Problem::bad_field("tenant", "tenant is required"))?;
    let cost = match q.get("cost") {
        None => 1,
        Some(c) => c
            .parse::<u64>()
            .map_err(|_| Problem::bad_field("cost", format!("cost must be a positive integer, got {c:?}")))?,
    };
    Ok((tenant, q.get("key").cloned(), cost))
}

async fn check_post(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    match parse_body(&headers, &body) {
        Ok((t, k, c)) => decide(&s, t, k, c).await,
        Err(p) => s.refused(p),
    }
}

/// Forward-auth form (nginx `auth_request`, Traefik ForwardAuth, Envoy
/// ext_authz HTTP): 200 allows, 429 denies.
async fn check_get(State(s): State<Arc<AppState>>, Query(q): Query<HashMap<String, String>>) -> Response {
    match parse_query(&q) {
        Ok((t, k, c)) => decide(&s, t, k, c).await,
        Err(p) => s.refused(p),
    }
}

async fn decide(s: &AppState, tenant: String, key: Option<String>, cost: u64) -> Response {
    let req = Request {
        tenant: &tenant,
        key: key.as_deref(),
        cost,
    };
    match s.decider.check(req).await {
        Ok(d) => decision_response(d),
        Err(e) => s.refused(e.into()),
    }
}

async fn refund(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let (tenant, key, cost) = match parse_body(&headers, &body) {
        Ok(v) => v,
        Err(p) => return s.refused(p),
    };
    let req = Request {
        tenant: &tenant,
        key: key.as_deref(),
        cost,
    };
    match s.decider.refund(req).await {
        Ok(d) => {
            let mut resp = axum::Json(json!({
                "refunded": d.cost,
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
    Path(tenant): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    match s.decider.peek(&tenant, q.get("key").map(String::as_str)).await {
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

async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    let store = s.decider.store().is_up();
    let view = s.view.caught_up();
    let body = json!({ "redis": store, "broadcast_view_caught_up": view });
    let status = if store && view {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

impl AppState {
    fn refused(&self, p: Problem) -> Response {
        if p.status != StatusCode::SERVICE_UNAVAILABLE {
            self.metrics.bad_requests.with_label_values(&[p.slug]).inc();
        }
        p.into_response()
    }
}

fn decision_response(d: Decision) -> Response {
    if d.allowed {
        let mut resp = axum::Json(&d).into_response();
        rate_limit_headers(resp.headers_mut(), &d.tiers);
        return resp;
    }
    let tier = d.denied_by.unwrap_or(Tier::Global);
    let violated = d.tiers.iter().find(|t| t.tier == tier);
    let detail = match (violated, d.retry_after_ms) {
        (Some(t), Some(_)) => format!(
            "tenant {:?} exceeded the {} policy ({} per {})",
            d.tenant,
            tier.name(),
            t.limit,
            tierlimit_shared::duration::format(std::time::Duration::from_millis(t.window_ms))
        ),
        (Some(t), None) => format!(
            "cost {} can never fit the {} policy ({} per {})",
            d.cost,
            tier.name(),
            t.limit,
            tierlimit_shared::duration::format(std::time::Duration::from_millis(t.window_ms))
        ),
        (None, _) => format!("tenant {:?} exceeded the {} policy", d.tenant, tier.name()),
    };
    let mut p = Problem::new(StatusCode::TOO_MANY_REQUESTS, "rate-limited", "Rate limit exceeded", detail)
        .with("violated-policy", tier.name())
        .with("tenant", d.tenant.clone())
        .with("key", d.key.clone())
        .with("cost", d.cost)
        .with("plan", d.plan.clone())
        .with("mode", d.mode.name())
        .with("tiers", serde_json::to_value(&d.tiers).unwrap_or_default());
    if let Some(ms) = d.retry_after_ms {
        p = p.with("retry_after_ms", ms);
        let secs = ms.div_ceil(1000).max(1);
        p.headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    rate_limit_headers(&mut p.headers, &d.tiers);
    p.into_response()
}

/// `RateLimit-Policy` / `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10,
/// one policy per tier) and the legacy `X-RateLimit-*` trio, which reports
/// the tier with the fewest units remaining.
fn rate_limit_headers(h: &mut HeaderMap, tiers: &[TierStatus]) {
    if tiers.is_empty() {
        return;
    }
    let secs = |ms: u64| ms.div_ceil(1000);
    let policy = tiers
        .iter()
        .map(|t| format!("\"{}\";q={};w={}", t.tier.name(), t.limit, secs(t.window_ms).max(1)))
        .collect::<Vec<_>>()
        .join(", ");
    let state = tiers
        .iter()
        .map(|t| format!("\"{}\";r={};t={}", t.tier.name(), t.remaining, secs(t.reset_ms)))
        .collect::<Vec<_>>()
        .join(", ");
    if let Ok(v) = HeaderValue::from_str(&policy) {
        h.insert("ratelimit-policy", v);
    }
    if let Ok(v) = HeaderValue::from_str(&state) {
        h.insert("ratelimit", v);
    }
    let tightest = tiers.iter().min_by_key(|t| t.remaining).expect("non-empty");
    h.insert("x-ratelimit-limit", HeaderValue::from(tightest.limit));
    h.insert("x-ratelimit-remaining", HeaderValue::from(tightest.remaining));
    h.insert("x-ratelimit-reset", HeaderValue::from(secs(tightest.reset_ms)));
}
