//! Wire v2 end to end against a real Tansu broker, real redis-servers and
//! the real binaries: forged deltas and broadcasts produced to the real
//! topics are refused, counted and never applied; nodes and aggregators
//! writing v1 (JSON) and v2 (binary) side by side merge into one exact
//! total (the rolling upgrade).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use harness::{
    temp_dir, wait_until, wire_keys, write_config, Aggregator, Redis, RegionNode, Tansu,
};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{json, Value};
use tierlimit_shared::messages::{actor, now_ms, partition_of, ActorPart, Delta, GlobalUpdate};
use tierlimit_shared::wire::{keys, BroadcastSigner, DeltaSigner, Version};

const PARTITIONS: i32 = 4;
const DELTAS: &str = "tierlimit.deltas";
const GLOBAL: &str = "tierlimit.global";
const DEADLINE: Duration = Duration::from_secs(30);

/// Broker, one Redis per region, a config naming them (signed: the
/// harness adds every region's test keys), and the processes.
struct World {
    tansu: Tansu,
    _redis: Vec<Redis>,
    agg: Aggregator,
    eu: RegionNode,
    us: RegionNode,
    _dir: harness::tempfile::TempDir,
}

impl World {
    /// `env[i]` overrides the config of the aggregator (0), eu's node (1)
    /// and us's node (2).
    async fn start(
        common: &[(&'static str, &'static str)],
        env: [&[(&'static str, &'static str)]; 3],
    ) -> World {
        let tansu = Tansu::start();
        tansu.create_topics(&[DELTAS, GLOBAL], PARTITIONS).await;
        let redis = vec![Redis::start(), Redis::start()];
        let toml = format!(
            r#"
cluster = "wire"
[kafka]
brokers = "{brokers}"
partitions = {PARTITIONS}
[node]
# This suite checks the Redis path decision by decision: no leases.
lease_max = 0
flush_interval = "100ms"
store_timeout = "2s"
[aggregator]
broadcast_interval = "100ms"
group_id = "agg-wire"
# Every limited tenant is broadcast: these tests are about what the
# topic carries, not about the threshold (global.rs tests that).
broadcast_fraction = 0
[regions.eu]
redis_url = "{eu}"
[regions.us]
redis_url = "{us}"
[plans.g]
global = {{ limit = 100 }}
[unknown_tenants]
policy = "plan"
plan = "g"
"#,
            brokers = tansu.brokers(),
            eu = redis[0].url(),
            us = redis[1].url(),
        );
        let dir = temp_dir();
        let cfg = write_config(dir.path(), &toml);
        let with = |own: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
            common.iter().chain(own).copied().collect()
        };
        let agg = Aggregator::start_with_env(&cfg, &with(env[0])).await;
        let eu = RegionNode::start_with_env(&cfg, "eu", "a", &with(env[1])).await;
        let us = RegionNode::start_with_env(&cfg, "us", "a", &with(env[2])).await;
        let url = agg.url("/readyz");
        wait_until("aggregator ready", DEADLINE, || {
            let url = url.clone();
            async move { reqwest::get(url).await.is_ok_and(|r| r.status() == 200) }
        })
        .await;
        World {
            tansu,
            _redis: redis,
            agg,
            eu,
            us,
            _dir: dir,
        }
    }

    async fn produce(&self, topic: &str, tenant: &str, key: &str, payload: &[u8]) {
        let producer: FutureProducer = self.tansu.client_config().create().unwrap();
        producer
            .send(
                FutureRecord::to(topic)
                    .partition(partition_of(tenant, PARTITIONS))
                    .key(key)
                    .payload(payload),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }

    /// Every record of `topic` whose key starts with `prefix`: its first byte.
    fn first_bytes(&self, topic: &str, prefix: &str) -> HashSet<u8> {
        let mut cc = self.tansu.client_config();
        cc.set("group.id", "wire-reader")
            .set("enable.partition.eof", "true");
        let reader: BaseConsumer = cc.create().unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition_offset(topic, p, Offset::Beginning)
                .unwrap();
        }
        reader.assign(&tpl).unwrap();
        let mut firsts = HashSet::new();
        let mut eof = HashSet::new();
        let start = Instant::now();
        while eof.len() < PARTITIONS as usize {
            assert!(start.elapsed() < DEADLINE, "reading {topic} back");
            match reader.poll(Duration::from_millis(100)) {
                Some(Ok(m)) if m.key().is_some_and(|k| k.starts_with(prefix.as_bytes())) => {
                    firsts.insert(m.payload().unwrap()[0]);
                }
                Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                    eof.insert(p);
                }
                _ => {}
            }
        }
        firsts
    }
}

async fn check(node: &RegionNode, tenant: &str) -> u16 {
    node.http
        .post(node.url("/v1/check"))
        .json(&json!({ "tenant": tenant }))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

async fn allow(node: &RegionNode, tenant: &str, n: u64) {
    for _ in 0..n {
        assert_eq!(
            check(node, tenant).await,
            200,
            "{tenant} on {}",
            node.region
        );
    }
}

async fn agg_total(a: &Aggregator, tenant: &str) -> Option<u64> {
    let v = harness::try_json(&a.http, &a.url(&format!("/v1/global/{tenant}"))).await?;
    v["today"]["total"].as_u64()
}

/// The global total in a node's broadcast view.
async fn view_total(n: &RegionNode, tenant: &str) -> Option<u64> {
    let v: Value = harness::try_json(&n.http, &n.url(&format!("/v1/tenants/{tenant}"))).await?;
    v["global_total"].as_u64()
}

/// Samples of `name` by their `reason` label.
async fn by_reason(http: &reqwest::Client, url: &str, name: &str) -> BTreeMap<String, u64> {
    let text = harness::try_text(http, url).await.unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix("{reason=\"")?;
            let (reason, value) = rest.split_once("\"} ")?;
            Some((reason.to_owned(), value.trim().parse::<f64>().ok()? as u64))
        })
        .collect()
}

async fn wait_totals(w: &World, tenant: &str, want: u64) {
    wait_until(
        &format!("aggregator and both views at {want} for {tenant}"),
        DEADLINE,
        || async {
            agg_total(&w.agg, tenant).await == Some(want)
                && view_total(&w.eu, tenant).await == Some(want)
                && view_total(&w.us, tenant).await == Some(want)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_deltas_and_broadcasts_are_refused_counted_and_never_applied() {
    let w = World::start(&[], [&[], &[], &[]]).await;
    // The signed path works end to end: deltas verified by the aggregator,
    // broadcasts verified by both nodes.
    allow(&w.eu, "t", 5).await;
    wait_totals(&w, "t", 5).await;

    let day = tierlimit_shared::day::today();
    let huge = 1_000_000;
    let eu_key = (wire_keys::delta_key_id("eu"), wire_keys::delta_secret("eu"));
    let eu_signer = DeltaSigner::with_key(Version::V2, Some((&eu_key.0, &eu_key.1)));
    let forged = |region: &str| {
        Delta::new("t", day, actor(region, "forged"), huge, 0, now_ms()).from_node("x")
    };
    let records: Vec<(&str, Delta, Vec<u8>)> = vec![
        // An actor of a region that is not configured, under eu's key.
        (
            "wrong_region",
            forged("mars"),
            eu_signer.encode(&forged("mars")),
        ),
        // eu's key writing us's part: replayed from another region.
        (
            "wrong_region",
            forged("us"),
            eu_signer.encode(&forged("us")),
        ),
        // eu's key id with another secret.
        (
            "bad_signature",
            forged("eu"),
            DeltaSigner::with_key(Version::V2, Some((&eu_key.0, &[7; 32]))).encode(&forged("eu")),
        ),
        (
            "unknown_key",
            forged("eu"),
            DeltaSigner::with_key(Version::V2, Some(("nobody", &[7; 32]))).encode(&forged("eu")),
        ),
        // The previous release's JSON: unsigned.
        ("unsigned", forged("eu"), forged("eu").encode()),
        ("corrupt", forged("eu"), vec![2, 1, 0xff, 0xff]),
    ];
    for (_, d, payload) in &records {
        w.produce(DELTAS, "t", &d.key(), payload).await;
    }
    // A broadcast saying "t" is far over its limit: signed with a key the
    // nodes do not trust (under the trusted key id), and unsigned.
    let update = GlobalUpdate {
        v: 1,
        tenant: "t".into(),
        period: tierlimit_shared::period::Period::day(day),
        total: huge,
        parts: vec![ActorPart {
            actor: actor("us", "forged"),
            p: huge,
            n: 0,
        }],
        limit: Some(100),
        over_limit: true,
        ts_ms: now_ms(),
        limits_version: 0,
    };
    let (mallory, _) = keys::ed25519_pair_from_seed([0x66; 32]);
    let forger = BroadcastSigner::with_key(
        Version::V2,
        Some((
            wire_keys::BROADCAST_KEY,
            keys::ed25519_private(&mallory).unwrap(),
        )),
    );
    w.produce(
        GLOBAL,
        "t",
        &update.key(),
        &forger.encode(std::slice::from_ref(&update))[0],
    )
    .await;
    w.produce(GLOBAL, "t", &update.key(), &update.encode())
        .await;

    // Every forgery counted under its reason.
    let mut want: BTreeMap<String, u64> = BTreeMap::new();
    for (reason, _, _) in &records {
        *want.entry(reason.to_string()).or_default() += 1;
    }
    let agg_metrics = w.agg.admin_url("/metrics");
    wait_until(
        "the aggregator counted every forged delta",
        DEADLINE,
        || async {
            let got = by_reason(
                &w.agg.http,
                &agg_metrics,
                "tierlimit_aggregator_deltas_rejected_total",
            )
            .await;
            want.iter().all(|(r, n)| got.get(r) == Some(n))
        },
    )
    .await;
    for node in [&w.eu, &w.us] {
        let url = node.admin_url("/metrics");
        wait_until(
            &format!("{} counted both forged broadcasts", node.region),
            DEADLINE,
            || async {
                let got = by_reason(&node.http, &url, "tierlimit_broadcasts_rejected_total").await;
                got.get("bad_signature") == Some(&1) && got.get("unsigned") == Some(&1)
            },
        )
        .await;
    }

    // Nothing was applied: totals and views unchanged, decisions too.
    assert_eq!(agg_total(&w.agg, "t").await, Some(5));
    for node in [&w.eu, &w.us] {
        assert_eq!(view_total(node, "t").await, Some(5), "{} view", node.region);
        assert_eq!(
            check(node, "t").await,
            200,
            "{} still admits t",
            node.region
        );
    }
    // And the pipeline goes on past them (5 + the two checks above + 3).
    allow(&w.us, "t", 3).await;
    wait_totals(&w, "t", 10).await;

    // Heartbeats date the views: fresh while the aggregator writes them,
    // growing old when it stops (hung here; the broker stays up, so reading
    // to the watermark alone would still call the views fresh), fresh
    // again when it resumes.
    for node in [&w.eu, &w.us] {
        let url = node.admin_url("/metrics");
        assert!(
            harness::scrape_metric(&node.http, &url, "tierlimit_heartbeats_received_total").await
                > 0.0
        );
        wait_until(
            &format!("{} view fresh by heartbeats", node.region),
            DEADLINE,
            || async { view_age_ms(node).await.is_some_and(|a| a < 2_000) },
        )
        .await;
    }
    w.agg.proc.stop();
    for node in [&w.eu, &w.us] {
        wait_until(
            &format!("{} sees the heartbeats stop", node.region),
            DEADLINE,
            || async { view_age_ms(node).await.is_some_and(|a| a > 3_000) },
        )
        .await;
    }
    w.agg.proc.cont();
    for node in [&w.eu, &w.us] {
        wait_until(
            &format!("{} fresh again", node.region),
            DEADLINE,
            || async { view_age_ms(node).await.is_some_and(|a| a < 2_000) },
        )
        .await;
    }
}

/// The age of a node's view (ms), as its API reports it.
async fn view_age_ms(n: &RegionNode) -> Option<u64> {
    let v: Value = harness::try_json(&n.http, &n.url("/v1/tenants/t")).await?;
    v["view_age_ms"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn v1_and_v2_producers_side_by_side_merge_into_one_total() {
    // The upgrade release: everything accepts unsigned records; eu's node
    // and the aggregator still write the previous release's JSON, us's node
    // already writes signed v2.
    let unsigned = [("TIERLIMIT__WIRE__ACCEPT_UNSIGNED", "true")];
    let v1: &[(&'static str, &'static str)] = &[("TIERLIMIT__WIRE__VERSION", "1")];
    let v2: &[(&'static str, &'static str)] = &[("TIERLIMIT__WIRE__VERSION", "2")];
    let w = World::start(&unsigned, [v1, v1, v2]).await;
    allow(&w.eu, "m", 7).await;
    allow(&w.us, "m", 4).await;
    wait_totals(&w, "m", 11).await;
    // Both formats are really on the deltas topic; broadcasts are JSON.
    let deltas = w.first_bytes(DELTAS, "m|");
    assert_eq!(deltas, HashSet::from([b'{', 2]), "v1 and v2 deltas of m");
    assert_eq!(w.first_bytes(GLOBAL, "m|"), HashSet::from([b'{']));

    // A v2 record with a bad signature is refused even in this release.
    let day = tierlimit_shared::day::today();
    let bad = DeltaSigner::with_key(
        Version::V2,
        Some((&wire_keys::delta_key_id("us"), &[7; 32])),
    );
    let d = Delta::new("m", day, actor("us", "forged"), 1_000_000, 0, now_ms()).from_node("x");
    w.produce(DELTAS, "m", &d.key(), &bad.encode(&d)).await;
    let url = w.agg.admin_url("/metrics");
    wait_until("the forged v2 delta is counted", DEADLINE, || async {
        by_reason(
            &w.agg.http,
            &url,
            "tierlimit_aggregator_deltas_rejected_total",
        )
        .await
        .get("bad_signature")
            == Some(&1)
    })
    .await;
    allow(&w.us, "m", 1).await;
    wait_totals(&w, "m", 12).await;
}
