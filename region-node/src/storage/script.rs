//! The typed interface of the decision script (`lua/decide.lua`): what a
//! call carries ([`DecideCall`]), how it is laid out as KEYS and ARGV
//! ([`encode`]), and what comes back ([`DecideReply`], in fixed positions,
//! read with the call in hand).
//!
//! Everything that knows the script's argument positions is in this module,
//! so the decision path, the `local` fail mode, the load generator and the
//! script tests all speak in named fields. The reply is a list in fixed
//! positions that holds only what the node cannot compute from its own call:
//! Redis converts a reply item by item (about 360 instructions an item), so
//! a window's reset (the node has the window and Redis' `now_ms`) and the
//! global remaining (the node has the limit, the broadcast and its parts)
//! are computed here instead. The node calls the script by the SHA1 of its
//! own text, so the reply's layout is the one this module reads; nodes of
//! two releases sharing a Redis each run their own script and read its own
//! reply, and the script's storage layout is what they share.

use redis::Value;

use tierlimit_shared::config::{Algorithm, Limit};
use tierlimit_shared::day::SECS_PER_DAY;
use tierlimit_shared::keys;
use tierlimit_shared::period::Period;

/// The decision script.
pub const DECIDE_LUA: &str = include_str!("../lua/decide.lua");

/// What a call asks of the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Charge every tier if every tier allows.
    Check,
    /// Give units back to every tier (never below zero).
    Refund,
    /// Read every tier without charging.
    Peek,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Check => "check",
            Op::Refund => "refund",
            Op::Peek => "peek",
        }
    }
}

/// Whose window a tier counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// This node's own window (strict per node).
    Node,
    /// The region's window, shared by its nodes (strict per region).
    Region,
}

/// One windowed tier of a call. A request carries the tiers of its plan
/// and, through a gateway, of each of its descriptors: all of them are
/// decided together, all-or-nothing.
#[derive(Debug, Clone)]
pub struct TierCall<'a> {
    pub scope: Scope,
    /// Which rule the tier belongs to: [`keys::WHOLE_TENANT`] for the plan's
    /// own tiers, a descriptor rule's id otherwise.
    pub rule: &'a str,
    /// The counting key ([`keys::WHOLE_TENANT`] = the whole tenant).
    pub key: &'a str,
    pub limit: &'a Limit,
    /// Units this tier is charged (or refunded).
    pub cost: u64,
}

impl TierCall<'_> {
    /// Whether the tier's state lives in the tenant hash: whole-tenant,
    /// windows of at most a day (the hash lives at least a day past its last
    /// new day), and not the sliding log (a zset of its own).
    pub fn in_tenant_hash(&self) -> bool {
        self.key == keys::WHOLE_TENANT
            && self.limit.window_ms <= SECS_PER_DAY * 1000
            && self.limit.algorithm != Algorithm::SlidingLog
    }

    /// The tier id of the key scheme.
    pub fn tier_id(&self, node_id: &str) -> String {
        let code = self.limit.algorithm.code();
        match self.scope {
            Scope::Node => keys::node_tier_id(node_id, self.rule, code),
            Scope::Region => keys::region_tier_id(self.rule, code),
        }
    }
}

/// The global tier's inputs, as the node's broadcast view sees them. With
/// `limit` 0 there is no global tier, and only `own_parts` is used (the
/// rollback check).
#[derive(Debug, Clone, Default)]
pub struct GlobalArgs {
    /// Daily limit (0 = no global tier).
    pub limit: u64,
    /// Broadcast total for (tenant, day), every actor.
    pub broadcast_total: u64,
    /// The most this region's current actor may reach (set when the view is
    /// stale: see `Decider::staleness_cap`).
    pub own_cap: Option<u64>,
    /// This region's actors in the broadcast: (epoch, P, N). The script also
    /// raises a rolled-back counter to its actor's broadcast P and N.
    pub own_parts: Vec<(String, u64, u64)>,
    /// This region's P − N from which (tenant, day) is published at the next
    /// flush (see `publisher::urgent_at`); `None`: never urgent.
    pub urgent_at: Option<u64>,
}

/// A global tier of another period than the day (hour, ISO week, calendar
/// month), as the node's broadcast view sees it: decided in the same call
/// as the day's, on a PN counter of its own (`g:<label>:` in the tenant
/// hash). The node computes the period from its estimate of Redis' clock
/// and sends its bounds; the script does no calendar arithmetic, and a
/// check whose period Redis' clock is not in does nothing (answered as for
/// another day, and sent again by the node).
#[derive(Debug, Clone)]
pub struct PeriodArgs {
    pub period: Period,
    pub limit: u64,
    /// Broadcast total for (tenant, period), every actor (at least the
    /// unbroadcast bound, as for the day).
    pub broadcast_total: u64,
    pub own_cap: Option<u64>,
    /// This region's actors in the period's broadcast: (epoch, P, N).
    pub own_parts: Vec<(String, u64, u64)>,
    pub urgent_at: Option<u64>,
}

/// The charge a refund by handle gives back (see `crate::refund`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundOf {
    /// Unique per charge: a handle's second use gives nothing back.
    pub id: String,
    /// Redis' clock when the charge ran, ms.
    pub charged_at_ms: u64,
    /// Redis' clock from which nothing is given back and the refund is
    /// refused (every window the charge touched has ended), ms; 0: never.
    /// The record of used handles lives at least until then.
    pub expires_at_ms: u64,
}

impl RefundOf {
    /// The UTC day of the charge.
    pub fn day(&self) -> u32 {
        (self.charged_at_ms / (SECS_PER_DAY * 1000)) as u32
    }
}

/// One call of the decision script.
#[derive(Debug, Clone)]
pub struct DecideCall<'a> {
    pub op: Op,
    pub tenant: &'a str,
    pub node_id: &'a str,
    /// Units charged to (or refunded from) the region's PN counter, the
    /// global tier's count (0 for a peek).
    pub cost: u64,
    /// The windowed tiers, checked together.
    pub tiers: Vec<TierCall<'a>>,
    /// Nodes the region is expected to run (the `local` fail mode enforces
    /// `region / expected_nodes` on its own).
    pub expected_nodes: u32,
    pub global: Option<GlobalArgs>,
    /// The tenant's global tiers of other periods (hour, week, month), in
    /// the order of `Policy::global_periods`.
    pub periods: Vec<PeriodArgs>,
    /// Used only if the day's PN counter does not exist yet.
    pub epoch_candidate: &'a str,
    /// The day the node computed (UTC days since the epoch).
    pub day: u32,
    /// The node's clock, ms (the `local` fail mode decides by it; Redis uses
    /// its own `TIME`).
    pub now_ms: u64,
    /// TTL of the tenant hash, seconds (retention + 1 day).
    pub counter_ttl_secs: u64,
    /// `relaxed_flush_interval`, ms: a (tenant, day) that is not urgent is
    /// published this long after its last publication at the earliest.
    pub relaxed_ms: u64,
    /// A refund by handle: which charge it gives back (`None`: a check, a
    /// peek, or a free-form refund).
    pub refund: Option<RefundOf>,
    /// A check that may also take a lease (see `crate::lease`).
    pub lease: Option<LeaseAsk>,
}

/// How big a lease a check may take: at most `max` units beyond its cost
/// (what the node wants: its recent rate times half the lease's life,
/// capped), scaled down by the time left when a tier's window or the day
/// ends within `life_ms` (so a lease is spent before its windows end at a
/// steady rate); at most 1/`share` of what every tier and the global
/// budget leave after it; none below [`MIN_GRANT`] (so near the limit there
/// is no lease). [`lease_grant`] is the script's arithmetic in Rust.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAsk {
    pub max: u64,
    pub share: u64,
    pub life_ms: u64,
}

/// The smallest lease the script grants: with fewer than
/// `MIN_GRANT × share` units left a check takes no lease.
pub const MIN_GRANT: u64 = 2;

/// One tier as the lease arithmetic sees it: leasable (a fixed or sliding
/// window), units left before the request, its cost, ms until its window
/// ends.
#[derive(Debug, Clone, Copy)]
pub struct LeaseTier {
    pub windowed: bool,
    pub remaining: u64,
    pub cost: u64,
    pub reset_ms: u64,
}

/// The units a lease takes beyond an allowed request: `decide.lua`'s
/// "Leases" in Rust (the script-vs-model test checks they agree), also what
/// the bound on units held in leases is proved against (`lease::bound`).
/// `global_left` is the global budget left before the request (`None`: no
/// global tier), `gcost` what the request charges to it, `now_ms` Redis'
/// clock.
pub fn lease_grant(
    ask: &LeaseAsk,
    tiers: &[LeaseTier],
    global_left: Option<u64>,
    gcost: u64,
    now_ms: u64,
) -> u64 {
    if ask.max == 0 || tiers.is_empty() || tiers.iter().any(|t| !t.windowed) {
        return 0;
    }
    let share = ask.share.max(1);
    let day_left = SECS_PER_DAY * 1000 - now_ms % (SECS_PER_DAY * 1000);
    let left = tiers.iter().map(|t| t.reset_ms).fold(day_left, u64::min);
    let want = if left < ask.life_ms {
        (u128::from(ask.max) * u128::from(left) / u128::from(ask.life_ms)) as u64
    } else {
        ask.max
    };
    let mut room = i128::from(want) * i128::from(share);
    for t in tiers {
        room = room.min(i128::from(t.remaining) - i128::from(t.cost));
    }
    if let Some(g) = global_left {
        room = room.min(i128::from(g) - i128::from(gcost));
    }
    let granted = want.min((room.max(0) as u64) / share);
    if granted < MIN_GRANT {
        0
    } else {
        granted
    }
}

impl DecideCall<'_> {
    /// The Redis Cluster slot of every key the call touches.
    pub fn slot(&self) -> u16 {
        keys::bucket_slot(keys::bucket_of(self.tenant))
    }
}

/// Appends KEYS and ARGV of `call` to `cmd` (an `EVALSHA <sha>` without its
/// key count). `deadline_ms` is in Redis' clock (0 = none): past it the
/// script does nothing, because the node has given up on the call.
///
/// Every number travels in one argument of little-endian doubles, which
/// the script reads with one `struct.unpack` per group: an argument costs
/// Redis a Lua string and a number in text a `strtod`, about 1.5 k
/// instructions a number in all (BENCHMARKS.md §9d). Doubles are what Lua
/// computes with anyway: every count, limit and time is an exact integer
/// below 2^53.
pub fn encode(cmd: &mut redis::Cmd, call: &DecideCall<'_>, deadline_ms: i64) {
    let t = call.tenant;
    let bucket = keys::bucket_of(t);
    let outside: Vec<String> = call
        .tiers
        .iter()
        .filter(|tier| !tier.in_tenant_hash())
        .map(|tier| keys::tier_key(t, &tier.tier_id(call.node_id), tier.key))
        .collect();
    let refund = call.refund.as_ref().filter(|_| call.op == Op::Refund);
    cmd.arg(2 + outside.len() + usize::from(refund.is_some()))
        .arg(keys::tenant_hash(t))
        .arg(keys::dirty(bucket));
    for k in &outside {
        cmd.arg(k);
    }
    if let Some(r) = refund {
        cmd.arg(keys::refund_record(t, r.day()));
    }

    let g = call.global.as_ref();
    let parts: &[(String, u64, u64)] = g.map_or(&[], |g| &g.own_parts);
    let mut n = Numbers::with_capacity(14 + 6 * call.tiers.len() + 2 * parts.len());
    n.push(deadline_ms as f64);
    n.int(u64::from(call.day));
    n.int(call.counter_ttl_secs);
    n.int(g.map_or(0, |g| g.limit));
    n.int(call.cost);
    n.int(g.map_or(0, |g| g.broadcast_total));
    n.or_minus_one(g.and_then(|g| g.own_cap));
    n.or_minus_one(g.and_then(|g| g.urgent_at));
    n.int(call.relaxed_ms);
    // The op's own three numbers: a check's lease, a refund's handle, a
    // peek's zeros.
    match call.op {
        Op::Check => match call.lease {
            Some(l) => {
                n.int(l.max);
                n.int(l.share.max(1));
                n.int(l.life_ms);
            }
            None => {
                n.int(0);
                n.int(1);
                n.int(0);
            }
        },
        Op::Refund => match refund {
            Some(r) => {
                n.int(3 + outside.len() as u64);
                n.int(r.charged_at_ms);
                n.int(0);
            }
            None => {
                n.int(0);
                n.int(0);
                n.int(0);
            }
        },
        Op::Peek => {
            n.int(0);
            n.int(0);
            n.int(0);
        }
    }
    n.int(call.tiers.len() as u64);
    n.int(call.periods.len() as u64);
    // Where each tier's state is: 0 the tenant hash, i KEYS[i] (the keys of
    // `outside`, from KEYS[3], in tier order).
    let mut next_key = 2;
    let locs: Vec<u64> = call
        .tiers
        .iter()
        .map(|tier| {
            if tier.in_tenant_hash() {
                0
            } else {
                next_key += 1;
                next_key
            }
        })
        .collect();
    for (tier, &loc) in call.tiers.iter().zip(&locs) {
        let l = tier.limit;
        n.int(loc);
        n.int(u64::from(l.algorithm.code()));
        n.int(l.limit);
        n.int(l.window_ms);
        n.int(tier.cost);
        n.int(if l.algorithm == Algorithm::TokenBucket {
            l.burst
        } else {
            0
        });
    }
    for x in &call.periods {
        n.int(x.period.start_ms().max(0) as u64);
        n.int(x.period.end_ms().max(0) as u64);
        n.int(x.limit);
        n.int(x.broadcast_total);
        n.or_minus_one(x.own_cap);
        n.or_minus_one(x.urgent_at);
        n.int(x.own_parts.len() as u64);
        for (_, p, nn) in &x.own_parts {
            n.int(*p);
            n.int(*nn);
        }
    }
    for (_, p, nn) in parts {
        n.int(*p);
        n.int(*nn);
    }

    cmd.arg(call.op.name())
        .arg(t)
        // The day's field prefix ready-made: a concatenation in the script
        // costs Redis a Lua string on every call.
        .arg(keys::day_prefix(call.day))
        .arg(call.epoch_candidate)
        .arg(n.0);
    for (tier, &loc) in call.tiers.iter().zip(&locs) {
        if loc > 0 {
            cmd.arg("-");
        } else {
            let mut prefix = tier.tier_id(call.node_id);
            prefix.push(':');
            cmd.arg(prefix);
        }
    }
    for x in &call.periods {
        cmd.arg(keys::period_prefix(x.period));
    }
    if call.op == Op::Refund {
        cmd.arg(refund.map_or("-", |r| r.id.as_str()));
        // Read only by a refund by handle: a string (a strtod on the rare
        // refund) rather than a number every call would carry.
        cmd.arg(refund.map_or(0, |r| r.expires_at_ms));
    }
    for x in &call.periods {
        for (epoch, _, _) in &x.own_parts {
            cmd.arg(epoch);
        }
    }
    for (epoch, _, _) in parts {
        cmd.arg(epoch);
    }
}

/// The numbers of a call, as the script unpacks them (`'<d'` each).
struct Numbers(Vec<u8>);

impl Numbers {
    fn with_capacity(n: usize) -> Numbers {
        Numbers(Vec::with_capacity(8 * n))
    }

    fn push(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// Counts, limits and times: exact as doubles below 2^53, and the
    /// configuration's limits are far below it.
    fn int(&mut self, v: u64) {
        self.push(v as f64);
    }

    fn or_minus_one(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.int(v),
            None => self.push(-1.0),
        }
    }
}

/// The numbers argument of a call, read back (tests and tools).
pub fn unpack_numbers(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("chunks of 8")))
        .collect()
}

/// What denied a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// The windowed tier at this index of the call.
    Tier(usize),
    /// The day's global tier.
    Global,
    /// The global tier of another period, at this index of
    /// `DecideCall::periods`.
    Period(usize),
}

/// One windowed tier's state after the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierReply {
    /// Units left: after this request if it was charged, before it if not.
    pub remaining: u64,
    /// ms until the window resets.
    pub reset_ms: u64,
}

/// A lower bound of when a window ends, in this node's monotonic clock,
/// that the script reported ending `reset_ms` after a call sent at `sent`. Redis ran the call after `sent`, and the script counts `reset_ms`
/// from its clock floored to the millisecond, which can overstate what was
/// left by up to 1 ms: hence one millisecond less. Leases and node-tier
/// reservations are spent only before it, so never in a later window.
pub fn window_end_lower_bound(sent: std::time::Instant, reset_ms: u64) -> std::time::Instant {
    sent + std::time::Duration::from_millis(reset_ms.saturating_sub(1))
}

/// What the script answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecideReply {
    pub allowed: bool,
    pub denied: Option<Denied>,
    /// When denied: ms until the request could pass; `None` means never
    /// (the cost exceeds the limit).
    pub retry_ms: Option<u64>,
    /// Redis' clock when the script ran.
    pub now_ms: i64,
    /// The call's tiers, in call order.
    pub tiers: Vec<TierReply>,
    /// This region's PN counter for the day: cumulative P and N, and the
    /// epoch that names the actor.
    pub own_p: u64,
    pub own_n: u64,
    pub epoch: String,
    pub day: u32,
    pub global_remaining: Option<u64>,
    /// Each other period's global remaining after the call, in the order
    /// of `DecideCall::periods`.
    pub periods_remaining: Vec<u64>,
    /// When the first of the call's other periods ends, Redis ms (`None`:
    /// the call has none). A lease never outlives it.
    pub periods_end_ms: Option<u64>,
    /// Units the rollback check added to P: Redis held less than the
    /// aggregator already had from this actor.
    pub raised: u64,
    /// Units a refund gave back to the region's PN counter.
    pub refunded: u64,
    /// A refund by handle that was used already: nothing given back.
    pub duplicate: bool,
    /// A refund by handle past its expiry (every window of the charge has
    /// ended, in Redis' clock): nothing given back, nothing recorded.
    pub expired: bool,
    /// Units of lease charged beyond the check's cost (every tier and the
    /// PN counter alike).
    pub granted: u64,
    /// How long the store waited for this reply, from the call sent to its
    /// answer: what `tierlimit_redis_seconds{op="decide"}` observed for it
    /// (zero where no call was made: the `local` store, a parse in a test).
    /// The decision path subtracts it from the decision's time to export
    /// the time region-node adds around its Redis call.
    pub round_trip: std::time::Duration,
}

/// Why a reply could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The call reached Redis after its deadline and did nothing.
    #[error("the call reached Redis after its deadline (at Redis time {now_ms} ms)")]
    Expired { now_ms: i64 },
    /// A check built for another day than Redis' clock says: it did
    /// nothing, and is to be sent again for Redis' day.
    #[error("the check was made for day {sent} but Redis' clock says {now_ms} ms (another day)")]
    OtherDay { sent: u32, now_ms: i64 },
    #[error("decision script reply: {0}")]
    Malformed(String),
}

/// Items of the reply before its tiers (the script documents them 1-based):
/// outcome, now_ms, own P, own N, raised, the op's units, epoch.
const HEADER: usize = 7;

/// Whether the script reports a tier's reset: a window's is the rest of
/// the window, which the node computes from `now_ms`.
fn reset_in_reply(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::TokenBucket | Algorithm::SlidingLog)
}

impl DecideReply {
    /// Parses the reply to `call`: integers in fixed positions and the epoch
    /// at [`HEADER`] − 1, then each tier's remaining (and its reset where
    /// the script reports it), then the retry when denied. What the script
    /// leaves out (a window's reset, the global remaining) is computed from
    /// the call as the script would have.
    pub fn parse(reply: Vec<Value>, call: &DecideCall<'_>) -> Result<DecideReply, ReplyError> {
        let at = |i: usize| {
            reply.get(i).and_then(int).ok_or_else(|| {
                ReplyError::Malformed(format!(
                    "item {} is not an integer: {:?}",
                    i + 1,
                    reply.get(i)
                ))
            })
        };
        let outcome = at(0)?;
        let now_ms = at(1)?;
        if outcome == -2 {
            return Err(ReplyError::Expired { now_ms });
        }
        if outcome == -3 {
            return Err(ReplyError::OtherDay {
                sent: call.day,
                now_ms,
            });
        }
        let k = call.tiers.len();
        let e = call.periods.len();
        let expected = HEADER
            + k
            + e
            + call
                .tiers
                .iter()
                .filter(|t| reset_in_reply(t.limit.algorithm))
                .count()
            + usize::from(outcome != 0);
        if reply.len() != expected {
            return Err(ReplyError::Malformed(format!(
                "{} items, expected {expected} for a call of {k} tiers (outcome {outcome})",
                reply.len()
            )));
        }
        let denied = match outcome {
            0 => None,
            -1 => Some(Denied::Global),
            i if i > 0 && (i as usize) <= k => Some(Denied::Tier(i as usize - 1)),
            i if i <= -4 && ((-i - 3) as usize) <= e => Some(Denied::Period((-i - 4) as usize)),
            other => return Err(ReplyError::Malformed(format!("outcome {other}"))),
        };
        let mut next = HEADER;
        let mut tiers = Vec::with_capacity(k);
        for tier in &call.tiers {
            let remaining = at(next)?.max(0) as u64;
            next += 1;
            let reset_ms = if reset_in_reply(tier.limit.algorithm) {
                let reset = at(next)?.max(0) as u64;
                next += 1;
                reset
            } else {
                let w = tier.limit.window_ms.max(1);
                w - (now_ms.max(0) as u64) % w
            };
            tiers.push(TierReply {
                remaining,
                reset_ms,
            });
        }
        let mut periods_remaining = Vec::with_capacity(e);
        for _ in 0..e {
            periods_remaining.push(at(next)?.max(0) as u64);
            next += 1;
        }
        let retry = if outcome != 0 { at(next)? } else { 0 };
        let unsigned = |i: usize| at(i).map(|v| v.max(0) as u64);
        let (own_p, own_n, raised) = (unsigned(2)?, unsigned(3)?, unsigned(4)?);
        let units = at(5)?;
        let mut reply = reply;
        let epoch = text(std::mem::replace(&mut reply[HEADER - 1], Value::Nil));
        let day = (now_ms.max(0) as u64 / (SECS_PER_DAY * 1000)) as u32;
        let global_remaining = global_remaining(call, day, own_p, own_n, &epoch);
        let (refunded, granted) = match call.op {
            Op::Check => (0, units.max(0) as u64),
            Op::Refund => (units.max(0) as u64, 0),
            Op::Peek => (0, 0),
        };
        Ok(DecideReply {
            allowed: denied.is_none(),
            denied,
            retry_ms: (retry >= 0).then_some(retry as u64),
            now_ms,
            tiers,
            own_p,
            own_n,
            epoch,
            day,
            global_remaining,
            periods_remaining,
            periods_end_ms: periods_end_ms(call),
            raised,
            refunded,
            duplicate: call.op == Op::Refund && units == -1,
            expired: call.op == Op::Refund && units == -2,
            granted,
            round_trip: std::time::Duration::ZERO,
        })
    }
}

/// When the first of `call`'s other periods ends, ms (`None`: it has none).
pub fn periods_end_ms(call: &DecideCall<'_>) -> Option<u64> {
    call.periods
        .iter()
        .map(|x| x.period.end_ms().max(0) as u64)
        .min()
}

/// What the global tier leaves this region after the call, as the script
/// computes it: the limit less the other actors' broadcast spend (the
/// broadcast total less this actor's part in it when Redis' day is the
/// call's; all of it otherwise) and this actor's count in Redis
/// (`own_p − own_n`, after the call), within `own_cap` when the view is
/// stale. `None`: no global tier.
fn global_remaining(
    call: &DecideCall<'_>,
    day: u32,
    own_p: u64,
    own_n: u64,
    epoch: &str,
) -> Option<u64> {
    let g = call.global.as_ref().filter(|g| g.limit > 0)?;
    let own = i128::from(own_p) - i128::from(own_n);
    // The script takes the last part of the epoch, as it reads them in
    // order; on another day it reads none.
    let mine = if day == call.day {
        g.own_parts
            .iter()
            .rev()
            .find(|(e, _, _)| e == epoch)
            .map_or(0, |(_, p, n)| i128::from(*p) - i128::from(*n))
    } else {
        0
    };
    let others = (i128::from(g.broadcast_total) - mine).max(0);
    let mut remaining = i128::from(g.limit) - others - own;
    if let Some(cap) = g.own_cap {
        remaining = remaining.min(i128::from(cap) - own);
    }
    Some(remaining.clamp(0, i128::from(u64::MAX)) as u64)
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// Takes the value out (no copy of a bulk string that is valid UTF-8).
fn text(v: Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8(b)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
        Value::SimpleString(s) => s,
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::BulkString(x.as_bytes().to_vec())
    }

    /// A reply as `decide.lua` lays it out: the header before the epoch,
    /// the epoch, then the tiers' items and the retry.
    fn reply(header: [i64; 6], epoch: &str, rest: &[i64]) -> Vec<Value> {
        let mut v: Vec<Value> = header.iter().map(|i| Value::Int(*i)).collect();
        v.push(s(epoch));
        v.extend(rest.iter().map(|i| Value::Int(*i)));
        v
    }

    const FIXED: Limit = Limit {
        algorithm: Algorithm::FixedWindow,
        limit: 10,
        window_ms: 1000,
        burst: 10,
    };
    const LOG: Limit = Limit {
        algorithm: Algorithm::SlidingLog,
        ..FIXED
    };

    /// A check of a node fixed window and a region sliding log, with a
    /// global limit of 100 of which the broadcast has 40 spent, 8 of them
    /// by this region's actor `e1`.
    fn call(op: Op, day: u32) -> DecideCall<'static> {
        DecideCall {
            op,
            tenant: "acme",
            node_id: "n1",
            cost: 2,
            tiers: vec![
                TierCall {
                    scope: Scope::Node,
                    rule: "_",
                    key: "_",
                    limit: &FIXED,
                    cost: 2,
                },
                TierCall {
                    scope: Scope::Region,
                    rule: "_",
                    key: "GET/x",
                    limit: &LOG,
                    cost: 3,
                },
            ],
            periods: Vec::new(),
            expected_nodes: 1,
            global: Some(GlobalArgs {
                limit: 100,
                broadcast_total: 40,
                own_cap: None,
                own_parts: vec![("e1".into(), 9, 1)],
                urgent_at: Some(30),
            }),
            epoch_candidate: "cand",
            day,
            now_ms: 0,
            counter_ttl_secs: 259_200,
            relaxed_ms: 2000,
            refund: None,
            lease: None,
        }
    }

    const NOW: i64 = 1_700_000_000_250;
    const DAY: u32 = 19_675;

    #[test]
    fn a_denial_parses_from_its_positions() {
        // outcome (tier 2), now_ms, p, n, raised, the op's units; the
        // fixed window's remaining; the log's remaining and reset; retry
        let check = call(Op::Check, DAY);
        let r = DecideReply::parse(reply([2, NOW, 7, 1, 0, 0], "e1", &[4, 0, 900, 250]), &check)
            .unwrap();
        assert!(!r.allowed);
        assert_eq!(r.denied, Some(Denied::Tier(1)), "1-based on the wire");
        assert_eq!(r.retry_ms, Some(250));
        assert_eq!(r.now_ms, NOW);
        assert_eq!(
            r.tiers,
            [
                TierReply {
                    remaining: 4,
                    reset_ms: 750
                },
                TierReply {
                    remaining: 0,
                    reset_ms: 900
                }
            ],
            "a window's reset is the rest of the window at Redis' now_ms"
        );
        assert_eq!(
            (r.own_p, r.own_n, r.epoch.as_str(), r.day),
            (7, 1, "e1", DAY),
            "the day is Redis' now_ms in UTC days"
        );
        assert_eq!(r.raised, 0);
        assert_eq!(
            r.global_remaining,
            Some(100 - (40 - 8) - 6),
            "the limit less the others' broadcast spend and this actor's count"
        );
    }

    #[test]
    fn the_global_remaining_is_computed_as_the_script_would() {
        let allowed = |c: &DecideCall<'_>, epoch: &str| {
            DecideReply::parse(reply([0, NOW, 7, 1, 0, 0], epoch, &[4, 5, 900]), c)
                .unwrap()
                .global_remaining
        };
        let mut c = call(Op::Check, DAY);
        assert_eq!(allowed(&c, "e1"), Some(62));
        assert_eq!(
            allowed(&c, "e2"),
            Some(100 - 40 - 6),
            "a new actor has no part in the broadcast: all of it is others'"
        );
        c.global.as_mut().unwrap().own_cap = Some(10);
        assert_eq!(allowed(&c, "e1"), Some(4), "within the cap of a stale view");
        c.global.as_mut().unwrap().own_cap = Some(3);
        assert_eq!(allowed(&c, "e1"), Some(0), "never below zero");
        let other_day = call(Op::Peek, DAY + 1);
        assert_eq!(
            allowed(&other_day, "e1"),
            Some(100 - 40 - 6),
            "Redis' day is not the call's: no part is this actor's, the whole total is others'"
        );
        let mut no_global = call(Op::Check, DAY);
        no_global.global.as_mut().unwrap().limit = 0;
        assert_eq!(allowed(&no_global, "e1"), None);
    }

    #[test]
    fn the_ops_units_are_a_lease_or_a_refund() {
        let check = call(Op::Check, DAY);
        let r = DecideReply::parse(reply([0, NOW, 9, 2, 4, 6], "e", &[5, 3, 800]), &check).unwrap();
        assert!(r.allowed && r.denied.is_none() && !r.duplicate);
        assert_eq!((r.raised, r.refunded, r.granted), (4, 0, 6));
        assert_eq!(r.retry_ms, Some(0), "no retry item when allowed");
        let refund = call(Op::Refund, DAY);
        let r =
            DecideReply::parse(reply([0, NOW, 9, 2, 0, 3], "e", &[5, 3, 800]), &refund).unwrap();
        assert_eq!((r.refunded, r.granted, r.duplicate), (3, 0, false));
        let r =
            DecideReply::parse(reply([0, NOW, 9, 2, 0, -1], "e", &[5, 3, 800]), &refund).unwrap();
        assert!(r.duplicate && r.refunded == 0, "-1: a used handle");
    }

    #[test]
    fn never_is_a_negative_retry_and_expired_is_an_error() {
        let c = call(Op::Check, DAY);
        let r = DecideReply::parse(reply([-1, NOW, 0, 0, 0, 0], "", &[1, 2, 3, -1]), &c).unwrap();
        assert_eq!((r.denied, r.retry_ms), (Some(Denied::Global), None));
        assert_eq!(
            DecideReply::parse(vec![Value::Int(-2), Value::Int(5)], &c),
            Err(ReplyError::Expired { now_ms: 5 })
        );
        assert!(
            matches!(DecideReply::parse(reply([3, NOW, 0, 0, 0, 0], "", &[1, 2, 3, 9]), &c), Err(ReplyError::Malformed(m)) if m.contains("outcome 3")),
            "a denied tier the call does not have"
        );
    }

    #[test]
    fn a_reply_of_another_layout_is_refused() {
        let c = call(Op::Check, DAY);
        // The name/value pairs of an old script.
        let named = vec![
            s("allowed"),
            Value::Int(1),
            s("denied"),
            s(""),
            s("now_ms"),
            Value::Int(5),
        ];
        assert!(matches!(
            DecideReply::parse(named, &c),
            Err(ReplyError::Malformed(_))
        ));
        // Layout 4: its version first, then 9 integers and the epoch.
        let mut v4: Vec<Value> = [4, 0, 0, NOW, 7, 1, 0, 0, 0, 50]
            .iter()
            .map(|i| Value::Int(*i))
            .collect();
        v4.push(s("e"));
        v4.extend([4, 750, 0, 900].map(Value::Int));
        assert!(matches!(
            DecideReply::parse(v4, &c),
            Err(ReplyError::Malformed(_))
        ));
        let no_log_reset = reply([0, NOW, 0, 0, 0, 0], "e", &[1, 2]);
        assert!(matches!(
            DecideReply::parse(no_log_reset, &c),
            Err(ReplyError::Malformed(m)) if m.contains("expected 10")
        ));
    }

    #[test]
    fn encode_lays_out_keys_and_argv_as_the_script_reads_them() {
        let call = call(Op::Check, 20_000);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg("sha");
        encode(&mut cmd, &call, 77);
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => b"<cursor>".to_vec(),
            })
            .collect();
        let hash = keys::tenant_hash("acme");
        let dirty = keys::dirty(keys::bucket_of("acme"));
        let log_key = keys::tier_key("acme", "r:_:4", "GET/x");
        let words: Vec<String> = args
            .iter()
            .enumerate()
            .map(|(i, a)| {
                if i == 10 {
                    "<numbers>".into()
                } else {
                    String::from_utf8_lossy(a).into_owned()
                }
            })
            .collect();
        let expect = [
            "EVALSHA",
            "sha",
            "3",
            &hash,
            &dirty,
            &log_key, // keys
            "check",
            "acme",
            "g:20000:",
            "cand",
            "<numbers>",
            "n:n1:_:1:", // the node tier's prefix in the hash
            "-",         // the region tier is in KEYS[3]
            "e1",        // the epoch of the own part
        ];
        assert_eq!(words, expect);
        #[rustfmt::skip]
        let numbers = [
            77.0, 20_000.0, 259_200.0, // deadline, day, TTL
            100.0, 2.0, 40.0, -1.0, 30.0, // global: limit, cost, broadcast, cap, urgent_at
            2000.0, // relaxed
            0.0, 1.0, 0.0, // a check's lease: none
            2.0, // K
            0.0, // E: no other period
            0.0, 1.0, 10.0, 1000.0, 2.0, 0.0, // node tier: in the hash, fixed window
            3.0, 4.0, 10.0, 1000.0, 3.0, 0.0, // region tier: KEYS[3], sliding log
            9.0, 1.0, // the own part's P and N
        ];
        assert_eq!(unpack_numbers(&args[10]), numbers);
        assert_eq!(call.slot(), keys::cluster_slot(log_key.as_bytes()));
    }
}
