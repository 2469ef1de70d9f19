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
//! **Period tiers** (hour, week, calendar month: `shared/src/period.rs`)
//! widen both. A counter is cumulative per actor, so a rebuild must see
//! every actor's *latest* delta of each period it keeps, and a month
//! counter's latest delta of an actor may be weeks old (a tenant that spent
//! its month on the 2nd and nothing since). So with a tier of kind K in the
//! configuration, a rebuild starts no later than the start of K's previous
//! period ([`rebuild_since_ms`]: a month tier on the 20th reads from the
//! 1st of the previous month), and the topics keep at least two of K's
//! longest periods plus a day of margin ([`topic_retention_ms_for`]: ~63
//! days for a month tier, 15 for a week). Compaction is not relied on: it
//! keeps the latest record per key, which would be enough, but Kafka never
//! compacts the active segment and Tansu's compaction is not something to
//! count on; retention by time alone keeps what a rebuild needs. The cost:
//! a rebuild reads every delta written since that start, which grows with
//! the days into the month (day-only configurations read what they did).
//!
//! A broker that cannot answer (a timeout, an error, or Kafka's "no record
//! that new": offset −1) gets the partition read from the beginning, as
//! before: never less than the retained data, only more. Tansu 0.6.0
//! answers offset 0 when no record is that new, which means the same.

use std::time::Duration;

use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::config::Config;
use crate::day::SECS_PER_DAY;
use crate::period::PeriodKind;

const DAY_MS: u64 = SECS_PER_DAY * 1000;

/// `retention.ms` of both topics for `retention_days` (see the module doc),
/// with day tiers only.
pub fn topic_retention_ms(retention_days: u32) -> u64 {
    (u64::from(retention_days) + 1) * DAY_MS
}

/// `retention.ms` of both topics for `retention_days` and tiers of `kinds`:
/// the day's [`topic_retention_ms`], or, if longer, two of the longest
/// periods of a kind in use (its previous period may have started that long
/// ago) plus a day of margin (producers' clocks; a broker deletes whole
/// segments, never earlier than this). A month tier: 2 × 31 + 1 = 63 days.
pub fn topic_retention_ms_for(retention_days: u32, kinds: &[PeriodKind]) -> u64 {
    kinds
        .iter()
        .map(|k| 2 * k.max_len_ms() + DAY_MS)
        .fold(topic_retention_ms(retention_days), u64::max)
}

/// The global tier kinds a configuration uses: the day always (every
/// tenant's counter), and each other kind a plan or a tenant names, hour →
/// month. What [`rebuild_since_ms`] and [`topic_retention_ms_for`] must
/// cover.
pub fn kinds_in_use(config: &Config) -> Vec<PeriodKind> {
    let tables: Vec<_> = config
        .plans
        .values()
        .filter_map(|p| p.global.as_ref())
        .chain(config.tenants.values().filter_map(|t| t.global.as_ref()))
        .collect();
    PeriodKind::ALL
        .into_iter()
        .filter(|k| *k == PeriodKind::Day || tables.iter().any(|g| g.of(*k).is_some()))
        .collect()
}

/// How much earlier than [`rebuild_since_ms`] a rebuild starts when some
/// plan or tenant counts in a time zone: a zone's period starts up to 14
/// hours before the UTC one of the same date (Pacific/Kiritimati, +14),
/// so its previous period does too. 0 when every tier is UTC's.
pub fn zone_margin_ms(config: &Config) -> i64 {
    let zoned = |z: &Option<String>| {
        z.as_deref()
            .is_some_and(|z| !crate::zone::Zone::named(z).is_ok_and(crate::zone::Zone::is_utc))
    };
    let any = config.plans.values().any(|p| zoned(&p.time_zone))
        || config.tenants.values().any(|t| zoned(&t.time_zone));
    if any {
        14 * 3_600_000
    } else {
        0
    }
}

/// Where a rebuild of the deltas (or of a view of the broadcasts) starts,
/// at wall-clock `now_ms`: the earliest of [`since_ms`] for `days_back`
/// days and the start of the previous period of every kind of `kinds` (an
/// actor's latest delta of a period still kept may date from its first
/// hour). Day-only configurations start where they always did.
pub fn rebuild_since_ms(now_ms: u64, days_back: u32, kinds: &[PeriodKind]) -> i64 {
    let today = PeriodKind::Day.at(now_ms).index;
    kinds
        .iter()
        .filter(|k| **k != PeriodKind::Day)
        .map(|k| k.at(now_ms).prev().start_ms().max(0))
        .fold(since_ms(today, days_back), i64::min)
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

    fn ms(y: i64, m: u32, d: u32) -> u64 {
        crate::period::days_from_civil(y, m, d) as u64 * DAY_MS
    }

    #[test]
    fn a_month_tier_rebuilds_from_the_previous_month() {
        let day = [PeriodKind::Day];
        let all = PeriodKind::ALL;
        // The 20th of November, 10:00.
        let now = ms(2026, 11, 20) + 10 * 3_600_000;
        let today = PeriodKind::Day.at(now).index;
        // Day only: as before.
        assert_eq!(rebuild_since_ms(now, 2, &day), since_ms(today, 2));
        // A week tier: the previous ISO week's Monday (2026-11-09).
        let week = [PeriodKind::Day, PeriodKind::Week];
        assert_eq!(rebuild_since_ms(now, 2, &week), ms(2026, 11, 9) as i64);
        // A month tier: October 1st, whatever else is in use.
        assert_eq!(rebuild_since_ms(now, 2, &all), ms(2026, 10, 1) as i64);
        // A long day retention can reach further back than a week tier.
        assert_eq!(rebuild_since_ms(now, 31, &week), since_ms(today, 31));
        // January: the previous month is last year's December.
        let jan = ms(2027, 1, 3);
        assert_eq!(rebuild_since_ms(jan, 2, &all), ms(2026, 12, 1) as i64);
        // Topics keep two longest months and a day; an hour tier adds
        // nothing to the day's.
        assert_eq!(topic_retention_ms_for(2, &all), 63 * DAY_MS);
        assert_eq!(topic_retention_ms_for(2, &week), 15 * DAY_MS);
        assert_eq!(
            topic_retention_ms_for(2, &[PeriodKind::Day, PeriodKind::Hour]),
            topic_retention_ms(2)
        );
        assert_eq!(topic_retention_ms_for(31, &day), topic_retention_ms(31));
        // The retention covers the rebuild's start at any time of the month.
        let start = rebuild_since_ms(ms(2026, 12, 31) + DAY_MS - 1, 2, &all);
        assert!(
            (ms(2026, 12, 31) + DAY_MS - 1) as i64 - start < topic_retention_ms_for(2, &all) as i64
        );
    }

    #[test]
    fn kinds_in_use_come_from_plans_and_tenants() {
        let base = r#"
cluster = "test"
[kafka]
brokers = "127.0.0.1:1"
[regions.eu]
redis_url = "redis://127.0.0.1:6379"
[plans.small]
global = { limit = 100 }
[tenants.acme]
plan = "small"
[wire]
accept_unsigned = true
"#;
        let c = Config::from_toml(base).unwrap().config;
        assert_eq!(kinds_in_use(&c), [PeriodKind::Day]);
        let text = base.replace(
            "[tenants.acme]\nplan = \"small\"",
            "[tenants.acme]\nplan = \"small\"\nglobal = { month = 1000 }\n[plans.h]\nglobal = { hour = 5 }",
        );
        let c = Config::from_toml(&text).unwrap().config;
        assert_eq!(
            kinds_in_use(&c),
            [PeriodKind::Hour, PeriodKind::Day, PeriodKind::Month]
        );
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
