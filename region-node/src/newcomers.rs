//! The newcomer gate: what a tenant the configuration does not name may
//! cost the region.
//!
//! With `unknown_tenants.policy = "plan"` any caller can name a tenant, and
//! each new one costs a tenant hash in Redis (for the counter's retention),
//! deltas on Kafka, a counter in the aggregator and a view entry in every
//! region. A caller inventing ids would make all of that grow without
//! bound. So the first sight of an unknown tenant on a UTC day passes a
//! gate in the region's Redis (`newcomer.lua`): at most
//! `unknown_tenants.max_new_per_second` new tenants a second and
//! `unknown_tenants.max_per_day` a day, counted across every node of the
//! region, not per node. A refused newcomer is answered 429 with nothing
//! charged and nothing written but the gate's counter.
//!
//! Each node remembers whom it saw admitted today, so a tenant costs one
//! gate call per node and day, and the hot path of an admitted tenant is
//! one set lookup. That memory is bounded by `max_per_day` (the region
//! admits no more), and is dropped when the day changes. Once the region's
//! day is full, a node copies the day's set and refuses further newcomers
//! without asking Redis; before that, a refused newcomer costs one small
//! script call (no key is created for it).
//!
//! The gate never resets anything: an admitted tenant's counters are the
//! ordinary ones, with the ordinary retention, so pausing does not give a
//! tenant a fresh daily count. Known tenants never reach the gate.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};

use redis::Value;
use tierlimit_shared::config::UnknownTenants;
use tierlimit_shared::{day, keys};

use crate::metrics::Metrics;
use crate::storage::redis::RedisStore;

/// The gate script.
pub const NEWCOMER_LUA: &str = include_str!("lua/newcomer.lua");

/// How long the day's set of admitted newcomers outlives its day: a node
/// whose clock lags still finds it.
const SET_TTL_SECS: u64 = 2 * 86_400;

/// Why a newcomer was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `unknown_tenants.max_new_per_second` is spent for this second.
    Rate,
    /// `unknown_tenants.max_per_day` is spent for this UTC day.
    Day,
}

impl Refusal {
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Rate => "refused_rate",
            Refusal::Day => "refused_day",
        }
    }
}

/// A refused newcomer and when to try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub reason: Refusal,
    pub retry_after_ms: u64,
}

/// What a node knows of today's admissions.
#[derive(Default)]
struct Seen {
    day: u32,
    /// Unknown tenants seen admitted on `day`.
    tenants: HashSet<Box<str>>,
    /// Set when the region's set for `day` was found full at this
    /// `max_per_day` and copied here whole: `tenants` is then every tenant
    /// the region admitted today, and a miss is refused without Redis.
    full_at: Option<u64>,
}

impl Seen {
    /// Moves to `today`: yesterday's admissions do not carry over (the
    /// region's set for today starts empty too).
    fn start(&mut self, today: u32) {
        if self.day != today {
            *self = Seen {
                day: today,
                ..Seen::default()
            };
        }
    }
}

/// The newcomer gate of one node.
pub struct Newcomers {
    store: Arc<RedisStore>,
    sha: String,
    metrics: Arc<Metrics>,
    seen: RwLock<Seen>,
}

impl Newcomers {
    pub fn new(store: Arc<RedisStore>, metrics: Arc<Metrics>) -> Newcomers {
        Newcomers {
            store,
            sha: redis::Script::new(NEWCOMER_LUA).get_hash().to_string(),
            metrics,
            seen: RwLock::new(Seen::default()),
        }
    }

    /// Admits `tenant` (not in the configuration) for `today`, or says why
    /// not. Redis unavailable: admitted without a record (the decision then
    /// meets the same unavailability and the plan's fail mode), counted as
    /// `unchecked`.
    pub async fn admit(
        &self,
        tenant: &str,
        today: u32,
        now_ms: u64,
        limits: &UnknownTenants,
    ) -> Result<(), Refused> {
        {
            let seen = self.seen.read().expect("newcomer set lock");
            if seen.day == today {
                if seen.tenants.contains(tenant) {
                    return Ok(());
                }
                if seen.full_at == Some(limits.max_per_day) {
                    drop(seen);
                    return Err(self.refuse(Refusal::Day, until_next_day(today, now_ms)));
                }
            }
        }

        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha)
            .arg(2)
            .arg(keys::newcomers(today))
            .arg(keys::newcomer_rate())
            .arg(tenant)
            .arg(SET_TTL_SECS)
            .arg(limits.max_new_per_second)
            .arg(limits.max_per_day);
        let reply = self
            .store
            .run_script("newcomer", keys::bucket_slot(0), &cmd, NEWCOMER_LUA)
            .await;
        let (outcome, retry_ms) = match reply.map(parse) {
            Ok(Some(r)) => r,
            Ok(None) | Err(_) => {
                self.count("unchecked");
                return Ok(());
            }
        };
        match outcome {
            0 | 1 => {
                self.remember(tenant, today, limits.max_per_day);
                self.count(if outcome == 1 { "admitted" } else { "known" });
                Ok(())
            }
            2 => {
                self.load_full_day(today, limits.max_per_day).await;
                Err(self.refuse(Refusal::Day, until_next_day(today, now_ms)))
            }
            _ => Err(self.refuse(Refusal::Rate, retry_ms.clamp(1, 1000))),
        }
    }

    fn remember(&self, tenant: &str, today: u32, cap: u64) {
        let mut seen = self.seen.write().expect("newcomer set lock");
        seen.start(today);
        // The region admits at most `cap` a day, so this never grows past
        // it; the check guards a lowered cap after a reload.
        if (seen.tenants.len() as u64) < cap {
            seen.tenants.insert(tenant.into());
        }
        self.metrics.newcomers_cached.set(seen.tenants.len() as i64);
    }

    /// The region's day is full: copies its set of admitted tenants (at
    /// most `cap`, once per node and day) so that from now on a flood of
    /// fresh ids is refused without a Redis call each, while every tenant
    /// another node admitted still gets in.
    async fn load_full_day(&self, today: u32, cap: u64) {
        let mut cmd = redis::cmd("SMEMBERS");
        cmd.arg(keys::newcomers(today));
        let Ok(members) = self
            .store
            .query::<Vec<String>>("newcomer", keys::bucket_slot(0), cmd)
            .await
        else {
            return;
        };
        let mut seen = self.seen.write().expect("newcomer set lock");
        seen.start(today);
        for m in members.into_iter().take(cap as usize) {
            seen.tenants.insert(m.into());
        }
        seen.full_at = Some(cap);
        self.metrics.newcomers_cached.set(seen.tenants.len() as i64);
    }

    fn refuse(&self, reason: Refusal, retry_after_ms: u64) -> Refused {
        self.count(reason.name());
        Refused {
            reason,
            retry_after_ms,
        }
    }

    fn count(&self, outcome: &str) {
        self.metrics.newcomers.with_label_values(&[outcome]).inc();
    }
}

/// Milliseconds from `now_ms` to the start of the UTC day after `today`.
fn until_next_day(today: u32, now_ms: u64) -> u64 {
    let next = (u64::from(today) + 1) * day::SECS_PER_DAY * 1000;
    next.saturating_sub(now_ms).max(1)
}

/// The script's `{outcome, retry_ms}`.
fn parse(v: Value) -> Option<(i64, u64)> {
    match v {
        Value::Array(items) => match items.as_slice() {
            [Value::Int(o), Value::Int(r)] => Some((*o, (*r).max(0) as u64)),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_day_starts_at_midnight_utc() {
        // Day 1 starts at 86 400 s; one second before it, 1 000 ms remain.
        assert_eq!(until_next_day(0, 86_399_000), 1_000);
        assert_eq!(until_next_day(0, 0), 86_400_000);
        // A clock already past the day never answers 0.
        assert_eq!(until_next_day(0, 90_000_000), 1);
    }

    #[test]
    fn replies_parse_and_junk_does_not() {
        let ok = Value::Array(vec![Value::Int(3), Value::Int(420)]);
        assert_eq!(parse(ok), Some((3, 420)));
        assert_eq!(parse(Value::Int(1)), None);
        assert_eq!(parse(Value::Array(vec![Value::Int(1)])), None);
    }
}
