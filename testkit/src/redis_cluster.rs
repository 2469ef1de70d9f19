//! A throw-away Redis Cluster: masters and replicas on free loopback ports,
//! with failover, restart and resharding for tests.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tempfile::TempDir;

use crate::port::{free_port, sub_dir, temp_dir};
use crate::proc::{respawn_ready, spawn_on_free_port, Cmd};
use crate::redis_server::{
    member_mut, ping, query, redis_cli_bin, replicated, running, server_cmd, Member,
};
use crate::wait::{wait_for_blocking, wait_until_blocking, START_DEADLINE};

/// Hash slots of a Redis Cluster.
pub const SLOTS: u16 = tierlimit_shared::keys::CLUSTER_SLOTS;

/// Builder of a [`RedisCluster`]: how many masters, replicas per master,
/// and the node timeout.
#[derive(Clone, Debug)]
pub struct ClusterBuilder {
    masters: usize,
    replicas_per_master: usize,
    node_timeout: Duration,
}

impl ClusterBuilder {
    /// `--cluster-node-timeout` (default 2 s). A master is failed over
    /// about two node timeouts after it stops answering (detection, then
    /// the replica election); Redis's own default of 15 s would make every
    /// failover test wait half a minute.
    pub fn node_timeout(mut self, timeout: Duration) -> ClusterBuilder {
        self.node_timeout = timeout;
        self
    }

    /// Starts the servers, joins them with `redis-cli --cluster create`, and
    /// waits until every node says `cluster_state:ok` and all agree on one
    /// slot map with every slot assigned and every replica attached.
    pub fn start(self) -> RedisCluster {
        assert!(
            self.masters >= 3,
            "redis-cli --cluster create needs at least 3 masters, asked for {}",
            self.masters
        );
        let dir = temp_dir();
        let count = self.masters * (1 + self.replicas_per_master);
        let nodes: Vec<Member> = (0..count)
            .map(|i| start_node(sub_dir(dir.path(), &format!("node{i}")), self.node_timeout))
            .collect();
        let cluster = RedisCluster {
            nodes,
            node_timeout: self.node_timeout,
            _dir: dir,
        };
        let mut args = vec!["--cluster".to_string(), "create".to_string()];
        args.extend(
            cluster
                .nodes
                .iter()
                .map(|n| format!("127.0.0.1:{}", n.port)),
        );
        args.extend([
            "--cluster-replicas".to_string(),
            self.replicas_per_master.to_string(),
            "--cluster-yes".to_string(),
        ]);
        redis_cli(&args, START_DEADLINE);
        let want_replicas = count - self.masters;
        wait_until_blocking(
            "every cluster node says cluster_state:ok and all agree on the slot map and replicas",
            START_DEADLINE,
            || {
                cluster.stable().is_some_and(|view| {
                    view.len() == count
                        && view.values().filter(|e| !e.master).count() == want_replicas
                })
            },
        );
        cluster
    }
}

/// Starts one `redis-server --cluster-enabled yes` in `dir`, where its
/// `nodes.conf` lives, so that a restart keeps its node ID and rejoins.
fn start_node(dir: PathBuf, node_timeout: Duration) -> Member {
    let (proc, port) = spawn_on_free_port(
        "redis-server --cluster-enabled yes",
        |port| {
            // A node that lost the port race may have written its ID.
            let _ = std::fs::remove_file(dir.join("nodes.conf"));
            // The bus port is explicit (`cluster-port`, Redis 7): the
            // default PORT+10000 may be taken, or above 65535 for a port
            // from the ephemeral range.
            let bus = free_port();
            server_cmd(port, &dir)
                .label(format!("redis-cluster:{port}"))
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-port", &bus.to_string()])
                .args([
                    "--cluster-node-timeout",
                    &node_timeout.as_millis().to_string(),
                ])
                .spawn()
        },
        ping,
    );
    Member { proc, port, dir }
}

/// A throw-away Redis Cluster on free loopback ports (see
/// [`RedisCluster::start`]); every server is killed when it is dropped.
///
/// Nothing is persisted (`--save "" --appendonly no`): a restarted node
/// comes back empty and gets its data from its master. Roles change
/// (failover, restart), so every question about the topology (which node is
/// master, who serves a slot) is asked of the running nodes with
/// `CLUSTER NODES` at call time, never remembered.
///
/// The methods block (they poll with deadlines). In an async test that keeps
/// traffic running meanwhile, use `#[tokio::test(flavor = "multi_thread")]`
/// and call them in `tokio::task::block_in_place`, not `spawn_blocking`:
/// [`RedisCluster::restart`] starts a server, which must be started from a
/// thread that lives as long as the test (see [`Proc`](crate::Proc)).
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Member>,
    node_timeout: Duration,
    _dir: TempDir,
}

impl RedisCluster {
    /// `masters` masters (at least 3) with `replicas_per_master` replicas
    /// each: `RedisCluster::start(3, 1)` is the usual six nodes. Node
    /// timeout 2 s; see [`RedisCluster::builder`] for another.
    pub fn start(masters: usize, replicas_per_master: usize) -> RedisCluster {
        RedisCluster::builder(masters, replicas_per_master).start()
    }

    pub fn builder(masters: usize, replicas_per_master: usize) -> ClusterBuilder {
        ClusterBuilder {
            masters,
            replicas_per_master,
            node_timeout: Duration::from_secs(2),
        }
    }

    /// The cluster's `--cluster-node-timeout`.
    pub fn node_timeout(&self) -> Duration {
        self.node_timeout
    }

    /// `redis://127.0.0.1:PORT/` of every node, running or not: what a
    /// cluster client is given to discover the rest.
    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}/", n.port))
            .collect()
    }

    /// `host:port` of every node: seeds for a cluster client.
    pub fn seed_addrs(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect()
    }

    /// The region-node URL of this cluster: `redis+cluster://h:p,h:p,…`.
    pub fn cluster_url(&self) -> String {
        format!("redis+cluster://{}", self.seed_addrs().join(","))
    }

    /// Ports of every node, running or not.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// Ports of the running masters, as a running node sees them now.
    pub fn masters(&self) -> Vec<u16> {
        self.running_with_role(true)
    }

    /// Ports of the running replicas, as a running node sees them now.
    pub fn replicas(&self) -> Vec<u16> {
        self.running_with_role(false)
    }

    fn running_with_role(&self, master: bool) -> Vec<u16> {
        let running = self.running();
        let view = running
            .iter()
            .find_map(|&p| cluster_nodes(p))
            .expect("no running cluster node answers CLUSTER NODES");
        let mut ports: Vec<u16> = view
            .values()
            .filter(|e| e.master == master && running.contains(&e.port))
            .map(|e| e.port)
            .collect();
        ports.sort_unstable();
        ports
    }

    /// The process ids of the nodes (for CPU accounting; a killed node's
    /// pid reads no CPU).
    pub fn pids(&self) -> Vec<u32> {
        self.nodes.iter().map(|n| n.proc.pid()).collect()
    }

    /// The port of the master serving `slot`, once every running node
    /// agrees on it (they may not for a moment after a failover or a
    /// reshard); panics if they do not within 10 node timeouts.
    pub fn master_of_slot(&self, slot: u16) -> u16 {
        wait_for_blocking(
            &format!("every running cluster node agrees on the master of slot {slot}"),
            self.settle_deadline(),
            || self.agreed_owner(slot),
        )
    }

    /// The hash slot of `key`: CRC16 (XMODEM) of the key, or of its hash tag
    /// (the part between the first `{` and the next `}`, if not empty),
    /// modulo 16384, as Redis computes it.
    pub fn slot_of(key: impl AsRef<[u8]>) -> u16 {
        tierlimit_shared::keys::cluster_slot(key.as_ref())
    }

    /// SIGKILLs the master serving `slot` and returns its port. Its replica
    /// takes over after about two node timeouts: see
    /// [`RedisCluster::wait_failover`].
    pub fn kill_master_of_slot(&mut self, slot: u16) -> u16 {
        let port = self.master_of_slot(slot);
        self.node_mut(port).proc.kill9();
        port
    }

    /// Ports of the running replicas of the master on `master`.
    pub fn replicas_of(&self, master: u16) -> Vec<u16> {
        let running = self.running();
        let view = running
            .iter()
            .find_map(|&p| cluster_nodes(p))
            .expect("no running cluster node answers CLUSTER NODES");
        let Some(id) = view
            .iter()
            .find(|(_, e)| e.port == master)
            .map(|(id, _)| id.clone())
        else {
            return Vec::new();
        };
        let mut ports: Vec<u16> = view
            .values()
            .filter(|e| e.master_id.as_ref() == Some(&id) && running.contains(&e.port))
            .map(|e| e.port)
            .collect();
        ports.sort_unstable();
        ports
    }

    /// SIGSTOPs the node on `port`: it answers nothing and reads nothing
    /// until [`RedisCluster::resume`] (a replica stops consuming its
    /// master's stream).
    pub fn pause(&mut self, port: u16) {
        self.node_mut(port).proc.stop();
    }

    /// SIGCONTs a node [`RedisCluster::pause`] stopped.
    pub fn resume(&mut self, port: u16) {
        self.node_mut(port).proc.cont();
    }

    /// SIGKILLs the node on `port` (master or replica).
    pub fn kill(&mut self, port: u16) {
        self.node_mut(port).proc.kill9();
    }

    /// Waits until a node other than `old_port` serves `slot` and the
    /// cluster is stable again ([`RedisCluster::wait_ok`]); returns the new
    /// master's port.
    pub fn wait_failover(&self, slot: u16, old_port: u16) -> u16 {
        wait_for_blocking(
            &format!("a node other than {old_port} serves slot {slot} and the cluster is ok"),
            self.settle_deadline(),
            || {
                self.agreed_owner(slot)
                    .filter(|&p| p != old_port && self.stable().is_some())
            },
        )
    }

    /// Starts the node on `port` again (with its `nodes.conf`, so it keeps
    /// its ID, but no data) and waits until the cluster is stable with it.
    /// After a failover it rejoins as a replica of the master that replaced
    /// it. Restarted *before* its replica took over, a master comes back as
    /// the (empty) master of its slots: that is what Redis does.
    pub fn restart(&mut self, port: u16) {
        let node = self.node_mut(port);
        assert!(
            !node.proc.is_running(),
            "redis-cluster:{port} still runs: kill it before restart"
        );
        respawn_ready(&mut node.proc, port, || ping(port));
        self.wait_ok();
    }

    /// Waits until the cluster is stable: every running node says
    /// `cluster_state:ok`, none suspects another (`fail?`), no slot is
    /// being migrated, and all agree on one view: the same nodes, roles and
    /// slot map, with all 16384 slots served by masters not marked failed.
    /// A killed node's failure is part of that view: right after a kill, this
    /// waits until its slots were failed over.
    pub fn wait_ok(&self) {
        wait_until_blocking(
            "every running cluster node says cluster_state:ok and all agree on the slot map",
            self.settle_deadline(),
            || self.stable().is_some(),
        );
    }

    /// Waits until every running replica has its master's whole
    /// replication stream: after this, what was written before survives a
    /// failover.
    pub fn wait_replicated(&self) {
        wait_until_blocking(
            "every cluster replica reaches its master's replication offset",
            self.settle_deadline(),
            || {
                let running = self.running();
                let Some(view) = self.stable() else {
                    return false;
                };
                view.iter()
                    .filter(|(_, e)| e.master && running.contains(&e.port))
                    .all(|(id, m)| {
                        let replicas: Vec<u16> = view
                            .values()
                            .filter(|r| {
                                r.master_id.as_ref() == Some(id) && running.contains(&r.port)
                            })
                            .map(|r| r.port)
                            .collect();
                        replicated(m.port, &replicas)
                    })
            },
        );
    }

    /// Moves `slots` slots from the master on `from_port` to the master on
    /// `to_port` with `redis-cli --cluster reshard` (keys included), waits
    /// until the cluster is stable, and returns the slots moved.
    pub fn reshard(&self, slots: usize, from_port: u16, to_port: u16) -> Vec<u16> {
        self.wait_ok();
        let before = self.slots_of(to_port);
        let from = node_id(from_port);
        let to = node_id(to_port);
        redis_cli(
            &[
                "--cluster".to_string(),
                "reshard".to_string(),
                format!("127.0.0.1:{from_port}"),
                "--cluster-from".to_string(),
                from,
                "--cluster-to".to_string(),
                to,
                "--cluster-slots".to_string(),
                slots.to_string(),
                "--cluster-yes".to_string(),
            ],
            START_DEADLINE,
        );
        self.wait_ok();
        self.slots_of(to_port)
            .into_iter()
            .filter(|s| !before.contains(s))
            .collect()
    }

    /// Moves one `slot`, with its keys, to the master on `to_port`, the way
    /// a live reshard does it: `CLUSTER SETSLOT slot IMPORTING` on the
    /// target, `MIGRATING` on the source, `MIGRATE … KEYS` in batches until
    /// the source has none left in the slot, then `SETSLOT slot NODE` on
    /// target, source and every other master. Clients that keep running get
    /// `ASK` redirections meanwhile and `MOVED` afterwards: this is how a
    /// test moves the slot of one hot tenant under traffic. Waits until every
    /// node agrees on the new owner. Does nothing if `to_port` serves it.
    pub fn move_slot(&self, slot: u16, to_port: u16) {
        let from_port = self.master_of_slot(slot);
        if from_port == to_port {
            return;
        }
        let from = node_id(from_port);
        let to = node_id(to_port);
        let setslot = |port: u16, args: &[&str]| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(args);
            query::<()>(port, &cmd).unwrap_or_else(|e| {
                panic!("CLUSTER SETSLOT {slot} {args:?} on 127.0.0.1:{port}: {e}")
            });
        };
        setslot(to_port, &["IMPORTING", &from]);
        setslot(from_port, &["MIGRATING", &to]);
        loop {
            let keys: Vec<Vec<u8>> = query(
                from_port,
                redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(100),
            )
            .unwrap_or_else(|e| panic!("CLUSTER GETKEYSINSLOT {slot} on {from_port}: {e}"));
            if keys.is_empty() {
                break;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate
                .arg("127.0.0.1")
                .arg(to_port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys);
            query::<()>(from_port, &migrate).unwrap_or_else(|e| {
                panic!(
                    "MIGRATE {} keys of slot {slot} from {from_port} to {to_port}: {e}",
                    keys.len()
                )
            });
        }
        setslot(to_port, &["NODE", &to]);
        setslot(from_port, &["NODE", &to]);
        for port in self.masters() {
            if port != to_port && port != from_port {
                setslot(port, &["NODE", &to]);
            }
        }
        wait_until_blocking(
            &format!("every running cluster node sees slot {slot} at {to_port}"),
            self.settle_deadline(),
            || self.agreed_owner(slot) == Some(to_port) && self.stable().is_some(),
        );
    }

    /// The slots the master on `port` serves, as it says itself.
    pub fn slots_of(&self, port: u16) -> Vec<u16> {
        let view = cluster_nodes(port)
            .unwrap_or_else(|| panic!("redis-cluster:{port} does not answer CLUSTER NODES"));
        view.values()
            .find(|e| e.port == port)
            .map(|e| e.slots.iter().flat_map(|&(a, b)| a..=b).collect())
            .unwrap_or_default()
    }

    /// How long topology changes may take to settle: failure detection,
    /// election and gossip are all paced by the node timeout.
    fn settle_deadline(&self) -> Duration {
        (self.node_timeout * 10).max(Duration::from_secs(30))
    }

    fn node_mut(&mut self, port: u16) -> &mut Member {
        member_mut(&mut self.nodes, port, "cluster")
    }

    /// Ports of the nodes not killed.
    fn running(&self) -> Vec<u16> {
        running(&self.nodes)
    }

    /// The owner of `slot` if every running node names the same one.
    fn agreed_owner(&self, slot: u16) -> Option<u16> {
        let mut owner = None;
        for port in self.running() {
            let view = cluster_nodes(port)?;
            let this = view
                .values()
                .find(|e| e.master && e.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))?
                .port;
            if *owner.get_or_insert(this) != this {
                return None;
            }
        }
        owner
    }

    /// The one view every running node shares, if the cluster is stable
    /// (see [`RedisCluster::wait_ok`]).
    fn stable(&self) -> Option<View> {
        let mut agreed: Option<View> = None;
        for port in self.running() {
            let info: String = query(port, redis::cmd("CLUSTER").arg("INFO")).ok()?;
            if !info.lines().any(|l| l.trim_end() == "cluster_state:ok") {
                return None;
            }
            let view = cluster_nodes(port)?;
            if view.values().any(|e| e.unsettled) {
                return None;
            }
            match &agreed {
                None => agreed = Some(view),
                Some(a) if *a == view => {}
                Some(_) => return None,
            }
        }
        let view = agreed?;
        let served: usize = view
            .values()
            .filter(|e| e.master && !e.failed)
            .flat_map(|e| e.slots.iter().map(|&(a, b)| usize::from(b - a) + 1))
            .sum();
        (served == usize::from(SLOTS)).then_some(view)
    }
}

/// One line of `CLUSTER NODES`, as far as the helpers compare views.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    port: u16,
    master: bool,
    /// The master's node ID, for a replica.
    master_id: Option<String>,
    /// Flagged `fail` (agreed failure).
    failed: bool,
    /// `fail?` (suspected by this node only), `handshake`, `noaddr`, or an
    /// open slot (`[slot->-id]`): the view is still changing.
    unsettled: bool,
    slots: Vec<(u16, u16)>,
}

/// Node ID -> entry.
type View = BTreeMap<String, Entry>;

/// `CLUSTER NODES` of the node on `port`, parsed; `None` if it does not
/// answer.
fn cluster_nodes(port: u16) -> Option<View> {
    let text: String = query(port, redis::cmd("CLUSTER").arg("NODES")).ok()?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(parse_node_line)
        .collect()
}

/// `<id> <ip:port@cport[,hostname]> <flags> <master> <ping-sent> <pong-recv>
/// <config-epoch> <link-state> <slot> <slot> …`
fn parse_node_line(line: &str) -> Option<(String, Entry)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 8 {
        return None;
    }
    let addr = f[1].split('@').next()?;
    let port = addr.rsplit(':').next()?.parse().ok()?;
    let flags: Vec<&str> = f[2].split(',').collect();
    let mut entry = Entry {
        port,
        master: flags.contains(&"master"),
        master_id: (f[3] != "-").then(|| f[3].to_string()),
        failed: flags.contains(&"fail"),
        unsettled: flags
            .iter()
            .any(|f| matches!(*f, "fail?" | "handshake" | "noaddr")),
        slots: Vec::new(),
    };
    for s in &f[8..] {
        if s.starts_with('[') {
            entry.unsettled = true;
        } else if let Some((a, b)) = s.split_once('-') {
            entry.slots.push((a.parse().ok()?, b.parse().ok()?));
        } else {
            let n = s.parse().ok()?;
            entry.slots.push((n, n));
        }
    }
    Some((f[0].to_string(), entry))
}

/// `CLUSTER MYID` of the node on `port`.
fn node_id(port: u16) -> String {
    query(port, redis::cmd("CLUSTER").arg("MYID"))
        .unwrap_or_else(|e| panic!("CLUSTER MYID on 127.0.0.1:{port}: {e}"))
}

/// Runs `redis-cli ARGS` to completion (killed after `deadline`); panics
/// with its output if it fails.
fn redis_cli(args: &[String], deadline: Duration) {
    let mut cli = Cmd::new(redis_cli_bin()).args(args).spawn();
    let status = cli.wait_exit(deadline);
    assert!(
        status.is_some_and(|s| s.success()),
        "redis-cli {} failed ({status:?}):\n{}",
        args.join(" "),
        cli.log()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster_keyslot() {
        // From `redis-cli CLUSTER KEYSLOT` on redis-server 7.0.15.
        for (key, slot) in [
            ("", 0),
            ("foo", 12182),
            ("bar", 5061),
            ("123456789", 12739),
            ("{user1000}.following", 3443),
            ("{user1000}.followers", 3443),
            ("foo{}{bar}", 8363),
            ("foo{{bar}}zap", 4015),
            ("foo{bar}{zap}", 5061),
            ("{}", 15257),
            ("a{b", 13340),
            ("tenant:{acme}:x", 11304),
        ] {
            assert_eq!(RedisCluster::slot_of(key), slot, "slot of {key:?}");
        }
    }

    #[test]
    fn parses_cluster_nodes_lines() {
        let (id, e) = parse_node_line(
            "847983d0 127.0.0.1:17002@17102 myself,master - 0 1795467182000 8 connected 5461-10922 12182 [93->-68c4df9b]",
        )
        .unwrap();
        assert_eq!(id, "847983d0");
        assert_eq!(e.port, 17002);
        assert!(e.master && !e.failed && e.unsettled);
        assert_eq!(e.slots, vec![(5461, 10922), (12182, 12182)]);
        let (_, e) = parse_node_line(
            "4364e003 127.0.0.1:17001@17101 slave,fail? b0754809 1795467166300 1795467165285 7 disconnected",
        )
        .unwrap();
        assert_eq!(e.master_id.as_deref(), Some("b0754809"));
        assert!(!e.master && !e.failed && e.unsettled);
    }
}
