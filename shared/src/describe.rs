//! A human-readable account of what a validated configuration enforces, for
//! `region-node check-config` and for operators reviewing a change.

use std::fmt::Write;
use std::time::Duration;

use crate::config::{Limit, Loaded, Policy};
use crate::duration;

fn limit_line(out: &mut String, tier: &str, l: &Limit, share: Option<u32>) {
    let window = duration::format(Duration::from_millis(l.window_ms));
    let _ = write!(
        out,
        "    {tier:<7}{} per {window:<6} {}",
        l.limit,
        l.algorithm.name()
    );
    if l.algorithm == crate::config::Algorithm::TokenBucket {
        let _ = write!(out, " (burst {})", l.burst);
    }
    if let Some(n) = share {
        let s = l.share(n);
        let _ = write!(out, "  [local fail mode: {} per node of {n}]", s.limit);
    }
    out.push('\n');
}

fn policy_lines(out: &mut String, p: &Policy, nodes: Option<u32>) {
    match &p.node {
        Some(l) => limit_line(out, "node", l, None),
        None => out.push_str("    node   unlimited\n"),
    }
    match &p.region {
        Some(l) => limit_line(out, "region", l, nodes),
        None => out.push_str("    region unlimited\n"),
    }
    match p.global {
        Some(g) => {
            let _ = writeln!(out, "    global {g} per UTC day");
        }
        None => out.push_str("    global unlimited\n"),
    }
    let _ = writeln!(
        out,
        "    on_store_error = {}{}",
        p.on_store_error.name(),
        if p.key_scoped {
            ", counted per (tenant, key)"
        } else {
            ""
        }
    );
}

/// Describes every plan, tenant and region of `loaded`.
pub fn describe(loaded: &Loaded) -> String {
    let c = &loaded.config;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "configuration OK: cluster {:?}, {} region(s), {} plan(s), {} tenant(s)",
        c.cluster,
        c.regions.len(),
        c.plans.len(),
        c.tenants.len()
    );
    let _ = writeln!(
        out,
        "kafka: {} (topics {} / {}, {} partitions)",
        c.kafka.brokers, c.kafka.deltas_topic, c.kafka.global_topic, c.kafka.partitions
    );
    out.push_str("regions:\n");
    for (name, r) in &c.regions {
        let _ = writeln!(
            out,
            "  {name:<12} {}  expected_nodes={}",
            r.redis_url, r.expected_nodes
        );
    }
    // The local-mode share differs per region; show it for the smallest
    // expected node count (the largest share) when regions disagree.
    let nodes = c.regions.values().map(|r| r.expected_nodes).min();
    out.push_str("plans:\n");
    for name in c.plans.keys() {
        let _ = writeln!(out, "  plan {name}");
        if let Some(p) = loaded.plan_policy(name) {
            policy_lines(&mut out, &p, nodes);
        }
    }
    out.push_str("tenants:\n");
    for (tenant, p) in loaded.policies() {
        let _ = writeln!(out, "  tenant {tenant} (plan {})", p.plan);
        policy_lines(&mut out, p, nodes);
    }
    match loaded.unknown_policy() {
        Some(p) => {
            let _ = writeln!(out, "unknown tenants: plan {}", p.plan);
        }
        None => out.push_str("unknown tenants: denied (403)\n"),
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn describes_plans_tenants_and_shares() {
        let loaded = Config::from_toml(
            r#"
cluster = "c"
[kafka]
brokers = "k:9092"
[regions.eu]
redis_url = "redis://r"
expected_nodes = 4
[plans.free]
node = { limit = 20, window = "1s" }
region = { limit = 600, window = "1m", algorithm = "fixed_window" }
global = { limit = 100000 }
[tenants.acme]
plan = "free"
region = { limit = 1000 }
[wire]
accept_unsigned = true
"#,
        )
        .unwrap();
        let d = super::describe(&loaded);
        assert!(d.contains("plan free"), "{d}");
        assert!(d.contains("region 600 per 1m"), "{d}");
        assert!(d.contains("local fail mode: 150 per node of 4"), "{d}");
        assert!(d.contains("tenant acme (plan free)"), "{d}");
        assert!(d.contains("region 1000 per 1m"), "{d}");
        assert!(d.contains("global 100000 per UTC day"), "{d}");
        assert!(d.contains("unknown tenants: denied"), "{d}");
    }
}
