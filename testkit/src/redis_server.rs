//! A throw-away `redis-server`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;

use crate::port::temp_dir;
use crate::proc::{respawn_ready, spawn_on_free_port, Cmd, Proc};

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
        let (proc, port) = spawn_on_free_port(
            "redis-server",
            |port| server_cmd(port, dir.path()).spawn(),
            ping,
        );
        Redis { proc, port, dir }
    }

    /// A server whose clock (`TIME`) runs `offset_s` seconds off the real
    /// one, under libfaketime ([`faketime_env`]): a Redis near a midnight
    /// of its own, to cross it in seconds. Debian's redis-server links
    /// jemalloc, which deadlocks against libfaketime at start (libfaketime
    /// issues #130 and #327), so glibc's `libc_malloc_debug.so.0` is
    /// preloaded first: malloc and friends are glibc's here.
    pub fn start_with_clock_offset(offset_s: i64) -> Redis {
        let dir = temp_dir();
        let (proc, port) = spawn_on_free_port(
            "redis-server",
            |port| {
                let mut cmd = server_cmd(port, dir.path());
                for (k, v) in redis_faketime_env(offset_s) {
                    cmd = cmd.env(k, v);
                }
                cmd.spawn()
            },
            ping,
        );
        Redis { proc, port, dir }
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
        let _ = std::fs::remove_file(self.dir().join("dump.rdb"));
        let port = self.port;
        respawn_ready(&mut self.proc, port, || ping(port));
    }

    /// `SAVE`s the data set and keeps a copy of the snapshot: what a backup,
    /// or the last RDB before a crash, holds. Returns the copy's path.
    pub fn snapshot(&self, name: &str) -> std::path::PathBuf {
        query::<()>(self.port, &redis::cmd("SAVE")).expect("SAVE");
        let copy = self.dir().join(format!("{name}.rdb"));
        std::fs::copy(self.dir().join("dump.rdb"), &copy).expect("copy dump.rdb");
        copy
    }

    /// Kills the server and starts it again from `snapshot` (see
    /// [`Redis::snapshot`]): a partial rollback, as after an RDB restore or
    /// an AOF `everysec` crash. Waits until it answers PING.
    pub fn restart_from(&mut self, snapshot: &Path) {
        self.proc.kill9();
        std::fs::copy(snapshot, self.dir().join("dump.rdb")).expect("restore dump.rdb");
        let port = self.port;
        respawn_ready(&mut self.proc, port, || ping(port));
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

/// One process of a Redis Cluster or a Sentinel group: a server or a
/// sentinel, its port and its own directory.
#[derive(Debug)]
pub(crate) struct Member {
    pub(crate) proc: Proc,
    pub(crate) port: u16,
    pub(crate) dir: PathBuf,
}

/// Ports of the `members` not killed: the ones expected to answer.
pub(crate) fn running(members: &[Member]) -> Vec<u16> {
    members
        .iter()
        .filter(|m| !m.proc.reaped())
        .map(|m| m.port)
        .collect()
}

/// The member on `port`; panics naming `group` if there is none.
pub(crate) fn member_mut<'a>(members: &'a mut [Member], port: u16, group: &str) -> &'a mut Member {
    members
        .iter_mut()
        .find(|m| m.port == port)
        .unwrap_or_else(|| panic!("no member of the {group} on port {port}"))
}

/// libfaketime's preload library, from Debian's `faketime` package
/// (installed by scripts/setup).
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The environment that runs a process `offset_s` seconds off the real
/// clock under libfaketime, with `preload_first` loaded before it. The
/// monotonic clock stays real (`FAKETIME_DONT_FAKE_MONOTONIC`): timers
/// and timeouts keep their length. Panics, naming the package, if
/// libfaketime is not installed.
pub fn faketime_env(offset_s: i64, preload_first: &[&str]) -> Vec<(String, String)> {
    assert!(
        Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} is missing: install Debian's faketime package (scripts/setup)"
    );
    let mut preload: Vec<&str> = preload_first.to_vec();
    preload.push(LIBFAKETIME);
    vec![
        ("LD_PRELOAD".into(), preload.join(":")),
        ("FAKETIME".into(), format!("{offset_s:+}s")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ]
}

/// [`faketime_env`] for a process that uses librdkafka (region-node, the
/// aggregator), `offset_s` ahead. librdkafka waits with C11
/// `cnd_timedwait` on an absolute `CLOCK_REALTIME` deadline it computes
/// from `gettimeofday`, which libfaketime fakes; glibc's `cnd_timedwait`
/// goes to its internal `pthread_cond_timedwait`, which libfaketime cannot
/// intercept, so the kernel waits for a deadline `offset_s` too late:
/// every timed wait of librdkafka becomes a wait for a signal. Observed:
/// nodes stuck at start in `rd_kafka_metadata` waiting for a broker state
/// change whose timeout never came (2 runs of 4, cluster of 6 nodes, offset
/// +3.3 days). A small preloaded shim ([`cnd_timedwait_shim`]) moves each
/// `cnd_timedwait` deadline back to the kernel's clock.
pub fn faketime_env_for_librdkafka(offset_s: i64) -> Vec<(String, String)> {
    let shim = cnd_timedwait_shim();
    faketime_env(offset_s, &[shim.to_str().expect("a UTF-8 temp path")])
}

/// Builds (once per process, with `cc`) the shim of
/// [`faketime_env_for_librdkafka`]: `cnd_timedwait` taking a deadline in
/// the faked clock (read through libfaketime) and waiting until the same
/// instant in the kernel's (read by a raw system call).
pub fn cnd_timedwait_shim() -> &'static Path {
    static SHIM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    SHIM.get_or_init(|| {
        const SOURCE: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/syscall.h>
#include <threads.h>
#include <time.h>
#include <unistd.h>

int cnd_timedwait(cnd_t *restrict c, mtx_t *restrict m, const struct timespec *restrict at) {
    static int (*next)(cnd_t *, mtx_t *, const struct timespec *);
    if (!next)
        next = dlsym(RTLD_NEXT, "cnd_timedwait");
    struct timespec fake, real;
    clock_gettime(CLOCK_REALTIME, &fake);
    syscall(SYS_clock_gettime, CLOCK_REALTIME, &real);
    long long skew = (long long)(fake.tv_sec - real.tv_sec) * 1000000000LL + (fake.tv_nsec - real.tv_nsec);
    long long t = (long long)at->tv_sec * 1000000000LL + at->tv_nsec - skew;
    struct timespec adj = { t / 1000000000LL, t % 1000000000LL };
    return next(c, m, &adj);
}
"#;
        let dir = std::env::temp_dir().join(format!("tierlimit-cnd-shim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("the shim's directory");
        let (src, lib) = (dir.join("cnd_shim.c"), dir.join("cnd_shim.so"));
        std::fs::write(&src, SOURCE).expect("the shim's source");
        let out = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&src)
            .arg("-ldl")
            .output()
            .expect("cc (to build the cnd_timedwait shim)");
        assert!(
            out.status.success(),
            "building the cnd_timedwait shim: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        lib
    })
}

/// [`faketime_env`] for a `redis-server`: Debian's links jemalloc, which
/// deadlocks against libfaketime at start (libfaketime issues #130 and
/// #327), so glibc's `libc_malloc_debug.so.0` is preloaded first.
pub fn redis_faketime_env(offset_s: i64) -> Vec<(String, String)> {
    let malloc = [
        "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
        "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("glibc's libc_malloc_debug.so.0 (glibc >= 2.34)");
    faketime_env(offset_s, &[malloc])
}

/// `$REDIS_SERVER_BIN`, or `redis-server` from `PATH`.
pub fn redis_server_bin() -> std::ffi::OsString {
    std::env::var_os("REDIS_SERVER_BIN").unwrap_or_else(|| "redis-server".into())
}

/// A throw-away `redis-server` ([`server_args`]) on 127.0.0.1:`port` in
/// `dir`, labelled `redis:PORT`, logging to `dir/redis-PORT.log`. Clusters
/// and Sentinel groups add their own arguments to it.
pub fn server_cmd(port: u16, dir: &Path) -> Cmd {
    server_args(Cmd::new(redis_server_bin()), port, "127.0.0.1", dir)
        .label(format!("redis:{port}"))
        .log_file(dir.join(format!("redis-{port}.log")))
}

/// Adds to `cmd` (a `redis-server`, maybe wrapped to run in a network
/// namespace) the arguments of a throw-away server: `port` on `bind`, no
/// persistence (`--save "" --appendonly no`, so a restart comes back empty),
/// working directory `dir`. Protected mode is off so that a server bound to
/// a namespace's address answers the test from outside.
///
/// `--repl-diskless-sync-delay 0`: a replica's full sync starts at once.
/// Redis 7.0 waits 5 s by default for more replicas to share one diskless
/// transfer, which would add 5 s to every replica start and restart.
pub fn server_args(cmd: Cmd, port: u16, bind: &str, dir: &Path) -> Cmd {
    cmd.args(["--port", &port.to_string(), "--bind", bind])
        .args(["--protected-mode", "no", "--save", "", "--appendonly", "no"])
        .args(["--repl-diskless-sync-delay", "0"])
        .arg("--dir")
        .arg(dir)
}

/// How long [`query`] waits to connect, and then for each reply.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// One command on a fresh synchronous connection to 127.0.0.1:`port`
/// (a server or a sentinel), each step bounded by [`QUERY_TIMEOUT`].
///
/// Synchronous and connection-per-call on purpose: the topology helpers
/// poll servers that are being killed, restarted and failed over, from
/// blocking code, where a pooled async connection would hide what state
/// the server is in right now.
pub fn query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> redis::RedisResult<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut con = client.get_connection_with_timeout(QUERY_TIMEOUT)?;
    con.set_read_timeout(Some(QUERY_TIMEOUT))?;
    con.set_write_timeout(Some(QUERY_TIMEOUT))?;
    cmd.query(&mut con)
}

/// The `INFO section` of the server on `port` as `field -> value`, or `None`
/// if it does not answer.
pub fn info(port: u16, section: &str) -> Option<std::collections::HashMap<String, String>> {
    let text: String = query(port, redis::cmd("INFO").arg(section)).ok()?;
    Some(
        text.lines()
            .filter_map(|l| l.trim_end().split_once(':'))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// A replication offset of the server on `port` (`master_repl_offset`,
/// `slave_repl_offset`), or `None` if it does not answer.
pub fn repl_offset(port: u16, field: &str) -> Option<u64> {
    info(port, "replication")?.get(field)?.parse().ok()
}

/// True if every server in `replicas` is a replica that has the whole
/// replication stream of the master on `master` (`slave_repl_offset` equals
/// the master's `master_repl_offset`): what was written to the master
/// before survives its loss.
pub fn replicated(master: u16, replicas: &[u16]) -> bool {
    let Some(m) = info(master, "replication") else {
        return false;
    };
    let offset = m.get("master_repl_offset");
    offset.is_some()
        && replicas
            .iter()
            .all(|&p| info(p, "replication").is_some_and(|r| r.get("slave_repl_offset") == offset))
}

/// `$REDIS_CLI_BIN`, or `redis-cli` from `PATH`.
pub fn redis_cli_bin() -> std::ffi::OsString {
    std::env::var_os("REDIS_CLI_BIN").unwrap_or_else(|| "redis-cli".into())
}

/// One PING over a plain socket (no client library, no runtime needed).
pub fn ping(port: u16) -> bool {
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
