//! Writing limits records: checked against everything written before,
//! versions that only grow.
//!
//! Kafka has no compare-and-set, so a check ("the tenant is still at
//! version 7", "the plan exists", an import's "unchanged, skip") is only
//! exact if one writer writes at a time and has read every earlier record
//! when it checks. This module does the second part: every write
//!
//! 1. reads the topic to its end (its own follower's table, checked against
//!    the tail with a private consumer, so a record acknowledged to another
//!    writer an instant ago is seen);
//! 2. runs the caller's check on that table;
//! 3. numbers the records after the highest version applied (and after the
//!    present in microseconds), signs them and produces them in order to
//!    the topic's one partition, awaiting every acknowledgement;
//! 4. waits until its own follower applied them (read your writes).
//!
//! The first part, one writer at a time, is the caller's: the aggregators
//! serving the limits API elect one (the owner of deltas partition 0,
//! `aggregator/src/limits_api.rs`) and forward writes to it. Apache Kafka's
//! transactional fence would do it on the broker, but not every
//! Kafka-protocol broker implements transactions (Tansu 0.6 has no
//! `EndTxn`), and the limits must work on all of them.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};
use thiserror::Error;

use crate::config::Config;
use crate::limits::record::{Body, LimitsRecord, Subject};
use crate::limits::table::LimitsTable;
use crate::limits::LimitsSigner;
use crate::messages::now_ms;

/// Records per produce-and-acknowledge round.
const CHUNK: usize = 4096;
/// How long a write waits to read the topic to its end, and then its own
/// records back.
const READ_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a produced record may wait in the client before it is given
/// up: a writer that loses its place can land a record at most this long
/// after it stopped being the writer (the next writer waits it out).
pub const PRODUCE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a write did not happen.
#[derive(Debug, Error)]
pub enum WriteError<R> {
    /// The caller's check refused the change (nothing was written).
    #[error("{0}")]
    Refused(R),
    /// The broker could not be reached, or refused a record (some of a
    /// large write's records may be written: run it again, an import
    /// writes only what is missing).
    #[error("kafka: {0}")]
    Kafka(String),
    /// The topic could not be read to its end (nothing was written).
    #[error("the limits topic could not be read to its end within {READ_TIMEOUT:?}")]
    Behind,
}

/// What a write did.
#[derive(Debug, Clone)]
pub struct Written {
    pub records: Vec<LimitsRecord>,
    /// This process's table applied them before the write returned (read
    /// your writes); false only if its follower lags by more than
    /// `READ_TIMEOUT`.
    pub applied: bool,
}

/// The writer of one process. Hold it behind a mutex: one write at a time
/// per process (across processes, the caller elects one writer).
pub struct Writer {
    topic: String,
    signer: LimitsSigner,
    writer: String,
    /// Followed by this process (`follow::run`): what a change is checked
    /// against.
    table: Arc<LimitsTable>,
    producer: FutureProducer,
    tail: Arc<BaseConsumer>,
}

impl Writer {
    /// A writer signing as the configuration's limits key (`writer`: the
    /// name the records carry). `table` must be followed by a running
    /// `follow::run` of the same configuration.
    pub fn new(config: &Config, writer: &str, table: Arc<LimitsTable>) -> Result<Writer, String> {
        let signer = LimitsSigner::new(config)?;
        let mut cc = crate::kafka::client_config(&config.kafka);
        cc.set("group.id", "tierlimit-limits-writer-tail")
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true");
        let tail: BaseConsumer = cc
            .create()
            .map_err(|e| format!("cannot create a Kafka consumer: {e}"))?;
        let producer: FutureProducer = crate::kafka::ordered_producer_config(&config.kafka)
            .set(
                "message.timeout.ms",
                PRODUCE_TIMEOUT.as_millis().to_string(),
            )
            .create()
            .map_err(|e| format!("cannot create the Kafka producer: {e}"))?;
        Ok(Writer {
            topic: config.kafka.limits_topic.clone(),
            signer,
            writer: writer.to_owned(),
            table,
            producer,
            tail: Arc::new(tail),
        })
    }

    /// The table this writer checks changes against.
    pub fn table(&self) -> &Arc<LimitsTable> {
        &self.table
    }

    /// Writes the changes `plan` returns, planned against a table that has
    /// read every record written before this write (see the module doc).
    /// An empty plan writes nothing. `writer`: who the records name (an API
    /// caller), else the writer's own name.
    pub async fn write<R>(
        &mut self,
        writer: Option<&str>,
        plan: impl FnOnce(&LimitsTable) -> Result<Vec<(Subject, Body)>, R>,
    ) -> Result<Written, WriteError<R>> {
        let name = writer.unwrap_or(&self.writer).to_owned();
        self.catch_up().await?;
        let changes = plan(&self.table).map_err(WriteError::Refused)?;
        if changes.is_empty() {
            return Ok(Written {
                records: Vec::new(),
                applied: true,
            });
        }
        let records = self
            .produce(&name, changes)
            .await
            .map_err(WriteError::Kafka)?;
        let last = records.last().map_or(0, |r| r.version);
        let applied = self
            .table
            .wait_until(READ_TIMEOUT, |t| t.applied_version() >= last)
            .await;
        for r in &records {
            audit(r, &name);
        }
        Ok(Written { records, applied })
    }

    /// Waits until this process's table holds every record of the topic
    /// before its current end.
    async fn catch_up<R>(&self) -> Result<(), WriteError<R>> {
        let (tail, topic) = (Arc::clone(&self.tail), self.topic.clone());
        let from = self.table.position(0).unwrap_or(0);
        // The offset of the last record at or after `from` (control records
        // of transactions are not records: only the tail knows where the
        // last one is).
        let last = tokio::task::spawn_blocking(move || last_record_from(&tail, &topic, from))
            .await
            .map_err(|e| WriteError::Kafka(e.to_string()))?
            .map_err(WriteError::Kafka)?;
        let Some(last) = last else { return Ok(()) };
        if self
            .table
            .wait_until(READ_TIMEOUT, |t| t.position(0).is_some_and(|p| p > last))
            .await
        {
            Ok(())
        } else {
            Err(WriteError::Behind)
        }
    }

    /// Numbers, signs and produces `changes` in order, awaiting every
    /// acknowledgement.
    async fn produce(
        &self,
        writer: &str,
        changes: Vec<(Subject, Body)>,
    ) -> Result<Vec<LimitsRecord>, String> {
        let ts_ms = now_ms();
        // After everything applied, and after the present in microseconds
        // (so versions keep growing even across a topic emptied by hand).
        let mut next = self.table.applied_version().max(ts_ms.saturating_mul(1000)) + 1;
        let mut written = Vec::with_capacity(changes.len());
        for chunk in changes.chunks(CHUNK) {
            let records: Vec<LimitsRecord> = chunk
                .iter()
                .enumerate()
                .map(|(i, (subject, body))| LimitsRecord {
                    subject: subject.clone(),
                    version: next + i as u64,
                    writer: writer.to_owned(),
                    ts_ms,
                    body: body.clone(),
                })
                .collect();
            let encoded = self.signer.encode(&records);
            let mut acks = Vec::with_capacity(encoded.len());
            for (key, value) in &encoded {
                let record = FutureRecord::to(&self.topic)
                    .partition(0)
                    .key(key)
                    .payload(value);
                match self.producer.send_result(record) {
                    Ok(f) => acks.push(f),
                    Err((e, _)) => return Err(format!("producing a limits record: {e}")),
                }
            }
            for ack in acks {
                match ack.await {
                    Ok(Ok(_)) => {}
                    Ok(Err((e, _))) => return Err(format!("a limits record was not written: {e}")),
                    Err(_) => return Err("the producer went away".into()),
                }
            }
            next += records.len() as u64;
            written.extend(records);
        }
        Ok(written)
    }
}

/// One structured line per change: who, what, the version it replaced and
/// its own, when (target `tierlimit::audit`; the API serves a tenant's
/// recent ones).
fn audit(r: &LimitsRecord, writer: &str) {
    tracing::info!(
        target: "tierlimit::audit",
        who = writer,
        subject = %r.subject.key(),
        version = r.version,
        change = match r.body {
            Body::Deleted => "delete",
            _ => "put",
        },
        ts_ms = r.ts_ms,
        "limits change"
    );
}

/// The offset of the last record of partition 0 at or after `from`
/// (`None`: none), read with a fresh assignment to its end.
fn last_record_from(tail: &BaseConsumer, topic: &str, from: i64) -> Result<Option<i64>, String> {
    let (_, high) = tail
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .map_err(|e| format!("limits topic {topic}: {e}"))?;
    if high <= from {
        return Ok(None);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(from))
        .map_err(|e| e.to_string())?;
    tail.assign(&tpl).map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + READ_TIMEOUT;
    let mut last = None;
    loop {
        if std::time::Instant::now() > deadline {
            return Err(format!("could not read {topic} to its end"));
        }
        match tail.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => last = Some(m.offset()),
            Some(Err(KafkaError::PartitionEOF(_))) => return Ok(last),
            Some(Err(e)) => return Err(e.to_string()),
            None => {}
        }
    }
}

/// A writer with a follower of its own, for a process that does not follow
/// the topic otherwise (`aggregator limits import`, the bench, tests). The
/// follower stops when it is dropped.
pub struct Standalone {
    pub writer: Writer,
    follower: tokio::task::JoinHandle<()>,
}

struct Quiet;

impl crate::limits::follow::Hooks for Quiet {
    fn outcome(&self, _outcome: &'static str) {}
}

impl Standalone {
    /// Follows the topic (with the configuration's `[plans]` beside it, as
    /// every process does) until it is read to its end, then writes as
    /// `writer`.
    pub async fn connect(config: &Config, writer: &str) -> Result<Standalone, String> {
        crate::limits::LimitsVerifier::new(config)
            .map_err(|e| format!("wire.limits_public_keys: {e}"))?;
        let table = Arc::new(LimitsTable::new());
        let mut file = std::collections::BTreeMap::new();
        for (name, p) in &config.plans {
            let policy = crate::config::resolve_plan(name, p).map_err(|e| e.to_string())?;
            file.insert(name.clone(), Arc::new(policy));
        }
        table.set_file_plans(&file);
        let follower = tokio::spawn(crate::limits::follow::run(
            config.clone(),
            format!("writer-{}", std::process::id()),
            Arc::clone(&table),
            std::collections::HashMap::new(),
            Arc::new(Quiet),
        ));
        // Ready once the topic is read to its end: however long that takes
        // (a million records), as long as the reading moves.
        let mut seen = None;
        while !table.wait_ready(READ_TIMEOUT).await {
            let now = table.position(0);
            if now == seen {
                follower.abort();
                return Err(format!(
                    "could not read {} to its end: no progress in {READ_TIMEOUT:?} (kafka.brokers)",
                    config.kafka.limits_topic
                ));
            }
            seen = now;
        }
        let writer = Writer::new(config, writer, table).inspect_err(|_| follower.abort())?;
        Ok(Standalone { writer, follower })
    }

    pub fn table(&self) -> &Arc<LimitsTable> {
        self.writer.table()
    }

    /// Writes `changes` as they are (no check beyond the fence).
    pub async fn publish(&mut self, changes: Vec<(Subject, Body)>) -> Result<Written, String> {
        self.writer
            .write(None, |_| Ok::<_, std::convert::Infallible>(changes))
            .await
            .map_err(|e| e.to_string())
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        self.follower.abort();
    }
}
