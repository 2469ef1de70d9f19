//! What a topic carried between two points: end offsets (watermarks) per
//! partition, and the records between two sets of offsets read back and
//! counted (key and value bytes, by wire-v2 kind). The bench reads
//! `tierlimit.global` this way to say what every region-node's follower
//! read: a follower reads every partition of it.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

/// Records and bytes (key + value, as the client hands them over; the
/// protocol's batch framing is not counted) of one stretch of a topic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Traffic {
    pub records: u64,
    pub bytes: u64,
    /// Global updates (broadcasts): v2 kind 2, or v1 JSON.
    pub broadcasts: u64,
    pub broadcast_bytes: u64,
    /// v2 kind 3.
    pub heartbeats: u64,
    pub heartbeat_bytes: u64,
}

impl Traffic {
    /// Counts one record.
    pub fn add(&mut self, key: Option<&[u8]>, value: Option<&[u8]>) {
        let value = value.unwrap_or_default();
        let n = (key.map_or(0, <[u8]>::len) + value.len()) as u64;
        self.records += 1;
        self.bytes += n;
        match tierlimit_shared::wire::codec::kind_of(value) {
            Some(k) if k == tierlimit_shared::wire::codec::Kind::Heartbeat as u8 => {
                self.heartbeats += 1;
                self.heartbeat_bytes += n;
            }
            Some(k) if k == tierlimit_shared::wire::codec::Kind::Global as u8 => {
                self.broadcasts += 1;
                self.broadcast_bytes += n;
            }
            None if value.first() == Some(&b'{') => {
                self.broadcasts += 1;
                self.broadcast_bytes += n;
            }
            _ => {}
        }
    }

    pub fn plus(self, o: Traffic) -> Traffic {
        Traffic {
            records: self.records + o.records,
            bytes: self.bytes + o.bytes,
            broadcasts: self.broadcasts + o.broadcasts,
            broadcast_bytes: self.broadcast_bytes + o.broadcast_bytes,
            heartbeats: self.heartbeats + o.heartbeats,
            heartbeat_bytes: self.heartbeat_bytes + o.heartbeat_bytes,
        }
    }
}

fn consumer(brokers: &str) -> anyhow::Result<BaseConsumer> {
    let mut cc = testkit::tansu::client_config(brokers);
    cc.set("group.id", "tierlimit-bench-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    cc.create().context("Kafka consumer")
}

/// The end offset of every partition of `topic` (blocking).
pub fn end_offsets(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<Vec<i64>> {
    let c = consumer(brokers)?;
    (0..partitions)
        .map(|p| {
            c.fetch_watermarks(topic, p, Duration::from_secs(10))
                .map(|(_, high)| high)
                .with_context(|| format!("watermarks of {topic}/{p}"))
        })
        .collect()
}

/// Reads `topic` from `from` to `to` (per partition, end exclusive) and
/// counts the records below `split` (per partition) and from it on apart:
/// two stretches of one run in one pass (blocking, bounded by `deadline`).
pub fn read_stretches(
    brokers: &str,
    topic: &str,
    from: &[i64],
    split: &[i64],
    to: &[i64],
    deadline: Duration,
) -> anyhow::Result<(Traffic, Traffic)> {
    let c = consumer(brokers)?;
    let mut tpl = TopicPartitionList::new();
    let mut left = 0i64;
    for (p, (f, t)) in from.iter().zip(to).enumerate() {
        if t > f {
            tpl.add_partition_offset(topic, p as i32, Offset::Offset(*f))?;
            left += t - f;
        }
    }
    let (mut first, mut second) = (Traffic::default(), Traffic::default());
    if left == 0 {
        return Ok((first, second));
    }
    c.assign(&tpl)?;
    let started = Instant::now();
    while left > 0 {
        if started.elapsed() > deadline {
            bail!("{left} records of {topic} still unread after {deadline:?}");
        }
        let Some(m) = c.poll(Duration::from_millis(500)) else {
            continue;
        };
        let m = m.with_context(|| format!("read {topic}"))?;
        let p = m.partition() as usize;
        if m.offset() >= to[p] {
            continue;
        }
        left -= 1;
        if m.offset() < split[p] {
            first.add(m.key(), m.payload());
        } else {
            second.add(m.key(), m.payload());
        }
    }
    Ok((first, second))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierlimit_shared::wire::codec::{self, Auth, Heartbeat};

    #[test]
    fn records_are_counted_by_kind() {
        let hb = codec::seal(
            codec::heartbeat_body(
                codec::V3,
                &Heartbeat {
                    partition: 1,
                    deltas_offset: 2,
                    limits_version: 0,
                    ts_ms: 3,
                },
            ),
            &Auth::None,
        );
        let mut t = Traffic::default();
        t.add(Some(b"~heartbeat|1"), Some(&hb));
        t.add(Some(b"t|1"), Some(b"{\"v\":1}"));
        t.add(Some(b"t|1"), Some(&[codec::V2, 2, 0]));
        t.add(None, None);
        assert_eq!(t.records, 4);
        assert_eq!(t.heartbeats, 1);
        assert_eq!(t.heartbeat_bytes, (12 + hb.len()) as u64);
        assert_eq!(t.broadcasts, 2);
        assert_eq!(t.broadcast_bytes, 3 + 7 + 3 + 3);
        assert_eq!(t.bytes, t.heartbeat_bytes + t.broadcast_bytes);
        assert_eq!(t.plus(t).records, 8);
    }
}
