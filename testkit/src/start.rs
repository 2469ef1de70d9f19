//! A server of any kind started on a free port: for programs or command
//! lines the typed starters ([`crate::Redis`], [`crate::Tansu`],
//! [`crate::RegionNode`]) do not cover, such as a server wrapped in an
//! environment (`LD_PRELOAD`) or a third-party peer.

use crate::proc::{spawn_on_free_port, Cmd, Proc};

/// Starts `cmd(port)` on a free port and waits until `ready(port)` is true
/// (polled, bounded by [`crate::START_DEADLINE`]); if the process exits
/// first saying its address is in use (the race [`crate::free_port`]
/// cannot close), tries again on another port, five times at most. Panics
/// naming `what` if it exits for another reason or is not ready in time.
pub fn start_on_free_port(
    what: &str,
    cmd: impl Fn(u16) -> Cmd,
    ready: impl FnMut(u16) -> bool,
) -> (Proc, u16) {
    spawn_on_free_port(what, |port| cmd(port).spawn(), ready)
}

/// True if something accepts TCP connections on `127.0.0.1:port`.
pub fn accepts(port: u16) -> bool {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(500)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_starts_on_a_free_port() {
        // A tiny TCP server that binds the port it is given.
        let (mut proc, port) = start_on_free_port(
            "listener",
            |port| {
                Cmd::new("python3").args([
                    "-c",
                    &format!(
                        "import socket,time\ns=socket.socket()\ns.bind(('127.0.0.1',{port}))\ns.listen()\ntime.sleep(60)"
                    ),
                ])
            },
            accepts,
        );
        assert!(accepts(port));
        assert!(proc.is_running());
    }
}
