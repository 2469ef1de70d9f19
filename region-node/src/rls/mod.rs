//! Envoy's rate limit service (RLS v3) over gRPC:
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, beside the
//! HTTP API on its own listener (`--grpc-listen`), with the standard gRPC
//! health service (`grpc.health.v1.Health`).
//!
//! - [`service`]: a request's descriptors → tenants, rules and one store
//!   call per tenant, all-or-nothing, with compensation across tenants;
//! - [`key`]: counting keys from descriptor values (IPv6 included);
//! - [`metadata`]: the answer's dynamic metadata (quota mode's routing);
//! - [`metrics`]: per domain and rule, bounded labels;
//! - [`unary`]: `ShouldRateLimit` on the plaintext listener, read and
//!   answered without tonic's codec.
//!
//! The messages and the service trait come from the `envoy-types` crate
//! (generated from envoy's data-plane-api), never written by hand. The
//! descriptor configuration is `tierlimit_shared::rls`.
//!
//! **Two transports.** With TLS, tonic's server serves the listener. In
//! plaintext (a gateway beside the node, the common deployment), hyper's
//! HTTP/2 server serves it directly ([`serve_plaintext`]): tonic's transport
//! adds a router and per-request layers (timeout, error recovery) that cost
//! about a tenth of region-node's CPU per RLS decision (BENCHMARKS.md §10),
//! and Envoy enforces the call's deadline itself. There `ShouldRateLimit`,
//! the one call Envoy makes per request, is decoded and answered by hand
//! ([`unary`]: the generated codec's per-call machinery cost more than the
//! HTTP check's whole front end), and the health service and any other
//! method go to the generated services. Both transports answer the RLS and
//! the health service alike, and drain in-flight calls on shutdown.

pub mod key;
pub mod metadata;
pub mod metrics;
pub mod service;
pub mod unary;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

use tierlimit_shared::config::GrpcSettings;

/// The tonic face of [`service::Service`].
pub struct Rls(pub Arc<service::Service>);

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.0
            .should_rate_limit(request.into_inner())
            .await
            .map(Response::new)
    }
}

/// A bound gRPC listener, ready to serve.
pub struct Listener {
    listener: tokio::net::TcpListener,
    tls: Option<ServerTlsConfig>,
}

impl Listener {
    /// Binds `addr` and reads the TLS identity of `[grpc]` (if set), so a
    /// bad address or certificate stops the node at start.
    pub async fn bind(addr: SocketAddr, grpc: &GrpcSettings) -> anyhow::Result<Listener> {
        let tls = match (&grpc.tls_cert, &grpc.tls_key) {
            (Some(cert), Some(key)) => {
                let c = std::fs::read(cert).with_context(|| format!("grpc.tls_cert {cert}"))?;
                let k = std::fs::read(key).with_context(|| format!("grpc.tls_key {key}"))?;
                Some(ServerTlsConfig::new().identity(Identity::from_pem(c, k)))
            }
            _ => None,
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --grpc-listen {addr}"))?;
        Ok(Listener { listener, tls })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves the RLS and the health service until `shutdown` resolves.
    pub async fn serve(
        self,
        app: Arc<crate::http::AppState>,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        let rls_metrics = metrics::RlsMetrics::new(&app.metrics.registry);
        let svc = Arc::new(service::Service {
            decider: app,
            metrics: rls_metrics,
        });
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter.set_serving::<RateLimitServiceServer<Rls>>().await;
        if self.tls.is_none() {
            return serve_plaintext(
                self.listener,
                Arc::clone(&svc),
                RateLimitServiceServer::new(Rls(svc)),
                health,
                shutdown,
            )
            .await;
        }
        let mut builder = Server::builder();
        if let Some(tls) = self.tls {
            builder = builder.tls_config(tls).context("grpc TLS configuration")?;
        }
        let incoming =
            tonic::transport::server::TcpIncoming::from(self.listener).with_nodelay(Some(true));
        builder
            .add_service(health)
            .add_service(RateLimitServiceServer::new(Rls(svc)))
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
            .context("serving gRPC")?;
        Ok(())
    }
}

/// The future of one call on the plaintext listener.
type CallFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<http::Response<unary::Reply>, std::convert::Infallible>,
            > + Send,
    >,
>;

/// `make()` in a box, built there: a decision's future is kilobytes (the
/// whole state machine down to the store call), and `Box::pin(make())`
/// builds it on the stack and copies all of it into the heap, about 9 k
/// instructions of `memcpy` per call (callgrind). Written into the
/// allocation directly, only what the unstarted future holds is stored.
fn boxed_in_place<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    let mut slot = Box::<F>::new_uninit();
    slot.write(make());
    // SAFETY: the slot was initialized by the write just above.
    Box::into_pin(unsafe { slot.assume_init() })
}

/// How long a shutdown waits for in-flight calls on the plaintext listener.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves the RLS and `health` on `listener` with hyper's HTTP/2 server, no
/// tonic transport in between (see the module docs). `ShouldRateLimit`, the
/// call Envoy makes, is served by hand ([`unary`]); a call to the health
/// service goes to `health`, anything else to `rls` (whose generated code
/// answers UNIMPLEMENTED for a method it does not have). On `shutdown` it
/// stops accepting and waits up to [`DRAIN`] for open calls.
async fn serve_plaintext<H>(
    listener: tokio::net::TcpListener,
    service: Arc<service::Service>,
    rls: RateLimitServiceServer<Rls>,
    health: H,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()>
where
    H: tonic::codegen::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
            Future = tonic::codegen::BoxFuture<
                http::Response<tonic::body::Body>,
                std::convert::Infallible,
            >,
        > + Clone
        + Send
        + 'static,
{
    use tonic::codegen::Service as _;
    const HEALTH: &str = "/grpc.health.v1.Health/";
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors and the like: the listener stays.
                    tracing::warn!(error = %e, "gRPC listener: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (service, rls, health) = (Arc::clone(&service), rls.clone(), health.clone());
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            // Boxed, and built in its box: a decision's future is
            // kilobytes, and hyper moves the future it is given into the
            // task it spawns per stream. Unboxed, those copies were half of
            // a call's instructions; boxed by `Box::pin`, one copy, 8 %
            // (callgrind, scripts/rls-profile).
            let call: CallFuture = if req.uri().path() == unary::PATH {
                let service = Arc::clone(&service);
                boxed_in_place(
                    move || async move { Ok(unary::should_rate_limit(&service, req).await) },
                )
            } else {
                let generated = if req.uri().path().starts_with(HEALTH) {
                    health.clone().call(req)
                } else {
                    rls.clone().call(req)
                };
                Box::pin(async move { Ok(generated.await?.map(unary::Reply::Generated)) })
            };
            call
        });
        let streams = ConnStreams::default();
        // No `date` header: gRPC does not use it, and formatting, adding
        // and HPACK-encoding it (a new table entry every second) was 3 % of
        // region-node's instructions per RLS decision (scripts/rls-profile).
        // hyper's other defaults stay: 1 MiB stream and connection windows
        // (Envoy's requests never wait for a WINDOW_UPDATE; one is sent
        // every few thousand calls), no adaptive window, 200 streams.
        let conn = hyper::server::conn::http2::Builder::new(streams.clone())
            .auto_date_header(false)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
        let conn = Driven::new(graceful.watch(conn), streams);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "gRPC connection ended");
            }
        });
    }
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("gRPC listener: calls still open {DRAIN:?} after shutdown");
    }
    Ok(())
}

/// One future per HTTP/2 stream, as hyper hands them to its executor.
type StreamFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// hyper's executor for the streams of one connection: instead of a task
/// per stream (`tokio::spawn`: a task allocated and scheduled, often on the
/// other worker thread, which must be woken for it), each stream's future
/// is queued here and polled by the connection's own task ([`Driven`]).
/// Envoy multiplexes its calls on one connection, so this is every call:
/// it cut region-node's /proc CPU per RLS decision by about a fifth
/// (BENCHMARKS.md §10), mostly in the kernel (fewer wake-ups). A stream
/// that panics ends alone, as its own task would have.
#[derive(Clone, Default)]
struct ConnStreams(Arc<std::sync::Mutex<Vec<StreamFuture>>>);

impl<F> hyper::rt::Executor<F> for ConnStreams
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        use futures_util::FutureExt as _;
        let fut = std::panic::AssertUnwindSafe(fut)
            .catch_unwind()
            .map(|_panicked| ());
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Box::pin(fut));
    }
}

/// A connection and its streams, polled together by one task: the
/// connection (reads frames, starts streams, writes what streams send),
/// then the streams it started, then the connection again when a stream
/// finished (so its answer is written in the same poll). Done when the
/// connection is and its last stream ended.
struct Driven<C> {
    conn: std::pin::Pin<Box<C>>,
    result: Option<Result<(), hyper::Error>>,
    queued: ConnStreams,
    streams: futures_util::stream::FuturesUnordered<StreamFuture>,
}

impl<C> Driven<C> {
    fn new(conn: C, queued: ConnStreams) -> Driven<C> {
        Driven {
            conn: Box::pin(conn),
            result: None,
            queued,
            streams: futures_util::stream::FuturesUnordered::new(),
        }
    }
}

impl<C> std::future::Future for Driven<C>
where
    C: std::future::Future<Output = Result<(), hyper::Error>>,
{
    type Output = Result<(), hyper::Error>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use futures_util::StreamExt as _;
        let me = &mut *self;
        loop {
            if me.result.is_none() {
                if let std::task::Poll::Ready(r) = me.conn.as_mut().poll(cx) {
                    me.result = Some(r);
                }
            }
            let mut started = false;
            for f in me
                .queued
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .drain(..)
            {
                me.streams.push(f);
                started = true;
            }
            let mut ended = false;
            while let std::task::Poll::Ready(Some(())) = me.streams.poll_next_unpin(cx) {
                ended = true;
            }
            // New streams were polled (and registered their wakers); one
            // that ended queued its answer for the connection to write.
            if !(started || ended) || me.result.is_some() {
                break;
            }
        }
        match me.result.take() {
            Some(r) if me.streams.is_empty() => std::task::Poll::Ready(r),
            r => {
                me.result = r;
                std::task::Poll::Pending
            }
        }
    }
}
