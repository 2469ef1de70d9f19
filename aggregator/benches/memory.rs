//! Aggregator memory per counter and per region part, in process, without
//! Kafka (issue 10: at most 150 B per region part of a counter at 20
//! regions). Fills a [`Merged`] with N (tenant, day) counters, each with a
//! part from R region actors, through the same `apply` the consumer calls,
//! and counts the bytes the global allocator holds before and after.
//!
//! Beside it, in the same run, the layout before interning (actor strings
//! in the CRDT's P and N maps and in a `BTreeMap` of parts), rebuilt here
//! from the same `crdts::PNCounter` as the baseline.
//!
//! `cargo bench -p aggregator --bench memory` (or `BENCH_ONLY=memory
//! scripts/bench`); `MEMORY_SIZES="100000x20,10000000x1"` picks the sizes.
//! `MEMORY_KINDS="hour,day,month"` gives every tenant a counter of each of
//! those global tiers (issue 33: bytes per tenant with three tiers against
//! the day's alone); the default is the day's only, and "counters" then
//! counts tenants × kinds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use aggregator::merge::Merged;
use crdts::pncounter::{Dir, Op};
use crdts::{CmRDT, Dot, PNCounter};
use tierlimit_shared::messages::{actor, Delta};
use tierlimit_shared::period::{Period, PeriodKind};

/// Bytes currently allocated through the global allocator.
struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HELD.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn held() -> isize {
    HELD.load(Ordering::Relaxed)
}

const DAY: u32 = 20_000;
/// Noon of `DAY`: what the retention is judged at.
const NOW: u64 = DAY as u64 * 86_400_000 + 43_200_000;

/// The previous layout: actor strings in both CRDT maps and the parts.
#[derive(Default)]
struct StringCounter {
    crdt: PNCounter<String>,
    parts: BTreeMap<String, (u64, u64)>,
}

fn main() {
    let sizes = std::env::var("MEMORY_SIZES")
        .unwrap_or_else(|_| "100000x20,300000x20,1000000x20,10000000x1".into());
    let regions: Vec<String> = (0..20).map(|i| format!("region-{i:02}")).collect();
    // Epochs as region-nodes make them: 32 hex digits.
    let actors: Vec<String> = regions
        .iter()
        .map(|r| actor(r, "0123456789abcdef0123456789abcdef"))
        .collect();
    let kinds: Vec<PeriodKind> = std::env::var("MEMORY_KINDS")
        .unwrap_or_else(|_| "day".into())
        .split(',')
        .map(|k| PeriodKind::parse(k.trim()).expect("MEMORY_KINDS: hour,day,week,month"))
        .collect();
    let periods: Vec<Period> = kinds.iter().map(|k| k.at(NOW)).collect();
    println!("(global tiers per tenant: {kinds:?})");
    println!("| counters | regions | bytes / counter | bytes / region part | before interning, bytes / part | fill time |");
    println!("(the tenant name of each counter's key excluded: every layout has it)");
    println!("|---:|---:|---:|---:|---:|---:|");
    for size in sizes.split(',') {
        let (n, r) = size
            .split_once('x')
            .and_then(|(n, r)| Some((n.parse::<usize>().ok()?, r.parse::<usize>().ok()?)))
            .expect("MEMORY_SIZES: NxR,…");
        let r = r.clamp(1, actors.len());
        let tenants: Vec<String> = (0..n).map(|i| format!("tenant-{i:08}")).collect();

        let before = held();
        let started = Instant::now();
        let mut merged = Merged::new(2);
        for a in &actors[..r] {
            for t in &tenants {
                for p in &periods {
                    let mut d = Delta::of(t, *p, a.clone(), 1_000, 10, 0);
                    // v3: the node's enforced limit and limits version.
                    d.limit = Some(100_000);
                    d.limits_version = 1;
                    merged.apply(0, &d, NOW);
                }
            }
        }
        let fill = started.elapsed();
        let n = n * periods.len();
        // The dirty set is what the next broadcast interval takes; in steady
        // state it holds only what changed since the last one.
        merged.take_dirty(false, |_| true, |_, _| false);
        let bytes = (held() - before) as f64 - periods.len() as f64 * tenant_names(&tenants);
        assert_eq!(merged.len(), n);
        drop(merged);

        // The baseline only for the sizes that fit twice in memory.
        let baseline = if n * r <= 2_000_000 {
            let before = held();
            let mut old: HashMap<(String, u32), StringCounter> = HashMap::new();
            for a in &actors[..r] {
                for t in &tenants {
                    let c = old.entry((t.clone(), DAY)).or_default();
                    c.parts.insert(a.clone(), (1_000, 10));
                    c.crdt.apply(Op {
                        dot: Dot::new(a.clone(), 1_000),
                        dir: Dir::Pos,
                    });
                    c.crdt.apply(Op {
                        dot: Dot::new(a.clone(), 10),
                        dir: Dir::Neg,
                    });
                }
            }
            let bytes = (held() - before) as f64 - tenant_names(&tenants);
            drop(old);
            format!("{:.0}", bytes / (tenants.len() * r) as f64)
        } else {
            "—".into()
        };
        println!(
            "| {n} | {r} | {:.0} | {:.0} | {baseline} | {:.1} s |",
            bytes / n as f64,
            bytes / (n * r) as f64,
            fill.as_secs_f64()
        );
    }
}

/// What the tenant names themselves take in the map keys (one `String`
/// per counter, as in any layout): not charged to the parts.
fn tenant_names(tenants: &[String]) -> f64 {
    tenants.iter().map(|t| t.capacity() as f64).sum()
}
