//! A check or refund as an HTTP caller sends it (`tierlimit_shared::check`,
//! what region-node's handlers call): the JSON body of `POST /v1/check`
//! and `/v1/refund`, the query of `GET /v1/check`, the `Content-Type`.
//!
//! Input: the whole input is tried as a JSON body (declared
//! `application/json`) and as a query string; then its first line is taken
//! as the `Content-Type` and the rest as the body.

use std::borrow::Cow;

use tierlimit_shared::check::{self, BadCheck, Check, Refund};
use tierlimit_shared::validate;

const JSON: Option<&str> = Some("application/json");

/// A parsed check written back as JSON parses to the same check.
fn json_round_trip(c: &Check<'_>) {
    let mut body = serde_json::json!({ "tenant": c.tenant, "cost": c.cost });
    if let Some(k) = &c.key {
        body["key"] = k.as_ref().into();
    }
    let bytes = serde_json::to_vec(&body).expect("a JSON value serialises");
    let again = check::from_body(JSON, &bytes).expect("a written check parses");
    assert_eq!(&again, c);
}

/// A parsed check written back as a query parses to the same check.
fn query_round_trip(c: &Check<'_>) {
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("tenant", &c.tenant);
    if let Some(k) = &c.key {
        q.append_pair("key", k);
    }
    q.append_pair("cost", &c.cost.to_string());
    let again = check::from_query(pairs(q.finish().as_bytes())).expect("a written query parses");
    assert_eq!(&again, c);
}

/// A query string split as axum's `Query<Vec<(String, String)>>` splits it.
fn pairs(query: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(query).into_owned().collect()
}

pub fn check(data: &[u8]) -> bool {
    let mut accepted = false;
    if let Ok(c) = check::from_body(JSON, data) {
        json_round_trip(&c);
        query_round_trip(&c);
        // What the decider validates next never panics on it.
        let _ = validate::tenant(&c.tenant);
        if let Some(k) = &c.key {
            let _ = validate::key(k);
        }
        accepted = true;
    }
    match check::refund_from_body(JSON, data) {
        Ok(Refund::Handle { handle, .. }) => {
            if let Some(t) = check::handle_tenant(&handle) {
                assert!(!t.contains('|'));
            }
        }
        Ok(Refund::FreeForm(c)) => json_round_trip(&c),
        Err(_) => {}
    }
    match check::from_query(pairs(data)) {
        Ok(c) => {
            assert!(matches!(c.tenant, Cow::Owned(_)));
            json_round_trip(&c);
            query_round_trip(&c);
            accepted = true;
        }
        Err(BadCheck::Field { field, .. }) => {
            // The field named is one the query gave, or the missing tenant.
            assert!(
                field == "tenant" || pairs(data).iter().any(|(k, _)| *k == field),
                "{field:?}"
            );
        }
        Err(e) => panic!("a query cannot fail with {e:?}"),
    }
    let (first, rest) = match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let content_type = std::str::from_utf8(first).ok();
    match check::parse_json(content_type, rest) {
        Ok(_) => {
            let mime = content_type.unwrap_or("").split(';').next().unwrap_or("");
            assert!(mime.trim().eq_ignore_ascii_case("application/json"));
        }
        Err(BadCheck::MediaType { got }) => assert_eq!(got, content_type.unwrap_or("")),
        Err(_) => {}
    }
    accepted
}
