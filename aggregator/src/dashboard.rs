//! `GET /`: the operator's page. One server-rendered HTML document, plain
//! HTML and CSS (no script, no build step), refreshed by a meta refresh:
//!
//! - today's usage per tenant: global total, daily limit, share used, and the
//!   per-region parts as a stacked bar with the limit marked;
//! - the tenants at or over their daily limit;
//! - per region: the newest delta seen and how long ago (the delta lag while
//!   a region has traffic), and its units today;
//! - the periods held (every global tier's: hour, day, week, month), with
//!   their counter count and units (kept as deltas merge: no walk);
//! - this instance's readiness, partitions and consumer lag.
//!
//! The tenant rows are the day's tier (every tenant has that counter); a
//! tenant's other tiers are in `/v1/global/<tenant>`. A row's limit is the
//! one the nodes' deltas carried, else the configuration's.
//!
//! Like the JSON API, it shows what *this* instance holds: with several
//! aggregators, each owns some partitions of the deltas topic, and the page
//! says which. Query parameters: `refresh` (seconds, default 5, 0 = off) and
//! `top` (most tenant rows, default 200).
//!
//! The markup carries `data-*` attributes with the raw numbers (tenant rows:
//! `data-tenant`, `data-total`, `data-limit`; region rows: `data-region`,
//! `data-last-delta-ms`), so tests and scrapers need not parse formatted text.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::{Query, State as AxumState};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use prometheus::core::Collector;
use tierlimit_shared::day;
use tierlimit_shared::messages::now_ms;
use tierlimit_shared::period::Period;

use crate::merge::{Carried, Counter};
use crate::progress::Readiness;
use crate::state::State;

/// Default and largest number of tenant rows.
const DEFAULT_TOP: usize = 200;
const MAX_TOP: usize = 5000;
const DEFAULT_REFRESH: u32 = 5;

/// Region colours, in configuration order (Tableau 10, readable on white).
const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f",
    "#e15759", "#bab0ac",
];
const UNKNOWN_COLOUR: &str = "#888888";

/// Everything the page shows (see [`snapshot`]).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub cluster: String,
    pub day: u32,
    pub now_ms: u64,
    /// `None` when ready, else why not.
    pub not_ready: Option<String>,
    pub partitions_owned: Vec<i32>,
    pub partitions_total: i32,
    pub consumer_lag: i64,
    /// Tenants with a counter today on this instance.
    pub tenant_count: usize,
    /// Σ global totals today over all of them.
    pub units: u64,
    /// Tenants at or over their limit: how many, and the first `top` of them
    /// (most over first).
    pub over_count: usize,
    /// The rows shown, in display order (over limit first, then by share of
    /// the limit used, then by total): at most `top`.
    pub tenants: Vec<TenantRow>,
    /// Configured regions (in order), then any other region seen in deltas.
    pub regions: Vec<RegionRow>,
    /// Whether `RegionRow::units_today` covers every tenant (it covers the
    /// shown rows only when there are more tenants than rows).
    pub region_units_complete: bool,
    /// Every period held (hour, day, week, month tiers), with its counter
    /// count and units: kept by the state as deltas merge, so listing them
    /// walks no counter. The tenant rows above are the day's.
    pub periods: Vec<PeriodRow>,
}

/// One period held: its counters on this instance and their units.
#[derive(Debug, Clone)]
pub struct PeriodRow {
    pub period: Period,
    pub counters: usize,
    pub units: u64,
}

#[derive(Debug, Clone)]
pub struct TenantRow {
    pub tenant: String,
    pub plan: Option<String>,
    pub total: u64,
    pub limit: Option<u64>,
    /// Net units per region.
    pub regions: BTreeMap<String, u64>,
}

impl TenantRow {
    pub fn over_limit(&self) -> bool {
        self.limit.is_some_and(|l| self.total >= l)
    }

    /// Share of the daily limit used, when there is a limit.
    fn used(&self) -> Option<f64> {
        self.limit.map(|l| self.total as f64 / l.max(1) as f64)
    }
}

#[derive(Debug, Clone)]
pub struct RegionRow {
    pub region: String,
    pub configured: bool,
    pub expected_nodes: Option<u32>,
    /// Wall clock (ms) of the newest delta seen from the region.
    pub last_delta_ms: Option<u64>,
    /// Net units today, over the tenants of [`Snapshot::tenants`].
    pub units_today: u64,
}

#[derive(Debug, Default, serde::Deserialize)]
pub struct Params {
    refresh: Option<u32>,
    top: Option<usize>,
}

/// `GET /`.
pub async fn page(AxumState(state): AxumState<Arc<State>>, Query(p): Query<Params>) -> Response {
    let snap = snapshot(&state, p.top.unwrap_or(DEFAULT_TOP).clamp(1, MAX_TOP));
    let html = render(&snap, p.refresh.unwrap_or(DEFAULT_REFRESH));
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        html,
    )
        .into_response()
}

/// Display order: over limit first, then by share of the limit used
/// (unlimited tenants last), then by total, then by name.
fn display_order(a: &TenantRow, b: &TenantRow) -> std::cmp::Ordering {
    b.over_limit()
        .cmp(&a.over_limit())
        .then(
            b.used()
                .unwrap_or(-1.0)
                .partial_cmp(&a.used().unwrap_or(-1.0))
                .unwrap_or(std::cmp::Ordering::Equal),
        )
        .then(b.total.cmp(&a.total))
        .then(a.tenant.cmp(&b.tenant))
}

/// Up to this many counters today, the page considers every tenant for its
/// rows; beyond, only the visible ones (at or past the broadcast threshold
/// of their limit, every over-limit tenant among them), so that a page
/// never copies a million counters under the state lock.
const LIST_ALL_UP_TO: usize = 10_000;

/// Reads the state and the live configuration for a page of at most `top`
/// tenant rows.
///
/// The state lock is shared with the consumer, so it is held twice, briefly:
/// once to copy (tenant, total) of the candidate rows, once to read the
/// per-region parts of the rows shown. Limits, sorting and selection happen
/// in between, outside the lock. The counts and units of the day are kept by
/// the state as deltas merge; the candidates are every tenant up to
/// [`LIST_ALL_UP_TO`], the visible ones beyond.
pub fn snapshot(state: &State, top: usize) -> Snapshot {
    let today = day::today();
    let config = state.live().load();
    let (totals, tenant_count, units, not_ready, owned, lag, periods) = {
        let core = state.lock();
        let day = core.merged.on(Period::day(today));
        let (tenant_count, units) = day.map_or((0, 0), |d| (d.len(), d.units()));
        let row = |(t, c): (&str, &Counter)| (t.to_owned(), c.total(), c.carried());
        let totals: Vec<(String, u64, Option<Carried>)> = match day {
            Some(d) if d.len() <= LIST_ALL_UP_TO => d.counters().map(row).collect(),
            Some(d) => d.visible().map(row).collect(),
            None => Vec::new(),
        };
        let periods: Vec<PeriodRow> = core
            .merged
            .periods()
            .map(|(period, g)| PeriodRow {
                period,
                counters: g.len(),
                units: g.units(),
            })
            .collect();
        let not_ready = match core.progress.readiness() {
            Readiness::Ready => None,
            Readiness::NotReady(why) => Some(why),
        };
        let lag: i64 = core.progress.partitions().filter_map(|p| p.lag()).sum();
        (
            totals,
            tenant_count,
            units,
            not_ready,
            core.progress.assigned_partitions(),
            lag,
            periods,
        )
    };
    let mut tenants: Vec<TenantRow> = totals
        .into_iter()
        .map(|(tenant, total, carried)| {
            let policy = config.policy(&tenant);
            TenantRow {
                plan: policy.as_ref().map(|p| p.plan.clone()),
                // The limit the nodes enforce (carried by the deltas), else
                // the configuration's.
                limit: Carried::or_config(carried, || policy.and_then(|p| p.global)).limit,
                tenant,
                total,
                regions: BTreeMap::new(),
            }
        })
        .collect();
    let listed_all = tenants.len() == tenant_count;
    let over_count = tenants.iter().filter(|t| t.over_limit()).count();
    let top = top.max(1);
    if tenants.len() > top {
        tenants.select_nth_unstable_by(top - 1, display_order);
        tenants.truncate(top);
    }
    tenants.sort_by(display_order);
    {
        let core = state.lock();
        for t in &mut tenants {
            if let Some(c) = core.merged.snapshot(&t.tenant, Period::day(today)) {
                t.regions = c.regions();
            }
        }
    }

    // Newest delta per region, from the gauge the consumer maintains
    // (collected, so that reading does not create label series).
    let mut last: HashMap<String, u64> = HashMap::new();
    for family in state.metrics.region_last_delta.collect() {
        for m in family.get_metric() {
            let region = m
                .get_label()
                .iter()
                .find(|l| l.name() == "region")
                .map(|l| l.value().to_owned());
            if let Some(region) = region {
                let secs = m.get_gauge().get_value();
                if secs > 0.0 {
                    last.insert(region, (secs * 1000.0) as u64);
                }
            }
        }
    }
    let mut region_units: HashMap<&str, u64> = HashMap::new();
    for t in &tenants {
        for (r, n) in &t.regions {
            *region_units.entry(r.as_str()).or_default() += n;
        }
    }
    let mut regions: Vec<RegionRow> = config
        .config
        .regions
        .iter()
        .map(|(name, rc)| RegionRow {
            region: name.clone(),
            configured: true,
            expected_nodes: Some(rc.expected_nodes),
            last_delta_ms: last.get(name).copied(),
            units_today: region_units.get(name.as_str()).copied().unwrap_or(0),
        })
        .collect();
    let mut others: Vec<&str> = region_units
        .keys()
        .copied()
        .filter(|r| !config.config.regions.contains_key(*r))
        .collect();
    others.sort_unstable();
    for r in others {
        regions.push(RegionRow {
            region: r.to_owned(),
            configured: false,
            expected_nodes: None,
            last_delta_ms: last.get("unknown").copied(),
            units_today: region_units[r],
        });
    }
    Snapshot {
        cluster: config.config.cluster.clone(),
        day: today,
        now_ms: now_ms(),
        not_ready,
        partitions_owned: owned,
        partitions_total: state.kafka().partitions,
        consumer_lag: lag,
        region_units_complete: listed_all && tenants.len() == tenant_count,
        tenant_count,
        units,
        over_count,
        tenants,
        regions,
        periods,
    }
}

/// HTML-escapes text and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `1234567` → `1,234,567`.
fn num(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `HH:MM:SS` (UTC) of a wall-clock instant in ms.
fn clock(ms: u64) -> String {
    let s = (ms / 1000) % day::SECS_PER_DAY;
    format!("{:02}:{:02}:{:02}", s / 3600, s % 3600 / 60, s % 60)
}

/// A short human duration: `0.4 s`, `12 s`, `3 min`, `2 h`.
fn ago(ms: u64) -> String {
    match ms {
        0..=9_999 => format!("{:.1} s", ms as f64 / 1000.0),
        10_000..=119_999 => format!("{} s", ms / 1000),
        120_000..=7_199_999 => format!("{} min", ms / 60_000),
        _ => format!("{} h", ms / 3_600_000),
    }
}

fn pct(x: f64) -> String {
    format!("{:.2}%", (x * 100.0).clamp(0.0, 100.0))
}

const CSS: &str = r#"
:root { --fg:#1d2330; --muted:#667085; --line:#e4e7ec; --bg:#f7f8fa; --card:#fff;
        --ok:#2e7d32; --warn:#b26a00; --bad:#c62828; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
       color:var(--fg); background:var(--bg); }
header { background:#1d2330; color:#fff; padding:14px 28px; display:flex; align-items:baseline; gap:18px; flex-wrap:wrap; }
header h1 { font-size:18px; margin:0; font-weight:600; }
header .meta { color:#c9ced8; font-size:13px; }
header .status { margin-left:auto; font-size:13px; padding:2px 10px; border-radius:10px; }
.status.ready { background:#2e7d32; } .status.not-ready { background:#b26a00; }
main { padding:20px 28px 32px; max-width:1280px; }
section { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:16px 20px; margin-bottom:18px; }
h2 { font-size:15px; margin:0 0 10px; }
.cards { display:flex; gap:14px; margin-bottom:18px; flex-wrap:wrap; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 16px; min-width:150px; }
.card .v { font-size:22px; font-weight:600; font-variant-numeric:tabular-nums; }
.card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.card.alert .v { color:var(--bad); }
table { border-collapse:collapse; width:100%; }
th { text-align:left; color:var(--muted); font-weight:500; font-size:12px; text-transform:uppercase;
     letter-spacing:.04em; border-bottom:1px solid var(--line); padding:6px 8px; }
td { border-bottom:1px solid var(--line); padding:7px 8px; vertical-align:middle; }
td.n, th.n { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
tr.over td.tenant { color:var(--bad); font-weight:600; }
.bar { position:relative; height:14px; background:#eef0f3; border-radius:3px; overflow:hidden; min-width:260px; display:flex; }
.seg { height:100%; display:block; }
.limit-mark { position:absolute; top:-2px; bottom:-2px; width:2px; background:var(--fg); }
.badge { display:inline-block; font-size:11px; font-weight:600; padding:1px 8px; border-radius:9px; margin-left:6px; vertical-align:1px; }
.badge.over-limit { background:#fdecea; color:var(--bad); border:1px solid #f5c2bd; }
.badge.unlimited { background:#eef0f3; color:var(--muted); }
.parts { color:var(--muted); font-size:12px; margin-top:3px; white-space:nowrap; }
.parts .swatch { width:8px; height:8px; margin-right:3px; }
.legend { display:flex; gap:14px; flex-wrap:wrap; color:var(--muted); font-size:12px; margin:0 0 10px; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:5px; vertical-align:-1px; }
.fresh { color:var(--ok); } .quiet { color:var(--warn); } .silent { color:var(--bad); }
.muted { color:var(--muted); }
ul.over { margin:0; padding-left:18px; } ul.over li { margin:2px 0; }
footer { color:var(--muted); font-size:12px; padding:0 28px 24px; }
footer a { color:var(--muted); }
"#;

/// Renders the page. Pure, so it is tested without a server.
pub fn render(s: &Snapshot, refresh: u32) -> String {
    let colour: HashMap<&str, &str> = s
        .regions
        .iter()
        .filter(|r| r.configured)
        .enumerate()
        .map(|(i, r)| (r.region.as_str(), PALETTE[i % PALETTE.len()]))
        .collect();
    let colour_of = |r: &str| colour.get(r).copied().unwrap_or(UNKNOWN_COLOUR);
    let date = day::to_iso(s.day);

    let rows = &s.tenants;
    let over: Vec<&TenantRow> = rows.iter().filter(|t| t.over_limit()).collect();

    let mut h = String::with_capacity(8192 + 700 * rows.len());
    h.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    if refresh > 0 {
        let _ = write!(h, "<meta http-equiv=\"refresh\" content=\"{refresh}\">");
    }
    let _ = write!(
        h,
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>tierlimit · {} · {}</title><style>{CSS}</style></head><body>",
        esc(&s.cluster),
        date
    );

    // Header.
    let _ = write!(
        h,
        "<header><h1>tierlimit aggregator</h1><span class=\"meta\">cluster <b>{}</b> · {} (UTC day) · \
         at {} UTC</span>",
        esc(&s.cluster),
        date,
        clock(s.now_ms)
    );
    match &s.not_ready {
        None => h.push_str("<span class=\"status ready\" id=\"status\">ready</span>"),
        Some(why) => {
            let _ = write!(
                h,
                "<span class=\"status not-ready\" id=\"status\" title=\"{}\">not ready: {}</span>",
                esc(why),
                esc(why)
            );
        }
    }
    h.push_str("</header><main>");

    // Summary cards.
    let _ = write!(
        h,
        "<div class=\"cards\">\
         <div class=\"card\"><div class=\"v\" id=\"tenant-count\">{}</div><div class=\"k\">tenants today</div></div>\
         <div class=\"card\"><div class=\"v\" id=\"units-today\">{}</div><div class=\"k\">units today</div></div>\
         <div class=\"card{}\"><div class=\"v\" id=\"over-limit-count\">{}</div><div class=\"k\">over their daily limit</div></div>\
         <div class=\"card\"><div class=\"v\">{} / {}</div><div class=\"k\">partitions owned</div></div>\
         <div class=\"card\"><div class=\"v\" id=\"consumer-lag\">{}</div><div class=\"k\">consumer lag (messages)</div></div>\
         </div>",
        num(s.tenant_count as u64),
        num(s.units),
        if s.over_count == 0 { "" } else { " alert" },
        s.over_count,
        s.partitions_owned.len(),
        s.partitions_total,
        num(s.consumer_lag.max(0) as u64),
    );

    // Over-limit tenants.
    h.push_str("<section id=\"over-limit\"><h2>Over the daily limit</h2>");
    if over.is_empty() {
        h.push_str("<p class=\"muted\">No tenant has reached its daily limit today.</p>");
    } else {
        h.push_str(
            "<p class=\"muted\">Every region denies these tenants from its broadcast view until \
             the UTC day ends.</p><ul class=\"over\">",
        );
        for t in &over {
            let limit = t.limit.unwrap_or(0);
            let _ = write!(
                h,
                "<li data-tenant=\"{}\"><b>{}</b>: {} of {} ({} over)</li>",
                esc(&t.tenant),
                esc(&t.tenant),
                num(t.total),
                num(limit),
                num(t.total.saturating_sub(limit))
            );
        }
        if s.over_count > over.len() {
            let _ = write!(
                h,
                "<li class=\"muted\">and {} more</li>",
                num((s.over_count - over.len()) as u64)
            );
        }
        h.push_str("</ul>");
    }
    h.push_str("</section>");

    // Usage per tenant.
    h.push_str("<section id=\"usage\"><h2>Usage today per tenant</h2><div class=\"legend\">");
    for r in &s.regions {
        let _ = write!(
            h,
            "<span><span class=\"swatch\" style=\"background:{}\"></span>{}</span>",
            colour_of(&r.region),
            esc(&r.region)
        );
    }
    h.push_str(
        "<span><span class=\"swatch\" style=\"background:#1d2330;width:2px\"></span>daily limit</span></div>",
    );
    if rows.is_empty() {
        h.push_str("<p class=\"muted\" id=\"no-tenants\">No traffic today on the partitions this instance owns.</p>");
    } else {
        h.push_str(
            "<table id=\"tenants\"><thead><tr><th>tenant</th><th>plan</th><th class=\"n\">global total</th>\
             <th class=\"n\">daily limit</th><th class=\"n\">used</th><th>per region</th></tr></thead><tbody>",
        );
        for t in rows {
            let over = t.over_limit();
            let scale = t.limit.unwrap_or(t.total).max(t.total).max(1) as f64;
            let _ = write!(
                h,
                "<tr class=\"tenant{}\" data-tenant=\"{}\" data-total=\"{}\" data-limit=\"{}\">\
                 <td class=\"tenant\">{}{}</td><td class=\"plan\">{}</td><td class=\"n total\">{}</td>\
                 <td class=\"n limit\">{}</td><td class=\"n used\">{}</td><td>",
                if over { " over" } else { "" },
                esc(&t.tenant),
                t.total,
                t.limit.map(|l| l.to_string()).unwrap_or_default(),
                esc(&t.tenant),
                if over {
                    "<span class=\"badge over-limit\">over limit</span>"
                } else {
                    ""
                },
                t.plan.as_deref().map(esc).unwrap_or_else(|| "—".into()),
                num(t.total),
                t.limit.map(num).unwrap_or_else(|| "none".into()),
                t.used()
                    .map(|u| format!("{:.1}%", u * 100.0))
                    .unwrap_or_else(|| "—".into()),
            );
            let title: Vec<String> = t
                .regions
                .iter()
                .map(|(r, n)| format!("{r}: {}", num(*n)))
                .collect();
            let _ = write!(
                h,
                "<div class=\"bar\" title=\"{}\">",
                esc(&title.join(", "))
            );
            for (r, n) in &t.regions {
                if *n == 0 {
                    continue;
                }
                let _ = write!(
                    h,
                    "<span class=\"seg\" data-region=\"{}\" data-units=\"{n}\" style=\"width:{};background:{}\" \
                     title=\"{}: {}\"></span>",
                    esc(r),
                    pct(*n as f64 / scale),
                    colour_of(r),
                    esc(r),
                    num(*n)
                );
            }
            if let Some(l) = t.limit {
                let _ = write!(
                    h,
                    "<span class=\"limit-mark\" style=\"left:calc({} - 1px)\"></span>",
                    pct(l as f64 / scale)
                );
            }
            h.push_str("</div><div class=\"parts\">");
            for (i, (r, n)) in t.regions.iter().enumerate() {
                if i > 0 {
                    h.push_str(" · ");
                }
                let _ = write!(
                    h,
                    "<span class=\"part\" data-region=\"{}\"><span class=\"swatch\" style=\"background:{}\"></span>{} {}</span>",
                    esc(r),
                    colour_of(r),
                    esc(r),
                    num(*n)
                );
            }
            h.push_str("</div></td></tr>");
        }
        h.push_str("</tbody></table>");
        if s.tenant_count > rows.len() {
            let _ = write!(
                h,
                "<p class=\"muted\" id=\"truncated\">Showing {} of {} tenants (over limit and most used first; \
                 <code>?top=N</code> shows more).</p>",
                rows.len(),
                s.tenant_count
            );
        }
    }
    h.push_str("</section>");

    // Regions.
    let _ = write!(
        h,
        "<section id=\"regions-section\"><h2>Regions</h2><table id=\"regions\"><thead><tr><th>region</th>\
         <th class=\"n\">expected nodes</th><th class=\"n\">units today{}</th><th>newest delta</th>\
         <th>delta lag</th></tr></thead><tbody>",
        if s.region_units_complete {
            ""
        } else {
            " (tenants shown)"
        }
    );
    for r in &s.regions {
        let (seen, lag) = match r.last_delta_ms {
            Some(ms) => {
                let age = s.now_ms.saturating_sub(ms);
                let class = match age {
                    0..=4_999 => "fresh",
                    5_000..=299_999 => "quiet",
                    _ => "silent",
                };
                (
                    format!("{} UTC", clock(ms)),
                    format!("<span class=\"{class}\">{} ago</span>", ago(age)),
                )
            }
            None => (
                "<span class=\"muted\">never</span>".to_string(),
                "<span class=\"silent\">no delta yet</span>".to_string(),
            ),
        };
        let _ = write!(
            h,
            "<tr class=\"region\" data-region=\"{}\" data-last-delta-ms=\"{}\">\
             <td><span class=\"swatch\" style=\"background:{}\"></span>{}{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td>{seen}</td><td>{lag}</td></tr>",
            esc(&r.region),
            r.last_delta_ms.map(|v| v.to_string()).unwrap_or_default(),
            colour_of(&r.region),
            esc(&r.region),
            if r.configured {
                ""
            } else {
                " <span class=\"muted\">(not configured)</span>"
            },
            r.expected_nodes
                .map(|n| n.to_string())
                .unwrap_or_else(|| "—".into()),
            num(r.units_today),
        );
    }
    h.push_str(
        "</tbody></table><p class=\"muted\">A region publishes a delta only when its counts change, \
         so while it has traffic the age of its newest delta is its lag; an idle region's age grows \
         with nothing wrong.</p></section>",
    );

    // Periods held: one line per period of every tier kind.
    h.push_str("<section id=\"periods-section\"><h2>Counters per period</h2>");
    if s.periods.is_empty() {
        h.push_str("<p class=\"muted\">No counter held.</p>");
    } else {
        h.push_str(
            "<table id=\"periods\"><thead><tr><th>tier</th><th>period (UTC)</th>\
             <th class=\"n\">counters</th><th class=\"n\">units</th></tr></thead><tbody>",
        );
        for p in &s.periods {
            let _ = write!(
                h,
                "<tr class=\"period\" data-period=\"{}\"><td>{}</td><td>{}</td>\
                 <td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
                esc(&p.period.label()),
                p.period.kind,
                esc(&p.period.human()),
                num(p.counters as u64),
                num(p.units),
            );
        }
        h.push_str("</tbody></table>");
    }
    h.push_str("</section>");

    let owned: Vec<String> = s.partitions_owned.iter().map(|p| p.to_string()).collect();
    let _ = writeln!(
        h,
        "</main><footer>This instance owns deltas partitions [{}] of {}; with several aggregators, \
         each page shows its own tenants. JSON: <a href=\"/v1/over-limit\">/v1/over-limit</a>, \
         <code>/v1/global/&lt;tenant&gt;</code> · <a href=\"/metrics\">/metrics</a> · \
         <a href=\"/readyz\">/readyz</a>{}</footer></body></html>",
        owned.join(", "),
        s.partitions_total,
        if refresh > 0 {
            format!(" · refreshes every {refresh} s (<code>?refresh=0</code> stops)")
        } else {
            String::new()
        }
    );
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierlimit_shared::messages::{actor, partition_of, Delta};

    use crate::state::tests::state;

    fn tenant(t: &str, total: u64, limit: Option<u64>, regions: &[(&str, u64)]) -> TenantRow {
        TenantRow {
            tenant: t.into(),
            plan: Some("p".into()),
            total,
            limit,
            regions: regions.iter().map(|(r, n)| (r.to_string(), *n)).collect(),
        }
    }

    fn snap(mut tenants: Vec<TenantRow>) -> Snapshot {
        tenants.sort_by(display_order);
        Snapshot {
            cluster: "c<1>".into(),
            day: 20_000,
            now_ms: 20_000 * 86_400_000 + 3_600_000,
            not_ready: None,
            partitions_owned: vec![0, 1],
            partitions_total: 2,
            consumer_lag: 0,
            tenant_count: tenants.len(),
            units: tenants.iter().map(|t| t.total).sum(),
            over_count: tenants.iter().filter(|t| t.over_limit()).count(),
            region_units_complete: true,
            periods: vec![PeriodRow {
                period: Period::day(20_000),
                counters: 2,
                units: 70,
            }],
            tenants,
            regions: vec![
                RegionRow {
                    region: "eu".into(),
                    configured: true,
                    expected_nodes: Some(2),
                    last_delta_ms: Some(20_000 * 86_400_000 + 3_599_600),
                    units_today: 70,
                },
                RegionRow {
                    region: "us".into(),
                    configured: true,
                    expected_nodes: Some(1),
                    last_delta_ms: None,
                    units_today: 0,
                },
            ],
        }
    }

    #[test]
    fn renders_rows_over_limit_first_and_escapes() {
        let html = render(
            &snap(vec![
                tenant("small", 10, Some(100), &[("eu", 10)]),
                tenant("hot", 120, Some(100), &[("eu", 60), ("us", 60)]),
                tenant("free", 5, None, &[("eu", 5)]),
            ]),
            5,
        );
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<meta http-equiv=\"refresh\" content=\"5\">"));
        assert!(html.contains("cluster <b>c&lt;1&gt;</b>"));
        // The periods held, each tier's on a line.
        assert!(html.contains(
            "<tr class=\"period\" data-period=\"20000\"><td>day</td><td>2024-10-04</td>"
        ));
        let hot = html.find("data-tenant=\"hot\" data-total=\"120\"").unwrap();
        let small = html.find("data-tenant=\"small\"").unwrap();
        let free = html.find("data-tenant=\"free\"").unwrap();
        assert!(
            hot < small && small < free,
            "over-limit first, unlimited last"
        );
        assert!(html.contains("<tr class=\"tenant over\" data-tenant=\"hot\""));
        assert_eq!(html.matches("badge over-limit").count(), 1);
        assert!(html.contains("<li data-tenant=\"hot\"><b>hot</b>: 120 of 100 (20 over)</li>"));
        assert!(html.contains("id=\"over-limit-count\">1<"));
        // Bars: two segments of 50% each, limit marker at 100/120.
        assert!(html.contains("data-region=\"us\" data-units=\"60\" style=\"width:50.00%"));
        assert!(html.contains("left:calc(83.33% - 1px)"));
        assert!(html.contains("data-region=\"eu\" data-last-delta-ms=\""));
        assert!(html.contains("0.4 s ago"));
        assert!(html.contains("no delta yet"));
        assert!(!html.contains("<script"));
    }

    #[test]
    fn empty_and_truncated() {
        let html = render(&snap(vec![]), 0);
        assert!(!html.contains("http-equiv=\"refresh\""));
        assert!(html.contains("id=\"no-tenants\""));
        let mut s = snap(vec![
            tenant("a", 200, Some(100), &[("eu", 200)]),
            tenant("b", 150, Some(100), &[("eu", 150)]),
        ]);
        s.tenant_count = 30;
        s.over_count = 5;
        s.region_units_complete = false;
        let html = render(&s, 5);
        assert_eq!(html.matches("<tr class=\"tenant").count(), 2);
        assert!(html.contains("Showing 2 of 30 tenants"));
        assert!(html.contains("<li class=\"muted\">and 3 more</li>"));
        assert!(html.contains("units today (tenants shown)"));
        assert!(html.contains("id=\"over-limit-count\">5<"));
    }

    #[test]
    fn formatting() {
        assert_eq!(num(0), "0");
        assert_eq!(num(1234567), "1,234,567");
        assert_eq!(num(100), "100");
        assert_eq!(clock(3_723_000), "01:02:03");
        assert_eq!(ago(400), "0.4 s");
        assert_eq!(ago(65_000), "65 s");
        assert_eq!(ago(600_000), "10 min");
        assert_eq!(
            esc("<a href='x'>&\""),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;"
        );
    }

    #[test]
    fn snapshot_reads_the_state() {
        let s = state();
        let g = s.on_assign(&[0, 1, 2, 3]);
        for p in 0..4 {
            s.on_watermarks(p, g, 0, 0);
        }
        let today = day::today();
        let d =
            |t: &str, r: &str, p: u64, n: u64| Delta::new(t, today, actor(r, "e"), p, n, now_ms());
        s.on_delta(partition_of("acme", 4), 0, &d("acme", "eu", 70, 5));
        s.on_delta(partition_of("acme", 4), 1, &d("acme", "us", 40, 0));
        for (i, t) in ["t1", "t2", "t3"].iter().enumerate() {
            s.on_delta(
                partition_of(t, 4),
                10 + i as i64,
                &d(t, "eu", 10 * (i as u64 + 1), 0),
            );
        }
        let snap = snapshot(&s, 10);
        assert_eq!(snap.not_ready, None);
        assert_eq!(
            (snap.tenant_count, snap.units, snap.over_count),
            (4, 165, 1)
        );
        assert!(snap.region_units_complete);
        let t = &snap.tenants[0];
        assert_eq!(t.tenant, "acme", "over limit first");
        assert_eq!((t.total, t.limit, t.over_limit()), (105, Some(100), true));
        assert_eq!(t.plan.as_deref(), Some("small"));
        assert_eq!(t.regions.get("us"), Some(&40));
        let order: Vec<&str> = snap.tenants.iter().map(|t| t.tenant.as_str()).collect();
        assert_eq!(order, ["acme", "t3", "t2", "t1"]);
        assert_eq!(snap.regions.len(), 2);
        assert_eq!(snap.regions[0].units_today, 125);
        assert!(snap.regions[0].last_delta_ms.is_some());
        let html = render(&snap, 5);
        assert!(html.contains("data-tenant=\"acme\" data-total=\"105\" data-limit=\"100\""));

        // Only the top rows are kept, the most used first.
        let snap = snapshot(&s, 2);
        assert_eq!(
            (snap.tenant_count, snap.units, snap.over_count),
            (4, 165, 1)
        );
        let order: Vec<&str> = snap.tenants.iter().map(|t| t.tenant.as_str()).collect();
        assert_eq!(order, ["acme", "t3"]);
        assert!(snap.tenants.iter().all(|t| !t.regions.is_empty()));
        assert!(!snap.region_units_complete);
        assert_eq!(snap.regions[0].units_today, 95);
    }
}
