//! Disaster recovery: `region-node republish` re-publishes every retained
//! (tenant, day) counter of one region from its Redis to the deltas topic.
//!
//! The deltas topic is the aggregators' only storage. If it is lost or
//! truncated (a broker cluster rebuilt, topics deleted by mistake, a
//! retention set too short), the counts it held live on in every region's
//! Redis: each tenant hash keeps its PN counter per day (`g:<day>:e|p|n`,
//! see [`tierlimit_shared::keys`]) for the retention. Running this once per
//! region writes them back as ordinary deltas, signed with the region's key
//! exactly as the publisher signs them, and the aggregators' max-merge
//! rebuilds the exact global counts: a delta is cumulative, so one record
//! per (tenant, day) restores everything, and re-publishing a counter the
//! topic still holds changes nothing.
//!
//! It walks the region's keyspace with `SCAN … TYPE hash` on every master
//! (never `KEYS`: Redis keeps serving decisions meanwhile), reads each
//! tenant hash with one `HGETALL` pipelined per bucket, and produces with
//! the ordered producer, bounding the records in flight. The records carry
//! the node id given (`republish` by default), so compaction keeps them
//! beside the nodes' own records instead of replacing a newer one. Days
//! outside the aggregator's retention are skipped (an aggregator would drop
//! them). Safe to run while the region serves, and to run again.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use redis::Value;

use tierlimit_shared::config::Config;
use tierlimit_shared::messages::{actor, now_ms, partition_of, Delta};
use tierlimit_shared::period::{Period, PeriodKind};
use tierlimit_shared::wire::DeltaSigner;
use tierlimit_shared::{day, keys, retention, validate};

use crate::metrics::Metrics;
use crate::storage::redis::{Options, RedisStore};
use crate::storage::CounterStore;

/// Keys asked per `SCAN` page.
const SCAN_COUNT: usize = 1000;
/// Records produced before their acknowledgements are awaited.
const IN_FLIGHT: usize = 10_000;
/// Longest wait for Redis to be usable at start.
const REDIS_DEADLINE: Duration = Duration::from_secs(30);
/// Bound on one Redis call of the walk (a page of `SCAN`, a bucket's
/// pipeline): generous, this is not the decision path.
const REDIS_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on one record's delivery.
const MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// What `republish` is told.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: PathBuf,
    pub region: String,
    /// The node id the records carry (part of their Kafka key).
    pub node_id: String,
    /// Only print what would be published.
    pub dry_run: bool,
}

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Tenant hashes read.
    pub tenants: u64,
    /// (tenant, day) counters within the retention.
    pub counters: u64,
    /// Deltas the broker acknowledged.
    pub published: u64,
    /// Deltas the broker did not take.
    pub failed: u64,
    /// Counters skipped: a day outside the retention, or no epoch.
    pub skipped: u64,
}

/// One (tenant, day) counter read from a tenant hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counter {
    /// The counter's period (a day, or another period of a global tier).
    pub period: Period,
    pub epoch: String,
    pub p: u64,
    pub n: u64,
}

/// The tenant of a tenant hash key (`tl:{B}:t:T`), if `key` is exactly
/// one: key-scoped tier hashes (`tl:{B}:t:T:k:…`) and anything not written
/// by tierlimit are not.
pub fn tenant_of(key: &str) -> Option<&str> {
    let (_, tenant) = key.split_once("}:t:")?;
    validate::tenant(tenant).ok()?;
    (keys::tenant_hash(tenant) == key).then_some(tenant)
}

/// The PN counters of a tenant hash (`HGETALL` as field, value pairs):
/// every day with an epoch and a P; the rest of the hash (tier states) is
/// ignored.
pub fn counters(fields: &[(String, String)]) -> Vec<Counter> {
    /// A day's epoch, P and N as far as read.
    type Fields = (Option<String>, Option<u64>, Option<u64>);
    let mut days: BTreeMap<Period, Fields> = BTreeMap::new();
    for (field, value) in fields {
        let Some(rest) = field.strip_prefix("g:") else {
            continue;
        };
        let Some((d, f)) = rest.split_once(':') else {
            continue;
        };
        let Some(d) = Period::parse_label(d) else {
            continue;
        };
        let entry = days.entry(d).or_default();
        match f {
            "e" => entry.0 = Some(value.clone()),
            // The script writes integers with %.0f: plain digits.
            "p" => entry.1 = value.parse().ok(),
            "n" => entry.2 = value.parse().ok(),
            _ => {}
        }
    }
    days.into_iter()
        .filter_map(|(period, (e, p, n))| {
            let (epoch, p) = (e?, p?);
            Some(Counter {
                period,
                epoch,
                p,
                // As the publisher: N never exceeds P on the wire.
                n: n.unwrap_or(0).min(p),
            })
        })
        .collect()
}

/// Runs the republish of one region; fails if Redis cannot be walked to the
/// end or any record was not acknowledged (running it again is safe).
pub async fn run(settings: Settings) -> anyhow::Result<Report> {
    let loaded = Config::load(&settings.config)
        .with_context(|| format!("loading {}", settings.config.display()))?;
    let config = &loaded.config;
    validate::name("node id", &settings.node_id).context("--node-id")?;
    let Some(region) = config.regions.get(&settings.region).cloned() else {
        bail!("--region {:?} is not configured", settings.region);
    };
    let signer = DeltaSigner::new(config, &settings.region)
        .map_err(|e| anyhow::anyhow!("wire keys: {e}"))?;
    let metrics = Arc::new(Metrics::new());
    let store = RedisStore::new(
        &region.redis_url,
        Options {
            timeout: REDIS_TIMEOUT,
            retry_interval: config.node.store_retry_interval,
            unavailable_after: REDIS_TIMEOUT,
            // Reading counters is safe whatever the eviction policy.
            allow_eviction: true,
        },
        metrics,
    )
    .with_context(|| format!("regions.{}.redis_url", settings.region))?;
    store.check_at_start().await?;
    let started = Instant::now();
    while !store.is_up() {
        if started.elapsed() > REDIS_DEADLINE {
            bail!("the region's Redis is not usable after {REDIS_DEADLINE:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Days by Redis' clock, as the script counts them.
    let today = day::of_unix_secs(store.redis_now_ms(now_ms()).max(0) as u64 / 1000);
    let oldest = today.saturating_sub(config.aggregator.retention_days.saturating_sub(1));

    let mut cc = tierlimit_shared::kafka::ordered_producer_config(&config.kafka);
    cc.set(
        "message.timeout.ms",
        MESSAGE_TIMEOUT.as_millis().to_string(),
    );
    let producer: FutureProducer = cc.create().context("creating the Kafka producer")?;
    let mut out = Output {
        producer,
        topic: config.kafka.deltas_topic.clone(),
        partitions: config.kafka.partitions,
        signer,
        pending: Vec::with_capacity(IN_FLIGHT),
        report: Report::default(),
        dry_run: settings.dry_run,
    };
    let (region_name, node) = (settings.region.as_str(), settings.node_id.as_str());
    let pattern = "tl:{*}:t:*";
    for target in store.scan_targets() {
        let mut cursor = 0;
        loop {
            let (next, page) = store
                .scan_hashes(target.as_deref(), cursor, pattern, SCAN_COUNT)
                .await
                .context("SCAN of the region's Redis")?;
            let mut by_bucket: HashMap<u16, Vec<&str>> = HashMap::new();
            for key in &page {
                if let Some(tenant) = tenant_of(key) {
                    by_bucket
                        .entry(keys::bucket_of(tenant))
                        .or_default()
                        .push(tenant);
                }
            }
            for (bucket, tenants) in by_bucket {
                let mut pipe = redis::pipe();
                for t in &tenants {
                    pipe.cmd("HGETALL").arg(keys::tenant_hash(t));
                }
                let hashes: Vec<Value> = store
                    .pipeline("republish_read", keys::bucket_slot(bucket), pipe)
                    .await
                    .context("reading tenant hashes")?;
                for (tenant, hash) in tenants.iter().zip(hashes) {
                    let fields: Vec<(String, String)> =
                        redis::from_redis_value(hash).unwrap_or_default();
                    out.report.tenants += 1;
                    for c in counters(&fields) {
                        // Retained: a day from `oldest` to tomorrow; another
                        // period that has not ended before `oldest` began.
                        let retained = match c.period.kind {
                            PeriodKind::Day if c.period.zone.is_utc() => {
                                (oldest..=today.saturating_add(1)).contains(&c.period.index)
                            }
                            _ => {
                                c.period.end_ms() > i64::from(oldest) * 86_400_000
                                    && c.period.start_ms()
                                        <= i64::from(today.saturating_add(1)) * 86_400_000
                            }
                        };
                        if !retained {
                            out.report.skipped += 1;
                            continue;
                        }
                        out.report.counters += 1;
                        let mut delta = Delta::of(
                            tenant,
                            c.period,
                            actor(region_name, &c.epoch),
                            c.p,
                            c.n,
                            now_ms(),
                        )
                        .from_node(node);
                        delta.limit = loaded
                            .policy(tenant)
                            .and_then(|policy| policy.global_limit(c.period.kind));
                        out.send(delta).await;
                    }
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    out.drain().await;
    let _ = out.producer.flush(Duration::from_secs(10));
    let report = out.report;
    if report.failed > 0 {
        bail!(
            "{} of {} deltas were not acknowledged by Kafka; run republish again",
            report.failed,
            report.counters
        );
    }
    Ok(report)
}

/// The producing side of a run: bounded records in flight.
struct Output {
    producer: FutureProducer,
    topic: String,
    partitions: i32,
    signer: DeltaSigner,
    pending: Vec<rdkafka::producer::DeliveryFuture>,
    report: Report,
    dry_run: bool,
}

impl Output {
    async fn send(&mut self, delta: Delta) {
        if self.dry_run {
            println!(
                "{} {} actor {} p {} n {}",
                delta.tenant, delta.period, delta.actor, delta.p, delta.n
            );
            return;
        }
        let (key, payload) = (delta.key(), self.signer.encode(&delta));
        let record = FutureRecord::to(&self.topic)
            .partition(partition_of(&delta.tenant, self.partitions))
            .key(&key)
            .payload(&payload)
            .timestamp(retention::record_timestamp_ms());
        match self.producer.send_result(record) {
            Ok(delivery) => self.pending.push(delivery),
            Err((e, _)) => {
                tracing::warn!(tenant = %delta.tenant, period = %delta.period, error = %e, "delta not enqueued");
                self.report.failed += 1;
            }
        }
        if self.pending.len() >= IN_FLIGHT {
            self.drain().await;
        }
    }

    async fn drain(&mut self) {
        for delivery in self.pending.drain(..) {
            match delivery.await {
                Ok(Ok(_)) => self.report.published += 1,
                _ => self.report.failed += 1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tenant_hashes_are_read() {
        let key = keys::tenant_hash("acme");
        assert_eq!(tenant_of(&key), Some("acme"));
        // A key-scoped tier hash of the same tenant, a bucket's dirty set,
        // a tenant hash under the wrong bucket tag: not tenant hashes.
        assert_eq!(tenant_of(&keys::tier_key("acme", "r:_:1", "ip")), None);
        assert_eq!(tenant_of(&keys::dirty(3)), None);
        assert_eq!(tenant_of("tl:{elsewhere}:t:acme"), None);
        assert_eq!(tenant_of("other:key"), None);
    }

    #[test]
    fn counters_are_the_days_with_an_epoch_and_a_p() {
        let f = |k: &str, v: &str| (k.to_string(), v.to_string());
        let fields = vec![
            f("gd", "20000,20001"),
            f("g:20000:e", "abc"),
            f("g:20000:p", "10"),
            f("g:20000:n", "3"),
            f("g:20000:d", "1"),
            f("g:20001:e", "def"),
            f("g:20001:p", "5"),
            // A day whose epoch was never written: nothing to publish.
            f("g:19999:p", "7"),
            // Tier state.
            f("r:_:1:w", "123"),
            f("r:_:1:c", "4"),
        ];
        assert_eq!(
            counters(&fields),
            vec![
                Counter {
                    period: Period::day(20000),
                    epoch: "abc".into(),
                    p: 10,
                    n: 3
                },
                Counter {
                    period: Period::day(20001),
                    epoch: "def".into(),
                    p: 5,
                    n: 0
                },
            ]
        );
        // N above P (never written by the script) is capped as on the wire.
        let odd = vec![f("g:1:e", "x"), f("g:1:p", "2"), f("g:1:n", "9")];
        assert_eq!(counters(&odd)[0].n, 2);
    }
}
