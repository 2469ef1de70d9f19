//! Partition and fault suite: Jepsen-style faults against a real deployment
//! in network namespaces, judged by a checker of exact histories.
//!
//! Every test builds the same topology (`harness::topology`,
//! `harness::cluster`): a `core` host with the Tansu broker and the
//! aggregator, and three regions (`eu`, `us`, `ap`), each with its own
//! `redis-server` and two region-nodes, every process in its host's network
//! namespace. Paced clients in the test process drive three tenants through
//! every node and record a history (`harness::history`):
//!
//! - `tiers`: node tier 30 / 2 s and region tier 50 / 2 s, fixed windows
//!   aligned to the wall clock, so "never more than the limit in a window"
//!   is checkable exactly (each reply's `reset_ms` pins its window);
//! - `g`: global limit 600 / day, crossed during the fault, to measure the
//!   global overshoot against the design's bound;
//! - `t`: a large global limit with a refund after every 10th allowed check,
//!   for the exact "allowed − refunds" count.
//!
//! Then a fault, a heal, and the checks, in this order (each failure is
//! collected and reported together at the end):
//!
//! 1. node and region tiers never allowed more than their limit in any
//!    window (and the regions' Redis counters agree with the history);
//! 2. the aggregator's total equals allowed − refunds exactly once healed
//!    and drained (or, when a request's answer was lost, equals the regions'
//!    Redis and lies within the in-flight bound of the history);
//! 3. the global overshoot is within the bound the design gives: the other
//!    regions' traffic over the staleness of each region's view, computed
//!    from the history, the configured intervals, the broker hops the
//!    test's own probe timed and the faults the test made (never from the
//!    system's staleness metrics), and printed;
//! 4. no process panicked, and the fault's metrics rose during it and fell
//!    after it healed.
//!
//! The suite runs as root (network namespaces, iptables). If the namespaces
//! cannot be created it fails with the reason; it never skips.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use harness::cluster::{
    wait, Cluster, Spec, BROADCAST_INTERVAL_MS, DEADLINE, DELTAS, FLUSH_INTERVAL_MS,
    FOLLOWER_FETCH_WAIT_MS, NODE_IDS, REGIONS,
};
use harness::history::{self, now_us, Op, Outcome};
use harness::load::{publish_lag, Load, Sampler, Samples, BROKER_HOP, VIEW_TOTAL};
use harness::metric_value;
use harness::procfs::MachineTicks;

const G_LIMIT: u64 = 600;
const NODE_LIMIT: u64 = 30;
const REGION_LIMIT: u64 = 50;
/// A node-tier reservation: `node.reserve_fraction`'s default (⅛) of
/// NODE_LIMIT, rounded down.
const RESERVE_CHUNK: u64 = NODE_LIMIT / 8;
const WINDOW_MS: u64 = 2000;
/// Traffic before the fault.
const WARMUP: Duration = Duration::from_secs(2);
/// How long a fault lasts (unless the scenario says otherwise).
const FAULT: Duration = Duration::from_secs(4);
/// Traffic after the heal.
const AFTER: Duration = Duration::from_secs(2);
/// After a heal, every node must have a fresh view and publish again within
/// this long. 20 s was too tight on the 2-core machine of 2026-11-25: after
/// a cut longer than `message.timeout.ms`, one node's follower took 10.7,
/// 14.0 and more than 20 s to confirm its view again, with the code before
/// and after that day's change alike (why it takes that long is not
/// established; the reconnect backoff is 500 ms here).
const RECOVERY: Duration = Duration::from_secs(35);
/// A node started during a cut from Kafka is ready this long after the
/// heal at most (measured: 2.7 and 4.0 s on the machine of 2026-11-26's
/// first session, 8.66 s in a clean-clone run on the second's, about 2×
/// slower; still well inside librdkafka's 30 s connection setup timeout and
/// the kernel's 31 s SYN retry that a stuck reconnect would wait for).
const READY_AFTER_HEAL: Duration = Duration::from_secs(15);
/// A view or publish pipeline counts as fresh below this age. Heartbeats
/// come at most 1 s apart; what a view's age adds to that is the follower's
/// confirmation against the broker under the suite's load. 2 s held on the
/// machines before 2026-11-26; on that day's (about 2× slower per
/// instruction, BENCHMARKS §1) the no-fault scenario saw 2.0 to 3.1 s, with
/// node-tier reservations on and off alike.
const FRESH: f64 = 3.5;
/// Without a fault a view's median age stays below this: the follower
/// confirms it every few hundred milliseconds (medians of 0.3 to 0.6 s
/// alone on the machine of 2026-11-26's last session, 1.6 to 2.4 s beside
/// 8 busy loops on its 2 cores). A follower confirming every 2 s instead
/// showed 2.4 to 3.1 s, every 3 s 3.9 s.
const TYPICAL: f64 = 2.5;
/// `wire::heartbeat_liveness` for the suite's config (two 1 s heartbeat
/// intervals and 5 s): past this a follower stops trusting the heartbeats
/// it has, so without a fault no view may get this old even in a stall.
const LIVENESS: f64 = 7.0;
/// A node's publish lag counts as fresh below this: [`FRESH`] plus the
/// relaxed flush interval (2 s). A tenant far from its global limit is
/// published once per interval by whichever node of the region comes first
/// (the stamp is shared in Redis), so a node whose sibling just published
/// it can go that long without publishing anything itself.
const PUBLISH_FRESH: f64 = FRESH + 2.0;
/// Flush (100 ms) + aggregation and broadcast (100 ms) + transport, plus
/// the metric sampling period: how late `node.max_staleness` can take
/// effect beyond its own setting (`every_region_cut_from_kafka`).
const PIPELINE: Duration = Duration::from_millis(700);
/// `g`'s count from which every node publishes it at every flush: the
/// default `urgent_fraction` (½) of its limit. Below it, and above the
/// broadcast threshold, the configuration lets the view lag by the relaxed
/// flush interval (2 s) instead.
const URGENT_AT: u64 = G_LIMIT / 2;
/// What the configuration lets a view lag behind the clients' record
/// without a fault: one flush interval (the unit waits for the node's next
/// flush), one broadcast interval (then for the aggregator's next
/// broadcast), one follower fetch wait. The rest is the time the machine
/// takes to hand the unit on, allowed for by [`HAND_OFFS`] hops of the
/// test's broker probe and [`LAG_SLACK`]. From configuration and the
/// test's own timing, not from any staleness the system reports, so a
/// slower publisher, aggregator or follower shows as a longer lag instead
/// of a wider bound.
const VIEW_PIPELINE: Duration =
    Duration::from_millis(FLUSH_INTERVAL_MS + BROADCAST_INTERVAL_MS + FOLLOWER_FETCH_WAIT_MS);
/// The hand-offs a unit makes between a client's answer and a node's view,
/// each slowed by the machine's load about as much as one hop of the
/// test's broker probe (`load::broker_probe`: a produce, a fetch and the
/// hand-offs between the test's own threads): two trips through the
/// broker, the node's flush, the aggregator's merge and broadcast, the
/// follower's apply: five, but the system's processes (debug builds, 13
/// of them on 2 cores) feel the load more than the probe does. Measured
/// on 2026-11-28 in eight runs (probe medians 56 to 166 ms, one beside a
/// compile): a node's median lag beyond [`VIEW_PIPELINE`] was 2.9 to 5.9
/// probe hops, hence eight.
const HAND_OFFS: f64 = 8.0;
/// On top of [`VIEW_PIPELINE`] and [`HAND_OFFS`] probe hops, for the
/// median lag.
const LAG_SLACK: Duration = Duration::from_millis(100);
/// On top of the same, for the staleness at one moment (the overshoot
/// bound's): a view's largest lag exceeded its median by 0.34 to 0.62 s in
/// the runs [`HAND_OFFS`] cites.
const STALE_SLACK: Duration = Duration::from_millis(500);
/// `node.store_timeout` of the test config.
const STORE_TIMEOUT: Duration = Duration::from_millis(250);

fn plans() -> String {
    format!("{}{TENANTS}", plan_tables())
}

/// The standard tenants (the file's `[tenants]`, or the limits topic's).
const TENANTS: &str = r#"
[tenants.tiers]
plan = "tiers"
[tenants.g]
plan = "global"
[tenants.t]
plan = "big"
[tenants.open]
plan = "fail_open"
[tenants.closed]
plan = "fail_closed"
[tenants.local]
plan = "fail_local"
"#;

/// The standard plans.
fn plan_tables() -> String {
    let tiers = format!(
        r#"node = {{ limit = {NODE_LIMIT}, window = "2s", algorithm = "fixed_window" }}
region = {{ limit = {REGION_LIMIT}, window = "2s", algorithm = "fixed_window" }}"#
    );
    format!(
        r#"
[plans.tiers]
{tiers}
[plans.global]
global = {{ limit = {G_LIMIT} }}
[plans.big]
global = {{ limit = 100000000 }}
[plans.fail_open]
{tiers}
global = {{ limit = 100000000 }}
on_store_error = "open"
[plans.fail_closed]
{tiers}
global = {{ limit = 100000000 }}
on_store_error = "closed"
[plans.fail_local]
{tiers}
global = {{ limit = 100000000 }}
on_store_error = "local"
"#
    )
}

/// The standard traffic: (tenant, checks per second per node, refund every n-th).
const STANDARD: &[(&str, f64, u32)] = &[("tiers", 40.0, 0), ("g", 25.0, 0), ("t", 10.0, 10)];

fn all_nodes() -> Vec<String> {
    REGIONS
        .iter()
        .flat_map(|r| NODE_IDS.iter().map(move |n| format!("{r}/{n}")))
        .collect()
}

fn region_nodes(r: &str) -> Vec<String> {
    NODE_IDS.iter().map(|n| format!("{r}/{n}")).collect()
}

/// A fault window and what it should do to the metrics.
struct Fault {
    what: String,
    start: u64,
    end: Option<u64>,
    /// (node, metric, expectation) to meet during the fault.
    expect: Vec<(String, &'static str, Expect)>,
    /// It stops or slows a region's way to the broker and the aggregator,
    /// or its publisher's input (the region's Redis): views are staler
    /// while it lasts and until they caught up (see [`Scenario::staleness`]).
    pipeline: bool,
}

#[derive(Debug, Clone, Copy)]
enum Expect {
    /// The metric reaches at least this value during the fault.
    RisesTo(f64),
    /// The metric drops to at most this value during the fault.
    DipsTo(f64),
}

/// One run: cluster, traffic, metric sampler, faults, and the failures found.
struct Scenario {
    c: Cluster,
    name: &'static str,
    loads: Vec<Load>,
    tenants: Vec<&'static str>,
    sampler: Option<Sampler>,
    faults: Vec<Fault>,
    failures: Vec<String>,
    /// Time without aggregator broadcasts (aggregator down, paused,
    /// rebuilding): every region's view of the others is that much staler.
    aggregator_gap: Duration,
    /// Per region, the longest a node of it served between its restart and
    /// its view's first confirmation: its view-age samples start only then
    /// (a restarted node knows no entry, and reads a missing one as the
    /// broadcast threshold), so the overshoot bound counts this as staleness.
    node_gap: BTreeMap<String, Duration>,
    /// Time ranges where a region's Redis lost its tier counters.
    tier_reset: Vec<(u64, u64)>,
    /// A region whose Redis lost its data at the end of this time range:
    /// what it charged in the range may not have been published yet, and
    /// is lost by design (only published counts survive a Redis loss).
    data_loss: Option<(&'static str, u64, u64)>,
    /// `node.max_staleness` and when every region lost its view: the
    /// overshoot is then at most what was allowed from just before that
    /// until the cap took effect.
    staleness_cap: Option<(Duration, u64)>,
    /// Convergence waits left at full length (later ones are short once
    /// one has failed, so a dead broker does not cost minutes).
    patience: u32,
    t0: Instant,
    /// [`now_us`] when the traffic started: the staleness log's origin.
    started_us: u64,
}

impl Scenario {
    async fn start(name: &'static str, traffic: &[(&'static str, f64, u32)]) -> Scenario {
        Self::start_with(name, traffic, "").await
    }

    async fn start_with(
        name: &'static str,
        traffic: &[(&'static str, f64, u32)],
        node_extra: &str,
    ) -> Scenario {
        Self::start_with_env(name, traffic, node_extra, &[]).await
    }

    /// [`Scenario::start_with`], every process started with `env` (see
    /// `Spec::env`).
    async fn start_with_env(
        name: &'static str,
        traffic: &[(&'static str, f64, u32)],
        node_extra: &str,
        env: &[(&str, &str)],
    ) -> Scenario {
        Self::start_full(name, traffic, node_extra, env, None).await
    }

    /// [`Scenario::start_with_env`], sampling every node's view of
    /// `view_of` beside the metrics (6 more requests every 100 ms: only
    /// the scenario that judges the lag pays for them).
    async fn start_full(
        name: &'static str,
        traffic: &[(&'static str, f64, u32)],
        node_extra: &str,
        env: &[(&str, &str)],
        view_of: Option<&str>,
    ) -> Scenario {
        let spec = Spec {
            plans: plans(),
            node_extra: node_extra.into(),
            kafka_extra: String::new(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            bin_dir: None,
            clock_offset_s: 0,
            limits: None,
        };
        Self::launch(name, traffic, spec, view_of).await
    }

    /// Starts the cluster of `spec` and `traffic` on every node.
    async fn launch(
        name: &'static str,
        traffic: &[(&'static str, f64, u32)],
        spec: Spec,
        view_of: Option<&str>,
    ) -> Scenario {
        let t0 = Instant::now();
        let c = Cluster::start(spec).await;
        println!(
            "== {name}: cluster ready in {:.1}s (topology slot {})",
            t0.elapsed().as_secs_f64(),
            c.topo.slot()
        );
        let sampler = Some(c.sample_metrics_and_view(view_of));
        let loads = traffic
            .iter()
            .map(|(t, rate, refund)| c.load(t, &[], *rate, *refund))
            .collect();
        Scenario {
            c,
            name,
            loads,
            tenants: traffic.iter().map(|(t, _, _)| *t).collect(),
            sampler,
            faults: Vec::new(),
            failures: Vec::new(),
            aggregator_gap: Duration::ZERO,
            node_gap: BTreeMap::new(),
            tier_reset: Vec::new(),
            data_loss: None,
            staleness_cap: None,
            patience: 1,
            t0,
            started_us: now_us(),
        }
    }

    async fn hold(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    fn begin(&mut self, what: &str) {
        self.c.log(&format!("FAULT: {what}"));
        self.faults.push(Fault {
            what: what.into(),
            start: now_us(),
            end: None,
            expect: Vec::new(),
            pipeline: false,
        });
    }

    /// During the current fault, `metric` on each of `nodes` must reach `at_least`.
    fn expect_rise(&mut self, nodes: &[String], metric: &'static str, at_least: f64) {
        let f = self.faults.last_mut().expect("a fault begun");
        for n in nodes {
            f.expect
                .push((n.clone(), metric, Expect::RisesTo(at_least)));
        }
    }

    /// During the current fault, `metric` on each of `nodes` must drop to `at_most`.
    fn expect_dip(&mut self, nodes: &[String], metric: &'static str, at_most: f64) {
        let f = self.faults.last_mut().expect("a fault begun");
        for n in nodes {
            f.expect.push((n.clone(), metric, Expect::DipsTo(at_most)));
        }
    }

    /// During a cut from the broker, `nodes`' broadcast view ages and their
    /// last publication falls behind, both to at least `secs`.
    fn expect_cut_from_kafka(&mut self, nodes: &[String], secs: f64) {
        self.pipeline_fault();
        self.expect_rise(nodes, "tierlimit_view_age_seconds", secs);
        self.expect_rise(nodes, "publish_lag_seconds", secs);
    }

    /// The current fault stops or slows what a region publishes (its way to
    /// Kafka, or the Redis its publisher reads).
    fn pipeline_fault(&mut self) {
        self.faults.last_mut().expect("a fault begun").pipeline = true;
    }

    fn end(&mut self) {
        let f = self.faults.last_mut().expect("a fault begun");
        f.end = Some(now_us());
        self.c.log(&format!("HEALED: {}", f.what));
    }

    /// `node` refused no broadcast since it started (wire version,
    /// signature).
    async fn expect_no_rejected_broadcasts(&mut self, node: &str) {
        let n = self
            .c
            .nodes
            .iter()
            .find(|x| x.name() == node)
            .expect("node");
        let rejected = self
            .c
            .node_metrics_text(n)
            .await
            .map(|t| metric_value(&t, "tierlimit_broadcasts_rejected_total"));
        if rejected != Some(0.0) {
            self.fail(format!("{node} refused broadcasts: {rejected:?}"));
        }
    }

    fn fail(&mut self, what: String) {
        println!("FAILED CHECK: {what}");
        self.failures.push(what);
    }

    /// Waits until every node in `nodes` has a fresh broadcast view and
    /// publishes again (below [`FRESH`] and [`PUBLISH_FRESH`] seconds), up
    /// to [`RECOVERY`];
    /// records a failure otherwise. Needs traffic running.
    async fn expect_recovery(&mut self, nodes: &[String]) {
        let start = Instant::now();
        let mut last = BTreeMap::new();
        loop {
            let mut stale = Vec::new();
            for n in nodes {
                let node = self.c.nodes.iter().find(|x| &x.name() == n).expect("node");
                let (age, lag) = match self.c.node_metrics_text(node).await {
                    Some(text) => (
                        metric_value(&text, "tierlimit_view_age_seconds"),
                        publish_lag(&text, self.c.clock_now_us()),
                    ),
                    None => (f64::INFINITY, f64::INFINITY),
                };
                if !(age < FRESH && lag < PUBLISH_FRESH) {
                    stale.push(n.clone());
                }
                last.insert(n.clone(), (age, lag));
            }
            if stale.is_empty() {
                self.c.log(&format!(
                    "recovered: {nodes:?} fresh {:.2}s after the heal",
                    start.elapsed().as_secs_f64()
                ));
                return;
            }
            if start.elapsed() > RECOVERY {
                self.fail(format!(
                    "{}: not recovered {RECOVERY:?} after the heal: (view age s, publish lag s) = {last:?}",
                    self.name
                ));
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// After a heal: [`Scenario::expect_recovery`], traffic for [`AFTER`],
    /// then [`Scenario::finish`].
    async fn recover_then_finish(mut self, nodes: &[String]) {
        self.expect_recovery(nodes).await;
        self.hold(AFTER).await;
        self.finish().await;
    }

    /// Stops the traffic and runs every check; panics listing the failures.
    async fn finish(self) {
        self.finish_with(|_, _, _| {}).await
    }

    /// [`Scenario::finish`] with an extra check on the metric samples.
    async fn finish_with(mut self, extra: impl FnOnce(&mut Scenario, &Samples, &[history::Event])) {
        for l in std::mem::take(&mut self.loads) {
            l.stop().await;
        }
        self.c.log("traffic stopped");
        let ev = self.c.history.events();
        println!("history: {} operations", ev.len());
        for t in &self.tenants {
            print!("{}", history::summary(&ev, t));
        }

        // 1. Node and region tiers, from the history and against Redis.
        for tenant in self.tenants.clone() {
            if tenant == "g" || tenant == "t" {
                continue;
            }
            self.check_tiers(&ev, tenant).await;
        }

        // 2. The global count, exactly.
        for tenant in self.tenants.clone() {
            self.check_global(&ev, tenant).await;
        }

        let samples = self.sampler.take().expect("sampler").stop().await;

        // 3. Global overshoot within the design's bound.
        if self.tenants.contains(&"g") {
            self.check_overshoot(&ev, &samples);
        }

        // 4. No panics; the fault's metrics rose during it.
        for p in self.c.panics() {
            self.fail(format!("panic: {p}"));
        }
        self.check_metrics(&samples);
        extra(&mut self, &samples, &ev);

        println!(
            "== {}: {} in {:.1}s",
            self.name,
            if self.failures.is_empty() {
                "ok"
            } else {
                "FAILED"
            },
            self.t0.elapsed().as_secs_f64()
        );
        if !self.failures.is_empty() {
            // Tear down first (keeping the logs), so the panic below is not
            // buried under every process's log tail.
            self.c.keep_logs = true;
            let Scenario {
                c, name, failures, ..
            } = self;
            drop(c);
            panic!(
                "{name}: {} failed checks:\n  {}",
                failures.len(),
                failures.join("\n  ")
            );
        }
    }

    async fn check_tiers(&mut self, ev: &[history::Event], tenant: &str) {
        let skip = self.tier_reset.clone();
        for (tier, limit) in [("node", NODE_LIMIT), ("region", REGION_LIMIT)] {
            let r = history::check_fixed_window_tier(
                ev,
                tenant,
                tier,
                limit,
                WINDOW_MS,
                &["redis"],
                false,
                &skip,
            );
            println!("{tenant}: {}", r.describe());
            for v in &r.violations {
                self.fail(format!("{tenant}: {v}"));
            }
            if !r.unplaced.is_empty() {
                self.fail(format!(
                    "{tenant}: {} decisions not placed in one window, e.g. {}",
                    r.unplaced.len(),
                    r.unplaced[0]
                ));
            }
            if r.full_windows() == 0 && tier == "region" {
                self.fail(format!(
                    "{tenant}: the region tier never filled a window: the test did not exercise it"
                ));
            }
        }
        // In `local` mode each node enforces the node tier and its share of
        // the region tier on its own.
        let share = REGION_LIMIT / 2;
        for (tier, limit) in [("node", NODE_LIMIT), ("region", share)] {
            let r = history::check_fixed_window_tier(
                ev,
                tenant,
                tier,
                limit,
                WINDOW_MS,
                &["local"],
                true,
                &[],
            );
            if !r.usage.is_empty() {
                println!("{tenant}: {}", r.describe());
            }
            for v in &r.violations {
                self.fail(format!("{tenant} (local mode): {v}"));
            }
        }
        // The regions' Redis agree with the history for the last window.
        for region in REGIONS {
            let tier = tierlimit_shared::keys::region_tier_id("_", 1);
            if let Some((w, c)) = self.c.redis_window(region, tenant, &tier).await {
                let (seen, unknown) = history::usage_in_window(
                    ev,
                    tenant,
                    "region",
                    WINDOW_MS,
                    w,
                    STORE_TIMEOUT,
                    |e| e.region == region,
                );
                if !(seen <= c && c <= seen + unknown && c <= REGION_LIMIT) {
                    self.fail(format!(
                        "{tenant}: {region}'s Redis counts {c} in window {w}, the history {seen} (+{unknown} unanswered or timed out), limit {REGION_LIMIT}"
                    ));
                }
            }
            for id in NODE_IDS {
                let tier = tierlimit_shared::keys::node_tier_id(id, "_", 1);
                if let Some((w, c)) = self.c.redis_window(region, tenant, &tier).await {
                    let (seen, unknown) = history::usage_in_window(
                        ev,
                        tenant,
                        "node",
                        WINDOW_MS,
                        w,
                        STORE_TIMEOUT,
                        |e| e.region == region && e.node == id,
                    );
                    // Redis also counts what the node reserved and has not
                    // spent (region-node's reserve.rs): at most one
                    // reservation, two across a crash (the stranded one and
                    // the restarted node's).
                    let reserved = 2 * RESERVE_CHUNK;
                    if !(seen <= c && c <= seen + unknown + reserved && c <= NODE_LIMIT) {
                        self.fail(format!(
                            "{tenant}: {region}/{id}'s node counter in Redis is {c} in window {w}, the history {seen} (+{unknown} unanswered or timed out, +{reserved} reserved), limit {NODE_LIMIT}"
                        ));
                    }
                }
            }
        }
    }

    async fn check_global(&mut self, ev: &[history::Event], tenant: &str) {
        let g = history::global_expectation(ev, tenant, STORE_TIMEOUT);
        // Charged just before the region's Redis lost its data, maybe not
        // yet published: lost by design.
        let (lost_checks, lost_refunds) = match self.data_loss {
            Some((region, from, to)) => ev
                .iter()
                .filter(|e| {
                    e.tenant == tenant
                        && e.region == region
                        && e.mode() == Some("redis")
                        && e.allowed()
                })
                .filter(|e| e.end_us >= from && e.start_us <= to)
                .fold((0, 0), |(c, r), e| match e.op {
                    Op::Check => (c + e.cost, r),
                    Op::Refund => (c, r + e.cost),
                }),
            None => (0, 0),
        };
        let (lo, hi) = g.range();
        let (lo, hi) = (lo.saturating_sub(lost_checks), hi + lost_refunds);
        let exact = g.is_exact() && lost_checks == 0 && lost_refunds == 0;
        // Without local actors or lost epochs, the regions' Redis hold every
        // count: the aggregator must equal their sum exactly.
        let redis_is_truth = self.data_loss.is_none()
            && !ev
                .iter()
                .any(|e| e.tenant == tenant && e.mode() == Some("local"));
        println!("{tenant}: {g:?}; accepted range {lo}..={hi}");
        let budget = Duration::from_secs(if self.patience > 0 { 20 } else { 5 });
        let deadline = Instant::now() + budget;
        let (mut last, mut truth, mut stable_since) = (None, None, Instant::now());
        while Instant::now() < deadline {
            let now = self.c.aggregator_total(tenant).await;
            if now != last {
                stable_since = Instant::now();
            }
            last = now;
            if redis_is_truth {
                truth = Some(self.c.redis_truth(tenant).await);
            }
            let ok = match last {
                Some(t) if exact => t == g.net(),
                Some(t) => {
                    lo <= t
                        && t <= hi
                        && truth.is_none_or(|x| x == t)
                        && stable_since.elapsed() > Duration::from_secs(1)
                }
                None => false,
            };
            if ok {
                let total = last.unwrap_or(0);
                self.c.log(&format!(
                    "{tenant}: aggregator total {total} = allowed {} - refunded {}{}",
                    g.counted,
                    g.refunded,
                    if exact {
                        " (exact)".to_string()
                    } else {
                        format!(
                            " within {lo}..={hi}: {} checks and {} refunds unanswered, {} checks answered from a fail mode after a store timeout, {} refunds of unknown effect, {lost_checks} charged just before a Redis loss; Redis truth {truth:?}",
                            g.unknown_checks, g.unknown_refunds, g.indeterminate, g.maybe_refunded
                        )
                    }
                ));
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.patience = self.patience.saturating_sub(1);
        let view = self.c.aggregator_view(tenant).await;
        self.fail(format!(
            "{tenant}: aggregator total {last:?}, expected {} (accepted {lo}..={hi}, Redis truth {truth:?}); aggregator view {view}",
            g.net()
        ));
    }

    /// Staleness of `region`'s view of the others at `at` (µs), from the
    /// configuration and from what the test itself did and timed, never
    /// from what the system reports about its own staleness (a slower
    /// publisher, aggregator or follower must show as a larger overshoot,
    /// not as a wider bound):
    ///
    /// - the configured pipeline ([`VIEW_PIPELINE`]: flush, broadcast,
    ///   follower fetch), [`HAND_OFFS`] hops of the test's own broker
    ///   probe (`BROKER_HOP`, its median over the run) and [`STALE_SLACK`];
    /// - a fault on the way to Kafka (or of the Redis the region's publisher
    ///   reads) that had begun by `at` and not yet been
    ///   caught up on: `at` minus its start, since everything allowed after
    ///   it began may be missing from the view. It is caught up on by one
    ///   fault's length after the heal: TCP's retransmission timer doubles,
    ///   so a connection that lost its packets for T retransmits within T of
    ///   the heal;
    /// - the aggregator's silence ([`Scenario::aggregator_gap`]) and a
    ///   restarted node's first view ([`Scenario::node_gap`]), both timed
    ///   by the test.
    fn staleness(&self, samples: &Samples, region: &str, at: u64) -> Duration {
        let hop = samples
            .median_in("broker", BROKER_HOP, 0, u64::MAX)
            .unwrap_or(0.0);
        let base = VIEW_PIPELINE + Duration::from_secs_f64(HAND_OFFS * hop) + STALE_SLACK;
        let fault = self
            .faults
            .iter()
            .filter(|f| f.pipeline && f.start <= at)
            .filter(|f| {
                let end = f.end.unwrap_or(u64::MAX / 4);
                at <= end + (end - f.start)
            })
            .map(|f| Duration::from_micros(at - f.start))
            .max()
            .unwrap_or_default();
        let restart = self.node_gap.get(region).copied().unwrap_or_default();
        println!(
            "staleness of {region}'s view at +{:.2}s: configured pipeline {:.2}s + {HAND_OFFS} x the probe's median broker hop {:.3}s + slack {:.2}s + a fault on what a region publishes {:.2}s + a restarted node's first view {:.2}s + aggregator silence {:.2}s",
            at.saturating_sub(self.started_us) as f64 / 1e6,
            VIEW_PIPELINE.as_secs_f64(),
            hop,
            STALE_SLACK.as_secs_f64(),
            fault.as_secs_f64(),
            restart.as_secs_f64(),
            self.aggregator_gap.as_secs_f64(),
        );
        base + fault + restart + self.aggregator_gap
    }

    fn check_overshoot(&mut self, ev: &[history::Event], samples: &Samples) {
        let o = history::overshoot(ev, "g", G_LIMIT, |r, at| self.staleness(samples, r, at));
        print!("{}", o.describe());
        println!(
            "OVERSHOOT {}: allowed {} of {} (overshoot {}), bound {}",
            self.name, o.allowed, o.limit, o.overshoot, o.bound
        );
        if o.allowed < G_LIMIT {
            self.fail(format!(
                "g: only {} allowed: the global limit {G_LIMIT} was never reached",
                o.allowed
            ));
        }
        if !o.within_bound() {
            self.fail(format!(
                "g: overshoot {} exceeds the design's bound {}",
                o.overshoot, o.bound
            ));
        }
        if let Some((max_staleness, cut)) = self.staleness_cap {
            // Every region spends at most its share of what remained once
            // its view is older than max_staleness.
            // A node notices staleness up to one freshness check (200 ms)
            // plus one watermark query timeout (1 s) late.
            let detection = Duration::from_millis(1200);
            // At the cut a node's last view may already be that old too, so
            // units allowed that long before the cut were not in it either.
            let (from, to) = (
                cut.saturating_sub((PIPELINE + detection).as_micros() as u64),
                cut + (max_staleness + PIPELINE + detection).as_micros() as u64,
            );
            let before_cap: u64 = ev
                .iter()
                .filter(|e| {
                    e.tenant == "g"
                        && e.op == Op::Check
                        && e.counted()
                        && e.end_us >= from
                        && e.start_us <= to
                })
                .map(|e| e.cost)
                .sum();
            println!(
                "OVERSHOOT {} with max_staleness {max_staleness:?}: overshoot {} <= allowed before the cap took effect {before_cap}?",
                self.name, o.overshoot
            );
            if o.overshoot > before_cap {
                self.fail(format!(
                    "g: with node.max_staleness = {max_staleness:?} the overshoot {} exceeds what was allowed before the cap could apply ({before_cap})",
                    o.overshoot
                ));
            }
        }
    }

    fn check_metrics(&mut self, samples: &Samples) {
        let mut found = Vec::new();
        for f in &self.faults {
            let end = f.end.unwrap_or_else(now_us);
            for m in harness::cluster::WATCHED {
                if f.expect.iter().any(|(_, x, _)| *x == m) {
                    println!("{}: {}", f.what, samples.table(m, (f.start, end)));
                }
            }
            // The fault's window, plus one sampling period.
            let (from, to) = (f.start, end + 300_000);
            for (node, metric, e) in &f.expect {
                match *e {
                    Expect::RisesTo(v) => {
                        let max = samples.max_in(node, metric, from, to);
                        if !max.is_some_and(|m| m >= v) {
                            found.push(format!(
                                "{}: {metric} on {node} should rise to >= {v} during the fault, max seen {max:?}",
                                f.what
                            ));
                        }
                    }
                    Expect::DipsTo(v) => {
                        let min = samples.min_in(node, metric, from, to);
                        if !min.is_some_and(|m| m <= v) {
                            found.push(format!(
                                "{}: {metric} on {node} should drop to <= {v} during the fault, min seen {min:?}",
                                f.what
                            ));
                        }
                    }
                }
            }
        }
        for f in found {
            self.fail(f);
        }
    }
}

/// How far a view may lag the clients' record at the median without a
/// fault, from `from` to `to`: what the configuration allows
/// ([`VIEW_PIPELINE`]), [`HAND_OFFS`] hops of the test's own broker probe
/// in the same window (`BROKER_HOP`, median) for the machine's load, and
/// [`LAG_SLACK`].
fn lag_limit(samples: &Samples, from: u64, to: u64) -> Duration {
    let mut hops: Vec<f64> = samples
        .0
        .iter()
        .filter(|s| s.metric == BROKER_HOP && s.t_us >= from && s.t_us <= to)
        .map(|s| s.value * 1000.0)
        .collect();
    hops.sort_by(f64::total_cmp);
    // The median, as `Samples::median_in` takes it (ms here).
    let hop = hops.get(hops.len() / 2).copied().unwrap_or(0.0) / 1000.0;
    let limit = VIEW_PIPELINE + Duration::from_secs_f64(HAND_OFFS * hop) + LAG_SLACK;
    println!(
        "broker hops (ms) in the window: {} timed, p10 {:?} p50 {:?} p90 {:?} max {:?}",
        hops.len(),
        hops.get(hops.len() / 10),
        hops.get(hops.len() / 2),
        hops.get(hops.len() * 9 / 10),
        hops.last()
    );
    println!(
        "lag limit {} ms = configured pipeline {} ms + {HAND_OFFS} x the probe's median broker hop {:.0} ms + slack {} ms",
        limit.as_millis(),
        VIEW_PIPELINE.as_millis(),
        hop * 1000.0,
        LAG_SLACK.as_millis()
    );
    limit
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

// ---------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------

/// No fault: the baseline every other scenario is compared with. Every
/// check holds, and every node's broadcast view stays fresh under load
/// (so `node.max_staleness` and the overshoot bound mean what they say):
/// its median age is below [`TYPICAL`], and no stall took it to
/// [`LIVENESS`].
///
/// Why not the max against [`FRESH`]: in a CI run of 2026-11-26 (827 s
/// where five runs earlier that day took 9.4 to 11.5 min) every node's view
/// reached 4.4 to 5.7 s at the same moment, while Redis calls on loopback
/// took longer than the 250 ms store timeout (10 checks answered from a
/// fail mode, none expected without a fault): the machine stalled, not a
/// node. On the next session's machine the views' max was 0.8 to 1.3 s
/// alone; beside 8 busy loops the medians were 1.6 to 2.4 s and the maxima
/// 2.6 to 3.9 s; beside 16 loops, the medians 3.9 to 5.6 s. The view's age
/// shows a loaded machine truthfully; what this checks is the follower:
/// one that stops confirming its view, or confirms it only seconds apart,
/// fails the median (mutation-checked with a 2 s freshness check period in
/// place of 200 ms: medians of 2.4 to 3.1 s). Where the machine's time
/// went during the window is logged beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_fault_baseline() {
    // g's view (broadcast once g nears its limit) is sampled beside the
    // metrics, to compare with the history.
    let s = Scenario::start_full("no_fault_baseline", STANDARD, "", &[], Some("g")).await;
    let from = now_us() + 1_000_000;
    let cpu_then = MachineTicks::now();
    s.hold(Duration::from_secs(8)).await;
    let to = now_us();
    if let (Some(then), Some(now)) = (cpu_then, MachineTicks::now()) {
        println!("the machine during the window: {}", now.since(&then));
    }
    s.finish_with(move |s, samples, ev| {
        // g's lag is judged while g is urgent (published at every flush)
        // and still moving: from URGENT_AT to its last allowed unit.
        let moving_until = ev
            .iter()
            .filter(|e| e.tenant == "g" && e.op == Op::Check && e.counted())
            .map(|e| e.end_us)
            .max()
            .unwrap_or(0)
            .min(to);
        for n in all_nodes() {
            let age = "tierlimit_view_age_seconds";
            let (median, max) = (
                samples.median_in(&n, age, from, to),
                samples.max_in(&n, age, from, to),
            );
            println!("{n}: view age without any fault: median {median:?}s, max {max:?}s");
            // How far the view of g lagged the clients' record (µs).
            let mut lags: Vec<u64> = samples
                .0
                .iter()
                .filter(|x| {
                    x.node == n
                        && x.metric == VIEW_TOTAL
                        && x.t_us >= from
                        && x.t_us <= moving_until
                        && x.value >= URGENT_AT as f64
                })
                .map(|x| history::view_lag_us(ev, "g", x.t_us, x.value as u64))
                .collect();
            lags.sort_unstable();
            let limit = lag_limit(samples, from, to).as_micros() as u64;
            let median_lag = lags.get(lags.len() / 2).copied();
            println!(
                "{n}: g's view behind the history: median {:?} ms, max {:?} ms of {} samples (median limit from config {} ms)",
                median_lag.map(|l| l / 1000),
                lags.last().map(|l| l / 1000),
                lags.len(),
                limit / 1000
            );
            if median_lag.is_none_or(|l| l > limit) {
                s.fail(format!(
                    "{n}: g's view lagged the clients' record by a median of {:?} ms > {} ms (flush {FLUSH_INTERVAL_MS} + broadcast {BROADCAST_INTERVAL_MS} + fetch {FOLLOWER_FETCH_WAIT_MS} ms + {HAND_OFFS} probe hops + slack {} ms); samples {lags:?}",
                    median_lag.map(|l| l / 1000),
                    limit / 1000,
                    LAG_SLACK.as_millis()
                ));
            }
            if !median.is_some_and(|m| m < TYPICAL) || !max.is_some_and(|m| m < LIVENESS) {
                s.fail(format!(
                    "{n}: the broadcast view went stale without any fault (view age median {median:?}s, \
                     max {max:?}s; fresh is a median < {TYPICAL}s and a max < {LIVENESS}s)"
                ));
            }
        }
    })
    .await;
}

/// One region loses Kafka (broker and aggregator) under load. Its node and
/// region tiers stay exact; it enforces the global tier from its last view
/// plus its own exact count; once healed its deltas flow again, its view is
/// fresh again, and the global count converges exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_cut_from_kafka_then_healed() {
    let mut s = Scenario::start("region_cut_from_kafka_then_healed", STANDARD).await;
    s.hold(WARMUP).await;
    s.begin("eu cut from core (broker + aggregator)");
    s.c.topo.partition("eu", "core");
    let eu = region_nodes("eu");
    s.expect_cut_from_kafka(&eu, secs(FAULT) - 1.0);
    s.hold(FAULT).await;
    s.c.topo.heal();
    s.end();
    s.recover_then_finish(&eu).await;
}

/// Limits as data under a partition (issue 32): every tenant on the limits
/// topic; eu cut from core (broker and aggregator); during the cut `tiers`'
/// region limit is lowered from 50 to 20 on the topic. us and ap apply it
/// at once; eu keeps enforcing the last version it applied (it cannot know
/// better) and applies the change on heal. Judged from the clients'
/// history against the limit in force: 50 in every window (the usual
/// checks: the old limit bounds every moment), 20 in every window of a
/// region that starts after its nodes reported the new version (and such
/// windows fill to 20: the change is exercised), and eu above 20 in a
/// window during the cut (it kept its last version, it did not stop).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_cut_from_kafka_during_a_limits_change() {
    const LOWERED: u64 = 20;
    let spec = Spec {
        plans: plan_tables(),
        node_extra: String::new(),
        kafka_extra: String::new(),
        env: Vec::new(),
        bin_dir: None,
        clock_offset_s: 0,
        limits: Some(TENANTS.into()),
    };
    let name = "region_cut_from_kafka_during_a_limits_change";
    let mut s = Scenario::launch(name, STANDARD, spec, None).await;
    s.hold(WARMUP).await;
    s.begin("eu cut from core; tiers' region limit lowered to 20 on the topic meanwhile");
    s.c.topo.partition("eu", "core");
    let eu = region_nodes("eu");
    s.expect_cut_from_kafka(&eu, secs(FAULT) - 1.0);
    s.hold(Duration::from_secs(1)).await;
    let v = s.c.import_limits(
        "lower",
        &format!("[tenants.tiers]\nplan = \"tiers\"\nregion = {{ limit = {LOWERED} }}\n"),
    );
    let written_at = now_us();
    let applied = async |s: &Scenario, region: &str| {
        let mut all = true;
        for id in NODE_IDS {
            let n = s.c.node(region, id);
            let got = s.c.node_metric(n, "tierlimit_limits_applied_version").await;
            all &= got.is_some_and(|g| g as u64 >= v.min(i64::MAX as u64));
        }
        all
    };
    let mut applied_at = BTreeMap::new();
    for r in ["us", "ap"] {
        wait(&format!("{r} applied version {v}"), DEADLINE, async || {
            applied(&s, r).await
        })
        .await;
        applied_at.insert(r, now_us());
    }
    let eu_saw_it = applied(&s, "eu").await;
    s.hold(FAULT).await;
    let healed_at = now_us();
    s.c.topo.heal();
    s.end();
    wait(
        &format!("eu applied version {v} after the heal"),
        DEADLINE,
        async || applied(&s, "eu").await,
    )
    .await;
    applied_at.insert("eu", now_us());
    let status_url = s.c.agg_url(&format!("/v1/limits/status?version={v}"));
    wait(
        "the aggregator reports the version on all 6 nodes",
        DEADLINE,
        async || {
            s.c.get_json(&status_url).await.is_some_and(|j| {
                j["reached"] == true && j["nodes"].as_array().is_some_and(|n| n.len() == 6)
            })
        },
    )
    .await;
    s.expect_recovery(&eu).await;
    s.hold(AFTER).await;
    s.finish_with(move |s, _, ev| {
        if eu_saw_it {
            s.fail("eu applied the change while cut from Kafka: the cut did not take".into());
        }
        for (region, at) in &applied_at {
            let mine: Vec<history::Event> =
                ev.iter().filter(|e| e.region == *region).cloned().collect();
            let r = history::check_fixed_window_tier(
                &mine,
                "tiers",
                "region",
                LOWERED,
                WINDOW_MS,
                &["redis"],
                false,
                &[(0, *at)],
            );
            println!("tiers in {region} after it applied the change: {}", r.describe());
            for v in &r.violations {
                s.fail(format!("tiers in {region} after the change: {v}"));
            }
            if r.full_windows() == 0 {
                s.fail(format!(
                    "tiers in {region}: no window filled to {LOWERED} after the change: not exercised"
                ));
            }
        }
        // eu during the cut, once its last record could have been the new
        // one: still the old limit (windows above 20).
        let eu_events: Vec<history::Event> = ev.iter().filter(|e| e.region == "eu").cloned().collect();
        let during = history::check_fixed_window_tier(
            &eu_events,
            "tiers",
            "region",
            LOWERED,
            WINDOW_MS,
            &["redis"],
            false,
            &[(0, written_at), (healed_at, u64::MAX / 2)],
        );
        println!("tiers in eu during the cut: {}", during.describe());
        if during.violations.is_empty() {
            s.fail("eu never allowed more than the new limit during the cut: it did not keep its last applied version".into());
        }
    })
    .await;
}

/// Every region loses Kafka at once (broker and aggregator unreachable
/// from everywhere), with `node.max_staleness = "1s"`: once its view is
/// older than that, every region spends at most its share of what remained,
/// so the overshoot is only what was allowed before the cap could apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_region_cut_from_kafka() {
    let mut s = Scenario::start_with(
        "every_region_cut_from_kafka",
        STANDARD,
        r#"max_staleness = "1s""#,
    )
    .await;
    s.hold(WARMUP).await;
    s.begin("every region cut from core");
    for r in REGIONS {
        s.c.topo.partition(r, "core");
    }
    s.staleness_cap = Some((Duration::from_secs(1), now_us()));
    let all = all_nodes();
    s.expect_cut_from_kafka(&all, secs(FAULT) - 1.0);
    s.hold(FAULT).await;
    s.c.topo.heal();
    s.end();
    s.recover_then_finish(&all).await;
}

/// A region cut from Kafka for longer than the producer's message timeout
/// (15 s): its deltas now fail (the failure counter rises) and stay dirty
/// in Redis; after the heal they are published again and the count is
/// exact. The broker must survive the producer's retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_cut_longer_than_the_message_timeout() {
    let mut s = Scenario::start("region_cut_longer_than_the_message_timeout", STANDARD).await;
    s.hold(WARMUP).await;
    s.begin("eu cut from core for 17s (> message.timeout.ms 15s)");
    s.c.topo.partition("eu", "core");
    let eu = region_nodes("eu");
    s.expect_cut_from_kafka(&eu, 15.0);
    s.expect_rise(&eu, "tierlimit_deltas_failed_total", 1.0);
    s.hold(Duration::from_secs(17)).await;
    s.c.topo.heal();
    s.end();
    s.recover_then_finish(&eu).await;
}

/// A region-node restarted while its region is cut from Kafka by a real
/// cut (`Topology::blackhole`: its packets leave and are never answered, so
/// every connection it opens waits on the kernel's SYN retransmissions,
/// 1, 3, 7, 15 and 31 s after the first): once healed 17 s later it is
/// ready (its view caught up from the topic) within [`READY_AFTER_HEAL`],
/// and every count stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_restarted_during_a_kafka_cut_is_ready_soon_after_the_heal() {
    let mut s = Scenario::start("node_restarted_during_a_kafka_cut", STANDARD).await;
    s.hold(WARMUP).await;
    s.begin("eu cut from core (black hole), eu/a restarted during the cut, healed 17s later");
    s.c.topo.blackhole("eu", "core");
    s.pipeline_fault();
    s.c.kill_node("eu", "a");
    s.c.restart_node("eu", "a");
    s.hold(Duration::from_secs(17)).await;
    s.c.topo.heal();
    match s
        .c
        .try_wait_node_ready("eu", "a", READY_AFTER_HEAL * 4)
        .await
    {
        Ok(t) if t <= READY_AFTER_HEAL => s.c.log(&format!(
            "eu/a ready {:.2}s after the heal",
            t.as_secs_f64()
        )),
        Ok(t) => s.fail(format!(
            "eu/a ready only {:.2}s after the heal (at most {READY_AFTER_HEAL:?})",
            t.as_secs_f64()
        )),
        Err(e) => s.fail(format!("the restarted eu/a never became ready: {e}")),
    }
    s.end();
    s.hold(AFTER).await;
    s.finish().await;
}

/// A rolling upgrade from the JSON wire release under traffic: every
/// process starts writing wire v1 (JSON, unsigned, as that release did;
/// `accept_unsigned` for the upgrade), then the aggregator and each node in
/// turn are restarted writing v2 (binary, signed), so for most of the run
/// processes of both versions write side by side. Both versions are on the
/// topics, and every count stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_upgrade_from_wire_v1() {
    let v1 = [
        ("TIERLIMIT__WIRE__VERSION", "1"),
        ("TIERLIMIT__WIRE__ACCEPT_UNSIGNED", "true"),
    ];
    let v2 = [("TIERLIMIT__WIRE__VERSION", "2")];
    let mut s = Scenario::start_with_env("rolling_upgrade_from_wire_v1", STANDARD, "", &v1).await;
    s.hold(WARMUP).await;
    s.begin("rolling upgrade v1 -> v2: the aggregator, then each node");
    let mut restarts = Vec::new();
    // The regions' views are stale by the aggregator's restart, as in
    // `aggregator_killed_and_restarted`: the overshoot bound counts it.
    let down = Instant::now();
    s.c.restart_aggregator_with(&v2);
    s.c.wait_aggregator_ready().await;
    s.aggregator_gap = down.elapsed();
    s.hold(Duration::from_secs(1)).await;
    for node in all_nodes() {
        let (region, id) = node.split_once('/').expect("region/id");
        // Until now it ran v1 beside a v2 aggregator: it read every broadcast.
        s.expect_no_rejected_broadcasts(&node).await;
        let down = Instant::now();
        restarts.push((node.clone(), now_us()));
        s.c.restart_node_with(region, id, &v2);
        if let Err(e) =
            s.c.try_wait_node_ready(region, id, Duration::from_secs(20))
                .await
        {
            s.fail(format!("{node} not ready after its upgrade: {e}"));
        }
        let gap = s.node_gap.entry(region.to_string()).or_default();
        *gap = (*gap).max(down.elapsed());
        s.hold(Duration::from_millis(500)).await;
    }
    s.end();
    s.hold(AFTER).await;
    for node in all_nodes() {
        s.expect_no_rejected_broadcasts(&node).await;
    }
    // The v2 aggregator read every v1 delta of the nodes not yet upgraded
    // (a refusal would only show as overshoot here: the upgraded node's
    // cumulative delta makes the count whole again).
    for metric in [
        "tierlimit_aggregator_deltas_rejected_total",
        "tierlimit_aggregator_undecodable_messages_total",
    ] {
        let n = s.c.aggregator_metric(metric).await;
        if n != Some(0.0) {
            s.fail(format!("the aggregator skipped deltas: {metric} = {n:?}"));
        }
    }
    let versions = s.c.first_bytes(DELTAS).await;
    if !(versions.contains(&b'{') && versions.contains(&2)) {
        s.fail(format!(
            "both versions of deltas on the topic, saw first bytes {versions:?}"
        ));
    }
    s.finish_with(move |s, _, _| restarted_nodes_keep_denying(s, &restarts))
        .await;
}

/// A node restarted once `g` was over its global limit and every node
/// denied it from the view must allow none of it after the restart: its
/// view is empty until the follower has read the topic, and a missing
/// entry must not read as "below the broadcast threshold" (before
/// `node.view_wait`, each restarted node allowed 10-20 more of `g` in its
/// first half second, an overshoot of 400-580 against the limit of 600).
fn restarted_nodes_keep_denying(s: &mut Scenario, restarts: &[(String, u64)]) {
    let ev = s.c.history.events();
    let g: Vec<_> = ev
        .iter()
        .filter(|e| e.tenant == "g" && e.op == Op::Check)
        .collect();
    let node_of = |e: &history::Event| format!("{}/{}", e.region, e.node);
    // When every node had denied g from the view at least once.
    let all_denying = all_nodes()
        .iter()
        .map(|n| {
            g.iter()
                .filter(|e| &node_of(e) == n)
                .filter(|e| matches!(&e.outcome, Outcome::Denied { tier, mode } if tier == "global" && mode == "view"))
                .map(|e| e.end_us)
                .min()
        })
        .collect::<Option<Vec<u64>>>()
        .and_then(|t| t.into_iter().max());
    let Some(all_denying) = all_denying else {
        s.fail("g: some node never denied g from the view".into());
        return;
    };
    let mut judged = 0;
    for (node, at) in restarts.iter().filter(|(_, at)| *at > all_denying) {
        judged += 1;
        let allowed: u64 = g
            .iter()
            .filter(|e| &node_of(e) == node && e.start_us > *at && e.counted())
            .map(|e| e.cost)
            .sum();
        println!(
            "{node} restarted with g over its limit: allowed {allowed} of g after the restart"
        );
        if allowed > 0 {
            s.fail(format!(
                "{node}, restarted after g was denied everywhere, allowed {allowed} of g"
            ));
        }
    }
    if judged == 0 {
        s.fail(
            "no node was restarted after g was denied everywhere: the scenario no longer tests it"
                .into(),
        );
    }
}

/// The aggregator is killed (-9) under load and restarted: node and region
/// tiers are unaffected, the regions go on with their last view, and the
/// restarted aggregator rebuilds from the topic to the exact count.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aggregator_killed_and_restarted() {
    let mut s = Scenario::start("aggregator_killed_and_restarted", STANDARD).await;
    s.hold(WARMUP).await;
    s.begin("aggregator kill -9, restarted after 4s");
    let down = Instant::now();
    s.c.kill_aggregator();
    s.hold(FAULT).await;
    s.c.restart_aggregator();
    s.c.wait_aggregator_ready().await;
    s.aggregator_gap = down.elapsed();
    s.end();
    s.c.log(&format!(
        "aggregator back and rebuilt {:.1}s after the kill",
        s.aggregator_gap.as_secs_f64()
    ));
    s.hold(AFTER).await;
    s.finish().await;
}

/// The aggregator is frozen (SIGSTOP) for three times
/// `aggregator.session_timeout` (2 s), then resumed: the group expired its
/// session, so on resume it rejoins, is assigned again, rebuilds from the
/// topic, and the count is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aggregator_paused_past_session_timeout() {
    let mut s = Scenario::start("aggregator_paused_past_session_timeout", STANDARD).await;
    let assignments = |c: &Cluster| {
        c.aggregators[0]
            .log()
            .lines()
            .filter(|l| l.contains("partitions assigned"))
            .count()
    };
    s.hold(WARMUP).await;
    let before = assignments(&s.c);
    s.begin("aggregator SIGSTOP for 6s (session timeout 2s)");
    let down = Instant::now();
    s.c.aggregators[0].stop();
    s.hold(Duration::from_secs(6)).await;
    s.c.aggregators[0].cont();
    // The member must rejoin and be assigned again (and rebuild).
    let deadline = Instant::now() + Duration::from_secs(10);
    while assignments(&s.c) <= before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = assignments(&s.c);
    s.c.wait_aggregator_ready().await;
    s.aggregator_gap = down.elapsed();
    s.end();
    s.c.log(&format!(
        "aggregator assignments: {before} before the pause, {after} after"
    ));
    if after <= before {
        s.fail(format!(
            "paused 3x aggregator.session_timeout, the aggregator was never assigned again after resuming \
             ({before} assignment(s) before, {after} after)"
        ));
    }
    s.hold(AFTER).await;
    s.finish().await;
}

/// A region-node is killed (-9) mid-traffic and restarted: the other node of
/// its region goes on, nothing it charged is lost (the count lives in
/// Redis), and clients saw at most what was charged, short of at most the
/// requests in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_node_killed() {
    let mut s = Scenario::start("region_node_killed", STANDARD).await;
    s.hold(WARMUP).await;
    s.begin("eu/a kill -9, restarted after 4s");
    s.c.kill_node("eu", "a");
    let served = |s: &Scenario| {
        s.c.history
            .events()
            .iter()
            .filter(|e| e.region == "eu" && e.node == "b")
            .count()
    };
    let b_before = served(&s);
    s.hold(FAULT).await;
    let b_after = served(&s);
    if b_after < b_before + 100 {
        s.fail(format!(
            "eu/b did not go on serving while eu/a was down ({b_before} -> {b_after} operations)"
        ));
    }
    s.c.restart_node("eu", "a");
    if let Err(e) =
        s.c.try_wait_node_ready("eu", "a", Duration::from_secs(20))
            .await
    {
        s.fail(format!("the restarted eu/a never became ready: {e}"));
    }
    s.end();
    s.hold(AFTER).await;
    s.finish().await;
}

/// The region's Redis is killed and restarted empty under load: a new epoch
/// (actor) starts, nothing already published is lost or counted twice, the
/// global count is exact up to what was charged but not yet published when
/// Redis died, and the nodes report the epoch change.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_redis_restarted_empty() {
    let mut s = Scenario::start("region_redis_restarted_empty", STANDARD).await;
    s.hold(WARMUP).await;
    let epoch_before = s.c.redis_counter("eu", "t").await.map(|(e, _, _)| e);
    s.begin("eu Redis kill -9, restarted empty");
    // eu's publishers read what to publish from that Redis.
    s.pipeline_fault();
    let from = now_us();
    s.c.restart_redis_empty("eu").await;
    // Charged since the region last published the tenant was never
    // published: up to flush_interval (100 ms) for an urgent tenant, up to
    // relaxed_flush_interval (2 s by default) for the others; allow 1 s for
    // a slow flush.
    s.data_loss = Some(("eu", from.saturating_sub(3_000_000), from));
    s.tier_reset.push((from, now_us()));
    // Reported by the aggregator, which sees the region's new epoch beside
    // the old one in every counter the region charges again (the nodes see
    // it only for the tenants their view holds: near their global limit).
    let epochs_before =
        s.c.aggregator_metric("tierlimit_aggregator_epoch_changes_total")
            .await
            .unwrap_or(0.0);
    s.hold(FAULT).await;
    s.end();
    let epoch_after = s.c.redis_counter("eu", "t").await.map(|(e, _, _)| e);
    if epoch_before.is_none() || epoch_before == epoch_after {
        s.fail(format!(
            "eu's epoch did not change: {epoch_before:?} -> {epoch_after:?}"
        ));
    }
    s.hold(AFTER).await;
    let epochs =
        s.c.aggregator_metric("tierlimit_aggregator_epoch_changes_total")
            .await
            .unwrap_or(0.0);
    if epochs < epochs_before + 1.0 {
        s.fail(format!(
            "the aggregator reported no new eu epoch ({epochs_before} -> {epochs})"
        ));
    }
    let view = s.c.aggregator_view("t").await;
    let eu_epochs = view["today"]["parts"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|p| {
                    p["actor"]
                        .as_str()
                        .is_some_and(|x| x.starts_with("eu/") && !x.starts_with("eu/local-"))
                })
                .count()
        })
        .unwrap_or(0);
    if eu_epochs < 2 {
        s.fail(format!(
            "the aggregator should sum two eu epochs (old and new): {view}"
        ));
    }
    s.finish().await;
}

/// The region's Redis becomes unreachable (packets dropped) under load, for
/// three tenants whose plans fail `open`, `closed` and `local`: open allows
/// everything uncounted, closed answers 503, local enforces node-local
/// limits (node tier, region tier ÷ 2 nodes) and counts under a local actor;
/// all go back to Redis after the heal, and the global count is exact up to
/// the few checks whose Redis call timed out (their outcome is unknown to
/// the node; see `timed_out_redis_calls_are_not_applied_after_the_heal`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_redis_unreachable_each_fail_mode() {
    // No refunds here: a refund taken in `local` mode answers `"mode":
    // "open"`, so the history could not tell it from an `open` no-op.
    let traffic: &[(&str, f64, u32)] =
        &[("open", 20.0, 0), ("closed", 20.0, 0), ("local", 40.0, 0)];
    let mut s = Scenario::start("region_redis_unreachable_each_fail_mode", traffic).await;
    s.hold(WARMUP).await;
    s.begin("eu Redis unreachable (DROP)");
    s.c.topo.block_port("eu", harness::cluster::REDIS_PORT);
    let f0 = now_us();
    let eu = region_nodes("eu");
    s.expect_dip(&eu, "tierlimit_store_up", 0.0);
    s.hold(FAULT).await;
    let f1 = now_us();
    s.c.topo.heal();
    s.end();
    // Every eu node uses Redis again.
    let start = Instant::now();
    loop {
        let mut up = 0;
        for n in s.c.nodes.iter().filter(|n| n.region == "eu") {
            if s.c.node_metric(n, "tierlimit_store_up").await == Some(1.0) {
                up += 1;
            }
        }
        if up == eu.len() {
            s.c.log(&format!(
                "eu back on Redis {:.2}s after the heal",
                start.elapsed().as_secs_f64()
            ));
            break;
        }
        if start.elapsed() > RECOVERY {
            s.fail("eu nodes did not go back to Redis after the heal".into());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.hold(AFTER).await;
    // What eu answered during the fault, per mode (from one store timeout
    // after the cut, when the breaker has surely opened, to the heal).
    let ev = s.c.history.events();
    let during = |e: &&history::Event| {
        e.region == "eu" && e.op == Op::Check && e.start_us > f0 + 1_000_000 && e.end_us < f1
    };
    let modes = |tenant: &str| {
        let mut m: BTreeMap<String, u64> = BTreeMap::new();
        for e in ev.iter().filter(|e| e.tenant == tenant).filter(during) {
            let k = match &e.outcome {
                Outcome::Ok { mode } => format!("ok-{mode}"),
                Outcome::Denied { tier, mode } => format!("denied-{tier}-{mode}"),
                Outcome::Unavailable => "503".into(),
                Outcome::Unknown(_) => "unknown".into(),
            };
            *m.entry(k).or_default() += 1;
        }
        m
    };
    let (open, closed, local) = (modes("open"), modes("closed"), modes("local"));
    println!("eu during the fault: open {open:?}\n  closed {closed:?}\n  local {local:?}");
    if !(open.keys().all(|k| k == "ok-open") && open.get("ok-open").is_some_and(|n| *n > 50)) {
        s.fail(format!(
            "open: every check during the fault should be allowed in open mode: {open:?}"
        ));
    }
    if !(closed.keys().all(|k| k == "503") && closed.get("503").is_some_and(|n| *n > 50)) {
        s.fail(format!(
            "closed: every check during the fault should get 503: {closed:?}"
        ));
    }
    if !(local.keys().all(|k| k.ends_with("-local"))
        && local.get("ok-local").is_some_and(|n| *n > 20))
    {
        s.fail(format!(
            "local: every check during the fault should be decided in local mode: {local:?}"
        ));
    }
    if !local.keys().any(|k| k.starts_with("denied-")) {
        s.fail(format!(
            "local: the node-local limits never denied: {local:?}"
        ));
    }
    s.finish().await;
}

/// 200 ms ± 50 ms of delay each way plus 5% packet loss between one region
/// and Kafka, through a delaying forwarder inside the region's namespace
/// (DNAT, transparent to librdkafka): the region keeps publishing and
/// following, slower, and everything stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_lossy_link_between_region_and_kafka() {
    let mut s = Scenario::start("slow_lossy_link_between_region_and_kafka", STANDARD).await;
    s.hold(WARMUP).await;
    s.begin("eu <-> core: 200ms +- 50ms delay each way, 5% loss");
    s.c.topo.delay(
        "eu",
        "core",
        harness::cluster::KAFKA_PORT,
        Duration::from_millis(200),
        Duration::from_millis(50),
    );
    s.c.topo.lossy("eu", "core", 0.05);
    s.pipeline_fault();
    let eu = region_nodes("eu");
    s.hold(Duration::from_secs(6)).await;
    let bytes = s.c.topo.delayed_bytes();
    println!("eu fault rules:\n{}", s.c.topo.fault_counters("eu"));
    if bytes == 0 {
        s.fail("no byte went through the delaying forwarder".into());
    }
    // Slow, not cut: eu still publishes and follows within a few round trips.
    let mut behind = Vec::new();
    for n in s.c.nodes.iter().filter(|n| n.region == "eu") {
        if let Some(text) = s.c.node_metrics_text(n).await {
            let (age, lag) = (
                metric_value(&text, "tierlimit_view_age_seconds"),
                publish_lag(&text, now_us()),
            );
            println!(
                "{} on the slow link: view age {age:.2}s, publish lag {lag:.2}s",
                n.name()
            );
            // 5 % loss on a 400 ms round trip: TCP's retransmission backoff
            // (RTO doubling on a segment lost twice) can hold one connection
            // for several seconds, so a few seconds of age are physics, not
            // a stall; a cut grows without bound.
            if !(age < 10.0 && lag < 10.0) {
                behind.push(format!("{} fell behind on a slow (not cut) link: view age {age:.2}s, publish lag {lag:.2}s", n.name()));
            }
        }
    }
    for b in behind {
        s.fail(b);
    }
    s.c.topo.heal();
    s.end();
    s.c.log(&format!(
        "{bytes} bytes went through the delaying forwarder"
    ));
    s.recover_then_finish(&eu).await;
}

/// A region is cut from Kafka, the aggregator is killed, and the partition
/// heals while the restarted aggregator is rebuilding: the cut region's
/// backlog and the rebuild meet, and the count is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partition_heals_while_aggregator_restarts() {
    let mut s = Scenario::start("partition_heals_while_aggregator_restarts", STANDARD).await;
    s.hold(WARMUP).await;
    s.begin("eu cut from core; aggregator kill -9; restart; heal during the rebuild");
    let down = Instant::now();
    s.c.topo.partition("eu", "core");
    s.pipeline_fault();
    s.hold(Duration::from_secs(2)).await;
    s.c.kill_aggregator();
    s.hold(Duration::from_secs(2)).await;
    s.c.restart_aggregator();
    // Heal as soon as the new aggregator answers HTTP, before it is ready.
    let url = s.c.agg_url("/healthz");
    let http = harness::http_client();
    harness::cluster::wait(
        "the restarted aggregator answers",
        harness::cluster::DEADLINE,
        async || http.get(&url).send().await.is_ok(),
    )
    .await;
    let ready_before_heal = http
        .get(s.c.agg_url("/readyz"))
        .send()
        .await
        .map(|r| r.status().as_u16() == 200)
        .unwrap_or(false);
    s.c.topo.heal();
    s.c.log(&format!(
        "healed; aggregator ready before the heal: {ready_before_heal}"
    ));
    s.c.wait_aggregator_ready().await;
    s.aggregator_gap = down.elapsed();
    s.end();
    let eu = region_nodes("eu");
    s.recover_then_finish(&eu).await;
}

/// Focused: a decision whose Redis call timed out was answered from the fail
/// mode (here `local`, and counted under the node's local actor). It must
/// not be charged in Redis as well once the network heals. The cut here
/// separates the nodes from their Redis but not the test, which reads
/// Redis during the cut: whatever Redis charges after that, with no traffic
/// running, was sent before the cut and delivered after the heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn timed_out_redis_calls_are_not_applied_after_the_heal() {
    let traffic: &[(&str, f64, u32)] = &[("t", 40.0, 0)];
    let mut s = Scenario::start(
        "timed_out_redis_calls_are_not_applied_after_the_heal",
        traffic,
    )
    .await;
    s.hold(Duration::from_secs(1)).await;
    s.begin("eu nodes cut from their Redis (DROP) 4s; traffic stops during the cut");
    s.c.topo
        .block_port_locally("eu", harness::cluster::REDIS_PORT);
    s.hold(Duration::from_secs(2)).await;
    for l in std::mem::take(&mut s.loads) {
        l.stop().await;
    }
    // Nothing runs now, and the nodes cannot reach Redis; the test can.
    let during = s.c.redis_counter("eu", "t").await.map(|(_, p, _)| p);
    s.hold(Duration::from_secs(2)).await;
    let still_during = s.c.redis_counter("eu", "t").await.map(|(_, p, _)| p);
    s.c.topo.heal();
    s.end();
    s.hold(Duration::from_secs(6)).await;
    let after = s.c.redis_counter("eu", "t").await.map(|(_, p, _)| p);
    let ev = s.c.history.events();
    let charged_by_redis: u64 = ev
        .iter()
        .filter(|e| {
            e.region == "eu"
                && e.tenant == "t"
                && e.op == Op::Check
                && e.mode() == Some("redis")
                && e.allowed()
        })
        .map(|e| e.cost)
        .sum();
    let timed_out: Vec<String> = ev
        .iter()
        .filter(|e| {
            e.region == "eu"
                && e.mode() == Some("local")
                && e.end_us - e.start_us >= STORE_TIMEOUT.as_micros() as u64
        })
        .map(|e| {
            format!(
                "{}/{} answered `local` after {:.0}ms",
                e.region,
                e.node,
                (e.end_us - e.start_us) as f64 / 1000.0
            )
        })
        .collect();
    println!(
        "eu's Redis P of t: {during:?} during the cut, {still_during:?} 2s later, {after:?} 6s after the heal (no traffic since the cut); \
         checks answered from Redis: {charged_by_redis}; answered from the fail mode after a store timeout: {timed_out:?}"
    );
    if after != Some(charged_by_redis) {
        s.fail(format!(
            "eu's Redis charged {after:?} units of t, the clients were answered from Redis for {charged_by_redis}: \
             {} request(s) answered from the `local` fail mode after their EVALSHA timed out were charged in Redis too \
             ({during:?} during the cut, {after:?} after the heal: {})",
            after.unwrap_or(0).saturating_sub(charged_by_redis),
            if after > still_during { "applied after the heal, from the node's old connection" } else { "applied before the timeout" }
        ));
    }
    s.finish().await;
}

/// Self-test of the fault injection: a partition cuts TCP between two
/// namespaces and a heal restores it; the delaying forwarder adds its delay
/// on both ways, transparently (same address and port); processes started
/// in a namespace are the program itself (`ip netns exec` execs in place,
/// so `PR_SET_PDEATHSIG` and the pid are the program's).
/// Issue 33's month limit of the partition suite: `m` may allow
/// [`M_LIMIT`] a calendar month (and far more a day); `mt` has a large
/// month limit and a refund after every 10th allowed check.
const M_LIMIT: u64 = 300;
const MONTH_PLANS: &str = r#"
[plans.month]
global = { day = 100000000, month = 300 }
[plans.month_big]
global = { day = 100000000, month = 100000000 }
[tenants.m]
plan = "month"
[tenants.mt]
plan = "month_big"
"#;
/// The deployment's month ends this long after its clock offset is
/// computed: the cluster starts in that time (1 to 12 s on 2 cores).
const MONTH_END_IN: Duration = Duration::from_secs(26);
/// Traffic starts this long before the month's end, in Redis' clock: at
/// 4 × 12 checks a second `m` reaches its month limit in the old month.
const TRAFFIC_BEFORE_END: Duration = Duration::from_secs(11);
/// The least old-month traffic for the test to mean something: if the
/// cluster came up later than this before the month's end, it fails.
const LEAST_BEFORE_END: Duration = Duration::from_secs(8);
/// `eu` is cut from the core from this long before the month's end...
const CUT_BEFORE_END: Duration = Duration::from_secs(5);
/// ...to this long after it.
const CUT_AFTER_END: Duration = Duration::from_secs(5);

/// A partition spanning a calendar month's end (issue 33). Every clock that
/// decides (each region's Redis, whose `TIME` places a decision in its
/// period; the nodes; the aggregator) runs under libfaketime, offset so
/// that the month ends about [`MONTH_END_IN`] after the test starts; Tansu
/// and the test keep the real clock. `eu` and `us` drive `m` (month limit
/// [`M_LIMIT`]) and `mt` (refunds) from 11 s before the end; `eu` is cut
/// from the broker and the aggregator from 5 s before to 5 s after it,
/// then healed. From the clients' record, each answer placed in its month
/// by the period its reply names (`tiers[].period`, `reset_ms`):
///
/// 1. in each month `m` reached its limit, and its overshoot is within the
///    design's bound (others' traffic within the staleness of each
///    region's view: `history::overshoot`, on that month's operations);
/// 2. each month's count is exact once healed: allowed − refunded of that
///    month equals what the regions charged in it (their Redis' counters of
///    that month, plus what nodes charged in `local` mode), or, for an
///    answer that did not say what was charged, that lies within the
///    record's range; and the aggregator holds exactly the regions' count
///    of each month: its last broadcast of it (`m`), its dashboard's units
///    of the period (the closed month is not in `GET /v1/global/{tenant}`,
///    which lists the current month only), its current month in
///    `periods`, and its `yesterday` and `today` (the day tier, whose days
///    the month's end also splits: each day's count is its month's);
/// 3. the cut showed in eu's metrics; no process panicked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn region_cut_from_kafka_across_a_month_end() {
    use tierlimit_shared::period::{Period, PeriodKind};
    let name = "region_cut_from_kafka_across_a_month_end";
    let real_ms = now_us() / 1000;
    // The month that ends at least MONTH_END_IN from now (the next one if
    // the real month ends sooner), and the whole seconds that put its end
    // MONTH_END_IN ahead.
    let lead_ms = MONTH_END_IN.as_millis() as u64;
    let end_ms = PeriodKind::Month.at(real_ms + lead_ms).end_ms();
    let offset_s = (end_ms - (real_ms + lead_ms) as i64).div_euclid(1000);
    let offset_ms = offset_s * 1000;
    let old_month = PeriodKind::Month.at(end_ms as u64 - 1);
    let new_month = old_month.next();
    let (old_day, new_day) = (
        Period::day((end_ms / 86_400_000) as u32 - 1),
        Period::day((end_ms / 86_400_000) as u32),
    );
    println!(
        "== {name}: clocks {offset_s:+} s: {} ends in {:.1}s",
        old_month.human(),
        (end_ms - offset_ms) as f64 / 1000.0 - real_ms as f64 / 1000.0
    );
    let spec = Spec {
        plans: format!("{}{MONTH_PLANS}", plans()),
        node_extra: String::new(),
        kafka_extra: String::new(),
        env: Vec::new(),
        bin_dir: None,
        clock_offset_s: offset_s,
        limits: None,
    };
    let mut s = Scenario::launch(name, &[], spec, None).await;
    let end = end_ms as u64;
    let redis_ms = async |s: &Scenario| s.c.redis_time_ms("eu").await.unwrap_or(0);
    // The faked clocks are the deployment's: Redis' agrees with the offset.
    let skew = redis_ms(&s).await as i64 - (now_us() / 1000) as i64 - offset_ms;
    assert!(
        skew.abs() < 2000,
        "eu's Redis clock is {skew} ms off the offset {offset_s} s: libfaketime did not take"
    );
    let until = async |s: &Scenario, what: &str, at_ms: u64| {
        wait(what, DEADLINE, async || redis_ms(s).await >= at_ms).await
    };
    let left = end.saturating_sub(redis_ms(&s).await);
    assert!(
        left >= LEAST_BEFORE_END.as_millis() as u64,
        "the cluster was ready only {left} ms before the month's end (at least {LEAST_BEFORE_END:?} of traffic is needed before it): raise MONTH_END_IN"
    );
    let before = |d: Duration| end - d.as_millis() as u64;
    until(
        &s,
        "11 s before the month's end",
        before(TRAFFIC_BEFORE_END),
    )
    .await;
    let regions = ["eu", "us"];
    s.loads.push(s.c.load("m", &regions, 12.0, 0));
    s.loads.push(s.c.load("mt", &regions, 5.0, 10));
    s.tenants = vec!["m", "mt"];
    until(&s, "5 s before the month's end", before(CUT_BEFORE_END)).await;
    s.begin("eu cut from core (broker + aggregator) across the month's end");
    s.c.topo.partition("eu", "core");
    let eu = region_nodes("eu");
    s.expect_cut_from_kafka(&eu, secs(CUT_BEFORE_END + CUT_AFTER_END) - 2.0);
    until(
        &s,
        "5 s after the month's end",
        end + CUT_AFTER_END.as_millis() as u64,
    )
    .await;
    s.c.topo.heal();
    s.end();
    s.expect_recovery(&eu).await;
    s.hold(AFTER).await;
    for l in std::mem::take(&mut s.loads) {
        l.stop().await;
    }
    s.c.log("traffic stopped");
    let ev = s.c.history.events();
    println!("history: {} operations", ev.len());
    let samples = s.sampler.take().expect("sampler").stop().await;

    let mut wants = BTreeMap::new();
    for tenant in ["m", "mt"] {
        // 2. Each month's and each day's count, from the record.
        let mut want = BTreeMap::new();
        for period in [old_month, new_month, old_day, new_day] {
            let (evs, unplaced) = history::events_in_period(&ev, tenant, period, offset_ms);
            if !unplaced.is_empty() {
                s.fail(format!(
                    "{tenant}: {} operations not placed in a {}, e.g. {}",
                    unplaced.len(),
                    period.kind.name(),
                    unplaced[0]
                ));
            }
            print!(
                "{} {}: {}",
                period.human(),
                period.kind.name(),
                history::summary(&evs, tenant)
            );
            let g = history::global_expectation(&evs, tenant, STORE_TIMEOUT);
            // What the regions charged in the period: their Redis' counters
            // plus what nodes charged in `local` mode (answered from the
            // plan's fail mode when a Redis call outlasted the store timeout
            // on a loaded machine; those answers are certain, and counted
            // by the node's own actor, not in Redis). The record's count
            // exactly, or, when an answer did not say what was charged
            // (a local or 503 answer after a store timeout, no answer),
            // within its range. The aggregator must hold exactly this.
            let mut truth = 0;
            for r in REGIONS {
                if let Some((p, n)) = s.c.redis_period_counter(r, tenant, period).await {
                    truth += p - n;
                }
            }
            let local: i64 = evs
                .iter()
                .filter(|e| e.mode() == Some("local") && e.allowed())
                .map(|e| match e.op {
                    Op::Check => e.cost as i64,
                    Op::Refund => -(e.refunded.unwrap_or(e.cost) as i64),
                })
                .sum();
            let truth = (truth as i64 + local) as u64;
            let (lo, hi) = g.range();
            println!(
                "{tenant} in {}: {g:?}; the regions' Redis and local actors {truth} (local {local})",
                period.human()
            );
            if (g.is_exact() && truth != g.net()) || !(lo..=hi).contains(&truth) {
                s.fail(format!(
                    "{tenant} in {}: the regions count {truth} (Redis + local {local}), the record {} (accepted {lo}..={hi}): {g:?}",
                    period.human(),
                    g.net()
                ));
            }
            if g.counted == 0 {
                s.fail(format!("{tenant}: nothing allowed in {}", period.human()));
            }
            want.insert(period, truth);
            // 1. The month tier's overshoot, month by month.
            if tenant == "m" && period.kind == PeriodKind::Month {
                let o =
                    history::overshoot(&evs, tenant, M_LIMIT, |r, at| s.staleness(&samples, r, at));
                print!("{} {}", period.human(), o.describe());
                println!(
                    "OVERSHOOT {name} {}: allowed {} of {} (overshoot {}), bound {}",
                    period.human(),
                    o.allowed,
                    o.limit,
                    o.overshoot,
                    o.bound
                );
                if o.allowed < M_LIMIT {
                    s.fail(format!(
                        "m: only {} allowed in {}: the month limit {M_LIMIT} was never reached",
                        o.allowed,
                        period.human()
                    ));
                }
                if !o.within_bound() {
                    s.fail(format!(
                        "m in {}: overshoot {} exceeds the design's bound {}",
                        period.human(),
                        o.overshoot,
                        o.bound
                    ));
                }
            }
        }
        // The whole month's units fall on its last day, the new month's on
        // its first: each day's count is its month's.
        for (m, d) in [(old_month, old_day), (new_month, new_day)] {
            if want[&m] != want[&d] {
                s.fail(format!(
                    "{tenant}: the regions count {} units in {} but {} in its day {}",
                    want[&m],
                    m.human(),
                    want[&d],
                    d.human()
                ));
            }
        }
        wants.insert(tenant, want);
    }

    // The aggregator, once healed and drained: per tenant, its current
    // month (`periods`), `yesterday` and `today`; the closed month by the
    // last broadcast of it (only a tenant near its limit is broadcast: `m`)
    // and by the dashboard's units per period, which hold every tenant's
    // counter of the period (only `m` and `mt` have month tiers).
    let agg = |v: &serde_json::Value| {
        let month = v["periods"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["kind"] == "month"))
            .filter(|p| p["period"] == new_month.label())
            .and_then(|p| p["total"].as_u64());
        let day = |d: &serde_json::Value, want: Period| {
            (d["day"].as_u64() == Some(want.index as u64))
                .then(|| d["total"].as_u64())
                .flatten()
        };
        (
            month,
            day(&v["yesterday"], old_day),
            day(&v["today"], new_day),
        )
    };
    let sum = |p: Period| wants.values().map(|w| w[&p]).sum::<u64>();
    let start = Instant::now();
    let mut seen = String::new();
    let converged = loop {
        let mut ok = true;
        seen.clear();
        for (tenant, w) in &wants {
            let v = s.c.aggregator_view(tenant).await;
            let got = agg(&v);
            ok &= v["caught_up"] == true
                && got == (Some(w[&new_month]), Some(w[&old_day]), Some(w[&new_day]));
            seen += &format!("{tenant}: (current month, yesterday, today) {got:?}; ");
        }
        let b = s.c.broadcast_totals("m").await;
        ok &= b.get(&old_month.label()) == Some(&wants["m"][&old_month])
            && b.get(&new_month.label()) == Some(&wants["m"][&new_month]);
        seen += &format!("m's last broadcasts {b:?}; ");
        let units = s.c.aggregator_period_units(&[old_month, new_month]).await;
        ok &= units == vec![Some(sum(old_month)), Some(sum(new_month))];
        seen += &format!("the dashboard's units of the two months {units:?}");
        if ok || start.elapsed() > Duration::from_secs(20) {
            break ok;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let record: Vec<String> = wants
        .iter()
        .map(|(t, w)| {
            format!(
                "{t}: {} {}, {} {}",
                old_month.human(),
                w[&old_month],
                new_month.human(),
                w[&new_month]
            )
        })
        .collect();
    if converged {
        s.c.log(&format!(
            "the aggregator holds the regions' counts exactly ({}): {seen}",
            record.join("; ")
        ));
    } else {
        s.fail(format!(
            "the aggregator does not hold the regions' counts ({}) 20 s after the heal: {seen}",
            record.join("; ")
        ));
    }

    // 3. The cut showed; no panics.
    for p in s.c.panics() {
        s.fail(format!("panic: {p}"));
    }
    s.check_metrics(&samples);
    println!(
        "== {name}: {} in {:.1}s",
        if s.failures.is_empty() {
            "ok"
        } else {
            "FAILED"
        },
        s.t0.elapsed().as_secs_f64()
    );
    if !s.failures.is_empty() {
        s.c.keep_logs = true;
        let Scenario { c, failures, .. } = s;
        drop(c);
        panic!(
            "{name}: {} failed checks:\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
}

#[test]
fn topology_self_test() {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    let topo = harness::topology::Topology::new(&["a", "b"]);
    let b = topo.host("b").clone();
    // An echo server on b:7000.
    let server = harness::topology::spawn_in_namespace(&b.ns, {
        let addr = SocketAddr::from((b.ip, 7000));
        move || {
            let l = TcpListener::bind(addr).expect("bind echo");
            for conn in l.incoming().take(3) {
                let Ok(mut c) = conn else { continue };
                let mut buf = [0u8; 64];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    // Round trip from a, in milliseconds, or the error.
    let rtt = |topo: &harness::topology::Topology| {
        let ns = topo.host("a").ns.clone();
        let to = SocketAddr::from((topo.host("b").ip, 7000));
        harness::topology::in_namespace(&ns, move || -> Result<f64, String> {
            let mut c = TcpStream::connect_timeout(&to, Duration::from_secs(1))
                .map_err(|e| e.to_string())?;
            c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let t = Instant::now();
            c.write_all(b"ping").map_err(|e| e.to_string())?;
            let mut buf = [0u8; 4];
            c.read_exact(&mut buf).map_err(|e| e.to_string())?;
            Ok(t.elapsed().as_secs_f64() * 1000.0)
        })
        .unwrap()
    };
    let direct = rtt(&topo).expect("a reaches b");
    topo.partition("a", "b");
    let cut = rtt(&topo);
    assert!(cut.is_err(), "a partition cuts a from b: {cut:?}");
    topo.heal();
    topo.delay(
        "a",
        "b",
        7000,
        Duration::from_millis(200),
        Duration::from_millis(50),
    );
    let slow = rtt(&topo).expect("a reaches b through the forwarder");
    assert!(
        topo.delayed_bytes() >= 4,
        "the bytes went through the forwarder"
    );
    assert!(
        (300.0..=700.0).contains(&slow),
        "two delayed ways of 150..250ms each, got {slow:.1}ms (direct {direct:.1}ms)"
    );
    topo.heal();
    println!("round trip a -> b: direct {direct:.2}ms, partitioned {cut:?}, delayed {slow:.1}ms");
    // `ip netns exec` runs the program itself, in the namespace.
    let mut p = topo.cmd("a", "sleep").arg("30").spawn();
    std::thread::sleep(Duration::from_millis(200));
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", p.pid())).unwrap();
    assert_eq!(
        comm.trim(),
        "sleep",
        "the pid is the program's, not a wrapper's"
    );
    let ns_of = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(
        ns_of(&p.pid().to_string()),
        ns_of("self"),
        "it runs in the namespace"
    );
    p.kill9();
    drop(topo);
    let _ = server;
}
