//! Reads `tierlimit.deltas` as a member of the aggregator consumer group and
//! feeds every delta into the merged state.
//!
//! The topic is the source of truth and this process keeps no storage, so
//! **every assignment is rebuilt from the topic**: the rebalance callback
//! sets each newly assigned partition's offset to the first record of the
//! retained days, or of the previous period of a configured week or month
//! tier if that started earlier (ListOffsets by timestamp, see
//! [`tierlimit_shared::retention`]; the beginning if the broker cannot say)
//! before handing it to librdkafka. An explicit offset in `assign` takes
//! precedence over committed offsets and over `auto.offset.reset`, so this
//! holds even if someone committed offsets for the group; we never do
//! (`enable.auto.commit=false`, no manual commits). The lookup blocks the
//! consumer (the callback runs in its poll) for at most [`LOOKUP_TIMEOUT`]
//! per rebalance; nothing else waits on it.
//!
//! The group assigns with `cooperative-sticky` by default
//! (`aggregator.assignment`): a rebalance then hands the callback only the
//! partitions that move (incremental assign and revoke), so a rolling
//! deploy rebuilds only what a restarted instance gives up or takes, and
//! the instances that keep their partitions keep their state and go on
//! broadcasting. With `eager`, every rebalance revokes everything. Either
//! way a partition's state is rebuilt from the retained start when it is
//! assigned, and dropped when it is revoked.
//!
//! The instance is ready once every assigned partition has been read up to
//! the high watermark fetched right after assignment (or the fetcher reported
//! end-of-partition, which also covers a partition that is empty).
//!
//! Nothing here gives up: an unreachable broker, a missing topic or a failed
//! watermark fetch is logged (throttled) and retried; a message that is not a
//! delta is counted, logged once with its offset and skipped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{
    BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use tierlimit_shared::config::{AggregatorSettings, KafkaConfig};
use tierlimit_shared::messages::{now_ms, DecodeError};
use tierlimit_shared::retention;
use tierlimit_shared::wire::{DeltaRecord, Reject};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::kafka::{error_kind, LogContext, Throttle};
use crate::state::State;

/// How often watermarks are fetched for the lag metric (and missing
/// catch-up targets are retried).
pub const LAG_REFRESH: Duration = Duration::from_secs(5);
/// Upper bound on one watermark query.
const WATERMARK_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bound on the lookup of a new assignment's start offsets; past it
/// the partitions are read from the beginning.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// Partitions just assigned, with the generation their watermarks must quote.
type Assigned = (Vec<i32>, u64);

/// The consumer's context: rebuilds on assignment, drops state on revocation.
pub struct RebuildContext {
    state: Arc<State>,
    topic: String,
    log: LogContext,
    assigned: mpsc::UnboundedSender<Assigned>,
}

impl ClientContext for RebuildContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log.log(level, fac, log_message)
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.log.error(error, reason)
    }
}

impl RebuildContext {
    fn partitions(&self, tpl: &TopicPartitionList) -> Vec<i32> {
        tpl.elements_for_topic(&self.topic)
            .iter()
            .map(|e| e.partition())
            .collect()
    }
}

impl ConsumerContext for RebuildContext {
    /// Replaces librdkafka-rust's default rebalance handling, which would
    /// assign at the committed offsets.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let partitions = self.partitions(tpl);
                // Where the retained days start (the cooperative protocol
                // also hands out empty increments: nothing to ask).
                let starts = if partitions.is_empty() {
                    Vec::new()
                } else {
                    // The retained days, or the previous period of every
                    // tier kind configured if that started earlier (a
                    // month counter's latest delta of an actor may be
                    // weeks old: `shared::retention`).
                    let config = self.state.live().load();
                    let kinds = retention::kinds_in_use(&config.config);
                    let since = retention::rebuild_since_ms(
                        now_ms(),
                        config.config.aggregator.retention_days,
                        &kinds,
                    ) - retention::zone_margin_ms(&config.config);
                    retention::start_offsets(
                        consumer,
                        &self.topic,
                        &partitions,
                        since,
                        LOOKUP_TIMEOUT,
                    )
                };
                // Forget what we had and start over, before any message of
                // the new assignment can arrive.
                let generation = self.state.on_assign_from(&partitions, &starts);
                for s in &starts {
                    if let Err(e) = tpl.set_partition_offset(&self.topic, s.partition, s.offset) {
                        tracing::error!(partition = s.partition, error = %e, "cannot set the start of the rebuild; reading from the beginning");
                        let _ =
                            tpl.set_partition_offset(&self.topic, s.partition, Offset::Beginning);
                    }
                }
                let result = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = result {
                    tracing::error!(error = %e, ?partitions, "assign failed");
                }
                let _ = self.assigned.send((partitions, generation));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                if cooperative {
                    let partitions = self.partitions(tpl);
                    self.state.on_revoke(Some(&partitions));
                    if let Err(e) = consumer.incremental_unassign(tpl) {
                        tracing::error!(error = %e, "incremental unassign failed");
                    }
                } else {
                    self.state.on_revoke(None);
                    if let Err(e) = consumer.unassign() {
                        tracing::error!(error = %e, "unassign failed");
                    }
                }
            }
            other => {
                // librdkafka asks the application to drop its assignment to
                // resynchronise; the next assignment rebuilds from scratch.
                tracing::error!(error = ?other, "rebalance error; dropping the assignment");
                self.state.on_revoke(None);
                let _ = consumer.unassign();
            }
        }
    }
}

/// A group member of the deltas topic.
pub struct DeltaConsumer {
    consumer: Arc<StreamConsumer<RebuildContext>>,
    state: Arc<State>,
    topic: String,
    assigned: mpsc::UnboundedReceiver<Assigned>,
    throttle: Throttle,
}

/// A watermark query's outcome, reported back to the consumer loop.
enum Watermarks {
    /// For the catch-up target of a fresh assignment.
    Target {
        partition: i32,
        generation: u64,
        low: i64,
        high: i64,
    },
    /// For the lag metric.
    Lag { partition: i32, high: i64 },
}

impl DeltaConsumer {
    /// Creates the consumer and subscribes. Fails only on an invalid client
    /// configuration: the brokers are not contacted yet.
    pub fn new(
        kafka: &KafkaConfig,
        settings: &AggregatorSettings,
        state: Arc<State>,
    ) -> Result<Self, KafkaError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let context = RebuildContext {
            state: state.clone(),
            topic: kafka.deltas_topic.clone(),
            log: LogContext::new(),
            assigned: tx,
        };
        let consumer: StreamConsumer<RebuildContext> =
            tierlimit_shared::kafka::client_config(kafka)
                .set("group.id", &settings.group_id)
                .set(
                    "partition.assignment.strategy",
                    settings.assignment.strategy(),
                )
                // A restarted instance cannot rejoin before the crashed one's
                // session ends: keep it short (librdkafka's default is 45s).
                .set(
                    "session.timeout.ms",
                    settings.session_timeout.as_millis().to_string(),
                )
                .set(
                    "heartbeat.interval.ms",
                    (settings.session_timeout.as_millis() / 3)
                        .max(100)
                        .to_string(),
                )
                // Offsets are never the source of truth: the state is rebuilt
                // from the topic on every assignment.
                .set("enable.auto.commit", "false")
                .set("enable.auto.offset.store", "false")
                .set("auto.offset.reset", "earliest")
                // Tells the rebuild that a partition has been read to its end.
                .set("enable.partition.eof", "true")
                // Deltas are latency-sensitive (global accuracy): do not let
                // the broker hold an empty fetch for librdkafka's 500 ms.
                .set("fetch.wait.max.ms", "50")
                .set_log_level(RDKafkaLogLevel::Info)
                .create_with_context(context)?;
        consumer.subscribe(&[&kafka.deltas_topic])?;
        Ok(DeltaConsumer {
            consumer: Arc::new(consumer),
            state,
            topic: kafka.deltas_topic.clone(),
            assigned: rx,
            throttle: Throttle::default(),
        })
    }

    /// Consumes until `shutdown`, then leaves the group. Returns an error
    /// only when librdkafka declares the consumer unusable (a fatal error);
    /// the caller then starts a new one, which rebuilds what it is assigned.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), KafkaError> {
        let (wm_tx, mut wm_rx) = mpsc::unbounded_channel::<Watermarks>();
        let refreshing = Arc::new(AtomicBool::new(false));
        let mut lag_tick = tokio::time::interval(LAG_REFRESH);
        lag_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(topic = %self.topic, "consuming deltas");
        let result = loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                Some((partitions, generation)) = self.assigned.recv() => {
                    self.fetch_targets(partitions, generation, wm_tx.clone());
                }
                Some(wm) = wm_rx.recv() => match wm {
                    Watermarks::Target { partition, generation, low, high } => {
                        self.state.on_watermarks(partition, generation, low, high);
                    }
                    Watermarks::Lag { partition, high } => {
                        self.state.lock().progress.set_high(partition, high);
                    }
                },
                msg = self.consumer.recv() => match msg {
                    Ok(msg) => self.handle(&msg),
                    Err(KafkaError::PartitionEOF(partition)) => self.state.on_end_of_partition(partition),
                    Err(e @ KafkaError::MessageConsumptionFatal(_)) => break Err(e),
                    // Each error is one event that librdkafka queued; it retries
                    // by itself. No pause here: the events behind it
                    // (messages, rebalances) must not wait.
                    Err(e) => {
                        if let Some(suppressed) = self.throttle.allow(&error_kind(&e)) {
                            tracing::warn!(error = %e, suppressed, topic = %self.topic, "consumer error; retrying");
                        }
                    }
                },
                _ = lag_tick.tick() => self.refresh_lag(&refreshing, wm_tx.clone()),
            }
        };
        self.close().await;
        result
    }

    fn handle(&self, msg: &BorrowedMessage<'_>) {
        let (partition, offset) = (msg.partition(), msg.offset());
        let decoded = match (msg.payload(), self.state.delta_verifier()) {
            (Some(bytes), Ok(verifier)) => verifier.decode_any(bytes),
            (None, _) => Err(Reject::Corrupt(DecodeError::Field(
                "empty payload (tombstone)".into(),
            ))),
            (_, Err(e)) => Err(Reject::Corrupt(DecodeError::Field(format!(
                "no delta keys: {e}"
            )))),
        };
        match decoded {
            Ok(DeltaRecord::Delta(delta)) => self.state.on_delta(partition, offset, &delta),
            Ok(DeltaRecord::Status(status)) => {
                self.state.on_node_status(partition, offset, &status)
            }
            Err(reject) => {
                self.state.on_rejected(partition, offset, &reject);
                // Logged once per reason and interval; the metric counts all.
                if let Some(suppressed) = self
                    .throttle
                    .allow(&format!("rejected {}", reject.reason()))
                {
                    tracing::warn!(topic = msg.topic(), partition, offset, error = %reject, reason = reject.reason(), suppressed, "skipping a refused delta record");
                }
            }
        }
    }

    /// Fetches the high watermark each new partition must be read up to.
    /// Blocking network calls: off the async threads.
    fn fetch_targets(
        &self,
        partitions: Vec<i32>,
        generation: u64,
        tx: mpsc::UnboundedSender<Watermarks>,
    ) {
        if partitions.is_empty() {
            return;
        }
        let consumer = self.consumer.clone();
        let topic = self.topic.clone();
        tokio::task::spawn_blocking(move || {
            for partition in partitions {
                match consumer.fetch_watermarks(&topic, partition, WATERMARK_TIMEOUT) {
                    Ok((low, high)) => {
                        let _ = tx.send(Watermarks::Target {
                            partition,
                            generation,
                            low,
                            high,
                        });
                    }
                    // Retried by the next lag refresh.
                    Err(e) => {
                        tracing::warn!(partition, error = %e, "cannot fetch watermarks; will retry")
                    }
                }
            }
        });
    }

    /// Refreshes the lag gauges, and retries catch-up targets that are still
    /// unknown. At most one refresh runs at a time.
    fn refresh_lag(&self, refreshing: &Arc<AtomicBool>, tx: mpsc::UnboundedSender<Watermarks>) {
        // Publish what we know now, then fetch fresher highs.
        let (assigned, missing) = {
            let core = self.state.lock();
            for p in core.progress.partitions() {
                if let Some(lag) = p.lag() {
                    self.state
                        .metrics
                        .consumer_lag
                        .with_label_values(&[&p.partition.to_string()])
                        .set(lag);
                }
            }
            (
                core.progress.assigned_partitions(),
                core.progress.missing_targets(),
            )
        };
        if assigned.is_empty() || refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let consumer = self.consumer.clone();
        let topic = self.topic.clone();
        let refreshing = refreshing.clone();
        tokio::task::spawn_blocking(move || {
            for partition in assigned {
                let target = missing.iter().find(|(p, _)| *p == partition);
                match consumer.fetch_watermarks(&topic, partition, WATERMARK_TIMEOUT) {
                    Ok((low, high)) => {
                        if let Some(&(_, generation)) = target {
                            let _ = tx.send(Watermarks::Target {
                                partition,
                                generation,
                                low,
                                high,
                            });
                        }
                        let _ = tx.send(Watermarks::Lag { partition, high });
                    }
                    Err(e) => {
                        tracing::debug!(partition, error = %e, "cannot fetch watermarks for the lag metric");
                        // The broker is away: no point trying the others now.
                        break;
                    }
                }
            }
            refreshing.store(false, Ordering::Release);
        });
    }

    /// Leaves the group. Closing may wait on the broker, so it runs off the
    /// async threads, bounded in time.
    async fn close(self) {
        let consumer = self.consumer;
        self.state.on_revoke(None);
        let closing = tokio::task::spawn_blocking(move || {
            consumer.unsubscribe();
            drop(consumer);
        });
        if tokio::time::timeout(Duration::from_secs(10), closing)
            .await
            .is_err()
        {
            tracing::warn!("consumer did not close within 10s; exiting anyway");
        }
    }
}
