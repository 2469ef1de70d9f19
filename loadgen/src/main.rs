//! `loadgen`: the load generator of tierlimit's benchmarks (`scripts/bench`).
//!
//! ```text
//! loadgen http  --url http://127.0.0.1:9000/v1/check [--url …] [run options]
//! loadgen redis --redis-url redis://127.0.0.1:6379 [script options] [run options]
//! loadgen script-args --tenant T [script options]   # EVALSHA line for redis-benchmark
//! ```
//!
//! Closed loop (`--mode closed --connections N`) or open loop (`--mode open
//! --rate R`, latency from the intended send time); tenants uniform, Zipf or
//! each once in order; several targets (regions) at once. Prints one JSON
//! summary: HDR percentiles, throughput, decisions by outcome, tier and mode.

mod http1;
mod run;
mod stats;
mod target;

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use rand_distr::Zipf;
use serde_json::{json, Value};

use crate::run::{Backend, Ctx, Dist, Model};
use crate::stats::{percentiles_us, Stats};
use crate::target::{Proto, ScriptCall, TierArgs, DECIDE_LUA};

#[derive(Debug, Parser)]
#[command(version, about = "Load generator for tierlimit benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// HTTP load on region-node (`/v1/check`) or throttlecrab-server.
    Http {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        http: HttpArgs,
    },
    /// `EVALSHA` of decide.lua straight on Redis (one multiplexed
    /// connection per `--redis-conns`), with the KEYS/ARGV region-node sends.
    Redis {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        script: ScriptArgs,
        #[arg(long, default_value = "redis://127.0.0.1:6379")]
        redis_url: String,
        /// Multiplexed connections shared by the workers.
        #[arg(long, default_value_t = 1)]
        redis_conns: usize,
    },
    /// Prints `EVALSHA <sha> 6 KEYS… ARGV…`, one argument per line, for
    /// `redis-benchmark` (use `__rand_int__` as the tenant with its `-r`).
    ScriptArgs {
        #[command(flatten)]
        script: ScriptArgs,
        #[arg(long)]
        tenant: String,
        /// SHA1 of decide.lua as `SCRIPT LOAD` returned it.
        #[arg(long)]
        sha: String,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    Closed,
    Open,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DistArg {
    Uniform,
    Zipf,
    /// Every tenant once, in order (populating state for scale runs).
    Seq,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[arg(long, value_enum, default_value = "closed")]
    mode: ModeArg,
    /// Closed loop: concurrent clients in all. Open loop: connections per
    /// target (the most requests in flight per target).
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Open loop: requests per second in all, spread evenly over targets.
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds of measured load (after the warm-up).
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds of unmeasured load first.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Most requests started in the whole run, warm-up included (0 = no limit).
    #[arg(long, default_value_t = 0)]
    max_requests: u64,
    /// Distinct tenants `{prefix}0 … {prefix}N-1`.
    #[arg(long, default_value_t = 10_000)]
    tenants: u64,
    #[arg(long, value_enum, default_value = "uniform")]
    dist: DistArg,
    /// Zipf exponent (tenant 0 hottest).
    #[arg(long, default_value_t = 1.1)]
    zipf_s: f64,
    #[arg(long, default_value = "t")]
    tenant_prefix: String,
    /// Worker threads of the generator's runtime (1: single-threaded, the
    /// lightest on a small machine).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Accuracy analysis against this global (daily) limit: overshoot and
    /// the time from the crossing to every target denying.
    #[arg(long)]
    accuracy_limit: Option<u64>,
    /// A name for the run, copied into the summary.
    #[arg(long, default_value = "")]
    label: String,
    /// Write the JSON summary here as well as to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ProtoArg {
    /// region-node `POST /v1/check`.
    Tierlimit,
    /// throttlecrab-server `POST /throttle`.
    Throttlecrab,
}

#[derive(Debug, Args)]
struct HttpArgs {
    /// Target URL, e.g. http://127.0.0.1:9000/v1/check; repeat for several
    /// regions (closed loop: clients round-robin; open loop: equal rates).
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    #[arg(long, value_enum, default_value = "tierlimit")]
    proto: ProtoArg,
    #[arg(long, default_value_t = 1)]
    cost: u64,
    /// Request key (region-node, key-scoped plans).
    #[arg(long)]
    key: Option<String>,
    /// throttlecrab: max_burst.
    #[arg(long, default_value_t = 1_000_000)]
    tc_burst: u64,
    /// throttlecrab: count_per_period.
    #[arg(long, default_value_t = 1_000_000)]
    tc_count: u64,
    /// throttlecrab: period in seconds.
    #[arg(long, default_value_t = 1)]
    tc_period: u64,
}

/// The tiers of the `EVALSHA` call (defaults: the bench plan).
#[derive(Debug, Args)]
struct ScriptArgs {
    #[arg(long, default_value = "bench-1")]
    node_id: String,
    /// 0 none, 1 fixed window, 2 sliding window, 3 token bucket, 4 sliding log.
    #[arg(long, default_value_t = 1)]
    node_algorithm: u8,
    #[arg(long, default_value_t = 1_000_000)]
    node_limit: u64,
    #[arg(long, default_value_t = 1000)]
    node_window_ms: u64,
    #[arg(long)]
    node_burst: Option<u64>,
    #[arg(long, default_value_t = 2)]
    region_algorithm: u8,
    #[arg(long, default_value_t = 100_000_000)]
    region_limit: u64,
    #[arg(long, default_value_t = 60_000)]
    region_window_ms: u64,
    #[arg(long)]
    region_burst: Option<u64>,
    #[arg(long, default_value_t = 1_000_000_000_000)]
    global_limit: u64,
    /// PN-counter TTL: (retention_days + 1) days.
    #[arg(long, default_value_t = 3 * 86_400)]
    ttl_s: u64,
    #[arg(long, default_value_t = 1)]
    script_cost: u64,
}

impl ScriptArgs {
    fn call(&self) -> ScriptCall {
        ScriptCall {
            node_id: self.node_id.clone(),
            node: TierArgs {
                algorithm: self.node_algorithm,
                limit: self.node_limit,
                window_ms: self.node_window_ms,
                burst: self.node_burst.unwrap_or(self.node_limit),
            },
            region: TierArgs {
                algorithm: self.region_algorithm,
                limit: self.region_limit,
                window_ms: self.region_window_ms,
                burst: self.region_burst.unwrap_or(self.region_limit),
            },
            global_limit: self.global_limit,
            cost: self.script_cost,
            ttl_s: self.ttl_s,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::ScriptArgs {
            script,
            tenant,
            sha,
        } => {
            let (keys, args) = script.call().keys_args(&tenant, ScriptCall::today());
            let mut out = std::io::stdout().lock();
            writeln!(out, "EVALSHA\n{sha}\n{}", keys.len())?;
            for a in keys.iter().chain(&args) {
                writeln!(out, "{a}")?;
            }
            Ok(())
        }
        Command::Http { run, http } => {
            let urls = http
                .urls
                .iter()
                .map(|u| http1::Url::parse(u))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let proto = match http.proto {
                ProtoArg::Tierlimit => Proto::Tierlimit {
                    cost: http.cost,
                    key: http.key.clone(),
                },
                ProtoArg::Throttlecrab => Proto::Throttlecrab {
                    burst: http.tc_burst,
                    count_per_period: http.tc_count,
                    period_s: http.tc_period,
                    cost: http.cost,
                },
            };
            let targets: Vec<String> = urls.iter().map(|u| u.text.clone()).collect();
            let kind = match http.proto {
                ProtoArg::Tierlimit => "tierlimit-http",
                ProtoArg::Throttlecrab => "throttlecrab-http",
            };
            execute(&run, kind, targets, move || async move {
                Ok(Backend::Http { urls, proto })
            })
        }
        Command::Redis {
            run,
            script,
            redis_url,
            redis_conns,
        } => {
            let call = script.call();
            let url = redis_url.clone();
            execute(&run, "redis-evalsha", vec![redis_url], move || async move {
                let client = redis::Client::open(url.as_str())?;
                let mut conns = Vec::new();
                for _ in 0..redis_conns.max(1) {
                    conns.push(client.get_multiplexed_async_connection().await?);
                }
                let sha: String = redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(DECIDE_LUA)
                    .query_async(&mut conns[0])
                    .await
                    .context("SCRIPT LOAD decide.lua")?;
                Ok(Backend::Redis { conns, sha, call })
            })
        }
    }
}

fn execute<F, Fut>(
    run: &RunArgs,
    kind: &str,
    targets: Vec<String>,
    backend: F,
) -> anyhow::Result<()>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Backend>>,
{
    let model = match (run.mode, run.rate) {
        (ModeArg::Closed, _) => Model::Closed,
        (ModeArg::Open, Some(r)) if r > 0.0 => Model::Open { rate: r },
        (ModeArg::Open, _) => bail!("--mode open needs --rate > 0"),
    };
    if run.tenants == 0 || run.connections == 0 {
        bail!("--tenants and --connections must be at least 1");
    }
    if targets.len() > 255 {
        bail!("at most 255 targets");
    }
    let dist = match run.dist {
        DistArg::Uniform => Dist::Uniform(run.tenants),
        DistArg::Zipf => Dist::Zipf(Zipf::new(run.tenants as f64, run.zipf_s).context("--zipf-s")?),
        DistArg::Seq => Dist::Seq(Arc::new(AtomicU64::new(0)), run.tenants),
    };
    let rt = if run.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(run.threads)
            .enable_all()
            .build()?
    };
    let summary = rt.block_on(async {
        let backend = Arc::new(backend().await?);
        let start = Instant::now();
        let warmup = Duration::from_secs_f64(run.warmup.max(0.0));
        let duration = Duration::from_secs_f64(run.duration.max(0.0));
        let ctx = Arc::new(Ctx {
            model,
            dist,
            tenant_prefix: run.tenant_prefix.clone(),
            start,
            measure_from: start + warmup,
            end: start + warmup + duration,
            drain_until: start + warmup + duration + Duration::from_secs(5),
            max_requests: run.max_requests,
            started: AtomicU64::new(0),
            unsent: AtomicU64::new(0),
            targets: targets.len(),
            keep_events: run.accuracy_limit.is_some(),
            seed: run.seed,
        });
        let stats = run::run(Arc::clone(&ctx), backend, run.connections).await;
        let finished = Instant::now();
        anyhow::Ok(summarize(run, kind, &targets, &ctx, stats, finished))
    })?;
    let text = serde_json::to_string_pretty(&summary)?;
    println!("{text}");
    if let Some(path) = &run.out {
        std::fs::write(path, format!("{text}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn summarize(
    run: &RunArgs,
    kind: &str,
    targets: &[String],
    ctx: &Ctx,
    mut stats: Stats,
    finished: Instant,
) -> Value {
    let measured_s = finished
        .saturating_duration_since(ctx.measure_from)
        .as_secs_f64()
        .max(1e-9);
    let requests = stats.requests();
    let (model, rate) = match ctx.model {
        Model::Closed => ("closed", None),
        Model::Open { rate } => ("open", Some(rate)),
    };
    // Closed loop: completions over the measured window. Open loop: the
    // window is the schedule (warm-up excluded), not the drain after it.
    let window_s = match ctx.model {
        Model::Closed => measured_s,
        Model::Open { .. } => run.duration.min(measured_s).max(1e-9),
    };
    let accuracy = run
        .accuracy_limit
        .map(|limit| accuracy(&mut stats, limit, targets.len()));
    json!({
        "label": run.label,
        "kind": kind,
        "model": model,
        "rate_target": rate,
        "connections": run.connections,
        "targets": targets,
        "tenants": run.tenants,
        "dist": format!("{:?}", run.dist).to_lowercase(),
        "zipf_s": matches!(run.dist, DistArg::Zipf).then_some(run.zipf_s),
        "warmup_s": run.warmup,
        "duration_s": run.duration,
        "measured_s": (window_s * 1000.0).round() / 1000.0,
        "requests": requests,
        "throughput_rps": (requests as f64 / window_s).round(),
        "allowed": stats.allowed,
        "denied": stats.denied,
        "errors": stats.errors,
        "unsent": ctx.unsent.load(Ordering::Relaxed),
        "latency_us": percentiles_us(&stats.latency),
        "service_us": percentiles_us(&stats.service),
        "queue_us": percentiles_us(&stats.lag),
        "denied_by": stats.denied_by,
        "modes": stats.modes,
        "status": stats.status.iter().map(|(k, v)| (k.to_string(), *v)).collect::<std::collections::BTreeMap<_, _>>(),
        "error_kinds": stats.error_kinds,
        "per_target": targets.iter().zip(&stats.per_target).map(|(t, c)| json!({
            "target": t, "requests": c.requests, "allowed": c.allowed, "denied": c.denied, "errors": c.errors,
        })).collect::<Vec<_>>(),
        "accuracy": accuracy,
    })
}

/// Overshoot past `limit` and, per target, how long after the crossing it
/// still allowed. The crossing is the completion of the `limit`-th allowed
/// decision across all targets, in completion order.
fn accuracy(stats: &mut Stats, limit: u64, targets: usize) -> Value {
    let events = &mut stats.events;
    events.sort_by_key(|e| e.done_ns);
    let allowed_total = events.iter().filter(|e| e.allowed).count() as u64;
    let crossing = if allowed_total >= limit && limit > 0 {
        events
            .iter()
            .filter(|e| e.allowed)
            .nth((limit - 1) as usize)
            .map(|e| e.done_ns)
    } else {
        None
    };
    let ms = |ns: u64| (ns as f64 / 1e4).round() / 100.0;
    let per_target: Vec<Value> = (0..targets)
        .map(|t| {
            let mine = events.iter().filter(|e| e.target as usize == t);
            let last_allowed = mine.clone().filter(|e| e.allowed).map(|e| e.done_ns).max();
            let allowed_after = crossing.map_or(0, |c| {
                mine.clone().filter(|e| e.allowed && e.done_ns > c).count()
            });
            let denied_before = crossing.map_or(0, |c| {
                mine.clone().filter(|e| !e.allowed && e.done_ns < c).count()
            });
            let to_deny = match (crossing, last_allowed) {
                (Some(c), Some(l)) => Some(ms(l.saturating_sub(c))),
                (Some(_), None) => Some(0.0),
                _ => None,
            };
            json!({
                "allowed": mine.clone().filter(|e| e.allowed).count(),
                "allowed_after_crossing": allowed_after,
                "denied_before_crossing": denied_before,
                "ms_from_crossing_to_denying": to_deny,
            })
        })
        .collect();
    let all_deny = per_target
        .iter()
        .filter_map(|t| t["ms_from_crossing_to_denying"].as_f64())
        .fold(None, |acc: Option<f64>, v| {
            Some(acc.map_or(v, |a| a.max(v)))
        });
    let overshoot = allowed_total as i64 - limit as i64;
    json!({
        "limit": limit,
        "allowed_total": allowed_total,
        "overshoot": overshoot,
        "overshoot_pct": (overshoot as f64 / limit as f64 * 100.0 * 1000.0).round() / 1000.0,
        "crossing_ms": crossing.map(ms),
        "ms_from_crossing_to_all_denying": all_deny,
        "per_target": per_target,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Event;

    fn ev(done_ms: u64, target: u8, allowed: bool) -> Event {
        Event {
            done_ns: done_ms * 1_000_000,
            target,
            allowed,
        }
    }

    #[test]
    fn accuracy_finds_crossing_overshoot_and_time_to_deny() {
        let mut s = Stats::new(2);
        // limit 3: allowed at 1, 2 (target 0), 3 (target 1) = crossing at 3 ms;
        // target 0 allows once more at 5 ms, target 1 at 4 ms, then both deny.
        s.events = vec![
            ev(1, 0, true),
            ev(2, 0, true),
            ev(3, 1, true),
            ev(4, 1, true),
            ev(5, 0, true),
            ev(6, 0, false),
            ev(7, 1, false),
        ];
        let a = accuracy(&mut s, 3, 2);
        assert_eq!(a["allowed_total"], 5);
        assert_eq!(a["overshoot"], 2);
        assert_eq!(a["crossing_ms"], 3.0);
        assert_eq!(a["per_target"][0]["ms_from_crossing_to_denying"], 2.0);
        assert_eq!(a["per_target"][1]["ms_from_crossing_to_denying"], 1.0);
        assert_eq!(a["ms_from_crossing_to_all_denying"], 2.0);
    }

    #[test]
    fn accuracy_without_crossing_reports_none() {
        let mut s = Stats::new(1);
        s.events = vec![ev(1, 0, true)];
        let a = accuracy(&mut s, 10, 1);
        assert_eq!(a["overshoot"], -9);
        assert!(a["crossing_ms"].is_null());
    }

    #[test]
    fn tierlimit_replies_are_classified() {
        let p = Proto::Tierlimit { cost: 1, key: None };
        let ok = p.outcome(200, br#"{"allowed":true,"mode":"redis","denied_by":null}"#);
        assert!(ok.allowed && ok.mode == Some("redis"));
        let denied = p.outcome(429, br#"{"violated-policy":"global","mode":"view"}"#);
        assert_eq!(
            (denied.allowed, denied.tier, denied.mode),
            (false, Some("global"), Some("view"))
        );
        let unavailable = p.outcome(503, br#"{"violated-policy":"store"}"#);
        assert_eq!(unavailable.tier, None, "a 503 is an error, not a decision");
    }

    #[test]
    fn script_call_matches_the_key_scheme() {
        let call = ScriptArgs {
            node_id: "n1".into(),
            node_algorithm: 1,
            node_limit: 20,
            node_window_ms: 1000,
            node_burst: None,
            region_algorithm: 2,
            region_limit: 600,
            region_window_ms: 60_000,
            region_burst: None,
            global_limit: 100_000,
            ttl_s: 259_200,
            script_cost: 1,
        }
        .call();
        let (keys, args) = call.keys_args("acme", 20_000);
        assert_eq!(
            keys,
            [
                "tl:{acme}:n:n1:_:1",
                "tl:{acme}:r:_:2",
                "tl:dirty",
                "tl:{acme}:g:19999",
                "tl:{acme}:g:20000",
                "tl:{acme}:g:20001"
            ]
        );
        assert_eq!(args.len(), 17);
        assert_eq!(&args[..2], ["check", "1"]);
        assert_eq!(&args[14..], ["acme", "20000", "259200"]);
    }

    #[test]
    fn urls_parse() {
        let u = http1::Url::parse("http://127.0.0.1:9000/v1/check").unwrap();
        assert_eq!(
            (u.host.as_str(), u.path.as_str()),
            ("127.0.0.1:9000", "/v1/check")
        );
        assert!(http1::Url::parse("https://x").is_err());
    }
}
