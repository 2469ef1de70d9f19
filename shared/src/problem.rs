//! RFC 9457 problem details: the one error body of both binaries' HTTP APIs.
//!
//! Every refusal, by a region-node or an aggregator, is an
//! `application/problem+json` body rather than a bare status or free text:
//! `type` is a stable URI under [`PROBLEM_BASE`] that a client can switch on
//! (`invalid-field`, `unknown-tenant`, `store-unavailable`, …), `detail` says
//! what was wrong in words, and extension members name the culprit (the
//! `field`, the `violated-policy`). One type for both binaries keeps the
//! shape, the type URIs and the media type the same everywhere.
//!
//! Behind the `http` feature: the rest of this crate knows nothing of HTTP.

use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

/// Where problem type URIs live: `type` is this followed by the slug.
pub const PROBLEM_BASE: &str = "https://tierlimit.dev/problems/";

/// An RFC 9457 problem response.
///
/// The body holds `type`, `title`, `status`, `detail` and the extension
/// members, in the sorted order of a `serde_json::Map`.
#[derive(Debug)]
pub struct Problem {
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    detail: String,
    extra: serde_json::Map<String, Value>,
    headers: HeaderMap,
}

impl Problem {
    /// A problem of type `PROBLEM_BASE` + `slug`.
    pub fn new(
        status: StatusCode,
        slug: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Problem {
        Problem {
            status,
            slug,
            title,
            detail: detail.into(),
            extra: serde_json::Map::new(),
            headers: HeaderMap::new(),
        }
    }

    /// Adds the extension member `k`.
    pub fn with(mut self, k: &str, v: impl Into<Value>) -> Problem {
        self.extra.insert(k.into(), v.into());
        self
    }

    /// Adds a response header (`Content-Type` is always the problem's own).
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Problem {
        self.headers.insert(name, value);
        self
    }

    /// 400 `invalid-field`, naming the request field.
    pub fn bad_field(field: &str, detail: impl Into<String>) -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-field",
            "Invalid request field",
            detail,
        )
        .with("field", field)
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What was wrong, in words (the body's `detail`).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The last segment of the type URI (a metrics label, for instance).
    pub fn slug(&self) -> &'static str {
        self.slug
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = serde_json::Map::new();
        body.insert("type".into(), format!("{PROBLEM_BASE}{}", self.slug).into());
        body.insert("title".into(), self.title.into());
        body.insert("status".into(), self.status.as_u16().into());
        body.insert("detail".into(), self.detail.into());
        body.extend(self.extra);
        let mut resp = (
            self.status,
            serde_json::to_string(&body).unwrap_or_default(),
        )
            .into_response();
        resp.headers_mut().extend(self.headers);
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parts(p: Problem) -> (StatusCode, HeaderMap, String) {
        let resp = p.into_response();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn body_has_the_members_in_sorted_order() {
        let p = Problem::new(
            StatusCode::FORBIDDEN,
            "unknown-tenant",
            "Unknown tenant",
            "no such tenant",
        )
        .with("tenant", "acme");
        assert_eq!(p.status(), StatusCode::FORBIDDEN);
        assert_eq!(p.slug(), "unknown-tenant");
        let (status, headers, body) = parts(p).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(
            body,
            r#"{"detail":"no such tenant","status":403,"tenant":"acme","title":"Unknown tenant","type":"https://tierlimit.dev/problems/unknown-tenant"}"#
        );
    }

    #[tokio::test]
    async fn bad_field_names_the_field_and_headers_are_kept() {
        let p = Problem::bad_field("cost", "cost must be positive")
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1"));
        let (status, headers, body) = parts(p).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["field"], "cost");
        assert_eq!(v["status"], 400);
        assert_eq!(v["type"], "https://tierlimit.dev/problems/invalid-field");
        assert_eq!(v["title"], "Invalid request field");
    }
}
