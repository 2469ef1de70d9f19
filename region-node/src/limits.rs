//! A node's side of limits as data (`limits.source = "topic"`): the
//! follower's hooks (metrics, handing back leases of a changed tenant) and
//! the status records that tell the aggregators which version the node
//! has applied.
//!
//! The table itself and the loop that fills it are shared with the
//! aggregator (`tierlimit_shared::limits`); the decision path reads it
//! through `Loaded::policy`, one shard read-lock per decision.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::producer::{FutureProducer, FutureRecord};

use tierlimit_shared::config::Config;
use tierlimit_shared::limits::follow::{Event, Hooks};
use tierlimit_shared::limits::LimitsTable;
use tierlimit_shared::messages::now_ms;
use tierlimit_shared::retention;
use tierlimit_shared::wire::{DeltaSigner, NodeStatus};

use crate::http::AppState;
use crate::limits_copy::{Item, RegionCopy, Snapshot, BATCH};

/// Writes applied records to the region's copy, in order, a batch at a
/// time; a batch that fails is retried (the mark only moves after it).
pub async fn write_copy(copy: RegionCopy, mut rx: tokio::sync::mpsc::UnboundedReceiver<Item>) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        if rx.recv_many(&mut batch, BATCH).await == 0 {
            return;
        }
        while let Err(e) = copy.write(&batch).await {
            tracing::warn!(error = %e, records = batch.len(), "limits copy not written; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        batch.clear();
    }
}

/// Loads the region's copy into `table` (before the follower starts), and
/// returns where the follower starts: after the copy's mark.
pub fn apply_copy(table: &LimitsTable, snapshot: Snapshot) -> std::collections::HashMap<i32, i64> {
    let mut refused = 0;
    for r in &snapshot.records {
        if table.apply(r).is_err() {
            refused += 1;
        }
    }
    tracing::info!(
        records = snapshot.records.len(),
        refused,
        version = table.applied_version(),
        mark = snapshot.mark,
        "limits loaded from the region's copy"
    );
    [(0, snapshot.mark + 1)].into()
}

/// What the node does beside the table with each record.
pub struct NodeHooks {
    pub state: Arc<AppState>,
    pub table: Arc<LimitsTable>,
    /// Applied records on their way to the region's copy (in order).
    pub copy: tokio::sync::mpsc::UnboundedSender<Item>,
}

impl Hooks for NodeHooks {
    fn outcome(&self, outcome: &'static str) {
        let m = &self.state.metrics.limits;
        m.records.with_label_values(&[outcome]).inc();
        m.observe(&self.table);
    }

    fn applied(&self, event: &Event<'_>) {
        self.state.decider.limits_changed(
            &event.record.subject,
            event.before.clone(),
            event.after.clone(),
        );
        let _ = self.copy.send(Item {
            subject: event.record.subject.clone(),
            version: event.record.version,
            body: crate::limits_copy::encode_body(&event.record.body),
            offset: event.offset,
        });
    }

    fn caught_up(&self, table: &LimitsTable) {
        self.state.metrics.limits.observe(table);
        self.state.metrics.limits_from_copy.set(0);
    }

    fn following(&self, up: bool) {
        self.state.metrics.limits.following.set(i64::from(up));
    }
}

/// How often a node reports when it only has its watermark to report
/// (`limits.source = "file"`), at most.
pub const WATERMARK_ONLY_EVERY: Duration = Duration::from_secs(5);

/// Every `limits.status_interval`, writes this node's applied limits
/// version (`table`: with `limits.source = "topic"`) and the region's
/// watermark it established (`publisher.rs`) to every partition of the
/// deltas topic (signed with the region's delta key), so every aggregator
/// hears every node. Each record is written after the deltas its watermark
/// covers were acknowledged, so on each partition it follows them.
pub async fn publish_status(
    config: Config,
    region: String,
    node: String,
    table: Option<Arc<LimitsTable>>,
    watermark: Arc<std::sync::atomic::AtomicU64>,
    following: impl Fn() -> bool + Send + 'static,
) {
    let signer = match DeltaSigner::new(&config, &region) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "node status: no delta key; not reporting the applied limits version");
            return;
        }
    };
    let producer: FutureProducer =
        match tierlimit_shared::kafka::ordered_producer_config(&config.kafka)
            .set("message.timeout.ms", "10000")
            .create()
        {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "node status: cannot create a producer");
                return;
            }
        };
    // Without the limits topic only the watermark needs reporting, and
    // closing a billing period a few seconds later costs nothing: one
    // record per node and partition every 5 s at most, not every second.
    let every = match table {
        Some(_) => config.limits.status_interval,
        None => config.limits.status_interval.max(WATERMARK_ONLY_EVERY),
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let status = NodeStatus {
            region: region.clone(),
            node: node.clone(),
            limits_version: table.as_ref().map_or(0, |t| t.applied_version()),
            following: following(),
            ts_ms: now_ms(),
            published_before_ms: watermark.load(std::sync::atomic::Ordering::Relaxed),
        };
        let key = status.key();
        let payload = signer.encode_status(&status);
        let mut acks = Vec::new();
        for partition in 0..config.kafka.partitions {
            let record = FutureRecord::to(&config.kafka.deltas_topic)
                .partition(partition)
                .key(&key)
                .payload(&payload)
                .timestamp(retention::record_timestamp_ms());
            match producer.send_result(record) {
                Ok(f) => acks.push(f),
                Err((e, _)) => {
                    tracing::debug!(error = %e, "node status not queued");
                    break;
                }
            }
        }
        // Awaited, so a cut link never queues statuses without bound.
        for a in acks {
            let _ = tokio::time::timeout(Duration::from_secs(15), a).await;
        }
    }
}
