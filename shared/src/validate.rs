//! Validation of tenant ids, keys and other names that end up inside Redis
//! keys and Kafka message keys.
//!
//! The key scheme (see [`crate::keys`]) joins parts with `:` and wraps the
//! tenant in a `{…}` hash tag, and Kafka keys join with `|`. An id that could
//! contain any of those could reach into another tenant's keys, so the allowed
//! alphabet excludes every separator we use. This is the only gate: anything
//! that reaches the key builders has passed through here.

use thiserror::Error;

/// Longest tenant id accepted (bytes).
pub const MAX_TENANT_LEN: usize = 64;
/// Longest key accepted (bytes).
pub const MAX_KEY_LEN: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InvalidId {
    #[error("{field} is empty")]
    Empty { field: &'static str },
    #[error("{field} is {len} bytes long; at most {max} are allowed")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{field} contains {ch:?}; allowed are ASCII letters, digits and {allowed}")]
    BadChar {
        field: &'static str,
        ch: char,
        allowed: &'static str,
    },
}

fn allowed(c: char, extra: &[char]) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') || extra.contains(&c)
}

fn check(
    field: &'static str,
    s: &str,
    max: usize,
    extra: &[char],
    allowed_text: &'static str,
) -> Result<(), InvalidId> {
    if s.is_empty() {
        return Err(InvalidId::Empty { field });
    }
    if s.len() > max {
        return Err(InvalidId::TooLong {
            field,
            len: s.len(),
            max,
        });
    }
    if let Some(ch) = s.chars().find(|c| !allowed(*c, extra)) {
        return Err(InvalidId::BadChar {
            field,
            ch,
            allowed: allowed_text,
        });
    }
    Ok(())
}

/// A tenant id: `[A-Za-z0-9._-]{1,64}`.
pub fn tenant(s: &str) -> Result<(), InvalidId> {
    check("tenant", s, MAX_TENANT_LEN, &[], "- _ .")
}

/// A key within a tenant (route, API key id, user …): `[A-Za-z0-9._/@+-]{1,128}`.
pub fn key(s: &str) -> Result<(), InvalidId> {
    check("key", s, MAX_KEY_LEN, &['/', '@', '+'], "- _ . / @ +")
}

/// A region name or node id: `[A-Za-z0-9._-]{1,64}`.
pub fn name(field: &'static str, s: &str) -> Result<(), InvalidId> {
    check(field, s, 64, &[], "- _ .")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_ids() {
        tenant("acme").unwrap();
        tenant("acme-corp_2.eu").unwrap();
        key("GET/v1/orders").unwrap();
        key("user@example.com+x").unwrap();
    }

    #[test]
    fn rejects_separators_and_tags() {
        for bad in ["a:b", "a{b", "a}b", "a|b", "a b", "a*", "ä", "a\nb", "a/b"] {
            assert!(tenant(bad).is_err(), "{bad:?}");
        }
        for bad in ["a:b", "{x}", "a|b", "a b", "x\u{0}"] {
            assert!(key(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn length_limits() {
        tenant(&"a".repeat(64)).unwrap();
        assert!(matches!(
            tenant(&"a".repeat(65)),
            Err(InvalidId::TooLong { .. })
        ));
        assert!(matches!(tenant(""), Err(InvalidId::Empty { .. })));
        key(&"k".repeat(128)).unwrap();
        assert!(key(&"k".repeat(129)).is_err());
    }
}
