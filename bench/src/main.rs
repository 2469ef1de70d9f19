//! `bench`: the benchmark runner of tierlimit (`scripts/bench` runs it).
//!
//! | module | what |
//! |---|---|
//! | [`knobs`] | the options: `BENCH_*` (and `ROLLOVER_*`) environment knobs |
//! | [`run`] | the run's directory, recorded command lines, loadgen and other tools run to completion |
//! | [`loadgen`] | loadgen's JSON summary, typed |
//! | [`world`] | the main run's processes (Redis, region-nodes, Tansu, aggregator), its config, Redis and metrics readings |
//! | [`scenario`] | one module per scenario, each returning a typed result |
//! | [`results`] | the results file: every run it holds, which run measured which section, recorded sections |
//! | [`target`] | a figure against its bound: the summary's met / not met |
//! | [`report`] | BENCHMARKS.md from the results file and `bench/BENCHMARKS.md.j2`, the machine, the charts |
//! | [`chart`] | SVG line charts of named series (plotters) |
//! | [`topic`] | what a Kafka topic carried between two sets of offsets |
//!
//! Every process is started through `testkit` (killed on drop, children die
//! with the runner); every wait polls a condition with a deadline.

mod chart;
mod knobs;
mod loadgen;
mod report;
mod results;
mod run;
mod scenario;
mod target;
mod topic;
mod world;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;

use crate::knobs::{Knobs, KAFKA_SIDE};
use crate::report::{Machine, Results};
use crate::results::{Provenance, RunKind, RunRecord};
use crate::run::Run;
use crate::scenario::{
    accuracy, baseline, ceiling, cluster, crossings, envoy, fast_path, flood, kafka, latency,
    leases, limits, periods, regions20, rollover, saturation, scale,
};
use crate::world::{start_node, Region};

fn main() -> ExitCode {
    let knobs = Knobs::from_env();
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
    if k.runs("rollover")
        || k.runs("regions20")
        || k.runs("limits")
        || KAFKA_SIDE.iter().any(|s| k.runs(s))
    {
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
    if knobs.render {
        let results = read_results(&knobs.results)?;
        write_markdown(&results, &knobs.out)?;
        eprintln!(
            "bench: {} rendered from {}",
            knobs.out.display(),
            knobs.results.display()
        );
        return Ok(());
    }
    if let Some(dir) = &knobs.report_from {
        let mut results = read_results(&dir.join("results").join("bench.json"))?;
        let written = publish(&mut results, &knobs)?;
        eprintln!(
            "bench: report from {} written to {}",
            dir.display(),
            written.display()
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
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let run_date = report::utc(now, false) + " UTC";
    let label = if k.only.is_empty() {
        "all".to_string()
    } else {
        k.only.join("-")
    };
    let quick = if k.quick { "-quick" } else { "" };
    let record = RunRecord {
        id: format!(
            "{}-{label}{quick}",
            report::utc(now, false).replace([' ', ':'], "-")
        ),
        kind: Some(if k.only.is_empty() {
            RunKind::Full
        } else {
            RunKind::Partial
        }),
        profile: k.profile(),
        started: Some(run_date),
        invocation: invocation(),
        only: k.only.clone(),
        machine: Some(Machine::describe()),
        load_before: Some(testkit::load_average()),
        knobs: Some(k.clone()),
        ..Default::default()
    };
    let mut r = Results::new(record);
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
            r.peer = peer.map(|mut p| {
                p.region_node = Some(c.node.clone());
                (p.connections, p.tenants, p.duration) = (c.connections, c.tenants, c.duration);
                p
            });
            r.ceiling = Some(c);
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
                let mut f = fast_path::run(&run, &k, &node, redis_path).await?;
                f.redis_path = r.ceiling.as_ref().map(|c| c.node.clone());
                r.fast_path = Some(f);
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
            r.provenance.runs[0].config = std::fs::read_to_string(&cfg).ok();
            drop(node);
            drop(agg);
            drop(tansu);
        } else {
            r.provenance.runs[0].config = std::fs::read_to_string(&cfg).ok();
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

    if k.runs("flood") {
        // Its own Redis and node, Kafka detached.
        match flood::run(&run, &k).await {
            Ok(f) => r.flood = Some(f),
            Err(e) => run.say(&format!("the flood run failed: {e:#}")),
        }
    }

    if k.runs("periods") {
        // Its own Redis, Tansu, aggregator and node.
        match periods::run(&run, &k).await {
            Ok(p) => r.periods = Some(p),
            Err(e) => run.say(&format!("the periods run failed: {e:#}")),
        }
    }

    if k.runs("limits") {
        // Its own Redis, Tansu, aggregators and nodes, one process at a
        // time; the main run's are stopped by now.
        // A task of its own, like 6b's: a panic of testkit's (a process
        // not ready in time) leaves the other scenarios' figures.
        let (run2, k2) = (Arc::clone(&run), k.clone());
        match tokio::spawn(async move { limits::run(&run2, &k2).await }).await {
            Ok(Ok(l)) => r.limits = Some(l),
            Ok(Err(e)) => {
                run.say(&format!("the limits run failed: {e:#}"));
                r.limits_error = Some(format!("{e:#}"));
            }
            Err(e) => {
                run.say(&format!("the limits run failed: {e}"));
                r.limits_error = Some(e.to_string());
            }
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

    run.mark_load("end".into());
    {
        let rec = &mut r.provenance.runs[0];
        rec.loads = run.loads();
        rec.load_after = Some(testkit::load_average());
        rec.elapsed_s = Some(run.started.elapsed().as_secs());
        rec.commands = Some(run.commands());
    }
    let id = r.provenance.runs[0].id.clone();
    r.attribute_to(&id);
    run.save("bench", &r)?;
    let written = publish(&mut r, &k)?;
    run.save("bench", &r)?;
    run.say(&format!(
        "done in {}s: {}",
        run.started.elapsed().as_secs(),
        written.display()
    ));
    Ok(keep)
}

/// How this run was started, as a user would type it: the `BENCH_*` and
/// `ROLLOVER_*` variables set, then the arguments (`--bin-dir`, which
/// `scripts/bench` adds, left out).
fn invocation() -> String {
    let mut words: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("BENCH_") || k.starts_with("ROLLOVER_"))
        .map(|(k, v)| format!("{k}={}", run::shell_quote(&v)))
        .collect();
    words.sort();
    words.push("scripts/bench".into());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--bin-dir" {
            args.next();
        } else if !a.starts_with("--bin-dir=") {
            words.push(run::shell_quote(&a));
        }
    }
    words.join(" ")
}

/// Reads a results file (a full run's, or a kept run's `bench.json`).
fn read_results(path: &Path) -> anyhow::Result<Results> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))
}

/// Writes `value` as pretty JSON, through a temporary file so that a
/// failed write leaves the old file.
fn write_json(path: &Path, value: &Results) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(value)? + "\n")
        .with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))
}

/// Where a run's results go, and the report with them: a full run (every
/// scenario, full profile) replaces the results file and BENCHMARKS.md,
/// keeping the sections recorded outside the runner (still marked with
/// their own runs); any other run writes `runs/ID.json` and `runs/ID.md`
/// beside the results file and touches nothing else. Returns the Markdown
/// file written.
fn publish(r: &mut Results, k: &Knobs) -> anyhow::Result<PathBuf> {
    let full = matches!(r.provenance.runs.as_slice(),
        [one] if one.kind == Some(RunKind::Full) && one.profile == results::Profile::Full);
    if full {
        if let Ok(old) = read_results(&k.results) {
            carry_recorded(&mut r.provenance, &old.provenance);
        }
        let dir = k
            .out
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        r.charts.clear();
        report::charts(r, &dir.join("benchmarks"))?;
        write_json(&k.results, r)?;
        write_markdown(r, &k.out)?;
        Ok(k.out.clone())
    } else {
        let dir = k.results.parent().unwrap_or(Path::new(".")).join("runs");
        let id = r
            .provenance
            .runs
            .first()
            .map_or("run".to_string(), |run| run.id.clone());
        // No charts: they would replace the full run's.
        r.charts.clear();
        write_json(&dir.join(format!("{id}.json")), r)?;
        let md = dir.join(format!("{id}.md"));
        write_markdown(r, &md)?;
        Ok(md)
    }
}

/// The sections recorded outside the runner, and the runs they name,
/// carried from the previous results file into a full run's: the runner
/// cannot measure them again, and dropping them would lose their figures.
fn carry_recorded(into: &mut Provenance, old: &Provenance) {
    let named: std::collections::BTreeSet<&str> = old
        .recorded
        .iter()
        .map(|r| r.source.run.as_str())
        .chain(old.recorded_rows.iter().map(|r| r.source.run.as_str()))
        .collect();
    for run in &old.runs {
        if named.contains(run.id.as_str()) && into.run(&run.id).is_none() {
            into.runs.push(run.clone());
        }
    }
    into.recorded = old.recorded.clone();
    into.recorded_rows = old.recorded_rows.clone();
}

/// `out` rendered from `r` (written to a temporary file first, so a failed
/// render leaves the old one).
fn write_markdown(r: &Results, out: &Path) -> anyhow::Result<()> {
    let md = report::render(r)?;
    let tmp = out.with_extension("md.tmp");
    std::fs::write(&tmp, md).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, out).with_context(|| format!("rename to {}", out.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::{Profile, Recorded, Source};

    fn knobs(dir: &Path, only: &[&str]) -> Knobs {
        let mut args = vec!["bench".to_string()];
        if !only.is_empty() {
            args.extend(["--only".to_string(), only.join(",")]);
        }
        let mut k = <Knobs as clap::Parser>::parse_from(args);
        k.out = dir.join("BENCHMARKS.md");
        k.results = dir.join("benchmarks").join("results.json");
        k
    }

    fn run_of(id: &str, k: &Knobs) -> Results {
        let mut r = Results::new(RunRecord {
            id: id.into(),
            kind: Some(if k.only.is_empty() {
                RunKind::Full
            } else {
                RunKind::Partial
            }),
            profile: k.profile(),
            started: Some("2026-11-27 16:00 UTC".into()),
            elapsed_s: Some(60),
            only: k.only.clone(),
            machine: Some(Machine::default()),
            ..Default::default()
        });
        r.attribute_to(id);
        r
    }

    #[test]
    fn a_partial_run_writes_its_own_files_and_leaves_benchmarks_md_alone() {
        let dir = testkit::tempfile::tempdir().unwrap();
        let k = knobs(dir.path(), &["leases"]);
        let mut r = run_of("2026-11-27-16-00-leases", &k);
        let written = publish(&mut r, &k).unwrap();
        let runs = dir.path().join("benchmarks").join("runs");
        assert_eq!(written, runs.join("2026-11-27-16-00-leases.md"));
        assert!(runs.join("2026-11-27-16-00-leases.json").exists());
        assert!(!k.out.exists() && !k.results.exists());
    }

    #[test]
    fn a_quick_run_of_everything_is_a_partial_one_too() {
        let dir = testkit::tempfile::tempdir().unwrap();
        let mut k = knobs(dir.path(), &[]);
        k.quick = true;
        assert_eq!(k.profile(), Profile::Quick);
        let mut r = run_of("2026-11-27-16-00-all-quick", &k);
        publish(&mut r, &k).unwrap();
        assert!(!k.out.exists() && !k.results.exists());
        let md = std::fs::read_to_string(
            dir.path()
                .join("benchmarks/runs/2026-11-27-16-00-all-quick.md"),
        )
        .unwrap();
        assert!(md.contains("the quick profile"), "{md}");
        assert!(md.contains("(budget ≤ 900 s: met)"), "{md}");
    }

    #[test]
    fn a_full_run_rewrites_both_files_and_keeps_the_recorded_sections() {
        let dir = testkit::tempfile::tempdir().unwrap();
        let k = knobs(dir.path(), &[]);
        let mut old = run_of("old-partial", &knobs(dir.path(), &["envoy"]));
        old.provenance.runs.push(RunRecord {
            id: "by-hand".into(),
            kind: Some(RunKind::Manual),
            ..Default::default()
        });
        old.provenance.recorded.push(Recorded {
            slot: "view".into(),
            source: Source {
                run: "by-hand".into(),
                note: None,
            },
            body: "A table measured by hand.".into(),
        });
        write_json(&k.results, &old).unwrap();
        let mut r = run_of("2026-11-27-16-00-all", &k);
        publish(&mut r, &k).unwrap();
        let new: Results = read_results(&k.results).unwrap();
        let ids: Vec<&str> = new.provenance.runs.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["2026-11-27-16-00-all", "by-hand"]);
        let md = std::fs::read_to_string(&k.out).unwrap();
        assert!(
            md.contains("Figures from one run of `scripts/bench`"),
            "{md}"
        );
        assert!(md.contains("A table measured by hand."), "{md}");
        assert!(md.contains("from run `by-hand`"), "{md}");
        assert_eq!(md, report::render(&new).unwrap());
    }
}
