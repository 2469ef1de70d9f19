//! One record of the limits topic: a tenant or a plan at a version.
//!
//! The body is JSON inside the signed frame (`wire::codec`, kind `Limits`):
//! the same tables a TOML file holds (`PlanConfig`, `TenantConfig`), so a
//! record and a file are validated by the same functions
//! (`config::resolve_plan`, `config::resolve_tenant`) and an operator can
//! read a record with any Kafka tool. JSON rather than postcard because
//! those tables skip absent fields, which a positional format cannot.

use serde::{Deserialize, Serialize};

use crate::config::{PlanConfig, TenantConfig};
use crate::messages::DecodeError;

/// What a record is about. Its Kafka key is [`Subject::key`]: one per
/// tenant or plan, so compaction keeps each one's latest record.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", content = "name", rename_all = "snake_case")]
pub enum Subject {
    Plan(String),
    Tenant(String),
}

impl Subject {
    /// The Kafka key: `p|<plan>` or `t|<tenant>`.
    pub fn key(&self) -> String {
        match self {
            Subject::Plan(p) => format!("p|{p}"),
            Subject::Tenant(t) => format!("t|{t}"),
        }
    }

    /// The subject a Kafka key names.
    pub fn from_key(key: &[u8]) -> Option<Subject> {
        let key = std::str::from_utf8(key).ok()?;
        match key.split_once('|')? {
            ("p", name) => Some(Subject::Plan(name.to_owned())),
            ("t", name) => Some(Subject::Tenant(name.to_owned())),
            _ => None,
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Subject::Plan(n) | Subject::Tenant(n) => n,
        }
    }
}

/// The state a record gives its subject.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Body {
    Plan(PlanConfig),
    Tenant(TenantConfig),
    /// The subject no longer exists (a signed deletion: followers never
    /// act on Kafka's null tombstones, which anyone allowed to produce to
    /// the topic could write).
    Deleted,
}

/// A tenant or plan at a version. Unknown fields are ignored, so a later
/// writer may add some (the signature covers them all the same).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LimitsRecord {
    #[serde(flatten)]
    pub subject: Subject,
    /// Grows with every record the writer writes (all subjects share one
    /// sequence), so "version V applied" means every earlier record is.
    pub version: u64,
    /// Who wrote it (a user, a billing system, `import`).
    pub writer: String,
    /// The writer's wall clock (Unix ms).
    pub ts_ms: u64,
    pub body: Body,
}

impl LimitsRecord {
    /// The record's JSON (what is signed, inside the frame).
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a record serializes")
    }

    /// Parses a record's JSON and checks what can be checked without the
    /// rest of the limits (names, the body's kind against the subject's);
    /// the body's tiers are checked when applied, by the same functions as
    /// a file's.
    pub fn from_json(bytes: &[u8]) -> Result<LimitsRecord, DecodeError> {
        let r: LimitsRecord = serde_json::from_slice(bytes)
            .map_err(|e| DecodeError::Field(format!("limits record: {e}")))?;
        match &r.subject {
            Subject::Tenant(t) => {
                crate::validate::tenant(t).map_err(|e| DecodeError::Field(e.to_string()))?
            }
            Subject::Plan(p) => crate::validate::name("plan name", p)
                .map_err(|e| DecodeError::Field(e.to_string()))?,
        }
        match (&r.subject, &r.body) {
            (Subject::Plan(_), Body::Tenant(_)) | (Subject::Tenant(_), Body::Plan(_)) => {
                return Err(DecodeError::Field(
                    "limits record: the body's kind differs from the subject's".into(),
                ))
            }
            _ => {}
        }
        if r.version == 0 {
            return Err(DecodeError::Field(
                "limits record: versions start at 1".into(),
            ));
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_name_their_key() {
        let r = LimitsRecord {
            subject: Subject::Tenant("acme".into()),
            version: 7,
            writer: "ops".into(),
            ts_ms: 1,
            body: Body::Tenant(TenantConfig {
                time_zone: Default::default(),
                plan: "pro".into(),
                node: None,
                region: None,
                global: None,
                on_store_error: None,
                grants: Vec::new(),
            }),
        };
        let json = r.to_json();
        let text = String::from_utf8(json.clone()).unwrap();
        assert!(text.contains(r#""kind":"tenant","name":"acme""#), "{text}");
        let back = LimitsRecord::from_json(&json).unwrap();
        assert_eq!((back.subject.clone(), back.version), (r.subject.clone(), 7));
        assert_eq!(
            Subject::from_key(r.subject.key().as_bytes()),
            Some(r.subject)
        );
        assert_eq!(Subject::from_key(b"x|acme"), None);
    }

    #[test]
    fn malformed_records_are_refused() {
        for bad in [
            r#"{"kind":"tenant","name":"acme","version":1,"writer":"w","ts_ms":1,"body":{"plan":{"node":null,"region":null,"global":null}}}"#,
            r#"{"kind":"tenant","name":"a b","version":1,"writer":"w","ts_ms":1,"body":"deleted"}"#,
            r#"{"kind":"tenant","name":"acme","version":0,"writer":"w","ts_ms":1,"body":"deleted"}"#,
            r#"not json"#,
        ] {
            assert!(LimitsRecord::from_json(bad.as_bytes()).is_err(), "{bad}");
        }
        let ok =
            r#"{"kind":"plan","name":"pro","version":3,"writer":"w","ts_ms":1,"body":"deleted"}"#;
        assert!(LimitsRecord::from_json(ok.as_bytes()).is_ok());
    }
}
