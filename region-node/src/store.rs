//! The region's Redis: one multiplexed connection, the decision script, and
//! a circuit breaker that keeps a failing Redis off the hot path.
//!
//! Concurrent decisions share one multiplexed connection, so their
//! `EVALSHA`s are pipelined on the wire instead of each waiting a full round
//! trip for a pooled connection. The script is loaded once and reloaded by
//! `redis::Script` when Redis answers NOSCRIPT (a restart or `SCRIPT FLUSH`).
//!
//! When a call fails or exceeds `store_timeout`, the breaker opens: decisions
//! go straight to the plan's fail mode without waiting on Redis, and a single
//! probe task PINGs every `store_retry_interval` until Redis answers again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, Value};
use thiserror::Error;
use tokio::sync::Notify;

use crate::metrics::Metrics;

/// The decision script: node tier, region tier and global budget in one call.
pub const DECIDE_LUA: &str = include_str!("lua/decide.lua");
/// Removes published dirty entries unless they changed since they were read.
pub const ACK_LUA: &str = include_str!("lua/ack.lua");

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("Redis is marked down; waiting for the probe to see it back")]
    Down,
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("Redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected reply from the decision script: {0}")]
    Reply(String),
}

impl StoreError {
    fn kind(&self) -> &'static str {
        match self {
            StoreError::Down => "down",
            StoreError::Timeout(_) => "timeout",
            StoreError::Redis(_) => "redis",
            StoreError::Reply(_) => "reply",
        }
    }
}

pub struct Store {
    conn: ConnectionManager,
    decide: redis::Script,
    ack: redis::Script,
    up: AtomicBool,
    timeout: Duration,
    retry_interval: Duration,
    wake_probe: Notify,
    metrics: Arc<Metrics>,
}

impl Store {
    /// Creates the store without connecting: a node starts (and serves in its
    /// fail mode) even while its Redis is down.
    pub fn new(
        url: &str,
        timeout: Duration,
        retry_interval: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Store>, StoreError> {
        let client = redis::Client::open(url)?;
        let cfg = ConnectionManagerConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(200))))
            .set_number_of_retries(1)
            .set_max_delay(retry_interval);
        let conn = ConnectionManager::new_lazy_with_config(client, cfg)?;
        let store = Arc::new(Store {
            conn,
            decide: redis::Script::new(DECIDE_LUA),
            ack: redis::Script::new(ACK_LUA),
            up: AtomicBool::new(true),
            timeout,
            retry_interval,
            wake_probe: Notify::new(),
            metrics,
        });
        store.metrics.store_up.set(1);
        tokio::spawn(Arc::clone(&store).probe_loop());
        Ok(store)
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Runs the decision script. `keys` and `args` follow the layout
    /// documented at the top of `decide.lua`.
    pub async fn decide(&self, keys: &[String], args: &[String]) -> Result<Vec<Value>, StoreError> {
        let mut inv = self.decide.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        for a in args {
            inv.arg(a);
        }
        let mut conn = self.conn.clone();
        self.call("decide", async move { inv.invoke_async::<Vec<Value>>(&mut conn).await })
            .await
    }

    /// Any command, under the same timeout and breaker as decisions.
    pub async fn query<T: FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        cmd: redis::Cmd,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        self.call(op, async move { cmd.query_async::<T>(&mut conn).await }).await
    }

    /// A pipeline, under the same timeout and breaker.
    pub async fn pipeline<T: FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        pipe: redis::Pipeline,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        self.call(op, async move { pipe.query_async::<T>(&mut conn).await }).await
    }

    /// Removes `(member, score)` pairs from the dirty set where the score has
    /// not grown since it was read (see `ack.lua`).
    pub async fn ack_dirty(&self, dirty_key: &str, published: &[(String, u64)]) -> Result<i64, StoreError> {
        let mut inv = self.ack.prepare_invoke();
        inv.key(dirty_key);
        for (m, s) in published {
            inv.arg(m).arg(s);
        }
        let mut conn = self.conn.clone();
        self.call("ack", async move { inv.invoke_async::<i64>(&mut conn).await })
            .await
    }

    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        if !self.is_up() {
            return Err(StoreError::Down);
        }
        let started = Instant::now();
        let result = match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StoreError::Redis(e)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        self.metrics
            .redis_seconds
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            self.metrics.redis_errors.with_label_values(&[op, e.kind()]).inc();
            if e.is_unavailability() {
                self.mark_down(e);
            }
        }
        result
    }

    fn mark_down(&self, e: &StoreError) {
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(error = %e, "Redis unavailable; decisions use each plan's on_store_error until it answers again");
            self.metrics.store_up.set(0);
            self.wake_probe.notify_one();
        }
    }

    /// While down, PING every `retry_interval`; the first answer closes the
    /// breaker.
    async fn probe_loop(self: Arc<Self>) {
        loop {
            if self.is_up() {
                self.wake_probe.notified().await;
                continue;
            }
            tokio::time::sleep(self.retry_interval).await;
            let mut conn = self.conn.clone();
            let ping = tokio::time::timeout(
                self.timeout.max(Duration::from_millis(200)),
                redis::cmd("PING").query_async::<String>(&mut conn),
            )
            .await;
            if matches!(ping, Ok(Ok(_))) {
                self.up.store(true, Ordering::Relaxed);
                self.metrics.store_up.set(1);
                tracing::info!("Redis answers again; leaving fail mode");
            }
        }
    }
}

impl StoreError {
    /// Errors that mean "Redis cannot serve us now" (as opposed to a bad
    /// reply to one call).
    fn is_unavailability(&self) -> bool {
        match self {
            StoreError::Down | StoreError::Timeout(_) => true,
            StoreError::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.is_unrecoverable_error()
                    || matches!(
                        e.kind(),
                        redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading)
                            | redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain)
                            | redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown)
                            | redis::ErrorKind::Server(redis::ServerErrorKind::MasterDown)
                            | redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
                    )
            }
            StoreError::Reply(_) => false,
        }
    }
}
