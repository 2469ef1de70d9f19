//! Which limits version every region-node has applied: "has version V
//! reached every node of every region?".
//!
//! Nodes write a signed status record (`NodeStatus`: region, node, applied
//! version) to every partition of the deltas topic each
//! `limits.status_interval`, so every aggregator hears every node whatever
//! partitions it owns. A node is *current* at V when it reported a version
//! ≥ V; *lagging* when it has stayed below the newest version this
//! aggregator applied for longer than `limits.lag_alert_after`; *gone*
//! when it has not reported for [`GONE_AFTER`] (a stopped node does not
//! hold a change back; it is listed apart).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use tierlimit_shared::wire::NodeStatus;

/// A node not heard from for this long is listed as gone.
pub const GONE_AFTER: Duration = Duration::from_secs(60);

/// Versions remembered with the time this aggregator applied them.
const APPLIED_KEPT: usize = 4096;

#[derive(Debug, Clone)]
struct Seen {
    version: u64,
    following: bool,
    /// The node's clock when it wrote its latest status.
    ts_ms: u64,
    /// This aggregator's clock when it read it.
    heard_ms: u64,
}

/// Node statuses and the times versions were applied here.
#[derive(Default)]
pub struct Nodes {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    nodes: BTreeMap<(String, String), Seen>,
    /// (version, when this aggregator applied it), oldest first.
    applied: VecDeque<(u64, u64)>,
}

/// One node in a [`Report`].
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NodeReport {
    pub region: String,
    pub node: String,
    pub applied_version: u64,
    pub following: bool,
    /// Since the node's latest status was read, ms.
    pub heard_ms_ago: u64,
    pub state: &'static str,
    /// How long the node has been behind the newest version, ms (0: not).
    pub behind_ms: u64,
}

/// The answer of `GET /v1/limits/status`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The version asked about (default: the newest this aggregator
    /// applied).
    pub version: u64,
    /// The newest version this aggregator applied.
    pub newest: u64,
    /// Every node heard recently has applied `version`.
    pub reached: bool,
    pub nodes: Vec<NodeReport>,
    /// Heard recently and below `version`.
    pub behind: Vec<String>,
    /// Below the newest version for longer than `limits.lag_alert_after`.
    pub lagging: Vec<String>,
    pub gone: Vec<String>,
}

impl Nodes {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A node's status, read at `now_ms`. Statuses of one node may arrive
    /// through several partitions in any order: the newest by its clock
    /// wins.
    pub fn heard(&self, s: &NodeStatus, now_ms: u64) {
        let mut inner = self.inner();
        let entry = inner
            .nodes
            .entry((s.region.clone(), s.node.clone()))
            .or_insert(Seen {
                version: 0,
                following: false,
                ts_ms: 0,
                heard_ms: 0,
            });
        if s.ts_ms >= entry.ts_ms {
            entry.version = s.limits_version;
            entry.following = s.following;
            entry.ts_ms = s.ts_ms;
        }
        entry.heard_ms = entry.heard_ms.max(now_ms);
    }

    /// This aggregator applied `version` at `now_ms`.
    pub fn applied(&self, version: u64, now_ms: u64) {
        let mut inner = self.inner();
        if inner.applied.back().is_some_and(|(v, _)| *v >= version) {
            return;
        }
        if inner.applied.len() == APPLIED_KEPT {
            inner.applied.pop_front();
        }
        inner.applied.push_back((version, now_ms));
    }

    pub fn report(&self, version: Option<u64>, lag_after: Duration, now_ms: u64) -> Report {
        let inner = self.inner();
        let newest = inner.applied.back().map_or(0, |(v, _)| *v);
        let version = version.unwrap_or(newest);
        // When this aggregator first knew of a version above `v`.
        let behind_since = |v: u64| {
            inner
                .applied
                .iter()
                .find(|(applied, _)| *applied > v)
                .map(|(_, at)| *at)
        };
        let mut report = Report {
            version,
            newest,
            reached: true,
            nodes: Vec::new(),
            behind: Vec::new(),
            lagging: Vec::new(),
            gone: Vec::new(),
        };
        for ((region, node), seen) in &inner.nodes {
            let name = format!("{region}/{node}");
            let heard_ms_ago = now_ms.saturating_sub(seen.heard_ms);
            let behind_ms = behind_since(seen.version).map_or(0, |at| now_ms.saturating_sub(at));
            let state = if heard_ms_ago > GONE_AFTER.as_millis() as u64 {
                report.gone.push(name);
                "gone"
            } else {
                if seen.version < version {
                    report.reached = false;
                    report.behind.push(name.clone());
                }
                if seen.version < newest && behind_ms > lag_after.as_millis() as u64 {
                    report.lagging.push(name);
                    "lagging"
                } else if seen.version < newest {
                    "behind"
                } else {
                    "current"
                }
            };
            report.nodes.push(NodeReport {
                region: region.clone(),
                node: node.clone(),
                applied_version: seen.version,
                following: seen.following,
                heard_ms_ago,
                state,
                behind_ms,
            });
        }
        report
    }
}

/// The aggregator's side of following the limits topic: metrics, and the
/// time each version was applied here (what "lagging" is measured from).
/// Counters need nothing: since wire v3 each is judged under the limit its
/// deltas carry (`merge::Carried`), which nodes take from the same topic.
pub struct AggregatorHooks {
    pub state: std::sync::Arc<crate::state::State>,
    pub table: std::sync::Arc<tierlimit_shared::limits::LimitsTable>,
}

impl tierlimit_shared::limits::follow::Hooks for AggregatorHooks {
    fn outcome(&self, outcome: &'static str) {
        let m = &self.state.metrics.limits;
        m.records.with_label_values(&[outcome]).inc();
        self.state.nodes.applied(
            self.table.applied_version(),
            tierlimit_shared::messages::now_ms(),
        );
    }

    fn applied(&self, event: &tierlimit_shared::limits::follow::Event<'_>) {
        self.state
            .limits_history
            .record(event.record, event.previous_version);
    }

    fn caught_up(&self, table: &tierlimit_shared::limits::LimitsTable) {
        self.state.metrics.limits.observe(table);
    }

    fn following(&self, up: bool) {
        self.state.metrics.limits.following.set(i64::from(up));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(node: &str, version: u64, ts_ms: u64) -> NodeStatus {
        NodeStatus {
            published_before_ms: Default::default(),
            region: "eu".into(),
            node: node.into(),
            limits_version: version,
            following: true,
            ts_ms,
        }
    }

    #[test]
    fn a_version_reaches_every_node_and_laggards_are_named() {
        let nodes = Nodes::default();
        let lag = Duration::from_secs(30);
        nodes.applied(5, 1_000);
        nodes.heard(&status("a", 5, 1_000), 1_000);
        nodes.heard(&status("b", 5, 1_000), 1_000);
        let r = nodes.report(None, lag, 2_000);
        assert!(r.reached);
        assert_eq!((r.version, r.newest), (5, 5));
        nodes.applied(9, 3_000);
        nodes.heard(&status("a", 9, 3_100), 3_100);
        let r = nodes.report(None, lag, 4_000);
        assert!(!r.reached);
        assert_eq!(r.behind, vec!["eu/b"]);
        assert!(r.lagging.is_empty(), "behind for 1 s only");
        assert!(nodes.report(Some(5), lag, 4_000).reached, "5 reached both");
        // Still behind 31 s after version 9 was applied here: lagging.
        nodes.heard(&status("b", 5, 34_000), 34_000);
        nodes.heard(&status("a", 9, 34_000), 34_000);
        let r = nodes.report(None, lag, 34_100);
        assert_eq!(r.lagging, vec!["eu/b"]);
        // An older status read later does not move a node back.
        nodes.heard(&status("a", 5, 2_000), 34_200);
        assert_eq!(nodes.report(None, lag, 34_300).nodes[0].applied_version, 9);
        // A node silent past GONE_AFTER no longer holds a version back.
        let r = nodes.report(None, lag, 34_000 + 61_000);
        assert_eq!(r.gone.len(), 2);
        assert!(r.reached);
    }
}
