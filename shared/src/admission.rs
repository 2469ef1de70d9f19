//! Admission control: saturation is answered by shedding, not by an outage.
//! One mechanism for every listener of both binaries.
//!
//! Every API request takes a slot before it does anything. At most
//! `max_in_flight` requests hold one; up to `max_queue` more wait, in
//! arrival order, at most `queue_timeout`; anything beyond is **shed**: 503
//! problem+json `overloaded` with `Retry-After`, before the request is
//! authenticated, parsed or charged.
//!
//! Why a bounded queue and not only a concurrency limit: region-node's
//! requests each make one Redis call. Without a bound, a load above what
//! Redis serves queues inside the node (tasks waiting on the multiplexed
//! connection, commands in Redis' input buffer); every call then waits
//! behind the backlog, exceeds `store_timeout` and takes its plan's fail
//! mode, so a saturated Redis looked like a dead one (8 740 of 20 000
//! decisions fell to `local` at 12.4 k checks/s, issue 15). With the bound,
//! a call's time in Redis is at most the service time of `max_in_flight`
//! calls whatever the offered load, and the excess waits here, where it is
//! cheap and visible. The aggregator uses the same gate with `max_queue`
//! 0: its reads are served from memory, so a request that finds every slot
//! busy is refused at once rather than queued behind answers nobody waits
//! for.
//!
//! What a binary measures is its own business: the gate reports through a
//! [`Meter`] (region-node: `tierlimit_shed_total`, `tierlimit_admission_*`;
//! the aggregator: its HTTP rejections counter).
//!
//! Front ends: [`layer`] puts the gate on an axum router's routes (probes
//! added after it are never shed: a liveness probe shed with the load would
//! get a busy process restarted); anything else that decides (region-node's
//! gRPC rate-limit service) calls [`Admission::admit`] and holds the
//! returned [`Admitted`] while it works.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::problem::Problem;

/// What a shed request is told to wait before trying again, in seconds
/// (`Retry-After` takes whole seconds; a shed request is one of many, and
/// retrying sooner would only feed the overload).
pub const RETRY_AFTER_SECS: u64 = 1;

/// The bounds of admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_in_flight: usize,
    /// Requests that may wait for a slot; 0 sheds at once when none is free.
    pub max_queue: usize,
    pub queue_timeout: Duration,
}

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Shed {
    #[error("saturated: {in_flight} requests in flight and {queued} waiting")]
    QueueFull { in_flight: usize, queued: usize },
    #[error("saturated: no slot freed within {0:?}")]
    QueueTimeout(Duration),
    /// The request had a slot, but its store call waited past the store
    /// timeout while the store kept answering others (or reached it past
    /// its deadline): a backlog, not an outage, so no fail mode. Whatever
    /// the late call charged is undone by the node.
    #[error(
        "saturated: the store serves, but this call waited past the store timeout behind others"
    )]
    StoreBacklog,
}

impl Shed {
    /// The reason label of the shed metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Shed::QueueFull { .. } => "queue_full",
            Shed::QueueTimeout(_) => "queue_timeout",
            Shed::StoreBacklog => "store_backlog",
        }
    }

    /// How long the caller should wait before retrying.
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(RETRY_AFTER_SECS)
    }

    /// 503 `overloaded`, with `Retry-After`: the caller did nothing wrong
    /// (not 429), and nothing was charged.
    pub fn problem(&self) -> Problem {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "Overloaded",
            format!("{self}; nothing was charged, retry later"),
        )
        .with("reason", self.reason())
        .with_header(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS))
    }
}

/// Where the gate reports what it does. Gauges move by ±1; `shed` is
/// called once per shed request.
pub trait Meter: Send + Sync {
    fn in_flight(&self, _delta: i64) {}
    fn queued(&self, _delta: i64) {}
    fn shed(&self, reason: &'static str);
}

/// A slot held: dropping it lets the next waiting request in.
#[must_use = "the slot is released when this is dropped"]
pub struct Admitted {
    _permit: OwnedSemaphorePermit,
    meter: Arc<dyn Meter>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.meter.in_flight(-1);
    }
}

/// An admission gate (one per listener group: every front end of a
/// process shares it).
pub struct Admission {
    slots: Arc<Semaphore>,
    /// Requests waiting for a slot.
    queued: AtomicUsize,
    limits: Limits,
    /// A body announced within this many bytes is read before a slot is
    /// taken (0: never): see [`middleware`].
    read_body_first: usize,
    meter: Arc<dyn Meter>,
}

/// Counts a waiting request while it waits, whatever way the wait ends
/// (a caller that goes away drops the wait too).
struct Waiting<'a>(&'a Admission);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
        self.0.meter.queued(-1);
    }
}

impl Admission {
    pub fn new(limits: Limits, meter: Arc<dyn Meter>) -> Arc<Admission> {
        Self::reading_bodies_first(limits, 0, meter)
    }

    /// A gate whose [`middleware`] reads a body announced within
    /// `max_body` bytes *before* taking a slot, so a client that sends its
    /// body slowly waits without holding one (a few slow clients must not
    /// take every slot).
    pub fn reading_bodies_first(
        limits: Limits,
        max_body: usize,
        meter: Arc<dyn Meter>,
    ) -> Arc<Admission> {
        Arc::new(Admission {
            slots: Arc::new(Semaphore::new(limits.max_in_flight.max(1))),
            queued: AtomicUsize::new(0),
            limits,
            read_body_first: max_body,
            meter,
        })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Takes a slot: at once if one is free, else after waiting in the queue
    /// (first come, first served), or [`Shed`] when the queue is full or the
    /// wait exceeds `queue_timeout`.
    pub async fn admit(&self) -> Result<Admitted, Shed> {
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => self
                .wait()
                .await
                .inspect_err(|shed| self.meter.shed(shed.reason()))?,
        };
        self.meter.in_flight(1);
        Ok(Admitted {
            _permit: permit,
            meter: Arc::clone(&self.meter),
        })
    }

    async fn wait(&self) -> Result<OwnedSemaphorePermit, Shed> {
        // Counted first, so two requests racing for the last place cannot
        // both take it.
        let queued = self.queued.fetch_add(1, Ordering::Relaxed) + 1;
        self.meter.queued(1);
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

/// Puts `gate` on every route of `router` added so far (a route layer:
/// routes added after this call, such as the probes, are never shed).
/// Added last, it is the outermost layer of those routes, so a shed
/// request costs no key check, no parsing and no charge.
pub fn layer<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    gate: Arc<Admission>,
) -> Router<S> {
    router.route_layer(axum::middleware::from_fn_with_state(gate, middleware))
}

/// The axum middleware of [`layer`].
pub async fn middleware(State(gate): State<Arc<Admission>>, req: Request, next: Next) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    // Other bodies (chunked, or too large: the handler answers 413) are
    // left to the handler.
    let req = match announced {
        Some(len) if len > 0 && len <= gate.read_body_first => {
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
    match gate.admit().await {
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
    use std::sync::atomic::AtomicI64;

    #[derive(Default)]
    struct Counts {
        in_flight: AtomicI64,
        queued: AtomicI64,
        full: AtomicI64,
        timeout: AtomicI64,
    }

    impl Meter for Counts {
        fn in_flight(&self, d: i64) {
            self.in_flight.fetch_add(d, Ordering::Relaxed);
        }
        fn queued(&self, d: i64) {
            self.queued.fetch_add(d, Ordering::Relaxed);
        }
        fn shed(&self, reason: &'static str) {
            match reason {
                "queue_full" => &self.full,
                _ => &self.timeout,
            }
            .fetch_add(1, Ordering::Relaxed);
        }
    }

    fn gate(in_flight: usize, queue: usize, wait_ms: u64) -> (Arc<Admission>, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let a = Admission::new(
            Limits {
                max_in_flight: in_flight,
                max_queue: queue,
                queue_timeout: Duration::from_millis(wait_ms),
            },
            Arc::clone(&counts) as Arc<dyn Meter>,
        );
        (a, counts)
    }

    #[tokio::test]
    async fn a_full_queue_sheds_at_once_and_a_long_wait_times_out() {
        let (a, m) = gate(2, 1, 50);
        let s1 = a.admit().await.unwrap();
        let _s2 = a.admit().await.unwrap();
        assert_eq!(m.in_flight.load(Ordering::Relaxed), 2);
        // The third waits (queue of 1); the fourth finds the queue full.
        let a2 = Arc::clone(&a);
        let third = tokio::spawn(async move { a2.admit().await.map(|_| ()) });
        while m.queued.load(Ordering::Relaxed) < 1 {
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
        assert_eq!(m.full.load(Ordering::Relaxed), 1);
        assert_eq!(m.timeout.load(Ordering::Relaxed), 1);
        assert_eq!(m.queued.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn no_queue_sheds_at_once_when_every_slot_is_taken() {
        let (a, m) = gate(1, 0, 10_000);
        let held = a.admit().await.unwrap();
        let started = tokio::time::Instant::now();
        assert!(matches!(a.admit().await, Err(Shed::QueueFull { .. })));
        // Refused at once, not after the queue timeout.
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(held);
        assert!(a.admit().await.is_ok());
        assert_eq!(m.full.load(Ordering::Relaxed), 1);
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

    #[tokio::test]
    async fn the_layer_sheds_only_the_routes_before_it() {
        use axum::body::Body;
        use axum::routing::get;
        use tower::ServiceExt;
        let (a, m) = gate(1, 0, 10);
        let held = a.admit().await.unwrap();
        let router: Router = layer(Router::new().route("/v1/x", get(|| async { "x" })), a)
            .route("/healthz", get(|| async { "ok" }));
        let get = |uri: &str| {
            router
                .clone()
                .oneshot(axum::http::Request::get(uri).body(Body::empty()).unwrap())
        };
        assert_eq!(
            get("/v1/x").await.unwrap().status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(get("/healthz").await.unwrap().status(), StatusCode::OK);
        drop(held);
        assert_eq!(get("/v1/x").await.unwrap().status(), StatusCode::OK);
        assert_eq!(m.full.load(Ordering::Relaxed), 1);
    }
}
