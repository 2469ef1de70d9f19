//! A Kafka-aware TCP proxy that stands for one region's network link to the
//! broker, so the demo can cut that region off from Kafka and heal it.
//!
//! Why not a plain TCP proxy: a Kafka client uses its bootstrap address only
//! for the first Metadata request, then connects to the broker addresses that
//! Metadata advertises. A plain proxy would be bypassed after a second. This
//! one forwards bytes unchanged except for the broker addresses in Metadata
//! and FindCoordinator responses, which it rewrites to its own address, so
//! every connection of the region's clients keeps going through it.
//!
//! Cutting the link **blackholes** it, like a network partition that drops
//! packets: no byte moves in either direction on existing connections, and
//! new connections are accepted but never reach the broker. The clients see
//! what they would see on a real partition: requests that time out, not
//! connections refused. Healing lets the held bytes flow again.
//!
//! Limits: one upstream broker (the demo's single Tansu), frames up to
//! 64 MiB. It is demo plumbing, not a production component. With
//! `DEMO_PROXY_TRACE` set, it logs every connection, cut and heal to stderr.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const MAX_FRAME: usize = 64 << 20;
const METADATA: i16 = 3;
const FIND_COORDINATOR: i16 = 10;

/// A running proxy. Dropping it does not stop the accept loop; the demo
/// process owns it for its whole life.
pub struct KafkaProxy {
    pub addr: SocketAddr,
    cut: watch::Sender<bool>,
}

impl KafkaProxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<KafkaProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the Kafka proxy")?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        tokio::spawn(accept_loop(listener, addr, upstream, cut_rx));
        Ok(KafkaProxy { addr, cut })
    }

    /// Blackholes the link (see the module docs).
    pub fn cut(&self) {
        trace(format_args!("{}: CUT", self.addr));
        let _ = self.cut.send(true);
    }

    /// Lets traffic flow again.
    pub fn heal(&self) {
        trace(format_args!("{}: HEAL", self.addr));
        let _ = self.cut.send(false);
    }
}

async fn accept_loop(
    listener: TcpListener,
    me: SocketAddr,
    upstream: SocketAddr,
    cut: watch::Receiver<bool>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let cut = cut.clone();
        tokio::spawn(async move {
            let mut gate = cut.clone();
            // A connection opened during the cut waits; it never reaches
            // the broker until the link heals.
            if wait_open(&mut gate).await.is_err() {
                return;
            }
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let requests = Arc::new(Mutex::new(HashMap::new()));
            let up = tokio::spawn(pump_requests(cr, sw, Arc::clone(&requests), cut.clone()));
            let down = tokio::spawn(pump_responses(sr, cw, requests, me, cut));
            trace(format_args!("{me}: connection open"));
            // Either direction ending ends the connection.
            tokio::select! {
                r = up => trace(format_args!("{me}: requests ended: {}", ended(r))),
                r = down => trace(format_args!("{me}: responses ended: {}", ended(r))),
            }
        });
    }
}

fn ended(r: Result<anyhow::Result<()>, tokio::task::JoinError>) -> String {
    match r {
        Ok(Ok(())) => "ok".into(),
        Ok(Err(e)) => format!("{e:#}"),
        Err(e) => e.to_string(),
    }
}

fn trace(a: std::fmt::Arguments<'_>) {
    if std::env::var_os("DEMO_PROXY_TRACE").is_some() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        eprintln!("{:.3} proxy {a}", t.as_secs_f64());
    }
}

/// Waits until the link is not cut. Errors if the proxy is gone.
async fn wait_open(cut: &mut watch::Receiver<bool>) -> Result<(), watch::error::RecvError> {
    cut.wait_for(|c| !*c).await.map(|_| ())
}

async fn read_frame(r: &mut OwnedReadHalf) -> anyhow::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let n = i32::from_be_bytes(len);
    if n < 0 || n as usize > MAX_FRAME {
        bail!("frame size {n} out of range");
    }
    let mut buf = vec![0u8; n as usize];
    r.read_exact(&mut buf).await?;
    Ok(buf)
}

async fn write_frame(w: &mut OwnedWriteHalf, body: &[u8]) -> anyhow::Result<()> {
    w.write_all(&(body.len() as i32).to_be_bytes()).await?;
    w.write_all(body).await?;
    Ok(())
}

type Requests = Arc<Mutex<HashMap<i32, (i16, i16)>>>;

/// Client → broker: remembers (api key, version) per correlation id, so the
/// matching response can be parsed; forwards the frame unchanged.
async fn pump_requests(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    requests: Requests,
    mut cut: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    loop {
        wait_open(&mut cut).await?;
        let frame = read_frame(&mut r).await?;
        if frame.len() >= 8 {
            let key = i16::from_be_bytes([frame[0], frame[1]]);
            let version = i16::from_be_bytes([frame[2], frame[3]]);
            let corr = i32::from_be_bytes([frame[4], frame[5], frame[6], frame[7]]);
            if key == METADATA || key == FIND_COORDINATOR {
                requests
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(corr, (key, version));
            }
        }
        wait_open(&mut cut).await?;
        write_frame(&mut w, &frame).await?;
    }
}

/// Broker → client: rewrites broker addresses to the proxy's own.
async fn pump_responses(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    requests: Requests,
    me: SocketAddr,
    mut cut: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    loop {
        wait_open(&mut cut).await?;
        let mut frame = read_frame(&mut r).await?;
        if frame.len() >= 4 {
            let corr = i32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]);
            let request = requests
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&corr);
            if let Some((key, version)) = request {
                let host = me.ip().to_string();
                let port = i32::from(me.port());
                let rewritten = match key {
                    METADATA => rewrite_metadata(&frame, version, &host, port),
                    _ => rewrite_find_coordinator(&frame, version, &host, port),
                };
                match rewritten {
                    Ok(f) => frame = f,
                    // Forward unchanged; the client may then bypass the
                    // proxy, which the demo would show as a failed promise.
                    Err(e) => {
                        eprintln!("demo: kafka proxy: cannot rewrite api {key} v{version}: {e:#}")
                    }
                }
            }
        }
        wait_open(&mut cut).await?;
        write_frame(&mut w, &frame).await?;
    }
}

/// A cursor over a response that copies what it reads into `out`, except
/// where the caller writes a replacement.
struct Rewriter<'a> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
    flexible: bool,
}

impl<'a> Rewriter<'a> {
    fn new(input: &'a [u8], flexible: bool) -> Self {
        Rewriter {
            input,
            pos: 0,
            out: Vec::with_capacity(input.len() + 16),
            flexible,
        }
    }

    fn take(&mut self, n: usize) -> anyhow::Result<&'a [u8]> {
        if self.pos + n > self.input.len() {
            bail!("truncated response at byte {}", self.pos);
        }
        let s = &self.input[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn copy(&mut self, n: usize) -> anyhow::Result<()> {
        let s = self.take(n)?;
        self.out.extend_from_slice(s);
        Ok(())
    }

    fn read_uvarint(&mut self) -> anyhow::Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("varint too long")
    }

    fn copy_uvarint(&mut self) -> anyhow::Result<u64> {
        let start = self.pos;
        let v = self.read_uvarint()?;
        self.out.extend_from_slice(&self.input[start..self.pos]);
        Ok(v)
    }

    fn copy_i16(&mut self) -> anyhow::Result<i16> {
        let s = self.take(2)?;
        self.out.extend_from_slice(s);
        Ok(i16::from_be_bytes([s[0], s[1]]))
    }

    fn copy_i32(&mut self) -> anyhow::Result<i32> {
        let s = self.take(4)?;
        self.out.extend_from_slice(s);
        Ok(i32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }

    /// Array length (compact: N+1 as uvarint; classic: int32, -1 = null).
    fn copy_array_len(&mut self) -> anyhow::Result<usize> {
        if self.flexible {
            Ok((self.copy_uvarint()? as usize).saturating_sub(1))
        } else {
            Ok(self.copy_i32()?.max(0) as usize)
        }
    }

    /// A (nullable) string, copied.
    fn copy_string(&mut self) -> anyhow::Result<()> {
        if self.flexible {
            let n = self.copy_uvarint()? as usize;
            self.copy(n.saturating_sub(1))
        } else {
            let n = self.copy_i16()?;
            self.copy(n.max(0) as usize)
        }
    }

    /// Skips a string in the input and writes `s` instead.
    fn replace_string(&mut self, s: &str) -> anyhow::Result<()> {
        if self.flexible {
            let n = self.read_uvarint()? as usize;
            self.take(n.saturating_sub(1))?;
            let mut v = s.len() as u64 + 1;
            loop {
                let b = (v & 0x7f) as u8;
                v >>= 7;
                if v == 0 {
                    self.out.push(b);
                    break;
                }
                self.out.push(b | 0x80);
            }
        } else {
            let n = i16::from_be_bytes(self.take(2)?.try_into()?);
            self.take(n.max(0) as usize)?;
            self.out.extend_from_slice(&(s.len() as i16).to_be_bytes());
        }
        self.out.extend_from_slice(s.as_bytes());
        Ok(())
    }

    fn replace_i32(&mut self, v: i32) -> anyhow::Result<()> {
        self.take(4)?;
        self.out.extend_from_slice(&v.to_be_bytes());
        Ok(())
    }

    fn copy_tagged_fields(&mut self) -> anyhow::Result<()> {
        if self.flexible {
            let n = self.copy_uvarint()?;
            for _ in 0..n {
                self.copy_uvarint()?; // tag
                let size = self.copy_uvarint()? as usize;
                self.copy(size)?;
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Vec<u8> {
        self.out.extend_from_slice(&self.input[self.pos..]);
        self.out
    }
}

/// Metadata response (v0–v12): every broker's host and port become the
/// proxy's.
fn rewrite_metadata(frame: &[u8], version: i16, host: &str, port: i32) -> anyhow::Result<Vec<u8>> {
    let mut r = Rewriter::new(frame, version >= 9);
    r.copy_i32()?; // correlation id
    r.copy_tagged_fields()?; // response header v1
    if version >= 3 {
        r.copy_i32()?; // throttle_time_ms
    }
    let brokers = r.copy_array_len()?;
    for _ in 0..brokers {
        r.copy_i32()?; // node_id
        r.replace_string(host)?;
        r.replace_i32(port)?;
        if version >= 1 {
            r.copy_string()?; // rack
        }
        r.copy_tagged_fields()?;
    }
    Ok(r.finish())
}

/// FindCoordinator response (v0–v6): the coordinator's host and port become
/// the proxy's.
fn rewrite_find_coordinator(
    frame: &[u8],
    version: i16,
    host: &str,
    port: i32,
) -> anyhow::Result<Vec<u8>> {
    let mut r = Rewriter::new(frame, version >= 3);
    r.copy_i32()?; // correlation id
    r.copy_tagged_fields()?;
    if version >= 1 {
        r.copy_i32()?; // throttle_time_ms
    }
    if version <= 3 {
        r.copy_i16()?; // error_code
        if version >= 1 {
            r.copy_string()?; // error_message
        }
        r.copy_i32()?; // node_id
        r.replace_string(host)?;
        r.replace_i32(port)?;
    } else {
        let n = r.copy_array_len()?;
        for _ in 0..n {
            r.copy_string()?; // key
            r.copy_i32()?; // node_id
            r.replace_string(host)?;
            r.replace_i32(port)?;
            r.copy_i16()?; // error_code
            r.copy_string()?; // error_message
            r.copy_tagged_fields()?;
        }
    }
    Ok(r.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compact(s: &str) -> Vec<u8> {
        let mut v = vec![s.len() as u8 + 1];
        v.extend_from_slice(s.as_bytes());
        v
    }

    #[test]
    fn metadata_v12_brokers_point_at_the_proxy() {
        let mut f = Vec::new();
        f.extend_from_slice(&7i32.to_be_bytes()); // corr
        f.push(0); // header tags
        f.extend_from_slice(&0i32.to_be_bytes()); // throttle
        f.push(2); // 1 broker
        f.extend_from_slice(&1i32.to_be_bytes());
        f.extend(compact("broker.example"));
        f.extend_from_slice(&9092i32.to_be_bytes());
        f.push(0); // null rack
        f.push(0); // broker tags
        f.extend_from_slice(b"REST");
        let out = rewrite_metadata(&f, 12, "127.0.0.1", 4242).unwrap();
        let mut want = Vec::new();
        want.extend_from_slice(&7i32.to_be_bytes());
        want.push(0);
        want.extend_from_slice(&0i32.to_be_bytes());
        want.push(2);
        want.extend_from_slice(&1i32.to_be_bytes());
        want.extend(compact("127.0.0.1"));
        want.extend_from_slice(&4242i32.to_be_bytes());
        want.push(0);
        want.push(0);
        want.extend_from_slice(b"REST");
        assert_eq!(out, want);
    }

    #[test]
    fn metadata_v1_classic_strings() {
        let mut f = Vec::new();
        f.extend_from_slice(&3i32.to_be_bytes());
        f.extend_from_slice(&1i32.to_be_bytes()); // 1 broker
        f.extend_from_slice(&5i32.to_be_bytes());
        f.extend_from_slice(&4i16.to_be_bytes());
        f.extend_from_slice(b"host");
        f.extend_from_slice(&9092i32.to_be_bytes());
        f.extend_from_slice(&(-1i16).to_be_bytes()); // null rack
        f.extend_from_slice(b"X");
        let out = rewrite_metadata(&f, 1, "127.0.0.1", 1).unwrap();
        assert_eq!(&out[12..14], &9i16.to_be_bytes());
        assert_eq!(&out[14..23], b"127.0.0.1");
        assert_eq!(&out[23..27], &1i32.to_be_bytes());
        assert_eq!(&out[27..], &[0xff, 0xff, b'X']);
    }

    #[test]
    fn find_coordinator_v4() {
        let mut f = Vec::new();
        f.extend_from_slice(&1i32.to_be_bytes());
        f.push(0);
        f.extend_from_slice(&0i32.to_be_bytes());
        f.push(2);
        f.extend(compact("group"));
        f.extend_from_slice(&1i32.to_be_bytes());
        f.extend(compact("h"));
        f.extend_from_slice(&9i32.to_be_bytes());
        f.extend_from_slice(&0i16.to_be_bytes());
        f.push(0); // null message
        f.push(0); // tags
        f.push(0); // top tags
        let out = rewrite_find_coordinator(&f, 4, "127.0.0.1", 77).unwrap();
        assert!(out
            .windows(10)
            .any(|w| w == compact("127.0.0.1").as_slice()));
        assert_eq!(out.len(), f.len() + 8);
    }
}
