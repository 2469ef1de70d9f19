//! Test harness for tierlimit's integration tests: real `redis-server`, a real
//! Kafka-protocol broker (Tansu), and the real `region-node` and `aggregator`
//! binaries, all on loopback ports.
//!
//! The rules it is built on, and why:
//!
//! - **Real processes, no mocks.** The interesting failures of a rate limiter
//!   spread over Redis and Kafka (a Lua script that is not atomic, a consumer
//!   that loses its position, a broker restart) only show against the real
//!   thing. Everything here starts a real server on `127.0.0.1`.
//! - **No sleeps as synchronisation.** Every wait polls a condition with a
//!   deadline ([`wait_until`], [`wait_for`], [`wait_until_blocking`]) and
//!   panics naming what it waited for. A fixed sleep is either too short on a
//!   loaded 2-core CI machine (flaky) or too long everywhere else (slow).
//! - **Children never outlive the test.** A [`Proc`] is SIGKILLed and reaped
//!   on drop, and every child is started with `PR_SET_PDEATHSIG = SIGKILL`, so
//!   even a test process killed by a timeout takes its servers with it.
//! - **Failing tests explain themselves.** Each child writes stdout and stderr
//!   to a log file; a [`Proc`] dropped while its thread panics prints the last
//!   [`LOG_TAIL_LINES`] lines of that log to stderr, so a failed assertion
//!   arrives with what the server said just before.
//! - **Ports are picked, not fixed.** [`free_port`] lets tests run in
//!   parallel, beside the machine's own Redis on 6379 and each other.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::OpenOptions;
use std::future::Future;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use tempfile::TempDir;

pub use tempfile;

/// How often the wait helpers re-check their condition.
pub const POLL: Duration = Duration::from_millis(20);

/// How many lines of a child's log a panicking test prints.
pub const LOG_TAIL_LINES: usize = 60;

/// How long a server may take to become ready before the test fails.
/// Generous because CI builds in debug on 2 cores, often while compiling.
pub const START_DEADLINE: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------
// Ports, directories, config files
// ---------------------------------------------------------------------------

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// The kernel picks it (bind to port 0), so parallel tests and parallel test
/// processes rarely collide; the port is remembered so that this process
/// never hands the same one out twice (the kernel may offer a just-released
/// port again while the first server is still starting). There is an
/// unavoidable window between releasing the port and the server binding it:
/// the `start` functions here retry with a fresh port when a server reports
/// its address already in use.
pub fn free_port() -> u16 {
    static HANDED_OUT: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let handed = HANDED_OUT.get_or_init(|| Mutex::new(HashSet::new()));
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local_addr").port();
        if handed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port)
        {
            return port;
        }
    }
}

/// A fresh temporary directory (removed on drop), named so that leftovers
/// are recognisable in /tmp.
pub fn temp_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("tierlimit-")
        .tempdir()
        .expect("create temp dir")
}

/// Writes `toml` to `dir/tierlimit.toml` and returns the path.
///
/// The write is atomic (temporary file + rename), so a process reloading on
/// SIGHUP never reads a half-written file; calling it again on the same `dir`
/// replaces the config, which is how reload tests change it. The text is not
/// validated here: tests of invalid configuration need to write one.
pub fn write_config(dir: &Path, toml: &str) -> PathBuf {
    let path = dir.join("tierlimit.toml");
    let tmp = dir.join(".tierlimit.toml.tmp");
    std::fs::write(&tmp, toml).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
    path
}

// ---------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------

/// Polls `f` every [`POLL`] until it returns true; panics with `what` once
/// `deadline` has passed.
///
/// Each call of `f` is itself bounded by what remains of the deadline, so a
/// condition that hangs (an HTTP call to a SIGSTOPped server) still fails in
/// time instead of hanging the test.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(what, deadline, move || {
        let fut = f();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Like [`wait_until`], for a condition that produces a value: polls `f`
/// until it returns `Some(v)` and returns `v`.
pub async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        let remaining = deadline.saturating_sub(start.elapsed()).max(POLL);
        if let Ok(Some(v)) = tokio::time::timeout(remaining, f()).await {
            return v;
        }
        if start.elapsed() >= deadline {
            panic!("timed out after {deadline:?} waiting until {what}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The blocking form of [`wait_until`], for code outside an async context
/// (and for the synchronous `start` functions here).
pub fn wait_until_blocking(what: &str, deadline: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    loop {
        if f() {
            return;
        }
        if start.elapsed() >= deadline {
            panic!("timed out after {deadline:?} waiting until {what}");
        }
        std::thread::sleep(POLL);
    }
}

// ---------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------

/// What to run: a program, its arguments, environment and working directory,
/// and where its output goes. Kept (and `Clone`) so a [`Proc`] can be started
/// again identically by [`Proc::respawn`].
#[derive(Clone, Debug)]
pub struct Cmd {
    label: String,
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    cwd: Option<PathBuf>,
    log: Option<PathBuf>,
}

impl Cmd {
    /// A command running `program` (a path, or a name looked up in `PATH`).
    /// The child inherits this process's environment plus what
    /// [`Cmd::env`] adds.
    pub fn new(program: impl AsRef<OsStr>) -> Cmd {
        let program = program.as_ref().to_os_string();
        let label = Path::new(&program)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| program.to_string_lossy().into_owned());
        Cmd {
            label,
            program,
            args: Vec::new(),
            env: Vec::new(),
            cwd: None,
            log: None,
        }
    }

    /// The name used in log headers and panic output (default: file name of
    /// the program).
    pub fn label(mut self, label: impl Into<String>) -> Cmd {
        self.label = label.into();
        self
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Cmd {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Cmd {
        self.env
            .push((key.as_ref().to_os_string(), value.as_ref().to_os_string()));
        self
    }

    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Cmd {
        self.cwd = Some(dir.into());
        self
    }

    /// Where stdout and stderr go (appended). Default: `output.log` in a
    /// temporary directory owned by the [`Proc`].
    pub fn log_file(mut self, path: impl Into<PathBuf>) -> Cmd {
        self.log = Some(path.into());
        self
    }

    /// Starts the process. Panics if it cannot be started.
    pub fn spawn(self) -> Proc {
        let (log_path, log_dir) = match &self.log {
            Some(p) => (p.clone(), None),
            None => {
                let dir = temp_dir();
                (dir.path().join("output.log"), Some(dir))
            }
        };
        let child = start_child(&self, &log_path);
        Proc {
            pid: child.id(),
            child: Some(child),
            exit: None,
            cmd: self,
            log_path,
            _log_dir: log_dir,
        }
    }
}

fn start_child(cmd: &Cmd, log_path: &Path) -> Child {
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .unwrap_or_else(|e| panic!("open log {}: {e}", log_path.display()));
    let _ = writeln!(
        log,
        "===== harness: starting {}: {:?} {:?}",
        cmd.label, cmd.program, cmd.args
    );
    let stderr = log.try_clone().expect("dup log file");
    let mut c = Command::new(&cmd.program);
    c.args(&cmd.args)
        .envs(cmd.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(stderr)
        // Its own process group, so that kill9 also reaches anything the
        // child started (a shell's children, say).
        .process_group(0);
    if let Some(dir) = &cmd.cwd {
        c.current_dir(dir);
    }
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls (prctl, getppid) between fork and
    // exec.
    unsafe {
        c.pre_exec(move || {
            // Die with the parent. Linux delivers this when the *thread* that
            // forked exits, so spawn from the test's thread (or another
            // thread that lives as long as the test), not from a short-lived
            // blocking-pool thread.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() != parent {
                return Err(io::Error::other("parent exited during spawn"));
            }
            // Children start with default dispositions for the signals the
            // tests send, even when the test runner was started with them
            // ignored (nohup, some CI runners): an ignored SIGHUP is
            // inherited across exec and would silently defeat reload tests.
            for sig in [libc::SIGHUP, libc::SIGINT, libc::SIGTERM, libc::SIGQUIT] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    c.spawn().unwrap_or_else(|e| {
        panic!(
            "cannot start {} ({:?}): {e}{}",
            cmd.label,
            cmd.program,
            if e.kind() == io::ErrorKind::NotFound {
                " (not installed? run scripts/setup)"
            } else {
                ""
            }
        )
    })
}

/// A running child process, killed (SIGKILL) and reaped when dropped.
///
/// Its stdout and stderr go to a log file ([`Proc::log`]); if the `Proc` is
/// dropped while the thread is panicking (a failing test), the last
/// [`LOG_TAIL_LINES`] lines are printed to stderr.
///
/// Children get `PR_SET_PDEATHSIG = SIGKILL`, which Linux ties to the
/// *thread* that spawned them: spawn from the test's own thread (or a thread
/// that lives as long as the test, like a Tokio worker), never from
/// `spawn_blocking`, whose idle threads exit after a few seconds and would
/// take the child with them.
#[derive(Debug)]
pub struct Proc {
    cmd: Cmd,
    /// `None` once reaped: after that the pid may be reused by an unrelated
    /// process, so no signal is sent to it any more.
    child: Option<Child>,
    exit: Option<ExitStatus>,
    pid: u32,
    log_path: PathBuf,
    _log_dir: Option<TempDir>,
}

impl Proc {
    /// Starts `program` with `args`, plus `env` on top of this process's
    /// environment. See [`Cmd`] for more control.
    pub fn spawn<I, S>(program: impl AsRef<OsStr>, args: I, env: &[(&str, &str)]) -> Proc
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Cmd::new(program).args(args);
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        cmd.spawn()
    }

    /// The pid of the current (or last) incarnation.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn label(&self) -> &str {
        &self.cmd.label
    }

    /// True while the process has not exited (reaps it if it has).
    pub fn is_running(&mut self) -> bool {
        self.poll_exit().is_none()
    }

    /// The exit status, if the process has exited (reaps it).
    pub fn poll_exit(&mut self) -> Option<ExitStatus> {
        if let Some(child) = &mut self.child {
            if let Ok(Some(status)) = child.try_wait() {
                self.exit = Some(status);
                self.child = None;
            }
        }
        self.exit
    }

    /// SIGKILL (to its whole process group) and reap. Harmless if it already
    /// exited.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: plain kill(2); the group exists until we reap the leader.
            unsafe {
                libc::kill(-(self.pid as libc::pid_t), libc::SIGKILL);
            }
            let _ = child.kill();
            self.exit = child.wait().ok();
        }
    }

    /// Sends `signal` to the process (not its group). Panics if it was
    /// already reaped.
    pub fn signal(&self, signal: libc::c_int) {
        assert!(
            self.child.is_some(),
            "{}: cannot send signal {signal}: process already exited ({:?})",
            self.cmd.label,
            self.exit
        );
        // SAFETY: plain kill(2) on our own unreaped child: the pid cannot
        // have been reused.
        let rc = unsafe { libc::kill(self.pid as libc::pid_t, signal) };
        assert_eq!(
            rc,
            0,
            "{}: kill({}, {signal}): {}",
            self.cmd.label,
            self.pid,
            io::Error::last_os_error()
        );
    }

    /// SIGSTOP: the process freezes (simulates a hung server: connections
    /// stay open, nothing answers).
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT: resume after [`Proc::stop`].
    pub fn cont(&self) {
        self.signal(libc::SIGCONT);
    }

    /// SIGHUP: region-node and aggregator reload their config file.
    pub fn hup(&self) {
        self.signal(libc::SIGHUP);
    }

    /// SIGTERM, then waits up to `deadline` for a graceful exit; panics if it
    /// does not exit in time (the process is then SIGKILLed on drop).
    pub fn terminate(&mut self, deadline: Duration) -> ExitStatus {
        if self.child.is_some() {
            self.signal(libc::SIGTERM);
        }
        self.wait_exit(deadline).unwrap_or_else(|| {
            panic!(
                "{} did not exit within {deadline:?} of SIGTERM",
                self.cmd.label
            )
        })
    }

    /// Waits up to `deadline` for the process to exit by itself.
    pub fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.poll_exit() {
                return Some(status);
            }
            if start.elapsed() >= deadline {
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Kills the process if it runs, then starts the same command again
    /// (same arguments, environment, working directory), appending to the
    /// same log.
    pub fn respawn(&mut self) {
        self.kill9();
        let child = start_child(&self.cmd, &self.log_path);
        self.pid = child.id();
        self.child = Some(child);
        self.exit = None;
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the process (all its incarnations) wrote so far. Each
    /// incarnation starts with a `===== harness: starting …` line quoting the
    /// command line, so match whole lines rather than substrings of
    /// arguments.
    pub fn log(&self) -> String {
        let mut buf = Vec::new();
        if let Ok(mut f) = std::fs::File::open(&self.log_path) {
            let _ = f.read_to_end(&mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// The last `n` lines of [`Proc::log`].
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "----- last {LOG_TAIL_LINES} lines of {} (pid {}, {}) -----\n{}\n----- end of {} -----",
                self.cmd.label,
                self.pid,
                self.log_path.display(),
                self.log_tail(LOG_TAIL_LINES),
                self.cmd.label,
            );
        }
    }
}

/// True if a log says the listen address was taken (the race [`free_port`]
/// cannot close), so the caller should retry on another port.
fn addr_in_use(log: &str) -> bool {
    let l = log.to_ascii_lowercase();
    l.contains("address already in use") || l.contains("addrinuse")
}

// ---------------------------------------------------------------------------
// Workspace binaries
// ---------------------------------------------------------------------------

/// Path of a workspace binary (`region-node`, `aggregator`).
///
/// With `TIERLIMIT_BIN_DIR` set, that directory is used as is (no build).
/// Otherwise the binary is looked up in the same target directory and profile
/// as this test executable (`target/debug/deps/xxx` → `target/debug/NAME`),
/// after running `cargo build --workspace --bins` once per test process.
///
/// Why build at all: `cargo test -p tierlimit-tests` does not rebuild other
/// packages' binaries, so after an edit to region-node the tests would
/// silently run the old binary. `scripts/test` builds the binaries first with
/// the same command, so there this build is a no-op that takes a moment.
/// If that build fails (another crate mid-edit) but the binary exists, it is
/// used with a warning on stderr; if it does not exist, this panics with
/// cargo's errors. Set `TIERLIMIT_SKIP_BUILD=1` to use whatever binary is
/// there without building.
pub fn bin_path(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("TIERLIMIT_BIN_DIR") {
        let path = PathBuf::from(dir).join(name);
        assert!(
            path.is_file(),
            "{} does not exist (TIERLIMIT_BIN_DIR is set)",
            path.display()
        );
        return path;
    }
    let profile_dir = profile_dir();
    let path = profile_dir.join(name);
    let skip = std::env::var_os("TIERLIMIT_SKIP_BUILD").is_some_and(|v| !v.is_empty() && v != "0");
    if !skip || !path.is_file() {
        if let Err(e) = build_binaries_once(&profile_dir) {
            // Another crate of the workspace may be mid-edit: a binary that
            // exists is still worth testing, with a warning that it may be
            // older than the source.
            if !path.is_file() {
                panic!("{e}");
            }
            eprintln!(
                "harness: WARNING: using {} as it is, it may be stale: {e}",
                path.display()
            );
        }
    }
    assert!(
        path.is_file(),
        "binary {name} not found at {} even after `cargo build --workspace --bins`; \
         is `{name}` a [[bin]] of the workspace?",
        path.display()
    );
    path
}

/// `target/<profile>` of the running test executable.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("test executable has a directory");
    if dir.file_name() == Some(OsStr::new("deps")) {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

fn build_binaries_once(profile_dir: &Path) -> Result<(), String> {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let result = BUILT.get_or_init(|| {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("tests/ is inside the workspace");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace)
            .args(["build", "--workspace", "--bins", "--manifest-path"])
            .arg(workspace.join("Cargo.toml"));
        if let Some(target_dir) = profile_dir.parent() {
            cmd.arg("--target-dir").arg(target_dir);
        }
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
        }
        eprintln!("harness: running {cmd:?}");
        match cmd.output() {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(format!(
                "`cargo build --workspace --bins` failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )),
            Err(e) => Err(format!("cannot run cargo: {e}")),
        }
    });
    result.clone()
}

// ---------------------------------------------------------------------------
// Redis
// ---------------------------------------------------------------------------

/// A throw-away `redis-server` on a free loopback port, keeping nothing on
/// disk (`--save "" --appendonly no`), so a restart comes back empty, which
/// is how a region's Redis losing its data is simulated.
///
/// The binary is `$REDIS_SERVER_BIN` or `redis-server` from `PATH`.
#[derive(Debug)]
pub struct Redis {
    pub proc: Proc,
    port: u16,
    dir: TempDir,
}

impl Redis {
    /// Starts a server and waits until it answers PING.
    pub fn start() -> Redis {
        let dir = temp_dir();
        for _attempt in 0..5 {
            let port = free_port();
            let mut proc = Self::cmd(port, dir.path()).spawn();
            match wait_ready(&mut proc, || ping(port)) {
                Ready::Yes => return Redis { proc, port, dir },
                Ready::AddrInUse => continue,
            }
        }
        panic!("redis-server: no free port after 5 attempts");
    }

    fn cmd(port: u16, dir: &Path) -> Cmd {
        let bin = std::env::var_os("REDIS_SERVER_BIN").unwrap_or_else(|| "redis-server".into());
        Cmd::new(bin)
            .label(format!("redis:{port}"))
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .log_file(dir.join(format!("redis-{port}.log")))
    }

    /// `redis://127.0.0.1:PORT/`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// True if the server answers PING right now.
    pub fn ping(&self) -> bool {
        ping(self.port)
    }

    /// SIGKILL and reap: the region's Redis is gone.
    pub fn kill(&mut self) {
        self.proc.kill9();
    }

    /// Starts the server again on the same port, with no data, and waits
    /// until it answers PING. Kills the running one first if needed.
    pub fn restart_empty(&mut self) {
        self.proc.kill9();
        self.proc.respawn();
        let port = self.port;
        if let Ready::AddrInUse = wait_ready(&mut self.proc, || ping(port)) {
            panic!("redis-server: port {port} taken by another process during restart");
        }
    }

    /// A multiplexed async connection (needs a Tokio runtime).
    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.url()))
    }

    /// The server's working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// One PING over a plain socket (no client library, no runtime needed).
fn ping(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    buf[..got].starts_with(b"+PONG")
}

enum Ready {
    Yes,
    AddrInUse,
}

/// Polls `ready` until true; if the process exits first, reports a port
/// collision (so the caller retries elsewhere) or panics with its status
/// (the log tail is printed as the `Proc` drops).
fn wait_ready(proc: &mut Proc, mut ready: impl FnMut() -> bool) -> Ready {
    let start = Instant::now();
    loop {
        if let Some(status) = proc.poll_exit() {
            if addr_in_use(&proc.log()) {
                return Ready::AddrInUse;
            }
            panic!("{} exited before it was ready: {status}", proc.label());
        }
        if ready() {
            return Ready::Yes;
        }
        if start.elapsed() >= START_DEADLINE {
            panic!("{} not ready within {START_DEADLINE:?}", proc.label());
        }
        std::thread::sleep(POLL);
    }
}

// ---------------------------------------------------------------------------
// Tansu (Kafka protocol broker)
// ---------------------------------------------------------------------------

/// The Tansu binary: `$TANSU_BIN`, else `tansu` on `PATH`, else
/// `$CARGO_HOME/bin/tansu` (where `scripts/setup` installs it).
pub fn tansu_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TANSU_BIN") {
        return PathBuf::from(p);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("tansu");
            if p.is_file() {
                return p;
            }
        }
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"));
    let p = cargo_home.join("bin").join("tansu");
    assert!(
        p.is_file(),
        "tansu not found ($TANSU_BIN, PATH, {}): run scripts/setup",
        p.display()
    );
    p
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
        for _attempt in 0..5 {
            let port = free_port();
            let mut proc = Self::cmd(port, dir.path()).spawn();
            let brokers = format!("127.0.0.1:{port}");
            match wait_ready(&mut proc, || metadata_answers(&brokers, port)) {
                Ready::Yes => return Tansu { proc, port, dir },
                Ready::AddrInUse => continue,
            }
        }
        panic!("tansu: no free port after 5 attempts");
    }

    fn cmd(port: u16, dir: &Path) -> Cmd {
        let url = format!("tcp://127.0.0.1:{port}");
        Cmd::new(tansu_bin())
            .label(format!("tansu:{port}"))
            .arg("broker")
            .args(["--kafka-cluster-id", "tierlimit-test"])
            .args(["--listener-url", &url])
            .args(["--advertised-listener-url", &url])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .current_dir(dir)
            .env(
                "RUST_LOG",
                std::env::var("TANSU_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .log_file(dir.join(format!("tansu-{port}.log")))
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
        let admin: AdminClient<DefaultClientContext> =
            self.client_config().create().expect("admin client");
        let new_topics: Vec<NewTopic> = topics
            .iter()
            .map(|name| {
                config.iter().fold(
                    NewTopic::new(name, partitions, TopicReplication::Fixed(1)),
                    |t, (k, v)| t.set(k, v),
                )
            })
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
        let results = admin
            .create_topics(new_topics.iter(), &opts)
            .await
            .unwrap_or_else(|e| panic!("CreateTopics {topics:?}: {e}"));
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => panic!("cannot create topic {name}: {code}"),
            }
        }
        let brokers = self.brokers();
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
    }

    /// SIGKILL and reap: the broker is gone (the database stays).
    pub fn kill(&mut self) {
        self.proc.kill9();
    }

    /// Starts the broker again on the same port with the same database, so
    /// every record survives, and waits until metadata answers. Kills the
    /// running one first if needed.
    pub fn restart(&mut self) {
        self.proc.kill9();
        self.proc.respawn();
        let brokers = self.brokers();
        let port = self.port;
        if let Ready::AddrInUse = wait_ready(&mut self.proc, || metadata_answers(&brokers, port)) {
            panic!("tansu: port {port} taken by another process during restart");
        }
    }
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

fn metadata_answers(brokers: &str, port: u16) -> bool {
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

fn topics_ready(brokers: &str, topics: &[String], partitions: i32) -> bool {
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

// ---------------------------------------------------------------------------
// region-node and aggregator
// ---------------------------------------------------------------------------

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

/// GETs `url` and parses its JSON body; panics naming the URL if either
/// fails (a test's precondition, not its subject).
pub async fn get_json(http: &reqwest::Client, url: &str) -> serde_json::Value {
    http.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: not JSON: {e}"))
}

/// GETs a Prometheus endpoint and sums metric `name` over its label sets
/// (see [`cluster::metric_value`]).
pub async fn scrape_metric(http: &reqwest::Client, url: &str, name: &str) -> f64 {
    let text = http
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    cluster::metric_value(&text, name)
}

pub mod cluster;
pub mod history;
pub mod topology;
