//! The decision path's read of the broadcast view while the follower
//! writes it (issue 10, item 4): p50/p99/p99.9 of one `View::with` read,
//! with an idle writer and with a writer applying 50 000 updates/s over
//! 100 000 tenants and pruning every 200 ms as the follower does, for the
//! sharded view and for the single-lock map it replaced (kept here as the
//! baseline, so both are measured in one run).
//!
//! A third writer drops a *populated* day (yesterday, 100 000 entries) once
//! while the reads run, as the follower does at midnight (issue 36, item
//! 5): the reads' tail and the drop's own time are what it shows.
//!
//! Run: `cargo bench -p region-node --bench view` (release). Prints a
//! Markdown table. In-process, no I/O: what it measures is lock waiting and
//! the work done under the locks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use region_node::view::{Entry, View};
use tierlimit_shared::messages::{ActorPart, GlobalUpdate, VERSION};

const TENANTS: usize = 100_000;
const UPDATES_PER_SEC: u64 = 50_000;
const READS: usize = 2_000_000;
const DAY: u32 = 20_000;

/// The view before issue 10's item 4: one lock over every day, a prune
/// that walks every entry under the write lock, allocation under it.
#[derive(Default)]
struct SingleLock {
    entries: RwLock<HashMap<String, HashMap<u32, Entry>>>,
}

trait Read: Send + Sync + 'static {
    fn read(&self, tenant: &str, day: u32) -> u64;
    fn write(&self, u: &GlobalUpdate);
    fn prune(&self, oldest: u32);
}

impl Read for View {
    fn read(&self, tenant: &str, day: u32) -> u64 {
        self.with(tenant, day, |e| e.map_or(0, Entry::total))
    }
    fn write(&self, u: &GlobalUpdate) {
        self.apply(u);
    }
    fn prune(&self, oldest: u32) {
        View::prune(self, oldest);
    }
}

impl Read for SingleLock {
    fn read(&self, tenant: &str, day: u32) -> u64 {
        let map = self.entries.read().unwrap();
        map.get(tenant)
            .and_then(|d| d.get(&day))
            .map_or(0, Entry::total)
    }
    fn write(&self, u: &GlobalUpdate) {
        let mut map = self.entries.write().unwrap();
        let e = map
            .entry(u.tenant.clone())
            .or_default()
            .entry(u.period.index)
            .or_default();
        for part in &u.parts {
            let slot = e.parts.entry(part.actor.clone()).or_insert((0, 0));
            slot.0 = slot.0.max(part.p);
            slot.1 = slot.1.max(part.n);
        }
        e.ts_ms = e.ts_ms.max(u.ts_ms);
    }
    fn prune(&self, oldest: u32) {
        let mut map = self.entries.write().unwrap();
        map.retain(|_, days| {
            days.retain(|d, _| *d >= oldest);
            !days.is_empty()
        });
    }
}

fn update(tenant: usize, p: u64) -> GlobalUpdate {
    GlobalUpdate {
        v: VERSION,
        tenant: format!("tenant-{tenant}"),
        period: tierlimit_shared::period::Period::day(DAY),
        total: p,
        parts: ["eu-west/e1", "us-east/e2", "ap-south/e3"]
            .iter()
            .map(|a| ActorPart {
                actor: (*a).into(),
                p,
                n: 0,
            })
            .collect(),
        limit: Some(1_000_000),
        over_limit: false,
        ts_ms: p,
        limits_version: 0,
    }
}

/// A tiny xorshift: the reads' tenants, without a dependency.
fn next(x: &mut u64) -> usize {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    (*x % TENANTS as u64) as usize
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * q) as usize]
}

/// What writes while the reads run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Writer {
    Idle,
    /// 50 000 updates/s and a prune every 200 ms (nothing to drop).
    Busy,
    /// One prune that drops yesterday, populated, 100 ms into the reads.
    DropDay,
}

/// Read latencies (ns) of `READS` reads, with a writer or without; the
/// updates applied (or, for [`Writer::DropDay`], the drop's µs).
fn measure<V: Read>(view: Arc<V>, writer: Writer) -> (Vec<u64>, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let dropper = (writer == Writer::DropDay).then(|| {
        let view = Arc::clone(&view);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let t0 = Instant::now();
            view.prune(DAY);
            t0.elapsed().as_micros() as u64
        })
    });
    let writer = (writer == Writer::Busy).then(|| {
        let (view, stop) = (Arc::clone(&view), Arc::clone(&stop));
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut last_prune = Instant::now();
            let mut applied = 0u64;
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            while !stop.load(Ordering::Relaxed) {
                // Paced: as many as 50 000/s allows by now, then a nap.
                let due = start.elapsed().as_micros() as u64 * UPDATES_PER_SEC / 1_000_000;
                while applied < due {
                    applied += 1;
                    view.write(&update(next(&mut x), 1_000 + applied));
                }
                if last_prune.elapsed() >= Duration::from_millis(200) {
                    view.prune(DAY - 1);
                    last_prune = Instant::now();
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            applied
        })
    });
    let mut lat = Vec::with_capacity(READS);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut sink = 0u64;
    for _ in 0..READS {
        let t = format!("tenant-{}", next(&mut x));
        let t0 = Instant::now();
        sink = sink.wrapping_add(view.read(&t, DAY));
        lat.push(t0.elapsed().as_nanos() as u64);
    }
    stop.store(true, Ordering::Relaxed);
    let applied =
        writer.map_or(0, |w| w.join().unwrap()) + dropper.map_or(0, |d| d.join().unwrap());
    std::hint::black_box(sink);
    lat.sort_unstable();
    (lat, applied)
}

fn fill<V: Read>(v: &V, yesterday_too: bool) {
    for t in 0..TENANTS {
        v.write(&update(t, 1));
        if yesterday_too {
            let mut u = update(t, 1);
            u.period = tierlimit_shared::period::Period::day(DAY - 1);
            v.write(&u);
        }
    }
}

fn main() {
    println!("| view | writer | reads | updates applied (drop: its µs) | p50 ns | p99 ns | p99.9 ns | max µs |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut p99 = HashMap::new();
    for (name, sharded) in [("sharded (now)", true), ("single lock (before)", false)] {
        for mode in [Writer::Idle, Writer::Busy, Writer::DropDay] {
            let yesterday = mode == Writer::DropDay;
            let (lat, applied) = if sharded {
                let v = Arc::new(View::new());
                fill(v.as_ref(), yesterday);
                measure(v, mode)
            } else {
                let v = Arc::new(SingleLock::default());
                fill(v.as_ref(), yesterday);
                measure(v, mode)
            };
            let writer = match mode {
                Writer::Idle => "idle",
                Writer::Busy => "50 k updates/s + prune every 200 ms",
                Writer::DropDay => "drops yesterday (100 k entries) once",
            };
            let busy = mode == Writer::Busy;
            if mode != Writer::DropDay {
                p99.insert((sharded, busy), percentile(&lat, 0.99));
            }
            println!(
                "| {name} | {writer} | {} | {applied} | {} | {} | {} | {:.0} |",
                lat.len(),
                percentile(&lat, 0.5),
                percentile(&lat, 0.99),
                percentile(&lat, 0.999),
                *lat.last().unwrap() as f64 / 1000.0
            );
        }
    }
    println!();
    for (name, sharded) in [("sharded", true), ("single lock", false)] {
        println!(
            "{name}: p99 busy ÷ idle = {:.2}",
            p99[&(sharded, true)] as f64 / p99[&(sharded, false)] as f64
        );
    }
}
