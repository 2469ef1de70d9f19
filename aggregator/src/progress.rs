//! Which deltas partitions this instance owns, and how far it has re-read each.
//!
//! The topic is the source of truth, so on every assignment the consumer
//! re-reads its partitions from the first record of the retained days, or of
//! the previous period of a configured week or month tier (see
//! [`tierlimit_shared::retention`]). Until a partition has been read
//! up to the high watermark it had when it was assigned, its counters are
//! partial: broadcasting them would move every region's view *backwards*.
//! This module tracks that catch-up, and answers the two questions that depend
//! on it: may a partition's counters be broadcast, and is the instance ready?
//!
//! Pure bookkeeping (no I/O): the consumer reports assignments, watermarks,
//! consumed offsets and end-of-partition events.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

/// Where this instance stands in the consumer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Membership {
    /// No assignment received yet.
    Joining,
    /// Eager rebalance: everything was revoked, the new assignment has not
    /// arrived.
    Rebalancing,
    /// Holding an assignment (possibly empty: more instances than partitions).
    Assigned,
}

/// Catch-up of one assigned partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionProgress {
    pub partition: i32,
    /// Identifies the assignment this entry belongs to, so a watermark fetch
    /// started for an earlier assignment of the same partition is ignored.
    #[serde(skip)]
    pub generation: u64,
    /// Offset the rebuild started at: the first record of the retained
    /// days (0 if read from the beginning).
    pub start: i64,
    /// High watermark at assignment: the offset the rebuild must reach.
    pub target: Option<i64>,
    /// Next offset to read (last consumed + 1).
    pub position: Option<i64>,
    /// Latest high watermark seen (for the lag metric).
    pub high: Option<i64>,
    pub caught_up: bool,
}

impl PartitionProgress {
    /// Messages still to read, when known.
    pub fn lag(&self) -> Option<i64> {
        let high = self.high.or(self.target)?;
        Some((high - self.position.unwrap_or(0)).max(0))
    }
}

/// Whether the instance may be sent traffic, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    NotReady(String),
}

#[derive(Debug)]
pub struct Progress {
    membership: Membership,
    partitions: BTreeMap<i32, PartitionProgress>,
    next_generation: u64,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress {
    pub fn new() -> Self {
        Progress {
            membership: Membership::Joining,
            partitions: BTreeMap::new(),
            next_generation: 1,
        }
    }

    pub fn membership(&self) -> Membership {
        self.membership
    }

    /// Starts (or restarts) the rebuild of `partitions`. Returns the
    /// generation to quote when reporting their watermarks.
    pub fn assign(&mut self, partitions: &[i32]) -> u64 {
        let generation = self.next_generation;
        self.next_generation += 1;
        for &partition in partitions {
            self.partitions.insert(
                partition,
                PartitionProgress {
                    partition,
                    generation,
                    start: 0,
                    target: None,
                    position: None,
                    high: None,
                    caught_up: false,
                },
            );
        }
        self.membership = Membership::Assigned;
        generation
    }

    /// Records where the rebuild of a just assigned partition starts.
    pub fn set_start(&mut self, partition: i32, start: i64) {
        if let Some(p) = self.partitions.get_mut(&partition) {
            p.start = start.max(0);
        }
    }

    /// Forgets `partitions` (incremental revocation).
    pub fn revoke(&mut self, partitions: &[i32]) {
        for p in partitions {
            self.partitions.remove(p);
        }
    }

    /// Forgets every partition until the next assignment (eager revocation).
    pub fn revoke_all(&mut self) -> Vec<i32> {
        self.membership = Membership::Rebalancing;
        std::mem::take(&mut self.partitions).into_keys().collect()
    }

    pub fn is_assigned(&self, partition: i32) -> bool {
        self.partitions.contains_key(&partition)
    }

    pub fn is_caught_up(&self, partition: i32) -> bool {
        self.partitions.get(&partition).is_some_and(|p| p.caught_up)
    }

    pub fn caught_up_partitions(&self) -> Vec<i32> {
        self.partitions
            .values()
            .filter(|p| p.caught_up)
            .map(|p| p.partition)
            .collect()
    }

    pub fn assigned_partitions(&self) -> Vec<i32> {
        self.partitions.keys().copied().collect()
    }

    /// Partitions whose target is still unknown (the watermark fetch failed
    /// or has not returned), with their generation.
    pub fn missing_targets(&self) -> Vec<(i32, u64)> {
        self.partitions
            .values()
            .filter(|p| p.target.is_none() && !p.caught_up)
            .map(|p| (p.partition, p.generation))
            .collect()
    }

    pub fn partitions(&self) -> impl Iterator<Item = &PartitionProgress> {
        self.partitions.values()
    }

    /// Records the watermarks fetched right after assignment. Returns `true`
    /// when this makes the partition caught up (it is empty, or was already
    /// read that far).
    pub fn set_target(&mut self, partition: i32, generation: u64, low: i64, high: i64) -> bool {
        let Some(p) = self.partitions.get_mut(&partition) else {
            return false;
        };
        if p.generation != generation || p.target.is_some() {
            return false;
        }
        p.target = Some(high);
        p.high = Some(p.high.map_or(high, |h| h.max(high)));
        // The rebuild starts at its start offset, or at the low watermark
        // if that is later (older offsets were deleted or compacted away).
        if p.position.is_none() {
            p.position = Some(low.max(p.start));
        }
        Self::check(p)
    }

    /// Records a consumed message. Returns `true` when it completes the
    /// catch-up.
    pub fn consumed(&mut self, partition: i32, offset: i64) -> bool {
        let Some(p) = self.partitions.get_mut(&partition) else {
            return false;
        };
        p.position = Some(p.position.map_or(offset + 1, |pos| pos.max(offset + 1)));
        Self::check(p)
    }

    /// Records that the fetcher reached the end of the partition. Everything
    /// that existed when the partition was assigned has then been read (this
    /// also covers a log whose last offsets are transaction markers, which
    /// the position of consumed messages never passes).
    pub fn reached_end(&mut self, partition: i32) -> bool {
        let Some(p) = self.partitions.get_mut(&partition) else {
            return false;
        };
        if p.caught_up {
            return false;
        }
        p.caught_up = true;
        true
    }

    /// Records a fresh high watermark (periodic lag refresh).
    pub fn set_high(&mut self, partition: i32, high: i64) {
        if let Some(p) = self.partitions.get_mut(&partition) {
            p.high = Some(high);
        }
    }

    fn check(p: &mut PartitionProgress) -> bool {
        if p.caught_up {
            return false;
        }
        match (p.target, p.position) {
            (Some(target), Some(pos)) if pos >= target => {
                p.caught_up = true;
                true
            }
            _ => false,
        }
    }

    pub fn readiness(&self) -> Readiness {
        match self.membership {
            Membership::Joining => {
                return Readiness::NotReady(
                    "waiting for a partition assignment from the consumer group".into(),
                )
            }
            Membership::Rebalancing => {
                return Readiness::NotReady("consumer group rebalance in progress".into())
            }
            Membership::Assigned => {}
        }
        let behind: Vec<&PartitionProgress> =
            self.partitions.values().filter(|p| !p.caught_up).collect();
        if behind.is_empty() {
            return Readiness::Ready;
        }
        let mut reason = String::from("rebuilding from the deltas topic: ");
        for (i, p) in behind.iter().enumerate() {
            if i > 0 {
                reason.push_str(", ");
            }
            let _ = match (p.position, p.target) {
                (Some(pos), Some(target)) => write!(
                    reason,
                    "partition {} at offset {pos} of {target}",
                    p.partition
                ),
                _ => write!(
                    reason,
                    "partition {} (high watermark not yet known)",
                    p.partition
                ),
            };
        }
        Readiness::NotReady(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_ready_before_assignment_and_during_rebalance() {
        let mut p = Progress::new();
        assert!(matches!(p.readiness(), Readiness::NotReady(_)));
        p.assign(&[]);
        // An empty assignment (more instances than partitions) is ready.
        assert_eq!(p.readiness(), Readiness::Ready);
        p.revoke_all();
        assert_eq!(p.membership(), Membership::Rebalancing);
        assert!(matches!(p.readiness(), Readiness::NotReady(r) if r.contains("rebalance")));
    }

    #[test]
    fn catches_up_at_the_target() {
        let mut p = Progress::new();
        let g = p.assign(&[0, 1]);
        // Messages may arrive before the watermark fetch returns.
        assert!(!p.consumed(0, 0));
        assert!(!p.set_target(0, g, 0, 3));
        assert!(!p.consumed(0, 1));
        assert!(p.consumed(0, 2));
        assert!(p.is_caught_up(0));
        // Partition 1 is empty: caught up as soon as the target is known.
        assert!(matches!(p.readiness(), Readiness::NotReady(r) if r.contains("partition 1")));
        assert!(p.set_target(1, g, 5, 5));
        assert_eq!(p.readiness(), Readiness::Ready);
        assert_eq!(p.caught_up_partitions(), vec![0, 1]);
    }

    #[test]
    fn target_already_passed_when_it_arrives() {
        let mut p = Progress::new();
        let g = p.assign(&[0]);
        p.consumed(0, 9);
        assert!(p.set_target(0, g, 0, 10));
    }

    #[test]
    fn a_rebuild_from_the_retained_start_is_caught_up_from_there() {
        let mut p = Progress::new();
        let g = p.assign(&[0, 1]);
        p.set_start(0, 7);
        p.set_start(1, 2);
        // Partition 0: nothing retained after offset 7 but 3 records.
        assert!(!p.set_target(0, g, 0, 10));
        assert_eq!(p.partitions().next().unwrap().lag(), Some(3));
        assert!(!p.consumed(0, 8));
        assert!(p.consumed(0, 9));
        // Partition 1: the low watermark (5) is past the start (2), and
        // is the high watermark: empty, caught up at once.
        assert!(p.set_target(1, g, 5, 5));
        assert_eq!(p.readiness(), Readiness::Ready);
    }

    #[test]
    fn end_of_partition_catches_up() {
        let mut p = Progress::new();
        p.assign(&[2]);
        assert!(p.reached_end(2));
        assert!(!p.reached_end(2));
        assert!(p.is_caught_up(2));
        assert!(!p.reached_end(7), "unassigned partitions are ignored");
    }

    #[test]
    fn stale_watermarks_are_ignored() {
        let mut p = Progress::new();
        let old = p.assign(&[0]);
        p.revoke_all();
        let new = p.assign(&[0]);
        assert!(!p.set_target(0, old, 0, 0));
        assert!(!p.is_caught_up(0));
        assert_eq!(p.missing_targets(), vec![(0, new)]);
        assert!(p.set_target(0, new, 0, 0));
        assert!(p.missing_targets().is_empty());
    }

    #[test]
    fn reassignment_restarts_the_rebuild() {
        let mut p = Progress::new();
        let g = p.assign(&[0]);
        p.set_target(0, g, 0, 1);
        p.consumed(0, 0);
        assert!(p.is_caught_up(0));
        p.assign(&[0]);
        assert!(!p.is_caught_up(0));
    }

    #[test]
    fn lag() {
        let mut p = Progress::new();
        let g = p.assign(&[0]);
        p.set_target(0, g, 4, 10);
        let lag = |p: &Progress| p.partitions().next().unwrap().lag();
        assert_eq!(lag(&p), Some(6));
        p.consumed(0, 7);
        p.set_high(0, 20);
        assert_eq!(lag(&p), Some(12));
        p.revoke(&[0]);
        assert!(p.partitions().next().is_none());
    }
}
