//! Library shared by `region-node` and `aggregator`.
//!
//! Everything here is either pure logic (config model and validation, window
//! arithmetic, the key scheme, wire messages) or thin Kafka plumbing that both
//! binaries need in the same shape. Nothing here talks to Redis: the decision
//! path lives in `region-node` so that it reads top to bottom in one place.

pub mod algorithm;
pub mod config;
pub mod day;
pub mod describe;
pub mod duration;
pub mod kafka;
pub mod keys;
pub mod messages;
pub mod reload;
pub mod validate;

pub use config::{Config, ConfigError};
