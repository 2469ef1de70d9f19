//! The region's copy of the applied limits, in its Redis: what a node
//! starting while Kafka is unreachable serves with.
//!
//! Every node writes each record it applies (`lua/limits_copy.lua`: a field
//! never moves back to an older version, whichever node writes last), in
//! topic order, and after each batch raises the copy's mark to the batch's
//! last offset, so the copy holds every record up to its mark: a node that
//! loads it follows the topic from the mark on. Non-expiring keys, apart
//! from the tenant hashes (which expire and are rewritten by the decision
//! script): `tl:{<bucket tag>}:lim:<n>`, a tenant in its own bucket (the
//! slot of its counters), plans in bucket 0, `n` one of [`SUBS`] so each
//! hash stays a small listpack; the mark in `tl:{<bucket 0>}:lim:mark`.
//!
//! The copy is trusted as the counters beside it are: it is written only
//! with records a node verified, and the region's Redis is inside the
//! trust boundary. A plain tenant is stored as `=<plan>` (about 30 bytes
//! with its key and version), others as their JSON.

use std::collections::BTreeMap;
use std::sync::Arc;

use redis::Value;

use tierlimit_shared::config::TenantConfig;
use tierlimit_shared::keys::{bucket_of, bucket_slot, bucket_tag, BUCKETS};
use tierlimit_shared::limits::{Body, LimitsRecord, Subject};

use crate::storage::redis::RedisStore;
use crate::storage::StoreError;

pub const LIMITS_COPY_LUA: &str = include_str!("lua/limits_copy.lua");

/// Hashes per bucket.
pub const SUBS: u32 = 1024;

/// Records a node writes per script call and mark.
pub const BATCH: usize = 512;

fn bucket_for(subject: &Subject) -> u16 {
    match subject {
        Subject::Tenant(t) => bucket_of(t),
        Subject::Plan(_) => 0,
    }
}

fn hash_key(bucket: u16, sub: u32) -> String {
    format!("tl:{{{}}}:lim:{sub}", bucket_tag(bucket))
}

fn mark_key() -> String {
    format!("tl:{{{}}}:lim:mark", bucket_tag(0))
}

fn sub_of(field: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in field.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % SUBS
}

/// A record's body as the copy stores it.
pub fn encode_body(body: &Body) -> String {
    match body {
        Body::Tenant(t) if t.is_plain() => format!("={}", t.plan),
        other => serde_json::to_string(other).expect("a body serializes"),
    }
}

/// The record a copy's field holds.
pub fn decode_field(field: &str, value: &str) -> Option<LimitsRecord> {
    let subject = Subject::from_key(field.as_bytes())?;
    let (version, body) = value.split_once('|')?;
    let body = match body.strip_prefix('=') {
        Some(plan) => Body::Tenant(TenantConfig {
            time_zone: Default::default(),
            plan: plan.to_owned(),
            node: None,
            region: None,
            global: None,
            on_store_error: None,
            grants: Vec::new(),
        }),
        None => serde_json::from_str(body).ok()?,
    };
    Some(LimitsRecord {
        subject,
        version: version.parse().ok()?,
        writer: "region-copy".into(),
        ts_ms: 0,
        body,
    })
}

/// One applied record to copy.
#[derive(Debug, Clone)]
pub struct Item {
    pub subject: Subject,
    pub version: u64,
    pub body: String,
    pub offset: i64,
}

/// What a load found: records (in version order) and the mark.
pub struct Snapshot {
    pub records: Vec<LimitsRecord>,
    pub mark: i64,
}

pub struct RegionCopy {
    store: Arc<RedisStore>,
}

impl RegionCopy {
    pub fn new(store: Arc<RedisStore>) -> Self {
        RegionCopy { store }
    }

    /// Writes a batch (in topic order), then raises the mark to its last
    /// offset.
    pub async fn write(&self, items: &[Item]) -> Result<(), StoreError> {
        let mut by_bucket: BTreeMap<u16, Vec<&Item>> = BTreeMap::new();
        for it in items {
            by_bucket
                .entry(bucket_for(&it.subject))
                .or_default()
                .push(it);
        }
        for (bucket, items) in by_bucket {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(sha1(LIMITS_COPY_LUA)).arg(items.len());
            let fields: Vec<String> = items.iter().map(|it| it.subject.key()).collect();
            for f in &fields {
                cmd.arg(hash_key(bucket, sub_of(f)));
            }
            for (it, f) in items.iter().zip(&fields) {
                cmd.arg(f).arg(it.version).arg(&it.body);
            }
            self.store
                .run_script("limits_copy", bucket_slot(bucket), &cmd, LIMITS_COPY_LUA)
                .await?;
        }
        if let Some(last) = items.iter().map(|it| it.offset).max() {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(sha1(LIMITS_COPY_LUA))
                .arg(1)
                .arg(mark_key())
                .arg("mark")
                .arg(last.max(0))
                .arg("");
            self.store
                .run_script("limits_copy", bucket_slot(0), &cmd, LIMITS_COPY_LUA)
                .await?;
        }
        Ok(())
    }

    /// The whole copy, or `None` if the region has none.
    pub async fn load(&self) -> Result<Option<Snapshot>, StoreError> {
        let mark: Option<String> = self
            .store
            .query(
                "limits_copy",
                bucket_slot(0),
                redis::cmd("HGET").arg(mark_key()).arg("mark").clone(),
            )
            .await?;
        let Some(mark) = mark.and_then(|m| m.split_once('|').and_then(|(v, _)| v.parse().ok()))
        else {
            return Ok(None);
        };
        let mut records = Vec::new();
        for bucket in 0..BUCKETS {
            let mut pipe = redis::pipe();
            for sub in 0..SUBS {
                pipe.cmd("HGETALL").arg(hash_key(bucket, sub));
            }
            let pages: Vec<Value> = self
                .store
                .pipeline("limits_copy", bucket_slot(bucket), pipe)
                .await?;
            for page in pages {
                let fields: BTreeMap<String, String> =
                    redis::from_redis_value(page).unwrap_or_default();
                records.extend(
                    fields
                        .iter()
                        .filter(|(f, _)| *f != "mark")
                        .filter_map(|(f, v)| decode_field(f, v)),
                );
            }
        }
        records.sort_by_key(|r| r.version);
        Ok(Some(Snapshot { records, mark }))
    }
}

fn sha1(source: &str) -> String {
    static SHA: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SHA.get_or_init(|| redis::Script::new(source).get_hash().to_string())
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_compactly() {
        let plain = Body::Tenant(TenantConfig {
            time_zone: Default::default(),
            plan: "pro".into(),
            node: None,
            region: None,
            global: None,
            on_store_error: None,
            grants: Vec::new(),
        });
        let v = format!("17|{}", encode_body(&plain));
        assert_eq!(v, "17|=pro");
        let r = decode_field("t|acme", &v).unwrap();
        assert_eq!((r.subject, r.version), (Subject::Tenant("acme".into()), 17));
        let deleted = format!("18|{}", encode_body(&Body::Deleted));
        assert!(matches!(
            decode_field("t|acme", &deleted).unwrap().body,
            Body::Deleted
        ));
        assert!(decode_field("x|acme", "1|=pro").is_none());
        assert!(decode_field("t|acme", "garbage").is_none());
    }
}
