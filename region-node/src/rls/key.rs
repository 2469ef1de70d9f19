//! The counting key of a descriptor: its entries' values, encoded so that
//! no value can reach another key.
//!
//! Keys end up in Redis key names, whose alphabet excludes `{ } : |` and
//! spaces ([`tierlimit_shared::validate::key`]); descriptor values are
//! anything an HTTP client sends (paths, IPv6 addresses with `:`, user
//! agents). Every byte outside `[A-Za-z0-9._-@]` is written `+XX` (hex),
//! values are joined by `/`, and the whole is prefixed `e.`: the encoding
//! is injective, so two different descriptors never share a counter. A key
//! longer than the key limit is replaced by `h.` and the SHA-256 of the
//! values (length-prefixed), still injective in practice and of fixed size.
//! The entries' keys need not be encoded: the rule a descriptor matched
//! fixes them, and the rule id is part of the Redis key already.

use sha2::{Digest, Sha256};
use std::fmt::Write;

use tierlimit_shared::validate::MAX_KEY_LEN;

/// The counting key of a descriptor's values (in entry order).
pub fn counting_key<'a>(values: impl IntoIterator<Item = &'a str> + Clone) -> String {
    let mut out = String::with_capacity(64);
    out.push_str("e.");
    for (i, v) in values.clone().into_iter().enumerate() {
        if i > 0 {
            out.push('/');
        }
        for b in v.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@') {
                out.push(b as char);
            } else {
                let _ = write!(out, "+{b:02X}");
            }
        }
        if out.len() > MAX_KEY_LEN {
            break;
        }
    }
    if out.len() <= MAX_KEY_LEN {
        return out;
    }
    let mut h = Sha256::new();
    for v in values {
        h.update((v.len() as u64).to_be_bytes());
        h.update(v.as_bytes());
    }
    let mut out = String::with_capacity(66);
    out.push_str("h.");
    for b in h.finalize() {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierlimit_shared::validate;

    #[test]
    fn keys_are_valid_and_distinct() {
        let cases: &[&[&str]] = &[
            &["2001:db8::1"],
            &["2001:db8:0::1"],
            &["10.0.0.1"],
            &["a/b"],
            &["a", "b"],
            &["a+2Fb"],
            &["{x}|y z"],
            &[""],
            &["", ""],
        ];
        let mut seen = std::collections::BTreeSet::new();
        for c in cases {
            let k = counting_key(c.iter().copied());
            validate::key(&k).unwrap_or_else(|e| panic!("{c:?} → {k}: {e}"));
            assert!(seen.insert(k.clone()), "{c:?} collides: {k}");
        }
        assert_eq!(counting_key(["2001:db8::1"]), "e.2001+3Adb8+3A+3A1");
    }

    #[test]
    fn long_values_are_hashed() {
        let long = "x".repeat(300);
        let k = counting_key([long.as_str()]);
        assert!(k.starts_with("h.") && k.len() == 66, "{k}");
        validate::key(&k).unwrap();
        let other = format!("{long}y");
        assert_ne!(k, counting_key([other.as_str()]));
    }
}
