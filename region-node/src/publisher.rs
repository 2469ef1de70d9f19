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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use tierlimit_shared::config::Config;
use tierlimit_shared::messages::{actor, now_ms, partition_of, Delta};
use tierlimit_shared::{day, keys};

use crate::local::Local;
use crate::metrics::Metrics;
use crate::store::Store;

pub struct Publisher {
    store: Arc<Store>,
    local: Arc<Local>,
    producer: FutureProducer,
    topic: String,
    partitions: i32,
    region: String,
    node_id: String,
    batch: usize,
    interval: Duration,
    metrics: Arc<Metrics>,
    /// Local-mode counts as last acknowledged, so unchanged ones are skipped.
    local_published: HashMap<(String, u32), (u64, u64)>,
    last_epochs: HashMap<String, String>,
}

/// One dirty entry read back from Redis.
struct Pending {
    member: String,
    delta: Delta,
}

impl Publisher {
    pub fn new(
        config: &Config,
        region: &str,
        node_id: &str,
        store: Arc<Store>,
        local: Arc<Local>,
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
            metrics,
            local_published: HashMap::new(),
            last_epochs: HashMap::new(),
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
    pub async fn flush(&mut self) -> Result<usize, String> {
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

    async fn flush_redis(&mut self) -> Result<usize, String> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZCARD").arg(keys::DIRTY);
        pipe.cmd("ZRANGE")
            .arg(keys::DIRTY)
            .arg(0)
            .arg(self.batch as i64 - 1);
        let (total, members): (i64, Vec<String>) = self
            .store
            .pipeline("dirty_read", pipe)
            .await
            .map_err(|e| e.to_string())?;
        self.metrics.dirty_entries.set(total);
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
        let rows: Vec<(Option<String>, Option<u64>, Option<u64>)> = self
            .store
            .pipeline("dirty_counters", pipe)
            .await
            .map_err(|e| e.to_string())?;
        let now = now_ms();
        let mut pending = Vec::with_capacity(parsed.len());
        for ((member, tenant, d), (e, p, n)) in parsed.into_iter().zip(rows) {
            match (e, p) {
                (Some(epoch), Some(p)) => {
                    self.note_epoch(&tenant, &epoch);
                    pending.push(Pending {
                        member,
                        delta: Delta::new(
                            &tenant,
                            d,
                            actor(&self.region, &epoch),
                            p,
                            n.unwrap_or(0).min(p),
                            now,
                        )
                        .from_node(&self.node_id),
                    })
                }
                // The counter expired or Redis lost it: nothing to publish.
                _ => stale.push((member, u64::MAX)),
            }
        }
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
                .ack_dirty(keys::DIRTY, &acks)
                .await
                .map_err(|e| e.to_string())?;
        }
        if failures > 0 {
            return Err(format!("{failures} deltas not acknowledged by Kafka"));
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
        self.local.prune(oldest, now * 1000);
        ok
    }

    fn note_epoch(&mut self, tenant: &str, epoch: &str) {
        match self.last_epochs.get(tenant) {
            Some(e) if e == epoch => {}
            Some(_) => {
                self.metrics.epoch_changes.inc();
                tracing::warn!(tenant, epoch, "new region epoch: Redis lost this tenant's counter; counting under a new actor");
                self.last_epochs
                    .insert(tenant.to_string(), epoch.to_string());
            }
            None => {
                if self.last_epochs.len() > 100_000 {
                    self.last_epochs.clear();
                }
                self.last_epochs
                    .insert(tenant.to_string(), epoch.to_string());
            }
        }
    }
}
