//! Smoke test of the Kafka features tierlimit relies on, against a real
//! Tansu broker through rdkafka: topic creation (with configs), the
//! idempotent producer with explicit partitions, manual assignment from the
//! beginning with partition EOF, watermarks, consumer groups, and data
//! surviving a broker restart.
//!
//! If one of these fails, the region-node and aggregator tests would fail in
//! confusing ways; this one says which Kafka feature is missing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use harness::{wait_for, Tansu};
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};

const TOPICS: [&str; 2] = ["smoke.a", "smoke.b"];
const PARTITIONS: i32 = 4;
const PER_TOPIC: usize = 50;
const DEADLINE: Duration = Duration::from_secs(60);

/// (topic, partition) → the (key, value) records in produce order.
type Log = BTreeMap<(String, i32), Vec<(String, String)>>;

fn producer(tansu: &Tansu) -> FutureProducer {
    tansu
        .client_config()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", "30000")
        .create()
        .expect("producer")
}

/// Produces `PER_TOPIC` keyed records to every topic, partition chosen
/// explicitly (round robin), all in flight at once; returns what was sent.
async fn produce(tansu: &Tansu, tag: &str) -> Log {
    let producer = producer(tansu);
    let mut sent = Log::new();
    let mut in_flight = Vec::new();
    for topic in TOPICS {
        for i in 0..PER_TOPIC {
            let partition = (i % PARTITIONS as usize) as i32;
            let key = format!("{tag}-key-{i}");
            let value = format!("{tag}-value-{topic}-{i}");
            let record = FutureRecord::to(topic)
                .partition(partition)
                .key(&key)
                .payload(&value);
            let delivery = producer
                .send_result(record)
                .unwrap_or_else(|(e, _)| panic!("enqueue to {topic}/{partition}: {e}"));
            in_flight.push((topic, partition, delivery));
            sent.entry((topic.to_string(), partition))
                .or_default()
                .push((key, value));
        }
    }
    for (topic, partition, delivery) in in_flight {
        let d = delivery
            .await
            .expect("delivery future not cancelled")
            .unwrap_or_else(|(e, _)| panic!("deliver to {topic}/{partition}: {e}"));
        assert_eq!(d.partition, partition, "broker put the record elsewhere");
    }
    sent
}

/// Reads every partition of `topic` from the beginning (manual assignment,
/// no group membership) until each has reported EOF; returns (offset, key,
/// value) per partition.
///
/// librdkafka refuses `assign` on a consumer without `group.id` ("Local:
/// Unknown group") even though manual assignment never joins the group: a
/// `group.id` is set, and nothing is committed.
async fn read_all(tansu: &Tansu, topic: &str) -> BTreeMap<i32, Vec<(i64, String, String)>> {
    let consumer: StreamConsumer = tansu
        .client_config()
        .set("group.id", "smoke-reader")
        .set("enable.partition.eof", "true")
        // The broker holds a fetch with nothing new for up to
        // fetch.wait.max.ms (default 500 ms), and reaching EOF on every
        // partition takes a few rounds: keep it short on loopback.
        .set("fetch.wait.max.ms", "50")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).expect("assign");

    let mut got: BTreeMap<i32, Vec<(i64, String, String)>> = BTreeMap::new();
    let mut eof = BTreeSet::new();
    let start = Instant::now();
    while eof.len() < PARTITIONS as usize {
        let remaining = DEADLINE.saturating_sub(start.elapsed());
        let next = tokio::time::timeout(remaining, consumer.recv())
            .await
            .unwrap_or_else(|_| {
                panic!("{topic}: EOF on only {eof:?} of {PARTITIONS} partitions after {DEADLINE:?}; read {got:?}")
            });
        match next {
            Ok(m) => {
                assert_eq!(m.topic(), topic);
                let text =
                    |b: Option<&[u8]>| String::from_utf8(b.expect("present").to_vec()).unwrap();
                got.entry(m.partition()).or_default().push((
                    m.offset(),
                    text(m.key()),
                    text(m.payload()),
                ));
            }
            Err(KafkaError::PartitionEOF(p)) => {
                eof.insert(p);
            }
            // Transient (a broker connection being re-established): librdkafka
            // retries by itself; the deadline bounds it.
            Err(e) => eprintln!("{topic}: consumer error (retrying): {e}"),
        }
    }
    got
}

/// Asserts that `topic` holds exactly what `sent` says, in order, at offsets
/// 0.., and that the high watermarks agree.
async fn assert_topic_holds(tansu: &Tansu, topic: &str, sent: &Log) {
    let got = read_all(tansu, topic).await;
    let mut total = 0;
    for p in 0..PARTITIONS {
        let expected = sent
            .get(&(topic.to_string(), p))
            .cloned()
            .unwrap_or_default();
        let actual = got.get(&p).cloned().unwrap_or_default();
        let actual_kv: Vec<(String, String)> = actual
            .iter()
            .map(|(_, k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(actual_kv, expected, "{topic}/{p}: records differ");
        let offsets: Vec<i64> = actual.iter().map(|(o, _, _)| *o).collect();
        let dense: Vec<i64> = (0..expected.len() as i64).collect();
        assert_eq!(offsets, dense, "{topic}/{p}: offsets are not 0..n");
        total += actual.len();
    }
    assert_eq!(
        total,
        sent.keys()
            .filter(|(t, _)| t == topic)
            .map(|k| sent[k].len())
            .sum::<usize>()
    );

    let consumer: StreamConsumer = tansu
        .client_config()
        .set("group.id", "smoke-watermarks")
        .create()
        .expect("consumer");
    for p in 0..PARTITIONS {
        let n = sent.get(&(topic.to_string(), p)).map_or(0, Vec::len) as i64;
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("watermarks of {topic}/{p}: {e}"));
        assert_eq!(high, n, "{topic}/{p}: high watermark");
        assert_eq!(low, 0, "{topic}/{p}: low watermark");
    }
}

#[tokio::test]
async fn produce_read_back_watermarks_and_survive_restart() {
    let mut tansu = Tansu::start();
    tansu.create_topics(&TOPICS, PARTITIONS).await;
    // Creating again is harmless (TopicAlreadyExists is accepted).
    tansu.create_topics(&TOPICS, PARTITIONS).await;

    let mut sent = produce(&tansu, "first").await;
    assert_eq!(
        sent.values().map(Vec::len).sum::<usize>(),
        PER_TOPIC * TOPICS.len()
    );
    for topic in TOPICS {
        assert_topic_holds(&tansu, topic, &sent).await;
    }

    // Same port, same SQLite database: everything is still there.
    tansu.restart();
    for topic in TOPICS {
        assert_topic_holds(&tansu, topic, &sent).await;
    }

    // And the restarted broker takes new writes after the old ones.
    let more = produce(&tansu, "second").await;
    for (tp, records) in more {
        sent.entry(tp).or_default().extend(records);
    }
    for topic in TOPICS {
        assert_topic_holds(&tansu, topic, &sent).await;
    }
}

#[tokio::test]
async fn consumer_group_member_receives_records() {
    let tansu = Tansu::start();
    tansu.create_topics(&TOPICS, PARTITIONS).await;
    let sent = produce(&tansu, "group").await;

    let consumer: StreamConsumer = tansu
        .client_config()
        .set("group.id", "smoke-group")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "10000")
        .create()
        .expect("group consumer");
    consumer.subscribe(&[TOPICS[0]]).expect("subscribe");

    let (partition, key, value) =
        wait_for("a group member receives a record", DEADLINE, || async {
            match consumer.recv().await {
                Ok(m) => Some((
                    m.partition(),
                    String::from_utf8(m.key().unwrap().to_vec()).unwrap(),
                    String::from_utf8(m.payload().unwrap().to_vec()).unwrap(),
                )),
                Err(e) => {
                    eprintln!("group consumer error (retrying): {e}");
                    None
                }
            }
        })
        .await;
    let expected = &sent[&(TOPICS[0].to_string(), partition)];
    assert!(
        expected.contains(&(key.clone(), value.clone())),
        "unexpected record {key}={value} on {}/{partition}",
        TOPICS[0]
    );
    let assignment = consumer.assignment().expect("assignment");
    assert!(
        assignment.count() > 0,
        "a member that received a record has partitions"
    );
}

/// `tierlimit_shared::kafka::ensure_topics` against the real broker, with
/// `cleanup.policy=compact,delete` and the retention of `retention_days`:
/// Tansu 0.6.0 accepts and stores topic configs (DescribeConfigs returns
/// them), and a second call is a no-op. The limits topic is created beside
/// them, compacted only.
#[tokio::test]
async fn shared_ensure_topics_creates_compacted_topics() {
    let tansu = Tansu::start();
    let k: tierlimit_shared::config::KafkaConfig = toml::from_str(&format!(
        "brokers = \"{}\"\npartitions = {PARTITIONS}\n",
        tansu.brokers()
    ))
    .expect("kafka config");

    let mut created = tierlimit_shared::kafka::ensure_topics(&k, 2, true)
        .await
        .expect("ensure_topics");
    created.sort();
    assert_eq!(
        created,
        vec![
            k.deltas_topic.clone(),
            k.global_topic.clone(),
            k.limits_topic.clone()
        ]
    );
    let again = tierlimit_shared::kafka::ensure_topics(&k, 2, true)
        .await
        .expect("ensure_topics again");
    assert!(again.is_empty(), "second call created {again:?}");

    // Wait for both to be usable, via the harness (idempotent create).
    tansu
        .create_topics(&[&k.deltas_topic, &k.global_topic], PARTITIONS)
        .await;
    tansu.create_topics(&[&k.limits_topic], 1).await;

    let admin: AdminClient<DefaultClientContext> = tansu.client_config().create().unwrap();
    for topic in [&k.deltas_topic, &k.global_topic] {
        let res = admin
            .describe_configs(&[ResourceSpecifier::Topic(topic)], &AdminOptions::new())
            .await
            .expect("DescribeConfigs");
        let resource = res[0].as_ref().expect("topic resource");
        let policy = resource.get("cleanup.policy").and_then(|e| e.value.clone());
        assert_eq!(
            policy.as_deref(),
            Some("compact,delete"),
            "{topic}: {resource:?}"
        );
        let retention = resource.get("retention.ms").and_then(|e| e.value.clone());
        assert_eq!(
            retention.as_deref(),
            Some("259200000"),
            "three days for retention_days = 2: {topic}: {resource:?}"
        );
    }
    // The limits topic is compacted only: a tenant's latest record lives as
    // long as the tenant, whatever `retention_days` says.
    let res = admin
        .describe_configs(
            &[ResourceSpecifier::Topic(&k.limits_topic)],
            &AdminOptions::new(),
        )
        .await
        .expect("DescribeConfigs");
    let resource = res[0].as_ref().expect("limits topic resource");
    let policy = resource.get("cleanup.policy").and_then(|e| e.value.clone());
    assert_eq!(policy.as_deref(), Some("compact"), "{resource:?}");
}

/// ListOffsets by timestamp (what a rebuild starts from, see
/// `tierlimit_shared::retention`): the broker keeps each record's
/// CreateTime and answers the first offset at or after a time. Records
/// stamped two and one days ago, then now: the start of yesterday finds the
/// first of yesterday's, the start of today the first of today's, and a
/// time after every record answers "nothing that new", read as offset 0
/// (Tansu answers 0, Apache Kafka −1 and becomes the beginning).
#[tokio::test]
async fn offsets_by_timestamp_find_the_first_retained_record() {
    use rdkafka::consumer::BaseConsumer;
    use tierlimit_shared::retention;
    const TOPIC: &str = "smoke.times";
    let tansu = Tansu::start();
    tansu.create_topics(&[TOPIC], 2).await;
    let producer = producer(&tansu);
    let today = tierlimit_shared::day::today();
    let day_ms = 86_400_000i64;
    let now = tierlimit_shared::messages::now_ms() as i64;
    // Partition 0: 3 records two days ago, 2 yesterday, 4 now.
    let stamps: Vec<i64> = [now - 2 * day_ms; 3]
        .into_iter()
        .chain([now - day_ms; 2])
        .chain([now; 4])
        .collect();
    for (i, ts) in stamps.iter().enumerate() {
        let (key, value) = (format!("k{i}"), format!("v{i}"));
        producer
            .send(
                FutureRecord::to(TOPIC)
                    .partition(0)
                    .key(&key)
                    .payload(&value)
                    .timestamp(*ts),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce {i}: {e}"));
    }
    let consumer: BaseConsumer = tansu
        .client_config()
        .set("group.id", "smoke-times")
        .create()
        .unwrap();
    let lookup = |since: i64| {
        let starts =
            retention::start_offsets(&consumer, TOPIC, &[0, 1], since, Duration::from_secs(10));
        starts.iter().map(retention::Start::at).collect::<Vec<_>>()
    };
    let yesterday = retention::since_ms(today, 1);
    let midnight = retention::since_ms(today, 0);
    assert_eq!(lookup(yesterday)[0], 3, "the first of yesterday's records");
    assert_eq!(lookup(midnight)[0], 5, "the first of today's records");
    assert_eq!(
        lookup(now + day_ms),
        vec![0, 0],
        "nothing that new: from the start"
    );
    assert_eq!(lookup(0), vec![0, 0], "everything is newer than 1970");
}
