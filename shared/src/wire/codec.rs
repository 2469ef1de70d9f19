//! Wire v2: the binary encoding of both topics' records.
//!
//! ```text
//! byte 0      version (2). JSON v1 records start with `{`, so one byte
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

use serde::{Deserialize, Serialize};

use crate::messages::{ActorPart, DecodeError, Delta, GlobalUpdate};
use crate::wire::merkle::Hash;

/// The version byte of this format.
pub const V2: u8 = 2;

/// What a v2 record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Delta = 1,
    Global = 2,
    Heartbeat = 3,
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

/// The kind of a v2 record (its second byte), if it is one.
pub fn kind_of(bytes: &[u8]) -> Option<u8> {
    match bytes {
        [V2, k, ..] => Some(*k),
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

fn header(kind: Kind) -> Vec<u8> {
    let mut out = Vec::with_capacity(96);
    out.push(V2);
    out.push(kind as u8);
    out
}

fn split_actor(actor: &str) -> (&str, &str) {
    actor.split_once('/').unwrap_or((actor, ""))
}

/// The signed part of a v2 delta (header and body, no auth yet).
pub fn delta_body(d: &Delta) -> Vec<u8> {
    let (region, epoch) = split_actor(&d.actor);
    let body = DeltaBody {
        tenant: &d.tenant,
        day: d.day,
        region,
        epoch,
        node: d.node.as_deref(),
        p: d.p,
        n: d.n,
        ts_ms: d.ts_ms,
    };
    postcard::to_extend(&body, header(Kind::Delta)).expect("a Vec never runs out of room")
}

/// The signed part of a v2 global update (header and body, no auth yet).
pub fn global_body(u: &GlobalUpdate) -> Vec<u8> {
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
    let body = GlobalBody {
        tenant: &u.tenant,
        day: u.day,
        total: u.total,
        regions,
        parts,
        limit: u.limit,
        over_limit: u.over_limit,
        ts_ms: u.ts_ms,
    };
    postcard::to_extend(&body, header(Kind::Global)).expect("a Vec never runs out of room")
}

/// The signed part of a heartbeat (header and body, no auth yet).
pub fn heartbeat_body(h: &Heartbeat) -> Vec<u8> {
    postcard::to_extend(h, header(Kind::Heartbeat)).expect("a Vec never runs out of room")
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

/// Splits a v2 record of `kind` into its body (decoded by `body`), signed
/// bytes and authentication.
fn frame<'a, B: Deserialize<'a>>(
    bytes: &'a [u8],
    kind: Kind,
) -> Result<(B, &'a [u8], Auth), DecodeError> {
    match bytes {
        [V2, k, rest @ ..] if *k == kind as u8 => {
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
        [V2, k, ..] => Err(DecodeError::Field(format!(
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
    let (b, signed, auth) = frame::<DeltaBody>(bytes, Kind::Delta)?;
    check_tenant(b.tenant)?;
    check_name("region", b.region)?;
    check_name("epoch", b.epoch)?;
    if let Some(node) = b.node {
        check_name("node", node)?;
    }
    check_pn(b.p, b.n)?;
    let message = Delta {
        v: u32::from(V2),
        tenant: b.tenant.to_owned(),
        day: b.day,
        actor: crate::messages::actor(b.region, b.epoch),
        p: b.p,
        n: b.n,
        ts_ms: b.ts_ms,
        node: b.node.map(str::to_owned),
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
    let (b, signed, auth) = frame::<GlobalBody>(bytes, Kind::Global)?;
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
        v: u32::from(V2),
        tenant: b.tenant.to_owned(),
        day: b.day,
        total: b.total,
        parts,
        limit: b.limit,
        over_limit: b.over_limit,
        ts_ms: b.ts_ms,
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
            day: 20_000,
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
        }
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
        let bytes = seal(heartbeat_body(&h), &Auth::None);
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
