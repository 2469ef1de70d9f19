//! Who may call what: API keys and client certificates mapped to scopes and
//! tenants.
//!
//! A key is a high-entropy secret the caller sends as
//! `Authorization: Bearer <key>` (or `x-api-key: <key>`); the configuration
//! holds only its SHA-256 digest (`[auth.keys.<name>] sha256 = "<hex>"`), so
//! a leaked configuration file gives nobody a key. A fast hash is enough
//! because keys are random (≥ 128 bits), not passwords: a slow password hash
//! would add milliseconds to every check. The presented key's digest is
//! compared with *every* configured digest in constant time (no early exit),
//! so the timing of a refusal says nothing about which bytes matched.
//!
//! With TLS and a client CA, a client certificate is an alternative: the
//! certificate's DNS subject-alternative names are matched against
//! `[auth.clients.<name>] dns_name`.
//!
//! Scopes: `check` (`/v1/check`), `refund` (a refund by handle), `read`
//! (usage views, and reading tenants and plans), `admin` (free-form
//! refunds), `limits:write` (writing tenants and plans through the limits
//! API). A key may be limited to some tenants, except one holding
//! `limits:write`: a tenant's own key must never be able to raise its own
//! limits, so the configuration refuses that pair. A request without credentials gets `auth.open_scopes` (none by
//! default): a deployment can leave `check` open on a trusted interface, and
//! says so in its configuration.
//!
//! The configuration is read per request from the live configuration, so a
//! SIGHUP that adds or revokes a key takes effect on the next request.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

/// What a caller may do. A key lists its scopes; none implies another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Ask for a decision (`/v1/check`).
    Check,
    /// Give back a charge by its refund handle.
    Refund,
    /// Read usage (`/v1/tenants/…`, `/v1/global/…`, `/v1/over-limit`).
    Read,
    /// Operator actions: free-form refunds tied to no charge.
    Admin,
    /// Writing tenants and plans (the limits API, `aggregator limits`).
    /// Never held by a key restricted to tenants.
    #[serde(rename = "limits:write")]
    LimitsWrite,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Scope::Check => "check",
            Scope::Refund => "refund",
            Scope::Read => "read",
            Scope::Admin => "admin",
            Scope::LimitsWrite => "limits:write",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// A small set of scopes (a bit set: checked on every request).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scopes(u8);

impl Scopes {
    pub fn contains(self, s: Scope) -> bool {
        self.0 & s.bit() != 0
    }
}

impl FromIterator<Scope> for Scopes {
    fn from_iter<I: IntoIterator<Item = Scope>>(it: I) -> Self {
        Scopes(it.into_iter().fold(0, |acc, s| acc | s.bit()))
    }
}

/// The SHA-256 digest of a key, written as 64 hex digits in the
/// configuration (`printf %s "$KEY" | sha256sum`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyDigest(pub [u8; 32]);

impl KeyDigest {
    /// The digest of a presented key.
    pub fn of(key: &[u8]) -> KeyDigest {
        KeyDigest(Sha256::digest(key).into())
    }

    /// Parses 64 hex digits (either case).
    pub fn parse_hex(s: &str) -> Result<KeyDigest, String> {
        let s = s.trim();
        if s.len() != 64 {
            return Err(format!(
                "a SHA-256 digest is 64 hex digits, got {} characters",
                s.len()
            ));
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.as_bytes().chunks(2).enumerate() {
            let hex = |c: u8| match c {
                b'0'..=b'9' => Some(c - b'0'),
                b'a'..=b'f' => Some(c - b'a' + 10),
                b'A'..=b'F' => Some(c - b'A' + 10),
                _ => None,
            };
            match (hex(pair[0]), hex(pair[1])) {
                (Some(h), Some(l)) => out[i] = h << 4 | l,
                _ => return Err(format!("not a hex digit at position {}", 2 * i)),
            }
        }
        Ok(KeyDigest(out))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyDigest({})", self.to_hex())
    }
}

impl<'de> Deserialize<'de> for KeyDigest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        KeyDigest::parse_hex(&s).map_err(serde::de::Error::custom)
    }
}

impl Serialize for KeyDigest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

/// `[auth]`: keys, client certificates and what is open without either.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Scopes a request without credentials gets on the main listener.
    /// Default none: every API call needs a key or a client certificate.
    /// `["check"]` leaves checks open, for a listener only trusted callers
    /// can reach.
    pub open_scopes: BTreeSet<Scope>,
    /// API keys by name (the name appears in logs, never the key).
    pub keys: BTreeMap<String, KeyConfig>,
    /// Client certificates (mTLS) by name, matched on a DNS SAN.
    pub clients: BTreeMap<String, ClientConfig>,
}

/// `[auth.keys.<name>]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// SHA-256 of the key, hex.
    pub sha256: KeyDigest,
    pub scopes: BTreeSet<Scope>,
    /// Tenants the key may act for; absent: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<BTreeSet<String>>,
}

/// `[auth.clients.<name>]`: a client certificate, verified against
/// `http.tls_client_ca`, identified by one of its DNS SANs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    pub dns_name: String,
    pub scopes: BTreeSet<Scope>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<BTreeSet<String>>,
}

/// Who is calling, as far as authorization cares.
#[derive(Debug, Clone)]
pub struct Principal {
    /// `key:<name>`, `client:<name>` or `anonymous`.
    pub name: Arc<str>,
    pub scopes: Scopes,
    /// `None`: any tenant.
    pub tenants: Option<Arc<BTreeSet<String>>>,
    pub anonymous: bool,
}

/// Why a request is refused before it reaches its handler, or by a scope
/// check in it. 401s say "who are you?", 403s "not you".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("this route needs the `{0}` scope: send `Authorization: Bearer <key>`")]
    Missing(&'static str),
    #[error("the API key is not valid")]
    BadKey,
    #[error("the client certificate is not mapped to any scope (auth.clients)")]
    UnknownClient,
    #[error("{who} lacks the `{scope}` scope")]
    Scope { who: String, scope: &'static str },
    #[error("{who} may not act for tenant {tenant:?}")]
    Tenant { who: String, tenant: String },
}

impl AuthError {
    /// 401 (no or unknown credentials) or 403 (known, not allowed).
    pub fn is_unauthenticated(&self) -> bool {
        matches!(
            self,
            AuthError::Missing(_) | AuthError::BadKey | AuthError::UnknownClient
        )
    }
}

impl AuthConfig {
    /// The principal of a request: by key if one is presented (a wrong key
    /// is refused, never downgraded to anonymous), else by client
    /// certificate DNS names, else anonymous with `open_scopes`.
    pub fn principal(
        &self,
        key: Option<&[u8]>,
        cert_dns_names: &[String],
    ) -> Result<Principal, AuthError> {
        if let Some(key) = key {
            let presented = KeyDigest::of(key);
            let mut found: Option<(&String, &KeyConfig)> = None;
            // Every digest is compared, whatever matched before.
            for (name, k) in &self.keys {
                if bool::from(k.sha256.0.ct_eq(&presented.0)) {
                    found = Some((name, k));
                }
            }
            let (name, k) = found.ok_or(AuthError::BadKey)?;
            return Ok(Principal {
                name: format!("key:{name}").into(),
                scopes: k.scopes.iter().copied().collect(),
                tenants: k.tenants.clone().map(Arc::new),
                anonymous: false,
            });
        }
        if !cert_dns_names.is_empty() {
            let (name, c) = self
                .clients
                .iter()
                .find(|(_, c)| {
                    cert_dns_names
                        .iter()
                        .any(|n| n.eq_ignore_ascii_case(&c.dns_name))
                })
                .ok_or(AuthError::UnknownClient)?;
            return Ok(Principal {
                name: format!("client:{name}").into(),
                scopes: c.scopes.iter().copied().collect(),
                tenants: c.tenants.clone().map(Arc::new),
                anonymous: false,
            });
        }
        Ok(Principal::anonymous(
            self.open_scopes.iter().copied().collect(),
        ))
    }

    /// Errors naming the key of what types cannot check.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let mut seen: BTreeMap<[u8; 32], &str> = BTreeMap::new();
        for (name, k) in &self.keys {
            crate::validate::name("auth key name", name)
                .map_err(|e| (format!("auth.keys.{name}"), e.to_string()))?;
            if k.scopes.is_empty() {
                return Err((
                    format!("auth.keys.{name}.scopes"),
                    "must name at least one scope (check, refund, read, admin, limits:write)"
                        .into(),
                ));
            }
            no_self_upgrade(&format!("auth.keys.{name}"), &k.scopes, &k.tenants)?;
            if let Some(other) = seen.insert(k.sha256.0, name) {
                return Err((
                    format!("auth.keys.{name}.sha256"),
                    format!("the same digest as auth.keys.{other}"),
                ));
            }
            check_tenants(&format!("auth.keys.{name}.tenants"), &k.tenants)?;
        }
        for (name, c) in &self.clients {
            if c.dns_name.is_empty() {
                return Err((
                    format!("auth.clients.{name}.dns_name"),
                    "must not be empty".into(),
                ));
            }
            if c.scopes.is_empty() {
                return Err((
                    format!("auth.clients.{name}.scopes"),
                    "must name at least one scope".into(),
                ));
            }
            check_tenants(&format!("auth.clients.{name}.tenants"), &c.tenants)?;
            no_self_upgrade(&format!("auth.clients.{name}"), &c.scopes, &c.tenants)?;
        }
        if self.open_scopes.contains(&Scope::Admin) {
            return Err((
                "auth.open_scopes".into(),
                "`admin` cannot be open: free-form refunds hand capacity back".into(),
            ));
        }
        if self.open_scopes.contains(&Scope::LimitsWrite) {
            return Err((
                "auth.open_scopes".into(),
                "`limits:write` cannot be open: it changes every tenant's limits".into(),
            ));
        }
        Ok(())
    }
}

/// A key restricted to tenants is a tenant's key: with `limits:write` it
/// could raise its own limits (or anyone's: a plan is shared).
fn no_self_upgrade(
    at: &str,
    scopes: &BTreeSet<Scope>,
    tenants: &Option<BTreeSet<String>>,
) -> Result<(), (String, String)> {
    if scopes.contains(&Scope::LimitsWrite) && tenants.is_some() {
        return Err((
            format!("{at}.scopes"),
            "`limits:write` cannot be held by a key restricted to tenants (a tenant's key \
             must not change its own limits); give it to an operator's key without `tenants`"
                .into(),
        ));
    }
    Ok(())
}

fn check_tenants(key: &str, t: &Option<BTreeSet<String>>) -> Result<(), (String, String)> {
    for t in t.iter().flatten() {
        crate::validate::tenant(t).map_err(|e| (key.to_string(), e.to_string()))?;
    }
    Ok(())
}

impl Principal {
    pub fn anonymous(scopes: Scopes) -> Principal {
        Principal {
            name: "anonymous".into(),
            scopes,
            tenants: None,
            anonymous: true,
        }
    }

    /// Whether this caller may use `scope` for `tenant` (`None`: a route
    /// about no single tenant).
    pub fn require(&self, scope: Scope, tenant: Option<&str>) -> Result<(), AuthError> {
        if !self.scopes.contains(scope) {
            return Err(if self.anonymous {
                AuthError::Missing(scope.name())
            } else {
                AuthError::Scope {
                    who: self.name.to_string(),
                    scope: scope.name(),
                }
            });
        }
        if let Some(t) = tenant {
            if !self.may_see(t) {
                return Err(AuthError::Tenant {
                    who: self.name.to_string(),
                    tenant: t.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Whether `tenant` is within this caller's tenants.
    pub fn may_see(&self, tenant: &str) -> bool {
        self.tenants.as_ref().is_none_or(|ts| ts.contains(tenant))
    }
}

/// The key of a request's headers: `Authorization: Bearer <key>` or
/// `x-api-key: <key>`. `Err` when an `Authorization` header is present but
/// not a bearer token (so a misconfigured client hears why).
#[cfg(feature = "http")]
pub fn presented_key(h: &axum::http::HeaderMap) -> Result<Option<&[u8]>, AuthError> {
    presented_key_from(
        h.get(axum::http::header::AUTHORIZATION)
            .map(|v| v.as_bytes()),
        h.get("x-api-key").map(|v| v.as_bytes()),
    )
}

/// [`presented_key`] from the two header values' bytes, without HTTP
/// types (the fuzz targets call it on arbitrary bytes).
pub fn presented_key_from<'a>(
    authorization: Option<&'a [u8]>,
    x_api_key: Option<&'a [u8]>,
) -> Result<Option<&'a [u8]>, AuthError> {
    if let Some(v) = authorization {
        let scheme = b"bearer ";
        if v.len() > scheme.len() && v[..scheme.len()].eq_ignore_ascii_case(scheme) {
            return Ok(Some(v[scheme.len()..].trim_ascii()));
        }
        return Err(AuthError::BadKey);
    }
    Ok(x_api_key.map(|v| v.trim_ascii()))
}

#[cfg(feature = "http")]
impl From<AuthError> for crate::problem::Problem {
    fn from(e: AuthError) -> Self {
        use crate::problem::Problem;
        use axum::http::{header, HeaderValue, StatusCode};
        if e.is_unauthenticated() {
            Problem::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Authentication required",
                e.to_string(),
            )
            .with_header(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"tierlimit\""),
            )
        } else {
            let p = Problem::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "Not allowed",
                e.to_string(),
            );
            match e {
                AuthError::Scope { scope, .. } => p.with("scope", scope),
                AuthError::Tenant { tenant, .. } => p.with("tenant", tenant),
                _ => p,
            }
        }
    }
}

/// What the authentication layer needs: the live configuration (keys are
/// reloaded with it) and the refusal counter.
#[cfg(feature = "http")]
#[derive(Clone)]
pub struct Authn {
    pub live: crate::reload::Live,
    pub on_reject: crate::serve::OnReject,
}

/// Authenticates every route of `router` (added so far): the request
/// gets a [`Principal`] extension that handlers check scopes and tenants
/// against; a bad key or an unknown client certificate is a counted 401
/// here. Routes added after this call (`/healthz`, `/readyz`) stay open.
#[cfg(feature = "http")]
pub fn require_auth<S: Clone + Send + Sync + 'static>(
    router: axum::Router<S>,
    authn: Authn,
) -> axum::Router<S> {
    router.route_layer(axum::middleware::from_fn_with_state(authn, authenticate))
}

#[cfg(feature = "http")]
async fn authenticate(
    axum::extract::State(a): axum::extract::State<Authn>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let principal = {
        let names = req
            .extensions()
            .get::<crate::serve::ClientIdentity>()
            .map(|c| c.0.clone())
            .unwrap_or_default();
        presented_key(req.headers())
            .and_then(|key| a.live.load().config.auth.principal(key, &names))
    };
    match principal {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(e) => {
            tracing::debug!(error = %e, path = %req.uri().path(), "request refused");
            let p = crate::problem::Problem::from(e);
            (a.on_reject)(p.slug());
            p.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AuthConfig {
        toml::from_str(&format!(
            r#"
            [keys.checkout]
            sha256 = "{}"
            scopes = ["check", "refund"]
            tenants = ["acme"]
            [keys.ops]
            sha256 = "{}"
            scopes = ["read", "admin"]
            [clients.billing]
            dns_name = "billing.internal"
            scopes = ["read"]
            "#,
            KeyDigest::of(b"k-checkout").to_hex(),
            KeyDigest::of(b"k-ops").to_hex().to_uppercase(),
        ))
        .unwrap()
    }

    #[test]
    fn digests_parse_from_hex_of_either_case_and_refuse_the_rest() {
        let d = KeyDigest::of(b"abc");
        // The well-known SHA-256 of "abc".
        assert_eq!(
            d.to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(KeyDigest::parse_hex(&d.to_hex().to_uppercase()), Ok(d));
        assert!(KeyDigest::parse_hex("abc")
            .unwrap_err()
            .contains("64 hex digits"));
        let bad = format!("{}g", &d.to_hex()[..63]);
        assert!(KeyDigest::parse_hex(&bad)
            .unwrap_err()
            .contains("position 62"));
    }

    #[test]
    fn keys_map_to_their_scopes_and_tenants() {
        let c = config();
        c.validate().unwrap();
        let p = c.principal(Some(b"k-checkout"), &[]).unwrap();
        assert_eq!(&*p.name, "key:checkout");
        assert!(p.require(Scope::Check, Some("acme")).is_ok());
        assert!(matches!(
            p.require(Scope::Check, Some("globex")),
            Err(AuthError::Tenant { .. })
        ));
        assert!(matches!(
            p.require(Scope::Admin, None),
            Err(AuthError::Scope { scope: "admin", .. })
        ));
        let ops = c.principal(Some(b"k-ops"), &[]).unwrap();
        assert!(ops.require(Scope::Read, Some("anyone")).is_ok());
        assert!(ops.require(Scope::Check, Some("acme")).is_err());
        assert_eq!(
            c.principal(Some(b"k-wrong"), &[]).unwrap_err(),
            AuthError::BadKey
        );
        // A wrong key is refused even when a certificate would be good.
        assert_eq!(
            c.principal(Some(b"nope"), &["billing.internal".into()])
                .unwrap_err(),
            AuthError::BadKey
        );
    }

    #[test]
    fn client_certificates_and_anonymous_callers() {
        let mut c = config();
        let p = c
            .principal(None, &["x.example".into(), "Billing.Internal".into()])
            .unwrap();
        assert_eq!(&*p.name, "client:billing");
        assert!(p.require(Scope::Read, Some("t")).is_ok());
        assert_eq!(
            c.principal(None, &["stranger".into()]).unwrap_err(),
            AuthError::UnknownClient
        );
        let anon = c.principal(None, &[]).unwrap();
        let e = anon.require(Scope::Check, Some("acme")).unwrap_err();
        assert!(e.is_unauthenticated());
        c.open_scopes.insert(Scope::Check);
        let anon = c.principal(None, &[]).unwrap();
        assert!(anon.require(Scope::Check, Some("acme")).is_ok());
        assert!(anon
            .require(Scope::Refund, Some("acme"))
            .unwrap_err()
            .is_unauthenticated());
    }

    #[test]
    fn validation_names_the_key() {
        let mut c = config();
        c.open_scopes.insert(Scope::Admin);
        assert_eq!(c.validate().unwrap_err().0, "auth.open_scopes");
        let mut c = config();
        let dup = c.keys["checkout"].clone();
        c.keys.insert("again".into(), dup);
        assert_eq!(c.validate().unwrap_err().0, "auth.keys.checkout.sha256");
        let mut c = config();
        c.keys.get_mut("ops").unwrap().tenants = Some(["a:b".to_string()].into());
        assert_eq!(c.validate().unwrap_err().0, "auth.keys.ops.tenants");
        let mut c = config();
        c.keys.get_mut("ops").unwrap().scopes.clear();
        assert_eq!(c.validate().unwrap_err().0, "auth.keys.ops.scopes");
    }

    #[test]
    fn a_tenant_key_cannot_hold_limits_write() {
        // An operator's key may write limits.
        let mut c = config();
        c.keys
            .get_mut("ops")
            .unwrap()
            .scopes
            .insert(Scope::LimitsWrite);
        c.validate().unwrap();
        let ops = c.principal(Some(b"k-ops"), &[]).unwrap();
        assert!(ops.require(Scope::LimitsWrite, None).is_ok());
        // A key restricted to tenants may not, nor a client, nor anyone open.
        let mut c = config();
        c.keys
            .get_mut("checkout")
            .unwrap()
            .scopes
            .insert(Scope::LimitsWrite);
        let (key, why) = c.validate().unwrap_err();
        assert_eq!(key, "auth.keys.checkout.scopes");
        assert!(why.contains("limits:write"), "{why}");
        let mut c = config();
        c.open_scopes.insert(Scope::LimitsWrite);
        assert_eq!(c.validate().unwrap_err().0, "auth.open_scopes");
        let parsed: BTreeSet<Scope> = toml::from_str::<toml::Value>(r#"s = ["limits:write"]"#)
            .unwrap()["s"]
            .clone()
            .try_into()
            .unwrap();
        assert!(parsed.contains(&Scope::LimitsWrite));
        // Without the scope, a read key is refused a write.
        assert!(matches!(
            config()
                .principal(Some(b"k-ops"), &[])
                .unwrap()
                .require(Scope::LimitsWrite, None),
            Err(AuthError::Scope {
                scope: "limits:write",
                ..
            })
        ));
    }

    #[cfg(feature = "http")]
    #[test]
    fn keys_come_from_bearer_or_x_api_key() {
        use axum::http::{HeaderMap, HeaderValue};
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), Ok(None));
        h.insert("x-api-key", HeaderValue::from_static("k1"));
        assert_eq!(presented_key(&h), Ok(Some(&b"k1"[..])));
        h.insert("authorization", HeaderValue::from_static("bearer  k2 "));
        assert_eq!(presented_key(&h), Ok(Some(&b"k2"[..])));
        h.insert("authorization", HeaderValue::from_static("Basic Zm9v"));
        assert_eq!(presented_key(&h), Err(AuthError::BadKey));
    }
}
