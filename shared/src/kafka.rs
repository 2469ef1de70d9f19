//! Kafka client plumbing both binaries share: client configuration from the
//! config file, and topic creation.
//!
//! Only plain Kafka protocol features are used (ordered producer, manual
//! assignment, consumer groups, watermarks, ListOffsets by timestamp,
//! CreateTopics), so any compatible
//! broker works: Apache Kafka, Redpanda, MSK, Tansu.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::RDKafkaErrorCode;

use crate::config::KafkaConfig;

/// A librdkafka config with the brokers and every `kafka.client` pass-through
/// setting (SASL, TLS, timeouts) applied.
pub fn client_config(k: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &k.brokers);
    for (key, value) in &k.client {
        c.set(key, value);
    }
    c
}

/// A follower's consumer (the broadcast view's, the limits table's): it
/// reads by manual assignment from offsets it chooses, so it never joins
/// its group and never commits (a group id is required by the client all
/// the same).
pub fn follower_config(k: &KafkaConfig, group: String) -> ClientConfig {
    let mut cc = client_config(k);
    cc.set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("fetch.wait.max.ms", "50")
        // A start before the low watermark (a lookup that answered 0, a
        // topic deleted and created again under a running process) reads
        // from the oldest record, never from the end.
        .set("auto.offset.reset", "earliest")
        // A fetch in flight when the link is cut would otherwise hold the
        // connection for librdkafka's default 60 s.
        .set("socket.timeout.ms", "10000");
    cc
}

/// The partitions of `topic`, from the broker's metadata (a blocking call,
/// on a blocking thread).
pub async fn partitions_of(
    consumer: &std::sync::Arc<rdkafka::consumer::StreamConsumer>,
    topic: &str,
) -> Result<Vec<i32>, String> {
    use rdkafka::consumer::Consumer;
    let (c, t) = (std::sync::Arc::clone(consumer), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        c.fetch_metadata(Some(&t), Duration::from_secs(5))
            .map_err(|e| e.to_string())
            .and_then(|md| {
                md.topics()
                    .first()
                    .filter(|tm| tm.error().is_none())
                    .map(|tm| tm.partitions().iter().map(|p| p.id()).collect::<Vec<i32>>())
                    .filter(|ps| !ps.is_empty())
                    .ok_or_else(|| {
                        format!("topic {t} not found (aggregator create-topics makes it)")
                    })
            })
    })
    .await
    .map_err(|e| e.to_string())?
}

/// A producer config for tierlimit's topics: ordered per partition, durable,
/// and deliberately **not** idempotent.
///
/// What correctness needs is order, not de-duplication: every message is a
/// cumulative value merged by max, so a duplicate is harmless. But one
/// publisher's messages for a key must stay in order, because compaction
/// keeps the last message per key. `max.in.flight.requests.per.connection=1`
/// gives that order through retries on any Kafka-protocol broker. The
/// idempotent producer would give it too, but it bumps its producer epoch
/// after a message times out (a long partition), which some brokers handle
/// badly (Tansu 0.6.0 panics on it). Nothing here depends on it.
pub fn ordered_producer_config(k: &KafkaConfig) -> ClientConfig {
    let mut c = client_config(k);
    c.set("enable.idempotence", "false")
        .set("max.in.flight.requests.per.connection", "1")
        .set("acks", "all")
        .set("linger.ms", "5");
    c
}

/// Creates the deltas and global topics if they do not exist.
///
/// `compact` asks for what production wants on both:
/// `cleanup.policy=compact,delete` and `retention.ms` of
/// `retention_days + 1` days (see [`crate::retention`]; with week or month
/// tiers, [`ensure_topics_retaining`] with
/// [`crate::retention::topic_retention_ms_for`]). Compaction keeps
/// the latest message per key (the whole truth: deltas are cumulative per
/// actor, broadcasts per tenant and day); deletion drops the days no
/// aggregator keeps any more, so a topic holds what is retained, not every
/// day ever seen. Brokers that do not accept topic configs can be given
/// `compact = false`. Existing topics are left as they are (README,
/// "Production / Kafka", says how to alter them).
pub async fn ensure_topics(
    k: &KafkaConfig,
    retention_days: u32,
    compact: bool,
) -> Result<Vec<String>, String> {
    let retention_ms = crate::retention::topic_retention_ms(retention_days);
    ensure_topics_retaining(k, retention_ms, compact).await
}

/// [`ensure_topics`] with `retention.ms` given: what a configuration with
/// week or month tiers needs (`retention::topic_retention_ms_for`), since a
/// rebuild must find every actor's latest delta of the previous month
/// without relying on compaction.
pub async fn ensure_topics_retaining(
    k: &KafkaConfig,
    retention_ms: u64,
    compact: bool,
) -> Result<Vec<String>, String> {
    let admin: AdminClient<DefaultClientContext> = client_config(k)
        .create()
        .map_err(|e| format!("cannot create Kafka admin client: {e}"))?;
    let retention_ms = retention_ms.to_string();
    let mut topics = Vec::new();
    for name in [&k.deltas_topic, &k.global_topic] {
        let repl = TopicReplication::Fixed(k.replication_factor);
        let mut t = NewTopic::new(name, k.partitions, repl);
        if compact {
            t = t
                .set("cleanup.policy", "compact,delete")
                .set("retention.ms", &retention_ms);
        }
        topics.push(t);
    }
    // The limits topic: one partition (one order for every record, so a
    // version is a watermark) and compaction only: a tenant's record must
    // stay however old it is.
    let mut limits = NewTopic::new(
        &k.limits_topic,
        1,
        TopicReplication::Fixed(k.replication_factor),
    );
    if compact {
        limits = limits.set("cleanup.policy", "compact");
    }
    topics.push(limits);
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    let results = admin
        .create_topics(topics.iter(), &opts)
        .await
        .map_err(|e| format!("CreateTopics failed: {e}"))?;
    let mut created = Vec::new();
    for r in results {
        match r {
            Ok(name) => created.push(name),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => return Err(format!("cannot create topic {name}: {code}")),
        }
    }
    Ok(created)
}
