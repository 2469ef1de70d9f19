//! A throw-away `redis-server`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use tempfile::TempDir;

use crate::port::{free_port, temp_dir};
use crate::proc::{wait_ready, Cmd, Proc, Ready};

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
        server_args(Cmd::new(redis_server_bin()), port, "127.0.0.1", dir)
            .label(format!("redis:{port}"))
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

/// `$REDIS_SERVER_BIN`, or `redis-server` from `PATH`.
pub fn redis_server_bin() -> std::ffi::OsString {
    std::env::var_os("REDIS_SERVER_BIN").unwrap_or_else(|| "redis-server".into())
}

/// Adds to `cmd` (a `redis-server`, maybe wrapped to run in a network
/// namespace) the arguments of a throw-away server: `port` on `bind`, no
/// persistence (`--save "" --appendonly no`, so a restart comes back empty),
/// working directory `dir`. Protected mode is off so that a server bound to
/// a namespace's address answers the test from outside.
pub fn server_args(cmd: Cmd, port: u16, bind: &str, dir: &Path) -> Cmd {
    cmd.args(["--port", &port.to_string(), "--bind", bind])
        .args(["--protected-mode", "no", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
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
