//! librdkafka plumbing shared by the consumer and the broadcaster: its logs
//! and errors routed into `tracing`, throttled.
//!
//! While a broker is unreachable librdkafka reports the same error on every
//! reconnect attempt, for as long as the outage lasts, each time with slightly
//! different text ("1 identical error(s) suppressed", "0/1 brokers are
//! down"). The process must keep going and say so, but one line per kind of
//! error (librdkafka facility or error code) per [`REPEAT_EVERY`] is enough to
//! tell an operator what is happening; the line counts what it swallowed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// How often the same message may be logged again.
pub const REPEAT_EVERY: Duration = Duration::from_secs(30);

/// Remembers when each kind of message was last logged.
#[derive(Debug, Default)]
pub struct Throttle {
    last: Mutex<HashMap<String, (Instant, u64)>>,
}

impl Throttle {
    /// Returns `Some(suppressed)` when a message of kind `key` may be logged
    /// now (with the number of repeats swallowed since one last was), `None`
    /// otherwise.
    pub fn allow(&self, key: &str) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if let Some((at, suppressed)) = last.get_mut(key) {
            if now.duration_since(*at) < REPEAT_EVERY {
                *suppressed += 1;
                return None;
            }
            let n = *suppressed;
            *at = now;
            *suppressed = 0;
            return Some(n);
        }
        // Keys may carry broker names or error text; keep the map bounded.
        if last.len() >= 256 {
            last.retain(|_, (at, _)| now.duration_since(*at) < REPEAT_EVERY);
        }
        last.insert(key.to_owned(), (now, 0));
        Some(0)
    }
}

/// Client context of the producer (the consumer's wraps the same logging).
#[derive(Debug, Default)]
pub struct LogContext {
    throttle: Throttle,
}

impl LogContext {
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        use RDKafkaLogLevel::*;
        match level {
            Emerg | Alert | Critical | Error | Warning => {
                if let Some(suppressed) = self.throttle.allow(&format!("log:{fac}")) {
                    if matches!(level, Warning) {
                        tracing::warn!(target: "librdkafka", facility = fac, suppressed, "{message}");
                    } else {
                        tracing::error!(target: "librdkafka", facility = fac, suppressed, "{message}");
                    }
                }
            }
            Notice | Info => tracing::info!(target: "librdkafka", facility = fac, "{message}"),
            Debug => tracing::debug!(target: "librdkafka", facility = fac, "{message}"),
        }
    }

    pub(crate) fn error(&self, error: KafkaError, reason: &str) {
        // End of partition is reported here too; the consumer handles it as
        // the catch-up signal it is, not as an error.
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) {
            return;
        }
        if let Some(suppressed) = self.throttle.allow(&error_kind(&error)) {
            // Transport errors are expected while a broker is away; the
            // client reconnects by itself.
            tracing::warn!(target: "librdkafka", suppressed, "Kafka client error (retrying): {error}: {reason}");
        }
    }
}

/// The throttling key of an error: its librdkafka code when it has one.
pub fn error_kind(error: &KafkaError) -> String {
    match error.rdkafka_error_code() {
        Some(code) => format!("error:{code:?}"),
        None => format!("error:{error}"),
    }
}

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        LogContext::log(self, level, fac, log_message)
    }

    fn error(&self, error: KafkaError, reason: &str) {
        LogContext::error(self, error, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttles_repeats_per_message() {
        let t = Throttle::default();
        assert_eq!(t.allow("a"), Some(0));
        assert_eq!(t.allow("a"), None);
        assert_eq!(t.allow("a"), None);
        assert_eq!(t.allow("b"), Some(0));
    }
}
