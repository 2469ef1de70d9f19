//! Serving a router on a socket, with the protections every listener of
//! both binaries shares.
//!
//! `axum::serve` offers no header read timeout, no TLS and no size limits,
//! so connections are driven here with hyper-util directly:
//! - TLS (optional, [`crate::tls`]) with a handshake deadline, and the
//!   client certificate's DNS names handed to the request as a
//!   [`ClientIdentity`] extension for [`crate::auth`];
//! - a **header read timeout**: a connection that trickles its headers
//!   (slow-loris) is closed after `http.header_read_timeout`, so idle
//!   sockets cannot pile up until checks find no file descriptor; every
//!   connection is its own task, so a slow one never delays another's
//!   request;
//! - HTTP/1 and HTTP/2 on the same port; graceful shutdown that lets
//!   in-flight requests finish.
//!
//! [`harden`] adds the per-request limits (URI and header size, request
//! timeout), each refusal a counted problem+json. The concurrency limit
//! with load shedding is [`crate::admission`], shared by both binaries.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use crate::config::HttpSettings;
use crate::problem::Problem;

/// Counts a refusal by its problem slug (each binary passes its metric).
pub type OnReject = Arc<dyn Fn(&'static str) + Send + Sync>;

/// DNS names of the verified client certificate of the request's
/// connection (empty without mTLS).
#[derive(Debug, Clone, Default)]
pub struct ClientIdentity(pub Arc<Vec<String>>);

/// Longest a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long graceful shutdown waits for in-flight requests.
const DRAIN: Duration = Duration::from_secs(5);

/// Serves `router` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    settings: &HttpSettings,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        // hyper's own hard ceiling; `harden` answers 431 well below it.
        .max_buf_size((4 * settings.max_header_bytes).max(64 * 1024));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(2 * settings.max_header_bytes).unwrap_or(u32::MAX))
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let builder = Arc::new(builder);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let router = router.clone();
        let builder = Arc::clone(&builder);
        let acceptor = acceptor.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            match acceptor {
                None => {
                    let id = ClientIdentity::default();
                    serve_io(&builder, watcher, TokioIo::new(tcp), router, id).await;
                }
                Some(acceptor) => {
                    let Some((stream, id)) = handshake(&acceptor, tcp).await else {
                        return;
                    };
                    serve_io(&builder, watcher, TokioIo::new(stream), router, id).await;
                }
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(DRAIN) => tracing::warn!("connections still open after {DRAIN:?}; closing"),
    }
    Ok(())
}

async fn handshake(
    acceptor: &tokio_rustls::TlsAcceptor,
    tcp: TcpStream,
) -> Option<(tokio_rustls::server::TlsStream<TcpStream>, ClientIdentity)> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(stream)) => {
            let names = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(crate::tls::dns_names)
                .unwrap_or_default();
            Some((stream, ClientIdentity(Arc::new(names))))
        }
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "TLS handshake failed");
            None
        }
        Err(_) => None,
    }
}

/// Drives one connection to its end (or to graceful shutdown).
async fn serve_io<I>(
    builder: &auto::Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    io: I,
    router: Router,
    id: ClientIdentity,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(id.clone());
        router.clone().oneshot(req.map(axum::body::Body::new))
    });
    let _ = watcher.watch(builder.serve_connection(io, svc)).await;
}

/// Unknown routes (404) and methods (405) answer problem+json too, counted
/// like every other refusal (axum's defaults are empty bodies).
pub fn problem_fallbacks<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    on_reject: OnReject,
) -> Router<S> {
    let on_405 = on_reject.clone();
    router
        .fallback(move |uri: axum::http::Uri| async move {
            on_reject("not-found");
            Problem::new(
                StatusCode::NOT_FOUND,
                "not-found",
                "No such route",
                format!("nothing is served at {}", uri.path()),
            )
            .into_response()
        })
        .method_not_allowed_fallback(
            move |method: axum::http::Method, uri: axum::http::Uri| async move {
                on_405("method-not-allowed");
                Problem::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method-not-allowed",
                    "Method not allowed",
                    format!("{method} is not served at {}", uri.path()),
                )
                .into_response()
            },
        )
}

/// What [`harden`] enforces, fixed at start.
#[derive(Clone)]
pub struct Limits {
    pub max_uri_bytes: usize,
    pub max_header_bytes: usize,
    pub request_timeout: Duration,
    pub on_reject: OnReject,
}

impl Limits {
    pub fn new(s: &HttpSettings, on_reject: OnReject) -> Limits {
        Limits {
            max_uri_bytes: s.max_uri_bytes,
            max_header_bytes: s.max_header_bytes,
            request_timeout: s.request_timeout,
            on_reject,
        }
    }

    /// A counted problem response.
    pub fn refuse(&self, p: Problem) -> Response {
        (self.on_reject)(p.slug());
        p.into_response()
    }
}

/// Adds URI and header size limits (414, 431) and the request timeout
/// (408) to every route of `router`, each refusal counted.
pub fn harden(router: Router, limits: Limits) -> Router {
    router.layer(axum::middleware::from_fn_with_state(limits, limit_request))
}

async fn limit_request(State(l): State<Limits>, req: Request, next: Next) -> Response {
    let uri_len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri_len > l.max_uri_bytes {
        return l.refuse(Problem::new(
            StatusCode::URI_TOO_LONG,
            "uri-too-long",
            "Request target too long",
            format!(
                "the request target is {uri_len} bytes; at most {} are accepted",
                l.max_uri_bytes
            ),
        ));
    }
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if header_bytes > l.max_header_bytes {
        return l.refuse(Problem::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers-too-large",
            "Request headers too large",
            format!(
                "the headers are {header_bytes} bytes; at most {} are accepted",
                l.max_header_bytes
            ),
        ));
    }
    match tokio::time::timeout(l.request_timeout, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => l.refuse(Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "request-timeout",
            "Request timed out",
            format!(
                "the request was not complete within {:?}",
                l.request_timeout
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::header;
    use axum::routing::get;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn limits(count: Arc<AtomicUsize>) -> Limits {
        Limits {
            max_uri_bytes: 64,
            max_header_bytes: 1024,
            request_timeout: Duration::from_millis(200),
            on_reject: Arc::new(move |_| {
                count.fetch_add(1, Ordering::Relaxed);
            }),
        }
    }

    async fn status(r: &Router, req: axum::http::Request<Body>) -> (StatusCode, String) {
        let resp = r.clone().oneshot(req).await.unwrap();
        let ct = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        (resp.status(), ct)
    }

    #[tokio::test]
    async fn limits_answer_counted_problems() {
        let count = Arc::new(AtomicUsize::new(0));
        let r = harden(
            Router::new().route("/ok", get(|| async { "ok" })).route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    "late"
                }),
            ),
            limits(count.clone()),
        );
        let get = |uri: &str| axum::http::Request::get(uri).body(Body::empty()).unwrap();
        assert_eq!(status(&r, get("/ok")).await.0, StatusCode::OK);
        let long = format!("/ok?x={}", "a".repeat(100));
        assert_eq!(
            status(&r, get(&long)).await,
            (StatusCode::URI_TOO_LONG, "application/problem+json".into())
        );
        let big = axum::http::Request::get("/ok")
            .header("x-big", "b".repeat(2000))
            .body(Body::empty())
            .unwrap();
        assert_eq!(
            status(&r, big).await.0,
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        );
        assert_eq!(
            status(&r, get("/slow")).await.0,
            StatusCode::REQUEST_TIMEOUT
        );
        assert_eq!(count.load(Ordering::Relaxed), 3);
    }
}
