//! Writing limits records: versions, signatures, one ordered partition.
//!
//! The writer finds the highest version on the topic (the last record of
//! each partition: records are appended in version order) and numbers its
//! changes after it and after the present in microseconds (so versions
//! keep growing even if the last record could not be read, or a writer's
//! clock is the only witness), signs them in batches (`auth`), and produces them in
//! order to partition 0 with the ordered producer, awaiting every
//! acknowledgement. One writer at a time: concurrent writers are the
//! second issue of the pair (an owner that serialises writes).

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};

use crate::config::Config;
use crate::limits::record::{Body, LimitsRecord, Subject};
use crate::limits::{LimitsSigner, LimitsVerifier};
use crate::messages::now_ms;

/// Records per produce-and-acknowledge round.
const CHUNK: usize = 4096;

pub struct Writer {
    producer: FutureProducer,
    topic: String,
    signer: LimitsSigner,
    writer: String,
    last: u64,
}

impl Writer {
    /// A writer signing as the configuration's limits key, numbering after
    /// the highest version on the topic.
    pub async fn connect(config: &Config, writer: &str) -> Result<Writer, String> {
        let signer = LimitsSigner::new(config)?;
        let last = {
            let config = config.clone();
            tokio::task::spawn_blocking(move || last_version(&config))
                .await
                .map_err(|e| e.to_string())??
        };
        let producer: FutureProducer = crate::kafka::ordered_producer_config(&config.kafka)
            .set("message.timeout.ms", "30000")
            .create()
            .map_err(|e| format!("cannot create the Kafka producer: {e}"))?;
        Ok(Writer {
            producer,
            topic: config.kafka.limits_topic.clone(),
            signer,
            writer: writer.to_owned(),
            last,
        })
    }

    /// The highest version written (by anyone, as of `connect`, then by
    /// this writer).
    pub fn last_version(&self) -> u64 {
        self.last
    }

    /// Writes `changes` in order, each at the next version; returns the
    /// records once the broker acknowledged all of them.
    pub async fn publish(
        &mut self,
        changes: Vec<(Subject, Body)>,
    ) -> Result<Vec<LimitsRecord>, String> {
        let ts_ms = now_ms();
        self.last = self.last.max(ts_ms.saturating_mul(1000));
        let mut written = Vec::with_capacity(changes.len());
        for chunk in changes.chunks(CHUNK) {
            let records: Vec<LimitsRecord> = chunk
                .iter()
                .enumerate()
                .map(|(i, (subject, body))| LimitsRecord {
                    subject: subject.clone(),
                    version: self.last + 1 + i as u64,
                    writer: self.writer.clone(),
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
            self.last += records.len() as u64;
            written.extend(records);
        }
        Ok(written)
    }
}

/// The version of the last record of every partition (0: empty topic).
fn last_version(config: &Config) -> Result<u64, String> {
    let topic = &config.kafka.limits_topic;
    let mut cc = crate::kafka::client_config(&config.kafka);
    cc.set("group.id", "tierlimit-limits-writer")
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = cc.create().map_err(|e| e.to_string())?;
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| format!("limits topic {topic}: {e}"))?;
    let partitions: Vec<i32> = md
        .topics()
        .first()
        .filter(|t| t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .filter(|ps: &Vec<i32>| !ps.is_empty())
        .ok_or_else(|| format!("topic {topic} not found (aggregator create-topics)"))?;
    let mut verifier = LimitsVerifier::new(config)?;
    let mut last = 0;
    for p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        if high <= low {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(high - 1))
            .map_err(|e| e.to_string())?;
        consumer.assign(&tpl).map_err(|e| e.to_string())?;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if std::time::Instant::now() > deadline {
                return Err(format!("could not read the last record of {topic}/{p}"));
            }
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    if let Some(value) = m.payload() {
                        if let Ok(r) = verifier.decode(m.key(), value) {
                            last = last.max(r.version);
                        }
                    }
                    if m.offset() >= high - 1 {
                        break;
                    }
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => {}
            }
        }
    }
    Ok(last)
}
