//! What one worker measured, merged into one summary at the end.
//!
//! Every worker owns its `Stats` (no locks on the hot path); the runner
//! merges them when the run is over.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::{json, Value};

/// Latencies are recorded in nanoseconds, 3 significant digits, up to 60 s.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// How one request ended, as far as the load generator can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// HTTP status, or 0 for a Redis reply.
    pub status: u16,
    pub allowed: bool,
    /// The tier that denied (`node`, `region`, `global`, `store`, `other`).
    pub tier: Option<&'static str>,
    /// How region-node decided (`redis`, `view`, `local`, `open`).
    pub mode: Option<&'static str>,
}

/// One response, kept only when a run asks for events (accuracy runs).
#[derive(Debug, Clone, Copy)]
pub struct Event {
    /// Completion time, ns since the start of the run.
    pub done_ns: u64,
    /// Tenant index (the number after `--tenant-prefix`).
    pub tenant: u32,
    pub target: u8,
    pub allowed: bool,
}

#[derive(Default, Debug, Clone, Copy, Serialize)]
pub struct TargetCounts {
    pub requests: u64,
    pub allowed: u64,
    pub denied: u64,
    pub errors: u64,
}

pub struct Stats {
    /// Latency as the caller sees it: from the intended send time (open
    /// loop) or the actual send time (closed loop) to the complete response.
    pub latency: Histogram<u64>,
    /// Open loop only: from the socket write to the complete response (what
    /// latency would be if queueing in the generator were hidden).
    pub service: Histogram<u64>,
    /// Open loop only: how late the scheduler handed a request to a worker.
    pub lag: Histogram<u64>,
    pub allowed: u64,
    pub denied: u64,
    pub errors: u64,
    pub denied_by: BTreeMap<&'static str, u64>,
    pub modes: BTreeMap<&'static str, u64>,
    pub status: BTreeMap<u16, u64>,
    pub error_kinds: BTreeMap<String, u64>,
    pub per_target: Vec<TargetCounts>,
    pub events: Vec<Event>,
}

impl Stats {
    pub fn new(targets: usize) -> Stats {
        Stats {
            latency: histogram(),
            service: histogram(),
            lag: histogram(),
            allowed: 0,
            denied: 0,
            errors: 0,
            denied_by: BTreeMap::new(),
            modes: BTreeMap::new(),
            status: BTreeMap::new(),
            error_kinds: BTreeMap::new(),
            per_target: vec![TargetCounts::default(); targets],
            events: Vec::new(),
        }
    }

    pub fn record(&mut self, target: usize, o: Outcome, latency_ns: u64) {
        let _ = self.latency.record(latency_ns.max(1));
        let t = &mut self.per_target[target];
        t.requests += 1;
        *self.status.entry(o.status).or_default() += 1;
        if let Some(m) = o.mode {
            *self.modes.entry(m).or_default() += 1;
        }
        if o.allowed {
            self.allowed += 1;
            t.allowed += 1;
        } else if let Some(tier) = o.tier {
            self.denied += 1;
            t.denied += 1;
            *self.denied_by.entry(tier).or_default() += 1;
        } else {
            self.errors += 1;
            t.errors += 1;
            *self
                .error_kinds
                .entry(format!("status {}", o.status))
                .or_default() += 1;
        }
    }

    pub fn error(&mut self, target: usize, kind: &str) {
        self.errors += 1;
        self.per_target[target].requests += 1;
        self.per_target[target].errors += 1;
        *self.error_kinds.entry(kind.to_string()).or_default() += 1;
    }

    pub fn merge(&mut self, o: Stats) {
        let _ = self.latency.add(&o.latency);
        let _ = self.service.add(&o.service);
        let _ = self.lag.add(&o.lag);
        self.allowed += o.allowed;
        self.denied += o.denied;
        self.errors += o.errors;
        for (k, v) in o.denied_by {
            *self.denied_by.entry(k).or_default() += v;
        }
        for (k, v) in o.modes {
            *self.modes.entry(k).or_default() += v;
        }
        for (k, v) in o.status {
            *self.status.entry(k).or_default() += v;
        }
        for (k, v) in o.error_kinds {
            *self.error_kinds.entry(k).or_default() += v;
        }
        for (a, b) in self.per_target.iter_mut().zip(o.per_target) {
            a.requests += b.requests;
            a.allowed += b.allowed;
            a.denied += b.denied;
            a.errors += b.errors;
        }
        self.events.extend(o.events);
    }

    pub fn requests(&self) -> u64 {
        self.allowed + self.denied + self.errors
    }
}

/// Percentiles of a histogram in microseconds (3 decimals).
pub fn percentiles_us(h: &Histogram<u64>) -> Value {
    if h.is_empty() {
        return Value::Null;
    }
    let us = |ns: u64| (ns as f64 / 1000.0 * 1000.0).round() / 1000.0;
    json!({
        "count": h.len(),
        "min": us(h.min()),
        "mean": (h.mean() / 1000.0 * 1000.0).round() / 1000.0,
        "p50": us(h.value_at_quantile(0.50)),
        "p90": us(h.value_at_quantile(0.90)),
        "p99": us(h.value_at_quantile(0.99)),
        "p99_9": us(h.value_at_quantile(0.999)),
        "p99_99": us(h.value_at_quantile(0.9999)),
        "max": us(h.max()),
    })
}
