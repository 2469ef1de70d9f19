//! `ShouldRateLimit`: one envoy request, every descriptor decided together.
//!
//! 1. Each descriptor resolves to a tenant (the domain's `tenant_entry`, else
//!    the domain) and to the rule its entries reach ([`Domain::rule`]); its
//!    counting key is the entries' values ([`super::key`]). `replaces` drops
//!    the replaced rules of the same request.
//! 2. Descriptors are grouped by tenant. One group is **one store call**:
//!    the plan's tiers, the global tier and one region tier per descriptor
//!    rule, all-or-nothing in the tenant's slot ([`Decider::check_tiers`]).
//! 3. Several tenants are several calls (different slots under Redis
//!    Cluster): if any denies, every tenant already charged gets its charge
//!    back exactly ([`Decider::compensate`], refund by charge id: only the
//!    windows and the day the charge was in, once). A crash between the
//!    charge and the compensation leaves those tenants charged for this one
//!    request (at most its hits per tenant); a compensation that fails is
//!    counted in `tierlimit_rls_compensations_total{outcome="failed"}`.
//! 4. Shadow mode (global flag, plan, rule): decided and counted, answered
//!    OK. A shadow rule that denies is taken out of its group's call and the
//!    call made again, so it never blocks the others.
//! 5. Quota mode (the rule's `quota_mode`, or `rls.quota_mode` for every
//!    descriptor), envoyproxy/ratelimit's meaning inside the all-or-nothing
//!    call: a quota rule that denies is taken out of its group's call and
//!    the call made again (as a shadow rule), its descriptor answered
//!    OVER_LIMIT with the request going on, unless it was the request's
//!    last quota descriptor not over: then the request is over, as when
//!    every quota descriptor is. The plan's tiers and rules without quota
//!    mode keep their strict meaning. The answer's dynamic metadata
//!    carries the `metadata` of the descriptors whose status is OK
//!    ([`passed_metadata`], [`super::metadata`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as PbUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::Status;

use tierlimit_shared::config::{Limit, Policy, MAX_LIMIT};
use tierlimit_shared::rls::{merge_metadata, Domain, Metadata, Rule, Unit};
use tierlimit_shared::validate;

use crate::decision::{DecideError, Decider, Request, TierStatus, TiersDecision};
use crate::storage::{Denied, Scope, TierCall};

use super::key::counting_key;
use super::metadata;
use super::metrics::RlsMetrics;

/// Why a descriptor ended as it did (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    OverLimit,
    /// A quota descriptor over its limit while another quota descriptor of
    /// the request was not: its status says OVER_LIMIT, the request goes on.
    OverQuota,
    NoRule,
    Unlimited,
    Replaced,
    UnknownTenant,
    InvalidTenant,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::OverLimit => "over_limit",
            Outcome::OverQuota => "over_quota",
            Outcome::NoRule => "no_rule",
            Outcome::Unlimited => "unlimited",
            Outcome::Replaced => "replaced",
            Outcome::UnknownTenant => "unknown_tenant",
            Outcome::InvalidTenant => "invalid_tenant",
        }
    }
}

/// One descriptor of the request, resolved.
struct Item {
    tenant: String,
    rule: Option<Arc<Rule>>,
    /// The counting key (only with a limited rule).
    key: String,
    cost: u64,
    outcome: Outcome,
    shadow: bool,
    /// One of the request's quota descriptors: over its limit, no reason to
    /// deny unless every one of them is (envoyproxy/ratelimit counts every
    /// descriptor but an `unlimited` one under the global switch, as if a
    /// descriptor without a rule were a quota that always passes).
    quota: bool,
    /// Its tier's state after the decision.
    status: Option<TierStatus>,
}

impl Item {
    /// A quota descriptor not (yet) found over its limit.
    fn quota_alive(&self) -> bool {
        self.quota && self.outcome != Outcome::OverQuota
    }

    fn limit(&self) -> Option<&Limit> {
        match self.outcome {
            Outcome::Ok => self.rule.as_ref()?.limit.as_ref(),
            _ => None,
        }
    }
}

/// One tenant's descriptors: one store call.
struct Group {
    tenant: String,
    policy: Arc<Policy>,
    shadow: bool,
    items: Vec<usize>,
    /// Items whose tier takes part in the call (shadow ones that denied are
    /// taken out).
    in_call: Vec<usize>,
    /// (item, the item of the same rule and key it was merged into): one
    /// tier per counter, charged the sum, or the script would read the
    /// counter once per tier and the last write would win.
    merged: Vec<(usize, usize)>,
    cost: u64,
    decided: Option<TiersDecision>,
}

pub struct Service {
    pub decider: Arc<crate::http::AppState>,
    pub metrics: RlsMetrics,
}

impl Service {
    pub async fn should_rate_limit(
        &self,
        req: RateLimitRequest,
    ) -> Result<RateLimitResponse, Status> {
        let started = Instant::now();
        // The node's one admission gate, shared with the HTTP API: past it
        // the call is shed before anything is charged, and Envoy applies
        // its failure_mode_deny (README, "Saturation and lost replies").
        let _slot = self
            .decider
            .decider
            .admission()
            .admit()
            .await
            .map_err(|shed| Status::unavailable(format!("overloaded: {shed}")))?;
        let out = self.decide(req).await;
        self.metrics
            .seconds
            .observe(started.elapsed().as_secs_f64());
        out
    }

    async fn decide(&self, req: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let decider: &Decider = &self.decider.decider;
        let cfg = decider.config();
        if req.domain.is_empty() {
            return Err(Status::invalid_argument("domain must not be empty"));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "the request carries no descriptor",
            ));
        }
        let Some(domain) = cfg.rls.domain(&req.domain) else {
            // As envoyproxy/ratelimit: nothing configured, nothing limited.
            for _ in &req.descriptors {
                self.count("_unknown", "_none", Outcome::NoRule, false);
            }
            self.metrics
                .requests
                .with_label_values(&["_unknown", "ok"])
                .inc();
            let mut response = ok_response(req.descriptors.len());
            response.dynamic_metadata =
                metadata::answer(&req, None, cfg.rls.response_dynamic_metadata);
            return Ok(response);
        };
        let request_hits = u64::from(req.hits_addend).max(1);
        let mut items = Vec::with_capacity(req.descriptors.len());
        for (i, d) in req.descriptors.iter().enumerate() {
            if d.entries.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}] has no entry"
                )));
            }
            if d.is_negative_hits {
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}]: negative hits are not supported (refunds go through POST /v1/refund)"
                )));
            }
            let cost = d
                .hits_addend
                .as_ref()
                .map(|h| h.value)
                .filter(|v| *v > 0)
                .unwrap_or(request_hits);
            if cost > MAX_LIMIT {
                return Err(Status::invalid_argument(format!(
                    "descriptors[{i}].hits_addend {cost} exceeds {MAX_LIMIT}"
                )));
            }
            items.push(resolve(domain, d, cost));
        }
        // `replaces`: a matched rule drops the rules it names.
        let replaced: BTreeSet<&str> = items
            .iter()
            .filter(|it| it.outcome == Outcome::Ok)
            .filter_map(|it| it.rule.as_ref())
            .flat_map(|r| r.replaces.iter().map(String::as_str))
            .collect();
        let replaced: BTreeSet<String> = replaced.into_iter().map(str::to_string).collect();
        for it in &mut items {
            if let Some(name) = it.rule.as_ref().and_then(|r| r.name.as_deref()) {
                if replaced.contains(name) && it.outcome == Outcome::Ok {
                    it.outcome = Outcome::Replaced;
                }
            }
            it.quota = match it.outcome {
                Outcome::Ok => cfg.rls.quota || it.rule.as_ref().is_some_and(|r| r.quota),
                Outcome::NoRule | Outcome::Replaced => cfg.rls.quota,
                _ => false,
            };
        }

        if let Err(e) = decider.await_limits().await {
            return Err(Status::unavailable(e.to_string()));
        }
        let mut groups = self.group(&cfg, domain, &mut items);
        let mut error = None;
        for g in &mut groups {
            if let Err(e) = self.decide_group(g, &mut items).await {
                error = Some(e);
                break;
            }
        }
        let denied = groups
            .iter()
            .any(|g| !g.shadow && g.decided.as_ref().is_some_and(|d| !d.decision.allowed));
        if denied || error.is_some() {
            self.compensate(&groups, &items).await;
        }
        if let Some(e) = error {
            self.metrics
                .requests
                .with_label_values(&[domain.name.as_str(), "error"])
                .inc();
            return Err(match e {
                DecideError::Unavailable => Status::unavailable(
                    "the region's Redis is unavailable and the plan fails closed",
                ),
                e @ DecideError::Newcomer(_) => Status::resource_exhausted(e.to_string()),
                DecideError::Shed(shed) => Status::unavailable(format!("overloaded: {shed}")),
                e @ (DecideError::ViewNotReady | DecideError::LimitsNotReady) => {
                    Status::unavailable(e.to_string())
                }
                other => Status::invalid_argument(other.to_string()),
            });
        }
        let mut response = self.respond(domain, &groups, &mut items);
        response.dynamic_metadata = metadata::answer(
            &req,
            passed_metadata(&items, &response),
            cfg.rls.response_dynamic_metadata,
        );
        Ok(response)
    }

    fn group(
        &self,
        cfg: &tierlimit_shared::config::Loaded,
        domain: &Domain,
        items: &mut [Item],
    ) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        for (i, it) in items.iter_mut().enumerate() {
            if it.outcome == Outcome::InvalidTenant {
                continue;
            }
            if let Some(g) = groups.iter_mut().find(|g| g.tenant == it.tenant) {
                g.items.push(i);
                continue;
            }
            let Some(policy) = cfg.policy_with_plan(&it.tenant, domain.plan.as_deref()) else {
                it.outcome = Outcome::UnknownTenant;
                continue;
            };
            let shadow = cfg.rls.shadow || cfg.plan_shadow(&policy.plan);
            groups.push(Group {
                tenant: it.tenant.clone(),
                policy,
                shadow,
                items: vec![i],
                in_call: Vec::new(),
                merged: Vec::new(),
                cost: 0,
                decided: None,
            });
        }
        for g in &mut groups {
            // Later descriptors of an unknown tenant found no group above.
            for &i in &g.items {
                items[i].shadow |= g.shadow;
            }
            g.in_call = g
                .items
                .iter()
                .copied()
                .filter(|&i| items[i].limit().is_some())
                .collect();
            // The plan's tiers and the global tier are charged once per
            // request: the largest hits of the tenant's descriptors.
            g.cost = g.items.iter().map(|&i| items[i].cost).max().unwrap_or(1);
            // The same descriptor twice in one request: one tier, charged
            // both hits.
            let mut kept: Vec<usize> = Vec::with_capacity(g.in_call.len());
            for &i in &g.in_call {
                let same = kept.iter().copied().find(|&k| {
                    items[k].key == items[i].key
                        && items[k].rule.as_ref().map(|r| &r.id)
                            == items[i].rule.as_ref().map(|r| &r.id)
                });
                match same {
                    Some(k) => {
                        items[k].cost = items[k].cost.saturating_add(items[i].cost);
                        g.merged.push((i, k));
                    }
                    None => kept.push(i),
                }
            }
            g.in_call = kept;
        }
        groups.retain(|g| {
            // A tenant with no limited descriptor and a plan without tiers
            // has nothing to decide (as envoyproxy/ratelimit: no rule, no
            // call).
            !g.in_call.is_empty()
                || g.policy.node.is_some()
                || g.policy.region.is_some()
                || g.policy.global.is_some()
        });
        groups
    }

    async fn decide_group(&self, g: &mut Group, items: &mut [Item]) -> Result<(), DecideError> {
        loop {
            let tiers = tier_calls(&g.in_call, items);
            let d = self
                .decider
                .decider
                .check_tiers(
                    Request {
                        tenant: &g.tenant,
                        key: None,
                        cost: g.cost,
                    },
                    Arc::clone(&g.policy),
                    &tiers,
                )
                .await?;
            // A shadow rule that denied: recorded, taken out, decided again
            // without it (it must not block the others). A quota rule that
            // denied: the same, unless it is the request's last quota
            // descriptor not over (then every one is, and the request is
            // over: this call's denial stands and nothing is charged).
            if let Some(Denied::Tier(t)) = d.denied {
                if let Some(j) = t.checked_sub(d.plan_tiers) {
                    if let Some(&i) = g.in_call.get(j) {
                        if items[i].shadow && !g.shadow {
                            items[i].status = d.decision.tiers.get(t).cloned();
                            items[i].outcome = Outcome::OverLimit;
                            g.in_call.remove(j);
                            continue;
                        }
                        // The descriptors merged into this tier are over
                        // with it.
                        let over: Vec<usize> = std::iter::once(i)
                            .chain(g.merged.iter().filter(|m| m.1 == i).map(|m| m.0))
                            .collect();
                        let alive = items.iter().filter(|it| it.quota_alive()).count();
                        if items[i].quota && alive > over.len() {
                            for &o in &over {
                                items[o].status = d.decision.tiers.get(t).cloned();
                                items[o].outcome = Outcome::OverQuota;
                            }
                            g.in_call.remove(j);
                            continue;
                        }
                    }
                }
            }
            for (j, &i) in g.in_call.iter().enumerate() {
                items[i].status = d.decision.tiers.get(d.plan_tiers + j).cloned();
            }
            for &(i, k) in &g.merged {
                items[i].status = items[k].status.clone();
            }
            g.decided = Some(d);
            return Ok(());
        }
    }

    /// Phase two: gives back every charge of a request that was denied.
    async fn compensate(&self, groups: &[Group], items: &[Item]) {
        for g in groups {
            let Some(d) = &g.decided else { continue };
            let Some(charged) = &d.charged else { continue };
            let tiers = tier_calls(&g.in_call, items);
            let r = self
                .decider
                .decider
                .compensate(
                    Request {
                        tenant: &g.tenant,
                        key: None,
                        cost: g.cost,
                    },
                    Arc::clone(&g.policy),
                    &tiers,
                    charged,
                )
                .await;
            let outcome = if r.is_ok() { "refunded" } else { "failed" };
            if r.is_err() {
                tracing::warn!(
                    tenant = g.tenant,
                    "could not give back a charge of a denied gateway request"
                );
            }
            self.metrics
                .compensations
                .with_label_values(&[outcome])
                .inc();
        }
    }

    fn respond(&self, domain: &Domain, groups: &[Group], items: &mut [Item]) -> RateLimitResponse {
        let mut overall_over = false;
        let mut retry_ms: Option<u64> = None;
        // Borrowed (name, state) of every policy the headers report: built
        // per request, so nothing is copied.
        let mut policies: Vec<(&str, &TierStatus)> = Vec::new();
        // Each group's own denial: its descriptors' codes.
        for g in groups {
            let Some(d) = &g.decided else { continue };
            for (t, st) in d.decision.tiers.iter().enumerate() {
                if t < d.plan_tiers || t >= d.plan_tiers + g.in_call.len() {
                    policies.push((st.name(), st));
                }
            }
            if d.decision.allowed {
                continue;
            }
            let by_descriptor = match d.denied {
                Some(Denied::Tier(t)) => t
                    .checked_sub(d.plan_tiers)
                    .and_then(|j| g.in_call.get(j).copied()),
                _ => None,
            };
            match by_descriptor {
                // A descriptor's own rule denied: that descriptor is over.
                Some(b) => {
                    for &(i, k) in g.merged.iter().chain([(b, b)].iter()) {
                        if k == b && items[i].outcome == Outcome::Ok {
                            items[i].outcome = Outcome::OverLimit;
                        }
                    }
                    // The last quota descriptor not over: every quota
                    // descriptor of the request is over, so each is (a
                    // tenant in shadow mode decides, but does not deny).
                    if items[b].quota && !g.shadow {
                        for it in items.iter_mut() {
                            if it.outcome == Outcome::OverQuota {
                                it.outcome = Outcome::OverLimit;
                            }
                        }
                    }
                }
                // The plan's tiers or the global tier denied: every
                // descriptor of the tenant is.
                None => {
                    for &i in &g.items {
                        items[i].outcome = Outcome::OverLimit;
                    }
                }
            }
            if !g.shadow {
                overall_over = true;
                let r = d.decision.retry_after_ms.unwrap_or_else(|| {
                    d.decision
                        .tiers
                        .iter()
                        .map(|t| t.reset_ms)
                        .max()
                        .unwrap_or(1000)
                });
                retry_ms = Some(retry_ms.map_or(r, |x| x.max(r)));
            }
        }
        let mut statuses = Vec::with_capacity(items.len());
        let items: &[Item] = items;
        for it in items {
            let rule_label = it.rule.as_ref().map_or("_none", |r| r.label.as_str());
            self.count(&domain.name, rule_label, it.outcome, it.shadow);
            let over = matches!(
                it.outcome,
                Outcome::OverLimit
                    | Outcome::OverQuota
                    | Outcome::UnknownTenant
                    | Outcome::InvalidTenant
            );
            // A quota descriptor over alone does not deny the request.
            if over && !it.shadow && it.outcome != Outcome::OverQuota {
                overall_over = true;
            }
            let mut s = DescriptorStatus {
                code: if over && !it.shadow {
                    Code::OverLimit
                } else {
                    Code::Ok
                } as i32,
                ..Default::default()
            };
            if let (Some(rule), Some(st)) = (&it.rule, &it.status) {
                s.current_limit = Some(RateLimit {
                    name: rule.label.clone(),
                    requests_per_unit: u32::try_from(rule.requests_per_unit).unwrap_or(u32::MAX),
                    unit: pb_unit(rule.unit) as i32,
                });
                s.limit_remaining = u32::try_from(st.remaining).unwrap_or(u32::MAX);
                s.duration_until_reset = Some(duration(st.reset_ms));
                if it.outcome == Outcome::Ok && st.remaining * 5 < st.limit {
                    self.metrics
                        .near_limit
                        .with_label_values(&[domain.name.as_str(), rule_label])
                        .inc();
                }
                policies.push((rule.label.as_str(), st));
            }
            statuses.push(s);
        }
        if overall_over && retry_ms.is_none() {
            retry_ms = Some(1000);
        }
        self.metrics
            .requests
            .with_label_values(&[
                domain.name.as_str(),
                if overall_over { "over_limit" } else { "ok" },
            ])
            .inc();
        RateLimitResponse {
            overall_code: if overall_over {
                Code::OverLimit
            } else {
                Code::Ok
            } as i32,
            statuses,
            response_headers_to_add: headers(&policies, overall_over.then_some(retry_ms).flatten()),
            ..Default::default()
        }
    }

    fn count(&self, domain: &str, rule: &str, outcome: Outcome, shadow: bool) {
        self.metrics
            .descriptors
            .with_label_values(&[
                domain,
                rule,
                outcome.name(),
                if shadow { "true" } else { "false" },
            ])
            .inc();
    }
}

/// Resolves one descriptor: tenant, rule, counting key.
fn resolve(
    domain: &Domain,
    d: &envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor,
    cost: u64,
) -> Item {
    let tenant = domain
        .tenant_entry
        .as_deref()
        .and_then(|k| d.entries.iter().find(|e| e.key == k))
        .map_or(domain.name.as_str(), |e| e.value.as_str())
        .to_string();
    let matched = domain.rule(d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())));
    let rule = matched.as_ref().map(|m| Arc::clone(m.rule));
    // A tenant value a client chose that cannot name a tenant is denied,
    // not skipped: skipping would let a malformed header bypass the limit.
    let outcome = if validate::tenant(&tenant).is_err() {
        Outcome::InvalidTenant
    } else {
        match &rule {
            None => Outcome::NoRule,
            Some(r) if r.limit.is_none() => Outcome::Unlimited,
            Some(_) => Outcome::Ok,
        }
    };
    // Each value counted apart, but a `share_threshold` wildcard's values
    // counted as its pattern: one counter for all of them.
    let key = match &matched {
        Some(m) if outcome == Outcome::Ok => counting_key(
            d.entries
                .iter()
                .enumerate()
                .map(|(i, e)| m.counted(i, e.value.as_str())),
        ),
        _ => String::new(),
    };
    Item {
        tenant,
        shadow: rule.as_ref().is_some_and(|r| r.shadow),
        rule,
        key,
        cost,
        outcome,
        quota: false,
        status: None,
    }
}

fn tier_calls<'a>(in_call: &[usize], items: &'a [Item]) -> Vec<TierCall<'a>> {
    in_call
        .iter()
        .filter_map(|&i| {
            let it = &items[i];
            let rule = it.rule.as_ref()?;
            Some(TierCall {
                scope: Scope::Region,
                rule: rule.id.as_str(),
                key: it.key.as_str(),
                limit: rule.limit.as_ref()?,
                cost: it.cost,
            })
        })
        .collect()
}

/// The `metadata` of every descriptor whose status is OK and whose rule
/// limits (not `unlimited`, not replaced), merged in request order as
/// envoyproxy/ratelimit merges them ([`merge_metadata`]: the first wins);
/// `None` when none has any.
fn passed_metadata(items: &[Item], response: &RateLimitResponse) -> Option<Metadata> {
    let mut passed: Option<Metadata> = None;
    for (it, status) in items.iter().zip(&response.statuses) {
        let Some(m) = it.rule.as_ref().and_then(|r| {
            r.limit.as_ref()?;
            r.metadata.as_deref()
        }) else {
            continue;
        };
        let limited = matches!(
            it.outcome,
            Outcome::Ok | Outcome::OverLimit | Outcome::OverQuota
        );
        if limited && status.code == Code::Ok as i32 {
            merge_metadata(passed.get_or_insert_with(Metadata::new), m);
        }
    }
    passed
}

fn ok_response(n: usize) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses: (0..n)
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn pb_unit(u: Option<Unit>) -> PbUnit {
    match u {
        Some(Unit::Second) => PbUnit::Second,
        Some(Unit::Minute) => PbUnit::Minute,
        Some(Unit::Hour) => PbUnit::Hour,
        Some(Unit::Day) => PbUnit::Day,
        Some(Unit::Week) => PbUnit::Week,
        Some(Unit::Month) => PbUnit::Month,
        Some(Unit::Year) => PbUnit::Year,
        None => PbUnit::Unknown,
    }
}

fn duration(ms: u64) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10,
/// one policy per tier and descriptor rule, as on the HTTP API), and
/// `Retry-After` when over the limit.
///
/// Written in place into two right-sized strings, numbers without the
/// formatting machinery: every answer carries these headers, and building
/// them with `write!` and per-policy strings was a tenth of the RLS's own
/// instructions per request (callgrind, BENCHMARKS.md section 10).
fn headers(policies: &[(&str, &TierStatus)], retry_ms: Option<u64>) -> Vec<HeaderValue> {
    let secs = |ms: u64| ms.div_ceil(1000);
    let mut out = Vec::with_capacity(3);
    let mut policy = String::with_capacity(40 * policies.len());
    let mut state = String::with_capacity(36 * policies.len());
    let mut seen: Vec<std::borrow::Cow<'_, str>> = Vec::with_capacity(policies.len());
    for (name, t) in policies {
        let name = field_name(name);
        if seen.contains(&name) {
            continue;
        }
        if !seen.is_empty() {
            policy.push_str(", ");
            state.push_str(", ");
        }
        for (s, a, av, b, bv) in [
            (
                &mut policy,
                "\";q=",
                t.limit,
                ";w=",
                secs(t.window_ms).max(1),
            ),
            (&mut state, "\";r=", t.remaining, ";t=", secs(t.reset_ms)),
        ] {
            s.push('"');
            s.push_str(&name);
            s.push_str(a);
            push_u64(s, av);
            s.push_str(b);
            push_u64(s, bv);
        }
        seen.push(name);
    }
    let mut push = |k: &str, v: String| {
        out.push(HeaderValue {
            key: k.into(),
            value: v,
            ..Default::default()
        })
    };
    if !seen.is_empty() {
        push("RateLimit-Policy", policy);
        push("RateLimit", state);
    }
    if let Some(ms) = retry_ms {
        let mut v = String::with_capacity(8);
        push_u64(&mut v, secs(ms).max(1));
        push("Retry-After", v);
    }
    out
}

/// A policy name as a structured-field string: names are config labels,
/// and quotes, backslashes or control characters would break the field, so
/// they are dropped (borrowed when there are none, as there usually are).
fn field_name(name: &str) -> std::borrow::Cow<'_, str> {
    let bad = |c: char| c == '"' || c == '\\' || c.is_control();
    if name.contains(bad) {
        name.chars().filter(|c| !bad(*c)).collect::<String>().into()
    } else {
        name.into()
    }
}

/// Appends `n` in decimal.
fn push_u64(s: &mut String, mut n: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    s.push_str(std::str::from_utf8(&buf[i..]).expect("ASCII digits"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::Tier;

    fn st(tier: Tier, limit: u64, remaining: u64, reset_ms: u64, window_ms: u64) -> TierStatus {
        TierStatus {
            tier,
            period: None,
            limit,
            remaining,
            reset_ms,
            window_ms,
            algorithm: "fixed_window",
        }
    }

    #[test]
    fn headers_name_every_policy_once_in_order_with_retry_after_when_over() {
        let node = st(Tier::Node, 20, 19, 997, 1000);
        let region = st(Tier::Region, 1200, 0, 55_001, 60_000);
        let global = st(Tier::Global, 100_000, 98_994, 40_555_500, 86_400_000);
        let rule = st(Tier::Region, 5, 4, 200, 0);
        let odd = st(Tier::Region, 7, 7, 0, 3_600_000);
        let policies = [
            ("node", &node),
            ("region", &region),
            ("global", &global),
            ("tenant", &rule),
            // The same rule for a second descriptor: reported once.
            ("tenant", &rule),
            ("we\"i\\rd\n", &odd),
        ];
        let h = headers(&policies, Some(55_001));
        let pairs: Vec<(&str, &str)> = h
            .iter()
            .map(|v| (v.key.as_str(), v.value.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                (
                    "RateLimit-Policy",
                    "\"node\";q=20;w=1, \"region\";q=1200;w=60, \"global\";q=100000;w=86400, \"tenant\";q=5;w=1, \"weird\";q=7;w=3600"
                ),
                (
                    "RateLimit",
                    "\"node\";r=19;t=1, \"region\";r=0;t=56, \"global\";r=98994;t=40556, \"tenant\";r=4;t=1, \"weird\";r=7;t=0"
                ),
                ("Retry-After", "56"),
            ]
        );
        assert!(headers(&[], None).is_empty());
        let only_retry = headers(&[], Some(0));
        assert_eq!(only_retry[0].value, "1", "Retry-After is at least 1 s");
        for n in [0, 7, 10, 99, 1_000_000, u64::MAX] {
            let mut s = String::new();
            push_u64(&mut s, n);
            assert_eq!(s, n.to_string());
        }
    }
}
