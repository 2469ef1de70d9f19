//! Tenant ids, keys and names (`validate`), the Redis and Kafka keys built
//! from them (`keys`, `messages`), and API keys as presented in headers
//! (`auth`): every request names these.
//!
//! Input: `<id>\0<authorization>\0<x-api-key>` (missing parts are absent
//! headers); the id is also read as a duration and a SHA-256 hex digest.

use tierlimit_shared::auth::{presented_key_from, KeyDigest, Scope};
use tierlimit_shared::{duration, keys, messages, validate};

use crate::fixture;

/// Characters no accepted id may contain: the separators of the key
/// scheme (`:`, `{`, `}`) and of Kafka keys (`|`).
const SEPARATORS: [char; 4] = [':', '{', '}', '|'];

pub fn ids(data: &[u8]) -> bool {
    let mut parts = data.splitn(3, |b| *b == 0);
    let id = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let authorization = parts.next();
    let api_key = parts.next();

    let tenant_ok = validate::tenant(&id).is_ok();
    let key_ok = validate::key(&id).is_ok();
    let name_ok = validate::name("name", &id).is_ok();
    for (ok, max) in [
        (tenant_ok, validate::MAX_TENANT_LEN),
        (key_ok, validate::MAX_KEY_LEN),
        (name_ok, 64),
    ] {
        if ok {
            assert!(!id.is_empty() && id.len() <= max, "{id:?}");
            assert!(id.is_ascii(), "{id:?}");
            assert!(!id.contains(SEPARATORS), "{id:?}");
        }
    }
    // Every tenant id is a key and a name too (tenant ⊂ name ⊂ key).
    assert!(!tenant_ok || (key_ok && name_ok), "{id:?}");
    if tenant_ok {
        // Every key of the tenant is in its bucket's slot, and the
        // bookkeeping members parse back to what was written.
        let slot = keys::bucket_slot(keys::bucket_of(&id));
        let tier = keys::region_tier_id(keys::WHOLE_TENANT, 1);
        for k in [
            keys::tenant_hash(&id),
            keys::tier_key(&id, &tier, keys::WHOLE_TENANT),
            keys::refund_record(&id, 20_000),
        ] {
            assert_eq!(keys::cluster_slot(k.as_bytes()), slot, "{k}");
        }
        let member = keys::dirty_member(&id, 20_000);
        assert_eq!(
            keys::parse_dirty_member(&member),
            Some((&*id, tierlimit_shared::period::Period::day(20_000)))
        );
        assert!(messages::partition_of(&id, 16) < 16);
    }
    if key_ok {
        let tier = keys::node_tier_id("n1", keys::WHOLE_TENANT, 2);
        let k = keys::tier_key("acme", &tier, &id);
        assert_eq!(
            keys::cluster_slot(k.as_bytes()),
            keys::bucket_slot(keys::bucket_of("acme")),
            "{k}"
        );
    }
    // Whatever a dirty set holds, parsing it never panics and gives back a
    // valid tenant.
    if let Some((t, _)) = keys::parse_dirty_member(&id) {
        assert!(validate::tenant(t).is_ok());
    }
    // Durations: what parses formats back to the same duration.
    if let Ok(d) = duration::parse(&id) {
        assert_eq!(duration::parse(&duration::format(d)), Ok(d), "{id:?}");
    }
    // Digests: 64 hex digits of either case, written back in lower case.
    if let Ok(digest) = KeyDigest::parse_hex(&id) {
        assert_eq!(digest.to_hex(), id.trim().to_ascii_lowercase());
    }
    // API keys: only the configured key authenticates, and only for its
    // scope and tenant.
    let auth = &fixture::signed().auth;
    let presented = presented_key_from(authorization, api_key);
    match presented {
        Ok(Some(k)) => match auth.principal(Some(k), &[]) {
            Ok(who) => {
                assert_eq!(k, fixture::API_KEY.as_bytes());
                assert!(who.require(Scope::Check, Some("acme")).is_ok());
                assert!(who.require(Scope::Refund, Some("acme")).is_err());
                assert!(who.require(Scope::Check, Some("other")).is_err());
            }
            Err(e) => {
                assert_ne!(k, fixture::API_KEY.as_bytes());
                assert!(e.is_unauthenticated());
            }
        },
        Ok(None) => assert!(authorization.is_none()),
        Err(e) => assert!(e.is_unauthenticated()),
    }
    tenant_ok || key_ok
}
