//! The limits metrics both binaries export, registered in their registry.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::limits::LimitsTable;

/// The outcome labels of `tierlimit_limits_records_total` besides a
/// refusal's reason (`Reject::REASONS`), so every label starts at zero.
pub const OUTCOMES: [&str; 5] = ["applied", "pending", "stale", "invalid", "tombstone"];

#[derive(Clone)]
pub struct LimitsMetrics {
    /// Limits records read, by outcome.
    pub records: IntCounterVec,
    /// Every limits record up to this version is applied.
    pub applied_version: IntGauge,
    /// Registered tenants in the table.
    pub tenants: IntGauge,
    /// Tenants whose plan is not applied yet.
    pub pending: IntGauge,
    /// 1 while the process reads the limits topic.
    pub following: IntGauge,
    /// Decisions shed because the limits were not read yet.
    pub not_ready: IntCounter,
}

impl LimitsMetrics {
    /// Registers them as `<prefix>_limits_…` (`tierlimit` for a node,
    /// `tierlimit_aggregator` for an aggregator).
    pub fn register(r: &Registry, prefix: &str) -> LimitsMetrics {
        let n = |name: &str| format!("{prefix}_limits_{name}");
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone())).expect("unique metric");
            c
        }
        let m = LimitsMetrics {
            records: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        n("records_total"),
                        "Limits records read, by outcome: applied, pending (plan not applied yet), stale (not newer than the subject's), invalid (tiers that do not validate: the previous version stays), tombstone (Kafka null values, ignored), or why the record was refused",
                    ),
                    &["outcome"],
                )
                .unwrap(),
            ),
            applied_version: reg(
                r,
                IntGauge::new(
                    n("applied_version"),
                    "Every limits record up to this version is applied (0: none, or limits come from the file)",
                )
                .unwrap(),
            ),
            tenants: reg(
                r,
                IntGauge::new(
                    n("tenants"),
                    "Tenants registered on the limits topic and applied",
                )
                .unwrap(),
            ),
            pending: reg(
                r,
                IntGauge::new(
                    n("pending_tenants"),
                    "Tenants whose plan is not applied yet (treated as unknown tenants)",
                )
                .unwrap(),
            ),
            following: reg(
                r,
                IntGauge::new(
                    n("following"),
                    "1 while the process reads the limits topic",
                )
                .unwrap(),
            ),
            not_ready: reg(
                r,
                IntCounter::new(
                    n("not_ready_total"),
                    "Decisions shed (503 limits-not-ready) because the limits were not read yet since the start",
                )
                .unwrap(),
            ),
        };
        for o in OUTCOMES.into_iter().chain(crate::wire::Reject::REASONS) {
            m.records.with_label_values(&[o]);
        }
        m
    }

    /// The table's gauges, as of now.
    pub fn observe(&self, table: &LimitsTable) {
        self.applied_version
            .set(table.applied_version().min(i64::MAX as u64) as i64);
        self.tenants.set(table.len() as i64);
        self.pending.set(table.pending() as i64);
    }
}
