//! The wire protocol of both Kafka topics: formats, versions and message
//! authentication.
//!
//! - [`codec`]: wire v2 and v3 (v3 adds periods, enforced limits and limits
//!   versions), a compact binary encoding (postcard: varints,
//!   interned regions) with a leading version byte and room for a signature;
//! - v1 is the previous release's JSON (`crate::messages`), still read for
//!   one release so that a rolling upgrade works;
//! - [`delta_auth`]: deltas carry an HMAC-SHA256 with their region's key;
//! - [`broadcast_auth`]: broadcasts carry an Ed25519 signature per batch
//!   ([`merkle`]);
//! - [`keys`]: key material from the configuration; [`reject`]: why a
//!   record was refused (a metric label) and rate-limited logging.
//!
//! The Kafka keys and partitioning are those of v1 (`crate::messages`), so a
//! compacted topic keeps one record per key whatever version wrote it.

pub mod broadcast_auth;
pub mod codec;
pub mod delta_auth;
pub mod keys;
pub mod merkle;
pub mod reject;

pub use broadcast_auth::{Broadcast, BroadcastSigner, BroadcastVerifier};
pub use codec::{Heartbeat, NodeStatus};
pub use delta_auth::{DeltaRecord, DeltaSigner, DeltaVerifier};
pub use reject::{LogThrottle, Reject};

use std::sync::{Arc, Mutex};

use crate::config::{Config, Loaded};
use crate::messages::DecodeError;
use crate::reload::Live;

/// A value made from the live configuration (a signer, a verifier), made
/// again when a SIGHUP reload swapped the configuration, so a key rotation
/// needs no restart. One pointer comparison per use otherwise.
pub struct PerConfig<T> {
    make: fn(&Config) -> Result<T, String>,
    cached: Mutex<Option<(Arc<Loaded>, Arc<T>)>>,
}

impl<T> PerConfig<T> {
    pub fn new(make: fn(&Config) -> Result<T, String>) -> Self {
        PerConfig {
            make,
            cached: Mutex::new(None),
        }
    }

    /// The value for the current configuration. If it cannot be made from
    /// a reloaded configuration, the previous one stays (and the error is
    /// returned only when there is none).
    pub fn get(&self, live: &Live) -> Result<Arc<T>, String> {
        let current = live.load_full();
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        match &*cached {
            Some((at, value)) if Arc::ptr_eq(at, &current) => return Ok(Arc::clone(value)),
            _ => {}
        }
        match (self.make)(&current.config) {
            Ok(value) => {
                let value = Arc::new(value);
                *cached = Some((current, Arc::clone(&value)));
                Ok(value)
            }
            Err(e) => match &*cached {
                Some((_, old)) => {
                    tracing::warn!(error = %e, "wire keys of the reloaded configuration unusable; keeping the previous ones");
                    Ok(Arc::clone(old))
                }
                None => Err(e),
            },
        }
    }
}

/// How often aggregators write heartbeats: a quarter of the nodes'
/// `max_staleness`, at most once a second, at least one broadcast interval
/// apart. Each is one small record per partition.
pub fn heartbeat_interval(config: &Config) -> std::time::Duration {
    use std::time::Duration;
    let per_staleness = config
        .node
        .max_staleness
        .map_or(Duration::from_secs(1), |s| s / 4);
    per_staleness
        .min(Duration::from_secs(1))
        .max(config.aggregator.broadcast_interval)
}

/// How long a follower waits for the next heartbeat of a partition before
/// it stops calling its view fresh: two heartbeat intervals and 5 s for the
/// pipeline (produce, broker, fetch). A second was too tight: a loaded
/// broker (Tansu on SQLite in the partition suite) delivers heartbeats
/// 1–3 s after they are written, and views aged without any fault. Reading
/// to the watermark still dates the view as before; the heartbeats only
/// add that an aggregator silent for this long ages it.
pub fn heartbeat_liveness(config: &Config) -> std::time::Duration {
    heartbeat_interval(config) * 2 + std::time::Duration::from_secs(5)
}

/// A wire format version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// JSON, unsigned (the previous release).
    V1,
    /// Binary, signed; UTC days only.
    V2,
    /// Binary, signed; periods, enforced limits and limits versions.
    V3,
}

impl Version {
    /// What producers write under `config` (`wire.version`, validated).
    pub fn from_config(config: &Config) -> Version {
        match config.wire.version {
            1 => Version::V1,
            2 => Version::V2,
            _ => Version::V3,
        }
    }
}

/// The version of a record from its first byte: `{` is v1's JSON object,
/// 2 is v2, 3 is v3; anything else is a version this build does not read.
pub fn read_version(bytes: &[u8]) -> Result<Version, DecodeError> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Ok(Version::V1),
        Some(&codec::V2) if bytes[0] == codec::V2 => Ok(Version::V2),
        Some(&codec::V3) if bytes[0] == codec::V3 => Ok(Version::V3),
        Some(b) => Err(DecodeError::Version(u32::from(*b))),
        None => Err(DecodeError::Field("empty record".into())),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const EU_SECRET: [u8; 32] = [1; 32];
    pub(crate) const US_SECRET: [u8; 32] = [2; 32];
    pub(crate) const AGG_SEED: [u8; 32] = [5; 32];

    /// Two regions with their keys and a broadcast key pair.
    pub(crate) fn config(accept_unsigned: bool) -> Config {
        let (private, public) = keys::ed25519_pair_from_seed(AGG_SEED);
        let text = format!(
            r#"
cluster = "t"
[kafka]
brokers = "127.0.0.1:1"
[regions.eu]
redis_url = "redis://127.0.0.1:1"
[regions.us]
redis_url = "redis://127.0.0.1:1"
[plans.p]
[wire]
accept_unsigned = {accept_unsigned}
broadcast_key = "agg-1"
broadcast_private_key = "{private}"
[wire.broadcast_public_keys]
agg-1 = "{public}"
[wire.delta_keys.eu]
sign_with = "eu-1"
keys = {{ eu-1 = "{eu}" }}
[wire.delta_keys.us]
sign_with = "us-1"
keys = {{ us-1 = "{us}" }}
"#,
            eu = keys::encode(&EU_SECRET),
            us = keys::encode(&US_SECRET),
        );
        Config::from_toml(&text)
            .expect("test config is valid")
            .config
    }

    proptest::proptest! {
        /// The verifiers, which read whatever is on the topics, never panic
        /// and never accept garbage (random bytes carry no valid signature).
        #[test]
        fn verifiers_refuse_garbage_without_panicking(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            kind in 1u8..4,
        ) {
            let cfg = config(false);
            let deltas = DeltaVerifier::new(&cfg).unwrap();
            let mut broadcasts = BroadcastVerifier::new(&cfg).unwrap();
            let mut v2 = vec![codec::V2, kind];
            v2.extend_from_slice(&bytes);
            for b in [&bytes, &v2] {
                proptest::prop_assert!(deltas.decode(b).is_err());
                proptest::prop_assert!(broadcasts.decode_any(b).is_err());
            }
        }
    }

    #[test]
    fn versions_by_first_byte() {
        assert_eq!(read_version(b"{\"v\":1}").unwrap(), Version::V1);
        assert_eq!(read_version(b" \n{").unwrap(), Version::V1);
        assert_eq!(read_version(&[2, 1]).unwrap(), Version::V2);
        assert_eq!(read_version(&[3, 1]).unwrap(), Version::V3);
        assert!(matches!(read_version(&[4]), Err(DecodeError::Version(4))));
        assert!(read_version(b"").is_err());
        assert!(read_version(b"  ").is_err());
    }
}
