//! Wire v2 and v3: the binary encoding of both topics' records.
//!
//! ```text
//! byte 0      version (2 or 3). JSON v1 records start with `{`, so one byte
//!             tells the formats apart.
//! byte 1      kind: 1 delta, 2 global update, 3 heartbeat
//! body        postcard of the kind's body (varints, length-prefixed UTF-8)
//! auth        postcard of [`Auth`]: none, an HMAC tag, or a batch proof
//! ```
//!
//! The signature covers bytes 0 up to the end of the body, so the version
//! and kind are authenticated too. Region and epoch travel separately (no
//! `"region/epoch"` string to split and validate), and a global update
//! interns its regions: each part names its region by index, so twenty
//! epochs of one region carry the region's name once.
//!
//! Decoding never panics and refuses trailing bytes; the bodies are then
//! validated like v1's (tenant and names, `n <= p`).
//!
//! v3 (this round's one wire change) adds to deltas and global updates the
//! counter's **period** (kind, index and zone: UTC days were the only
//! period of v2), the **limit the node enforced** for that period (so the
//! aggregator never resolves a tenant through its own table to judge it)
//! and the **limits version** both sides judged under. The zone is a name,
//! empty for UTC, `name#fingerprint` in a zone (`zone.rs`): time zones
//! needed no further wire change. Heartbeats are the same body in both.

use serde::{Deserialize, Serialize};

use crate::messages::{ActorPart, DecodeError, Delta, GlobalUpdate};
use crate::period::{Period, PeriodKind};
use crate::wire::merkle::Hash;
use crate::zone::Zone;

/// The version byte of v2.
pub const V2: u8 = 2;
/// The version byte of v3 (periods, enforced limits, limits versions).
pub const V3: u8 = 3;

/// What a v2 record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Delta = 1,
    Global = 2,
    Heartbeat = 3,
    /// A record of the limits topic (`crate::limits`): its JSON, signed
    /// per batch like broadcasts with the limits key.
    Limits = 4,
    /// A node's word on the deltas topic: the limits version it applied
    /// (`NodeStatus`), HMAC-signed with its region's delta key.
    NodeStatus = 5,
}

/// A region-node's periodic status on the deltas topic: which limits
/// version it has applied, so an aggregator can answer "has version V
/// reached every node?" (`crate::limits`). Written to every partition, so
/// every aggregator hears every node whatever partitions it owns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub region: String,
    pub node: String,
    /// Every limits record up to this version is applied (0: none).
    pub limits_version: u64,
    /// The node reads the limits topic (false: it serves the region's last
    /// applied copy, or the file).
    pub following: bool,
    /// The node's wall clock when it wrote the record.
    pub ts_ms: u64,
    /// The region's **watermark** as this node last established it (Redis'
    /// clock, ms; 0: not yet): every unit charged in the region's Redis
    /// before it, and every unit this node charged in its local fail mode
    /// before it, is in a delta the broker acknowledged before this record
    /// was written (`publisher.rs`). A period whose end every region's
    /// watermark passed is **closed** (`aggregator/src/usage.rs`).
    pub published_before_ms: u64,
}

impl NodeStatus {
    /// Kafka key: one per node, so compaction keeps the latest. `~` cannot
    /// start a tenant id.
    pub fn key(&self) -> String {
        format!("~node|{}|{}", self.region, self.node)
    }
}

/// An aggregator's periodic word on one partition of the global topic:
/// "caught up; every delta of this partition up to `deltas_offset` is
/// merged and its changes broadcast before this record; limits as of
/// `limits_version`". Written only by an aggregator that owns the deltas
/// partition and has rebuilt it, so a follower that keeps reading fresh
/// heartbeats knows its view is current, and one that stops (an aggregator
/// down or rebuilding) knows it is not: freshness no longer means merely
/// "read to the watermark".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub partition: u32,
    /// Offset of the next delta to merge (every earlier one is merged).
    pub deltas_offset: u64,
    /// Bumped by every configuration reload of the aggregator that wrote it.
    pub limits_version: u64,
    /// The aggregator's wall clock when it wrote the record.
    pub ts_ms: u64,
}

impl Heartbeat {
    /// Kafka key: one per partition, so compaction keeps the latest. `~`
    /// cannot start a tenant id, so it never collides with `tenant|day`.
    pub fn key(&self) -> String {
        format!("~heartbeat|{}", self.partition)
    }
}

/// The kind of a v2 or v3 record (its second byte), if it is one.
pub fn kind_of(bytes: &[u8]) -> Option<u8> {
    match bytes {
        [V2 | V3, k, ..] => Some(*k),
        _ => None,
    }
}

/// How a v2 record is authenticated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Auth {
    /// Unsigned: accepted only with `wire.accept_unsigned = true`.
    None,
    /// A delta: HMAC-SHA256 of the signed bytes with region key `key`.
    Hmac { key: String, tag: Hash },
    /// A broadcast: this record's place in a signed batch.
    Batch(BatchProof),
}

/// A record's proof of membership in a batch whose Merkle root the
/// aggregator signed (see `merkle` and `broadcast_auth`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchProof {
    pub key: String,
    /// The Ed25519 signature of the root (64 bytes, as two halves: serde
    /// arrays stop at 32).
    pub sig: (Hash, Hash),
    pub count: u32,
    pub index: u32,
    pub path: Vec<Hash>,
}

#[derive(Serialize, Deserialize)]
struct DeltaBody<'a> {
    tenant: &'a str,
    day: u32,
    region: &'a str,
    epoch: &'a str,
    node: Option<&'a str>,
    p: u64,
    n: u64,
    ts_ms: u64,
}

/// A counter's period on the wire (v3): the kind's code, the index in that
/// kind's calendar and the zone (empty: UTC; else `name#fingerprint`, so a
/// process whose zone database has other rules for that zone refuses the
/// record instead of merging two calendars: `zone.rs`).
#[derive(Serialize, Deserialize)]
struct PeriodBody<'a> {
    kind: u8,
    index: u32,
    #[serde(borrow)]
    zone: std::borrow::Cow<'a, str>,
}

impl<'a> PeriodBody<'a> {
    fn of(p: Period) -> Self {
        PeriodBody {
            kind: p.kind.code(),
            index: p.index,
            zone: if p.zone.is_utc() {
                std::borrow::Cow::Borrowed("")
            } else {
                std::borrow::Cow::Owned(p.zone.wire())
            },
        }
    }

    fn period(&self) -> Result<Period, DecodeError> {
        let kind = PeriodKind::from_code(self.kind)
            .ok_or_else(|| DecodeError::Field(format!("unknown period kind {}", self.kind)))?;
        let zone = Zone::from_wire(&self.zone).map_err(|e| DecodeError::Field(e.to_string()))?;
        Ok(Period {
            kind,
            index: self.index,
            zone,
        })
    }
}

#[derive(Serialize, Deserialize)]
struct DeltaBodyV3<'a> {
    tenant: &'a str,
    #[serde(borrow)]
    period: PeriodBody<'a>,
    region: &'a str,
    epoch: &'a str,
    node: Option<&'a str>,
    p: u64,
    n: u64,
    ts_ms: u64,
    limit: Option<u64>,
    limits_version: u64,
}

#[derive(Serialize, Deserialize)]
struct GlobalBodyV3<'a> {
    tenant: &'a str,
    #[serde(borrow)]
    period: PeriodBody<'a>,
    total: u64,
    #[serde(borrow)]
    regions: Vec<&'a str>,
    #[serde(borrow)]
    parts: Vec<PartBody<'a>>,
    limit: Option<u64>,
    over_limit: bool,
    ts_ms: u64,
    limits_version: u64,
}

#[derive(Serialize, Deserialize)]
struct PartBody<'a> {
    /// Index into [`GlobalBody::regions`].
    region: u32,
    epoch: &'a str,
    p: u64,
    n: u64,
}

#[derive(Serialize, Deserialize)]
struct GlobalBody<'a> {
    tenant: &'a str,
    day: u32,
    total: u64,
    #[serde(borrow)]
    regions: Vec<&'a str>,
    #[serde(borrow)]
    parts: Vec<PartBody<'a>>,
    limit: Option<u64>,
    over_limit: bool,
    ts_ms: u64,
}

/// A decoded v2 record: the message, the bytes its signature covers, and
/// its authentication.
#[derive(Debug)]
pub struct Frame<'a, T> {
    pub message: T,
    pub signed: &'a [u8],
    pub auth: Auth,
}

fn header(version: u8, kind: Kind) -> Vec<u8> {
    let mut out = Vec::with_capacity(96);
    out.push(version);
    out.push(kind as u8);
    out
}

fn split_actor(actor: &str) -> (&str, &str) {
    actor.split_once('/').unwrap_or((actor, ""))
}

/// The signed part of a v2 delta (header and body, no auth yet). v2 knows
/// only UTC days: a delta of another period is a v3 record whatever the
/// caller asked (the configuration refuses such tiers under `wire.version
/// = 2`, so this is a last guard, not a path).
pub fn delta_body(d: &Delta) -> Vec<u8> {
    if d.period.kind != PeriodKind::Day || !d.period.zone.is_utc() {
        return delta_body_v3(d);
    }
    let (region, epoch) = split_actor(&d.actor);
    let body = DeltaBody {
        tenant: &d.tenant,
        day: d.period.index,
        region,
        epoch,
        node: d.node.as_deref(),
        p: d.p,
        n: d.n,
        ts_ms: d.ts_ms,
    };
    postcard::to_extend(&body, header(V2, Kind::Delta)).expect("a Vec never runs out of room")
}

/// The signed part of a v3 delta (header and body, no auth yet).
pub fn delta_body_v3(d: &Delta) -> Vec<u8> {
    let (region, epoch) = split_actor(&d.actor);
    let body = DeltaBodyV3 {
        tenant: &d.tenant,
        period: PeriodBody::of(d.period),
        region,
        epoch,
        node: d.node.as_deref(),
        p: d.p,
        n: d.n,
        ts_ms: d.ts_ms,
        limit: d.limit,
        limits_version: d.limits_version,
    };
    postcard::to_extend(&body, header(V3, Kind::Delta)).expect("a Vec never runs out of room")
}

/// A global update's parts with their regions interned.
fn interned(u: &GlobalUpdate) -> (Vec<&str>, Vec<PartBody<'_>>) {
    let mut regions: Vec<&str> = Vec::new();
    let parts = u
        .parts
        .iter()
        .map(|part| {
            let (region, epoch) = split_actor(&part.actor);
            let index = match regions.iter().position(|r| *r == region) {
                Some(i) => i,
                None => {
                    regions.push(region);
                    regions.len() - 1
                }
            };
            PartBody {
                region: index as u32,
                epoch,
                p: part.p,
                n: part.n,
            }
        })
        .collect();
    (regions, parts)
}

/// The signed part of a v2 global update (header and body, no auth yet);
/// v3 for a period other than a UTC day (see [`delta_body`]).
pub fn global_body(u: &GlobalUpdate) -> Vec<u8> {
    if u.period.kind != PeriodKind::Day || !u.period.zone.is_utc() {
        return global_body_v3(u);
    }
    let (regions, parts) = interned(u);
    let body = GlobalBody {
        tenant: &u.tenant,
        day: u.period.index,
        total: u.total,
        regions,
        parts,
        limit: u.limit,
        over_limit: u.over_limit,
        ts_ms: u.ts_ms,
    };
    postcard::to_extend(&body, header(V2, Kind::Global)).expect("a Vec never runs out of room")
}

/// The signed part of a v3 global update (header and body, no auth yet).
pub fn global_body_v3(u: &GlobalUpdate) -> Vec<u8> {
    let (regions, parts) = interned(u);
    let body = GlobalBodyV3 {
        tenant: &u.tenant,
        period: PeriodBody::of(u.period),
        total: u.total,
        regions,
        parts,
        limit: u.limit,
        over_limit: u.over_limit,
        ts_ms: u.ts_ms,
        limits_version: u.limits_version,
    };
    postcard::to_extend(&body, header(V3, Kind::Global)).expect("a Vec never runs out of room")
}

/// The signed part of a heartbeat (header and body, no auth yet), the same
/// body in v2 and v3.
pub fn heartbeat_body(version: u8, h: &Heartbeat) -> Vec<u8> {
    postcard::to_extend(h, header(version, Kind::Heartbeat)).expect("a Vec never runs out of room")
}

/// The signed part of a node status (v3 only).
pub fn node_status_body(s: &NodeStatus) -> Vec<u8> {
    postcard::to_extend(s, header(V3, Kind::NodeStatus)).expect("a Vec never runs out of room")
}

/// Decodes a node status (the HMAC is checked by the caller).
pub fn decode_node_status(bytes: &[u8]) -> Result<Frame<'_, NodeStatus>, DecodeError> {
    let (message, signed, auth) = frame::<NodeStatus>(bytes, Kind::NodeStatus)?;
    check_name("region", &message.region)?;
    check_name("node", &message.node)?;
    Ok(Frame {
        message,
        signed,
        auth,
    })
}

/// The signed part of a limits record: its JSON (v3 only).
pub fn limits_body(json: &[u8]) -> Vec<u8> {
    postcard::to_extend(json, header(V3, Kind::Limits)).expect("a Vec never runs out of room")
}

/// Splits a limits record into its JSON, signed bytes and authentication.
pub fn decode_limits(bytes: &[u8]) -> Result<Frame<'_, &[u8]>, DecodeError> {
    let (message, signed, auth) = frame::<&[u8]>(bytes, Kind::Limits)?;
    Ok(Frame {
        message,
        signed,
        auth,
    })
}

/// Decodes a heartbeat (the signature is checked by the caller).
pub fn decode_heartbeat(bytes: &[u8]) -> Result<Frame<'_, Heartbeat>, DecodeError> {
    let (message, signed, auth) = frame::<Heartbeat>(bytes, Kind::Heartbeat)?;
    Ok(Frame {
        message,
        signed,
        auth,
    })
}

/// Appends the authentication to a signed part: the whole record.
pub fn seal(mut signed: Vec<u8>, auth: &Auth) -> Vec<u8> {
    signed = postcard::to_extend(auth, signed).expect("a Vec never runs out of room");
    signed
}

fn binary(e: postcard::Error) -> DecodeError {
    DecodeError::Field(format!("not a v2 record: {e}"))
}

/// The body of a record of one kind in either binary version.
enum Either<B2, B3> {
    V2(B2),
    V3(B3),
}

/// Splits a v2 or v3 record of `kind` into its version, its body (decoded
/// by `body`), signed bytes and authentication.
#[allow(clippy::type_complexity)]
fn frame_of<'a, B2: Deserialize<'a>, B3: Deserialize<'a>>(
    bytes: &'a [u8],
    kind: Kind,
) -> Result<(Either<B2, B3>, &'a [u8], Auth), DecodeError> {
    let version = bytes.first().copied();
    let (body, signed, auth) = match version {
        Some(V3) => {
            let (b, signed, auth) = frame::<B3>(bytes, kind)?;
            (Either::V3(b), signed, auth)
        }
        _ => {
            let (b, signed, auth) = frame::<B2>(bytes, kind)?;
            (Either::V2(b), signed, auth)
        }
    };
    Ok((body, signed, auth))
}

/// Splits a v2 or v3 record of `kind` into its body (decoded as `B`),
/// signed bytes and authentication.
fn frame<'a, B: Deserialize<'a>>(
    bytes: &'a [u8],
    kind: Kind,
) -> Result<(B, &'a [u8], Auth), DecodeError> {
    match bytes {
        [V2 | V3, k, rest @ ..] if *k == kind as u8 => {
            let (body, after_body) = postcard::take_from_bytes::<B>(rest).map_err(binary)?;
            let signed = &bytes[..bytes.len() - after_body.len()];
            let (auth, trailing) = postcard::take_from_bytes::<Auth>(after_body).map_err(binary)?;
            if !trailing.is_empty() {
                return Err(DecodeError::Field(format!(
                    "{} trailing bytes after the record",
                    trailing.len()
                )));
            }
            Ok((body, signed, auth))
        }
        [V2 | V3, k, ..] => Err(DecodeError::Field(format!(
            "record kind {k} where {} was expected",
            kind as u8
        ))),
        [v, ..] => Err(DecodeError::Version(u32::from(*v))),
        [] => Err(DecodeError::Field("empty record".into())),
    }
}

fn check_name(field: &'static str, s: &str) -> Result<(), DecodeError> {
    crate::validate::name(field, s).map_err(|e| DecodeError::Field(e.to_string()))
}

fn check_tenant(t: &str) -> Result<(), DecodeError> {
    crate::validate::tenant(t).map_err(|e| DecodeError::Field(e.to_string()))
}

fn check_pn(p: u64, n: u64) -> Result<(), DecodeError> {
    if n > p {
        return Err(DecodeError::Field(format!("n {n} exceeds p {p}")));
    }
    Ok(())
}

/// Decodes and validates a v2 delta (the signature is checked by the caller).
pub fn decode_delta(bytes: &[u8]) -> Result<Frame<'_, Delta>, DecodeError> {
    let (body, signed, auth) = frame_of::<DeltaBody, DeltaBodyV3>(bytes, Kind::Delta)?;
    let b = match body {
        Either::V2(b) => DeltaBodyV3 {
            tenant: b.tenant,
            period: PeriodBody::of(Period::day(b.day)),
            region: b.region,
            epoch: b.epoch,
            node: b.node,
            p: b.p,
            n: b.n,
            ts_ms: b.ts_ms,
            limit: None,
            limits_version: 0,
        },
        Either::V3(b) => b,
    };
    check_tenant(b.tenant)?;
    check_name("region", b.region)?;
    check_name("epoch", b.epoch)?;
    if let Some(node) = b.node {
        check_name("node", node)?;
    }
    check_pn(b.p, b.n)?;
    let message = Delta {
        v: u32::from(bytes[0]),
        tenant: b.tenant.to_owned(),
        period: b.period.period()?,
        actor: crate::messages::actor(b.region, b.epoch),
        p: b.p,
        n: b.n,
        ts_ms: b.ts_ms,
        node: b.node.map(str::to_owned),
        limit: b.limit,
        limits_version: b.limits_version,
    };
    Ok(Frame {
        message,
        signed,
        auth,
    })
}

/// Decodes and validates a v2 global update (the signature is checked by
/// the caller).
pub fn decode_global(bytes: &[u8]) -> Result<Frame<'_, GlobalUpdate>, DecodeError> {
    let (body, signed, auth) = frame_of::<GlobalBody, GlobalBodyV3>(bytes, Kind::Global)?;
    let b = match body {
        Either::V2(b) => GlobalBodyV3 {
            tenant: b.tenant,
            period: PeriodBody::of(Period::day(b.day)),
            total: b.total,
            regions: b.regions,
            parts: b.parts,
            limit: b.limit,
            over_limit: b.over_limit,
            ts_ms: b.ts_ms,
            limits_version: 0,
        },
        Either::V3(b) => b,
    };
    check_tenant(b.tenant)?;
    for r in &b.regions {
        check_name("region", r)?;
    }
    let mut parts = Vec::with_capacity(b.parts.len());
    for part in &b.parts {
        let region = b.regions.get(part.region as usize).ok_or_else(|| {
            DecodeError::Field(format!("region index {} out of range", part.region))
        })?;
        check_name("epoch", part.epoch)?;
        check_pn(part.p, part.n)?;
        parts.push(ActorPart {
            actor: crate::messages::actor(region, part.epoch),
            p: part.p,
            n: part.n,
        });
    }
    let message = GlobalUpdate {
        v: u32::from(bytes[0]),
        tenant: b.tenant.to_owned(),
        period: b.period.period()?,
        total: b.total,
        parts,
        limit: b.limit,
        over_limit: b.over_limit,
        ts_ms: b.ts_ms,
        limits_version: b.limits_version,
    };
    Ok(Frame {
        message,
        signed,
        auth,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::actor;
    use proptest::prelude::*;

    fn delta() -> Delta {
        Delta::new(
            "acme",
            20_000,
            actor("eu-west", "a1b2c3"),
            1_234_567,
            89,
            1_700_000_000_000,
        )
        .from_node("eu-west-1")
    }

    fn global() -> GlobalUpdate {
        GlobalUpdate {
            v: 1,
            tenant: "acme".into(),
            period: Period::day(20_000),
            total: 300,
            parts: ["eu/a", "eu/b", "us/c", "eu/d"]
                .iter()
                .map(|a| ActorPart {
                    actor: a.to_string(),
                    p: 100,
                    n: 0,
                })
                .collect(),
            limit: Some(1_000),
            over_limit: false,
            ts_ms: 5,
            limits_version: 0,
        }
    }

    #[test]
    fn v3_carries_the_period_the_enforced_limit_and_the_limits_version() {
        let month = PeriodKind::Month.at(1_800_000_000_000);
        let mut d = delta();
        d.period = month;
        d.limit = Some(2_000_000);
        d.limits_version = 7;
        // A month cannot be a v2 record: v3 whatever was asked.
        for body in [delta_body(&d), delta_body_v3(&d)] {
            assert_eq!(body[0], V3);
            let m = decode_delta(&seal(body, &Auth::None)).unwrap().message;
            assert_eq!(m, Delta { v: 3, ..d.clone() });
        }
        // A day in v3 keeps its Kafka key: the bare day number.
        let day = delta();
        let m = decode_delta(&seal(delta_body_v3(&day), &Auth::None))
            .unwrap()
            .message;
        assert_eq!(m.key(), day.key());
        assert_eq!(day.key(), "acme|20000|eu-west/a1b2c3|eu-west-1");
        let mut u = global();
        u.period = month;
        u.limits_version = 9;
        let m = decode_global(&seal(global_body_v3(&u), &Auth::None))
            .unwrap()
            .message;
        assert_eq!(m, GlobalUpdate { v: 3, ..u.clone() });
        assert_eq!(m.key(), format!("acme|m{}", month.index));
        // v2 records decode as UTC days with no enforced limit.
        let m = decode_delta(&seal(delta_body(&day), &Auth::None))
            .unwrap()
            .message;
        assert_eq!((m.v, m.period, m.limit), (2, Period::day(20_000), None));
    }

    #[test]
    fn v3_refuses_unknown_period_kinds_and_zones_of_other_rules() {
        let mut bytes = delta_body_v3(&delta());
        // tenant "acme" is 1 + 4 bytes after the header: the kind follows.
        assert_eq!(bytes[2 + 5], PeriodKind::Day.code());
        bytes[2 + 5] = 9;
        let e = decode_delta(&seal(bytes, &Auth::None)).unwrap_err();
        assert!(e.to_string().contains("unknown period kind 9"), "{e}");
        let zoned = |zone: &str| {
            let body = DeltaBodyV3 {
                tenant: "acme",
                period: PeriodBody {
                    kind: 2,
                    index: 1,
                    zone: zone.into(),
                },
                region: "eu",
                epoch: "e",
                node: None,
                p: 1,
                n: 0,
                ts_ms: 0,
                limit: None,
                limits_version: 0,
            };
            let bytes = postcard::to_extend(&body, header(V3, Kind::Delta)).unwrap();
            decode_delta(&seal(bytes, &Auth::None))
                .map(|f| f.message.period)
                .map_err(|e| e.to_string())
        };
        // Another database's rules for the zone, or none named: refused.
        let e = zoned("Europe/Berlin#00000000").unwrap_err();
        assert!(e.contains("other rules"), "{e}");
        assert!(zoned("Europe/Berlin").is_err());
        assert!(zoned("Nowhere/Else#1").is_err());
        // This process's own rules: the period is Berlin's.
        let berlin = Zone::named("Europe/Berlin").unwrap();
        assert_eq!(zoned(&berlin.wire()).unwrap().zone, berlin);
        // And a zoned delta round-trips through the encoder.
        let mut d = delta();
        d.period = PeriodKind::Month.at_in(berlin, 1_800_000_000_000);
        let back = decode_delta(&seal(delta_body_v3(&d), &Auth::None))
            .unwrap()
            .message;
        assert_eq!(back.period, d.period);
    }

    #[test]
    fn delta_round_trip_is_compact() {
        let d = delta();
        let bytes = seal(delta_body(&d), &Auth::None);
        let f = decode_delta(&bytes).unwrap();
        assert_eq!(f.message, Delta { v: 2, ..d.clone() });
        assert_eq!(f.auth, Auth::None);
        assert_eq!(f.signed, &bytes[..bytes.len() - 1]);
        // Varints and no field names: well under half of the JSON.
        assert!(
            bytes.len() * 2 < d.encode().len(),
            "{} vs {}",
            bytes.len(),
            d.encode().len()
        );
    }

    #[test]
    fn global_round_trip_interns_regions() {
        let u = global();
        let bytes = seal(global_body(&u), &Auth::None);
        let f = decode_global(&bytes).unwrap();
        assert_eq!(f.message, GlobalUpdate { v: 2, ..u.clone() });
        // "eu" is written once for three parts.
        assert_eq!(bytes.windows(2).filter(|w| w == b"eu").count(), 1);
    }

    #[test]
    fn heartbeat_round_trip() {
        let h = Heartbeat {
            partition: 3,
            deltas_offset: 1_234_567,
            limits_version: 2,
            ts_ms: 1_700_000_000_000,
        };
        let bytes = seal(heartbeat_body(V2, &h), &Auth::None);
        assert_eq!(kind_of(&bytes), Some(Kind::Heartbeat as u8));
        assert_eq!(decode_heartbeat(&bytes).unwrap().message, h);
        assert!(decode_global(&bytes).is_err());
        assert_eq!(h.key(), "~heartbeat|3");
        assert!(crate::validate::tenant("~heartbeat").is_err());
    }

    #[test]
    fn refuses_what_is_not_a_v2_record_of_the_kind() {
        let d = seal(delta_body(&delta()), &Auth::None);
        assert!(matches!(decode_global(&d), Err(DecodeError::Field(_))));
        assert!(matches!(
            decode_delta(b"{\"v\":1}"),
            Err(DecodeError::Version(123))
        ));
        assert!(decode_delta(&[]).is_err());
        let mut trailing = d.clone();
        trailing.push(0);
        assert!(decode_delta(&trailing).is_err());
        assert!(decode_delta(&d[..d.len() - 2]).is_err());
        let mut bad = delta();
        bad.n = bad.p + 1;
        assert!(decode_delta(&seal(delta_body(&bad), &Auth::None)).is_err());
        let bad = Delta::new("ac:me", 1, actor("eu", "e"), 1, 0, 0);
        assert!(decode_delta(&seal(delta_body(&bad), &Auth::None)).is_err());
        let bad = Delta::new("acme", 1, "noslash".into(), 1, 0, 0);
        assert!(decode_delta(&seal(delta_body(&bad), &Auth::None)).is_err());
    }

    proptest! {
        /// Any bytes: an error or a valid record, never a panic.
        #[test]
        fn decoders_never_panic_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_delta(&bytes);
            let _ = decode_global(&bytes);
            let mut v2 = vec![V2, 1];
            v2.extend_from_slice(&bytes);
            let _ = decode_delta(&v2);
            v2[1] = 2;
            let _ = decode_global(&v2);
            v2[1] = 3;
            let _ = decode_heartbeat(&v2);
        }

        /// A valid record with any byte changed or cut: never a panic, and a
        /// record that still decodes is still valid.
        #[test]
        fn corrupted_records_never_panic(at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>()) {
            for record in [seal(delta_body(&delta()), &Auth::None), seal(global_body(&global()), &Auth::Hmac { key: "k".into(), tag: [9; 32] })] {
                let mut changed = record.clone();
                let i = at.index(changed.len());
                changed[i] = byte;
                for r in [&changed[..], &record[..cut.index(record.len())]] {
                    if let Ok(f) = decode_delta(r) {
                        prop_assert!(f.message.n <= f.message.p);
                    }
                    if let Ok(f) = decode_global(r) {
                        prop_assert!(f.message.parts.iter().all(|p| p.n <= p.p));
                    }
                }
            }
        }

        #[test]
        fn any_valid_delta_round_trips(p in any::<u64>(), n in any::<u64>(), day in any::<u32>(), ts in any::<u64>()) {
            let d = Delta::new("t-1", day, actor("eu", "e"), p.max(n), n.min(p), ts);
            let bytes = seal(delta_body(&d), &Auth::None);
            let f = decode_delta(&bytes).unwrap();
            prop_assert_eq!(f.message, Delta { v: 2, ..d });
        }
    }
}
