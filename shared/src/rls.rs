//! Envoy's rate limit service (RLS v3): how a request's (domain, descriptor)
//! maps to a tenant, a descriptor rule and its limit.
//!
//! The descriptor rules are envoyproxy/ratelimit's format, field for field,
//! so an existing YAML file is loaded as it is (`rls.envoy_configs`) or
//! turned into the same rules in TOML (`region-node import-envoy-config`):
//! both roads end in the same [`DomainConfig`], and so in the same rule ids
//! and counting keys, which is why they decide identically. Both roads
//! check a file as envoyproxy/ratelimit's loader does (`config_impl.go`),
//! each refusal naming the key ([`compile`]).
//!
//! A domain adds what envoyproxy/ratelimit has no notion of: which entry of
//! a descriptor names the **tenant** (`tenant_entry`, else the domain itself
//! is the tenant) and the **plan** of tenants that `[tenants]` does not list.
//! A descriptor's limit is a tier of its own beside the plan's node, region
//! and global tiers; ARCHITECTURE.md ("Descriptors and plans") says how they
//! combine, quota mode included.
//!
//! Matching follows envoyproxy/ratelimit: the descriptor's entries walk the
//! rule tree one level per entry, each level preferring a rule with the same
//! key and value, then the first wildcard (`value` with `*` anywhere, each
//! `*` any run of characters) in the order the file declares them, then a
//! rule with the key and no value; the limit is the one of the rule reached
//! by the last entry. Key-only and wildcard rules count each value apart,
//! except a wildcard with `share_threshold`, whose values share one counter
//! ([`Match::counted`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::config::{Algorithm, ConfigError, Limit, MAX_LIMIT};
use crate::validate;

/// Longest window of a descriptor limit: envoyproxy/ratelimit's `year` (365
/// days, its fixed divider). Plans keep their 7-day cap.
pub const MAX_DESCRIPTOR_WINDOW_MS: u64 = 365 * 86_400_000;

/// Deepest descriptor tree accepted (envoy descriptors are a few entries).
const MAX_DEPTH: usize = 16;

/// `[rls]`: the gRPC rate limit service's descriptor configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlsConfig {
    /// Decide and count every descriptor, but always answer OK (metrics
    /// carry `shadow="true"`). Per rule: `shadow_mode`; per plan:
    /// `plans.<name>.shadow_mode`. envoyproxy/ratelimit's `SHADOW_MODE`.
    pub shadow_mode: bool,
    /// Every descriptor with a rule in quota mode, as if each had
    /// `quota_mode: true` (envoyproxy/ratelimit's `QUOTA_MODE`): a request
    /// is over the limit only when every one of its descriptors but the
    /// `unlimited` ones is (or a plan's tier denies).
    #[serde(skip_serializing_if = "is_false")]
    pub quota_mode: bool,
    /// Answer every request with envoyproxy/ratelimit's whole dynamic
    /// metadata (`RESPONSE_DYNAMIC_METADATA`): `domain`, `descriptors`,
    /// `hitsAddend` beside the passed descriptors' `metadata`, which is
    /// sent whenever there is some.
    #[serde(skip_serializing_if = "is_false")]
    pub response_dynamic_metadata: bool,
    /// Merge domains configured more than once (envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG`): their descriptors join one tree, a key and
    /// value twice at one level is still refused. Off: a domain twice is
    /// refused.
    #[serde(skip_serializing_if = "is_false")]
    pub merge_domain_configs: bool,
    /// Plan of the tenants a domain names that `[tenants]` does not list,
    /// when the domain names no plan of its own. Unset: `unknown_tenants`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// envoyproxy/ratelimit YAML files, loaded as they are: each is a domain
    /// whose tenant is the domain name, with `rls.plan`. Relative paths are
    /// relative to the working directory; a SIGHUP reads them again.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub envoy_configs: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<DomainConfig>,
}

/// One RLS domain (`[[rls.domains]]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DomainConfig {
    /// The `domain` of envoy's `RateLimitRequest`.
    pub domain: String,
    /// The descriptor entry whose value is the tenant (e.g. `tenant`, filled
    /// by envoy from an `x-tenant` header or an API key). A descriptor
    /// without it, or a domain without `tenant_entry`, counts against the
    /// tenant named like the domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_entry: Option<String>,
    /// Plan of this domain's tenants that `[tenants]` does not list
    /// (default `rls.plan`, then `unknown_tenants`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// envoyproxy/ratelimit's descriptor rules.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub descriptors: Vec<DescriptorRule>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A YAML `descriptors:` (or `replaces:`) with nothing after it is null,
/// which envoyproxy/ratelimit reads as an empty list.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// One node of envoyproxy/ratelimit's descriptor tree (same field names).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DescriptorRule {
    /// Required; absent or empty is refused at [`compile`] with the key
    /// named (envoyproxy/ratelimit: "descriptor has empty key").
    #[serde(default)]
    pub key: String,
    /// Exact value; with `*` anywhere a wildcard (each `*` any run of
    /// characters, `prefix*` every value with the prefix); absent or empty:
    /// every value (each counted apart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitConfig>,
    /// Decide and count, but answer OK.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow_mode: bool,
    /// Over its limit, the rule denies only if every quota descriptor of
    /// the request is over too; otherwise the request goes on (this
    /// descriptor's status says OVER_LIMIT, nothing is charged to it) and
    /// the descriptors that passed return their `metadata`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub quota_mode: bool,
    /// envoyproxy/ratelimit puts the descriptor's values into the metric
    /// name; tierlimit keeps one series per rule whatever the values (the
    /// flag is accepted so files load unchanged; see README).
    #[serde(default, skip_serializing_if = "is_false")]
    pub detailed_metric: bool,
    /// As `detailed_metric`: accepted, metrics stay per rule.
    #[serde(default, skip_serializing_if = "is_false")]
    pub value_to_metric: bool,
    /// On a wildcard value only: every value the wildcard matches counts
    /// against one counter (instead of one per value).
    #[serde(default, skip_serializing_if = "is_false")]
    pub share_threshold: bool,
    /// Returned to Envoy as dynamic metadata (`envoy.filters.http.ratelimit`
    /// namespace, under `metadata`) when this rule's descriptor passed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Metadata>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub descriptors: Vec<DescriptorRule>,
}

/// A rule's limit (`rate_limit:`), envoyproxy/ratelimit's fields plus
/// tierlimit's `algorithm`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<Unit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_unit: Option<u64>,
    /// Never limited (and never counted). No `unit` with it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub unlimited: bool,
    /// The rule's name: what `replaces` refers to, and its metric label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Rules (by name) this one replaces when both match one request.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub replaces: Vec<Replaces>,
    /// Default `fixed_window` aligned to the Unix epoch, as
    /// envoyproxy/ratelimit counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<Algorithm>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Replaces {
    /// Required and not empty (checked at [`compile`], so `- name:` is
    /// refused with the key named rather than as a YAML type error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A descriptor's `metadata`: any YAML mapping, as envoyproxy/ratelimit
/// turns it into a `google.protobuf.Struct`.
pub type Metadata = BTreeMap<String, MetaValue>;

/// One value of [`Metadata`]: the kinds of `google.protobuf.Value` but null
/// (TOML, the import's language, has none; a null is refused with its key).
/// Numbers are doubles, as in the protobuf.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Bool(bool),
    Number(f64),
    String(String),
    List(Vec<MetaValue>),
    Struct(Metadata),
}

impl<'de> Deserialize<'de> for MetaValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<MetaValue, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MetaValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, number, boolean, list or mapping")
            }
            fn visit_bool<E>(self, v: bool) -> Result<MetaValue, E> {
                Ok(MetaValue::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<MetaValue, E> {
                Ok(MetaValue::Number(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<MetaValue, E> {
                Ok(MetaValue::Number(v as f64))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<MetaValue, E> {
                if v.is_finite() {
                    Ok(MetaValue::Number(v))
                } else {
                    Err(E::custom(format!("{v} is not a finite number")))
                }
            }
            fn visit_str<E>(self, v: &str) -> Result<MetaValue, E> {
                Ok(MetaValue::String(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<MetaValue, E> {
                Ok(MetaValue::String(v))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<MetaValue, E> {
                Err(E::custom(
                    "null is not supported in metadata (the TOML configuration has no null): give a value",
                ))
            }
            fn visit_none<E: serde::de::Error>(self) -> Result<MetaValue, E> {
                self.visit_unit()
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<MetaValue, D::Error> {
                MetaValue::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<MetaValue, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = a.next_element()? {
                    out.push(v);
                }
                Ok(MetaValue::List(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<MetaValue, A::Error> {
                let mut out = Metadata::new();
                while let Some((k, v)) = a.next_entry::<String, MetaValue>()? {
                    out.insert(k, v);
                }
                Ok(MetaValue::Struct(out))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for MetaValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        /// Integers are exact in a double up to 2^53: written as TOML
        /// integers (`2`, not `2.0`), read back as the same double.
        const EXACT: f64 = 9_007_199_254_740_992.0;
        match self {
            MetaValue::Bool(b) => s.serialize_bool(*b),
            MetaValue::Number(n) if n.fract() == 0.0 && n.abs() <= EXACT => {
                s.serialize_i64(*n as i64)
            }
            MetaValue::Number(n) => s.serialize_f64(*n),
            MetaValue::String(v) => s.serialize_str(v),
            MetaValue::List(l) => l.serialize(s),
            MetaValue::Struct(m) => m.serialize(s),
        }
    }
}

/// Merges `src` into `dest` as envoyproxy/ratelimit merges the metadata of
/// a request's passed descriptors (`mergeMetadata`): a key `dest` lacks is
/// added, two mappings under one key are merged, and otherwise the value
/// already there stays (the first descriptor that passed wins).
pub fn merge_metadata(dest: &mut Metadata, src: &Metadata) {
    for (k, v) in src {
        match (dest.get_mut(k), v) {
            (Some(MetaValue::Struct(d)), MetaValue::Struct(s)) => merge_metadata(d, s),
            (Some(_), _) => {}
            (None, _) => {
                dest.insert(k.clone(), v.clone());
            }
        }
    }
}

/// envoyproxy/ratelimit's units with its fixed dividers: a week is 7 days,
/// a month 30 days, a year 365 days (not calendar months).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    pub fn window_ms(self) -> u64 {
        const S: u64 = 1000;
        match self {
            Unit::Second => S,
            Unit::Minute => 60 * S,
            Unit::Hour => 3600 * S,
            Unit::Day => 86_400 * S,
            Unit::Week => 7 * 86_400 * S,
            Unit::Month => 30 * 86_400 * S,
            Unit::Year => 365 * 86_400 * S,
        }
    }

    /// The unit whose window is exactly `ms`, if any.
    pub fn of_window(ms: u64) -> Option<Unit> {
        Unit::ALL.into_iter().find(|u| u.window_ms() == ms)
    }
}

impl<'de> Deserialize<'de> for Unit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Unit, D::Error> {
        let s = String::deserialize(d)?;
        // envoyproxy/ratelimit accepts either case (`second`, `SECOND`).
        Unit::ALL
            .into_iter()
            .find(|u| u.name().eq_ignore_ascii_case(&s))
            .ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "unknown unit {s:?} (second, minute, hour, day, week, month, year)"
                ))
            })
    }
}

impl Serialize for Unit {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// An envoyproxy/ratelimit configuration file: one domain.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EnvoyFile {
    /// Required; absent or empty is refused at [`compile`] with the key
    /// named (envoyproxy/ratelimit: "config file cannot have empty domain").
    #[serde(default)]
    pub domain: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub descriptors: Vec<DescriptorRule>,
}

/// Why an envoyproxy/ratelimit file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
}

impl EnvoyFile {
    /// Parses an envoyproxy/ratelimit YAML document; errors name the field
    /// (`descriptors[0].rate_limit.unit: unknown unit "fortnight"`). What
    /// parses may still be refused by [`EnvoyFile::check`].
    pub fn parse(path: &str, text: &str) -> Result<EnvoyFile, ImportError> {
        let de = serde_norway::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| ImportError::Invalid {
            path: path.into(),
            reason: format!("{}: {}", e.path(), e.inner()),
        })
    }

    pub fn read(path: &Path) -> Result<EnvoyFile, ImportError> {
        let text = std::fs::read_to_string(path).map_err(|source| ImportError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&path.display().to_string(), &text)
    }

    /// Checks the file as envoyproxy/ratelimit's loader and [`compile`] do
    /// (the same rules as loading it through `rls.envoy_configs`), the key
    /// named from the file's root (`descriptors[1].rate_limit.unit: …`).
    /// The domain's plan is not known here, so it is not checked.
    pub fn check(&self, path: &str) -> Result<(), ImportError> {
        let mut domains = HashMap::new();
        add_domain(
            &mut domains,
            &DomainSource {
                at: String::new(),
                config: self.clone().into_domain(),
            },
            false,
            &|_| true,
        )
        .map_err(|e| ImportError::Invalid {
            path: path.into(),
            reason: match e {
                ConfigError::Invalid { key, reason } => format!("{key}: {reason}"),
                other => other.to_string(),
            },
        })
    }

    /// The domain as loaded directly: tenant = the domain, plan = `rls.plan`.
    pub fn into_domain(self) -> DomainConfig {
        DomainConfig {
            domain: self.domain,
            tenant_entry: None,
            plan: None,
            descriptors: self.descriptors,
        }
    }

    /// The equivalent `[[rls.domains]]` TOML, with comments saying what
    /// each limit becomes (`region-node import-envoy-config`, after
    /// [`EnvoyFile::check`]). Refused only for metadata TOML cannot write
    /// (an array mixing mappings and values).
    pub fn to_toml(&self, source: &str) -> Result<String, ImportError> {
        let mut out = String::new();
        out.push_str(&format!(
            "# Imported from envoyproxy/ratelimit configuration {source}.\n\
             # Paste into regions.toml. The domain is the tenant (set `tenant_entry` to take\n\
             # it from a descriptor entry instead); tenants not listed in [tenants] get\n\
             # `plan` below, else rls.plan, else unknown_tenants. Each rate_limit is a\n\
             # region-tier fixed window aligned to the Unix epoch, counted per distinct\n\
             # descriptor value, exactly as envoyproxy/ratelimit counts it; a plan's own\n\
             # node/region/global tiers apply on top (ARCHITECTURE.md, \"Descriptors and plans\").\n\
             # envoyproxy/ratelimit's QUOTA_MODE, RESPONSE_DYNAMIC_METADATA and\n\
             # MERGE_DOMAIN_CONFIG are [rls] quota_mode, response_dynamic_metadata and\n\
             # merge_domain_configs.\n\n"
        ));
        let domain = self.clone().into_domain();
        let wrapper = DomainsOnly {
            rls: DomainsInner {
                domains: vec![domain],
            },
        };
        let body = toml::to_string_pretty(&wrapper).map_err(|e| ImportError::Invalid {
            path: source.into(),
            reason: format!("cannot be written as TOML: {e}"),
        })?;
        // Comment each limit in place: `unit = "month"` → its window.
        let mut in_metadata = false;
        for line in body.lines() {
            let trimmed = line.trim_start();
            if let Some(u) = trimmed
                .strip_prefix("unit = \"")
                .and_then(|r| r.strip_suffix('"'))
            {
                if let Some(unit) = Unit::ALL.into_iter().find(|x| x.name() == u) {
                    out.push_str(&format!(
                        "# {}: a fixed window of {} s, aligned to the Unix epoch\n",
                        unit.name(),
                        unit.window_ms() / 1000
                    ));
                }
            }
            if trimmed.starts_with("shadow_mode = true") {
                out.push_str("# shadow: decided and counted, always answered OK\n");
            }
            if trimmed.starts_with("quota_mode = true") {
                out.push_str(
                    "# quota: over its limit, denies only when every quota descriptor of the request is over\n",
                );
            }
            if trimmed.starts_with("share_threshold = true") {
                out.push_str(
                    "# shared: every value the wildcard matches counts against one counter\n",
                );
            }
            if trimmed.starts_with("detailed_metric = true")
                || trimmed.starts_with("value_to_metric = true")
            {
                out.push_str(
                    "# accepted; tierlimit keeps one metric series per rule (bounded cardinality)\n",
                );
            }
            if trimmed.starts_with('[') {
                // The first table of a descriptor's metadata (its own, or
                // the first nested one when it holds only mappings).
                let meta = trimmed.contains(".metadata]") || trimmed.contains(".metadata.");
                if meta && !in_metadata {
                    out.push_str(
                        "# returned to Envoy as dynamic metadata when this descriptor passed\n",
                    );
                }
                in_metadata = meta;
            }
            out.push_str(line);
            out.push('\n');
        }
        Ok(out)
    }
}

#[derive(Serialize)]
struct DomainsOnly {
    rls: DomainsInner,
}
#[derive(Serialize)]
struct DomainsInner {
    domains: Vec<DomainConfig>,
}

/// A descriptor rule, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Stable id within the tenant's keys (`r<16 hex>`: a hash of domain and
    /// path, so a reload that keeps the rule keeps its counters).
    pub id: String,
    /// Metric label: the rule's `name`, else its path (`key=value/key`).
    pub label: String,
    /// `None`: `unlimited`, or a node without `rate_limit` (not a rule).
    pub limit: Option<Limit>,
    /// The envoy unit (for `current_limit` in the answer).
    pub unit: Option<Unit>,
    pub requests_per_unit: u64,
    pub shadow: bool,
    /// `quota_mode` (the rule's own; `rls.quota_mode` is in [`Compiled`]).
    pub quota: bool,
    pub name: Option<String>,
    pub replaces: Vec<String>,
    /// Returned as dynamic metadata when the descriptor passed.
    pub metadata: Option<Arc<Metadata>>,
}

/// One wildcard of a level: `key` with a value pattern, split at its `*`s
/// once at load.
#[derive(Debug)]
struct Wildcard {
    key: String,
    pattern: String,
    parts: Vec<String>,
    /// `share_threshold`: the pattern, not the value, is counted.
    share: bool,
    node: Node,
}

impl Wildcard {
    /// envoyproxy/ratelimit's `wildcardMatch`: the value starts with the
    /// first part, ends with the last, and holds the middle ones in order
    /// between them; each `*` matches any run of characters, none included.
    fn matches(&self, value: &str) -> bool {
        let parts = &self.parts;
        let (first, last) = (&parts[0], &parts[parts.len() - 1]);
        if value.len() < parts.iter().map(String::len).sum::<usize>()
            || !value.starts_with(first.as_str())
            || !value.ends_with(last.as_str())
        {
            return false;
        }
        let mut rest = &value[first.len()..value.len() - last.len()];
        for part in &parts[1..parts.len() - 1] {
            match rest.find(part.as_str()) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

#[derive(Debug, Default)]
struct Node {
    exact: HashMap<(String, String), Node>,
    /// In the order the configuration declares them: the first that
    /// matches wins, as in envoyproxy/ratelimit.
    wildcard: Vec<Wildcard>,
    any: HashMap<String, Node>,
    rule: Option<Arc<Rule>>,
}

impl Node {
    /// The child an entry walks to, and the pattern it counts by when it
    /// matched a `share_threshold` wildcard.
    fn child(&self, key: &str, value: &str) -> Option<(&Node, Option<&str>)> {
        if let Some(n) = self.exact.get(&(key.to_string(), value.to_string())) {
            return Some((n, None));
        }
        if let Some(w) = self
            .wildcard
            .iter()
            .find(|w| w.key == key && w.matches(value))
        {
            return Some((&w.node, w.share.then_some(w.pattern.as_str())));
        }
        self.any.get(key).map(|n| (n, None))
    }
}

/// One domain, compiled.
#[derive(Debug)]
pub struct Domain {
    pub name: String,
    pub tenant_entry: Option<String>,
    /// The plan named by the domain or by `rls.plan`.
    pub plan: Option<String>,
    root: Node,
}

/// The rule a descriptor reached, and how its entries are counted.
#[derive(Debug)]
pub struct Match<'a> {
    pub rule: &'a Arc<Rule>,
    /// Entry i's wildcard pattern when it matched one with
    /// `share_threshold` (on the way to the rule or at it).
    shared: [Option<&'a str>; MAX_DEPTH],
}

impl<'a> Match<'a> {
    /// What entry `i` (of value `value`) counts by: its value, or the
    /// pattern of the `share_threshold` wildcard it matched, so every
    /// value of the pattern shares one counter (as envoyproxy/ratelimit's
    /// cache key does). The rule id fixes which entries are patterns, so a
    /// pattern and a value never meet in one counter.
    pub fn counted<'b>(&'b self, i: usize, value: &'b str) -> &'b str {
        self.shared.get(i).copied().flatten().unwrap_or(value)
    }

    /// Whether any entry counts by a pattern.
    pub fn shares(&self) -> bool {
        self.shared.iter().any(Option::is_some)
    }
}

impl Domain {
    /// The rule a descriptor's entries reach, if any (see the module doc).
    pub fn rule<'a, I>(&self, entries: I) -> Option<Match<'_>>
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let mut node = &self.root;
        let mut shared = [None; MAX_DEPTH];
        for (i, (k, v)) in entries.into_iter().enumerate() {
            let (next, pattern) = node.child(k, v)?;
            if let Some(p) = pattern {
                *shared.get_mut(i)? = Some(p);
            }
            node = next;
        }
        node.rule.as_ref().map(|rule| Match { rule, shared })
    }
}

/// `[rls]`, compiled at load.
#[derive(Debug, Default)]
pub struct Compiled {
    pub shadow: bool,
    /// `rls.quota_mode`: every descriptor in quota mode.
    pub quota: bool,
    /// `rls.response_dynamic_metadata`.
    pub response_dynamic_metadata: bool,
    pub domains: HashMap<String, Domain>,
}

impl Compiled {
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// Every rule's metric label per domain (for dashboards and tests).
    pub fn labels(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out = BTreeMap::new();
        for (name, d) in &self.domains {
            let mut labels = BTreeSet::new();
            collect_labels(&d.root, &mut labels);
            out.insert(name.clone(), labels);
        }
        out
    }
}

fn collect_labels(n: &Node, out: &mut BTreeSet<String>) {
    if let Some(r) = &n.rule {
        out.insert(r.label.clone());
    }
    for c in n.exact.values().chain(n.any.values()) {
        collect_labels(c, out);
    }
    for w in &n.wildcard {
        collect_labels(&w.node, out);
    }
}

/// One configured domain and where it came from (the key errors name).
struct DomainSource {
    at: String,
    config: DomainConfig,
}

/// A domain being compiled: its tree, and the rule ids it holds.
struct Building {
    domain: Domain,
    ids: BTreeSet<String>,
}

/// Compiles `[rls]`: reads `envoy_configs`, checks every domain and rule
/// as envoyproxy/ratelimit's loader does and as tierlimit needs (errors
/// name the key), checks that named plans exist, and merges a domain
/// configured twice when `merge_domain_configs` is on.
pub fn compile(
    rls: &RlsConfig,
    plan_exists: impl Fn(&str) -> bool,
) -> Result<Compiled, ConfigError> {
    let invalid = |key: String, reason: String| ConfigError::Invalid { key, reason };
    if let Some(p) = &rls.plan {
        if !plan_exists(p) {
            return Err(invalid("rls.plan".into(), format!("no plan named {p:?}")));
        }
    }
    let mut sources: Vec<DomainSource> = rls
        .domains
        .iter()
        .enumerate()
        .map(|(i, d)| DomainSource {
            at: format!("rls.domains[{i}]"),
            config: d.clone(),
        })
        .collect();
    for (i, path) in rls.envoy_configs.iter().enumerate() {
        let file = EnvoyFile::read(Path::new(path))
            .map_err(|e| invalid(format!("rls.envoy_configs[{i}]"), e.to_string()))?;
        sources.push(DomainSource {
            at: format!("rls.envoy_configs[{i}] ({path})"),
            config: file.into_domain(),
        });
    }
    let mut building: HashMap<String, Building> = HashMap::new();
    for s in &sources {
        add_domain(&mut building, s, rls.merge_domain_configs, &|p: &str| {
            plan_exists(p)
        })?;
    }
    Ok(Compiled {
        shadow: rls.shadow_mode,
        quota: rls.quota_mode,
        response_dynamic_metadata: rls.response_dynamic_metadata,
        domains: building
            .into_iter()
            .map(|(name, b)| {
                let mut d = b.domain;
                if d.plan.is_none() {
                    d.plan = rls.plan.clone();
                }
                (name, d)
            })
            .collect(),
    })
}

/// Adds one configured domain: a new one, or (merging) its descriptors
/// into the tree of the same domain configured before.
fn add_domain(
    building: &mut HashMap<String, Building>,
    s: &DomainSource,
    merge: bool,
    plan_exists: &dyn Fn(&str) -> bool,
) -> Result<(), ConfigError> {
    let invalid = |key: String, reason: String| ConfigError::Invalid { key, reason };
    // The key of a field of this domain: `rls.domains[0].plan`, or `plan`
    // at a file's root (import).
    let key = |field: &str| {
        if s.at.is_empty() {
            field.to_string()
        } else {
            format!("{}.{field}", s.at)
        }
    };
    let d = &s.config;
    if d.domain.is_empty() {
        return Err(invalid(
            key("domain"),
            "must not be empty (envoyproxy/ratelimit: config file cannot have empty domain)".into(),
        ));
    }
    // The domain is the tenant of descriptors that name none.
    validate::tenant(&d.domain).map_err(|e| {
        invalid(
            key("domain"),
            format!("{e} (the domain is the tenant of descriptors without a tenant entry)"),
        )
    })?;
    if let Some(p) = &d.plan {
        if !plan_exists(p) {
            return Err(invalid(key("plan"), format!("no plan named {p:?}")));
        }
    }
    if d.tenant_entry.as_deref() == Some("") {
        return Err(invalid(key("tenant_entry"), "must not be empty".into()));
    }
    let b = match building.get_mut(&d.domain) {
        Some(_) if !merge => {
            return Err(invalid(
                key("domain"),
                format!(
                    "domain {:?} is configured twice (rls.merge_domain_configs = true merges them, as envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG)",
                    d.domain
                ),
            ));
        }
        Some(b) => {
            // One domain, one tenant rule and one plan: a merged part may
            // leave them out or repeat them, not contradict them.
            for (field, mine, theirs) in [
                ("tenant_entry", &d.tenant_entry, &mut b.domain.tenant_entry),
                ("plan", &d.plan, &mut b.domain.plan),
            ] {
                match (mine, theirs.as_ref()) {
                    (Some(m), Some(t)) if m != t => {
                        return Err(invalid(
                            key(field),
                            format!("{m:?} contradicts {t:?} of the same domain configured before"),
                        ));
                    }
                    (Some(m), None) => *theirs = Some(m.clone()),
                    _ => {}
                }
            }
            b
        }
        None => building.entry(d.domain.clone()).or_insert(Building {
            domain: Domain {
                name: d.domain.clone(),
                tenant_entry: d.tenant_entry.clone(),
                plan: d.plan.clone(),
                root: Node::default(),
            },
            ids: BTreeSet::new(),
        }),
    };
    compile_level(
        &mut b.domain.root,
        &d.domain,
        &key("descriptors"),
        &d.descriptors,
        &mut Vec::new(),
        &mut b.ids,
    )
}

/// Adds `rules` (one level of the tree, at `at`) to `node`.
fn compile_level(
    node: &mut Node,
    domain: &str,
    at: &str,
    rules: &[DescriptorRule],
    path: &mut Vec<(String, Option<String>)>,
    ids: &mut BTreeSet<String>,
) -> Result<(), ConfigError> {
    let invalid = |key: String, reason: String| ConfigError::Invalid { key, reason };
    if path.len() >= MAX_DEPTH {
        return Err(invalid(
            at.into(),
            format!("deeper than {MAX_DEPTH} levels"),
        ));
    }
    for (i, r) in rules.iter().enumerate() {
        let at = format!("{at}[{i}]");
        if r.key.is_empty() {
            return Err(invalid(
                format!("{at}.key"),
                "must not be empty (envoyproxy/ratelimit: descriptor has empty key)".into(),
            ));
        }
        // An empty value is no value (envoyproxy/ratelimit: the key alone).
        let value = r.value.as_deref().filter(|v| !v.is_empty());
        let wildcard = value.is_some_and(|v| v.contains('*'));
        if r.share_threshold && !wildcard {
            return Err(invalid(
                format!("{at}.share_threshold"),
                format!(
                    "only on a wildcard value (containing `*`), not {} (envoyproxy/ratelimit: share_threshold can only be used with wildcard values)",
                    value.map_or("a key without value".to_string(), |v| format!("{v:?}"))
                ),
            ));
        }
        let dup = match value {
            None => node.any.contains_key(&r.key),
            Some(v) if wildcard => node
                .wildcard
                .iter()
                .any(|w| w.key == r.key && w.pattern == v),
            Some(v) => node.exact.contains_key(&(r.key.clone(), v.to_string())),
        };
        if dup {
            return Err(invalid(
                at,
                format!(
                    "key {:?} with {} appears twice at this level (envoyproxy/ratelimit: duplicate descriptor composite key)",
                    r.key,
                    value.map_or("no value".to_string(), |v| format!("value {v:?}"))
                ),
            ));
        }
        path.push((r.key.clone(), value.map(str::to_string)));
        let mut child = Node::default();
        compile_level(
            &mut child,
            domain,
            &format!("{at}.descriptors"),
            &r.descriptors,
            path,
            ids,
        )?;
        if let Some(rl) = &r.rate_limit {
            let rule = compile_rule(domain, &at, rl, r, path)?;
            if !ids.insert(rule.id.clone()) {
                return Err(invalid(
                    at.clone(),
                    "two rules of this domain hash to one id: rename a key".into(),
                ));
            }
            child.rule = Some(Arc::new(rule));
        }
        path.pop();
        match value {
            None => {
                node.any.insert(r.key.clone(), child);
            }
            Some(v) if wildcard => node.wildcard.push(Wildcard {
                key: r.key.clone(),
                pattern: v.to_string(),
                parts: v.split('*').map(str::to_string).collect(),
                share: r.share_threshold,
                node: child,
            }),
            Some(v) => {
                node.exact.insert((r.key.clone(), v.to_string()), child);
            }
        }
    }
    Ok(())
}

fn compile_rule(
    domain: &str,
    at: &str,
    rl: &RateLimitConfig,
    r: &DescriptorRule,
    path: &[(String, Option<String>)],
) -> Result<Rule, ConfigError> {
    let invalid = |key: &str, reason: String| ConfigError::Invalid {
        key: format!("{at}.rate_limit.{key}"),
        reason,
    };
    let mut h = Fnv::new();
    h.write(domain.as_bytes());
    for (k, v) in path {
        h.write(&[0]);
        h.write(k.as_bytes());
        h.write(&[1]);
        if let Some(v) = v {
            h.write(v.as_bytes());
        }
    }
    let id = format!("r{:016x}", h.0);
    let label = rl.name.clone().unwrap_or_else(|| {
        path.iter()
            .map(|(k, v)| match v {
                Some(v) => format!("{k}={v}"),
                None => k.clone(),
            })
            .collect::<Vec<_>>()
            .join("/")
    });
    let mut replaces = Vec::with_capacity(rl.replaces.len());
    for (j, rep) in rl.replaces.iter().enumerate() {
        let key = format!("replaces[{j}].name");
        match rep.name.as_deref() {
            None | Some("") => {
                return Err(invalid(
                    &key,
                    "must not be empty (envoyproxy/ratelimit: should not have an empty replaces entry)"
                        .into(),
                ))
            }
            Some(n) if rl.name.as_deref() == Some(n) => {
                return Err(invalid(
                    &key,
                    format!(
                        "{n:?} is this rule's own name (envoyproxy/ratelimit: replaces should not contain name of same descriptor)"
                    ),
                ))
            }
            Some(n) => replaces.push(n.to_string()),
        }
    }
    let metadata = r
        .metadata
        .as_ref()
        .filter(|m| !m.is_empty())
        .map(|m| Arc::new(m.clone()));
    if rl.unlimited {
        if let Some(u) = rl.unit {
            return Err(invalid(
                "unit",
                format!(
                    "{:?} must not be given with unlimited = true (envoyproxy/ratelimit: should not specify rate limit unit when unlimited)",
                    u.name()
                ),
            ));
        }
        return Ok(Rule {
            id,
            label,
            limit: None,
            unit: None,
            requests_per_unit: rl.requests_per_unit.unwrap_or(0),
            shadow: r.shadow_mode,
            quota: r.quota_mode,
            name: rl.name.clone(),
            replaces,
            metadata,
        });
    }
    let unit = rl
        .unit
        .ok_or_else(|| invalid("unit", "required unless unlimited = true".into()))?;
    let n = rl.requests_per_unit.ok_or_else(|| {
        invalid(
            "requests_per_unit",
            "required unless unlimited = true (write 0 to deny every request)".into(),
        )
    })?;
    if n > MAX_LIMIT {
        return Err(invalid(
            "requests_per_unit",
            format!("must be at most {MAX_LIMIT}"),
        ));
    }
    let algorithm = rl.algorithm.unwrap_or(Algorithm::FixedWindow);
    if n == 0 && algorithm != Algorithm::FixedWindow {
        return Err(invalid(
            "requests_per_unit",
            "0 (deny everything) needs the default fixed_window".into(),
        ));
    }
    if algorithm == Algorithm::TokenBucket && window_ms_of(unit) * 1000 / n.max(1) == 0 {
        return Err(invalid(
            "requests_per_unit",
            "more than one unit per microsecond cannot be expressed".into(),
        ));
    }
    let window_ms = unit.window_ms();
    debug_assert!(window_ms <= MAX_DESCRIPTOR_WINDOW_MS);
    if algorithm == Algorithm::SlidingLog && n > crate::config::MAX_SLIDING_LOG_LIMIT {
        return Err(invalid(
            "algorithm",
            "sliding_log keeps one entry per unit; use sliding_window".into(),
        ));
    }
    Ok(Rule {
        id,
        label,
        // 0 requests per unit: everything is over the limit, as in
        // envoyproxy/ratelimit. The script takes a limit of 0 (every
        // request denied, retry never).
        limit: Some(Limit {
            limit: n,
            window_ms,
            algorithm,
            burst: n,
        }),
        unit: Some(unit),
        requests_per_unit: n,
        shadow: r.shadow_mode,
        quota: r.quota_mode,
        name: rl.name.clone(),
        replaces,
        metadata,
    })
}

fn window_ms_of(u: Unit) -> u64 {
    u.window_ms()
}

/// FNV-1a 64: rule ids only need to be stable and distinct within a
/// configuration (checked at load), not secret.
struct Fnv(u64);
impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, b: &[u8]) {
        for x in b {
            self.0 ^= u64::from(*x);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const YAML: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: path
    value: "/api*"
    rate_limit: { unit: SECOND, requests_per_unit: 5, name: api }
  - key: path
    value: "/api/v2*"
    rate_limit: { unit: second, requests_per_unit: 7 }
  - key: tenant
    descriptors:
      - key: plan
        value: gold
        rate_limit: { unit: month, requests_per_unit: 1000000 }
        shadow_mode: true
      - key: plan
        rate_limit: { unlimited: true, name: other, replaces: [ { name: api } ] }
"#;

    fn compile_yaml(yaml: &str, rls: RlsConfig) -> Result<Compiled, ConfigError> {
        let f = EnvoyFile::parse("t.yaml", yaml).unwrap();
        compile(
            &RlsConfig {
                domains: vec![f.into_domain()],
                ..rls
            },
            |_| true,
        )
    }

    fn compiled() -> Compiled {
        compile_yaml(YAML, RlsConfig::default()).unwrap()
    }

    #[test]
    fn matches_exact_wildcard_and_key_only() {
        let c = compiled();
        let d = c.domain("edge").unwrap();
        let ip = d.rule([("remote_address", "2001:db8::1")]).unwrap().rule;
        assert_eq!(ip.limit.as_ref().unwrap().window_ms, 60_000);
        assert_eq!(ip.label, "remote_address");
        // The first wildcard written wins, as in envoyproxy/ratelimit
        // (not the longest): `/api*` is before `/api/v2*`.
        let v2 = d.rule([("path", "/api/v2/x")]).unwrap().rule;
        assert_eq!((v2.label.as_str(), v2.requests_per_unit), ("api", 5));
        assert!(d.rule([("path", "/other")]).is_none());
        let gold = d.rule([("tenant", "acme"), ("plan", "gold")]).unwrap().rule;
        assert!(gold.shadow);
        assert_eq!(gold.limit.as_ref().unwrap().window_ms, 30 * 86_400_000);
        let other = d.rule([("tenant", "acme"), ("plan", "free")]).unwrap().rule;
        assert!(other.limit.is_none());
        assert_eq!(other.replaces, vec!["api".to_string()]);
        // A node without rate_limit is no rule; entries past the tree neither.
        assert!(d.rule([("tenant", "acme")]).is_none());
        assert!(d.rule([("remote_address", "x"), ("y", "z")]).is_none());
    }

    #[test]
    fn units_use_envoys_fixed_dividers() {
        assert_eq!(Unit::Week.window_ms(), 7 * 86_400_000);
        assert_eq!(Unit::Month.window_ms(), 30 * 86_400_000);
        assert_eq!(Unit::Year.window_ms(), MAX_DESCRIPTOR_WINDOW_MS);
        assert_eq!(Unit::of_window(3_600_000), Some(Unit::Hour));
    }

    #[test]
    fn import_round_trips_through_toml() {
        let f = EnvoyFile::parse("t.yaml", YAML).unwrap();
        let text = f.to_toml("t.yaml").unwrap();
        assert!(
            text.contains("# month: a fixed window of 2592000 s"),
            "{text}"
        );
        #[derive(Deserialize)]
        struct W {
            rls: RlsConfig,
        }
        let w: W = toml::from_str(&text).unwrap();
        assert_eq!(w.rls.domains, vec![f.into_domain()]);
    }

    #[test]
    fn errors_name_the_field() {
        let e = EnvoyFile::parse(
            "x.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("descriptors[0].rate_limit.unit"), "{e}");
        let e = compile_yaml(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second }\n",
            RlsConfig::default(),
        )
        .unwrap_err();
        assert_eq!(
            e.key(),
            Some("rls.domains[0].descriptors[0].rate_limit.requests_per_unit")
        );
        // The import's check names the key from the file's root.
        let f = EnvoyFile::parse(
            "x.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, unlimited: true }\n",
        )
        .unwrap();
        let e = f.check("x.yaml").unwrap_err().to_string();
        assert!(
            e.starts_with("x.yaml: descriptors[0].rate_limit.unit: "),
            "{e}"
        );
    }

    #[test]
    fn rule_ids_are_stable_and_distinct() {
        let a = compiled();
        let b = compiled();
        let d1 = a.domain("edge").unwrap();
        let d2 = b.domain("edge").unwrap();
        let r1 = d1.rule([("remote_address", "1")]).unwrap().rule;
        assert_eq!(r1.id, d2.rule([("remote_address", "2")]).unwrap().rule.id);
        assert_ne!(r1.id, d1.rule([("path", "/api/x")]).unwrap().rule.id);
        validate::name("rule id", &r1.id).unwrap();
    }

    /// `*` as a shell glob: any run of characters, none included.
    fn glob(p: &[u8], v: &[u8]) -> bool {
        match p.split_first() {
            None => v.is_empty(),
            Some((b'*', rest)) => (0..=v.len()).any(|i| glob(rest, &v[i..])),
            Some((c, rest)) => v.first() == Some(c) && glob(rest, &v[1..]),
        }
    }

    fn wildcard(pattern: &str) -> Wildcard {
        Wildcard {
            key: "k".into(),
            pattern: pattern.into(),
            parts: pattern.split('*').map(str::to_string).collect(),
            share: false,
            node: Node::default(),
        }
    }

    #[test]
    fn wildcards_match_anywhere_as_envoyproxy_ratelimit() {
        let mid = wildcard("bar*b");
        for v in ["barab", "bar123b", "barb"] {
            assert!(mid.matches(v), "{v}");
        }
        for v in ["bara", "xbarb", "bar"] {
            assert!(!mid.matches(v), "{v}");
        }
        let multi = wildcard("foo*bar*baz");
        assert!(multi.matches("foo123bar456baz") && multi.matches("foobarbaz"));
        assert!(!multi.matches("foo123baz") && !multi.matches("xfoobarbaz"));
        assert!(wildcard("*").matches("") && wildcard("é*").matches("éa"));
    }

    proptest! {
        // A value that tells a wrong matcher from a glob is rare among
        // random pairs (about 1 in 400 for a middle part searched into the
        // suffix), and a case costs microseconds.
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The one-pass matcher (prefix, suffix, middle parts leftmost)
        /// agrees with a backtracking glob on every pattern and value.
        #[test]
        fn wildcard_matching_is_a_glob(
            p in ("[ab*]{0,3}", "[ab*]{0,3}").prop_map(|(a, b)| format!("{a}*{b}")),
            v in "[ab]{0,8}",
        ) {
            prop_assert_eq!(wildcard(&p).matches(&v), glob(p.as_bytes(), v.as_bytes()));
        }
    }

    #[test]
    fn a_shared_wildcard_counts_by_its_pattern() {
        let c = compile_yaml(
            r#"
domain: d
descriptors:
  - key: user
    value: user/*
    share_threshold: true
    descriptors:
      - key: file
        value: f*
        rate_limit: { unit: minute, requests_per_unit: 1 }
"#,
            RlsConfig::default(),
        )
        .unwrap();
        let d = c.domain("d").unwrap();
        let m = d.rule([("user", "user/alice"), ("file", "f1")]).unwrap();
        assert!(m.shares());
        assert_eq!(m.counted(0, "user/alice"), "user/*");
        assert_eq!(
            m.counted(1, "f1"),
            "f1",
            "an unshared wildcard counts each value"
        );
    }

    #[test]
    fn quota_mode_metadata_and_the_global_switches_compile() {
        let c = compile_yaml(
            r#"
domain: d
descriptors:
  - key: service
    value: a
    quota_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
    metadata: { service_with_quota: { name: a, weight: 2, ratio: 0.5, on: true, zones: [x] } }
  - key: other
    rate_limit: { unit: minute, requests_per_unit: 1 }
    metadata: {}
"#,
            RlsConfig {
                quota_mode: true,
                response_dynamic_metadata: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(c.quota && c.response_dynamic_metadata);
        let d = c.domain("d").unwrap();
        let a = d.rule([("service", "a")]).unwrap().rule;
        assert!(a.quota);
        let Some(MetaValue::Struct(s)) = a.metadata.as_ref().unwrap().get("service_with_quota")
        else {
            panic!("{a:?}")
        };
        assert_eq!(s["name"], MetaValue::String("a".into()));
        assert_eq!(s["weight"], MetaValue::Number(2.0));
        assert_eq!(s["on"], MetaValue::Bool(true));
        let other = d.rule([("other", "x")]).unwrap().rule;
        assert!(
            !other.quota && other.metadata.is_none(),
            "empty metadata is none"
        );
    }

    #[test]
    fn metadata_round_trips_through_the_imports_toml() {
        let f = EnvoyFile::parse(
            "m.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: day, requests_per_unit: 1 }\n    metadata:\n      a: { b: 1, c: 0.25, d: [1, x, true], e: -3 }\n      big: 12345678901234567890\n",
        )
        .unwrap();
        let text = f.to_toml("m.yaml").unwrap();
        // Integers stay integers; what a double cannot hold exactly is a float.
        assert!(
            text.contains("b = 1\n") && text.contains("e = -3\n"),
            "{text}"
        );
        #[derive(Deserialize)]
        struct W {
            rls: RlsConfig,
        }
        let w: W = toml::from_str(&text).unwrap();
        assert_eq!(w.rls.domains, vec![f.into_domain()]);
        let e = EnvoyFile::parse(
            "m.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    metadata: { a: { b: .nan } }\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("descriptors[0].metadata.a.b: "), "{e}");
    }

    #[test]
    fn passed_metadata_merges_first_wins_mappings_merged() {
        let parse = |y: &str| -> Metadata { serde_norway::from_str(y).unwrap() };
        let mut m = parse("service_with_quota: { name: a }\nx: 1\n");
        merge_metadata(
            &mut m,
            &parse("service_with_quota: { name: b, zone: z }\nx: { y: 2 }\nw: true\n"),
        );
        assert_eq!(
            m,
            parse("service_with_quota: { name: a, zone: z }\nx: 1\nw: true\n")
        );
    }

    #[test]
    fn a_domain_twice_is_refused_or_merged() {
        let a = EnvoyFile::parse("a.yaml", "domain: d\ndescriptors:\n  - key: x\n    rate_limit: { unit: day, requests_per_unit: 1 }\n").unwrap();
        let b = EnvoyFile::parse("b.yaml", "domain: d\ndescriptors:\n  - key: y\n    rate_limit: { unit: day, requests_per_unit: 2 }\n").unwrap();
        let twice = |merge| {
            compile(
                &RlsConfig {
                    merge_domain_configs: merge,
                    domains: vec![a.clone().into_domain(), b.clone().into_domain()],
                    ..Default::default()
                },
                |_| true,
            )
        };
        let e = twice(false).unwrap_err();
        assert_eq!(e.key(), Some("rls.domains[1].domain"));
        let c = twice(true).unwrap();
        let d = c.domain("d").unwrap();
        assert_eq!(d.rule([("x", "1")]).unwrap().rule.requests_per_unit, 1);
        assert_eq!(d.rule([("y", "1")]).unwrap().rule.requests_per_unit, 2);
        // Merged, the ids are the ones each file alone gives.
        let alone = compile(
            &RlsConfig {
                domains: vec![b.clone().into_domain()],
                ..Default::default()
            },
            |_| true,
        )
        .unwrap();
        assert_eq!(
            alone
                .domain("d")
                .unwrap()
                .rule([("y", "1")])
                .unwrap()
                .rule
                .id,
            d.rule([("y", "1")]).unwrap().rule.id
        );
        // Merging a file with itself: its keys twice at the top level.
        let e = compile(
            &RlsConfig {
                merge_domain_configs: true,
                domains: vec![a.clone().into_domain(), a.clone().into_domain()],
                ..Default::default()
            },
            |_| true,
        )
        .unwrap_err();
        assert_eq!(e.key(), Some("rls.domains[1].descriptors[0]"));
        // Merged parts may not disagree on the tenant entry.
        let mut t1 = a.clone().into_domain();
        t1.tenant_entry = Some("t".into());
        let mut t2 = b.clone().into_domain();
        t2.tenant_entry = Some("u".into());
        let e = compile(
            &RlsConfig {
                merge_domain_configs: true,
                domains: vec![t1, t2],
                ..Default::default()
            },
            |_| true,
        )
        .unwrap_err();
        assert_eq!(e.key(), Some("rls.domains[1].tenant_entry"));
    }
}
