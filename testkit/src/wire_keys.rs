//! Wire keys for the configurations that tests, the demo and the bench
//! write: every region's delta HMAC key and the aggregator's Ed25519 key
//! pair, deterministic so a failing run can be replayed.
//!
//! Signing is required by default (`wire.accept_unsigned = false`), so a
//! configuration without keys does not load; [`toml`] is the `[wire]`
//! section to append. The private key sits in the same file because the
//! test processes share it; a deployment gives it to aggregators only.

use tierlimit_shared::wire::keys;

/// The broadcast key id of [`toml`].
pub const BROADCAST_KEY: &str = "test-agg";

/// The aggregator's test key seed.
pub const BROADCAST_SEED: [u8; 32] = [0x5a; 32];

/// The key id region `region` signs deltas with.
pub fn delta_key_id(region: &str) -> String {
    format!("{region}-test")
}

/// Region `region`'s test HMAC secret (32 bytes).
pub fn delta_secret(region: &str) -> [u8; 32] {
    let mut s = [0u8; 32];
    for (i, (b, r)) in s.iter_mut().zip(region.bytes().cycle()).enumerate() {
        *b = r ^ (i as u8).wrapping_mul(31);
    }
    s
}

/// The limits writer's key id of [`toml`].
pub const LIMITS_KEY: &str = "test-limits";

/// The limits writer's test key seed.
pub const LIMITS_SEED: [u8; 32] = [0x3c; 32];

/// The `[wire]` section for `regions`: signed, every region keyed, and,
/// with `limits`, the limits writer's key (for `limits.source = "topic"`;
/// left out otherwise, because the previous release refuses the keys).
pub fn toml(regions: &[&str], limits: bool) -> String {
    let (private, public) = keys::ed25519_pair_from_seed(BROADCAST_SEED);
    let mut s = format!(
        "\n[wire]\nbroadcast_key = \"{BROADCAST_KEY}\"\nbroadcast_private_key = \"{private}\"\n"
    );
    if limits {
        let (limits_private, limits_public) = keys::ed25519_pair_from_seed(LIMITS_SEED);
        s.push_str(&format!(
            "limits_key = \"{LIMITS_KEY}\"\nlimits_private_key = \"{limits_private}\"\n\
             [wire.limits_public_keys]\n{LIMITS_KEY} = \"{limits_public}\"\n"
        ));
    }
    s.push_str(&format!(
        "[wire.broadcast_public_keys]\n{BROADCAST_KEY} = \"{public}\"\n"
    ));
    for r in regions {
        s.push_str(&format!(
            "[wire.delta_keys.{r}]\nsign_with = \"{id}\"\nkeys = {{ {id} = \"{secret}\" }}\n",
            id = delta_key_id(r),
            secret = keys::encode(&delta_secret(r)),
        ));
    }
    s
}
