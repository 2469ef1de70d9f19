//! A Tansu broker (the Kafka protocol), librdkafka client config, topics.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use tempfile::TempDir;

use crate::port::temp_dir;
use crate::proc::{respawn_ready, spawn_on_free_port, Cmd, Proc};
use crate::wait::{wait_until, START_DEADLINE};

/// The Tansu binary: `$TANSU_BIN`, else `tansu` on `PATH`, else
/// `$CARGO_HOME/bin/tansu` (where `scripts/setup` installs it). Panics if
/// none is there; see [`try_tansu_bin`].
pub fn tansu_bin() -> PathBuf {
    try_tansu_bin().unwrap_or_else(|e| panic!("{e}"))
}

/// [`tansu_bin`] that returns the error (where it looked) instead of
/// panicking.
pub fn try_tansu_bin() -> Result<PathBuf, String> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"));
    look_for_tansu(
        std::env::var_os("TANSU_BIN"),
        std::env::var_os("PATH"),
        &cargo_home,
    )
}

/// [`try_tansu_bin`] with its environment as arguments.
fn look_for_tansu(
    tansu_bin: Option<OsString>,
    path: Option<OsString>,
    cargo_home: &Path,
) -> Result<PathBuf, String> {
    if let Some(p) = tansu_bin {
        return Ok(PathBuf::from(p));
    }
    if let Some(path) = path {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("tansu");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    let p = cargo_home.join("bin").join("tansu");
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!(
            "tansu not found ($TANSU_BIN, PATH, {}): run scripts/setup",
            p.display()
        ))
    }
}

/// A single-node Tansu broker (Kafka protocol) on a free loopback port,
/// storing in SQLite in its own temporary directory, so data survives
/// [`Tansu::restart`].
///
/// It is started as
/// `tansu broker --kafka-cluster-id tierlimit-test
///  --listener-url tcp://127.0.0.1:P --advertised-listener-url tcp://127.0.0.1:P
///  --storage-engine sqlite://tansu.db` with its working directory set to the
/// temporary directory: Tansu 0.6.0 resolves the SQLite path *relative to
/// its working directory* (host and path of the URL are joined onto it). The
/// listener is explicit 127.0.0.1, never `localhost`, which may resolve to
/// ::1 first. Tansu 0.6.0 does not create topics on demand: use
/// [`Tansu::create_topics`]. Its log level is `warn` unless `TANSU_LOG` sets
/// another `RUST_LOG` filter for it.
#[derive(Debug)]
pub struct Tansu {
    pub proc: Proc,
    port: u16,
    dir: TempDir,
}

impl Tansu {
    /// Starts the broker and waits until it answers a metadata request.
    pub fn start() -> Tansu {
        let dir = temp_dir();
        let (proc, port) = spawn_on_free_port(
            "tansu",
            |port| Self::cmd(port, dir.path()).spawn(),
            |port| metadata_answers(&format!("127.0.0.1:{port}"), port),
        );
        Tansu { proc, port, dir }
    }

    fn cmd(port: u16, dir: &Path) -> Cmd {
        let cmd = Cmd::new(tansu_bin()).label(format!("tansu:{port}"));
        broker_args(
            cmd,
            &format!("127.0.0.1:{port}"),
            "tierlimit-test",
            dir,
            dir.join(format!("tansu-{port}.log")),
        )
    }

    /// `bootstrap.servers` value: `127.0.0.1:PORT`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The SQLite database holding every topic.
    pub fn db_path(&self) -> PathBuf {
        self.dir.path().join("tansu.db")
    }

    /// A librdkafka config with `bootstrap.servers` set and short reconnect
    /// backoffs (so a client notices a restarted broker quickly).
    pub fn client_config(&self) -> ClientConfig {
        client_config(&self.brokers())
    }

    /// Creates `topics` with `partitions` partitions each (replication 1),
    /// then waits until metadata shows every partition with a leader.
    /// Topics that already exist are left as they are.
    pub async fn create_topics(&self, topics: &[&str], partitions: i32) {
        self.create_topics_with_config(topics, partitions, &[])
            .await
    }

    /// [`Tansu::create_topics`] with topic configs, such as
    /// `("cleanup.policy", "compact")`, which Tansu 0.6.0 accepts and stores.
    pub async fn create_topics_with_config(
        &self,
        topics: &[&str],
        partitions: i32,
        config: &[(&str, &str)],
    ) {
        create_topics(&self.brokers(), topics, partitions, config).await
    }

    /// [`Tansu::create_topics`] that returns the broker's refusal (or a
    /// request timeout) instead of panicking, for a test that can recover
    /// from a broker fault. It still panics if the topics never show their
    /// partitions after a successful request.
    pub async fn try_create_topics(&self, topics: &[&str], partitions: i32) -> Result<(), String> {
        try_create_topics(&self.brokers(), topics, partitions, &[]).await
    }

    /// SIGKILL and reap: the broker is gone (the database stays).
    pub fn kill(&mut self) {
        self.proc.kill9();
    }

    /// Starts the broker again on the same port with the same database, so
    /// every record survives, and waits until metadata answers. Kills the
    /// running one first if needed.
    pub fn restart(&mut self) {
        let brokers = self.brokers();
        let port = self.port;
        respawn_ready(&mut self.proc, port, || metadata_answers(&brokers, port));
    }
}

/// Adds to `cmd` (a `tansu` program, maybe wrapped to run in a network
/// namespace) the arguments of a single broker listening on and advertising
/// `addr` (`IP:PORT`, explicit: never `localhost`, which may resolve to ::1
/// first), storing in SQLite inside `dir`, logging to `log`.
///
/// Tansu 0.6.0 resolves the SQLite path *relative to its working
/// directory*, so the working directory is `dir`.
pub fn broker_args(cmd: Cmd, addr: &str, cluster_id: &str, dir: &Path, log: PathBuf) -> Cmd {
    let url = format!("tcp://{addr}");
    cmd.arg("broker")
        .args(["--kafka-cluster-id", cluster_id])
        .args(["--listener-url", &url])
        .args(["--advertised-listener-url", &url])
        .args(["--storage-engine", "sqlite://tansu.db"])
        .current_dir(dir)
        .env(
            "RUST_LOG",
            std::env::var("TANSU_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .log_file(log)
}

/// Creates `topics` with `partitions` partitions each (replication 1) and
/// the topic `config`, then waits until metadata shows every partition with
/// a leader. Topics that already exist are left as they are. Tansu 0.6.0
/// creates no topic on demand, and neither should a production broker.
pub async fn create_topics(
    brokers: &str,
    topics: &[&str],
    partitions: i32,
    config: &[(&str, &str)],
) {
    try_create_topics(brokers, topics, partitions, config)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`create_topics`], with the request's failure as an error.
pub async fn try_create_topics(
    brokers: &str,
    topics: &[&str],
    partitions: i32,
    config: &[(&str, &str)],
) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> =
        client_config(brokers).create().expect("admin client");
    let new_topics: Vec<NewTopic> = topics
        .iter()
        .map(|name| {
            config.iter().fold(
                NewTopic::new(name, partitions, TopicReplication::Fixed(1)),
                |t, (k, v)| t.set(k, v),
            )
        })
        .collect();
    let opts = AdminOptions::new()
        .operation_timeout(Some(Duration::from_secs(20)))
        .request_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .create_topics(new_topics.iter(), &opts)
        .await
        .map_err(|e| format!("CreateTopics {topics:?}: {e}"))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => return Err(format!("cannot create topic {name}: {code}")),
        }
    }
    let brokers = brokers.to_string();
    let names: Vec<String> = topics.iter().map(|t| t.to_string()).collect();
    wait_until(
        &format!("topics {topics:?} have {partitions} partitions with leaders"),
        START_DEADLINE,
        || {
            let brokers = brokers.clone();
            let names = names.clone();
            async move {
                tokio::task::spawn_blocking(move || topics_ready(&brokers, &names, partitions))
                    .await
                    .unwrap_or(false)
            }
        },
    )
    .await;
    Ok(())
}

/// True once the broker at `brokers` answers a metadata request listing at
/// least one broker (any port).
pub fn answers_metadata(brokers: &str) -> bool {
    let Ok(c) = client_config(brokers).create::<BaseConsumer>() else {
        return false;
    };
    c.client()
        .fetch_metadata(None, Duration::from_millis(1000))
        .map(|md| !md.brokers().is_empty())
        .unwrap_or(false)
}

/// A librdkafka config for `brokers` with short reconnect backoffs: the
/// default backoff grows to 10 s, which would make a client (or a readiness
/// probe) see a restarted broker seconds late.
pub fn client_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("reconnect.backoff.ms", "20")
        .set("reconnect.backoff.max.ms", "200")
        .set("socket.connection.setup.timeout.ms", "5000");
    c
}

pub fn metadata_answers(brokers: &str, port: u16) -> bool {
    let Ok(consumer) = client_config(brokers).create::<BaseConsumer>() else {
        return false;
    };
    match consumer
        .client()
        .fetch_metadata(None, Duration::from_millis(1000))
    {
        Ok(md) => md.brokers().iter().any(|b| b.port() == port as i32),
        Err(_) => false,
    }
}

pub fn topics_ready(brokers: &str, topics: &[String], partitions: i32) -> bool {
    let Ok(consumer) = client_config(brokers).create::<BaseConsumer>() else {
        return false;
    };
    topics.iter().all(|topic| {
        let Ok(md) = consumer
            .client()
            .fetch_metadata(Some(topic), Duration::from_millis(2000))
        else {
            return false;
        };
        md.topics().iter().any(|t| {
            t.name() == topic
                && t.error().is_none()
                && t.partitions().len() == partitions as usize
                && t.partitions()
                    .iter()
                    .all(|p| p.error().is_none() && p.leader() >= 0)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tansu_is_looked_for_in_tansu_bin_then_path_then_cargo_home() {
        let on_path = temp_dir();
        let home = temp_dir();
        let nowhere = home.path().join("nowhere");
        let path = std::env::join_paths([nowhere.as_path(), on_path.path()]).unwrap();
        let err = look_for_tansu(None, Some(path.clone()), home.path()).unwrap_err();
        assert!(err.contains("run scripts/setup"), "{err}");

        std::fs::create_dir(home.path().join("bin")).unwrap();
        std::fs::write(home.path().join("bin/tansu"), "").unwrap();
        let found = look_for_tansu(None, Some(path.clone()), home.path());
        assert_eq!(found, Ok(home.path().join("bin/tansu")));

        std::fs::write(on_path.path().join("tansu"), "").unwrap();
        let found = look_for_tansu(None, Some(path.clone()), home.path());
        assert_eq!(found, Ok(on_path.path().join("tansu")));

        let found = look_for_tansu(Some("/opt/tansu".into()), Some(path), home.path());
        assert_eq!(found, Ok(PathBuf::from("/opt/tansu")));
    }
}
