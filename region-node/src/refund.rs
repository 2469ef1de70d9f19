//! Refund handles: a refund names the charge it gives back.
//!
//! An allowed check answers a handle: the tenant, the counting key, the
//! units charged, Redis' time of the charge and a random id, signed with
//! HMAC-SHA-256 under the region's `node.refund_secret`. A refund presents
//! it; the decision script then gives back at most those units, only to
//! windows the charge was in and only to the charge's day, and once: the
//! handle's id goes into a set in the tenant's slot (written by refunds
//! only, so checks stay as cheap as before), and a retried refund gives
//! nothing more. Without the signature anyone could mint a handle for any
//! charge, so a node without a secret issues none.
//!
//! Why HMAC and not a record of every charge: a record per allowed check
//! would add a write to every decision for the rare refund; the signature
//! makes the handle its own record, and only its use is written.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use tierlimit_shared::validate;

use crate::storage::script::RefundOf;

/// Bytes of the MAC kept in a handle: 128 bits are past any forging budget
/// and keep handles short.
const MAC_LEN: usize = 16;

/// A charge, as its handle names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle {
    pub tenant: String,
    pub key: String,
    pub cost: u64,
    pub charged_at_ms: u64,
    pub id: String,
}

/// Why a handle is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    #[error("refund handles are not enabled on this region (node.refund_secret is not set)")]
    Disabled,
    #[error("the refund handle is malformed")]
    Malformed,
    #[error("the refund handle's signature does not verify (not issued by this region)")]
    Forged,
}

/// Signs and verifies handles with the region's secret.
#[derive(Clone)]
pub struct Signer {
    key: Hmac<Sha256>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer(…)")
    }
}

impl Signer {
    pub fn new(secret: &[u8]) -> Signer {
        Signer {
            key: Hmac::new_from_slice(secret).expect("HMAC takes keys of any length"),
        }
    }

    /// `<payload>.<mac>`, both base64url without padding; the payload is
    /// `tenant|key|cost|charged_at_ms|id` (`|` is in no id's alphabet).
    pub fn sign(&self, h: &Handle) -> String {
        let payload = format!(
            "{}|{}|{}|{}|{}",
            h.tenant, h.key, h.cost, h.charged_at_ms, h.id
        );
        let mut mac = self.key.clone();
        mac.update(payload.as_bytes());
        let tag = mac.finalize().into_bytes();
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(payload),
            URL_SAFE_NO_PAD.encode(&tag[..MAC_LEN])
        )
    }

    /// The charge a handle names, if this region signed it.
    pub fn verify(&self, handle: &str) -> Result<Handle, HandleError> {
        let (payload, tag) = handle.split_once('.').ok_or(HandleError::Malformed)?;
        let payload = URL_SAFE_NO_PAD
            .decode(payload)
            .map_err(|_| HandleError::Malformed)?;
        let tag = URL_SAFE_NO_PAD
            .decode(tag)
            .map_err(|_| HandleError::Malformed)?;
        if tag.len() != MAC_LEN {
            return Err(HandleError::Forged);
        }
        let mut mac = self.key.clone();
        mac.update(&payload);
        // Constant time: the comparison must not tell a forger how many
        // leading bytes were right.
        mac.verify_truncated_left(&tag)
            .map_err(|_| HandleError::Forged)?;
        let payload = String::from_utf8(payload).map_err(|_| HandleError::Malformed)?;
        let f: Vec<&str> = payload.split('|').collect();
        let [tenant, key, cost, at, id] = f[..] else {
            return Err(HandleError::Malformed);
        };
        validate::tenant(tenant).map_err(|_| HandleError::Malformed)?;
        if key != tierlimit_shared::keys::WHOLE_TENANT {
            validate::key(key).map_err(|_| HandleError::Malformed)?;
        }
        Ok(Handle {
            tenant: tenant.into(),
            key: key.into(),
            cost: cost.parse().map_err(|_| HandleError::Malformed)?,
            charged_at_ms: at.parse().map_err(|_| HandleError::Malformed)?,
            id: id.into(),
        })
    }
}

impl Handle {
    /// What the decision script needs of it.
    pub fn refund_of(&self) -> RefundOf {
        RefundOf {
            id: self.id.clone(),
            charged_at_ms: self.charged_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> Handle {
        Handle {
            tenant: "acme".into(),
            key: "GET/x".into(),
            cost: 3,
            charged_at_ms: 1_790_000_000_123,
            id: "0123456789abcdef".into(),
        }
    }

    #[test]
    fn a_signed_handle_verifies_and_round_trips() {
        let s = Signer::new(b"a region secret of at least 32 bytes!");
        assert_eq!(s.verify(&s.sign(&handle())), Ok(handle()));
    }

    #[test]
    fn another_secret_or_a_changed_byte_is_refused() {
        let s = Signer::new(b"a region secret of at least 32 bytes!");
        let other = Signer::new(b"another region's secret, 32 bytes long");
        let h = s.sign(&handle());
        assert_eq!(other.verify(&h), Err(HandleError::Forged));
        // Raise the cost in the payload: the MAC no longer matches.
        let mut forged = handle();
        forged.cost = 1000;
        let (payload, _) = other
            .sign(&forged)
            .split_once('.')
            .map(|(p, t)| (p.to_string(), t.to_string()))
            .unwrap();
        let (_, tag) = h.split_once('.').unwrap();
        assert_eq!(
            s.verify(&format!("{payload}.{tag}")),
            Err(HandleError::Forged)
        );
        assert_eq!(s.verify("nonsense"), Err(HandleError::Malformed));
        assert_eq!(s.verify("!!.!!"), Err(HandleError::Malformed));
        // A truncated tag is not accepted either.
        let short = &h[..h.len() - 4];
        assert!(s.verify(short).is_err());
    }
}
