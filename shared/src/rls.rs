//! Envoy's rate limit service (RLS v3): how a request's (domain, descriptor)
//! maps to a tenant, a descriptor rule and its limit.
//!
//! The descriptor rules are envoyproxy/ratelimit's format, field for field,
//! so an existing YAML file is loaded as it is (`rls.envoy_configs`) or
//! turned into the same rules in TOML (`region-node import-envoy-config`):
//! both roads end in the same [`DomainConfig`], and so in the same rule ids
//! and counting keys, which is why they decide identically.
//!
//! A domain adds what envoyproxy/ratelimit has no notion of: which entry of
//! a descriptor names the **tenant** (`tenant_entry`, else the domain itself
//! is the tenant) and the **plan** of tenants that `[tenants]` does not list.
//! A descriptor's limit is a tier of its own beside the plan's node, region
//! and global tiers; ARCHITECTURE.md ("Descriptors and plans") says how they
//! combine.
//!
//! Matching follows envoyproxy/ratelimit: the descriptor's entries walk the
//! rule tree one level per entry, each level preferring a rule with the same
//! key and value, then the longest `value: "prefix*"` wildcard, then a rule
//! with the key and no value; the limit is the one of the rule reached by
//! the last entry. Key-only and wildcard rules count each value apart.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

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
    /// `plans.<name>.shadow_mode`.
    pub shadow_mode: bool,
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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub descriptors: Vec<DescriptorRule>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One node of envoyproxy/ratelimit's descriptor tree (same field names).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DescriptorRule {
    pub key: String,
    /// Exact value; `prefix*` matches every value with the prefix; absent:
    /// every value (each counted apart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitConfig>,
    /// Decide and count, but answer OK.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow_mode: bool,
    /// envoyproxy/ratelimit puts the descriptor's values into the metric
    /// name; tierlimit keeps one series per rule whatever the values (the
    /// flag is accepted so files load unchanged; see README).
    #[serde(default, skip_serializing_if = "is_false")]
    pub detailed_metric: bool,
    /// As `detailed_metric`: accepted, metrics stay per rule.
    #[serde(default, skip_serializing_if = "is_false")]
    pub value_to_metric: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
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
    /// Never limited (and never counted).
    #[serde(default, skip_serializing_if = "is_false")]
    pub unlimited: bool,
    /// The rule's name: what `replaces` refers to, and its metric label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Rules (by name) this one replaces when both match one request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replaces: Vec<Replaces>,
    /// Default `fixed_window` aligned to the Unix epoch, as
    /// envoyproxy/ratelimit counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<Algorithm>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Replaces {
    pub name: String,
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
    pub domain: String,
    #[serde(default)]
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
    /// (`descriptors[0].rate_limit.unit: unknown unit "fortnight"`).
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
    /// each limit becomes (`region-node import-envoy-config`).
    pub fn to_toml(&self, source: &str) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "# Imported from envoyproxy/ratelimit configuration {source}.\n\
             # Paste into regions.toml. The domain is the tenant (set `tenant_entry` to take\n\
             # it from a descriptor entry instead); tenants not listed in [tenants] get\n\
             # `plan` below, else rls.plan, else unknown_tenants. Each rate_limit is a\n\
             # region-tier fixed window aligned to the Unix epoch, counted per distinct\n\
             # descriptor value, exactly as envoyproxy/ratelimit counts it; a plan's own\n\
             # node/region/global tiers apply on top (ARCHITECTURE.md, \"Descriptors and plans\").\n\n"
        ));
        let domain = self.clone().into_domain();
        let wrapper = DomainsOnly {
            rls: DomainsInner {
                domains: vec![domain],
            },
        };
        let body = toml::to_string_pretty(&wrapper).expect("descriptor rules serialise");
        // Comment each limit in place: `unit = "month"` → its window.
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
            if trimmed.starts_with("detailed_metric = true")
                || trimmed.starts_with("value_to_metric = true")
            {
                out.push_str(
                    "# accepted; tierlimit keeps one metric series per rule (bounded cardinality)\n",
                );
            }
            out.push_str(line);
            out.push('\n');
        }
        out
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
    pub name: Option<String>,
    pub replaces: Vec<String>,
}

#[derive(Debug, Default)]
struct Node {
    exact: HashMap<(String, String), Node>,
    /// (key, prefix, node), longest prefix first.
    wildcard: Vec<(String, String, Node)>,
    any: HashMap<String, Node>,
    rule: Option<Arc<Rule>>,
}

impl Node {
    fn child(&self, key: &str, value: &str) -> Option<&Node> {
        if let Some(n) = self.exact.get(&(key.to_string(), value.to_string())) {
            return Some(n);
        }
        if let Some((_, _, n)) = self
            .wildcard
            .iter()
            .find(|(k, p, _)| k == key && value.starts_with(p.as_str()))
        {
            return Some(n);
        }
        self.any.get(key)
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

impl Domain {
    /// The rule a descriptor's entries reach, if any (see the module doc).
    pub fn rule<'a, I>(&self, entries: I) -> Option<&Arc<Rule>>
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let mut node = &self.root;
        for (k, v) in entries {
            node = node.child(k, v)?;
        }
        node.rule.as_ref()
    }
}

/// `[rls]`, compiled at load.
#[derive(Debug, Default)]
pub struct Compiled {
    pub shadow: bool,
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
    for (_, _, c) in &n.wildcard {
        collect_labels(c, out);
    }
}

/// Compiles `[rls]`: reads `envoy_configs`, checks every domain and rule
/// (errors name the key), and checks that named plans exist.
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
    let mut domains: Vec<(String, DomainConfig)> = rls
        .domains
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("rls.domains[{i}]"), d.clone()))
        .collect();
    for (i, path) in rls.envoy_configs.iter().enumerate() {
        let file = EnvoyFile::read(Path::new(path))
            .map_err(|e| invalid(format!("rls.envoy_configs[{i}]"), e.to_string()))?;
        domains.push((
            format!("rls.envoy_configs[{i}] ({path})"),
            file.into_domain(),
        ));
    }
    let mut out = Compiled {
        shadow: rls.shadow_mode,
        domains: HashMap::new(),
    };
    for (at, d) in domains {
        if d.domain.is_empty() {
            return Err(invalid(format!("{at}.domain"), "must not be empty".into()));
        }
        // The domain is the tenant of descriptors that name none.
        validate::tenant(&d.domain).map_err(|e| {
            invalid(
                format!("{at}.domain"),
                format!("{e} (the domain is the tenant of descriptors without a tenant entry)"),
            )
        })?;
        if out.domains.contains_key(&d.domain) {
            return Err(invalid(
                format!("{at}.domain"),
                format!("domain {:?} is configured twice", d.domain),
            ));
        }
        if let Some(p) = &d.plan {
            if !plan_exists(p) {
                return Err(invalid(
                    format!("{at}.plan"),
                    format!("no plan named {p:?}"),
                ));
            }
        }
        if d.tenant_entry.as_deref() == Some("") {
            return Err(invalid(
                format!("{at}.tenant_entry"),
                "must not be empty".into(),
            ));
        }
        let mut ids = BTreeSet::new();
        let mut names = BTreeSet::new();
        let root = compile_level(
            &d.domain,
            &format!("{at}.descriptors"),
            &d.descriptors,
            &mut Vec::new(),
            &mut ids,
            &mut names,
        )?;
        out.domains.insert(
            d.domain.clone(),
            Domain {
                name: d.domain.clone(),
                tenant_entry: d.tenant_entry.clone(),
                plan: d.plan.clone().or_else(|| rls.plan.clone()),
                root,
            },
        );
    }
    Ok(out)
}

fn compile_level(
    domain: &str,
    at: &str,
    rules: &[DescriptorRule],
    path: &mut Vec<(String, Option<String>)>,
    ids: &mut BTreeSet<String>,
    names: &mut BTreeSet<String>,
) -> Result<Node, ConfigError> {
    let invalid = |key: String, reason: String| ConfigError::Invalid { key, reason };
    if path.len() >= MAX_DEPTH {
        return Err(invalid(
            at.into(),
            format!("deeper than {MAX_DEPTH} levels"),
        ));
    }
    let mut node = Node::default();
    for (i, r) in rules.iter().enumerate() {
        let at = format!("{at}[{i}]");
        if r.key.is_empty() {
            return Err(invalid(format!("{at}.key"), "must not be empty".into()));
        }
        path.push((r.key.clone(), r.value.clone()));
        let mut child = compile_level(
            domain,
            &format!("{at}.descriptors"),
            &r.descriptors,
            path,
            ids,
            names,
        )?;
        if let Some(rl) = &r.rate_limit {
            let rule = compile_rule(domain, &at, rl, r.shadow_mode, path)?;
            if !ids.insert(rule.id.clone()) {
                return Err(invalid(
                    at.clone(),
                    "the same key and value appear twice at this level".into(),
                ));
            }
            if let Some(n) = &rule.name {
                if !names.insert(n.clone()) {
                    return Err(invalid(
                        format!("{at}.rate_limit.name"),
                        format!("name {n:?} is used twice"),
                    ));
                }
            }
            child.rule = Some(Arc::new(rule));
        }
        path.pop();
        let dup = match &r.value {
            None => node.any.insert(r.key.clone(), child).is_some(),
            Some(v) if v.ends_with('*') => {
                let prefix = v.trim_end_matches('*').to_string();
                let dup = node
                    .wildcard
                    .iter()
                    .any(|(k, p, _)| *k == r.key && *p == prefix);
                node.wildcard.push((r.key.clone(), prefix, child));
                dup
            }
            Some(v) => node
                .exact
                .insert((r.key.clone(), v.clone()), child)
                .is_some(),
        };
        if dup {
            return Err(invalid(
                at,
                format!(
                    "key {:?} with value {:?} appears twice at this level",
                    r.key, r.value
                ),
            ));
        }
    }
    node.wildcard
        .sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
    Ok(node)
}

fn compile_rule(
    domain: &str,
    at: &str,
    rl: &RateLimitConfig,
    shadow: bool,
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
    let replaces = rl.replaces.iter().map(|r| r.name.clone()).collect();
    if rl.unlimited {
        return Ok(Rule {
            id,
            label,
            limit: None,
            unit: rl.unit,
            requests_per_unit: rl.requests_per_unit.unwrap_or(0),
            shadow,
            name: rl.name.clone(),
            replaces,
        });
    }
    let unit = rl
        .unit
        .ok_or_else(|| invalid("unit", "required unless unlimited = true".into()))?;
    let n = rl.requests_per_unit.ok_or_else(|| {
        invalid(
            "requests_per_unit",
            "required unless unlimited = true".into(),
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
        shadow,
        name: rl.name.clone(),
        replaces,
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

    fn compiled() -> Compiled {
        let f = EnvoyFile::parse("t.yaml", YAML).unwrap();
        compile(
            &RlsConfig {
                domains: vec![f.into_domain()],
                ..Default::default()
            },
            |_| true,
        )
        .unwrap()
    }

    #[test]
    fn matches_exact_wildcard_and_key_only() {
        let c = compiled();
        let d = c.domain("edge").unwrap();
        let ip = d.rule([("remote_address", "2001:db8::1")]).unwrap();
        assert_eq!(ip.limit.as_ref().unwrap().window_ms, 60_000);
        assert_eq!(ip.label, "remote_address");
        // The longest wildcard wins.
        let v2 = d.rule([("path", "/api/v2/x")]).unwrap();
        assert_eq!(v2.requests_per_unit, 7);
        let api = d.rule([("path", "/api/x")]).unwrap();
        assert_eq!(api.label, "api");
        assert!(d.rule([("path", "/other")]).is_none());
        let gold = d.rule([("tenant", "acme"), ("plan", "gold")]).unwrap();
        assert!(gold.shadow);
        assert_eq!(gold.limit.as_ref().unwrap().window_ms, 30 * 86_400_000);
        let other = d.rule([("tenant", "acme"), ("plan", "free")]).unwrap();
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
        let text = f.to_toml("t.yaml");
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
        let f = EnvoyFile::parse(
            "x.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second }\n",
        )
        .unwrap();
        let e = compile(
            &RlsConfig {
                domains: vec![f.into_domain()],
                ..Default::default()
            },
            |_| true,
        )
        .unwrap_err();
        assert_eq!(
            e.key(),
            Some("rls.domains[0].descriptors[0].rate_limit.requests_per_unit")
        );
    }

    #[test]
    fn rule_ids_are_stable_and_distinct() {
        let a = compiled();
        let b = compiled();
        let d1 = a.domain("edge").unwrap();
        let d2 = b.domain("edge").unwrap();
        let r1 = d1.rule([("remote_address", "1")]).unwrap();
        assert_eq!(r1.id, d2.rule([("remote_address", "2")]).unwrap().id);
        assert_ne!(r1.id, d1.rule([("path", "/api/x")]).unwrap().id);
        validate::name("rule id", &r1.id).unwrap();
    }
}
