//! The Redis key scheme of one region.
//!
//! Every key of a tenant carries the hash tag `{tenant}`, so one decision
//! script touches a single Redis Cluster slot. Callers pass only ids that
//! passed [`crate::validate`], whose alphabet excludes `{`, `}`, `:` and `|`,
//! so no input can name a key of another tenant.
//!
//! | key                     | type | holds                                   |
//! |-------------------------|------|-----------------------------------------|
//! | `tl:{T}:n:<node>:<k>:<a>` | hash/string/zset | node-tier state of one node   |
//! | `tl:{T}:r:<k>:<a>`      | hash/string/zset | region-tier state             |
//! | `tl:{T}:g:<day>`        | hash `e p n` | the region's PN counter part for (T, day): epoch, P, N |
//! | `tl:dirty`              | zset `T|day → p+n` | (T, day) pairs not yet published |
//! | `tl:published`          | zset `T|day → ms` | when the region last published (T, day), Redis clock; entries older than `relaxed_flush_interval` are dropped |
//!
//! `<k>` is the request key when the plan is `key_scoped`, else `_`; `<a>` is
//! the algorithm code.

/// The region-wide set of (tenant, day) pairs with unpublished changes.
pub const DIRTY: &str = "tl:dirty";

/// When each (tenant, day) was last published by some node of the region
/// (Redis clock, ms). Shared by the region's publishers so that a tenant
/// published by one node is not published again by another before its
/// `relaxed_flush_interval` is up.
pub const PUBLISHED: &str = "tl:published";

/// Placeholder for `<k>` when a plan counts per tenant, not per key.
pub const WHOLE_TENANT: &str = "_";

/// Node-tier state. The algorithm code is part of the key because each
/// algorithm keeps a different Redis type there: a reload that changes the
/// algorithm starts from fresh state instead of failing with WRONGTYPE.
pub fn node_tier(tenant: &str, node: &str, key: &str, algorithm: u8) -> String {
    format!("tl:{{{tenant}}}:n:{node}:{key}:{algorithm}")
}

/// Region-tier state (see [`node_tier`] for the algorithm code).
pub fn region_tier(tenant: &str, key: &str, algorithm: u8) -> String {
    format!("tl:{{{tenant}}}:r:{key}:{algorithm}")
}

pub fn pn_counter(tenant: &str, day: u32) -> String {
    format!("tl:{{{tenant}}}:g:{day}")
}

/// Member of [`DIRTY`] for (tenant, day).
pub fn dirty_member(tenant: &str, day: u32) -> String {
    format!("{tenant}|{day}")
}

/// Parses a [`DIRTY`] member back; `None` for anything we did not write.
pub fn parse_dirty_member(m: &str) -> Option<(&str, u32)> {
    let (t, d) = m.rsplit_once('|')?;
    crate::validate::tenant(t).ok()?;
    Some((t, d.parse().ok()?))
}

/// Slots of a Redis Cluster.
pub const CLUSTER_SLOTS: u16 = 16384;

/// The Redis Cluster slot of `key`: CRC16-XMODEM of its hash tag (the text
/// between the first `{` and the next `}`, if not empty) or of the whole
/// key, modulo 16384, exactly as Redis computes it. Keys that must be
/// touched by one script have to share it.
pub fn cluster_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    let mut crc: u16 = 0;
    for &byte in hashed {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % CLUSTER_SLOTS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_tenant_hash_tag() {
        assert_eq!(node_tier("acme", "n1", "_", 2), "tl:{acme}:n:n1:_:2");
        assert_eq!(region_tier("acme", "GET/x", 3), "tl:{acme}:r:GET/x:3");
        assert_eq!(pn_counter("acme", 20_000), "tl:{acme}:g:20000");
    }

    #[test]
    fn cluster_slots_follow_hash_tags() {
        // Values from `redis-cli CLUSTER KEYSLOT`.
        assert_eq!(cluster_slot(b"foo"), 12182);
        assert_eq!(
            cluster_slot(b"{user1000}.following"),
            cluster_slot(b"user1000")
        );
        assert_eq!(cluster_slot(b"{}x"), cluster_slot(b"{}x"));
        assert_eq!(cluster_slot(b"123456789"), 0x31c3);
        assert_eq!(
            cluster_slot(pn_counter("acme", 1).as_bytes()),
            cluster_slot(region_tier("acme", "_", 1).as_bytes())
        );
    }

    #[test]
    fn dirty_members_round_trip() {
        assert_eq!(
            parse_dirty_member(&dirty_member("a.b-c", 7)),
            Some(("a.b-c", 7))
        );
        assert_eq!(parse_dirty_member("x|y"), None);
        assert_eq!(parse_dirty_member("a{b|1"), None);
    }
}
