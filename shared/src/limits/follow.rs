//! Following the limits topic: every record, in order, into a
//! [`LimitsTable`]. Region-nodes and aggregators run the same loop.
//!
//! Manual assignment (no consumer group): every process reads every
//! record. It starts at the beginning of each partition (the topic is
//! compacted: one record per tenant and plan), or where the caller says
//! (a node that loaded its region's copy starts after what the copy
//! holds). The table is ready once every partition was read to its end
//! once (partition EOF); a process keeps following after that, so a
//! change reaches it as fast as a fetch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::{Message, Offset, TopicPartitionList};

use crate::config::Config;
use crate::limits::record::LimitsRecord;
use crate::limits::table::{Applied, LimitsTable};
use crate::limits::LimitsVerifier;
use crate::wire::{LogThrottle, Reject};

/// One applied record, for what else a process does with it (the region's
/// copy, handing back leases, judging counters again).
pub struct Event<'a> {
    pub record: &'a LimitsRecord,
    pub applied: &'a Applied,
    /// The subject's policy before and after (a tenant's, or a plan's
    /// effective one); `None` where there was none.
    pub before: Option<Arc<crate::config::Policy>>,
    pub after: Option<Arc<crate::config::Policy>>,
    /// The subject's version before (0: none).
    pub previous_version: u64,
    /// The record as read (key and value), for a copy that must verify the
    /// same way.
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub partition: i32,
    pub offset: i64,
}

/// What a process counts and does beside the table.
pub trait Hooks: Send + Sync + 'static {
    /// A record's outcome: `applied`, `stale`, `pending`, `invalid`,
    /// `tombstone` or a refusal's reason (`bad_signature`, `unsigned`,
    /// `corrupt`, …).
    fn outcome(&self, outcome: &'static str);
    /// After a record changed the table.
    fn applied(&self, _event: &Event<'_>) {}
    /// Every partition read to its end (each time the loop starts).
    fn caught_up(&self, _table: &LimitsTable) {}
    /// Whether the follower is connected and reading.
    fn following(&self, _up: bool) {}
}

/// Follows the topic forever (reconnecting after errors). `starts`: the
/// offset to start each partition at (absent: the beginning).
pub async fn run(
    config: Config,
    client_id: String,
    table: Arc<LimitsTable>,
    starts: HashMap<i32, i64>,
    hooks: Arc<dyn Hooks>,
) {
    let mut starts = starts;
    loop {
        match follow(&config, &client_id, &table, &mut starts, hooks.as_ref()).await {
            Ok(()) => {}
            Err(e) => tracing::warn!(error = %e, "limits follower restarting"),
        }
        hooks.following(false);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn follow(
    config: &Config,
    client_id: &str,
    table: &Arc<LimitsTable>,
    starts: &mut HashMap<i32, i64>,
    hooks: &dyn Hooks,
) -> Result<(), String> {
    let topic = config.kafka.limits_topic.clone();
    let mut verifier = LimitsVerifier::new(config)?;
    let mut log = LogThrottle::default();
    let mut cc =
        crate::kafka::follower_config(&config.kafka, format!("tierlimit-limits-{client_id}"));
    // Partition EOF tells when the table is caught up (ready).
    cc.set("enable.partition.eof", "true");
    let consumer: Arc<StreamConsumer> = Arc::new(cc.create().map_err(|e| e.to_string())?);
    let partitions = crate::kafka::partitions_of(&consumer, &topic).await?;
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        let offset = match starts.get(p) {
            Some(o) => Offset::Offset(*o),
            None => Offset::Beginning,
        };
        tpl.add_partition_offset(&topic, *p, offset)
            .map_err(|e| e.to_string())?;
    }
    consumer.assign(&tpl).map_err(|e| e.to_string())?;
    hooks.following(true);
    tracing::info!(%topic, partitions = partitions.len(), "following limits");
    let mut at_end: HashMap<i32, bool> = partitions.iter().map(|p| (*p, false)).collect();
    let mut reported = false;
    loop {
        let msg = match consumer.recv().await {
            Ok(m) => m,
            Err(KafkaError::PartitionEOF(p)) => {
                at_end.insert(p, true);
                if at_end.values().all(|e| *e) && !reported {
                    reported = true;
                    table.mark_ready();
                    tracing::info!(
                        version = table.applied_version(),
                        tenants = table.len(),
                        "limits read to the end of the topic"
                    );
                    hooks.caught_up(table);
                }
                continue;
            }
            Err(e) => return Err(e.to_string()),
        };
        starts.insert(msg.partition(), msg.offset() + 1);
        // After the record is handled, whatever it was (a writer waits for
        // this: `write`).
        let _consumed = Consumed(table, msg.partition(), msg.offset() + 1);
        let Some(value) = msg.payload() else {
            // Kafka's null tombstone: compaction's business, never ours (a
            // deletion is a signed record).
            hooks.outcome("tombstone");
            continue;
        };
        let key = msg.key().unwrap_or_default();
        let record = match verifier.decode(Some(key), value) {
            Ok(r) => r,
            Err(reject) => {
                hooks.outcome(reject.reason());
                refused(&mut log, &reject, msg.offset());
                continue;
            }
        };
        let policy_of = |subject: &crate::limits::Subject| match subject {
            crate::limits::Subject::Tenant(id) => table.tenant(id),
            crate::limits::Subject::Plan(name) => table.plan(name),
        };
        let before = policy_of(&record.subject);
        let previous_version = table.version_of(&record.subject);
        match table.apply(&record) {
            Ok(applied) => {
                hooks.outcome(match &applied {
                    Applied::Changed(_) => "applied",
                    Applied::Pending(_) => "pending",
                    Applied::Stale => "stale",
                });
                if applied != Applied::Stale {
                    hooks.applied(&Event {
                        record: &record,
                        applied: &applied,
                        before,
                        after: policy_of(&record.subject),
                        previous_version,
                        key,
                        value,
                        partition: msg.partition(),
                        offset: msg.offset(),
                    });
                }
            }
            Err(e) => {
                hooks.outcome(e.reason());
                if let Some(suppressed) = log.allow(e.reason()) {
                    tracing::warn!(
                        subject = %record.subject.key(),
                        version = record.version,
                        error = %e,
                        suppressed,
                        "refusing a limits record; the previous version stays"
                    );
                }
            }
        }
    }
}

/// Reports a record handled when dropped (every path out of the loop
/// body).
struct Consumed<'a>(&'a LimitsTable, i32, i64);

impl Drop for Consumed<'_> {
    fn drop(&mut self) {
        self.0.consumed(self.1, self.2);
    }
}

fn refused(log: &mut LogThrottle, reject: &Reject, offset: i64) {
    if let Some(suppressed) = log.allow(reject.reason()) {
        tracing::warn!(
            offset,
            error = %reject,
            reason = reject.reason(),
            suppressed,
            "skipping a refused limits record"
        );
    }
}
