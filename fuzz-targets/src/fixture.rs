//! The fixed deployment the targets decode against: two regions (`eu`,
//! `us`) with HMAC delta keys, an Ed25519 broadcast key pair, and one API
//! key. Built once per process.

use std::sync::OnceLock;

use tierlimit_shared::config::{Config, Loaded};
use tierlimit_shared::wire::keys;

/// The eu region's delta secret.
pub const EU_SECRET: [u8; 32] = [0x11; 32];
/// The us region's delta secret.
pub const US_SECRET: [u8; 32] = [0x22; 32];
/// The aggregator's broadcast key seed.
pub const AGG_SEED: [u8; 32] = [0x33; 32];
/// The one API key of `[auth.keys.fuzz]` (scope check, tenant acme).
pub const API_KEY: &str = "fuzz-api-key-0123456789abcdef";

/// The configuration text: `accept_unsigned` decides whether unsigned and
/// v1 records pass (the upgrade mode) or are refused (the default).
pub fn config_text(accept_unsigned: bool) -> String {
    let (private, public) = keys::ed25519_pair_from_seed(AGG_SEED);
    format!(
        r#"cluster = "fuzz"
[kafka]
brokers = "127.0.0.1:1"
[regions.eu]
redis_url = "redis://127.0.0.1:1"
[regions.us]
redis_url = "redis://127.0.0.1:1"
[plans.p]
[auth.keys.fuzz]
sha256 = "{digest}"
scopes = ["check"]
tenants = ["acme"]
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
        digest = tierlimit_shared::auth::KeyDigest::of(API_KEY.as_bytes()).to_hex(),
        eu = keys::encode(&EU_SECRET),
        us = keys::encode(&US_SECRET),
    )
}

/// The validated configuration (signed: unsigned records refused).
pub fn signed() -> &'static Config {
    static C: OnceLock<Loaded> = OnceLock::new();
    &C.get_or_init(|| Config::from_toml(&config_text(false)).expect("fixture config is valid"))
        .config
}

/// The same in upgrade mode (`wire.accept_unsigned = true`).
pub fn open() -> &'static Config {
    static C: OnceLock<Loaded> = OnceLock::new();
    &C.get_or_init(|| Config::from_toml(&config_text(true)).expect("fixture config is valid"))
        .config
}

#[cfg(test)]
mod tests {
    #[test]
    fn fixture_configs_validate() {
        assert!(!super::signed().wire.accept_unsigned);
        assert!(super::open().wire.accept_unsigned);
    }
}
