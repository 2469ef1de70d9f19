//! What is sent and how the answer is read: region-node's check API,
//! a gateway that takes the tenant from a header (Envoy with the ratelimit
//! filter), throttlecrab-server's HTTP API, or a bare `EVALSHA` of
//! `decide.lua`.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::http1::Url;
use crate::stats::Outcome;

/// The decision script, byte for byte the one region-node runs.
pub use region_node::storage::script::DECIDE_LUA;
use region_node::storage::script::{
    self, DecideCall, DecideReply, Denied, GlobalArgs, Op, Scope, TierCall,
};
use tierlimit_shared::config::{Algorithm, Limit};

#[derive(Debug, Clone)]
pub enum Proto {
    /// `POST {path}` `{"tenant": T, "cost": C}` (region-node `/v1/check`).
    Tierlimit { cost: u64, key: Option<String> },
    /// `GET {path}` with the tenant in a request header (`x-tenant` for
    /// Envoy's `request_headers` descriptor action): 200 allowed, 429
    /// denied, anything else an error. No body either way.
    Gateway { header: String },
    /// `POST /throttle` of throttlecrab-server (GCRA per key).
    Throttlecrab {
        burst: u64,
        count_per_period: u64,
        period_s: u64,
        cost: u64,
    },
}

impl Proto {
    /// Writes the whole HTTP/1.1 request for `tenant` into `out`.
    pub fn request(&self, url: &Url, tenant: &str, out: &mut Vec<u8>, body: &mut String) {
        body.clear();
        out.clear();
        match self {
            Proto::Gateway { header } => {
                // Written by hand into the reused buffer, like the others:
                // the generator's cost is taken from the system measured.
                for part in [
                    "GET ",
                    url.path.as_str(),
                    " HTTP/1.1\r\nHost: ",
                    url.host.as_str(),
                    "\r\n",
                    header.as_str(),
                    ": ",
                    tenant,
                    "\r\n\r\n",
                ] {
                    out.extend_from_slice(part.as_bytes());
                }
                return;
            }
            Proto::Tierlimit { cost, key } => {
                let _ = write!(body, r#"{{"tenant":"{tenant}","cost":{cost}"#);
                if let Some(k) = key {
                    let _ = write!(body, r#","key":"{k}""#);
                }
                body.push('}');
            }
            Proto::Throttlecrab {
                burst,
                count_per_period,
                period_s,
                cost,
            } => {
                let _ = write!(
                    body,
                    r#"{{"key":"{tenant}","max_burst":{burst},"count_per_period":{count_per_period},"period":{period_s},"quantity":{cost}}}"#
                );
            }
        }
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            url.path,
            url.host,
            body.len()
        );
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(body.as_bytes());
    }

    pub fn outcome(&self, status: u16, body: &[u8]) -> Outcome {
        match self {
            Proto::Tierlimit { .. } => tierlimit_outcome(status, body),
            Proto::Gateway { .. } => Outcome {
                status,
                allowed: status == 200,
                tier: (status == 429).then_some("gateway"),
                mode: None,
            },
            Proto::Throttlecrab { .. } => {
                #[derive(Deserialize)]
                struct R {
                    allowed: bool,
                }
                match (status, serde_json::from_slice::<R>(body)) {
                    (200, Ok(r)) => Outcome {
                        status,
                        allowed: r.allowed,
                        tier: (!r.allowed).then_some("throttlecrab"),
                        mode: None,
                    },
                    _ => Outcome {
                        status,
                        allowed: false,
                        tier: None,
                        mode: None,
                    },
                }
            }
        }
    }
}

fn tierlimit_outcome(status: u16, body: &[u8]) -> Outcome {
    #[derive(Deserialize)]
    struct R<'a> {
        #[serde(borrow)]
        mode: Option<Cow<'a, str>>,
        #[serde(borrow)]
        denied_by: Option<Cow<'a, str>>,
        #[serde(borrow, rename = "violated-policy")]
        violated: Option<Cow<'a, str>>,
    }
    let r: Option<R> = serde_json::from_slice(body).ok();
    let mode = r.as_ref().and_then(|r| r.mode.as_deref()).map(mode_name);
    match status {
        200 => Outcome {
            status,
            allowed: true,
            tier: None,
            mode,
        },
        429 => {
            let tier = r
                .as_ref()
                .and_then(|r| r.violated.as_deref().or(r.denied_by.as_deref()))
                .map(tier_name)
                .unwrap_or("other");
            Outcome {
                status,
                allowed: false,
                tier: Some(tier),
                mode,
            }
        }
        _ => Outcome {
            status,
            allowed: false,
            tier: None,
            mode,
        },
    }
}

pub fn tier_name(s: &str) -> &'static str {
    match s {
        "node" => "node",
        "region" => "region",
        "global" => "global",
        "store" => "store",
        _ => "other",
    }
}

fn mode_name(s: &str) -> &'static str {
    match s {
        "redis" => "redis",
        "view" => "view",
        "local" => "local",
        "open" => "open",
        _ => "other",
    }
}

/// One windowed tier as `decide.lua` takes it.
#[derive(Debug, Clone, Copy)]
pub struct TierArgs {
    /// 0 = no tier, 1 fixed window, 2 sliding window, 3 token bucket, 4 sliding log.
    pub algorithm: u8,
    pub limit: u64,
    pub window_ms: u64,
    pub burst: u64,
}

impl TierArgs {
    fn limit(self) -> Option<Limit> {
        let algorithm = match self.algorithm {
            1 => Algorithm::FixedWindow,
            2 => Algorithm::SlidingWindow,
            3 => Algorithm::TokenBucket,
            4 => Algorithm::SlidingLog,
            _ => return None,
        };
        Some(Limit {
            algorithm,
            limit: self.limit,
            window_ms: self.window_ms,
            burst: self.burst,
        })
    }
}

/// One `decide.lua` check as region-node makes it, built through
/// region-node's typed script interface (`storage::script`), so the load
/// generator cannot drift from the node's layout.
#[derive(Debug, Clone)]
pub struct ScriptCall {
    pub node_id: String,
    node: Option<Limit>,
    region: Option<Limit>,
    pub global_limit: u64,
    /// Global tiers of other periods (hour, week, month) and their limits.
    pub periods: Vec<(tierlimit_shared::period::PeriodKind, u64)>,
    pub cost: u64,
    /// TTL of the PN counter: (retention_days + 1) days.
    pub ttl_s: u64,
}

impl ScriptCall {
    pub fn new(
        node_id: String,
        node: TierArgs,
        region: TierArgs,
        global_limit: u64,
        cost: u64,
        ttl_s: u64,
    ) -> ScriptCall {
        ScriptCall {
            node_id,
            node: node.limit(),
            region: region.limit(),
            global_limit,
            periods: Vec::new(),
            cost,
            ttl_s,
        }
    }

    /// The UTC day number of now (the day the node computes).
    pub fn today() -> u32 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| (d.as_secs() / 86_400) as u32)
            .unwrap_or(0)
    }

    /// `EVALSHA sha …` of a check of `tenant` on `day`: nothing broadcast
    /// yet, no staleness cap, no deadline.
    pub fn cmd(&self, sha: &str, tenant: &str, day: u32) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha);
        script::encode(&mut cmd, &self.call(tenant, day), 0);
        cmd
    }

    /// The check `cmd` sends.
    fn call<'a>(&'a self, tenant: &'a str, day: u32) -> DecideCall<'a> {
        let tier = |scope, limit| TierCall {
            scope,
            rule: tierlimit_shared::keys::WHOLE_TENANT,
            key: tierlimit_shared::keys::WHOLE_TENANT,
            limit,
            cost: self.cost,
        };
        let tiers = [(Scope::Node, &self.node), (Scope::Region, &self.region)]
            .into_iter()
            .filter_map(|(scope, l)| l.as_ref().map(|l| tier(scope, l)))
            .collect();
        DecideCall {
            op: Op::Check,
            tenant,
            node_id: &self.node_id,
            cost: self.cost,
            tiers,
            expected_nodes: 1,
            global: (self.global_limit > 0).then(|| GlobalArgs {
                limit: self.global_limit,
                ..GlobalArgs::default()
            }),
            // Each period as of now (the caller's clock: Redis' on this
            // machine).
            periods: self
                .periods
                .iter()
                .map(|&(kind, limit)| script::PeriodArgs {
                    period: kind.at(SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64)),
                    limit,
                    broadcast_total: 0,
                    own_cap: None,
                    own_parts: Vec::new(),
                    urgent_at: None,
                })
                .collect(),
            epoch_candidate: "00000000b3c4a001",
            day,
            now_ms: 0,
            counter_ttl_secs: self.ttl_s,
            relaxed_ms: 2000,
            refund: None,
            lease: None,
        }
    }

    /// Reads `decide.lua`'s reply.
    pub fn outcome(&self, v: redis::Value) -> Outcome {
        let has_node = self.node.is_some();
        let reply = match v {
            redis::Value::Array(items) => DecideReply::parse(items, &self.call("", 0)).ok(),
            _ => None,
        };
        match reply {
            Some(r) => Outcome {
                status: 0,
                allowed: r.allowed,
                // Tier 0 is the node tier when there is one (see `cmd`).
                tier: r.denied.map(|d| match d {
                    Denied::Tier(0) if has_node => "node",
                    Denied::Tier(_) => "region",
                    Denied::Global | Denied::Period(_) => "global",
                }),
                mode: Some("redis"),
            },
            None => Outcome {
                status: 0,
                allowed: false,
                tier: None,
                mode: None,
            },
        }
    }
}
