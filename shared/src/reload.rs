//! Live configuration: the current [`Loaded`] config behind an `ArcSwap`,
//! replaced on SIGHUP when (and only when) the new file validates.
//!
//! Readers on the hot path pay one atomic load; a bad file on disk never
//! takes a running process down or half-applies.

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::config::{Config, ConfigError, Loaded};

/// The process-wide current configuration.
pub type Live = Arc<ArcSwap<Loaded>>;

/// Wraps a loaded config for sharing.
pub fn live(loaded: Loaded) -> Live {
    Arc::new(ArcSwap::from_pointee(loaded))
}

/// Re-reads `path`; on success swaps it in and returns `Ok`, otherwise keeps
/// the old configuration and returns why.
pub fn reload(path: &std::path::Path, live: &Live) -> Result<(), ConfigError> {
    let mut loaded = Config::load(path)?;
    // The limits topic's table outlives any file: the new configuration
    // reads the same one (and hands it its plans).
    let current = live.load();
    if current.config.limits.source != loaded.config.limits.source {
        return Err(ConfigError::Invalid {
            key: "limits.source".into(),
            reason: "changes only with a restart (the process follows the topic or the file \
                     from its start)"
                .into(),
        });
    }
    if let Some(table) = current.limits() {
        loaded.attach_limits(Arc::clone(table));
    }
    live.store(Arc::new(loaded));
    Ok(())
}

/// Spawns a task that reloads `path` on every SIGHUP, logging the outcome.
/// `on_reload` runs after each successful swap (e.g. to bump a metric).
pub fn spawn_sighup_reloader(
    path: PathBuf,
    live: Live,
    on_reload: impl Fn(Result<(), &ConfigError>) + Send + 'static,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    Ok(tokio::spawn(async move {
        while hup.recv().await.is_some() {
            match reload(&path, &live) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), "configuration reloaded");
                    on_reload(Ok(()));
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "configuration reload refused; keeping the previous configuration");
                    on_reload(Err(&e));
                }
            }
        }
    }))
}
