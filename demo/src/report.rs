//! What the demo prints: its `demo:` lines, the phase banners and the
//! progress line every 2 s while the story runs, then the promises and the
//! final report.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::story::{
    Outcome, BURSTY, BURSTY_REGION_LIMIT, BURST_REGION, CUT_REGION, ENVOY_REGION, HOT,
    HOT_DAILY_LIMIT, HOT_RATE, REGIONS, STEADY, TENANTS,
};
use crate::traffic::{Cell, Tally};
use crate::world::World;

pub fn say(msg: impl AsRef<str>) {
    println!("demo: {}", msg.as_ref());
}

/// The current phase, shared by the story and the progress printer.
pub struct Progress {
    phase: Mutex<&'static str>,
    start: Instant,
}

impl Progress {
    pub fn new(phase: &'static str) -> Progress {
        Progress {
            phase: Mutex::new(phase),
            start: Instant::now(),
        }
    }

    /// Enters phase `name` and prints its banner, `what` happens in it.
    pub fn set_phase(&self, name: &'static str, what: &str) {
        *self.phase.lock().unwrap() = name;
        println!(
            "\n[{:>5.1}s] ==> {what}",
            self.start.elapsed().as_secs_f64()
        );
    }
}

/// Prints [`progress_line`] every 2 s until aborted.
pub fn spawn_progress(
    w: Arc<World>,
    tally: Arc<Tally>,
    p: Arc<Progress>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        tick.tick().await;
        loop {
            tick.tick().await;
            println!("{}", progress_line(&w, &tally, &p).await);
        }
    })
}

/// Time, phase, what each region's clients saw, the aggregator's hot and
/// acme, and how old each region's newest delta at the aggregator is.
async fn progress_line(w: &World, tally: &Tally, p: &Progress) -> String {
    let mut line = format!(
        "[{:>5.1}s] {:<12} | allowed/denied",
        p.start.elapsed().as_secs_f64(),
        *p.phase.lock().unwrap()
    );
    for r in REGIONS {
        let c = tally.totals(None, Some(r));
        let _ = write!(line, " {r} {}/{}", c.allowed, c.denied());
        if c.errors > 0 {
            let _ = write!(line, " ({} errors)", c.errors);
        }
    }
    line.push_str(" | global");
    for t in [HOT, "acme"] {
        if let Some((total, _)) = w.agg_view(t).await {
            let _ = write!(line, " {t} {total}");
            if t == HOT {
                let _ = write!(line, "/{HOT_DAILY_LIMIT}");
            }
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    line.push_str(" | last delta");
    for r in REGIONS {
        match w.last_delta(r).await {
            Some(ts) => {
                let _ = write!(line, " {r} {:.1}s ago", (now - ts).max(0.0));
            }
            None => {
                let _ = write!(line, " {r} -");
            }
        }
    }
    line
}

struct Promise {
    ok: bool,
    text: String,
}

fn promise(ok: bool, text: impl Into<String>) -> Promise {
    Promise {
        ok,
        text: text.into(),
    }
}

/// Judges every promise, prints the report, and returns whether every
/// promise held. `dead` lists the processes that died.
pub fn report(w: &World, o: &Outcome, dead: &[String]) -> bool {
    let promises = promises(w, o, dead);
    if o.fail_mode > 0.0 {
        say(format!(
            "note: {} decisions were taken in a fail mode (Redis slower than store_timeout); \
             they are counted under a node actor, not in Redis",
            o.fail_mode
        ));
    }
    print_report(o, &promises);
    promises.iter().all(|p| p.ok)
}

fn promises(w: &World, o: &Outcome, dead: &[String]) -> Vec<Promise> {
    let tally = &o.tally;
    let mut promises = Vec::new();
    let steady =
        STEADY
            .iter()
            .map(|t| tally.totals(Some(t), None))
            .fold(Cell::default(), |mut a, c| {
                a.add(&c);
                a
            });
    promises.push(promise(
        steady.denied() == 0 && steady.errors == 0 && steady.allowed > 0,
        format!(
            "steady tenants (acme, globex, initech): {} allowed, {} denied, {} errors, {} refunded",
            steady.allowed,
            steady.denied(),
            steady.errors,
            steady.refunded
        ),
    ));
    let bursty_eu = o.bursty_eu;
    let bursty_us = tally.cell(BURSTY, "us-east");
    promises.push(promise(
        bursty_eu.allowed == BURSTY_REGION_LIMIT
            && bursty_eu.denied_region == bursty_eu.denied()
            && bursty_eu.denied_region > 0
            && bursty_eu.errors == 0,
        format!(
            "bursty in {BURST_REGION}: exactly {} allowed (region limit {BURSTY_REGION_LIMIT}/min), \
             {} denied, all by the region tier",
            bursty_eu.allowed, bursty_eu.denied_region
        ),
    ));
    promises.push(promise(
        bursty_us.denied() == 0 && bursty_us.errors == 0 && bursty_us.allowed > 0,
        format!(
            "bursty in us-east is not affected by eu-west's region limit: {} allowed, {} denied",
            bursty_us.allowed,
            bursty_us.denied()
        ),
    ));
    promises.push(promise(
        o.global.all_deny,
        format!(
            "hot over its daily limit: every region denies it from the broadcast view ({})",
            o.global
                .crossing_spread
                .map_or("not reached".into(), |d| format!(
                    "{:.2} s from the first global denial to the last region",
                    d.as_secs_f64()
                ))
        ),
    ));
    let up = &o.upgrade;
    promises.push(promise(
        up.everywhere.is_some(),
        format!(
            "initech upgraded through the limits API (version {}): applied by all {} region-nodes {}",
            up.version,
            up.nodes,
            match (up.written, up.everywhere) {
                (Some(w), Some(e)) => format!(
                    "{} ms after the request (written in {} ms)",
                    e.as_millis(),
                    w.as_millis()
                ),
                _ => "NOT within the deadline".into(),
            }
        ),
    ));
    let hot_allowed = tally.totals(Some(HOT), None).allowed;
    let overshoot = hot_allowed.saturating_sub(HOT_DAILY_LIMIT);
    // DESIGN: overshoot ≈ Σ other regions' rate × (flush + broadcast + transport).
    let others_rate = HOT_RATE * (REGIONS.len() - 1) as f64;
    let expected = others_rate * (w.flush + w.broadcast).as_secs_f64();
    // Checked with 2 s of slack for the transport: a busy 2-core machine.
    let bound =
        (others_rate * (w.flush + w.broadcast + Duration::from_secs(2)).as_secs_f64()) as u64;
    promises.push(promise(
        hot_allowed >= HOT_DAILY_LIMIT && overshoot <= bound,
        format!(
            "hot allowed {hot_allowed} for a limit of {HOT_DAILY_LIMIT}: overshoot {overshoot} \
             (expected about others' rate × (flush + broadcast) = {expected:.0}; bound checked: {bound})"
        ),
    ));
    let cut = &o.cut;
    promises.push(promise(
        cut.during_cut.allowed > 0 && cut.during_cut.errors == 0 && cut.frozen,
        format!(
            "{CUT_REGION} cut off from Kafka for {} s kept serving ({} allowed, {} errors) while the aggregator \
             heard nothing from it (its part of acme: {} before the cut, {} at the heal)",
            cut.cut_for.as_secs(),
            cut.during_cut.allowed,
            cut.during_cut.errors,
            cut.acme_before.map_or("?".into(), |v| v.to_string()),
            cut.acme_frozen_to.map_or("?".into(), |v| v.to_string()),
        ),
    ));
    let c = &o.converge;
    let exact = TENANTS.iter().all(|t| c.exact(t));
    promises.push(promise(
        exact && c.converged.is_some(),
        format!(
            "after the heal the global count is exact for every tenant: aggregator = clients' allowed − refunded \
             = Redis truth ({})",
            c.converged.map_or("did not converge".into(), |d| format!("converged {:.2} s after the heal", d.as_secs_f64()))
        ),
    ));
    // The steady tenants' month tier (a fresh world: the month holds what
    // today holds, counted by a counter of its own).
    let months: Vec<String> = STEADY
        .iter()
        .map(|t| match &c.month[t] {
            Some((name, total)) => format!("{t} {total} in {name}"),
            None => format!("{t} ?"),
        })
        .collect();
    promises.push(promise(
        STEADY
            .iter()
            .all(|t| c.month[t].as_ref().map(|m| m.1) == Some(c.want[t])),
        format!(
            "a calendar-month tier beside the daily one (plan standard: 100000 a day, 2000000 a month): \
             the aggregator's month count = clients' allowed − refunded ({})",
            months.join(", ")
        ),
    ));
    let p = &o.periods;
    let hours: Vec<String> = p
        .hours
        .iter()
        .map(|(name, total, closed, _)| {
            format!(
                "{name} {total} ({})",
                if *closed { "closed" } else { "open" }
            )
        })
        .collect();
    promises.push(promise(
        p.exact(c.want["globex"]),
        match p.hour_end_ms {
            Some(_) => format!(
                "globex counts on Berlin's calendar; the hour the Redis clocks crossed is closed (every region's \
                 watermark past its end) and its hours add up to the clients' allowed − refunded: {} = {}",
                hours.join(" + "),
                c.want["globex"]
            ),
            None => "no hour ended in the story (it ran too near a midnight of UTC or Berlin: the Redis clocks \
                     ran true)"
                .to_string(),
        },
    ));
    let e = &o.envoy;
    promises.push(promise(
        e.counted(),
        format!(
            "{ENVOY_REGION}'s traffic went through Envoy and is counted like the others: its clients sent {} checks \
             through Envoy, its region-nodes answered {} ShouldRateLimit calls over gRPC; the aggregator's \
             {ENVOY_REGION} part = its clients' allowed − refunded ({} = {})",
            e.sent,
            e.rls_calls,
            e.seen.map_or("?".into(), |v| v.to_string()),
            e.want
        ),
    ));
    promises.push(promise(
        dead.is_empty(),
        if dead.is_empty() {
            "no process died".to_string()
        } else {
            format!("processes died: {}", dead.join(", "))
        },
    ));
    promises
}

fn print_report(o: &Outcome, promises: &[Promise]) {
    let tally = &o.tally;
    println!("\n================================ REPORT ================================");
    let direct: Vec<&str> = REGIONS.into_iter().filter(|r| *r != ENVOY_REGION).collect();
    println!(
        "\n{ENVOY_REGION}'s clients went through a real Envoy (envoy.filters.http.ratelimit, RLS v3 over gRPC \
         to {ENVOY_REGION}'s region-nodes); {}'s called region-node's HTTP API.",
        direct.join("'s and ")
    );
    println!("\nDecisions the clients saw, per region and tier (allowed / denied by tier):");
    println!(
        "  {:<10} {:>8} {:>9} {:>12} {:>14} {:>14} {:>7}",
        "region", "allowed", "refunded", "denied:node", "denied:region", "denied:global", "errors"
    );
    let mut all = Cell::default();
    for r in REGIONS {
        let c = tally.totals(None, Some(r));
        all.add(&c);
        let name = if r == ENVOY_REGION {
            format!("{r}*")
        } else {
            r.to_string()
        };
        println!(
            "  {:<10} {:>8} {:>9} {:>12} {:>14} {:>14} {:>7}",
            name, c.allowed, c.refunded, c.denied_node, c.denied_region, c.denied_global, c.errors
        );
    }
    println!(
        "  {:<10} {:>8} {:>9} {:>12} {:>14} {:>14} {:>7}",
        "all",
        all.allowed,
        all.refunded,
        all.denied_node,
        all.denied_region,
        all.denied_global,
        all.errors
    );
    println!(
        "  (* through Envoy: the denying tier read from the RateLimit header the RLS answered)"
    );
    println!("\nPer tenant and region (allowed / denied):");
    print!("  {:<8}", "tenant");
    for r in REGIONS {
        print!(" {r:>15}");
    }
    println!();
    for t in TENANTS {
        print!("  {t:<8}");
        for r in REGIONS {
            let c = tally.cell(t, r);
            print!(" {:>15}", format!("{} / {}", c.allowed, c.denied()));
        }
        println!();
    }
    println!("\nGlobal count per tenant, today (UTC):");
    println!(
        "  {:<8} {:>8} {:>22} {:>11} {:>12} {:>6}",
        "tenant", "limit", "clients: allowed−ref.", "aggregator", "Redis truth", "exact"
    );
    let limits: BTreeMap<&str, u64> = [
        ("acme", 100_000),
        ("globex", 100_000),
        ("initech", 100_000),
        (BURSTY, 1_000_000),
        (HOT, HOT_DAILY_LIMIT),
    ]
    .into_iter()
    .collect();
    let c = &o.converge;
    for t in TENANTS {
        println!(
            "  {:<8} {:>8} {:>22} {:>11} {:>12} {:>6}",
            t,
            limits[t],
            c.want[t],
            c.seen[t].map_or("?".into(), |v| v.to_string()),
            c.truth[t],
            if c.exact(t) { "yes" } else { "NO" }
        );
    }
    let p = &o.periods;
    println!("\nCalendars and usage per period (GET /v1/usage/<tenant> on the aggregator):");
    for (who, d) in [
        ("acme, UTC", &p.utc_day),
        ("globex, Europe/Berlin", &p.berlin_day),
    ] {
        match d {
            Some((name, start, total)) => {
                println!("  {who:<22} day {name} from {start}: {total}")
            }
            None => println!("  {who:<22} day: ?"),
        }
    }
    for (name, total, closed, _) in &p.hours {
        println!(
            "  globex hour {name}: {total} ({})",
            if *closed {
                "closed: every region reported past its end; the figure is final"
            } else {
                "open"
            }
        );
    }
    println!("\nTimings:");
    println!(
        "  hot: first global denial → every region denies from the broadcast view: {}",
        o.global
            .crossing_spread
            .map_or("—".into(), |d| format!("{:.2} s", d.as_secs_f64()))
    );
    println!(
        "  {CUT_REGION}: cut off from Kafka {:.1} s; heal → first {CUT_REGION} delta at the aggregator: {}; \
         heal → global count exact: {}",
        o.cut.cut_for.as_secs_f64(),
        c.first_delta_after_heal
            .map_or("—".into(), |d| format!("{:.2} s", d.as_secs_f64())),
        c.converged
            .map_or("did not converge".into(), |d| format!("{:.2} s", d.as_secs_f64()))
    );
    let (slowest, slowest_what) = tally.slowest();
    println!(
        "  slowest answer a client saw: {:.0} ms ({slowest_what})",
        slowest.as_secs_f64() * 1000.0
    );
    println!(
        "  region-node metrics: {} fail-mode decisions, {} deltas refused by Kafka",
        o.fail_mode, o.deltas_failed
    );
    println!("\nPromises:");
    for p in promises {
        println!("  [{}] {}", if p.ok { "PASS" } else { "FAIL" }, p.text);
    }
    if let Some(e) = tally.last_error() {
        println!("\n  last client error: {e}");
    }
    println!("========================================================================");
}
