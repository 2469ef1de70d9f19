//! The limits API: reading and writing tenants and plans on the limits
//! topic over HTTP, on the aggregator's API listener.
//!
//! Why on the aggregator: it already follows the topic (its table answers
//! every read without Kafka), serves an authenticated API with the same
//! keys, and an operator runs it centrally; a binary of its own would be one
//! more process to deploy, key and watch for the same table.
//!
//! **One writer.** Kafka has no compare-and-set, so an `If-Match` is exact
//! only if one process writes at a time, after reading everything before
//! (`limits::write`). The writer is the aggregator holding deltas partition
//! 0 ([`WRITER_PARTITION`]): the consumer group already elects exactly one
//! owner per partition and moves it when an aggregator dies. Any aggregator
//! serves writes: one that is not the writer forwards the request to its
//! `aggregator.peers` until the writer answers (a peer that is not the
//! writer answers 421 to a forwarded request). A new writer waits
//! [`TAKEOVER_WAIT`] before writing, so a record the previous one produced
//! just before losing the place (the producer gives up after
//! `write::PRODUCE_TIMEOUT`) has landed and is seen by the check.
//!
//! Every write is validated by the same functions as a TOML file
//! (`config::resolve_plan`, `config::resolve_tenant`), against the table
//! the write is checked on, and refused with a problem+json naming the
//! field. Optimistic concurrency: a read returns the version as its `ETag`;
//! a write with `If-Match: "<version>"` is refused (412) if the subject has
//! moved on, checked inside the fence, so two writers racing on one version
//! get one 200 and one 412. `If-None-Match: *` creates only.
//!
//! Scopes: reads need `read` (a key restricted to tenants reads only
//! those); writes need `limits:write`, which a restricted key cannot hold
//! (`auth.rs`).

// Every check here ends in an HTTP answer: its `Err` is the problem+json
// itself, built once on a refusal path, never on a hot one.
#![allow(clippy::result_large_err)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Extension, Path, Query, State as AxumState};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use tierlimit_shared::auth::{Principal, Scope};
use tierlimit_shared::config::{resolve_plan, resolve_tenant, PlanConfig, TenantConfig};
use tierlimit_shared::limits::table::{TenantFilter, TenantView};
use tierlimit_shared::limits::write::{WriteError, Writer};
use tierlimit_shared::limits::{Body, LimitsRecord, LimitsTable, Subject};
use tierlimit_shared::problem::Problem;

use crate::state::State;

type AppState = Arc<State>;

/// Changes kept for the history routes (all subjects together).
const HISTORY: usize = 10_000;
/// Largest page of a listing.
const MAX_PAGE: usize = 1000;

/// The deltas partition whose owner writes limits.
pub const WRITER_PARTITION: i32 = 0;
/// How long a new writer waits before its first write: the previous
/// writer's last produce attempt is over by then.
pub const TAKEOVER_WAIT: Duration = Duration::from_millis(
    tierlimit_shared::limits::write::PRODUCE_TIMEOUT.as_millis() as u64 + 1000,
);
/// How long a write waits for a writer (an aggregator starting, a writer
/// moving) before it is refused.
const WRITER_DEADLINE: Duration = Duration::from_secs(8);
/// Marks a forwarded write: it is never forwarded again.
const FORWARDED: &str = "x-tierlimit-forwarded";
/// Largest body a write may have (a batch of an import).
const MAX_BODY: usize = 32 << 20;

/// Where the writer's place is, seen from this aggregator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Held long enough: this aggregator writes.
    Held,
    /// Held, but for less than [`TAKEOVER_WAIT`].
    Taking(Duration),
    /// Another aggregator holds it (or none, during a rebalance).
    Elsewhere,
}

pub fn place(state: &State) -> Place {
    match state.writer_since() {
        None => Place::Elsewhere,
        Some(since) => match TAKEOVER_WAIT.checked_sub(since.elapsed()) {
            None => Place::Held,
            Some(left) if left.is_zero() => Place::Held,
            Some(left) => Place::Taking(left),
        },
    }
}

/// A refusal when the place moved away between the routing and the write.
fn still_writer(state: &State) -> Result<(), Problem> {
    match place(state) {
        Place::Held => Ok(()),
        _ => Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "limits-writer-moved",
            "The limits writer moved",
            "this aggregator stopped being the limits writer during the request: nothing was written, try again",
        )),
    }
}

/// Routes every write to the writer: served here if this aggregator holds
/// the place, else forwarded to the peers (see the module doc). Reads pass.
pub async fn route_writes(
    AxumState(state): AxumState<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.method() == axum::http::Method::GET || req.method() == axum::http::Method::HEAD {
        return next.run(req).await;
    }
    let forwarded = req.headers().contains_key(FORWARDED);
    let deadline = tokio::time::Instant::now() + WRITER_DEADLINE;
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e) => {
            return problem(
                &state,
                Problem::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body-too-large",
                    "Request body too large",
                    format!("{e} (at most {MAX_BODY} bytes: split the import)"),
                ),
            )
        }
    };
    loop {
        match place(&state) {
            Place::Held => {
                let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(body));
                return next.run(req).await;
            }
            Place::Taking(left) => {
                tokio::time::sleep_until((tokio::time::Instant::now() + left).min(deadline)).await;
            }
            Place::Elsewhere if forwarded => {
                return problem(
                    &state,
                    Problem::new(
                        StatusCode::MISDIRECTED_REQUEST,
                        "not-the-limits-writer",
                        "Not the limits writer",
                        "this aggregator does not hold deltas partition 0, the limits writer's place",
                    ),
                );
            }
            Place::Elsewhere => {
                if let Some(resp) = forward(&state, &parts, &body).await {
                    return resp;
                }
                let pause = tokio::time::Instant::now() + Duration::from_millis(200);
                tokio::time::sleep_until(pause.min(deadline)).await;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            let peers = state.live().load().config.aggregator.peers.clone();
            return problem(
                &state,
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "limits-writer-unavailable",
                    "No limits writer reachable",
                    format!(
                        "no aggregator holding deltas partition 0 (the limits writer) answered within {WRITER_DEADLINE:?}; \
                         this one does not hold it, and its aggregator.peers are {peers:?}"
                    ),
                )
                .with_header(header::RETRY_AFTER, HeaderValue::from_static("2")),
            );
        }
    }
}

/// Sends a write to each peer in turn; the first answer that is not
/// "not the writer" (421) is the answer. `None`: no peer wrote.
async fn forward(
    state: &State,
    parts: &axum::http::request::Parts,
    body: &Bytes,
) -> Option<Response> {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    let client = CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("a plain HTTP client")
    });
    let peers = state.live().load().config.aggregator.peers.clone();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    for peer in peers {
        let url = format!("{}{path}", peer.trim_end_matches('/'));
        let Ok(method) = reqwest::Method::from_bytes(parts.method.as_str().as_bytes()) else {
            return None;
        };
        let mut req = client.request(method, &url).header(FORWARDED, "1");
        for name in [
            header::AUTHORIZATION.as_str(),
            "x-api-key",
            header::IF_MATCH.as_str(),
            header::IF_NONE_MATCH.as_str(),
            header::CONTENT_TYPE.as_str(),
        ] {
            if let Some(v) = parts.headers.get(name) {
                req = req.header(name, v.as_bytes());
            }
        }
        let resp = match req.body(body.clone()).send().await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(%url, error = %e, "limits peer unreachable");
                continue;
            }
        };
        if resp.status().as_u16() == StatusCode::MISDIRECTED_REQUEST.as_u16() {
            continue;
        }
        let status =
            StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let mut headers = HeaderMap::new();
        for name in [header::CONTENT_TYPE, header::ETAG, header::RETRY_AFTER] {
            if let Some(v) = resp.headers().get(name.as_str()) {
                if let Ok(v) = HeaderValue::from_bytes(v.as_bytes()) {
                    headers.insert(name, v);
                }
            }
        }
        let bytes = resp.bytes().await.unwrap_or_default();
        return Some((status, headers, bytes).into_response());
    }
    None
}

/// The routes (added to the authenticated API router).
pub fn routes(state: AppState) -> Router<AppState> {
    Router::new()
        .route("/v1/limits/tenants", get(list_tenants))
        .route(
            "/v1/limits/tenants/{id}",
            get(get_tenant).put(put_tenant).delete(delete_tenant),
        )
        .route("/v1/limits/tenants/{id}/history", get(tenant_history))
        .route(
            "/v1/limits/tenants/{id}/grants",
            axum::routing::post(grant_tenant),
        )
        .route("/v1/limits/plans", get(list_plans))
        .route(
            "/v1/limits/plans/{name}",
            get(get_plan).put(put_plan).delete(delete_plan),
        )
        .route("/v1/limits/plans/{name}/history", get(plan_history))
        .route("/v1/limits/import", axum::routing::post(import))
        .route("/v1/limits/export", get(export))
        .layer(axum::middleware::from_fn_with_state(state, route_writes))
}

/// One change as the follower applied it.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub kind: &'static str,
    pub name: String,
    pub version: u64,
    /// The version it replaced (0: none).
    pub previous_version: u64,
    pub writer: String,
    pub ts_ms: u64,
    /// `put` or `delete`.
    pub change: &'static str,
}

/// The latest changes this aggregator applied (at most [`HISTORY`], all
/// subjects together): what it read of the topic since it started. The
/// topic is compacted, so older history lives in the `tierlimit::audit`
/// log lines every writer emits.
#[derive(Default)]
pub struct History(Mutex<VecDeque<Change>>);

impl History {
    pub fn record(&self, r: &LimitsRecord, previous_version: u64) {
        let (kind, name) = match &r.subject {
            Subject::Tenant(t) => ("tenant", t.clone()),
            Subject::Plan(p) => ("plan", p.clone()),
        };
        let mut h = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if h.len() == HISTORY {
            h.pop_front();
        }
        h.push_back(Change {
            kind,
            name,
            version: r.version,
            previous_version,
            writer: r.writer.clone(),
            ts_ms: r.ts_ms,
            change: match r.body {
                Body::Deleted => "delete",
                _ => "put",
            },
        });
    }

    /// A subject's changes, newest first.
    fn of(&self, kind: &str, name: &str) -> Vec<Change> {
        let h = self.0.lock().unwrap_or_else(|e| e.into_inner());
        h.iter()
            .rev()
            .filter(|c| c.kind == kind && c.name == name)
            .cloned()
            .collect()
    }
}

/// The process's writer, made on the first write (it needs
/// `wire.limits_private_key`, which an aggregator that only reads lacks).
#[derive(Default)]
pub struct WriterSlot(tokio::sync::Mutex<Option<Writer>>);

/// A handler's result: its answer, or a refusal counted and answered as
/// problem+json.
fn answer(state: &State, r: Result<Response, Problem>) -> Response {
    r.unwrap_or_else(|p| problem(state, p))
}

/// A counted refusal (the API's one: `http::refuse`).
fn problem(state: &State, p: Problem) -> Response {
    crate::http::refuse(state, p)
}

/// The table, or 404 when tenants come from the file.
fn table_of(state: &State) -> Result<Arc<LimitsTable>, Problem> {
    state.live().load().limits().cloned().ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "limits-from-file",
            "Limits come from the configuration file",
            "limits.source is \"file\": tenants and plans are edited in the file, not through the API",
        )
    })
}

fn etag(version: u64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{version}\"")).expect("digits")
}

/// The preconditions of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Precondition {
    None,
    /// `If-Match`: the subject's version must be this (0: absent).
    Version(u64),
    /// `If-None-Match: *`: the subject must not exist.
    Absent,
}

fn precondition(h: &HeaderMap) -> Result<Precondition, Problem> {
    if let Some(v) = h.get(header::IF_MATCH) {
        let text = v.to_str().unwrap_or("").trim();
        let text = text.strip_prefix("W/").unwrap_or(text).trim_matches('"');
        return text.parse().map(Precondition::Version).map_err(|_| {
            Problem::bad_field(
                "If-Match",
                format!("expected a version as the read's ETag gave it (\"123\"), got {text:?}"),
            )
        });
    }
    if let Some(v) = h.get(header::IF_NONE_MATCH) {
        if v.as_bytes() == b"*" {
            return Ok(Precondition::Absent);
        }
        return Err(Problem::bad_field(
            "If-None-Match",
            "only `*` (create, never replace) is understood",
        ));
    }
    Ok(Precondition::None)
}

/// Checks a precondition against the subject's current version (inside
/// the writer's fence).
fn check_precondition(pre: Precondition, current: u64, exists: bool) -> Result<(), Problem> {
    let stale = |detail: String| {
        Problem::new(
            StatusCode::PRECONDITION_FAILED,
            "stale-version",
            "The subject changed since it was read",
            detail,
        )
        .with("current_version", current)
    };
    match pre {
        Precondition::None => Ok(()),
        Precondition::Version(v) if v == current && (exists || v == 0) => Ok(()),
        Precondition::Version(v) => Err(stale(format!(
            "If-Match names version {v}; the current version is {current}: read it again and retry"
        ))),
        Precondition::Absent if !exists => Ok(()),
        Precondition::Absent => Err(stale("If-None-Match: * but it exists".into())),
    }
}

/// Parses a JSON body, naming the field that fails.
fn parse_body<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Problem> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." { "body".into() } else { field };
        Problem::bad_field(&field, format!("{}", e.inner()))
    })
}

/// The problem of a configuration error, naming its key.
pub fn invalid(e: tierlimit_shared::config::ConfigError) -> Problem {
    let field = e.key().unwrap_or("body").to_owned();
    Problem::bad_field(&field, e.to_string())
}

/// Validates a tenant record as a file's `[tenants.<id>]` is validated.
pub fn check_tenant(table: &LimitsTable, id: &str, t: &TenantConfig) -> Result<(), Problem> {
    tierlimit_shared::validate::tenant(id)
        .map_err(|e| Problem::bad_field("tenant", e.to_string()))?;
    let at = format!("tenants.{id}");
    let Some(plan) = table.plan(&t.plan) else {
        return Err(Problem::bad_field(
            "plan",
            format!(
                "{at}.plan: no plan named {:?} on the topic or in the configuration",
                t.plan
            ),
        ));
    };
    resolve_tenant(&at, t, &plan).map_err(invalid)?;
    Ok(())
}

/// Validates a plan record as a file's `[plans.<name>]` is validated.
pub fn check_plan(name: &str, p: &PlanConfig) -> Result<(), Problem> {
    tierlimit_shared::validate::name("plan name", name)
        .map_err(|e| Problem::bad_field("plan", e.to_string()))?;
    resolve_plan(name, p).map_err(invalid)?;
    Ok(())
}

/// A plan still used by tenants cannot be deleted (they would all become
/// unknown tenants at once).
pub fn check_plan_unused(table: &LimitsTable, name: &str) -> Result<(), Problem> {
    let n = table.tenants_of_plan(name);
    if n > 0 {
        return Err(Problem::new(
            StatusCode::CONFLICT,
            "plan-in-use",
            "The plan still has tenants",
            format!("{n} tenants are on plan {name:?}: move them first"),
        )
        .with("tenants", n));
    }
    Ok(())
}

/// Runs a write through the process's writer.
async fn write(
    state: &State,
    who: &Principal,
    plan: impl FnOnce(&LimitsTable) -> Result<Vec<(Subject, Body)>, Problem>,
) -> Result<tierlimit_shared::limits::write::Written, Problem> {
    let table = table_of(state)?;
    let mut slot = state.limits_writer.0.lock().await;
    if slot.is_none() {
        let config = state.live().load().config.clone();
        let w = Writer::new(&config, "aggregator", table).map_err(|e| {
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "limits-writer-unavailable",
                "This aggregator cannot write limits",
                format!("{e} (wire.limits_private_key)"),
            )
        })?;
        *slot = Some(w);
    }
    let w = slot.as_mut().expect("made above");
    // Checked again inside the write, after the topic was read to its end
    // and right before producing: the place may have moved meanwhile.
    let plan = |table: &LimitsTable| {
        still_writer(state)?;
        plan(table)
    };
    w.write(Some(&who.name), plan).await.map_err(|e| match e {
        WriteError::Refused(p) => p,
        WriteError::Kafka(e) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "limits-topic-unavailable",
            "The limits topic cannot be written now",
            format!("kafka: {e}"),
        ),
        WriteError::Behind => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "limits-topic-unavailable",
            "The limits topic cannot be written now",
            "this aggregator could not read the limits topic to its end: nothing was written",
        ),
    })
}

/// A tenant as the API shows it: its record's tables, flattened.
#[derive(Debug, Serialize)]
struct TenantOut {
    tenant: String,
    version: u64,
    /// Its plan is defined nowhere yet: treated as an unknown tenant.
    pending: bool,
    #[serde(flatten)]
    config: TenantConfig,
}

impl From<TenantView> for TenantOut {
    fn from(v: TenantView) -> Self {
        TenantOut {
            tenant: v.id,
            version: v.version,
            pending: v.pending,
            config: v.config,
        }
    }
}

fn written_response(
    status: StatusCode,
    written: &tierlimit_shared::limits::write::Written,
    body: serde_json::Value,
) -> Response {
    let version = written.records.last().map_or(0, |r| r.version);
    let mut body = body;
    body["version"] = version.into();
    body["applied"] = written.applied.into();
    let mut r = (status, Json(body)).into_response();
    r.headers_mut().insert(header::ETAG, etag(version));
    r
}

async fn get_tenant(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::Read, Some(&id))?;
            let table = table_of(&state)?;
            match table.tenant_view(&id) {
                Some(v) => {
                    let version = v.version;
                    let mut r = Json(TenantOut::from(v)).into_response();
                    r.headers_mut().insert(header::ETAG, etag(version));
                    Ok(r)
                }
                None => Err(not_found("tenant", &id)),
            }
        }
        .await,
    )
}

fn not_found(kind: &str, name: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "not-found",
        "No such record",
        format!("no {kind} {name:?} on the limits topic"),
    )
    .with(kind, name)
}

async fn put_tenant(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::LimitsWrite, Some(&id))?;
            let pre = precondition(&headers)?;
            let config: TenantConfig = parse_body(&body)?;
            let mut existed = false;
            let subject = Subject::Tenant(id.clone());
            let w = write(&state, &who, |table| {
                check_tenant(table, &id, &config)?;
                let view = table.tenant_view(&id);
                existed = view.is_some();
                check_precondition(pre, view.map_or(0, |v| v.version), existed)?;
                Ok(vec![(subject.clone(), Body::Tenant(config.clone()))])
            })
            .await?;
            Ok({
                let status = if existed {
                    StatusCode::OK
                } else {
                    StatusCode::CREATED
                };
                let body = serde_json::json!({"tenant": id, "config": config});
                written_response(status, &w, body)
            })
        }
        .await,
    )
}

async fn delete_tenant(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::LimitsWrite, Some(&id))?;
            let pre = precondition(&headers)?;
            let subject = Subject::Tenant(id.clone());
            let w = write(&state, &who, |table| {
                let Some(view) = table.tenant_view(&id) else {
                    return Err(not_found("tenant", &id));
                };
                check_precondition(pre, view.version, true)?;
                Ok(vec![(subject.clone(), Body::Deleted)])
            })
            .await?;
            Ok(written_response(
                StatusCode::OK,
                &w,
                serde_json::json!({"tenant": id, "deleted": true}),
            ))
        }
        .await,
    )
}

/// A grant's request body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantBody {
    /// The tier: `hour`, `day`, `week` or `month`; the current period of it
    /// (UTC) gets the units.
    period: tierlimit_shared::period::PeriodKind,
    extra: u64,
    #[serde(default)]
    reason: Option<String>,
}

/// `POST /v1/limits/tenants/{id}/grants`: extra units for the current
/// period of one of the tenant's global tiers. A PN-counter cannot be
/// reset safely, so the period's limit is raised instead; the grant is
/// part of the tenant's record (audited like any change) and ends with the
/// period. Two grants for one period add up.
async fn grant_tenant(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(
        &state,
        async {
            use tierlimit_shared::config::Grant;
            who.require(Scope::LimitsWrite, Some(&id))?;
            let pre = precondition(&headers)?;
            let g: GrantBody = parse_body(&body)?;
            if g.extra == 0 {
                return Err(Problem::bad_field("extra", "must be at least 1"));
            }
            if g.reason.as_ref().is_some_and(|r| r.len() > 500) {
                return Err(Problem::bad_field("reason", "at most 500 bytes"));
            }
            let now = tierlimit_shared::messages::now_ms();
            let mut granted = None;
            let mut zone = tierlimit_shared::zone::Zone::UTC;
            let subject = Subject::Tenant(id.clone());
            let w = write(&state, &who, |table| {
                let Some(view) = table.tenant_view(&id) else {
                    return Err(not_found("tenant", &id));
                };
                check_precondition(pre, view.version, true)?;
                let policy = table.tenant_at(&id, now);
                let has_tier = policy
                    .as_ref()
                    .is_some_and(|p| p.global_limit(g.period).is_some());
                // The period now on the tenant's own calendar.
                zone = policy.map_or(zone, |p| p.time_zone);
                let start = g.period.at_in(zone, now).start_ms().max(0) as u64;
                if !has_tier {
                    return Err(Problem::bad_field(
                        "period",
                        format!("tenant {id:?} has no {:?} tier to raise", g.period),
                    ));
                }
                let mut config = view.config;
                // Ended grants go; one for the same period adds up.
                config.grants.retain(|x| x.until_ms(zone) > now);
                match config
                    .grants
                    .iter_mut()
                    .find(|x| x.period == g.period && x.period_start_ms == start)
                {
                    Some(x) => {
                        x.extra = x.extra.saturating_add(g.extra);
                        if g.reason.is_some() {
                            x.reason = g.reason.clone();
                        }
                    }
                    None => config.grants.push(Grant {
                        period: g.period,
                        period_start_ms: start,
                        extra: g.extra,
                        reason: g.reason.clone(),
                    }),
                }
                granted = config
                    .grants
                    .iter()
                    .find(|x| x.period == g.period && x.period_start_ms == start)
                    .cloned();
                check_tenant(table, &id, &config)?;
                Ok(vec![(subject.clone(), Body::Tenant(config))])
            })
            .await?;
            Ok({
                let table = table_of(&state).ok();
                let limit = table
                    .and_then(|t| t.tenant(&id))
                    .and_then(|p| p.global_limit(g.period));
                let grant = granted.map(|x| {
                    serde_json::json!({
                        "period": x.period, "period_start_ms": x.period_start_ms,
                        "extra": x.extra, "until_ms": x.until_ms(zone), "reason": x.reason,
                    })
                });
                written_response(
                    StatusCode::OK,
                    &w,
                    serde_json::json!({"tenant": id, "grant": grant, "limit_now": limit}),
                )
            })
        }
        .await,
    )
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    plan: Option<String>,
    overrides: Option<bool>,
    after: Option<String>,
    limit: Option<usize>,
}

async fn list_tenants(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::Read, None)?;
            let Query(q) = match query {
                Ok(q) => q,
                Err(e) => {
                    return Err(Problem::bad_field(
                        "query",
                        format!(
                        "{e} (plan=<name>, overrides=true|false, after=<id>, limit=1..{MAX_PAGE})"
                    ),
                    ))
                }
            };
            let limit = q.limit.unwrap_or(100);
            if limit == 0 || limit > MAX_PAGE {
                return Err(Problem::bad_field(
                    "limit",
                    format!("between 1 and {MAX_PAGE}"),
                ));
            }
            let table = table_of(&state)?;
            let filter = TenantFilter {
                plan: q.plan,
                overrides: q.overrides,
            };
            // A key restricted to tenants lists only those (read one by one).
            let page: Vec<TenantView> = match &who.tenants {
                Some(mine) => mine
                    .iter()
                    .filter(|t| q.after.as_ref().is_none_or(|a| *t > a))
                    .filter_map(|t| table.tenant_view(t))
                    .filter(|v| {
                        filter.plan.as_ref().is_none_or(|p| *p == v.config.plan)
                            && filter.overrides.is_none_or(|o| o != v.config.is_plain())
                    })
                    .take(limit)
                    .collect(),
                None => table.list_tenants(q.after.as_deref(), limit, &filter),
            };
            let next = (page.len() == limit).then(|| page.last().map(|v| v.id.clone()));
            let tenants: Vec<TenantOut> = page.into_iter().map(TenantOut::from).collect();
            Ok(Json(serde_json::json!({
                "tenants": tenants,
                "next": next.flatten(),
                "applied_version": table.applied_version(),
            }))
            .into_response())
        }
        .await,
    )
}

async fn tenant_history(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    answer(&state, async {
        who.require(Scope::Read, Some(&id))?;
        table_of(&state)?;
        Ok(Json(serde_json::json!({"tenant": id, "changes": state.limits_history.of("tenant", &id)}))
            .into_response())
    }
    .await)
}

async fn plan_history(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(name): Path<String>,
) -> Response {
    answer(&state, async {
        who.require(Scope::Read, None)?;
        table_of(&state)?;
        Ok(Json(serde_json::json!({"plan": name, "changes": state.limits_history.of("plan", &name)}))
            .into_response())
    }
    .await)
}

/// A plan as the API shows it.
#[derive(Debug, Serialize)]
struct PlanOut {
    plan: String,
    /// `topic` (a record; writable here) or `file` (the configuration's
    /// `[plans]`; read-only here, version 0).
    source: &'static str,
    version: u64,
    tenants: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    limits: Option<PlanConfig>,
}

fn plan_out(state: &State, table: &LimitsTable, name: &str) -> Option<PlanOut> {
    if let Some((version, Some(p))) = table.topic_plan(name) {
        return Some(PlanOut {
            plan: name.to_owned(),
            source: "topic",
            version,
            tenants: table.tenants_of_plan(name),
            limits: Some(p),
        });
    }
    let config = state.live().load();
    config.config.plans.get(name).map(|p| PlanOut {
        plan: name.to_owned(),
        source: "file",
        version: 0,
        tenants: table.tenants_of_plan(name),
        limits: Some(p.clone()),
    })
}

async fn get_plan(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(name): Path<String>,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::Read, None)?;
            let table = table_of(&state)?;
            match plan_out(&state, &table, &name) {
                Some(p) => {
                    let version = p.version;
                    let mut r = Json(p).into_response();
                    r.headers_mut().insert(header::ETAG, etag(version));
                    Ok(r)
                }
                None => Err(not_found("plan", &name)),
            }
        }
        .await,
    )
}

async fn list_plans(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::Read, None)?;
            let table = table_of(&state)?;
            let (topic, _) = table.export();
            let mut names: Vec<String> = topic.into_keys().collect();
            names.extend(table.file_plan_names());
            names.sort();
            names.dedup();
            let plans: Vec<PlanOut> = names
                .iter()
                .filter_map(|n| plan_out(&state, &table, n))
                .collect();
            Ok(Json(
                serde_json::json!({"plans": plans, "applied_version": table.applied_version()}),
            )
            .into_response())
        }
        .await,
    )
}

async fn put_plan(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::LimitsWrite, None)?;
            let pre = precondition(&headers)?;
            let config: PlanConfig = parse_body(&body)?;
            check_plan(&name, &config)?;
            let mut existed = false;
            let subject = Subject::Plan(name.clone());
            let w = write(&state, &who, |table| {
                let current = table.topic_plan(&name);
                existed = matches!(current, Some((_, Some(_))));
                check_precondition(pre, current.map_or(0, |(v, _)| v), existed)?;
                Ok(vec![(subject.clone(), Body::Plan(config.clone()))])
            })
            .await?;
            Ok({
                let status = if existed {
                    StatusCode::OK
                } else {
                    StatusCode::CREATED
                };
                written_response(
                    status,
                    &w,
                    serde_json::json!({"plan": name, "limits": config}),
                )
            })
        }
        .await,
    )
}

async fn delete_plan(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    answer(
        &state,
        async {
            who.require(Scope::LimitsWrite, None)?;
            let pre = precondition(&headers)?;
            let subject = Subject::Plan(name.clone());
            let file_defines = state.live().load().config.plans.contains_key(&name);
            let w = write(&state, &who, |table| {
                let Some((version, Some(_))) = table.topic_plan(&name) else {
                    return Err(not_found("plan", &name));
                };
                check_precondition(pre, version, true)?;
                // The file's definition takes over when the topic's goes: only a
                // plan no one else defines must be unused.
                if !file_defines {
                    check_plan_unused(table, &name)?;
                }
                Ok(vec![(subject.clone(), Body::Deleted)])
            })
            .await?;
            Ok(written_response(
                StatusCode::OK,
                &w,
                serde_json::json!({"plan": name, "deleted": true}),
            ))
        }
        .await,
    )
}

#[derive(Debug, Deserialize)]
struct ExportQuery {
    #[serde(default)]
    format: Option<String>,
}

/// `GET /v1/limits/export[?format=jsonl|toml]`: every tenant and plan the
/// topic holds (not the file's plans), as `import` reads them back with no
/// change. From this aggregator's table: no Kafka read. Needs `read` on a
/// key not restricted to tenants.
async fn export(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    query: Result<Query<ExportQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    answer(
        &state,
        async {
            use crate::limits_import::Tables;
            who.require(Scope::Read, None)?;
            crate::http::require_every_tenant(&who, "export the limits")?;
            let format = match query.as_ref().ok().and_then(|q| q.0.format.as_deref()) {
                None | Some("jsonl") => "jsonl",
                Some("toml") => "toml",
                Some(other) => {
                    return Err(Problem::bad_field(
                        "format",
                        format!("{other:?}: jsonl or toml"),
                    ))
                }
            };
            let table = table_of(&state)?;
            let (plans, tenants) = table.export();
            let tables = Tables { plans, tenants };
            if format == "toml" {
                let text = toml::to_string(&tables).map_err(|e| {
                    Problem::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "export-failed",
                        "Export failed",
                        e.to_string(),
                    )
                })?;
                return Ok(([(header::CONTENT_TYPE, "application/toml")], text).into_response());
            }
            let mut text = tables.to_jsonl().join("\n");
            text.push('\n');
            Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], text).into_response())
        }
        .await,
    )
}

#[derive(Debug, Deserialize)]
struct ImportQuery {
    #[serde(default)]
    dry_run: bool,
}

/// `POST /v1/limits/import[?dry_run=true]`: a batch of JSON Lines
/// (`limits_import.rs`), checked whole, and only what differs from the
/// topic written; a dry run lists what would change. Idempotent, so a
/// client may resend a batch it got no answer for.
async fn import(
    AxumState(state): AxumState<AppState>,
    Extension(who): Extension<Principal>,
    query: Result<Query<ImportQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Response {
    answer(
        &state,
        async {
            use crate::limits_import::{plan_import, Action, Tables};
            who.require(Scope::LimitsWrite, None)?;
            let Ok(Query(q)) = query else {
                return Err(Problem::bad_field("dry_run", "true or false"));
            };
            let tables = match std::str::from_utf8(&body)
                .map_err(|e| e.to_string())
                .and_then(Tables::from_jsonl)
            {
                Ok(t) => t,
                Err(e) => return Err(Problem::bad_field("body", e)),
            };
            let total = tables.len();
            let summary = |changes: &[(Action, Subject, Body)]| {
                let created = changes.iter().filter(|c| c.0 == Action::Create).count();
                let updated = changes.len() - created;
                (created, updated)
            };
            if q.dry_run {
                let table = table_of(&state)?;
                let changes = plan_import(&table, &tables)?;
                let (created, updated) = summary(&changes);
                let list: Vec<Value> = changes
                    .iter()
                    .take(1000)
                    .map(|(a, s, _)| serde_json::json!({"action": a, "subject": s.key()}))
                    .collect();
                return Ok(Json(serde_json::json!({
                    "dry_run": true, "subjects": total, "created": created,
                    "updated": updated, "unchanged": total - created - updated,
                    "changes": list,
                }))
                .into_response());
            }
            let mut counts = (0, 0);
            let w = write(&state, &who, |table| {
                let changes = plan_import(table, &tables)?;
                counts = summary(&changes);
                Ok(changes.into_iter().map(|(_, s, b)| (s, b)).collect())
            })
            .await?;
            Ok(Json(serde_json::json!({
                "dry_run": false, "subjects": total, "created": counts.0,
                "updated": counts.1, "unchanged": total - counts.0 - counts.1,
                "first_version": w.records.first().map(|r| r.version),
                "last_version": w.records.last().map(|r| r.version),
                "applied": w.applied,
            }))
            .into_response())
        }
        .await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preconditions_parse_and_check() {
        let mut h = HeaderMap::new();
        assert_eq!(precondition(&h).unwrap(), Precondition::None);
        h.insert(header::IF_MATCH, HeaderValue::from_static("\"42\""));
        assert_eq!(precondition(&h).unwrap(), Precondition::Version(42));
        h.insert(header::IF_MATCH, HeaderValue::from_static("W/\"42\""));
        assert_eq!(precondition(&h).unwrap(), Precondition::Version(42));
        h.insert(header::IF_MATCH, HeaderValue::from_static("abc"));
        assert_eq!(precondition(&h).unwrap_err().status(), 400);
        let mut h = HeaderMap::new();
        h.insert(header::IF_NONE_MATCH, HeaderValue::from_static("*"));
        assert_eq!(precondition(&h).unwrap(), Precondition::Absent);

        assert!(check_precondition(Precondition::Version(7), 7, true).is_ok());
        let stale = check_precondition(Precondition::Version(7), 8, true).unwrap_err();
        assert_eq!(stale.status(), 412);
        assert_eq!(stale.slug(), "stale-version");
        // Version 0: "it did not exist when I read it".
        assert!(check_precondition(Precondition::Version(0), 0, false).is_ok());
        assert!(check_precondition(Precondition::Absent, 0, false).is_ok());
        assert_eq!(
            check_precondition(Precondition::Absent, 3, true)
                .unwrap_err()
                .status(),
            412
        );
        assert!(check_precondition(Precondition::None, 3, true).is_ok());
    }

    #[test]
    fn bodies_name_the_failing_field() {
        let p = parse_body::<TenantConfig>(&Bytes::from_static(
            br#"{"plan":"pro","region":{"limit":"ten"}}"#,
        ))
        .unwrap_err();
        assert_eq!(p.status(), 400);
        let body = format!("{p:?}");
        assert!(body.contains("region.limit"), "{body}");
        let p = parse_body::<TenantConfig>(&Bytes::from_static(br#"{"plan":"pro","bogus":1}"#))
            .unwrap_err();
        assert!(format!("{p:?}").contains("bogus"));
    }

    #[test]
    fn history_keeps_the_latest_changes_newest_first() {
        let h = History::default();
        for v in 1..=3 {
            h.record(
                &LimitsRecord {
                    subject: Subject::Tenant("acme".into()),
                    version: v,
                    writer: "key:ops".into(),
                    ts_ms: v,
                    body: Body::Deleted,
                },
                v - 1,
            );
        }
        let c = h.of("tenant", "acme");
        assert_eq!(
            c.iter()
                .map(|c| (c.version, c.previous_version))
                .collect::<Vec<_>>(),
            vec![(3, 2), (2, 1), (1, 0)]
        );
        assert!(h.of("plan", "acme").is_empty());
    }
}
