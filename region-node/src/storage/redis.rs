//! The region's Redis as a [`CounterStore`]: the decision script over one
//! multiplexed master connection ([`Link`]), and a circuit breaker that
//! keeps a failing Redis off the hot path.
//!
//! A call that fails or exceeds `store_timeout` takes the plan's fail mode
//! for that request. The breaker opens — every decision goes straight to its
//! fail mode without waiting on Redis — on a connection-level error, or after
//! [`TIMEOUTS_TO_OPEN`] consecutive timeouts (one slow call under a load
//! spike should not flip a whole node into fail mode). While open, a single
//! probe task re-resolves the master every `store_retry_interval` and closes
//! the breaker only when `ROLE` says *master*: a replica that answers PING
//! must not pull the node back from its fail mode to be refused again.
//!
//! READONLY (the server was demoted by a failover) is handled apart: behind
//! Sentinel it means "find the master again", which the probe task does at
//! once while the breaker stays closed; a fixed URL has no other master to
//! find, so there it opens the breaker until the server is a master again.
//!
//! The script is loaded once and reloaded on NOSCRIPT (a restart, a
//! failover to a replica that never saw `SCRIPT LOAD`, or `SCRIPT FLUSH`):
//! NOSCRIPT means the script did not run, so re-sending it is safe. Nothing
//! else is ever re-sent: after an I/O error or a timeout the script may
//! already have run.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{FromRedisValue, Value};
use tokio::sync::Notify;

use super::cluster::ClusterRouter;
use super::link::{Link, Target};
use super::safety::Eviction;
use super::script::{self, DecideCall, DecideReply, ReplyError, DECIDE_LUA};
use super::{BoxFuture, CounterStore, StoreError};
use crate::metrics::Metrics;
use tierlimit_shared::keys;

/// Removes published dirty entries unless they changed since they were read.
pub const ACK_LUA: &str = include_str!("../lua/ack.lua");

/// Consecutive timeouts that open the breaker.
pub const TIMEOUTS_TO_OPEN: u32 = 3;

/// How a node uses its Redis (`node.store_timeout`,
/// `node.store_retry_interval`, `--allow-eviction`).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub timeout: Duration,
    pub retry_interval: Duration,
    /// Accept a master whose maxmemory-policy can evict counters.
    pub allow_eviction: bool,
}

pub struct RedisStore {
    /// A standalone or Sentinel-found master, or a Redis Cluster.
    route: Route,
    /// SHA1 of `DECIDE_LUA`, for `EVALSHA`.
    decide_sha: String,
    ack_sha: String,
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
    /// Wakes the probe task: the breaker opened, or the master must be
    /// found again.
    wake_probe: Notify,
    /// Set with `wake_probe` when a READONLY asks for a new master.
    reresolve: AtomicBool,
    metrics: Arc<Metrics>,
}

/// How calls reach Redis.
enum Route {
    /// One master (standalone, or found through Sentinel).
    Master(Box<Link>),
    /// Every call goes to the master of its slot; `allow_eviction` applies
    /// to every master.
    Cluster(Arc<ClusterRouter>, bool),
}

impl RedisStore {
    /// Creates the store without connecting: a node starts (and serves in its
    /// fail mode) even while its Redis is down.
    pub fn new(
        url: &str,
        options: Options,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<RedisStore>, StoreError> {
        let Options {
            timeout,
            retry_interval,
            allow_eviction,
        } = options;
        let route = match Target::parse(url)? {
            Target::Cluster { seeds } => {
                Route::Cluster(ClusterRouter::new(seeds, timeout), allow_eviction)
            }
            _ => Route::Master(Box::new(Link::new(
                url,
                timeout,
                retry_interval,
                allow_eviction,
            )?)),
        };
        // A sentinel or cluster target has no master until the probe asks:
        // start down.
        let up = match &route {
            Route::Master(link) => link.conn().is_some(),
            Route::Cluster(..) => false,
        };
        let store = Arc::new(RedisStore {
            route,
            decide_sha: redis::Script::new(DECIDE_LUA).get_hash().to_string(),
            ack_sha: redis::Script::new(ACK_LUA).get_hash().to_string(),
            decide_seconds: metrics.redis_seconds.with_label_values(&["decide"]),
            up: AtomicBool::new(up),
            timeouts: AtomicU32::new(0),
            clock_offset_ms: AtomicI64::new(i64::MIN),
            timeout,
            retry_interval,
            wake_probe: Notify::new(),
            reresolve: AtomicBool::new(false),
            metrics,
        });
        store.metrics.store_up.set(i64::from(up));
        let probe = Arc::clone(&store);
        tokio::spawn(async move { probe.probe_loop().await });
        if !up {
            store.wake_probe.notify_one();
        }
        Ok(store)
    }

    /// What the region's URL names.
    pub fn target_kind(&self) -> &'static str {
        match &self.route {
            Route::Master(link) => link.target().kind(),
            Route::Cluster(..) => "cluster",
        }
    }

    /// The slots whose dirty sets the publisher reads: one per bucket.
    pub fn is_cluster(&self) -> bool {
        matches!(self.route, Route::Cluster(..))
    }

    /// Finds the master(s) and checks them (role, eviction policy).
    async fn resolve(&self) -> Result<Eviction, StoreError> {
        match &self.route {
            Route::Master(link) => link.resolve().await,
            Route::Cluster(router, allow) => {
                router.refresh().await.inspect_err(|e| {
                    tracing::debug!(error = %e, "no node answered CLUSTER SLOTS");
                })?;
                let mut worst = None;
                for addr in router.masters() {
                    let mut cmd = redis::cmd("INFO");
                    cmd.arg("memory");
                    let info: String = router.query_on(&addr, &cmd).await.inspect_err(|e| {
                        tracing::debug!(%addr, error = %e, "INFO memory of a master failed");
                    })?;
                    let eviction = Eviction::from_info(&info).ok_or_else(|| {
                        StoreError::Unsafe(format!(
                            "INFO memory of {addr} has no maxmemory_policy: cannot tell whether Redis evicts counters"
                        ))
                    })?;
                    eviction.check(*allow)?;
                    if worst.as_ref().is_none_or(|w: &Eviction| !w.can_evict()) {
                        worst = Some(eviction);
                    }
                }
                worst.ok_or(StoreError::Down)
            }
        }
    }

    /// Resolves the master once now (the start-up check): a master whose
    /// policy can evict counters is refused here with an error naming the
    /// setting, before the node serves. An unreachable Redis is not an
    /// error at start (the node serves in its fail mode and the probe goes
    /// on trying, with the same checks).
    pub async fn check_at_start(&self) -> Result<(), StoreError> {
        match self.resolve().await {
            Ok(eviction) => {
                if eviction.can_evict() {
                    tracing::warn!(policy = %eviction.policy, "Redis may evict counters; running anyway (--allow-eviction)");
                }
                self.resolved(&eviction);
                Ok(())
            }
            Err(e @ StoreError::Unsafe(_)) => Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "Redis not usable at start; serving by each plan's on_store_error until it is");
                self.mark_down(&e);
                Ok(())
            }
        }
    }

    /// Sends `cmd` (keys all in `slot`) to the master that serves the slot.
    async fn send<T: FromRedisValue>(&self, slot: u16, cmd: &redis::Cmd) -> Result<T, StoreError> {
        match &self.route {
            Route::Master(link) => {
                let mut conn = link.conn().ok_or(StoreError::Down)?;
                cmd.query_async::<T>(&mut conn)
                    .await
                    .map_err(StoreError::from_redis)
            }
            Route::Cluster(router, _) => router.query(slot, cmd).await,
        }
    }

    /// A pipeline (keys all in `slot`), routed as [`Self::send`].
    async fn send_pipe<T: FromRedisValue>(
        &self,
        slot: u16,
        pipe: &redis::Pipeline,
    ) -> Result<T, StoreError> {
        match &self.route {
            Route::Master(link) => {
                let mut conn = link.conn().ok_or(StoreError::Down)?;
                pipe.query_async::<T>(&mut conn)
                    .await
                    .map_err(StoreError::from_redis)
            }
            Route::Cluster(router, _) => router.pipeline(slot, pipe).await,
        }
    }

    /// `EVALSHA` of a script, loading it on NOSCRIPT (the script did not
    /// run, so sending it again is safe) on the slot's master.
    async fn evalsha(
        &self,
        slot: u16,
        cmd: &redis::Cmd,
        source: &'static str,
    ) -> Result<Value, StoreError> {
        match self.send::<Value>(slot, cmd).await {
            Err(StoreError::Redis(e))
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(source);
                self.send::<String>(slot, &load).await?;
                self.send::<Value>(slot, cmd).await
            }
            other => other,
        }
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

    /// Redis' clock now, estimated from ours and the offset learnt from the
    /// last decision reply (ours until one arrived).
    pub fn redis_now_ms(&self, now_ms: u64) -> i64 {
        match self.clock_offset_ms.load(Ordering::Relaxed) {
            i64::MIN => now_ms as i64,
            offset => now_ms as i64 + offset,
        }
    }

    /// One decision: `EVALSHA` of the script, loading it once on NOSCRIPT.
    async fn run_decide(&self, call: &DecideCall<'_>) -> Result<DecideReply, StoreError> {
        let mut cmd = redis::Cmd::with_capacity(3 + 32, 512);
        cmd.arg("EVALSHA").arg(&self.decide_sha);
        script::encode(
            &mut cmd,
            call,
            self.deadline_ms(tierlimit_shared::messages::now_ms()),
        );
        let slot = call.slot();
        let fut = async {
            match self.evalsha(slot, &cmd, DECIDE_LUA).await? {
                Value::Array(items) => Ok(items),
                other => Err(StoreError::Reply(ReplyError::Malformed(format!(
                    "not a list: {other:?}"
                )))),
            }
        };
        let reply = self
            .call_timed("decide", Some(&self.decide_seconds), fut)
            .await?;
        let parsed = DecideReply::parse(reply);
        let redis_now = match &parsed {
            Ok(r) => r.now_ms,
            Err(ReplyError::Expired { now_ms }) => *now_ms,
            Err(ReplyError::Malformed(_)) => i64::MIN,
        };
        if redis_now != i64::MIN {
            let offset = redis_now - tierlimit_shared::messages::now_ms() as i64;
            self.clock_offset_ms.store(offset, Ordering::Relaxed);
        }
        match parsed {
            Ok(r) => Ok(r),
            // Past its deadline the script did nothing; for the caller that
            // is a timeout, and it counts towards opening the breaker.
            Err(ReplyError::Expired { .. }) => {
                self.note_error("decide", &StoreError::Expired);
                Err(StoreError::Expired)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Any command whose keys are all in `slot`, under the same timeout
    /// and breaker as decisions.
    pub async fn query<T: FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        slot: u16,
        cmd: redis::Cmd,
    ) -> Result<T, StoreError> {
        self.call_timed(op, None, self.send(slot, &cmd)).await
    }

    /// An `EVALSHA` (`cmd`, keys all in `slot`) of a script other than the
    /// decision script, loading `source` on NOSCRIPT, under the same timeout
    /// and breaker as decisions.
    pub async fn run_script(
        &self,
        op: &'static str,
        slot: u16,
        cmd: &redis::Cmd,
        source: &'static str,
    ) -> Result<Value, StoreError> {
        self.call_timed(op, None, self.evalsha(slot, cmd, source))
            .await
    }

    /// A pipeline whose keys are all in `slot`, under the same timeout and
    /// breaker. Only for commands safe to repeat (see
    /// [`ClusterRouter::pipeline`]).
    pub async fn pipeline<T: FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        slot: u16,
        pipe: redis::Pipeline,
    ) -> Result<T, StoreError> {
        self.call_timed(op, None, self.send_pipe(slot, &pipe)).await
    }

    /// Acknowledges published entries of bucket `bucket` (see `ack.lua`):
    /// each `(tenant, day, P + N as published)` leaves the bucket's dirty
    /// set unless a charge raised it since.
    pub async fn ack_dirty(
        &self,
        bucket: u16,
        relaxed: Duration,
        published: &[(String, u32, u64)],
    ) -> Result<i64, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.ack_sha)
            .arg(1 + published.len())
            .arg(keys::dirty(bucket));
        for (tenant, _, _) in published {
            cmd.arg(keys::tenant_hash(tenant));
        }
        cmd.arg(relaxed.as_millis() as u64);
        for (tenant, day, pn) in published {
            cmd.arg(keys::dirty_member(tenant, *day)).arg(day).arg(pn);
        }
        let slot = keys::bucket_slot(bucket);
        let fut = async {
            let v = self.evalsha(slot, &cmd, ACK_LUA).await?;
            Ok(i64::from_redis_value(v).map_err(redis::RedisError::from)?)
        };
        self.call_timed("ack", None, fut).await
    }

    async fn call_timed<T>(
        &self,
        op: &'static str,
        seconds: Option<&prometheus::Histogram>,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if !self.is_up() {
            return Err(StoreError::Down);
        }
        let started = Instant::now();
        let result = match tokio::time::timeout(self.timeout, fut).await {
            Ok(result) => result,
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
            Err(e) => self.note_error(op, e),
        }
        result
    }

    /// Counts an error and decides what it does to the breaker.
    fn note_error(&self, op: &'static str, e: &StoreError) {
        self.metrics
            .redis_errors
            .with_label_values(&[op, e.kind()])
            .inc();
        let open = match e {
            StoreError::Timeout(_) | StoreError::Expired => {
                self.timeouts.fetch_add(1, Ordering::Relaxed) + 1 >= TIMEOUTS_TO_OPEN
            }
            // Behind Sentinel a demoted master means "ask again", not "down".
            StoreError::NotMaster if self.follows_failovers() => {
                self.request_resolve();
                false
            }
            other => other.is_unavailability(),
        };
        if open {
            self.mark_down(e);
        }
    }

    fn follows_failovers(&self) -> bool {
        match &self.route {
            Route::Master(link) => matches!(link.target(), Target::Sentinel { .. }),
            Route::Cluster(..) => true,
        }
    }

    /// Asks the probe task to find the master again (single flight).
    fn request_resolve(&self) {
        if !self.reresolve.swap(true, Ordering::Relaxed) {
            self.metrics.master_resolutions.inc();
            self.wake_probe.notify_one();
        }
    }

    /// A master was found and passed the checks: serve from it.
    fn resolved(&self, eviction: &super::safety::Eviction) {
        self.metrics
            .eviction_allowed
            .set(i64::from(eviction.can_evict()));
        self.reresolve.store(false, Ordering::Relaxed);
        self.timeouts.store(0, Ordering::Relaxed);
        if !self.up.swap(true, Ordering::Relaxed) {
            self.metrics.store_up.set(1);
            tracing::info!(
                kind = self.target_kind(),
                "Redis master answers; leaving fail mode"
            );
        }
    }

    fn mark_down(&self, e: &StoreError) {
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(error = %e, "Redis unavailable; decisions use each plan's on_store_error until it answers again");
            self.metrics.store_up.set(0);
            self.wake_probe.notify_one();
        }
    }

    /// While down, or when asked to find the master again: resolve the
    /// master and check its role every `retry_interval` until it is one.
    async fn probe_loop(self: Arc<Self>) {
        loop {
            if self.is_up() && !self.reresolve.load(Ordering::Relaxed) {
                self.wake_probe.notified().await;
                continue;
            }
            match self.resolve().await {
                Ok(eviction) => self.resolved(&eviction),
                Err(e) => {
                    if let StoreError::Unsafe(why) = &e {
                        tracing::error!("{why}");
                    } else {
                        tracing::debug!(error = %e, "no Redis master yet");
                    }
                    // A re-resolution that keeps failing is an outage.
                    if self.reresolve.load(Ordering::Relaxed) {
                        self.mark_down(&e);
                    }
                    tokio::time::sleep(self.retry_interval).await;
                }
            }
        }
    }
}

impl CounterStore for RedisStore {
    fn kind(&self) -> &'static str {
        self.target_kind()
    }

    fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    fn decide<'a>(
        &'a self,
        call: &'a DecideCall<'a>,
    ) -> BoxFuture<'a, Result<DecideReply, StoreError>> {
        Box::pin(self.run_decide(call))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> Options {
        Options {
            timeout: Duration::from_millis(100),
            retry_interval: Duration::from_secs(60),
            allow_eviction: false,
        }
    }

    /// READONLY behind Sentinel asks for the master again and keeps the
    /// breaker closed; behind a fixed URL there is no other master to find,
    /// so it opens the breaker until `ROLE` says master.
    #[tokio::test]
    async fn readonly_re_resolves_behind_sentinel_and_opens_the_breaker_otherwise() {
        let readonly = || {
            StoreError::from_redis(redis::RedisError::from((
                redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
                "READONLY You can't write against a read only replica.",
            )))
        };
        assert!(matches!(readonly(), StoreError::NotMaster));

        let metrics = Arc::new(Metrics::new());
        let sentinel = RedisStore::new(
            "redis+sentinel://127.0.0.1:1/m",
            options(),
            Arc::clone(&metrics),
        )
        .unwrap();
        // A sentinel store starts without a master; pretend it has one.
        sentinel.up.store(true, Ordering::Relaxed);
        sentinel.note_error("decide", &readonly());
        assert!(
            sentinel.is_up(),
            "READONLY is not an outage behind Sentinel"
        );
        assert_eq!(metrics.master_resolutions.get(), 1);
        sentinel.note_error("decide", &readonly());
        assert_eq!(metrics.master_resolutions.get(), 1, "one look-up at a time");

        let fixed =
            RedisStore::new("redis://127.0.0.1:1/", options(), Arc::new(Metrics::new())).unwrap();
        assert!(fixed.is_up());
        fixed.note_error("decide", &readonly());
        assert!(!fixed.is_up(), "a fixed URL's replica opens the breaker");
    }
}
