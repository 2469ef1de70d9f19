//! Key material as written in the configuration (base64), parsed once.
//!
//! Errors are plain strings: the configuration validator wraps them in a
//! `ConfigError` naming the key.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use ed25519_dalek::{SigningKey, VerifyingKey};

/// Shortest accepted HMAC secret: the size of SHA-256's output, below which
/// HMAC-SHA256 loses strength.
pub const MIN_HMAC_SECRET: usize = 32;

fn b64(text: &str) -> Result<Vec<u8>, String> {
    STANDARD
        .decode(text.trim())
        .map_err(|e| format!("not base64 ({e}); generate one with `openssl rand -base64 32`"))
}

/// An HMAC-SHA256 secret: base64 of at least 32 bytes.
pub fn hmac_secret(text: &str) -> Result<Vec<u8>, String> {
    let bytes = b64(text)?;
    if bytes.len() < MIN_HMAC_SECRET {
        return Err(format!(
            "decodes to {} bytes, at least {MIN_HMAC_SECRET} are required (`openssl rand -base64 32`)",
            bytes.len()
        ));
    }
    Ok(bytes)
}

fn exactly_32(text: &str, what: &str) -> Result<[u8; 32], String> {
    let bytes = b64(text)?;
    <[u8; 32]>::try_from(bytes.as_slice())
        .map_err(|_| format!("{what} must decode to 32 bytes, got {}", bytes.len()))
}

/// An Ed25519 public key: base64 of its 32 bytes.
pub fn ed25519_public(text: &str) -> Result<VerifyingKey, String> {
    let bytes = exactly_32(text, "an Ed25519 public key")?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| "not a valid Ed25519 public key".to_owned())
}

/// An Ed25519 private key: base64 of its 32-byte seed.
pub fn ed25519_private(text: &str) -> Result<SigningKey, String> {
    Ok(SigningKey::from_bytes(&exactly_32(
        text,
        "an Ed25519 private key (seed)",
    )?))
}

/// A new broadcast key pair from 32 random bytes: `(private, public)`, both
/// base64, as the configuration takes them.
pub fn ed25519_pair_from_seed(seed: [u8; 32]) -> (String, String) {
    let signing = SigningKey::from_bytes(&seed);
    (
        STANDARD.encode(signing.to_bytes()),
        STANDARD.encode(signing.verifying_key().to_bytes()),
    )
}

/// A new random broadcast key pair `(private, public)` from the operating
/// system's random source (`aggregator keygen`).
pub fn ed25519_generate() -> std::io::Result<(String, String)> {
    use std::io::Read;
    let mut seed = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut seed)?;
    Ok(ed25519_pair_from_seed(seed))
}

/// Base64 of bytes, for secrets made by tools and tests.
pub fn encode(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses_key_material() {
        assert!(hmac_secret(&encode(&[7; 32])).is_ok());
        assert!(hmac_secret(&encode(&[7; 31]))
            .unwrap_err()
            .contains("31 bytes"));
        assert!(hmac_secret("not base64!").is_err());
        let (private, public) = ed25519_pair_from_seed([1; 32]);
        let signing = ed25519_private(&private).unwrap();
        assert_eq!(signing.verifying_key(), ed25519_public(&public).unwrap());
        assert!(ed25519_public(&encode(&[1; 31])).is_err());
    }
}
