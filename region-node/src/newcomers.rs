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
//! The set holds a keyed 64-bit hash of each id, not the id: a node that
//! meets a million newcomers a day would otherwise keep a million strings
//! (about 48 B each with the table; BENCHMARKS.md §6c measured the node 4 MiB
//! over its 64 MiB target at 1 M tenants for that alone), where a hash costs
//! 9 B plus the table's slack. The key is drawn per process (SipHash, std's
//! `RandomState`), so callers cannot aim ids at a collision; an accidental
//! one (about n/2^64 per lookup) would let one unknown tenant skip the gate
//! for a day, which costs a tenant hash and nothing else. The set is
//! sharded, so inserting (and growing a shard's table) never holds up the
//! lookups of other shards, and a day's set is dropped outside the locks.
//!
//! The gate never resets anything: an admitted tenant's counters are the
//! ordinary ones, with the ordinary retention, so pausing does not give a
//! tenant a fresh daily count. Known tenants never reach the gate.

use std::collections::hash_map::RandomState;
use std::collections::HashSet;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, RwLock};

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

/// How many shards the set of admitted newcomers has.
const SHARDS: usize = 64;

/// A hasher for keys that are already keyed hashes: the set must not hash
/// them again.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("the newcomer set holds u64 hashes only")
    }
    fn write_u64(&mut self, h: u64) {
        self.0 = h;
    }
}

type HashSet64 = HashSet<u64, BuildHasherDefault<Prehashed>>;

/// One shard of the set: the hashes of the unknown tenants seen admitted on
/// `day`. A shard moves to a new day when it is next written.
#[derive(Default)]
struct Shard {
    day: u32,
    tenants: HashSet64,
}

/// What a node knows of the day as a whole.
#[derive(Default)]
struct Day {
    day: u32,
    /// Tenants remembered on `day`, in every shard.
    count: u64,
    /// Set when the region's set for `day` was found full at this
    /// `max_per_day` and copied here whole: the shards then hold every
    /// tenant the region admitted today, and a miss is refused without
    /// Redis.
    full_at: Option<u64>,
}

impl Day {
    /// Moves to `today`: yesterday's admissions do not carry over (the
    /// region's set for today starts empty too).
    fn start(&mut self, today: u32) {
        if self.day != today {
            *self = Day {
                day: today,
                ..Day::default()
            };
        }
    }
}

/// The set of newcomers a node saw admitted today.
struct Seen {
    key: RandomState,
    shards: Box<[RwLock<Shard>]>,
    day: Mutex<Day>,
}

impl Seen {
    fn new() -> Seen {
        Seen {
            key: RandomState::new(),
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            day: Mutex::default(),
        }
    }

    fn hash(&self, tenant: &str) -> (u64, &RwLock<Shard>) {
        let h = self.key.hash_one(tenant);
        // The table indexes by the low bits; the shard comes from others.
        (h, &self.shards[((h >> 40) % SHARDS as u64) as usize])
    }

    fn contains(&self, tenant: &str, today: u32) -> bool {
        let (h, shard) = self.hash(tenant);
        let shard = shard.read().expect("newcomer shard lock");
        shard.day == today && shard.tenants.contains(&h)
    }

    /// Whether the region's day was found full at `cap`.
    fn full(&self, today: u32, cap: u64) -> bool {
        let day = self.day.lock().expect("newcomer day lock");
        day.day == today && day.full_at == Some(cap)
    }

    /// Remembers `tenant` for `today` unless `cap` are remembered already;
    /// returns how many are.
    fn insert(&self, tenant: &str, today: u32, cap: u64) -> u64 {
        let mut day = self.day.lock().expect("newcomer day lock");
        day.start(today);
        if day.count >= cap {
            return day.count;
        }
        let (h, shard) = self.hash(tenant);
        let mut shard = shard.write().expect("newcomer shard lock");
        let yesterday = (shard.day != today).then(|| {
            shard.day = today;
            std::mem::take(&mut shard.tenants)
        });
        if shard.tenants.insert(h) {
            day.count += 1;
        }
        let count = day.count;
        drop(shard);
        drop(day);
        // Freed here, outside the locks.
        drop(yesterday);
        count
    }

    fn set_full(&self, today: u32, cap: u64) -> u64 {
        let mut day = self.day.lock().expect("newcomer day lock");
        day.start(today);
        day.full_at = Some(cap);
        day.count
    }
}

/// Members a node asks for per `SSCAN` while copying a full day's set.
const COPY_BATCH: u64 = 1000;

/// The newcomer gate of one node.
pub struct Newcomers {
    store: Arc<RedisStore>,
    sha: String,
    metrics: Arc<Metrics>,
    seen: Seen,
    /// Held by the one copy of a full day's set in progress. The checks in
    /// flight when the day fills all hear "full" from the script; had each
    /// copied the set, a flood at `max_per_day` = 100 000 made dozens of
    /// copies of 100 000 members at once, slow enough to time out, so that
    /// the day was never marked full and the next refusals copied again
    /// (BENCHMARKS §6d found 118 k of 200 k refusals answered 503 that way).
    copying: tokio::sync::Mutex<()>,
}

impl Newcomers {
    pub fn new(store: Arc<RedisStore>, metrics: Arc<Metrics>) -> Newcomers {
        Newcomers {
            store,
            sha: redis::Script::new(NEWCOMER_LUA).get_hash().to_string(),
            metrics,
            seen: Seen::new(),
            copying: tokio::sync::Mutex::new(()),
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
        if self.seen.contains(tenant, today) {
            return Ok(());
        }
        if self.seen.full(today, limits.max_per_day) {
            return Err(self.refuse(Refusal::Day, until_next_day(today, now_ms)));
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
                // One copy at a time; the others refuse at once (the script
                // said so) and meet the copied set from their next check.
                if let Ok(_copy) = self.copying.try_lock() {
                    if !self.seen.full(today, limits.max_per_day) {
                        self.load_full_day(today, limits.max_per_day).await;
                    }
                }
                Err(self.refuse(Refusal::Day, until_next_day(today, now_ms)))
            }
            _ => Err(self.refuse(Refusal::Rate, retry_ms.clamp(1, 1000))),
        }
    }

    fn remember(&self, tenant: &str, today: u32, cap: u64) {
        // The region admits at most `cap` a day, so this never grows past
        // it; the cap guards a lowered one after a reload.
        let count = self.seen.insert(tenant, today, cap);
        self.metrics.newcomers_cached.set(count as i64);
    }

    /// The region's day is full: copies its set of admitted tenants (at
    /// most `cap`, once per node and day) so that from now on a flood of
    /// fresh ids is refused without a Redis call each, while every tenant
    /// another node admitted still gets in. In `SSCAN` batches of
    /// [`COPY_BATCH`]: one `SMEMBERS` of 100 000 ids holds Redis and the
    /// node's connection long enough to delay the decisions behind it. The
    /// day is marked full only once the whole set is here (until then the
    /// script answers); a failed batch leaves it to the next refusal.
    async fn load_full_day(&self, today: u32, cap: u64) {
        let key = keys::newcomers(today);
        let mut cursor = 0u64;
        loop {
            let mut cmd = redis::cmd("SSCAN");
            cmd.arg(&key).arg(cursor).arg("COUNT").arg(COPY_BATCH);
            let Ok((next, members)) = self
                .store
                .query::<(u64, Vec<String>)>("newcomer", keys::bucket_slot(0), cmd)
                .await
            else {
                return;
            };
            for m in &members {
                self.seen.insert(m, today, cap);
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        let count = self.seen.set_full(today, cap);
        self.metrics.newcomers_cached.set(count as i64);
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

    /// Issue 36, item 5: the memory a node spends remembering a full day of
    /// newcomers at the default `max_per_day` (100 000), which README
    /// quotes (~1.6 MB): the tables' allocation, computed from each shard's
    /// capacity as std's (hashbrown's) layout gives it — a power-of-two
    /// number of buckets, each an 8-byte hash and a control byte, plus a
    /// group of control bytes.
    #[test]
    fn a_full_day_of_100_000_newcomers_costs_a_node_under_two_megabytes() {
        const DAY: u32 = 20_000;
        const CAP: u64 = 100_000;
        let seen = Seen::new();
        for i in 0..CAP {
            seen.insert(&format!("invented-{i}"), DAY, CAP);
        }
        // The cap holds: one more is not remembered.
        assert_eq!(seen.insert("one-more", DAY, CAP), CAP);
        assert!(!seen.contains("one-more", DAY));
        assert!(seen.contains("invented-77", DAY));
        let bytes: usize = seen
            .shards
            .iter()
            .map(|s| {
                let cap = s.read().unwrap().tenants.capacity();
                let buckets = (cap * 8).div_ceil(7).next_power_of_two();
                buckets * (8 + 1) + 16
            })
            .sum();
        println!(
            "{CAP} newcomers: {bytes} B in the set's tables, {:.1} B each",
            bytes as f64 / CAP as f64
        );
        assert!(bytes >= 9 * CAP as usize, "{bytes}");
        assert!(bytes <= 2_000_000, "{bytes} B for {CAP} newcomers");
    }

    #[test]
    fn the_next_day_starts_at_midnight_utc() {
        // Day 1 starts at 86 400 s; one second before it, 1 000 ms remain.
        assert_eq!(until_next_day(0, 86_399_000), 1_000);
        assert_eq!(until_next_day(0, 0), 86_400_000);
        // A clock already past the day never answers 0.
        assert_eq!(until_next_day(0, 90_000_000), 1);
    }

    #[test]
    fn the_set_remembers_today_only_and_up_to_the_cap() {
        let seen = Seen::new();
        for i in 0..1000 {
            assert_eq!(seen.insert(&format!("t{i}"), 7, 600), (i + 1).min(600));
        }
        assert!(seen.contains("t0", 7) && seen.contains("t599", 7));
        // Past the cap nothing more is remembered.
        assert!(!seen.contains("t600", 7) && !seen.contains("t999", 7));
        // Another day: nothing carries over, in any shard.
        assert!(!seen.contains("t0", 8));
        assert_eq!(seen.insert("t0", 8, 600), 1);
        assert!(seen.contains("t0", 8));
        assert!((1..600).all(|i| !seen.contains(&format!("t{i}"), 8)));
        // Remembering twice counts once; fullness is per day and cap.
        assert_eq!(seen.insert("t0", 8, 600), 1);
        assert_eq!(seen.set_full(8, 600), 1);
        assert!(seen.full(8, 600) && !seen.full(8, 601) && !seen.full(9, 600));
    }

    #[test]
    fn replies_parse_and_junk_does_not() {
        let ok = Value::Array(vec![Value::Int(3), Value::Int(420)]);
        assert_eq!(parse(ok), Some((3, 420)));
        assert_eq!(parse(Value::Int(1)), None);
        assert_eq!(parse(Value::Array(vec![Value::Int(1)])), None);
    }
}
