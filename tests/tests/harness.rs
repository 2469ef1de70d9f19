//! Self-test of the harness: if these fail, no other integration test can be
//! trusted.

use std::collections::HashSet;
use std::time::Duration;

use harness::{free_port, wait_until, wait_until_blocking, write_config, Cmd, Proc, Redis};

/// True while `pid` names a process (that is not a zombie).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the ")" that closes the command name.
        Ok(stat) => {
            !matches!(stat.rsplit(')').next().map(str::trim_start), Some(s) if s.starts_with('Z'))
        }
        Err(_) => false,
    }
}

fn state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("process exists");
    stat.rsplit(')')
        .next()
        .and_then(|s| s.trim_start().chars().next())
        .expect("state field")
}

/// The log also holds the harness's header line, which quotes the command
/// line: match whole lines, not substrings.
fn has_line(proc: &Proc, line: &str) -> bool {
    proc.log().lines().any(|l| l == line)
}

#[test]
fn free_port_never_repeats_within_a_process() {
    let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
    let unique: HashSet<u16> = ports.iter().copied().collect();
    assert_eq!(unique.len(), ports.len());
    // And each was bindable.
    for p in &ports[..5] {
        std::net::TcpListener::bind(("127.0.0.1", *p)).expect("free port is bindable");
    }
}

#[tokio::test]
async fn redis_start_ping_kill_restart_empty() {
    let mut redis = Redis::start();
    assert!(redis.ping());
    assert!(redis.url().starts_with("redis://127.0.0.1:"));

    let mut conn = redis.client().await;
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    let v: Option<String> = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v.as_deref(), Some("v"));

    let pid = redis.proc.pid();
    redis.kill();
    assert!(!alive(pid), "redis-server {pid} still alive after kill");
    assert!(!redis.ping());

    redis.restart_empty();
    assert!(redis.ping());
    assert_ne!(redis.proc.pid(), pid);
    let mut conn = redis.client().await;
    let v: Option<String> = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, None, "restart_empty must come back without data");
    let size: i64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(size, 0);
}

#[test]
fn proc_is_killed_on_drop() {
    let proc = Proc::spawn("sleep", ["1000"], &[]);
    let pid = proc.pid();
    assert!(alive(pid));
    drop(proc);
    assert!(!alive(pid), "sleep {pid} survived the drop of its Proc");
}

#[test]
fn proc_kill9_stop_cont_and_log() {
    let mut proc = Cmd::new("sh")
        .args([
            "-c",
            "echo out-$GREETING; echo err-line >&2; exec sleep 1000",
        ])
        .env("GREETING", "hello")
        .spawn();
    wait_until_blocking(
        "the child wrote both lines",
        Duration::from_secs(10),
        || has_line(&proc, "out-hello") && has_line(&proc, "err-line"),
    );

    proc.stop();
    wait_until_blocking("state T after SIGSTOP", Duration::from_secs(10), || {
        state(proc.pid()) == 'T'
    });
    proc.cont();
    wait_until_blocking(
        "running again after SIGCONT",
        Duration::from_secs(10),
        || state(proc.pid()) != 'T',
    );

    let pid = proc.pid();
    assert!(proc.is_running());
    proc.kill9();
    assert!(!proc.is_running());
    assert!(!alive(pid));

    // respawn: same command, same log, new pid.
    proc.respawn();
    assert_ne!(proc.pid(), pid);
    wait_until_blocking(
        "the respawned child wrote again",
        Duration::from_secs(10),
        || proc.log().lines().filter(|l| *l == "out-hello").count() == 2,
    );
}

#[test]
fn proc_hup_and_terminate() {
    // A shell that reports SIGHUP, and exits 7 on SIGTERM.
    let script = "trap 'echo got-hup' HUP; trap 'exit 7' TERM; echo ready; \
                  while true; do sleep 0.05; done";
    let mut proc = Proc::spawn("sh", ["-c", script], &[]);
    wait_until_blocking("traps installed", Duration::from_secs(10), || {
        has_line(&proc, "ready")
    });
    proc.hup();
    wait_until_blocking("SIGHUP handled", Duration::from_secs(10), || {
        has_line(&proc, "got-hup")
    });
    let status = proc.terminate(Duration::from_secs(10));
    assert_eq!(status.code(), Some(7), "{status:?}");
}

/// Children die with the test process even when it is SIGKILLed (no Drop
/// runs then): PR_SET_PDEATHSIG. Runs this test binary again as a child that
/// spawns `sleep`, kills that child, and checks the grandchild is gone.
#[test]
fn children_die_with_a_killed_test_process() {
    if std::env::var_os("HARNESS_PDEATHSIG_CHILD").is_some() {
        return; // we are the child of this very test: see pdeathsig_child
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = Cmd::new(&exe)
        .args([
            "--exact",
            "pdeathsig_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("HARNESS_PDEATHSIG_CHILD", "1")
        .spawn();
    let sleep_pid: u32 = {
        let mut found = None;
        wait_until_blocking(
            "the child reported its sleep pid",
            Duration::from_secs(30),
            || {
                found = child.log().lines().find_map(|l| {
                    l.split("sleep-pid=")
                        .nth(1)
                        .map(|p| p.trim().parse().unwrap())
                });
                found.is_some()
            },
        );
        found.unwrap()
    };
    assert!(alive(sleep_pid));
    child.kill9();
    wait_until_blocking(
        "the grandchild died with its parent",
        Duration::from_secs(10),
        || !alive(sleep_pid),
    );
}

/// Helper for `children_die_with_a_killed_test_process`; does nothing unless
/// started by it.
#[test]
fn pdeathsig_child() {
    if std::env::var_os("HARNESS_PDEATHSIG_CHILD").is_none() {
        return;
    }
    let proc = Proc::spawn("sleep", ["1000"], &[]);
    println!("sleep-pid={}", proc.pid());
    // Wait to be killed by the parent test.
    std::thread::sleep(Duration::from_secs(60));
    drop(proc);
}

#[tokio::test]
async fn wait_until_returns_when_the_condition_holds() {
    let mut n = 0;
    wait_until("the counter reaches 3", Duration::from_secs(5), || {
        n += 1;
        let done = n >= 3;
        async move { done }
    })
    .await;
    assert_eq!(n, 3);
}

#[tokio::test]
#[should_panic(expected = "timed out after 100ms waiting until never")]
async fn wait_until_panics_with_what_on_timeout() {
    wait_until("never", Duration::from_millis(100), || async { false }).await;
}

#[test]
fn write_config_replaces_atomically() {
    let dir = harness::temp_dir();
    let p1 = write_config(dir.path(), "cluster = \"a\"\n");
    let p2 = write_config(dir.path(), "cluster = \"b\"\n");
    assert_eq!(p1, p2);
    assert_eq!(std::fs::read_to_string(&p2).unwrap(), "cluster = \"b\"\n");
}
