//! How much of the topics is kept, and where a rebuild starts reading.
//!
//! Both follow from `aggregator.retention_days`, the number of UTC days the
//! aggregator keeps (`today − retention_days < day ≤ today + 1`):
//!
//! - **the topics keep** `retention_days + 1` days (`retention.ms`, with
//!   `cleanup.policy=compact,delete`): the oldest kept day started at most
//!   `retention_days` days ago, and the extra day is a margin for clocks
//!   (a record's timestamp is the producer's clock, the day in it Redis');
//! - **a rebuild starts** at the first record written since the start of
//!   day `today − retention_days` (the oldest kept day minus the same day
//!   of margin), found with Kafka's ListOffsets by timestamp
//!   ([`start_offsets`]), not at offset 0. A record written earlier can only
//!   hold a day the aggregator drops anyway (`deltas_ignored_total{reason=
//!   "expired"}`), so skipping it changes no count, and the rebuild reads
//!   what is retained, not what was ever written.
//!
//! Producers stamp every record with its creation time (librdkafka does so
//! by default; tierlimit's producers set it explicitly, see
//! [`record_timestamp_ms`]), so the lookup works on any broker with
//! `message.timestamp.type=CreateTime` (the default).
//!
//! A broker that cannot answer (a timeout, an error, or Kafka's "no record
//! that new": offset −1) gets the partition read from the beginning, as
//! before: never less than the retained data, only more. Tansu 0.6.0
//! answers offset 0 when no record is that new, which means the same.

use std::time::Duration;

use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::day::SECS_PER_DAY;

const DAY_MS: u64 = SECS_PER_DAY * 1000;

/// `retention.ms` of both topics for `retention_days` (see the module doc).
pub fn topic_retention_ms(retention_days: u32) -> u64 {
    (u64::from(retention_days) + 1) * DAY_MS
}

/// Unix ms of the start of UTC day `today − days_back`: records written
/// before it are not needed by a rebuild that keeps `days_back` days
/// (including today) with a day of margin.
pub fn since_ms(today: u32, days_back: u32) -> i64 {
    (u64::from(today.saturating_sub(days_back)) * DAY_MS) as i64
}

/// The timestamp a producer gives a record: now (CreateTime). Explicit, so
/// a rebuild's lookup by timestamp never depends on a client default.
pub fn record_timestamp_ms() -> i64 {
    crate::messages::now_ms() as i64
}

/// Where each partition's rebuild starts, and whether the broker answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub partition: i32,
    /// `Offset::Offset(n)`: the first record at or after the cut-off;
    /// `Offset::Beginning`: the broker could not say.
    pub offset: Offset,
}

impl Start {
    /// The offset as a number, for progress and logs (`Beginning` is 0:
    /// the consumer starts at the low watermark, which is never below).
    pub fn at(&self) -> i64 {
        match self.offset {
            Offset::Offset(n) => n,
            _ => 0,
        }
    }
}

/// Asks the broker, for each of `partitions` of `topic`, the first offset
/// whose record timestamp is at or after `since_ms` (ListOffsets by
/// timestamp). A blocking network call bounded by `timeout`.
///
/// Falls back to `Offset::Beginning` per partition when the lookup fails or
/// answers nothing (−1, or an error for that partition).
pub fn start_offsets<C, K>(
    consumer: &K,
    topic: &str,
    partitions: &[i32],
    since_ms: i64,
    timeout: Duration,
) -> Vec<Start>
where
    C: ConsumerContext,
    K: Consumer<C>,
{
    let beginning = |partition| Start {
        partition,
        offset: Offset::Beginning,
    };
    if partitions.is_empty() {
        return Vec::new();
    }
    let mut query = TopicPartitionList::new();
    for &p in partitions {
        if query
            .add_partition_offset(topic, p, Offset::Offset(since_ms))
            .is_err()
        {
            return partitions.iter().map(|&p| beginning(p)).collect();
        }
    }
    let answer = match consumer.offsets_for_times(query, timeout) {
        Ok(answer) => answer,
        Err(e) => {
            tracing::warn!(topic, error = %e, "offsets by timestamp unavailable; rebuilding from the beginning");
            return partitions.iter().map(|&p| beginning(p)).collect();
        }
    };
    partitions
        .iter()
        .map(|&p| {
            let offset = answer
                .find_partition(topic, p)
                .filter(|e| e.error().is_ok())
                .map(|e| e.offset());
            match offset {
                Some(Offset::Offset(n)) if n >= 0 => Start {
                    partition: p,
                    offset: Offset::Offset(n),
                },
                _ => beginning(p),
            }
        })
        .collect()
}

/// A partition list of `topic` at the given starts, for `assign`.
pub fn assignment(topic: &str, starts: &[Start]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for s in starts {
        // Only an invalid offset can fail here, and `Start` never holds one.
        let _ = tpl.add_partition_offset(topic, s.partition, s.offset);
    }
    tpl
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_keeps_a_day_more_than_the_aggregator() {
        assert_eq!(topic_retention_ms(2), 3 * 86_400_000);
        assert_eq!(topic_retention_ms(1), 2 * 86_400_000);
    }

    #[test]
    fn a_rebuild_starts_at_the_start_of_a_utc_day() {
        let today = 20_000;
        assert_eq!(since_ms(today, 2), 19_998 * 86_400_000);
        assert_eq!(since_ms(today, 0), 20_000 * 86_400_000);
        assert_eq!(since_ms(1, 5), 0);
    }

    #[test]
    fn beginning_reads_as_offset_zero() {
        let s = Start {
            partition: 1,
            offset: Offset::Beginning,
        };
        assert_eq!(s.at(), 0);
        let s = Start {
            partition: 1,
            offset: Offset::Offset(42),
        };
        assert_eq!(s.at(), 42);
        assert_eq!(assignment("t", &[s]).count(), 1);
    }
}
