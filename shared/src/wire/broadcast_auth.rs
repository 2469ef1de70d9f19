//! Broadcasts: signed by the aggregator with Ed25519, verified by every
//! region-node.
//!
//! Asymmetric, unlike deltas: every node holds the verifying key, and a key
//! every node holds must not be able to forge what all nodes trust. One
//! signature per batch rather than per record keeps a rebuild fast: a
//! batch's records carry their Merkle path to a root the aggregator signed
//! once ([`crate::wire::merkle`]), and a follower verifies each root once
//! (a small cache of verified roots), so a rebuild of a million records
//! costs a million short hash paths and one Ed25519 verification per batch
//! instead of a million verifications. Each record stays verifiable on its
//! own, whatever compaction left of its batch.

use std::collections::{HashMap, VecDeque};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

use crate::config::Config;
use crate::messages::{DecodeError, GlobalUpdate};
use crate::wire::codec::{self, Auth, BatchProof, Heartbeat, Kind};
use crate::wire::merkle::{self, Hash};
use crate::wire::reject::Reject;
use crate::wire::{keys, read_version, Version};

/// Largest batch one signature covers: a record carries log2(batch) hashes
/// of 32 bytes, so 64 records cost 192 bytes of path each and one
/// signature per 64 records.
pub const MAX_BATCH: usize = 64;

/// Verified roots remembered per follower. Records of one batch are
/// consecutive on a partition, so a few per partition are plenty.
const VERIFIED_ROOTS: usize = 1024;

/// The domain tag of broadcast signatures.
const BROADCAST_TAG: &[u8] = b"tierlimit/broadcast/v2\0";

/// What the signature covers: a domain tag (so a signature made for one
/// kind of record never verifies another: broadcasts, limits records), the
/// batch size and the root.
fn signed_message(tag: &[u8], count: u32, root: &Hash) -> Vec<u8> {
    let mut m = Vec::with_capacity(tag.len() + 4 + root.len());
    m.extend_from_slice(tag);
    m.extend_from_slice(&count.to_le_bytes());
    m.extend_from_slice(root);
    m
}

/// Signs `bodies` in batches of at most [`MAX_BATCH`] under `tag`: each
/// record is its body and its [`BatchProof`]. `None` writes unsigned
/// records. Shared by broadcasts and limits records
/// (`crate::limits::auth`).
pub(crate) fn seal_batches(
    tag: &[u8],
    key: Option<&(String, SigningKey)>,
    bodies: Vec<Vec<u8>>,
) -> Vec<Vec<u8>> {
    let Some((id, key)) = key else {
        return bodies
            .into_iter()
            .map(|b| codec::seal(b, &Auth::None))
            .collect();
    };
    let mut out = Vec::with_capacity(bodies.len());
    let mut bodies = bodies.into_iter().peekable();
    while bodies.peek().is_some() {
        let batch: Vec<Vec<u8>> = bodies.by_ref().take(MAX_BATCH).collect();
        let leaves: Vec<Hash> = batch.iter().map(|b| merkle::leaf(b)).collect();
        let (root, paths) = merkle::build(&leaves);
        let count = batch.len() as u32;
        let sig = key.sign(&signed_message(tag, count, &root)).to_bytes();
        let (r, s) = sig.split_at(32);
        let sig = (
            <Hash>::try_from(r).expect("64-byte signature"),
            <Hash>::try_from(s).expect("64-byte signature"),
        );
        for (index, (body, path)) in batch.into_iter().zip(paths).enumerate() {
            let proof = BatchProof {
                key: id.clone(),
                sig,
                count,
                index: index as u32,
                path,
            };
            out.push(codec::seal(body, &Auth::Batch(proof)));
        }
    }
    out
}

/// Checks batch proofs under one domain tag against a set of Ed25519
/// public keys, remembering the roots that verified.
pub(crate) struct RootVerifier {
    tag: &'static [u8],
    keys: HashMap<String, VerifyingKey>,
    /// Roots whose signature verified, newest last.
    verified: VecDeque<Hash>,
}

impl RootVerifier {
    pub(crate) fn new(
        tag: &'static [u8],
        public: &std::collections::BTreeMap<String, String>,
    ) -> Result<Self, String> {
        let mut map = HashMap::new();
        for (id, public) in public {
            map.insert(id.clone(), keys::ed25519_public(public)?);
        }
        Ok(RootVerifier {
            tag,
            keys: map,
            verified: VecDeque::with_capacity(VERIFIED_ROOTS),
        })
    }

    pub(crate) fn verify(&mut self, signed: &[u8], proof: &BatchProof) -> Result<(), Reject> {
        let key = self
            .keys
            .get(&proof.key)
            .ok_or_else(|| Reject::UnknownKey(proof.key.clone()))?;
        let root =
            merkle::root_from_path(merkle::leaf(signed), proof.index, proof.count, &proof.path)
                .ok_or_else(|| Reject::BadSignature(proof.key.clone()))?;
        // The root commits to the count only through the signature, so the
        // cache is keyed by what was signed: root and count together.
        let cached = cache_key(&root, proof.count);
        if self.verified.contains(&cached) {
            return Ok(());
        }
        let mut sig = [0u8; 64];
        sig[..32].copy_from_slice(&proof.sig.0);
        sig[32..].copy_from_slice(&proof.sig.1);
        key.verify(
            &signed_message(self.tag, proof.count, &root),
            &Signature::from_bytes(&sig),
        )
        .map_err(|_| Reject::BadSignature(proof.key.clone()))?;
        if self.verified.len() == VERIFIED_ROOTS {
            self.verified.pop_front();
        }
        self.verified.push_back(cached);
        Ok(())
    }
}

/// What an aggregator writes broadcasts with.
pub struct BroadcastSigner {
    version: Version,
    /// `None` writes unsigned records (`wire.accept_unsigned = true`
    /// without a private key).
    key: Option<(String, SigningKey)>,
}

impl BroadcastSigner {
    pub fn new(config: &Config) -> Result<Self, String> {
        let w = &config.wire;
        let key = match (&w.broadcast_key, &w.broadcast_private_key) {
            (Some(id), Some(private)) => Some((id.clone(), keys::ed25519_private(private)?)),
            _ if w.accept_unsigned => None,
            _ => {
                return Err(
                    "wire.broadcast_private_key (TIERLIMIT__WIRE__BROADCAST_PRIVATE_KEY) and wire.broadcast_key are required to sign broadcasts".into(),
                )
            }
        };
        Ok(BroadcastSigner {
            version: Version::from_config(config),
            key,
        })
    }

    /// A signer with an explicit key (tests and tools).
    pub fn with_key(version: Version, key: Option<(&str, SigningKey)>) -> Self {
        BroadcastSigner {
            version,
            key: key.map(|(id, k)| (id.to_owned(), k)),
        }
    }

    /// The records of `updates`, in order. Signed in batches of at most
    /// [`MAX_BATCH`]; the caller should pass the updates of one partition
    /// together so a batch's records stay together on the topic.
    pub fn encode(&self, updates: &[GlobalUpdate]) -> Vec<Vec<u8>> {
        match self.version {
            Version::V1 => updates
                .iter()
                .map(|u| {
                    GlobalUpdate {
                        v: crate::messages::VERSION,
                        ..u.clone()
                    }
                    .encode()
                })
                .collect(),
            Version::V2 => self.seal(updates.iter().map(codec::global_body).collect()),
            Version::V3 => self.seal(updates.iter().map(codec::global_body_v3).collect()),
        }
    }

    /// The records of `heartbeats` (none in v1, which has no heartbeat).
    pub fn encode_heartbeats(&self, heartbeats: &[Heartbeat]) -> Vec<Vec<u8>> {
        match self.version {
            Version::V1 => Vec::new(),
            Version::V2 => self.seal(
                heartbeats
                    .iter()
                    .map(|h| codec::heartbeat_body(codec::V2, h))
                    .collect(),
            ),
            Version::V3 => self.seal(
                heartbeats
                    .iter()
                    .map(|h| codec::heartbeat_body(codec::V3, h))
                    .collect(),
            ),
        }
    }

    /// Signs v2 bodies in batches of at most [`MAX_BATCH`].
    fn seal(&self, bodies: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
        seal_batches(BROADCAST_TAG, self.key.as_ref(), bodies)
    }
}

/// A record of the global topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Broadcast {
    Update(GlobalUpdate),
    Heartbeat(Heartbeat),
}

/// What a region-node reads broadcasts with.
pub struct BroadcastVerifier {
    roots: RootVerifier,
    accept_unsigned: bool,
}

impl BroadcastVerifier {
    pub fn new(config: &Config) -> Result<Self, String> {
        Ok(BroadcastVerifier {
            roots: RootVerifier::new(BROADCAST_TAG, &config.wire.broadcast_public_keys)?,
            accept_unsigned: config.wire.accept_unsigned,
        })
    }

    /// Decodes a global update (v1 JSON or v2) and checks that an
    /// aggregator wrote it; a heartbeat is an error here.
    pub fn decode(&mut self, bytes: &[u8]) -> Result<GlobalUpdate, Reject> {
        match self.decode_any(bytes)? {
            Broadcast::Update(u) => Ok(u),
            Broadcast::Heartbeat(_) => Err(Reject::Corrupt(DecodeError::Field(
                "a heartbeat where an update was expected".into(),
            ))),
        }
    }

    /// Decodes any record of the global topic (v1 JSON or v2) and checks
    /// that an aggregator wrote it.
    pub fn decode_any(&mut self, bytes: &[u8]) -> Result<Broadcast, Reject> {
        match read_version(bytes)? {
            Version::V1 => {
                let u = GlobalUpdate::decode(bytes)?;
                if !self.accept_unsigned {
                    return Err(Reject::Unsigned);
                }
                Ok(Broadcast::Update(u))
            }
            Version::V2 | Version::V3 if codec::kind_of(bytes) == Some(Kind::Heartbeat as u8) => {
                let frame = codec::decode_heartbeat(bytes)?;
                self.check(frame.signed, &frame.auth)?;
                Ok(Broadcast::Heartbeat(frame.message))
            }
            Version::V2 | Version::V3 => {
                let frame = codec::decode_global(bytes)?;
                self.check(frame.signed, &frame.auth)?;
                Ok(Broadcast::Update(frame.message))
            }
        }
    }

    fn check(&mut self, signed: &[u8], auth: &Auth) -> Result<(), Reject> {
        match auth {
            Auth::Batch(proof) => self.verify(signed, proof),
            Auth::None if self.accept_unsigned => Ok(()),
            Auth::None => Err(Reject::Unsigned),
            Auth::Hmac { .. } => Err(Reject::Corrupt(DecodeError::Field(
                "a broadcast cannot carry a delta's HMAC".into(),
            ))),
        }
    }

    fn verify(&mut self, signed: &[u8], proof: &BatchProof) -> Result<(), Reject> {
        self.roots.verify(signed, proof)
    }
}

fn cache_key(root: &Hash, count: u32) -> Hash {
    let mut k = *root;
    for (b, c) in k.iter_mut().zip(count.to_le_bytes()) {
        *b ^= c;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::ActorPart;
    use crate::wire::tests::{config, AGG_SEED};

    fn u(tenant: &str, p: u64) -> GlobalUpdate {
        GlobalUpdate {
            v: 3,
            tenant: tenant.into(),
            period: crate::period::Period::day(20_000),
            total: p,
            parts: vec![ActorPart {
                actor: "eu/e1".into(),
                p,
                n: 0,
            }],
            limit: Some(100),
            over_limit: p >= 100,
            ts_ms: 7,
            limits_version: 0,
        }
    }

    fn batch(n: usize) -> Vec<GlobalUpdate> {
        (0..n).map(|i| u(&format!("t{i}"), i as u64)).collect()
    }

    #[test]
    fn batches_verify_record_by_record_in_any_order() {
        let cfg = config(false);
        let signer = BroadcastSigner::new(&cfg).unwrap();
        let updates = batch(150);
        let mut records = signer.encode(&updates);
        assert_eq!(records.len(), 150);
        // What compaction may leave: any subset, in any order.
        records.reverse();
        let mut v = BroadcastVerifier::new(&cfg).unwrap();
        for (r, expected) in records.iter().zip(updates.iter().rev()) {
            assert_eq!(&v.decode(r).unwrap(), expected);
        }
        // Three batches: three roots verified.
        assert_eq!(v.roots.verified.len(), 3);
    }

    #[test]
    fn forged_and_corrupted_broadcasts_are_refused() {
        let cfg = config(false);
        let mut v = BroadcastVerifier::new(&cfg).unwrap();
        // A key nobody trusts, under a trusted key id and under its own.
        let forger = SigningKey::from_bytes(&[9; 32]);
        let forged = BroadcastSigner::with_key(Version::V2, Some(("agg-1", forger.clone())));
        assert_eq!(
            v.decode(&forged.encode(&batch(1))[0]).unwrap_err().reason(),
            "bad_signature"
        );
        let forged = BroadcastSigner::with_key(Version::V2, Some(("mallory", forger)));
        assert_eq!(
            v.decode(&forged.encode(&batch(1))[0]).unwrap_err().reason(),
            "unknown_key"
        );
        // Every single-byte change of a signed record is refused.
        let good = BroadcastSigner::new(&cfg).unwrap().encode(&batch(5));
        for i in 0..good[2].len() {
            let mut bad = good[2].clone();
            bad[i] ^= 0x01;
            assert!(v.decode(&bad).is_err(), "byte {i} changed");
        }
        // After its root was verified, a changed body still fails its path.
        assert!(v.decode(&good[2]).is_ok());
        let mut bad = good[2].clone();
        bad[4] ^= 0x01;
        assert!(v.decode(&bad).is_err());
        // Unsigned records.
        let unsigned = BroadcastSigner::with_key(Version::V2, None);
        assert_eq!(
            v.decode(&unsigned.encode(&batch(1))[0])
                .unwrap_err()
                .reason(),
            "unsigned"
        );
        let v1 = BroadcastSigner::with_key(Version::V1, None);
        assert_eq!(
            v.decode(&v1.encode(&batch(1))[0]).unwrap_err().reason(),
            "unsigned"
        );
    }

    #[test]
    fn heartbeats_are_signed_like_updates() {
        let cfg = config(false);
        let signer = BroadcastSigner::new(&cfg).unwrap();
        let hb = Heartbeat {
            partition: 1,
            deltas_offset: 42,
            limits_version: 3,
            ts_ms: 9,
        };
        let records = signer.encode_heartbeats(std::slice::from_ref(&hb));
        let mut v = BroadcastVerifier::new(&cfg).unwrap();
        assert_eq!(
            v.decode_any(&records[0]).unwrap(),
            Broadcast::Heartbeat(hb.clone())
        );
        assert!(v.decode(&records[0]).is_err());
        let forger = BroadcastSigner::with_key(
            Version::V2,
            Some(("agg-1", SigningKey::from_bytes(&[9; 32]))),
        );
        // A fresher heartbeat than the aggregator wrote: refused. (The
        // genuine record under a garbage signature passes once its root is
        // known: its content is authentic, like any replay.)
        let fresher = Heartbeat {
            ts_ms: 10,
            ..hb.clone()
        };
        let forged = forger.encode_heartbeats(&[fresher]);
        assert_eq!(
            v.decode_any(&forged[0]).unwrap_err().reason(),
            "bad_signature"
        );
        assert!(BroadcastSigner::with_key(Version::V1, None)
            .encode_heartbeats(&[hb])
            .is_empty());
    }

    #[test]
    fn rotation_accepts_both_public_keys() {
        let mut cfg = config(false);
        let (private, public) = keys::ed25519_pair_from_seed([77; 32]);
        cfg.wire
            .broadcast_public_keys
            .insert("agg-2".into(), public);
        let mut v = BroadcastVerifier::new(&cfg).unwrap();
        let old = BroadcastSigner::with_key(
            Version::V2,
            Some(("agg-1", SigningKey::from_bytes(&AGG_SEED))),
        );
        let new = BroadcastSigner::with_key(
            Version::V2,
            Some(("agg-2", keys::ed25519_private(&private).unwrap())),
        );
        assert!(v.decode(&old.encode(&batch(1))[0]).is_ok());
        assert!(v.decode(&new.encode(&batch(1))[0]).is_ok());
    }

    #[test]
    fn upgrade_mode_reads_v1_and_unsigned() {
        let cfg = config(true);
        let mut v = BroadcastVerifier::new(&cfg).unwrap();
        let v1 = BroadcastSigner::with_key(Version::V1, None);
        let json = &v1.encode(&batch(1))[0];
        assert_eq!(json[0], b'{');
        assert_eq!(
            v.decode(json).unwrap(),
            GlobalUpdate {
                v: 1,
                ..batch(1)[0].clone()
            }
        );
        let unsigned = BroadcastSigner::with_key(Version::V2, None);
        assert!(v.decode(&unsigned.encode(&batch(1))[0]).is_ok());
    }
}
