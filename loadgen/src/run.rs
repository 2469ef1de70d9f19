//! The two load models.
//!
//! **Closed loop**: N workers, each sends a request, waits for the answer,
//! sends the next. Throughput is what the system sustains with N callers;
//! latency is measured from the actual send.
//!
//! **Open loop**: a scheduler thread hands out requests at a fixed rate
//! (intended send times `start + i / rate`) to a pool of workers
//! (connections). Latency is measured from the *intended* send time, so
//! when the system stalls, the requests that should have been sent during
//! the stall count their full wait: coordinated omission does not hide it.
//! The pool is bounded (`--connections` per target); requests beyond it wait
//! in the generator's queue, and that wait is part of their latency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

use crate::http1::{Conn, Url};
use crate::stats::{Event, Stats};
use crate::target::{Proto, ScriptCall};

/// How tenants are drawn.
#[derive(Clone)]
pub enum Dist {
    /// Uniform over `0..n`.
    Uniform(u64),
    /// Zipf over `0..n` with exponent s: tenant 0 is the hottest.
    Zipf(Zipf<f64>),
    /// Every tenant of `0..n` exactly once, in order, then stop.
    Seq(Arc<AtomicU64>, u64),
    /// Staggered tenants of `0..n`: tenant `i` is active while the time
    /// since the run's start is in `[i·phase, (i + width)·phase)`, so a new
    /// tenant starts every `phase` and each stays for `width` phases; a
    /// request picks uniformly among the active ones (see [`phased_active`]).
    Phased { phase: Duration, width: u64, n: u64 },
}

impl Dist {
    /// The tenant of a request scheduled `since_start` after the run's
    /// start, or `None` when no tenant is left (the worker stops).
    pub fn pick(&self, rng: &mut SmallRng, since_start: Duration) -> Option<u64> {
        match self {
            Dist::Uniform(n) => Some(rng.random_range(0..*n)),
            Dist::Zipf(z) => Some((z.sample(rng) as u64).saturating_sub(1)),
            Dist::Seq(next, n) => {
                let i = next.fetch_add(1, Ordering::Relaxed);
                (i < *n).then_some(i)
            }
            Dist::Phased { phase, width, n } => {
                phased_active(*phase, *width, *n, since_start).map(|r| rng.random_range(r))
            }
        }
    }
}

/// The tenants [`Dist::Phased`] draws from at `since_start`. With
/// `k = ⌊since_start / phase⌋` they are `k − width + 1 ..= k`, capped to
/// `0..n`: in steady state `width` tenants share the rate (each gets
/// rate / width for `width` phases), but while the first `width − 1` phases
/// ramp up and the last ones ramp down fewer are active and each gets more.
/// `None` once `k − width + 1 ≥ n`, i.e. from `(n + width − 1)·phase` on:
/// no tenant is left and the run stops there.
pub fn phased_active(
    phase: Duration,
    width: u64,
    n: u64,
    since_start: Duration,
) -> Option<std::ops::RangeInclusive<u64>> {
    let k = (since_start.as_nanos() / phase.as_nanos().max(1)).min(u64::MAX as u128) as u64;
    let first = k.saturating_sub(width.max(1) - 1);
    let last = k.min(n.checked_sub(1)?);
    (first <= last).then_some(first..=last)
}

#[derive(Clone, Copy, Debug)]
pub enum Model {
    Closed,
    Open { rate: f64 },
}

/// Settings shared by every worker of one run.
pub struct Ctx {
    pub model: Model,
    pub dist: Dist,
    pub tenant_prefix: String,
    pub start: Instant,
    /// Requests sent (closed) or intended (open) before this are not recorded.
    pub measure_from: Instant,
    /// No request is started after this.
    pub end: Instant,
    /// Open loop: queued requests not started by then are given up.
    pub drain_until: Instant,
    /// Most requests started in the whole run (0 = unbounded).
    pub max_requests: u64,
    pub started: AtomicU64,
    pub unsent: AtomicU64,
    /// Requests answered (or failed) in the whole run, warm-up included:
    /// what a server's CPU over the whole run is divided by.
    pub completed: AtomicU64,
    pub targets: usize,
    pub keep_events: bool,
    pub seed: u64,
}

impl Ctx {
    fn take(&self) -> bool {
        self.max_requests == 0 || self.started.fetch_add(1, Ordering::Relaxed) < self.max_requests
    }

    /// Writes the tenant of a request scheduled at `at` into `name` and
    /// returns its index, or `None` when the distribution has no more.
    fn tenant(&self, rng: &mut SmallRng, at: Instant, name: &mut String) -> Option<u64> {
        let i = self
            .dist
            .pick(rng, at.saturating_duration_since(self.start))?;
        name.clear();
        name.push_str(&self.tenant_prefix);
        use std::fmt::Write as _;
        let _ = write!(name, "{i}");
        Some(i)
    }

    fn record_event(
        &self,
        stats: &mut Stats,
        target: usize,
        tenant: u64,
        done: Instant,
        allowed: bool,
    ) {
        if self.keep_events {
            stats.events.push(Event {
                done_ns: done.duration_since(self.start).as_nanos() as u64,
                tenant: u32::try_from(tenant).unwrap_or(u32::MAX),
                target: target as u8,
                allowed,
            });
        }
    }
}

/// What a worker talks to.
pub enum Backend {
    Http {
        urls: Vec<Url>,
        proto: Proto,
    },
    Redis {
        conns: Vec<redis::aio::MultiplexedConnection>,
        sha: String,
        call: ScriptCall,
    },
}

/// Runs the whole load and returns the merged stats.
pub async fn run(ctx: Arc<Ctx>, backend: Arc<Backend>, connections: usize) -> Stats {
    let targets = ctx.targets;
    let mut handles = Vec::new();
    match ctx.model {
        Model::Closed => {
            for w in 0..connections {
                let (ctx, backend) = (Arc::clone(&ctx), Arc::clone(&backend));
                handles.push(tokio::spawn(async move {
                    worker(ctx, backend, w % targets, w, None).await
                }));
            }
        }
        Model::Open { rate } => {
            let mut senders = Vec::new();
            for t in 0..targets {
                let (tx, rx) = async_channel::unbounded::<Instant>();
                senders.push(tx);
                for c in 0..connections {
                    let (ctx, backend, rx) = (Arc::clone(&ctx), Arc::clone(&backend), rx.clone());
                    let w = t * connections + c;
                    handles.push(tokio::spawn(async move {
                        worker(ctx, backend, t, w, Some(rx)).await
                    }));
                }
            }
            let sched_ctx = Arc::clone(&ctx);
            std::thread::Builder::new()
                .name("scheduler".into())
                .spawn(move || schedule(&sched_ctx, rate, senders))
                .expect("spawn scheduler thread");
        }
    }
    let mut total = Stats::new(targets);
    for h in handles {
        if let Ok(s) = h.await {
            total.merge(s);
        }
    }
    total
}

/// Open-loop scheduler: hands out intended send times at `rate`, spread
/// round-robin over the targets, until `end` or `max_requests`.
fn schedule(ctx: &Ctx, rate: f64, senders: Vec<async_channel::Sender<Instant>>) {
    // Sleep precisely: the default 50 µs timer slack would delay every
    // request by up to 50 µs and show up as generator-made latency.
    // SAFETY: prctl on the calling thread only.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
    let interval = 1e9 / rate;
    let mut i: u64 = 0;
    loop {
        if ctx.max_requests > 0 && i >= ctx.max_requests {
            break;
        }
        let intended = ctx.start + Duration::from_nanos((i as f64 * interval) as u64);
        if intended >= ctx.end {
            break;
        }
        let now = Instant::now();
        if intended > now {
            std::thread::sleep(intended - now);
        }
        if senders[(i % senders.len() as u64) as usize]
            .send_blocking(intended)
            .is_err()
        {
            break;
        }
        i += 1;
    }
}

async fn worker(
    ctx: Arc<Ctx>,
    backend: Arc<Backend>,
    target: usize,
    w: usize,
    jobs: Option<async_channel::Receiver<Instant>>,
) -> Stats {
    let mut rng =
        SmallRng::seed_from_u64(ctx.seed ^ (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut stats = Stats::new(ctx.targets);
    let mut name = String::with_capacity(32);
    let mut req = Vec::with_capacity(256);
    let mut body = String::with_capacity(128);
    let mut conn = match &*backend {
        Backend::Http { urls, .. } => Some(Conn::new(urls[target].addr)),
        Backend::Redis { .. } => None,
    };
    let redis_conn = match &*backend {
        Backend::Redis { conns, .. } => Some(conns[w % conns.len()].clone()),
        Backend::Http { .. } => None,
    };
    let mut redis_conn = redis_conn;
    let day = ScriptCall::today();
    loop {
        // Closed loop: the next request starts now. Open loop: the next
        // intended send time from the scheduler.
        let intended = match &jobs {
            None => {
                let now = Instant::now();
                if now >= ctx.end || !ctx.take() {
                    break;
                }
                now
            }
            Some(rx) => match rx.recv().await {
                Ok(t) => t,
                Err(_) => break,
            },
        };
        if jobs.is_some() && Instant::now() >= ctx.drain_until {
            ctx.unsent.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let Some(tenant) = ctx.tenant(&mut rng, intended, &mut name) else {
            break;
        };
        let measured = intended >= ctx.measure_from;
        let sent = Instant::now();
        let result = match &*backend {
            Backend::Http { urls, proto } => {
                proto.request(&urls[target], &name, &mut req, &mut body);
                let c = conn.as_mut().expect("http connection");
                match c.roundtrip(&req).await {
                    Ok((status, b)) => Ok(proto.outcome(status, b)),
                    Err(e) => Err(format!("{:#}", e)
                        .split(':')
                        .next()
                        .unwrap_or("io")
                        .to_string()),
                }
            }
            Backend::Redis { sha, call, .. } => {
                let cmd = call.cmd(sha, &name, day);
                let c = redis_conn.as_mut().expect("redis connection");
                match cmd.query_async::<redis::Value>(c).await {
                    Ok(v) => Ok(call.outcome(v)),
                    Err(e) => Err(format!("redis {:?}", e.kind())),
                }
            }
        };
        let done = Instant::now();
        ctx.completed.fetch_add(1, Ordering::Relaxed);
        if !measured {
            continue;
        }
        match result {
            Ok(o) => {
                stats.record(target, o, done.duration_since(intended).as_nanos() as u64);
                if jobs.is_some() {
                    let _ = stats
                        .service
                        .record((done.duration_since(sent).as_nanos() as u64).max(1));
                    let _ = stats
                        .lag
                        .record((sent.duration_since(intended).as_nanos() as u64).max(1));
                }
                ctx.record_event(&mut stats, target, tenant, done, o.allowed);
            }
            Err(kind) => {
                stats.error(target, &kind);
                // A refused connection fails at once: do not spin on it.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    stats
}
