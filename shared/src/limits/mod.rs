//! Limits as data: tenants and plans as versioned, signed records of a
//! compacted Kafka topic (`kafka.limits_topic`) that every region-node and
//! aggregator follows, instead of a TOML table every process must hold
//! identically (`limits.source = "topic"`).
//!
//! - [`record`]: a record (a tenant or a plan at a version, or its
//!   deletion), JSON inside the signed frame of `wire::codec`;
//! - [`auth`]: Ed25519 per batch with the limits key (not the broadcast
//!   key);
//! - [`table`]: the applied records of one process, read by
//!   `config::Loaded` on every decision;
//! - `follow` (feature `kafka`): the loop every process runs to apply
//!   the topic; `write`: the writer (versions, signing, producing).
//!
//! The topic has one partition: limits change far less often than anything
//! else the system writes, and one order for all records makes a version a
//! watermark ("V applied" means every record up to V is), which is what
//! "has this change reached every node?" needs.

pub mod auth;
#[cfg(feature = "kafka")]
pub mod follow;
pub mod metrics;
pub mod record;
pub mod table;
#[cfg(feature = "kafka")]
pub mod write;

pub use auth::{LimitsSigner, LimitsVerifier};
pub use record::{Body, LimitsRecord, Subject};
pub use table::{Applied, ApplyError, LimitsTable};
