//! `demo`: three regions of tierlimit on loopback and a scripted story, run
//! by `scripts/demo`.
//!
//! It starts a Tansu broker (SQLite in the state directory), the aggregator,
//! and three regions (eu-west, us-east, ap-south), each with its own
//! `redis-server` and two region-nodes, on free loopback ports. us-east's
//! clients go through a real Envoy whose ratelimit filter asks its nodes
//! over gRPC (RLS v3), as a gateway in front of a service would; the other
//! regions' clients call region-node's HTTP API. Each region
//! reaches Kafka through its own link (a Kafka-aware proxy, see
//! [`proxy`]), so one region can be cut off from Kafka while everything
//! else keeps running. Then:
//!
//! 1. **steady**: acme, globex and initech send steady traffic in every
//!    region (acme refunds one unit in ten); nobody is denied;
//! 2. **region limit**: bursty floods eu-west past its region limit (300 per
//!    minute, sliding log): exactly 300 are allowed there, the rest denied by
//!    the region tier, while us-east keeps serving bursty normally;
//! 3. **upgrade**: initech moves to plan premium through the aggregator's
//!    limits API (the tenants are records of the limits topic): every
//!    region-node applies it, and the demo reports how long that took;
//! 4. **global limit**: hot pushes in all three regions past its daily limit
//!    of 2500: every region starts denying it from the broadcast view;
//! 5. **cut**: ap-south's link to Kafka is blackholed for 10 s: it keeps
//!    serving (node and region tiers are local), the aggregator stops hearing
//!    from it; then the link heals;
//! 6. **converge**: traffic stops; the aggregator's global count of every
//!    tenant must equal exactly what the clients were allowed minus what they
//!    refunded, and the regions' Redis truth; us-east's part of it must be
//!    exactly what its clients kept through Envoy, every check of which its
//!    nodes answered over gRPC;
//! 7. **calendars**: globex counts on Berlin's calendar; the regions' Redis
//!    clocks run ahead so that an hour ends early in the story, and the
//!    report shows that hour closed (every region's watermark past its end)
//!    with globex's hours adding up to its exact count.
//!
//! It prints progress while it runs and a report at the end, stops every
//! process it started (also on Ctrl-C), and exits 1 if any promise failed.
//!
//! One module per part: [`world`] starts everything (its processes come from
//! `testkit`) and reads it back, [`story`] tells the six phases, [`report`]
//! prints progress, promises and the report; [`traffic`] is the clients and
//! [`proxy`] each region's link to Kafka. This file only wires them: the
//! command line, signals, the runtime, and the exit code.

mod proxy;
mod report;
mod story;
mod traffic;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use clap::Parser;
use testkit::ProcGroup;

use crate::report::say;

/// tierlimit's local demo: Tansu, the aggregator and three regions (own
/// redis-server each, two region-nodes each) on loopback ports, driven
/// through a scripted story, then a report. Run it with scripts/demo, which
/// installs what is missing and builds the release binaries first.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// Directory holding the region-node and aggregator binaries [default:
    /// the directory of this binary].
    #[arg(long, env = "DEMO_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// State directory: configuration, logs, Tansu's SQLite database.
    /// Emptied at start and kept at the end for inspection.
    #[arg(long, env = "DEMO_STATE_DIR", default_value = ".tierlimit/demo")]
    state_dir: PathBuf,
    /// The tansu binary [default: $TANSU_BIN, else tansu on PATH, else
    /// ~/.cargo/bin/tansu].
    #[arg(long, env = "TANSU_BIN")]
    tansu: Option<PathBuf>,
    /// The redis-server binary.
    #[arg(long, env = "REDIS_SERVER_BIN", default_value = "redis-server")]
    redis_server: PathBuf,
    /// Seconds the cut region stays cut off from Kafka.
    #[arg(long, env = "DEMO_CUT_SECONDS", default_value_t = 10)]
    cut_seconds: u64,
    /// After the report, keep everything running (the aggregator's dashboard
    /// stays up) until Ctrl-C.
    #[arg(long, env = "DEMO_KEEP_RUNNING")]
    keep_running: bool,
}

/// With --keep-running: the verdict of the story (1 held, 2 failed), so that
/// the Ctrl-C ending it still exits with the story's result.
static VERDICT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

#[derive(Debug)]
struct Interrupted(&'static str);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", self.0)
    }
}

impl std::error::Error for Interrupted {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The main future runs on this thread, which starts every child: their
    // PR_SET_PDEATHSIG is tied to it and it lives as long as the demo.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let mut procs = ProcGroup::new();
    let started = Instant::now();
    let result = runtime.block_on(async {
        let signals = signals();
        tokio::select! {
            r = run(&cli, &mut procs) => r,
            s = signals => Err(anyhow!(Interrupted(s))),
        }
    });
    let interrupted = result
        .as_ref()
        .err()
        .is_some_and(|e| e.downcast_ref::<Interrupted>().is_some());
    if let Err(e) = &result {
        if !interrupted {
            eprintln!("\ndemo: error: {e:#}");
            for p in procs.iter() {
                let tail = p.log_tail(8);
                if !tail.is_empty() {
                    eprintln!(
                        "----- last lines of {} ({}) -----\n{tail}",
                        p.label(),
                        p.log_path().display()
                    );
                }
            }
        }
    }
    let result = match (VERDICT.load(std::sync::atomic::Ordering::SeqCst), result) {
        (1, Err(_)) => Ok(true),
        (2, Err(_)) => Ok(false),
        (_, r) => r,
    };
    let stopped = procs.stop_all(Duration::from_secs(5));
    println!(
        "\ndemo: stopped {stopped} processes; state and logs kept in {} ({:.0} s in all)",
        cli.state_dir.display(),
        started.elapsed().as_secs_f64()
    );
    runtime.shutdown_timeout(Duration::from_millis(200));
    match result {
        Ok(true) => {
            println!("demo: every promise held");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("demo: FAILED: at least one promise did not hold (see the report above)");
            ExitCode::FAILURE
        }
        Err(_) if interrupted => {
            println!("demo: interrupted");
            ExitCode::from(130)
        }
        Err(_) => ExitCode::from(2),
    }
}

async fn signals() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    tokio::select! {
        _ = int.recv() => "Ctrl-C",
        _ = term.recv() => "SIGTERM",
        _ = hup.recv() => "SIGHUP",
    }
}

/// World → story → report; with --keep-running, then waits for a signal.
async fn run(cli: &Cli, procs: &mut ProcGroup) -> anyhow::Result<bool> {
    let w = Arc::new(world::start(cli, procs).await?);
    let outcome = story::tell(&w, Duration::from_secs(cli.cut_seconds)).await?;
    let ok = report::report(&w, &outcome, &procs.dead());
    if cli.keep_running {
        VERDICT.store(if ok { 1 } else { 2 }, std::sync::atomic::Ordering::SeqCst);
        say(format!(
            "everything keeps running: dashboard {}/ , config {} ; Ctrl-C to stop",
            w.aggregator,
            w.config.display()
        ));
        std::future::pending::<()>().await;
    }
    Ok(ok)
}
