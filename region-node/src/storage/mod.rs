//! Where a region's counters live, behind one trait.
//!
//! [`CounterStore`] is what the decision path talks to: one atomic call that
//! checks (or refunds, or peeks) every tier of a tenant and charges all of
//! them or none. Two kinds of store implement it:
//!
//! - [`redis::RedisStore`], the region's Redis, strict for the whole region:
//!   a standalone server (`redis://`, `rediss://`, `unix://`) or a master
//!   found through Sentinel (`redis+sentinel://`, see [`link`]), with a
//!   circuit breaker that keeps a failing Redis off the hot path;
//! - [`crate::local::Local`], the `local` fail mode: this node's share of
//!   the limits, in process, while Redis cannot answer.
//!
//! The script's arguments and reply are typed in [`script`]; the start-up
//! safety checks (can Redis evict counters?) are in [`safety`]. Redis
//! Cluster lands here as a third [`link`] kind with the cluster-safe key
//! scheme of the next script redesign.

pub mod cluster;
pub mod link;
pub mod redis;
pub mod safety;
pub mod script;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use thiserror::Error;

pub use self::script::{
    DecideCall, DecideReply, Denied, GlobalArgs, LeaseAsk, Op, Scope, TierCall, TierReply,
};

/// A boxed future: the trait is used as `dyn CounterStore`, and one
/// allocation per decision is noise beside a Redis round trip.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A region's counters: every tier of one tenant decided in one atomic call.
pub trait CounterStore: Send + Sync {
    /// `"redis"`, `"sentinel"` or `"local"`: for logs and `/readyz`.
    fn kind(&self) -> &'static str;

    /// False while the store is known to be unable to answer (an open
    /// breaker): decisions then go straight to their fail mode.
    fn is_up(&self) -> bool {
        true
    }

    /// Runs one call atomically: a check charges every tier or none.
    fn decide<'a>(
        &'a self,
        call: &'a DecideCall<'a>,
    ) -> BoxFuture<'a, Result<DecideReply, StoreError>>;

    /// The store's clock now, estimated from ours (`now_ms`) and what its
    /// replies said: Redis' `TIME`, which decides the day of every
    /// decision. `None` until known, and for a store without a clock of its
    /// own (the `local` fail mode).
    ///
    /// Behind Redis Cluster the masters' clocks differ: the estimate is of
    /// the master that answered most recently with the least delay, and a
    /// check built for the wrong day near midnight is refused by its
    /// master's script ([`StoreError::OtherDay`]) and sent again, so no
    /// decision depends on the masters agreeing.
    fn redis_now_ms(&self, _now_ms: u64) -> Option<i64> {
        None
    }
}

/// The `reason` labels of [`StoreError::refused_writes`].
pub const WRITE_REFUSALS: [&str; 2] = ["oom", "misconf"];

/// Why a store could not decide.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("Redis is marked down; waiting for the probe to see it back")]
    Down,
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    /// The call was not answered within the store timeout, but Redis
    /// answered other calls meanwhile: it waited behind a backlog. Not an
    /// outage (see [`StoreError::is_backlog`]).
    #[error("Redis answered other calls but not this one within {0:?}")]
    Backlog(Duration),
    /// The call reached Redis after its deadline and did nothing: for the
    /// caller, a timeout that is known not to have charged.
    #[error("the call reached Redis after its deadline and did nothing")]
    Expired,
    /// The server is a replica (READONLY, or ROLE says so): the master must
    /// be found again (Sentinel), or an operator must fix the URL.
    #[error("the Redis server is not a master (READONLY)")]
    NotMaster,
    #[error("Redis error: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error(transparent)]
    Reply(#[from] script::ReplyError),
    #[error("invalid Redis URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("Redis refused at start: {0}")]
    Unsafe(String),
    /// A check built for another day (or another period of a global tier)
    /// than Redis' clock says: it did nothing; sent again for `day`, with
    /// the periods of Redis' clock `now_ms`.
    #[error("the check was built for another day or period than Redis' clock says (day {day})")]
    OtherDay { day: u32, now_ms: u64 },
}

impl StoreError {
    /// The `kind` label of `tierlimit_redis_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Down => "down",
            StoreError::Timeout(_) | StoreError::Expired => "timeout",
            StoreError::Backlog(_) => "backlog",
            StoreError::NotMaster => "readonly",
            StoreError::Redis(_) => "redis",
            StoreError::Reply(_) => "reply",
            StoreError::Url { .. } | StoreError::Unsafe(_) => "config",
            StoreError::OtherDay { .. } => "other_day",
        }
    }

    /// A call that waited behind others while Redis kept serving: too
    /// late, but no sign of an outage. The decision path sheds it (503
    /// `overloaded`) instead of taking the plan's fail mode, so a load
    /// above what Redis serves is answered by shedding, never by the fail
    /// mode. `Expired` is one too: the script answered, only after the
    /// call's deadline.
    pub fn is_backlog(&self) -> bool {
        matches!(self, StoreError::Backlog(_) | StoreError::Expired)
    }

    /// Redis answered that it refuses writes, and why (a label of
    /// [`WRITE_REFUSALS`]): `oom` (used memory over `maxmemory` under
    /// `noeviction`) or `misconf` (`stop-writes-on-bgsave-error` after a
    /// failed RDB save). Such a server answers: a capacity alarm, not an
    /// outage. The refused call wrote nothing: Redis refuses a script only
    /// at its first write, before any side effect; one whose first write
    /// cannot grow memory (a sliding log's pruning) it lets run to the end,
    /// deciding it normally.
    pub fn refused_writes(&self) -> Option<&'static str> {
        let StoreError::Redis(e) = self else {
            return None;
        };
        match e.code() {
            Some("OOM") => Some("oom"),
            Some("MISCONF") => Some("misconf"),
            _ => None,
        }
    }

    /// Errors that mean "this server cannot serve us now" (as opposed to a
    /// bad reply to one call).
    pub fn is_unavailability(&self) -> bool {
        if self.refused_writes().is_some() {
            // It answers (reads, pings): the breaker stays closed, so the
            // first call after memory is freed is decided in Redis again.
            return false;
        }
        match self {
            StoreError::Backlog(_) => false,
            StoreError::Down | StoreError::Timeout(_) | StoreError::Expired => true,
            StoreError::NotMaster => true,
            StoreError::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.is_unrecoverable_error()
                    || matches!(
                        e.kind(),
                        ::redis::ErrorKind::Server(::redis::ServerErrorKind::BusyLoading)
                            | ::redis::ErrorKind::Server(::redis::ServerErrorKind::TryAgain)
                            | ::redis::ErrorKind::Server(::redis::ServerErrorKind::ClusterDown)
                            | ::redis::ErrorKind::Server(::redis::ServerErrorKind::MasterDown)
                    )
            }
            StoreError::Reply(_)
            | StoreError::Url { .. }
            | StoreError::Unsafe(_)
            | StoreError::OtherDay { .. } => false,
        }
    }

    /// A redis-rs error that says the server is a replica.
    pub(crate) fn from_redis(e: ::redis::RedisError) -> StoreError {
        if e.kind() == ::redis::ErrorKind::Server(::redis::ServerErrorKind::ReadOnly) {
            StoreError::NotMaster
        } else {
            StoreError::Redis(e)
        }
    }
}
