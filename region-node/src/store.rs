//! The region's Redis: one multiplexed connection, the decision script, and
//! a circuit breaker that keeps a failing Redis off the hot path.
//!
//! Concurrent decisions share one multiplexed connection, so their
//! `EVALSHA`s are pipelined on the wire instead of each waiting a full round
//! trip for a pooled connection. The script is loaded once and reloaded by
//! `redis::Script` when Redis answers NOSCRIPT (a restart or `SCRIPT FLUSH`).
//!
//! A call that fails or exceeds `store_timeout` takes the plan's fail mode
//! for that request. The breaker opens — every decision goes straight to its
//! fail mode without waiting on Redis — on a connection-level error, or after
//! [`TIMEOUTS_TO_OPEN`] consecutive timeouts (one slow call under a load
//! spike should not flip a whole node into fail mode). While open, a single
//! probe task PINGs every `store_retry_interval` until Redis answers again.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
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

/// Consecutive timeouts that open the breaker.
pub const TIMEOUTS_TO_OPEN: u32 = 3;

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
    /// SHA1 of `DECIDE_LUA`, for `EVALSHA`.
    decide_sha: String,
    ack: redis::Script,
    /// `tierlimit_redis_seconds{op="decide"}`, resolved once: looking a
    /// labelled child up hashes the labels and takes a lock on every call.
    decide_seconds: prometheus::Histogram,
    up: AtomicBool,
    /// Timeouts since the last successful call.
    timeouts: AtomicU32,
    /// Redis' clock minus ours, in ms, learnt from every decision reply
    /// (`i64::MIN` until the first). Lets the node express a deadline in
    /// Redis' clock without trusting the two clocks to agree.
    clock_offset_ms: AtomicI64,
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
        // No response timeout inside the connection: every call is already
        // bounded by `timeout` in `Store::call`, and a second timer per call
        // is measurable on the hot path.
        let cfg = ConnectionManagerConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(200))))
            .set_number_of_retries(1)
            .set_max_delay(retry_interval);
        let conn = ConnectionManager::new_lazy_with_config(client, cfg)?;
        let store = Arc::new(Store {
            conn,
            decide_sha: redis::Script::new(DECIDE_LUA).get_hash().to_string(),
            ack: redis::Script::new(ACK_LUA),
            decide_seconds: metrics.redis_seconds.with_label_values(&["decide"]),
            up: AtomicBool::new(true),
            timeouts: AtomicU32::new(0),
            clock_offset_ms: AtomicI64::new(i64::MIN),
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

    /// An `EVALSHA` of the decision script with its key count, ready for
    /// KEYS and ARGV (layout at the top of `decide.lua`). The caller appends
    /// them straight into the command: no intermediate strings.
    pub fn decide_cmd(&self, numkeys: usize, capacity: usize) -> redis::Cmd {
        let mut cmd = redis::Cmd::with_capacity(3 + 32, capacity);
        cmd.arg("EVALSHA").arg(&self.decide_sha).arg(numkeys);
        cmd
    }

    /// Runs a command built by [`Store::decide_cmd`]. On `NOSCRIPT` (Redis
    /// restarted or `SCRIPT FLUSH`) it loads the script and retries once, as
    /// `redis::Script` does.
    pub async fn decide(&self, cmd: &redis::Cmd) -> Result<Vec<Value>, StoreError> {
        let mut conn = self.conn.clone();
        let fut = async move {
            match cmd.query_async::<Vec<Value>>(&mut conn).await {
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    redis::cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(DECIDE_LUA)
                        .query_async::<String>(&mut conn)
                        .await?;
                    cmd.query_async::<Vec<Value>>(&mut conn).await
                }
                other => other,
            }
        };
        let reply = self
            .call_timed("decide", Some(&self.decide_seconds), fut)
            .await?;
        // Reply field 4 is the script's `now_ms` (Redis TIME).
        if let Some(Value::Int(redis_now)) = reply.get(3) {
            let offset = redis_now - tierlimit_shared::messages::now_ms() as i64;
            self.clock_offset_ms.store(offset, Ordering::Relaxed);
        }
        // Denied tier 4: the call reached Redis after its deadline and did
        // nothing; for the caller that is a timeout.
        if let Some(Value::Int(4)) = reply.get(1) {
            return Err(StoreError::Timeout(self.timeout));
        }
        Ok(reply)
    }

    /// The deadline (ms, in Redis' clock) for a decision sent now: past it
    /// the script refuses to charge, because the node will have given up and
    /// answered from its fail mode. It falls at half the store timeout, so a
    /// call Redis runs just before it still has the other half for its reply
    /// to arrive before the node gives up; otherwise the request could be
    /// charged in Redis *and* answered from the fail mode. 0 (no deadline)
    /// until the clock offset is known.
    pub fn deadline_ms(&self, now_ms: u64) -> i64 {
        match self.clock_offset_ms.load(Ordering::Relaxed) {
            i64::MIN => 0,
            offset => now_ms as i64 + offset + (self.timeout.as_millis() as i64 / 2).max(1),
        }
    }

    /// Any command, under the same timeout and breaker as decisions.
    pub async fn query<T: FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        cmd: redis::Cmd,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        self.call(op, async move { cmd.query_async::<T>(&mut conn).await })
            .await
    }

    /// A pipeline, under the same timeout and breaker.
    pub async fn pipeline<T: FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        pipe: redis::Pipeline,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        self.call(op, async move { pipe.query_async::<T>(&mut conn).await })
            .await
    }

    /// Removes `(member, score)` pairs from the dirty set where the score has
    /// not grown since it was read, stamps each in the published set with
    /// Redis' time, and forgets published stamps older than `remember`
    /// (see `ack.lua`).
    pub async fn ack_dirty(
        &self,
        dirty_key: &str,
        published_key: &str,
        remember: Duration,
        published: &[(String, u64)],
    ) -> Result<i64, StoreError> {
        let mut inv = self.ack.prepare_invoke();
        inv.key(dirty_key)
            .key(published_key)
            .arg(remember.as_millis() as u64);
        for (m, s) in published {
            inv.arg(m).arg(s);
        }
        let mut conn = self.conn.clone();
        self.call(
            "ack",
            async move { inv.invoke_async::<i64>(&mut conn).await },
        )
        .await
    }

    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        self.call_timed(op, None, fut).await
    }

    async fn call_timed<T>(
        &self,
        op: &'static str,
        seconds: Option<&prometheus::Histogram>,
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
        let elapsed = started.elapsed().as_secs_f64();
        match seconds {
            Some(h) => h.observe(elapsed),
            None => self
                .metrics
                .redis_seconds
                .with_label_values(&[op])
                .observe(elapsed),
        }
        match &result {
            Ok(_) => self.timeouts.store(0, Ordering::Relaxed),
            Err(e) => {
                self.metrics
                    .redis_errors
                    .with_label_values(&[op, e.kind()])
                    .inc();
                let open = match e {
                    StoreError::Timeout(_) => {
                        self.timeouts.fetch_add(1, Ordering::Relaxed) + 1 >= TIMEOUTS_TO_OPEN
                    }
                    other => other.is_unavailability(),
                };
                if open {
                    self.mark_down(e);
                }
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
                self.timeouts.store(0, Ordering::Relaxed);
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
