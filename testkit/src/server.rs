//! `region-node` and `aggregator` processes, ready once `/healthz` answers.
//!
//! Each gets two ports: the API (`--listen`, [`RegionNode::url`]) and the
//! admin listener (`--admin-listen`, [`RegionNode::admin_url`]: `/metrics`,
//! the dashboard), and accepts the harness key ([`crate::auth`]).

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::bins::bin_path;
use crate::port::free_port;
use crate::proc::{addr_in_use, Cmd, Proc};
use crate::wait::{POLL, START_DEADLINE};

/// An HTTP client for talking to local servers: no proxy (a proxy from the
/// environment must not see loopback traffic), 10 s per request, sending
/// the harness key ([`crate::auth::HARNESS_KEY`]).
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .default_headers(crate::auth::harness_headers())
        .timeout(Duration::from_secs(10))
        .build()
        .expect("reqwest client")
}

/// API base URL (`http://127.0.0.1:PORT`) → admin base URL, for every
/// server this process started.
static ADMIN_BASES: Mutex<Option<HashMap<String, String>>> = Mutex::new(None);

/// The admin listener's base URL of the server whose API is at `base`
/// (`http://127.0.0.1:PORT`, as [`RegionNode::url`]`("")` gives), for code
/// that only kept the base. `base` itself if testkit did not start it.
pub fn admin_base(base: &str) -> String {
    let base = base.trim_end_matches('/');
    ADMIN_BASES
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|m| m.get(base).cloned())
        .unwrap_or_else(|| base.to_string())
}

/// Records that the server whose API is at `base` has its admin listener
/// at `admin` (for servers started without [`RegionNode`]/[`Aggregator`]).
pub fn register_admin_base(base: &str, admin: &str) {
    ADMIN_BASES
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(base.trim_end_matches('/').to_string(), admin.to_string());
}

/// Starts `bin` with `args(port, admin_port)` on free ports (retrying on a
/// port collision) and waits until `GET /healthz` answers 200 on the admin
/// listener.
async fn start_http_server(
    label: &str,
    bin: &Path,
    args: impl Fn(u16, u16) -> Vec<OsString>,
    env: &[(&str, &str)],
) -> (Proc, u16, u16) {
    let client = http_client();
    for _attempt in 0..5 {
        let port = free_port();
        let mut admin_port = free_port();
        while admin_port == port {
            admin_port = free_port();
        }
        let mut cmd = Cmd::new(bin)
            .label(format!("{label}:{port}"))
            .args(args(port, admin_port))
            .env("RUST_LOG", "info");
        for (k, v) in crate::auth::harness_env() {
            cmd = cmd.env(&k, &v);
        }
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        let mut proc = cmd.spawn();
        let admin_url = format!("http://127.0.0.1:{admin_port}/healthz");
        let start = Instant::now();
        loop {
            if let Some(status) = proc.poll_exit() {
                if addr_in_use(&proc.log()) {
                    break;
                }
                panic!("{} exited before /healthz answered: {status}", proc.label());
            }
            // The admin listener: it answers plain HTTP even when the API
            // speaks TLS, and both are bound before either serves, so an
            // answer here means the API port accepts connections too.
            let ok = client
                .get(&admin_url)
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .is_ok_and(|r| r.status() == reqwest::StatusCode::OK);
            if ok {
                register_admin_base(
                    &format!("http://127.0.0.1:{port}"),
                    &format!("http://127.0.0.1:{admin_port}"),
                );
                return (proc, port, admin_port);
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
/// `region-node --config FILE --region NAME --node-id ID --listen 127.0.0.1:PORT
/// --admin-listen 127.0.0.1:ADMIN_PORT` with `RUST_LOG=info` and the harness
/// key, ready once `GET /healthz` answers 200 on the admin listener.
#[derive(Debug)]
pub struct RegionNode {
    pub proc: Proc,
    pub http: reqwest::Client,
    pub region: String,
    pub node_id: String,
    port: u16,
    admin_port: u16,
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
        Self::start_from(&bin_path("region-node"), config, region, node_id, env).await
    }

    /// [`RegionNode::start_with_env`] from the binary `bin` (the previous
    /// release's, [`crate::previous_release::bin`], in an upgrade test).
    pub async fn start_from(
        bin: &Path,
        config: &Path,
        region: &str,
        node_id: &str,
        env: &[(&str, &str)],
    ) -> RegionNode {
        let config = config.to_path_buf();
        let (r, n) = (region.to_string(), node_id.to_string());
        let (proc, port, admin_port) = start_http_server(
            &format!("region-node[{region}/{node_id}]"),
            bin,
            |port, admin_port| {
                vec![
                    "--config".into(),
                    config.clone().into(),
                    "--region".into(),
                    r.clone().into(),
                    "--node-id".into(),
                    n.clone().into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}").into(),
                    "--admin-listen".into(),
                    format!("127.0.0.1:{admin_port}").into(),
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
            admin_port,
        }
    }

    /// `http://127.0.0.1:PORT{path}`; `path` starts with `/`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:ADMIN_PORT{path}`: `/metrics` (and the dashboard).
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }
}

/// A real `aggregator` process:
/// `aggregator --config FILE --listen 127.0.0.1:PORT --admin-listen
/// 127.0.0.1:ADMIN_PORT` with `RUST_LOG=info` and the harness key, ready
/// once `GET /healthz` answers 200 on the admin listener.
#[derive(Debug)]
pub struct Aggregator {
    pub proc: Proc,
    pub http: reqwest::Client,
    port: u16,
    admin_port: u16,
}

impl Aggregator {
    pub async fn start(config: &Path) -> Aggregator {
        Self::start_with_env(config, &[]).await
    }

    /// [`Aggregator::start`] with extra environment variables.
    pub async fn start_with_env(config: &Path, env: &[(&str, &str)]) -> Aggregator {
        Self::start_from(&bin_path("aggregator"), config, env).await
    }

    /// [`Aggregator::start_with_env`] from the binary `bin` (the previous
    /// release's in an upgrade test).
    pub async fn start_from(bin: &Path, config: &Path, env: &[(&str, &str)]) -> Aggregator {
        let config = config.to_path_buf();
        let (proc, port, admin_port) = start_http_server(
            "aggregator",
            bin,
            |port, admin_port| {
                vec![
                    "--config".into(),
                    config.clone().into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}").into(),
                    "--admin-listen".into(),
                    format!("127.0.0.1:{admin_port}").into(),
                ]
            },
            env,
        )
        .await;
        Aggregator {
            proc,
            http: http_client(),
            port,
            admin_port,
        }
    }

    /// `http://127.0.0.1:PORT{path}`; `path` starts with `/`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:ADMIN_PORT{path}`: `/metrics` (and the dashboard).
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }
}
