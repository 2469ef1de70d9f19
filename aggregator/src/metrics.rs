//! Prometheus metrics of the aggregator, in a registry of its own (so a test
//! can run several instances in one process, and nothing global leaks in).
//!
//! Every name starts with `tierlimit_aggregator_`.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

const PREFIX: &str = "tierlimit_aggregator";

/// Every metric the aggregator exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Deltas decoded and handed to the merge.
    pub deltas_consumed: IntCounter,
    /// Records read while their partition was rebuilding (before catch-up):
    /// what rebuilds cost, bounded by the retained days.
    pub rebuild_records: IntCounter,
    /// Deltas that changed a counter (the rest were duplicates or replays).
    pub merges_applied: IntCounter,
    /// Decoded deltas dropped, by reason (`expired`, `future`, `unassigned`).
    pub deltas_ignored: IntCounterVec,
    /// Messages that could not be decoded (skipped).
    pub undecodable: IntCounter,
    /// Records refused by the wire layer, by `Reject::reason`.
    pub deltas_rejected: IntCounterVec,
    /// Deltas that would have raised a closed period's figure (`usage.rs`).
    pub late_deltas: IntCounter,
    pub heartbeats_produced: IntCounter,
    /// Limits from the topic (`limits.source = "topic"`).
    pub limits: tierlimit_shared::limits::metrics::LimitsMetrics,
    /// Region-nodes by limits state (`nodes.rs`): current, behind, lagging,
    /// gone.
    pub limits_nodes: IntGaugeVec,
    /// Deltas found on a partition other than `partition_of(tenant)`: the
    /// producers' `kafka.partitions` does not match the topic's.
    pub misrouted: IntCounter,
    /// Live deltas below what their actor already published (out-of-order
    /// publishers of one actor); see [`crate::merge::Merge::stale`].
    pub stale_deltas: IntCounter,
    /// New Redis epochs of a region beside an older one in a counter (the
    /// region's Redis lost data), by region.
    pub epoch_changes: IntCounterVec,
    /// Global updates acknowledged by the broker.
    pub broadcasts_produced: IntCounter,
    /// Global updates the broker did not take (retried next interval).
    pub broadcasts_failed: IntCounter,
    /// Changed counters not broadcast: below `aggregator.broadcast_fraction`
    /// of their limit, or of a tenant without a global limit.
    pub broadcasts_withheld: IntCounter,
    /// Tenants at or over one of their global limits in its current period.
    pub over_limit_tenants: IntGauge,
    /// (tenant, period) counters held in memory.
    pub tracked_counters: IntGauge,
    /// High watermark minus position, per assigned partition.
    pub consumer_lag: IntGaugeVec,
    /// Assigned partitions.
    pub assigned_partitions: IntGauge,
    /// Whether the instance is ready (1) or rebuilding (0).
    pub ready: IntGauge,
    /// Unix time (seconds) of the newest delta seen per region.
    pub region_last_delta: GaugeVec,
    /// Age of a delta when merged (now − its `ts_ms`), live traffic only.
    pub delta_age: Histogram,
    /// Configuration reloads by result (`ok`, `error`).
    pub config_reloads: IntCounterVec,
    /// HTTP requests refused (auth, limits, shedding), by problem slug.
    pub http_rejections: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn name(n: &str) -> String {
    format!("{PREFIX}_{n}")
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        tierlimit_shared::register_build_info(&registry);
        let counter = |n: &str, help: &str| {
            let c = IntCounter::new(name(n), help).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let counter_vec = |n: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name(n), help), labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let gauge = |n: &str, help: &str| {
            let g = IntGauge::new(name(n), help).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let deltas_consumed = counter(
            "deltas_consumed_total",
            "Deltas decoded from the deltas topic.",
        );
        let rebuild_records = counter(
            "rebuild_records_total",
            "Records read from a deltas partition before it caught up (rebuilds after an assignment): bounded by the retained days (or, with a week or month tier, the previous such period), not by all history.",
        );
        let merges_applied = counter(
            "merges_applied_total",
            "Deltas that changed a merged counter (duplicates and replays do not).",
        );
        let deltas_ignored = counter_vec(
            "deltas_ignored_total",
            "Decoded deltas dropped, by reason: expired (period past its kind's retention), future (period ahead of the next one), unassigned.",
            &["reason"],
        );
        let undecodable = counter(
            "undecodable_messages_total",
            "Messages on the deltas topic that could not be decoded and were skipped.",
        );
        let heartbeats_produced = counter(
            "heartbeats_produced_total",
            "Signed heartbeats (\"partition caught up, merged through offset X\") acknowledged by the broker.",
        );
        let late_deltas = counter(
            "late_deltas_total",
            "Deltas that would have raised a period every region had reported past (a closed, final figure); kept apart as the period's late_units.",
        );
        let deltas_rejected = counter_vec(
            "deltas_rejected_total",
            "Records on the deltas topic refused and skipped, by reason: corrupt, version, unsigned, unknown_key, \
             bad_signature, wrong_region (a region's key signing another region's actor), unknown_region.",
            &["reason"],
        );
        for reason in tierlimit_shared::wire::Reject::REASONS {
            deltas_rejected.with_label_values(&[reason]);
        }
        let misrouted = counter(
            "misrouted_deltas_total",
            "Deltas on a partition other than the tenant's: producers and topic disagree on the partition count.",
        );
        let stale_deltas = counter(
            "stale_deltas_total",
            "Live deltas below what their actor already published: publishers of one actor reached Kafka out of order \
             (harmless for the merge; on a compacted topic the key's latest message understates the actor until its next delta).",
        );
        let epoch_changes = counter_vec(
            "epoch_changes_total",
            "Counters where a region's new Redis epoch appeared beside an older one: that region's Redis lost data \
             (restarted empty, flushed, failed over to an empty replica). Live traffic only.",
            &["region"],
        );
        let broadcasts_produced = counter(
            "broadcasts_produced_total",
            "Global updates acknowledged by the broker.",
        );
        let broadcasts_withheld = counter(
            "broadcasts_withheld_total",
            "Changed counters not broadcast: below aggregator.broadcast_fraction of their global limit, or without one \
             (region-nodes bound the others' spend of a tenant they hold no entry for by that fraction).",
        );
        let broadcasts_failed = counter(
            "broadcasts_failed_total",
            "Global updates that could not be produced (kept dirty and retried).",
        );
        let over_limit_tenants = gauge(
            "over_limit_tenants",
            "Tenants at or over one of their global limits in its current period (today for the day's).",
        );
        let http_rejections = counter_vec(
            "http_rejections_total",
            "HTTP requests refused with a problem+json, by its type slug (unauthorized, forbidden, overloaded, request-timeout, …).",
            &["reason"],
        );
        let tracked_counters = gauge(
            "tracked_counters",
            "(tenant, period) counters held in memory.",
        );
        let consumer_lag = IntGaugeVec::new(
            Opts::new(
                name("consumer_lag"),
                "Messages between the consumer position and the high watermark.",
            ),
            &["partition"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(consumer_lag.clone()))
            .expect("unique metric");
        let assigned_partitions = gauge(
            "assigned_partitions",
            "Deltas partitions assigned to this instance.",
        );
        let ready = gauge(
            "ready",
            "1 once every assigned partition has been rebuilt, else 0.",
        );
        let region_last_delta = GaugeVec::new(
            Opts::new(
                name("region_last_delta_timestamp_seconds"),
                "Unix time of the newest delta seen per region (from the delta's ts_ms).",
            ),
            &["region"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(region_last_delta.clone()))
            .expect("unique metric");
        let delta_age = Histogram::with_opts(
            HistogramOpts::new(
                name("delta_age_seconds"),
                "Age of a delta when merged (now − ts_ms), for partitions already rebuilt.",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
        )
        .expect("valid metric");
        registry
            .register(Box::new(delta_age.clone()))
            .expect("unique metric");
        let config_reloads = counter_vec(
            "config_reloads_total",
            "Configuration reloads on SIGHUP, by result.",
            &["result"],
        );
        let limits = tierlimit_shared::limits::metrics::LimitsMetrics::register(&registry, PREFIX);
        let limits_nodes = IntGaugeVec::new(
            Opts::new(
                name("limits_nodes"),
                "Region-nodes by the limits version they applied: current (the newest this aggregator applied), behind (below it, for less than limits.lag_alert_after), lagging (longer: alert), gone (no status for 60 s).",
            ),
            &["state"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(limits_nodes.clone()))
            .expect("unique metric");
        for s in ["current", "behind", "lagging", "gone"] {
            limits_nodes.with_label_values(&[s]);
        }
        Metrics {
            limits,
            limits_nodes,
            registry,
            deltas_consumed,
            rebuild_records,
            merges_applied,
            deltas_ignored,
            undecodable,
            deltas_rejected,
            late_deltas,
            heartbeats_produced,
            misrouted,
            stale_deltas,
            epoch_changes,
            broadcasts_produced,
            broadcasts_failed,
            broadcasts_withheld,
            over_limit_tenants,
            tracked_counters,
            consumer_lag,
            assigned_partitions,
            ready,
            region_last_delta,
            delta_age,
            config_reloads,
            http_rejections,
        }
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The registry in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# failed to encode metrics: {e}\n"))
    }

    /// Drops the lag series of partitions no longer assigned, so a dashboard
    /// does not show a frozen lag for a partition another instance now owns.
    pub fn forget_partitions(&self, partitions: &[i32]) {
        for p in partitions {
            let _ = self.consumer_lag.remove_label_values(&[&p.to_string()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prefixed_names() {
        let m = Metrics::new();
        m.deltas_consumed.inc();
        m.consumer_lag.with_label_values(&["3"]).set(7);
        m.region_last_delta.with_label_values(&["eu"]).set(1.5);
        m.delta_age.observe(0.2);
        let text = m.render();
        assert!(text.contains("tierlimit_aggregator_deltas_consumed_total 1"));
        assert!(text.contains("tierlimit_aggregator_consumer_lag{partition=\"3\"} 7"));
        assert!(text.contains("tierlimit_aggregator_delta_age_seconds_bucket"));
        m.forget_partitions(&[3]);
        assert!(!m.render().contains("consumer_lag{partition=\"3\"}"));
        // The one shared metric: the release and its zone database.
        let build = format!("tzdb=\"{}\"", tierlimit_shared::zone::tzdb_version());
        assert!(m.render().contains(&build), "{build}");
        for line in m.render().lines().filter(|l| !l.starts_with('#')) {
            assert!(
                line.starts_with("tierlimit_aggregator_")
                    || line.starts_with("tierlimit_build_info{"),
                "{line}"
            );
        }
    }
}
