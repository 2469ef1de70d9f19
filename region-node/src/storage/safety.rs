//! Start-up safety checks of a region's Redis.
//!
//! The counters must not be evicted: a PN-counter hash that vanishes under
//! memory pressure resets a tenant's region spend (the node tiers admit
//! again), and its unpublished part is lost to the global count. Every
//! counter key carries a TTL, so even the `volatile-*` policies evict them.
//! Only `noeviction` is safe: under memory pressure Redis then refuses
//! writes, the script fails, and each plan's `on_store_error` decides, which
//! is visible and bounded.
//!
//! The policy is read with `INFO memory`, not `CONFIG GET`, because managed
//! Redis services block `CONFIG`.

use super::StoreError;

/// What `INFO memory` says about eviction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    pub policy: String,
    /// `maxmemory` in bytes (0 = no limit).
    pub maxmemory: u64,
}

impl Eviction {
    /// Parses the text of `INFO memory` (or a full `INFO`).
    pub fn from_info(info: &str) -> Option<Eviction> {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_string())
        };
        Some(Eviction {
            policy: field("maxmemory_policy")?,
            maxmemory: field("maxmemory")?.parse().ok()?,
        })
    }

    /// True if Redis may delete keys to make room (now, or as soon as an
    /// operator sets `maxmemory`).
    pub fn can_evict(&self) -> bool {
        self.policy != "noeviction"
    }

    /// `Ok` if counters cannot be evicted, or eviction is explicitly
    /// allowed; otherwise the error an operator reads at start.
    pub fn check(&self, allow_eviction: bool) -> Result<(), StoreError> {
        if !self.can_evict() || allow_eviction {
            return Ok(());
        }
        Err(StoreError::Unsafe(format!(
            "maxmemory-policy is {} (maxmemory {} bytes): Redis may evict rate-limit counters, \
             which resets tenants' spend and loses unpublished global counts. \
             Set maxmemory-policy to noeviction, or start region-node with --allow-eviction \
             to accept that risk (tierlimit_redis_eviction_allowed then reports it)",
            self.policy, self.maxmemory
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "# Memory\r\nused_memory:1000\r\nmaxmemory:0\r\nmaxmemory_human:0B\r\nmaxmemory_policy:noeviction\r\n";

    #[test]
    fn noeviction_is_safe() {
        let e = Eviction::from_info(INFO).unwrap();
        assert_eq!(e.policy, "noeviction");
        assert_eq!(e.maxmemory, 0);
        assert!(e.check(false).is_ok());
    }

    #[test]
    fn every_evicting_policy_is_refused_unless_allowed() {
        for p in [
            "volatile-lru",
            "volatile-ttl",
            "allkeys-lru",
            "allkeys-random",
        ] {
            let info = INFO
                .replace("noeviction", p)
                .replace("maxmemory:0", "maxmemory:1048576");
            let e = Eviction::from_info(&info).unwrap();
            let err = e.check(false).unwrap_err().to_string();
            assert!(err.contains(p) && err.contains("--allow-eviction"), "{err}");
            assert!(e.check(true).is_ok());
        }
    }

    #[test]
    fn an_info_without_the_fields_is_not_guessed() {
        assert_eq!(
            Eviction::from_info("# Server\r\nredis_version:7.0.15\r\n"),
            None
        );
    }
}
