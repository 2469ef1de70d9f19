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
pub mod zone;

pub use config::{Config, ConfigError};

/// Registers `tierlimit_build_info{version, tzdb} 1`: which release runs
/// and which IANA time zone database it carries (`zone.rs`), so an operator
/// sees two databases in one deployment before their zones disagree.
pub fn register_build_info(registry: &prometheus::Registry) {
    let g = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "tierlimit_build_info",
            "The running release and its bundled IANA time zone database",
        ),
        &["version", "tzdb"],
    )
    .expect("valid metric");
    g.with_label_values(&[env!("CARGO_PKG_VERSION"), zone::tzdb_version()])
        .set(1);
    registry
        .register(Box::new(g))
        .expect("tierlimit_build_info is registered once");
}
