//! `loadgen`: the load generator of tierlimit's benchmarks (`scripts/bench`).
//!
//! ```text
//! loadgen http  --url http://127.0.0.1:9000/v1/check [--url …] [run options]
//! loadgen http  --proto gateway --url http://127.0.0.1:10000/ [--tenant-header x-tenant]
//! loadgen redis --redis-url redis://127.0.0.1:6379 [script options] [run options]
//! loadgen script-resp --sha SHA --calls N --out F [script options]   # for redis-cli --pipe
//! loadgen deltas --config tierlimit.toml --regions r01,… --tenants N --phase far|near
//! ```
//!
//! Closed loop (`--mode closed --connections N`) or open loop (`--mode open
//! --rate R`, latency from the intended send time); tenants uniform, Zipf,
//! each once in order, or staggered in phases; several targets (regions) at
//! once. Prints one JSON summary: HDR percentiles, throughput, decisions by
//! outcome, tier and mode, and with `--accuracy-limit` the overshoot and the
//! time from crossing the limit to every target denying, per tenant too.
//!
//! `deltas` is not a request load: simulated regions publishing signed
//! wire-v2 deltas straight to Kafka (see [`deltas`]).

mod deltas;
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
use crate::stats::{percentiles_us, Event, Stats};
use crate::target::{Proto, ScriptCall, TierArgs, DECIDE_LUA};

#[derive(Debug, Parser)]
#[command(version, about = "Load generator for tierlimit benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// HTTP load on region-node (`/v1/check`), a gateway (Envoy) or
    /// throttlecrab-server.
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
    /// Simulated regions: signed wire-v2 deltas straight to the deltas
    /// topic, for near- and far-from-limit tenants (see `deltas.rs`).
    Deltas(deltas::DeltaArgs),
    /// Writes `--calls` checks (`EVALSHA <sha> …` with the KEYS and ARGV
    /// region-node sends) as RESP to `--out`, for `redis-cli --pipe`
    /// (`scripts/script-profile`). RESP, not words: the script's numbers
    /// are one binary argument, which no command line can carry.
    ScriptResp {
        #[command(flatten)]
        script: ScriptArgs,
        /// SHA1 of decide.lua as `SCRIPT LOAD` returned it.
        #[arg(long)]
        sha: String,
        /// Tenants 0 … N-1, taken in turn.
        #[arg(long, default_value_t = 1000)]
        tenants: u64,
        #[arg(long)]
        calls: u64,
        #[arg(long)]
        out: PathBuf,
        /// Calls of this many days before today (a tenant's history, for
        /// a script whose clock is faked to that day).
        #[arg(long, default_value_t = 0)]
        days_ago: u32,
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
    /// Staggered tenants: tenant i is active from i·X to (i + W)·X seconds
    /// after the start (X = --phase-seconds, W = --phase-width), a request
    /// picks uniformly among the active ones; the run stops once the last
    /// tenant's phases are over, at (N + W − 1)·X (accuracy runs: many
    /// crossings of the limit, out of step with the system's timers).
    Phased,
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
    /// Phased: seconds between the starts of consecutive tenants.
    #[arg(long, default_value_t = 1.5)]
    phase_seconds: f64,
    /// Phased: how many phases each tenant stays active (tenants active at once).
    #[arg(long, default_value_t = 4)]
    phase_width: u64,
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
    /// `GET` with the tenant in `--tenant-header` (Envoy's ratelimit
    /// filter in front): 200 allowed, 429 denied.
    Gateway,
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
    /// gateway: the request header that carries the tenant.
    #[arg(long, default_value = "x-tenant")]
    tenant_header: String,
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
    /// Global tiers of other periods beside the day's, each `KIND:LIMIT`
    /// (`hour:1000000000,month:1000000000`): issue 33's cost of periods.
    #[arg(long, value_delimiter = ',')]
    global_periods: Vec<String>,
    /// PN-counter TTL: (retention_days + 1) days.
    #[arg(long, default_value_t = 3 * 86_400)]
    ttl_s: u64,
    #[arg(long, default_value_t = 1)]
    script_cost: u64,
}

impl ScriptArgs {
    fn call(&self) -> ScriptCall {
        let mut call = self.base_call();
        call.periods = self
            .global_periods
            .iter()
            .filter_map(|p| {
                let (kind, limit) = p.split_once(':')?;
                Some((
                    tierlimit_shared::period::PeriodKind::parse(kind)?,
                    limit.parse().ok()?,
                ))
            })
            .collect();
        call
    }

    fn base_call(&self) -> ScriptCall {
        ScriptCall::new(
            self.node_id.clone(),
            TierArgs {
                algorithm: self.node_algorithm,
                limit: self.node_limit,
                window_ms: self.node_window_ms,
                burst: self.node_burst.unwrap_or(self.node_limit),
            },
            TierArgs {
                algorithm: self.region_algorithm,
                limit: self.region_limit,
                window_ms: self.region_window_ms,
                burst: self.region_burst.unwrap_or(self.region_limit),
            },
            self.global_limit,
            self.script_cost,
            self.ttl_s,
        )
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Deltas(args) => deltas::run(args),
        Command::ScriptResp {
            script,
            sha,
            tenants,
            calls,
            out,
            days_ago,
        } => {
            let call = script.call();
            let day = ScriptCall::today().saturating_sub(days_ago);
            let mut w = std::io::BufWriter::new(std::fs::File::create(&out)?);
            for i in 0..calls {
                let tenant = format!("{:012}", i % tenants.max(1));
                w.write_all(&call.cmd(&sha, &tenant, day).get_packed_command())?;
            }
            w.flush()?;
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
                ProtoArg::Gateway => Proto::Gateway {
                    header: http.tenant_header.clone(),
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
                ProtoArg::Gateway => "gateway-http",
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
        DistArg::Phased => {
            if !(run.phase_seconds > 0.0 && run.phase_seconds.is_finite()) || run.phase_width == 0 {
                bail!("--dist phased needs --phase-seconds > 0 and --phase-width ≥ 1");
            }
            Dist::Phased {
                phase: Duration::from_secs_f64(run.phase_seconds),
                width: run.phase_width,
                n: run.tenants,
            }
        }
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
            completed: AtomicU64::new(0),
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
        "phase_seconds": matches!(run.dist, DistArg::Phased).then_some(run.phase_seconds),
        "phase_width": matches!(run.dist, DistArg::Phased).then_some(run.phase_width),
        "warmup_s": run.warmup,
        "duration_s": run.duration,
        "measured_s": (window_s * 1000.0).round() / 1000.0,
        "requests": requests,
        "completed_total": ctx.completed.load(Ordering::Relaxed),
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
/// decision across all targets, in completion order. The top-level figures
/// count every event as one tenant's (a single-tenant run); `per_tenant`
/// applies the same definitions to each tenant on its own (see
/// [`per_tenant`]).
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
        "per_tenant": per_tenant(events, limit, targets),
    })
}

/// Nearest-rank percentile of ascending `sorted`: the smallest value with at
/// least `p`·n values at or below it (`p` in (0, 1]); `None` when empty.
fn nearest_rank(sorted: &[u64], p: f64) -> Option<u64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let rank = ((p * n as f64).ceil() as usize).clamp(1, n);
    Some(sorted[rank - 1])
}

/// One tenant's decisions, in completion order.
struct TenantTrack {
    allowed: u64,
    /// Completion of its `limit`-th allowed decision.
    crossing: Option<u64>,
    /// Per target: completion of the last allowed and of the last denied decision.
    last_allowed: Vec<Option<u64>>,
    last_denied: Vec<Option<u64>>,
}

/// The accuracy figures per tenant, over every tenant that reached `limit`
/// (`events` in completion order). A tenant's crossing is the completion of
/// its `limit`-th allowed decision (completion order across targets); its
/// time to "every target denying" is the largest, over targets, of that
/// target's last allowed decision of the tenant − the crossing (0 when it
/// came before the crossing or the target allowed none); its overshoot is
/// its allowed decisions − `limit`. Distributions are nearest-rank
/// percentiles over the crossed tenants. `not_all_seen_denying` counts the
/// crossed tenants with a target that allowed after the crossing and was
/// never seen denying after its last allowed decision (the run ended
/// first): their time is a lower bound.
fn per_tenant(events: &[Event], limit: u64, targets: usize) -> Value {
    let mut tenants: std::collections::BTreeMap<u32, TenantTrack> = Default::default();
    for e in events {
        let t = tenants.entry(e.tenant).or_insert_with(|| TenantTrack {
            allowed: 0,
            crossing: None,
            last_allowed: vec![None; targets],
            last_denied: vec![None; targets],
        });
        let target = e.target as usize;
        if e.allowed {
            t.allowed += 1;
            if t.allowed == limit {
                t.crossing = Some(e.done_ns);
            }
            if let Some(slot) = t.last_allowed.get_mut(target) {
                *slot = Some(e.done_ns);
            }
        } else if let Some(slot) = t.last_denied.get_mut(target) {
            *slot = Some(e.done_ns);
        }
    }
    let mut to_deny = Vec::new();
    let mut overshoot = Vec::new();
    let mut unseen = 0u64;
    for t in tenants.values() {
        let Some(c) = t.crossing.filter(|_| limit > 0) else {
            continue;
        };
        let mut slowest = 0;
        let mut seen_denying = true;
        for (a, d) in t.last_allowed.iter().zip(&t.last_denied) {
            let Some(a) = *a else { continue };
            slowest = u64::max(slowest, a.saturating_sub(c));
            if a > c && d.is_none_or(|d| d < a) {
                seen_denying = false;
            }
        }
        to_deny.push(slowest);
        overshoot.push(t.allowed - limit);
        unseen += u64::from(!seen_denying);
    }
    to_deny.sort_unstable();
    overshoot.sort_unstable();
    let ms = |ns: Option<u64>| ns.map(|ns| (ns as f64 / 1e4).round() / 100.0);
    let pct = |o: Option<u64>| {
        o.map(|o| (o as f64 / limit.max(1) as f64 * 100.0 * 1000.0).round() / 1000.0)
    };
    json!({
        "tenants": tenants.len(),
        "crossed": to_deny.len(),
        "not_crossed": tenants.len() - to_deny.len(),
        "not_all_seen_denying": unseen,
        "crossing_to_all_denying_ms": {
            "p50": ms(nearest_rank(&to_deny, 0.50)),
            "p90": ms(nearest_rank(&to_deny, 0.90)),
            "p99": ms(nearest_rank(&to_deny, 0.99)),
            "max": ms(to_deny.last().copied()),
            "n": to_deny.len(),
            // Every crossing's time, ascending (the bench charts them).
            "all": to_deny.iter().map(|&ns| ms(Some(ns))).collect::<Vec<_>>(),
        },
        "overshoot": {
            "total": overshoot.iter().sum::<u64>(),
            "p50": nearest_rank(&overshoot, 0.50),
            "p99": nearest_rank(&overshoot, 0.99),
            "max": overshoot.last(),
        },
        "overshoot_pct_of_limit": {
            "p50": pct(nearest_rank(&overshoot, 0.50)),
            "p99": pct(nearest_rank(&overshoot, 0.99)),
            "max": pct(overshoot.last().copied()),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Event;

    fn ev(done_ms: u64, target: u8, allowed: bool) -> Event {
        evt(done_ms, 0, target, allowed)
    }

    fn evt(done_ms: u64, tenant: u32, target: u8, allowed: bool) -> Event {
        Event {
            done_ns: done_ms * 1_000_000,
            tenant,
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
    fn accuracy_per_tenant_crossings_overshoot_and_time_to_deny() {
        let mut s = Stats::new(2);
        // limit 2, two targets, tenants interleaved in time (and given out
        // of order: accuracy sorts by completion).
        // tenant 0: allowed 1 (t0), 2 (t1) = crossing at 2 ms; t1 allows at
        //   3, t0 at 4, then both deny: 2 ms to all denying, overshoot 2.
        // tenant 1: allowed 3.5 (t1), 5 (t0) = crossing at 5 ms; t1's last
        //   allowed came before it (floored to 0), t0's is the crossing: 0 ms,
        //   overshoot 0.
        // tenant 2: one allowed: not crossed.
        // tenant 3: crossing at 31 ms (t0 twice), t1 allows until 40 and is
        //   never seen denying: 9 ms (a lower bound), overshoot 3.
        s.events = vec![
            evt(40, 3, 1, true),
            evt(1, 0, 0, true),
            evt(2, 0, 1, true),
            evt(3, 0, 1, true),
            evt(4, 0, 0, true),
            evt(4, 1, 1, true),
            evt(5, 1, 0, true),
            evt(6, 0, 0, false),
            evt(6, 1, 0, false),
            evt(7, 0, 1, false),
            evt(7, 1, 1, false),
            evt(20, 2, 0, true),
            evt(30, 3, 0, true),
            evt(31, 3, 0, true),
            evt(32, 3, 1, true),
            evt(33, 3, 1, true),
            evt(41, 3, 0, false),
        ];
        let a = accuracy(&mut s, 2, 2);
        // The top level still treats every event as one tenant's.
        assert_eq!(a["allowed_total"], 12);
        assert_eq!(a["overshoot"], 10);
        assert_eq!(a["crossing_ms"], 2.0);
        let t = &a["per_tenant"];
        assert_eq!(t["tenants"], 4);
        assert_eq!(t["crossed"], 3);
        assert_eq!(t["not_crossed"], 1);
        assert_eq!(t["not_all_seen_denying"], 1);
        // Sorted times to all denying: 0, 2, 9 ms (nearest rank).
        let d = &t["crossing_to_all_denying_ms"];
        assert_eq!(
            (&d["p50"], &d["p90"], &d["p99"], &d["max"], &d["n"]),
            (
                &json!(2.0),
                &json!(9.0),
                &json!(9.0),
                &json!(9.0),
                &json!(3)
            )
        );
        // Sorted overshoots: 0, 2, 3 decisions; of a limit of 2.
        assert_eq!(
            t["overshoot"],
            json!({"total": 5, "p50": 2, "p99": 3, "max": 3})
        );
        assert_eq!(
            t["overshoot_pct_of_limit"],
            json!({"p50": 100.0, "p99": 150.0, "max": 150.0})
        );
    }

    #[test]
    fn accuracy_per_tenant_without_crossing_is_empty() {
        let mut s = Stats::new(1);
        s.events = vec![evt(1, 0, 0, true), evt(2, 1, 0, true)];
        let t = &accuracy(&mut s, 10, 1)["per_tenant"];
        assert_eq!((&t["crossed"], &t["not_crossed"]), (&json!(0), &json!(2)));
        assert!(t["crossing_to_all_denying_ms"]["p99"].is_null());
        assert_eq!(t["overshoot"]["total"], 0);
        assert!(t["overshoot"]["max"].is_null());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(nearest_rank(&v, 0.50), Some(50));
        assert_eq!(nearest_rank(&v, 0.90), Some(90));
        assert_eq!(nearest_rank(&v, 0.99), Some(99));
        assert_eq!(nearest_rank(&v, 1.0), Some(100));
        // 60 values: p99 is the largest (rank ⌈59.4⌉ = 60); p50 the 30th.
        let v: Vec<u64> = (1..=60).collect();
        assert_eq!(nearest_rank(&v, 0.99), Some(60));
        assert_eq!(nearest_rank(&v, 0.50), Some(30));
        assert_eq!(nearest_rank(&[7], 0.5), Some(7));
        assert_eq!(nearest_rank(&[], 0.5), None);
    }

    #[test]
    fn phased_tenants_are_staggered() {
        use crate::run::phased_active;
        let x = Duration::from_millis(1500);
        let at = |s: f64| phased_active(x, 4, 10, Duration::from_secs_f64(s));
        // Ramp up: tenant 0 alone, then one more every 1.5 s.
        assert_eq!(at(0.0), Some(0..=0));
        assert_eq!(at(1.499), Some(0..=0));
        assert_eq!(at(1.5), Some(0..=1));
        assert_eq!(at(4.6), Some(0..=3));
        // Steady: 4 at once, the oldest leaving as the next arrives.
        assert_eq!(at(6.0), Some(1..=4));
        assert_eq!(at(13.6), Some(6..=9));
        // Ramp down: no tenant 10; the last one leaves at (10 + 4 − 1)·1.5 s.
        assert_eq!(at(15.0), Some(7..=9));
        assert_eq!(at(19.4), Some(9..=9));
        assert_eq!(at(19.5), None);
        assert_eq!(at(1000.0), None);
        // Each tenant is active for exactly width phases from i·phase.
        for i in 0..10u64 {
            let on = |s: f64| at(s).is_some_and(|r| r.contains(&i));
            let start = i as f64 * 1.5;
            assert!(i == 0 || !on(start - 0.001), "tenant {i} before its start");
            assert!(
                on(start) && on(start + 5.999),
                "tenant {i} during its phases"
            );
            assert!(!on(start + 6.0), "tenant {i} after its phases");
        }
        assert_eq!(phased_active(x, 1, 3, Duration::from_secs(2)), Some(1..=1));
        assert_eq!(phased_active(x, 4, 0, Duration::ZERO), None);

        // pick draws uniformly among the active ones, and stops after them.
        let d = Dist::Phased {
            phase: x,
            width: 4,
            n: 10,
        };
        let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(7);
        let mut seen = [0u32; 10];
        for _ in 0..4000 {
            let i = d.pick(&mut rng, Duration::from_secs(7)).unwrap();
            seen[i as usize] += 1;
        }
        assert_eq!(&seen[..1], [0]);
        assert!(seen[1..=4].iter().all(|&c| c > 800), "{seen:?}");
        assert_eq!(&seen[5..], [0; 5]);
        assert_eq!(d.pick(&mut rng, Duration::from_secs(20)), None);
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
    fn gateway_requests_carry_the_tenant_header_and_statuses_decide() {
        let p = Proto::Gateway {
            header: "x-tenant".into(),
        };
        let url = http1::Url::parse("http://127.0.0.1:10000/x").unwrap();
        let (mut out, mut body) = (b"stale".to_vec(), String::new());
        p.request(&url, "t42", &mut out, &mut body);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "GET /x HTTP/1.1\r\nHost: 127.0.0.1:10000\r\nx-tenant: t42\r\n\r\n"
        );
        assert!(p.outcome(200, b"ok").allowed);
        let denied = p.outcome(429, b"");
        assert_eq!((denied.allowed, denied.tier), (false, Some("gateway")));
        let failed = p.outcome(500, b"");
        assert_eq!((failed.allowed, failed.tier), (false, None));
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
            global_periods: Vec::new(),
            ttl_s: 259_200,
            script_cost: 1,
        }
        .call();
        let cmd = call.cmd("sha", "acme", 20_000);
        let args: Vec<&[u8]> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b,
                _ => &[][..],
            })
            .collect();
        let keys = tierlimit_shared::keys::tenant_hash("acme");
        let dirty = tierlimit_shared::keys::dirty(tierlimit_shared::keys::bucket_of("acme"));
        // Both tiers live in the tenant hash: two keys.
        let text = |i: usize| std::str::from_utf8(args[i]).unwrap();
        assert_eq!(
            (0..5).map(text).collect::<Vec<_>>(),
            ["EVALSHA", "sha", "2", keys.as_str(), dirty.as_str()]
        );
        assert_eq!(
            (5..8).map(text).collect::<Vec<_>>(),
            ["check", "acme", "g:20000:"]
        );
        let n = region_node::storage::script::unpack_numbers(args[9]);
        // deadline, day, TTL; the check's lease: none asked (max 0, share
        // 1, no tail); K = 2 tiers of six numbers, E = 0 other periods.
        assert_eq!(n[..3], [0.0, 20_000.0, 259_200.0]);
        assert_eq!(n[9..14], [0.0, 1.0, 0.0, 2.0, 0.0]);
        assert_eq!(n[14..20], [0.0, 1.0, 20.0, 1000.0, 1.0, 0.0]);
        assert_eq!(n.len(), 26);
        assert_eq!((text(10), text(11)), ("n:n1:_:1:", "r:_:2:"));
        assert_eq!(args.len(), 12);
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
