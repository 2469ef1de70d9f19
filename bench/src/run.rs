//! One run of the bench: its temporary directory, the command lines it ran
//! (the report lists them), the load average as each scenario started, and
//! the ways it drives tools that run to completion (`loadgen`,
//! `redis-benchmark`).

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use testkit::{Cmd, Proc, POLL};

use crate::loadgen::Summary;

/// What every scenario shares.
#[derive(Debug)]
pub struct Run {
    /// The run's temporary directory (`$TMP` in the listed commands).
    pub tmp: PathBuf,
    /// `$TMP/results`: loadgen's JSON, each scenario's typed result.
    pub res: PathBuf,
    pub loadgen: PathBuf,
    pub started: Instant,
    commands: Mutex<Vec<String>>,
    loads: Mutex<Vec<(String, String)>>,
}

impl Run {
    pub fn new(tmp: PathBuf, loadgen: PathBuf) -> anyhow::Result<Run> {
        let res = tmp.join("results");
        std::fs::create_dir_all(&res).with_context(|| format!("create {}", res.display()))?;
        Ok(Run {
            tmp,
            res,
            loadgen,
            started: Instant::now(),
            commands: Mutex::new(Vec::new()),
            loads: Mutex::new(Vec::new()),
        })
    }

    pub fn say(&self, what: &str) {
        eprintln!("\nbench: {what}");
    }

    /// Marks a scenario's start with the machine's 1-minute load average,
    /// which the report prints: on a shared machine it tells how much CPU
    /// was left. `what` is `"NAME: details"`; the report shows NAME.
    pub fn scenario(&self, what: &str) {
        self.say(what);
        let name = what.split(':').next().unwrap_or(what).to_string();
        self.mark_load(name);
    }

    pub fn mark_load(&self, name: String) {
        let one = testkit::load_average()
            .split(' ')
            .next()
            .unwrap_or("")
            .to_string();
        self.loads.lock().unwrap().push((name, one));
    }

    pub fn loads(&self) -> Vec<(String, String)> {
        self.loads.lock().unwrap().clone()
    }

    /// Appends a command line to the report's list, `$TMP` for the run's
    /// directory and paths inside the workspace made relative. A trailing
    /// `&` marks a server started in the background.
    pub fn record(&self, line: impl Into<String>) {
        let mut line: String = line.into();
        line = line.replace(&self.tmp.display().to_string(), "$TMP");
        if let Ok(cwd) = std::env::current_dir() {
            line = line.replace(&format!("{}/", cwd.display()), "");
        }
        self.commands.lock().unwrap().push(line);
    }

    /// Records `program args…` as a shell would write it.
    pub fn record_cmd<S: AsRef<str>>(&self, prefix: &str, program: &Path, args: &[S], bg: bool) {
        let mut line = String::from(prefix);
        line.push_str(&shell_quote(&program.display().to_string()));
        for a in args {
            line.push(' ');
            line.push_str(&shell_quote(a.as_ref()));
        }
        if bg {
            line.push_str(" &");
        }
        self.record(line);
    }

    /// Records a process just spawned through testkit: its argv as testkit
    /// spawned it (the header testkit writes at the top of the process's
    /// log), the environment it was given beyond the runner's own
    /// (`/proc/PID/environ`), and its working directory when not the
    /// runner's. So the list is what ran, not what a hand-written line says
    /// ran (those had drifted: region-node's `--admin-listen` was missing).
    /// A trailing `&`: a background server.
    pub fn record_spawned(&self, proc: &Proc) {
        let argv = harness_argv(&proc.log());
        match spawned_line(proc.pid(), argv) {
            Some(line) => self.record(line + " &"),
            None => self.record(format!(
                "# pid {} exited before its command line was read",
                proc.pid()
            )),
        }
    }

    /// [`Run::record_spawned`] for a process testkit does not hand out
    /// (a cluster's nodes): its argv from `/proc/PID/cmdline`, which
    /// redis-server overwrites with its title; then the title is recorded
    /// as a comment, not as a command.
    pub fn record_spawned_pid(&self, pid: u32) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let words: Vec<&[u8]> = cmdline
            .split(|b| *b == 0)
            .filter(|w| !w.is_empty())
            .collect();
        if let [title] = words.as_slice() {
            if title.contains(&b' ') {
                let title = String::from_utf8_lossy(title);
                self.record(format!("# pid {pid}, which retitled itself: {title}"));
                return;
            }
        }
        match spawned_line(pid, None) {
            Some(line) => self.record(line + " &"),
            None => self.record(format!(
                "# pid {pid} exited before its command line was read"
            )),
        }
    }

    pub fn commands(&self) -> Vec<String> {
        self.commands.lock().unwrap().clone()
    }

    /// Runs `program args` to completion (recorded), its output in
    /// `$TMP/results/NAME.out`; fails with that output if it fails or
    /// outlives `deadline`. Returns what it printed.
    pub async fn exec(
        &self,
        name: &str,
        program: &Path,
        args: &[String],
        deadline: Duration,
    ) -> anyhow::Result<String> {
        self.record_cmd("", program, args, false);
        let log = self.res.join(format!("{name}.out"));
        let _ = std::fs::remove_file(&log);
        let mut proc = Cmd::new(program)
            .label(name)
            .args(args)
            .log_file(&log)
            .spawn();
        let status = wait_exit(&mut proc, deadline).await;
        let out = output_of(&proc);
        match status {
            Some(s) if s.success() => Ok(out),
            Some(s) => bail!("{name} failed ({s}):\n{}", proc.log_tail(30)),
            None => bail!("{name} still running after {deadline:?}"),
        }
    }

    /// `loadgen http|redis --out $TMP/results/NAME.json --label NAME ARGS…`,
    /// its summary parsed.
    pub async fn loadgen(
        &self,
        kind: &str,
        name: &str,
        args: &[String],
    ) -> anyhow::Result<Summary> {
        let out = self.res.join(format!("{name}.json"));
        let mut all = vec![
            kind.to_string(),
            "--out".into(),
            out.display().to_string(),
            "--label".into(),
            name.into(),
        ];
        all.extend(args.iter().cloned());
        // Bounded: the longest run is the scale populate (240 s) plus
        // loadgen's 5 s drain.
        self.exec(name, &self.loadgen.clone(), &all, Duration::from_secs(3600))
            .await?;
        let text =
            std::fs::read_to_string(&out).with_context(|| format!("read {}", out.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parse {}", out.display()))
    }

    pub async fn http(&self, name: &str, args: &[String]) -> anyhow::Result<Summary> {
        self.loadgen("http", name, args).await
    }

    pub async fn redis(&self, name: &str, args: &[String]) -> anyhow::Result<Summary> {
        self.loadgen("redis", name, args).await
    }

    /// Writes a scenario's typed result as `$TMP/results/NAME.json`.
    pub fn save<T: Serialize>(&self, name: &str, value: &T) -> anyhow::Result<()> {
        let path = self.res.join(format!("{name}.json"));
        std::fs::write(&path, serde_json::to_string_pretty(value)? + "\n")
            .with_context(|| format!("write {}", path.display()))
    }
}

/// Waits for `proc` to exit without blocking the runtime's thread.
pub async fn wait_exit(proc: &mut Proc, deadline: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = proc.poll_exit() {
            return Some(s);
        }
        if start.elapsed() >= deadline {
            return None;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// What a finished process printed, without testkit's header lines.
pub fn output_of(proc: &Proc) -> String {
    proc.log()
        .lines()
        .filter(|l| !l.starts_with("===== harness:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The first line of `program args` (a `--version`), or `""`.
pub fn version_of(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default()
}

/// The argv of the last `===== harness: starting LABEL: "PROGRAM" ["ARG", …]`
/// line of a testkit log (Rust's `Debug` of each string), `None` without
/// one.
fn harness_argv(log: &str) -> Option<Vec<String>> {
    let line = log
        .lines()
        .rfind(|l| l.starts_with("===== harness: starting "))?;
    let rest = &line[line.find('"')?..];
    let mut words = Vec::new();
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut word = String::new();
        loop {
            match chars.next()? {
                '"' => break,
                '\\' => match chars.next()? {
                    'n' => word.push('\n'),
                    't' => word.push('\t'),
                    'r' => word.push('\r'),
                    '0' => word.push('\0'),
                    'u' => {
                        let hex: String =
                            chars.by_ref().skip(1).take_while(|c| *c != '}').collect();
                        word.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                    }
                    other => word.push(other),
                },
                other => word.push(other),
            }
        }
        words.push(word);
    }
    (!words.is_empty()).then_some(words)
}

/// `[cd DIR;] [env K=V…] PROGRAM ARGS…` of a running process: `argv`, or
/// its `/proc/PID/cmdline` (`None` once it is gone).
fn spawned_line(pid: u32, argv: Option<Vec<String>>) -> Option<String> {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let split = |bytes: Vec<u8>| -> Vec<String> {
        bytes
            .split(|b| *b == 0)
            .filter(|w| !w.is_empty())
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect()
    };
    let argv = match argv {
        Some(a) => a,
        None => split(std::fs::read(proc_dir.join("cmdline")).ok()?),
    };
    if argv.is_empty() {
        return None;
    }
    let own: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    let mut env: Vec<String> = split(std::fs::read(proc_dir.join("environ")).unwrap_or_default())
        .into_iter()
        .filter(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            own.get(k).map(String::as_str) != Some(v)
        })
        .collect();
    env.sort();
    let mut line = String::new();
    if let (Ok(cwd), Ok(here)) = (
        std::fs::read_link(proc_dir.join("cwd")),
        std::env::current_dir(),
    ) {
        if cwd != here {
            line.push_str(&format!("cd {}; ", shell_quote(&cwd.display().to_string())));
        }
    }
    if !env.is_empty() {
        line.push_str("env ");
        for kv in &env {
            line.push_str(&shell_quote(kv));
            line.push(' ');
        }
    }
    line.push_str(
        &argv
            .iter()
            .map(|a| shell_quote(a))
            .collect::<Vec<_>>()
            .join(" "),
    );
    Some(line)
}

/// One argument quoted for a POSIX shell, only when it needs it.
pub fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_./:=@%+,-$".contains(c));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// `"s"`-style list of strings.
pub fn strings<I, S>(items: I) -> Vec<String>
where
    I: IntoIterator<Item = S>,
    S: ToString,
{
    items.into_iter().map(|s| s.to_string()).collect()
}

/// Seconds since `since`, whole (as bash's `$SECONDS` differences are).
pub fn secs(since: Instant) -> u64 {
    since.elapsed().as_secs()
}

/// Nearest-integer formatting as `printf %g` would for short values.
pub fn g(x: f64) -> String {
    crate::report::num(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argv_is_read_from_the_last_harness_header() {
        let log = "===== harness: starting redis: \"redis-server\" [\"--port\", \"1\"]\n\
                   some output\n\
                   ===== harness: starting redis: \"redis-server\" [\"--save\", \"\", \"--dir\", \"/tmp/a \\\"b\\\"\"]\n";
        assert_eq!(
            harness_argv(log).unwrap(),
            ["redis-server", "--save", "", "--dir", "/tmp/a \"b\""]
        );
        assert_eq!(harness_argv("no header"), None);
    }
}
