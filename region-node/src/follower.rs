//! The broadcast follower: reads every partition of the global topic into
//! the [`View`].
//!
//! It uses manual assignment (no consumer group), so each node rebuilds the
//! whole view on start and no rebalance can ever pause it. It starts at the
//! first record written since the start of the day before yesterday (Kafka's
//! ListOffsets by timestamp, see [`tierlimit_shared::retention`]; the
//! beginning if the broker cannot say): the view keeps today and yesterday
//! only, so older broadcasts would be read to be pruned, and a day of margin
//! covers the aggregators' clocks. A new node's catch-up then reads two
//! days of broadcasts, not every day the topic ever held. When a plan has a
//! global tier of a longer period (an ISO week, a calendar month), it starts
//! instead at the start of the previous period of that kind, since a tenant
//! over its month limit may have been broadcast weeks ago and nothing since
//! (`since_ms`). It is "caught up"
//! (ready) when its position on every partition has reached the high
//! watermark.
//!
//! The view's age also listens to the aggregators' signed heartbeats (wire
//! v2): every heartbeat interval (a quarter of `max_staleness`, at most
//! 1 s), the owner of each rebuilt partition writes "merged through offset
//! X" after a flush's updates. The view is confirmed fresh when the
//! follower has read to the watermark *and* every partition's latest
//! heartbeat is recent (within `wire::heartbeat_liveness`); otherwise it is
//! not confirmed, and ages from its last confirmation. So an aggregator that is down, hung or rebuilding (it
//! writes no heartbeat for a partition it has not rebuilt) ages every
//! node's view, where reading to the watermark alone would have called it
//! fresh. A follower that never read a heartbeat (aggregators of the JSON
//! release) keeps the watermark rule.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::Message;

use tierlimit_shared::config::Config;
use tierlimit_shared::messages::now_ms;
use tierlimit_shared::wire::{Broadcast, BroadcastVerifier, LogThrottle, Reject};
use tierlimit_shared::{day, retention};

use crate::metrics::Metrics;
use crate::view::View;

/// How often the follower checks whether it is caught up.
const FRESHNESS_CHECK: Duration = Duration::from_millis(200);
/// Longest wait for one partition's watermarks.
const WATERMARK_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the start offsets (then: from the beginning).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Days before today whose broadcasts a rebuild reads from their start:
/// yesterday (the view keeps it) and a day of margin for clocks.
const VIEW_DAYS_BACK: u32 = 2;

/// Where a rebuild of the view starts (Unix ms): the day before yesterday,
/// or the start of the previous period of each longer kind of global tier
/// the configuration has, whichever is earlier (`retention`).
pub fn since_ms(config: &Config, now_ms: u64) -> i64 {
    retention::rebuild_since_ms(now_ms, VIEW_DAYS_BACK, &retention::kinds_in_use(config))
        - retention::zone_margin_ms(config)
}

pub async fn run(config: Config, node: String, view: Arc<View>, metrics: Arc<Metrics>) {
    loop {
        if let Err(e) = follow(&config, &node, &view, &metrics).await {
            tracing::warn!(error = %e, "broadcast follower restarting");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn follow(
    config: &Config,
    node: &str,
    view: &Arc<View>,
    metrics: &Arc<Metrics>,
) -> Result<(), String> {
    let topic = config.kafka.global_topic.clone();
    // Only records an aggregator signed reach the view.
    let mut verifier = BroadcastVerifier::new(config)?;
    let mut log = LogThrottle::default();
    let cc = tierlimit_shared::kafka::follower_config(
        &config.kafka,
        format!("tierlimit-follower-{node}"),
    );
    let consumer: Arc<StreamConsumer> = Arc::new(cc.create().map_err(|e| e.to_string())?);
    let partitions = tierlimit_shared::kafka::partitions_of(&consumer, &topic).await?;
    let starts = {
        let (c, t, ps) = (Arc::clone(&consumer), topic.clone(), partitions.clone());
        let since = since_ms(config, now_ms());
        tokio::task::spawn_blocking(move || {
            retention::start_offsets(&*c, &t, &ps, since, LOOKUP_TIMEOUT)
        })
        .await
        .map_err(|e| e.to_string())?
    };
    consumer
        .assign(&retention::assignment(&topic, &starts))
        .map_err(|e| e.to_string())?;
    let at: Vec<i64> = starts.iter().map(retention::Start::at).collect();
    tracing::info!(%topic, partitions = partitions.len(), starts = ?at, "following broadcasts from the retained start");

    // The receive loop only applies broadcasts; freshness is checked by a
    // separate task, so a slow watermark query (a cut, a slow link) never
    // holds back consumption. A partition's position starts where its
    // rebuild starts: one with nothing retained past it is read to its
    // watermark already.
    let positions: Arc<Vec<AtomicI64>> = Arc::new(at.iter().map(|&s| AtomicI64::new(s)).collect());
    // The aggregator's time of the latest heartbeat read per partition (0:
    // none yet).
    let heartbeats: Arc<Vec<AtomicU64>> =
        Arc::new(partitions.iter().map(|_| AtomicU64::new(0)).collect());
    let checker = tokio::spawn(freshness_loop(
        Arc::clone(&consumer),
        topic.clone(),
        partitions.clone(),
        Arc::clone(&positions),
        Arc::clone(&heartbeats),
        tierlimit_shared::wire::heartbeat_liveness(config),
        Arc::clone(view),
        Arc::clone(metrics),
    ));
    let result = loop {
        let msg = match consumer.recv().await {
            Ok(m) => m,
            Err(e) => break Err(e.to_string()),
        };
        let index = partitions.iter().position(|p| *p == msg.partition());
        if let Some(i) = index {
            positions[i].store(msg.offset() + 1, Ordering::Relaxed);
        }
        let decoded = match msg.payload() {
            Some(bytes) => verifier.decode_any(bytes),
            None => Err(Reject::Corrupt(
                tierlimit_shared::messages::DecodeError::Field("empty payload".into()),
            )),
        };
        match decoded {
            Ok(Broadcast::Update(u)) => {
                view.apply(&u);
                metrics.broadcasts_received.inc();
            }
            Ok(Broadcast::Heartbeat(h)) => {
                if let Some(i) = index {
                    // Max: a replayed older heartbeat never makes the view
                    // look fresher than it is.
                    heartbeats[i].fetch_max(h.ts_ms, Ordering::Relaxed);
                }
                metrics.heartbeats_received.inc();
            }
            Err(reject) => {
                metrics
                    .broadcasts_rejected
                    .with_label_values(&[reject.reason()])
                    .inc();
                if matches!(reject, Reject::Corrupt(_)) {
                    metrics.broadcasts_undecodable.inc();
                }
                if let Some(suppressed) = log.allow(reject.reason()) {
                    tracing::warn!(
                        partition = msg.partition(),
                        offset = msg.offset(),
                        error = %reject,
                        reason = reject.reason(),
                        suppressed,
                        "skipping a refused broadcast record"
                    );
                }
            }
        }
    };
    checker.abort();
    result
}

/// Every [`FRESHNESS_CHECK`], asks the broker for every partition's high
/// watermark (concurrently, off the async threads). A partition is current
/// as of the moment a watermark was asked once the follower's position has
/// reached that watermark, at this check or a later one; the view is fresh
/// as of the oldest partition's such moment. Requiring every partition to
/// be read to the watermark *of the same instant* would call a view stale
/// whenever any partition had a record in flight (heartbeats land on every
/// partition every second), which under load happened for seconds on end.
#[allow(clippy::too_many_arguments)] // one task's whole context, passed once
async fn freshness_loop(
    consumer: Arc<StreamConsumer>,
    topic: String,
    partitions: Vec<i32>,
    positions: Arc<Vec<AtomicI64>>,
    heartbeats: Arc<Vec<AtomicU64>>,
    liveness: Duration,
    view: Arc<View>,
    metrics: Arc<Metrics>,
) {
    let mut tick = tokio::time::interval(FRESHNESS_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Per partition: the watermark still to reach and when it was asked,
    // and the latest moment the partition was confirmed current (0: never).
    let mut pending: Vec<Option<(i64, u64)>> = vec![None; partitions.len()];
    let mut current_as_of: Vec<u64> = vec![0; partitions.len()];
    loop {
        tick.tick().await;
        // Current as of when the check started: the watermarks can only be
        // that new. The query timeout is generous so that a slow (not cut)
        // link still confirms freshness; a cut fails it and the age grows.
        let started = now_ms();
        let checks = partitions.iter().map(|p| {
            let (c, t, p) = (Arc::clone(&consumer), topic.clone(), *p);
            tokio::task::spawn_blocking(move || c.fetch_watermarks(&t, p, WATERMARK_TIMEOUT).ok())
        });
        let mut answered = true;
        for (i, check) in checks.collect::<Vec<_>>().into_iter().enumerate() {
            let position = positions[i].load(Ordering::Relaxed);
            // A watermark asked earlier and reached since: current as of then.
            if let Some((high, at)) = pending[i] {
                if position >= high {
                    current_as_of[i] = current_as_of[i].max(at);
                    pending[i] = None;
                }
            }
            match check.await.ok().flatten() {
                Some((low, high)) if high <= low || position >= high => {
                    current_as_of[i] = started;
                    pending[i] = None;
                }
                // Not read that far yet: keep the oldest unreached target,
                // so a partition that always has a record in flight is still
                // confirmed, as of the older moment, once it gets there.
                Some((_, high)) => {
                    if pending[i].is_none() {
                        pending[i] = Some((high, started));
                    }
                }
                None => answered = false,
            }
        }
        let now = now_ms();
        let fresh_as_of = current_as_of.iter().copied().min().unwrap_or(0);
        let caught_up = fresh_as_of > 0;
        // Heartbeats only ever withhold a confirmation: with every
        // partition's aggregator heard from within the liveness bound (or
        // no heartbeat at all, from aggregators that write none), the
        // watermark rule confirms the view; otherwise it is not confirmed
        // and ages from its last confirmation.
        let alive = match heartbeat_floor(&heartbeats) {
            None => true,
            Some(None) => false,
            Some(Some(oldest)) => started.saturating_sub(oldest) <= liveness.as_millis() as u64,
        };
        if caught_up && alive && answered {
            view.mark_fresh(fresh_as_of);
        } else if caught_up {
            // Ready (read to the end) all the same: readiness is about the
            // view being complete, staleness about it being current.
            view.mark_caught_up();
        }
        if caught_up {
            metrics.view_caught_up.set(1);
        }
        if let Some(age) = view.age_ms(now) {
            metrics.view_age_seconds.set(age as f64 / 1000.0);
        }
        view.prune(day::today().saturating_sub(1));
        metrics.view_entries.set(view.len() as i64);
    }
}

/// How current the view is by the heartbeats: `None` if no partition ever
/// had one (aggregators that write none: judge by the watermark instead),
/// `Some(None)` if some partition has none yet (not current), otherwise
/// `Some(Some(t))` with `t` the oldest partition's latest heartbeat time.
fn heartbeat_floor(heartbeats: &[AtomicU64]) -> Option<Option<u64>> {
    let times: Vec<u64> = heartbeats
        .iter()
        .map(|h| h.load(Ordering::Relaxed))
        .collect();
    if times.iter().all(|t| *t == 0) {
        return None;
    }
    let oldest = times.iter().copied().min().unwrap_or(0);
    Some((oldest > 0).then_some(oldest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freshness_is_the_oldest_partitions_heartbeat() {
        let hb = |ts: &[u64]| -> Vec<AtomicU64> { ts.iter().map(|t| AtomicU64::new(*t)).collect() };
        assert_eq!(heartbeat_floor(&hb(&[0, 0, 0])), None);
        assert_eq!(heartbeat_floor(&hb(&[5, 0, 7])), Some(None));
        assert_eq!(heartbeat_floor(&hb(&[5, 9, 7])), Some(Some(5)));
    }
}
