//! The decision path. `check` reads top to bottom:
//!
//! 1. validate the request and resolve the tenant's policy (one map lookup);
//! 2. global fast path: if the broadcast view already says the tenant is
//!    over the limit of one of its global tiers (the day's, or an hour's,
//!    an ISO week's or a calendar month's), deny without touching Redis;
//! 3. one call of the region's [`CounterStore`] (one `EVALSHA` of
//!    `decide.lua`), which checks node tier, region tier and the region's
//!    global budget (`limit − others`, others = broadcast total minus this
//!    region's current actor, the total taken to be at least the broadcast
//!    threshold) and charges all of them only if all pass. A lease this
//!    node holds answers without the call; a node-tier reservation
//!    ([`crate::reserve`]) answers the node tier, and the call carries the
//!    others;
//! 4. if Redis cannot answer, the plan's `on_store_error` decides: `local`
//!    is the same call answered by the in-process store ([`Local`]).
//!
//! `refund` and `peek` are the same call with another [`Op`], so every
//! tier's arithmetic lives in exactly one place (the script, and its
//! in-process twin for the fail mode).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use prometheus::IntCounter;

use serde::Serialize;
use thiserror::Error;

use tierlimit_shared::config::{Algorithm, Limit, Loaded, Policy, StoreErrorMode, MAX_LIMIT};
use tierlimit_shared::day::SECS_PER_DAY;
use tierlimit_shared::messages::now_ms;
use tierlimit_shared::period::{Period, PeriodKind};
use tierlimit_shared::reload::Live;
use tierlimit_shared::validate::{self, InvalidId};
use tierlimit_shared::{day, keys};

use crate::admission::{Admission, Shed};
use crate::lease::{Leases, Leftover, Take};
use crate::local::Local;
use crate::metrics::Metrics;
use crate::newcomers::{Newcomers, Refusal, Refused};
use crate::refund::{Handle, HandleError, Signer, Verified, Window};
use crate::reserve::{self, Reserves};
use crate::storage::script::PeriodArgs;
use crate::storage::{
    CounterStore, DecideCall, DecideReply, Denied, GlobalArgs, LeaseAsk, Op, Scope, StoreError,
    TierCall,
};
use crate::transition::{Carried, Transitions};
use crate::view::View;

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
    /// Allowed from a lease this node holds: units an earlier decision
    /// charged in Redis for it (see [`crate::lease`]).
    Lease,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Redis => "redis",
            Mode::View => "view",
            Mode::Local => "local",
            Mode::Open => "open",
            Mode::Lease => "lease",
        }
    }
}

/// One tier's state as reported to the caller.
#[derive(Debug, Clone, Serialize)]
pub struct TierStatus {
    pub tier: Tier,
    /// A global tier's period (`day`, `hour`, `week`, `month`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<PeriodKind>,
    pub limit: u64,
    pub remaining: u64,
    /// Milliseconds until the window resets (global: the period's end in
    /// UTC, e.g. midnight for the day).
    pub reset_ms: u64,
    pub window_ms: u64,
    pub algorithm: &'static str,
}

impl TierStatus {
    /// The policy's name in headers, `violated-policy` and metric labels:
    /// `node`, `region`, `global` (the day's, as before periods existed),
    /// `global-hour`, `global-week`, `global-month`.
    pub fn name(&self) -> &'static str {
        policy_name(self.tier, self.period)
    }
}

/// See [`TierStatus::name`].
pub fn policy_name(tier: Tier, period: Option<PeriodKind>) -> &'static str {
    match (tier, period) {
        (Tier::Global, Some(PeriodKind::Hour)) => "global-hour",
        (Tier::Global, Some(PeriodKind::Week)) => "global-week",
        (Tier::Global, Some(PeriodKind::Month)) => "global-month",
        (tier, _) => tier.name(),
    }
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
    /// When a global tier denied: its period.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub denied_period: Option<PeriodKind>,
    /// When denied: ms until this request could pass. `None` with a denial
    /// means never (the cost exceeds the limit).
    pub retry_after_ms: Option<u64>,
    pub tiers: Vec<TierStatus>,
    /// For an allowed check decided in Redis, when the region signs refund
    /// handles: what a refund of this charge presents (see [`crate::refund`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refund_handle: Option<String>,
}

/// What a refund gave back.
#[derive(Debug, Clone, Serialize)]
pub struct Refunded {
    #[serde(flatten)]
    pub decision: Decision,
    /// Units given back to the region's count (0 when the charge's day is
    /// over, or the handle was used already).
    pub refunded: u64,
    /// The handle was used already: nothing was given back this time.
    pub duplicate: bool,
    /// Every window of the handle's charge has ended: nothing given back.
    #[serde(skip)]
    pub expired: bool,
    /// Redis' clock when the refund ran (the node's without Redis).
    #[serde(skip)]
    pub at_ms: u64,
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
    /// Redis serves, but this request's call waited past `store_timeout`
    /// behind others: shed like a full admission queue, not failed over.
    #[error(transparent)]
    Shed(#[from] Shed),
    #[error(transparent)]
    Handle(#[from] HandleError),
    #[error("refunds must name a refund handle on this region (node.free_form_refunds = false)")]
    FreeFormRefund,
    /// An unknown tenant's first sight today, refused by the region's
    /// newcomer gate: nothing was charged.
    #[error("the region admits no more new tenants {}; retry in {} ms", match .0.reason { Refusal::Rate => "this second (unknown_tenants.max_new_per_second)", Refusal::Day => "today (unknown_tenants.max_per_day)" }, .0.retry_after_ms)]
    Newcomer(Refused),
    /// The tenant has a global tier and the broadcast view has not been
    /// read to its end since the node started (`node.view_wait`): without
    /// it the node cannot tell a tenant over its limit from one below the
    /// broadcast threshold. Nothing was charged.
    #[error("the broadcast view is not read yet since this node started; nothing was charged, retry shortly")]
    ViewNotReady,
    /// `limits.source = "topic"` and neither the limits topic nor the
    /// region's copy of it has been read since the node started: it cannot
    /// tell a registered tenant from an unknown one. Nothing was charged.
    #[error("the node has not read the tenants' limits yet (limits topic or the region's copy); nothing was charged, retry shortly")]
    LimitsNotReady,
}

/// What [`Decider::check_tiers`] decided.
#[derive(Debug, Clone)]
pub struct TiersDecision {
    /// Tier statuses in call order: the plan's node and region tiers
    /// (`plan_tiers` of them), then the extra tiers, then the global tier.
    pub decision: Decision,
    pub plan_tiers: usize,
    /// Which tier of the call denied, when the store said so.
    pub denied: Option<Denied>,
    /// An allowed charge that [`Decider::compensate`] can give back.
    pub charged: Option<Charged>,
}

/// An allowed charge of [`Decider::check_tiers`].
#[derive(Debug, Clone)]
pub struct Charged {
    /// Unique per charge (the call's epoch candidate).
    pub id: String,
    /// Redis' clock at the charge (the node's for `local`).
    pub at_ms: u64,
    pub mode: Mode,
}

/// Whose charge a refund by handle gives back: the node whose node tier
/// was charged, and the tiers charged (`None`: every tier of the plan, a
/// previous release's handle).
struct Charger<'h> {
    node: &'h str,
    windows: Option<&'h [Window]>,
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
    /// The region's counters (Redis: standalone or behind Sentinel).
    store: Arc<dyn CounterStore>,
    view: Arc<View>,
    /// The `local` fail mode, behind the same interface.
    local: Arc<Local>,
    region: String,
    node_id: String,
    metrics: Arc<Metrics>,
    /// Children of `tierlimit_decisions_total` by (tier, outcome, mode),
    /// resolved on first use: `with_label_values` hashes the labels and
    /// takes a lock on every call.
    counters: [OnceLock<IntCounter>; 70],
    /// The refund-handle signer and the secret it was built from.
    signer: arc_swap::ArcSwapOption<(String, Signer)>,
    /// The region's gate for tenants the configuration does not name.
    newcomers: Option<Newcomers>,
    /// Units this node holds in leases, and what expired or replaced
    /// leases left to give back.
    leases: Leases,
    leftovers: std::sync::Mutex<Vec<Leftover>>,
    /// Node-tier units this node charged ahead and spends in process.
    reserves: Reserves,
    /// Old tiers carried after a limits change of their shape.
    transitions: Transitions,
    /// The admission gate every front end takes a slot of before it
    /// decides (`node.max_in_flight`, read at start).
    admission: Arc<Admission>,
    /// When this node started: `node.view_wait` counts from here.
    started: Instant,
    /// Whether this node's clock was last seen beyond `node.max_clock_offset`
    /// of its Redis' (logged when it changes).
    clock_off: AtomicBool,
}

impl Decider {
    pub fn new(
        live: Live,
        store: Arc<dyn CounterStore>,
        view: Arc<View>,
        local: Arc<Local>,
        region: String,
        node_id: String,
        metrics: Arc<Metrics>,
    ) -> Decider {
        let admission = crate::admission::gate(&live.load().config.node, Arc::clone(&metrics));
        Decider {
            admission,
            live,
            store,
            view,
            local,
            region,
            node_id,
            metrics,
            counters: std::array::from_fn(|_| OnceLock::new()),
            signer: arc_swap::ArcSwapOption::empty(),
            newcomers: None,
            leases: Leases::default(),
            leftovers: std::sync::Mutex::default(),
            reserves: Reserves::default(),
            transitions: Transitions::default(),
            started: Instant::now(),
            clock_off: AtomicBool::new(false),
        }
    }

    /// Puts unknown tenants behind the region's newcomer gate.
    pub fn with_newcomers(mut self, gate: Newcomers) -> Decider {
        self.newcomers = Some(gate);
        self
    }

    /// A global-tier decision needs the broadcast view read to its end at
    /// least once since the start: an empty view holds no entry for a
    /// tenant already over its limit, and a missing entry reads as "below
    /// the broadcast threshold" (ARCHITECTURE.md, "Only what decisions need
    /// is broadcast"), which a restarted node would take at its word. So
    /// until then (at most `node.view_wait` after the start) such a check
    /// waits up to `store_timeout` for the catch-up and is otherwise shed;
    /// past `view_wait` (the broker unreachable since the start) it is
    /// decided without the view, and counted.
    async fn await_view(&self, cfg: &Loaded) -> Result<(), DecideError> {
        if self.view.caught_up() {
            return Ok(());
        }
        let node = &cfg.config.node;
        let Some(left) = node.view_wait.checked_sub(self.started.elapsed()) else {
            self.metrics.view_blind.inc();
            return Ok(());
        };
        if self.view.wait_caught_up(left.min(node.store_timeout)).await {
            self.metrics.view_waited.inc();
            Ok(())
        } else if self.started.elapsed() >= node.view_wait {
            self.metrics.view_blind.inc();
            Ok(())
        } else {
            self.metrics.view_shed.inc();
            Err(DecideError::ViewNotReady)
        }
    }

    /// With `limits.source = "topic"`, a decision needs the limits read to
    /// their end once (from the topic, or the region's copy of it): before
    /// that a registered tenant would look unknown. Waits up to
    /// `store_timeout`, then sheds (503, nothing charged), as `await_view`.
    pub async fn await_limits(&self) -> Result<(), DecideError> {
        let cfg = self.live.load();
        let Some(table) = cfg.limits() else {
            return Ok(());
        };
        if table.is_ready() || table.wait_ready(cfg.config.node.store_timeout).await {
            return Ok(());
        }
        self.metrics.limits_shed.inc();
        Err(DecideError::LimitsNotReady)
    }

    /// An unknown tenant's first sight today passes the newcomer gate;
    /// configured tenants never reach it.
    async fn admit_newcomer(
        &self,
        cfg: &Loaded,
        tenant: &str,
        today: u32,
        now: u64,
    ) -> Result<(), DecideError> {
        match &self.newcomers {
            Some(gate) if cfg.is_unknown(tenant) => gate
                .admit(tenant, today, now, &cfg.config.unknown_tenants)
                .await
                .map_err(DecideError::Newcomer),
            _ => Ok(()),
        }
    }

    pub fn store(&self) -> &dyn CounterStore {
        self.store.as_ref()
    }

    /// The node's admission gate: the HTTP router's layer
    /// ([`tierlimit_shared::admission::layer`]) and any other front end take a
    /// slot of it ([`Admission::admit`]) before deciding.
    pub fn admission(&self) -> Arc<Admission> {
        Arc::clone(&self.admission)
    }

    /// The live configuration (the RLS reads its descriptor rules here).
    pub fn config(&self) -> arc_swap::Guard<Arc<Loaded>> {
        self.live.load()
    }

    /// May `tenant` spend `cost` units now? Charges every tier if allowed.
    pub async fn check(&self, req: Request<'_>) -> Result<Decision, DecideError> {
        let started = Instant::now();
        self.await_limits().await?;
        let (cfg, policy, key) = self.resolve(&req)?;
        let (now, today) = self.clock();
        self.admit_newcomer(&cfg, req.tenant, today, now).await?;
        if has_global(&policy) {
            self.await_view(&cfg).await?;
        }

        // 1. Global fast path: known over a global tier's limit, no Redis
        //    needed.
        if let Some((period, limit)) = self.over_in_view(req.tenant, &policy, today, now) {
            let d = self.view_denial(&req, &policy, key, (period, limit), self.redis_now(now));
            return Ok(self.record(d, started));
        }

        // A tenant whose tier changed shape carries the old tier for a
        // while (see `crate::transition`): no lease, no reservation then.
        let carried = self
            .transitions
            .carried(req.tenant, &policy, || self.redis_now(now));

        // 2. A lease this node holds: units charged in Redis already.
        let epoch = new_epoch();
        let life = if carried.is_empty() {
            lease_life(&cfg, &policy)
        } else {
            None
        };
        let mut asking = None;
        if let Some((life, cap)) = life {
            match self.leases.take(
                (req.tenant, key),
                req.cost,
                (Instant::now(), now),
                (life, cap),
            ) {
                Take::Leased(r, from) => {
                    let call = self.call(Op::Check, &req, &cfg, &policy, key, today, now, &epoch);
                    let mut d = self.reply_decision(&req, &policy, key, *r, Mode::Lease, &call);
                    d.refund_handle = self.sign_handle(&cfg, &d, from.charged_at_ms as i64, &call);
                    self.metrics.lease_checks.inc();
                    return Ok(self.record(d, started));
                }
                Take::Redis { ask } => asking = ask,
            }
        }

        // 3. One round trip: every tier checked and charged atomically
        // (and a lease taken, when asked for). Without a lease, the node
        // tier may come from this node's reservation: the script then runs
        // without it (see `crate::reserve`).
        let mut call = self.call(Op::Check, &req, &cfg, &policy, key, today, now, &epoch);
        let extra = carry(&mut call, &carried, req.key, req.cost);
        let mut reserve = None;
        if let (Some(a), Some((life, _))) = (&asking, life) {
            call.lease = Some(LeaseAsk {
                max: a.want,
                share: 2 * u64::from(call.expected_nodes.max(1)),
                life_ms: life.as_millis() as u64,
            });
        } else if life.is_none() && carried.is_empty() {
            reserve = self
                .reserve_take(&cfg, &policy, &req, key, now)
                .map(|t| self.reserves.pending((req.tenant, key), t));
        }
        let covered = match reserve.as_ref().map(reserve::Pending::get) {
            Some(reserve::Take::Covered { .. }) => Some(call.tiers.remove(0)),
            Some(reserve::Take::Charge { reserve }) => {
                call.tiers[0].cost += reserve;
                None
            }
            None => None,
        };
        let sent = Instant::now();
        let mut result = self.decide_on_redis_day(&cfg, &policy, &mut call).await;
        if let (Some(asking), Some((life, _))) = (asking, life) {
            let id = lease_id(call.epoch_candidate);
            if let Ok(r) = &result {
                self.metrics
                    .lease_units
                    .with_label_values(&["granted"])
                    .inc_by(r.granted);
            }
            if let Some(left) = self
                .leases
                .settle(asking, result.as_ref().ok(), (sent, life), &id)
            {
                self.leftovers.lock().expect("leftovers").push(left);
            }
        }
        if let Some(taken) = reserve {
            let taken = taken.into_take();
            result = self
                .reserve_settle(
                    (&cfg, &policy),
                    &req,
                    key,
                    &mut call,
                    covered,
                    taken,
                    sent,
                    result,
                )
                .await;
        }
        let (decision, round_trip) = match result {
            Ok(r) => {
                let (charged_at, round_trip) = (r.now_ms, r.round_trip);
                let mut d = self.reply_decision(&req, &policy, key, r, Mode::Redis, &call);
                fold_carried(&mut d.tiers, &call, extra);
                if d.allowed {
                    d.refund_handle = self.sign_handle(&cfg, &d, charged_at, &call);
                }
                (d, Some(round_trip))
            }
            // 4. Redis unavailable: the plan's fail mode.
            Err(e) => {
                let mut d = self.fail_mode(&req, &policy, key, &call, e)?;
                fold_carried(&mut d.tiers, &call, extra);
                (d, None)
            }
        };
        Ok(self.record_called(decision, started, round_trip))
    }

    /// A check whose store call carries `extra` windowed tiers beside the
    /// plan's (a gateway's descriptors, see [`crate::rls`]): all of them and
    /// the global tier decided together in one round trip, all-or-nothing,
    /// under `policy` (the tenant's, or the plan its RLS domain names). The
    /// plan's tiers and the global tier are charged `req.cost`.
    pub async fn check_tiers(
        &self,
        req: Request<'_>,
        policy: Arc<Policy>,
        extra: &[TierCall<'_>],
    ) -> Result<TiersDecision, DecideError> {
        let started = Instant::now();
        validate::tenant(req.tenant)?;
        if req.cost == 0 || req.cost > MAX_LIMIT {
            return Err(DecideError::Cost(req.cost));
        }
        let cfg = self.live.load();
        let key = keys::WHOLE_TENANT;
        let (now, today) = self.clock();
        self.admit_newcomer(&cfg, req.tenant, today, now).await?;
        let plan_tiers = usize::from(policy.node.is_some()) + usize::from(policy.region.is_some());
        if has_global(&policy) {
            self.await_view(&cfg).await?;
        }
        if let Some((period, limit)) = self.over_in_view(req.tenant, &policy, today, now) {
            let d = self.view_denial(&req, &policy, key, (period, limit), self.redis_now(now));
            let denied = match period.kind {
                PeriodKind::Day if period.zone.is_utc() => Denied::Global,
                kind => Denied::Period(
                    policy
                        .global_periods
                        .iter()
                        .position(|t| t.kind == kind)
                        .unwrap_or(0),
                ),
            };
            return Ok(TiersDecision {
                decision: self.record(d, started),
                plan_tiers,
                denied: Some(denied),
                charged: None,
            });
        }
        let epoch = new_epoch();
        let carried = self
            .transitions
            .carried(req.tenant, &policy, || self.redis_now(now));
        let mut call = self.call(Op::Check, &req, &cfg, &policy, key, today, now, &epoch);
        call.tiers.extend(extra.iter().cloned());
        // Carried tiers go last: a denial by one reads as the plan's (its
        // index is past every descriptor's), and its status folds into the
        // plan tier's.
        let carried_n = carry(&mut call, &carried, None, req.cost);
        let result = self.decide_on_redis_day(&cfg, &policy, &mut call).await;
        let round_trip = result.as_ref().ok().map(|r| r.round_trip);
        let (decision, denied, charged) = match result {
            Ok(r) => {
                let denied = match r.denied {
                    Some(Denied::Tier(t)) if t >= call.tiers.len() - carried_n => {
                        Some(Denied::Tier(plan_tier_of(&call, t)))
                    }
                    d => d,
                };
                let charged = r.allowed.then(|| Charged {
                    id: call.epoch_candidate.to_string(),
                    at_ms: r.now_ms.max(0) as u64,
                    mode: Mode::Redis,
                });
                let mut d = self.reply_decision(&req, &policy, key, r, Mode::Redis, &call);
                fold_carried(&mut d.tiers, &call, carried_n);
                (d, denied, charged)
            }
            Err(e) => {
                let mut d = self.fail_mode(&req, &policy, key, &call, e)?;
                fold_carried(&mut d.tiers, &call, carried_n);
                let charged = (d.allowed && d.mode == Mode::Local).then(|| Charged {
                    id: call.epoch_candidate.to_string(),
                    at_ms: now,
                    mode: Mode::Local,
                });
                // The local store reports which tier denied only through
                // `denied_by`; the caller reads the tier statuses.
                (d, None, charged)
            }
        };
        Ok(TiersDecision {
            decision: self.record_called(decision, started, round_trip),
            plan_tiers,
            denied,
            charged,
        })
    }

    /// Gives back exactly what an allowed [`Decider::check_tiers`] charged
    /// (only to the windows and the day the charge was in, once: the same
    /// mechanism as a refund by handle). Used when another tenant of the
    /// same gateway request denied.
    pub async fn compensate(
        &self,
        req: Request<'_>,
        policy: Arc<Policy>,
        extra: &[TierCall<'_>],
        charged: &Charged,
    ) -> Result<(), DecideError> {
        let cfg = self.live.load();
        let (now, today) = self.clock();
        let epoch = new_epoch();
        let key = keys::WHOLE_TENANT;
        let mut call = self.call(Op::Refund, &req, &cfg, &policy, key, today, now, &epoch);
        call.tiers.extend(extra.iter().cloned());
        match charged.mode {
            Mode::Local => {
                self.local.decide_now(&call);
                Ok(())
            }
            _ => {
                call.refund = Some(crate::storage::script::RefundOf {
                    id: charged.id.clone(),
                    charged_at_ms: charged.at_ms,
                    expires_at_ms: 0,
                });
                // The periods the charge was in: a refund gives back only
                // to them, while they are open.
                call.periods = self.period_args(req.tenant, &cfg, &policy, charged.at_ms, now);
                self.store
                    .decide(&call)
                    .await
                    .map(|_| ())
                    .map_err(|_| DecideError::Unavailable)
            }
        }
    }

    /// A free-form refund: gives `cost` units back to every tier's current
    /// window and today's count (never below zero), tied to no charge.
    /// Refused when `node.free_form_refunds` is off; logged and counted.
    pub async fn refund(&self, req: Request<'_>) -> Result<Refunded, DecideError> {
        if !self.live.load().config.node.free_form_refunds {
            return Err(DecideError::FreeFormRefund);
        }
        tracing::info!(
            tenant = req.tenant,
            key = req.key,
            cost = req.cost,
            "free-form refund"
        );
        self.refund_call(req, None, "free_form", None).await
    }

    /// A refund by handle: gives back at most the charge the handle names
    /// (`cost` units if given, else all of it), to the tiers it names of
    /// the node that charged it, only while their windows are current and
    /// to its day's count, once; refused (and counted) in another region,
    /// once used, and once every window it touched has ended (see
    /// [`crate::refund`]).
    pub async fn refund_handle(
        &self,
        handle: &str,
        cost: Option<u64>,
    ) -> Result<Refunded, DecideError> {
        let result = self.refund_by_handle(handle, cost).await;
        if let Err(DecideError::Handle(e)) = &result {
            self.metrics
                .refund_refusals
                .with_label_values(&[e.reason()])
                .inc();
        }
        result
    }

    async fn refund_by_handle(
        &self,
        handle: &str,
        cost: Option<u64>,
    ) -> Result<Refunded, DecideError> {
        let verified = self.signer(&self.live.load())?.verify(handle)?;
        let (tenant, key, charged, of, charger) = match &verified {
            Verified::Current(h) => {
                if h.region != self.region {
                    return Err(HandleError::OtherRegion {
                        issued: h.region.clone(),
                        here: self.region.clone(),
                    }
                    .into());
                }
                let charger = Charger {
                    node: &h.node,
                    windows: Some(&h.windows),
                };
                (&h.tenant, &h.key, h.cost, h.refund_of(), charger)
            }
            // The previous format names no node or windows: its old
            // meaning (this node's tiers), within its grace.
            Verified::Previous(h) => {
                let charger = Charger {
                    node: &self.node_id,
                    windows: None,
                };
                (&h.tenant, &h.key, h.cost, h.refund_of(), charger)
            }
        };
        let key = (key != keys::WHOLE_TENANT).then_some(key.as_str());
        let req = Request {
            tenant,
            key,
            cost: cost.unwrap_or(charged).min(charged),
        };
        let r = self
            .refund_call(req, Some(of), "handle", Some(charger))
            .await?;
        if r.duplicate {
            return Err(HandleError::Used.into());
        }
        if r.expired {
            return Err(match verified {
                Verified::Current(_) => HandleError::Expired,
                Verified::Previous(_) => HandleError::Outdated,
            }
            .into());
        }
        Ok(r)
    }

    async fn refund_call(
        &self,
        req: Request<'_>,
        of: Option<crate::storage::script::RefundOf>,
        kind: &'static str,
        charger: Option<Charger<'_>>,
    ) -> Result<Refunded, DecideError> {
        let (cfg, policy, key) = self.resolve(&req)?;
        let (now, today) = self.clock();
        let epoch = new_epoch();
        let mut call = self.call(Op::Refund, &req, &cfg, &policy, key, today, now, &epoch);
        if let Some(of) = &of {
            // A refund by handle names the periods its charge was in; the
            // script gives back to each only while it is open.
            call.periods = self.period_args(req.tenant, &cfg, &policy, of.charged_at_ms, now);
        }
        call.refund = of;
        if let Some(c) = &charger {
            // The charging node's node tier, and only the tiers charged.
            call.node_id = c.node;
            if let Some(windows) = c.windows {
                call.tiers
                    .retain(|t| windows.iter().any(|w| w.is_tier(t.scope, t.limit)));
            }
        }
        let by_handle = call.refund.is_some();
        let node_first = call.tiers.first().is_some_and(|t| t.scope == Scope::Node)
            && call.node_id == self.node_id;
        if !by_handle && node_first {
            // Tied to no charge, it gives back to the current window down
            // to zero: this node's unspent reservation goes back with it,
            // so the count cannot fall below what the node still holds.
            let held = self.reserves.withdraw(
                (req.tenant, key),
                Instant::now(),
                cfg.config.node.store_timeout,
            );
            call.tiers[0].cost += held;
        }
        // Likewise this node's live lease: its units are charged in every
        // tier and the day's count, so a refund tied to no charge could
        // otherwise floor them below what the lease still holds. It goes
        // back with the refund (an expired one through the usual return).
        let mut withdrawn = 0;
        if !by_handle {
            if let Some((left, live)) = self.leases.withdraw(req.tenant, key, Instant::now()) {
                if live {
                    withdrawn = left.units;
                    call.cost += withdrawn;
                    for t in &mut call.tiers {
                        t.cost += withdrawn;
                    }
                } else {
                    self.leftovers.lock().expect("leftovers").push(left);
                }
            }
        }
        let result = self.store.decide(&call).await;
        if withdrawn > 0 {
            let event = if result.is_ok() {
                "returned"
            } else {
                "unreturned"
            };
            self.metrics
                .lease_units
                .with_label_values(&[event])
                .inc_by(withdrawn);
        }
        match result {
            Ok(r) => {
                if let (true, Some(t)) = (node_first, r.tiers.first()) {
                    self.reserves.observe((req.tenant, key), t, r.now_ms);
                }
                let (refunded, duplicate, expired, at_ms) =
                    (r.refunded, r.duplicate, r.expired, r.now_ms);
                let refunded = refunded.saturating_sub(withdrawn);
                let kind = if duplicate { "duplicate" } else { kind };
                self.metrics.refunds.with_label_values(&[kind]).inc();
                let mut decision = self.reply_decision(&req, &policy, key, r, Mode::Redis, &call);
                if call.node_id == self.node_id {
                    self.count_reserved(&mut decision, (req.tenant, key));
                }
                Ok(Refunded {
                    decision,
                    refunded,
                    duplicate,
                    expired,
                    at_ms: at_ms.max(0) as u64,
                })
            }
            // A refund by handle needs the record of used handles in
            // Redis: without it a retry could give back twice.
            Err(_) if by_handle => Err(DecideError::Unavailable),
            // Without Redis a refund reaches only what this node charged in
            // local mode, and says so: `refunded` is what it gave back to
            // the day's count (0 in `open` mode, which counts nothing).
            Err(_) => {
                self.metrics.refunds.with_label_values(&[kind]).inc();
                let (d, refunded) = match policy.on_store_error {
                    StoreErrorMode::Closed => return Err(DecideError::Unavailable),
                    StoreErrorMode::Open => (self.open_decision(&req, &policy, key), 0),
                    StoreErrorMode::Local => {
                        let r = self.local.decide_now(&call);
                        let mut d = self.open_decision(&req, &policy, key);
                        d.mode = Mode::Local;
                        (d, r.refunded)
                    }
                };
                Ok(Refunded {
                    refunded,
                    decision: d,
                    duplicate: false,
                    expired: false,
                    at_ms: now,
                })
            }
        }
    }

    /// Gives back the unused part of expired and replaced leases: to the
    /// day's global count (same day only) and to the windows the lease was
    /// charged in while they are current, never into a later window. Run
    /// by the node every few hundred ms (`lib.rs`).
    /// A limits record changed `subject`: its leases are given back (within
    /// `lease::RETURN_EVERY`) and its node-tier reservations forgotten, so
    /// no unit taken under the old limit is spent under the new one (a
    /// plan's change reaches every tenant, so all of them).
    ///
    /// A change of a tier's shape (algorithm, window, `key_scoped`) starts
    /// carrying the old tier, with the new limit (see `crate::transition`).
    pub fn limits_changed(
        &self,
        subject: &tierlimit_shared::limits::Subject,
        before: Option<Arc<Policy>>,
        after: Option<Arc<Policy>>,
    ) {
        use tierlimit_shared::limits::Subject;
        self.transitions
            .begin(subject.clone(), before, after, self.redis_now(now_ms()));
        let which = |t: &str| match subject {
            Subject::Tenant(id) => t == id,
            Subject::Plan(_) => true,
        };
        let mut back = self.leases.withdraw_where(which);
        self.reserves.forget_where(which);
        if !back.is_empty() {
            self.leftovers.lock().expect("leftovers").append(&mut back);
        }
    }

    pub async fn return_leases(&self) {
        let mut due = self.leases.expire(Instant::now());
        due.append(&mut self.leftovers.lock().expect("leftovers"));
        for l in due {
            let key = (l.key != keys::WHOLE_TENANT).then_some(l.key.as_str());
            let req = Request {
                tenant: &l.tenant,
                key,
                cost: l.units,
            };
            let of = crate::storage::script::RefundOf {
                id: l.id,
                charged_at_ms: l.charged_at_ms,
                expires_at_ms: 0,
            };
            let outcome = match self.refund_call(req, Some(of), "lease", None).await {
                // Given back after its first window or its day ended: the
                // windows it was charged in keep it (lost to them).
                Ok(r) if r.at_ms >= l.first_end_ms => "lost",
                Ok(_) => "returned",
                Err(e) => {
                    tracing::warn!(tenant = l.tenant, units = l.units, error = %e, "lease not returned");
                    "unreturned"
                }
            };
            self.metrics
                .lease_units
                .with_label_values(&[outcome])
                .inc_by(l.units);
        }
        self.metrics
            .lease_outstanding
            .set(self.leases.outstanding() as i64);
        let held = self.reserves.expire(Instant::now());
        self.metrics.reserve_held.set(held as i64);
    }

    /// The signer of the region's current `node.refund_secret`, rebuilt
    /// only when a reload changed it.
    fn signer(&self, cfg: &Loaded) -> Result<Signer, HandleError> {
        let secret = cfg
            .config
            .node
            .refund_secret
            .as_deref()
            .ok_or(HandleError::Disabled)?;
        if let Some(cached) = self.signer.load().as_ref() {
            if cached.0 == secret {
                return Ok(cached.1.clone());
            }
        }
        let signer = Signer::new(secret.as_bytes());
        self.signer
            .store(Some(Arc::new((secret.to_string(), signer.clone()))));
        Ok(signer)
    }

    /// The refund handle of an allowed charge, if the region signs them:
    /// this region, this node, and the window of each tier of the call at
    /// the charge's Redis time.
    fn sign_handle(
        &self,
        cfg: &Loaded,
        d: &Decision,
        charged_at_ms: i64,
        call: &DecideCall<'_>,
    ) -> Option<String> {
        let signer = self.signer(cfg).ok()?;
        let at = charged_at_ms.max(0) as u64;
        Some(
            signer.sign(&Handle {
                region: self.region.clone(),
                node: self.node_id.clone(),
                tenant: d.tenant.clone(),
                key: d.key.clone(),
                cost: d.cost,
                charged_at_ms: at,
                id: call.epoch_candidate.to_string(),
                windows: call
                    .tiers
                    .iter()
                    .map(|t| Window::of_charge(t.scope, t.limit, at))
                    .collect(),
            }),
        )
    }

    /// Current usage without charging anything.
    pub async fn peek(&self, tenant: &str, key: Option<&str>) -> Result<Usage, DecideError> {
        let req = Request {
            tenant,
            key,
            cost: 1,
        };
        let (cfg, policy, k) = self.resolve(&req)?;
        let (now, today) = self.clock();
        let epoch = new_epoch();
        let mut call = self.call(Op::Peek, &req, &cfg, &policy, k, today, now, &epoch);
        call.cost = 0;
        let reply = self.store.decide(&call).await.ok();
        let view = self.view.get(tenant, today);
        let mut d = match &reply {
            Some(r) => self.reply_decision(&req, &policy, k, r.clone(), Mode::Redis, &call),
            None => self.open_decision(&req, &policy, k),
        };
        self.count_reserved(&mut d, (tenant, k));
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

    /// The store call of one request: its tiers from the policy, and the
    /// global tier's inputs from the broadcast view (this region's parts
    /// read under the view's lock).
    #[allow(clippy::too_many_arguments)]
    fn call<'a>(
        &'a self,
        op: Op,
        req: &Request<'a>,
        cfg: &Loaded,
        policy: &'a Policy,
        key: &'a str,
        today: u32,
        now: u64,
        epoch: &'a [u8; 16],
    ) -> DecideCall<'a> {
        let global = self.global_args(req.tenant, cfg, policy, today, now);
        let periods = self.period_args(req.tenant, cfg, policy, self.redis_now(now), now);
        let tier = |scope, limit| TierCall {
            scope,
            rule: keys::WHOLE_TENANT,
            key,
            limit,
            cost: req.cost,
        };
        let mut tiers = Vec::with_capacity(2);
        if let Some(l) = &policy.node {
            tiers.push(tier(Scope::Node, l));
        }
        if let Some(l) = &policy.region {
            tiers.push(tier(Scope::Region, l));
        }
        DecideCall {
            op,
            tenant: req.tenant,
            node_id: &self.node_id,
            cost: req.cost,
            tiers,
            expected_nodes: self.expected_nodes(cfg),
            global,
            periods,
            epoch_candidate: std::str::from_utf8(epoch).expect("hex digits are ASCII"),
            day: today,
            now_ms: now,
            counter_ttl_secs: (u64::from(cfg.config.aggregator.retention_days) + 1) * SECS_PER_DAY,
            relaxed_ms: cfg.config.node.relaxed_flush_interval().as_millis() as u64,
            refund: None,
            lease: None,
        }
    }

    /// The global tier's inputs of a call for `today`, from the broadcast
    /// view of that day.
    fn global_args(
        &self,
        tenant: &str,
        cfg: &Loaded,
        policy: &Policy,
        today: u32,
        now: u64,
    ) -> Option<GlobalArgs> {
        // One look at the broadcast view: the global total, and this
        // region's actors in it with P and N. The script takes others =
        // total − its actor's part, and raises a rolled-back counter to the
        // part (for every tenant the view holds, global limit or not: the
        // aggregator's count needs the raise as much as the limit does).
        let global = self.view.with(tenant, today, |e| {
            let e = e?;
            let own_parts = self.own_parts(e);
            (policy.global.is_some() || !own_parts.is_empty()).then(|| (e.total(), own_parts))
        });
        match (policy.global, global) {
            (Some(limit), seen) => {
                let (total, own_parts) = seen.unwrap_or_default();
                let own = crate::view::net_sum(own_parts.iter().map(|(_, p, n)| (*p, *n)));
                // The aggregator broadcasts a limited tenant once its total
                // reaches the threshold θ; below it the view holds no entry,
                // or one that may no longer be updated (broadcast before a
                // limit was raised, or before the aggregator restarted). So
                // the total is taken to be at least θ − 1, the most an
                // unbroadcast counter holds: others ≤ θ − 1 − own part,
                // never 0 for want of an entry, and a region alone still
                // reaches θ (ARCHITECTURE.md, "Only what decisions need is
                // broadcast").
                let bounded = total.max(cfg.config.aggregator.unbroadcast_bound(limit));
                Some(GlobalArgs {
                    limit,
                    broadcast_total: bounded,
                    own_cap: self.staleness_cap(cfg, limit, bounded, own, now),
                    own_parts,
                    urgent_at: crate::publisher::urgent_at(
                        Some(limit),
                        total,
                        own,
                        cfg.config.regions.len() as u64,
                        cfg.config.node.urgent_fraction,
                    ),
                })
            }
            // No global tier: only the parts, for the rollback check.
            (None, Some((_, own_parts))) => Some(GlobalArgs {
                own_parts,
                ..GlobalArgs::default()
            }),
            (None, None) => None,
        }
    }

    /// This region's actors in a broadcast entry: (epoch, P, N).
    fn own_parts(&self, e: &crate::view::Entry) -> Vec<(String, u64, u64)> {
        e.parts
            .iter()
            .filter_map(|(actor, (p, n))| {
                let (region, epoch) = actor.split_once('/')?;
                (region == self.region).then(|| (epoch.to_string(), *p, *n))
            })
            .collect()
    }

    /// The global tiers of other periods (hour, week, month) of a call at
    /// `at` (Redis' clock as this node estimates it, or a charge's time for
    /// a refund by handle), each from the broadcast view of its period, as
    /// [`Decider::global_args`] does for the day.
    fn period_args(
        &self,
        tenant: &str,
        cfg: &Loaded,
        policy: &Policy,
        at: u64,
        now: u64,
    ) -> Vec<PeriodArgs> {
        policy
            .global_periods
            .iter()
            .map(|t| {
                let period = t.at(at);
                let (total, own_parts) = self
                    .view
                    .with_period(tenant, period, |e| {
                        e.map(|e| (e.total(), self.own_parts(e)))
                    })
                    .unwrap_or_default();
                let own = crate::view::net_sum(own_parts.iter().map(|(_, p, n)| (*p, *n)));
                // As for the day: below the broadcast threshold the view
                // holds no entry, so the total is taken to be at least the
                // most an unbroadcast counter holds.
                let bounded = total.max(cfg.config.aggregator.unbroadcast_bound(t.limit));
                PeriodArgs {
                    period,
                    limit: t.limit,
                    broadcast_total: bounded,
                    own_cap: self.staleness_cap(cfg, t.limit, bounded, own, now),
                    own_parts,
                    urgent_at: crate::publisher::urgent_at(
                        Some(t.limit),
                        total,
                        own,
                        cfg.config.regions.len() as u64,
                        cfg.config.node.urgent_fraction,
                    ),
                }
            })
            .collect()
    }

    /// The first global tier the broadcast view already shows at or over
    /// its limit (the day's first, then hour, week, month), with its period
    /// by Redis' clock as this node estimates it.
    fn over_in_view(
        &self,
        tenant: &str,
        policy: &Policy,
        today: u32,
        now: u64,
    ) -> Option<(Period, u64)> {
        let over = |period: Period, limit: u64| {
            self.view
                .with_period(tenant, period, |e| e.map(|e| e.total()))
                .is_some_and(|t| t >= limit)
                .then_some((period, limit))
        };
        if let Some(found) = policy.global.and_then(|l| over(Period::day(today), l)) {
            return Some(found);
        }
        if policy.global_periods.is_empty() {
            return None;
        }
        let at = self.redis_now(now);
        policy
            .global_periods
            .iter()
            .find_map(|t| over(t.at(at), t.limit))
    }

    /// This node's clock (ms), and the day of a decision by Redis' clock:
    /// the store's estimate of it (this node's clock plus the offset its
    /// replies taught), ours only until the first reply. One clock decides
    /// the day, so a node whose clock is off does not move its tenants'
    /// midnight; the script refuses a check made for another day anyway
    /// (see [`Decider::decide_on_redis_day`]). The offset is exported, and
    /// beyond `node.max_clock_offset` logged and shown in `/readyz`.
    pub fn clock(&self) -> (u64, u32) {
        let now = now_ms();
        let redis = self.store.redis_now_ms(now);
        if let Some(r) = redis {
            let offset = now as i64 - r;
            self.metrics.clock_offset_ms.set(offset);
            let bound = self.live.load().config.node.max_clock_offset.as_millis() as i64;
            self.metrics.clock_offset_bound_ms.set(bound);
            let off = offset.abs() > bound;
            if self.clock_off.swap(off, Ordering::Relaxed) != off {
                if off {
                    tracing::warn!(
                        offset_ms = offset,
                        bound_ms = bound,
                        "this node's clock is off its Redis' by more than node.max_clock_offset; decisions use Redis' day, but fix the node's time sync"
                    );
                } else {
                    tracing::info!(
                        offset_ms = offset,
                        "this node's clock agrees with its Redis' again"
                    );
                }
            }
        }
        let at = redis.unwrap_or(now as i64).max(0) as u64;
        (now, day::of_unix_secs(at / 1000))
    }

    /// Redis' clock now as this node estimates it (its own until a reply
    /// taught the offset): the global tier resets at Redis' midnight.
    fn redis_now(&self, now: u64) -> u64 {
        self.store
            .redis_now_ms(now)
            .map_or(now, |r| r.max(0) as u64)
    }

    /// This node's clock against its Redis' (`/readyz`): the offset (ours
    /// minus Redis', ms; `None` until a reply taught it), the bound, and
    /// whether it is within it.
    pub fn clock_status(&self) -> serde_json::Value {
        let now = now_ms();
        let bound = self.live.load().config.node.max_clock_offset.as_millis() as i64;
        match self.store.redis_now_ms(now) {
            Some(r) => {
                let offset = now as i64 - r;
                serde_json::json!({
                    "offset_ms": offset,
                    "max_offset_ms": bound,
                    "within_bound": offset.abs() <= bound,
                })
            }
            None => serde_json::json!({
                "offset_ms": null,
                "max_offset_ms": bound,
                "within_bound": null,
            }),
        }
    }

    /// One check's store call, decided on Redis' day. A check built for
    /// another day (the node's estimate of Redis' clock was on the other
    /// side of midnight) is refused by the script, which did nothing: it is
    /// built again with the broadcast view of the day Redis says, and sent
    /// once more. The script never decides with another day's broadcast.
    async fn decide_on_redis_day(
        &self,
        cfg: &Loaded,
        policy: &Policy,
        call: &mut DecideCall<'_>,
    ) -> Result<DecideReply, StoreError> {
        let first = self.store.decide(call).await;
        let Err(StoreError::OtherDay { day, now_ms }) = first else {
            return first;
        };
        self.metrics.day_retries.inc();
        call.day = day;
        call.global = self.global_args(call.tenant, cfg, policy, day, call.now_ms);
        call.periods = self.period_args(call.tenant, cfg, policy, now_ms, call.now_ms);
        self.store.decide(call).await
    }

    /// Redis counts this node's reservation as spent; it is not yet: a
    /// usage read or a refund reports the node tier with it unspent.
    fn count_reserved(&self, d: &mut Decision, at: (&str, &str)) {
        if let Some(t) = d.tiers.iter_mut().find(|t| t.tier == Tier::Node) {
            let held = self.reserves.unspent(at, Instant::now());
            t.remaining = t.remaining.saturating_add(held).min(t.limit);
        }
    }

    /// The node tier of a check from this node's reservation
    /// ([`crate::reserve`]), when its plan's node tier can reserve: a
    /// fixed or sliding window, and `node.reserve_fraction` of its limit at
    /// least one unit.
    fn reserve_take(
        &self,
        cfg: &Loaded,
        policy: &Policy,
        req: &Request<'_>,
        key: &str,
        now: u64,
    ) -> Option<reserve::Take> {
        let node = policy.node.as_ref()?;
        if !matches!(
            node.algorithm,
            Algorithm::FixedWindow | Algorithm::SlidingWindow
        ) {
            return None;
        }
        let chunk = (node.limit as f64 * cfg.config.node.reserve_fraction) as u64;
        if chunk == 0 {
            return None;
        }
        Some(self.reserves.take(
            (req.tenant, key),
            req.cost,
            (node.limit, chunk),
            (Instant::now(), now, Duration::ZERO),
        ))
    }

    /// After the script call of a check that took from, or charged, a
    /// reservation: the reply made whole again for the node tier (as if
    /// the script had decided it), the unit put back if the check was not
    /// charged, the reservation kept if it was.
    #[allow(clippy::too_many_arguments)]
    async fn reserve_settle<'a>(
        &self,
        (cfg, policy): (&Loaded, &Policy),
        req: &Request<'_>,
        key: &str,
        call: &mut DecideCall<'a>,
        covered: Option<TierCall<'a>>,
        taken: reserve::Take,
        sent: Instant,
        mut result: Result<DecideReply, StoreError>,
    ) -> Result<DecideReply, StoreError> {
        let at = (req.tenant, key);
        match taken {
            reserve::Take::Covered { ticket, tier } => {
                call.tiers
                    .insert(0, covered.expect("a covered check lent its node tier"));
                match &mut result {
                    Ok(r) => {
                        r.tiers.insert(0, tier);
                        if let Some(Denied::Tier(i)) = &mut r.denied {
                            *i += 1;
                        }
                        if r.allowed {
                            self.metrics.reserve_covered.inc();
                        } else {
                            self.reserves.give_back(at, ticket);
                        }
                    }
                    Err(_) => self.reserves.give_back(at, ticket),
                }
            }
            reserve::Take::Charge { reserve } => {
                call.tiers[0].cost = req.cost;
                let mut reserve = reserve;
                let mut sent = sent;
                // The node tier could not take the reservation but has room
                // for the check alone: decide again without one (rare: only
                // near the node limit, or after a restart stranded one).
                let refused = matches!(&result, Ok(r) if r.denied == Some(Denied::Tier(0))
                    && r.tiers.first().is_some_and(|t| t.remaining >= req.cost));
                if reserve > 0 && refused {
                    self.reserves.settle(at, reserve, None, sent);
                    self.metrics.reserve_retried.inc();
                    reserve = 0;
                    sent = Instant::now();
                    result = self.decide_on_redis_day(cfg, policy, call).await;
                }
                let charged = result
                    .as_ref()
                    .ok()
                    .filter(|r| r.allowed)
                    .and_then(|r| Some((r.tiers.first()?, r.now_ms)));
                let remaining = self.reserves.settle(at, reserve, charged, sent);
                if let (Some(remaining), Ok(r)) = (remaining, &mut result) {
                    r.tiers[0].remaining = remaining.min(call.tiers[0].limit.limit);
                    self.metrics.reserve_units.inc_by(reserve);
                }
            }
        }
        result
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
        Some(own.saturating_add(glimit.saturating_sub(total) / regions))
    }

    /// The decision a store's reply makes. In `local` mode the region tier
    /// shown is this node's share of it, which is what local mode enforces.
    fn reply_decision(
        &self,
        req: &Request<'_>,
        policy: &Policy,
        key: &str,
        r: DecideReply,
        mode: Mode,
        call: &DecideCall<'_>,
    ) -> Decision {
        if r.raised > 0 {
            self.metrics.counter_rollbacks.inc();
            tracing::warn!(
                tenant = req.tenant,
                raised = r.raised,
                "Redis counter below its broadcast part (partial rollback); raised"
            );
        }
        let mut tiers = Vec::with_capacity(3);
        for (t, reply) in call.tiers.iter().zip(&r.tiers) {
            let tier = match t.scope {
                Scope::Node => Tier::Node,
                Scope::Region => Tier::Region,
            };
            // In local mode the region tier shown is this node's share.
            let share;
            let limit = match (mode, t.scope) {
                (Mode::Local, Scope::Region) => {
                    share = t.limit.share(call.expected_nodes);
                    &share
                }
                _ => t.limit,
            };
            tiers.push(status(tier, limit, reply.remaining, reply.reset_ms));
        }
        // The global tier resets at midnight of the clock that decided:
        // Redis' (the local store answers with this node's).
        let now = u64::try_from(r.now_ms).unwrap_or(call.now_ms);
        if let Some(g) = policy.global {
            tiers.push(global_status(
                (Period::day(day::of_unix_secs(now / 1000)), g),
                r.global_remaining.unwrap_or(0),
                now,
            ));
        }
        for (x, remaining) in call.periods.iter().zip(&r.periods_remaining) {
            tiers.push(global_status((x.period, x.limit), *remaining, now));
        }
        let denied_by = r.denied.map(|d| match d {
            Denied::Tier(i) => match call.tiers.get(i).map(|t| t.scope) {
                Some(Scope::Node) => Tier::Node,
                _ => Tier::Region,
            },
            Denied::Global | Denied::Period(_) => Tier::Global,
        });
        let denied_period = match r.denied {
            Some(Denied::Global) => Some(PeriodKind::Day),
            Some(Denied::Period(j)) => call.periods.get(j).map(|x| x.period.kind),
            _ => None,
        };
        Decision {
            allowed: r.allowed,
            tenant: req.tenant.into(),
            key: key.into(),
            cost: req.cost,
            plan: policy.plan.clone(),
            mode,
            denied_by,
            denied_period,
            retry_after_ms: if r.allowed { None } else { r.retry_ms },
            tiers,
            refund_handle: None,
        }
    }

    fn view_denial(
        &self,
        req: &Request<'_>,
        policy: &Policy,
        key: &str,
        (period, limit): (Period, u64),
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
            denied_period: Some(period.kind),
            retry_after_ms: Some(period.left_ms(now).max(1)),
            tiers: self.view_tiers(req.tenant, policy, (period, limit), now),
            refund_handle: None,
        }
    }

    /// Every global tier of `policy` as the broadcast view shows it (the
    /// denying one at 0 left), so a denial from the view reports the same
    /// policies (`RateLimit-Policy`) as one from the script. Node and
    /// region tiers are not known without Redis, and are left out.
    fn view_tiers(
        &self,
        tenant: &str,
        policy: &Policy,
        (denying, limit): (Period, u64),
        now: u64,
    ) -> Vec<TierStatus> {
        let day = Period::day(day::of_unix_secs(now / 1000));
        let tiers = policy
            .global
            .map(|l| (day, l))
            .into_iter()
            .chain(policy.global_periods.iter().map(|t| (t.at(now), t.limit)));
        tiers
            .map(|(p, l)| {
                if p.kind == denying.kind && p.zone == denying.zone {
                    return global_status((denying, limit), 0, now);
                }
                let spent = self
                    .view
                    .with_period(tenant, p, |e| e.map(|e| e.total()))
                    .unwrap_or(0);
                global_status((p, l), l.saturating_sub(spent), now)
            })
            .collect()
    }

    fn open_decision(&self, req: &Request<'_>, policy: &Policy, key: &str) -> Decision {
        Decision {
            allowed: true,
            tenant: req.tenant.into(),
            key: key.into(),
            cost: req.cost,
            plan: policy.plan.clone(),
            mode: Mode::Open,
            denied_by: None,
            denied_period: None,
            retry_after_ms: None,
            tiers: Vec::new(),
            refund_handle: None,
        }
    }

    /// Redis could not decide: the plan's `on_store_error`.
    fn fail_mode(
        &self,
        req: &Request<'_>,
        policy: &Policy,
        key: &str,
        call: &DecideCall<'_>,
        error: StoreError,
    ) -> Result<Decision, DecideError> {
        if error.is_backlog() {
            // Saturation, not an outage: shed (its late charge, if any, is
            // undone by the store), whatever the plan's fail mode.
            let shed = Shed::StoreBacklog;
            self.metrics.shed.with_label_values(&[shed.reason()]).inc();
            return Err(shed.into());
        }
        if let Some(reason) = error.refused_writes() {
            return self.refused_writes(req, policy, key, call, reason, &error);
        }
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
            StoreErrorMode::Open => Ok(self.open_decision(req, policy, key)),
            StoreErrorMode::Local => {
                let r = self.local.decide_now(call);
                Ok(self.reply_decision(req, policy, key, r, Mode::Local, call))
            }
        }
    }

    /// Redis answered but refused to write (OOM at `maxmemory` under
    /// `noeviction`, MISCONF after a failed save): a capacity alarm, not an
    /// outage, so not the fail mode. `open` would admit uncounted for as
    /// long as the operator takes to add memory; instead the check is
    /// decided by the node's local limiter (counted, and published under
    /// the node's local actor like any `local` decision), for `open` and
    /// `local` plans alike. A `closed` plan asked never to be decided
    /// without Redis: 503. Nothing was charged in Redis (a script is
    /// refused only at its first write). Counted in
    /// `tierlimit_store_writes_refused_total{reason}`.
    fn refused_writes(
        &self,
        req: &Request<'_>,
        policy: &Policy,
        key: &str,
        call: &DecideCall<'_>,
        reason: &'static str,
        error: &StoreError,
    ) -> Result<Decision, DecideError> {
        self.metrics
            .store_writes_refused
            .with_label_values(&[reason])
            .inc();
        tracing::debug!(%error, tenant = req.tenant, "Redis refuses writes; deciding with the local limiter");
        match policy.on_store_error {
            StoreErrorMode::Closed => Err(DecideError::Unavailable),
            StoreErrorMode::Open | StoreErrorMode::Local => {
                let r = self.local.decide_now(call);
                Ok(self.reply_decision(req, policy, key, r, Mode::Local, call))
            }
        }
    }

    fn record(&self, d: Decision, started: Instant) -> Decision {
        self.record_called(d, started, None)
    }

    /// [`Self::record`] of a decision whose Redis call answered after
    /// `round_trip` (`None`: it made none that answered): the rest of its
    /// time is what region-node adds around the call, exported apart so
    /// that the node's own cost is read from the server, not guessed from
    /// two loaded client runs (BENCHMARKS §2). A check sent again for
    /// Redis' day, or without its reservation, counts its first call in
    /// the rest: rare, and never in the node's favour.
    fn record_called(
        &self,
        d: Decision,
        started: Instant,
        round_trip: Option<Duration>,
    ) -> Decision {
        let took = started.elapsed();
        self.metrics.decision_seconds.observe(took.as_secs_f64());
        if let Some(call) = round_trip {
            self.metrics
                .decision_overhead_seconds
                .observe(took.saturating_sub(call).as_secs_f64());
        }
        // 0 none, 1 node, 2 region, 3 the day's global tier, 4..6 the
        // hour's, week's and month's.
        let tier = match (d.denied_by, d.denied_period) {
            (None, _) => 0,
            (Some(Tier::Global), Some(PeriodKind::Hour)) => 4,
            (Some(Tier::Global), Some(PeriodKind::Week)) => 5,
            (Some(Tier::Global), Some(PeriodKind::Month)) => 6,
            (Some(t), _) => t as usize + 1,
        };
        let slot = tier * 10 + usize::from(!d.allowed) * 5 + d.mode as usize;
        self.counters[slot]
            .get_or_init(|| {
                let tier = d
                    .denied_by
                    .map_or("none", |t| policy_name(t, d.denied_period));
                let outcome = if d.allowed { "allowed" } else { "denied" };
                self.metrics
                    .decisions
                    .with_label_values(&[tier, outcome, d.mode.name()])
            })
            .inc();
        d
    }
}

/// Whether a policy's checks may take leases, and if so a lease's life and
/// cap: it has windowed tiers, all fixed or sliding windows (the script
/// grants nothing otherwise), the shortest long enough for a lease's life
/// ([`crate::lease::life`]), and neither `node.lease_max` nor the plan's
/// `lease_max` is 0.
/// Adds the carried old tiers of a check to its call (see
/// `crate::transition`): an old tier that reads the same fields as the new
/// one of its scope replaces its limit's shape; one whose state is
/// elsewhere goes last, beside it; one identical to it is left out.
/// Returns how many went last.
fn carry<'a>(
    call: &mut DecideCall<'a>,
    carried: &'a [Carried],
    req_key: Option<&'a str>,
    cost: u64,
) -> usize {
    let mut extra = 0;
    for c in carried {
        let key = match (c.key_scoped, req_key) {
            (true, Some(k)) => k,
            _ => keys::WHOLE_TENANT,
        };
        let old = TierCall {
            scope: c.scope,
            rule: keys::WHOLE_TENANT,
            key,
            limit: &c.limit,
            cost,
        };
        let same_place = call.tiers.iter().position(|t| {
            t.scope == c.scope
                && t.rule == keys::WHOLE_TENANT
                && t.key == key
                && t.limit.algorithm == c.limit.algorithm
                && t.in_tenant_hash() == old.in_tenant_hash()
        });
        match same_place {
            Some(i) if call.tiers[i].limit.window_ms != c.limit.window_ms => call.tiers[i] = old,
            Some(_) => {}
            None => {
                call.tiers.push(old);
                extra += 1;
            }
        }
    }
    extra
}

/// The plan tier a carried tier at `t` (last in the call) stands for.
fn plan_tier_of(call: &DecideCall<'_>, t: usize) -> usize {
    let scope = call.tiers.get(t).map(|c| c.scope);
    call.tiers
        .iter()
        .position(|c| Some(c.scope) == scope && c.rule == keys::WHOLE_TENANT)
        .unwrap_or(0)
}

/// Folds the statuses of the `extra` carried tiers (last among the call's
/// tiers) into their plan tier's: the tighter remaining, the later reset.
fn fold_carried(statuses: &mut Vec<TierStatus>, call: &DecideCall<'_>, extra: usize) {
    if extra == 0 || statuses.len() < call.tiers.len() {
        return;
    }
    let first = call.tiers.len() - extra;
    let carried: Vec<TierStatus> = statuses.drain(first..call.tiers.len()).collect();
    for (c, st) in call.tiers[first..].iter().zip(carried) {
        let plan = statuses[..first]
            .iter_mut()
            .zip(&call.tiers[..first])
            .find(|(_, t)| t.scope == c.scope && t.rule == keys::WHOLE_TENANT);
        if let Some((p, _)) = plan {
            p.remaining = p.remaining.min(st.remaining);
            p.reset_ms = p.reset_ms.max(st.reset_ms);
        }
    }
}

fn lease_life(cfg: &Loaded, p: &Policy) -> Option<(Duration, u64)> {
    let cap = p.lease_max.map_or(cfg.config.node.lease_max, |m| {
        m.min(cfg.config.node.lease_max)
    });
    if cap == 0 {
        return None;
    }
    let tiers = [p.node.as_ref(), p.region.as_ref()];
    let leasable = tiers.iter().any(Option::is_some)
        && tiers.iter().flatten().all(|l| {
            matches!(
                l.algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingWindow
            )
        });
    if !leasable {
        return None;
    }
    let shortest = tiers.iter().flatten().map(|l| l.window_ms).min()?;
    Some((crate::lease::life(shortest)?, cap))
}

/// The refund-record id of a lease's return: distinct from the id a refund
/// handle of the same charge carries (the call's epoch candidate).
fn lease_id(epoch_candidate: &str) -> String {
    format!("{epoch_candidate}:lease")
}

fn status(tier: Tier, l: &Limit, remaining: u64, reset_ms: u64) -> TierStatus {
    TierStatus {
        tier,
        period: None,
        limit: l.limit,
        remaining,
        reset_ms,
        window_ms: l.window_ms,
        algorithm: l.algorithm.name(),
    }
}

/// A global tier's status: its period resets at the period's end in UTC
/// (midnight for the day; the 1st of next month for a month).
fn global_status((period, limit): (Period, u64), remaining: u64, now: u64) -> TierStatus {
    TierStatus {
        tier: Tier::Global,
        period: Some(period.kind),
        limit,
        remaining,
        reset_ms: period.left_ms(now),
        window_ms: period.len_ms(),
        algorithm: match (period.kind, period.zone.is_utc()) {
            (PeriodKind::Hour, true) => "utc_hour",
            (PeriodKind::Day, true) => "utc_day",
            (PeriodKind::Week, true) => "utc_iso_week",
            (PeriodKind::Month, true) => "utc_month",
            // On the tenant's zone's calendar (`time_zone`).
            (PeriodKind::Hour, false) => "zoned_hour",
            (PeriodKind::Day, false) => "zoned_day",
            (PeriodKind::Week, false) => "zoned_iso_week",
            (PeriodKind::Month, false) => "zoned_month",
        },
    }
}

/// Whether a policy has any global tier (the day's or another period's).
fn has_global(policy: &Policy) -> bool {
    policy.global.is_some() || !policy.global_periods.is_empty()
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
