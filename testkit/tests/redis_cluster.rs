//! A real six-node Redis Cluster: keys written through the masters that
//! serve them, a master killed and failed over, a node restarted, slots
//! moved with their keys.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use testkit::{query, RedisCluster};

fn set(port: u16, key: &str, value: &str) {
    query::<()>(port, redis::cmd("SET").arg(key).arg(value))
        .unwrap_or_else(|e| panic!("SET {key} on 127.0.0.1:{port}: {e}"));
}

fn get(port: u16, key: &str) -> redis::RedisResult<Option<String>> {
    query(port, redis::cmd("GET").arg(key))
}

/// Writes `key` at the master that serves its slot now.
fn set_at_master(c: &RedisCluster, key: &str, value: &str) {
    set(c.master_of_slot(RedisCluster::slot_of(key)), key, value);
}

/// Reads `key` at the master that serves its slot now.
fn get_at_master(c: &RedisCluster, key: &str) -> Option<String> {
    let port = c.master_of_slot(RedisCluster::slot_of(key));
    get(port, key).unwrap_or_else(|e| panic!("GET {key} on 127.0.0.1:{port}: {e}"))
}

/// INCR `key` the way a cluster client does: at the master believed to
/// serve its slot (`owner`), following `MOVED` (and remembering it) and
/// `ASK` (once, with `ASKING`, without remembering it).
fn incr(owner: &mut u16, key: &str) -> i64 {
    static ASKED: AtomicUsize = AtomicUsize::new(0);
    let redirect = |e: &redis::RedisError| -> u16 {
        let (addr, _slot) = e.redirect_node().expect("redirect address");
        addr.rsplit(':').next().unwrap().parse().unwrap()
    };
    loop {
        match query::<i64>(*owner, redis::cmd("INCR").arg(key)) {
            Ok(v) => return v,
            Err(e) if e.code() == Some("MOVED") => *owner = redirect(&e),
            Err(e) if e.code() == Some("ASK") => {
                let target = redirect(&e);
                if ASKED.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!("first ASK redirection for {key}: to {target}");
                }
                let mut con = redis::Client::open(format!("redis://127.0.0.1:{target}/"))
                    .unwrap()
                    .get_connection()
                    .unwrap_or_else(|e| panic!("connect to {target}: {e}"));
                let ((), v): ((), i64) = redis::pipe()
                    .cmd("ASKING")
                    .cmd("INCR")
                    .arg(key)
                    .query(&mut con)
                    .unwrap_or_else(|e| panic!("ASKING INCR {key} at {target}: {e}"));
                return v;
            }
            Err(e) => panic!("INCR {key} at {owner}: {e}"),
        }
    }
}

fn tenant_keys() -> Vec<String> {
    (0..40)
        .map(|i| format!("tl:{{tenant-{i}}}:count"))
        .collect()
}

#[test]
fn a_master_is_failed_over_and_comes_back_as_a_replica() {
    let t = Instant::now();
    let mut c = RedisCluster::start(3, 1);
    eprintln!("cluster ready after {:?}", t.elapsed());
    assert_eq!(c.seed_urls().len(), 6);
    assert_eq!(c.masters().len(), 3);
    assert_eq!(c.replicas().len(), 3);

    let keys = tenant_keys();
    for k in &keys {
        // Our slot function agrees with the server's.
        let server: u16 = query(c.masters()[0], redis::cmd("CLUSTER").arg("KEYSLOT").arg(k))
            .expect("CLUSTER KEYSLOT");
        assert_eq!(RedisCluster::slot_of(k), server, "slot of {k}");
        set_at_master(&c, k, k);
    }
    // A master that does not serve a key redirects to the one that does.
    let hot = "tl:{acme}:count";
    let slot = RedisCluster::slot_of(hot);
    set_at_master(&c, hot, "42");
    let owner = c.master_of_slot(slot);
    let other = *c.masters().iter().find(|&&p| p != owner).unwrap();
    let err = get(other, hot).expect_err("a master that does not serve the slot answers MOVED");
    assert_eq!(err.code(), Some("MOVED"));
    assert_eq!(
        err.redirect_node(),
        Some((format!("127.0.0.1:{owner}").as_str(), slot))
    );

    c.wait_replicated();
    let t = Instant::now();
    let old = c.kill_master_of_slot(slot);
    let new = c.wait_failover(slot, old);
    eprintln!("failover {old} -> {new} after {:?}", t.elapsed());
    assert_ne!(new, old);
    assert!(c.masters().contains(&new) && !c.masters().contains(&old));
    assert_eq!(get(new, hot).unwrap().as_deref(), Some("42"));
    set(new, hot, "43");
    for k in &keys {
        assert_eq!(
            get_at_master(&c, k).as_deref(),
            Some(k.as_str()),
            "{k} after failover"
        );
    }

    let t = Instant::now();
    c.restart(old);
    eprintln!("{old} back after {:?}", t.elapsed());
    assert!(c.replicas().contains(&old), "{old} rejoins as a replica");
    assert_eq!(c.masters().len(), 3);
    assert_eq!(c.master_of_slot(slot), new);
    c.wait_replicated();
    assert_eq!(
        query::<Option<String>>(old, redis::cmd("GET").arg(hot))
            .err()
            .and_then(|e| e.code().map(str::to_string))
            .as_deref(),
        Some("MOVED"),
        "a replica redirects reads to its master"
    );
}

#[test]
fn slots_move_with_their_keys() {
    let t = Instant::now();
    let c = RedisCluster::builder(3, 1).start();
    eprintln!("cluster ready after {:?}", t.elapsed());
    let keys = tenant_keys();
    for k in &keys {
        set_at_master(&c, k, k);
    }

    // One slot, the hot tenant's, with many keys in it (so that moving them
    // takes several MIGRATE batches), moved while a client increments one
    // of them: no increment is lost or doubled.
    let hot = "tl:{acme}:count";
    let slot = RedisCluster::slot_of(hot);
    set_at_master(&c, hot, "42");
    set_at_master(&c, "tl:{acme}:window", "7");
    let from = c.master_of_slot(slot);
    for i in 0..2000 {
        set(from, &format!("tl:{{acme}}:bucket:{i}"), "1");
    }
    let to = *c.masters().iter().find(|&&p| p != from).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let (mut owner, mut n) = (from, 0);
            while !stop.load(Ordering::Relaxed) {
                incr(&mut owner, "tl:{acme}:hits");
                n += 1;
            }
            n
        }
    });
    let t = Instant::now();
    c.move_slot(slot, to);
    eprintln!("slot {slot} moved {from} -> {to} after {:?}", t.elapsed());
    stop.store(true, Ordering::Relaxed);
    let hits = traffic.join().expect("traffic thread");
    assert!(hits > 0, "no traffic ran during the move");
    eprintln!("{hits} increments during the move");
    assert_eq!(get(to, "tl:{acme}:hits").unwrap(), Some(hits.to_string()));
    assert_eq!(
        get(to, "tl:{acme}:bucket:1999").unwrap().as_deref(),
        Some("1")
    );
    assert_eq!(c.master_of_slot(slot), to);
    assert!(c.slots_of(to).contains(&slot) && !c.slots_of(from).contains(&slot));
    assert_eq!(get(to, hot).unwrap().as_deref(), Some("42"));
    assert_eq!(get(to, "tl:{acme}:window").unwrap().as_deref(), Some("7"));
    assert_eq!(
        get(from, hot).expect_err("the old owner redirects").code(),
        Some("MOVED")
    );

    // A batch of slots with redis-cli --cluster reshard.
    let t = Instant::now();
    let moved = c.reshard(50, to, from);
    eprintln!("50 slots moved {to} -> {from} after {:?}", t.elapsed());
    assert_eq!(moved.len(), 50);
    for s in &moved {
        assert_eq!(c.master_of_slot(*s), from);
    }
    for k in &keys {
        assert_eq!(
            get_at_master(&c, k).as_deref(),
            Some(k.as_str()),
            "{k} after reshard"
        );
    }
    assert_eq!(get_at_master(&c, hot).as_deref(), Some("42"));
}
