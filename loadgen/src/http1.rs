//! A deliberately small HTTP/1.1 keep-alive client: one request in flight per
//! connection, `Content-Length` bodies only.
//!
//! Why not reqwest or hyper's client: on a 2-core machine the load generator
//! shares the CPU with the server under test and its Redis, so every
//! microsecond the client spends is taken from the system being measured.
//! This client writes a prepared request with one syscall and parses the
//! response head with `httparse` in place, which keeps its cost close to
//! that of `wrk` or `redis-benchmark`.

use std::net::SocketAddr;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `http://host:port/path` split into what a connection needs.
#[derive(Debug, Clone)]
pub struct Url {
    pub addr: SocketAddr,
    pub host: String,
    pub path: String,
    pub text: String,
}

impl Url {
    pub fn parse(s: &str) -> anyhow::Result<Url> {
        let rest = s
            .strip_prefix("http://")
            .with_context(|| format!("{s:?}: only http:// URLs are supported"))?;
        let (host, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let addr: SocketAddr = host
            .parse()
            .or_else(|_| {
                std::net::ToSocketAddrs::to_socket_addrs(host)
                    .ok()
                    .and_then(|mut a| a.next())
                    .context("no address")
            })
            .with_context(|| format!("{s:?}: cannot resolve {host:?}"))?;
        Ok(Url {
            addr,
            host: host.to_string(),
            path: path.to_string(),
            text: s.to_string(),
        })
    }
}

/// One keep-alive connection.
pub struct Conn {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
    /// Bytes of `buf` that belong to the current response head + body.
    filled: usize,
}

impl Conn {
    pub fn new(addr: SocketAddr) -> Conn {
        Conn {
            addr,
            stream: None,
            buf: vec![0; 16 * 1024],
            filled: 0,
        }
    }

    /// Sends `request` (a complete HTTP/1.1 request) and returns the status
    /// and the body. The body borrows the connection's buffer.
    pub async fn roundtrip(&mut self, request: &[u8]) -> anyhow::Result<(u16, &[u8])> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr)
                .await
                .with_context(|| format!("connect {}", self.addr))?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
        }
        let result = self.exchange(request).await;
        if result.is_err() {
            self.stream = None;
        }
        let (status, start, end, close) = result?;
        if close {
            self.stream = None;
        }
        Ok((status, &self.buf[start..end]))
    }

    async fn exchange(&mut self, request: &[u8]) -> anyhow::Result<(u16, usize, usize, bool)> {
        let stream = self.stream.as_mut().expect("connected");
        stream.write_all(request).await.context("write")?;
        self.filled = 0;
        loop {
            if self.filled == self.buf.len() {
                self.buf.resize(self.buf.len() * 2, 0);
            }
            let n = stream
                .read(&mut self.buf[self.filled..])
                .await
                .context("read")?;
            if n == 0 {
                bail!("connection closed by the server");
            }
            self.filled += n;
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            let head_len = match resp
                .parse(&self.buf[..self.filled])
                .context("bad response")?
            {
                httparse::Status::Partial => continue,
                httparse::Status::Complete(n) => n,
            };
            let status = resp.code.unwrap_or(0);
            let mut length = None;
            let mut close = false;
            for h in resp.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    length = std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| v.trim().parse::<usize>().ok());
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    bail!("chunked responses are not supported");
                } else if h.name.eq_ignore_ascii_case("connection")
                    && h.value.eq_ignore_ascii_case(b"close")
                {
                    close = true;
                }
            }
            let length = length.context("response without Content-Length")?;
            let end = head_len + length;
            if self.buf.len() < end {
                self.buf.resize(end, 0);
            }
            while self.filled < end {
                let n = stream
                    .read(&mut self.buf[self.filled..end])
                    .await
                    .context("read body")?;
                if n == 0 {
                    bail!("connection closed in the body");
                }
                self.filled += n;
            }
            return Ok((status, head_len, end, close));
        }
    }
}
