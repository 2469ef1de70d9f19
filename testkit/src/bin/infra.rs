//! `infra`: real infrastructure by hand, for developers (run by
//! `scripts/infra`).
//!
//! ```text
//! infra up [--redis N] [--partitions P]   N redis-servers (default 2) and one Tansu
//!                                         broker on free loopback ports, topics
//!                                         tierlimit.deltas and tierlimit.global
//!                                         (P partitions, default 8, compact);
//!                                         prints `export …` lines on stdout
//! infra down                              stops them
//! infra status                            says what runs
//! ```
//!
//! `eval "$(scripts/infra up)"` exports the addresses. Run again while up, it
//! prints the same lines and starts nothing. The servers outlive this
//! command (they are started detached); their pids, logs and data are in
//! `.tierlimit/infra/` of the current directory.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use testkit::{free_port, redis_server, tansu, wait_until_blocking, Cmd};

const TOPICS: [&str; 2] = ["tierlimit.deltas", "tierlimit.global"];

fn say(msg: impl AsRef<str>) {
    eprintln!("infra: {}", msg.as_ref());
}

fn state_dir() -> PathBuf {
    PathBuf::from(".tierlimit/infra")
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("up") => up(&args[1..]),
        Some("down") => {
            down(&state_dir());
            say("down");
            Ok(())
        }
        Some("status") => {
            status(&state_dir());
            Ok(())
        }
        _ => Err("usage: scripts/infra up [--redis N] [--partitions P] | down | status".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(e);
            ExitCode::FAILURE
        }
    }
}

/// `(name, pid)` of every server started, from `STATE/*/pid`.
fn pids(state: &Path) -> Vec<(String, u32)> {
    let Ok(dirs) = std::fs::read_dir(state) else {
        return Vec::new();
    };
    let mut out: Vec<(String, u32)> = dirs
        .flatten()
        .filter_map(|d| {
            let pid = std::fs::read_to_string(d.path().join("pid")).ok()?;
            Some((
                d.file_name().to_string_lossy().into_owned(),
                pid.trim().parse().ok()?,
            ))
        })
        .collect();
    out.sort();
    out
}

fn alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

fn up(args: &[String]) -> Result<(), String> {
    let (mut redis, mut partitions) = (2usize, 8i32);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let value = it.next().ok_or(format!("{a} takes a value"))?;
        match a.as_str() {
            "--redis" => redis = value.parse().map_err(|_| "--redis takes a number")?,
            "--partitions" => {
                partitions = value.parse().map_err(|_| "--partitions takes a number")?
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    let state = state_dir();
    let env_file = state.join("env");
    let running = pids(&state);
    if env_file.is_file() && !running.is_empty() && running.iter().all(|(_, p)| alive(*p)) {
        say("already up");
        print!(
            "{}",
            std::fs::read_to_string(&env_file).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    down(&state);
    let tansu_bin = testkit::try_tansu_bin()?;
    let mut env = Vec::new();

    for i in 1..=redis {
        let port = free_port();
        let dir = start_dir(&state, &format!("redis-{i}"))?;
        let cmd = redis_server::server_args(
            Cmd::new(redis_server::redis_server_bin()),
            port,
            "127.0.0.1",
            &dir,
        )
        .label(format!("redis-{i}"))
        .log_file(dir.join("redis.log"))
        .detached();
        record(&dir, cmd)?;
        wait_until_blocking(
            &format!("redis-server on {port}"),
            Duration::from_secs(10),
            || redis_server::ping(port),
        );
        say(format!(
            "redis {i} on 127.0.0.1:{port} (log {})",
            dir.join("redis.log").display()
        ));
        env.push(format!(
            "export TIERLIMIT_REDIS_URL_{i}=redis://127.0.0.1:{port}/"
        ));
    }

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let dir = start_dir(&state, "tansu")?;
    let dir = std::fs::canonicalize(&dir).map_err(|e| e.to_string())?;
    let cmd = tansu::broker_args(
        Cmd::new(tansu_bin),
        &addr,
        "tierlimit",
        &dir,
        dir.join("tansu.log"),
    )
    .label("tansu")
    .detached();
    record(&dir, cmd)?;
    wait_until_blocking(&format!("tansu on {addr}"), Duration::from_secs(30), || {
        tansu::answers_metadata(&addr)
    });
    let started = Instant::now();
    tokio::runtime::Runtime::new()
        .map_err(|e| e.to_string())?
        .block_on(tansu::create_topics(
            &addr,
            &TOPICS,
            partitions,
            &[("cleanup.policy", "compact")],
        ));
    say(format!(
        "tansu on {addr}, topics {} ({partitions} partitions) in {:?} (log {})",
        TOPICS.join(" and "),
        started.elapsed(),
        dir.join("tansu.log").display()
    ));
    env.push(format!("export TIERLIMIT_KAFKA_BROKERS={addr}"));
    env.push(format!("export TIERLIMIT__KAFKA__BROKERS={addr}"));
    env.push(format!("export TIERLIMIT__KAFKA__PARTITIONS={partitions}"));
    let text = env.join("\n") + "\n";
    std::fs::write(&env_file, &text).map_err(|e| e.to_string())?;
    print!("{text}");
    Ok(())
}

fn start_dir(state: &Path, name: &str) -> Result<PathBuf, String> {
    let dir = state.join(name);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// Starts `cmd` detached and writes its pid to `dir/pid`.
fn record(dir: &Path, cmd: Cmd) -> Result<(), String> {
    let pid = cmd.try_spawn().map_err(|e| e.to_string())?.detach();
    std::fs::write(dir.join("pid"), pid.to_string()).map_err(|e| e.to_string())
}

fn down(state: &Path) {
    for (name, pid) in pids(state) {
        if !alive(pid) {
            continue;
        }
        // SAFETY: plain kill(2) of a pid this tool started (its own session).
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while alive(pid) && Instant::now() < deadline {
            std::thread::sleep(testkit::POLL);
        }
        if alive(pid) {
            // SAFETY: as above.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        say(format!("stopped {name} (pid {pid})"));
    }
    let _ = std::fs::remove_dir_all(state);
}

fn status(state: &Path) {
    let running = pids(state);
    if running.is_empty() {
        say("down");
        return;
    }
    for (name, pid) in running {
        let s = if alive(pid) { "running" } else { "dead" };
        say(format!("{name}: pid {pid} {s}"));
    }
    if let Ok(env) = std::fs::read_to_string(state.join("env")) {
        print!("{env}");
    }
}
