//! `region-node` binary: flags, logging, then [`region_node::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// jemalloc: see the comment on the dependency in Cargo.toml.
#[cfg(target_os = "linux")]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// tierlimit region-node: strict node and region rate limits against the
/// region's Redis, global daily limits from the aggregator's broadcast.
///
/// Without a subcommand it serves the HTTP API. Every flag can also be given
/// as the environment variable shown; any config value can be overridden
/// with TIERLIMIT__SECTION__KEY=value (e.g. TIERLIMIT__KAFKA__BROKERS).
#[derive(Debug, Parser)]
#[command(version, about, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Configuration file (TOML; regions.example.toml documents every key).
    #[arg(long, env = "TIERLIMIT_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Region this node serves: a key of [regions] in the config.
    #[arg(long, env = "TIERLIMIT_REGION", global = true)]
    region: Option<String>,
    /// Id of this node, unique within its region ([A-Za-z0-9._-]); names its
    /// node-tier keys in Redis.
    #[arg(long, env = "TIERLIMIT_NODE_ID")]
    node_id: Option<String>,
    /// Address of the HTTP API.
    #[arg(long, env = "TIERLIMIT_LISTEN", default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Address of the admin listener: /metrics (and /healthz, /readyz),
    /// never the API. Loopback by default: Prometheus on the same host, or
    /// bind a private interface; it takes no credentials.
    #[arg(long, env = "TIERLIMIT_ADMIN_LISTEN", default_value = "127.0.0.1:9001")]
    admin_listen: SocketAddr,
    /// Log as JSON lines instead of text (level from RUST_LOG, default info).
    #[arg(long, env = "TIERLIMIT_LOG_JSON")]
    log_json: bool,
    /// Serve even if the region's Redis may evict counters (a
    /// maxmemory-policy other than noeviction). Evicted counters reset
    /// tenants' spend; tierlimit_redis_eviction_allowed reports the choice.
    #[arg(long, env = "TIERLIMIT_ALLOW_EVICTION")]
    allow_eviction: bool,
    /// Address of Envoy's rate limit service (RLS v3 over gRPC, with the
    /// gRPC health service); TLS when [grpc] tls_cert and tls_key are set.
    /// Unset: not served.
    #[arg(long, env = "TIERLIMIT_GRPC_LISTEN")]
    grpc_listen: Option<SocketAddr>,
}

const AFTER_HELP: &str = "\
Serving needs --config, --region and --node-id (or their environment variables);
republish needs --config and --region.

Environment:
  TIERLIMIT__SECTION__KEY=value  Override any configuration key before validation, e.g.
                                 TIERLIMIT__KAFKA__BROKERS=kafka-1:9092 (see regions.example.toml)
  RUST_LOG                       Log filter [default: info]

Signals: SIGHUP reloads plans, tenants and unknown-tenant policy (kafka.*, regions.*.redis_url
and node.* need a restart; an invalid file is refused and the old configuration stays);
SIGTERM and SIGINT stop gracefully.

HTTP (--listen, keys from [auth]): POST|GET /v1/check, POST /v1/refund, GET /v1/tenants/{tenant},
/healthz, /readyz. Admin (--admin-listen): /metrics, /healthz, /readyz.
gRPC (--grpc-listen): envoy.service.ratelimit.v3.RateLimitService, grpc.health.v1.Health";

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate a configuration file (with TIERLIMIT__ overrides applied) and
    /// print what it enforces per plan, tenant and tier. Exits 1 if invalid.
    CheckConfig {
        /// The configuration file.
        file: PathBuf,
    },
    /// Print the tierlimit TOML ([[rls.domains]]) equivalent to an
    /// envoyproxy/ratelimit YAML configuration file, with comments. A file
    /// loading would refuse (envoyproxy/ratelimit's rules) prints the key
    /// and the reason instead, exit 1.
    ImportEnvoyConfig {
        /// The envoyproxy/ratelimit YAML file.
        file: PathBuf,
    },
    /// Disaster recovery: publish every retained (tenant, day) counter of
    /// the region (--region) from its Redis to the deltas topic, signed
    /// like the nodes' deltas, so that aggregators rebuild exact counts
    /// after the topics were lost or truncated. Run once per region after
    /// the topics exist again; safe while the region serves, and to repeat.
    /// Exits 1 if a record was not acknowledged.
    Republish {
        /// Node id the records carry in their Kafka key.
        #[arg(long = "as-node", default_value = "republish")]
        as_node: String,
        /// Print the counters instead of publishing them.
        #[arg(long)]
        dry_run: bool,
    },
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if json {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .json()
            .init();
    } else {
        // Colours only on a terminal: a log file or a pipe gets plain text.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(ansi)
            .init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::ImportEnvoyConfig { file }) = &cli.command {
        // Checked as loading it would (envoyproxy/ratelimit's rules), so a
        // file it refuses is not printed as TOML that will not load.
        let path = file.display().to_string();
        return match tierlimit_shared::rls::EnvoyFile::read(file)
            .and_then(|f| f.check(&path).map(|()| f))
            .and_then(|f| f.to_toml(&path))
        {
            Ok(toml) => {
                print!("{toml}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(Command::CheckConfig { file }) = &cli.command {
        return match tierlimit_shared::Config::load(file) {
            Ok(loaded) => {
                print!("{}", tierlimit_shared::describe::describe(&loaded));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {e}", file.display());
                ExitCode::FAILURE
            }
        };
    }
    init_logging(cli.log_json);
    if let Some(Command::Republish { as_node, dry_run }) = cli.command {
        let (Some(config), Some(region)) = (cli.config, cli.region) else {
            eprintln!("region-node republish: --config and --region are required");
            return ExitCode::from(2);
        };
        let runtime = tokio::runtime::Runtime::new().expect("starting the tokio runtime");
        let settings = region_node::republish::Settings {
            config,
            region,
            node_id: as_node,
            dry_run,
        };
        return match runtime.block_on(region_node::republish::run(settings)) {
            Ok(r) => {
                tracing::info!(
                    tenants = r.tenants,
                    counters = r.counters,
                    published = r.published,
                    skipped = r.skipped,
                    "republished the region's counters"
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("region-node republish: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let (Some(config), Some(region), Some(node_id)) = (cli.config, cli.region, cli.node_id) else {
        eprintln!(
            "region-node: --config, --region and --node-id are required to serve (see --help)"
        );
        return ExitCode::from(2);
    };
    let runtime = tokio::runtime::Runtime::new().expect("starting the tokio runtime");
    match runtime.block_on(region_node::run(region_node::Settings {
        config,
        region,
        node_id,
        listen: cli.listen,
        admin_listen: cli.admin_listen,
        allow_eviction: cli.allow_eviction,
        grpc_listen: cli.grpc_listen,
    })) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("region-node: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Cli, Command};

    #[test]
    fn the_command_line_is_consistent() {
        <Cli as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn republish_takes_config_and_region_before_or_after_it() {
        for args in [
            &[
                "region-node",
                "republish",
                "--config",
                "c.toml",
                "--region",
                "eu",
            ][..],
            &[
                "region-node",
                "--config",
                "c.toml",
                "--region",
                "eu",
                "republish",
            ][..],
        ] {
            let cli = Cli::try_parse_from(args).expect("parses");
            assert_eq!(cli.region.as_deref(), Some("eu"));
            assert!(cli.config.is_some());
            assert!(matches!(
                cli.command,
                Some(Command::Republish { ref as_node, dry_run: false }) if as_node == "republish"
            ));
        }
    }
}
