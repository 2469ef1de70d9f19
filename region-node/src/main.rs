//! `region-node` binary: flags, logging, then [`region_node::run`].

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

/// tierlimit region-node: strict node and region rate limits against the
/// region's Redis, global daily limits from the aggregator's broadcast.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Configuration file (TOML; see regions.example.toml). Environment
    /// variables TIERLIMIT__SECTION__KEY override its values.
    #[arg(long, env = "TIERLIMIT_CONFIG")]
    config: PathBuf,
    /// Region this node serves (a key of [regions] in the config).
    #[arg(long, env = "TIERLIMIT_REGION")]
    region: String,
    /// Id of this node, unique within its region ([A-Za-z0-9._-]).
    #[arg(long, env = "TIERLIMIT_NODE_ID")]
    node_id: String,
    /// Address of the HTTP API.
    #[arg(long, env = "TIERLIMIT_LISTEN", default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, env = "TIERLIMIT_LOG_JSON")]
    log_json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if cli.log_json {
        tracing_subscriber::fmt().with_env_filter(filter).json().init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    region_node::run(region_node::Settings {
        config: cli.config,
        region: cli.region,
        node_id: cli.node_id,
        listen: cli.listen,
    })
    .await
}
