//! A real Sentinel group: the master killed, the sentinels promote the
//! replica, which has the data and takes writes; the old master comes back
//! as a replica.

use std::time::Instant;

use testkit::{query, SentinelGroup};

fn set(port: u16, key: &str, value: &str) -> redis::RedisResult<()> {
    query(port, redis::cmd("SET").arg(key).arg(value))
}

fn get(port: u16, key: &str) -> Option<String> {
    query(port, redis::cmd("GET").arg(key))
        .unwrap_or_else(|e| panic!("GET {key} on 127.0.0.1:{port}: {e}"))
}

#[test]
fn the_sentinels_fail_the_master_over_and_the_data_survives() {
    let t = Instant::now();
    let mut g = SentinelGroup::start();
    eprintln!("sentinel group ready after {:?}", t.elapsed());
    assert_eq!(g.master_name(), "tierlimit");
    assert_eq!(g.sentinel_addrs().len(), 3);
    assert_eq!(g.sentinel_urls().len(), 3);
    let url = g.sentinel_url();
    assert!(
        url.starts_with("redis+sentinel://127.0.0.1:") && url.ends_with("/tierlimit"),
        "{url}"
    );

    let master = g.master_port();
    let replicas = g.replicas();
    assert_eq!(replicas.len(), 1);
    for i in 0..100 {
        set(master, &format!("tl:{{t{i}}}:count"), &i.to_string()).expect("SET on the master");
    }
    // A replica refuses writes.
    let err = set(replicas[0], "x", "1").expect_err("a replica is read-only");
    assert_eq!(err.code(), Some("READONLY"));
    g.wait_replicated();

    let t = Instant::now();
    let old = g.kill_master();
    assert_eq!(old, master);
    let new = g.wait_failover(old);
    eprintln!("failover {old} -> {new} after {:?}", t.elapsed());
    assert_eq!(new, replicas[0]);
    assert_eq!(g.master_port(), new);
    for i in 0..100 {
        assert_eq!(get(new, &format!("tl:{{t{i}}}:count")), Some(i.to_string()));
    }
    set(new, "after", "failover").expect("the new master takes writes");

    let t = Instant::now();
    g.restart(old);
    eprintln!("{old} back after {:?}", t.elapsed());
    assert_eq!(
        g.master_port(),
        new,
        "a restarted old master does not take over"
    );
    assert_eq!(g.replicas(), vec![old]);
    g.wait_replicated();
    assert_eq!(get(old, "after"), Some("failover".to_string()));
}
