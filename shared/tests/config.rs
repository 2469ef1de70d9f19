//! Every way a configuration can be refused, each naming the right key; how
//! overrides merge; and the documented example `regions.example.toml`.

use std::time::Duration;

use tierlimit_shared::config::{
    Algorithm, Config, ConfigError, Limit, Loaded, StoreErrorMode, UnknownPolicy, MAX_LIMIT,
};

/// A small valid configuration the tests change one key at a time.
const BASE: &str = r#"
cluster = "test"

[kafka]
brokers = "localhost:9092"

[regions.eu-west]
redis_url = "redis://127.0.0.1:6379"

[plans.free]
global = { limit = 1000 }

[plans.free.node]
limit = 20
window = "1s"

[plans.free.region]
limit = 600
window = "1m"

[plans.bucket.node]
limit = 10
window = "1s"
algorithm = "token_bucket"
burst = 30

[wire]
broadcast_key = "agg-1"

[wire.broadcast_public_keys]
agg-1 = "6kpsY+KcUgq+9VB7Ey7F+ZVHdq6+vnuSQh7qaRRG0iw="

[wire.delta_keys.eu-west]
sign_with = "eu-1"
keys = { eu-1 = "yjSvs3/DXCopz9CRhvi6yCiWGD8jfHtGu3HHkHYkOG8=" }
"#;

/// The private key of BASE's `agg-1` (seed 0x07 × 32).
const AGG_1_PRIVATE: &str = "BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=";
/// Another key pair's private key (seed 0x08 × 32) and public key.
const AGG_2_PRIVATE: &str = "CAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAg=";
const AGG_2_PUBLIC: &str = "E5j2LG0aRXxRumpLXz29L2n8qTIWIY3ImX5Ba9F9k8o=";

type Table = toml::Table;

/// A TOML value written as TOML: `v("5")`, `v("\"1s\"")`, `v("{ limit = 1 }")`.
fn v(src: &str) -> toml::Value {
    format!("x = {src}")
        .parse::<Table>()
        .unwrap_or_else(|e| panic!("{src}: {e}"))
        .remove("x")
        .unwrap()
}

fn s(text: &str) -> toml::Value {
    toml::Value::String(text.into())
}

fn base() -> Table {
    BASE.parse().unwrap()
}

fn table_at<'a>(t: &'a mut Table, path: &[&str]) -> &'a mut Table {
    let mut node = t;
    for seg in path {
        node = node
            .entry(seg.to_string())
            .or_insert_with(|| toml::Value::Table(Table::new()))
            .as_table_mut()
            .unwrap_or_else(|| panic!("{seg} is not a table"));
    }
    node
}

/// `base()` with `path` set to `value`.
fn with(path: &[&str], value: toml::Value) -> Table {
    let mut t = base();
    set(&mut t, path, value);
    t
}

fn set(t: &mut Table, path: &[&str], value: toml::Value) {
    let (last, parents) = path.split_last().unwrap();
    table_at(t, parents).insert(last.to_string(), value);
}

/// `base()` without `path`.
fn without(path: &[&str]) -> Table {
    let mut t = base();
    let (last, parents) = path.split_last().unwrap();
    assert!(
        table_at(&mut t, parents).remove(*last).is_some(),
        "{path:?}"
    );
    t
}

fn text(t: &Table) -> String {
    toml::to_string(t).unwrap()
}

fn load(t: &Table) -> Result<Loaded, ConfigError> {
    Config::from_toml(&text(t))
}

fn ok(t: &Table) -> Loaded {
    load(t).unwrap_or_else(|e| panic!("should load: {e}\n{}", text(t)))
}

/// Refused, naming `key`, with `reason` in the message.
#[track_caller]
fn refused(t: &Table, key: &str, reason: &str) -> ConfigError {
    let e = match load(t) {
        Ok(_) => panic!("should be refused ({key}):\n{}", text(t)),
        Err(e) => e,
    };
    assert_eq!(e.key(), Some(key), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&format!("`{key}`")), "{msg}");
    // One line, naming the key once (fit for a log line).
    assert!(!msg.contains('\n'), "{msg:?}");
    assert!(!msg.contains("\nin `"), "{msg:?}");
    assert!(msg.contains(reason), "{msg:?} does not contain {reason:?}");
    e
}

fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
    vars.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn load_env(vars: &[(&str, &str)]) -> Result<Loaded, ConfigError> {
    Config::from_toml_with_env(BASE, env(vars))
}

fn limit(limit: u64, window_ms: u64, algorithm: Algorithm, burst: u64) -> Limit {
    Limit {
        limit,
        window_ms,
        algorithm,
        burst,
    }
}

// ----- parsing --------------------------------------------------------------

#[test]
fn base_loads_with_documented_defaults() {
    let l = ok(&base());
    let c = &l.config;
    assert_eq!(c.cluster, "test");
    assert_eq!(c.kafka.deltas_topic, "tierlimit.deltas");
    assert_eq!(c.kafka.global_topic, "tierlimit.global");
    assert_eq!(c.kafka.partitions, 8);
    assert_eq!(c.kafka.replication_factor, 1);
    assert!(c.kafka.client.is_empty());
    assert_eq!(c.node.flush_interval, Duration::from_millis(250));
    assert_eq!(c.node.store_timeout, Duration::from_millis(50));
    assert_eq!(c.node.store_retry_interval, Duration::from_millis(500));
    assert_eq!(c.node.max_staleness, None);
    assert_eq!(c.node.publish_batch, 5000);
    assert_eq!(c.aggregator.group_id, "tierlimit-aggregator-cooperative");
    assert_eq!(
        c.aggregator.assignment,
        tierlimit_shared::config::Assignment::CooperativeSticky
    );
    assert_eq!(c.aggregator.broadcast_interval, Duration::from_millis(250));
    assert_eq!(c.aggregator.retention_days, 2);
    assert_eq!(c.regions["eu-west"].expected_nodes, 1);
    // No [unknown_tenants] section: unknown tenants are denied.
    assert_eq!(c.unknown_tenants.policy, UnknownPolicy::Deny);
    assert!(l.policy("anyone").is_none());
    assert!(l.unknown_policy().is_none());

    let free = &c.plans["free"];
    assert_eq!(free.on_store_error, StoreErrorMode::Local);
    assert!(!free.key_scoped);
    assert_eq!(
        free.node.as_ref().unwrap().algorithm,
        Algorithm::SlidingWindow
    );
}

#[test]
fn toml_syntax_errors_name_no_key() {
    for bad in [
        "cluster = \n".to_string(),
        "cluster = \"x".to_string(),
        format!("{BASE}\n[kafka]\nbrokers = \"again\"\n"),
        format!("cluster = \"twice\"\n{BASE}"),
    ] {
        let e = Config::from_toml(&bad).unwrap_err();
        assert!(matches!(e, ConfigError::Syntax(_)), "{e:?}");
        assert_eq!(e.key(), None);
        assert!(
            e.to_string().starts_with("config is not valid TOML: "),
            "{e}"
        );
    }
}

#[test]
fn unknown_fields_are_named_with_their_full_path() {
    let cases: &[(&[&str], &str)] = &[
        (&["clustr"], "clustr"),
        (&["kafka", "topic"], "kafka.topic"),
        (&["node", "flush_intervall"], "node.flush_intervall"),
        (&["aggregator", "groupid"], "aggregator.groupid"),
        (&["regions", "eu-west", "redis"], "regions.eu-west.redis"),
        (&["plans", "free", "regoin"], "plans.free.regoin"),
        (&["plans", "free", "node", "windw"], "plans.free.node.windw"),
        (
            &["plans", "free", "global", "limt"],
            "plans.free.global.limt",
        ),
        (&["tenants", "acme", "plna"], "tenants.acme.plna"),
        (&["unknown_tenants", "plna"], "unknown_tenants.plna"),
    ];
    for (path, key) in cases {
        let e = refused(&with(path, v("1")), key, "unknown field");
        let field = path.last().unwrap();
        assert!(e.to_string().contains(&format!("`{field}`")), "{e}");
    }
    // Also inside an override, written inline.
    let mut t = base();
    set(&mut t, &["tenants", "acme", "plan"], s("free"));
    set(
        &mut t,
        &["tenants", "acme", "node"],
        v("{ limit = 1, windw = \"1s\" }"),
    );
    refused(&t, "tenants.acme.node.windw", "unknown field `windw`");
    // kafka.client is a free-form map: anything goes (except reserved keys).
    let l = ok(&with(&["kafka", "client", "anything.goes"], s("yes")));
    assert_eq!(l.config.kafka.client["anything.goes"], "yes");
}

#[test]
fn missing_required_fields_are_named() {
    let cases: &[(&[&str], &str, &str)] = &[
        (&["cluster"], "(root)", "missing field `cluster`"),
        (&["kafka"], "(root)", "missing field `kafka`"),
        (&["regions"], "(root)", "missing field `regions`"),
        (&["plans"], "plans", "at least one plan is required"),
        (&["kafka", "brokers"], "kafka", "missing field `brokers`"),
        (
            &["regions", "eu-west", "redis_url"],
            "regions.eu-west",
            "missing field `redis_url`",
        ),
        (
            &["plans", "free", "node", "limit"],
            "plans.free.node",
            "missing field `limit`",
        ),
        (
            &["plans", "free", "region", "window"],
            "plans.free.region",
            "missing field `window`",
        ),
        (
            &["plans", "free", "global", "limit"],
            "plans.free.global",
            "needs at least one limit",
        ),
    ];
    for (path, key, reason) in cases {
        refused(&without(path), key, reason);
    }
    refused(
        &with(&["tenants", "acme", "node"], v("{ limit = 1 }")),
        "tenants.acme",
        "missing field `plan`",
    );
}

#[test]
fn wrong_types_and_enum_values_are_named() {
    refused(&with(&["cluster"], v("1")), "cluster", "invalid type");
    refused(
        &with(&["kafka", "partitions"], s("8")),
        "kafka.partitions",
        "invalid type",
    );
    refused(
        &with(&["regions", "eu-west", "expected_nodes"], s("two")),
        "regions.eu-west.expected_nodes",
        "invalid type",
    );
    refused(
        &with(&["node", "publish_batch"], v("-1")),
        "node.publish_batch",
        "",
    );
    refused(
        &with(&["plans", "free", "node", "limit"], v("-5")),
        "plans.free.node.limit",
        "",
    );
    refused(
        &with(&["plans", "free", "node", "algorithm"], s("leaky_bucket")),
        "plans.free.node.algorithm",
        "unknown variant `leaky_bucket`",
    );
    refused(
        &with(&["plans", "free", "on_store_error"], s("maybe")),
        "plans.free.on_store_error",
        "unknown variant `maybe`",
    );
    refused(
        &with(&["unknown_tenants", "policy"], s("allow")),
        "unknown_tenants.policy",
        "unknown variant `allow`",
    );
    refused(
        &with(&["unknown_tenants", "max_per_day"], toml::Value::Integer(0)),
        "unknown_tenants.max_per_day",
        "must be between 1",
    );
    refused(
        &with(&["plans", "free", "key_scoped"], s("yes")),
        "plans.free.key_scoped",
        "invalid type",
    );
    // `gcra` is an alias of token_bucket.
    let l = ok(&with(&["plans", "bucket", "node", "algorithm"], s("gcra")));
    assert_eq!(
        l.config.plans["bucket"].node.as_ref().unwrap().algorithm,
        Algorithm::TokenBucket
    );
}

#[test]
fn bad_durations_are_named() {
    let cases: &[(&[&str], &str)] = &[
        (&["node", "flush_interval"], "node.flush_interval"),
        (&["node", "store_timeout"], "node.store_timeout"),
        (
            &["node", "store_retry_interval"],
            "node.store_retry_interval",
        ),
        (&["node", "max_staleness"], "node.max_staleness"),
        (
            &["aggregator", "broadcast_interval"],
            "aggregator.broadcast_interval",
        ),
        (
            &["plans", "free", "node", "window"],
            "plans.free.node.window",
        ),
        (
            &["plans", "free", "region", "window"],
            "plans.free.region.window",
        ),
    ];
    for (path, key) in cases {
        refused(&with(path, s("10x")), key, "unknown unit \"x\"");
        refused(&with(path, s("1.5s")), key, "unknown unit");
        refused(&with(path, s("10")), key, "has no unit");
        refused(&with(path, s("s")), key, "does not start with a number");
        refused(&with(path, s("")), key, "");
        refused(&with(path, s("99999999999999999999d")), key, "too large");
        refused(&with(path, v("250")), key, "invalid type");
    }
    let mut t = base();
    set(&mut t, &["tenants", "acme", "plan"], s("free"));
    set(
        &mut t,
        &["tenants", "acme", "node"],
        v("{ window = \"5w\" }"),
    );
    refused(&t, "tenants.acme.node.window", "unknown unit \"w\"");
}

// ----- settings ranges ------------------------------------------------------

#[test]
fn every_settings_range_is_checked() {
    // (path, too small, smallest ok, largest ok, too large)
    let ranges: &[(&[&str], &str, &str, &str, &str)] = &[
        (&["node", "flush_interval"], "9ms", "10ms", "60s", "60001ms"),
        (&["node", "store_timeout"], "0ms", "1ms", "10s", "10001ms"),
        (
            &["node", "store_retry_interval"],
            "9ms",
            "10ms",
            "1m",
            "61s",
        ),
        (
            &["node", "max_staleness"],
            "99ms",
            "100ms",
            "1d",
            "86400001ms",
        ),
        (
            &["aggregator", "broadcast_interval"],
            "9ms",
            "10ms",
            "60s",
            "2m",
        ),
    ];
    for &(path, low, lo, hi, high) in ranges {
        let key = path.join(".");
        for bad in [low, high] {
            refused(&with(path, s(bad)), &key, "is out of range");
        }
        for good in [lo, hi] {
            ok(&with(path, s(good)));
        }
    }
    let e = refused(
        &with(&["node", "flush_interval"], s("2m")),
        "node.flush_interval",
        "",
    );
    assert!(e.to_string().contains("2m is out of range 10ms..1m"), "{e}");

    refused(
        &with(&["node", "publish_batch"], v("0")),
        "node.publish_batch",
        "at least 1",
    );
    ok(&with(&["node", "publish_batch"], v("1")));
    let e = refused(
        &with(&["node", "relaxed_flush_interval"], s("100ms")),
        "node.relaxed_flush_interval",
        "shorter than node.flush_interval (250ms)",
    );
    assert!(e.to_string().contains("100ms"), "{e}");
    ok(&with(&["node", "relaxed_flush_interval"], s("250ms")));
    for bad in ["-0.1", "1.5"] {
        refused(
            &with(&["node", "urgent_fraction"], v(bad)),
            "node.urgent_fraction",
            "within 0..1",
        );
    }
    ok(&with(&["node", "urgent_fraction"], v("0.0")));
    for bad in ["-0.1", "0.51"] {
        refused(
            &with(&["aggregator", "broadcast_fraction"], v(bad)),
            "aggregator.broadcast_fraction",
            "within 0..0.5",
        );
    }
    ok(&with(&["aggregator", "broadcast_fraction"], v("0.5")));
    refused(
        &with(&["aggregator", "group_id"], s("")),
        "aggregator.group_id",
        "must not be empty",
    );
    for bad in ["0", "32"] {
        refused(
            &with(&["aggregator", "retention_days"], v(bad)),
            "aggregator.retention_days",
            "between 1 and 31",
        );
    }
    for good in ["1", "31"] {
        ok(&with(&["aggregator", "retention_days"], v(good)));
    }
}

// ----- kafka ----------------------------------------------------------------

#[test]
fn kafka_is_validated() {
    for bad in ["", "   "] {
        refused(
            &with(&["kafka", "brokers"], s(bad)),
            "kafka.brokers",
            "must not be empty",
        );
    }
    let long = "t".repeat(250);
    for key in ["deltas_topic", "global_topic"] {
        let path = ["kafka", key];
        let full = format!("kafka.{key}");
        for bad in ["", "a b", "a/b", "tópico", "a:b", long.as_str()] {
            refused(
                &with(&path, s(bad)),
                &full,
                "is not a valid Kafka topic name",
            );
        }
        ok(&with(&path, s(&"t".repeat(249))));
        ok(&with(&path, s("My_Topic-1.x")));
    }
    // Equal topics: the second one is named.
    refused(
        &with(&["kafka", "deltas_topic"], s("tierlimit.global")),
        "kafka.global_topic",
        "must differ from kafka.deltas_topic",
    );
    for bad in ["0", "-1", "10001"] {
        refused(
            &with(&["kafka", "partitions"], v(bad)),
            "kafka.partitions",
            "between 1 and 10000",
        );
    }
    for good in ["1", "10000"] {
        ok(&with(&["kafka", "partitions"], v(good)));
    }
    for bad in ["0", "17"] {
        refused(
            &with(&["kafka", "replication_factor"], v(bad)),
            "kafka.replication_factor",
            "between 1 and 16",
        );
    }
    ok(&with(&["kafka", "replication_factor"], v("16")));
    for reserved in [
        "bootstrap.servers",
        "group.id",
        "enable.idempotence",
        "enable.auto.commit",
    ] {
        refused(
            &with(&["kafka", "client", reserved], s("x")),
            &format!("kafka.client.{reserved}"),
            "is set by tierlimit itself",
        );
    }
    let l = ok(&with(
        &["kafka", "client", "security.protocol"],
        s("SASL_SSL"),
    ));
    assert_eq!(l.config.kafka.client["security.protocol"], "SASL_SSL");
}

// ----- cluster and regions ----------------------------------------------------

#[test]
fn cluster_and_regions_are_validated() {
    refused(&with(&["cluster"], s("")), "cluster", "is empty");
    refused(
        &with(&["cluster"], s("my cluster")),
        "cluster",
        "contains ' '",
    );
    refused(
        &with(&["cluster"], s(&"c".repeat(65))),
        "cluster",
        "at most 64",
    );

    refused(
        &with(&["regions"], v("{}")),
        "regions",
        "at least one region is required",
    );
    for bad in ["eu west", "eu:west", "eu{west}"] {
        let mut t = without(&["regions", "eu-west"]);
        set(&mut t, &["regions", bad, "redis_url"], s("redis://r"));
        refused(&t, &format!("regions.{bad}"), "region name contains");
    }
    for bad in ["http://127.0.0.1:6379", "127.0.0.1:6379", "", "REDIS://x"] {
        refused(
            &with(&["regions", "eu-west", "redis_url"], s(bad)),
            "regions.eu-west.redis_url",
            "is not a redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL",
        );
    }
    for good in [
        "rediss://h:6380",
        "unix:///run/redis.sock",
        "redis+unix:///run/redis.sock",
    ] {
        ok(&with(&["regions", "eu-west", "redis_url"], s(good)));
    }
    refused(
        &with(&["regions", "eu-west", "expected_nodes"], v("0")),
        "regions.eu-west.expected_nodes",
        "must be at least 1",
    );
    let l = ok(&with(&["regions", "eu-west", "expected_nodes"], v("3")));
    assert_eq!(l.config.regions["eu-west"].expected_nodes, 3);
}

// ----- plans ----------------------------------------------------------------

#[test]
fn plans_are_validated() {
    refused(
        &with(&["plans"], v("{}")),
        "plans",
        "at least one plan is required",
    );
    let mut t = base();
    set(&mut t, &["plans", "gold plan"], v("{}"));
    refused(&t, "plans.gold plan", "plan name contains ' '");

    let node = |k: &'static str| vec!["plans", "free", "node", k];
    let over = (MAX_LIMIT + 1).to_string();
    for bad in ["0", over.as_str()] {
        refused(
            &with(&node("limit"), v(bad)),
            "plans.free.node.limit",
            "must be between 1 and",
        );
        refused(
            &with(&["plans", "free", "region", "limit"], v(bad)),
            "plans.free.region.limit",
            "must be between 1 and",
        );
        refused(
            &with(&["plans", "free", "global", "limit"], v(bad)),
            "plans.free.global.limit",
            "must be between 1 and",
        );
    }
    ok(&with(&node("limit"), v(&MAX_LIMIT.to_string())));

    for bad in ["0ms", "0s", "8d", "169h", "604800001ms"] {
        refused(
            &with(&node("window"), s(bad)),
            "plans.free.node.window",
            "between 1ms and 7d",
        );
    }
    for good in ["1ms", "7d", "168h", "7s", "90m"] {
        ok(&with(&node("window"), s(good)));
    }

    // Sliding log: at most 10000 entries.
    let mut t = with(&node("algorithm"), s("sliding_log"));
    set(&mut t, &node("limit"), v("10001"));
    refused(
        &t,
        "plans.free.node.limit",
        "sliding_log keeps one entry per unit",
    );
    set(&mut t, &node("limit"), v("10000"));
    ok(&t);

    // A burst on anything but a token bucket.
    for algorithm in ["fixed_window", "sliding_window", "sliding_log"] {
        let mut t = with(&node("algorithm"), s(algorithm));
        set(&mut t, &node("burst"), v("40"));
        refused(
            &t,
            "plans.free.node.burst",
            "only token_bucket takes a burst",
        );
        // Absent, or equal to the limit, is the same as no burst.
        set(&mut t, &node("burst"), v("20"));
        ok(&t);
    }
    refused(
        &with(&["plans", "free", "region", "burst"], v("1")),
        "plans.free.region.burst",
        "only token_bucket takes a burst",
    );

    // Token bucket: burst range, and at most one unit per microsecond.
    let bucket = |k: &'static str| vec!["plans", "bucket", "node", k];
    for bad in ["0", over.as_str()] {
        refused(
            &with(&bucket("burst"), v(bad)),
            "plans.bucket.node.burst",
            "must be between 1 and",
        );
    }
    let mut t = with(&bucket("window"), s("1ms"));
    set(&mut t, &bucket("limit"), v("1001"));
    set(&mut t, &bucket("burst"), v("1"));
    refused(
        &t,
        "plans.bucket.node.limit",
        "more than one unit per microsecond",
    );
    set(&mut t, &bucket("limit"), v("1000"));
    ok(&t);

    // A plan without any tier limits nothing, and is valid.
    let mut t = base();
    set(&mut t, &["plans", "unlimited"], v("{}"));
    let l = ok(&t);
    assert!(l.config.plans["unlimited"].node.is_none());
}

// ----- tenants ----------------------------------------------------------------

fn tenant(fields: &str) -> Table {
    let mut t = base();
    set(&mut t, &["tenants", "acme"], v(&format!("{{ {fields} }}")));
    t
}

#[test]
fn tenants_are_validated() {
    for bad in ["acme corp", "a:b", "a{b}", "a|b", "a/b"] {
        let mut t = base();
        set(&mut t, &["tenants", bad, "plan"], s("free"));
        refused(&t, &format!("tenants.{bad}"), "tenant contains");
    }
    let long = "t".repeat(65);
    let mut t = base();
    set(&mut t, &["tenants", &long, "plan"], s("free"));
    refused(&t, &format!("tenants.{long}"), "at most 64");

    let e = refused(
        &tenant("plan = \"gold\""),
        "tenants.acme.plan",
        "no plan named \"gold\"",
    );
    assert!(e.to_string().contains("(plans: bucket, free)"), "{e}");

    // Overriding a tier the plan lacks needs limit and window.
    refused(
        &tenant("plan = \"bucket\", region = { limit = 5 }"),
        "tenants.acme.region.window",
        "required: the plan has no such tier",
    );
    refused(
        &tenant("plan = \"bucket\", region = { window = \"1s\" }"),
        "tenants.acme.region.limit",
        "required: the plan has no such tier",
    );
    refused(
        &tenant("plan = \"bucket\", region = { algorithm = \"fixed_window\" }"),
        "tenants.acme.region.limit",
        "required",
    );

    // Override values are validated like a plan's.
    let cases = [
        (
            "node = { limit = 0 }",
            "tenants.acme.node.limit",
            "must be between 1 and",
        ),
        (
            "region = { limit = 0 }",
            "tenants.acme.region.limit",
            "must be between 1 and",
        ),
        (
            "node = { window = \"0ms\" }",
            "tenants.acme.node.window",
            "between 1ms and 7d",
        ),
        (
            "node = { window = \"8d\" }",
            "tenants.acme.node.window",
            "between 1ms and 7d",
        ),
        (
            "node = { burst = 5 }",
            "tenants.acme.node.burst",
            "only token_bucket",
        ),
        (
            "node = { algorithm = \"sliding_log\", limit = 10001 }",
            "tenants.acme.node.limit",
            "sliding_log keeps one entry per unit",
        ),
        (
            "node = { algorithm = \"token_bucket\", burst = 0 }",
            "tenants.acme.node.burst",
            "must be between 1 and",
        ),
        (
            "node = { algorithm = \"token_bucket\", limit = 2000, window = \"1ms\" }",
            "tenants.acme.node.limit",
            "more than one unit per microsecond",
        ),
        (
            "global = { limit = 0 }",
            "tenants.acme.global.limit",
            "must be between 1 and",
        ),
    ];
    for (fields, key, reason) in cases {
        refused(&tenant(&format!("plan = \"free\", {fields}")), key, reason);
    }
    refused(
        &tenant("plan = \"bucket\", region = { limit = 0, window = \"1s\" }"),
        "tenants.acme.region.limit",
        "must be between 1 and",
    );
}

#[test]
fn unknown_tenants_are_validated() {
    let mut t = base();
    set(&mut t, &["unknown_tenants", "policy"], s("plan"));
    refused(
        &t,
        "unknown_tenants.plan",
        "required when unknown_tenants.policy = \"plan\"",
    );
    // Inside the section, the policy defaults to "plan": a plan is required.
    let mut t = base();
    set(&mut t, &["unknown_tenants"], v("{}"));
    refused(&t, "unknown_tenants.plan", "required");
    let e = refused(
        &with(&["unknown_tenants", "plan"], s("gold")),
        "unknown_tenants.plan",
        "no plan named \"gold\"",
    );
    assert!(e.to_string().contains("(plans: bucket, free)"), "{e}");
}

// ----- merging and resolved policies -----------------------------------------

#[test]
fn tenant_overrides_merge_into_the_plan() {
    let mut t = base();
    let tenants = [
        ("plain", "plan = \"free\""),
        ("only-limit", "plan = \"free\", node = { limit = 50 }"),
        (
            "only-window",
            "plan = \"free\", region = { window = \"90m\" }",
        ),
        (
            "new-tier",
            "plan = \"bucket\", region = { limit = 7, window = \"7s\" }",
        ),
        ("bucket-limit", "plan = \"bucket\", node = { limit = 20 }"),
        ("bucket-burst", "plan = \"bucket\", node = { burst = 5 }"),
        (
            "bucket-both",
            "plan = \"bucket\", node = { limit = 20, burst = 60 }",
        ),
        (
            "bucket-window",
            "plan = \"bucket\", node = { window = \"2s\" }",
        ),
        (
            "to-bucket",
            "plan = \"free\", node = { algorithm = \"token_bucket\", burst = 100 }",
        ),
        // The plan's burst belongs to its token bucket: switching the
        // algorithm away drops it instead of failing validation.
        (
            "from-bucket",
            "plan = \"bucket\", node = { algorithm = \"fixed_window\" }",
        ),
        (
            "the-rest",
            "plan = \"free\", global = { limit = 5 }, on_store_error = \"closed\"",
        ),
    ];
    for (id, fields) in tenants {
        set(&mut t, &["tenants", id], v(&format!("{{ {fields} }}")));
    }
    let l = ok(&t);
    let p = |id: &str| l.policy(id).unwrap_or_else(|| panic!("{id}"));
    let free_node = limit(20, 1000, Algorithm::SlidingWindow, 20);
    let free_region = limit(600, 60_000, Algorithm::SlidingWindow, 600);
    let bucket_node = limit(10, 1000, Algorithm::TokenBucket, 30);

    let plain = p("plain");
    assert_eq!(plain.plan, "free");
    assert_eq!(plain.node, Some(free_node.clone()));
    assert_eq!(plain.region, Some(free_region.clone()));
    assert_eq!(plain.global, Some(1000));
    assert_eq!(plain.on_store_error, StoreErrorMode::Local);
    assert!(!plain.key_scoped);

    // Only the limit: the plan's window and algorithm stay.
    let only_limit = p("only-limit");
    assert_eq!(
        only_limit.node,
        Some(limit(50, 1000, Algorithm::SlidingWindow, 50))
    );
    assert_eq!(only_limit.region, Some(free_region.clone()));
    assert_eq!(only_limit.plan, "free");

    assert_eq!(
        p("only-window").region,
        Some(limit(600, 5_400_000, Algorithm::SlidingWindow, 600))
    );
    assert_eq!(p("only-window").node, Some(free_node.clone()));

    let new_tier = p("new-tier");
    assert_eq!(
        new_tier.region,
        Some(limit(7, 7000, Algorithm::SlidingWindow, 7))
    );
    assert_eq!(new_tier.node, Some(bucket_node.clone()));
    assert_eq!(new_tier.global, None);

    // The burst follows a new limit unless given.
    assert_eq!(
        p("bucket-limit").node,
        Some(limit(20, 1000, Algorithm::TokenBucket, 20))
    );
    assert_eq!(
        p("bucket-burst").node,
        Some(limit(10, 1000, Algorithm::TokenBucket, 5))
    );
    assert_eq!(
        p("bucket-both").node,
        Some(limit(20, 1000, Algorithm::TokenBucket, 60))
    );
    assert_eq!(
        p("bucket-window").node,
        Some(limit(10, 2000, Algorithm::TokenBucket, 30))
    );
    assert_eq!(
        p("to-bucket").node,
        Some(limit(20, 1000, Algorithm::TokenBucket, 100))
    );
    assert_eq!(
        p("from-bucket").node,
        Some(limit(10, 1000, Algorithm::FixedWindow, 10))
    );

    let rest = p("the-rest");
    assert_eq!(rest.global, Some(5));
    assert_eq!(rest.on_store_error, StoreErrorMode::Closed);
    assert_eq!(rest.node, Some(free_node));

    let ids: Vec<&str> = l.policies().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), tenants.len());
    assert!(ids.contains(&"from-bucket"));
}

#[test]
fn policy_of_known_and_unknown_tenants() {
    let mut t = base();
    set(&mut t, &["tenants", "acme", "plan"], s("bucket"));

    // Deny (explicit, and the default without the section).
    for deny in [true, false] {
        let mut t = t.clone();
        if deny {
            set(&mut t, &["unknown_tenants", "policy"], s("deny"));
        }
        let l = ok(&t);
        assert_eq!(l.policy("acme").unwrap().plan, "bucket");
        assert!(l.policy("stranger").is_none());
        assert!(l.unknown_policy().is_none());
    }

    // Plan: unknown tenants get the plan, known ones keep theirs.
    let mut t = t.clone();
    set(&mut t, &["unknown_tenants", "policy"], s("plan"));
    set(&mut t, &["unknown_tenants", "plan"], s("free"));
    let l = ok(&t);
    assert_eq!(l.config.unknown_tenants.policy, UnknownPolicy::Plan);
    assert_eq!(l.policy("acme").unwrap().plan, "bucket");
    let stranger = l.policy("stranger").unwrap();
    assert_eq!(stranger.plan, "free");
    assert_eq!(
        stranger.node,
        Some(limit(20, 1000, Algorithm::SlidingWindow, 20))
    );
    assert_eq!(l.unknown_policy().unwrap().as_ref(), stranger.as_ref());

    // `policy` defaults to "plan" inside the section.
    let mut t = base();
    set(&mut t, &["unknown_tenants", "plan"], s("bucket"));
    assert_eq!(ok(&t).policy("anyone").unwrap().plan, "bucket");
}

#[test]
fn limit_share_divides_limit_and_burst() {
    let region = limit(600, 60_000, Algorithm::SlidingWindow, 600);
    assert_eq!(
        region.share(2),
        limit(300, 60_000, Algorithm::SlidingWindow, 300)
    );
    assert_eq!(region.share(1), region);
    // Zero nodes is treated as one, never a division by zero.
    assert_eq!(region.share(0), region);
    // Never below one unit.
    assert_eq!(
        limit(2, 1000, Algorithm::FixedWindow, 2).share(3),
        limit(1, 1000, Algorithm::FixedWindow, 1)
    );
    let bucket = limit(10, 1000, Algorithm::TokenBucket, 30);
    assert_eq!(bucket.share(4), limit(2, 1000, Algorithm::TokenBucket, 7));
    assert_eq!(bucket.share(100), limit(1, 1000, Algorithm::TokenBucket, 1));
}

// ----- environment overrides -----------------------------------------------------

#[test]
fn env_overrides_are_applied() {
    let l = load_env(&[
        ("TIERLIMIT__KAFKA__BROKERS", "x"),
        ("TIERLIMIT__KAFKA__PARTITIONS", "16"),
        ("TIERLIMIT__NODE__PUBLISH_BATCH", "7"),
        ("TIERLIMIT__NODE__MAX_STALENESS", "5s"),
        ("TIERLIMIT__REGIONS__EU-WEST__EXPECTED_NODES", "3"),
        ("TIERLIMIT__KAFKA__CLIENT__SASL.PASSWORD", "\"12345\""),
        ("TIERLIMIT__KAFKA__CLIENT__SASL.USERNAME", "svc-tierlimit"),
        ("TIERLIMIT__PLANS__FREE__KEY_SCOPED", "true"),
        // Not ours: ignored.
        ("PATH", "/usr/bin"),
        ("TIERLIMIT_KAFKA__BROKERS", "ignored"),
        ("tierlimit__kafka__brokers", "ignored"),
    ])
    .unwrap();
    let c = &l.config;
    assert_eq!(c.kafka.brokers, "x");
    assert_eq!(c.kafka.partitions, 16);
    assert_eq!(c.node.publish_batch, 7);
    assert_eq!(c.node.max_staleness, Some(Duration::from_secs(5)));
    assert_eq!(c.regions["eu-west"].expected_nodes, 3);
    assert_eq!(c.kafka.client["sasl.password"], "12345");
    assert_eq!(c.kafka.client["sasl.username"], "svc-tierlimit");
    assert!(l.policy("x").is_none());
    assert!(c.plans["free"].key_scoped);

    // The last of two settings of one key wins.
    let l = load_env(&[
        ("TIERLIMIT__KAFKA__BROKERS", "a"),
        ("TIERLIMIT__KAFKA__BROKERS", "b"),
    ])
    .unwrap();
    assert_eq!(l.config.kafka.brokers, "b");

    // Whole new entries can be added.
    let l = load_env(&[
        ("TIERLIMIT__TENANTS__ACME__PLAN", "bucket"),
        ("TIERLIMIT__UNKNOWN_TENANTS__PLAN", "free"),
    ])
    .unwrap();
    assert_eq!(l.policy("acme").unwrap().plan, "bucket");
    assert_eq!(l.policy("other").unwrap().plan, "free");
}

#[test]
fn env_override_errors_name_the_key_or_the_variable() {
    // An overridden value is validated like any other.
    let e = load_env(&[("TIERLIMIT__AGGREGATOR__RETENTION_DAYS", "0")]).unwrap_err();
    assert_eq!(e.key(), Some("aggregator.retention_days"), "{e}");
    let e = load_env(&[("TIERLIMIT__PLANS__FREE__NODE__LIMIT", "0")]).unwrap_err();
    assert_eq!(e.key(), Some("plans.free.node.limit"), "{e}");
    let e = load_env(&[("TIERLIMIT__KAFKA__PARTITIONS", "many")]).unwrap_err();
    assert_eq!(e.key(), Some("kafka.partitions"), "{e}");
    assert!(
        e.to_string().contains("invalid type: string \"many\""),
        "{e}"
    );
    // A value that parses as TOML keeps its TOML type: a numeric string must be quoted.
    let e = load_env(&[("TIERLIMIT__KAFKA__CLIENT__SASL.PASSWORD", "12345")]).unwrap_err();
    assert_eq!(e.key(), Some("kafka.client.sasl.password"), "{e}");
    let e = load_env(&[("TIERLIMIT__NODE__FLUSH_INTERVALL", "1s")]).unwrap_err();
    assert_eq!(e.key(), Some("node.flush_intervall"), "{e}");

    // A path through a value that is not a table names the variable.
    for (var, through) in [
        ("TIERLIMIT__CLUSTER__NAME", "cluster"),
        ("TIERLIMIT__KAFKA__BROKERS__HOST", "brokers"),
        ("TIERLIMIT__PLANS__FREE__NODE__LIMIT__MAX", "limit"),
    ] {
        let e = load_env(&[(var, "1")]).unwrap_err();
        assert!(matches!(e, ConfigError::Env { .. }), "{e:?}");
        assert_eq!(e.key(), None);
        assert_eq!(
            e.to_string(),
            format!("environment override {var}: `{through}` is not a table")
        );
    }
    for var in [
        "TIERLIMIT__KAFKA____BROKERS",
        "TIERLIMIT__",
        "TIERLIMIT__KAFKA__",
    ] {
        let e = load_env(&[(var, "x")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("environment override {var}: empty path segment")
        );
    }
    // Errors in the file come before the environment is looked at.
    let e = Config::from_toml_with_env("cluster = ", env(&[("TIERLIMIT__", "x")])).unwrap_err();
    assert!(matches!(e, ConfigError::Syntax(_)), "{e:?}");
}

#[test]
fn load_reports_an_unreadable_file() {
    let e = Config::load(std::path::Path::new("/nonexistent/tierlimit.toml")).unwrap_err();
    assert!(matches!(e, ConfigError::Io { .. }), "{e:?}");
    assert_eq!(e.key(), None);
    assert!(e
        .to_string()
        .starts_with("cannot read config file /nonexistent/tierlimit.toml: "));
}

// ----- wire keys ------------------------------------------------------------

#[test]
fn wire_defaults_are_signed_v3() {
    let l = ok(&base());
    let w = &l.config.wire;
    assert_eq!(w.version, 3);
    assert!(!w.accept_unsigned);
    assert_eq!(w.delta_keys["eu-west"].sign_with, "eu-1");
}

#[test]
fn signing_is_required_unless_explicitly_unsigned() {
    let t = without(&["wire", "delta_keys", "eu-west"]);
    refused(&t, "wire.delta_keys.eu-west", "required: deltas are signed");
    let mut t = without(&["wire", "broadcast_public_keys", "agg-1"]);
    set(&mut t, &["wire", "broadcast_key"], v("\"x\""));
    refused(&t, "wire.broadcast_key", "no key \"x\"");
    let t = without(&["wire", "broadcast_key"]);
    refused(&t, "wire.broadcast_key", "required");
    let mut t = base();
    t.remove("wire");
    refused(&t, "wire.delta_keys.eu-west", "accept_unsigned");
    set(&mut t, &["wire", "accept_unsigned"], v("true"));
    ok(&t);
    // JSON cannot be signed.
    set(&mut t, &["wire", "version"], v("1"));
    ok(&t);
    refused(
        &with(&["wire", "version"], v("1")),
        "wire.version",
        "cannot be signed",
    );
    ok(&with(&["wire", "version"], v("2")));
    refused(
        &with(&["wire", "version"], v("4")),
        "wire.version",
        "must be 1, 2 or 3",
    );
}

#[test]
fn global_tiers_take_calendar_periods() {
    use tierlimit_shared::config::GlobalTier;
    use tierlimit_shared::period::PeriodKind;
    let with_acme = |path: &[&str], value: toml::Value| {
        let mut t = with(path, value);
        set(&mut t, &["tenants", "acme", "plan"], s("free"));
        t
    };
    // `limit` keeps meaning one UTC day.
    let l = ok(&with_acme(
        &["plans", "free", "global"],
        v("{ limit = 1000 }"),
    ));
    assert_eq!(l.policy("acme").unwrap().global, Some(1000));
    assert!(l.policy("acme").unwrap().global_periods.is_empty());
    // A plan with hour, day and month tiers; a tenant overriding the month
    // inherits the plan's hour and day.
    let mut t = with_acme(
        &["plans", "free", "global"],
        v("{ hour = 100, day = 1000, month = 20000 }"),
    );
    set(
        &mut t,
        &["tenants", "acme", "global"],
        v("{ month = 50000 }"),
    );
    let l = ok(&t);
    let p = l.policy("acme").unwrap();
    assert_eq!(p.global, Some(1000));
    assert_eq!(
        p.global_periods,
        vec![
            GlobalTier {
                zone: Default::default(),
                kind: PeriodKind::Hour,
                limit: 100
            },
            GlobalTier {
                zone: Default::default(),
                kind: PeriodKind::Month,
                limit: 50000
            },
        ]
    );
    // A month alone has no day tier.
    let l = ok(&with_acme(&["plans", "free", "global"], v("{ month = 7 }")));
    let p = l.policy("acme").unwrap();
    assert_eq!((p.global, p.global_periods.len()), (None, 1));
    // Refusals name the key.
    refused(
        &with(&["plans", "free", "global"], v("{ limit = 1, day = 2 }")),
        "plans.free.global.day",
        "the same tier",
    );
    refused(
        &with(&["plans", "free", "global"], v("{ month = 0 }")),
        "plans.free.global.month",
        "between 1 and",
    );
    refused(
        &with(&["plans", "free", "global"], v("{ fortnight = 3 }")),
        "plans.free.global.fortnight",
        "fortnight",
    );
    // Wire v2 cannot carry a month.
    let mut t = with(&["plans", "free", "global"], v("{ month = 7 }"));
    set(&mut t, &["wire", "version"], v("2"));
    refused(&t, "wire.version", "plans.free.global.month");
}

#[test]
fn time_zones_put_every_global_tier_on_the_zone_calendar() {
    use tierlimit_shared::config::GlobalTier;
    use tierlimit_shared::period::PeriodKind;
    let with_acme = |path: &[&str], value: toml::Value| {
        let mut t = with(path, value);
        set(&mut t, &["tenants", "acme", "plan"], s("free"));
        t
    };
    let berlin = tierlimit_shared::zone::Zone::named("Europe/Berlin").unwrap();
    let mut t = with_acme(
        &["plans", "free", "global"],
        v("{ hour = 100, day = 1000 }"),
    );
    set(&mut t, &["plans", "free", "time_zone"], s("Europe/Berlin"));
    let l = ok(&t);
    let p = l.policy("acme").unwrap();
    // In a zone the day is a tier of that zone, not the UTC day's field.
    assert_eq!((p.global, p.time_zone), (None, berlin));
    assert_eq!(
        p.global_periods,
        vec![
            GlobalTier {
                kind: PeriodKind::Hour,
                limit: 100,
                zone: berlin
            },
            GlobalTier {
                kind: PeriodKind::Day,
                limit: 1000,
                zone: berlin
            },
        ]
    );
    assert_eq!(p.global_limit(PeriodKind::Day), Some(1000));
    // A tenant's zone wins over its plan's, and spelling UTC out is UTC.
    set(&mut t, &["tenants", "acme", "time_zone"], s("UTC"));
    let l = ok(&t);
    let p = l.policy("acme").unwrap();
    assert_eq!((p.global, p.global_periods.len()), (Some(1000), 1));
    assert!(p.time_zone.is_utc());
    // Refusals name the key.
    set(&mut t, &["tenants", "acme", "time_zone"], s("Mars/Olympus"));
    refused(&t, "tenants.acme.time_zone", "unknown time zone");
    let mut t = with_acme(&["plans", "free", "global"], v("{ hour = 100 }"));
    set(
        &mut t,
        &["plans", "free", "time_zone"],
        s("Australia/Lord_Howe"),
    );
    refused(&t, "plans.free.time_zone", "part of an hour");
    // Wire v2 carries UTC days only.
    let mut t = with_acme(&["plans", "free", "global"], v("{ day = 10 }"));
    set(
        &mut t,
        &["plans", "free", "time_zone"],
        s("America/New_York"),
    );
    set(&mut t, &["wire", "version"], v("2"));
    refused(&t, "wire.version", "plans.free.time_zone");
}

#[test]
fn wire_key_material_is_checked() {
    refused(
        &with(
            &["wire", "delta_keys", "eu-west", "keys", "eu-1"],
            s("c2hvcnQ="),
        ),
        "wire.delta_keys.eu-west.keys.eu-1",
        "at least 32 are required",
    );
    refused(
        &with(&["wire", "delta_keys", "eu-west", "sign_with"], s("eu-2")),
        "wire.delta_keys.eu-west.sign_with",
        "no key \"eu-2\"",
    );
    refused(
        &with(&["wire", "delta_keys", "mars"], v("{ sign_with = \"m\", keys = { m = \"yjSvs3/DXCopz9CRhvi6yCiWGD8jfHtGu3HHkHYkOG8=\" } }")),
        "wire.delta_keys.mars",
        "no region named \"mars\"",
    );
    refused(
        &with(&["wire", "broadcast_public_keys", "agg-1"], s("not base64")),
        "wire.broadcast_public_keys.agg-1",
        "not base64",
    );
    // The private key must match the public key of broadcast_key.
    ok(&with(&["wire", "broadcast_private_key"], s(AGG_1_PRIVATE)));
    refused(
        &with(&["wire", "broadcast_private_key"], s(AGG_2_PRIVATE)),
        "wire.broadcast_private_key",
        "does not match wire.broadcast_public_keys.agg-1",
    );
    // Rotation: two public keys, the new one signing.
    let mut t = with(&["wire", "broadcast_public_keys", "agg-2"], s(AGG_2_PUBLIC));
    set(&mut t, &["wire", "broadcast_key"], s("agg-2"));
    set(&mut t, &["wire", "broadcast_private_key"], s(AGG_2_PRIVATE));
    ok(&t);
    // Key ids name one region.
    let mut t = with(&["regions", "us"], v("{ redis_url = \"redis://h\" }"));
    set(
        &mut t,
        &["wire", "delta_keys", "us"],
        v("{ sign_with = \"eu-1\", keys = { eu-1 = \"X5Jz8lDRgOOgFVEUIGZo4N7JNtIo9eDjWwH22pSd2tw=\" } }"),
    );
    refused(&t, "wire.delta_keys.us.keys.eu-1", "unique across regions");
}

#[test]
fn the_private_key_comes_from_the_environment() {
    let l = load_env(&[("TIERLIMIT__WIRE__BROADCAST_PRIVATE_KEY", AGG_1_PRIVATE)]).unwrap();
    assert_eq!(
        l.config.wire.broadcast_private_key.as_deref(),
        Some(AGG_1_PRIVATE)
    );
}

// ----- the documented example -----------------------------------------------------

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../regions.example.toml");

#[test]
fn example_config_validates_and_resolves_as_documented() {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let l = Config::from_toml(&text).unwrap_or_else(|e| panic!("{EXAMPLE}: {e}"));
    let c = &l.config;
    assert_eq!(c.cluster, "demo");
    assert_eq!(c.kafka.partitions, 8);
    assert!(
        c.kafka.client.is_empty(),
        "client examples are commented out"
    );
    assert_eq!(c.node.max_staleness, Some(Duration::from_secs(30)));

    let regions: Vec<&str> = c.regions.keys().map(String::as_str).collect();
    assert_eq!(regions, ["ap-south", "eu-west", "us-east"]);
    let mut urls: Vec<&str> = c.regions.values().map(|r| r.redis_url.as_str()).collect();
    urls.sort();
    assert_eq!(
        urls,
        [
            "redis://127.0.0.1:6379",
            "redis://127.0.0.1:6380",
            "redis://127.0.0.1:6381"
        ]
    );
    assert!(c.regions.values().all(|r| r.expected_nodes == 2));

    // Plans exercise every algorithm and every fail mode.
    let mut algorithms = Vec::new();
    for p in c.plans.values() {
        for tier in [&p.node, &p.region].into_iter().flatten() {
            algorithms.push(tier.algorithm);
        }
    }
    for a in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::SlidingLog,
    ] {
        assert!(algorithms.contains(&a), "{a:?} not exercised");
    }
    let modes: Vec<StoreErrorMode> = c.plans.values().map(|p| p.on_store_error).collect();
    for m in [
        StoreErrorMode::Open,
        StoreErrorMode::Closed,
        StoreErrorMode::Local,
    ] {
        assert!(modes.contains(&m), "{m:?} not exercised");
    }

    let free = l.policy("free-for-all").expect("unknown tenants get free");
    assert_eq!(free.plan, "free");
    assert_eq!(free.node, Some(limit(20, 1000, Algorithm::FixedWindow, 20)));
    assert_eq!(
        free.region,
        Some(limit(600, 60_000, Algorithm::SlidingWindow, 600))
    );
    assert_eq!(free.global, Some(100_000));
    assert_eq!(free.on_store_error, StoreErrorMode::Local);
    assert!(!free.key_scoped);

    let acme = l.policy("acme").unwrap();
    assert_eq!(acme.plan, "pro");
    assert_eq!(acme.node, Some(limit(80, 1000, Algorithm::TokenBucket, 80)));
    assert_eq!(
        acme.region,
        Some(limit(3000, 60_000, Algorithm::SlidingWindow, 3000))
    );
    assert_eq!(acme.global, Some(2_000_000));
    assert_eq!(acme.on_store_error, StoreErrorMode::Open);

    let globex = l.policy("globex").unwrap();
    assert_eq!(globex.plan, "enterprise");
    assert_eq!(
        globex.node,
        Some(limit(200, 1000, Algorithm::SlidingLog, 200))
    );
    assert_eq!(
        globex.region,
        Some(limit(40_000, 120_000, Algorithm::TokenBucket, 10_000))
    );
    assert_eq!(globex.global, Some(10_000_000));
    assert_eq!(globex.on_store_error, StoreErrorMode::Local);
    assert!(globex.key_scoped);

    let initech = l.policy("initech").unwrap();
    assert_eq!(initech.plan, "free");
    assert_eq!(initech.node, Some(limit(5, 7000, Algorithm::SlidingLog, 5)));
    assert_eq!(initech.region, free.region);
}

#[test]
fn example_config_documents_every_key() {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let keys = [
        "cluster",
        "[kafka]",
        "brokers",
        "deltas_topic",
        "global_topic",
        "partitions",
        "replication_factor",
        "[kafka.client]",
        "[node]",
        "flush_interval",
        "store_timeout",
        "store_retry_interval",
        "max_staleness",
        "publish_batch",
        "relaxed_flush_interval",
        "urgent_fraction",
        "[aggregator]",
        "group_id",
        "assignment",
        "broadcast_interval",
        "broadcast_fraction",
        "retention_days",
        "[regions.",
        "redis_url",
        "expected_nodes",
        "[plans.",
        "node",
        "region",
        "global",
        "limit",
        "window",
        "algorithm",
        "burst",
        "on_store_error",
        "key_scoped",
        "[tenants.",
        "plan",
        "[unknown_tenants]",
        "policy",
        "fixed_window",
        "sliding_window",
        "token_bucket",
        "sliding_log",
        "\"open\"",
        "\"closed\"",
        "\"local\"",
        "\"deny\"",
        "security.protocol",
        "sasl.mechanisms",
        "ssl.ca.location",
        "TIERLIMIT__",
        "[auth]",
        "open_scopes",
        "[auth.keys.",
        "sha256",
        "scopes",
        "tenants",
        "[auth.clients.",
        "dns_name",
        "[http]",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "header_read_timeout",
        "request_timeout",
        "max_header_bytes",
        "max_uri_bytes",
        "max_concurrent_requests",
    ];
    for key in keys {
        assert!(text.contains(key), "{key} is not documented in the example");
    }
    // And it stays valid with the environment overrides it documents.
    let l = Config::from_toml_with_env(
        &text,
        env(&[
            ("TIERLIMIT__KAFKA__BROKERS", "kafka-1:9092,kafka-2:9092"),
            ("TIERLIMIT__KAFKA__PARTITIONS", "16"),
            ("TIERLIMIT__NODE__MAX_STALENESS", "30s"),
            (
                "TIERLIMIT__REGIONS__EU-WEST__REDIS_URL",
                "rediss://redis.eu:6380",
            ),
        ]),
    )
    .unwrap();
    assert_eq!(l.config.kafka.brokers, "kafka-1:9092,kafka-2:9092");
    assert_eq!(
        l.config.regions["eu-west"].redis_url,
        "rediss://redis.eu:6380"
    );
}

// ----- [auth] and [http] -------------------------------------------------------------

#[test]
fn auth_and_http_errors_name_the_key() {
    let base = std::fs::read_to_string(EXAMPLE).unwrap();
    let with = |extra: &str| Config::from_toml(&format!("{base}\n{extra}"));
    let err = |extra: &str| with(extra).unwrap_err();
    let e = err("[auth.keys.bad]\nsha256 = \"abc\"\nscopes = [\"check\"]\n");
    assert_eq!(e.key(), Some("auth.keys.bad.sha256"), "{e}");
    assert!(e.to_string().contains("64 hex digits"), "{e}");
    let e = err("[auth.keys.bad]\nsha256 = \"8f434346648f6b96df89dda901c5176b10a6d83961dd3c1ac88b59b2dc327aa4\"\nscopes = [\"root\"]\n");
    assert!(e.key().unwrap().starts_with("auth.keys.bad.scopes"), "{e}");
    assert!(e.to_string().contains("root"), "{e}");
    // The example's keys validated; the defaults are the safe ones.
    let l = with("").unwrap();
    assert!(l.config.auth.open_scopes.is_empty());
    assert_eq!(l.config.auth.keys.len(), 2);
    assert!(l.config.http.tls().is_none());
    let mut text = base.replace("open_scopes = []", "open_scopes = [\"admin\"]");
    assert_eq!(
        Config::from_toml(&text).unwrap_err().key(),
        Some("auth.open_scopes")
    );
    text = base.replace("max_uri_bytes = 4096", "max_uri_bytes = 10");
    assert_eq!(
        Config::from_toml(&text).unwrap_err().key(),
        Some("http.max_uri_bytes")
    );
    text = base.replace("# tls_cert = ", "tls_cert = ");
    assert_eq!(
        Config::from_toml(&text).unwrap_err().key(),
        Some("http.tls_key")
    );
}

// ----- plans only the gateway names (issue 29, item 4) ----------------------

/// BASE (plan `free` has a global limit of 1000, `bucket` none) with
/// `extra` tables appended.
fn with_tables(extra: &str) -> Result<Loaded, ConfigError> {
    Config::from_toml(&format!(
        "{BASE}\n[plans.other]\nglobal = {{ limit = 5 }}\n{extra}"
    ))
}

/// A domain naming its tenants by an entry, under `rls.plan = plan`.
fn gateway(plan: &str, unknown: &str) -> String {
    format!(
        "{unknown}\n[rls]\nplan = \"{plan}\"\n[[rls.domains]]\ndomain = \"edge\"\ntenant_entry = \"tenant\"\n"
    )
}

#[track_caller]
fn gateway_refused(r: Result<Loaded, ConfigError>, key: &str, reasons: &[&str]) {
    let e = match r {
        Ok(_) => panic!("should be refused ({key})"),
        Err(e) => e,
    };
    assert_eq!(e.key(), Some(key), "{e}");
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "{msg:?}");
    for reason in reasons {
        assert!(msg.contains(reason), "{msg:?} does not contain {reason:?}");
    }
}

/// A plan with a global tier that only the gateway names is refused unless
/// the aggregator resolves the same tenants to the same global limit: it
/// resolves unlisted tenants through `unknown_tenants` alone, so it would
/// never broadcast them and every region would admit its whole limit.
#[test]
fn a_gateway_plans_global_tier_must_be_the_aggregators() {
    let deny = "[unknown_tenants]\npolicy = \"deny\"";
    let plan = |p: &str| format!("[unknown_tenants]\npolicy = \"plan\"\nplan = \"{p}\"");
    // rls.plan with a global tier, unknown tenants denied.
    gateway_refused(
        with_tables(&gateway("free", deny)),
        "rls.plan",
        &[
            "plan \"free\"",
            "1000 a day",
            "RLS domain \"edge\"",
            "unknown_tenants.policy = \"deny\"",
            "unknown_tenants.plan = \"free\"",
            "a plan without a global tier",
        ],
    );
    // Unknown tenants under a plan without a global tier, or another limit.
    gateway_refused(
        with_tables(&gateway("free", &plan("bucket"))),
        "rls.plan",
        &["unknown_tenants.plan \"bucket\", which has no global tier"],
    );
    gateway_refused(
        with_tables(&gateway("free", &plan("other"))),
        "rls.plan",
        &["unknown_tenants.plan \"other\", whose global limit is 5"],
    );
    // A domain's own plan is named by its own key.
    gateway_refused(
        with_tables(&format!(
            "{deny}\n[rls]\nplan = \"bucket\"\n[[rls.domains]]\ndomain = \"a\"\ntenant_entry = \"t\"\n[[rls.domains]]\ndomain = \"edge\"\ntenant_entry = \"tenant\"\nplan = \"free\"\n"
        )),
        "rls.domains[1].plan",
        &["plan \"free\"", "RLS domain \"edge\""],
    );
    // Without a tenant entry the domain is the tenant: listing it is a fix.
    let single = format!("{deny}\n[rls]\nplan = \"free\"\n[[rls.domains]]\ndomain = \"acme\"\n");
    gateway_refused(
        with_tables(&single),
        "rls.plan",
        &["or list tenant \"acme\" under [tenants]"],
    );
    with_tables(&format!("{single}[tenants.acme]\nplan = \"bucket\"\n")).unwrap();

    // Accepted: the aggregator resolves unlisted tenants to the same limit
    // (the same plan, or another with the same global limit), or the
    // gateway's plan has no global tier.
    for ok in [
        gateway("free", &plan("free")),
        format!(
            "[plans.same]\nglobal = {{ limit = 1000 }}\n{}",
            gateway("free", &plan("same"))
        ),
        gateway("bucket", deny),
        gateway("bucket", &plan("other")),
    ] {
        let l = with_tables(&ok).unwrap_or_else(|e| panic!("{e}\n{ok}"));
        // What the nodes enforce for an unlisted tenant through the
        // gateway, the aggregator enforces too.
        let domain = l.rls.domain("edge").unwrap();
        let node = l.policy_with_plan("newcomer", domain.plan.as_deref());
        if let Some(g) = node.and_then(|p| p.global) {
            assert_eq!(l.policy("newcomer").and_then(|p| p.global), Some(g), "{ok}");
        }
    }
}

/// `limits.source = "topic"`: tenants only from the topic, signed records,
/// wire v3; each refusal names its key.
#[test]
fn limits_from_the_topic_are_refused_when_ambiguous_or_unsigned() {
    let topic = |t: &mut Table| {
        set(t, &["limits", "source"], s("topic"));
        set(
            t,
            &["wire", "limits_public_keys"],
            v(&format!("{{ lim-1 = \"{AGG_2_PUBLIC}\" }}")),
        );
    };
    let mut t = base();
    topic(&mut t);
    let l = ok(&t);
    assert!(
        l.limits().is_none(),
        "attached by the process, not the loader"
    );
    assert!(l.policy("anyone").is_none());

    // Two sources for one tenant: refused.
    let mut t = base();
    topic(&mut t);
    set(&mut t, &["tenants", "acme"], v("{ plan = \"free\" }"));
    refused(&t, "tenants", "tenants are records of the limits topic");

    // Unsigned records would be accepted: refused.
    let mut t = base();
    set(&mut t, &["limits", "source"], s("topic"));
    refused(&t, "wire.limits_public_keys", "at least one key");

    // The broadcast key cannot sign limits.
    let mut t = base();
    topic(&mut t);
    set(
        &mut t,
        &["wire", "limits_public_keys"],
        v("{ lim-1 = \"6kpsY+KcUgq+9VB7Ey7F+ZVHdq6+vnuSQh7qaRRG0iw=\" }"),
    );
    refused(&t, "wire.limits_public_keys.lim-1", "is a broadcast key");

    // A private key must match its public key, and name it.
    let mut t = base();
    topic(&mut t);
    set(&mut t, &["wire", "limits_private_key"], s(AGG_1_PRIVATE));
    refused(
        &t,
        "wire.limits_key",
        "required with wire.limits_private_key",
    );
    set(&mut t, &["wire", "limits_key"], s("lim-1"));
    refused(&t, "wire.limits_private_key", "does not match");
    set(&mut t, &["wire", "limits_private_key"], s(AGG_2_PRIVATE));
    ok(&t);

    // Versions travel in v3 only.
    let mut t = base();
    topic(&mut t);
    set(&mut t, &["wire", "version"], v("2"));
    refused(&t, "limits.source", "wire.version = 3");

    // One topic per purpose.
    let t = with(&["kafka", "limits_topic"], s("tierlimit.deltas"));
    refused(&t, "kafka.limits_topic", "must differ");
    let t = with(&["limits", "status_interval"], s("1ms"));
    refused(&t, "limits.status_interval", "");

    // Plans may all live on the topic.
    let mut t = without(&["plans"]);
    topic(&mut t);
    ok(&t);
    refused(&without(&["plans"]), "plans", "at least one plan");
}

/// With the topic, a reload keeps the table and may not switch sources.
#[test]
fn a_reload_keeps_the_limits_table_and_refuses_a_source_change() {
    use std::sync::Arc;
    use tierlimit_shared::limits::{Body, LimitsRecord, LimitsTable, Subject};
    let dir = std::env::temp_dir().join(format!("tl-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    let mut t = base();
    set(&mut t, &["limits", "source"], s("topic"));
    set(
        &mut t,
        &["wire", "limits_public_keys"],
        v(&format!("{{ lim-1 = \"{AGG_2_PUBLIC}\" }}")),
    );
    std::fs::write(&path, text(&t)).unwrap();
    let mut loaded = Config::load(&path).unwrap();
    let table = Arc::new(LimitsTable::new());
    loaded.attach_limits(Arc::clone(&table));
    let live = tierlimit_shared::reload::live(loaded);
    table
        .apply(&LimitsRecord {
            subject: Subject::Tenant("acme".into()),
            version: 1,
            writer: "t".into(),
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
        })
        .unwrap();
    assert_eq!(live.load().policy("acme").unwrap().global, Some(1000));
    // The file's plan changes: the topic's tenant follows it.
    set(&mut t, &["plans", "free", "global"], v("{ limit = 7 }"));
    std::fs::write(&path, text(&t)).unwrap();
    tierlimit_shared::reload::reload(&path, &live).unwrap();
    assert_eq!(live.load().policy("acme").unwrap().global, Some(7));
    // Back to the file: refused, the table stays.
    set(&mut t, &["limits", "source"], s("file"));
    std::fs::write(&path, text(&t)).unwrap();
    let e = tierlimit_shared::reload::reload(&path, &live).unwrap_err();
    assert_eq!(e.key(), Some("limits.source"));
    assert!(live.load().limits().is_some());
    std::fs::remove_dir_all(&dir).ok();
}
