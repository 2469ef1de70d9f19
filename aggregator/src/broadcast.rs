//! Publishes the merged counters to `tierlimit.global`, where every
//! region-node follows them: one `GlobalUpdate` per (tenant, period), keyed
//! `tenant|<period label>` (a day's label is the bare day number, so a day
//! counter's key is the one it always had), carrying the period, the limit
//! it was judged under and that limit's version (the one the deltas carried,
//! see [`crate::merge::Carried`]; version 0 when the aggregator's own
//! configuration decided).
//!
//! Only what decisions need: a region-node needs the other regions' spend
//! of a tenant only when the tenant has a global limit and is near it. A
//! counter is broadcast once its total reaches `aggregator.broadcast_fraction`
//! of its tenant's limit (and from then on at every change); a node with no
//! entry for a limited tenant takes the others' spend to be that fraction of
//! the limit (region-node's `decision.rs`). So the topic's traffic and every
//! node's view grow with the tenants near their limit, not with all tenants.
//! The one other case: an actor that published less than before (its Redis
//! was rolled back) makes its counter broadcast, so the region can raise it.
//!
//! Coalesced: a counter that changes a thousand times in one
//! `broadcast_interval` is published once, with its latest value, so the
//! traffic grows with the number of near-limit tenants, not with requests.
//! The exception is a tenant crossing the broadcast threshold or its limit:
//! regions should see it as soon as possible, so it is published at once.
//!
//! Heartbeats (one per partition, every heartbeat interval) tell the
//! followers "every counter of this partition you need was on the topic
//! before me". They are written right behind the updates taken with them,
//! and a partition that lost an update since its last heartbeat skips one.
//!
//! A counter is only published when its partition has been rebuilt (see
//! [`crate::progress`]): a partial total would move the regions' view
//! backwards. The producer keeps one request in flight, so retries inside
//! librdkafka never reorder messages of one partition (a duplicate is
//! harmless: the view merges per actor by max); an update that still fails
//! is marked dirty again and goes out, with the then-current value, at the
//! next interval. Nothing is lost, nothing older overwrites anything newer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tierlimit_shared::config::KafkaConfig;
use tierlimit_shared::messages::{now_ms, partition_of, GlobalUpdate, VERSION};
use tierlimit_shared::retention;
use tierlimit_shared::wire::{heartbeat_interval, Heartbeat};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::kafka::{LogContext, Throttle};
use crate::merge::{Carried, Snapshot, TenantPeriod};
use crate::state::{configured_limit, Core, State};

/// Longest wait for queued updates to be delivered at shutdown.
const FLUSH_ON_SHUTDOWN: Duration = Duration::from_secs(3);

/// The global update of one counter of `key`'s period, judged under
/// `judged` (the limit its deltas carried, else the configuration's: see
/// [`Carried::or_config`]).
pub fn update(key: &TenantPeriod, counter: &Snapshot, judged: Carried) -> GlobalUpdate {
    let total = counter.total;
    GlobalUpdate {
        v: VERSION,
        tenant: key.tenant.clone(),
        period: key.period,
        total,
        parts: counter.parts.clone(),
        limit: judged.limit,
        over_limit: judged.limit.is_some_and(|l| total >= l),
        ts_ms: now_ms(),
        limits_version: judged.limits_version,
    }
}

/// Which dirty counters a flush takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Everything dirty (the interval tick).
    All,
    /// Only counters that just crossed their limit.
    Urgent,
}

pub struct Broadcaster {
    /// What the delivery tasks need too.
    out: Arc<Out>,
    /// Wall-clock ms of the last heartbeats written.
    last_heartbeat_ms: AtomicU64,
    /// `Out::failures` as of the last heartbeats written: a partition whose
    /// count moved since gets no heartbeat at this one.
    failures_at_heartbeat: std::sync::Mutex<Vec<u64>>,
}

/// The producer side of the broadcaster, shared with the tasks that await
/// deliveries (they put failed updates back for the next interval).
struct Out {
    producer: FutureProducer<LogContext>,
    state: Arc<State>,
    topic: String,
    partitions: i32,
    throttle: Throttle,
    /// Per global partition, how many updates failed so far. A heartbeat
    /// promises the followers that every counter of its partition they need
    /// is on the topic before it, so a partition that lost an update since
    /// its last heartbeat skips one: by the next, the update was taken again
    /// (the failure puts it back under the state lock) and sits before it.
    failures: Vec<AtomicU64>,
}

impl Broadcaster {
    /// Creates the ordered producer (see `ordered_producer_config`). Fails only on an invalid client
    /// configuration: the brokers are not contacted yet.
    pub fn new(kafka: &KafkaConfig, state: Arc<State>) -> Result<Self, KafkaError> {
        let producer = tierlimit_shared::kafka::ordered_producer_config(kafka)
            .create_with_context(LogContext::new())?;
        Ok(Broadcaster {
            out: Arc::new(Out {
                producer,
                state,
                topic: kafka.global_topic.clone(),
                partitions: kafka.partitions,
                throttle: Throttle::default(),
                failures: (0..kafka.partitions.max(1))
                    .map(|_| AtomicU64::new(0))
                    .collect(),
            }),
            last_heartbeat_ms: AtomicU64::new(0),
            failures_at_heartbeat: std::sync::Mutex::new(vec![0; kafka.partitions.max(1) as usize]),
        })
    }

    /// Broadcasts until `shutdown`, then makes a last attempt to deliver
    /// what is dirty.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut every = self.interval();
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        tracing::info!(topic = %self.out.topic, interval = ?every, "broadcasting global counts");
        loop {
            // The tick before urgent flushes: it is ready once per interval,
            // so it cannot starve them, while a steady stream of urgent
            // notifications (a tenant at its limit under load) would
            // otherwise starve the full flush and with it the heartbeats,
            // and every node's view would age without any fault.
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.tick() => {
                    self.flush(Scope::All);
                    // A reload may have changed the interval.
                    let now = self.interval();
                    if now != every {
                        every = now;
                        ticker = tokio::time::interval(every);
                        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
                        tracing::info!(interval = ?every, "broadcast interval changed");
                    }
                }
                _ = self.out.state.urgent().notified() => self.flush(Scope::Urgent),
            }
        }
        self.flush(Scope::All);
        let producer = self.out.producer.clone();
        let flushed = tokio::task::spawn_blocking(move || producer.flush(FLUSH_ON_SHUTDOWN)).await;
        if !matches!(flushed, Ok(Ok(()))) {
            tracing::warn!("some global updates were not delivered before shutdown; the next instance rebroadcasts them");
        }
    }

    /// Whether this flush writes heartbeats: every [`heartbeat_interval`].
    fn heartbeat_due(&self) -> bool {
        let every = heartbeat_interval(&self.out.state.live().load().config);
        let now = now_ms();
        let last = self.last_heartbeat_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) + 5 < every.as_millis() as u64 {
            return false;
        }
        self.last_heartbeat_ms.store(now, Ordering::Relaxed);
        true
    }

    fn interval(&self) -> Duration {
        self.out
            .state
            .live()
            .load()
            .config
            .aggregator
            .broadcast_interval
    }

    /// Takes the dirty counters of rebuilt partitions that the regions need
    /// (`State::wanted`) and hands them to the producer, then the
    /// heartbeats if due. Deliveries are awaited in a task of their own, so
    /// a broker outage never stalls the next interval.
    fn flush(&self, scope: Scope) {
        let state = &self.out.state;
        let now = now_ms();
        // Computed from the two configurations, outside the lock.
        let changes = match scope {
            Scope::All => state.take_limit_changes(),
            Scope::Urgent => None,
        };
        let wanted = state.wanted();
        let (taken, heartbeats) = {
            let mut core = state.lock();
            if let Some(changes) = changes.filter(|c| !c.is_empty()) {
                let marked = changes.mark(&mut core.merged, now);
                tracing::info!(
                    counters = marked,
                    "limits changed: their counters are broadcast again"
                );
            }
            let Core {
                merged, progress, ..
            } = &mut *core;
            let (taken, withheld) =
                merged.take_dirty(scope == Scope::Urgent, |p| progress.is_caught_up(p), wanted);
            state.metrics.broadcasts_withheld.inc_by(withheld as u64);
            // Under the same lock as the take: every counter a heartbeat's
            // partition needs is in `taken` or was broadcast earlier, and
            // the heartbeat is produced right after `taken`.
            let heartbeats = if scope == Scope::All && self.heartbeat_due() {
                let mut seen = self
                    .failures_at_heartbeat
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                let heartbeats = state
                    .heartbeats(progress)
                    .into_iter()
                    .filter(|h| {
                        let p = h.partition as usize;
                        seen.get(p).copied() == Some(self.out.failures_of(p as i32))
                    })
                    .collect();
                for (p, f) in seen.iter_mut().enumerate() {
                    *f = self.out.failures_of(p as i32);
                }
                heartbeats
            } else {
                Vec::new()
            };
            (taken, heartbeats)
        };
        // The heartbeats go right behind the updates (the same produce
        // request where they share a partition); the producer keeps one
        // request in flight, so they land after them.
        let pending = self.out.produce_updates(taken);
        let heartbeats = self.out.produce_heartbeats(heartbeats);
        if pending.is_empty() && heartbeats.is_empty() {
            return;
        }
        let out = Arc::clone(&self.out);
        tokio::spawn(async move {
            out.settle(pending).await;
            for delivery in heartbeats {
                if let Ok(Ok(_)) = delivery.await {
                    out.state.metrics.heartbeats_produced.inc();
                }
            }
        });
    }
}

/// A produced update and its delivery.
type Pending = (TenantPeriod, DeliveryFuture);

impl Out {
    fn failures_of(&self, partition: i32) -> u64 {
        self.failures
            .get(partition as usize)
            .map_or(0, |f| f.load(Ordering::Acquire))
    }

    /// Hands `taken` to the producer, one signed batch per partition.
    fn produce_updates(&self, taken: Vec<(TenantPeriod, Snapshot)>) -> Vec<Pending> {
        if taken.is_empty() {
            return Vec::new();
        }
        let config = self.state.live().load();
        let signer = match self.state.broadcast_signer() {
            Ok(s) => s,
            Err(e) => {
                for (key, _) in &taken {
                    self.failed(key, &e);
                }
                return Vec::new();
            }
        };
        // One signed batch per partition: a batch's records stay together
        // on the topic, so a follower verifies each root once.
        let mut by_partition: BTreeMap<i32, Vec<(TenantPeriod, GlobalUpdate)>> = BTreeMap::new();
        for (key, counter) in taken {
            let judged = Carried::or_config(counter.carried, || {
                configured_limit(&config, &key.tenant, key.period.kind)
            });
            let update = update(&key, &counter, judged);
            by_partition
                .entry(partition_of(&key.tenant, self.partitions))
                .or_default()
                .push((key, update));
        }
        let mut pending = Vec::new();
        for (partition, items) in by_partition {
            let updates: Vec<GlobalUpdate> = items.iter().map(|(_, u)| u.clone()).collect();
            let records = signer.encode(&updates);
            for ((key, update), payload) in items.into_iter().zip(records) {
                let record_key = update.key();
                let record = FutureRecord::to(&self.topic)
                    .partition(partition)
                    .key(&record_key)
                    .payload(&payload)
                    .timestamp(retention::record_timestamp_ms());
                match self.producer.send_result(record) {
                    Ok(delivery) => pending.push((key, delivery)),
                    Err((e, _)) => self.failed(&key, &e.to_string()),
                }
            }
        }
        pending
    }

    /// Awaits the deliveries of one flush; a failed one's counter is dirty
    /// again, for the next interval.
    async fn settle(&self, pending: Vec<Pending>) {
        for (key, delivery) in pending {
            let error = match delivery.await {
                Ok(Ok(_)) => {
                    self.state.metrics.broadcasts_produced.inc();
                    continue;
                }
                Ok(Err((e, _))) => e.to_string(),
                Err(_) => "producer dropped the message".to_owned(),
            };
            self.failed(&key, &error);
        }
    }

    /// Produces the heartbeats of one flush, after its updates. Not
    /// retried: the next flush writes fresher ones.
    fn produce_heartbeats(&self, heartbeats: Vec<Heartbeat>) -> Vec<DeliveryFuture> {
        if heartbeats.is_empty() {
            return Vec::new();
        }
        let signer = match self.state.broadcast_signer() {
            Ok(s) => s,
            Err(_) => return Vec::new(),
        };
        let records = signer.encode_heartbeats(&heartbeats);
        let mut pending = Vec::with_capacity(records.len());
        for (h, payload) in heartbeats.iter().zip(&records) {
            let key = h.key();
            let record = FutureRecord::to(&self.topic)
                .partition(h.partition as i32)
                .key(&key)
                .payload(payload)
                .timestamp(retention::record_timestamp_ms());
            match self.producer.send_result(record) {
                Ok(delivery) => pending.push(delivery),
                Err((e, _)) => {
                    if let Some(suppressed) = self.throttle.allow("heartbeat") {
                        tracing::warn!(error = %e, suppressed, "heartbeat not produced");
                    }
                }
            }
        }
        pending
    }

    /// Counts a failed update and keeps its counter dirty for the next
    /// interval; its partition writes no heartbeat until it is delivered.
    fn failed(&self, key: &TenantPeriod, error: &str) {
        self.state.metrics.broadcasts_failed.inc();
        let partition = partition_of(&key.tenant, self.partitions);
        {
            // Under the lock a flush takes and snapshots under: either this
            // counter is dirty again before a take (and retried by it), or
            // the flush sees the count move and withholds its heartbeat.
            let mut core = self.state.lock();
            core.merged.mark_dirty(key);
            if let Some(f) = self.failures.get(partition as usize) {
                f.fetch_add(1, Ordering::AcqRel);
            }
        }
        if let Some(suppressed) = self.throttle.allow(error) {
            tracing::warn!(tenant = %key.tenant, period = %key.period, %error, suppressed, "global update not produced; retrying next interval");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::{Applied, Merged};
    use tierlimit_shared::messages::{actor, Delta};
    use tierlimit_shared::period::{Period, PeriodKind};

    #[test]
    fn heartbeats_come_well_within_max_staleness() {
        let config = |extra: &str| {
            let text = format!("{}\n{extra}", crate::state::tests::CONFIG)
                .replace("[kafka]", "[node]\nmax_staleness = \"1s\"\n[kafka]");
            tierlimit_shared::Config::from_toml(&text).unwrap().config
        };
        let mut c = config("");
        assert_eq!(heartbeat_interval(&c), Duration::from_millis(250));
        c.node.max_staleness = None;
        assert_eq!(heartbeat_interval(&c), Duration::from_secs(1));
        c.node.max_staleness = Some(Duration::from_secs(30));
        assert_eq!(heartbeat_interval(&c), Duration::from_secs(1));
        c.node.max_staleness = Some(Duration::from_millis(200));
        c.aggregator.broadcast_interval = Duration::from_millis(100);
        assert_eq!(heartbeat_interval(&c), Duration::from_millis(100));
    }

    /// Noon of day 10.
    const NOW: u64 = 10 * 86_400_000 + 43_200_000;

    fn limit(limit: Option<u64>) -> Carried {
        Carried {
            limit,
            limits_version: 0,
        }
    }

    #[test]
    fn update_carries_total_parts_and_flag() {
        let mut m = Merged::new(2);
        let d = |a: &str, p| Delta::new("acme", 10, actor(a, "x"), p, 1, 0);
        assert!(matches!(
            m.apply(0, &d("eu", 60), NOW),
            Applied::Changed { .. }
        ));
        m.apply(0, &d("us", 41), NOW);
        let key = TenantPeriod::day("acme", 10);
        let c = m.snapshot("acme", Period::day(10)).unwrap();
        let u = update(&key, &c, limit(Some(99)));
        assert_eq!(u.key(), "acme|10");
        assert_eq!(u.period, Period::day(10));
        assert_eq!(u.total, 99);
        assert!(u.over_limit);
        assert_eq!(u.parts.len(), 2);
        assert_eq!(u.v, VERSION);
        assert!(!update(&key, &c, limit(Some(100))).over_limit);
        assert!(!update(&key, &c, limit(None)).over_limit);
        assert_eq!(GlobalUpdate::decode(&u.encode()).unwrap(), u);
    }

    #[test]
    fn update_carries_the_period_and_the_carried_limit() {
        let mut m = Merged::new(2);
        let month = PeriodKind::Month.at(NOW);
        let mut d = Delta::of("acme", month, actor("eu", "x"), 700, 0, 5);
        d.limit = Some(600);
        d.limits_version = 4;
        m.apply(0, &d, NOW);
        let (taken, _) = m.take_dirty(false, |_| true, |_, _| true);
        let (key, snapshot) = &taken[0];
        assert_eq!(key.period, month);
        // The configuration (1000 here) is not consulted: the delta said.
        let judged = Carried::or_config(snapshot.carried, || Some(1_000));
        let u = update(key, snapshot, judged);
        assert_eq!(u.period, month);
        assert_eq!(u.key(), format!("acme|m{}", month.index));
        assert_eq!(
            (u.limit, u.limits_version, u.over_limit),
            (Some(600), 4, true)
        );
        // On the wire (v3, the default) it decodes with its period.
        let config = tierlimit_shared::Config::from_toml(crate::state::tests::CONFIG).unwrap();
        let signer = tierlimit_shared::wire::BroadcastSigner::new(&config.config).unwrap();
        let records = signer.encode(std::slice::from_ref(&u));
        let back = tierlimit_shared::wire::codec::decode_global(&records[0])
            .unwrap()
            .message;
        assert_eq!(
            (back.period, back.limit, back.limits_version),
            (month, Some(600), 4)
        );
    }
}
