//! The configuration most single-node suites start from: one region `eu`
//! on the test's Redis, Kafka detached (brokers on a closed port: node and
//! region tiers must not depend on it; the global tier has its own suites),
//! a store timeout generous enough that a loaded 2-core machine never
//! pushes a check into a fail mode, and unknown tenants denied. Each suite
//! appends its plans, tenants and sections.

/// One region `eu` on `redis_url` with `expected_nodes`, then `extra`
/// (TOML tables: plans, tenants, `[rls]` …).
pub fn one_region(redis_url: &str, expected_nodes: u32, extra: &str) -> String {
    format!(
        r#"
cluster = "test"
[kafka]
brokers = "127.0.0.1:1"
[node]
store_timeout = "2s"
store_retry_interval = "50ms"
# Kafka is detached, so the view is never read: decide the global tier
# without it from the start (node.view_wait).
view_wait = "0s"
[regions.eu]
redis_url = "{redis_url}"
expected_nodes = {expected_nodes}
[unknown_tenants]
policy = "deny"
{extra}
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_base_configuration_is_valid_and_takes_the_suites_tables() {
        let text = one_region(
            "redis://127.0.0.1:6379",
            2,
            "[plans.p]\nregion = { limit = 5, window = \"1h\" }\n[tenants.acme]\nplan = \"p\"\n",
        );
        // As write_config writes it: with the test keys of [wire].
        let loaded = tierlimit_shared::Config::from_toml(&testkit::with_wire_keys(&text))
            .expect("valid configuration");
        assert_eq!(loaded.config.regions["eu"].expected_nodes, 2);
        assert_eq!(loaded.config.kafka.brokers, "127.0.0.1:1");
        assert!(loaded.policy("acme").is_some());
        assert!(
            loaded.policy("stranger").is_none(),
            "unknown tenants denied"
        );
    }
}
