//! Admission control: saturation is answered by shedding, not by an outage.
//!
//! Every API request (a check, a refund, a usage read: each one Redis call)
//! takes a slot before it does anything. At most `node.max_in_flight`
//! requests hold one; up to `node.max_queue` more wait, in arrival order,
//! at most `node.queue_timeout`; anything beyond is **shed**: 503
//! problem+json with `Retry-After` (`tierlimit_shed_total`), before the
//! request is parsed or charged.
//!
//! Why: without a bound, a load above what Redis serves queues inside the
//! node (tasks waiting on the multiplexed connection, commands waiting in
//! Redis' input buffer). Every call then waits behind the backlog, exceeds
//! `store_timeout` and takes its plan's fail mode: a saturated Redis looked
//! like a dead one (8 740 of 20 000 decisions fell to `local` at 12.4 k
//! checks/s in the measurement of issue 15). With the bound, a call's time
//! in Redis is at most the service time of `max_in_flight` calls, whatever
//! the offered load, and the excess waits here, where it is cheap and
//! visible, and is refused cleanly once it cannot be served in time.
//!
//! One mechanism for every front end: [`middleware`] for the axum router
//! (only `/v1/…` paths; `/metrics`, `/healthz` and `/readyz` are never
//! shed), and [`Admission::admit`] for anything else that decides (the
//! gRPC rate-limit service), which holds the returned [`Admitted`] for as
//! long as its decision runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use tierlimit_shared::config::NodeSettings;
use tierlimit_shared::problem::Problem;

use crate::metrics::Metrics;

/// What a shed request is told to wait before trying again, in seconds
/// (`Retry-After` takes whole seconds; a shed request is one of many, and
/// retrying sooner would only feed the overload).
pub const RETRY_AFTER_SECS: u64 = 1;

/// The bounds of admission (`[node]` `max_in_flight`, `max_queue`,
/// `queue_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_in_flight: usize,
    pub max_queue: usize,
    pub queue_timeout: Duration,
}

impl Limits {
    pub fn of(node: &NodeSettings) -> Limits {
        Limits {
            max_in_flight: node.max_in_flight,
            max_queue: node.max_queue,
            queue_timeout: node.queue_timeout,
        }
    }
}

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Shed {
    #[error("the node is saturated: {in_flight} requests in flight and {queued} waiting")]
    QueueFull { in_flight: usize, queued: usize },
    #[error("the node is saturated: no slot freed within {0:?}")]
    QueueTimeout(Duration),
}

impl Shed {
    /// The `reason` label of `tierlimit_shed_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Shed::QueueFull { .. } => "queue_full",
            Shed::QueueTimeout(_) => "queue_timeout",
        }
    }

    /// How long the caller should wait before retrying.
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(RETRY_AFTER_SECS)
    }

    /// 503 `overloaded`, with `Retry-After`: the tenant did nothing wrong
    /// (not 429), and nothing was charged.
    pub fn problem(&self) -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "Rate limiter overloaded",
            format!("{self}; nothing was charged, retry later"),
        )
        .with("reason", self.reason())
        .with_header(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS))
    }
}

/// A slot held: dropping it lets the next waiting request in.
#[must_use = "the slot is released when this is dropped"]
pub struct Admitted {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.metrics.admission_in_flight.dec();
    }
}

/// The node's admission gate (one per process, shared by every front end).
pub struct Admission {
    slots: Arc<Semaphore>,
    /// Requests waiting for a slot (the gauge mirrors it).
    queued: AtomicUsize,
    limits: Limits,
    metrics: Arc<Metrics>,
}

/// Counts a waiting request while it waits, whatever way the wait ends
/// (a caller that goes away drops the wait too).
struct Waiting<'a>(&'a Admission);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.admission_queued.dec();
    }
}

impl Admission {
    pub fn new(limits: Limits, metrics: Arc<Metrics>) -> Arc<Admission> {
        Arc::new(Admission {
            slots: Arc::new(Semaphore::new(limits.max_in_flight.max(1))),
            queued: AtomicUsize::new(0),
            limits,
            metrics,
        })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Takes a slot: at once if one is free, else after waiting in the queue
    /// (first come, first served), or [`Shed`] when the queue is full or the
    /// wait exceeds `queue_timeout`. Counted in `tierlimit_shed_total`.
    pub async fn admit(&self) -> Result<Admitted, Shed> {
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => self.wait().await.inspect_err(|shed| {
                self.metrics.shed.with_label_values(&[shed.reason()]).inc();
            })?,
        };
        self.metrics.admission_in_flight.inc();
        Ok(Admitted {
            _permit: permit,
            metrics: Arc::clone(&self.metrics),
        })
    }

    async fn wait(&self) -> Result<OwnedSemaphorePermit, Shed> {
        // Counted first, so two requests racing for the last place cannot
        // both take it.
        let queued = self.queued.fetch_add(1, Ordering::Relaxed) + 1;
        self.metrics.admission_queued.inc();
        let waiting = Waiting(self);
        if queued > self.limits.max_queue {
            drop(waiting);
            return Err(Shed::QueueFull {
                in_flight: self.limits.max_in_flight,
                queued: self.limits.max_queue,
            });
        }
        let acquire = Arc::clone(&self.slots).acquire_owned();
        let result = match tokio::time::timeout(self.limits.queue_timeout, acquire).await {
            Ok(Ok(permit)) => Ok(permit),
            // The semaphore is never closed.
            Ok(Err(_)) | Err(_) => Err(Shed::QueueTimeout(self.limits.queue_timeout)),
        };
        drop(waiting);
        result
    }
}

/// Whether a request goes through admission: the API (`/v1/…`), whose
/// requests each make a Redis call. Metrics and health endpoints must
/// answer during an overload, when they matter most.
pub fn admits(path: &str) -> bool {
    path.starts_with("/v1/")
}

/// The axum middleware: `.layer(axum::middleware::from_fn_with_state(
/// admission, admission::middleware))`.
///
/// A body announced within [`crate::http::MAX_BODY`] is read *before* the
/// slot is taken, so a client that sends its body slowly waits without
/// holding one (a few slow clients must not take every slot). Other bodies
/// (chunked, or too large: the handler answers 413) are left to the
/// handler.
pub async fn middleware(
    State(admission): State<Arc<Admission>>,
    req: Request,
    next: Next,
) -> Response {
    if !admits(req.uri().path()) {
        return next.run(req).await;
    }
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let req = match announced {
        Some(len) if len > 0 && len <= crate::http::MAX_BODY => {
            let (parts, body) = req.into_parts();
            match axum::body::to_bytes(body, len).await {
                Ok(bytes) => Request::from_parts(parts, axum::body::Body::from(bytes)),
                Err(e) => {
                    return Problem::new(
                        StatusCode::BAD_REQUEST,
                        "unreadable-body",
                        "Request body could not be read",
                        format!("{e} (Content-Length {len})"),
                    )
                    .into_response()
                }
            }
        }
        _ => req,
    };
    match admission.admit().await {
        Ok(slot) => {
            let resp = next.run(req).await;
            drop(slot);
            resp
        }
        Err(shed) => shed.problem().into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(in_flight: usize, queue: usize, wait_ms: u64) -> (Arc<Admission>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let a = Admission::new(
            Limits {
                max_in_flight: in_flight,
                max_queue: queue,
                queue_timeout: Duration::from_millis(wait_ms),
            },
            Arc::clone(&metrics),
        );
        (a, metrics)
    }

    #[tokio::test]
    async fn a_full_queue_sheds_at_once_and_a_long_wait_times_out() {
        let (a, m) = gate(2, 1, 50);
        let s1 = a.admit().await.unwrap();
        let _s2 = a.admit().await.unwrap();
        assert_eq!(m.admission_in_flight.get(), 2);
        // The third waits (queue of 1); the fourth finds the queue full.
        let a2 = Arc::clone(&a);
        let third = tokio::spawn(async move { a2.admit().await.map(|_| ()) });
        tokio::task::yield_now().await;
        while m.admission_queued.get() < 1 {
            tokio::task::yield_now().await;
        }
        assert!(matches!(a.admit().await, Err(Shed::QueueFull { .. })));
        // A slot freed lets the waiting one in.
        drop(s1);
        assert!(third.await.unwrap().is_ok());
        // Nobody frees a slot now: the next waiter times out.
        let held = a.admit().await.unwrap();
        assert!(matches!(a.admit().await, Err(Shed::QueueTimeout(_))));
        drop(held);
        assert_eq!(m.shed.with_label_values(&["queue_full"]).get(), 1);
        assert_eq!(m.shed.with_label_values(&["queue_timeout"]).get(), 1);
        assert_eq!(m.admission_queued.get(), 0);
    }

    #[tokio::test]
    async fn a_shed_request_is_a_503_problem_with_retry_after() {
        let resp = Shed::QueueTimeout(Duration::from_millis(5))
            .problem()
            .into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }

    #[test]
    fn only_the_api_is_admitted() {
        assert!(admits("/v1/check"));
        assert!(admits("/v1/tenants/t"));
        for p in ["/metrics", "/healthz", "/readyz", "/"] {
            assert!(!admits(p), "{p}");
        }
    }
}
