//! Refund handles: a refund names the charge it gives back.
//!
//! An allowed check answers a handle that names everything the charge
//! touched: the region and the node that charged it, the tenant and the
//! counting key, the units, Redis' time of the charge, a random id, and
//! each windowed tier it was charged to with the window it fell in
//! (start and end). It is signed with HMAC-SHA-256 under
//! `node.refund_secret`. A refund presents it; then
//!
//! - it verifies only in the region that issued it: the secret is one for
//!   the whole deployment (it lives in `[node]`), so the region is in the
//!   signed payload and a node of another region refuses the handle
//!   ([`HandleError::OtherRegion`]); each region keeps its own record of
//!   used handles, so a handle accepted everywhere would give back once
//!   per region;
//! - it gives back to the tiers of the node that charged it, whichever
//!   node of the region the refund reaches: behind a load balancer a
//!   client cannot choose the node, and the node tier that holds the
//!   charge is the charging node's (given back on the refunding node, it
//!   would leave the charging node full and let the other admit its limit
//!   plus the refunds);
//! - it gives back exactly what was charged: its cost, to the tiers it
//!   names, only while the window it fell in is current, and to the global
//!   count only on the charge's day (the decision script checks both);
//! - it is refused once used (the id goes into a set of used handles, in
//!   the tenant's slot, written by refunds only so checks stay as cheap as
//!   before) and once every window it touched has ended
//!   ([`Handle::expires_at_ms`], checked by the script in Redis' clock);
//!   the set lives at least as long as the longest window it holds, so a
//!   handle cannot outlive its record.
//!
//! Handles of the previous format (`tenant|key|cost|charged_at_ms|id`,
//! no region, node or windows) are accepted for [`PREVIOUS_GRACE_MS`]
//! after their charge, with their old meaning (this node's tiers), so that
//! refunds in flight across a rolling upgrade are not lost; past it they are
//! refused as outdated. Without the signature anyone could mint a handle
//! for any charge, so a node without a secret issues none.
//!
//! Why HMAC and not a record of every charge: a record per allowed check
//! would add a write to every decision for the rare refund; the signature
//! makes the handle its own record, and only its use is written.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use tierlimit_shared::config::Limit;
use tierlimit_shared::day::SECS_PER_DAY;
use tierlimit_shared::validate;

use crate::storage::script::{RefundOf, Scope};

/// Bytes of the MAC kept in a handle: 128 bits are past any forging budget
/// and keep handles short.
const MAC_LEN: usize = 16;

const DAY_MS: u64 = SECS_PER_DAY * 1000;

/// How long after its charge a handle of the previous format (issued by a
/// node of the previous release) is still accepted: long enough for the
/// refunds of requests in flight during a rolling upgrade, short enough
/// that its missing region and windows (a replay in another region, a
/// reuse after its record expired) stay bounded to that time.
pub const PREVIOUS_GRACE_MS: u64 = 15 * 60 * 1000;

/// The current format's tag, the first field of the payload.
const FORMAT: &str = "2";

/// One windowed tier a charge was charged to, and the window it fell in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub scope: Scope,
    /// The algorithm's code (`Algorithm::code`).
    pub algorithm: u8,
    pub window_ms: u64,
    /// The window the charge counts in, Redis ms: a fixed or sliding
    /// window's current window; the time since the charge for a token
    /// bucket or a sliding log.
    pub start_ms: u64,
    pub end_ms: u64,
}

impl Window {
    /// The window a charge at `at_ms` fell in, for a tier of `limit`.
    pub fn of_charge(scope: Scope, limit: &Limit, at_ms: u64) -> Window {
        let w = limit.window_ms.max(1);
        let code = limit.algorithm.code();
        // Fixed and sliding windows give back only within the window the
        // charge was counted in (the script compares window indices); a
        // token bucket and a sliding log only within a window's length of
        // the charge.
        let start_ms = if code <= 2 { at_ms - at_ms % w } else { at_ms };
        Window {
            scope,
            algorithm: code,
            window_ms: limit.window_ms,
            start_ms,
            end_ms: start_ms + w,
        }
    }

    /// Whether a tier of the current plan is the tier this window was
    /// charged to (a reload that changed its algorithm or window made it
    /// another tier: nothing is given back to it).
    pub fn is_tier(&self, scope: Scope, limit: &Limit) -> bool {
        self.scope == scope
            && self.algorithm == limit.algorithm.code()
            && self.window_ms == limit.window_ms
    }

    fn encode(&self) -> String {
        let s = match self.scope {
            Scope::Node => 'n',
            Scope::Region => 'r',
        };
        format!(
            "{s},{},{},{},{}",
            self.algorithm, self.window_ms, self.start_ms, self.end_ms
        )
    }

    fn decode(text: &str) -> Option<Window> {
        let f: Vec<&str> = text.split(',').collect();
        let [s, alg, w, start, end] = f[..] else {
            return None;
        };
        let scope = match s {
            "n" => Scope::Node,
            "r" => Scope::Region,
            _ => return None,
        };
        Some(Window {
            scope,
            algorithm: alg.parse().ok()?,
            window_ms: w.parse().ok()?,
            start_ms: start.parse().ok()?,
            end_ms: end.parse().ok()?,
        })
    }
}

/// A charge, as its handle names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle {
    /// The region whose Redis holds the charge.
    pub region: String,
    /// The node whose node tier was charged.
    pub node: String,
    pub tenant: String,
    pub key: String,
    pub cost: u64,
    pub charged_at_ms: u64,
    pub id: String,
    /// The windowed tiers charged, each with its window.
    pub windows: Vec<Window>,
}

/// A handle of the previous format: no region, node or windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviousHandle {
    pub tenant: String,
    pub key: String,
    pub cost: u64,
    pub charged_at_ms: u64,
    pub id: String,
}

/// What a handle that verified names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verified {
    Current(Handle),
    /// Issued by a node of the previous release (see [`PREVIOUS_GRACE_MS`]).
    Previous(PreviousHandle),
}

/// Why a handle is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    #[error("refund handles are not enabled on this region (node.refund_secret is not set)")]
    Disabled,
    #[error("the refund handle is malformed")]
    Malformed,
    #[error("the refund handle's signature does not verify (not issued by this deployment)")]
    Forged,
    #[error("the refund handle was issued by region {issued:?}, not this one ({here:?}): refund it there")]
    OtherRegion { issued: String, here: String },
    #[error("the refund handle was used already: its charge was given back once")]
    Used,
    #[error(
        "every window the refund handle's charge was in has ended: nothing is left to give back"
    )]
    Expired,
    #[error("the refund handle is of the previous release's format and more than {} minutes old", PREVIOUS_GRACE_MS / 60_000)]
    Outdated,
}

impl HandleError {
    /// The `reason` label of `tierlimit_refund_refusals_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            HandleError::Disabled => "disabled",
            HandleError::Malformed => "malformed",
            HandleError::Forged => "forged",
            HandleError::OtherRegion { .. } => "other_region",
            HandleError::Used => "used",
            HandleError::Expired => "expired",
            HandleError::Outdated => "outdated",
        }
    }
}

/// Signs and verifies handles with the deployment's secret.
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
    /// `2|region|node|tenant|key|cost|charged_at_ms|id|windows`, the
    /// windows `;`-separated, each `scope,algorithm,window_ms,start,end`
    /// (`|`, `;` and `,` are in no name's alphabet).
    pub fn sign(&self, h: &Handle) -> String {
        let windows: Vec<String> = h.windows.iter().map(Window::encode).collect();
        let payload = format!(
            "{FORMAT}|{}|{}|{}|{}|{}|{}|{}|{}",
            h.region,
            h.node,
            h.tenant,
            h.key,
            h.cost,
            h.charged_at_ms,
            h.id,
            windows.join(";")
        );
        self.seal(&payload)
    }

    /// A handle as the previous release signed it (`tenant|key|cost|
    /// charged_at_ms|id`): for upgrade tests and tools.
    pub fn sign_previous(&self, h: &PreviousHandle) -> String {
        let payload = format!(
            "{}|{}|{}|{}|{}",
            h.tenant, h.key, h.cost, h.charged_at_ms, h.id
        );
        self.seal(&payload)
    }

    fn seal(&self, payload: &str) -> String {
        let mut mac = self.key.clone();
        mac.update(payload.as_bytes());
        let tag = mac.finalize().into_bytes();
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(payload),
            URL_SAFE_NO_PAD.encode(&tag[..MAC_LEN])
        )
    }

    /// The charge a handle names, if this deployment signed it. Where it
    /// may be refunded is the caller's to check ([`Handle::region`]).
    pub fn verify(&self, handle: &str) -> Result<Verified, HandleError> {
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
        let num = |s: &str| s.parse::<u64>().map_err(|_| HandleError::Malformed);
        let names = |tenant: &str, key: &str| -> Result<(), HandleError> {
            validate::tenant(tenant).map_err(|_| HandleError::Malformed)?;
            if key != tierlimit_shared::keys::WHOLE_TENANT {
                validate::key(key).map_err(|_| HandleError::Malformed)?;
            }
            Ok(())
        };
        match f[..] {
            [FORMAT, region, node, tenant, key, cost, at, id, windows] => {
                names(tenant, key)?;
                validate::name("region", region).map_err(|_| HandleError::Malformed)?;
                validate::name("node", node).map_err(|_| HandleError::Malformed)?;
                let windows = if windows.is_empty() {
                    Vec::new()
                } else {
                    windows
                        .split(';')
                        .map(Window::decode)
                        .collect::<Option<Vec<_>>>()
                        .ok_or(HandleError::Malformed)?
                };
                Ok(Verified::Current(Handle {
                    region: region.into(),
                    node: node.into(),
                    tenant: tenant.into(),
                    key: key.into(),
                    cost: num(cost)?,
                    charged_at_ms: num(at)?,
                    id: id.into(),
                    windows,
                }))
            }
            [tenant, key, cost, at, id] => {
                names(tenant, key)?;
                Ok(Verified::Previous(PreviousHandle {
                    tenant: tenant.into(),
                    key: key.into(),
                    cost: num(cost)?,
                    charged_at_ms: num(at)?,
                    id: id.into(),
                }))
            }
            _ => Err(HandleError::Malformed),
        }
    }
}

/// The end of the UTC day of `at_ms`: the day's global count is a window
/// every charge touches.
fn day_end(at_ms: u64) -> u64 {
    (at_ms / DAY_MS + 1) * DAY_MS
}

impl Handle {
    /// When every window the charge touched has ended (Redis ms): its
    /// tiers' windows and the day's global count. From then on nothing is
    /// left to give back and the handle is refused.
    pub fn expires_at_ms(&self) -> u64 {
        self.windows
            .iter()
            .map(|w| w.end_ms)
            .fold(day_end(self.charged_at_ms), u64::max)
    }

    /// What the decision script needs of it.
    pub fn refund_of(&self) -> RefundOf {
        RefundOf {
            id: self.id.clone(),
            charged_at_ms: self.charged_at_ms,
            expires_at_ms: self.expires_at_ms(),
        }
    }
}

impl PreviousHandle {
    /// What the decision script needs of it: its old meaning, for
    /// [`PREVIOUS_GRACE_MS`] after the charge (within the charge's day:
    /// the script gives back to the global count only then anyway).
    pub fn refund_of(&self) -> RefundOf {
        RefundOf {
            id: self.id.clone(),
            charged_at_ms: self.charged_at_ms,
            expires_at_ms: self.charged_at_ms + PREVIOUS_GRACE_MS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierlimit_shared::config::Algorithm;

    fn handle() -> Handle {
        Handle {
            region: "eu".into(),
            node: "a".into(),
            tenant: "acme".into(),
            key: "GET/x".into(),
            cost: 3,
            charged_at_ms: 1_790_000_000_123,
            id: "0123456789abcdef".into(),
            windows: vec![
                Window::of_charge(
                    Scope::Node,
                    &Limit {
                        algorithm: Algorithm::FixedWindow,
                        limit: 10,
                        window_ms: 1000,
                        burst: 10,
                    },
                    1_790_000_000_123,
                ),
                Window::of_charge(
                    Scope::Region,
                    &Limit {
                        algorithm: Algorithm::SlidingLog,
                        limit: 10,
                        window_ms: 7 * DAY_MS,
                        burst: 10,
                    },
                    1_790_000_000_123,
                ),
            ],
        }
    }

    #[test]
    fn a_signed_handle_verifies_and_round_trips() {
        let s = Signer::new(b"a region secret of at least 32 bytes!");
        assert_eq!(
            s.verify(&s.sign(&handle())),
            Ok(Verified::Current(handle()))
        );
        let mut none = handle();
        none.windows.clear();
        assert_eq!(s.verify(&s.sign(&none)), Ok(Verified::Current(none)));
    }

    #[test]
    fn windows_and_expiry_are_those_of_the_charge() {
        let h = handle();
        assert_eq!(
            (h.windows[0].start_ms, h.windows[0].end_ms),
            (1_790_000_000_000, 1_790_000_001_000),
            "a fixed window: the window the charge was counted in"
        );
        assert_eq!(
            h.windows[1].start_ms, h.charged_at_ms,
            "a log: from the charge"
        );
        assert_eq!(
            h.expires_at_ms(),
            h.charged_at_ms + 7 * DAY_MS,
            "the longest window touched, past the day's end"
        );
        let mut short = h.clone();
        short.windows.truncate(1);
        assert_eq!(
            short.expires_at_ms(),
            day_end(h.charged_at_ms),
            "the day's global count is touched by every charge"
        );
    }

    #[test]
    fn a_previous_release_handle_verifies_with_a_bounded_grace() {
        let s = Signer::new(b"a region secret of at least 32 bytes!");
        let old = PreviousHandle {
            tenant: "acme".into(),
            key: "_".into(),
            cost: 2,
            charged_at_ms: 1_790_000_000_123,
            id: "00ff".into(),
        };
        let v = s.verify(&s.sign_previous(&old)).unwrap();
        assert_eq!(v, Verified::Previous(old.clone()));
        assert_eq!(
            old.refund_of().expires_at_ms,
            old.charged_at_ms + PREVIOUS_GRACE_MS
        );
    }

    #[test]
    fn another_secret_or_a_changed_byte_is_refused() {
        let s = Signer::new(b"a region secret of at least 32 bytes!");
        let other = Signer::new(b"another region's secret, 32 bytes long");
        let h = s.sign(&handle());
        assert_eq!(other.verify(&h), Err(HandleError::Forged));
        // Change the region in the payload: the MAC no longer matches.
        let mut forged = handle();
        forged.region = "us".into();
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
