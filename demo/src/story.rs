//! The story the demo tells, one function per phase (see the crate docs):
//! steady, region limit, global limit, cut, converge. Each phase drives
//! client traffic ([`traffic`]) against the [`World`] and returns what it
//! measured; [`tell`] gathers it into an [`Outcome`] for the report.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::report::{self, say, Progress};
use crate::traffic::{self, Cell, Stream, Tally};
use crate::world::World;

pub const REGIONS: [&str; 3] = ["eu-west", "us-east", "ap-south"];
pub const STEADY: [&str; 3] = ["acme", "globex", "initech"];
pub const BURSTY: &str = "bursty";
pub const HOT: &str = "hot";
pub const TENANTS: [&str; 5] = ["acme", "globex", "initech", BURSTY, HOT];
pub const BURST_REGION: &str = "eu-west";
pub const CUT_REGION: &str = "ap-south";
/// The region whose clients go through a real Envoy (its ratelimit filter
/// asks the region's nodes over gRPC); the others call region-node's HTTP
/// API.
pub const ENVOY_REGION: &str = "us-east";

pub const BURSTY_REGION_LIMIT: u64 = 300;
pub const HOT_DAILY_LIMIT: u64 = 2500;

/// Requests per second of each steady tenant in each region.
const STEADY_RATE: f64 = 10.0;
/// bursty's flood in eu-west, and its normal traffic in us-east.
const BURST_RATE: f64 = 120.0;
const BURSTY_NORMAL_RATE: f64 = 5.0;
/// hot's push in each region, and its probing rate once denied.
pub const HOT_RATE: f64 = 80.0;
const HOT_PROBE_RATE: f64 = 5.0;

const PHASE_STEADY: Duration = Duration::from_secs(8);
const PHASE_BURST: Duration = Duration::from_secs(8);
const DENY_DEADLINE: Duration = Duration::from_secs(60);
pub const CONVERGE_DEADLINE: Duration = Duration::from_secs(60);
const UPGRADE_DEADLINE: Duration = Duration::from_secs(15);

/// What the story measured, for the report.
pub struct Outcome {
    pub tally: Arc<Tally>,
    /// bursty in eu-west right after its flood.
    pub bursty_eu: Cell,
    pub global: GlobalLimit,
    pub upgrade: Upgrade,
    pub cut: Cut,
    pub converge: Converge,
    /// Σ over the region-nodes, at the end.
    pub fail_mode: f64,
    pub deltas_failed: f64,
    pub envoy: ThroughEnvoy,
    pub periods: Periods,
}

/// globex (on Berlin's calendar) by period, from the aggregator's usage
/// API once the story is over.
pub struct Periods {
    /// The hour the regions' Redis clocks crossed early in the story
    /// (`World::hour_end_ms`), if they did.
    pub hour_end_ms: Option<i64>,
    /// globex's hours, oldest first: (name, total, closed, end ms).
    pub hours: Vec<(String, u64, bool, i64)>,
    /// globex's Berlin day and acme's UTC day: (name, local start, total).
    pub berlin_day: Option<(String, String, u64)>,
    pub utc_day: Option<(String, String, u64)>,
}

impl Periods {
    /// The hour that ended in the story is closed, and globex's hours add
    /// up to its exact count (`want`); true when no hour ended.
    pub fn exact(&self, want: u64) -> bool {
        let Some(end) = self.hour_end_ms else {
            return true;
        };
        let ended = self.hours.iter().find(|h| h.3 == end);
        ended.is_some_and(|h| h.2) && self.hours.iter().map(|h| h.1).sum::<u64>() == want
    }
}

/// initech's move to another plan through the limits API.
pub struct Upgrade {
    /// The record's version (0: the API refused).
    pub version: u64,
    /// From the request to its answer (the record written and applied by
    /// the aggregator).
    pub written: Option<Duration>,
    /// From the request until every region-node reported the version.
    pub everywhere: Option<Duration>,
    pub nodes: usize,
}

/// [`ENVOY_REGION`]'s traffic, which went through Envoy.
pub struct ThroughEnvoy {
    /// Checks its clients sent through Envoy (allowed, denied, errors).
    pub sent: u64,
    /// `ShouldRateLimit` calls its region-nodes answered
    /// (`tierlimit_rls_requests_total`).
    pub rls_calls: f64,
    /// Its clients' allowed − refunded, every tenant.
    pub want: u64,
    /// The aggregator's part of the region, every tenant, once converged.
    pub seen: Option<u64>,
}

impl ThroughEnvoy {
    /// Every check went through the RLS, and the region's part of the
    /// global count is exactly what its clients kept.
    pub fn counted(&self) -> bool {
        self.sent > 0 && self.rls_calls == self.sent as f64 && self.seen == Some(self.want)
    }
}

pub struct GlobalLimit {
    /// Every region denied hot from its broadcast view in time.
    pub all_deny: bool,
    /// From the first global denial to the last region denying from the view.
    pub crossing_spread: Option<Duration>,
}

pub struct Cut {
    /// From the cut to the heal.
    pub cut_for: Duration,
    /// What the cut region's clients saw during the cut.
    pub during_cut: Cell,
    /// The aggregator heard nothing from the cut region while it was cut.
    pub frozen: bool,
    /// The aggregator's cut-region part of acme before the cut and at the heal.
    pub acme_before: Option<u64>,
    pub acme_frozen_to: Option<u64>,
    healed_at: Instant,
    /// The newest delta from the cut region at the heal.
    frozen_to: Option<f64>,
}

pub struct Converge {
    /// Per tenant: the clients' allowed − refunded.
    pub want: BTreeMap<&'static str, u64>,
    /// Per tenant: Σ P − N over the regions' Redis.
    pub truth: BTreeMap<&'static str, u64>,
    /// Per tenant: the aggregator's total when the wait ended.
    pub seen: BTreeMap<&'static str, Option<u64>>,
    /// Per steady tenant (plan `standard`, with a month tier): the
    /// aggregator's month name and total when the wait ended.
    pub month: BTreeMap<&'static str, Option<(String, u64)>>,
    /// Heal → every tenant exact, if it happened in time.
    pub converged: Option<Duration>,
    /// Heal → the first delta of the cut region at the aggregator.
    pub first_delta_after_heal: Option<Duration>,
}

impl Converge {
    /// Aggregator = clients' allowed − refunded = Redis truth for `tenant`.
    pub fn exact(&self, tenant: &str) -> bool {
        self.seen[tenant] == Some(self.want[tenant]) && self.truth[tenant] == self.want[tenant]
    }
}

/// Tells the whole story against `w`, cutting [`CUT_REGION`] off for `cut`.
pub async fn tell(w: &Arc<World>, cut: Duration) -> anyhow::Result<Outcome> {
    let day = tierlimit_shared::day::today();
    let tally = Arc::new(Tally::default());
    let progress = Arc::new(Progress::new("steady"));
    let printer = report::spawn_progress(Arc::clone(w), Arc::clone(&tally), Arc::clone(&progress));
    let mut s = Story {
        w,
        tally,
        progress,
        streams: Vec::new(),
    };
    s.steady().await;
    let bursty_eu = s.region_limit().await;
    let upgrade = s.upgrade().await;
    let global = s.global_limit().await;
    let cut = s.cut(cut).await;
    let converge = s.converge(&cut, day).await?;
    let periods = s.periods(converge.want["globex"]).await;
    printer.abort();
    match converge.converged {
        Some(d) => say(format!(
            "global count exact for every tenant {:.2} s after the heal",
            d.as_secs_f64()
        )),
        None => say(format!(
            "global count NOT exact {CONVERGE_DEADLINE:?} after the heal"
        )),
    }
    if tierlimit_shared::day::today() != day {
        bail!("the demo crossed midnight UTC, where daily counters start again: run it once more");
    }

    // Node metrics: decisions taken without Redis, deltas Kafka refused,
    // and the Envoy region's gRPC calls.
    let mut fail_mode = 0.0;
    let mut deltas_failed = 0.0;
    let mut rls_calls = 0.0;
    for r in &w.regions {
        for n in &r.nodes {
            let text = w.metrics_text(n).await;
            fail_mode += testkit::metric_value(&text, "tierlimit_fail_mode_decisions_total");
            deltas_failed += testkit::metric_value(&text, "tierlimit_deltas_failed_total");
            if r.name == ENVOY_REGION {
                rls_calls += testkit::metric_value(&text, "tierlimit_rls_requests_total");
            }
        }
    }
    let through = s.tally.totals(None, Some(ENVOY_REGION));
    let mut seen = Some(0);
    for t in TENANTS {
        let part = w.agg_part(t, ENVOY_REGION).await;
        seen = seen.zip(part).map(|(a, b)| a + b);
    }
    let envoy = ThroughEnvoy {
        sent: through.allowed + through.denied() + through.errors,
        rls_calls,
        want: through.allowed - through.refunded,
        seen,
    };
    Ok(Outcome {
        tally: s.tally,
        bursty_eu,
        global,
        upgrade,
        cut,
        converge,
        fail_mode,
        deltas_failed,
        envoy,
        periods,
    })
}

/// The story so far: the world, what the clients saw, the streams running.
struct Story<'a> {
    w: &'a Arc<World>,
    tally: Arc<Tally>,
    progress: Arc<Progress>,
    streams: Vec<Stream>,
}

impl Story<'_> {
    fn start_stream(&self, tenant: &str, region: &str, rate: f64, refund: Option<u64>) -> Stream {
        let r = self.w.region(region);
        traffic::start(
            &self.w.http,
            &self.tally,
            tenant,
            region,
            &r.vias(),
            &r.nodes,
            rate,
            refund,
        )
    }

    /// Phase 1, steady: multi-tenant traffic everywhere.
    async fn steady(&mut self) {
        self.progress.set_phase(
            "steady",
            &format!(
                "steady traffic: acme, globex, initech at {STEADY_RATE} req/s in each region \
                 (acme refunds 1 unit in 10); bursty at {BURSTY_NORMAL_RATE} req/s in us-east"
            ),
        );
        for t in STEADY {
            for r in REGIONS {
                let refund = (t == "acme").then_some(10);
                self.streams
                    .push(self.start_stream(t, r, STEADY_RATE, refund));
            }
        }
        self.streams
            .push(self.start_stream(BURSTY, "us-east", BURSTY_NORMAL_RATE, None));
        tokio::time::sleep(PHASE_STEADY).await;
    }

    /// Phase 2, region limit: one tenant over it in one region.
    async fn region_limit(&mut self) -> Cell {
        self.progress.set_phase(
            "region limit",
            &format!(
                "bursty floods {BURST_REGION} at {BURST_RATE} req/s for {}s; its region limit is \
                 {BURSTY_REGION_LIMIT}/min (sliding log, exact)",
                PHASE_BURST.as_secs()
            ),
        );
        let burst = self.start_stream(BURSTY, BURST_REGION, BURST_RATE, None);
        tokio::time::sleep(PHASE_BURST).await;
        burst.stop().await;
        let bursty_eu = self.tally.cell(BURSTY, BURST_REGION);
        say(format!(
            "bursty in {BURST_REGION}: {} allowed, {} denied by the region tier, {} by others",
            bursty_eu.allowed,
            bursty_eu.denied_region,
            bursty_eu.denied() - bursty_eu.denied_region
        ));
        bursty_eu
    }

    /// Phase 3, upgrade: initech moves to another plan through the limits
    /// API while its traffic runs; how long until every region-node of
    /// every region applied it.
    async fn upgrade(&mut self) -> Upgrade {
        let w = self.w;
        self.progress.set_phase(
            "upgrade",
            "initech moves from plan standard to premium: PUT /v1/limits/tenants/initech on the \
             aggregator, no file edited, no process signalled",
        );
        let nodes: usize = w.regions.iter().map(|r| r.nodes.len()).sum();
        let started = Instant::now();
        let answer = w
            .http
            .put(format!("{}/v1/limits/tenants/initech", w.aggregator))
            .bearer_auth(crate::world::OPS_KEY)
            .json(&serde_json::json!({ "plan": "premium" }))
            .send()
            .await;
        let body: serde_json::Value = match answer {
            Ok(r) if r.status().is_success() => r.json().await.unwrap_or_default(),
            Ok(r) => {
                say(format!("upgrade: the API answered {}", r.status()));
                serde_json::Value::Null
            }
            Err(e) => {
                say(format!("upgrade: the API did not answer: {e}"));
                serde_json::Value::Null
            }
        };
        let written = started.elapsed();
        let version = body["version"].as_u64().unwrap_or(0);
        let mut everywhere = None;
        while version > 0 && started.elapsed() < UPGRADE_DEADLINE {
            let status: Option<serde_json::Value> = async {
                w.http
                    .get(format!(
                        "{}/v1/limits/status?version={version}",
                        w.aggregator
                    ))
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()
            }
            .await;
            let reached = status.as_ref().is_some_and(|s| {
                s["reached"] == true && s["nodes"].as_array().is_some_and(|n| n.len() == nodes)
            });
            if reached {
                everywhere = Some(started.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match everywhere {
            Some(d) => say(format!(
                "initech on premium (limits version {version}): written in {} ms, applied by all {nodes} \
                 region-nodes of the 3 regions {} ms after the request",
                written.as_millis(),
                d.as_millis()
            )),
            None => say(format!(
                "initech's upgrade (version {version}) NOT applied by every region-node within {UPGRADE_DEADLINE:?}"
            )),
        }
        Upgrade {
            version,
            written: (version > 0).then_some(written),
            everywhere,
            nodes,
        }
    }

    /// Phase 4, global limit: one tenant over its daily limit; every region
    /// denies it.
    async fn global_limit(&mut self) -> GlobalLimit {
        self.progress.set_phase(
            "global limit",
            &format!(
                "hot pushes at {HOT_RATE} req/s in each of the 3 regions; its daily limit is \
                 {HOT_DAILY_LIMIT} for all regions together"
            ),
        );
        let tally = &self.tally;
        let hot_push: Vec<Stream> = REGIONS
            .iter()
            .map(|r| self.start_stream(HOT, r, HOT_RATE, None))
            .collect();
        let push_started = Instant::now();
        let all_deny = loop {
            if REGIONS
                .iter()
                .all(|r| tally.first_view_denial(HOT, r).is_some())
            {
                break true;
            }
            if push_started.elapsed() > DENY_DEADLINE {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        traffic::stop_all(hot_push).await;
        let hot_allowed_at_crossing = tally.totals(Some(HOT), None).allowed;
        let crossing_spread = tally.first_global_denial().and_then(|first| {
            REGIONS
                .iter()
                .map(|r| tally.first_view_denial(HOT, r))
                .collect::<Option<Vec<_>>>()
                .and_then(|v| v.into_iter().max())
                .map(|last| last.saturating_duration_since(first))
        });
        if all_deny {
            say(format!(
                "hot: every region denies it from the broadcast view, {:.2} s after the first global denial; \
                 allowed {hot_allowed_at_crossing} in all",
                crossing_spread.unwrap_or_default().as_secs_f64()
            ));
        } else {
            say("hot: NOT every region denied it from the broadcast view in time");
        }
        for r in REGIONS {
            self.streams
                .push(self.start_stream(HOT, r, HOT_PROBE_RATE, None));
        }
        GlobalLimit {
            all_deny,
            crossing_spread,
        }
    }

    /// Phase 5, cut: one region cut off from Kafka, then healed; traffic
    /// stops just before the heal.
    async fn cut(&mut self, cut: Duration) -> Cut {
        let w = self.w;
        self.progress.set_phase(
            "cut",
            &format!(
                "{CUT_REGION} cut off from Kafka for {} s: its link to the broker is blackholed \
                 (no byte moves either way, like a partition that drops packets); traffic goes on everywhere, \
                 and stops just before the heal",
                cut.as_secs()
            ),
        );
        let cut_region = w.region(CUT_REGION);
        let before_cut = self.tally.snapshot();
        let acme_before = w.agg_part("acme", CUT_REGION).await;
        cut_region.proxy.cut();
        let cut_at = Instant::now();
        // Deltas already in flight when the link went down may still land.
        let settle = Duration::from_millis(1500).min(cut / 2);
        tokio::time::sleep(settle).await;
        let frozen_from = w.last_delta(CUT_REGION).await;
        let acme_frozen_from = w.agg_part("acme", CUT_REGION).await;
        tokio::time::sleep(cut.saturating_sub(settle)).await;
        let frozen_to = w.last_delta(CUT_REGION).await;
        let acme_frozen_to = w.agg_part("acme", CUT_REGION).await;
        // Traffic stops just before the heal, so the heal → exact time below
        // measures the backlog only, against final client counts.
        traffic::stop_all(std::mem::take(&mut self.streams)).await;
        // The broadcast view's age: the cut region's nodes against the others'.
        let (mut view_age_cut, mut view_age_others): (f64, f64) = (0.0, 0.0);
        for r in &w.regions {
            for n in &r.nodes {
                let age =
                    testkit::metric_value(&w.metrics_text(n).await, "tierlimit_view_age_seconds");
                if r.name == CUT_REGION {
                    view_age_cut = view_age_cut.max(age);
                } else {
                    view_age_others = view_age_others.max(age);
                }
            }
        }
        let during_cut: Cell = {
            let now = self.tally.snapshot();
            let mut c = Cell::default();
            for ((t, r), cell) in &now {
                if r == CUT_REGION {
                    let before = before_cut
                        .get(&(t.clone(), r.clone()))
                        .copied()
                        .unwrap_or_default();
                    c.add(&cell.minus(&before));
                }
            }
            c
        };
        let acme_cut = self.tally.cell("acme", CUT_REGION);
        let acme_cut_clients = acme_cut.allowed - acme_cut.refunded;
        cut_region.proxy.heal();
        let healed_at = Instant::now();
        let cut_for = healed_at.duration_since(cut_at);
        self.progress.set_phase(
            "converge",
            &format!(
                "traffic stopped; {CUT_REGION}'s link healed after {:.1} s; waiting for the global count to be exact",
                cut_for.as_secs_f64()
            ),
        );
        say(format!(
            "during the cut {CUT_REGION} answered {} checks ({} allowed, {} denied, {} errors); \
             the aggregator's {CUT_REGION} part of acme stayed at {} while {CUT_REGION}'s clients had {acme_cut_clients}; \
             tierlimit_view_age_seconds at the heal: {view_age_cut:.1} s in {CUT_REGION}, at most {view_age_others:.1} s elsewhere",
            during_cut.allowed + during_cut.denied() + during_cut.errors,
            during_cut.allowed,
            during_cut.denied(),
            during_cut.errors,
            acme_frozen_to.map_or("?".into(), |v| v.to_string()),
        ));
        let frozen = matches!((frozen_from, frozen_to), (Some(a), Some(b)) if a == b)
            && acme_frozen_from.is_some()
            && acme_frozen_from == acme_frozen_to;
        Cut {
            cut_for,
            during_cut,
            frozen,
            acme_before,
            acme_frozen_to,
            healed_at,
            frozen_to,
        }
    }

    /// Phase 6, converge: waits after the heal until aggregator = clients'
    /// allowed − refunded (= Redis truth).
    /// globex's periods from the usage API: its hours (waiting, up to 20 s,
    /// for the one that ended in the story to close, every region's
    /// watermark past its end, and for the open one to hold the rest of
    /// `want`: it is published on the relaxed schedule) and its Berlin day
    /// beside acme's UTC day.
    async fn periods(&self, want: u64) -> Periods {
        let w = self.w;
        let day = |ps: &[serde_json::Value]| {
            ps.iter().rev().find(|p| p["kind"] == "day").and_then(|p| {
                Some((
                    p["name"].as_str()?.to_string(),
                    p["start"].as_str()?.to_string(),
                    p["total"].as_u64()?,
                ))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ps = w.agg_usage("globex").await;
            let hours: Vec<(String, u64, bool, i64)> = ps
                .iter()
                .filter(|p| p["kind"] == "hour")
                .filter_map(|p| {
                    Some((
                        p["name"].as_str()?.to_string(),
                        p["total"].as_u64()?,
                        p["closed"].as_bool()?,
                        p["end_ms"].as_i64()?,
                    ))
                })
                .collect();
            let done = w.hour_end_ms.is_none_or(|end| {
                hours.iter().any(|h| h.3 == end && h.2)
                    && hours.iter().map(|h| h.1).sum::<u64>() == want
            });
            if done || Instant::now() > deadline {
                return Periods {
                    hour_end_ms: w.hour_end_ms,
                    hours,
                    berlin_day: day(&ps),
                    utc_day: day(&w.agg_usage("acme").await),
                };
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn converge(&self, cut: &Cut, day: u32) -> anyhow::Result<Converge> {
        let w = self.w;
        let mut want = BTreeMap::new();
        for t in TENANTS {
            let c = self.tally.totals(Some(t), None);
            want.insert(t, c.allowed - c.refunded);
        }
        let mut truth = BTreeMap::new();
        for t in TENANTS {
            truth.insert(t, w.redis_truth(t, day).await?);
        }
        let mut seen: BTreeMap<&str, Option<u64>> = BTreeMap::new();
        let mut month: BTreeMap<&str, Option<(String, u64)>> = BTreeMap::new();
        let mut first_delta_after_heal = None;
        let converged = loop {
            if first_delta_after_heal.is_none()
                && w.last_delta(CUT_REGION)
                    .await
                    .zip(cut.frozen_to)
                    .is_some_and(|(now, then)| now > then)
            {
                first_delta_after_heal = Some(cut.healed_at.elapsed());
            }
            for t in TENANTS {
                seen.insert(t, w.agg_view(t).await.map(|v| v.0));
            }
            for t in STEADY {
                month.insert(t, w.agg_month(t).await);
            }
            let months_exact = STEADY
                .iter()
                .all(|t| month[t].as_ref().map(|m| m.1) == Some(want[t]));
            if TENANTS.iter().all(|t| seen[t] == Some(want[t])) && months_exact {
                break Some(cut.healed_at.elapsed());
            }
            if cut.healed_at.elapsed() > CONVERGE_DEADLINE {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        Ok(Converge {
            want,
            truth,
            seen,
            month,
            converged,
            first_delta_after_heal,
        })
    }
}
