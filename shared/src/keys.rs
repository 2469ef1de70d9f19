//! The Redis key scheme of one region (scheme 2: bucketed, cluster-safe).
//!
//! Every key one decision touches shares one Redis Cluster slot, and so does
//! the bookkeeping the publisher needs, without a key per tenant outside it:
//!
//! - a tenant belongs to one of [`BUCKETS`] buckets (its CRC16 slot ÷ 256);
//! - every key of the bucket carries the bucket's hash tag, chosen so that
//!   bucket `i` hashes into slots `256·i .. 256·i+255` (see [`bucket_tag`]).
//!   `redis-cli --cluster create` hands out contiguous slot ranges, so the
//!   buckets spread evenly over the masters, and a reshard moves whole
//!   buckets with their bookkeeping;
//! - the publisher polls the [`BUCKETS`] dirty sets every flush (one small
//!   read each, pipelined per master), not 16 384 slots.
//!
//! | key                          | type | holds |
//! |------------------------------|------|-------|
//! | `tl:{B}:t:T`                 | hash | the tenant: its whole-tenant tier states (fields `<tier id>:<f>`), its PN counter per day (`g:<day>:e`, `:p`, `:n`), the day's publish state (`g:<day>:d`: absent clean, 1 dirty, 2 urgent) and the list of its days (`gd`); a tenant with global tiers of other periods has their counters the same way (`g:<label>:e` … with `m<index>`, `w<index>`, `h<index>`) and their list (`gx`) |
//! | `tl:{B}:t:T:k:<tier id>:<k>` | hash/zset | a tier that cannot live in the tenant hash: key-scoped (one per counting key, with its own TTL), a window longer than a day, or the exact sliding log (a zset) |
//! | `tl:{B}:t:T:rf:<day>`        | set  | refund handles used against charges of that day (idempotent refunds) |
//! | `tl:{B}:dirty`               | zset `T|period → score` | (tenant, period) pairs with unpublished changes (a day's period is the bare day number, other periods `h`/`w`/`m` and an index: `shared/src/period.rs`); score 0 = urgent, else the Redis time (ms) it became due for the relaxed flush |
//!
//! `<tier id>` is `n:<node>:<rule>:<a>` (node tier) or `r:<rule>:<a>` (region
//! tier), where `<rule>` is `_` for a plan's own tiers and `<a>` the
//! algorithm code: each algorithm keeps other state, so a reload that changes
//! it starts afresh instead of misreading. Callers pass only ids that passed
//! [`crate::validate`], whose alphabet excludes `{`, `}`, `:` and `|`, so no
//! input can name another tenant's key or field.
//!
//! Why one hash per tenant: a decision then reads every whole-tenant tier and
//! the day's counter with one `HMGET` and writes them with one `HSET`,
//! where scheme 1 (`tl:{T}:…`, one key per tier and per day, and the
//! region-wide `tl:dirty` and `tl:published`, which no cluster can serve
//! from one slot) needed a read, a write and a TTL per key.

use crate::period::Period;

/// Buckets of the key scheme. Part of the scheme: changing it moves every
/// key. 64 lets a region spread over up to 64 masters.
pub const BUCKETS: u16 = 64;

/// Placeholder for `<k>` when a plan counts per tenant, not per key, and for
/// `<rule>` of a plan's own tiers.
pub const WHOLE_TENANT: &str = "_";

/// Slots of a Redis Cluster.
pub const CLUSTER_SLOTS: u16 = 16384;

/// The bucket of a tenant.
pub fn bucket_of(tenant: &str) -> u16 {
    cluster_slot(tenant.as_bytes()) / (CLUSTER_SLOTS / BUCKETS)
}

/// The hash tag of bucket `i`: the first `b<i>.<n>` (n = 0, 1, …) whose
/// slot lies in bucket `i`'s range of slots. Computed once.
pub fn bucket_tag(i: u16) -> &'static str {
    static TAGS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let width = CLUSTER_SLOTS / BUCKETS;
        (0..BUCKETS)
            .map(|b| {
                (0u32..)
                    .map(|n| format!("b{b}.{n}"))
                    .find(|t| cluster_slot(t.as_bytes()) / width == b)
                    .expect("CRC16 reaches every range")
            })
            .collect()
    });
    &tags[usize::from(i % BUCKETS)]
}

/// The slot every key of bucket `i` hashes to.
pub fn bucket_slot(i: u16) -> u16 {
    cluster_slot(bucket_tag(i).as_bytes())
}

/// The tenant hash.
pub fn tenant_hash(tenant: &str) -> String {
    format!("tl:{{{}}}:t:{tenant}", bucket_tag(bucket_of(tenant)))
}

/// The dirty set of bucket `i`.
pub fn dirty(i: u16) -> String {
    format!("tl:{{{}}}:dirty", bucket_tag(i))
}

/// The tier id of a node tier (see the module doc).
pub fn node_tier_id(node: &str, rule: &str, algorithm: u8) -> String {
    format!("n:{node}:{rule}:{algorithm}")
}

/// The tier id of a region tier.
pub fn region_tier_id(rule: &str, algorithm: u8) -> String {
    format!("r:{rule}:{algorithm}")
}

/// The key of a tier kept outside the tenant hash.
pub fn tier_key(tenant: &str, tier_id: &str, key: &str) -> String {
    format!("{}:k:{tier_id}:{key}", tenant_hash(tenant))
}

/// The set of refund handles used against charges of `day` (written only by
/// refunds; expires with the day's counter).
pub fn refund_record(tenant: &str, day: u32) -> String {
    format!("{}:rf:{day}", tenant_hash(tenant))
}

/// The set of unknown tenants the region admitted on `day` (the newcomer
/// gate, `newcomer.lua`). In bucket 0 with the gate's rate counter, so one
/// script call on one slot sees both.
pub fn newcomers(day: u32) -> String {
    format!("tl:{{{}}}:nt:{day}", bucket_tag(0))
}

/// The region's one-second counter of newly admitted unknown tenants.
pub fn newcomer_rate() -> String {
    format!("tl:{{{}}}:nt:rate", bucket_tag(0))
}

/// Field-name prefix of the PN counter of `day` in the tenant hash.
pub fn day_prefix(day: u32) -> String {
    format!("g:{day}:")
}

/// Field-name prefix of the PN counter of `period` in the tenant hash:
/// `g:<label>:`, the same as [`day_prefix`] for a day.
pub fn period_prefix(period: Period) -> String {
    format!("g:{}:", period.label())
}

/// The PN counter's fields of `day` in the tenant hash: epoch, P, N.
pub fn counter_fields(day: u32) -> [String; 3] {
    let g = day_prefix(day);
    [format!("{g}e"), format!("{g}p"), format!("{g}n")]
}

/// The fields of a window tier's state in the tenant hash: window index and
/// count (fixed and sliding windows).
pub fn window_fields(tier_id: &str) -> [String; 2] {
    [format!("{tier_id}:w"), format!("{tier_id}:c")]
}

/// Every bucket's dirty set.
pub fn all_dirty() -> impl Iterator<Item = String> {
    (0..BUCKETS).map(dirty)
}

/// Member of a dirty set for (tenant, day).
pub fn dirty_member(tenant: &str, day: u32) -> String {
    format!("{tenant}|{day}")
}

/// Member of a dirty set for (tenant, period): `T|<label>`, the same as
/// [`dirty_member`] for a day.
pub fn dirty_member_of(tenant: &str, period: Period) -> String {
    format!("{tenant}|{}", period.label())
}

/// Parses a dirty-set member back; `None` for anything we did not write.
pub fn parse_dirty_member(m: &str) -> Option<(&str, Period)> {
    let (t, d) = m.rsplit_once('|')?;
    crate::validate::tenant(t).ok()?;
    Some((t, Period::parse_label(d)?))
}

/// Scheme 1's keys, read only to carry a region's counts over an upgrade
/// (`region-node migrate-keys`).
pub mod v1 {
    /// The region-wide dirty set of scheme 1.
    pub const DIRTY: &str = "tl:dirty";
    /// The region-wide publish stamps of scheme 1.
    pub const PUBLISHED: &str = "tl:published";

    /// Scheme 1's PN counter of (tenant, day): hash `e p n`.
    pub fn pn_counter(tenant: &str, day: u32) -> String {
        format!("tl:{{{tenant}}}:g:{day}")
    }
}

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
    fn every_key_of_a_tenant_shares_its_buckets_slot() {
        for t in ["acme", "a.b-c", "x", "tenant-123456"] {
            let b = bucket_of(t);
            let slot = bucket_slot(b);
            assert_eq!(cluster_slot(tenant_hash(t).as_bytes()), slot);
            assert_eq!(cluster_slot(dirty(b).as_bytes()), slot);
            let id = region_tier_id("_", 4);
            assert_eq!(cluster_slot(tier_key(t, &id, "GET/x").as_bytes()), slot);
        }
    }

    #[test]
    fn bucket_tags_land_in_their_own_slot_range() {
        let width = CLUSTER_SLOTS / BUCKETS;
        for b in 0..BUCKETS {
            assert_eq!(bucket_slot(b) / width, b, "{}", bucket_tag(b));
        }
        // A tenant's bucket is the range its own slot falls in.
        assert_eq!(bucket_of("foo"), 12182 / width);
    }

    #[test]
    fn keys_and_tier_ids_read_as_documented() {
        let tag = bucket_tag(bucket_of("acme"));
        assert_eq!(tenant_hash("acme"), format!("tl:{{{tag}}}:t:acme"));
        assert_eq!(node_tier_id("n1", "_", 2), "n:n1:_:2");
        assert_eq!(region_tier_id("_", 3), "r:_:3");
        assert_eq!(
            tier_key("acme", "r:_:4", "GET/x"),
            format!("tl:{{{tag}}}:t:acme:k:r:_:4:GET/x")
        );
        assert_eq!(day_prefix(20_000), "g:20000:");
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
    }

    #[test]
    fn dirty_members_round_trip() {
        assert_eq!(
            parse_dirty_member(&dirty_member("a.b-c", 7)),
            Some(("a.b-c", Period::day(7)))
        );
        let month = crate::period::PeriodKind::Month.at(1_800_000_000_000);
        assert_eq!(dirty_member_of("t", Period::day(7)), dirty_member("t", 7));
        assert_eq!(
            parse_dirty_member(&dirty_member_of("t", month)),
            Some(("t", month))
        );
        assert_eq!(parse_dirty_member("x|y"), None);
        assert_eq!(parse_dirty_member("a{b|1"), None);
    }
}
