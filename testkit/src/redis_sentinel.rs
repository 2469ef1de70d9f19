//! A throw-away Redis Sentinel group: a master, its replica and three
//! `redis-sentinel` processes on free loopback ports.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;

use crate::port::{sub_dir, temp_dir};
use crate::proc::{spawn_on_free_port, wait_restarted, Cmd};
use crate::redis_server::{info, member_mut, ping, query, replicated, running, server_cmd, Member};
use crate::wait::{wait_for_blocking, wait_until_blocking, START_DEADLINE};

/// `$REDIS_SENTINEL_BIN`, or `redis-sentinel` from `PATH` (Debian package
/// `redis-sentinel`, installed by `scripts/setup`).
pub fn redis_sentinel_bin() -> std::ffi::OsString {
    std::env::var_os("REDIS_SENTINEL_BIN").unwrap_or_else(|| "redis-sentinel".into())
}

/// Builder of a [`SentinelGroup`].
#[derive(Clone, Debug)]
pub struct SentinelBuilder {
    master_name: String,
    replicas: usize,
    sentinels: usize,
    down_after: Duration,
    failover_timeout: Duration,
}

impl SentinelBuilder {
    /// The name the sentinels monitor the master under (default
    /// `tierlimit`).
    pub fn master_name(mut self, name: impl Into<String>) -> SentinelBuilder {
        self.master_name = name.into();
        self
    }

    /// Sentinels (default 3); the quorum is a majority of them.
    pub fn sentinels(mut self, n: usize) -> SentinelBuilder {
        self.sentinels = n;
        self
    }

    /// Replicas of the master (default 1).
    pub fn replicas(mut self, n: usize) -> SentinelBuilder {
        self.replicas = n;
        self
    }

    /// `sentinel down-after-milliseconds` (default 2 s): how long the master
    /// must not answer before a sentinel thinks it down. Redis's default of
    /// 30 s would make every failover test wait that long. Not 1 s: a
    /// sentinel pings every min(down-after, 1 s), so at 1 s a sentinel that
    /// has just switched to the new master can judge it down before its
    /// first PING was even answered, and fail over a second time (seen in a
    /// CI run on a busy machine: +sdown of the new master 1.01 s after
    /// +switch-master). At 2 s it gets two pings' worth of time.
    pub fn down_after(mut self, d: Duration) -> SentinelBuilder {
        self.down_after = d;
        self
    }

    /// `sentinel failover-timeout` (default 3 s). A sentinel that lost an
    /// election retries only after twice this, so it bounds how long a
    /// failover can take when the first vote splits.
    pub fn failover_timeout(mut self, d: Duration) -> SentinelBuilder {
        self.failover_timeout = d;
        self
    }

    /// Starts the master, its replicas (`--replicaof`), then the sentinels
    /// (quorum: a majority), and waits until every sentinel reports the master, knows
    /// every replica and the other sentinels, and every replica's link to
    /// the master is up.
    pub fn start(self) -> SentinelGroup {
        assert!(self.sentinels >= 1, "a Sentinel group needs a sentinel");
        let dir = temp_dir();
        let master = start_server(sub_dir(dir.path(), "server0"), None);
        let master_port = master.port;
        let mut servers = vec![master];
        for i in 1..=self.replicas {
            let replica = start_server(
                sub_dir(dir.path(), &format!("server{i}")),
                Some(master_port),
            );
            servers.push(replica);
        }
        let quorum = self.sentinels / 2 + 1;
        let sentinels = (0..self.sentinels)
            .map(|i| {
                let sdir = sub_dir(dir.path(), &format!("sentinel{i}"));
                let (proc, port) = spawn_on_free_port(
                    "redis-sentinel",
                    |port| {
                        // Sentinel rewrites its config file (IDs, known
                        // replicas and sentinels, epochs): it lives in the
                        // sentinel's own writable directory.
                        let conf = sdir.join("sentinel.conf");
                        let text = self.config(port, &sdir, master_port, quorum);
                        std::fs::write(&conf, text)
                            .unwrap_or_else(|e| panic!("write {}: {e}", conf.display()));
                        Cmd::new(redis_sentinel_bin())
                            .arg(&conf)
                            .label(format!("sentinel:{port}"))
                            .log_file(sdir.join(format!("sentinel-{port}.log")))
                            .spawn()
                    },
                    ping,
                );
                Member {
                    proc,
                    port,
                    dir: sdir,
                }
            })
            .collect();
        let group = SentinelGroup {
            name: self.master_name,
            servers,
            sentinels,
            down_after: self.down_after,
            failover_timeout: self.failover_timeout,
            _dir: dir,
        };
        wait_until_blocking(
            "every sentinel reports the master and knows its replicas and the other sentinels",
            START_DEADLINE,
            || group.settled(master_port),
        );
        group
    }

    fn config(&self, port: u16, dir: &Path, master: u16, quorum: usize) -> String {
        let name = &self.master_name;
        format!(
            "port {port}\n\
             bind 127.0.0.1\n\
             protected-mode no\n\
             dir {dir}\n\
             sentinel resolve-hostnames no\n\
             sentinel monitor {name} 127.0.0.1 {master} {quorum}\n\
             sentinel down-after-milliseconds {name} {down}\n\
             sentinel failover-timeout {name} {failover}\n",
            dir = dir.display(),
            down = self.down_after.as_millis(),
            failover = self.failover_timeout.as_millis(),
        )
    }
}

/// Starts a `redis-server` of the group in `dir`, a replica of `replicaof`
/// if given; waits for PING and, for a replica, for its link to the master.
fn start_server(dir: PathBuf, replicaof: Option<u16>) -> Member {
    let (proc, port) = spawn_on_free_port(
        "redis-server",
        |port| server_cmd_of(port, &dir, replicaof).spawn(),
        ping,
    );
    if replicaof.is_some() {
        wait_linked(port);
    }
    Member { proc, port, dir }
}

fn server_cmd_of(port: u16, dir: &Path, replicaof: Option<u16>) -> Cmd {
    let cmd = server_cmd(port, dir);
    match replicaof {
        Some(master) => cmd.args(["--replicaof", "127.0.0.1", &master.to_string()]),
        None => cmd,
    }
}

/// Waits until the replica on `port` has its link to the master up.
fn wait_linked(port: u16) {
    wait_until_blocking(
        &format!("replica 127.0.0.1:{port} has master_link_status:up"),
        START_DEADLINE,
        || {
            info(port, "replication").is_some_and(|i| {
                i.get("role").map(String::as_str) == Some("slave")
                    && i.get("master_link_status").map(String::as_str) == Some("up")
            })
        },
    );
}

/// A throw-away Sentinel group on free loopback ports: one master, one
/// replica (`--replicaof`), three `redis-sentinel`s (quorum 2) monitoring
/// the master as `tierlimit` (see [`SentinelGroup::builder`] for other
/// settings). Every process is killed when it is dropped.
///
/// Like [`Redis`](crate::Redis), the servers keep nothing on disk: a
/// restarted server comes back empty and gets its data from the master.
/// Which server is master changes with failover, so it is asked of the
/// sentinels at call time ([`SentinelGroup::master_port`]), never
/// remembered.
///
/// The methods block; see [`RedisCluster`](crate::RedisCluster) on using
/// them from async tests.
#[derive(Debug)]
pub struct SentinelGroup {
    name: String,
    servers: Vec<Member>,
    sentinels: Vec<Member>,
    down_after: Duration,
    failover_timeout: Duration,
    _dir: TempDir,
}

impl SentinelGroup {
    /// One master, one replica, three sentinels; master name `tierlimit`,
    /// `down-after-milliseconds` 2000, `failover-timeout` 3000.
    pub fn start() -> SentinelGroup {
        SentinelGroup::builder().start()
    }

    pub fn builder() -> SentinelBuilder {
        SentinelBuilder {
            master_name: "tierlimit".to_string(),
            replicas: 1,
            sentinels: 3,
            down_after: Duration::from_secs(2),
            failover_timeout: Duration::from_secs(3),
        }
    }

    /// The name the sentinels know the master by.
    pub fn master_name(&self) -> &str {
        &self.name
    }

    /// `127.0.0.1:PORT` of every sentinel.
    pub fn sentinel_addrs(&self) -> Vec<SocketAddr> {
        self.sentinels
            .iter()
            .map(|s| SocketAddr::from(([127, 0, 0, 1], s.port)))
            .collect()
    }

    /// `redis://127.0.0.1:PORT/` of every sentinel: with
    /// [`SentinelGroup::master_name`], what the `redis` crate's Sentinel
    /// support takes (`redis::sentinel::Sentinel::build(urls)` then
    /// `master_for(name, None)`, or `SentinelClient::build(urls, name, None,
    /// SentinelServerType::Master)`, feature `sentinel`).
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}/", s.port))
            .collect()
    }

    /// All of it in one string, for a config file:
    /// `redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/NAME`.
    ///
    /// The `redis` crate (1.8) has no single-URL form for Sentinel: it takes
    /// the sentinels' `redis://` URLs and the master name separately
    /// ([`SentinelGroup::sentinel_urls`]). This is the form a consumer
    /// splits into those: the scheme, comma-separated `host:port` of the
    /// sentinels, and the master name as the path.
    pub fn sentinel_url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinel_addrs()
            .iter()
            .map(SocketAddr::to_string)
            .collect();
        format!("redis+sentinel://{}/{}", hosts.join(","), self.name)
    }

    /// The port of the master, as every running sentinel reports it
    /// (`SENTINEL get-master-addr-by-name`). They may disagree for a moment
    /// during a failover: this waits until they agree.
    pub fn master_port(&self) -> u16 {
        wait_for_blocking(
            &format!(
                "every running sentinel reports the same master {:?}",
                self.name
            ),
            self.settle_deadline(),
            || self.agreed_master(),
        )
    }

    /// `redis://127.0.0.1:PORT/` of the master now.
    pub fn master_url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.master_port())
    }

    /// Ports of the running replicas of the master now, as its own
    /// `INFO replication` lists them.
    pub fn replicas(&self) -> Vec<u16> {
        let master = self.master_port();
        let mut ports: Vec<u16> = running(&self.servers)
            .into_iter()
            .filter(|&p| p != master)
            .filter(|&p| {
                info(p, "replication").is_some_and(|i| {
                    i.get("role").map(String::as_str) == Some("slave")
                        && i.get("master_port") == Some(&master.to_string())
                })
            })
            .collect();
        ports.sort_unstable();
        ports
    }

    /// Waits until every running replica has the master's whole replication
    /// stream (`slave_repl_offset` equals the master's `master_repl_offset`):
    /// after this, what was written to the master survives its loss.
    pub fn wait_replicated(&self) {
        let master = self.master_port();
        let replicas = self.replicas();
        wait_until_blocking(
            &format!("replicas {replicas:?} reach the replication offset of master {master}"),
            self.settle_deadline(),
            || replicated(master, &replicas),
        );
    }

    /// SIGKILLs the master and returns its port. The sentinels fail over
    /// about `down_after` plus an election later: see
    /// [`SentinelGroup::wait_failover`].
    pub fn kill_master(&mut self) -> u16 {
        let port = self.master_port();
        self.server_mut(port).proc.kill9();
        port
    }

    /// SIGSTOPs the server on `port` until [`SentinelGroup::resume`]: a
    /// replica stops reading its master's stream.
    pub fn pause(&mut self, port: u16) {
        self.server_mut(port).proc.stop();
    }

    /// SIGCONTs a server [`SentinelGroup::pause`] stopped.
    pub fn resume(&mut self, port: u16) {
        self.server_mut(port).proc.cont();
    }

    /// SIGKILLs the server (master or replica) on `port`.
    pub fn kill(&mut self, port: u16) {
        self.server_mut(port).proc.kill9();
    }

    /// Waits until every running sentinel reports a master other than
    /// `old_port` and that server says `role:master`; returns its port.
    pub fn wait_failover(&self, old_port: u16) -> u16 {
        wait_for_blocking(
            &format!("the sentinels fail {:?} over from {old_port}", self.name),
            self.settle_deadline(),
            || {
                self.agreed_master().filter(|&p| {
                    p != old_port
                        && info(p, "replication")
                            .is_some_and(|i| i.get("role").map(String::as_str) == Some("master"))
                })
            },
        )
    }

    /// Starts the killed server on `port` again, empty, and waits until the
    /// sentinels see it up again.
    ///
    /// After a failover it starts as a replica of the current master
    /// (`--replicaof`), as its restarted config would say once Sentinel had
    /// rewritten it; started as a master, it would be an empty second master
    /// until the sentinels' next `INFO` round (every 10 s) converted it.
    /// Restarted before any failover, the master comes back as the (empty)
    /// master, and its replica resyncs from it and loses its data: that is
    /// what Redis without persistence does.
    pub fn restart(&mut self, port: u16) {
        let master = self.master_port();
        let server = self.server_mut(port);
        assert!(
            server.proc.reaped(),
            "redis:{port} still runs: kill it before restart"
        );
        let replicaof = (master != port).then_some(master);
        server.proc = server_cmd_of(port, &server.dir, replicaof).spawn();
        wait_restarted(&mut server.proc, port, || ping(port));
        if replicaof.is_some() {
            wait_linked(port);
        }
        wait_until_blocking(
            &format!("every sentinel sees redis:{port} up again"),
            self.settle_deadline(),
            || self.settled(master),
        );
    }

    /// True if every running sentinel reports `master_port` as master, sees
    /// it and every running replica up, and knows the other running
    /// sentinels.
    fn settled(&self, master_port: u16) -> bool {
        let replicas: Vec<u16> = running(&self.servers)
            .into_iter()
            .filter(|&p| p != master_port)
            .collect();
        let sentinels = running(&self.sentinels);
        sentinels.iter().all(|&sp| {
            if get_master_port(sp, &self.name) != Some(master_port) {
                return false;
            }
            let Some(m) = sentinel_master(sp, &self.name) else {
                return false;
            };
            if m.get("flags").map(String::as_str) != Some("master")
                || m.get("num-other-sentinels") != Some(&(sentinels.len() - 1).to_string())
            {
                return false;
            }
            let Ok(known) = query::<Vec<HashMap<String, String>>>(
                sp,
                redis::cmd("SENTINEL").arg("REPLICAS").arg(&self.name),
            ) else {
                return false;
            };
            replicas.iter().all(|p| {
                known.iter().any(|r| {
                    r.get("port") == Some(&p.to_string())
                        && r.get("flags").map(String::as_str) == Some("slave")
                })
            })
        })
    }

    /// The master every running sentinel reports, if they agree.
    fn agreed_master(&self) -> Option<u16> {
        let mut agreed = None;
        for sp in running(&self.sentinels) {
            let port = get_master_port(sp, &self.name)?;
            if *agreed.get_or_insert(port) != port {
                return None;
            }
        }
        agreed
    }

    /// Detection, election, promotion and the news reaching every sentinel,
    /// with room for a split vote and its retry.
    fn settle_deadline(&self) -> Duration {
        ((self.down_after + self.failover_timeout * 2) * 3).max(Duration::from_secs(30))
    }

    fn server_mut(&mut self, port: u16) -> &mut Member {
        member_mut(&mut self.servers, port, "Sentinel group")
    }
}

/// `SENTINEL get-master-addr-by-name NAME` on the sentinel on `port`.
fn get_master_port(port: u16, name: &str) -> Option<u16> {
    let addr: Option<(String, String)> = query(
        port,
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(name),
    )
    .ok()?;
    addr?.1.parse().ok()
}

/// `SENTINEL MASTER NAME` on the sentinel on `port`, as field -> value.
fn sentinel_master(port: u16, name: &str) -> Option<HashMap<String, String>> {
    query(port, redis::cmd("SENTINEL").arg("MASTER").arg(name)).ok()
}
