//! A network built by the test itself, for partition tests: one Linux network
//! namespace per host, each with a veth pair onto one bridge in the root
//! namespace, and faults cut at the network layer the way Jepsen does it.
//!
//! ```text
//!   root namespace (the test process: clients, checkers)
//!        tlb<N>  10.77.<N>.1/24   (bridge)
//!          ├── tl<N>v0 ══ eth0 10.77.<N>.10  namespace tierlimit-<pid>-<N>-core
//!          ├── tl<N>v1 ══ eth0 10.77.<N>.11  namespace tierlimit-<pid>-<N>-<region 1>
//!          └── …
//! ```
//!
//! Rules it is built on:
//!
//! - **Nothing leaves the machine.** Addresses are in 10.77.<N>.0/24, used
//!   only on the bridge and inside the namespaces created here. The
//!   namespaces have no default route, and the bridge has no uplink.
//! - **Unique per run, clean on every exit.** `<N>` is a slot claimed
//!   atomically by creating the bridge `tlb<N>` (creation fails if another
//!   run holds it); namespace names carry the pid. [`Topology`] deletes
//!   everything on drop, panics included. Leftovers of a run that was
//!   SIGKILLed (its children die with it through `PR_SET_PDEATHSIG`) are
//!   found by the pid in their names and removed by the next run.
//! - **Fails loudly, never skips.** If namespaces cannot be created (not
//!   root, no `ip`/`iptables`, no kernel support) [`Topology::new`] panics
//!   with the reason.
//! - **Faults are network faults.** A partition is iptables `DROP` in both
//!   namespaces (no RST: peers see silence, as with a real cut); a lossy
//!   link is `-m statistic --mode random` drops; a slow link is a delaying
//!   TCP forwarder running *inside* the namespace plus a DNAT rule, so the
//!   client (librdkafka, with its advertised listeners) sees the same
//!   address and just a slower network. The kernel here has no `netem`.
//!   Every rule lives in the chains `TLFAULT` (filter) and `TLNAT` (nat) of
//!   the namespace, so [`Topology::heal`] is one flush per namespace.

use std::ffi::OsStr;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Cmd;

/// Prefix of every namespace this module creates.
pub const NS_PREFIX: &str = "tierlimit-";
/// First octets of every address used; the third octet is the slot.
const NET: [u8; 2] = [10, 77];
/// Packet mark the delay forwarder puts on its own upstream connections, so
/// the DNAT rule that feeds it does not catch them.
const PROXY_MARK: u32 = 0x77;
/// Filter and nat chains holding every fault rule of a namespace.
const FAULT_CHAIN: &str = "TLFAULT";
const NAT_CHAIN: &str = "TLNAT";

/// One host of the topology: a network namespace with one address.
#[derive(Debug, Clone)]
pub struct Host {
    /// Logical name ("core", "eu", …).
    pub name: String,
    /// Network namespace name (`ip netns`).
    pub ns: String,
    pub ip: Ipv4Addr,
    /// Host end of the veth pair (in the root namespace, on the bridge).
    veth: String,
}

impl Host {
    /// `ip:port` as a string.
    pub fn addr(&self, port: u16) -> String {
        format!("{}:{port}", self.ip)
    }
}

/// The whole network: bridge, namespaces, veths, fault rules and delay
/// forwarders. Dropping it removes all of it.
///
/// Drop every process running in the namespaces *before* the topology (in a
/// struct, declare the processes first: fields drop in declaration order).
pub struct Topology {
    slot: u8,
    bridge: String,
    bridge_ip: Ipv4Addr,
    hosts: Vec<Host>,
    proxies: Mutex<Vec<DelayProxy>>,
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topology")
            .field("slot", &self.slot)
            .field("bridge", &self.bridge)
            .field("hosts", &self.hosts)
            .finish()
    }
}

/// Runs a short command (ip, iptables) to completion; `Err` carries its
/// stderr.
pub fn run<S: AsRef<OsStr>>(program: &str, args: &[S]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let argv: Vec<String> = args
            .iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect();
        Err(format!(
            "`{program} {}` failed ({}): {}",
            argv.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Like [`run`], panicking with the error.
fn must<S: AsRef<OsStr>>(program: &str, args: &[S]) -> String {
    run(program, args).unwrap_or_else(|e| panic!("topology: {e}"))
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Everything the suite needs from the machine; the error names what is
/// missing. Called by [`Topology::new`], which panics with it.
pub fn preflight() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(
            "the partition suite creates network namespaces and must run as root \
                    (CI runs as root; locally use sudo)"
                .into(),
        );
    }
    run("ip", &["-V"]).map_err(|e| format!("{e} (install iproute2: scripts/setup)"))?;
    run("iptables", &["--version"])
        .map_err(|e| format!("{e} (install iptables: scripts/setup)"))?;
    Ok(())
}

/// Removes namespaces and bridges left by runs whose process is gone.
fn sweep_leftovers() {
    if let Ok(list) = run("ip", &["netns", "list"]) {
        for line in list.lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            let Some(rest) = name.strip_prefix(NS_PREFIX) else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if !pid_alive(pid) {
                let _ = run("ip", &["netns", "del", name]);
            }
        }
    }
    // Bridges carry "tierlimit-test pid <pid>" as their alias.
    if let Ok(list) = run("ip", &["-o", "link", "show", "type", "bridge"]) {
        for line in list.lines() {
            let Some(name) = line
                .split(": ")
                .nth(1)
                .map(|n| n.split('@').next().unwrap_or(n))
            else {
                continue;
            };
            if !name.starts_with("tlb") {
                continue;
            }
            let pid = line
                .split("alias tierlimit-test pid ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(pid) = pid {
                if !pid_alive(pid) {
                    // Its veths go with the namespaces (deleted above) or here.
                    if let Some(slot) = name.strip_prefix("tlb") {
                        if let Ok(links) = run("ip", &["-o", "link", "show"]) {
                            for l in links.lines() {
                                if let Some(v) = l
                                    .split(": ")
                                    .nth(1)
                                    .map(|n| n.split('@').next().unwrap_or(n))
                                {
                                    if v.starts_with(&format!("tl{slot}v")) {
                                        let _ = run("ip", &["link", "del", v]);
                                    }
                                }
                            }
                        }
                    }
                    let _ = run("ip", &["link", "del", name]);
                }
            }
        }
    }
}

impl Topology {
    /// Creates the bridge and one namespace per name in `hosts` (the first
    /// gets 10.77.N.10, the next .11, …), with loopback up, the fault chains
    /// installed, and every namespace reachable from the root namespace and
    /// from each other. Panics with the reason if any of it fails.
    pub fn new(hosts: &[&str]) -> Topology {
        if let Err(e) = preflight() {
            panic!("cannot build the test network: {e}");
        }
        static LOCK: Mutex<()> = Mutex::new(());
        let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        sweep_leftovers();
        let pid = std::process::id();
        // Claim a slot: bridge creation is atomic, so two runs never share one.
        let mut claimed = None;
        let mut last_err = String::new();
        for slot in 1u8..=250 {
            let bridge = format!("tlb{slot}");
            match run("ip", &["link", "add", &bridge, "type", "bridge"]) {
                Ok(_) => {
                    claimed = Some((slot, bridge));
                    break;
                }
                Err(e) if e.contains("File exists") => continue,
                Err(e) => {
                    last_err = e;
                    break;
                }
            }
        }
        let Some((slot, bridge)) = claimed else {
            panic!("cannot build the test network: cannot create a bridge: {last_err}");
        };
        let bridge_ip = Ipv4Addr::new(NET[0], NET[1], slot, 1);
        let mut topo = Topology {
            slot,
            bridge: bridge.clone(),
            bridge_ip,
            hosts: Vec::new(),
            proxies: Mutex::new(Vec::new()),
        };
        // From here on, a panic drops `topo`, which removes what exists.
        must(
            "ip",
            &[
                "link",
                "set",
                &bridge,
                "alias",
                &format!("tierlimit-test pid {pid}"),
            ],
        );
        must(
            "ip",
            &["addr", "add", &format!("{bridge_ip}/24"), "dev", &bridge],
        );
        must("ip", &["link", "set", &bridge, "up"]);
        for (i, name) in hosts.iter().enumerate() {
            assert!(
                name.chars().all(|c| c.is_ascii_alphanumeric()) && name.len() <= 12,
                "host name {name:?}: letters and digits only, at most 12"
            );
            let ns = format!("{NS_PREFIX}{pid}-{slot}-{name}");
            let veth = format!("tl{slot}v{i}");
            let peer = format!("tl{slot}p{i}");
            let ip = Ipv4Addr::new(NET[0], NET[1], slot, 10 + i as u8);
            if let Err(e) = run("ip", &["netns", "add", &ns]) {
                panic!("cannot build the test network: cannot create a network namespace: {e}");
            }
            topo.hosts.push(Host {
                name: name.to_string(),
                ns: ns.clone(),
                ip,
                veth: veth.clone(),
            });
            must(
                "ip",
                &[
                    "link", "add", &veth, "type", "veth", "peer", "name", &peer, "netns", &ns,
                ],
            );
            must("ip", &["-n", &ns, "link", "set", &peer, "name", "eth0"]);
            must(
                "ip",
                &["-n", &ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"],
            );
            must("ip", &["-n", &ns, "link", "set", "eth0", "up"]);
            must("ip", &["-n", &ns, "link", "set", "lo", "up"]);
            must("ip", &["link", "set", &veth, "master", &bridge]);
            must("ip", &["link", "set", &veth, "up"]);
            topo.iptables(&ns, &["-N", FAULT_CHAIN]);
            topo.iptables(&ns, &["-I", "INPUT", "-j", FAULT_CHAIN]);
            topo.iptables(&ns, &["-I", "OUTPUT", "-j", FAULT_CHAIN]);
            topo.iptables(&ns, &["-t", "nat", "-N", NAT_CHAIN]);
            topo.iptables(&ns, &["-t", "nat", "-I", "OUTPUT", "-j", NAT_CHAIN]);
        }
        drop(_guard);
        // Every host answers from the root namespace and from every other.
        for h in &topo.hosts {
            topo.wait_reachable(None, h);
            if let Some(first) = topo.hosts.first() {
                if first.ns != h.ns {
                    topo.wait_reachable(Some(first), h);
                }
            }
        }
        topo
    }

    fn wait_reachable(&self, from: Option<&Host>, to: &Host) {
        // A TCP connect to a closed port: "refused" proves the path works.
        let start = Instant::now();
        loop {
            let ip = to.ip;
            let ok = match from {
                None => tcp_path_works(ip),
                Some(f) => in_namespace(&f.ns, move || tcp_path_works(ip)).unwrap_or(false),
            };
            if ok {
                return;
            }
            if start.elapsed() > Duration::from_secs(10) {
                panic!(
                    "topology: {} unreachable from {} after 10s",
                    to.name,
                    from.map_or("the root namespace", |f| f.name.as_str())
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The slot: the third octet of every address.
    pub fn slot(&self) -> u8 {
        self.slot
    }

    /// The root namespace's address on the bridge (where test clients come
    /// from).
    pub fn bridge_ip(&self) -> Ipv4Addr {
        self.bridge_ip
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// The host called `name`; panics if there is none.
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("topology has no host {name:?}"))
    }

    /// A [`Cmd`] running `program` inside `host`'s namespace
    /// (`ip netns exec NS program …`). `ip` execs the program in place, so
    /// the pid, the process group and `PR_SET_PDEATHSIG` are the program's.
    pub fn cmd(&self, host: &str, program: impl AsRef<OsStr>) -> Cmd {
        let h = self.host(host);
        let label = std::path::Path::new(program.as_ref())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Cmd::new("ip")
            .args(["netns", "exec", &h.ns])
            .arg(program)
            .label(format!("{label}@{}", h.name))
    }

    /// Runs a short command inside `host`'s namespace to completion.
    pub fn exec(&self, host: &Host, argv: &[&str]) -> Result<String, String> {
        let mut args = vec!["netns", "exec", host.ns.as_str()];
        args.extend_from_slice(argv);
        run("ip", &args)
    }

    fn iptables(&self, ns: &str, args: &[&str]) {
        let mut argv = vec!["netns", "exec", ns, "iptables", "-w"];
        argv.extend_from_slice(args);
        must("ip", &argv);
    }

    fn fault_rule(&self, host: &Host, rule: &[&str]) {
        let mut args = vec!["-A", FAULT_CHAIN];
        args.extend_from_slice(rule);
        self.iptables(&host.ns, &args);
    }

    // -----------------------------------------------------------------
    // Faults
    // -----------------------------------------------------------------

    /// Cuts every packet between `a` and `b`, both directions, in both
    /// namespaces (DROP: no reset, the peers just stop hearing each other).
    pub fn partition(&self, a: &str, b: &str) {
        let (ha, hb) = (self.host(a).clone(), self.host(b).clone());
        for (me, other) in [(&ha, &hb), (&hb, &ha)] {
            let ip = other.ip.to_string();
            self.fault_rule(me, &["-s", &ip, "-j", "DROP"]);
            self.fault_rule(me, &["-d", &ip, "-j", "DROP"]);
        }
    }

    /// Cuts `a` from `b` as a real network cut does: each namespace drops
    /// what arrives from the other, nothing on the way out. [`partition`]
    /// also drops outgoing packets, which the kernel reports to the sender
    /// at once (`EPERM` on a connect or send), so a client retries at its
    /// own pace; here its SYN leaves and is never answered, and it waits on
    /// the kernel's retransmissions (1, 3, 7, 15, 31 s) as it would behind
    /// a failed link.
    ///
    /// [`partition`]: Topology::partition
    pub fn blackhole(&self, a: &str, b: &str) {
        let (ha, hb) = (self.host(a).clone(), self.host(b).clone());
        for (me, other) in [(&ha, &hb), (&hb, &ha)] {
            self.fault_rule(me, &["-s", &other.ip.to_string(), "-j", "DROP"]);
        }
    }

    /// Drops each packet between `a` and `b` with `probability`, in each
    /// direction (rules in `a`'s namespace).
    pub fn lossy(&self, a: &str, b: &str, probability: f64) {
        let (ha, hb) = (self.host(a).clone(), self.host(b).clone());
        let ip = hb.ip.to_string();
        let p = format!("{probability:.4}");
        for dir in ["-s", "-d"] {
            self.fault_rule(
                &ha,
                &[
                    dir,
                    &ip,
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    &p,
                    "-j",
                    "DROP",
                ],
            );
        }
    }

    /// Makes `host`'s TCP `port` unreachable for everyone (including its
    /// own namespace's loopback): packets to and from it are dropped.
    pub fn block_port(&self, host: &str, port: u16) {
        let h = self.host(host).clone();
        let p = port.to_string();
        self.fault_rule(&h, &["-p", "tcp", "--dport", &p, "-j", "DROP"]);
        self.fault_rule(&h, &["-p", "tcp", "--sport", &p, "-j", "DROP"]);
    }

    /// Makes `host`'s TCP `port` unreachable for the clients inside its own
    /// namespace only (the test process, coming through the bridge, still
    /// gets through): packets between the host's address and that port are
    /// dropped in both directions.
    pub fn block_port_locally(&self, host: &str, port: u16) {
        let h = self.host(host).clone();
        let (p, ip) = (port.to_string(), h.ip.to_string());
        self.fault_rule(
            &h,
            &[
                "-s", &ip, "-d", &ip, "-p", "tcp", "--dport", &p, "-j", "DROP",
            ],
        );
        self.fault_rule(
            &h,
            &[
                "-s", &ip, "-d", &ip, "-p", "tcp", "--sport", &p, "-j", "DROP",
            ],
        );
    }

    /// Sends `from`'s TCP connections to `to:port` through a forwarder
    /// running inside `from`'s namespace that delays every byte by
    /// `base ± jitter` in each direction (order kept). New connections are
    /// redirected by DNAT; existing direct ones are reset so the client
    /// reconnects through the forwarder. Undone by [`Topology::heal`].
    pub fn delay(&self, from: &str, to: &str, port: u16, base: Duration, jitter: Duration) {
        let (hf, ht) = (self.host(from).clone(), self.host(to).clone());
        let proxy_port = 19_000 + port % 1000;
        let listen = SocketAddrV4::new(hf.ip, proxy_port);
        let target = SocketAddrV4::new(ht.ip, port);
        let proxy = DelayProxy::start(&hf.ns, listen, target, base, jitter)
            .unwrap_or_else(|e| panic!("topology: delay forwarder in {}: {e}", hf.name));
        self.proxies.lock().unwrap().push(proxy);
        let (to_ip, port_s, mark) = (
            ht.ip.to_string(),
            port.to_string(),
            format!("0x{PROXY_MARK:x}"),
        );
        let dest = format!("{}:{proxy_port}", hf.ip);
        // TCP to the target that did not come through the forwarder (whose
        // packets carry the mark).
        let unproxied = [
            "-p", "tcp", "-d", &to_ip, "--dport", &port_s, "-m", "mark", "!", "--mark", &mark,
        ];
        let dnat = ["-j", "DNAT", "--to-destination", &dest];
        let nat: Vec<&str> = ["-t", "nat", "-A", NAT_CHAIN]
            .iter()
            .chain(&unproxied)
            .chain(&dnat)
            .copied()
            .collect();
        self.iptables(&hf.ns, &nat);
        // Connections made before the rule still go direct: reset them.
        // (Packets of new connections are already rewritten by DNAT when the
        // filter chain sees them, and the forwarder's carry the mark.)
        let reset = ["-j", "REJECT", "--reject-with", "tcp-reset"];
        let rule: Vec<&str> = unproxied.iter().chain(&reset).copied().collect();
        self.fault_rule(&hf, &rule);
    }

    /// Takes `host`'s link down (the veth end on the bridge).
    pub fn link_down(&self, host: &str) {
        must("ip", &["link", "set", &self.host(host).veth, "down"]);
    }

    /// Ends every fault: flushes the fault chains of every namespace, stops
    /// the delay forwarders (their connections close; clients reconnect
    /// directly) and brings every link up.
    pub fn heal(&self) {
        for h in &self.hosts {
            self.iptables(&h.ns, &["-F", FAULT_CHAIN]);
            self.iptables(&h.ns, &["-t", "nat", "-F", NAT_CHAIN]);
            must("ip", &["link", "set", &h.veth, "up"]);
        }
        let proxies: Vec<DelayProxy> = std::mem::take(&mut *self.proxies.lock().unwrap());
        drop(proxies);
    }

    /// Bytes forwarded by the delay forwarders so far (to prove traffic
    /// really went through them).
    pub fn delayed_bytes(&self) -> u64 {
        self.proxies
            .lock()
            .unwrap()
            .iter()
            .map(|p| p.bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// The fault rules of `host` with packet counters (for diagnostics).
    pub fn fault_counters(&self, host: &str) -> String {
        self.exec(
            self.host(host),
            &["iptables", "-w", "-L", FAULT_CHAIN, "-v", "-n"],
        )
        .unwrap_or_else(|e| e)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let proxies: Vec<DelayProxy> =
            std::mem::take(&mut *self.proxies.lock().unwrap_or_else(|e| e.into_inner()));
        drop(proxies);
        let mut errors = Vec::new();
        for h in &self.hosts {
            if let Err(e) = run("ip", &["link", "del", &h.veth]) {
                errors.push(e);
            }
            if let Err(e) = run("ip", &["netns", "del", &h.ns]) {
                errors.push(e);
            }
        }
        if let Err(e) = run("ip", &["link", "del", &self.bridge]) {
            errors.push(e);
        }
        if !errors.is_empty() {
            eprintln!("topology: teardown: {}", errors.join("; "));
        }
    }
}

/// Runs `f` on a new thread that has entered the network namespace `ns`
/// (sockets it creates belong to that namespace).
pub fn in_namespace<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        enter_namespace(&path)?;
        Ok(f())
    })
    .join()
    .map_err(|_| "namespace thread panicked".to_string())?
}

/// Spawns a thread that enters the network namespace `ns` and runs `f`
/// (a server, say); sockets it creates belong to that namespace.
pub fn spawn_in_namespace<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<Result<T, String>> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        enter_namespace(&path)?;
        Ok(f())
    })
}

/// `setns` of the calling thread into the network namespace at `path`.
fn enter_namespace(path: &str) -> Result<(), String> {
    let f = std::fs::File::open(path).map_err(|e| format!("open {path}: {e}"))?;
    // SAFETY: setns on a valid fd; affects the calling thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("setns {path}: {}", io::Error::last_os_error()));
    }
    Ok(())
}

/// True if a TCP connect from here to `ip` port 9 gets an answer (a refusal
/// counts: the path works).
fn tcp_path_works(ip: Ipv4Addr) -> bool {
    match std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from((ip, 9)),
        Duration::from_millis(300),
    ) {
        Ok(_) => true,
        Err(e) => e.kind() == io::ErrorKind::ConnectionRefused,
    }
}

// ---------------------------------------------------------------------------
// The delaying TCP forwarder
// ---------------------------------------------------------------------------

/// A TCP forwarder running on its own thread *inside a network namespace*
/// (the thread `setns`es into it before creating any socket), delaying every
/// chunk of bytes by `base ± jitter` in each direction, keeping order.
/// Upstream connections carry [`PROXY_MARK`]. Stops (closing every
/// connection) on drop.
pub struct DelayProxy {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    bytes: Arc<AtomicU64>,
}

impl DelayProxy {
    pub fn start(
        ns: &str,
        listen: SocketAddrV4,
        target: SocketAddrV4,
        base: Duration,
        jitter: Duration,
    ) -> Result<DelayProxy, String> {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let ns_path = format!("/run/netns/{ns}");
        let bytes = Arc::new(AtomicU64::new(0));
        let counted = bytes.clone();
        let thread = std::thread::Builder::new()
            .name(format!("delay-proxy-{ns}"))
            .spawn(move || {
                let setup =
                    (|| -> Result<(tokio::runtime::Runtime, std::net::TcpListener), String> {
                        enter_namespace(&ns_path)?;
                        let l = std::net::TcpListener::bind(listen)
                            .map_err(|e| format!("bind {listen}: {e}"))?;
                        l.set_nonblocking(true).map_err(|e| e.to_string())?;
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .map_err(|e| e.to_string())?;
                        Ok((rt, l))
                    })();
                let (rt, listener) = match setup {
                    Ok(v) => {
                        let _ = ready_tx.send(Ok(()));
                        v
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                    let mut stop_rx = stop_rx;
                    let mut seed = seed();
                    loop {
                        tokio::select! {
                            _ = &mut stop_rx => break,
                            accepted = listener.accept() => {
                                let Ok((client, _)) = accepted else { continue };
                                seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
                                let counted = counted.clone();
                                tokio::spawn(forward(client, target, base, jitter, seed, counted));
                            }
                        }
                    }
                });
                // Dropping the runtime drops every connection task.
                drop(rt);
            })
            .map_err(|e| e.to_string())?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(DelayProxy {
                stop: Some(stop_tx),
                thread: Some(thread),
                bytes,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err("forwarder thread died".into()),
        }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.as_nanos() as u64) ^ 0xD1B5_4A32_D192_ED03 | 1
}

/// xorshift64*: a few random bits without a dependency.
fn next_rand(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

async fn forward(
    client: tokio::net::TcpStream,
    target: SocketAddrV4,
    base: Duration,
    jitter: Duration,
    seed: u64,
    counted: Arc<AtomicU64>,
) {
    let Ok(sock) = tokio::net::TcpSocket::new_v4() else {
        return;
    };
    let mark: libc::c_int = PROXY_MARK as libc::c_int;
    // SAFETY: setsockopt with a valid fd and an int option value.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MARK,
            &mark as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return;
    }
    let Ok(Ok(upstream)) =
        tokio::time::timeout(Duration::from_secs(10), sock.connect(target.into())).await
    else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    let up = pump(cr, uw, base, jitter, seed, counted.clone());
    let down = pump(ur, cw, base, jitter, seed ^ 0xABCD_EF01_2345_6789, counted);
    // When one direction ends the other follows (half-close is forwarded).
    let _ = tokio::join!(up, down);
}

/// Copies `r` to `w`, releasing each chunk `base ± jitter` after it was
/// read and never before the previous one (a delayed pipe keeps order).
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    base: Duration,
    jitter: Duration,
    mut seed: u64,
    counted: Arc<AtomicU64>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let writer = async move {
        while let Some((at, data)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if w.write_all(&data).await.is_err() {
                return;
            }
            counted.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        let _ = w.shutdown().await;
    };
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut last = tokio::time::Instant::now();
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let j = jitter.as_micros() as u64;
                    let offset = if j == 0 {
                        0
                    } else {
                        next_rand(&mut seed) % (2 * j + 1)
                    };
                    let d = (base.as_micros() as u64 + offset).saturating_sub(j);
                    let at = (tokio::time::Instant::now() + Duration::from_micros(d)).max(last);
                    last = at;
                    if tx.send((at, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
        // Dropping tx lets the writer finish and forward the half-close.
    };
    tokio::join!(reader, writer);
}
