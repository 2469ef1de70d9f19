//! The node's admission gate: the shared one
//! ([`tierlimit_shared::admission`]: a bounded number of requests in flight,
//! a bounded queue, then 503 with `Retry-After`), sized by `[node]`
//! `max_in_flight`, `max_queue` and `queue_timeout`, and reported in the
//! node's metrics (`tierlimit_shed_total{reason}`,
//! `tierlimit_admission_in_flight`, `tierlimit_admission_queued`).
//!
//! Every front end that decides takes a slot of the same gate: the HTTP
//! API through [`tierlimit_shared::admission::layer`], the gRPC rate-limit
//! service through [`Admission::admit`]. A request waits for a slot instead
//! of waiting on Redis, so saturation is answered by shedding and the fail
//! mode engages only for a Redis that is unreachable or slower than
//! `store_timeout` (README, "Saturation and lost replies").

use std::sync::Arc;

use tierlimit_shared::admission::Meter;
pub use tierlimit_shared::admission::{Admission, Admitted, Limits, Shed};
use tierlimit_shared::config::NodeSettings;

use crate::metrics::Metrics;

/// The gate's bounds from `[node]`.
pub fn limits(node: &NodeSettings) -> Limits {
    Limits {
        max_in_flight: node.max_in_flight,
        max_queue: node.max_queue,
        queue_timeout: node.queue_timeout,
    }
}

/// The node's gate: bodies of a check or refund (within
/// [`crate::http::MAX_BODY`]) are read before a slot is taken, so a slow
/// sender does not hold one.
pub fn gate(node: &NodeSettings, metrics: Arc<Metrics>) -> Arc<Admission> {
    Admission::reading_bodies_first(limits(node), crate::http::MAX_BODY, metrics)
}

impl Meter for Metrics {
    fn in_flight(&self, delta: i64) {
        self.admission_in_flight.add(delta);
    }
    fn queued(&self, delta: i64) {
        self.admission_queued.add(delta);
    }
    fn shed(&self, reason: &'static str) {
        self.shed.with_label_values(&[reason]).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_gate_reports_in_the_node_metrics() {
        let metrics = Arc::new(Metrics::new());
        let node = NodeSettings {
            max_in_flight: 1,
            max_queue: 0,
            ..NodeSettings::default()
        };
        let gate = gate(&node, Arc::clone(&metrics));
        let held = gate.admit().await.unwrap();
        assert_eq!(metrics.admission_in_flight.get(), 1);
        assert!(gate.admit().await.is_err());
        assert_eq!(metrics.shed.with_label_values(&["queue_full"]).get(), 1);
        assert_eq!(metrics.admission_queued.get(), 0);
        drop(held);
        assert_eq!(metrics.admission_in_flight.get(), 0);
    }
}
