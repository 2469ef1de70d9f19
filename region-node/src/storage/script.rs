//! The typed interface of the decision script (`lua/decide.lua`): what a
//! call carries ([`DecideCall`]), how it is laid out as KEYS and ARGV
//! ([`encode`]), and what comes back ([`DecideReply`], parsed by field name).
//!
//! Everything that knows the script's argument positions is in this module,
//! so the decision path, the `local` fail mode, the load generator and the
//! script tests all speak in named fields. The reply is a flat list of
//! name/value pairs rather than positions: a field added to the script does
//! not shift the others, and a reader of an older layout fails loudly
//! (`missing field`) instead of misreading a number.

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
pub fn encode(cmd: &mut redis::Cmd, call: &DecideCall<'_>, deadline_ms: i64) {
    let t = call.tenant;
    let bucket = keys::bucket_of(t);
    let outside: Vec<(usize, String)> = call
        .tiers
        .iter()
        .enumerate()
        .filter(|(_, tier)| !tier.in_tenant_hash())
        .map(|(i, tier)| (i, keys::tier_key(t, &tier.tier_id(call.node_id), tier.key)))
        .collect();
    let refund = call.refund.as_ref().filter(|_| call.op == Op::Refund);
    cmd.arg(2 + outside.len() + usize::from(refund.is_some()))
        .arg(keys::tenant_hash(t))
        .arg(keys::dirty(bucket));
    for (_, k) in &outside {
        cmd.arg(k);
    }
    if let Some(r) = refund {
        cmd.arg(keys::refund_record(t, r.day()));
    }
    let g = call.global.as_ref();
    cmd.arg(call.op.name())
        .arg(deadline_ms)
        .arg(t)
        .arg(call.day)
        .arg(call.epoch_candidate)
        .arg(call.counter_ttl_secs)
        .arg(g.map_or(0, |g| g.limit))
        .arg(call.cost)
        .arg(g.map_or(0, |g| g.broadcast_total));
    match g.and_then(|g| g.own_cap) {
        Some(c) => cmd.arg(c),
        None => cmd.arg(-1i64),
    };
    match g.and_then(|g| g.urgent_at) {
        Some(u) => cmd.arg(u),
        None => cmd.arg(-1i64),
    };
    cmd.arg(call.relaxed_ms);
    match refund {
        Some(r) => cmd.arg(3 + outside.len()).arg(&r.id).arg(r.charged_at_ms),
        // No empty arguments: a tool that splits the command on spaces
        // (redis-benchmark in scripts/bench) would drop them.
        None => cmd.arg(0u8).arg("-").arg(0u8),
    };
    match call.lease.filter(|_| call.op == Op::Check) {
        Some(l) => cmd.arg(l.max).arg(l.share.max(1)),
        None => cmd.arg(0u8).arg(1u8),
    };
    cmd.arg(call.tiers.len());
    let mut next_key = 3;
    for (i, tier) in call.tiers.iter().enumerate() {
        let l = tier.limit;
        if outside.iter().any(|(j, _)| *j == i) {
            cmd.arg(next_key).arg("-");
            next_key += 1;
        } else {
            let mut prefix = tier.tier_id(call.node_id);
            prefix.push(':');
            cmd.arg(0u8).arg(prefix);
        }
        cmd.arg(l.algorithm.code())
            .arg(l.limit)
            .arg(l.window_ms)
            .arg(l.burst)
            .arg(tier.cost);
    }
    if let Some(g) = g {
        for (epoch, p, n) in &g.own_parts {
            cmd.arg(epoch).arg(p).arg(n);
        }
    }
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

impl DecideReply {
    /// Parses the script's name/value list.
    pub fn parse(reply: Vec<Value>) -> Result<DecideReply, ReplyError> {
        if !reply.len().is_multiple_of(2) {
            return Err(ReplyError::Malformed(format!(
                "odd number of items ({})",
                reply.len()
            )));
        }
        let mut f = Fields::default();
        let mut it = reply.into_iter();
        while let (Some(name), Some(value)) = (it.next(), it.next()) {
            let name = match name {
                Value::BulkString(b) => b,
                Value::SimpleString(s) => s.into_bytes(),
                other => return Err(ReplyError::Malformed(format!("field name {other:?}"))),
            };
            f.set(&name, value)?;
        }
        f.finish()
    }
}

/// The fields as they arrive, before the required ones are checked.
#[derive(Default)]
struct Fields {
    allowed: Option<i64>,
    denied: Option<String>,
    denied_tier: Option<i64>,
    retry_ms: Option<i64>,
    now_ms: Option<i64>,
    tiers: Option<Vec<i64>>,
    own_p: Option<i64>,
    own_n: Option<i64>,
    epoch: Option<String>,
    day: Option<i64>,
    global_remaining: Option<i64>,
    raised: Option<i64>,
    refunded: Option<i64>,
    duplicate: Option<i64>,
    granted: Option<i64>,
}

impl Fields {
    fn set(&mut self, name: &[u8], v: Value) -> Result<(), ReplyError> {
        let bad = |v: &Value| {
            ReplyError::Malformed(format!(
                "{} is not an integer: {v:?}",
                String::from_utf8_lossy(name)
            ))
        };
        let slot = match name {
            b"allowed" => &mut self.allowed,
            b"denied_tier" => &mut self.denied_tier,
            b"retry_ms" => &mut self.retry_ms,
            b"now_ms" => &mut self.now_ms,
            b"own_p" => &mut self.own_p,
            b"own_n" => &mut self.own_n,
            b"day" => &mut self.day,
            b"global_remaining" => &mut self.global_remaining,
            b"raised" => &mut self.raised,
            b"refunded" => &mut self.refunded,
            b"duplicate" => &mut self.duplicate,
            b"granted" => &mut self.granted,
            b"denied" => {
                self.denied = Some(text(v));
                return Ok(());
            }
            b"epoch" => {
                self.epoch = Some(text(v));
                return Ok(());
            }
            b"tiers" => {
                let Value::Array(items) = v else {
                    return Err(ReplyError::Malformed(format!("tiers is not a list: {v:?}")));
                };
                let values = items
                    .iter()
                    .map(|i| int(i).ok_or_else(|| bad(i)))
                    .collect::<Result<_, _>>()?;
                self.tiers = Some(values);
                return Ok(());
            }
            // A field of a newer script: ignored, so nodes of both
            // versions can share a Redis during a rolling upgrade.
            _ => return Ok(()),
        };
        *slot = Some(int(&v).ok_or_else(|| bad(&v))?);
        Ok(())
    }

    fn finish(self) -> Result<DecideReply, ReplyError> {
        let need = |v: Option<i64>, name: &str| {
            v.ok_or_else(|| ReplyError::Malformed(format!("missing field {name}")))
        };
        let now_ms = need(self.now_ms, "now_ms")?;
        let denied = match self.denied.as_deref() {
            Some("") => None,
            Some("tier") => {
                let i = need(self.denied_tier, "denied_tier")?;
                if i < 1 {
                    return Err(ReplyError::Malformed(format!("denied_tier = {i}")));
                }
                Some(Denied::Tier(i as usize - 1))
            }
            Some("global") => Some(Denied::Global),
            Some("expired") => return Err(ReplyError::Expired { now_ms }),
            Some(other) => return Err(ReplyError::Malformed(format!("denied = {other:?}"))),
            None => return Err(ReplyError::Malformed("missing field denied".into())),
        };
        let tiers = self
            .tiers
            .ok_or_else(|| ReplyError::Malformed("missing field tiers".into()))?
            .chunks(2)
            .map(|c| TierReply {
                remaining: c[0].max(0) as u64,
                reset_ms: c.get(1).copied().unwrap_or(0).max(0) as u64,
            })
            .collect();
        let retry = need(self.retry_ms, "retry_ms")?;
        Ok(DecideReply {
            allowed: need(self.allowed, "allowed")? == 1,
            denied,
            retry_ms: (retry >= 0).then_some(retry as u64),
            now_ms,
            tiers,
            own_p: need(self.own_p, "own_p")?.max(0) as u64,
            own_n: need(self.own_n, "own_n")?.max(0) as u64,
            epoch: self.epoch.unwrap_or_default(),
            day: need(self.day, "day")?.max(0) as u32,
            global_remaining: self.global_remaining.map(|g| g.max(0) as u64),
            raised: self.raised.unwrap_or(0).max(0) as u64,
            refunded: self.refunded.unwrap_or(0).max(0) as u64,
            duplicate: self.duplicate == Some(1),
            granted: self.granted.unwrap_or(0).max(0) as u64,
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

    fn pairs(items: &[(&str, Value)]) -> Vec<Value> {
        items
            .iter()
            .flat_map(|(k, v)| [Value::BulkString(k.as_bytes().to_vec()), v.clone()])
            .collect()
    }

    fn s(x: &str) -> Value {
        Value::BulkString(x.as_bytes().to_vec())
    }

    #[test]
    fn a_denial_parses_by_name_in_any_order() {
        let r = DecideReply::parse(pairs(&[
            ("denied", s("tier")),
            ("denied_tier", Value::Int(2)),
            ("allowed", Value::Int(0)),
            ("retry_ms", Value::Int(250)),
            ("now_ms", Value::Int(1_700_000_000_000)),
            ("own_p", Value::Int(7)),
            ("own_n", Value::Int(1)),
            ("epoch", s("abc")),
            ("day", Value::Int(20_000)),
            (
                "tiers",
                Value::Array(vec![
                    Value::Int(4),
                    Value::Int(100),
                    Value::Int(0),
                    Value::Int(900),
                ]),
            ),
            ("a_field_of_a_newer_script", Value::Int(3)),
        ]))
        .unwrap();
        assert!(!r.allowed);
        assert_eq!(r.denied, Some(Denied::Tier(1)), "1-based on the wire");
        assert_eq!(r.retry_ms, Some(250));
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
        assert_eq!((r.own_p, r.own_n, r.epoch.as_str()), (7, 1, "abc"));
        assert_eq!((r.global_remaining, r.raised), (None, 0));
    }

    #[test]
    fn never_is_a_negative_retry_and_expired_is_an_error() {
        let mut base = vec![
            ("allowed", Value::Int(0)),
            ("denied", s("global")),
            ("retry_ms", Value::Int(-1)),
            ("now_ms", Value::Int(5)),
            ("own_p", Value::Int(0)),
            ("own_n", Value::Int(0)),
            ("day", Value::Int(1)),
            ("tiers", Value::Array(vec![])),
        ];
        assert_eq!(DecideReply::parse(pairs(&base)).unwrap().retry_ms, None);
        base[1].1 = s("expired");
        assert_eq!(
            DecideReply::parse(pairs(&base)),
            Err(ReplyError::Expired { now_ms: 5 })
        );
    }

    #[test]
    fn a_reply_of_another_layout_is_refused() {
        let positional = vec![Value::Int(1), Value::Int(0), Value::Int(0), Value::Int(5)];
        assert!(matches!(
            DecideReply::parse(positional),
            Err(ReplyError::Malformed(_))
        ));
        let missing = pairs(&[("allowed", Value::Int(1)), ("denied", s(""))]);
        assert!(matches!(
            DecideReply::parse(missing),
            Err(ReplyError::Malformed(m)) if m.contains("now_ms")
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
        let args: Vec<String> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                _ => "<cursor>".into(),
            })
            .collect();
        let hash = keys::tenant_hash("acme");
        let dirty = keys::dirty(keys::bucket_of("acme"));
        let log_key = keys::tier_key("acme", "r:_:4", "GET/x");
        let expect = [
            "EVALSHA",
            "sha",
            "3",
            &hash,
            &dirty,
            &log_key, // keys
            "check",
            "77",
            "acme",
            "20000",
            "cand",
            "259200", // call
            "100",
            "2",
            "40",
            "-1",
            "30",   // global
            "2000", // relaxed
            "0",
            "-",
            "0", // no refund record
            "0",
            "1", // no lease
            "2", // tiers
            "0",
            "n:n1:_:1:",
            "1",
            "10",
            "1000",
            "10",
            "2", // node, in the hash
            "3",
            "-",
            "4",
            "10",
            "1000",
            "10",
            "3", // region, KEYS[3]
            "e1",
            "9",
            "1", // own parts
        ];
        assert_eq!(args, expect);
        assert_eq!(call.slot(), keys::cluster_slot(log_key.as_bytes()));
    }
}
