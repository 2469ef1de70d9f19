//! The delta publisher: drains the region's dirty set to the deltas topic.
//!
//! Every `flush_interval` it reads up to `publish_batch` dirty (tenant, day)
//! entries, reads each one's PN counter (epoch, cumulative P and N) and
//! produces one delta per entry. Only after Kafka acknowledged a delta is its
//! entry removed from the dirty set, and only if no charge raised it since
//! (`ack.lua`). So a crash, a Kafka outage or a slow broker at any point
//! leaves the entry dirty, and some node of the region publishes it later:
//! deltas are at-least-once and cumulative, which the aggregator's max-merge
//! makes exactly-once in effect.
//!
//! Every node of a region runs a publisher over the same dirty set. That is
//! harmless by construction (same actor, same cumulative values), so no
//! leader election is needed; the cost is duplicate messages.
//!
//! Not every dirty entry goes out at every flush. The other regions need a
//! tenant's exact count only once the tenant nears its global limit; until
//! then, publishing every `flush_interval` makes Kafka traffic grow with time
//! instead of with information. So an entry is published at this flush when
//! it is **urgent** ([`urgent`]: the tenant's estimated global spend reached
//! `urgent_fraction` of its limit) or **due** (the region last published it
//! `relaxed_flush_interval` ago or more, per the shared `tl:published` set);
//! the rest stay dirty and are counted as deferred. Deferring never loses a
//! count: the entry stays in Redis until a later flush publishes it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use tierlimit_shared::config::Config;
use tierlimit_shared::messages::{actor, now_ms, partition_of, Delta};
use tierlimit_shared::reload::Live;
use tierlimit_shared::{day, keys};

use crate::local::Local;
use crate::metrics::Metrics;
use crate::storage::redis::RedisStore;
use crate::storage::CounterStore;
use crate::storage::StoreError;
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
    /// Where the next read of the dirty set starts when it holds more than
    /// `batch` entries: deferred entries stay, so always reading from the
    /// front could leave the rest unread.
    cursor: usize,
    metrics: Arc<Metrics>,
    /// Local-mode counts as last acknowledged, so unchanged ones are skipped.
    local_published: HashMap<(String, u32), (u64, u64)>,
    /// (tenant, day, epoch) already reported as a new epoch, so each data
    /// loss is counted once per node; pruned with the day.
    reported_epochs: HashSet<(String, u32, String)>,
    /// Redis' clock at the previous flush, for pruning `tl:published` even
    /// when nothing is published.
    last_redis_now_ms: Option<i64>,
}

/// One dirty entry read back from Redis.
struct Pending {
    member: String,
    delta: Delta,
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
            cursor: 0,
            metrics,
            local_published: HashMap::new(),
            reported_epochs: HashSet::new(),
            last_redis_now_ms: None,
        })
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
        if self.store.is_up() {
            acked += self.flush_redis().await?;
        }
        acked += self.flush_local().await;
        if acked > 0 {
            self.metrics.last_publish_ms.set(now_ms() as i64);
        }
        Ok(acked)
    }

    async fn flush_redis(&mut self) -> Result<usize, PublishError> {
        // Read at every flush, so a SIGHUP reload applies to the next one.
        let cfg = self.live.load_full();
        let relaxed = cfg.config.node.relaxed_flush_interval();
        let batch = self.batch as i64;
        let mut pipe = redis::pipe();
        pipe.cmd("ZCARD").arg(keys::DIRTY);
        pipe.cmd("ZRANGE")
            .arg(keys::DIRTY)
            .arg(self.cursor as i64)
            .arg(self.cursor as i64 + batch - 1);
        pipe.cmd("TIME");
        // Stamps older than the relaxed interval are of no use; the ack
        // prunes them too, but only when something is published.
        if let Some(prev) = self.last_redis_now_ms {
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(keys::PUBLISHED)
                .arg("-inf")
                .arg(format!("({}", prev - relaxed.as_millis() as i64))
                .ignore();
        }
        let (total, members, (secs, micros)): (i64, Vec<String>, (i64, i64)) =
            self.store.pipeline("dirty_read", pipe).await?;
        self.metrics.dirty_entries.set(total);
        // Next flush reads the next window, back to the front at the end.
        self.cursor += self.batch;
        if self.cursor as i64 >= total {
            self.cursor = 0;
        }
        let redis_now_ms = secs * 1000 + micros / 1000;
        self.last_redis_now_ms = Some(redis_now_ms);
        if members.is_empty() {
            return Ok(0);
        }
        let mut pipe = redis::pipe();
        let mut parsed = Vec::with_capacity(members.len());
        let mut stale = Vec::new();
        for m in &members {
            match keys::parse_dirty_member(m) {
                Some((t, d)) => {
                    pipe.cmd("HMGET")
                        .arg(keys::pn_counter(t, d))
                        .arg("e")
                        .arg("p")
                        .arg("n");
                    parsed.push((m.clone(), t.to_string(), d));
                }
                // Not ours: drop it so it cannot block the queue forever.
                None => stale.push((m.clone(), u64::MAX)),
            }
        }
        let rows: Vec<(Option<String>, Option<u64>, Option<u64>)> =
            self.store.pipeline("dirty_counters", pipe).await?;
        let published_at: Vec<Option<f64>> = if parsed.is_empty() {
            Vec::new()
        } else {
            let mut cmd = redis::cmd("ZMSCORE");
            cmd.arg(keys::PUBLISHED);
            for (m, _, _) in &parsed {
                cmd.arg(m);
            }
            self.store.query("published_read", cmd).await?
        };
        let now = now_ms();
        let relaxed_ms = relaxed.as_millis() as f64;
        let fraction = cfg.config.node.urgent_fraction;
        let regions = cfg.config.regions.len().max(1) as u64;
        let mut pending = Vec::with_capacity(parsed.len());
        let mut deferred = 0;
        for (((member, tenant, d), (e, p, n)), last) in
            parsed.into_iter().zip(rows).zip(published_at)
        {
            let (Some(epoch), Some(p)) = (e, p) else {
                // The counter expired or Redis lost it: nothing to publish.
                stale.push((member, u64::MAX));
                continue;
            };
            let n = n.unwrap_or(0).min(p);
            let actor = actor(&self.region, &epoch);
            // One look at the broadcast view serves both the epoch check and
            // the urgency estimate: the global total, and this actor's part.
            let (epoch_new, total, mine) = self.view.with(&tenant, d, |e| {
                (
                    epoch_is_new(e, &self.region, &epoch),
                    e.map_or(0, |e| e.total()),
                    e.and_then(|e| e.parts.get(&actor))
                        .map_or(0, |(p, n)| p.saturating_sub(*n)),
                )
            });
            if epoch_new {
                self.report_new_epoch(&tenant, d, &epoch);
            }
            let due = last.is_none_or(|t| redis_now_ms as f64 - t >= relaxed_ms);
            let limit = || cfg.policy(&tenant).and_then(|policy| policy.global);
            if !due
                && !urgent(
                    limit(),
                    total,
                    (p - n).saturating_sub(mine),
                    regions,
                    fraction,
                )
            {
                deferred += 1;
                continue;
            }
            pending.push(Pending {
                member,
                delta: Delta::new(&tenant, d, actor, p, n, now).from_node(&self.node_id),
            });
        }
        if deferred > 0 {
            self.metrics.deltas_deferred.inc_by(deferred);
        }
        tracing::debug!(
            dirty = total,
            read = members.len(),
            deferred,
            publishing = pending.len(),
            "flush"
        );
        let mut acks = stale;
        let mut failures = 0;
        // Enqueue everything first so librdkafka batches, then await acks.
        let mut deliveries = Vec::with_capacity(pending.len());
        for p in pending {
            let key = p.delta.key();
            let payload = p.delta.encode();
            let record = FutureRecord::to(&self.topic)
                .partition(partition_of(&p.delta.tenant, self.partitions))
                .key(&key)
                .payload(&payload);
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
                    acks.push((p.member, p.delta.p + p.delta.n));
                }
                _ => failures += 1,
            }
        }
        self.metrics.deltas_produced.inc_by(ok as u64);
        if failures > 0 {
            self.metrics.deltas_failed.inc_by(failures);
        }
        if !acks.is_empty() {
            self.store
                .ack_dirty(keys::DIRTY, keys::PUBLISHED, relaxed, &acks)
                .await?;
        }
        if failures > 0 {
            return Err(PublishError::NotAcknowledged(failures));
        }
        Ok(ok)
    }

    /// Counts taken in `local` fail mode live in this process only until
    /// Kafka has them; publish every one that changed.
    async fn flush_local(&mut self) -> usize {
        let now = now_ms();
        let mut ok = 0;
        for (tenant, d, p, n) in self.local.counts() {
            let k = (tenant.clone(), d);
            if self.local_published.get(&k) == Some(&(p, n)) {
                continue;
            }
            let delta = Delta::new(&tenant, d, self.local.actor.clone(), p, n, now);
            let key = delta.key();
            let payload = delta.encode();
            let record = FutureRecord::to(&self.topic)
                .partition(partition_of(&tenant, self.partitions))
                .key(&key)
                .payload(&payload);
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
                Err(_) => self.metrics.deltas_failed.inc(),
            }
        }
        let oldest = day::today().saturating_sub(2);
        self.local_published.retain(|(_, d), _| *d >= oldest);
        self.reported_epochs.retain(|(_, d, _)| *d >= oldest);
        self.local.prune(oldest, now * 1000);
        ok
    }

    /// Reports an epoch this region's Redis started for (tenant, day) after
    /// losing its counter (see [`epoch_is_new`]), once per node. A new day
    /// or a new tenant has no part in the view yet, so a midnight is not
    /// mistaken for a data loss, and no per-tenant memory is needed to tell
    /// them apart.
    fn report_new_epoch(&mut self, tenant: &str, day: u32, epoch: &str) {
        if self
            .reported_epochs
            .insert((tenant.to_string(), day, epoch.to_string()))
        {
            self.metrics.epoch_changes.inc();
            tracing::warn!(
                tenant,
                day,
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

/// Whether a tenant's delta must go out at this flush rather than when it is
/// next due. `total` is the last broadcast global total, `unbroadcast` what
/// this region spent since its own part in that broadcast. Without a global
/// limit nobody enforces on the count, so it is never urgent.
///
/// The estimate assumes every region spent `unbroadcast` too since the
/// broadcast: this region cannot see the others' unpublished spend, and its
/// own is the best sample of the tenant's current rate. A burst therefore
/// turns a tenant urgent early, which keeps the global overshoot where it was
/// when every entry was published at every flush.
pub fn urgent(
    limit: Option<u64>,
    total: u64,
    unbroadcast: u64,
    regions: u64,
    fraction: f64,
) -> bool {
    let Some(limit) = limit else {
        return false;
    };
    let estimate = total as f64 + (regions as f64) * (unbroadcast as f64);
    estimate >= fraction * limit as f64
}

#[cfg(test)]
mod tests {
    use super::{epoch_is_new, urgent};
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
        assert!(!urgent(None, u64::MAX / 2, 1 << 40, 3, 0.0));
        assert!(urgent(Some(1 << 40), 0, 0, 3, 0.0));
    }
}
