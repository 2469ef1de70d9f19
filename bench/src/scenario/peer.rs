//! Scenario 7, a peer: throttlecrab-server (crates.io; in-memory GCRA, no
//! shared state) on its HTTP transport, driven by the same `loadgen` with
//! the same connections and keys, in rounds alternating with scenario 1's
//! (which runs them: see [`super::ceiling`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use testkit::{start_on_free_port, Cmd, Proc};

use crate::loadgen::Summary;
use crate::run::{strings, Run};
use crate::scenario::ceiling::median_index;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Peer {
    pub version: String,
    /// The median round.
    pub run: Summary,
    pub rounds: Vec<f64>,
    /// Scenario 1's region-node median round of the same run, which these
    /// rounds alternate with: the comparison never mixes two runs, even in
    /// a results file whose §1 comes from another run.
    #[serde(default)]
    pub region_node: Option<Summary>,
    /// The load both were driven with.
    #[serde(default)]
    pub connections: u64,
    #[serde(default)]
    pub tenants: u64,
    #[serde(default)]
    pub duration: u64,
}

impl Peer {
    pub fn from_rounds(version: String, runs: Vec<Summary>) -> Peer {
        let rounds: Vec<f64> = runs.iter().map(|r| r.throughput_rps).collect();
        let run = runs[median_index(&rounds)].clone();
        Peer {
            version,
            run,
            rounds,
            region_node: None,
            connections: 0,
            tenants: 0,
            duration: 0,
        }
    }
}

/// `throttlecrab-server --version`'s last word.
pub fn version() -> String {
    crate::run::version_of("throttlecrab-server", &["--version"])
        .split_whitespace()
        .last()
        .unwrap_or("")
        .to_string()
}

/// A running throttlecrab-server.
pub struct Throttlecrab {
    _proc: Proc,
    port: u16,
}

/// Starts throttlecrab-server on a free port (recorded), ready once
/// `GET /health` answers 200.
pub async fn start(run: &Run) -> Throttlecrab {
    let bin =
        crate::scenario::ceiling::which("throttlecrab-server").unwrap_or_else(|e| panic!("{e}"));
    let log = run.tmp.join("throttlecrab.log");
    let args = |port: u16| {
        strings([
            "--http".to_string(),
            "--http-host".into(),
            "127.0.0.1".into(),
            "--http-port".into(),
            port.to_string(),
            "--log-level".into(),
            "warn".into(),
        ])
    };
    let (proc, port) = start_on_free_port(
        "throttlecrab-server",
        |port| Cmd::new(&bin).args(args(port)).log_file(&log),
        testkit::start::accepts,
    );
    run.record_spawned(&proc);
    let http = testkit::http_client();
    crate::world::wait_ok(
        &http,
        "throttlecrab-server answers /health",
        &format!("http://127.0.0.1:{port}/health"),
        Duration::from_secs(30),
    )
    .await;
    Throttlecrab { _proc: proc, port }
}

/// One round: `common` options against throttlecrab's `POST /throttle`.
pub async fn round(
    run: &Run,
    tc: &Throttlecrab,
    i: u64,
    common: &[String],
) -> anyhow::Result<Summary> {
    let mut a = strings([
        "--url".to_string(),
        format!("http://127.0.0.1:{}/throttle", tc.port),
        "--proto".into(),
        "throttlecrab".into(),
    ]);
    a.extend(common.iter().cloned());
    run.http(&format!("s7_throttlecrab_{i}"), &a).await
}
