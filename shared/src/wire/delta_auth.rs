//! Deltas: signed by a region-node with its region's HMAC-SHA256 key,
//! verified by the aggregator.
//!
//! HMAC rather than a signature: the only verifier is the aggregator, which
//! is trusted with every region's key anyway, and an HMAC costs about a
//! microsecond. What matters is that a region's key can only vouch for
//! that region's actors: every key id belongs to one region, and a delta
//! whose actor is of another region is refused ([`Reject::WrongRegion`]),
//! so a compromised region cannot write another region's parts.

use std::collections::{HashMap, HashSet};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config::Config;
use crate::messages::{actor_region, Delta};
use crate::wire::codec::{self, Auth};
use crate::wire::reject::Reject;
use crate::wire::{keys, read_version, Version};

type HmacSha256 = Hmac<Sha256>;

fn tag(secret: &[u8], bytes: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any size");
    mac.update(bytes);
    mac.finalize().into_bytes().into()
}

/// What a region-node writes deltas with.
#[derive(Clone)]
pub struct DeltaSigner {
    version: Version,
    /// `(key id, secret)`; `None` writes unsigned records (only configs
    /// with `wire.accept_unsigned = true` have no key).
    key: Option<(String, Vec<u8>)>,
}

impl DeltaSigner {
    /// The signer of `region`'s nodes under `config` (validated).
    pub fn new(config: &Config, region: &str) -> Result<Self, String> {
        let key = match config.wire.delta_keys.get(region) {
            Some(rk) => {
                let secret = rk
                    .keys
                    .get(&rk.sign_with)
                    .ok_or_else(|| format!("wire.delta_keys.{region}.sign_with names no key"))?;
                Some((rk.sign_with.clone(), keys::hmac_secret(secret)?))
            }
            None if config.wire.accept_unsigned => None,
            None => {
                return Err(format!(
                    "wire.delta_keys.{region} is required to sign deltas"
                ))
            }
        };
        Ok(DeltaSigner {
            version: Version::from_config(config),
            key,
        })
    }

    /// A signer with an explicit key (tests and tools).
    pub fn with_key(version: Version, key: Option<(&str, &[u8])>) -> Self {
        DeltaSigner {
            version,
            key: key.map(|(id, s)| (id.to_owned(), s.to_vec())),
        }
    }

    /// The record to produce for `d`.
    /// A node's status record (always v3: only processes that follow the
    /// limits topic write one, and those read v3).
    pub fn encode_status(&self, status: &codec::NodeStatus) -> Vec<u8> {
        let signed = codec::node_status_body(status);
        let auth = self.auth(&signed);
        codec::seal(signed, &auth)
    }

    fn auth(&self, signed: &[u8]) -> Auth {
        match &self.key {
            Some((id, secret)) => Auth::Hmac {
                key: id.clone(),
                tag: tag(secret, signed),
            },
            None => Auth::None,
        }
    }

    pub fn encode(&self, d: &Delta) -> Vec<u8> {
        match self.version {
            Version::V1 => Delta {
                v: crate::messages::VERSION,
                ..d.clone()
            }
            .encode(),
            Version::V2 | Version::V3 => {
                let signed = if self.version == Version::V3 {
                    codec::delta_body_v3(d)
                } else {
                    codec::delta_body(d)
                };
                let auth = self.auth(&signed);
                codec::seal(signed, &auth)
            }
        }
    }
}

/// What the aggregator reads deltas with.
/// A record of the deltas topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeltaRecord {
    Delta(Delta),
    Status(codec::NodeStatus),
}

pub struct DeltaVerifier {
    /// key id → (region, secret).
    keys: HashMap<String, (String, Vec<u8>)>,
    regions: HashSet<String>,
    accept_unsigned: bool,
}

impl DeltaVerifier {
    pub fn new(config: &Config) -> Result<Self, String> {
        let mut map = HashMap::new();
        for (region, rk) in &config.wire.delta_keys {
            for (id, secret) in &rk.keys {
                map.insert(id.clone(), (region.clone(), keys::hmac_secret(secret)?));
            }
        }
        Ok(DeltaVerifier {
            keys: map,
            regions: config.regions.keys().cloned().collect(),
            accept_unsigned: config.wire.accept_unsigned,
        })
    }

    /// Decodes `bytes` (v1 JSON or v2) and checks who wrote it: a delta is
    /// returned only if its signature verifies under a key of its actor's
    /// region (or unsigned records are accepted and the region is known).
    /// Decodes any record of the deltas topic: a delta, or a node's status
    /// (checked like a delta: a region's key vouches only for its region's
    /// nodes).
    pub fn decode_any(&self, bytes: &[u8]) -> Result<DeltaRecord, Reject> {
        if codec::kind_of(bytes) != Some(codec::Kind::NodeStatus as u8) {
            return self.decode(bytes).map(DeltaRecord::Delta);
        }
        let frame = codec::decode_node_status(bytes)?;
        self.check(&frame.auth, frame.signed, &frame.message.region)?;
        if !self.regions.contains(&frame.message.region) {
            return Err(Reject::UnknownRegion(frame.message.region));
        }
        Ok(DeltaRecord::Status(frame.message))
    }

    /// Checks a v2/v3 record's authentication: a key of `region`.
    fn check(&self, auth: &Auth, signed: &[u8], region: &str) -> Result<(), Reject> {
        match auth {
            Auth::Hmac { key, tag: got } => {
                let (key_region, secret) = self
                    .keys
                    .get(key)
                    .ok_or_else(|| Reject::UnknownKey(key.clone()))?;
                let mut mac =
                    HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any size");
                mac.update(signed);
                mac.verify_slice(got)
                    .map_err(|_| Reject::BadSignature(key.clone()))?;
                if region != key_region {
                    return Err(Reject::WrongRegion {
                        actor_region: region.to_owned(),
                        key_region: key_region.clone(),
                    });
                }
                Ok(())
            }
            Auth::None if self.accept_unsigned => Ok(()),
            Auth::None => Err(Reject::Unsigned),
            Auth::Batch(_) => Err(Reject::Corrupt(crate::messages::DecodeError::Field(
                "a delta cannot carry a broadcast proof".into(),
            ))),
        }
    }

    pub fn decode(&self, bytes: &[u8]) -> Result<Delta, Reject> {
        let delta = match read_version(bytes)? {
            Version::V1 => {
                let d = Delta::decode(bytes)?;
                if !self.accept_unsigned {
                    return Err(Reject::Unsigned);
                }
                d
            }
            Version::V2 | Version::V3 => {
                let frame = codec::decode_delta(bytes)?;
                self.check(
                    &frame.auth,
                    frame.signed,
                    actor_region(&frame.message.actor),
                )?;
                frame.message
            }
        };
        let region = actor_region(&delta.actor);
        if !self.regions.contains(region) {
            return Err(Reject::UnknownRegion(region.to_owned()));
        }
        Ok(delta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::actor;
    use crate::wire::tests::{config, EU_SECRET, US_SECRET};

    fn d(region: &str) -> Delta {
        Delta::new("acme", 20_000, actor(region, "e1"), 10, 1, 5).from_node("n1")
    }

    #[test]
    fn signed_deltas_verify_and_forgeries_do_not() {
        let cfg = config(false);
        let v = DeltaVerifier::new(&cfg).unwrap();
        let eu = DeltaSigner::new(&cfg, "eu").unwrap();
        let got = v.decode(&eu.encode(&d("eu"))).unwrap();
        assert_eq!(got, Delta { v: 3, ..d("eu") });

        // eu's key vouching for a us actor: another region's part.
        let e = v.decode(&eu.encode(&d("us"))).unwrap_err();
        assert_eq!(e.reason(), "wrong_region");
        // An actor of a region that is not configured.
        let e = v.decode(&eu.encode(&d("mars"))).unwrap_err();
        assert_eq!(e.reason(), "wrong_region");
        // A key nobody configured, or the right id with the wrong secret.
        let stranger = DeltaSigner::with_key(Version::V2, Some(("zz-1", &[3; 32])));
        assert_eq!(
            v.decode(&stranger.encode(&d("eu"))).unwrap_err().reason(),
            "unknown_key"
        );
        let wrong = DeltaSigner::with_key(Version::V2, Some(("eu-1", &US_SECRET)));
        assert_eq!(
            v.decode(&wrong.encode(&d("eu"))).unwrap_err().reason(),
            "bad_signature"
        );
        // A changed count under a valid tag.
        let mut bytes = eu.encode(&d("eu"));
        let at = bytes.iter().position(|b| *b == 10).unwrap();
        bytes[at] = 11;
        assert_eq!(v.decode(&bytes).unwrap_err().reason(), "bad_signature");
        // Unsigned records, v1 or v2, are refused by default.
        let unsigned = DeltaSigner::with_key(Version::V2, None);
        assert_eq!(
            v.decode(&unsigned.encode(&d("eu"))).unwrap_err().reason(),
            "unsigned"
        );
        assert_eq!(
            v.decode(&d("eu").encode()).unwrap_err().reason(),
            "unsigned"
        );
        assert_eq!(v.decode(b"\x07abc").unwrap_err().reason(), "version");
        assert_eq!(v.decode(b"\x02\x01\xff").unwrap_err().reason(), "corrupt");
    }

    #[test]
    fn rotation_accepts_both_keys() {
        let mut cfg = config(false);
        let eu = cfg.wire.delta_keys.get_mut("eu").unwrap();
        eu.keys.insert("eu-2".into(), keys::encode(&[42; 32]));
        let v = DeltaVerifier::new(&cfg).unwrap();
        let old = DeltaSigner::with_key(Version::V2, Some(("eu-1", &EU_SECRET)));
        let new = DeltaSigner::with_key(Version::V2, Some(("eu-2", &[42; 32])));
        assert!(v.decode(&old.encode(&d("eu"))).is_ok());
        assert!(v.decode(&new.encode(&d("eu"))).is_ok());
    }

    #[test]
    fn upgrade_mode_reads_v1_and_unsigned_v2_but_never_a_bad_tag() {
        let cfg = config(true);
        let v = DeltaVerifier::new(&cfg).unwrap();
        assert_eq!(v.decode(&d("eu").encode()).unwrap(), d("eu"));
        let unsigned = DeltaSigner::with_key(Version::V2, None);
        assert!(v.decode(&unsigned.encode(&d("us"))).is_ok());
        assert_eq!(
            v.decode(&d("mars").encode()).unwrap_err().reason(),
            "unknown_region"
        );
        let wrong = DeltaSigner::with_key(Version::V2, Some(("eu-1", &US_SECRET)));
        assert_eq!(
            v.decode(&wrong.encode(&d("eu"))).unwrap_err().reason(),
            "bad_signature"
        );
        let v1 = DeltaSigner::with_key(Version::V1, None);
        assert_eq!(v1.encode(&d("eu")), d("eu").encode());
    }
}
