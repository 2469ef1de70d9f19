//! `bench`: the benchmark runner of tierlimit (`scripts/bench` runs it).
//!
//! | module | what |
//! |---|---|
//! | [`knobs`] | the options: `BENCH_*` (and `ROLLOVER_*`) environment knobs |
//! | [`run`] | the run's directory, recorded command lines, loadgen and other tools run to completion |
//! | [`loadgen`] | loadgen's JSON summary, typed |
//! | [`world`] | the main run's processes (Redis, region-nodes, Tansu, aggregator), its config, Redis and metrics readings |
//! | [`scenario`] | one module per scenario, each returning a typed result |
//! | [`report`] | BENCHMARKS.md from `bench/BENCHMARKS.md.j2`, the machine, the charts |
//! | [`chart`] | SVG line charts of named series (plotters) |
//! | [`topic`] | what a Kafka topic carried between two sets of offsets |
//!
//! Every process is started through `testkit` (killed on drop, children die
//! with the runner); every wait polls a condition with a deadline.

mod chart;
mod knobs;
mod loadgen;
mod report;
mod run;
mod scenario;
mod topic;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

use crate::knobs::{Knobs, KAFKA_SIDE};
use crate::report::{Machine, Results};
use crate::run::Run;
use crate::scenario::{
    accuracy, baseline, ceiling, cluster, crossings, envoy, fast_path, kafka, latency, leases,
    regions20, rollover, saturation, scale,
};
use crate::world::{start_node, Region};

fn main() -> ExitCode {
    let knobs = Knobs::parse();
    match main_sync(knobs) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\nbench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Fails early, naming `scripts/setup --bench`, if a tool a selected
/// scenario needs is missing (the runner installs nothing).
fn preflight(k: &Knobs) -> anyhow::Result<()> {
    let mut need = vec!["redis-server"];
    if k.runs("peer") {
        need.push("throttlecrab-server");
    }
    if k.runs("rollover") {
        need.push("cc");
    }
    for program in need {
        ceiling::which(program)?;
    }
    if k.runs("envoy") {
        testkit::try_envoy_bin().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    if k.runs("rollover") || k.runs("regions20") || KAFKA_SIDE.iter().any(|s| k.runs(s)) {
        testkit::try_tansu_bin().map_err(|e| anyhow::anyhow!("{e} (run scripts/setup --bench)"))?;
    }
    if k.runs("rollover") {
        let ok = std::process::Command::new("dpkg")
            .args(["-s", "libfaketime"])
            .output()
            .is_ok_and(|o| o.status.success());
        anyhow::ensure!(
            ok,
            "libfaketime is not installed: run scripts/setup --bench"
        );
    }
    Ok(())
}

fn main_sync(knobs: Knobs) -> anyhow::Result<()> {
    knobs.validate()?;
    if let Some(dir) = &knobs.report_from {
        let path = dir.join("results").join("bench.json");
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let mut results: Results =
            serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        write_report(&mut results, &knobs.out)?;
        eprintln!(
            "bench: report from {} written to {}",
            dir.display(),
            knobs.out.display()
        );
        return Ok(());
    }
    preflight(&knobs)?;
    let bin_dir = match &knobs.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("executable directory")?
            .to_path_buf(),
    };
    testkit::set_bin_dir(bin_dir);
    let tmp = testkit::tempfile::Builder::new()
        .prefix("tierlimit-bench.")
        .tempdir()?
        .keep();
    let guard = TmpGuard {
        dir: tmp.clone(),
        keep: knobs.keep,
        ok: false,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = rt.block_on(bench(knobs, tmp));
    let mut guard = guard;
    match outcome {
        Ok(keep) => {
            guard.ok = true;
            guard.keep |= keep;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Removes the run's directory at the end, unless asked to keep it or the
/// run failed (then it says where it is).
struct TmpGuard {
    dir: PathBuf,
    keep: bool,
    ok: bool,
}

impl Drop for TmpGuard {
    fn drop(&mut self) {
        if self.keep || !self.ok {
            eprintln!("bench: logs and results kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The whole run; returns whether the directory must be kept (a failed
/// rollover).
async fn bench(k: Knobs, tmp: PathBuf) -> anyhow::Result<bool> {
    let run = Arc::new(Run::new(tmp.clone(), testkit::bin_path("loadgen"))?);
    let run_date = report::utc(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs(),
        false,
    ) + " UTC";
    let load_start = testkit::load_average();
    let mut r = Results::new(run_date, k.clone(), Machine::describe(), load_start);
    let kafka_side = KAFKA_SIDE.iter().any(|s| k.runs(s));
    if k.runs("ceiling") || kafka_side {
        run.say(&format!("starting redis-servers (in {})", tmp.display()));
        let eu = Region::start(&run).await?;
        let us = Region::start(&run).await?;
        let ap = Region::start(&run).await?;
        // The brokers are filled in once Tansu runs (after scenarios 1 and
        // 2, which measure the decision path alone).
        let cfg = testkit::write_config(&tmp, &world::config(&k, "127.0.0.1:1", [&eu, &us, &ap]));

        if k.runs("ceiling") {
            // Scenarios 1, 2 and 7 measure the decision path alone:
            // region-node with its Kafka side detached (brokers on a closed
            // port), so that the 2 cores hold only what the ceiling run
            // holds too: Redis, the server under test and the load
            // generator.
            let solo = start_node(
                &run,
                &cfg,
                "eu",
                "eu-1",
                "/healthz",
                &[
                    ("TIERLIMIT__KAFKA__BROKERS", "127.0.0.1:1"),
                    ("TIERLIMIT__NODE__VIEW_WAIT", "0s"),
                ],
            )
            .await;
            let (c, peer) = ceiling::run(&run, &k, &solo, &eu, k.runs("peer")).await?;
            if k.runs("latency") {
                r.latency = Some(latency::run(&run, &k, c.node.throughput_rps, &solo, &eu).await?);
            }
            r.ceiling = Some(c);
            r.peer = peer;
        }

        if kafka_side {
            run.say("starting Tansu, the aggregator and region-node eu-1");
            let tansu = world::start_tansu(&run).await;
            let cfg =
                testkit::write_config(&tmp, &world::config(&k, &tansu.brokers(), [&eu, &us, &ap]));
            let agg = world::start_aggregator(&run, &cfg, &[]).await;
            let node = start_node(&run, &cfg, "eu", "eu-1", "/readyz", &[]).await;
            scenario::drained(&eu.conn, "the dirty set of runs 1-2 to drain", 120).await;
            if k.runs("fast_path") {
                let redis_path = r.ceiling.as_ref().map(|c| c.node.throughput_rps);
                r.fast_path = Some(fast_path::run(&run, &k, &node, redis_path).await?);
            }
            if k.runs("kafka") {
                r.kafka = Some(kafka::run(&run, &node, &eu.conn).await?);
            }
            if k.runs("accuracy") || k.runs("crossings") {
                if k.runs("accuracy") {
                    run.scenario(&format!(
                        "5/7 accuracy: three regions push acc0 past {}/day at {} req/s in all",
                        k.acc_limit, k.acc_rate
                    ));
                }
                let node_us = start_node(&run, &cfg, "us", "us-1", "/readyz", &[]).await;
                let node_ap = start_node(&run, &cfg, "ap", "ap-1", "/readyz", &[]).await;
                if k.runs("accuracy") {
                    r.accuracy =
                        Some(accuracy::run(&run, &k, [&node, &node_us, &node_ap], &agg).await?);
                }
                if k.runs("crossings") {
                    r.crossings = Some(
                        crossings::run(&run, &k, [&node, &node_us, &node_ap], &eu.conn).await?,
                    );
                }
                drop(node_ap);
                drop(node_us);
            }
            if k.runs("scale") {
                r.scale = Some(scale::run(&run, &k, &node, &agg, &eu.conn).await?);
            }
            r.config = std::fs::read_to_string(&cfg).ok();
            drop(node);
            drop(agg);
            drop(tansu);
        } else {
            r.config = std::fs::read_to_string(&cfg).ok();
        }
        drop((eu, us, ap));
    }

    if k.runs("regions20") {
        // Its own Redis, Tansu, aggregator and node; the main run's are
        // stopped by now.
        match regions20::run(&run, &k).await {
            Ok(r20) => r.regions20 = Some(r20),
            Err(e) => run.say(&format!("the regions20 run failed: {e:#}")),
        }
    }

    if k.runs("saturation") {
        // Its own Redis and node; the main run's are stopped by now.
        match saturation::run(&run, &k).await {
            Ok(s) => r.saturation = Some(s),
            Err(e) => run.say(&format!("the saturation run failed: {e:#}")),
        }
    }

    if k.runs("cluster") {
        // Its own Redis servers, cluster and sentinels; the main run's are
        // stopped by now.
        match cluster::run(&run, &k).await {
            Ok(c) => r.cluster = Some(c),
            Err(e) => run.say(&format!("the cluster run failed: {e:#}")),
        }
    }

    if k.runs("leases") {
        // Its own Redis servers and nodes, like scenario 8.
        match leases::run(&run, &k).await {
            Ok(l) => r.leases = Some(l),
            Err(e) => run.say(&format!("the leases run failed: {e:#}")),
        }
    }

    if k.runs("baseline") {
        // Its own Redis servers and nodes, like scenario 9; builds the old
        // region-node once.
        match baseline::run(&run, &k).await {
            Ok(b) => r.baseline = Some(b),
            Err(e) => run.say(&format!("the baseline run failed: {e:#}")),
        }
    }

    if k.runs("envoy") {
        // Its own Redis, region-node and two Envoys, like scenario 9.
        match envoy::run(&run, &k).await {
            Ok(e) => r.envoy = Some(e),
            Err(e) => run.say(&format!("the envoy run failed: {e:#}")),
        }
    }

    let mut keep = false;
    if k.runs("rollover") {
        // Its own stack under libfaketime; everything above is stopped, so
        // that the 2 cores and the memory are its own.
        run.scenario(&format!(
            "6b/7 day rollover: {} tenants before and after a faked UTC midnight",
            k.rollover_tenants
        ));
        let (run2, k2) = (Arc::clone(&run), k.clone());
        // A task of its own: a failure (or a panic of testkit's) of this
        // scenario leaves the others' figures to report.
        match tokio::spawn(async move { rollover::run(&run2, &k2).await }).await {
            Ok(Ok(roll)) => r.rollover = Some(roll),
            Ok(Err(e)) => {
                run.say(&format!("the rollover run failed: {e:#}"));
                r.rollover_error = Some(format!("{e:#}"));
                keep = true;
            }
            Err(e) => {
                run.say(&format!("the rollover run failed: {e}"));
                r.rollover_error = Some(e.to_string());
                keep = true;
            }
        }
    }

    run.say(&format!("writing {}", k.out.display()));
    run.mark_load("end".into());
    r.loads = run.loads();
    r.elapsed_s = run.started.elapsed().as_secs();
    r.commands = run.commands();
    run.save("bench", &r)?;
    write_report(&mut r, &k.out)?;
    run.save("bench", &r)?;
    run.say(&format!("done in {}s: {}", r.elapsed_s, k.out.display()));
    Ok(keep)
}

/// Charts into `benchmarks/` beside `out`, then `out` itself (written to a
/// temporary file first, so a failed render leaves the old one).
fn write_report(r: &mut Results, out: &std::path::Path) -> anyhow::Result<()> {
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    r.charts.clear();
    report::charts(r, &dir.join("benchmarks"))?;
    let md = report::render(r)?;
    let tmp = out.with_extension("md.tmp");
    std::fs::write(&tmp, md).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, out).with_context(|| format!("rename to {}", out.display()))?;
    Ok(())
}
