//! The tierlimit aggregator: merges every region's PN-counter deltas into
//! global counts per tenant and calendar period (UTC hour, day, ISO week,
//! month: one counter per global tier) and broadcasts them back to the
//! regions, each judged under the limit the nodes' deltas carried.
//!
//! ```text
//!  tierlimit.deltas ──► consumer ──► state (merge + progress) ──► broadcast ──► tierlimit.global
//!                                         │
//!                                         └──► http (/v1/global, /v1/over-limit, /metrics, /readyz)
//! ```
//!
//! - [`merge`]: the CRDT state, one `PNCounter` per (tenant, period),
//!   grouped per period, each kind with its own retention;
//! - [`progress`]: which partitions this instance owns and how far their
//!   rebuild from the beginning has come;
//! - [`state`]: both behind one lock, plus the rules that join them;
//! - [`consumer`]: the consumer-group member that rebuilds on assignment;
//! - [`broadcast`]: the coalescing, ordered producer of global updates;
//! - [`limits`]: which counters a reload changes (re-broadcast only those);
//! - [`http`], [`metrics`], [`dashboard`] (`GET /`): the operator's view.
//!
//! The process keeps no storage: the deltas topic is the source of truth and
//! every assignment is rebuilt from it, so a restart, a crash or a rebalance
//! converges to the same exact counts.

pub mod broadcast;
pub mod consumer;
pub mod dashboard;
pub mod http;
pub mod kafka;
pub mod limits;
pub mod limits_api;
pub mod limits_cli;
pub mod limits_client;
pub mod limits_import;
pub mod merge;
pub mod metrics;
pub mod nodes;
pub mod progress;
pub mod state;
pub mod usage;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tierlimit_shared::config::{Config, ConfigError};
use tokio_util::sync::CancellationToken;

use crate::broadcast::Broadcaster;
use crate::consumer::DeltaConsumer;
use crate::metrics::Metrics;
use crate::state::State;

/// How often expired periods are dropped and the gauges recomputed.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(1);
/// Pause before replacing a consumer that librdkafka declared unusable.
const CONSUMER_RESTART_DELAY: Duration = Duration::from_secs(1);

/// Why the aggregator could not start (or stopped abnormally).
#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid Kafka client settings: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error("HTTP server failed: {0}")]
    Http(#[source] std::io::Error),
    #[error(transparent)]
    Tls(#[from] tierlimit_shared::tls::TlsError),
    #[error("{0}")]
    Topics(String),
    /// Keys missing or unusable for the wire format in force.
    #[error("wire keys: {0}")]
    Wire(String),
    /// A limits file or record that does not validate, or the topic
    /// refused a write.
    #[error("limits: {0}")]
    Limits(String),
}

/// Where the aggregator listens: the API (`listen`) and the admin
/// listener (dashboard, `/metrics`).
#[derive(Debug, Clone, Copy)]
pub struct Listen {
    pub api: SocketAddr,
    pub admin: SocketAddr,
}

/// Runs the aggregator until SIGTERM or SIGINT.
pub async fn run(config_path: &Path, listen: Listen) -> Result<(), Error> {
    let signals = shutdown_signal().map_err(Error::Signals)?;
    run_until(config_path, listen, signals).await
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, Error> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Listen { addr, source })
}

/// Runs the aggregator until `shutdown` completes.
///
/// Fails fast on what an operator must fix (invalid configuration or client
/// settings, a port in use); everything about Kafka's availability is
/// retried for as long as the process runs.
pub async fn run_until(
    config_path: &Path,
    listen: Listen,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let mut loaded = Config::load(config_path)?;
    // With limits on the topic: one table for the process's life.
    let limits_table = (loaded.config.limits.source
        == tierlimit_shared::config::LimitsSource::Topic)
        .then(|| Arc::new(tierlimit_shared::limits::LimitsTable::new()));
    if let Some(table) = &limits_table {
        loaded.attach_limits(Arc::clone(table));
    }
    let kafka = loaded.config.kafka.clone();
    let settings = loaded.config.aggregator.clone();
    let http_settings = loaded.config.http.clone();
    let tls = match http_settings.tls() {
        Some((cert, key)) => Some(tierlimit_shared::tls::server_config(
            cert,
            key,
            http_settings.tls_client_ca.as_deref(),
        )?),
        None => None,
    };
    tracing::info!(
        cluster = %loaded.config.cluster,
        brokers = %kafka.brokers,
        deltas = %kafka.deltas_topic,
        global = %kafka.global_topic,
        group_id = %settings.group_id,
        "starting aggregator"
    );
    let live = tierlimit_shared::reload::live(loaded);
    let state = State::new(live.clone(), Metrics::new());
    // An aggregator that could not sign its broadcasts or verify deltas
    // would run but apply nothing: refuse to start instead.
    state.delta_verifier().map_err(Error::Wire)?;
    state.broadcast_signer().map_err(Error::Wire)?;

    let reloaded = state.clone();
    tierlimit_shared::reload::spawn_sighup_reloader(PathBuf::from(config_path), live, move |r| {
        reloaded.on_reload(r)
    })
    .map_err(Error::Signals)?;

    let listener = bind(listen.api).await?;
    let admin_listener = bind(listen.admin).await?;
    let local = listener.local_addr().map_err(Error::Http)?;

    // Created up front so invalid client settings stop the start.
    let consumer = DeltaConsumer::new(&kafka, &settings, state.clone())?;
    let broadcaster = Broadcaster::new(&kafka, state.clone())?;

    let stop = CancellationToken::new();
    // The consumer stops after the broadcaster's last flush: closing the
    // consumer drops the counters that flush reads.
    let stop_consumer = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            shutdown.await;
            tracing::info!("shutting down");
            stop.cancel();
        }
    });

    let consumer_task = tokio::spawn(consume_forever(
        consumer,
        kafka.clone(),
        settings.clone(),
        state.clone(),
        stop_consumer.clone(),
    ));
    let broadcast_task = tokio::spawn(broadcaster.run(stop.clone()));
    let limits_task = limits_table.map(|table| {
        tokio::spawn(tierlimit_shared::limits::follow::run(
            state.live().load().config.clone(),
            format!("aggregator-{}", settings.group_id),
            Arc::clone(&table),
            Default::default(),
            Arc::new(nodes::AggregatorHooks {
                state: state.clone(),
                table,
            }),
        ))
    });
    let housekeeping_task = tokio::spawn(housekeeping(state.clone(), stop.clone()));

    tracing::info!(addr = %local, admin = %listen.admin, tls = tls.is_some(), "HTTP listening");
    let api = tierlimit_shared::serve::serve(
        listener,
        http::router(state.clone(), &http_settings),
        tls,
        &http_settings,
        stop.clone().cancelled_owned(),
    );
    let admin = tierlimit_shared::serve::serve(
        admin_listener,
        http::admin_router(state.clone(), &http_settings),
        None,
        &http_settings,
        stop.clone().cancelled_owned(),
    );
    let (api, admin) = tokio::join!(api, admin);
    let served = api.and(admin);
    // The server only returns early on an I/O error; stop the rest too.
    stop.cancel();

    let _ = broadcast_task.await;
    stop_consumer.cancel();
    let _ = consumer_task.await;
    let _ = housekeeping_task.await;
    if let Some(t) = limits_task {
        t.abort();
    }
    tracing::info!("aggregator stopped");
    served.map_err(Error::Http)
}

/// Runs the consumer, replacing it if librdkafka ever declares it unusable.
async fn consume_forever(
    mut consumer: DeltaConsumer,
    kafka: tierlimit_shared::config::KafkaConfig,
    settings: tierlimit_shared::config::AggregatorSettings,
    state: Arc<State>,
    stop: CancellationToken,
) {
    loop {
        match consumer.run(stop.clone()).await {
            Ok(()) => return,
            Err(e) => tracing::error!(error = %e, "consumer failed fatally; starting a new one"),
        }
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(CONSUMER_RESTART_DELAY) => {}
            }
            match DeltaConsumer::new(&kafka, &settings, state.clone()) {
                Ok(c) => {
                    consumer = c;
                    break;
                }
                Err(e) => tracing::error!(error = %e, "cannot create a consumer; retrying"),
            }
        }
    }
}

async fn housekeeping(state: Arc<State>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(HOUSEKEEPING_EVERY);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => state.housekeeping(),
        }
    }
}

/// Completes on the first SIGTERM or SIGINT.
pub fn shutdown_signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Creates the deltas and global topics (if missing) with the partition
/// count and replication factor of the configuration and, with `compact`,
/// `cleanup.policy=compact,delete` and the retention that
/// `aggregator.retention_days` and the configured tier kinds imply (a month
/// tier: ~63 days, so that a rebuild on the 20th finds every actor's latest
/// delta of the previous month; `shared::retention`). Returns the topics
/// that were created.
pub async fn create_topics(config_path: &Path, compact: bool) -> Result<Vec<String>, Error> {
    let loaded = Config::load(config_path)?;
    let c = &loaded.config;
    let kinds = tierlimit_shared::retention::kinds_in_use(c);
    let retention_ms =
        tierlimit_shared::retention::topic_retention_ms_for(c.aggregator.retention_days, &kinds);
    tierlimit_shared::kafka::ensure_topics_retaining(&c.kafka, retention_ms, compact)
        .await
        .map_err(Error::Topics)
}
