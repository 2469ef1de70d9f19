//! How a node reaches its region's Redis master.
//!
//! - **Fixed**: `redis://`, `rediss://` (TLS), `unix://` / `redis+unix://`.
//!   One address, trusted to be the master; if it turns out to be a replica
//!   (READONLY), the breaker opens and the probe waits until `ROLE` says
//!   master again.
//! - **Sentinel**: `redis+sentinel://[user:password@]host:port[,host:port…]/<master name>[/<db>]`
//!   (`rediss+sentinel://` for TLS to the master). The master's address is
//!   asked of the sentinels through the `redis` crate's sentinel support,
//!   at start and whenever the current one answers READONLY or drops: after
//!   a failover the node follows the promoted replica without a restart,
//!   and a demoted master is never written to. The user and password are
//!   the master's; the sentinels are reached without credentials.
//!
//! Every connection is one multiplexed [`ConnectionManager`]: concurrent
//! decisions are pipelined on it instead of each waiting for a pooled
//! connection. Resolution is single-flight (one task at a time, behind a
//! mutex), so a burst of READONLY replies asks the sentinels once.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{RedisConnectionInfo, TlsMode};

use super::safety::Eviction;
use super::StoreError;

/// What a region's `redis_url` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One server at a fixed URL.
    Fixed(String),
    /// A Redis Cluster, found through any of its nodes (`host:port`):
    /// `redis+cluster://h1:p1,h2:p2`.
    Cluster { seeds: Vec<String> },
    /// The master that sentinels name `master`.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
        tls: bool,
        username: Option<String>,
        password: Option<String>,
        db: i64,
    },
}

impl Target {
    /// Parses a region's `redis_url`.
    pub fn parse(url: &str) -> Result<Target, StoreError> {
        let bad = |reason: &str| StoreError::Url {
            url: redact(url),
            reason: reason.into(),
        };
        if let Some(rest) = url.strip_prefix("redis+cluster://") {
            let mut seeds = Vec::new();
            for h in rest.trim_end_matches('/').split(',') {
                let (host, port) = h
                    .rsplit_once(':')
                    .ok_or_else(|| bad("every cluster node needs host:port"))?;
                if host.is_empty() || port.parse::<u16>().is_err() {
                    return Err(bad("every cluster node needs host:port"));
                }
                seeds.push(h.to_string());
            }
            return Ok(Target::Cluster { seeds });
        }
        let (rest, tls) = if let Some(r) = url.strip_prefix("redis+sentinel://") {
            (r, false)
        } else if let Some(r) = url.strip_prefix("rediss+sentinel://") {
            (r, true)
        } else {
            return Ok(Target::Fixed(url.to_string()));
        };
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) => (Some(a), r),
            None => (None, rest),
        };
        let (hosts, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("no master name: expected …/<master name>"))?;
        let mut parts = path.split('/');
        let master = parts.next().unwrap_or_default();
        if master.is_empty() {
            return Err(bad("empty master name"));
        }
        let db = match parts.next() {
            None | Some("") => 0,
            Some(d) => d.parse().map_err(|_| bad("the database is not a number"))?,
        };
        let mut sentinels = Vec::new();
        for h in hosts.split(',') {
            let (host, port) = h
                .rsplit_once(':')
                .ok_or_else(|| bad("every sentinel needs host:port"))?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad("every sentinel needs host:port"));
            }
            sentinels.push(format!("redis://{h}/"));
        }
        let (username, password) = match auth {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some((u, p)) => ((!u.is_empty()).then(|| u.to_string()), Some(p.to_string())),
                None => (Some(a.to_string()), None),
            },
        };
        Ok(Target::Sentinel {
            sentinels,
            master: master.to_string(),
            tls,
            username,
            password,
            db,
        })
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Target::Fixed(_) => "redis",
            Target::Sentinel { .. } => "sentinel",
            Target::Cluster { .. } => "cluster",
        }
    }
}

/// The URL with any password replaced, for logs and errors.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let auth = &url[s + 3..at];
            match auth.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

enum Resolver {
    Fixed,
    Sentinel(Box<tokio::sync::Mutex<SentinelClient>>),
}

/// The current master connection and how to find the master again.
pub struct Link {
    target: Target,
    resolver: Resolver,
    conn: ArcSwapOption<ConnectionManager>,
    cfg: ConnectionManagerConfig,
    timeout: Duration,
    allow_eviction: bool,
}

impl Link {
    /// Prepares the link without connecting: a node starts (and serves in
    /// its fail mode) even while Redis or every sentinel is down.
    pub fn new(
        url: &str,
        timeout: Duration,
        retry_interval: Duration,
        allow_eviction: bool,
    ) -> Result<Link, StoreError> {
        let target = Target::parse(url)?;
        // No response timeout inside the connection: every call is already
        // bounded by the store's timeout, and a second timer per call is
        // measurable on the hot path.
        let cfg = ConnectionManagerConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(200))))
            .set_number_of_retries(1)
            .set_max_delay(retry_interval);
        let (resolver, conn) = match &target {
            Target::Fixed(u) => {
                let client = redis::Client::open(u.as_str())?;
                let conn = ConnectionManager::new_lazy_with_config(client, cfg.clone())?;
                (Resolver::Fixed, Some(Arc::new(conn)))
            }
            Target::Sentinel {
                sentinels,
                master,
                tls,
                username,
                password,
                db,
            } => {
                let mut info = RedisConnectionInfo::default().set_db(*db);
                if let Some(u) = username {
                    info = info.set_username(u);
                }
                if let Some(p) = password {
                    info = info.set_password(p);
                }
                let mut node =
                    SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
                if *tls {
                    node = node.set_tls_mode(TlsMode::Secure);
                }
                let client = SentinelClient::build(
                    sentinels.clone(),
                    master.clone(),
                    Some(node),
                    SentinelServerType::Master,
                )?;
                (
                    Resolver::Sentinel(Box::new(tokio::sync::Mutex::new(client))),
                    None,
                )
            }
            Target::Cluster { .. } => {
                return Err(StoreError::Url {
                    url: redact(url),
                    reason: "a cluster is reached through ClusterRouter, not one link".into(),
                })
            }
        };
        Ok(Link {
            target,
            resolver,
            conn: ArcSwapOption::new(conn),
            cfg,
            timeout,
            allow_eviction,
        })
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The current master connection; `None` until a sentinel named one.
    pub fn conn(&self) -> Option<ConnectionManager> {
        self.conn.load().as_deref().cloned()
    }

    /// Finds the master (asks the sentinels, or keeps the fixed address),
    /// connects, checks with `ROLE` that it is a master and with
    /// `INFO memory` that it cannot evict counters (see [`super::safety`]).
    /// On success the new connection serves every following call, and the
    /// master's eviction settings are returned.
    pub async fn resolve(&self) -> Result<Eviction, StoreError> {
        let conn = match &self.resolver {
            Resolver::Fixed => self.conn().expect("a fixed link always has a connection"),
            Resolver::Sentinel(sentinel) => {
                let client = {
                    let mut s = sentinel.lock().await;
                    tokio::time::timeout(
                        self.timeout.max(Duration::from_secs(1)),
                        s.async_get_client(),
                    )
                    .await
                    .map_err(|_| StoreError::Timeout(self.timeout))??
                };
                tokio::time::timeout(
                    self.timeout.max(Duration::from_secs(1)),
                    ConnectionManager::new_with_config(client, self.cfg.clone()),
                )
                .await
                .map_err(|_| StoreError::Timeout(self.timeout))??
            }
        };
        if !is_master(conn.clone(), self.timeout).await? {
            return Err(StoreError::NotMaster);
        }
        let mut info = redis::cmd("INFO");
        info.arg("memory");
        let info: String = query(conn.clone(), &info, self.timeout).await?;
        let eviction = Eviction::from_info(&info).ok_or_else(|| {
            StoreError::Unsafe(
                "INFO memory has no maxmemory_policy: cannot tell whether Redis evicts counters"
                    .into(),
            )
        })?;
        eviction.check(self.allow_eviction)?;
        if matches!(self.resolver, Resolver::Sentinel(_)) {
            self.conn.store(Some(Arc::new(conn)));
        }
        Ok(eviction)
    }
}

/// One command outside the breaker (the probe's own), bounded by `timeout`.
async fn query<T: redis::FromRedisValue>(
    mut conn: ConnectionManager,
    cmd: &redis::Cmd,
    timeout: Duration,
) -> Result<T, StoreError> {
    let timeout = timeout.max(Duration::from_millis(200));
    Ok(tokio::time::timeout(timeout, cmd.query_async(&mut conn))
        .await
        .map_err(|_| StoreError::Timeout(timeout))??)
}

/// `ROLE` says master (a replica answers `slave`, a sentinel `sentinel`).
async fn is_master(conn: ConnectionManager, timeout: Duration) -> Result<bool, StoreError> {
    let role: Vec<redis::Value> = query(conn, &redis::cmd("ROLE"), timeout).await?;
    Ok(matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_parse() {
        let t =
            Target::parse("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster/2").unwrap();
        assert_eq!(
            t,
            Target::Sentinel {
                sentinels: vec![
                    "redis://10.0.0.1:26379/".into(),
                    "redis://10.0.0.2:26380/".into()
                ],
                master: "mymaster".into(),
                tls: false,
                username: None,
                password: Some("pw".into()),
                db: 2,
            }
        );
        assert_eq!(t.kind(), "sentinel");
        assert!(matches!(
            Target::parse("rediss+sentinel://h:1/m").unwrap(),
            Target::Sentinel {
                tls: true,
                db: 0,
                ..
            }
        ));
        assert_eq!(
            Target::parse("redis://127.0.0.1:6379/").unwrap(),
            Target::Fixed("redis://127.0.0.1:6379/".into())
        );
    }

    #[test]
    fn bad_sentinel_urls_say_why() {
        for (url, why) in [
            ("redis+sentinel://h:1", "master name"),
            ("redis+sentinel://h:1/", "empty master"),
            ("redis+sentinel://h/m", "host:port"),
            ("redis+sentinel://h:x/m", "host:port"),
            ("redis+sentinel://h:1/m/x", "database"),
        ] {
            let e = Target::parse(url).unwrap_err().to_string();
            assert!(e.contains(why), "{url}: {e}");
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("redis+sentinel://u:secret@h:1/m"),
            "redis+sentinel://u:***@h:1/m"
        );
        assert_eq!(redact("redis://h:1/"), "redis://h:1/");
    }
}
