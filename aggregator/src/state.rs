//! The state every task of the aggregator shares, and the rules that tie the
//! merge, the catch-up progress and the broadcast together.
//!
//! The merged counters and the catch-up progress sit behind **one** mutex on
//! purpose: "may this counter be broadcast?" depends on both, and a
//! rebalance can revoke and re-assign a partition between any two steps of
//! the broadcaster. Under one lock, a counter is taken for broadcast only if
//! its partition is caught up *at that instant*, so a half-rebuilt counter can
//! never be published. Critical sections are short (no I/O under the lock).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tierlimit_shared::config::{ConfigError, KafkaConfig, Loaded};
use tierlimit_shared::messages::{now_ms, partition_of, Delta};
use tierlimit_shared::period::PeriodKind;
use tierlimit_shared::reload::Live;
use tierlimit_shared::retention;
use tierlimit_shared::wire::{BroadcastSigner, DeltaVerifier, Heartbeat, PerConfig, Reject};
use tokio::sync::Notify;

use crate::limits::LimitChanges;
use crate::merge::{Applied, Carried, Counter, Merged, TenantPeriod};

/// The global limit of `tenant`'s tier of `kind` under the aggregator's own
/// configuration: the day's `policy.global`, another kind's
/// `policy.global_periods` entry. Only the fallback for a counter no delta
/// carried a limit for (v2 writers, see [`crate::merge::Carried`]).
pub fn configured_limit(config: &Loaded, tenant: &str, kind: PeriodKind) -> Option<u64> {
    config.policy(tenant)?.global_limit(kind)
}

/// The limit `counter` of `key` is judged under: the one its deltas
/// carried, else the configuration's.
pub fn judged(config: &Loaded, key: &TenantPeriod, counter: &Counter) -> Carried {
    Carried::or_config(counter.carried(), || {
        configured_limit(config, &key.tenant, key.period.kind)
    })
}
use crate::metrics::Metrics;
use crate::progress::{Progress, Readiness};

/// What the lock protects.
#[derive(Debug)]
pub struct Core {
    pub merged: Merged,
    pub progress: Progress,
    /// The regions' watermarks per partition (`usage.rs`): which periods
    /// are closed.
    pub watermarks: crate::usage::Watermarks,
}

/// Shared by the consumer, the broadcaster, the HTTP handlers and the
/// housekeeping task.
pub struct State {
    live: Live,
    pub metrics: Metrics,
    /// Kafka settings the process started with; topics and partition count
    /// cannot change without a restart (the consumer is subscribed, the
    /// partition of a tenant depends on them).
    kafka: KafkaConfig,
    core: Mutex<Core>,
    /// Woken when a counter crosses its limit: it is broadcast at once
    /// instead of at the next interval.
    urgent: Notify,
    /// Set on a configuration reload: limits may have changed, so today's
    /// counters whose limit changed are broadcast again with the new limit
    /// and flag.
    limits_changed: AtomicBool,
    /// The configuration today's broadcasts were made under (what a reload
    /// is compared with; several reloads between two flushes compare the
    /// last one with this).
    broadcast_config: Mutex<Arc<Loaded>>,
    /// Bumped by every successful reload; carried by heartbeats.
    limits_version: AtomicU64,
    /// Delta keys and broadcast key of the current configuration (a SIGHUP
    /// rotates them).
    delta_verifier: PerConfig<DeltaVerifier>,
    broadcast_signer: PerConfig<BroadcastSigner>,
    /// The limits version each region-node reported (`nodes.rs`).
    pub nodes: crate::nodes::Nodes,
    /// The limits API's writer and the changes it serves as history
    /// (`limits_api.rs`).
    pub limits_writer: crate::limits_api::WriterSlot,
    pub limits_history: crate::limits_api::History,
    /// Since when this instance holds deltas partition 0, the limits
    /// writer's place (`limits_api.rs`).
    writer_since: Mutex<Option<std::time::Instant>>,
}

impl State {
    pub fn new(live: Live, metrics: Metrics) -> Arc<Self> {
        let config = live.load_full();
        let kafka = config.config.kafka.clone();
        let retention = config.config.aggregator.retention_days;
        // Every configured region's series exists from the start, so the
        // alert rule and the dashboard see a 0, not an absent metric.
        for region in config.config.regions.keys() {
            metrics.epoch_changes.with_label_values(&[region]);
        }
        Arc::new(State {
            live,
            metrics,
            kafka,
            core: Mutex::new(Core {
                merged: Merged::new(retention),
                progress: Progress::new(),
                watermarks: Default::default(),
            }),
            urgent: Notify::new(),
            limits_changed: AtomicBool::new(false),
            broadcast_config: Mutex::new(config),
            limits_version: AtomicU64::new(0),
            delta_verifier: PerConfig::new(DeltaVerifier::new),
            broadcast_signer: PerConfig::new(BroadcastSigner::new),
            nodes: crate::nodes::Nodes::default(),
            limits_writer: Default::default(),
            limits_history: Default::default(),
            writer_since: Mutex::new(None),
        })
    }

    /// What deltas are decoded and authenticated with.
    pub fn delta_verifier(&self) -> Result<Arc<DeltaVerifier>, String> {
        self.delta_verifier.get(&self.live)
    }

    /// What broadcasts are encoded and signed with.
    pub fn broadcast_signer(&self) -> Result<Arc<BroadcastSigner>, String> {
        self.broadcast_signer.get(&self.live)
    }

    /// Locks the merged state. A panic while holding the lock cannot leave
    /// the CRDT half-updated in a way that matters (every update is a max),
    /// so a poisoned lock is simply taken over.
    pub fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn live(&self) -> &Live {
        &self.live
    }

    /// The Kafka settings in force (those the process started with).
    pub fn kafka(&self) -> &KafkaConfig {
        &self.kafka
    }

    /// The tenant's global limit of `kind` under the current configuration
    /// (the fallback for counters no delta carried a limit for).
    pub fn limit_of(&self, tenant: &str, kind: PeriodKind) -> Option<u64> {
        configured_limit(&self.live.load(), tenant, kind)
    }

    /// The zone `tenant`'s global tiers count in (UTC if unknown).
    pub fn zone_of(&self, tenant: &str) -> tierlimit_shared::zone::Zone {
        self.live
            .load()
            .policy(tenant)
            .map_or(tierlimit_shared::zone::Zone::UTC, |p| p.time_zone)
    }

    /// Which changed counters the regions need (see [`Merged::take_dirty`]):
    /// those with a global limit (carried by the deltas, else configured)
    /// whose total reached `aggregator.broadcast_fraction` of it. Built
    /// from the configuration outside the state lock; called under it, once
    /// per dirty counter.
    pub fn wanted(&self) -> impl Fn(&TenantPeriod, &Counter) -> bool {
        let config = self.live.load_full();
        move |key, counter| {
            judged(&config, key, counter)
                .limit
                .is_some_and(|l| counter.total() >= config.config.aggregator.broadcast_threshold(l))
        }
    }

    /// Wakes the broadcaster for counters marked urgent.
    pub fn urgent(&self) -> &Notify {
        &self.urgent
    }

    /// Called after every SIGHUP reload attempt.
    pub fn on_reload(&self, result: Result<(), &ConfigError>) {
        match result {
            Ok(()) => {
                self.metrics.config_reloads.with_label_values(&["ok"]).inc();
                self.limits_changed.store(true, Ordering::Release);
                self.limits_version.fetch_add(1, Ordering::AcqRel);
                let now = self.live.load();
                let same_kafka = serde_json::to_value(&now.config.kafka).ok()
                    == serde_json::to_value(&self.kafka).ok();
                if !same_kafka {
                    tracing::warn!(
                        "kafka settings changed on reload; they take effect only after a restart"
                    );
                }
                tracing::info!("limits may have changed; today's counters whose limit changed will be broadcast again");
            }
            Err(_) => {
                self.metrics
                    .config_reloads
                    .with_label_values(&["error"])
                    .inc();
            }
        }
    }

    /// Whether limits changed since the last call.
    pub fn take_limits_changed(&self) -> bool {
        self.limits_changed.swap(false, Ordering::AcqRel)
    }

    /// After a reload: the tenants whose global limit differs from the
    /// configuration the last broadcasts were made under (which the current
    /// one then becomes). `None` if nothing was reloaded since the last call.
    pub fn take_limit_changes(&self) -> Option<LimitChanges> {
        if !self.take_limits_changed() {
            return None;
        }
        let now = self.live.load_full();
        let before = {
            let mut seen = self
                .broadcast_config
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *seen, Arc::clone(&now))
        };
        Some(LimitChanges::between(&before, now))
    }

    /// [`State::on_assign_from`] the beginning of every partition.
    pub fn on_assign(&self, partitions: &[i32]) -> u64 {
        self.on_assign_from(partitions, &[])
    }

    /// Starts the rebuild of newly assigned partitions: whatever this
    /// instance held for them is dropped and re-read from `starts` (the
    /// first record of the retained days; a partition not listed is read
    /// from the beginning). Returns the generation to quote with their
    /// watermarks.
    pub fn on_assign_from(&self, partitions: &[i32], starts: &[retention::Start]) -> u64 {
        let mut core = self.lock();
        let dropped = core.merged.drop_partitions(partitions);
        core.watermarks.forget(partitions);
        let generation = core.progress.assign(partitions);
        if partitions.contains(&crate::limits_api::WRITER_PARTITION) {
            let mut since = self.writer_since.lock().unwrap_or_else(|e| e.into_inner());
            since.get_or_insert_with(std::time::Instant::now);
        }
        for s in starts {
            core.progress.set_start(s.partition, s.at());
        }
        self.metrics
            .assigned_partitions
            .set(core.progress.assigned_partitions().len() as i64);
        self.metrics
            .ready
            .set(i64::from(core.progress.readiness() == Readiness::Ready));
        drop(core);
        // Cooperative rebalancing hands out empty increments; say nothing.
        if !partitions.is_empty() {
            let starts: Vec<i64> = starts.iter().map(retention::Start::at).collect();
            tracing::info!(
                ?partitions,
                ?starts,
                dropped,
                "partitions assigned; rebuilding them from the retained start"
            );
        }
        generation
    }

    /// Since when this instance holds the limits writer's place (`None`:
    /// it does not).
    pub fn writer_since(&self) -> Option<std::time::Instant> {
        *self.writer_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the state of revoked partitions; `None` revokes everything
    /// (eager rebalance, error, or close).
    pub fn on_revoke(&self, partitions: Option<&[i32]>) {
        let mut core = self.lock();
        let revoked = match partitions {
            Some(ps) => {
                core.progress.revoke(ps);
                ps.to_vec()
            }
            None => core.progress.revoke_all(),
        };
        if revoked.contains(&crate::limits_api::WRITER_PARTITION) {
            *self.writer_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        let dropped = core.merged.drop_partitions(&revoked);
        core.watermarks.forget(&revoked);
        self.metrics
            .assigned_partitions
            .set(core.progress.assigned_partitions().len() as i64);
        self.metrics.tracked_counters.set(core.merged.len() as i64);
        self.metrics
            .ready
            .set(i64::from(core.progress.readiness() == Readiness::Ready));
        drop(core);
        self.metrics.forget_partitions(&revoked);
        if !revoked.is_empty() {
            tracing::info!(partitions = ?revoked, dropped, "partitions revoked; their counters are dropped");
        }
    }

    /// Records the high watermark a rebuild must reach.
    pub fn on_watermarks(&self, partition: i32, generation: u64, low: i64, high: i64) {
        let mut core = self.lock();
        if core.progress.set_target(partition, generation, low, high) {
            self.caught_up(&mut core, partition);
        }
    }

    /// The fetcher reached the end of `partition`.
    pub fn on_end_of_partition(&self, partition: i32) {
        let mut core = self.lock();
        if core.progress.reached_end(partition) {
            self.caught_up(&mut core, partition);
        }
    }

    /// A message that is not a delta was skipped; it still counts as read.
    pub fn on_skipped(&self, partition: i32, offset: i64) {
        let mut core = self.lock();
        if !core.progress.is_caught_up(partition) {
            self.metrics.rebuild_records.inc();
        }
        if core.progress.consumed(partition, offset) {
            self.caught_up(&mut core, partition);
        }
    }

    /// The heartbeats of every rebuilt partition: "merged through this
    /// offset, limits of this version". A partition still rebuilding has
    /// none, so followers see its broadcasts as not current.
    pub fn heartbeats(&self, progress: &Progress) -> Vec<Heartbeat> {
        let (version, ts_ms) = (self.limits_version.load(Ordering::Acquire), now_ms());
        progress
            .partitions()
            .filter(|p| p.caught_up)
            .map(|p| Heartbeat {
                partition: p.partition as u32,
                deltas_offset: p.position.unwrap_or(0).max(0) as u64,
                limits_version: version,
                ts_ms,
            })
            .collect()
    }

    /// A record was refused (forged, of an unknown region, corrupt):
    /// counted by reason and skipped; it still counts as read.
    pub fn on_rejected(&self, partition: i32, offset: i64, reject: &Reject) {
        self.metrics
            .deltas_rejected
            .with_label_values(&[reject.reason()])
            .inc();
        if matches!(reject, Reject::Corrupt(_)) {
            self.metrics.undecodable.inc();
        }
        self.on_skipped(partition, offset);
    }

    /// A region-node's status read at (`partition`, `offset`): remembered,
    /// and the offset is done with like any record that merges nothing.
    pub fn on_node_status(
        &self,
        partition: i32,
        offset: i64,
        status: &tierlimit_shared::wire::NodeStatus,
    ) {
        self.nodes.heard(status, now_ms());
        {
            let config = self.live.load();
            let mut core = self.lock();
            if core.progress.is_assigned(partition) {
                let regions = config.config.regions.keys().map(String::as_str);
                core.watermarks.heard(partition, status, regions);
            }
        }
        self.on_skipped(partition, offset);
    }

    /// Merges a delta read at (`partition`, `offset`).
    pub fn on_delta(&self, partition: i32, offset: i64, delta: &Delta) {
        let m = &self.metrics;
        m.deltas_consumed.inc();
        if partition_of(&delta.tenant, self.kafka.partitions) != partition {
            m.misrouted.inc();
        }
        let config = self.live.load();
        // Only looked up if no delta of the counter carried a limit.
        let configured = || configured_limit(&config, &delta.tenant, delta.period.kind);
        let now = now_ms();
        let mut core = self.lock();
        if !core.progress.is_assigned(partition) {
            // Only possible in a race with a revocation; the next owner
            // rebuilds the partition anyway.
            m.deltas_ignored.with_label_values(&["unassigned"]).inc();
            return;
        }
        // Before catch-up the deltas are history being replayed: no urgent
        // broadcasts (the counter is partial), no age observations (they
        // would measure how old the topic is, not how fresh the pipeline).
        let live_traffic = core.progress.is_caught_up(partition);
        if !live_traffic {
            m.rebuild_records.inc();
        }
        if core.watermarks.is_closed(partition, delta.period) {
            // Every region reported past this period's end: its figure is
            // final, and what this delta adds is kept apart (`usage.rs`).
            if core.merged.apply_late(partition, delta) > 0 {
                m.late_deltas.inc();
            }
            if core.progress.consumed(partition, offset) {
                self.caught_up(&mut core, partition);
            }
            return;
        }
        let (mut wake, mut epoch_changed) = (false, false);
        let key = || TenantPeriod::new(delta.tenant.as_str(), delta.period);
        match core.merged.apply(partition, delta, now) {
            Applied::Changed {
                before,
                after,
                stale,
                new_epoch,
                limit_changed,
            } => {
                m.merges_applied.inc();
                if !live_traffic {
                    // History being replayed: marked with its whole
                    // partition at catch-up, not walked by every flush.
                    core.merged.forget_dirty(&key());
                }
                epoch_changed = new_epoch && live_traffic;
                if stale && live_traffic {
                    m.stale_deltas.inc();
                    core.merged.mark_visible(&key());
                }
                // The limit judged after this delta: the one it carried if
                // it won, else the one held, else the configuration's.
                let carried = core
                    .merged
                    .get(&delta.tenant, delta.period)
                    .and_then(Counter::carried);
                let limit = Carried::or_config(carried, configured).limit;
                // Crossing the broadcast threshold is urgent like crossing
                // the limit: until their entry arrives the regions bound the
                // others' spend by it. So is a new limit (a node's reload)
                // the total is already at.
                let threshold = limit.map(|l| config.config.aggregator.broadcast_threshold(l));
                let crossed = |at: Option<u64>| {
                    at.is_some_and(|at| (before < at || limit_changed) && after >= at)
                };
                if live_traffic && (crossed(limit) || crossed(threshold)) {
                    core.merged.mark_urgent(&key());
                    wake = true;
                }
            }
            Applied::Unchanged {
                stale,
                limit_changed,
            } => {
                if !live_traffic && limit_changed {
                    core.merged.forget_dirty(&key());
                }
                if stale && live_traffic {
                    m.stale_deltas.inc();
                    core.merged.mark_visible(&key());
                }
            }
            Applied::Expired => m.deltas_ignored.with_label_values(&["expired"]).inc(),
            Applied::Future => m.deltas_ignored.with_label_values(&["future"]).inc(),
        }
        if core.progress.consumed(partition, offset) {
            self.caught_up(&mut core, partition);
        }
        drop(core);

        let region = tierlimit_shared::messages::actor_region(&delta.actor);
        // Label only configured regions: the label set must not be driven
        // by whatever a producer writes.
        let label = if config.config.regions.contains_key(region) {
            region
        } else {
            "unknown"
        };
        if epoch_changed {
            m.epoch_changes.with_label_values(&[label]).inc();
        }
        let gauge = m.region_last_delta.with_label_values(&[label]);
        let ts = delta.ts_ms as f64 / 1000.0;
        if ts > gauge.get() {
            gauge.set(ts);
        }
        if live_traffic {
            let age_ms = now_ms().saturating_sub(delta.ts_ms);
            m.delta_age.observe(age_ms as f64 / 1000.0);
        }
        if wake {
            self.urgent.notify_one();
        }
    }

    /// A partition finished its rebuild: its counters (every retained day)
    /// become dirty, so those the regions need are broadcast once and a
    /// global topic that lost data is refilled.
    fn caught_up(&self, core: &mut Core, partition: i32) {
        let marked = core.merged.mark_partition_dirty(partition);
        let ready = core.progress.readiness() == Readiness::Ready;
        self.metrics.ready.set(i64::from(ready));
        tracing::info!(
            partition,
            counters = marked,
            ready,
            "partition rebuilt from the deltas topic"
        );
    }

    pub fn readiness(&self) -> Readiness {
        self.lock().progress.readiness()
    }

    /// Periodic upkeep: drops expired periods (each kind on its own
    /// retention) and refreshes the gauges. Under the lock it walks only the
    /// current periods' visible counters (every over-limit tenant is one),
    /// never every counter; the expired periods are freed after the lock is
    /// released.
    pub fn housekeeping(&self) {
        let now = now_ms();
        let config = self.live.load();
        if let Some(table) = config.limits() {
            self.metrics.limits.observe(table);
            let report = self
                .nodes
                .report(None, config.config.limits.lag_alert_after, now);
            for state in ["current", "behind", "lagging", "gone"] {
                let n = report.nodes.iter().filter(|n| n.state == state).count();
                self.metrics
                    .limits_nodes
                    .with_label_values(&[state])
                    .set(n as i64);
            }
        }
        let mut core = self.lock();
        core.merged
            .set_retention(config.config.aggregator.retention_days);
        let gone = core.merged.expire(now);
        // Tenants at or over any of their tiers in its current period,
        // each counted once.
        let mut over = std::collections::BTreeSet::new();
        for period in core.merged.current(now) {
            let Some(g) = core.merged.on(period) else {
                continue;
            };
            for (tenant, c) in g.visible() {
                let key = TenantPeriod::new(tenant, period);
                if judged(&config, &key, c)
                    .limit
                    .is_some_and(|limit| c.total() >= limit)
                {
                    over.insert(tenant.to_owned());
                }
            }
        }
        let over = over.len();
        let tracked = core.merged.len();
        let ready = core.progress.readiness() == Readiness::Ready;
        drop(core);
        let expired = gone.counters();
        drop(gone);
        if expired > 0 {
            tracing::info!(expired, "dropped counters past the retention window");
        }
        self.metrics.over_limit_tenants.set(over as i64);
        self.metrics.tracked_counters.set(tracked as i64);
        self.metrics.ready.set(i64::from(ready));
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tierlimit_shared::config::Config;
    use tierlimit_shared::day;
    use tierlimit_shared::messages::actor;
    use tierlimit_shared::period::Period;

    pub(crate) const CONFIG: &str = r#"
cluster = "test"
[kafka]
brokers = "127.0.0.1:1"
partitions = 4
[regions.eu]
redis_url = "redis://127.0.0.1:6379"
[regions.us]
redis_url = "redis://127.0.0.1:6379"
[plans.small]
global = { limit = 100 }
[plans.unlimited]
[tenants.acme]
plan = "small"
[tenants.free]
plan = "unlimited"
[unknown_tenants]
policy = "plan"
plan = "small"
[wire]
accept_unsigned = true
"#;

    pub(crate) fn state() -> Arc<State> {
        let loaded = Config::from_toml(CONFIG).expect("test config is valid");
        State::new(tierlimit_shared::reload::live(loaded), Metrics::new())
    }

    fn d(tenant: &str, region: &str, p: u64) -> Delta {
        Delta::new(tenant, day::today(), actor(region, "e1"), p, 0, now_ms())
    }

    #[test]
    fn deltas_of_unassigned_partitions_are_ignored() {
        let s = state();
        s.on_delta(0, 0, &d("acme", "eu", 5));
        assert!(s.lock().merged.is_empty());
        assert_eq!(
            s.metrics
                .deltas_ignored
                .with_label_values(&["unassigned"])
                .get(),
            1
        );
    }

    #[test]
    fn nothing_is_broadcast_before_catch_up() {
        let s = state();
        let p = partition_of("acme", 4);
        let g = s.on_assign(&[p]);
        s.on_delta(p, 0, &d("acme", "eu", 5));
        // Crossing during the rebuild is not urgent.
        s.on_delta(p, 1, &d("acme", "us", 500));
        {
            let mut core = s.lock();
            // Replayed history is not in the dirty set every flush walks:
            // its partition is marked whole at catch-up.
            assert_eq!(core.merged.dirty_len(), 0);
            let Core {
                merged, progress, ..
            } = &mut *core;
            assert!(!merged.has_urgent());
            assert!(merged
                .take_dirty(false, |p| progress.is_caught_up(p), |_, _| true)
                .0
                .is_empty());
        }
        s.on_watermarks(p, g, 0, 2);
        assert_eq!(s.readiness(), Readiness::Ready);
        let mut core = s.lock();
        let Core {
            merged, progress, ..
        } = &mut *core;
        let (taken, _) = merged.take_dirty(false, |p| progress.is_caught_up(p), |_, _| true);
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].1.total, 505);
    }

    /// Takes the broadcasts as the broadcaster does (the counters it takes
    /// become visible).
    pub(crate) fn broadcasts(s: &State) -> Vec<String> {
        let wanted = s.wanted();
        let mut core = s.lock();
        let Core {
            merged, progress, ..
        } = &mut *core;
        let (taken, _) = merged.take_dirty(false, |p| progress.is_caught_up(p), wanted);
        taken.into_iter().map(|(k, _)| k.tenant).collect()
    }

    #[test]
    fn only_limited_tenants_past_the_broadcast_fraction_are_broadcast() {
        let s = state();
        let mut ps = vec![partition_of("acme", 4), partition_of("free", 4)];
        ps.dedup();
        let g = s.on_assign(&ps);
        for p in &ps {
            s.on_watermarks(*p, g, 0, 0);
        }
        let (pa, pf) = (partition_of("acme", 4), partition_of("free", 4));
        // acme's limit is 100, the default fraction 0.25: threshold 25.
        s.on_delta(pa, 0, &d("acme", "eu", 24));
        s.on_delta(pf, 0, &d("free", "eu", 1_000_000));
        assert!(!s.lock().merged.has_urgent());
        assert!(
            broadcasts(&s).is_empty(),
            "below the threshold, or unlimited"
        );
        // Crossing the threshold is urgent, and from then on acme is broadcast.
        s.on_delta(pa, 1, &d("acme", "eu", 25));
        assert!(s.lock().merged.has_urgent());
        assert_eq!(broadcasts(&s), ["acme"]);
        // An unlimited tenant whose actor published less than before (a
        // rolled-back Redis) is broadcast, so its region can raise the
        // counter back.
        s.on_delta(pf, 1, &d("free", "eu", 10));
        assert_eq!(broadcasts(&s), ["free"]);
        assert_eq!(s.metrics.stale_deltas.get(), 1);
    }

    #[test]
    fn crossing_the_limit_is_urgent_once_caught_up() {
        let s = state();
        let p = partition_of("acme", 4);
        let g = s.on_assign(&[p]);
        s.on_watermarks(p, g, 0, 0);
        s.on_delta(p, 0, &d("acme", "eu", 30));
        // Crossing the broadcast threshold (25) was urgent; taken.
        s.lock().merged.take_dirty(true, |_| true, |_, _| true);
        s.on_delta(p, 1, &d("acme", "us", 69));
        assert!(!s.lock().merged.has_urgent());
        s.on_delta(p, 2, &d("acme", "us", 70));
        assert!(s.lock().merged.has_urgent());
        // Unlimited tenants never cross.
        let q = partition_of("free", 4);
        let g = s.on_assign(&[q]);
        s.on_watermarks(q, g, 0, 0);
        s.lock().merged.take_dirty(true, |_| true, |_, _| true);
        s.on_delta(q, 0, &d("free", "eu", 1_000_000));
        assert!(!s.lock().merged.has_urgent());
    }

    #[test]
    fn revocation_drops_state_and_readiness() {
        let s = state();
        let g = s.on_assign(&[0, 1]);
        s.on_watermarks(0, g, 0, 0);
        s.on_watermarks(1, g, 0, 0);
        assert_eq!(s.readiness(), Readiness::Ready);
        s.on_delta(0, 0, &d("t0", "eu", 1));
        s.on_delta(1, 0, &d("t1", "eu", 1));
        s.on_revoke(Some(&[0]));
        assert_eq!(s.lock().merged.len(), 1);
        s.on_revoke(None);
        assert!(s.lock().merged.is_empty());
        assert!(matches!(s.readiness(), Readiness::NotReady(_)));
    }

    #[test]
    fn skipped_messages_advance_the_rebuild() {
        let s = state();
        let g = s.on_assign(&[3]);
        s.on_watermarks(3, g, 0, 1);
        assert!(matches!(s.readiness(), Readiness::NotReady(_)));
        s.on_skipped(3, 0);
        assert_eq!(s.readiness(), Readiness::Ready);
    }

    #[test]
    fn housekeeping_counts_over_limit_tenants() {
        let s = state();
        let g = s.on_assign(&[0, 1, 2, 3]);
        for p in 0..4 {
            s.on_watermarks(p, g, 0, 0);
        }
        for (i, t) in ["acme", "other", "free"].iter().enumerate() {
            s.on_delta(partition_of(t, 4), i as i64, &d(t, "eu", 100));
        }
        // Over-limit tenants are found among the broadcast ones.
        s.housekeeping();
        assert_eq!(s.metrics.over_limit_tenants.get(), 0);
        broadcasts(&s);
        s.housekeeping();
        // acme (plan) and other (unknown → plan small) are at 100; free has no limit.
        assert_eq!(s.metrics.over_limit_tenants.get(), 2);
        assert_eq!(s.metrics.tracked_counters.get(), 3);
        assert_eq!(s.metrics.ready.get(), 1);
    }

    /// A v3 delta of a month carrying its tier's limit.
    fn month(tenant: &str, region: &str, p: u64, limit: Option<u64>, version: u64) -> Delta {
        let mut d = Delta::of(
            tenant,
            PeriodKind::Month.at(now_ms()),
            actor(region, "e1"),
            p,
            0,
            now_ms(),
        );
        d.limit = limit;
        d.limits_version = version;
        d
    }

    #[test]
    fn limits_carried_by_deltas_decide_without_the_configuration() {
        let s = state();
        let p = partition_of("free", 4);
        let g = s.on_assign(&[p]);
        s.on_watermarks(p, g, 0, 0);
        // "free" has no global tier in the aggregator's configuration; the
        // node enforces a month tier of 1000 and says so.
        s.on_delta(p, 0, &month("free", "eu", 200, Some(1_000), 1));
        assert!(broadcasts(&s).is_empty(), "below 25 % of 1000");
        s.on_delta(p, 1, &month("free", "eu", 250, Some(1_000), 1));
        assert!(s.lock().merged.has_urgent(), "the threshold crossed");
        assert_eq!(broadcasts(&s), ["free"]);
        // The node lowers the limit to what is spent: over it, urgent.
        s.on_delta(p, 2, &month("free", "us", 1, Some(251), 2));
        assert!(s.lock().merged.has_urgent());
        let config = s.live().load_full();
        let core = s.lock();
        let period = PeriodKind::Month.at(now_ms());
        let c = core.merged.get("free", period).unwrap();
        let j = judged(&config, &TenantPeriod::new("free", period), c);
        assert_eq!((j.limit, j.limits_version), (Some(251), 2));
        drop(core);
        s.housekeeping();
        assert_eq!(s.metrics.over_limit_tenants.get(), 1);
    }

    #[test]
    fn without_a_carried_limit_the_configuration_decides() {
        let config = Config::from_toml(&CONFIG.replace(
            "[plans.small]\nglobal = { limit = 100 }",
            "[plans.small]\nglobal = { limit = 100, month = 1000, hour = 10 }",
        ))
        .unwrap();
        let at = |t: &str, k| configured_limit(&config, t, k);
        assert_eq!(at("acme", PeriodKind::Day), Some(100));
        assert_eq!(at("acme", PeriodKind::Month), Some(1_000));
        assert_eq!(at("acme", PeriodKind::Hour), Some(10));
        assert_eq!(at("acme", PeriodKind::Week), None);
        assert_eq!(at("free", PeriodKind::Month), None);
        let s = State::new(tierlimit_shared::reload::live(config), Metrics::new());
        let p = partition_of("acme", 4);
        let g = s.on_assign(&[p]);
        s.on_watermarks(p, g, 0, 0);
        // A v2 writer's month delta (no limit): judged under 1000.
        s.on_delta(p, 0, &month("acme", "eu", 249, None, 0));
        assert!(broadcasts(&s).is_empty());
        s.on_delta(p, 1, &month("acme", "eu", 250, None, 0));
        assert_eq!(broadcasts(&s), ["acme"]);
        let period = PeriodKind::Month.at(now_ms());
        assert_ne!(period, Period::day(day::today()));
    }
}
