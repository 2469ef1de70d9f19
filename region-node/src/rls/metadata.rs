//! The dynamic metadata of an RLS answer: what Envoy's ratelimit filter
//! stores in the request's `envoy.filters.http.ratelimit` namespace, for
//! the filters and the router after it (envoyproxy/ratelimit's example
//! turns `metadata.service_with_quota.name` into a header, then into
//! load-balancer metadata that picks an upstream subset).
//!
//! Built as envoyproxy/ratelimit builds it (`ratelimitToMetadata`):
//! `metadata`, the passed descriptors' configured metadata (merged by
//! [`super::service`]); and with `rls.response_dynamic_metadata` also
//! `domain`, `descriptors` (each one's `entries` as `key=value` and its
//! `hitsAddend`) and the request's `hitsAddend`. Nothing to say is no
//! struct at all, so an answer of a configuration without metadata costs
//! nothing more.

use std::collections::HashMap;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

use tierlimit_shared::rls::{MetaValue, Metadata};

/// The answer's dynamic metadata: `passed` under `metadata`, and with
/// `whole` the request's domain, descriptors and hits.
pub fn answer(req: &RateLimitRequest, passed: Option<Metadata>, whole: bool) -> Option<Struct> {
    if passed.is_none() && !whole {
        return None;
    }
    let mut fields = HashMap::new();
    if let Some(m) = passed {
        fields.insert("metadata".to_string(), to_struct_value(&m));
    }
    if whole {
        fields.insert("domain".into(), kind(Kind::StringValue(req.domain.clone())));
        let descriptors = req
            .descriptors
            .iter()
            .map(|d| {
                let entries = d
                    .entries
                    .iter()
                    .map(|e| kind(Kind::StringValue(format!("{}={}", e.key, e.value))))
                    .collect();
                let mut f = HashMap::from([(
                    "entries".to_string(),
                    kind(Kind::ListValue(ListValue { values: entries })),
                )]);
                if let Some(h) = &d.hits_addend {
                    f.insert("hitsAddend".into(), kind(Kind::NumberValue(h.value as f64)));
                }
                kind(Kind::StructValue(Struct { fields: f }))
            })
            .collect();
        fields.insert(
            "descriptors".into(),
            kind(Kind::ListValue(ListValue {
                values: descriptors,
            })),
        );
        if req.hits_addend != 0 {
            fields.insert(
                "hitsAddend".into(),
                kind(Kind::NumberValue(f64::from(req.hits_addend))),
            );
        }
    }
    Some(Struct { fields })
}

fn kind(k: Kind) -> Value {
    Value { kind: Some(k) }
}

fn to_struct_value(m: &Metadata) -> Value {
    kind(Kind::StructValue(Struct {
        fields: m.iter().map(|(k, v)| (k.clone(), to_value(v))).collect(),
    }))
}

/// A configured value as `google.protobuf.Value` (numbers are doubles
/// there too).
fn to_value(v: &MetaValue) -> Value {
    match v {
        MetaValue::Bool(b) => kind(Kind::BoolValue(*b)),
        MetaValue::Number(n) => kind(Kind::NumberValue(*n)),
        MetaValue::String(s) => kind(Kind::StringValue(s.clone())),
        MetaValue::List(l) => kind(Kind::ListValue(ListValue {
            values: l.iter().map(to_value).collect(),
        })),
        MetaValue::Struct(m) => to_struct_value(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

    fn request() -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 }),
                ..Default::default()
            }],
            hits_addend: 2,
        }
    }

    #[test]
    fn nothing_to_say_is_no_struct() {
        assert_eq!(answer(&request(), None, false), None);
    }

    #[test]
    fn metadata_becomes_a_struct_and_whole_adds_the_request() {
        let quota = Metadata::from([
            ("name".to_string(), MetaValue::String("a".into())),
            ("weight".to_string(), MetaValue::Number(2.0)),
            ("on".to_string(), MetaValue::Bool(true)),
            (
                "zones".to_string(),
                MetaValue::List(vec![MetaValue::String("x".into())]),
            ),
        ]);
        let passed = Metadata::from([("service_with_quota".to_string(), MetaValue::Struct(quota))]);
        let s = answer(&request(), Some(passed.clone()), false).unwrap();
        assert_eq!(s.fields.keys().collect::<Vec<_>>(), ["metadata"]);
        let Some(Kind::StructValue(m)) = &s.fields["metadata"].kind else {
            panic!("{s:?}")
        };
        let Some(Kind::StructValue(q)) = &m.fields["service_with_quota"].kind else {
            panic!("{m:?}")
        };
        assert_eq!(q.fields["name"].kind, Some(Kind::StringValue("a".into())));
        assert_eq!(q.fields["weight"].kind, Some(Kind::NumberValue(2.0)));
        assert_eq!(q.fields["on"].kind, Some(Kind::BoolValue(true)));

        let whole = answer(&request(), Some(passed), true).unwrap();
        assert_eq!(
            whole.fields["domain"].kind,
            Some(Kind::StringValue("d".into()))
        );
        assert_eq!(
            whole.fields["hitsAddend"].kind,
            Some(Kind::NumberValue(2.0))
        );
        let Some(Kind::ListValue(ds)) = &whole.fields["descriptors"].kind else {
            panic!("{whole:?}")
        };
        let Some(Kind::StructValue(d)) = &ds.values[0].kind else {
            panic!("{ds:?}")
        };
        assert_eq!(
            d.fields["entries"].kind,
            Some(Kind::ListValue(ListValue {
                values: vec![kind(Kind::StringValue("k=v".into()))]
            }))
        );
        // A descriptor's hits_addend, even 0, is reported as sent.
        assert_eq!(d.fields["hitsAddend"].kind, Some(Kind::NumberValue(0.0)));
        // Without a request hits_addend, none.
        let mut r = request();
        r.hits_addend = 0;
        assert!(!answer(&r, None, true)
            .unwrap()
            .fields
            .contains_key("hitsAddend"));
    }
}
