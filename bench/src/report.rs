//! BENCHMARKS.md: the run's typed results rendered through the template
//! `bench/BENCHMARKS.md.j2` (minijinja), which holds every word of prose;
//! here only the machine's description, number formatting filters and the
//! charts.

use std::path::Path;

use anyhow::Context;
use minijinja::value::Value;
use minijinja::{Environment, UndefinedBehavior};
use serde::{Deserialize, Serialize};

use crate::chart::{line_chart, Chart, Series};
use crate::loadgen::Summary;
use crate::results::{Provenance, RunRecord, Source, SCHEMA};
use crate::scenario::{
    accuracy::Accuracy, ceiling::Ceiling, crossings::Crossings, fast_path::FastPath, kafka::Kafka,
    latency::Latency, peer::Peer, rollover::Rollover, saturation::Saturation, scale::Scale,
};

/// The template, compiled in (scripts/bench rebuilds the runner first).
pub const TEMPLATE: &str = include_str!("../BENCHMARKS.md.j2");

/// Everything the report shows, as written to the results file
/// (`benchmarks/results.json` for a full run, `benchmarks/runs/…json` for
/// a partial one) and rendered into BENCHMARKS.md. A scenario that did not
/// run is `None`; [`Provenance`] says which run measured each one.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Results {
    /// [`crate::results::SCHEMA`] when written.
    pub schema: u32,
    #[serde(flatten)]
    pub provenance: Provenance,
    pub ceiling: Option<Ceiling>,
    pub latency: Option<Latency>,
    #[serde(default)]
    pub saturation: Option<Saturation>,
    pub fast_path: Option<FastPath>,
    pub kafka: Option<Kafka>,
    pub accuracy: Option<Accuracy>,
    pub crossings: Option<Crossings>,
    pub scale: Option<Scale>,
    #[serde(default)]
    pub regions20: Option<crate::scenario::regions20::Regions20>,
    #[serde(default)]
    pub flood: Option<crate::scenario::flood::Flood>,
    #[serde(default)]
    pub periods: Option<crate::scenario::periods::Periods>,
    #[serde(default)]
    pub limits: Option<crate::scenario::limits::LimitsBench>,
    #[serde(default)]
    pub limits_error: Option<String>,
    pub rollover: Option<Rollover>,
    pub rollover_error: Option<String>,
    pub peer: Option<Peer>,
    #[serde(default)]
    pub cluster: Option<crate::scenario::cluster::ClusterBench>,
    #[serde(default)]
    pub leases: Option<crate::scenario::leases::LeaseBench>,
    pub baseline: Option<crate::scenario::baseline::BaselineBench>,
    #[serde(default)]
    pub envoy: Option<crate::scenario::envoy::EnvoyBench>,
    /// Charts written beside the report (name → relative path).
    #[serde(default)]
    pub charts: std::collections::BTreeMap<String, String>,
}

impl Results {
    /// A run that has measured nothing yet: one [`RunRecord`], which every
    /// section the run fills in will name.
    pub fn new(run: RunRecord) -> Results {
        Results {
            schema: SCHEMA,
            provenance: Provenance {
                runs: vec![run],
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The names of the scenarios this file holds figures of.
    pub fn present(&self) -> Vec<&'static str> {
        let has = [
            ("ceiling", self.ceiling.is_some()),
            ("latency", self.latency.is_some()),
            ("saturation", self.saturation.is_some()),
            ("fast_path", self.fast_path.is_some()),
            ("kafka", self.kafka.is_some()),
            ("accuracy", self.accuracy.is_some()),
            ("crossings", self.crossings.is_some()),
            ("scale", self.scale.is_some()),
            ("regions20", self.regions20.is_some()),
            ("flood", self.flood.is_some()),
            ("periods", self.periods.is_some()),
            (
                "limits",
                self.limits.is_some() || self.limits_error.is_some(),
            ),
            (
                "rollover",
                self.rollover.is_some() || self.rollover_error.is_some(),
            ),
            ("peer", self.peer.is_some()),
            ("cluster", self.cluster.is_some()),
            ("leases", self.leases.is_some()),
            ("baseline", self.baseline.is_some()),
            ("envoy", self.envoy.is_some()),
        ];
        has.iter().filter(|(_, h)| *h).map(|(n, _)| *n).collect()
    }

    /// Every section that holds figures names run `id` (a run just made).
    pub fn attribute_to(&mut self, id: &str) {
        for name in self.present() {
            self.provenance.sources.insert(
                name.to_string(),
                Source {
                    run: id.to_string(),
                    note: None,
                },
            );
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory: String,
    pub kernel: String,
    pub redis: String,
    pub tansu: String,
    pub rustc: String,
}

impl Machine {
    pub fn describe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .unwrap_or("")
            .trim()
            .to_string();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_kib: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let last_word = |s: String| s.split_whitespace().last().unwrap_or("").to_string();
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory: format!("{:.1} GiB", mem_kib / 1048576.0),
            kernel: format!(
                "{} {}",
                read("/proc/sys/kernel/ostype"),
                read("/proc/sys/kernel/osrelease")
            ),
            redis: redis_version(),
            tansu: testkit::try_tansu_bin()
                .map(|t| {
                    last_word(crate::run::version_of(
                        &t.display().to_string(),
                        &["--version"],
                    ))
                })
                .unwrap_or_default(),
            rustc: crate::run::version_of("rustc", &["--version"])
                .split_whitespace()
                .nth(1)
                .unwrap_or("")
                .to_string(),
        }
    }
}

/// `redis-server --version`'s `v=X.Y.Z`, as `X.Y.Z`.
pub fn redis_version() -> String {
    crate::run::version_of("redis-server", &["--version"])
        .split_whitespace()
        .nth(2)
        .unwrap_or("")
        .trim_start_matches("v=")
        .to_string()
}

/// A number as `jq` prints it: integers without a decimal point, others in
/// their shortest form.
pub fn num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

/// (year, month, day, hour, minute, second) of a Unix time, UTC.
fn civil(secs: u64) -> (i64, u64, u64, u64, u64, u64) {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u64;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u64;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// `YYYY-MM-DD HH:MM[:SS]` (UTC).
pub fn utc(secs: u64, seconds: bool) -> String {
    let (y, m, d, h, mi, s) = civil(secs);
    if seconds {
        format!("{y:04}-{m:02}-{d:02} {h:02}:{mi:02}:{s:02}")
    } else {
        format!("{y:04}-{m:02}-{d:02} {h:02}:{mi:02}")
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_iso(secs: u64) -> String {
    utc(secs, true).replace(' ', "T") + "Z"
}

fn as_f64(v: &Value) -> Option<f64> {
    if v.is_undefined() || v.is_none() {
        return None;
    }
    f64::try_from(v.clone()).ok()
}

/// The template's environment: its filters format numbers as the old
/// shell report did (`printf`, `jq`).
pub fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Chainable);
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(true);
    // Like jq: 3.5, 2, 1.84.
    env.add_filter("num", |v: Value| match as_f64(&v) {
        Some(x) => num(x),
        None => v.to_string(),
    });
    // Like printf %.Nf.
    env.add_filter("fixed", |v: Value, digits: usize| match as_f64(&v) {
        Some(x) => format!("{x:.digits$}"),
        None => "n/a".to_string(),
    });
    // µs → ms, 2 decimals, like jq's `/ 1000 * 100 | round / 100`.
    env.add_filter("ms", |v: Value| {
        num((as_f64(&v).unwrap_or(0.0) / 1000.0 * 100.0).round() / 100.0)
    });
    // Rounded to an integer (jq's round).
    env.add_filter("iround", |v: Value| num(as_f64(&v).unwrap_or(0.0).round()));
    // A number or "n/a" when absent.
    env.add_filter("na", |v: Value| match as_f64(&v) {
        Some(x) => num(x),
        None if v.is_undefined() || v.is_none() => "n/a".to_string(),
        None => v.to_string(),
    });
    // Compact JSON, like jq's tostring.
    env.add_filter("json", |v: Value| {
        serde_json::to_string(&v).unwrap_or_default()
    });
    env.add_template("BENCHMARKS.md", TEMPLATE)
        .expect("bench/BENCHMARKS.md.j2 is a valid template");
    env
}

/// A section's source as the template sees it: the run itself, and the
/// note.
#[derive(Serialize)]
struct SectionSource<'a> {
    run: &'a RunRecord,
    note: &'a Option<String>,
}

fn section_source<'a>(p: &'a Provenance, s: &'a Source) -> Option<SectionSource<'a>> {
    Some(SectionSource {
        run: p.run(&s.run)?,
        note: &s.note,
    })
}

/// Renders the report: the results, plus what the generator computes from
/// them (every target's verdict, each section's run).
pub fn render(results: &Results) -> anyhow::Result<String> {
    if results.schema != SCHEMA {
        return Err(crate::results::ProvenanceError::Schema {
            found: results.schema,
        }
        .into());
    }
    results.provenance.check()?;
    let p = &results.provenance;
    let src = |s| section_source(p, s);
    let sources: std::collections::BTreeMap<&str, SectionSource> = p
        .sources
        .iter()
        .filter_map(|(name, s)| Some((name.as_str(), src(s)?)))
        .collect();
    let recorded: Vec<_> = p
        .recorded
        .iter()
        .filter_map(|r| {
            Some(minijinja::context! {
                slot => r.slot,
                body => r.body,
                source => Value::from_serialize(src(&r.source)?),
            })
        })
        .collect();
    let recorded_rows: Vec<_> = p
        .recorded_rows
        .iter()
        .filter_map(|r| {
            let judged = r.target.clone().map(crate::target::Judged::from);
            let figure = r.figure().map(num).unwrap_or_else(|| "n/a".into());
            Some(minijinja::context! {
                section => r.section,
                what => r.what,
                result => r.result.replace("{}", &figure),
                target => Value::from_serialize(&judged),
                target_text => r.target_text,
                source => Value::from_serialize(src(&r.source)?),
            })
        })
        .collect();
    // The run that measured every typed section, when there is one: runs
    // carried along with their recorded sections do not make a full run's
    // report a merge.
    let bench_runs: Vec<&RunRecord> = p.measuring_runs();
    let only_run = match bench_runs.as_slice() {
        [one] => Some(*one),
        _ => None,
    };
    let env = environment();
    let tmpl = env.get_template("BENCHMARKS.md")?;
    let ctx = minijinja::context! {
        t => Value::from_serialize(crate::target::of(results)),
        src => Value::from_serialize(&sources),
        recorded_slots => p.recorded.iter().map(|r| r.slot.as_str()).collect::<Vec<_>>(),
        recorded => recorded,
        recorded_rows => recorded_rows,
        only_run => Value::from_serialize(only_run),
        ..Value::from_serialize(results)
    };
    tmpl.render(ctx).context("rendering bench/BENCHMARKS.md.j2")
}

/// Writes the charts into `dir` (`benchmarks/` beside the report) and
/// records them in `results.charts`.
pub fn charts(results: &mut Results, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut runs: Vec<(&str, &Summary)> = Vec::new();
    if let Some(c) = &results.ceiling {
        runs.push(("1 region-node (closed loop)", &c.node));
        runs.push(("1 bare EVALSHA, redis-rs (closed)", &c.evalsha_mux));
        runs.push(("1 region-node, Zipf tenants", &c.node_zipf));
    }
    if let Some(l) = &results.latency {
        runs.push(("2 region-node at 50 % (open loop)", &l.check));
        runs.push(("2 bare EVALSHA at 50 % (open loop)", &l.evalsha));
    }
    if let Some(f) = &results.fast_path {
        runs.push(("3 over-limit fast path", &f.run));
    }
    if let Some(p) = &results.peer {
        runs.push(("7 throttlecrab-server", &p.run));
    }
    let labels = ["p50", "p90", "p99", "p99.9", "p99.99", "max"];
    let series: Vec<Series> = runs
        .iter()
        .filter_map(|(name, s)| {
            let p = s.latency_us.as_ref()?;
            let ms = [p.p50, p.p90, p.p99, p.p99_9, p.p99_99, p.max].map(|us| us / 1000.0);
            Some(Series::new(
                *name,
                ms.iter().enumerate().map(|(i, v)| (i as f64, *v)).collect(),
            ))
        })
        .collect();
    if !series.is_empty() {
        line_chart(
            &dir.join("latency.svg"),
            &Chart {
                title: "Latency percentiles per scenario".into(),
                x_desc: "percentile".into(),
                y_desc: "latency, ms (log scale)".into(),
                x_labels: labels.iter().map(|s| s.to_string()).collect(),
                log_y: true,
            },
            &series,
        )?;
        results
            .charts
            .insert("latency".into(), "benchmarks/latency.svg".into());
    }
    if let Some(acc) = results
        .crossings
        .as_ref()
        .and_then(|c| c.run.accuracy.as_ref())
    {
        let d = &acc.per_tenant.crossing_to_all_denying_ms;
        // Share of crossings at or below each time (nearest rank), from
        // every crossing when loadgen listed them, else its percentiles.
        let points: Vec<(f64, f64)> = if !d.all.is_empty() {
            // A step from 0: the share rises at each crossing's time.
            let n = d.all.len() as f64;
            let mut pts = vec![(0.0, 0.0)];
            for (i, ms) in d.all.iter().enumerate() {
                pts.push((*ms, i as f64 / n * 100.0));
                pts.push((*ms, (i + 1) as f64 / n * 100.0));
            }
            pts
        } else {
            [(d.p50, 50.0), (d.p90, 90.0), (d.p99, 99.0), (d.max, 100.0)]
                .iter()
                .filter_map(|(v, p)| Some(((*v)?, *p)))
                .collect()
        };
        if !points.is_empty() {
            line_chart(
                &dir.join("crossings.svg"),
                &Chart {
                    title: "5b: crossing → every region denying".into(),
                    x_desc: "time from the crossing to every region denying, ms".into(),
                    y_desc: "crossings at or below, %".into(),
                    x_labels: Vec::new(),
                    log_y: false,
                },
                &[Series::new(
                    format!("{} crossings (cumulative)", d.n),
                    points,
                )],
            )?;
            results
                .charts
                .insert("crossings".into(), "benchmarks/crossings.svg".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_dates_print_like_the_shell_report() {
        assert_eq!(num(26713.0), "26713");
        assert_eq!(num(3.5), "3.5");
        assert_eq!(num(1.84), "1.84");
        assert_eq!(utc(0, true), "1970-01-01 00:00:00");
        assert_eq!(utc(1_795_219_200, false), "2026-11-21 00:00");
        assert_eq!(utc_iso(1_795_305_600), "2026-11-22T00:00:00Z");
    }

    /// A run of `only` that has measured nothing yet.
    fn run_of(only: &[&str]) -> Results {
        let mut args = vec!["bench"];
        if !only.is_empty() {
            args.push("--only");
        }
        let joined = only.join(",");
        if !only.is_empty() {
            args.push(&joined);
        }
        let knobs = <crate::knobs::Knobs as clap::Parser>::parse_from(args);
        Results::new(RunRecord {
            id: "r".into(),
            kind: Some(if only.is_empty() {
                crate::results::RunKind::Full
            } else {
                crate::results::RunKind::Partial
            }),
            started: Some("2026-11-21 15:25 UTC".into()),
            only: knobs.only.clone(),
            machine: Some(Machine::default()),
            load_before: Some("1 1 1".into()),
            knobs: Some(knobs),
            ..Default::default()
        })
    }

    /// The committed BENCHMARKS.md is exactly what the generator makes from
    /// the committed results file: a hand edit of either, or a template
    /// change without `scripts/bench --render`, fails here, in the test
    /// command, not in a reader's hands.
    #[test]
    fn the_committed_benchmarks_md_is_the_generators_output() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let read = |name: &str| {
            std::fs::read_to_string(root.join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"))
        };
        let results: Results = serde_json::from_str(&read("benchmarks/results.json"))
            .expect("benchmarks/results.json parses as the runner's results");
        let rendered = render(&results).expect("benchmarks/results.json renders");
        let committed = read("BENCHMARKS.md");
        if rendered != committed {
            let line = rendered
                .lines()
                .zip(committed.lines())
                .position(|(a, b)| a != b)
                .unwrap_or_else(|| rendered.lines().count().min(committed.lines().count()));
            panic!(
                "BENCHMARKS.md is not the generator's output from benchmarks/results.json \
                 (first difference at line {}: generated {:?}, committed {:?}); \
                 run `scripts/bench --render`",
                line + 1,
                rendered.lines().nth(line).unwrap_or("<end>"),
                committed.lines().nth(line).unwrap_or("<end>"),
            );
        }
    }

    /// Every section of a results file names a run it lists, so that no
    /// figure is printed without its date and machine.
    #[test]
    fn a_section_naming_an_unlisted_run_is_refused() {
        let mut results = run_of(&["envoy"]);
        results.provenance.sources.insert(
            "envoy".into(),
            Source {
                run: "elsewhere".into(),
                note: None,
            },
        );
        let err = render(&results).unwrap_err();
        assert!(err.to_string().contains("elsewhere"), "{err}");
    }

    #[test]
    fn the_template_renders_an_empty_run() {
        let results = run_of(&[]);
        let md = render(&results).unwrap();
        assert!(md.starts_with("# Benchmarks\n"));
        assert!(md.contains("## Commands"), "{md}");
        // No recorded section: no heading left empty.
        assert!(!md.contains("## Hot path"), "{md}");
    }

    #[test]
    fn the_regions20_section_renders_its_targets() {
        use crate::scenario::regions20::{Reading, Regions20};
        let mut results = run_of(&["regions20"]);
        let reading = |node_mib: u64, agg_mib: u64, at_s: u64| Reading {
            at_s,
            node_rss_kib: node_mib * 1024,
            agg_rss_kib: agg_mib * 1024,
            view_entries: Some(0.0),
            ..Default::default()
        };
        results.regions20 = Some(Regions20 {
            tenants: 100_000,
            near: 1_000,
            far: 99_000,
            regions: 20,
            rounds: 3,
            broadcast_fraction: 0.25,
            start: reading(18, 13, 0),
            after_far: reading(30, 80, 60),
            after_near: reading(33, 83, 100),
            near_parts: 20_000,
            far_parts: 198_000,
            agg_b_per_part_near: 120.4,
            agg_b_per_part_far: 300.0,
            ..Default::default()
        });
        let md = render(&results).unwrap();
        assert!(md.contains("### 6c. Twenty regions"), "{md}");
        assert!(md.contains("| 6c | aggregator RSS growth per region part of a counter at 20 regions (near phase) | **120 B**"), "{md}");
        assert!(md.contains("**30 MiB** after the far tenants"), "{md}");
        assert!(
            md.contains("| region-node eu-1 RSS | 18 MiB | 30 MiB | 33 MiB |"),
            "{md}"
        );
    }

    /// A partial run that a recorded section quotes is carried along with
    /// it; the report is still the full run's, with its wall time judged.
    #[test]
    fn runs_carried_for_recorded_sections_leave_one_runs_report() {
        let mut results = run_of(&[]);
        results.provenance.runs[0].elapsed_s = Some(1344);
        for section in ["envoy", "leases"] {
            results.provenance.sources.insert(
                section.into(),
                Source {
                    run: "r".into(),
                    note: None,
                },
            );
        }
        results.provenance.runs.push(RunRecord {
            id: "old-partial".into(),
            kind: Some(crate::results::RunKind::Partial),
            started: Some("2026-11-25 20:47 UTC".into()),
            ..Default::default()
        });
        results.provenance.recorded.push(crate::results::Recorded {
            slot: "scale".into(),
            source: Source {
                run: "old-partial".into(),
                note: None,
            },
            body: "a curve".into(),
        });
        let md = render(&results).unwrap();
        assert!(
            md.contains("Figures from one run of `scripts/bench`"),
            "{md}"
        );
        assert!(md.contains("1344 s (budget ≤ 3600 s: met)"), "{md}");
        assert!(md.contains("- run `old-partial`"), "{md}");
        // A typed section measured by the other run makes it a merge.
        results.provenance.sources.insert(
            "envoy".into(),
            Source {
                run: "old-partial".into(),
                note: None,
            },
        );
        let md = render(&results).unwrap();
        assert!(md.contains("come from 2 runs, not one"), "{md}");
    }

    #[test]
    fn the_periods_section_judges_three_tiers_against_one() {
        use crate::scenario::periods::{Periods, Populate};
        let mut results = run_of(&["periods"]);
        let populate = |agg: f64, redis: f64| Populate {
            agg_b_per_tenant: agg,
            redis_b_per_tenant: redis,
            restart_ready_s: Some(2.5),
            ..Default::default()
        };
        results.periods = Some(Periods {
            tenants: 1000,
            steady_tenants: 1000,
            day: populate(100.0, 200.0),
            three: populate(250.0, 300.0),
            day_usec_per_call: 20.0,
            three_usec_per_call: 25.0,
            day_deltas_per_1000: 10.0,
            three_deltas_per_1000: 30.0,
            script_ratio: 1.25,
            day_instructions: Some(100_000.0),
            three_instructions: Some(125_000.0),
            floor_instructions: Some(25_000.0),
            instructions_ratio: Some(1.25),
            deltas_ratio: 3.0,
            agg_bytes_ratio: 2.5,
            redis_bytes_ratio: 1.5,
            ..Default::default()
        });
        let md = render(&results).unwrap();
        assert!(md.contains("## 14. Calendar periods"), "{md}");
        assert!(
            md.contains("| **1.25×** (125000 vs 100000); in time, Redis µs per call of the script alone 1.25× (25.00 vs 20.00 µs) | ≤ 1.3× | met |"),
            "{md}"
        );
        assert!(
            md.contains("| **3.00×** (30.0 vs 10.0) | ≤ 1.2× | **not met** |"),
            "{md}"
        );
        assert!(
            md.contains("| **2.50×** (250 vs 100 B) | ≤ 2× | **not met** |"),
            "{md}"
        );
        assert!(
            md.contains("| **300 vs 200 B** (1.50×) | — (reported) |"),
            "{md}"
        );
        assert!(md.contains("the day tenants: 2.50 s"), "{md}");
    }

    #[test]
    fn the_flood_section_judges_what_refused_ids_cost() {
        use crate::scenario::flood::{Flood, Phase};
        let mut results = run_of(&["flood"]);
        let phase =
            |allowed: u64, denied: u64, keys: (u64, u64), commands: u64, rss: (u64, u64)| {
                let ids = (allowed + denied) as f64;
                Phase {
                    run: Summary {
                        completed_total: allowed + denied,
                        allowed,
                        denied,
                        ..Default::default()
                    },
                    keys_before: keys.0,
                    keys_after: keys.1,
                    commands,
                    commands_per_id: commands as f64 / ids,
                    node_rss_kib_before: rss.0,
                    node_rss_kib_after: rss.1,
                    node_b_per_id: (rss.1 as f64 - rss.0 as f64) * 1024.0 / ids,
                    ..Default::default()
                }
            };
        results.flood = Some(Flood {
            max_per_day: 1000,
            admitted: phase(1000, 0, (0, 1003), 2100, (20_000, 21_000)),
            invented: phase(0, 1000, (1003, 1003), 200, (21_000, 21_100)),
            again: phase(0, 1000, (1003, 1003), 1, (21_100, 21_100)),
            ..Default::default()
        });
        let md = render(&results).unwrap();
        assert!(md.contains("### 6d. Invented tenant ids"), "{md}");
        assert!(
            md.contains("checks allowed | **0** (2000 refused with 429, 0 errors) | = 0 | met |"),
            "{md}"
        );
        assert!(md.contains("which copy it: 200 commands) | **0.0010** (1 commands for 1000 ids) | ≤ 0.001 | met |"), "{md}");
        assert!(md.contains("| **0.0 B** | ≤ 16 B | met |"), "{md}");
        // A refused id that wrote a key, asked Redis or stayed in memory
        // misses.
        let f = results.flood.as_mut().unwrap();
        f.again.keys_after = 1004;
        f.again = phase(0, 1000, (1003, 1004), 1000, (21_100, 22_100));
        let md = render(&results).unwrap();
        assert!(md.contains("checks allowed | **1** (2000 refused"), "{md}");
        assert!(md.contains("| = 0 | **not met** |"), "{md}");
        assert!(
            md.contains("| **1.0000** (1000 commands for 1000 ids) | ≤ 0.001 | **not met** |"),
            "{md}"
        );
        assert!(
            md.contains("| **1024.0 B** | ≤ 16 B | **not met** |"),
            "{md}"
        );
    }

    #[test]
    fn the_limits_section_renders_its_targets_and_says_when_it_did_not_run() {
        use crate::scenario::limits::{derive, Dist, LimitsBench, Propagation, Start};
        let md = render(&run_of(&["envoy"])).unwrap();
        assert!(md.contains("| 13 | limits as data: start, RSS and propagation on the limits topic | not run in this run"), "{md}");
        let mut results = run_of(&["limits"]);
        let start = |process: &str, source: &str, tenants: u64, ready_s: f64, rss_mib: u64| Start {
            process: process.into(),
            source: source.into(),
            tenants,
            ready_s: Some(ready_s),
            rss_kib: rss_mib * 1024,
            redis_copy_bytes: (process == "region-node" && source == "topic")
                .then_some(tenants * 40),
            ..Default::default()
        };
        let mut l = LimitsBench {
            topic_counts: vec![1_000_000],
            file_counts: vec![1_000_000],
            starts: vec![
                start("region-node", "topic", 1, 1.0, 20),
                start("region-node", "file", 1, 1.0, 20),
                start("aggregator", "topic", 1, 2.0, 20),
                start("region-node", "topic", 1_000_000, 3.0, 40),
                start("region-node", "file", 1_000_000, 10.0, 500),
                start("aggregator", "topic", 1_000_000, 4.0, 60),
            ],
            idle: Some(Propagation {
                nodes_ms: Dist::of(vec![Some(100.0), Some(200.0)]),
                ..Default::default()
            }),
            ..Default::default()
        };
        derive(&mut l);
        assert_eq!(l.node_start_ratio, Some(0.3));
        results.limits = Some(l);
        let md = render(&results).unwrap();
        assert!(md.contains("## 13. Limits as data"), "{md}");
        assert!(
            md.contains("**0.30×** (3.00 vs 10.00 s; 2.00 vs 9.00 µs per tenant) | ≤ 0.5× | met |"),
            "{md}"
        );
        // 20 MiB over 1 M tenants: 20.97 B of RSS, 40 B in Redis.
        assert!(md.contains("**61 B** (RSS 21 B + Redis 40 B;"), "{md}");
        assert!(
            md.contains(
                "| 13 | aggregator RSS growth per tenant on the topic, 1000000 tenants | **42 B**"
            ),
            "{md}"
        );
        assert!(md.contains("**100.0 / 200.0 ms** (p50 / p99;"), "{md}");
        assert!(md.contains("not judged: 5b is not in this run"), "{md}");
    }

    #[test]
    fn the_latency_section_renders_every_level_and_the_inside_figures() {
        use crate::loadgen::Percentiles;
        use crate::scenario::latency::{BucketQuantiles, Latency, Level, ServerSide};
        let mut results = run_of(&["latency"]);
        let summary = |rps: f64, p50: f64, p99: f64| Summary {
            throughput_rps: rps,
            latency_us: Some(Percentiles {
                p50,
                p99,
                p99_9: p99 * 2.0,
                ..Default::default()
            }),
            ..Default::default()
        };
        let server = ServerSide {
            decision: BucketQuantiles {
                count: 1000,
                p50_ms: Some(0.1),
                p99_ms: Some(1.0),
                p99_9_ms: None,
                p99_above_ms: Some(0.75),
            },
            redis_call: BucketQuantiles {
                count: 400,
                p50_ms: Some(0.5),
                p99_ms: Some(2.5),
                p99_9_ms: Some(5.0),
                p99_above_ms: Some(2.0),
            },
            overhead: BucketQuantiles {
                count: 400,
                p50_ms: Some(0.025),
                p99_ms: Some(0.25),
                p99_9_ms: Some(1.0),
                p99_above_ms: Some(0.1),
            },
        };
        let level = |fraction: f64| Level {
            fraction,
            rate: (20000.0 * fraction) as u64,
            check: summary(20000.0 * fraction, 400.0, 3000.0),
            evalsha: summary(20000.0 * fraction, 200.0, 1000.0),
            server: Some(server.clone()),
        };
        results.latency = Some(Latency {
            rate: 10000,
            check: summary(10000.0, 400.0, 3000.0),
            evalsha: summary(10000.0, 200.0, 1000.0),
            server: Some(server.clone()),
            levels: crate::scenario::latency::LEVELS.map(level).to_vec(),
            ..Default::default()
        });
        let md = render(&results).unwrap();
        assert!(
            md.contains(
                "| 75 % | 15000 | 0.4 / 3 / 6 | 0.2 / 1 / 2 | 0.1 / 1 | 0.5 / 2.5 | 0.025 / 0.25 |"
            ),
            "{md}"
        );
        assert!(md.contains("| a decision | 1000 | 0.1 | 1 | n/a |"), "{md}");
        // 0.25 ms over the call's p99 bucket's lower bound, 2 ms: 0.125×,
        // missed (the upper bound 2.5 ms would have flattered it to 0.1×).
        assert!(
            md.contains("**0.125×** (≤ 0.25 ms vs > 2 ms) | ≤ 0.1× | **not met** |"),
            "{md}"
        );
        assert!(
            md.contains("| around the call: a check's time minus its call's (`tierlimit_decision_overhead_seconds`) | 400 | 0.025 | 0.25 | 1 |"),
            "{md}"
        );
        // A run from before the histogram: the old, unjudged row.
        let mut old = results.clone();
        if let Some(l) = old.latency.as_mut() {
            l.server.as_mut().unwrap().overhead = BucketQuantiles::default();
        }
        let md = render(&old).unwrap();
        assert!(
            md.contains("**≤ 1 ms** vs ≤ 2.5 ms | — (this run had"),
            "{md}"
        );
    }

    #[test]
    fn the_envoy_section_renders_its_rows_and_target() {
        let mut results = run_of(&["envoy"]);
        let row = |rps: f64, node: Option<f64>| crate::scenario::envoy::Row {
            rps,
            p50_ms: 1.5,
            p99_ms: 4.0,
            node_cpu_us: node,
            redis_cpu_us: node.map(|_| 30.0),
            envoy_cpu_us: Some(40.0),
            ..Default::default()
        };
        results.envoy = Some(crate::scenario::envoy::EnvoyBench {
            envoy_version: "1.40.0".into(),
            rounds: 3,
            duration: 5,
            connections: 50,
            tenants: 1000,
            ceiling: row(30000.0, None),
            rls: row(12000.0, Some(30.0)),
            http: row(15000.0, Some(36.0)),
            node_cpu_ratio: 30.0 / 36.0,
            node_redis_cpu_ratio: 60.0 / 66.0,
            rls_of_ceiling: 0.4,
            rls_of_http: 0.8,
            ..Default::default()
        });
        let md = render(&results).unwrap();
        assert!(md.contains("## 10. Envoy"), "{md}");
        assert!(md.contains("| Envoy + RLS over gRPC | 12000 | 1.50 | 4.00 | 30.0 | 30.0 | 40.0 |"));
        assert!(md.contains("| Envoy, no filter (ceiling) | 30000 |"));
        assert!(
            md.contains("**0.83×** (30.0 vs 36.0 µs) | ≤ 1× | met |"),
            "{md}"
        );
    }
}
