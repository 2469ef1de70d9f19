//! The processes the demo starts, and the guarantee that it stops them all.
//!
//! Each child runs in its own process group, writes to its own log file in
//! the state directory, and gets `PR_SET_PDEATHSIG = SIGKILL`, so even a demo
//! killed with SIGKILL takes its servers with it. [`Procs::stop_all`] sends
//! SIGTERM (newest first), waits a little, then SIGKILLs what is left; the
//! same happens on drop (a panic).

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

pub struct Managed {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Managed {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once it exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

#[derive(Default)]
pub struct Procs {
    procs: Vec<Managed>,
}

pub struct Spec<'a> {
    pub name: String,
    pub program: &'a Path,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<&'a Path>,
    pub log_dir: &'a Path,
}

impl Procs {
    /// Starts a child. Call it from the main thread: Linux ties
    /// `PR_SET_PDEATHSIG` to the thread that forked.
    pub fn spawn(&mut self, spec: Spec<'_>) -> anyhow::Result<()> {
        let log_path = spec.log_dir.join(format!("{}.log", spec.name));
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let _ = writeln!(
            log,
            "===== demo: starting {}: {} {:?}",
            spec.name,
            spec.program.display(),
            spec.args
        );
        let mut cmd = Command::new(spec.program);
        cmd.args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        if let Some(dir) = spec.cwd {
            cmd.current_dir(dir);
        }
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(std::io::Error::other("parent exited during spawn"));
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| {
            format!(
                "starting {} ({}); run scripts/setup?",
                spec.name,
                spec.program.display()
            )
        })?;
        self.procs.push(Managed {
            name: spec.name,
            log: log_path,
            child,
        });
        Ok(())
    }

    /// Names of children that exited although nobody stopped them.
    pub fn dead(&mut self) -> Vec<String> {
        self.procs
            .iter_mut()
            .filter_map(|p| p.exited().map(|s| format!("{} ({s})", p.name)))
            .collect()
    }

    pub fn logs(&self) -> impl Iterator<Item = (&str, &Path)> {
        self.procs
            .iter()
            .map(|p| (p.name.as_str(), p.log.as_path()))
    }

    /// SIGTERM every child (newest first, so region-nodes go before the
    /// broker and Redis they flush to), wait up to `grace`, SIGKILL the rest.
    /// Returns how many were still running.
    pub fn stop_all(&mut self, grace: Duration) -> usize {
        let mut running = 0;
        for p in self.procs.iter_mut().rev() {
            if p.exited().is_none() {
                running += 1;
                // SAFETY: plain kill(2) on our unreaped child's group.
                unsafe {
                    libc::kill(-(p.pid() as libc::pid_t), libc::SIGTERM);
                }
            }
        }
        let start = Instant::now();
        while start.elapsed() < grace && self.procs.iter_mut().any(|p| p.exited().is_none()) {
            std::thread::sleep(Duration::from_millis(50));
        }
        for p in self.procs.iter_mut() {
            if p.exited().is_none() {
                // SAFETY: as above.
                unsafe {
                    libc::kill(-(p.pid() as libc::pid_t), libc::SIGKILL);
                }
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
        self.procs.clear();
        running
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        if !self.procs.is_empty() {
            self.stop_all(Duration::from_secs(3));
        }
    }
}

/// The last `n` lines of a log file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
