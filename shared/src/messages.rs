//! Wire messages on the two Kafka topics, as versioned JSON.
//!
//! JSON rather than a binary format: the messages are small, few (one per
//! dirty tenant and flush, not per request) and an operator can read them
//! with any Kafka tool. `"v": 1` lets a future format coexist during a
//! rolling upgrade; a consumer skips (and counts) versions it does not know.
//!
//! Deltas carry the actor's **cumulative** P and N, never increments, so any
//! duplicate, replay or reordering merges to the same state (max per actor).

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::period::Period;

/// v1 JSON names a period by its `day` (v1 has only UTC days): a period of
/// another kind cannot be written as v1 (the producer refuses: `wire.version
/// = 1` with a non-day global tier is a configuration error).
mod v1_day {
    use super::Period;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(p: &Period, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(p.index)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Period, D::Error> {
        Ok(Period::day(u32::deserialize(d)?))
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The only message version this build writes and reads.
pub const VERSION: u32 = 1;

/// One region actor's cumulative counts for (tenant, day), on the deltas topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    pub v: u32,
    pub tenant: String,
    /// The counter's period (a UTC day number in v1's `day`).
    #[serde(rename = "day", with = "v1_day")]
    pub period: Period,
    /// `"{region}/{epoch}"`.
    pub actor: String,
    /// Cumulative allowed cost.
    pub p: u64,
    /// Cumulative refunded cost (never above `p`).
    pub n: u64,
    /// Wall-clock ms when the delta was produced (for lag metrics only).
    pub ts_ms: u64,
    /// The region-node that published it. Part of the Kafka key, so that on
    /// a compacted topic the last message per key is one publisher's latest,
    /// hence its highest, value (see [`Delta::key`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The global limit of this period's tier that the node enforced when it
    /// last charged the counter (wire v3; `None`: no tier of this kind, or
    /// an older writer). The aggregator takes the limit from here, so it
    /// needs no tenant table to know when a tenant is near or over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// The version of the limits the node enforced under (wire v3; 0 from
    /// an older writer).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub limits_version: u64,
}

/// One actor's part in a global total.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorPart {
    pub actor: String,
    pub p: u64,
    pub n: u64,
}

impl ActorPart {
    /// Region name of the actor (`"eu-west/abc" → "eu-west"`).
    pub fn region(&self) -> &str {
        actor_region(&self.actor)
    }
    pub fn net(&self) -> u64 {
        self.p.saturating_sub(self.n)
    }
}

/// The aggregator's merged view of (tenant, day), on the global topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalUpdate {
    pub v: u32,
    pub tenant: String,
    #[serde(rename = "day", with = "v1_day")]
    pub period: Period,
    /// Σ P − Σ N over all actors.
    pub total: u64,
    pub parts: Vec<ActorPart>,
    /// The tenant's global limit per day, if it has one.
    pub limit: Option<u64>,
    pub over_limit: bool,
    pub ts_ms: u64,
    /// The limits version the aggregator judged `limit` under (wire v3).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub limits_version: u64,
}

#[derive(Debug, Error)]
pub enum DecodeError {
    #[error("not JSON of the expected shape: {0}")]
    Json(#[from] serde_json::Error),
    #[error("unsupported message version {0}")]
    Version(u32),
    #[error("invalid field: {0}")]
    Field(String),
}

/// Region part of an actor id.
pub fn actor_region(actor: &str) -> &str {
    actor.split_once('/').map(|(r, _)| r).unwrap_or(actor)
}

/// Builds an actor id.
pub fn actor(region: &str, epoch: &str) -> String {
    format!("{region}/{epoch}")
}

fn check_actor(actor: &str) -> Result<(), DecodeError> {
    match actor.split_once('/') {
        Some((r, e))
            if crate::validate::name("region", r).is_ok()
                && crate::validate::name("epoch", e).is_ok() =>
        {
            Ok(())
        }
        _ => Err(DecodeError::Field(format!(
            "actor {actor:?} is not region/epoch"
        ))),
    }
}

impl Delta {
    /// A delta of the UTC day `day` (see [`Delta::of`] for other periods).
    pub fn new(tenant: &str, day: u32, actor: String, p: u64, n: u64, ts_ms: u64) -> Self {
        Delta::of(tenant, Period::day(day), actor, p, n, ts_ms)
    }

    pub fn of(tenant: &str, period: Period, actor: String, p: u64, n: u64, ts_ms: u64) -> Self {
        Delta {
            v: VERSION,
            tenant: tenant.into(),
            period,
            actor,
            p,
            n,
            ts_ms,
            node: None,
            limit: None,
            limits_version: 0,
        }
    }

    /// Marks the delta as published by `node`.
    pub fn from_node(mut self, node: &str) -> Self {
        self.node = Some(node.to_string());
        self
    }

    /// Kafka key: `tenant|period|actor|node` (or `tenant|period|actor`
    /// without a node), the period by its label: a UTC day's is the bare
    /// day number, so a day counter's key is the same in every version.
    ///
    /// Why the node: compaction keeps the *latest* message per key, not the
    /// largest. Several nodes of a region publish the same actor, and their
    /// messages may reach Kafka in any order, so with a per-actor key a lower
    /// value could be the one compaction keeps. One node's values for an
    /// actor only grow and go through one producer in order (one request in flight), so
    /// per (actor, node) the latest message is also the largest, and the
    /// aggregator's max over all of them is the truth.
    pub fn key(&self) -> String {
        let period = self.period.label();
        match &self.node {
            Some(node) => format!("{}|{}|{}|{}", self.tenant, period, self.actor, node),
            None => format!("{}|{}|{}", self.tenant, period, self.actor),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a Delta always serializes")
    }

    /// Decodes and validates; anything else is an undecodable message.
    pub fn decode(bytes: &[u8]) -> Result<Delta, DecodeError> {
        let d: Delta = serde_json::from_slice(bytes)?;
        if d.v != VERSION {
            return Err(DecodeError::Version(d.v));
        }
        crate::validate::tenant(&d.tenant).map_err(|e| DecodeError::Field(e.to_string()))?;
        check_actor(&d.actor)?;
        if d.n > d.p {
            return Err(DecodeError::Field(format!("n {} exceeds p {}", d.n, d.p)));
        }
        Ok(d)
    }
}

impl GlobalUpdate {
    /// Kafka key: `tenant|period` (a day's period label is the bare day).
    pub fn key(&self) -> String {
        format!("{}|{}", self.tenant, self.period.label())
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a GlobalUpdate always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Result<GlobalUpdate, DecodeError> {
        let g: GlobalUpdate = serde_json::from_slice(bytes)?;
        if g.v != VERSION {
            return Err(DecodeError::Version(g.v));
        }
        crate::validate::tenant(&g.tenant).map_err(|e| DecodeError::Field(e.to_string()))?;
        for p in &g.parts {
            check_actor(&p.actor)?;
            // As in a delta and in wire v2: N counts refunds of what P
            // charged, so it is never above P. (Found by the broadcast
            // fuzz target: v1 updates, read in upgrade mode, let it pass.)
            if p.n > p.p {
                return Err(DecodeError::Field(format!(
                    "part {}: n {} exceeds p {}",
                    p.actor, p.n, p.p
                )));
            }
        }
        Ok(g)
    }
}

/// The partition of a tenant: FNV-1a (64-bit) of its id modulo the partition
/// count. Chosen explicitly (not librdkafka's default partitioner) so that
/// every tenant's deltas from every region land on one partition, owned by
/// one aggregator, whatever client or language produced them.
pub fn partition_of(tenant: &str, partitions: i32) -> i32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tenant.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % partitions.max(1) as u64) as i32
}

/// Wall-clock milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_round_trip_and_key() {
        let d = Delta::new("acme", 20_000, actor("eu", "abc123"), 10, 2, 5);
        assert_eq!(d.key(), "acme|20000|eu/abc123");
        assert_eq!(Delta::decode(&d.encode()).unwrap(), d);
        let d = d.from_node("eu-1");
        assert_eq!(d.key(), "acme|20000|eu/abc123|eu-1");
        assert_eq!(Delta::decode(&d.encode()).unwrap(), d);
    }

    #[test]
    fn rejects_bad_deltas() {
        assert!(matches!(Delta::decode(b"nope"), Err(DecodeError::Json(_))));
        let mut d = Delta::new("acme", 1, actor("eu", "e"), 1, 0, 0);
        d.v = 2;
        assert!(matches!(
            Delta::decode(&d.encode()),
            Err(DecodeError::Version(2))
        ));
        let d = Delta::new("ac:me", 1, actor("eu", "e"), 1, 0, 0);
        assert!(Delta::decode(&d.encode()).is_err());
        let d = Delta::new("acme", 1, "noslash".into(), 1, 0, 0);
        assert!(Delta::decode(&d.encode()).is_err());
        let d = Delta::new("acme", 1, actor("eu", "e"), 1, 2, 0);
        assert!(Delta::decode(&d.encode()).is_err());
    }

    /// Regression (fuzz/regressions/broadcast/): a v1 update whose part
    /// refunds more than it charged was accepted, unlike a delta or a v2
    /// update.
    #[test]
    fn rejects_updates_with_a_part_above_its_charges() {
        let mut u = GlobalUpdate {
            v: VERSION,
            tenant: "acme".into(),
            period: Period::day(1),
            total: 0,
            parts: vec![ActorPart {
                actor: actor("eu", "e"),
                p: 20,
                n: 20,
            }],
            limit: None,
            over_limit: false,
            ts_ms: 0,
            limits_version: 0,
        };
        assert_eq!(GlobalUpdate::decode(&u.encode()).unwrap(), u);
        u.parts[0].p = 0;
        let e = GlobalUpdate::decode(&u.encode()).unwrap_err();
        assert!(e.to_string().contains("n 20 exceeds p 0"), "{e}");
    }

    #[test]
    fn partition_is_stable_and_in_range() {
        // Pinned values: changing the hash would move tenants between
        // aggregators during a rolling upgrade.
        assert_eq!(partition_of("acme", 8), partition_of("acme", 8));
        assert_eq!(partition_of("", 8), (0xcbf2_9ce4_8422_2325u64 % 8) as i32);
        for t in ["a", "b", "tenant-42", "x.y"] {
            let p = partition_of(t, 7);
            assert!((0..7).contains(&p));
        }
    }
}
