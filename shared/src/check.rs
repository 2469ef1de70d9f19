//! A check or refund request, parsed from what a caller sent: the JSON body
//! of `POST /v1/check` and `POST /v1/refund`, or the query of
//! `GET /v1/check`.
//!
//! Pure parsing, no HTTP types: region-node's handlers call it after axum
//! has read the body or split the query, and the fuzz targets
//! (`fuzz-targets/`) call it on arbitrary bytes without building a server.
//! Ids are *not* validated here: the decider validates tenant and key
//! ([`crate::validate`]) before anything is charged, whatever route they
//! came by. A [`BadCheck`] becomes the API's problem+json through
//! `From<BadCheck> for Problem` (feature `http`).

use std::borrow::Cow;
use std::collections::HashMap;

use serde::Deserialize;
use thiserror::Error;

/// Why a request is not a check (or refund) at all.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BadCheck {
    /// 415: the body is not declared JSON (`got` is the `Content-Type` as
    /// sent, `""` when absent or not visible ASCII).
    #[error("expected Content-Type: application/json, got {got:?}")]
    MediaType { got: String },
    /// 400: the body is not the JSON object of a check.
    #[error("{0}")]
    Json(String),
    /// 400: a field (or query parameter) is missing, repeated, unknown or
    /// malformed.
    #[error("{detail}")]
    Field { field: String, detail: String },
}

impl BadCheck {
    fn field(field: &str, detail: impl Into<String>) -> BadCheck {
        BadCheck::Field {
            field: field.to_owned(),
            detail: detail.into(),
        }
    }
}

/// A check: who is charged, under which key, how much. `Cow` so that the
/// query form moves its owned strings in; a body's strings come owned too
/// (serde borrows a `Cow` only outside an `Option`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check<'a> {
    pub tenant: Cow<'a, str>,
    pub key: Option<Cow<'a, str>>,
    /// 1 when not given.
    pub cost: u64,
}

/// The JSON body of check and refund.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Body<'a> {
    #[serde(borrow)]
    pub tenant: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub key: Option<Cow<'a, str>>,
    pub cost: Option<u64>,
    /// Refunds only: the handle of the charge to give back.
    #[serde(borrow, default)]
    pub handle: Option<Cow<'a, str>>,
}

/// A refund request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refund<'a> {
    /// Gives back (at most `cost` of) the charge the handle names.
    Handle {
        handle: Cow<'a, str>,
        cost: Option<u64>,
    },
    /// Tied to no charge: the `admin` scope's free-form refund.
    FreeForm(Check<'a>),
}

/// The body of `POST /v1/check`. `content_type` is the header as text
/// (`None` when absent or not visible ASCII).
pub fn from_body<'a>(content_type: Option<&str>, body: &'a [u8]) -> Result<Check<'a>, BadCheck> {
    let b = parse_json(content_type, body)?;
    if b.handle.is_some() {
        return Err(BadCheck::field("handle", "only a refund takes a handle"));
    }
    tenant_key_cost(b)
}

/// The body of `POST /v1/refund`: a handle (and optionally a cost), or a
/// free-form tenant, key and cost; never both.
pub fn refund_from_body<'a>(
    content_type: Option<&str>,
    body: &'a [u8],
) -> Result<Refund<'a>, BadCheck> {
    let b = parse_json(content_type, body)?;
    match b.handle {
        // The handle names the tenant and key: one beside it is refused.
        Some(_) if b.tenant.is_some() || b.key.is_some() => Err(BadCheck::field(
            "handle",
            "a refund by handle names no tenant or key: the handle does",
        )),
        Some(handle) => Ok(Refund::Handle {
            handle,
            cost: b.cost,
        }),
        None => tenant_key_cost(b).map(Refund::FreeForm),
    }
}

/// A JSON body of check or refund: the content type, then the JSON.
pub fn parse_json<'a>(content_type: Option<&str>, body: &'a [u8]) -> Result<Body<'a>, BadCheck> {
    let ct = content_type.unwrap_or("");
    let mime = ct.split(';').next().unwrap_or("").trim();
    if !mime.eq_ignore_ascii_case("application/json") {
        return Err(BadCheck::MediaType { got: ct.to_owned() });
    }
    serde_json::from_slice(body).map_err(|e| BadCheck::Json(e.to_string()))
}

/// Tenant (required), key and cost (default 1) of a body that names no
/// handle.
fn tenant_key_cost(b: Body<'_>) -> Result<Check<'_>, BadCheck> {
    let tenant = b
        .tenant
        .ok_or_else(|| BadCheck::field("tenant", "tenant is required"))?;
    Ok(Check {
        tenant,
        key: b.key,
        cost: b.cost.unwrap_or(1),
    })
}

/// Query parameters, each at most once: `?tenant=a&tenant=b` would
/// otherwise charge whichever one a map kept.
pub fn unique_query(q: Vec<(String, String)>) -> Result<HashMap<String, String>, BadCheck> {
    let mut map = HashMap::with_capacity(q.len());
    for (k, v) in q {
        if map.contains_key(&k) {
            let detail = format!("query parameter {k:?} is given more than once");
            return Err(BadCheck::Field { field: k, detail });
        }
        map.insert(k, v);
    }
    Ok(map)
}

/// The query of `GET /v1/check` (forward-auth callers): `tenant`, `key`,
/// `cost`, each at most once, nothing else.
pub fn from_query(q: Vec<(String, String)>) -> Result<Check<'static>, BadCheck> {
    let q = unique_query(q)?;
    if let Some(unknown) = q
        .keys()
        .find(|k| !["tenant", "key", "cost"].contains(&k.as_str()))
    {
        return Err(BadCheck::field(
            unknown,
            format!("unknown query parameter {unknown:?}"),
        ));
    }
    let mut q = q;
    let tenant = q
        .remove("tenant")
        .ok_or_else(|| BadCheck::field("tenant", "tenant is required"))?;
    let cost = match q.get("cost") {
        None => 1,
        Some(c) => c.parse::<u64>().map_err(|_| {
            BadCheck::field(
                "cost",
                format!("cost must be a positive integer, got {c:?}"),
            )
        })?,
    };
    Ok(Check {
        tenant: Cow::Owned(tenant),
        key: q.remove("key").map(Cow::Owned),
        cost,
    })
}

/// The tenant a refund handle names (`<payload>.<mac>`, the payload
/// `tenant|…`), unverified: authorization looks at it, the decider checks
/// the signature.
pub fn handle_tenant(handle: &str) -> Option<String> {
    use base64::Engine as _;
    let payload = handle.split_once('.')?.0;
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .ok()?;
    let payload = String::from_utf8(payload).ok()?;
    let fields: Vec<&str> = payload.split('|').collect();
    // The current format: `2|region|node|tenant|…` (nine fields); the
    // previous release's: `tenant|key|cost|charged_at_ms|id`.
    match fields[..] {
        ["2", _, _, tenant, _, _, _, _, _] => Some(tenant.to_owned()),
        _ => Some(fields.first()?.to_string()),
    }
}

#[cfg(feature = "http")]
impl From<BadCheck> for crate::problem::Problem {
    fn from(e: BadCheck) -> Self {
        use crate::problem::Problem;
        use axum::http::StatusCode;
        match e {
            BadCheck::MediaType { .. } => Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported-media-type",
                "Unsupported media type",
                e.to_string(),
            ),
            BadCheck::Json(detail) => Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid-json",
                "Invalid JSON body",
                detail,
            ),
            BadCheck::Field { field, detail } => Problem::bad_field(&field, detail),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: Option<&str> = Some("application/json");

    fn pairs(q: &[(&str, &str)]) -> Vec<(String, String)> {
        q.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn bodies() {
        let c = from_body(JSON, br#"{"tenant":"acme","key":"k","cost":3}"#).unwrap();
        assert_eq!(
            (&*c.tenant, c.key.as_deref(), c.cost),
            ("acme", Some("k"), 3)
        );
        let c = from_body(
            Some("Application/JSON; charset=utf-8"),
            br#"{"tenant":"a"}"#,
        )
        .unwrap();
        assert_eq!((c.key, c.cost), (None, 1));
        assert!(matches!(
            from_body(Some("text/plain"), b"{}"),
            Err(BadCheck::MediaType { got }) if got == "text/plain"
        ));
        assert!(matches!(
            from_body(None, b"{}"),
            Err(BadCheck::MediaType { got }) if got.is_empty()
        ));
        assert!(matches!(from_body(JSON, b"{"), Err(BadCheck::Json(_))));
        assert!(matches!(
            from_body(JSON, br#"{"tenant":"a","x":1}"#),
            Err(BadCheck::Json(_))
        ));
        assert!(matches!(
            from_body(JSON, br#"{"tenant":"a","cost":-1}"#),
            Err(BadCheck::Json(_))
        ));
        assert!(matches!(
            from_body(JSON, br#"{"key":"k"}"#),
            Err(BadCheck::Field { field, .. }) if field == "tenant"
        ));
        assert!(matches!(
            from_body(JSON, br#"{"tenant":"a","handle":"h"}"#),
            Err(BadCheck::Field { field, .. }) if field == "handle"
        ));
    }

    #[test]
    fn refunds() {
        assert_eq!(
            refund_from_body(JSON, br#"{"handle":"h.m","cost":2}"#).unwrap(),
            Refund::Handle {
                handle: "h.m".into(),
                cost: Some(2)
            }
        );
        assert!(matches!(
            refund_from_body(JSON, br#"{"tenant":"a","cost":2}"#).unwrap(),
            Refund::FreeForm(Check { cost: 2, .. })
        ));
        assert!(matches!(
            refund_from_body(JSON, br#"{"handle":"h","tenant":"a"}"#),
            Err(BadCheck::Field { field, .. }) if field == "handle"
        ));
    }

    #[test]
    fn queries() {
        let c = from_query(pairs(&[("tenant", "a"), ("cost", "7")])).unwrap();
        assert_eq!((&*c.tenant, c.key, c.cost), ("a", None, 7));
        let e = from_query(pairs(&[("tenant", "a:b"), ("tenant", "T")])).unwrap_err();
        assert!(
            matches!(e, BadCheck::Field { ref field, .. } if field == "tenant"),
            "{e:?}"
        );
        let e = from_query(pairs(&[("tenant", "a"), ("x", "1")])).unwrap_err();
        assert!(
            matches!(e, BadCheck::Field { ref field, .. } if field == "x"),
            "{e:?}"
        );
        let e = from_query(pairs(&[("tenant", "a"), ("cost", "-1")])).unwrap_err();
        assert!(
            matches!(e, BadCheck::Field { ref field, .. } if field == "cost"),
            "{e:?}"
        );
        let e = from_query(pairs(&[])).unwrap_err();
        assert!(
            matches!(e, BadCheck::Field { ref field, .. } if field == "tenant"),
            "{e:?}"
        );
    }

    #[test]
    fn handle_tenants() {
        use base64::Engine as _;
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("acme|k|1");
        assert_eq!(
            handle_tenant(&format!("{payload}.mac")).as_deref(),
            Some("acme")
        );
        let current =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("2|eu|a|acme|k|1|5|id|");
        assert_eq!(
            handle_tenant(&format!("{current}.mac")).as_deref(),
            Some("acme")
        );
        assert_eq!(handle_tenant("garbage"), None);
        assert_eq!(handle_tenant("!!.x"), None);
    }
}
