//! Carrying a region over from key scheme 1 (`tl:{T}:…`, one region-wide
//! `tl:dirty`) to key scheme 2 (bucketed, see `tierlimit_shared::keys`).
//!
//! Scheme 2 starts every (tenant, day) under a fresh epoch, so the counts a
//! scheme-1 counter holds stay where they are: under their own actor, which
//! the aggregator already has or gets from here, beside the new one. The
//! global count stays exact through an upgrade, and through a rolling one
//! while nodes of both versions serve the region: each counts under its own
//! actor and the aggregator sums them. What the upgrade does not carry over
//! is the windowed tiers' state: a node of the new version starts its node
//! and region windows afresh, so while both versions serve, and for the
//! windows that overlap the switch, a region may admit up to its window
//! limit once per scheme (README, "Upgrading to key scheme 2").
//!
//! What must not be lost is a scheme-1 counter charged but not yet
//! published: its entry waits in `tl:dirty`. [`LegacyDrain`] publishes those
//! entries as the old publisher would have, while `tl:dirty` exists (nodes
//! of the old version may still be adding to it), and stops looking once it
//! is gone. Only a standalone or Sentinel-found Redis can hold scheme 1:
//! scheme 1 never ran on a cluster.

use std::time::{Duration, Instant};

use tierlimit_shared::keys::v1;

use crate::storage::redis::RedisStore;
use crate::storage::StoreError;

/// Acknowledges scheme 1's dirty entries.
pub const ACK_V1_LUA: &str = include_str!("lua/ack_v1.lua");

/// How often to look for `tl:dirty` once it was found gone: nodes of the
/// previous version may still add to it during a rolling upgrade (and they
/// publish their own entries too, so this is a backstop, not a deadline).
const RECHECK: Duration = Duration::from_secs(2);

/// One scheme-1 counter to publish: (tenant, day, epoch, P, N).
pub type LegacyCounter = (String, u32, String, u64, u64);

/// Drains key scheme 1's dirty set.
pub struct LegacyDrain {
    /// When to look for `tl:dirty` again (`None`: it exists; look at every
    /// flush).
    next_check: Option<Instant>,
}

impl Default for LegacyDrain {
    fn default() -> Self {
        Self::new()
    }
}

impl LegacyDrain {
    pub fn new() -> LegacyDrain {
        LegacyDrain {
            next_check: Some(Instant::now()),
        }
    }

    /// Up to `batch` scheme-1 entries with their counters, or nothing if
    /// `tl:dirty` is gone (then again only after [`RECHECK`]).
    pub async fn read(
        &mut self,
        store: &RedisStore,
        batch: usize,
    ) -> Result<Vec<(LegacyCounter, u64)>, StoreError> {
        if store.is_cluster() || self.next_check.is_some_and(|t| Instant::now() < t) {
            return Ok(Vec::new());
        }
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(v1::DIRTY)
            .arg(0)
            .arg(batch.saturating_sub(1))
            .arg("WITHSCORES");
        let members: Vec<(String, f64)> = store.query("legacy_read", 0, cmd).await?;
        if members.is_empty() {
            self.next_check = Some(Instant::now() + RECHECK);
            return Ok(Vec::new());
        }
        if self.next_check.take().is_some() {
            tracing::info!(
                "key scheme 1 entries found in tl:dirty: publishing them (nodes of the previous version served this region)"
            );
        }
        let mut pipe = redis::pipe();
        let mut parsed = Vec::new();
        for (m, score) in &members {
            // Scheme 1 knew only days.
            let parsed_member = tierlimit_shared::keys::parse_dirty_member(m)
                .filter(|(_, p)| {
                    p.kind == tierlimit_shared::period::PeriodKind::Day && p.zone.is_utc()
                })
                .map(|(t, p)| (t, p.index));
            if let Some((t, d)) = parsed_member {
                pipe.cmd("HMGET")
                    .arg(v1::pn_counter(t, d))
                    .arg("e")
                    .arg("p")
                    .arg("n");
                parsed.push((t.to_string(), d, *score as u64));
            }
        }
        let rows: Vec<(Option<String>, Option<u64>, Option<u64>)> =
            store.pipeline("legacy_counters", 0, pipe).await?;
        Ok(parsed
            .into_iter()
            .zip(rows)
            .map(|((t, d, score), (e, p, n))| match (e, p) {
                (Some(e), Some(p)) => ((t, d, e, p, n.unwrap_or(0).min(p)), score),
                // Gone: acknowledged with any score, so it leaves.
                _ => ((t, d, String::new(), 0, 0), u64::MAX),
            })
            .collect())
    }

    /// Removes published entries whose score did not grow since the read.
    pub async fn ack(
        &self,
        store: &RedisStore,
        published: &[(String, u32, u64)],
    ) -> Result<(), StoreError> {
        if published.is_empty() {
            return Ok(());
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(ACK_V1_LUA).arg(1).arg(v1::DIRTY);
        for (t, d, pn) in published {
            cmd.arg(tierlimit_shared::keys::dirty_member(t, *d)).arg(pn);
        }
        store.query::<i64>("legacy_ack", 0, cmd).await.map(|_| ())
    }
}
