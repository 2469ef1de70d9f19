//! tierlimit region-node: the process a service asks "may tenant T spend C
//! units now?".
//!
//! Module map:
//! - [`admission`]: a bounded number of requests in flight, a bounded
//!   queue, then 503 (saturation is shed, not taken for an outage);
//! - [`decision`]: the hot path, top to bottom (validate → global fast path →
//!   one store call → fail mode);
//! - [`storage`]: the counter stores behind one trait: the region's Redis
//!   (standalone or behind Sentinel, the circuit breaker, start-up safety
//!   checks) and the typed interface of the Lua scripts;
//! - [`local`]: the in-process `local` fail mode (a store too);
//! - [`lease`]: budget charged in Redis ahead and spent in process;
//! - [`reserve`]: the node tier decided in process against units its
//!   decisions charged in Redis ahead;
//! - [`view`] and [`follower`]: the broadcast view of global totals;
//! - [`newcomers`]: the region's gate for tenants the configuration does
//!   not name (how many new ones a second and a day);
//! - [`publisher`]: dirty set → deltas topic;
//! - [`republish`]: `region-node republish`, the region's Redis → deltas
//!   topic (disaster recovery of lost or truncated topics);
//! - [`http`]: the axum API; [`metrics`]: Prometheus;
//! - [`rls`]: Envoy's rate limit service over gRPC (`--grpc-listen`).

pub mod admission;
pub mod decision;
pub mod follower;
pub mod http;
pub mod lease;
pub mod legacy;
pub mod limits;
pub mod limits_copy;
pub mod local;
pub mod metrics;
pub mod newcomers;
pub mod publisher;
pub mod refund;
pub mod republish;
pub mod reserve;
pub mod rls;
pub mod storage;
pub mod transition;
pub mod view;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};

use tierlimit_shared::config::Config;
use tierlimit_shared::reload;

/// What `main` hands over after parsing flags.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: PathBuf,
    pub region: String,
    pub node_id: String,
    pub listen: SocketAddr,
    /// The admin listener (`/metrics`, probes); kept off the API listener.
    pub admin_listen: SocketAddr,
    /// Accept a Redis whose maxmemory-policy can evict counters.
    pub allow_eviction: bool,
    /// Address of Envoy's rate limit service (gRPC); `None`: not served.
    pub grpc_listen: Option<SocketAddr>,
}

/// Runs a region-node until SIGINT/SIGTERM.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let mut loaded = Config::load(&settings.config)
        .with_context(|| format!("loading {}", settings.config.display()))?;
    // Tenants from the limits topic: one table for the process's life,
    // read by every configuration it loads.
    let limits_table = (loaded.config.limits.source
        == tierlimit_shared::config::LimitsSource::Topic)
        .then(|| Arc::new(tierlimit_shared::limits::LimitsTable::new()));
    if let Some(table) = &limits_table {
        loaded.attach_limits(Arc::clone(table));
    }
    tierlimit_shared::validate::name("node id", &settings.node_id).context("--node-id")?;
    let Some(region) = loaded.config.regions.get(&settings.region).cloned() else {
        bail!(
            "--region {:?} is not configured (regions: {})",
            settings.region,
            loaded
                .config
                .regions
                .keys()
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let config = loaded.config.clone();
    // A node that cannot sign its deltas or check broadcasts would run but
    // count for nothing globally: refuse to start.
    tierlimit_shared::wire::DeltaSigner::new(&config, &settings.region)
        .map_err(|e| anyhow::anyhow!("wire keys: {e}"))?;
    tierlimit_shared::wire::BroadcastVerifier::new(&config)
        .map_err(|e| anyhow::anyhow!("wire keys: {e}"))?;
    let metrics = Arc::new(metrics::Metrics::new());
    let live = reload::live(loaded);
    {
        let m = Arc::clone(&metrics);
        reload::spawn_sighup_reloader(settings.config.clone(), Arc::clone(&live), move |r| {
            m.config_reloads
                .with_label_values(&[if r.is_ok() { "ok" } else { "refused" }])
                .inc();
        })?;
    }

    let store = storage::redis::RedisStore::new(
        &region.redis_url,
        storage::redis::Options {
            timeout: config.node.store_timeout,
            retry_interval: config.node.store_retry_interval,
            unavailable_after: config.node.store_unavailable_after,
            allow_eviction: settings.allow_eviction,
        },
        Arc::clone(&metrics),
    )
    .with_context(|| format!("regions.{}.redis_url", settings.region))?;
    store
        .check_at_start()
        .await
        .with_context(|| format!("regions.{}.redis_url", settings.region))?;
    let view = Arc::new(view::View::new());
    let local = Arc::new(local::Local::new(&settings.region, &settings.node_id));
    let store_for_limits = Arc::clone(&store);

    let publisher = publisher::Publisher::new(
        &config,
        &settings.region,
        &settings.node_id,
        Arc::clone(&store),
        Arc::clone(&local),
        Arc::clone(&live),
        Arc::clone(&view),
        Arc::clone(&metrics),
    )
    .context("creating the Kafka producer")?;
    let watermark = publisher.watermark();
    tokio::spawn(publisher.run());
    tokio::spawn(follower::run(
        config.clone(),
        format!("{}-{}", settings.region, settings.node_id),
        Arc::clone(&view),
        Arc::clone(&metrics),
    ));

    let newcomers = newcomers::Newcomers::new(Arc::clone(&store), Arc::clone(&metrics));
    let live_for_http = Arc::clone(&live);
    let decider = decision::Decider::new(
        live,
        store,
        Arc::clone(&view),
        local,
        settings.region.clone(),
        settings.node_id.clone(),
        Arc::clone(&metrics),
    )
    .with_newcomers(newcomers);
    let http_settings = config.http.clone();
    let state = Arc::new(http::AppState {
        decider,
        metrics,
        view,
        live: Arc::clone(&live_for_http),
    });
    if let Some(table) = &limits_table {
        // The region's copy first: a node that cannot reach Kafka serves
        // with the region's last applied limits (after `node.view_wait`,
        // the same grace the broadcast view gets), and one that can
        // follows the topic from where the copy ends.
        let copy = limits_copy::RegionCopy::new(Arc::clone(&store_for_limits));
        let starts = match copy.load().await {
            Ok(Some(snapshot)) => {
                let starts = limits::apply_copy(table, snapshot);
                let (table, metrics, wait) = (
                    Arc::clone(table),
                    Arc::clone(&state.metrics),
                    config.node.view_wait,
                );
                tokio::spawn(async move {
                    if !table.wait_ready(wait).await {
                        table.mark_ready();
                        metrics.limits_from_copy.set(1);
                        metrics.limits.observe(&table);
                        tracing::warn!(
                            version = table.applied_version(),
                            tenants = table.len(),
                            "limits topic unreachable: serving the region's copy of the limits"
                        );
                    }
                });
                starts
            }
            Ok(None) => Default::default(),
            Err(e) => {
                tracing::warn!(error = %e, "the region's copy of the limits could not be read");
                Default::default()
            }
        };
        let (copy_tx, copy_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(limits::write_copy(copy, copy_rx));
        tokio::spawn(tierlimit_shared::limits::follow::run(
            config.clone(),
            format!("{}-{}", settings.region, settings.node_id),
            Arc::clone(table),
            starts,
            Arc::new(limits::NodeHooks {
                state: Arc::clone(&state),
                table: Arc::clone(table),
                copy: copy_tx,
            }),
        ));
    }
    {
        // Whatever the limits' source: the status carries the watermark.
        let following = state.metrics.limits.following.clone();
        tokio::spawn(limits::publish_status(
            config.clone(),
            settings.region.clone(),
            settings.node_id.clone(),
            limits_table.clone(),
            watermark,
            move || following.get() == 1,
        ));
    }
    {
        // The unused part of expired and replaced leases goes back, and
        // node-tier reservations of ended windows are forgotten.
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            // Often: a lease that expires with units left (its life over,
            // its holder's rate fell) gives them back to its window while
            // it is current (see `lease`).
            let mut tick = tokio::time::interval(crate::lease::RETURN_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                state.decider.return_leases().await;
            }
        });
    }
    let tls = match http_settings.tls() {
        Some((cert, key)) => Some(
            tierlimit_shared::tls::server_config(cert, key, http_settings.tls_client_ca.as_deref())
                .context("[http] TLS")?,
        ),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("binding {}", settings.listen))?;
    let admin = tokio::net::TcpListener::bind(settings.admin_listen)
        .await
        .with_context(|| format!("binding the admin listener {}", settings.admin_listen))?;
    if config.auth.keys.is_empty() && config.auth.clients.is_empty() {
        tracing::warn!(
            open_scopes = ?config.auth.open_scopes,
            "no API keys configured ([auth.keys]): only auth.open_scopes are usable"
        );
    }
    let grpc = match settings.grpc_listen {
        Some(addr) => Some(rls::Listener::bind(addr, &config.grpc).await?),
        None => None,
    };
    if let Some(grpc) = grpc {
        tracing::info!(grpc_listen = %grpc.local_addr()?, "Envoy rate limit service serving");
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            if let Err(e) = grpc.serve(state, shutdown_signal()).await {
                tracing::error!("gRPC listener: {e:#}");
            }
        });
    }
    tracing::info!(
        listen = %settings.listen,
        admin_listen = %settings.admin_listen,
        tls = tls.is_some(),
        region = %settings.region,
        node = %settings.node_id,
        "region-node serving"
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let api = tierlimit_shared::serve::serve(
        listener,
        http::router(Arc::clone(&state), &http_settings),
        tls,
        &http_settings,
        stopped(stop_rx.clone()),
    );
    let admin = tierlimit_shared::serve::serve(
        admin,
        http::admin_router(state, &http_settings),
        None,
        &http_settings,
        stopped(stop_rx),
    );
    let (api, admin) = tokio::join!(api, admin);
    api.context("API listener")?;
    admin.context("admin listener")?;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}
