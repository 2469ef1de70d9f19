//! Limits records are signed like broadcasts (Ed25519 per batch of at most
//! 64, each record carrying its Merkle path: `wire::broadcast_auth`), with
//! a key of their own (`wire.limits_*`) under their own domain tag, so
//! neither an aggregator's broadcast key nor a region's delta key can
//! write limits. One signature per batch keeps a bulk import cheap to
//! verify: a follower reading a million records checks about sixteen
//! thousand signatures, not a million.

use ed25519_dalek::SigningKey;

use crate::config::Config;
use crate::limits::record::{LimitsRecord, Subject};
use crate::messages::DecodeError;
use crate::wire::broadcast_auth::{seal_batches, RootVerifier};
use crate::wire::codec::{self, Auth};
use crate::wire::{keys, Reject};

const LIMITS_TAG: &[u8] = b"tierlimit/limits/v1\0";

/// What the limits writer signs records with.
pub struct LimitsSigner {
    key: Option<(String, SigningKey)>,
}

impl LimitsSigner {
    /// The writer's key from `wire.limits_key` and `wire.limits_private_key`
    /// (unsigned only with `wire.accept_unsigned`).
    pub fn new(config: &Config) -> Result<Self, String> {
        let w = &config.wire;
        let key = match (&w.limits_key, &w.limits_private_key) {
            (Some(id), Some(private)) => Some((id.clone(), keys::ed25519_private(private)?)),
            _ if w.accept_unsigned => None,
            _ => {
                return Err(
                    "wire.limits_private_key (TIERLIMIT__WIRE__LIMITS_PRIVATE_KEY) and wire.limits_key are required to write limits".into(),
                )
            }
        };
        Ok(LimitsSigner { key })
    }

    /// A signer with an explicit key (tests and tools).
    pub fn with_key(key: Option<(&str, SigningKey)>) -> Self {
        LimitsSigner {
            key: key.map(|(id, k)| (id.to_owned(), k)),
        }
    }

    /// Each record's Kafka key and value, in order.
    pub fn encode(&self, records: &[LimitsRecord]) -> Vec<(String, Vec<u8>)> {
        let bodies = records
            .iter()
            .map(|r| codec::limits_body(&r.to_json()))
            .collect();
        records
            .iter()
            .map(|r| r.subject.key())
            .zip(seal_batches(LIMITS_TAG, self.key.as_ref(), bodies))
            .collect()
    }
}

/// What every follower of the limits topic checks records with.
pub struct LimitsVerifier {
    roots: RootVerifier,
    accept_unsigned: bool,
}

impl LimitsVerifier {
    pub fn new(config: &Config) -> Result<Self, String> {
        Ok(LimitsVerifier {
            roots: RootVerifier::new(LIMITS_TAG, &config.wire.limits_public_keys)?,
            accept_unsigned: config.wire.accept_unsigned,
        })
    }

    /// Decodes a record and checks that a limits writer signed it and that
    /// it sits under its own subject's key (a record copied under another
    /// key would survive compaction beside that key's real record).
    pub fn decode(&mut self, key: Option<&[u8]>, bytes: &[u8]) -> Result<LimitsRecord, Reject> {
        let frame = codec::decode_limits(bytes)?;
        match &frame.auth {
            Auth::Batch(proof) => self.roots.verify(frame.signed, proof)?,
            Auth::None if self.accept_unsigned => {}
            Auth::None => return Err(Reject::Unsigned),
            Auth::Hmac { .. } => {
                return Err(Reject::Corrupt(DecodeError::Field(
                    "a limits record cannot carry a delta's HMAC".into(),
                )))
            }
        }
        let record = LimitsRecord::from_json(frame.message)?;
        if key.and_then(Subject::from_key).as_ref() != Some(&record.subject) {
            return Err(Reject::Corrupt(DecodeError::Field(format!(
                "limits record of {} under another Kafka key",
                record.subject.key()
            ))));
        }
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::record::Body;

    fn config_with(public: &str) -> Config {
        let mut c = crate::wire::tests::config(false);
        c.wire
            .limits_public_keys
            .insert("lim-1".into(), public.into());
        c
    }

    fn rec(name: &str, version: u64) -> LimitsRecord {
        LimitsRecord {
            subject: Subject::Tenant(name.into()),
            version,
            writer: "test".into(),
            ts_ms: 1,
            body: Body::Deleted,
        }
    }

    #[test]
    fn signed_records_verify_and_forgeries_do_not() {
        let (private, public) = keys::ed25519_pair_from_seed([5; 32]);
        let cfg = config_with(&public);
        let signer =
            LimitsSigner::with_key(Some(("lim-1", keys::ed25519_private(&private).unwrap())));
        let records: Vec<_> = (1..=70).map(|i| rec(&format!("t{i}"), i)).collect();
        let encoded = signer.encode(&records);
        let mut v = LimitsVerifier::new(&cfg).unwrap();
        for ((key, value), r) in encoded.iter().rev().zip(records.iter().rev()) {
            let got = v.decode(Some(key.as_bytes()), value).unwrap();
            assert_eq!((got.subject, got.version), (r.subject.clone(), r.version));
        }
        // Under another key.
        assert_eq!(
            v.decode(Some(b"t|other"), &encoded[0].1)
                .unwrap_err()
                .reason(),
            "corrupt"
        );
        // A broadcast key (or any other) cannot sign limits.
        let forger = LimitsSigner::with_key(Some(("lim-1", SigningKey::from_bytes(&[9; 32]))));
        let forged = forger.encode(&[rec("t1", 99)]);
        assert_eq!(
            v.decode(Some(forged[0].0.as_bytes()), &forged[0].1)
                .unwrap_err()
                .reason(),
            "bad_signature"
        );
        let unsigned = LimitsSigner::with_key(None).encode(&[rec("t1", 99)]);
        assert_eq!(
            v.decode(Some(unsigned[0].0.as_bytes()), &unsigned[0].1)
                .unwrap_err()
                .reason(),
            "unsigned"
        );
        // Any changed byte is refused (by a follower that has not verified
        // the batch's root yet; one that has still checks the path).
        let (k, good) = &encoded[3];
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 1;
            let mut fresh = LimitsVerifier::new(&cfg).unwrap();
            assert!(fresh.decode(Some(k.as_bytes()), &bad).is_err(), "byte {i}");
        }
    }
}
