//! The results file (`benchmarks/results.json`, or a partial run's
//! `benchmarks/runs/DATE-NAMES.json`): every figure BENCHMARKS.md shows,
//! typed, with the run it came from.
//!
//! Why provenance is per section and not per file: until a full run is made
//! on one commit, BENCHMARKS.md holds sections measured by different partial
//! runs (and some measured by hand, outside the runner). The file says which
//! run measured which section, so the report can say it too, instead of a
//! header claiming one run for everything. A full run has one
//! [`RunRecord`] and every section points to it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::report::Machine;
use crate::target::Target;

/// The results file's format; bumped when a change would make an older
/// file render wrongly rather than fail to parse.
pub const SCHEMA: u32 = 1;

/// How a run was made, which decides where its results may go: only a
/// [`RunKind::Full`] run of the full profile rewrites BENCHMARKS.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// `scripts/bench` with every scenario.
    Full,
    /// `BENCH_ONLY=…` or `--quick`: its own file under `benchmarks/runs/`.
    Partial,
    /// A command outside the runner (callgrind, `cargo bench`, a
    /// hand-driven session); its figures are recorded text.
    Manual,
}

/// The size of every scenario: the full profile is what BENCHMARKS.md
/// reports; the quick one checks the pipeline end to end in minutes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    #[default]
    Full,
    Quick,
}

/// One run whose figures the file holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RunRecord {
    /// Referenced by [`Source::run`].
    pub id: String,
    pub kind: Option<RunKind>,
    pub profile: Profile,
    /// `YYYY-MM-DD HH:MM UTC`, or `None` when nobody wrote it down.
    pub started: Option<String>,
    pub elapsed_s: Option<u64>,
    /// How the run was started, as a user would type it.
    pub invocation: String,
    /// The scenarios it ran (`BENCH_ONLY`); empty: all of them.
    pub only: Vec<String>,
    /// `None`: not recorded (a run from before the runner recorded it).
    pub machine: Option<Machine>,
    /// What is known of the machine when [`RunRecord::machine`] is not.
    pub machine_note: Option<String>,
    /// `/proc/loadavg`'s three load averages before the first scenario and
    /// after the last: on a shared machine they say how much CPU was left.
    pub load_before: Option<String>,
    pub load_after: Option<String>,
    /// (scenario, 1-min load average as it started), then ("end", …).
    pub loads: Vec<(String, String)>,
    /// Every command the run spawned, in order, as it spawned it; `None`
    /// when the run did not record them.
    pub commands: Option<Vec<String>>,
    /// The main run's configuration file.
    pub config: Option<String>,
    pub knobs: Option<Knobs>,
    pub note: Option<String>,
}

/// Where a section's figures come from.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Source {
    /// A [`RunRecord::id`].
    pub run: String,
    /// What a reader must know about these figures (stale code, another
    /// run's figures it replaced).
    pub note: Option<String>,
}

/// A section measured outside the runner, kept as recorded text with the
/// run it came from. Its figures are not typed: the runner cannot measure
/// them again, so a full run carries them over unchanged, still marked
/// with their own run, rather than dropping or freshening them.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Recorded {
    /// Where the template places it.
    pub slot: String,
    pub source: Source,
    /// Markdown.
    pub body: String,
}

/// A summary row of a recorded section: its figure and target typed, so
/// that the generator, not the text, says whether the target is met.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RecordedRow {
    pub section: String,
    pub what: String,
    /// Markdown around the figure, `{}` where the figure goes.
    pub result: String,
    /// `None`: a row with no numeric bound ([`RecordedRow::target_text`]
    /// says what was aimed at), which the generator does not judge.
    pub target: Option<Target>,
    /// The figure of a row without a target.
    pub figure: Option<f64>,
    pub target_text: Option<String>,
    pub source: Source,
}

impl RecordedRow {
    pub fn figure(&self) -> Option<f64> {
        self.target.as_ref().and_then(|t| t.figure).or(self.figure)
    }
}

/// What the generator needs beside the scenarios' typed results.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Provenance {
    pub runs: Vec<RunRecord>,
    /// Section (a scenario's name) → where its figures come from.
    pub sources: BTreeMap<String, Source>,
    pub recorded: Vec<Recorded>,
    pub recorded_rows: Vec<RecordedRow>,
}

/// Why a results file cannot be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ProvenanceError {
    #[error("section {section:?} names run {run:?}, which the file does not list")]
    UnknownRun { section: String, run: String },
    #[error("the file lists run {0:?} twice")]
    DuplicateRun(String),
    #[error("results schema {found}, this runner renders {SCHEMA}")]
    Schema { found: u32 },
}

impl Provenance {
    /// Every source names a listed run, and no run is listed twice: a
    /// figure whose run is unknown would be printed without a date.
    pub fn check(&self) -> Result<(), ProvenanceError> {
        let mut ids = std::collections::BTreeSet::new();
        for r in &self.runs {
            if !ids.insert(r.id.as_str()) {
                return Err(ProvenanceError::DuplicateRun(r.id.clone()));
            }
        }
        let named = self
            .sources
            .iter()
            .map(|(s, src)| (s.clone(), &src.run))
            .chain(
                self.recorded
                    .iter()
                    .map(|r| (r.slot.clone(), &r.source.run)),
            )
            .chain(
                self.recorded_rows
                    .iter()
                    .map(|r| (r.section.clone(), &r.source.run)),
            );
        for (section, run) in named {
            if !ids.contains(run.as_str()) {
                return Err(ProvenanceError::UnknownRun {
                    section,
                    run: run.clone(),
                });
            }
        }
        Ok(())
    }

    pub fn run(&self, id: &str) -> Option<&RunRecord> {
        self.runs.iter().find(|r| r.id == id)
    }

    /// The runs whose figures the typed sections print: those a section
    /// names. Runs carried along only for recorded sections (hand
    /// measurements, or the partial runs a recorded text quotes) are not
    /// among them, so a full run's report is still the report of one run.
    /// With no typed section, every run the runner made.
    pub fn measuring_runs(&self) -> Vec<&RunRecord> {
        let named: Vec<&RunRecord> = self
            .runs
            .iter()
            .filter(|r| self.sources.values().any(|s| s.run == r.id))
            .collect();
        if !named.is_empty() {
            return named;
        }
        self.runs
            .iter()
            .filter(|r| r.kind != Some(RunKind::Manual))
            .collect()
    }
}
