//! Why a record read from Kafka was refused. Every refusal is counted by
//! its [`Reject::reason`] (`tierlimit_…_rejected_total{reason}`), logged at
//! most once per reason and interval ([`LogThrottle`]), skipped and never
//! applied.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::messages::DecodeError;

#[derive(Debug, Error)]
pub enum Reject {
    /// Not a record of a version we read, or malformed.
    #[error("{0}")]
    Corrupt(#[from] DecodeError),
    #[error("unsigned record refused (wire.accept_unsigned = false)")]
    Unsigned,
    #[error("signed with unknown key {0:?}")]
    UnknownKey(String),
    #[error("signature does not verify (key {0:?})")]
    BadSignature(String),
    /// A region's key signed another region's actor: a region may only
    /// write its own parts.
    #[error("actor of region {actor_region:?} signed with region {key_region:?}'s key")]
    WrongRegion {
        actor_region: String,
        key_region: String,
    },
    #[error("region {0:?} is not in the configuration")]
    UnknownRegion(String),
}

impl Reject {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Reject::Corrupt(DecodeError::Version(_)) => "version",
            Reject::Corrupt(_) => "corrupt",
            Reject::Unsigned => "unsigned",
            Reject::UnknownKey(_) => "unknown_key",
            Reject::BadSignature(_) => "bad_signature",
            Reject::WrongRegion { .. } => "wrong_region",
            Reject::UnknownRegion(_) => "unknown_region",
        }
    }

    /// Every label [`Reject::reason`] can return, so metrics can be
    /// initialised at zero.
    pub const REASONS: [&'static str; 7] = [
        "version",
        "corrupt",
        "unsigned",
        "unknown_key",
        "bad_signature",
        "wrong_region",
        "unknown_region",
    ];
}

/// At most one log line per reason per interval: someone writing garbage
/// to a topic must not flood the logs (the counter has the exact number).
#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    last: HashMap<&'static str, (Instant, u64)>,
}

impl Default for LogThrottle {
    fn default() -> Self {
        LogThrottle::new(Duration::from_secs(10))
    }
}

impl LogThrottle {
    pub fn new(every: Duration) -> Self {
        LogThrottle {
            every,
            last: HashMap::new(),
        }
    }

    /// `Some(suppressed since the last line)` if this one should be logged.
    pub fn allow(&mut self, reason: &'static str) -> Option<u64> {
        let now = Instant::now();
        match self.last.get_mut(reason) {
            Some((at, suppressed)) if now.duration_since(*at) < self.every => {
                *suppressed += 1;
                None
            }
            Some((at, suppressed)) => {
                *at = now;
                Some(std::mem::take(suppressed))
            }
            None => {
                self.last.insert(reason, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_once_per_reason_and_interval() {
        let mut t = LogThrottle::new(Duration::from_secs(3600));
        assert_eq!(t.allow("unsigned"), Some(0));
        assert_eq!(t.allow("unsigned"), None);
        assert_eq!(t.allow("corrupt"), Some(0));
        let mut t = LogThrottle::new(Duration::ZERO);
        t.allow("x");
        assert_eq!(t.allow("x"), Some(0));
    }
}
