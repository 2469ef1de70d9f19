//! The harness's API key: every region-node and aggregator started by
//! testkit accepts it (with every scope), and [`crate::http_client`] sends
//! it, so tests exercise the authenticated API exactly as deployed instead
//! of a weakened default. A test of authentication itself builds a client
//! without it (see `tests/tests/security.rs`).
//!
//! The key is added through `TIERLIMIT__AUTH__KEYS__HARNESS__*` environment
//! overrides, beside whatever keys a test's configuration names.

use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use tierlimit_shared::auth::KeyDigest;

/// The harness's key (test-only; never valid outside the test processes).
pub const HARNESS_KEY: &str = "tl-harness-3f9c1e7a5b2d4c6e8f0a1b3c5d7e9f21";

/// Environment variables that add the harness key to a process's
/// configuration, as `auth.keys.harness` with every scope.
pub fn harness_env() -> Vec<(String, String)> {
    vec![
        (
            "TIERLIMIT__AUTH__KEYS__HARNESS__SHA256".into(),
            KeyDigest::of(HARNESS_KEY.as_bytes()).to_hex(),
        ),
        (
            "TIERLIMIT__AUTH__KEYS__HARNESS__SCOPES".into(),
            r#"["check", "refund", "read", "admin"]"#.into(),
        ),
    ]
}

/// `Authorization: Bearer <HARNESS_KEY>`, for clients built by hand.
pub fn harness_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {HARNESS_KEY}")).expect("ASCII key"),
    );
    h
}
