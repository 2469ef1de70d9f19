//! One module per scenario. Each runs its load against processes the
//! caller started (or, for the rollover, starts its own), and returns its
//! figures as a typed result, also written as JSON into `$TMP/results`.

pub mod accuracy;
pub mod baseline;
pub mod ceiling;
pub mod cluster;
pub mod crossings;
pub mod envoy;
pub mod fast_path;
pub mod flood;
pub mod kafka;
pub mod latency;
pub mod lease_limit;
pub mod leases;
pub mod limits;
pub mod peer;
pub mod periods;
pub mod regions20;
pub mod rollover;
pub mod saturation;
pub mod scale;

use std::time::Duration;

use crate::world::RedisConn;

/// The median of `v` (the upper one of an even count; 0 when empty): what
/// the alternating-round scenarios report of their rounds.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Waits (up to `seconds`) until a region's dirty sets are empty:
/// every charge published to Kafka.
pub async fn drained(redis: &RedisConn, what: &str, seconds: u64) {
    testkit::wait_until(what, Duration::from_secs(seconds), || async {
        redis.dirty_total().await.is_ok_and(|n| n == 0)
    })
    .await
}
