//! Limits as data end to end: tenants and plans as signed records of the
//! limits topic (real Tansu), written by the real `aggregator limits`
//! command, followed by real region-nodes and an aggregator, each node
//! keeping a copy in its region's real Redis.
//!
//! What would fail if the feature broke: a record not applied in a region
//! (the tenant stays unknown: 403), a change that does not take effect in
//! the current window, a forged or malformed record applied, a node that
//! cannot start without Kafka although its region has a copy, a status that
//! says "reached" before every node applied the version.

use std::path::{Path, PathBuf};
use std::time::Duration;

use harness::limits::{allowed_until_refused, check, reached, ready};
use harness::{temp_dir, wait_for, wait_until, write_config, Aggregator, Redis, RegionNode, Tansu};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};

const PARTITIONS: i32 = 4;
const DELTAS: &str = "tierlimit.deltas";
const GLOBAL: &str = "tierlimit.global";
const LIMITS: &str = "tierlimit.limits";
const DEADLINE: Duration = Duration::from_secs(30);

struct World {
    tansu: Tansu,
    redis: Vec<(String, Redis)>,
    cfg: PathBuf,
    dir: harness::tempfile::TempDir,
}

impl World {
    async fn new(regions: &[&str]) -> World {
        let tansu = Tansu::start();
        tansu.create_topics(&[DELTAS, GLOBAL], PARTITIONS).await;
        tansu
            .create_topics_with_config(&[LIMITS], 1, &[("cleanup.policy", "compact")])
            .await;
        let redis: Vec<(String, Redis)> = regions
            .iter()
            .map(|r| (r.to_string(), Redis::start()))
            .collect();
        let dir = temp_dir();
        let mut w = World {
            tansu,
            redis,
            cfg: PathBuf::new(),
            dir,
        };
        w.cfg = w.config("topic", "");
        w
    }

    /// A configuration of this world with `limits.source = source` and
    /// `tables` (TOML) appended, written to a directory of its own (the
    /// world's first is `cfg`).
    fn config(&self, source: &str, tables: &str) -> PathBuf {
        let mut toml = format!(
            r#"
cluster = "test"
[kafka]
brokers = "{}"
partitions = {PARTITIONS}
[node]
flush_interval = "100ms"
store_timeout = "2s"
view_wait = "1s"
[aggregator]
broadcast_interval = "100ms"
group_id = "agg-limits"
[limits]
source = "{source}"
status_interval = "200ms"
lag_alert_after = "2s"
[unknown_tenants]
policy = "deny"
# The file keeps a plan of its own: tenants on the topic may name it.
[plans.free]
region = {{ limit = 100, window = "1h", algorithm = "fixed_window" }}
"#,
            self.tansu.brokers()
        );
        for (name, r) in &self.redis {
            toml += &format!(
                "[regions.{name}]\nredis_url = \"{}\"\nexpected_nodes = 1\n",
                r.url()
            );
        }
        toml += tables;
        let dir = self.dir.path().join(format!(
            "{source}-{}",
            self.dir.path().read_dir().unwrap().count()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        write_config(&dir, &toml)
    }

    fn redis(&self, region: &str) -> &Redis {
        &self.redis.iter().find(|(n, _)| n == region).unwrap().1
    }

    /// Writes `tables` (TOML `[plans]` / `[tenants]`) with the real
    /// `aggregator limits import`; returns the last version written.
    fn import(&self, name: &str, tables: &str) -> u64 {
        self.import_with(&self.cfg, name, tables)
    }

    /// [`World::import`] with the configuration `cfg`.
    fn import_with(&self, cfg: &Path, name: &str, tables: &str) -> u64 {
        let file = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, tables).unwrap();
        let out = run_aggregator(&[
            "limits",
            "import",
            "--config",
            path(cfg),
            "--file",
            path(&file),
            "--writer",
            "test",
        ]);
        last_version(&out)
    }

    /// A record written with the library's writer, past the command's
    /// checks: a tenant of a plan no record defines yet.
    async fn publish(&self, tenant: &str, plan: &str) -> u64 {
        use tierlimit_shared::limits::{write::Standalone, Body, Subject};
        let loaded = tierlimit_shared::Config::load(&self.cfg).unwrap();
        let mut w = Standalone::connect(&loaded.config, "test").await.unwrap();
        let written = w
            .publish(vec![(
                Subject::Tenant(tenant.into()),
                Body::Tenant(tierlimit_shared::config::TenantConfig {
                    time_zone: Default::default(),
                    plan: plan.into(),
                    node: None,
                    region: None,
                    global: None,
                    on_store_error: None,
                    grants: Vec::new(),
                }),
            )])
            .await
            .unwrap();
        written.records[0].version
    }

    fn delete_tenant(&self, tenant: &str) -> u64 {
        let out = run_aggregator(&[
            "limits",
            "delete",
            "--config",
            path(&self.cfg),
            "--tenant",
            tenant,
        ]);
        out.trim()
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no version in {out:?}"))
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn run_aggregator(args: &[&str]) -> String {
    let out = std::process::Command::new(harness::bin_path("aggregator"))
        .args(args)
        .output()
        .expect("aggregator runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "aggregator {args:?} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `… (versions A..=B)` → B.
fn last_version(out: &str) -> u64 {
    out.rsplit("..=")
        .next()
        .and_then(|s| s.trim().trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| panic!("no versions in {out:?}"))
}

async fn node_metric(n: &RegionNode, sample: &str) -> f64 {
    let text = n
        .http
        .get(n.admin_url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    harness::metric_sample(&text, sample).unwrap_or(0.0)
}

const PRO_3: &str = r#"
[plans.pro]
region = { limit = 3, window = "1h", algorithm = "fixed_window" }
[tenants.acme]
plan = "pro"
[tenants.globex]
plan = "pro"
region = { limit = 2, algorithm = "sliding_window" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_apply_in_every_region_at_once_and_forgeries_change_nothing() {
    let w = World::new(&["eu", "us"]).await;
    let agg = Aggregator::start(&w.cfg).await;
    let eu = RegionNode::start(&w.cfg, "eu", "e1").await;
    let us = RegionNode::start(&w.cfg, "us", "u1").await;
    ready(&eu).await;
    ready(&us).await;

    // 1. Registered on the topic: known in both regions, with the plan's
    //    limit and the tenant's override; a tenant whose plan no record
    //    defines yet is unknown (denied here), a stranger too.
    w.import("first", PRO_3);
    let v1 = w.publish("initech", "gold").await;
    let status = reached(&agg, v1, 2).await;
    assert_eq!(status["lagging"], json!([]), "{status}");
    for n in [&eu, &us] {
        assert_eq!(
            allowed_until_refused(n, "acme", 10).await,
            (3, 429),
            "{}",
            n.region
        );
        assert_eq!(allowed_until_refused(n, "globex", 10).await, (2, 429));
        assert_eq!(
            check(n, "initech").await,
            403,
            "its plan is not applied yet"
        );
        assert_eq!(check(n, "stranger").await, 403);
    }

    // 2. Raised: the tenant gets through in the current window (3 of 5
    //    spent: two more), in every region, with no restart or reload.
    let v2 = w.import(
        "raise",
        "[plans.pro]\nregion = { limit = 5, window = \"1h\", algorithm = \"fixed_window\" }\n",
    );
    reached(&agg, v2, 2).await;
    for n in [&eu, &us] {
        assert_eq!(
            allowed_until_refused(n, "acme", 10).await,
            (2, 429),
            "{}",
            n.region
        );
    }

    // 3. Lowered below what is spent: denied at once; a tenant of the plan
    //    that spent nothing gets the new limit exactly.
    let v3 = w.import(
        "lower",
        "[plans.pro]\nregion = { limit = 1, window = \"1h\", algorithm = \"fixed_window\" }\n\
         [tenants.hooli]\nplan = \"pro\"\n",
    );
    reached(&agg, v3, 2).await;
    for n in [&eu, &us] {
        assert_eq!(check(n, "acme").await, 429, "{}", n.region);
        assert_eq!(allowed_until_refused(n, "hooli", 10).await, (1, 429));
    }

    // 4. The pending tenant's plan arrives: it applies; a deletion denies.
    let v4 = w.import(
        "gold",
        "[plans.gold]\nregion = { limit = 4, window = \"1h\", algorithm = \"fixed_window\" }\n",
    );
    reached(&agg, v4, 2).await;
    assert_eq!(allowed_until_refused(&eu, "initech", 10).await, (4, 429));
    let v5 = w.delete_tenant("acme");
    reached(&agg, v5, 2).await;
    assert_eq!(check(&eu, "acme").await, 403);
    assert_eq!(check(&us, "acme").await, 403);

    // 5. Forged, unsigned and malformed records on the real topic, each
    //    bringing acme back with a huge limit at a huge version: refused
    //    and counted; the deletion stays. A valid record written after
    //    them tells when they have been read.
    let forged = {
        use tierlimit_shared::limits::{Body, LimitsRecord, LimitsSigner, Subject};
        let rec = LimitsRecord {
            subject: Subject::Tenant("acme".into()),
            version: u64::MAX / 2,
            writer: "mallory".into(),
            ts_ms: 0,
            body: Body::Tenant(tierlimit_shared::config::TenantConfig {
                time_zone: Default::default(),
                plan: "free".into(),
                node: None,
                region: None,
                global: None,
                on_store_error: None,
                grants: Vec::new(),
            }),
        };
        let wrong_key = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
        let mut out = LimitsSigner::with_key(Some((harness::wire_keys::LIMITS_KEY, wrong_key)))
            .encode(std::slice::from_ref(&rec));
        out.extend(LimitsSigner::with_key(None).encode(std::slice::from_ref(&rec)));
        out.push(("t|acme".into(), b"\x03\x04not a record".to_vec()));
        out
    };
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", w.tansu.brokers())
        .create()
        .unwrap();
    for (key, value) in &forged {
        producer
            .send(
                FutureRecord::to(LIMITS)
                    .partition(0)
                    .key(key)
                    .payload(value),
                Duration::from_secs(10),
            )
            .await
            .expect("produced");
    }
    let v6 = w.import("marker", "[tenants.marker]\nplan = \"free\"\n");
    reached(&agg, v6, 2).await;
    for n in [&eu, &us] {
        assert_eq!(
            check(n, "acme").await,
            403,
            "{}: a forgery applied",
            n.region
        );
        assert_eq!(check(n, "marker").await, 200);
        for reason in ["bad_signature", "unsigned", "corrupt"] {
            let sample = format!("tierlimit_limits_records_total{{outcome=\"{reason}\"}}");
            assert_eq!(node_metric(n, &sample).await, 1.0, "{}: {reason}", n.region);
        }
        let applied = node_metric(n, "tierlimit_limits_applied_version").await;
        assert_eq!(applied as u64, v6.min(i64::MAX as u64), "{}", n.region);
    }

    // 6. The status names every node and its version, and the aggregator's
    //    gauge counts them current.
    let status = reached(&agg, v6, 2).await;
    let names: Vec<String> = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            format!(
                "{}/{}",
                n["region"].as_str().unwrap(),
                n["node"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(names, ["eu/e1", "us/u1"], "{status}");
    assert_eq!(status["newest"], json!(v6));
    // (The gauge is refreshed by the aggregator's housekeeping, every
    // second.)
    wait_until(
        "the aggregator counts both nodes current",
        DEADLINE,
        || async {
            let url = agg.admin_url("/metrics");
            let text = agg
                .http
                .get(url)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            harness::metric_sample(
                &text,
                "tierlimit_aggregator_limits_nodes{state=\"current\"}",
            ) == Some(2.0)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_without_kafka_serves_the_regions_copy_and_without_one_waits() {
    let w = World::new(&["eu"]).await;
    let agg = Aggregator::start(&w.cfg).await;
    let v = w.import("first", PRO_3);
    {
        let e1 = RegionNode::start(&w.cfg, "eu", "e1").await;
        ready(&e1).await;
        reached(&agg, v, 1).await;
        // The copy's mark reaches the last record's offset (3 records:
        // offsets 0..=2).
        let redis = w.redis("eu");
        wait_until("the region's copy written", DEADLINE, || async {
            let mut c = redis.client().await;
            let tag = tierlimit_shared::keys::bucket_tag(0);
            let mark: Option<String> = redis::cmd("HGET")
                .arg(format!("tl:{{{tag}}}:lim:mark"))
                .arg("mark")
                .query_async(&mut c)
                .await
                .unwrap_or(None);
            mark.is_some_and(|m| m.starts_with("2|"))
        })
        .await;
        // Spend one of acme's three in the region.
        assert_eq!(check(&e1, "acme").await, 200);
    }

    // Kafka unreachable (a closed port): after view_wait the node serves
    // the region's copy, and says so.
    let unreachable = [("TIERLIMIT__KAFKA__BROKERS", "127.0.0.1:1")];
    let e2 = RegionNode::start_with_env(&w.cfg, "eu", "e2", &unreachable).await;
    // (Not ready as a whole: the broadcast view is unreachable too.)
    let body: Value = wait_for("e2 serves the region's copy", DEADLINE, || async {
        let v: Value = reqwest::get(e2.url("/readyz"))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (v["limits"]["ready"] == true).then_some(v)
    })
    .await;
    assert_eq!(body["limits"]["from_region_copy"], true, "{body}");
    assert_eq!(body["limits"]["applied_version"], json!(v), "{body}");
    assert_eq!(allowed_until_refused(&e2, "acme", 10).await, (2, 429));
    assert_eq!(allowed_until_refused(&e2, "globex", 10).await, (2, 429));
    assert_eq!(check(&e2, "stranger").await, 403);
    assert_eq!(
        node_metric(&e2, "tierlimit_limits_from_region_copy").await,
        1.0
    );

    // Neither Kafka nor a copy (another region's empty Redis): not ready,
    // and a check is shed (503 limits-not-ready), nothing charged.
    let empty = Redis::start();
    let alone = [
        ("TIERLIMIT__KAFKA__BROKERS", "127.0.0.1:1"),
        ("TIERLIMIT__REGIONS__EU__REDIS_URL", &*empty.url()),
    ];
    let e3 = RegionNode::start_with_env(&w.cfg, "eu", "e3", &alone).await;
    let r = reqwest::get(e3.url("/readyz")).await.unwrap();
    assert_eq!(r.status(), 503);
    let r = e3
        .http
        .post(e3.url("/v1/check"))
        .json(&json!({ "tenant": "acme" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let problem: Value = r.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("limits-not-ready")),
        "{problem}"
    );
}

/// Checks of `tenant` under counting key `key`, until the first refusal.
async fn keyed_until_refused(n: &RegionNode, tenant: &str, key: &str, max: u32) -> (u32, u16) {
    for i in 0..max {
        let s = n
            .http
            .post(n.url("/v1/check"))
            .json(&json!({ "tenant": tenant, "key": key }))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0);
        if s != 200 {
            return (i, s);
        }
    }
    (max, 200)
}

/// Item 4's four effects on every algorithm, on one node (window one day,
/// so nothing ends during the test). Each plan has a region tier of 4:
///
/// - raised to 8 after 2 spent: let through in the current window (6
///   more; a token bucket 4: its bucket keeps its level and fills at the
///   new rate);
/// - lowered to 2 after 3 spent: denied at once;
/// - moved to a plan of another algorithm after the 4 spent: still
///   denied (the new algorithm's state is empty: without the old window
///   carried, 4 more would pass), while a tenant that spent 1 and moved
///   gets exactly 3;
/// - its plan turned `key_scoped` after the 4 spent: a key is still
///   denied (its own window is empty); a tenant of the plan that spent
///   nothing is held, all keys together, to the old whole-tenant window
///   until it ends; one registered after the change gets 4 per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_applies_at_once_and_a_new_shape_grants_no_free_burst_on_every_algorithm() {
    const ALGS: [(&str, &str); 4] = [
        ("fw", "fixed_window"),
        ("sw", "sliding_window"),
        ("tb", "token_bucket"),
        ("sl", "sliding_log"),
    ];
    let plan = |name: &str, alg: &str, keyed: bool| {
        format!(
            "[plans.{name}]\nregion = {{ limit = 4, window = \"1d\", algorithm = \"{alg}\" }}\n\
             key_scoped = {keyed}\n"
        )
    };
    let next = |i: usize| ALGS[(i + 1) % ALGS.len()].0;
    let w = World::new(&["eu"]).await;
    let agg = Aggregator::start(&w.cfg).await;
    let n = RegionNode::start(&w.cfg, "eu", "e1").await;
    ready(&n).await;

    let mut first = String::new();
    for (a, alg) in ALGS {
        first += &plan(a, alg, false);
        first += &plan(&format!("k{a}"), alg, false);
        for t in ["raise", "lower", "switch", "fresh"] {
            first += &format!("[tenants.{t}-{a}]\nplan = \"{a}\"\n");
        }
        first += &format!("[tenants.keyed-{a}]\nplan = \"k{a}\"\n");
        first += &format!("[tenants.newkey-{a}]\nplan = \"k{a}\"\n");
    }
    let v1 = w.import("first", &first);
    reached(&agg, v1, 1).await;
    for (a, _) in ALGS {
        assert_eq!(
            allowed_until_refused(&n, &format!("raise-{a}"), 2).await,
            (2, 200)
        );
        assert_eq!(
            allowed_until_refused(&n, &format!("lower-{a}"), 3).await,
            (3, 200)
        );
        assert_eq!(
            allowed_until_refused(&n, &format!("switch-{a}"), 10).await,
            (4, 429),
            "{a}"
        );
        assert_eq!(
            allowed_until_refused(&n, &format!("fresh-{a}"), 1).await,
            (1, 200)
        );
        assert_eq!(
            allowed_until_refused(&n, &format!("keyed-{a}"), 10).await,
            (4, 429),
            "{a}"
        );
    }

    let mut change = String::new();
    for (i, (a, alg)) in ALGS.iter().enumerate() {
        change += &format!("[tenants.raise-{a}]\nplan = \"{a}\"\nregion = {{ limit = 8 }}\n");
        change += &format!("[tenants.lower-{a}]\nplan = \"{a}\"\nregion = {{ limit = 2 }}\n");
        change += &format!("[tenants.switch-{a}]\nplan = \"{}\"\n", next(i));
        change += &format!("[tenants.fresh-{a}]\nplan = \"{}\"\n", next(i));
        change += &plan(&format!("k{a}"), alg, true);
        change += &format!("[tenants.later-{a}]\nplan = \"k{a}\"\n");
    }
    let v2 = w.import("change", &change);
    reached(&agg, v2, 1).await;
    for (a, _) in ALGS {
        let raised = if a == "tb" { 4 } else { 6 };
        assert_eq!(
            allowed_until_refused(&n, &format!("raise-{a}"), 10).await,
            (raised, 429),
            "{a}: raised"
        );
        assert_eq!(
            allowed_until_refused(&n, &format!("lower-{a}"), 10).await,
            (0, 429),
            "{a}: lowered"
        );
        assert_eq!(
            allowed_until_refused(&n, &format!("switch-{a}"), 10).await,
            (0, 429),
            "{a}: another algorithm must not start afresh"
        );
        assert_eq!(
            allowed_until_refused(&n, &format!("fresh-{a}"), 10).await,
            (3, 429),
            "{a}: moved after one: the old window's three"
        );
        assert_eq!(
            keyed_until_refused(&n, &format!("keyed-{a}"), "k1", 10).await,
            (0, 429),
            "{a}: a key must not start afresh"
        );
        // Until the old window ends, the tenant as a whole is held to it
        // (under the new limit): its keys together get what it had left.
        assert_eq!(
            keyed_until_refused(&n, &format!("newkey-{a}"), "k1", 10).await,
            (4, 429),
            "{a}"
        );
        assert_eq!(
            keyed_until_refused(&n, &format!("newkey-{a}"), "k2", 10).await,
            (0, 429),
            "{a}: the old whole-tenant window is spent"
        );
        // A tenant registered after the change counts per key.
        for key in ["k1", "k2"] {
            assert_eq!(
                keyed_until_refused(&n, &format!("later-{a}"), key, 10).await,
                (4, 429),
                "{a}: per key"
            );
        }
    }
}

/// Item 5: a fleet moves from `[tenants]` in its TOML to the topic with a
/// rolling restart, processes of both sources side by side on one
/// region's count, and back with `aggregator limits export`. The import
/// runs with the file-source configuration the fleet already has.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_moves_from_toml_tenants_to_the_topic_and_back() {
    const PRO: &str =
        "[plans.pro]\nregion = { limit = 4, window = \"1h\", algorithm = \"fixed_window\" }\n";
    let tenants = "[tenants.acme]\nplan = \"pro\"\n[tenants.globex]\nplan = \"pro\"\nregion = { limit = 2 }\n";
    let w = World::new(&["eu"]).await;

    // 1. Today: every process reads its file.
    let file_cfg = w.config("file", &format!("{PRO}{tenants}"));
    let agg = Aggregator::start(&file_cfg).await;
    let e1 = RegionNode::start(&file_cfg, "eu", "e1").await;
    ready(&e1).await;
    assert_eq!(allowed_until_refused(&e1, "acme", 1).await, (1, 200));

    // 2. The file's own tables onto the topic, with that configuration.
    let v1 = w.import_with(&file_cfg, "move", &format!("{PRO}{tenants}"));

    // 3. A node on the topic (plans may stay in its file; no [tenants])
    //    joins the region beside the file one: one count, one limit.
    let topic_cfg = w.config("topic", PRO);
    let e2 = RegionNode::start(&topic_cfg, "eu", "e2").await;
    ready(&e2).await;
    assert_eq!(allowed_until_refused(&e2, "acme", 2).await, (2, 200));
    assert_eq!(allowed_until_refused(&e1, "acme", 10).await, (1, 429));
    assert_eq!(check(&e2, "acme").await, 429);
    assert_eq!(allowed_until_refused(&e2, "globex", 10).await, (2, 429));
    assert_eq!(check(&e1, "globex").await, 429);

    // 4. The rest of the fleet restarts on the topic; the count stays, and
    //    the status names both nodes at the import's version.
    drop(e1);
    let e1 = RegionNode::start(&topic_cfg, "eu", "e1").await;
    ready(&e1).await;
    assert_eq!(check(&e1, "acme").await, 429, "the count survived the move");
    drop(agg);
    let agg = Aggregator::start(&topic_cfg).await;
    reached(&agg, v1, 2).await;
    // Now a change reaches every node: a tenant only the topic has.
    let v2 = w.import("signup", "[tenants.initech]\nplan = \"pro\"\n");
    reached(&agg, v2, 2).await;
    assert_eq!(allowed_until_refused(&e1, "initech", 1).await, (1, 200));

    // 5. And back: the export is what a file-source configuration holds.
    let exported = run_aggregator(&["limits", "export", "--config", path(&topic_cfg)]);
    for t in ["acme", "globex", "initech"] {
        assert!(exported.contains(&format!("[tenants.{t}]")), "{exported}");
    }
    let back_cfg = w.config("file", &exported);
    drop(e2);
    let e2 = RegionNode::start(&back_cfg, "eu", "e2").await;
    ready(&e2).await;
    assert_eq!(check(&e2, "acme").await, 429);
    assert_eq!(check(&e2, "globex").await, 429);
    assert_eq!(allowed_until_refused(&e2, "initech", 10).await, (3, 429));
}
