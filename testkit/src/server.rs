//! `region-node` and `aggregator` processes, ready once `/healthz` answers.

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::bins::bin_path;
use crate::port::free_port;
use crate::proc::{addr_in_use, Cmd, Proc};
use crate::wait::{POLL, START_DEADLINE};

/// An HTTP client for talking to local servers: no proxy (a proxy from the
/// environment must not see loopback traffic), 10 s per request.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("reqwest client")
}

/// Starts `bin` with `args(port)` on a free port (retrying on a port
/// collision) and waits until `GET /healthz` answers 200.
async fn start_http_server(
    label: &str,
    bin: &Path,
    args: impl Fn(u16) -> Vec<OsString>,
    env: &[(&str, &str)],
) -> (Proc, u16) {
    let client = http_client();
    for _attempt in 0..5 {
        let port = free_port();
        let mut cmd = Cmd::new(bin)
            .label(format!("{label}:{port}"))
            .args(args(port))
            .env("RUST_LOG", "info");
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        let mut proc = cmd.spawn();
        let url = format!("http://127.0.0.1:{port}/healthz");
        let start = Instant::now();
        loop {
            if let Some(status) = proc.poll_exit() {
                if addr_in_use(&proc.log()) {
                    break;
                }
                panic!("{} exited before /healthz answered: {status}", proc.label());
            }
            let ok = client
                .get(&url)
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .is_ok_and(|r| r.status() == reqwest::StatusCode::OK);
            if ok {
                return (proc, port);
            }
            if start.elapsed() >= START_DEADLINE {
                panic!(
                    "{}: GET /healthz not 200 within {START_DEADLINE:?}",
                    proc.label()
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }
    panic!("{label}: no free port after 5 attempts");
}

/// A real `region-node` process:
/// `region-node --config FILE --region NAME --node-id ID --listen 127.0.0.1:PORT`
/// with `RUST_LOG=info`, ready once `GET /healthz` answers 200.
#[derive(Debug)]
pub struct RegionNode {
    pub proc: Proc,
    pub http: reqwest::Client,
    pub region: String,
    pub node_id: String,
    port: u16,
}

impl RegionNode {
    pub async fn start(config: &Path, region: &str, node_id: &str) -> RegionNode {
        Self::start_with_env(config, region, node_id, &[]).await
    }

    /// [`RegionNode::start`] with extra environment variables (e.g.
    /// `TIERLIMIT__…` config overrides).
    pub async fn start_with_env(
        config: &Path,
        region: &str,
        node_id: &str,
        env: &[(&str, &str)],
    ) -> RegionNode {
        let bin = bin_path("region-node");
        let config = config.to_path_buf();
        let (r, n) = (region.to_string(), node_id.to_string());
        let (proc, port) = start_http_server(
            &format!("region-node[{region}/{node_id}]"),
            &bin,
            |port| {
                vec![
                    "--config".into(),
                    config.clone().into(),
                    "--region".into(),
                    r.clone().into(),
                    "--node-id".into(),
                    n.clone().into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}").into(),
                ]
            },
            env,
        )
        .await;
        RegionNode {
            proc,
            http: http_client(),
            region: region.to_string(),
            node_id: node_id.to_string(),
            port,
        }
    }

    /// `http://127.0.0.1:PORT{path}`; `path` starts with `/`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

/// A real `aggregator` process:
/// `aggregator --config FILE --listen 127.0.0.1:PORT` with `RUST_LOG=info`,
/// ready once `GET /healthz` answers 200.
#[derive(Debug)]
pub struct Aggregator {
    pub proc: Proc,
    pub http: reqwest::Client,
    port: u16,
}

impl Aggregator {
    pub async fn start(config: &Path) -> Aggregator {
        Self::start_with_env(config, &[]).await
    }

    /// [`Aggregator::start`] with extra environment variables.
    pub async fn start_with_env(config: &Path, env: &[(&str, &str)]) -> Aggregator {
        let bin = bin_path("aggregator");
        let config = config.to_path_buf();
        let (proc, port) = start_http_server(
            "aggregator",
            &bin,
            |port| {
                vec![
                    "--config".into(),
                    config.clone().into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}").into(),
                ]
            },
            env,
        )
        .await;
        Aggregator {
            proc,
            http: http_client(),
            port,
        }
    }

    /// `http://127.0.0.1:PORT{path}`; `path` starts with `/`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}
