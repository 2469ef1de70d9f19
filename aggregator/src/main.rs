//! `aggregator` binary: command line, logging and the runtime; everything
//! else lives in the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Merges PN-counter deltas from every region into global daily counts per
/// tenant and broadcasts them.
#[derive(Debug, Parser)]
#[command(
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = AFTER_HELP
)]
struct Cli {
    /// Configuration file (TOML).
    #[arg(long, env = "TIERLIMIT_CONFIG", required = true)]
    config: Option<PathBuf>,

    /// Address of the HTTP API (views, metrics, health).
    #[arg(long, env = "TIERLIMIT_LISTEN", default_value = "127.0.0.1:9100")]
    listen: SocketAddr,

    /// Address of the admin listener: the dashboard (GET /) and /metrics
    /// (and the probes), never the API. Loopback by default; it takes no
    /// credentials, so bind it only where operators and Prometheus reach.
    #[arg(long, env = "TIERLIMIT_ADMIN_LISTEN", default_value = "127.0.0.1:9101")]
    admin_listen: SocketAddr,

    /// Log as JSON lines instead of text (level from RUST_LOG, default info).
    #[arg(long, env = "TIERLIMIT_LOG_JSON", global = true)]
    log_json: bool,

    #[command(subcommand)]
    command: Option<Command>,
}

const AFTER_HELP: &str = "\
Environment:
  TIERLIMIT__SECTION__KEY=value  Override any configuration key before validation, e.g.
                                 TIERLIMIT__KAFKA__BROKERS=kafka-1:9092 (see regions.example.toml)
  RUST_LOG                       Log filter [default: info]

Signals: SIGHUP reloads the configuration file (limits and tenants; kafka.* needs a
restart; an invalid file is refused and the old configuration stays); SIGTERM and
SIGINT stop after a last broadcast.

HTTP (--listen, keys from [auth], `read` scope): /v1/global/{tenant}, /v1/over-limit, /healthz, /readyz.
Admin (--admin-listen): GET / (dashboard), /metrics, /healthz, /readyz.";

#[derive(Debug, Subcommand)]
enum Command {
    /// Creates the deltas and global topics with the configured partition
    /// count, `cleanup.policy=compact,delete` and `retention.ms` of
    /// `aggregator.retention_days` + 1 days, or two of the longest periods
    /// of a configured week or month tier plus a day (63 days for a month)
    /// (existing topics are left alone).
    CreateTopics {
        /// Configuration file (TOML).
        #[arg(long, env = "TIERLIMIT_CONFIG")]
        config: PathBuf,
        /// Do not ask for `cleanup.policy` and `retention.ms` (for brokers
        /// that refuse topic configs).
        #[arg(long, env = "TIERLIMIT_NO_COMPACT")]
        no_compact: bool,
    },
    /// Prints a new Ed25519 key pair for signing broadcasts or limits
    /// records (see `[wire]` in regions.example.toml).
    Keygen,
    /// Writes tenants and plans to the limits topic (`limits.source =
    /// "topic"`), signed with `wire.limits_private_key`, or reads them
    /// back.
    #[command(subcommand)]
    Limits(LimitsCommand),
}

#[derive(Debug, Subcommand)]
enum LimitsCommand {
    /// Imports `[plans]` and `[tenants]` from a TOML file (a whole
    /// configuration file or only those tables) or JSON Lines: each checked
    /// as the configuration loader checks it, only what differs written
    /// (run it again to resume). Through the API (`--url`, key in
    /// TIERLIMIT_API_KEY), or with `--config` straight to the topic with
    /// the limits key (a fleet's first import; no aggregator needed, so run
    /// it while nobody writes through the API).
    Import {
        /// Configuration file (TOML): Kafka and the limits key. Writes
        /// straight to the topic.
        #[arg(long)]
        config: Option<PathBuf>,
        /// The aggregator's API (when `--config` is not given).
        #[arg(
            long,
            env = "TIERLIMIT_API_URL",
            default_value = "http://127.0.0.1:9100"
        )]
        url: String,
        /// The file to import.
        #[arg(long)]
        file: PathBuf,
        /// Its format (default: `jsonl` for .jsonl/.ndjson, else `toml`).
        #[arg(long, value_enum)]
        format: Option<aggregator::limits_import::Format>,
        /// Recorded as each record's writer (`--config`; through the API
        /// the writer is the key's name).
        #[arg(long, default_value = "import")]
        writer: String,
        /// Print what would change; write nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Prints the topic's plans and tenants (what `import` reads back
    /// unchanged; as TOML, what a file-source configuration holds): from
    /// the API (`--url`), or with `--config` read from the topic itself.
    Export {
        #[arg(long)]
        config: Option<PathBuf>,
        /// The aggregator's API (when `--config` is not given).
        #[arg(
            long,
            env = "TIERLIMIT_API_URL",
            default_value = "http://127.0.0.1:9100"
        )]
        url: String,
        #[arg(long, value_enum, default_value = "toml")]
        format: aggregator::limits_import::Format,
    },
    /// Deletes a tenant or a plan straight on the topic (a signed deletion
    /// record; a plan only once no tenant uses it).
    Delete {
        #[arg(long, env = "TIERLIMIT_CONFIG")]
        config: PathBuf,
        #[arg(long, conflicts_with = "plan", required_unless_present = "plan")]
        tenant: Option<String>,
        #[arg(long)]
        plan: Option<String>,
        #[arg(long, default_value = "cli")]
        writer: String,
    },
    /// A tenant through the API (key in TIERLIMIT_API_KEY).
    Tenant {
        #[command(subcommand)]
        op: Op,
    },
    /// A plan through the API (key in TIERLIMIT_API_KEY).
    Plan {
        #[command(subcommand)]
        op: Op,
    },
    /// Has a limits version reached every region-node? (the API's
    /// `/v1/limits/status`).
    Status {
        #[command(flatten)]
        api: Api,
        #[arg(long)]
        version: Option<u64>,
    },
}

#[derive(Debug, Clone, clap::Args)]
struct Api {
    /// The aggregator's API.
    #[arg(
        long,
        env = "TIERLIMIT_API_URL",
        default_value = "http://127.0.0.1:9100"
    )]
    url: String,
    /// Print the API's JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Op {
    Get {
        name: String,
        #[command(flatten)]
        api: Api,
    },
    /// Creates or replaces it: `--plan` alone for a tenant on a plan, or
    /// the whole record as JSON with `--body`.
    Put {
        name: String,
        #[arg(long, required_unless_present = "body", conflicts_with = "body")]
        plan: Option<String>,
        /// The record as JSON (a tenant: `{"plan":"pro","region":{"limit":5}}`;
        /// a plan: its tiers).
        #[arg(long)]
        body: Option<String>,
        /// Only if its version is still this one (else 412).
        #[arg(long)]
        if_match: Option<u64>,
        /// Only if it does not exist yet.
        #[arg(long, conflicts_with = "if_match")]
        create: bool,
        #[command(flatten)]
        api: Api,
    },
    Delete {
        name: String,
        #[arg(long)]
        if_match: Option<u64>,
        #[command(flatten)]
        api: Api,
    },
    /// Tenants: filtered and paged; plans: all.
    List {
        #[arg(long)]
        plan: Option<String>,
        #[arg(long)]
        overrides: Option<bool>,
        #[arg(long)]
        after: Option<String>,
        #[arg(long)]
        limit: Option<usize>,
        #[command(flatten)]
        api: Api,
    },
    /// Its recent changes, newest first.
    History {
        name: String,
        #[command(flatten)]
        api: Api,
    },
    /// Tenants only: its counters in every tier and region (the global
    /// count and each region's part from the aggregator; node and region
    /// windows from a region-node of each `--node REGION=URL`).
    Inspect {
        name: String,
        /// A region-node of each region: `eu-west=http://10.0.1.5:9000`.
        #[arg(long = "node", value_parser = region_url)]
        nodes: Vec<(String, String)>,
        #[command(flatten)]
        api: Api,
    },
    /// Tenants only: extra units for the current period of one of its
    /// global tiers (the limit is raised until the period ends).
    Grant {
        name: String,
        /// hour, day, week or month.
        #[arg(long)]
        period: String,
        #[arg(long)]
        extra: u64,
        /// Why (kept in the record, shown by `get`).
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        api: Api,
    },
}

/// `REGION=URL`.
fn region_url(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(r, u)| !r.is_empty() && u.starts_with("http"))
        .map(|(r, u)| (r.to_owned(), u.to_owned()))
        .ok_or_else(|| format!("expected REGION=URL (eu-west=http://10.0.1.5:9000), got {s:?}"))
}

/// Runs one API command; prints its answer.
async fn api_command(kind: &str, op: Op) -> Result<(), aggregator::Error> {
    use aggregator::limits_client::{call, ok, render, Call};
    let base = format!("/v1/limits/{kind}s");
    let enc = |s: &str| {
        s.replace('%', "%25")
            .replace('/', "%2F")
            .replace('?', "%3F")
            .replace('#', "%23")
    };
    let api = match &op {
        Op::Get { api, .. }
        | Op::Put { api, .. }
        | Op::Delete { api, .. }
        | Op::List { api, .. }
        | Op::History { api, .. }
        | Op::Grant { api, .. }
        | Op::Inspect { api, .. } => api.clone(),
    };
    if let Op::Inspect { name, nodes, .. } = &op {
        if kind != "tenant" {
            return Err(aggregator::Error::Limits(
                "inspect is for tenants: aggregator limits tenant inspect …".into(),
            ));
        }
        let body = aggregator::limits_client::inspect(&api.url, name, nodes).await?;
        if api.json {
            println!("{body}");
        } else {
            println!("{}", render("inspect", &body));
        }
        return Ok(());
    }
    let (c, shape) = match op {
        Op::Get { name, .. } => (Call::get(format!("{base}/{}", enc(&name))), kind),
        Op::History { name, .. } => (
            Call::get(format!("{base}/{}/history", enc(&name))),
            "history",
        ),
        Op::List {
            plan,
            overrides,
            after,
            limit,
            ..
        } => {
            let mut q = Vec::new();
            if let Some(p) = plan {
                q.push(format!("plan={}", enc(&p)));
            }
            if let Some(o) = overrides {
                q.push(format!("overrides={o}"));
            }
            if let Some(a) = after {
                q.push(format!("after={}", enc(&a)));
            }
            if let Some(l) = limit {
                q.push(format!("limit={l}"));
            }
            let query = if q.is_empty() {
                String::new()
            } else {
                format!("?{}", q.join("&"))
            };
            (
                Call::get(format!("{base}{query}")),
                if kind == "tenant" { "tenants" } else { "plans" },
            )
        }
        Op::Put {
            name,
            plan,
            body,
            if_match,
            create,
            ..
        } => {
            let body = match (plan, body) {
                (Some(p), _) => serde_json::json!({ "plan": p }),
                (None, Some(b)) => serde_json::from_str(&b)
                    .map_err(|e| aggregator::Error::Limits(format!("--body is not JSON: {e}")))?,
                (None, None) => unreachable!("clap requires one"),
            };
            (
                Call {
                    method: reqwest::Method::PUT,
                    path: format!("{base}/{}", enc(&name)),
                    body: Some(body),
                    if_match,
                    create_only: create,
                },
                "written",
            )
        }
        Op::Inspect { .. } => unreachable!("answered above"),
        Op::Grant {
            name,
            period,
            extra,
            reason,
            ..
        } => {
            if kind != "tenant" {
                return Err(aggregator::Error::Limits(
                    "grants are for tenants: aggregator limits tenant grant …".into(),
                ));
            }
            (
                Call {
                    method: reqwest::Method::POST,
                    path: format!("{base}/{}/grants", enc(&name)),
                    body: Some(serde_json::json!({
                        "period": period, "extra": extra, "reason": reason,
                    })),
                    if_match: None,
                    create_only: false,
                },
                "written",
            )
        }
        Op::Delete { name, if_match, .. } => (
            Call {
                method: reqwest::Method::DELETE,
                path: format!("{base}/{}", enc(&name)),
                body: None,
                if_match,
                create_only: false,
            },
            "written",
        ),
    };
    let body = ok(call(&api.url, c).await?)?;
    if api.json {
        println!("{body}");
    } else {
        println!("{}", render(shape, &body));
    }
    Ok(())
}

fn init_logging(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if json {
        builder.json().init();
    } else {
        // Colours only on a terminal: log files and pipes stay plain text.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        builder.with_ansi(ansi).with_writer(std::io::stderr).init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Keygen) = cli.command {
        return match tierlimit_shared::wire::keys::ed25519_generate() {
            Ok((private, public)) => {
                println!(
                    "# A broadcast key: aggregators only, e.g. TIERLIMIT__WIRE__BROADCAST_PRIVATE_KEY:\n\
                     broadcast_private_key = \"{private}\"\n\
                     # every node and aggregator, under [wire.broadcast_public_keys]:\n\
                     <key id> = \"{public}\"\n\
                     # Or a limits key (a pair of its own, never the broadcast one): the\n\
                     # writer only (limits_private_key), the public key under\n\
                     # [wire.limits_public_keys] on every process."
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cannot read /dev/urandom: {e}");
                ExitCode::FAILURE
            }
        };
    }
    init_logging(cli.log_json);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Some(Command::CreateTopics { config, no_compact }) => {
                aggregator::create_topics(&config, !no_compact)
                    .await
                    .map(|created| {
                        if created.is_empty() {
                            tracing::info!("topics already exist");
                        } else {
                            tracing::info!(?created, "topics created");
                        }
                    })
            }
            Some(Command::Keygen) => unreachable!("handled before the runtime starts"),
            Some(Command::Limits(LimitsCommand::Import {
                config,
                url,
                file,
                format,
                writer,
                dry_run,
            })) => match config {
                Some(config) => {
                    aggregator::limits_cli::import(&config, &file, format, &writer, dry_run).await
                }
                None => aggregator::limits_cli::import_via_api(&url, &file, format, dry_run).await,
            }
            .map(|summary| println!("{summary}")),
            Some(Command::Limits(LimitsCommand::Export {
                config,
                url,
                format,
            })) => match config {
                Some(config) => {
                    aggregator::limits_cli::export(&config, format, &mut std::io::stdout().lock())
                        .await
                }
                None => aggregator::limits_cli::export_via_api(&url, format)
                    .await
                    .map(|text| print!("{text}")),
            },
            Some(Command::Limits(LimitsCommand::Tenant { op })) => api_command("tenant", op).await,
            Some(Command::Limits(LimitsCommand::Plan { op })) => api_command("plan", op).await,
            Some(Command::Limits(LimitsCommand::Status { api, version })) => {
                let path = match version {
                    Some(v) => format!("/v1/limits/status?version={v}"),
                    None => "/v1/limits/status".into(),
                };
                let json = api.json;
                aggregator::limits_client::call(
                    &api.url,
                    aggregator::limits_client::Call::get(path),
                )
                .await
                .and_then(aggregator::limits_client::ok)
                .map(|body| {
                    if json {
                        println!("{body}");
                    } else {
                        println!("{}", aggregator::limits_client::render("status", &body));
                    }
                })
            }
            Some(Command::Limits(LimitsCommand::Delete {
                config,
                tenant,
                plan,
                writer,
            })) => aggregator::limits_cli::delete(&config, tenant, plan, &writer)
                .await
                .map(|summary| println!("{summary}")),
            None => {
                let config = cli
                    .config
                    .expect("clap requires --config without a subcommand");
                let listen = aggregator::Listen {
                    api: cli.listen,
                    admin: cli.admin_listen,
                };
                aggregator::run(&config, listen).await
            }
        }
    });
    // librdkafka calls that outlived their deadline may still sit on
    // blocking threads; do not wait for them.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "aggregator failed");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_shapes() {
        Cli::command_for_tests().debug_assert();
        let cli = Cli::try_parse_from(["aggregator", "--config", "c.toml"]).unwrap();
        assert_eq!(cli.listen, "127.0.0.1:9100".parse().unwrap());
        assert_eq!(cli.admin_listen, "127.0.0.1:9101".parse().unwrap());
        assert!(cli.command.is_none());
        let cli = Cli::try_parse_from([
            "aggregator",
            "create-topics",
            "--config",
            "c.toml",
            "--no-compact",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Some(Command::CreateTopics {
                no_compact: true,
                ..
            })
        ));
    }

    impl Cli {
        fn command_for_tests() -> clap::Command {
            <Cli as clap::CommandFactory>::command()
        }
    }
}
