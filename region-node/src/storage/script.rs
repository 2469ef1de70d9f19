//! The typed interface of the decision script (`lua/decide.lua`): what a
//! call carries ([`DecideCall`]), how it is laid out as KEYS and ARGV
//! ([`encode`]), and what comes back ([`DecideReply`], in fixed positions
//! behind a layout version).
//!
//! Everything that knows the script's argument positions is in this module,
//! so the decision path, the `local` fail mode, the load generator and the
//! script tests all speak in named fields. The reply is a list in fixed
//! positions whose first item is its layout version, so a reader of another
//! layout fails loudly instead of misreading a number. (It used to be
//! name/value pairs; Redis converts a reply item by item, and the names cost
//! as much as the values.) Nodes of two releases sharing a Redis each run
//! their own script by its SHA1 and read its own reply; the script's storage
//! layout is what they share.

use redis::Value;

use tierlimit_shared::config::{Algorithm, Limit};
use tierlimit_shared::day::SECS_PER_DAY;
use tierlimit_shared::keys;

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

/// The charge a refund by handle gives back (see `crate::refund`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundOf {
    /// Unique per charge: a handle's second use gives nothing back.
    pub id: String,
    /// Redis' clock when the charge ran, ms.
    pub charged_at_ms: u64,
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

/// How big a lease a check may take: at most `max` units beyond its cost,
/// and at most 1/`share` of what every tier and the global budget leave
/// after it (so near the limit the lease shrinks to nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAsk {
    pub max: u64,
    pub share: u64,
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
    let mut n = Numbers::with_capacity(12 + 6 * call.tiers.len() + 2 * parts.len());
    n.push(deadline_ms as f64);
    n.int(u64::from(call.day));
    n.int(call.counter_ttl_secs);
    n.int(g.map_or(0, |g| g.limit));
    n.int(call.cost);
    n.int(g.map_or(0, |g| g.broadcast_total));
    n.or_minus_one(g.and_then(|g| g.own_cap));
    n.or_minus_one(g.and_then(|g| g.urgent_at));
    n.int(call.relaxed_ms);
    // The op's own two numbers: a check's lease, a refund's handle, a
    // peek's zeros.
    match call.op {
        Op::Check => match call.lease {
            Some(l) => {
                n.int(l.max);
                n.int(l.share.max(1));
            }
            None => {
                n.int(0);
                n.int(1);
            }
        },
        Op::Refund => match refund {
            Some(r) => {
                n.int(3 + outside.len() as u64);
                n.int(r.charged_at_ms);
            }
            None => {
                n.int(0);
                n.int(0);
            }
        },
        Op::Peek => {
            n.int(0);
            n.int(0);
        }
    }
    n.int(call.tiers.len() as u64);
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
    for (_, p, nn) in parts {
        n.int(*p);
        n.int(*nn);
    }

    cmd.arg(call.op.name())
        .arg(t)
        .arg(call.day)
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
    if call.op == Op::Refund {
        cmd.arg(refund.map_or("-", |r| r.id.as_str()));
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
    Global,
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
    /// Units the rollback check added to P: Redis held less than the
    /// aggregator already had from this actor.
    pub raised: u64,
    /// Units a refund gave back to the region's PN counter.
    pub refunded: u64,
    /// A refund by handle that was used already: nothing given back.
    pub duplicate: bool,
    /// Units of lease charged beyond the check's cost (every tier and the
    /// PN counter alike).
    pub granted: u64,
}

/// Why a reply could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The call reached Redis after its deadline and did nothing.
    #[error("the call reached Redis after its deadline (at Redis time {now_ms} ms)")]
    Expired { now_ms: i64 },
    #[error("decision script reply: {0}")]
    Malformed(String),
}

/// The reply layout `decide.lua` writes in its first position. A reply of
/// another layout (an older script under the same SHA cannot happen, but a
/// hand-loaded one can) is refused instead of misread.
pub const REPLY_LAYOUT: i64 = 4;

/// Positions of the reply (0-based; the script documents them 1-based).
const HEADER: usize = 11;

impl DecideReply {
    /// Parses the script's reply: integers in fixed positions, the epoch at
    /// [`HEADER`] − 1, then two integers per tier. Positions, not names:
    /// Redis converts a script's reply element by element, and the names
    /// doubled that cost (BENCHMARKS.md, "Where the decision script's
    /// instructions go"); the version in the first position keeps a reply
    /// of another layout from being misread.
    pub fn parse(reply: Vec<Value>) -> Result<DecideReply, ReplyError> {
        if reply.len() < HEADER || !(reply.len() - HEADER).is_multiple_of(2) {
            return Err(ReplyError::Malformed(format!(
                "{} items, expected {HEADER} + 2 per tier",
                reply.len()
            )));
        }
        let at = |i: usize| {
            int(&reply[i]).ok_or_else(|| {
                ReplyError::Malformed(format!("item {} is not an integer: {:?}", i + 1, reply[i]))
            })
        };
        let layout = at(0)?;
        if layout != REPLY_LAYOUT {
            return Err(ReplyError::Malformed(format!(
                "reply layout {layout}, expected {REPLY_LAYOUT}"
            )));
        }
        let now_ms = at(3)?;
        let denied = match at(1)? {
            0 => None,
            -1 => Some(Denied::Global),
            -2 => return Err(ReplyError::Expired { now_ms }),
            i if i > 0 && (i as usize) <= (reply.len() - HEADER) / 2 => {
                Some(Denied::Tier(i as usize - 1))
            }
            other => return Err(ReplyError::Malformed(format!("outcome {other}"))),
        };
        let tiers = (HEADER..reply.len())
            .step_by(2)
            .map(|i| {
                Ok(TierReply {
                    remaining: at(i)?.max(0) as u64,
                    reset_ms: at(i + 1)?.max(0) as u64,
                })
            })
            .collect::<Result<_, ReplyError>>()?;
        let retry = at(2)?;
        let global = at(9)?;
        let unsigned = |i: usize| at(i).map(|v| v.max(0) as u64);
        let (own_p, own_n, raised, granted) =
            (unsigned(4)?, unsigned(5)?, unsigned(6)?, unsigned(8)?);
        let refunded = at(7)?;
        let mut reply = reply;
        let epoch = text(std::mem::replace(&mut reply[HEADER - 1], Value::Nil));
        Ok(DecideReply {
            allowed: denied.is_none(),
            denied,
            retry_ms: (retry >= 0).then_some(retry as u64),
            now_ms,
            tiers,
            own_p,
            own_n,
            epoch,
            day: (now_ms.max(0) as u64 / (SECS_PER_DAY * 1000)) as u32,
            global_remaining: (global >= 0).then_some(global as u64),
            raised,
            refunded: refunded.max(0) as u64,
            duplicate: refunded == -1,
            granted,
        })
    }
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

    /// A reply as `decide.lua` lays it out: the header, then two integers
    /// per tier.
    fn reply(header: [i64; 10], epoch: &str, tiers: &[i64]) -> Vec<Value> {
        let mut v: Vec<Value> = header.iter().map(|i| Value::Int(*i)).collect();
        v.push(s(epoch));
        v.extend(tiers.iter().map(|i| Value::Int(*i)));
        v
    }

    #[test]
    fn a_denial_parses_from_its_positions() {
        // layout, outcome (tier 2), retry, now_ms, p, n, raised, refunded,
        // granted, global (-1 none)
        let now = 1_700_000_000_000;
        let header = [4, 2, 250, now, 7, 1, 0, 0, 0, -1];
        let r = DecideReply::parse(reply(header, "abc", &[4, 100, 0, 900])).unwrap();
        assert!(!r.allowed);
        assert_eq!(r.denied, Some(Denied::Tier(1)), "1-based on the wire");
        assert_eq!(r.retry_ms, Some(250));
        assert_eq!(r.now_ms, 1_700_000_000_000);
        assert_eq!(
            r.tiers,
            [
                TierReply {
                    remaining: 4,
                    reset_ms: 100
                },
                TierReply {
                    remaining: 0,
                    reset_ms: 900
                }
            ]
        );
        assert_eq!(
            (r.own_p, r.own_n, r.epoch.as_str(), r.day),
            (7, 1, "abc", 19_675),
            "the day is Redis' now_ms in UTC days"
        );
        assert_eq!((r.global_remaining, r.raised), (None, 0));

        let header = [4, 0, 0, 5, 9, 2, 4, 3, 6, 17];
        let r = DecideReply::parse(reply(header, "e", &[])).unwrap();
        assert!(r.allowed && r.denied.is_none() && !r.duplicate);
        assert_eq!(
            (r.raised, r.refunded, r.granted, r.global_remaining),
            (4, 3, 6, Some(17))
        );
        let header = [4, 0, 0, 5, 9, 2, 0, -1, 0, 17];
        let r = DecideReply::parse(reply(header, "e", &[])).unwrap();
        assert!(
            r.allowed && r.duplicate && r.refunded == 0,
            "-1: a used handle"
        );
    }

    #[test]
    fn never_is_a_negative_retry_and_expired_is_an_error() {
        let mut header = [4, -1, -1, 5, 0, 0, 0, 0, 0, 0];
        let r = DecideReply::parse(reply(header, "", &[])).unwrap();
        assert_eq!((r.denied, r.retry_ms), (Some(Denied::Global), None));
        header[1] = -2;
        assert_eq!(
            DecideReply::parse(reply(header, "", &[])),
            Err(ReplyError::Expired { now_ms: 5 })
        );
        header[1] = 3;
        assert!(
            matches!(DecideReply::parse(reply(header, "", &[1, 2])), Err(ReplyError::Malformed(m)) if m.contains("outcome 3")),
            "a denied tier the call does not have"
        );
    }

    #[test]
    fn a_reply_of_another_layout_is_refused() {
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
            DecideReply::parse(named),
            Err(ReplyError::Malformed(_))
        ));
        // Layout 3 (15 header items) read as 4 would shift every number.
        let mut v3: Vec<Value> = [3, 1, 0, 0, 0, 5, 0, 0, 1, 0, 0, 0, 0, -1]
            .iter()
            .map(|i| Value::Int(*i))
            .collect();
        v3.push(s("e"));
        assert!(matches!(
            DecideReply::parse(v3),
            Err(ReplyError::Malformed(m)) if m.contains("layout 3")
        ));
        let odd_tiers = reply([4, 0, 0, 5, 0, 0, 0, 0, 0, -1], "e", &[1]);
        assert!(matches!(
            DecideReply::parse(odd_tiers),
            Err(ReplyError::Malformed(_))
        ));
    }

    #[test]
    fn encode_lays_out_keys_and_argv_as_the_script_reads_them() {
        let fixed = Limit {
            algorithm: tierlimit_shared::config::Algorithm::FixedWindow,
            limit: 10,
            window_ms: 1000,
            burst: 10,
        };
        let log = Limit {
            algorithm: tierlimit_shared::config::Algorithm::SlidingLog,
            ..fixed.clone()
        };
        let call = DecideCall {
            op: Op::Check,
            tenant: "acme",
            node_id: "n1",
            cost: 2,
            tiers: vec![
                TierCall {
                    scope: Scope::Node,
                    rule: "_",
                    key: "_",
                    limit: &fixed,
                    cost: 2,
                },
                TierCall {
                    scope: Scope::Region,
                    rule: "_",
                    key: "GET/x",
                    limit: &log,
                    cost: 3,
                },
            ],
            expected_nodes: 1,
            global: Some(GlobalArgs {
                limit: 100,
                broadcast_total: 40,
                own_cap: None,
                own_parts: vec![("e1".into(), 9, 1)],
                urgent_at: Some(30),
            }),
            epoch_candidate: "cand",
            day: 20_000,
            now_ms: 0,
            counter_ttl_secs: 259_200,
            relaxed_ms: 2000,
            refund: None,
            lease: None,
        };
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
            "20000",
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
            0.0, 1.0, // a check's lease: none
            2.0, // K
            0.0, 1.0, 10.0, 1000.0, 2.0, 0.0, // node tier: in the hash, fixed window
            3.0, 4.0, 10.0, 1000.0, 3.0, 0.0, // region tier: KEYS[3], sliding log
            9.0, 1.0, // the own part's P and N
        ];
        assert_eq!(unpack_numbers(&args[10]), numbers);
        assert_eq!(call.slot(), keys::cluster_slot(log_key.as_bytes()));
    }
}
