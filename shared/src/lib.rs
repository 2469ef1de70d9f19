//! Library shared by `region-node` and `aggregator`.
//!
//! Everything here is either pure logic (config model and validation, window
//! arithmetic, the key scheme, wire messages) or thin Kafka plumbing that both
//! binaries need in the same shape. Nothing here talks to Redis: the decision
//! path lives in `region-node` so that it reads top to bottom in one place.
//! The one piece of HTTP, the problem+json type both APIs answer with, is
//! behind the `http` feature, and the Kafka plumbing (librdkafka) behind
//! `kafka` (default), so that the fuzz targets build without either.

#[cfg(feature = "http")]
pub mod admission;
pub mod algorithm;
pub mod auth;
pub mod check;
pub mod config;
pub mod day;
pub mod describe;
pub mod duration;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod keys;
pub mod limits;
pub mod messages;
pub mod period;
#[cfg(feature = "http")]
pub mod problem;
pub mod reload;
#[cfg(feature = "kafka")]
pub mod retention;
pub mod rls;
#[cfg(feature = "http")]
pub mod serve;
#[cfg(feature = "http")]
pub mod tls;
pub mod validate;
pub mod wire;

pub use config::{Config, ConfigError};
