//! Scenario 6b, scale across a UTC day rollover. Does Redis memory per
//! tenant, region-node RSS and aggregator RSS stay flat when the day
//! changes?
//!
//! # What it measures
//!
//! One region (eu, one region-node eu-1, one Redis), one aggregator, one
//! Tansu broker, all on loopback, release builds, on a stack of its own
//! (the main run's processes are stopped first). N distinct tenants (s0 …
//! sN-1) are each checked once shortly before a UTC midnight (phase A), and
//! the same N once more shortly after it (phase B). After each phase it
//! waits until the dirty set drained and the node's view holds the new
//! (tenant, day) entries, then records a [`Snapshot`]: Redis used_memory
//! (and RSS), DBSIZE, keys per kind (node window, region window, PN counter
//! per day), `MEMORY USAGE` of one tenant's keys (null once expired),
//! region-node and aggregator RSS, the node's view entries and the
//! aggregator's tracked counters, and the counters that would reveal a
//! clock problem (deltas the aggregator ignored as expired or future,
//! fail-mode decisions, Redis errors, epoch changes). Redis' active expiry
//! leaves up to ~10 % of the keys with a TTL dead but counted; each
//! snapshot first runs one full `SCAN`, which deletes every expired key it
//! meets, so the figures are of live state. Snapshots: start, a (phase A
//! drained), midnight (just after the fake midnight), b (phase B drained),
//! b_settled (once phase B's window keys expired; `ROLLOVER_SETTLE=0`
//! skips it).
//!
//! # Why libfaketime
//!
//! Days are UTC days, decided by Redis' clock (`TIME` in decide.lua); the
//! region-node prunes its view to today and yesterday by its own clock; the
//! aggregator drops days older than `retention_days` by its own. We cannot
//! wait for a real midnight, so redis-server, the aggregator and the
//! region-node run under libfaketime with one relative offset,
//! `FAKETIME="+<s>s"`, the same for the three, reading a few minutes
//! before midnight when the run starts. `FAKETIME_DONT_FAKE_MONOTONIC=1`
//! keeps CLOCK_MONOTONIC real (tokio and librdkafka timers, Redis' own).
//! Tansu, loadgen and this runner run unfaked.
//!
//! redis-server caveat: Debian's redis-server links libjemalloc.so.2, and
//! libfaketime deadlocks against jemalloc at start (libfaketime issues #130
//! and #327). The faked redis-server therefore also preloads glibc's
//! `libc_malloc_debug.so.0`, which interposes malloc and friends with
//! glibc's allocator: its used_memory is measured with glibc's size
//! classes, comparable within this scenario, not with scenario 6.
//!
//! librdkafka caveat (region-node and aggregator): librdkafka's timed waits
//! compute an absolute deadline with `gettimeofday()`, which libfaketime
//! fakes, and wait with C11 `cnd_timedwait()`, which libfaketime does not
//! intercept, so every timed wait would last hours. The preload
//! `bench/src/cnd_timedwait_shim.c` (see [`compile_shim`]) maps
//! `cnd_timedwait` onto `pthread_cond_timedwait`, which libfaketime does
//! translate; it is loaded before libfaketime in both binaries.
//!
//! # What "flat" can mean here
//!
//! By design, yesterday's state does not vanish at midnight: a tenant
//! active on both days holds two PN hashes in Redis (kept for
//! retention + 1 days), two view entries until the next midnight, two
//! merged counters in the aggregator. So across ONE rollover the
//! expectation is bounded growth by one day's counters, not zero growth.
//!
//! # Timing
//!
//! The fake midnight falls `ROLLOVER_PHASE_A_SECONDS` +
//! `ROLLOVER_MARGIN_SECONDS` after the faked processes start (150 + 60 s).
//! Phase A must end before it (checked with Redis' fake `TIME`; raise
//! `ROLLOVER_PHASE_A_SECONDS` otherwise).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tierlimit_shared::keys;

use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};
use testkit::redis_server::{ping, redis_server_bin, server_args};
use testkit::{start_on_free_port, Cmd, Proc};

use crate::knobs::Knobs;
use crate::run::{strings, Run};
use crate::world::{metric, metric_sum, RedisConn};

/// C11 `cnd_timedwait` through `pthread_cond_timedwait`.
///
/// Compiled by the runner, with `cc`, into the run's directory when this
/// scenario starts, not by a build script: a build.rs would make every
/// build of the workspace (tests, clippy, CI) need a C compiler and glibc's
/// `<threads.h>` for a preload only this scenario uses; here a missing
/// compiler fails this scenario alone, naming `scripts/setup --bench`.
pub const SHIM_C: &str = include_str!("../cnd_timedwait_shim.c");

const RETENTION_DAYS: u64 = 2;
const REGION_WINDOW_S: u64 = 60;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Rollover {
    pub run_started: String,
    pub elapsed_s: u64,
    pub tenants: u64,
    pub load_average_end: String,
    pub redis_version: String,
    pub redis_allocator: String,
    pub faketime_offset_s: u64,
    pub fake_midnight_unix: u64,
    pub fake_midnight_utc: String,
    pub day_a: u64,
    pub day_b: u64,
    pub retention_days: u64,
    pub phase_a: Phase,
    pub phase_b: Phase,
    pub snapshots: BTreeMap<String, Snapshot>,
    /// "a - start (one day of N tenants)", "b - a (across the rollover)",
    /// "b_settled - start (two days of PN counters, no windows)".
    pub growth: BTreeMap<String, Option<Growth>>,
    pub log_findings: Vec<Finding>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Phase {
    pub load_s: u64,
    pub pipeline_s: u64,
    pub populated: u64,
    pub view_before: f64,
    pub allowed: u64,
    pub denied: u64,
    pub errors: u64,
    pub throughput_rps: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KeyCounts {
    pub node_window: u64,
    pub region_window: u64,
    pub pn_by_day: BTreeMap<String, u64>,
    pub other: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Snapshot {
    pub fake_unix: u64,
    pub fake_utc: String,
    pub redis_day: u64,
    pub node_day: serde_json::Value,
    pub elapsed_s: u64,
    pub redis_used_memory: u64,
    pub redis_used_memory_rss: u64,
    pub redis_dbsize: u64,
    pub redis_keys_live: u64,
    pub redis_keys: KeyCounts,
    pub dirty: u64,
    pub published: u64,
    pub mu_published: Option<u64>,
    pub sample_tenant: String,
    pub mu_node: Option<u64>,
    pub mu_region: Option<u64>,
    pub mu_pn_day_a: Option<u64>,
    pub mu_pn_day_b: Option<u64>,
    pub ttl_pn_day_a: i64,
    pub ttl_pn_day_b: i64,
    pub redis_rss_kib: u64,
    pub node_rss_kib: u64,
    pub agg_rss_kib: u64,
    pub view_entries: Option<f64>,
    pub view_age_s: Option<f64>,
    pub agg_tracked: Option<f64>,
    pub agg_ignored_future: f64,
    pub agg_ignored_expired: f64,
    pub agg_deltas_consumed: Option<f64>,
    pub deltas_produced: Option<f64>,
    pub fail_mode_decisions: f64,
    pub redis_errors: f64,
    pub epoch_changes: f64,
    pub node_log_warnings: u64,
    pub agg_log_warnings: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Growth {
    pub redis_used_memory: i64,
    pub redis_bytes_per_tenant: i64,
    pub redis_keys_live: i64,
    pub node_rss_kib: i64,
    pub node_rss_bytes_per_tenant: i64,
    pub agg_rss_kib: i64,
    pub agg_rss_bytes_per_tenant: i64,
    pub view_entries: f64,
    pub agg_tracked: f64,
}

impl Growth {
    fn between(x: &Snapshot, y: &Snapshot, tenants: u64) -> Growth {
        let n = tenants.max(1) as f64;
        let d = |a: u64, b: u64| b as i64 - a as i64;
        Growth {
            redis_used_memory: d(x.redis_used_memory, y.redis_used_memory),
            redis_bytes_per_tenant: (d(x.redis_used_memory, y.redis_used_memory) as f64 / n).round()
                as i64,
            redis_keys_live: d(x.redis_keys_live, y.redis_keys_live),
            node_rss_kib: d(x.node_rss_kib, y.node_rss_kib),
            node_rss_bytes_per_tenant: (d(x.node_rss_kib, y.node_rss_kib) as f64 * 1024.0 / n)
                .round() as i64,
            agg_rss_kib: d(x.agg_rss_kib, y.agg_rss_kib),
            agg_rss_bytes_per_tenant: (d(x.agg_rss_kib, y.agg_rss_kib) as f64 * 1024.0 / n).round()
                as i64,
            view_entries: y.view_entries.unwrap_or(0.0) - x.view_entries.unwrap_or(0.0),
            agg_tracked: y.agg_tracked.unwrap_or(0.0) - x.agg_tracked.unwrap_or(0.0),
        }
    }
}

/// Warnings and errors of the faked processes, grouped by message.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Finding {
    pub log: String,
    pub count: u64,
    pub message: String,
    pub first: String,
}

/// libfaketime's preload library, from the Debian package.
fn libfaketime() -> anyhow::Result<PathBuf> {
    let out = std::process::Command::new("dpkg")
        .args(["-L", "libfaketime"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .ok_or_else(|| {
            anyhow::anyhow!("libfaketime is not installed: run scripts/setup --bench")
        })?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.ends_with("/libfaketime.so.1"))
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "libfaketime.so.1 not found (dpkg -L libfaketime): run scripts/setup --bench"
            )
        })
}

/// glibc's malloc interposer (jemalloc deadlocks under libfaketime).
fn libc_malloc_debug() -> anyhow::Result<PathBuf> {
    let out = std::process::Command::new("ldconfig").arg("-p").output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("libc_malloc_debug.so.0 "))
        .collect();
    lines
        .iter()
        .find(|l| l.contains("x86-64"))
        .or(lines.first())
        .and_then(|l| l.split(" => ").nth(1))
        .map(|p| PathBuf::from(p.trim()))
        .filter(|p| p.is_file())
        .ok_or_else(|| anyhow::anyhow!("libc_malloc_debug.so.0 not found (glibc >= 2.34 ships it)"))
}

/// Compiles [`SHIM_C`] into `dir/cnd_timedwait_shim.so`.
pub fn compile_shim(dir: &Path) -> anyhow::Result<PathBuf> {
    let src = dir.join("cnd_timedwait_shim.c");
    let so = dir.join("cnd_timedwait_shim.so");
    std::fs::write(&src, SHIM_C)?;
    let out = std::process::Command::new("cc")
        .args(["-O2", "-shared", "-fPIC", "-pthread", "-o"])
        .arg(&so)
        .arg(&src)
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run cc ({e}): run scripts/setup --bench"))?;
    ensure!(
        out.status.success(),
        "cannot compile the cnd_timedwait preload (run scripts/setup --bench):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(so)
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `line` without ANSI colour sequences (`ESC [ digits ; … m`).
fn strip_ansi(line: &str) -> String {
    let mut clean = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' && chars.peek() == Some(&'[') {
            chars.next();
            for d in chars.by_ref() {
                if !(d.is_ascii_digit() || d == ';') {
                    break;
                }
            }
        } else {
            clean.push(c);
        }
    }
    clean
}

/// Lines of `log` with a warning, an error or a panic.
fn warnings(log: &str) -> impl Iterator<Item = &str> {
    log.lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("panick"))
}

/// A log line without its leading timestamp, ANSI colours and field values
/// (`key=…`), so that lines of one kind group together.
pub fn message_of(line: &str) -> String {
    let clean = strip_ansi(line);
    // ^[0-9TZ:.-]+ +
    let ts_end = clean
        .find(|c: char| !(c.is_ascii_digit() || "TZ:.-".contains(c)))
        .unwrap_or(clean.len());
    let rest = &clean[ts_end..];
    let s = if ts_end > 0 && rest.starts_with(' ') {
        rest.trim_start_matches(' ')
    } else {
        clean.as_str()
    };
    // ([a-z_]+)=("[^"]*"|[^ ]*) -> \1=…
    let b = s.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        let word = |c: u8| c.is_ascii_lowercase() || c == b'_';
        if word(b[i]) {
            let start = i;
            while i < b.len() && word(b[i]) {
                i += 1;
            }
            out.push_str(&s[start..i]);
            if i < b.len() && b[i] == b'=' {
                out.push_str("=…");
                i += 1;
                let quoted_end = (b.get(i) == Some(&b'"'))
                    .then(|| s[i + 1..].find('"').map(|e| i + 1 + e + 1))
                    .flatten();
                i = match quoted_end {
                    Some(e) => e,
                    None => s[i..].find(' ').map_or(b.len(), |e| i + e),
                };
            }
        } else {
            let ch = s[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn findings(logs: &[(&str, String)]) -> Vec<Finding> {
    let mut groups: BTreeMap<(String, String), Finding> = BTreeMap::new();
    for (name, text) in logs {
        for line in warnings(text).filter(|l| !l.contains("overcommit")) {
            let message = message_of(line);
            let f = groups
                .entry((name.to_string(), message.clone()))
                .or_insert_with(|| Finding {
                    log: name.to_string(),
                    count: 0,
                    message,
                    first: strip_ansi(line),
                });
            f.count += 1;
        }
    }
    let mut v: Vec<Finding> = groups.into_values().collect();
    v.sort_by_key(|f| std::cmp::Reverse(f.count));
    v
}

struct Stack {
    redis: Proc,
    conn: RedisConn,
    node: testkit::RegionNode,
    agg: testkit::Aggregator,
    redis_log: PathBuf,
    sample: String,
    day_a: u64,
    day_b: u64,
    started: Instant,
}

impl Stack {
    async fn has_day(&self, tenant: &str, day: u64) -> anyhow::Result<bool> {
        let [e, _, _] = keys::counter_fields(day as u32);
        self.conn
            .query::<bool>(redis::cmd("HEXISTS").arg(keys::tenant_hash(tenant)).arg(e))
            .await
    }

    async fn fake_now(&self) -> anyhow::Result<u64> {
        self.conn.time().await
    }

    /// Key scheme 2: `tl:{B}:t:T` is a tenant hash (counted as a node
    /// window key: each holds the tenant's windows and days),
    /// `tl:{B}:t:T:k:…` a tier of its own, `tl:{B}:dirty` a dirty set.
    async fn key_counts(&self) -> anyhow::Result<KeyCounts> {
        let mut k = KeyCounts::default();
        for key in self.conn.scan("tl:*").await? {
            let f: Vec<&str> = key.split(':').collect();
            match (f.get(2).copied(), f.len()) {
                (Some("t"), 4) => k.node_window += 1,
                (Some("t"), _) => k.region_window += 1,
                _ => *k.other.entry(key.clone()).or_default() += 1,
            }
        }
        Ok(k)
    }

    async fn snapshot(&self, run: &Run, name: &str) -> anyhow::Result<Snapshot> {
        let c = &self.conn;
        let live = c.scan("*").await?.len() as u64;
        let t = self.fake_now().await?;
        let http = &self.node.http;
        let (nb, ab) = (self.node.url(""), self.agg.url(""));
        let s = &self.sample;
        let ttl = |key: String| async move { c.query::<i64>(redis::cmd("TTL").arg(key)).await };
        let snap = Snapshot {
            fake_unix: t,
            fake_utc: crate::report::utc(t, true),
            redis_day: t / 86400,
            node_day: testkit::try_json(http, &self.node.url(&format!("/v1/tenants/{s}")))
                .await
                .unwrap_or_default()["day"]
                .clone(),
            elapsed_s: self.started.elapsed().as_secs(),
            redis_used_memory: c.info_u64("memory", "used_memory").await?,
            redis_used_memory_rss: c.info_u64("memory", "used_memory_rss").await?,
            redis_dbsize: c.dbsize().await?,
            redis_keys_live: live,
            redis_keys: self.key_counts().await?,
            dirty: c.dirty_total().await?,
            // Key scheme 2 keeps no publish stamps: the dirty set's order is
            // the schedule.
            published: 0,
            mu_published: None,
            sample_tenant: s.clone(),
            // Key scheme 2: node tier, region tier and every day's counter
            // of a tenant share one hash (reported as the node figure).
            mu_node: c.memory_usage(&keys::tenant_hash(s)).await?,
            mu_region: None,
            // Whether each day's counter is in the hash (1) or dropped (0).
            mu_pn_day_a: Some(u64::from(self.has_day(s, self.day_a).await?)),
            mu_pn_day_b: Some(u64::from(self.has_day(s, self.day_b).await?)),
            ttl_pn_day_a: ttl(keys::tenant_hash(s)).await?,
            ttl_pn_day_b: ttl(keys::tenant_hash(s)).await?,
            redis_rss_kib: testkit::rss_kib(self.redis.pid()).unwrap_or(0),
            node_rss_kib: testkit::rss_kib(self.node.proc.pid()).unwrap_or(0),
            agg_rss_kib: testkit::rss_kib(self.agg.proc.pid()).unwrap_or(0),
            view_entries: metric(http, &nb, "tierlimit_view_entries").await,
            view_age_s: metric(http, &nb, "tierlimit_view_age_seconds").await,
            agg_tracked: metric(http, &ab, "tierlimit_aggregator_tracked_counters").await,
            agg_ignored_future: metric(
                http,
                &ab,
                "tierlimit_aggregator_deltas_ignored_total{reason=\"future\"}",
            )
            .await
            .unwrap_or(0.0),
            agg_ignored_expired: metric(
                http,
                &ab,
                "tierlimit_aggregator_deltas_ignored_total{reason=\"expired\"}",
            )
            .await
            .unwrap_or(0.0),
            agg_deltas_consumed: metric(http, &ab, "tierlimit_aggregator_deltas_consumed_total")
                .await,
            deltas_produced: metric(http, &nb, "tierlimit_deltas_produced_total").await,
            fail_mode_decisions: metric_sum(http, &nb, "tierlimit_fail_mode_decisions_total").await,
            redis_errors: metric_sum(http, &nb, "tierlimit_redis_errors_total").await,
            epoch_changes: metric_sum(http, &nb, "tierlimit_epoch_changes_total").await,
            node_log_warnings: warnings(&self.node.proc.log()).count() as u64,
            agg_log_warnings: warnings(&self.agg.proc.log()).count() as u64,
        };
        run.save(&format!("rollover_snap_{name}"), &snap)?;
        eprintln!(
            "bench: rollover: snapshot {name} at fake {}: used_memory {}, keys {}, node RSS {} KiB, aggregator RSS {} KiB, view {:?}, tracked {:?}",
            snap.fake_utc, snap.redis_used_memory, snap.redis_dbsize, snap.node_rss_kib, snap.agg_rss_kib,
            snap.view_entries, snap.agg_tracked
        );
        Ok(snap)
    }

    /// One phase: every tenant once, then wait until published and merged. Returns the phase and when its load ended.
    async fn phase(&self, run: &Run, k: &Knobs, name: &str) -> anyhow::Result<(Phase, Instant)> {
        let http = &self.node.http;
        let nb = self.node.url("");
        let ab = self.agg.url("");
        let view0 = metric(http, &nb, "tierlimit_view_entries")
            .await
            .unwrap_or(0.0);
        let tracked0 = metric(http, &ab, "tierlimit_aggregator_tracked_counters")
            .await
            .unwrap_or(0.0);
        let started = Instant::now();
        let n = k.rollover_tenants.to_string();
        let r = run
            .http(
                &format!("rollover_load_{name}"),
                &strings([
                    "--url".to_string(),
                    self.node.url("/v1/check"),
                    "--dist".into(),
                    "seq".into(),
                    "--tenants".into(),
                    n.clone(),
                    "--max-requests".into(),
                    n,
                    "--connections".into(),
                    k.rollover_connections.to_string(),
                    "--tenant-prefix".into(),
                    "s".into(),
                    "--duration".into(),
                    "120".into(),
                    "--warmup".into(),
                    "0".into(),
                ]),
            )
            .await?;
        let end = Instant::now();
        let populated = r.allowed;
        eprintln!(
            "bench: rollover: phase {name}: {populated} checks allowed in {}s ({}/s)",
            (end - started).as_secs(),
            r.throughput_rps
        );
        let deadline = Instant::now() + Duration::from_secs(k.rollover_drain_seconds);
        loop {
            // Merged by the aggregator; far from their global limit, the
            // tenants are not broadcast back, so the view stays as it was.
            let d = self.conn.dirty_total().await?;
            let merged = metric(http, &ab, "tierlimit_aggregator_tracked_counters")
                .await
                .unwrap_or(0.0);
            if d == 0 && merged - tracked0 >= populated as f64 {
                break;
            }
            if Instant::now() >= deadline {
                bail!(
                    "phase {name}: not drained after {}s (dirty {d}, merged +{} of {populated})",
                    k.rollover_drain_seconds,
                    merged - tracked0
                );
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let p = Phase {
            load_s: (end - started).as_secs(),
            pipeline_s: started.elapsed().as_secs(),
            populated,
            view_before: view0,
            allowed: r.allowed,
            denied: r.denied,
            errors: r.errors,
            throughput_rps: r.throughput_rps,
        };
        eprintln!(
            "bench: rollover: phase {name} drained {}s after its start",
            p.pipeline_s
        );
        Ok((p, end))
    }
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<Rollover> {
    let started = Instant::now();
    let run_started = crate::report::utc(now_unix(), true) + " UTC";
    let libfaketime = libfaketime()?;
    let libc_malloc = libc_malloc_debug()?;
    let dir = testkit::port::sub_dir(&run.tmp, "rollover");
    let shim = compile_shim(&dir)?;

    // One offset for the whole run: the faked processes start at fake time
    // MIDNIGHT − LEAD, MIDNIGHT being the first UTC midnight that leaves
    // the offset non-negative.
    let lead = k.rollover_phase_a_seconds + k.rollover_margin_seconds;
    let now = now_unix();
    let midnight = (now + lead).div_ceil(86400) * 86400;
    let offset = midnight - lead - now;
    let (day_a, day_b) = (midnight / 86400 - 1, midnight / 86400);
    let mut fake: Vec<(String, String)> = vec![
        ("FAKETIME".into(), format!("+{offset}s")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ];
    if k.rollover_faketime_no_cache == 1 {
        fake.push(("FAKETIME_NO_CACHE".into(), "1".into()));
    }
    eprintln!(
        "bench: rollover: fake clock: offset +{offset}s, fake midnight {} UTC (day {day_a} -> {day_b}) in about {lead}s",
        crate::report::utc(midnight, true)
    );

    let redis_dir = testkit::port::sub_dir(&run.tmp, "rollover/redis");
    let redis_log = redis_dir.join("redis.log");
    let preload = format!("{}:{}", libc_malloc.display(), libfaketime.display());
    let (redis, port) = start_on_free_port(
        "redis-server (faked)",
        |port| {
            let mut cmd = Cmd::new(redis_server_bin()).label("redis (faked)");
            cmd = cmd.env("LD_PRELOAD", &preload);
            for (key, v) in &fake {
                cmd = cmd.env(key, v);
            }
            server_args(cmd, port, "127.0.0.1", &redis_dir)
                .arg("--logfile")
                .arg(&redis_log)
                .log_file(redis_dir.join("stderr.log"))
        },
        ping,
    );
    run.record_spawned(&redis);
    let conn = RedisConn::open(&format!("redis://127.0.0.1:{port}/")).await?;

    // libfaketime on redis-server: its TIME must read real time + OFFSET,
    // and move.
    let t_real = now_unix();
    let t_fake = conn.time().await?;
    let skew = t_fake as i64 - t_real as i64 - offset as i64;
    ensure!(
        (-2..=2).contains(&skew),
        "redis-server TIME {t_fake} is not real time {t_real} + {offset} (libfaketime not in effect?)"
    );
    testkit::wait_until(
        "redis-server's fake clock advances (else try ROLLOVER_FAKETIME_NO_CACHE=1)",
        Duration::from_secs(5),
        || async { conn.time().await.is_ok_and(|t| t > t_fake) },
    )
    .await;
    eprintln!(
        "bench: rollover: redis-server TIME reads {} UTC: libfaketime works",
        crate::report::utc(t_fake, true)
    );

    let tansu = crate::world::start_tansu(run).await;
    let cfg = testkit::write_config(
        &dir,
        &format!(
            r#"# Written by the bench runner (scenario 6b).
cluster = "rollover"
[kafka]
brokers = "{brokers}"
partitions = 8
[node]
flush_interval = "250ms"
store_timeout = "500ms"
[aggregator]
broadcast_interval = "250ms"
retention_days = {RETENTION_DAYS}
[regions.eu]
redis_url = "redis://127.0.0.1:{port}/"

{bench_plan}
# The probe: a limit small enough that its one check is broadcast back
# (the aggregator broadcasts a tenant from `broadcast_fraction` of its
# limit), so that it reaches the node's view.
[plans.probe]
global = {{ limit = 2 }}
[tenants.probe]
plan = "probe"

[unknown_tenants]
policy = "plan"
plan = "bench"
# The run brings its tenants in within minutes: the newcomer gate's
# defaults (100 new tenants/s, 100 000 a day) would refuse most.
max_new_per_second = 1000000
max_per_day = 100000000
"#,
            brokers = tansu.brokers(),
            bench_plan = crate::world::bench_plan(&format!("{REGION_WINDOW_S}s")),
        ),
    );
    let check = std::process::Command::new(testkit::bin_path("region-node"))
        .arg("check-config")
        .arg(&cfg)
        .output()?;
    ensure!(
        check.status.success(),
        "the generated configuration is invalid:\n{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    eprintln!("bench: rollover: starting the aggregator and region-node eu-1 (faked)");
    let preload = format!("{}:{}", shim.display(), libfaketime.display());
    let mut env: Vec<(&str, &str)> = vec![
        ("LD_PRELOAD", preload.as_str()),
        ("RUST_LOG", k.rollover_log.as_str()),
        ("RUST_BACKTRACE", "1"),
        crate::world::BENCH_OPEN_SCOPES,
    ];
    env.extend(fake.iter().map(|(a, b)| (a.as_str(), b.as_str())));
    let agg = testkit::Aggregator::start_with_env(&cfg, &env).await;
    crate::world::wait_ok(
        &agg.http,
        "the aggregator ready on /readyz",
        &agg.url("/readyz"),
        Duration::from_secs(60),
    )
    .await;
    let node = testkit::RegionNode::start_with_env(&cfg, "eu", "eu-1", &env).await;
    crate::world::wait_ok(
        &node.http,
        "region-node ready on /readyz",
        &node.url("/readyz"),
        Duration::from_secs(60),
    )
    .await;
    run.record_spawned(&agg.proc);
    run.record_spawned(&node.proc);

    // libfaketime on region-node and the aggregator, and the delta's day
    // end to end: one check for tenant "probe" must land on the fake day in
    // Redis, reach the aggregator as a delta of that day, and come back in
    // the node's view.
    let probe_day = conn.time().await? / 86400;
    let node_day = testkit::try_json(&node.http, &node.url("/v1/tenants/probe"))
        .await
        .unwrap_or_default()["day"]
        .as_u64();
    ensure!(
        node_day == Some(probe_day),
        "region-node's day is {node_day:?}, Redis' fake day {probe_day} (libfaketime not in effect on region-node?)"
    );
    let r = node
        .http
        .get(node.url("/v1/check?tenant=probe"))
        .send()
        .await
        .context("the probe check")?;
    ensure!(
        r.status().is_success(),
        "the probe check failed: {}",
        r.status()
    );
    let probe_key = keys::tenant_hash("probe");
    let [probe_field, _, _] = keys::counter_fields(probe_day as u32);
    testkit::wait_until(
        &format!("the probe's PN counter of day {probe_day} in Redis"),
        Duration::from_secs(10),
        || async {
            conn.query::<bool>(redis::cmd("HEXISTS").arg(&probe_key).arg(&probe_field))
                .await
                .unwrap_or(false)
        },
    )
    .await;
    let (ah, au) = (agg.http.clone(), agg.url("/v1/global/probe"));
    testkit::wait_until(
        &format!("the aggregator to count the probe on day {probe_day} (ignored as future/expired? see its metrics)"),
        Duration::from_secs(60),
        || {
            let (ah, au) = (ah.clone(), au.clone());
            async move {
                let v = testkit::try_json(&ah, &au).await.unwrap_or_default();
                v["today"]["day"].as_u64() == Some(probe_day) && v["today"]["total"].as_f64().unwrap_or(0.0) >= 1.0
            }
        },
    )
    .await;
    let (nh, nu) = (node.http.clone(), node.url("/v1/tenants/probe"));
    testkit::wait_until(
        "the probe in region-node's view",
        Duration::from_secs(60),
        || {
            let (nh, nu) = (nh.clone(), nu.clone());
            async move {
                testkit::try_json(&nh, &nu).await.unwrap_or_default()["global_total"]
                    .as_f64()
                    .unwrap_or(0.0)
                    >= 1.0
            }
        },
    )
    .await;
    eprintln!(
        "bench: rollover: libfaketime works on region-node and the aggregator: the probe counted on day {probe_day} everywhere"
    );

    let st = Stack {
        redis,
        conn,
        node,
        agg,
        redis_log,
        sample: format!("s{}", k.rollover_tenants / 2),
        day_a,
        day_b,
        started,
    };
    let mut snaps = BTreeMap::new();
    snaps.insert("start".to_string(), st.snapshot(run, "start").await?);

    eprintln!(
        "bench: rollover: phase A: {} tenants on day {day_a}",
        k.rollover_tenants
    );
    let (phase_a, _) = st.phase(run, k, "a").await?;
    let a = st.snapshot(run, "a").await?;
    let a_end = a.fake_unix;
    ensure!(
        a_end < midnight,
        "phase A ended at fake {}, after the fake midnight: raise ROLLOVER_PHASE_A_SECONDS (it took {}s)",
        crate::report::utc(a_end, true),
        phase_a.pipeline_s
    );
    let pn_b = a
        .redis_keys
        .pn_by_day
        .get(&day_b.to_string())
        .copied()
        .unwrap_or(0);
    ensure!(
        pn_b == 0,
        "phase A wrote {pn_b} PN counters of day {day_b} before the fake midnight"
    );
    eprintln!(
        "bench: rollover: phase A ended {}s before the fake midnight",
        midnight - a_end
    );
    snaps.insert("a".to_string(), a);

    // A few seconds past midnight: the node's prune, the aggregator's
    // housekeeping.
    testkit::wait_until(
        "the fake midnight",
        Duration::from_secs(midnight - a_end + 60),
        || async { st.fake_now().await.is_ok_and(|t| t >= midnight + 3) },
    )
    .await;
    snaps.insert("midnight".to_string(), st.snapshot(run, "midnight").await?);

    eprintln!(
        "bench: rollover: phase B: the same {} tenants on day {day_b}",
        k.rollover_tenants
    );
    let (phase_b, b_end) = st.phase(run, k, "b").await?;
    snaps.insert("b".to_string(), st.snapshot(run, "b").await?);
    if k.rollover_settle == 1 {
        // Region windows are kept 2 windows + 1 s after their last charge:
        // wait until those of the sample and of the last tenant charged are
        // gone (EXISTS expires them lazily).
        let last = format!("s{}", phase_b.populated.saturating_sub(1));
        // Key scheme 2 keeps whole-tenant windows in the tenant hash, which
        // lives as long as its days: no window key to wait for.
        let _ = (&st.sample, &last);
        let keys: Vec<String> = Vec::new();
        let bound = (2 * REGION_WINDOW_S + 5 + 60).saturating_sub(b_end.elapsed().as_secs());
        eprintln!(
            "bench: rollover: waiting (at most {bound}s) for phase B's window keys to expire"
        );
        testkit::wait_until(
            "phase B's window keys to expire",
            Duration::from_secs(bound.max(1)),
            || async {
                for key in &keys {
                    if st.conn.exists(key).await.unwrap_or(true) {
                        return false;
                    }
                }
                true
            },
        )
        .await;
        snaps.insert(
            "b_settled".to_string(),
            st.snapshot(run, "b_settled").await?,
        );
    }

    let redis_log_text = std::fs::read_to_string(&st.redis_log).unwrap_or_default();
    let log_findings = findings(&[
        ("node.log", st.node.proc.log()),
        ("aggregator.log", st.agg.proc.log()),
        ("redis/redis.log", redis_log_text),
    ]);
    let n = k.rollover_tenants;
    let mut growth = BTreeMap::new();
    growth.insert(
        "a - start (one day of N tenants)".to_string(),
        Some(Growth::between(&snaps["start"], &snaps["a"], n)),
    );
    growth.insert(
        "b - a (across the rollover)".to_string(),
        Some(Growth::between(&snaps["a"], &snaps["b"], n)),
    );
    growth.insert(
        "b_settled - start (two days of PN counters, no windows)".to_string(),
        snaps
            .get("b_settled")
            .map(|s| Growth::between(&snaps["start"], s, n)),
    );
    let redis_version = crate::report::redis_version();
    let r = Rollover {
        run_started,
        elapsed_s: started.elapsed().as_secs(),
        tenants: n,
        load_average_end: testkit::load_average(),
        redis_version,
        redis_allocator:
            "glibc malloc (libc_malloc_debug.so.0 preloaded; jemalloc deadlocks under libfaketime)"
                .into(),
        faketime_offset_s: offset,
        fake_midnight_unix: midnight,
        fake_midnight_utc: crate::report::utc_iso(midnight),
        day_a,
        day_b,
        retention_days: RETENTION_DAYS,
        phase_a,
        phase_b,
        snapshots: snaps,
        growth,
        log_findings,
    };
    run.save("s6b_rollover", &r)?;
    drop(tansu);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_lose_timestamps_colours_and_values() {
        let line =
            "2026-11-21T23:56:33.123Z \x1b[33m WARN\x1b[0m follower: lag tenant=\"a b\" n=5 done";
        assert_eq!(message_of(line), "WARN follower: lag tenant=… n=… done");
        let f = findings(&[(
            "node.log",
            format!("{line}\n{line}\nINFO fine\nWARN overcommit x=1\n"),
        )]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].count, 2);
    }
}
