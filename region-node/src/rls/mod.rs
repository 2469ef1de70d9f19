//! Envoy's rate limit service (RLS v3) over gRPC:
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, beside the
//! HTTP API on its own listener (`--grpc-listen`), with the standard gRPC
//! health service (`grpc.health.v1.Health`).
//!
//! - [`service`]: a request's descriptors → tenants, rules and one store
//!   call per tenant, all-or-nothing, with compensation across tenants;
//! - [`key`]: counting keys from descriptor values (IPv6 included);
//! - [`metrics`]: per domain and rule, bounded labels.
//!
//! The messages and the service trait come from the `envoy-types` crate
//! (generated from envoy's data-plane-api), never written by hand. The
//! descriptor configuration is `tierlimit_shared::rls`.

pub mod key;
pub mod metrics;
pub mod service;

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
