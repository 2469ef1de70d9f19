//! The decision path. `check` reads top to bottom:
//!
//! 1. validate the request and resolve the tenant's policy (one map lookup);
//! 2. global fast path: if the broadcast view already says the tenant is
//!    over its daily limit, deny without touching Redis;
//! 3. one `EVALSHA` of `decide.lua`, which checks node tier, region tier and
//!    the region's global budget (`limit − others`, others = broadcast total
//!    minus this region's current actor) and charges all of them only if all
//!    pass;
//! 4. if Redis cannot answer, the plan's `on_store_error` decides.
//!
//! `refund` and `peek` run the same script with another op, so every tier's
//! arithmetic lives in exactly one place (the script).

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use prometheus::IntCounter;

use redis::Value;
use serde::Serialize;
use thiserror::Error;

use tierlimit_shared::config::{Limit, Loaded, Policy, StoreErrorMode, MAX_LIMIT};
use tierlimit_shared::day::SECS_PER_DAY;
use tierlimit_shared::messages::now_ms;
use tierlimit_shared::reload::Live;
use tierlimit_shared::validate::{self, InvalidId};
use tierlimit_shared::{day, keys};

use crate::local::{Charge, Local, LocalTier};
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};
use crate::view::View;

const DAY_MS: u64 = SECS_PER_DAY * 1000;

/// The three tiers, in the order they are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    Node,
    Region,
    Global,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Node => "node",
            Tier::Region => "region",
            Tier::Global => "global",
        }
    }
}

/// How a decision was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The decision script ran in the region's Redis.
    Redis,
    /// Denied from the broadcast view alone (tenant over its global limit).
    View,
    /// Redis unreachable; node-local limits (`on_store_error = "local"`).
    Local,
    /// Redis unreachable; allowed unchecked (`on_store_error = "open"`).
    Open,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Redis => "redis",
            Mode::View => "view",
            Mode::Local => "local",
            Mode::Open => "open",
        }
    }
}

/// One tier's state as reported to the caller.
#[derive(Debug, Clone, Serialize)]
pub struct TierStatus {
    pub tier: Tier,
    pub limit: u64,
    pub remaining: u64,
    /// Milliseconds until the window resets (global: UTC midnight).
    pub reset_ms: u64,
    pub window_ms: u64,
    pub algorithm: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    pub allowed: bool,
    pub tenant: String,
    pub key: String,
    pub cost: u64,
    pub plan: String,
    pub mode: Mode,
    /// The tier that denied (the first failing one in node, region, global order).
    pub denied_by: Option<Tier>,
    /// When denied: ms until this request could pass. `None` with a denial
    /// means never (the cost exceeds the limit).
    pub retry_after_ms: Option<u64>,
    pub tiers: Vec<TierStatus>,
}

/// Usage of one tenant as this node sees it (`GET /v1/tenants/{tenant}`).
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub tenant: String,
    pub key: String,
    pub plan: String,
    pub region: String,
    pub day: u32,
    pub date: String,
    pub tiers: Vec<TierStatus>,
    /// This region's current actor for today: epoch and cumulative P, N.
    pub region_actor: Option<String>,
    pub region_p: u64,
    pub region_n: u64,
    /// The broadcast view of today: global total and per-actor parts.
    pub global_total: Option<u64>,
    pub global_parts: Vec<(String, u64, u64)>,
    pub view_age_ms: Option<u64>,
}

#[derive(Debug, Error)]
pub enum DecideError {
    #[error(transparent)]
    Invalid(#[from] InvalidId),
    #[error("cost must be between 1 and {MAX_LIMIT}, got {0}")]
    Cost(u64),
    #[error("tenant {0:?} is not configured and unknown tenants are denied")]
    UnknownTenant(String),
    #[error("the region's Redis is unavailable and the plan fails closed")]
    Unavailable,
}

/// A parsed check or refund request.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub tenant: &'a str,
    pub key: Option<&'a str>,
    pub cost: u64,
}

/// The live configuration, the tenant's policy and the key it counts by.
type Resolved<'r> = (arc_swap::Guard<Arc<Loaded>>, Arc<Policy>, &'r str);

pub struct Decider {
    live: Live,
    store: Arc<Store>,
    view: Arc<View>,
    local: Arc<Local>,
    region: String,
    node_id: String,
    metrics: Arc<Metrics>,
    /// Children of `tierlimit_decisions_total` by (tier, outcome, mode),
    /// resolved on first use: `with_label_values` hashes the labels and
    /// takes a lock on every call.
    counters: [OnceLock<IntCounter>; 32],
}

/// The reply of `decide.lua`, field by field (see the script's header).
#[derive(Clone)]
struct Reply {
    allowed: bool,
    denied: i64,
    retry_ms: i64,
    node: (i64, i64),
    region: (i64, i64),
    own_p: u64,
    own_n: u64,
    epoch: String,
    global_remaining: i64,
}

impl Decider {
    pub fn new(
        live: Live,
        store: Arc<Store>,
        view: Arc<View>,
        local: Arc<Local>,
        region: String,
        node_id: String,
        metrics: Arc<Metrics>,
    ) -> Decider {
        Decider {
            live,
            store,
            view,
            local,
            region,
            node_id,
            metrics,
            counters: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// May `tenant` spend `cost` units now? Charges every tier if allowed.
    pub async fn check(&self, req: Request<'_>) -> Result<Decision, DecideError> {
        let started = Instant::now();
        let (cfg, policy, key) = self.resolve(&req)?;
        let now = now_ms();
        let today = day::of_unix_secs(now / 1000);

        // 1. Global fast path: known over the daily limit, no Redis needed.
        if let Some(limit) = policy.global {
            let total = self.view.with(req.tenant, today, |e| e.map(|e| e.total()));
            if total.is_some_and(|t| t >= limit) {
                let d = self.view_denial(&req, &policy, key, limit, now);
                return Ok(self.record(d, started));
            }
        }

        // 2. One round trip: every tier checked and charged atomically.
        let cmd = self.script_call(
            "check", req.cost, &cfg, &policy, req.tenant, key, today, now,
        );
        let decision = match self.store.decide(&cmd).await {
            Ok(reply) => {
                let r = parse_reply(reply);
                self.reply_decision(&req, &policy, key, r, now)
            }
            // 3. Redis unavailable: the plan's fail mode.
            Err(e) => self.fail_mode(&req, &cfg, &policy, key, now, e)?,
        };
        Ok(self.record(decision, started))
    }

    /// Gives `cost` units back to every tier (never below zero).
    pub async fn refund(&self, req: Request<'_>) -> Result<Decision, DecideError> {
        let (cfg, policy, key) = self.resolve(&req)?;
        let now = now_ms();
        let today = day::of_unix_secs(now / 1000);
        let cmd = self.script_call(
            "refund", req.cost, &cfg, &policy, req.tenant, key, today, now,
        );
        self.metrics.refunds.inc();
        match self.store.decide(&cmd).await {
            Ok(reply) => Ok(self.reply_decision(&req, &policy, key, parse_reply(reply), now)),
            Err(_) => match policy.on_store_error {
                StoreErrorMode::Closed => Err(DecideError::Unavailable),
                StoreErrorMode::Open => Ok(self.open_decision(&req, &policy, key, now)),
                StoreErrorMode::Local => {
                    let nodes = self.expected_nodes(&cfg);
                    self.local
                        .refund(&policy, nodes, local_charge(&req, key, now, today));
                    let mut d = self.open_decision(&req, &policy, key, now);
                    d.mode = Mode::Local;
                    Ok(d)
                }
            },
        }
    }

    /// Current usage without charging anything.
    pub async fn peek(&self, tenant: &str, key: Option<&str>) -> Result<Usage, DecideError> {
        let req = Request {
            tenant,
            key,
            cost: 1,
        };
        let (cfg, policy, k) = self.resolve(&req)?;
        let now = now_ms();
        let today = day::of_unix_secs(now / 1000);
        let cmd = self.script_call("peek", 0, &cfg, &policy, tenant, k, today, now);
        let reply = self.store.decide(&cmd).await.ok().map(parse_reply);
        let view = self.view.get(tenant, today);
        let d = match &reply {
            Some(r) => self.reply_decision(&req, &policy, k, r.clone(), now),
            None => self.open_decision(&req, &policy, k, now),
        };
        Ok(Usage {
            tenant: tenant.into(),
            key: k.into(),
            plan: policy.plan.clone(),
            region: self.region.clone(),
            day: today,
            date: day::to_iso(today),
            tiers: d.tiers,
            region_actor: reply
                .as_ref()
                .map(|r| tierlimit_shared::messages::actor(&self.region, &r.epoch)),
            region_p: reply.as_ref().map_or(0, |r| r.own_p),
            region_n: reply.as_ref().map_or(0, |r| r.own_n),
            global_total: view.as_ref().map(|e| e.total()),
            global_parts: view
                .map(|e| e.parts.into_iter().map(|(a, (p, n))| (a, p, n)).collect())
                .unwrap_or_default(),
            view_age_ms: self.view.age_ms(now),
        })
    }

    fn resolve<'r>(&self, req: &Request<'r>) -> Result<Resolved<'r>, DecideError> {
        validate::tenant(req.tenant)?;
        if let Some(k) = req.key {
            validate::key(k)?;
        }
        if req.cost == 0 || req.cost > MAX_LIMIT {
            return Err(DecideError::Cost(req.cost));
        }
        let cfg = self.live.load();
        let policy = cfg
            .policy(req.tenant)
            .ok_or_else(|| DecideError::UnknownTenant(req.tenant.into()))?;
        let key = match (policy.key_scoped, req.key) {
            (true, Some(k)) => k,
            _ => keys::WHOLE_TENANT,
        };
        Ok((cfg, policy, key))
    }

    fn expected_nodes(&self, cfg: &Loaded) -> u32 {
        cfg.config
            .regions
            .get(&self.region)
            .map_or(1, |r| r.expected_nodes)
    }

    /// The `EVALSHA` of one `decide.lua` call (KEYS and ARGV layout in the
    /// script header). Numbers and the epoch go straight into the command
    /// buffer, and this region's parts of the broadcast are read under the
    /// view's lock without copying them out: no per-argument strings.
    #[allow(clippy::too_many_arguments)]
    fn script_call(
        &self,
        op: &str,
        cost: u64,
        cfg: &Loaded,
        policy: &Policy,
        t: &str,
        key: &str,
        today: u32,
        now: u64,
    ) -> redis::Cmd {
        let code = |l: &Option<Limit>| l.as_ref().map_or(0, |l| l.algorithm.code());
        let mut cmd = self.store.decide_cmd(6, 512);
        cmd.arg(keys::node_tier(t, &self.node_id, key, code(&policy.node)))
            .arg(keys::region_tier(t, key, code(&policy.region)))
            .arg(keys::DIRTY)
            .arg(keys::pn_counter(t, today.saturating_sub(1)))
            .arg(keys::pn_counter(t, today))
            .arg(keys::pn_counter(t, today + 1));
        cmd.arg(op).arg(cost);
        for limit in [&policy.node, &policy.region] {
            match limit {
                Some(l) => cmd
                    .arg(l.algorithm.code())
                    .arg(l.limit)
                    .arg(l.window_ms)
                    .arg(l.burst),
                None => cmd.arg(0u8).arg(0u8).arg(0u8).arg(0u8),
            };
        }
        let glimit = policy.global.unwrap_or(0);
        cmd.arg(glimit);
        let epoch = new_epoch();
        let epoch = std::str::from_utf8(&epoch).expect("hex digits are ASCII");
        let ttl = (u64::from(cfg.config.aggregator.retention_days) + 1) * SECS_PER_DAY;
        // Broadcast total and this region's actors in it.
        self.view.with(t, today, |e| {
            let total = e.map_or(0, |e| e.total());
            let own: u64 = e.map_or(0, |e| e.region_parts(&self.region).map(|(_, v)| v).sum());
            let cap = self.staleness_cap(cfg, glimit, total, own, now);
            cmd.arg(total);
            match cap {
                Some(c) => cmd.arg(c),
                None => cmd.arg(-1i64),
            };
            cmd.arg(epoch)
                .arg(t)
                .arg(today)
                .arg(ttl)
                .arg(self.store.deadline_ms(now));
            if let Some(e) = e {
                for (epoch, part) in e.region_parts(&self.region) {
                    cmd.arg(epoch).arg(part);
                }
            }
        });
        cmd
    }

    /// With `node.max_staleness` set and the view older than that, this
    /// region may reach at most its view-time part (`own`) plus its share
    /// (1 / regions) of what globally remained then.
    fn staleness_cap(
        &self,
        cfg: &Loaded,
        glimit: u64,
        total: u64,
        own: u64,
        now: u64,
    ) -> Option<u64> {
        let max = cfg.config.node.max_staleness?;
        if glimit == 0 {
            return None;
        }
        let stale = self
            .view
            .age_ms(now)
            .is_none_or(|age| age > max.as_millis() as u64);
        if !stale {
            return None;
        }
        let regions = cfg.config.regions.len().max(1) as u64;
        Some(own + glimit.saturating_sub(total) / regions)
    }

    fn reply_decision(
        &self,
        req: &Request<'_>,
        policy: &Policy,
        key: &str,
        r: Reply,
        now: u64,
    ) -> Decision {
        let mut tiers = Vec::with_capacity(3);
        for (tier, limit, (remaining, reset)) in [
            (Tier::Node, &policy.node, r.node),
            (Tier::Region, &policy.region, r.region),
        ] {
            if let Some(l) = limit {
                tiers.push(status(
                    tier,
                    l,
                    remaining.max(0) as u64,
                    reset.max(0) as u64,
                ));
            }
        }
        if let Some(g) = policy.global {
            tiers.push(global_status(g, r.global_remaining.max(0) as u64, now));
        }
        let denied_by = match r.denied {
            1 => Some(Tier::Node),
            2 => Some(Tier::Region),
            3 => Some(Tier::Global),
            _ => None,
        };
        Decision {
            allowed: r.allowed,
            tenant: req.tenant.into(),
            key: key.into(),
            cost: req.cost,
            plan: policy.plan.clone(),
            mode: Mode::Redis,
            denied_by,
            retry_after_ms: (!r.allowed && r.retry_ms >= 0).then_some(r.retry_ms as u64),
            tiers,
        }
    }

    fn view_denial(
        &self,
        req: &Request<'_>,
        policy: &Policy,
        key: &str,
        limit: u64,
        now: u64,
    ) -> Decision {
        Decision {
            allowed: false,
            tenant: req.tenant.into(),
            key: key.into(),
            cost: req.cost,
            plan: policy.plan.clone(),
            mode: Mode::View,
            denied_by: Some(Tier::Global),
            retry_after_ms: Some(DAY_MS - now % DAY_MS),
            tiers: vec![global_status(limit, 0, now)],
        }
    }

    fn open_decision(&self, req: &Request<'_>, policy: &Policy, key: &str, _now: u64) -> Decision {
        Decision {
            allowed: true,
            tenant: req.tenant.into(),
            key: key.into(),
            cost: req.cost,
            plan: policy.plan.clone(),
            mode: Mode::Open,
            denied_by: None,
            retry_after_ms: None,
            tiers: Vec::new(),
        }
    }

    fn fail_mode(
        &self,
        req: &Request<'_>,
        cfg: &Loaded,
        policy: &Policy,
        key: &str,
        now: u64,
        error: StoreError,
    ) -> Result<Decision, DecideError> {
        if !matches!(error, StoreError::Down) {
            tracing::debug!(%error, tenant = req.tenant, "decision script failed; using on_store_error");
        }
        let mode = policy.on_store_error;
        self.metrics
            .fail_mode
            .with_label_values(&[mode.name()])
            .inc();
        match mode {
            StoreErrorMode::Closed => Err(DecideError::Unavailable),
            StoreErrorMode::Open => Ok(self.open_decision(req, policy, key, now)),
            StoreErrorMode::Local => {
                let today = day::of_unix_secs(now / 1000);
                let nodes = self.expected_nodes(cfg);
                let (allowed, node, region) =
                    self.local
                        .check(policy, nodes, local_charge(req, key, now, today));
                let mut tiers = Vec::new();
                let mut denied_by = None;
                let mut retry: Option<u64> = Some(0);
                for (tier, lt) in [(Tier::Node, node), (Tier::Region, region)] {
                    let Some(LocalTier { limit, eval }) = lt else {
                        continue;
                    };
                    if !eval.allowed {
                        denied_by.get_or_insert(tier);
                        retry = match (retry, eval.retry_ms) {
                            (Some(a), Some(b)) => Some(a.max(b)),
                            _ => None,
                        };
                    }
                    // A tier that passed reports units after this request;
                    // nothing was charged if another tier denied.
                    let remaining = if eval.allowed && !allowed {
                        eval.remaining + req.cost
                    } else {
                        eval.remaining
                    };
                    tiers.push(status(tier, &limit, remaining, eval.reset_ms));
                }
                if let Some(g) = policy.global {
                    let total = self
                        .view
                        .with(req.tenant, today, |e| e.map_or(0, |e| e.total()));
                    tiers.push(global_status(g, g.saturating_sub(total), now));
                }
                Ok(Decision {
                    allowed,
                    tenant: req.tenant.into(),
                    key: key.into(),
                    cost: req.cost,
                    plan: policy.plan.clone(),
                    mode: Mode::Local,
                    denied_by,
                    retry_after_ms: if allowed { None } else { retry },
                    tiers,
                })
            }
        }
    }

    fn record(&self, d: Decision, started: Instant) -> Decision {
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        let tier = d.denied_by.map_or(0, |t| t as usize + 1);
        let slot = tier * 8 + usize::from(!d.allowed) * 4 + d.mode as usize;
        self.counters[slot]
            .get_or_init(|| {
                let tier = d.denied_by.map_or("none", Tier::name);
                let outcome = if d.allowed { "allowed" } else { "denied" };
                self.metrics
                    .decisions
                    .with_label_values(&[tier, outcome, d.mode.name()])
            })
            .inc();
        d
    }
}

fn local_charge<'a>(req: &Request<'a>, key: &'a str, now_ms: u64, day: u32) -> Charge<'a> {
    Charge {
        tenant: req.tenant,
        key,
        cost: req.cost,
        now_us: now_ms * 1000,
        day,
    }
}

fn status(tier: Tier, l: &Limit, remaining: u64, reset_ms: u64) -> TierStatus {
    TierStatus {
        tier,
        limit: l.limit,
        remaining,
        reset_ms,
        window_ms: l.window_ms,
        algorithm: l.algorithm.name(),
    }
}

fn global_status(limit: u64, remaining: u64, now: u64) -> TierStatus {
    TierStatus {
        tier: Tier::Global,
        limit,
        remaining,
        reset_ms: DAY_MS - now % DAY_MS,
        window_ms: DAY_MS,
        algorithm: "utc_day",
    }
}

/// A fresh epoch id (16 lowercase hex digits), used by the script only when
/// today's counter is new.
fn new_epoch() -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let v = rand::random::<u64>();
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = HEX[((v >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

fn int(v: Option<&Value>) -> i64 {
    match v {
        Some(Value::Int(i)) => *i,
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

/// Takes the value out (no copy of a bulk string that is valid UTF-8).
fn text(v: Option<&mut Value>) -> String {
    match v {
        Some(Value::BulkString(b)) => match String::from_utf8(std::mem::take(b)) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        },
        Some(Value::SimpleString(s)) => std::mem::take(s),
        Some(Value::Int(i)) => i.to_string(),
        _ => String::new(),
    }
}

fn parse_reply(mut v: Vec<Value>) -> Reply {
    Reply {
        allowed: int(v.first()) == 1,
        denied: int(v.get(1)),
        retry_ms: int(v.get(2)),
        node: (int(v.get(4)), int(v.get(5))),
        region: (int(v.get(6)), int(v.get(7))),
        own_p: int(v.get(8)).max(0) as u64,
        own_n: int(v.get(9)).max(0) as u64,
        epoch: text(v.get_mut(10)),
        global_remaining: int(v.get(12)),
    }
}
