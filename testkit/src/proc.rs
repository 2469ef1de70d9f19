//! Child processes: what to run ([`Cmd`]), one running child killed on drop
//! ([`Proc`]), and a group stopped together ([`ProcGroup`]).

use std::ffi::{OsStr, OsString};
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::port::temp_dir;
use crate::wait::{POLL, START_DEADLINE};

/// How many lines of a child's log a panicking caller prints.
pub const LOG_TAIL_LINES: usize = 60;

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
    /// Outlives its parent: a session of its own, no `PR_SET_PDEATHSIG`.
    detached: bool,
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
            detached: false,
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

    /// The child outlives this process: it gets a session of its own and no
    /// `PR_SET_PDEATHSIG`, and [`Proc::detach`] lets it go. Only for
    /// servers started by hand (`scripts/infra`), never in tests.
    pub fn detached(mut self) -> Cmd {
        self.detached = true;
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
        self.try_spawn().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts the process, or returns why it could not be started (the
    /// program is missing, the log file cannot be opened), naming the label
    /// and the program: for a caller that reports errors instead of
    /// panicking, such as the demo.
    pub fn try_spawn(self) -> io::Result<Proc> {
        let (log_path, log_dir) = match &self.log {
            Some(p) => (p.clone(), None),
            None => {
                let dir = temp_dir();
                (dir.path().join("output.log"), Some(dir))
            }
        };
        let child = try_start_child(&self, &log_path)?;
        Ok(Proc {
            pid: child.id(),
            child: Some(child),
            exit: None,
            cmd: self,
            log_path,
            _log_dir: log_dir,
        })
    }
}

fn start_child(cmd: &Cmd, log_path: &Path) -> Child {
    try_start_child(cmd, log_path).unwrap_or_else(|e| panic!("{e}"))
}

fn try_start_child(cmd: &Cmd, log_path: &Path) -> io::Result<Child> {
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .map_err(|e| io::Error::new(e.kind(), format!("open log {}: {e}", log_path.display())))?;
    let _ = writeln!(
        log,
        "===== harness: starting {}: {:?} {:?}",
        cmd.label, cmd.program, cmd.args
    );
    let stderr = log.try_clone()?;
    let mut c = Command::new(&cmd.program);
    c.args(&cmd.args)
        .envs(cmd.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(stderr);
    if !cmd.detached {
        // Its own process group, so that kill9 also reaches anything the
        // child started (a shell's children, say).
        c.process_group(0);
    }
    if let Some(dir) = &cmd.cwd {
        c.current_dir(dir);
    }
    let parent = std::process::id() as libc::pid_t;
    let detached = cmd.detached;
    // SAFETY: only async-signal-safe calls (setsid, prctl, getppid, signal)
    // between fork and exec.
    unsafe {
        c.pre_exec(move || {
            if detached {
                // A session (and process group) of its own: a terminal's
                // hangup does not reach it, and nothing ties it to us.
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                for sig in [libc::SIGHUP, libc::SIGINT, libc::SIGTERM, libc::SIGQUIT] {
                    libc::signal(sig, libc::SIG_DFL);
                }
                return Ok(());
            }
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
    c.spawn().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "cannot start {} ({:?}): {e}{}",
                cmd.label,
                cmd.program,
                if e.kind() == io::ErrorKind::NotFound {
                    " (not installed? run scripts/setup)"
                } else {
                    ""
                }
            ),
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

    /// Lets a [`Cmd::detached`] process run on after this `Proc` is
    /// dropped; returns its pid.
    pub fn detach(mut self) -> u32 {
        assert!(
            self.cmd.detached,
            "{}: only a Cmd::detached process can be let go",
            self.cmd.label
        );
        self.child = None;
        self.pid
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

    /// True once the process was reaped ([`Proc::kill9`], or an exit seen
    /// by [`Proc::poll_exit`]). Unlike [`Proc::is_running`] it needs no
    /// `&mut` and does not look again: what a topology helper needs to tell
    /// the servers it killed from the ones it expects to answer.
    pub fn reaped(&self) -> bool {
        self.child.is_none()
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

    /// Sends `signal` to the process's whole group (it and whatever it
    /// started). Does nothing once it was reaped.
    pub fn signal_group(&self, signal: libc::c_int) {
        if self.child.is_some() {
            // SAFETY: plain kill(2); the group exists until we reap the leader.
            unsafe {
                libc::kill(-(self.pid as libc::pid_t), signal);
            }
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
pub(crate) fn addr_in_use(log: &str) -> bool {
    let l = log.to_ascii_lowercase();
    l.contains("address already in use") || l.contains("addrinuse")
}

/// What [`wait_ready`] saw.
pub(crate) enum Ready {
    Yes,
    AddrInUse,
}

/// Polls `ready` until true; if the process exits first, reports a port
/// collision (so the caller retries elsewhere) or panics with its status
/// (the log tail is printed as the `Proc` drops).
pub(crate) fn wait_ready(proc: &mut Proc, mut ready: impl FnMut() -> bool) -> Ready {
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

/// Starts a server on a free port and waits until `ready(port)`: `spawn`
/// starts it on the port it is given; when the server reports its address
/// taken (the race [`free_port`] cannot close), it is started again on
/// another port. Returns the ready process and its port.
///
/// [`free_port`]: crate::port::free_port
pub(crate) fn spawn_on_free_port(
    what: &str,
    mut spawn: impl FnMut(u16) -> Proc,
    mut ready: impl FnMut(u16) -> bool,
) -> (Proc, u16) {
    for _attempt in 0..5 {
        let port = crate::port::free_port();
        let mut proc = spawn(port);
        match wait_ready(&mut proc, || ready(port)) {
            Ready::Yes => return (proc, port),
            Ready::AddrInUse => continue,
        }
    }
    panic!("{what}: no free port after 5 attempts");
}

/// Kills `proc` if it runs, starts the same command again and waits until
/// `ready`. Its port cannot change (clients and peers know it), so a port
/// taken meanwhile by another process is fatal.
pub(crate) fn respawn_ready(proc: &mut Proc, port: u16, ready: impl FnMut() -> bool) {
    proc.respawn();
    wait_restarted(proc, port, ready);
}

/// [`wait_ready`] for a server restarted on its old `port`: a port taken
/// meanwhile by another process is fatal.
pub(crate) fn wait_restarted(proc: &mut Proc, port: u16, ready: impl FnMut() -> bool) {
    if let Ready::AddrInUse = wait_ready(proc, ready) {
        panic!(
            "{}: port {port} taken by another process during restart",
            proc.label()
        );
    }
}

/// Processes that live and die together: a whole world of the demo or of a
/// bench scenario (and, as they land, a Redis Cluster's six servers or a
/// Sentinel group).
///
/// [`ProcGroup::stop_all`] stops them gracefully, newest first, so that
/// region-nodes go before the broker and the Redis they flush to; dropping
/// the group does the same with a short grace (every [`Proc`] is also killed
/// on its own drop).
#[derive(Debug, Default)]
pub struct ProcGroup {
    procs: Vec<Proc>,
}

impl ProcGroup {
    pub fn new() -> ProcGroup {
        ProcGroup::default()
    }

    /// Adds a started process; returns its index for [`ProcGroup::get`].
    pub fn push(&mut self, proc: Proc) -> usize {
        self.procs.push(proc);
        self.procs.len() - 1
    }

    /// Starts `cmd` and adds it. Call it from a thread that lives as long as
    /// the group (see [`Proc`] on `PR_SET_PDEATHSIG`).
    pub fn spawn(&mut self, cmd: Cmd) -> usize {
        self.push(cmd.spawn())
    }

    /// [`ProcGroup::spawn`] that returns the error ([`Cmd::try_spawn`])
    /// instead of panicking; nothing is added then.
    pub fn try_spawn(&mut self, cmd: Cmd) -> io::Result<usize> {
        Ok(self.push(cmd.try_spawn()?))
    }

    pub fn get(&self, i: usize) -> &Proc {
        &self.procs[i]
    }

    pub fn get_mut(&mut self, i: usize) -> &mut Proc {
        &mut self.procs[i]
    }

    pub fn iter(&self) -> impl Iterator<Item = &Proc> {
        self.procs.iter()
    }

    /// Labels (with exit status) of members that exited although nobody
    /// stopped them.
    pub fn dead(&mut self) -> Vec<String> {
        self.procs
            .iter_mut()
            .filter_map(|p| p.poll_exit().map(|s| format!("{} ({s})", p.label())))
            .collect()
    }

    /// (label, log file) of every member.
    pub fn logs(&self) -> impl Iterator<Item = (&str, &Path)> {
        self.procs.iter().map(|p| (p.label(), p.log_path()))
    }

    /// SIGTERM to every member's process group (newest first), waits up to
    /// `grace` for them to exit, SIGKILLs the rest. Returns how many were
    /// still running when asked to stop.
    pub fn stop_all(&mut self, grace: Duration) -> usize {
        let mut running = 0;
        for p in self.procs.iter_mut().rev() {
            if p.is_running() {
                running += 1;
                p.signal_group(libc::SIGTERM);
            }
        }
        let start = Instant::now();
        while start.elapsed() < grace && self.procs.iter_mut().any(|p| p.is_running()) {
            std::thread::sleep(POLL);
        }
        for p in self.procs.iter_mut() {
            p.kill9();
        }
        self.procs.clear();
        running
    }
}

impl Drop for ProcGroup {
    fn drop(&mut self) {
        if !self.procs.is_empty() {
            self.stop_all(Duration::from_secs(3));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_stops_its_members_and_reports_the_dead() {
        let mut g = ProcGroup::new();
        let sleeper = g.spawn(Cmd::new("sleep").arg("60").label("sleeper"));
        g.spawn(Cmd::new("true").label("quick"));
        let pid = g.get(sleeper).pid();
        crate::wait_until_blocking("quick exits", Duration::from_secs(10), || {
            !g.dead().is_empty()
        });
        assert_eq!(g.dead().len(), 1);
        assert!(g.dead()[0].starts_with("quick"));
        assert_eq!(g.stop_all(Duration::from_secs(5)), 1);
        // SAFETY: kill(2) with signal 0 only checks for existence.
        let alive = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0;
        assert!(!alive, "sleeper still runs after stop_all");
    }

    #[test]
    fn try_spawn_reports_a_missing_program_and_adds_nothing() {
        let mut g = ProcGroup::new();
        let e = g
            .try_spawn(Cmd::new("/nonexistent/tierlimit-no-such-program").label("ghost"))
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        let msg = e.to_string();
        assert!(
            msg.contains("ghost") && msg.contains("run scripts/setup"),
            "{msg}"
        );
        assert_eq!(g.iter().count(), 0);
        let i = g.try_spawn(Cmd::new("true")).expect("true starts");
        assert!(g.get_mut(i).wait_exit(Duration::from_secs(10)).is_some());
    }

    #[test]
    fn a_proc_logs_its_output_and_respawns_identically() {
        let mut p = Cmd::new("sh").args(["-c", "echo hello"]).spawn();
        assert!(p.wait_exit(Duration::from_secs(10)).is_some());
        p.respawn();
        assert!(p.wait_exit(Duration::from_secs(10)).is_some());
        assert_eq!(p.log().lines().filter(|l| *l == "hello").count(), 2);
    }
}
