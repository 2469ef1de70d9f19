//! The region's Redis as a [`CounterStore`]: the decision script over one
//! multiplexed master connection ([`Link`]), a circuit breaker that keeps
//! an unavailable Redis off the hot path, and the compensation of replies
//! that arrive after the node gave up.
//!
//! **The breaker judges progress, not latency.** A call that fails or
//! exceeds `store_timeout` takes the plan's fail mode for that request
//! alone. The breaker opens (every decision goes straight to its fail mode
//! without waiting on Redis) on a connection-level error, or when a call
//! times out and *nothing* has come back from Redis for
//! `store_unavailable_after` while calls were waiting ([`Progress`]). A
//! Redis that is merely saturated still answers, one reply after another,
//! so queueing cannot trip it: before this, three consecutive timeouts
//! opened it, and a load above capacity (every call waiting behind the
//! backlog) flipped a whole node into its fail mode. Admission control
//! ([`crate::admission`]) keeps that backlog out of Redis in the first
//! place. While open, a single probe task re-resolves the master every
//! `store_retry_interval` and closes the breaker only when `ROLE` says
//! *master*: a replica that answers PING must not pull the node back from
//! its fail mode to be refused again.
//!
//! READONLY (the server was demoted by a failover) is handled apart: behind
//! Sentinel it means "find the master again", which the probe task does at
//! once while the breaker stays closed; a fixed URL has no other master to
//! find, so there it opens the breaker until the server is a master again.
//!
//! **Lost replies.** Every decision carries a deadline in Redis' clock
//! (half the store timeout after it is sent, see [`RedisStore::deadline_ms`];
//! the clock offset is learnt with `TIME` when the master is resolved and
//! from every reply): the script does nothing past it. What the deadline
//! cannot exclude is a call Redis ran in time whose *reply* came back after
//! the node gave up (a slow return path, a node too busy to read it). Such a
//! call is not dropped: its reply is awaited in the background, and a check
//! that turns out charged is refunded through the script's refund-by-handle
//! path (the call's own id, the charge's Redis time: exactly its windows
//! and day, at most once, so the refund may be re-sent until it gets
//! through). `tierlimit_late_replies_total` says what each late reply was;
//! `tierlimit_uncompensated_total` counts what could not be undone.
//!
//! The script is loaded once and reloaded on NOSCRIPT (a restart, a
//! failover to a replica that never saw `SCRIPT LOAD`, or `SCRIPT FLUSH`):
//! NOSCRIPT means the script did not run, so re-sending it is safe. Nothing
//! else is ever re-sent: after an I/O error or a timeout the script may
//! already have run.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use redis::{FromRedisValue, Value};
use tokio::sync::Notify;

use super::cluster::ClusterRouter;
use super::link::{Link, Target};
use super::safety::Eviction;
use super::script::{
    self, DecideCall, DecideReply, GlobalArgs, Op, PeriodArgs, RefundOf, ReplyError, Scope,
    TierCall, DECIDE_LUA,
};
use super::{BoxFuture, CounterStore, StoreError};
use crate::metrics::Metrics;
use tierlimit_shared::config::Limit;
use tierlimit_shared::keys;
use tierlimit_shared::period::Period;

/// Removes published dirty entries unless they changed since they were read.
pub const ACK_LUA: &str = include_str!("../lua/ack.lua");

/// How long the reply of a call the node gave up on is still awaited. A
/// reply that takes longer (a connection silently gone) is counted in
/// `tierlimit_uncompensated_total{reason="no_reply"}`.
pub const LATE_REPLY_WAIT: Duration = Duration::from_secs(30);

/// How long the refund of a late-charged check is retried (Redis may be
/// failing again) before it is counted as `refund_failed`.
pub const COMPENSATE_FOR: Duration = Duration::from_secs(60);

/// How a node uses its Redis (`node.store_timeout`,
/// `node.store_retry_interval`, `node.store_unavailable_after`,
/// `--allow-eviction`).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub timeout: Duration,
    pub retry_interval: Duration,
    /// No reply at all for this long, while calls wait, opens the breaker.
    pub unavailable_after: Duration,
    /// Accept a master whose maxmemory-policy can evict counters.
    pub allow_eviction: bool,
}

/// Whether Redis is making progress: since when calls have been waiting
/// without any reply. Any reply proves the server is serving, however long
/// its queue; only silence while calls wait says it is not.
struct Progress {
    origin: Instant,
    /// ms since `origin` (+1) of the first call sent since the last reply;
    /// 0: none waiting since the last reply.
    waiting_since: AtomicU64,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            origin: Instant::now(),
            waiting_since: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64 + 1
    }

    /// A call goes out: the silence starts now unless it already had.
    fn sent(&self) {
        if self.waiting_since.load(Ordering::Relaxed) == 0 {
            let _ = self.waiting_since.compare_exchange(
                0,
                self.now(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Redis answered something.
    fn replied(&self) {
        if self.waiting_since.load(Ordering::Relaxed) != 0 {
            self.waiting_since.store(0, Ordering::Relaxed);
        }
    }

    /// How long calls have waited without any reply, if they have.
    fn silence(&self) -> Option<Duration> {
        match self.waiting_since.load(Ordering::Relaxed) {
            0 => None,
            since => Some(Duration::from_millis(self.now().saturating_sub(since))),
        }
    }
}

/// Redis' clock minus ours, estimated from replies. Each sample is Redis'
/// time when the script ran minus ours when the reply was read, so it is
/// below the true offset by the reply's delay, never above: the estimate is
/// the *largest* recent sample (the least delayed). Taking the latest one
/// instead made deadlines earlier and earlier under load (replies read
/// late), and the script refused calls that were in time. Samples age out
/// after one to two [`ClockOffset::WINDOW_MS`], so a clock that steps back
/// is followed.
struct ClockOffset {
    origin: Instant,
    /// Window number (`WINDOW_MS` since `origin`) of `current`.
    window: AtomicU64,
    current: AtomicI64,
    previous: AtomicI64,
}

impl ClockOffset {
    const WINDOW_MS: u64 = 5_000;

    fn new() -> ClockOffset {
        ClockOffset {
            origin: Instant::now(),
            window: AtomicU64::new(0),
            current: AtomicI64::new(i64::MIN),
            previous: AtomicI64::new(i64::MIN),
        }
    }

    fn sample(&self, offset: i64) {
        let w = self.origin.elapsed().as_millis() as u64 / Self::WINDOW_MS;
        let seen = self.window.load(Ordering::Relaxed);
        if w != seen
            && self
                .window
                .compare_exchange(seen, w, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            // A window passed: what was current is the previous one now
            // (or nothing, after a silence longer than a window).
            let last = self.current.swap(offset, Ordering::Relaxed);
            self.previous.store(
                if w == seen + 1 { last } else { i64::MIN },
                Ordering::Relaxed,
            );
            return;
        }
        self.current.fetch_max(offset, Ordering::Relaxed);
    }

    /// The estimate, `i64::MIN` until the first sample.
    fn get(&self) -> i64 {
        self.current
            .load(Ordering::Relaxed)
            .max(self.previous.load(Ordering::Relaxed))
    }
}

/// Whether a call's outcome came from Redis (a reply, even an error reply)
/// rather than from the connection or a timer.
fn is_reply<T>(r: &Result<T, StoreError>) -> bool {
    match r {
        Ok(_) => true,
        Err(StoreError::Expired | StoreError::NotMaster | StoreError::Reply(_)) => true,
        Err(StoreError::Redis(e)) => {
            !(e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || e.is_timeout())
        }
        Err(_) => false,
    }
}

/// The `reason` label of `tierlimit_breaker_opens_total` for an error that
/// opens the breaker.
fn open_reason(e: &StoreError) -> &'static str {
    match e {
        StoreError::Timeout(_) => "stalled",
        StoreError::NotMaster => "readonly",
        _ => "connection",
    }
}

/// What a call is sent through, owned, so that a call the node gave up on
/// can still be awaited for its reply.
#[derive(Clone)]
enum Sender {
    Conn(ConnectionManager),
    Cluster(Arc<ClusterRouter>),
}

impl Sender {
    async fn send<T: FromRedisValue>(&self, slot: u16, cmd: &redis::Cmd) -> Result<T, StoreError> {
        match self {
            Sender::Conn(conn) => cmd
                .query_async::<T>(&mut conn.clone())
                .await
                .map_err(StoreError::from_redis),
            Sender::Cluster(router) => router.query(slot, cmd).await,
        }
    }

    /// `EVALSHA`, loading the script on NOSCRIPT (it did not run, so
    /// sending it again is safe).
    async fn evalsha(
        self,
        slot: u16,
        cmd: redis::Cmd,
        source: &'static str,
    ) -> Result<Value, StoreError> {
        match self.send::<Value>(slot, &cmd).await {
            Err(StoreError::Redis(e))
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(source);
                self.send::<String>(slot, &load).await?;
                self.send::<Value>(slot, &cmd).await
            }
            other => other,
        }
    }
}

/// An owned copy of a check the node gave up on: what its refund needs if
/// the late reply says it was charged. Made only on a timeout.
struct Compensation {
    tenant: String,
    node_id: String,
    cost: u64,
    tiers: Vec<(Scope, String, String, Limit, u64)>,
    expected_nodes: u32,
    global: Option<GlobalArgs>,
    periods: Vec<PeriodArgs>,
    /// The call's unique id (its epoch candidate), the refund handle's id.
    id: String,
    day: u32,
    now_ms: u64,
    counter_ttl_secs: u64,
    relaxed_ms: u64,
}

impl Compensation {
    fn of(call: &DecideCall<'_>) -> Compensation {
        Compensation {
            tenant: call.tenant.to_string(),
            node_id: call.node_id.to_string(),
            cost: call.cost,
            tiers: call
                .tiers
                .iter()
                .map(|t| {
                    (
                        t.scope,
                        t.rule.to_string(),
                        t.key.to_string(),
                        t.limit.clone(),
                        t.cost,
                    )
                })
                .collect(),
            expected_nodes: call.expected_nodes,
            global: call.global.clone(),
            periods: call.periods.clone(),
            id: call.epoch_candidate.to_string(),
            day: call.day,
            now_ms: call.now_ms,
            counter_ttl_secs: call.counter_ttl_secs,
            relaxed_ms: call.relaxed_ms,
        }
    }

    /// The refund of exactly this charge: a refund by handle with the
    /// call's id, into the windows and the day of `charged_at_ms`, of the
    /// cost and of the lease the check took with it (`granted` units, every
    /// tier and the day's count alike).
    fn refund(&self, charged_at_ms: u64, granted: u64) -> DecideCall<'_> {
        let handle = RefundOf {
            id: self.id.clone(),
            charged_at_ms,
            // The node's own undo, sent again until it gets through: its
            // windows decide what it gives back, never an expiry.
            expires_at_ms: 0,
        };
        self.call(Op::Refund, granted, Some(handle))
    }

    /// The call again, as `op`, with `extra` units on every tier and the
    /// day's count (the check's own call: `Check`, 0, `None`).
    fn call(&self, op: Op, extra: u64, refund: Option<RefundOf>) -> DecideCall<'_> {
        DecideCall {
            op,
            tenant: &self.tenant,
            node_id: &self.node_id,
            cost: self.cost + extra,
            tiers: self
                .tiers
                .iter()
                .map(|(scope, rule, key, limit, cost)| TierCall {
                    scope: *scope,
                    rule,
                    key,
                    limit,
                    cost: *cost + extra,
                })
                .collect(),
            expected_nodes: self.expected_nodes,
            global: self.global.clone(),
            periods: self.periods.clone(),
            epoch_candidate: &self.id,
            day: self.day,
            now_ms: self.now_ms,
            counter_ttl_secs: self.counter_ttl_secs,
            relaxed_ms: self.relaxed_ms,
            refund,
            lease: None,
        }
    }
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
    /// Since when calls have waited without any reply.
    progress: Progress,
    unavailable_after: Duration,
    /// This store, for the tasks that await late replies.
    this: Weak<RedisStore>,
    /// Redis' clock minus ours, in ms (see [`ClockOffset`]).
    clock: ClockOffset,
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
            unavailable_after,
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
        let store = Arc::new_cyclic(|this| RedisStore {
            route,
            decide_sha: redis::Script::new(DECIDE_LUA).get_hash().to_string(),
            ack_sha: redis::Script::new(ACK_LUA).get_hash().to_string(),
            decide_seconds: metrics.redis_seconds.with_label_values(&["decide"]),
            up: AtomicBool::new(up),
            progress: Progress::new(),
            unavailable_after,
            this: this.clone(),
            clock: ClockOffset::new(),
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
                self.resolved(&eviction).await;
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

    /// How calls reach the master now (`Down` while Sentinel named none).
    fn sender(&self) -> Result<Sender, StoreError> {
        match &self.route {
            Route::Master(link) => Ok(Sender::Conn(link.conn().ok_or(StoreError::Down)?)),
            Route::Cluster(router, _) => Ok(Sender::Cluster(Arc::clone(router))),
        }
    }

    /// Sends `cmd` (keys all in `slot`) to the master that serves the slot.
    async fn send<T: FromRedisValue>(&self, slot: u16, cmd: &redis::Cmd) -> Result<T, StoreError> {
        self.sender()?.send(slot, cmd).await
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

    /// `EVALSHA` of a script on the slot's master, as an owned future: a
    /// decision the node stops waiting for is still awaited for its reply.
    fn evalsha(
        &self,
        slot: u16,
        cmd: redis::Cmd,
        source: &'static str,
    ) -> BoxFuture<'static, Result<Value, StoreError>> {
        match self.sender() {
            Ok(sender) => Box::pin(sender.evalsha(slot, cmd, source)),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    /// The deadline (ms, in Redis' clock) for a decision sent now: past it
    /// the script refuses to charge, because the node will have given up and
    /// answered from its fail mode. It falls at half the store timeout, so a
    /// call Redis runs just before it still has the other half for its reply
    /// to arrive before the node gives up; a reply slower than that is
    /// compensated (see the module doc). 0 (no deadline) until the clock
    /// offset is known (it is learnt with `TIME` before the first decision
    /// whenever the master answers at start).
    ///
    /// The offset is learnt as Redis' time when it answered minus ours when
    /// the reply was read (the least delayed recent reply, see
    /// [`ClockOffset`]), so it errs towards an earlier deadline, never a
    /// later one.
    pub fn deadline_ms(&self, now_ms: u64) -> i64 {
        match self.clock.get() {
            i64::MIN => 0,
            offset => now_ms as i64 + offset + (self.timeout.as_millis() as i64 / 2).max(1),
        }
    }

    /// Redis' clock now, estimated from ours and the offset learnt from the
    /// last decision reply (ours until one arrived).
    pub fn redis_now_ms(&self, now_ms: u64) -> i64 {
        match self.clock.get() {
            i64::MIN => now_ms as i64,
            offset => now_ms as i64 + offset,
        }
    }

    fn learn_offset(&self, redis_now_ms: i64) {
        self.clock
            .sample(redis_now_ms - tierlimit_shared::messages::now_ms() as i64);
    }

    /// Asks the master its clock (`TIME`), so that decisions carry a
    /// deadline from the first one on.
    async fn learn_clock(&self) {
        let time = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(200)),
            self.send::<(i64, i64)>(0, &redis::cmd("TIME")),
        )
        .await;
        if let Ok(Ok((secs, micros))) = time {
            self.learn_offset(secs * 1000 + micros / 1000);
        }
    }

    /// One decision: `EVALSHA` of the script, loading it once on NOSCRIPT.
    /// A call not answered within the store timeout is given up (the caller
    /// takes its fail mode) but not dropped: see [`Self::abandon`].
    async fn run_decide(&self, call: &DecideCall<'_>) -> Result<DecideReply, StoreError> {
        if !self.is_up() {
            return Err(StoreError::Down);
        }
        let mut cmd = redis::Cmd::with_capacity(3 + 32, 512);
        cmd.arg("EVALSHA").arg(&self.decide_sha);
        script::encode(
            &mut cmd,
            call,
            self.deadline_ms(tierlimit_shared::messages::now_ms()),
        );
        // Sent: from here the script may charge whether or not this future
        // is polled to the end. A caller that drops it (a client that
        // disconnected) leaves the reply to `abandon`, like a timeout.
        let mut in_flight = InFlight {
            store: self,
            call,
            reply: Some(self.evalsha(call.slot(), cmd, DECIDE_LUA)),
        };
        let started = Instant::now();
        self.progress.sent();
        let waited =
            tokio::time::timeout(self.timeout, in_flight.reply.as_mut().expect("set above")).await;
        let reply = in_flight.reply.take().expect("set above");
        let result = match waited {
            Ok(result) => {
                if is_reply(&result) {
                    self.progress.replied();
                }
                result
            }
            Err(_) => {
                self.abandon(reply, call);
                Err(self.timed_out())
            }
        };
        let round_trip = started.elapsed();
        self.decide_seconds.observe(round_trip.as_secs_f64());
        let items = match result {
            Ok(Value::Array(items)) => items,
            Ok(other) => {
                let e = StoreError::Reply(ReplyError::Malformed(format!("not a list: {other:?}")));
                self.note_error("decide", &e);
                return Err(e);
            }
            Err(e) => {
                self.note_error("decide", &e);
                return Err(e);
            }
        };
        let parsed = DecideReply::parse(items, call);
        match &parsed {
            Ok(r) => self.learn_offset(r.now_ms),
            Err(ReplyError::Expired { now_ms }) | Err(ReplyError::OtherDay { now_ms, .. }) => {
                self.learn_offset(*now_ms)
            }
            Err(ReplyError::Malformed(_)) => {}
        }
        match parsed {
            Ok(r) => Ok(DecideReply { round_trip, ..r }),
            // Made for another day than Redis' clock says: nothing done,
            // the decision path sends it again for Redis' day.
            Err(ReplyError::OtherDay { now_ms, .. }) => Err(StoreError::OtherDay {
                day: (now_ms.max(0) as u64 / 86_400_000) as u32,
                now_ms: now_ms.max(0) as u64,
            }),
            // Past its deadline the script did nothing: for the caller a
            // timeout known not to have charged. Redis answered, so it is
            // no sign of an outage.
            Err(ReplyError::Expired { .. }) => {
                self.note_error("decide", &StoreError::Expired);
                Err(StoreError::Expired)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Why a call sent `store_timeout` ago has no reply: if Redis answered
    /// anything since it was sent (the silence began after it), it waited
    /// behind a backlog; if nothing came back all that time, Redis is slow
    /// or unreachable.
    fn timed_out(&self) -> StoreError {
        match self.progress.silence() {
            Some(quiet) if quiet >= self.timeout => StoreError::Timeout(self.timeout),
            _ => StoreError::Backlog(self.timeout),
        }
    }

    /// The node gave up on `call` (its caller takes the fail mode, or
    /// dropped the decision: a client that disconnected): its
    /// reply is still awaited in the background, and a check it says was
    /// charged is refunded.
    fn abandon(&self, reply: BoxFuture<'static, Result<Value, StoreError>>, call: &DecideCall<'_>) {
        let Some(this) = self.this.upgrade() else {
            return;
        };
        let undo = (call.op == Op::Check).then(|| Compensation::of(call));
        tokio::spawn(async move { this.late_reply(reply, undo).await });
    }

    /// Awaits the reply of an abandoned call and undoes its charge.
    async fn late_reply(
        self: Arc<Self>,
        reply: BoxFuture<'static, Result<Value, StoreError>>,
        undo: Option<Compensation>,
    ) {
        let result = tokio::time::timeout(LATE_REPLY_WAIT, reply)
            .await
            .unwrap_or(Err(StoreError::Timeout(LATE_REPLY_WAIT)));
        if is_reply(&result) {
            self.progress.replied();
        }
        let Some(undo) = undo else {
            return;
        };
        let late = |outcome: &str| {
            self.metrics
                .late_replies
                .with_label_values(&[outcome])
                .inc()
        };
        let charged_at = match result {
            Ok(Value::Array(items)) => {
                match DecideReply::parse(items, &undo.call(Op::Check, 0, None)) {
                    Ok(r) if r.allowed => (r.now_ms, r.granted),
                    Ok(_) => return late("not_charged"),
                    Err(ReplyError::Expired { .. }) | Err(ReplyError::OtherDay { .. }) => {
                        return late("refused")
                    }
                    Err(ReplyError::Malformed(why)) => {
                        tracing::error!(tenant = %undo.tenant, %why, "late decision reply unreadable; it may have charged");
                        return self.uncompensated("no_reply");
                    }
                }
            }
            // An error reply: the script refused or failed before writing.
            r @ (Ok(_) | Err(_)) if is_reply(&r) => return late("not_charged"),
            Ok(_) | Err(_) => {
                tracing::warn!(tenant = %undo.tenant, cost = undo.cost, "no reply to a decision the node gave up on: Redis may have charged it");
                return self.uncompensated("no_reply");
            }
        };
        self.compensate(undo, charged_at.0.max(0) as u64, charged_at.1)
            .await;
    }

    fn uncompensated(&self, reason: &str) {
        self.metrics
            .uncompensated
            .with_label_values(&[reason])
            .inc();
    }

    /// Refunds a check Redis charged after the node gave up on it, retried
    /// for [`COMPENSATE_FOR`]: a refund by handle gives back at most once,
    /// so sending it again after a timeout is safe.
    async fn compensate(&self, undo: Compensation, charged_at_ms: u64, granted: u64) {
        let call = undo.refund(charged_at_ms, granted);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.decide_sha);
        script::encode(&mut cmd, &call, 0);
        let started = Instant::now();
        loop {
            if self.is_up() {
                let sent = self.evalsha(call.slot(), cmd.clone(), DECIDE_LUA);
                let result =
                    tokio::time::timeout(self.timeout.max(Duration::from_millis(200)), sent).await;
                if let Ok(Ok(Value::Array(items))) = result {
                    if let Ok(r) = DecideReply::parse(items, &call) {
                        self.metrics
                            .late_replies
                            .with_label_values(&["compensated"])
                            .inc();
                        tracing::info!(
                            tenant = %undo.tenant,
                            cost = undo.cost,
                            refunded = r.refunded,
                            duplicate = r.duplicate,
                            "a check Redis charged after the node gave up on it was refunded"
                        );
                        return;
                    }
                }
            }
            if started.elapsed() >= COMPENSATE_FOR {
                tracing::error!(tenant = %undo.tenant, cost = undo.cost, "could not refund a check Redis charged after the node gave up on it");
                return self.uncompensated("refund_failed");
            }
            tokio::time::sleep(self.retry_interval).await;
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
        self.call_timed(op, None, self.evalsha(slot, cmd.clone(), source))
            .await
    }

    /// Where a `SCAN` of the whole region must run: every master of a
    /// cluster (`Some(addr)`: keys live on the master of their slot), or the
    /// one master (`None`).
    pub fn scan_targets(&self) -> Vec<Option<String>> {
        match &self.route {
            Route::Master(_) => vec![None],
            Route::Cluster(router, _) => router.masters().into_iter().map(Some).collect(),
        }
    }

    /// One page of `SCAN cursor MATCH pattern COUNT count TYPE hash` on a
    /// target of [`Self::scan_targets`]: the next cursor (0 = done) and the
    /// keys. Not for the hot path (an operator's tool walks the keyspace
    /// with it); a resharding cluster may hand a key twice or not at all.
    pub async fn scan_hashes(
        &self,
        target: Option<&str>,
        cursor: u64,
        pattern: &str,
        count: usize,
    ) -> Result<(u64, Vec<String>), StoreError> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(count)
            .arg("TYPE")
            .arg("hash");
        let fut = async {
            match (&self.route, target) {
                (Route::Cluster(router, _), Some(addr)) => router.query_on(addr, &cmd).await,
                _ => self.send(0, &cmd).await,
            }
        };
        self.call_timed("scan", None, fut).await
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
        published: &[(String, Period, u64)],
    ) -> Result<i64, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.ack_sha)
            .arg(1 + published.len())
            .arg(keys::dirty(bucket));
        for (tenant, _, _) in published {
            cmd.arg(keys::tenant_hash(tenant));
        }
        cmd.arg(relaxed.as_millis() as u64);
        for (tenant, period, pn) in published {
            cmd.arg(keys::dirty_member_of(tenant, *period))
                .arg(period.label())
                .arg(pn);
        }
        let slot = keys::bucket_slot(bucket);
        let fut = async {
            let v = self.evalsha(slot, cmd, ACK_LUA).await?;
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
        self.progress.sent();
        let result = match tokio::time::timeout(self.timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        if is_reply(&result) {
            self.progress.replied();
        }
        let elapsed = started.elapsed().as_secs_f64();
        match seconds {
            Some(h) => h.observe(elapsed),
            None => self
                .metrics
                .redis_seconds
                .with_label_values(&[op])
                .observe(elapsed),
        }
        if let Err(e) = &result {
            self.note_error(op, e);
        }
        result
    }

    /// Counts an error and decides what it does to the breaker: a
    /// connection error opens it; a timeout only when Redis has answered
    /// nothing for `store_unavailable_after` (see [`Progress`]).
    fn note_error(&self, op: &'static str, e: &StoreError) {
        self.metrics
            .redis_errors
            .with_label_values(&[op, e.kind()])
            .inc();
        let open = match e {
            StoreError::Timeout(_) => self
                .progress
                .silence()
                .is_some_and(|quiet| quiet >= self.unavailable_after),
            // The script answered, or Redis answered others: Redis serves,
            // only this call was late.
            StoreError::Expired | StoreError::Backlog(_) => false,
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

    /// A master was found and passed the checks: learn its clock, then
    /// serve from it.
    async fn resolved(&self, eviction: &super::safety::Eviction) {
        self.learn_clock().await;
        self.metrics
            .eviction_allowed
            .set(i64::from(eviction.can_evict()));
        self.reresolve.store(false, Ordering::Relaxed);
        // Whatever went unanswered before belongs to the outage.
        self.progress.replied();
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
            self.metrics
                .breaker_opens
                .with_label_values(&[open_reason(e)])
                .inc();
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
                Ok(eviction) => self.resolved(&eviction).await,
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

    fn redis_now_ms(&self, now_ms: u64) -> Option<i64> {
        match self.clock.get() {
            i64::MIN => None,
            offset => Some(now_ms as i64 + offset),
        }
    }
}

/// A decision call sent to Redis and not yet answered: dropped with its
/// reply still pending (the caller's future dropped mid-call), it hands the
/// reply to [`RedisStore::abandon`], so a check the script charged after
/// its caller left is given back, lease included.
struct InFlight<'s, 'c, 'a> {
    store: &'s RedisStore,
    call: &'c DecideCall<'a>,
    reply: Option<BoxFuture<'static, Result<Value, StoreError>>>,
}

impl Drop for InFlight<'_, '_, '_> {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            self.store.metrics.abandoned_calls.inc();
            self.store.abandon(reply, self.call);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> Options {
        Options {
            timeout: Duration::from_millis(100),
            retry_interval: Duration::from_secs(60),
            unavailable_after: Duration::from_millis(250),
            allow_eviction: false,
        }
    }

    /// The least delayed recent reply gives the offset; a clock that steps
    /// back is followed within two windows.
    #[test]
    fn the_clock_offset_is_the_least_delayed_recent_sample() {
        let c = ClockOffset::new();
        assert_eq!(c.get(), i64::MIN);
        c.sample(100);
        c.sample(80); // a reply read 20 ms late
        assert_eq!(c.get(), 100);
        c.sample(101);
        assert_eq!(c.get(), 101);
    }

    /// Silence is measured from the first call that went unanswered, not
    /// from each call: a stream of replies, however late each one is,
    /// keeps it at zero; calls piling up without any reply make it grow.
    #[test]
    fn silence_grows_only_while_nothing_comes_back() {
        let p = Progress::new();
        assert_eq!(p.silence(), None, "nothing sent, nothing waited for");
        p.sent();
        let first = p.waiting_since.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        p.sent();
        assert_eq!(
            p.waiting_since.load(Ordering::Relaxed),
            first,
            "a second call does not restart the silence"
        );
        assert!(p.silence().unwrap() >= Duration::from_millis(5));
        p.replied();
        assert_eq!(p.silence(), None, "any reply ends it");
        p.sent();
        assert!(p.silence().unwrap() < Duration::from_millis(5));
    }

    /// A reply, even an error reply or the script's refusal, proves Redis
    /// is serving; a timeout or a broken connection does not.
    #[test]
    fn what_counts_as_a_reply() {
        assert!(is_reply::<()>(&Ok(())));
        assert!(is_reply::<()>(&Err(StoreError::Expired)));
        assert!(is_reply::<()>(&Err(StoreError::NotMaster)));
        let busy = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading),
            "LOADING",
        ));
        assert!(is_reply::<()>(&Err(StoreError::Redis(busy))));
        assert!(!is_reply::<()>(&Err(StoreError::Timeout(
            Duration::from_millis(1)
        ))));
        assert!(!is_reply::<()>(&Err(StoreError::Down)));
        let io = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!is_reply::<()>(&Err(StoreError::Redis(io))));
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
