//! Routing to a Redis Cluster: every command goes to the master of its
//! hash slot, over one multiplexed connection per master.
//!
//! Why not redis-rs' cluster client: it re-sends a request after an I/O
//! error or a dropped connection, and a decision script that reached Redis
//! before the connection broke may already have charged. Here the rule is
//! the one the decision path needs:
//!
//! - **MOVED** (the slot lives elsewhere now): the slot map is updated and
//!   the command sent to the new master. Redis did not run it.
//! - **ASK** (the slot is being migrated and this key has moved):
//!   `ASKING` + the command on the target, once. Redis did not run it on the
//!   source.
//! - **TRYAGAIN** (keys of the command split across a migration) and
//!   **CLUSTERDOWN** (no master for the slot yet, during a failover): wait a
//!   little and send again, a bounded number of times. Redis did not run it.
//! - **An I/O error or a timeout**: never sent again (it may have run); the
//!   connection is dropped, the slot map is refreshed in the background, and
//!   the caller takes its fail mode for this request.
//!
//! The slot map comes from `CLUSTER SLOTS`, asked of any known node (seeds
//! first), at start, after every MOVED, and after a connection-level error.
//!
//! The decision script needs every key of one call in one slot; the key
//! scheme that gives it that on a cluster (hash-tag buckets for the dirty
//! set and publish stamps) comes with the script redesign. This module is
//! the routing it will run on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, Value};
use tokio::sync::Mutex;

use tierlimit_shared::keys::CLUSTER_SLOTS;

use super::StoreError;

/// Redirections and waits one command may take before it fails.
const MAX_REDIRECTS: usize = 5;
/// The wait before re-sending after TRYAGAIN or CLUSTERDOWN.
const RETRY_WAIT: Duration = Duration::from_millis(50);

/// Which master serves each slot (`host:port`).
#[derive(Debug, Clone)]
struct SlotMap {
    masters: Vec<Arc<str>>,
    /// Index into `masters` per slot; `u16::MAX` = unserved.
    slots: Vec<u16>,
}

impl SlotMap {
    fn master(&self, slot: u16) -> Option<&Arc<str>> {
        let i = *self.slots.get(usize::from(slot))?;
        self.masters.get(usize::from(i))
    }
}

/// Parses a `CLUSTER SLOTS` reply.
fn parse_slots(reply: &Value) -> Result<SlotMap, StoreError> {
    let bad = |what: &str| StoreError::Url {
        url: "CLUSTER SLOTS".into(),
        reason: what.into(),
    };
    let Value::Array(ranges) = reply else {
        return Err(bad("not an array"));
    };
    let mut map = SlotMap {
        masters: Vec::new(),
        slots: vec![u16::MAX; usize::from(CLUSTER_SLOTS)],
    };
    for range in ranges {
        let Value::Array(r) = range else {
            return Err(bad("a range is not an array"));
        };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
            (r.first(), r.get(1), r.get(2))
        else {
            return Err(bad("a range without start, end and master"));
        };
        let host = match master.first() {
            Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
            _ => return Err(bad("a master without a host")),
        };
        let Some(Value::Int(port)) = master.get(1) else {
            return Err(bad("a master without a port"));
        };
        let addr: Arc<str> = format!("{host}:{port}").into();
        let idx = match map.masters.iter().position(|m| *m == addr) {
            Some(i) => i,
            None => {
                map.masters.push(addr);
                map.masters.len() - 1
            }
        } as u16;
        for slot in *start..=*end {
            if let Some(s) = map.slots.get_mut(slot as usize) {
                *s = idx;
            }
        }
    }
    Ok(map)
}

/// What is sent to one slot's master.
#[derive(Clone, Copy)]
enum Req<'a> {
    Cmd(&'a redis::Cmd),
    Pipe(&'a redis::Pipeline),
}

/// A Redis Cluster: the slot map and a connection per master.
pub struct ClusterRouter {
    seeds: Vec<String>,
    map: ArcSwap<SlotMap>,
    conns: Mutex<HashMap<Arc<str>, MultiplexedConnection>>,
    /// Serialises refreshes: a burst of MOVED asks once.
    refreshing: Mutex<()>,
    /// A background refresh is under way.
    refresh_pending: AtomicBool,
    timeout: Duration,
}

impl ClusterRouter {
    /// Learns the slot map from the first seed (`host:port`) that answers.
    pub async fn connect(
        seeds: Vec<String>,
        timeout: Duration,
    ) -> Result<Arc<ClusterRouter>, StoreError> {
        let router = ClusterRouter::new(seeds, timeout);
        router.refresh().await?;
        Ok(router)
    }

    /// A router that knows no slot yet: [`Self::refresh`] learns the map
    /// (the store's probe does, so a node starts while the cluster is down).
    pub fn new(seeds: Vec<String>, timeout: Duration) -> Arc<ClusterRouter> {
        Arc::new(ClusterRouter {
            seeds,
            map: ArcSwap::from_pointee(SlotMap {
                masters: Vec::new(),
                slots: vec![u16::MAX; usize::from(CLUSTER_SLOTS)],
            }),
            conns: Mutex::new(HashMap::new()),
            refreshing: Mutex::new(()),
            refresh_pending: AtomicBool::new(false),
            timeout,
        })
    }

    /// One command on the master at `addr` (not routed by slot: `INFO`).
    pub async fn query_on<T: FromRedisValue>(
        &self,
        addr: &str,
        cmd: &redis::Cmd,
    ) -> Result<T, StoreError> {
        let v = self.on(addr, Req::Cmd(cmd)).await?;
        Ok(T::from_redis_value(v).map_err(redis::RedisError::from)?)
    }

    /// The masters of the current slot map (`host:port`): the publisher
    /// polls each one.
    pub fn masters(&self) -> Vec<String> {
        self.map
            .load()
            .masters
            .iter()
            .map(|m| m.to_string())
            .collect()
    }

    /// The master serving `slot` in the current map.
    pub fn master_of(&self, slot: u16) -> Option<String> {
        self.map.load().master(slot).map(|m| m.to_string())
    }

    /// Asks `CLUSTER SLOTS` of the known masters, then the seeds, until one
    /// answers, and installs the map.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        let _one = self.refreshing.lock().await;
        let mut candidates: Vec<String> = self.masters();
        candidates.extend(self.seeds.iter().cloned());
        let mut last = StoreError::Down;
        for addr in candidates {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            match self.on(&addr, Req::Cmd(&cmd)).await {
                Ok(reply) => match parse_slots(&reply) {
                    Ok(map) if map.slots.iter().all(|s| *s != u16::MAX) => {
                        self.map.store(Arc::new(map));
                        return Ok(());
                    }
                    Ok(_) => last = StoreError::Down,
                    Err(e) => last = e,
                },
                Err(e) => {
                    tracing::debug!(%addr, error = %e, "CLUSTER SLOTS failed");
                    last = e
                }
            }
        }
        Err(last)
    }

    /// The connection to `addr`, made on first use.
    async fn conn(&self, addr: &str) -> Result<MultiplexedConnection, StoreError> {
        let mut conns = self.conns.lock().await;
        if let Some(c) = conns.get(addr) {
            return Ok(c.clone());
        }
        let client = redis::Client::open(format!("redis://{addr}/"))?;
        let c = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(200)),
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))??;
        conns.insert(addr.into(), c.clone());
        Ok(c)
    }

    /// One command on one node, bounded by the timeout; a broken
    /// connection is forgotten so the next call makes a new one.
    async fn on(&self, addr: &str, req: Req<'_>) -> Result<Value, StoreError> {
        let mut c = self.conn(addr).await?;
        let result = match req {
            Req::Cmd(cmd) => {
                tokio::time::timeout(self.timeout, cmd.query_async::<Value>(&mut c)).await
            }
            Req::Pipe(p) => {
                tokio::time::timeout(self.timeout, p.query_async::<Value>(&mut c)).await
            }
        };
        match result {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error() {
                    self.conns.lock().await.remove(addr);
                }
                Err(StoreError::from_redis(e))
            }
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    /// Sends `cmd`, whose keys all hash to `slot`, to the slot's master,
    /// following MOVED and ASK and waiting out TRYAGAIN and CLUSTERDOWN (none
    /// of which ran the command). Never re-sends after an I/O error or a
    /// timeout.
    pub async fn query<T: FromRedisValue>(
        self: &Arc<Self>,
        slot: u16,
        cmd: &redis::Cmd,
    ) -> Result<T, StoreError> {
        let v = self.exec(slot, Req::Cmd(cmd)).await?;
        Ok(T::from_redis_value(v).map_err(redis::RedisError::from)?)
    }

    /// A pipeline whose keys all hash to `slot`, routed as [`Self::query`].
    /// Only for commands that are safe to repeat after a redirection (the
    /// publisher's reads): a pipeline redirected half-way ran its first part.
    pub async fn pipeline<T: FromRedisValue>(
        self: &Arc<Self>,
        slot: u16,
        pipe: &redis::Pipeline,
    ) -> Result<T, StoreError> {
        let v = self.exec(slot, Req::Pipe(pipe)).await?;
        Ok(T::from_redis_value(v).map_err(redis::RedisError::from)?)
    }

    async fn exec(self: &Arc<Self>, slot: u16, req: Req<'_>) -> Result<Value, StoreError> {
        let mut ask: Option<String> = None;
        for _ in 0..=MAX_REDIRECTS {
            let result = match ask.take() {
                Some(addr) => {
                    let mut pipe = redis::pipe();
                    pipe.cmd("ASKING").ignore();
                    match req {
                        Req::Cmd(c) => {
                            pipe.add_command(c.clone());
                        }
                        Req::Pipe(p) => {
                            for c in p.cmd_iter() {
                                pipe.add_command(c.clone());
                            }
                        }
                    }
                    let mut c = self.conn(&addr).await?;
                    match tokio::time::timeout(self.timeout, pipe.query_async::<Vec<Value>>(&mut c))
                        .await
                    {
                        Ok(Ok(mut v)) => Ok(match req {
                            Req::Cmd(_) => v.pop().unwrap_or(Value::Nil),
                            Req::Pipe(_) => Value::Array(v),
                        }),
                        Ok(Err(e)) => Err(StoreError::from_redis(e)),
                        Err(_) => Err(StoreError::Timeout(self.timeout)),
                    }
                }
                None => {
                    let addr = self
                        .map
                        .load()
                        .master(slot)
                        .map(|m| m.to_string())
                        .ok_or(StoreError::Down)?;
                    self.on(&addr, req).await
                }
            };
            match result {
                Ok(v) => return Ok(v),
                Err(StoreError::Redis(e)) => match e.kind() {
                    redis::ErrorKind::Server(redis::ServerErrorKind::Moved) => {
                        if let Some((addr, moved)) = e.redirect_node() {
                            self.point(moved, addr);
                        }
                        let _ = self.refresh().await;
                    }
                    redis::ErrorKind::Server(redis::ServerErrorKind::Ask) => {
                        ask = e.redirect_node().map(|(addr, _)| addr.to_string());
                    }
                    redis::ErrorKind::Server(
                        redis::ServerErrorKind::TryAgain | redis::ServerErrorKind::ClusterDown,
                    ) => {
                        tokio::time::sleep(RETRY_WAIT).await;
                        let _ = self.refresh().await;
                    }
                    _ => {
                        if e.is_io_error() || e.is_connection_dropped() {
                            self.refresh_later();
                        }
                        return Err(StoreError::Redis(e));
                    }
                },
                Err(e) => {
                    if e.is_unavailability() {
                        self.refresh_later();
                    }
                    return Err(e);
                }
            }
        }
        Err(StoreError::Down)
    }

    /// Points `slot` at `addr` at once (a MOVED says so), before the full
    /// refresh confirms it.
    fn point(&self, slot: u16, addr: &str) {
        let mut map = SlotMap::clone(&self.map.load());
        let idx = match map.masters.iter().position(|m| &**m == addr) {
            Some(i) => i,
            None => {
                map.masters.push(addr.into());
                map.masters.len() - 1
            }
        } as u16;
        if let Some(s) = map.slots.get_mut(usize::from(slot)) {
            *s = idx;
        }
        self.map.store(Arc::new(map));
    }

    /// A connection broke or timed out: the topology may have changed (a
    /// master died and its replica is being promoted). Refresh in the
    /// background, one refresh at a time, without holding up the caller.
    fn refresh_later(self: &Arc<Self>) {
        if self.refresh_pending.swap(true, Ordering::Relaxed) {
            return;
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let _ = this.refresh().await;
            this.refresh_pending.store(false, Ordering::Relaxed);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn cluster_slots_parse_into_a_map_of_masters() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(8191),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7000), bulk("id-a")]),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7003), bulk("id-d")]),
            ]),
            Value::Array(vec![
                Value::Int(8192),
                Value::Int(16383),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7001), bulk("id-b")]),
            ]),
        ]);
        let map = parse_slots(&reply).unwrap();
        assert_eq!(map.masters.len(), 2);
        assert_eq!(map.master(0).map(|m| &**m), Some("127.0.0.1:7000"));
        assert_eq!(map.master(8191).map(|m| &**m), Some("127.0.0.1:7000"));
        assert_eq!(map.master(16383).map(|m| &**m), Some("127.0.0.1:7001"));
        assert!(parse_slots(&Value::Int(3)).is_err());
    }
}
