//! The delta publisher: drains the region's dirty sets to the deltas topic.
//!
//! Every `flush_interval` it reads each of the [`keys::BUCKETS`] dirty sets
//! (all at once; under Redis Cluster each bucket is one slot, so every
//! master is covered), reads each due entry's PN counter (epoch, cumulative
//! P and N) and produces one delta per entry. Only after Kafka acknowledged
//! a delta does its entry leave the dirty set, and only if no charge raised
//! it since (`ack.lua`). So a crash, a Kafka outage or a slow broker at any
//! point leaves the entry dirty, and some node of the region publishes it
//! later: deltas are at-least-once and cumulative, which the aggregator's
//! max-merge makes exactly-once in effect.
//!
//! Every node of a region runs a publisher over the same dirty sets. That is
//! harmless by construction (same actor, same cumulative values), so no
//! leader election is needed; the cost is duplicate messages.
//!
//! Not every dirty entry goes out at every flush. The other regions need a
//! tenant's exact count only once the tenant nears its global limit; until
//! then, publishing every `flush_interval` makes Kafka traffic grow with time
//! instead of with information. The dirty set is therefore a queue ordered by
//! when an entry is due: the decision script marks an entry **urgent** (score
//! 0, published at the next flush whatever the backlog) once the region's
//! count reaches the `urgent_at` the node computed from its view
//! ([`urgent_at`]), and otherwise due a `relaxed_flush_interval` after it
//! became dirty (or after its last publication, if charged since). A flush
//! reads only what is due, urgent first, so the heaviest tenants never wait
//! behind a backlog. Nothing is lost by waiting: the entry stays in Redis.
//!
//! **The watermark.** A flush that read every due entry of every bucket
//! (none left behind by the batch limit), had each delta acknowledged and
//! published every local fail-mode count establishes: every unit charged
//! before `min(cutoff, next_due − relaxed) − WATERMARK_MARGIN` is in an
//! acknowledged delta, where `cutoff` is Redis' time the flush read up to
//! and `next_due` the earliest due time of an entry it left (an entry is
//! due at most `relaxed` after its first unpublished charge, so nothing left
//! was charged before `next_due − relaxed`). Every node reads every dirty
//! set, so one node's watermark covers the whole region's Redis; its local
//! counts are its own, so the aggregator takes the least watermark of a
//! region's live nodes. Nodes report it in their status records
//! (`limits::publish_status`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use tierlimit_shared::config::Config;
use tierlimit_shared::messages::{actor, now_ms, partition_of, Delta};
use tierlimit_shared::period::{Period, PeriodKind};
use tierlimit_shared::reload::Live;
use tierlimit_shared::wire::DeltaSigner;
use tierlimit_shared::{day, keys, retention};

use crate::local::Local;
use crate::metrics::Metrics;
use crate::storage::redis::RedisStore;
use crate::storage::script::PeriodArgs;
use crate::storage::{CounterStore, DecideCall, GlobalArgs, Op, StoreError};
use crate::view::View;

/// Why a flush did not publish everything it meant to. Nothing is lost:
/// what was not acknowledged stays dirty in Redis for the next flush.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("reading the dirty set: {0}")]
    Store(#[from] StoreError),
    #[error("{0} deltas not acknowledged by Kafka")]
    NotAcknowledged(u64),
}

pub struct Publisher {
    store: Arc<RedisStore>,
    local: Arc<Local>,
    producer: FutureProducer,
    topic: String,
    partitions: i32,
    region: String,
    node_id: String,
    batch: usize,
    interval: Duration,
    /// The live configuration (global limits) and the broadcast view (the
    /// last global totals): what [`urgent`] estimates from.
    live: Live,
    view: Arc<View>,
    metrics: Arc<Metrics>,
    /// Local-mode counts as last acknowledged, so unchanged ones are skipped.
    local_published: HashMap<(String, Period), (u64, u64)>,
    /// Key scheme 1's dirty entries, left by nodes of the previous version.
    legacy: crate::legacy::LegacyDrain,
    /// The region's watermark this node established (see the module doc).
    watermark: Arc<AtomicU64>,
    /// What this flush may raise it to, once all of it succeeded.
    candidate: Option<i64>,
    /// (tenant, day, epoch) already reported as a new epoch, so each data
    /// loss is counted once per node; pruned with the day.
    reported_epochs: HashSet<(String, Period, String)>,
}

/// One delta to publish, and where its dirty entry lives.
struct Pending {
    bucket: u16,
    tenant: String,
    period: Period,
    delta: Delta,
}

/// What a flush read from one bucket.
struct BucketRead {
    bucket: u16,
    /// Entries in the dirty set.
    total: i64,
    /// The earliest due time of a non-urgent entry (Redis clock, ms).
    oldest: Option<i64>,
    /// The earliest due time of an entry not due at the cutoff (`None`:
    /// none), and whether every due entry was read (the batch limit left
    /// none behind): what the watermark needs.
    next_due: Option<i64>,
    drained: bool,
    entries: Vec<DirtyEntry>,
}

/// Taken off a flush's cutoff for the watermark: the node's estimate of
/// Redis' clock may run ahead of a script's `TIME` by the estimate's error,
/// and a Cluster's masters keep clocks of their own.
pub const WATERMARK_MARGIN_MS: i64 = 1_000;

struct DirtyEntry {
    tenant: String,
    period: Period,
    /// (epoch, P, N); `None` if the counter is gone.
    counter: Option<(String, u64, u64)>,
}

/// Reads bucket `bucket`'s due entries (urgent first, then oldest, at most
/// `limit`) and their counters: two round trips to the bucket's master.
async fn read_bucket(
    store: &RedisStore,
    bucket: u16,
    cutoff: i64,
    limit: usize,
) -> Result<BucketRead, StoreError> {
    let slot = keys::bucket_slot(bucket);
    let dirty = keys::dirty(bucket);
    let mut pipe = redis::pipe();
    pipe.cmd("ZCARD").arg(&dirty);
    pipe.cmd("ZRANGE")
        .arg(&dirty)
        .arg("-inf")
        .arg(cutoff)
        .arg("BYSCORE")
        .arg("LIMIT")
        .arg(0)
        .arg(limit);
    // The first entry due after 0 (not urgent), and after the cutoff.
    for above in [0, cutoff] {
        pipe.cmd("ZRANGE")
            .arg(&dirty)
            .arg(format!("({above}"))
            .arg("+inf")
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(1)
            .arg("WITHSCORES");
    }
    #[allow(clippy::type_complexity)]
    let (total, members, oldest, next_due): (
        i64,
        Vec<String>,
        Vec<(String, f64)>,
        Vec<(String, f64)>,
    ) = store.pipeline("dirty_read", slot, pipe).await?;
    let drained = members.len() < limit;
    let mut entries = Vec::with_capacity(members.len());
    let mut pipe = redis::pipe();
    for m in &members {
        match keys::parse_dirty_member(m) {
            Some((t, d)) => {
                let g = keys::period_prefix(d);
                pipe.cmd("HMGET")
                    .arg(keys::tenant_hash(t))
                    .arg(format!("{g}e"))
                    .arg(format!("{g}p"))
                    .arg(format!("{g}n"));
                entries.push(DirtyEntry {
                    tenant: t.to_string(),
                    period: d,
                    counter: None,
                });
            }
            // Not ours: drop it so it cannot block the queue forever.
            None => {
                let mut cmd = redis::cmd("ZREM");
                cmd.arg(&dirty).arg(m);
                let _ = store.query::<i64>("dirty_drop", slot, cmd).await;
            }
        }
    }
    if !entries.is_empty() {
        let rows: Vec<(Option<String>, Option<u64>, Option<u64>)> =
            store.pipeline("dirty_counters", slot, pipe).await?;
        for (e, (epoch, p, n)) in entries.iter_mut().zip(rows) {
            if let (Some(epoch), Some(p)) = (epoch, p) {
                e.counter = Some((epoch, p, n.unwrap_or(0)));
            }
        }
    }
    Ok(BucketRead {
        bucket,
        total,
        oldest: oldest.first().map(|(_, s)| *s as i64),
        next_due: next_due.first().map(|(_, s)| *s as i64),
        drained,
        entries,
    })
}

impl Publisher {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &Config,
        region: &str,
        node_id: &str,
        store: Arc<RedisStore>,
        local: Arc<Local>,
        live: Live,
        view: Arc<View>,
        metrics: Arc<Metrics>,
    ) -> Result<Publisher, rdkafka::error::KafkaError> {
        let mut cc = tierlimit_shared::kafka::ordered_producer_config(&config.kafka);
        cc.set("message.timeout.ms", "15000")
            .set("request.timeout.ms", "5000");
        Ok(Publisher {
            store,
            local,
            producer: cc.create()?,
            topic: config.kafka.deltas_topic.clone(),
            partitions: config.kafka.partitions,
            region: region.to_string(),
            node_id: node_id.to_string(),
            batch: config.node.publish_batch,
            interval: config.node.flush_interval,
            live,
            view,
            metrics,
            local_published: HashMap::new(),
            reported_epochs: HashSet::new(),
            legacy: crate::legacy::LegacyDrain::new(),
            watermark: Arc::new(AtomicU64::new(0)),
            candidate: None,
        })
    }

    /// The region's watermark this node established (Redis ms; 0: not
    /// yet), shared with the status task that reports it.
    pub fn watermark(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.watermark)
    }

    pub async fn run(mut self) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let started = Instant::now();
            match self.flush().await {
                Ok(n) if n > 0 => {
                    self.metrics
                        .publish_seconds
                        .observe(started.elapsed().as_secs_f64());
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "flush incomplete; entries stay dirty"),
            }
        }
    }

    /// One flush. Returns how many deltas Kafka acknowledged.
    pub async fn flush(&mut self) -> Result<usize, PublishError> {
        let mut acked = 0;
        self.candidate = None;
        let up = self.store.is_up();
        if up {
            acked += self.flush_redis().await?;
            acked += self.flush_legacy().await?;
        }
        let (local_acked, local_failed) = self.flush_local().await;
        acked += local_acked;
        // The watermark moves only on a flush that left nothing behind.
        if let (true, 0, Some(w)) = (up, local_failed, self.candidate.take()) {
            self.watermark.fetch_max(w.max(0) as u64, Ordering::Relaxed);
        }
        if acked > 0 {
            self.metrics.last_publish_ms.set(now_ms() as i64);
        }
        Ok(acked)
    }

    async fn flush_redis(&mut self) -> Result<usize, PublishError> {
        // Read at every flush, so a SIGHUP reload applies to the next one.
        let cfg = self.live.load_full();
        let signer = self.signer(&cfg.config);
        let relaxed = cfg.config.node.relaxed_flush_interval();
        let redis_now = self.store.redis_now_ms(now_ms());
        // Due: urgent (score 0), or due by now (see decide.lua).
        let cutoff = redis_now;
        let per_bucket = (self.batch * 4)
            .div_ceil(usize::from(keys::BUCKETS))
            .max(16);

        // 1. Every bucket's due entries and their counters, all buckets at
        //    once (each bucket is one slot: one master serves its reads).
        let mut reads = tokio::task::JoinSet::new();
        for bucket in 0..keys::BUCKETS {
            let store = Arc::clone(&self.store);
            reads.spawn(async move { read_bucket(&store, bucket, cutoff, per_bucket).await });
        }
        let mut total = 0;
        let mut oldest: Option<i64> = None;
        let mut drained = true;
        let mut next_due: Option<i64> = None;
        let mut entries = Vec::new();
        let mut stale: HashMap<u16, Vec<(String, Period, u64)>> = HashMap::new();
        let mut first_error = None;
        while let Some(joined) = reads.join_next().await {
            match joined {
                Ok(Ok(read)) => {
                    total += read.total;
                    drained &= read.drained;
                    if let Some(d) = read.next_due {
                        next_due = Some(next_due.map_or(d, |x: i64| x.min(d)));
                    }
                    if let Some(o) = read.oldest {
                        oldest = Some(oldest.map_or(o, |x: i64| x.min(o)));
                    }
                    for e in read.entries {
                        match e.counter {
                            Some(c) => entries.push((read.bucket, e.tenant, e.period, c)),
                            // The counter expired or Redis lost it: nothing
                            // to publish; the entry just leaves.
                            None => stale.entry(read.bucket).or_default().push((
                                e.tenant,
                                e.period,
                                u64::MAX,
                            )),
                        }
                    }
                }
                Ok(Err(e)) => {
                    drained = false;
                    first_error.get_or_insert(e);
                }
                Err(e) => {
                    drained = false;
                    tracing::warn!(error = %e, "bucket read task failed");
                }
            }
        }
        self.metrics.dirty_entries.set(total);
        self.metrics
            .dirty_oldest_seconds
            .set(oldest.map_or(0.0, |o| (redis_now - o).max(0) as f64 / 1000.0));
        if let Some(e) = first_error {
            // What was read is still published; the rest waits in Redis.
            tracing::debug!(error = %e, "a bucket's dirty set could not be read");
        }

        // 2. One delta per entry, after the rollback check against the view.
        let now = now_ms();
        let mut pending = Vec::with_capacity(entries.len());
        for (bucket, tenant, d, (epoch, p, n)) in entries {
            let actor = actor(&self.region, &epoch);
            let (epoch_new, known) = self.view.with_period(&tenant, d, |e| {
                (
                    epoch_is_new(e, &self.region, &epoch),
                    e.and_then(|e| e.parts.get(&actor)).copied(),
                )
            });
            if epoch_new {
                self.report_new_epoch(&tenant, d, &epoch);
            }
            let (mut p, mut n) = (p, n.min(p));
            if let Some((kp, kn)) = known.filter(|(kp, kn)| *kp > p || *kn > n) {
                // Redis rolled back below what the aggregator holds from
                // this actor (see decide.lua): raise it there, so the region
                // does not spend it twice and the global count grows again.
                match self.raise(&tenant, d, &epoch, kp, kn).await {
                    Ok(()) => {
                        self.metrics.counter_rollbacks.inc();
                        tracing::warn!(
                            tenant,
                            period = %d,
                            epoch,
                            redis_p = p,
                            broadcast_p = kp,
                            "Redis counter below its broadcast part (partial rollback); raised"
                        );
                        p = p.max(kp);
                        n = n.max(kn).min(p);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "rollback raise failed; retried next flush")
                    }
                }
            }
            // The limit this node enforces for the period's tier travels
            // with the count (wire v3): the aggregator judges the counter by
            // it instead of resolving the tenant in a table of its own.
            let mut delta = Delta::of(&tenant, d, actor, p, n, now).from_node(&self.node_id);
            delta.limit = cfg
                .policy(&tenant)
                .and_then(|policy| policy.global_limit(d.kind));
            // With limits on the topic, the version the limit was applied
            // at: an aggregator takes the limit of the highest version any
            // node reports, so a change wins over what lagging nodes send.
            delta.limits_version = cfg.limits().map_or(0, |t| t.applied_version());
            pending.push(Pending {
                bucket,
                tenant: tenant.clone(),
                period: d,
                delta,
            });
        }
        let deferred = (total as u64).saturating_sub(pending.len() as u64);
        if deferred > 0 {
            self.metrics.deltas_deferred.inc_by(deferred);
        }
        tracing::debug!(dirty = total, publishing = pending.len(), deferred, "flush");

        // 3. Produce everything, then await Kafka's acknowledgements.
        let mut acks = stale;
        let mut failures = 0;
        let mut deliveries = Vec::with_capacity(pending.len());
        for p in pending {
            let key = p.delta.key();
            let payload = signer.encode(&p.delta);
            let record = FutureRecord::to(&self.topic)
                .partition(partition_of(&p.delta.tenant, self.partitions))
                .key(&key)
                .payload(&payload)
                .timestamp(retention::record_timestamp_ms());
            match self.producer.send_result(record) {
                Ok(f) => deliveries.push((p, f)),
                Err((e, _)) => {
                    failures += 1;
                    tracing::debug!(error = %e, "delta not enqueued");
                }
            }
        }
        let mut ok = 0;
        for (p, f) in deliveries {
            match f.await {
                Ok(Ok(_)) => {
                    ok += 1;
                    let pn = p.delta.p.saturating_add(p.delta.n);
                    acks.entry(p.bucket)
                        .or_default()
                        .push((p.tenant, p.period, pn));
                }
                _ => failures += 1,
            }
        }
        self.metrics.deltas_produced.inc_by(ok as u64);
        if failures > 0 {
            self.metrics.deltas_failed.inc_by(failures);
        }

        // 4. Acknowledge per bucket: entries leave their dirty set unless
        //    charged since they were read.
        let mut ack_tasks = tokio::task::JoinSet::new();
        for (bucket, list) in acks {
            let store = Arc::clone(&self.store);
            ack_tasks.spawn(async move { store.ack_dirty(bucket, relaxed, &list).await });
        }
        while let Some(r) = ack_tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::debug!(error = %e, "ack failed; entries stay dirty and are published again");
            }
        }
        if failures > 0 {
            return Err(PublishError::NotAcknowledged(failures));
        }
        if drained {
            let relaxed_ms = relaxed.as_millis() as i64;
            let left = next_due.map_or(cutoff, |d| d.saturating_sub(relaxed_ms));
            self.candidate = Some(cutoff.min(left) - WATERMARK_MARGIN_MS);
        }
        Ok(ok)
    }

    /// What deltas are written with under `config`: the format of
    /// `wire.version`, signed with the region's key (made at every flush,
    /// so a SIGHUP rotates the key). The configuration was validated, so
    /// this fails only on a region without keys under
    /// `wire.accept_unsigned = true`, which then writes unsigned records.
    fn signer(&self, config: &Config) -> DeltaSigner {
        DeltaSigner::new(config, &self.region).unwrap_or_else(|e| {
            tracing::error!(error = %e, "cannot sign deltas; writing them unsigned");
            DeltaSigner::with_key(tierlimit_shared::wire::Version::from_config(config), None)
        })
    }

    /// Publishes key scheme 1's dirty entries (see [`crate::legacy`]).
    async fn flush_legacy(&mut self) -> Result<usize, PublishError> {
        let entries = self.legacy.read(&self.store, self.batch).await?;
        if entries.is_empty() {
            return Ok(0);
        }
        let signer = self.signer(&self.live.load().config);
        let now = now_ms();
        let mut acks = Vec::new();
        let mut deliveries = Vec::new();
        for ((tenant, day, epoch, p, n), score) in entries {
            if epoch.is_empty() {
                acks.push((tenant, day, score));
                continue;
            }
            let delta = Delta::new(&tenant, day, actor(&self.region, &epoch), p, n, now)
                .from_node(&self.node_id);
            let (key, payload) = (delta.key(), signer.encode(&delta));
            let record = FutureRecord::to(&self.topic)
                .partition(partition_of(&tenant, self.partitions))
                .key(&key)
                .payload(&payload)
                .timestamp(retention::record_timestamp_ms());
            match self.producer.send_result(record) {
                Ok(f) => deliveries.push(((tenant, day, p.saturating_add(n)), f)),
                Err(_) => self.metrics.deltas_failed.inc(),
            }
        }
        let mut ok = 0;
        for (entry, f) in deliveries {
            match f.await {
                Ok(Ok(_)) => {
                    ok += 1;
                    acks.push(entry);
                }
                _ => self.metrics.deltas_failed.inc(),
            }
        }
        self.metrics.deltas_produced.inc_by(ok as u64);
        self.legacy.ack(&self.store, &acks).await?;
        Ok(ok)
    }

    /// Raises (tenant, period)'s counter of `epoch` to the broadcast P and
    /// N: a peek call carrying the part, which the script persists (for a
    /// period other than the day, only while it is open).
    async fn raise(
        &self,
        tenant: &str,
        period: Period,
        epoch: &str,
        p: u64,
        n: u64,
    ) -> Result<(), StoreError> {
        let cfg = self.live.load();
        let part = vec![(epoch.to_string(), p, n)];
        let (day, global, periods) = match period.kind {
            PeriodKind::Day if period.zone.is_utc() => (
                period.index,
                Some(GlobalArgs {
                    own_parts: part,
                    ..GlobalArgs::default()
                }),
                Vec::new(),
            ),
            _ => (
                day::of_unix_secs(self.store.redis_now_ms(now_ms()).max(0) as u64 / 1000),
                None,
                vec![PeriodArgs {
                    period,
                    limit: 0,
                    broadcast_total: 0,
                    own_cap: None,
                    own_parts: part,
                    urgent_at: None,
                }],
            ),
        };
        let call = DecideCall {
            op: Op::Peek,
            tenant,
            node_id: &self.node_id,
            cost: 0,
            tiers: Vec::new(),
            expected_nodes: 1,
            global,
            periods,
            epoch_candidate: epoch,
            day,
            now_ms: now_ms(),
            counter_ttl_secs: (u64::from(cfg.config.aggregator.retention_days) + 1)
                * tierlimit_shared::day::SECS_PER_DAY,
            relaxed_ms: cfg.config.node.relaxed_flush_interval().as_millis() as u64,
            refund: None,
            lease: None,
        };
        self.store.decide(&call).await.map(|_| ())
    }

    /// Counts taken in `local` fail mode live in this process only until
    /// Kafka has them; publish every one that changed.
    /// Publishes the local fail mode's counts; (acknowledged, failed).
    async fn flush_local(&mut self) -> (usize, u64) {
        let now = now_ms();
        let signer = self.signer(&self.live.load().config);
        let mut ok = 0;
        let mut failed = 0;
        for (tenant, d, p, n) in self.local.counts() {
            let k = (tenant.clone(), d);
            if self.local_published.get(&k) == Some(&(p, n)) {
                continue;
            }
            let delta = Delta::of(&tenant, d, self.local.actor.clone(), p, n, now);
            let key = delta.key();
            let payload = signer.encode(&delta);
            let record = FutureRecord::to(&self.topic)
                .partition(partition_of(&tenant, self.partitions))
                .key(&key)
                .payload(&payload)
                .timestamp(retention::record_timestamp_ms());
            match self
                .producer
                .send(record, Timeout::After(Duration::from_secs(15)))
                .await
            {
                Ok(_) => {
                    ok += 1;
                    self.local_published.insert(k, (p, n));
                    self.metrics.deltas_produced.inc();
                }
                Err(_) => {
                    failed += 1;
                    self.metrics.deltas_failed.inc()
                }
            }
        }
        let oldest = day::today().saturating_sub(2);
        self.local_published
            .retain(|(_, p), _| p.end_ms() > i64::from(oldest) * 86_400_000);
        let oldest_ms = i64::from(oldest) * 86_400_000;
        self.reported_epochs
            .retain(|(_, p, _)| p.end_ms() > oldest_ms);
        self.local.prune(oldest, now * 1000);
        (ok, failed)
    }

    /// Reports an epoch this region's Redis started for (tenant, day) after
    /// losing its counter (see [`epoch_is_new`]), once per node. A new day
    /// or a new tenant has no part in the view yet, so a midnight is not
    /// mistaken for a data loss, and no per-tenant memory is needed to tell
    /// them apart.
    fn report_new_epoch(&mut self, tenant: &str, period: Period, epoch: &str) {
        if self
            .reported_epochs
            .insert((tenant.to_string(), period, epoch.to_string()))
        {
            self.metrics.epoch_changes.inc();
            tracing::warn!(
                tenant,
                period = %period,
                epoch,
                "new region epoch: Redis lost this tenant's counter; counting under a new actor"
            );
        }
    }
}

/// Whether `epoch` is a new epoch of `region` for a (tenant, day) whose
/// broadcast entry is `e`: the entry holds parts of the region, none under
/// `epoch`.
fn epoch_is_new(e: Option<&crate::view::Entry>, region: &str, epoch: &str) -> bool {
    e.is_some_and(|e| {
        let mut parts = e.region_parts(region).peekable();
        parts.peek().is_some() && parts.all(|(known, _)| known != epoch)
    })
}

/// This region's P − N from which a tenant's (tenant, day) is urgent:
/// published at the next flush rather than when it is next due. `total` is
/// the last broadcast global total and `mine` this region's part of it.
/// Without a global limit nobody enforces on the count: never urgent.
///
/// The estimate assumes every region spent as much as this one since the
/// broadcast: this region cannot see the others' unpublished spend, and its
/// own is the best sample of the tenant's current rate. So the tenant is
/// urgent once `total + regions × (own − mine) ≥ fraction × limit`, which
/// turns a burst urgent early and keeps the global overshoot where it was
/// when every entry was published at every flush.
pub fn urgent_at(
    limit: Option<u64>,
    total: u64,
    mine: u64,
    regions: u64,
    fraction: f64,
) -> Option<u64> {
    let limit = limit?;
    let gap = fraction * limit as f64 - total as f64;
    if gap <= 0.0 {
        return Some(0);
    }
    // A float-to-int cast saturates; the sum must too.
    Some(mine.saturating_add((gap / regions.max(1) as f64).ceil() as u64))
}

#[cfg(test)]
mod tests {
    use super::{epoch_is_new, urgent_at};
    use crate::view::Entry;

    #[test]
    fn a_new_epoch_is_one_the_view_lacks_where_it_has_the_region() {
        let mut e = Entry::default();
        e.parts.insert("eu/aaa".into(), (10, 0));
        e.parts.insert("us/bbb".into(), (5, 0));
        // Redis lost eu's counter: a new epoch beside the broadcast one.
        assert!(epoch_is_new(Some(&e), "eu", "ccc"));
        assert!(!epoch_is_new(Some(&e), "eu", "aaa"));
        // A region not in the view yet (first publication) and a (tenant,
        // day) the view does not hold (a new day, a new tenant) are not a
        // data loss.
        assert!(!epoch_is_new(Some(&e), "ap", "ddd"));
        assert!(!epoch_is_new(None, "eu", "ccc"));
    }

    /// Urgent iff `own ≥ urgent_at`, as the script applies it.
    fn urgent(limit: Option<u64>, total: u64, unbroadcast: u64, regions: u64, f: f64) -> bool {
        urgent_at(limit, total, 0, regions, f).is_some_and(|u| unbroadcast >= u)
    }

    #[test]
    fn far_from_the_limit_is_not_urgent() {
        // 1 000 spent of a million, 3 regions: 0.3 % of the limit.
        assert!(!urgent(Some(1_000_000), 0, 1_000, 3, 0.5));
        assert!(!urgent(Some(1_000_000), 400_000, 10_000, 3, 0.5));
    }

    #[test]
    fn near_the_limit_is_urgent() {
        assert!(urgent(Some(1_000_000), 500_000, 0, 3, 0.5));
        assert!(urgent(Some(1_000_000), 490_000, 4_000, 3, 0.5));
    }

    #[test]
    fn a_burst_is_urgent_before_any_broadcast() {
        // Nothing broadcast yet, but this region alone spent a fifth of the
        // limit: three regions like it would be past half.
        assert!(urgent(Some(100), 0, 20, 3, 0.5));
        assert!(!urgent(Some(100), 0, 16, 3, 0.5));
    }

    #[test]
    fn no_global_limit_is_never_urgent_and_fraction_zero_always_is() {
        assert_eq!(urgent_at(None, u64::MAX / 2, 0, 3, 0.0), None);
        assert!(urgent(Some(1 << 40), 0, 0, 3, 0.0));
        // This region's own broadcast part counts towards the threshold.
        assert_eq!(urgent_at(Some(100), 40, 30, 2, 0.5), Some(35));
        // Absurd parts saturate rather than wrap.
        assert_eq!(
            urgent_at(Some(u64::MAX), 0, u64::MAX, 1, 1.0),
            Some(u64::MAX)
        );
        assert_eq!(urgent_at(Some(u64::MAX), 0, 0, 1, 1.0), Some(u64::MAX));
    }
}
