//! What is sent and how the answer is read: region-node's check API,
//! throttlecrab-server's HTTP API, or a bare `EVALSHA` of `decide.lua`.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::http1::Url;
use crate::stats::Outcome;

/// The decision script, byte for byte the one region-node runs.
pub const DECIDE_LUA: &str = include_str!("../../region-node/src/lua/decide.lua");

#[derive(Debug, Clone)]
pub enum Proto {
    /// `POST {path}` `{"tenant": T, "cost": C}` (region-node `/v1/check`).
    Tierlimit { cost: u64, key: Option<String> },
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
        match self {
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
        out.clear();
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

/// KEYS and ARGV of one `decide.lua` check, laid out exactly as
/// region-node's `Decider::script_call` does (see the script's header).
#[derive(Debug, Clone)]
pub struct ScriptCall {
    pub node_id: String,
    pub node: TierArgs,
    pub region: TierArgs,
    pub global_limit: u64,
    pub cost: u64,
    /// TTL of the PN counter: (retention_days + 1) days.
    pub ttl_s: u64,
}

impl ScriptCall {
    /// The UTC day number of now (what the node passes as ARGV[16]).
    pub fn today() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() / 86_400)
            .unwrap_or(0)
    }

    /// `(keys, args)` for a check of `tenant` on `day`.
    pub fn keys_args(&self, tenant: &str, day: u64) -> (Vec<String>, Vec<String>) {
        let keys = vec![
            format!(
                "tl:{{{tenant}}}:n:{}:_:{}",
                self.node_id, self.node.algorithm
            ),
            format!("tl:{{{tenant}}}:r:_:{}", self.region.algorithm),
            "tl:dirty".to_string(),
            format!("tl:{{{tenant}}}:g:{}", day.saturating_sub(1)),
            format!("tl:{{{tenant}}}:g:{day}"),
            format!("tl:{{{tenant}}}:g:{}", day + 1),
        ];
        let mut args = vec!["check".to_string(), self.cost.to_string()];
        for t in [self.node, self.region] {
            if t.algorithm == 0 {
                args.extend(["0", "0", "0", "0"].map(String::from));
            } else {
                args.extend(
                    [t.algorithm as u64, t.limit, t.window_ms, t.burst].map(|v| v.to_string()),
                );
            }
        }
        args.push(self.global_limit.to_string());
        args.push("0".into()); // broadcast total: nothing seen yet
        args.push("-1".into()); // no staleness cap
        args.push("00000000b3c4a001".into()); // epoch candidate
        args.push(tenant.to_string());
        args.push(day.to_string());
        args.push(self.ttl_s.to_string());
        (keys, args)
    }

    /// Reads `decide.lua`'s reply: `{allowed, denied_tier, ...}`.
    pub fn outcome(v: &redis::Value) -> Outcome {
        let int = |v: Option<&redis::Value>| match v {
            Some(redis::Value::Int(i)) => *i,
            _ => -1,
        };
        match v {
            redis::Value::Array(items) => {
                let allowed = int(items.first()) == 1;
                let tier = match int(items.get(1)) {
                    0 => None,
                    1 => Some("node"),
                    2 => Some("region"),
                    3 => Some("global"),
                    _ => Some("other"),
                };
                Outcome {
                    status: 0,
                    allowed,
                    tier: if allowed {
                        None
                    } else {
                        tier.or(Some("other"))
                    },
                    mode: Some("redis"),
                }
            }
            _ => Outcome {
                status: 0,
                allowed: false,
                tier: None,
                mode: None,
            },
        }
    }
}
