//! Writes the seed corpus, `fuzz/corpus/<target>/`, from the real encoders
//! and the repository's real configuration files:
//!
//! ```text
//! cargo run -p tierlimit-fuzz-targets --example seeds
//! ```
//!
//! Seeds named `ok-…` must be accepted by their target and `bad-…`
//! refused (tests/corpus.rs replays them with `cargo test`). The output is
//! deterministic (fixed keys, fixed messages), so running it again changes
//! nothing unless an encoder did.

use std::fs;
use std::path::{Path, PathBuf};

use tierlimit_fuzz_targets::fixture;
use tierlimit_shared::messages::{actor, ActorPart, Delta, GlobalUpdate};
use tierlimit_shared::wire::codec::{self, Auth};
use tierlimit_shared::wire::{BroadcastSigner, DeltaSigner, Heartbeat, Version};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn write(target: &str, name: &str, bytes: impl AsRef<[u8]>) {
    let dir = root().join("fuzz/corpus").join(target);
    fs::create_dir_all(&dir).expect("corpus dir");
    fs::write(dir.join(name), bytes).expect("seed written");
}

fn copy(target: &str, name: &str, from: &str) {
    let text = fs::read(root().join(from)).unwrap_or_else(|e| panic!("{from}: {e}"));
    write(target, name, text);
}

fn delta(region: &str) -> Delta {
    Delta::new(
        "acme",
        20_000,
        actor(region, "e1"),
        1_234,
        56,
        1_700_000_000_000,
    )
    .from_node("n1")
}

fn update() -> GlobalUpdate {
    GlobalUpdate {
        v: 2,
        tenant: "acme".into(),
        period: tierlimit_shared::period::Period::day(20_000),
        total: 300,
        parts: ["eu/a", "eu/b", "us/c"]
            .iter()
            .map(|a| ActorPart {
                actor: a.to_string(),
                p: 120,
                n: 20,
            })
            .collect(),
        limit: Some(1_000),
        over_limit: false,
        ts_ms: 1_700_000_000_000,
        limits_version: 0,
    }
}

fn config() {
    copy("config", "ok-regions.example.toml", "regions.example.toml");
    copy("config", "ok-compose.toml", "deploy/compose/tierlimit.toml");
    write("config", "ok-fixture.toml", fixture::config_text(false));
    write(
        "config",
        "ok-minimal.toml",
        "cluster = \"c\"\n[kafka]\nbrokers = \"k:9092\"\n[regions.eu]\nredis_url = \"redis://r\"\n\
         [wire]\naccept_unsigned = true\n[plans.free]\nnode = { limit = 10, window = \"1s\" }\n\
         global = { limit = 1000 }\n[tenants.acme]\nplan = \"free\"\n",
    );
    write("config", "bad-syntax.toml", "cluster = \n[kafka");
    write(
        "config",
        "bad-unknown-key.toml",
        "cluster = \"c\"\nregoin = 1\n[kafka]\nbrokers = \"k\"\n",
    );
    write(
        "config",
        "bad-duration.toml",
        "cluster = \"c\"\n[kafka]\nbrokers = \"k\"\n[regions.eu]\nredis_url = \"redis://r\"\n\
         [wire]\naccept_unsigned = true\n[plans.free]\nnode = { limit = 10, window = \"1m30s\" }\n",
    );
    write(
        "config",
        "bad-tenant-id.toml",
        "cluster = \"c\"\n[kafka]\nbrokers = \"k\"\n[regions.eu]\nredis_url = \"redis://r\"\n\
         [wire]\naccept_unsigned = true\n[plans.free]\n[tenants.\"a:b\"]\nplan = \"free\"\n",
    );
}

fn deltas() {
    let eu = DeltaSigner::new(fixture::signed(), "eu").expect("fixture keys");
    let us = DeltaSigner::new(fixture::signed(), "us").expect("fixture keys");
    write("delta", "ok-signed-eu.bin", eu.encode(&delta("eu")));
    write("delta", "ok-signed-us.bin", us.encode(&delta("us")));
    let mut big = delta("eu");
    big.p = u64::MAX;
    big.n = u64::MAX;
    big.node = None;
    write("delta", "ok-signed-max.bin", eu.encode(&big));
    // The previous release's v2, still read; and a v3 month counter with
    // the limit the node enforced.
    let eu_v2 = DeltaSigner::with_key(Version::V2, Some(("eu-1", fixture::EU_SECRET.as_slice())));
    write("delta", "ok-signed-eu-v2.bin", eu_v2.encode(&delta("eu")));
    let mut month = delta("eu");
    month.period = tierlimit_shared::period::PeriodKind::Month.at(1_700_000_000_000);
    month.limit = Some(2_000_000);
    month.limits_version = 3;
    write("delta", "ok-signed-month.bin", eu.encode(&month));
    write("delta", "bad-wrong-region.bin", eu.encode(&delta("us")));
    write("delta", "bad-unknown-region.bin", eu.encode(&delta("mars")));
    let unsigned = DeltaSigner::with_key(Version::V2, None);
    write("delta", "bad-unsigned.bin", unsigned.encode(&delta("eu")));
    write("delta", "bad-v1.json", delta("eu").encode());
    let stranger = DeltaSigner::with_key(Version::V2, Some(("zz-1", &[9; 32])));
    write(
        "delta",
        "bad-unknown-key.bin",
        stranger.encode(&delta("eu")),
    );
    let mut tampered = eu.encode(&delta("eu"));
    let at = tampered.len() - 40;
    tampered[at] ^= 1;
    write("delta", "bad-tampered.bin", tampered);
    let mut trailing = eu.encode(&delta("eu"));
    trailing.push(0);
    write("delta", "bad-trailing.bin", trailing);
}

fn broadcasts() {
    let signer = BroadcastSigner::new(fixture::signed()).expect("fixture keys");
    let mut other = update();
    other.tenant = "globex".into();
    other.limit = None;
    other.over_limit = true;
    let records = signer.encode(&[update(), other]);
    write("broadcast", "ok-update-0.bin", &records[0]);
    write("broadcast", "ok-update-1.bin", &records[1]);
    let mut month = update();
    month.period = tierlimit_shared::period::PeriodKind::Month.at(1_700_000_000_000);
    month.limits_version = 3;
    write(
        "broadcast",
        "ok-update-month.bin",
        &signer.encode(&[month])[0],
    );
    let hb = Heartbeat {
        partition: 3,
        deltas_offset: 1_234_567,
        limits_version: 2,
        ts_ms: 1_700_000_000_000,
    };
    let hb = signer.encode_heartbeats(&[hb]);
    write("broadcast", "ok-heartbeat.bin", &hb[0]);
    write(
        "broadcast",
        "bad-unsigned.bin",
        codec::seal(codec::global_body(&update()), &Auth::None),
    );
    write(
        "broadcast",
        "bad-hmac.bin",
        codec::seal(
            codec::global_body(&update()),
            &Auth::Hmac {
                key: "eu-1".into(),
                tag: [7; 32],
            },
        ),
    );
    write(
        "broadcast",
        "bad-v1.json",
        GlobalUpdate { v: 1, ..update() }.encode(),
    );
    let mut tampered = records[0].clone();
    tampered[5] ^= 1;
    write("broadcast", "bad-tampered.bin", tampered);
}

fn ids() {
    let bearer = format!("acme\0Bearer {}\0", fixture::API_KEY);
    write("ids", "ok-tenant-bearer", bearer);
    write(
        "ids",
        "ok-key-x-api-key",
        format!("GET/v1/orders@x+y\0\0{}", fixture::API_KEY).as_bytes(),
    );
    write("ids", "ok-tenant-only", "acme-corp_2.eu");
    write("ids", "bad-colon", "a:b\0Basic dXNlcg==");
    write("ids", "bad-hash-tag", "{acme}\0Bearer wrong");
    write("ids", "bad-too-long", "t".repeat(129));
    write("ids", "any-duration", "90s");
    write(
        "ids",
        "any-digest",
        "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
    );
    write("ids", "bad-unicode", "ä\0\0");
}

fn checks() {
    write(
        "check",
        "ok-body",
        r#"{"tenant":"acme","key":"GET/v1/orders","cost":3}"#,
    );
    write("check", "ok-body-escaped", r#"{"tenant":"ac\u006de"}"#);
    write("check", "ok-query", "tenant=acme&key=k%2Fx&cost=2");
    write("check", "bad-repeated-query", "tenant=a:b&tenant=T");
    write(
        "check",
        "bad-unknown-field",
        r#"{"tenant":"acme","tenant_id":"x"}"#,
    );
    write(
        "check",
        "bad-negative-cost",
        r#"{"tenant":"acme","cost":-1}"#,
    );
    write(
        "check",
        "bad-refund-handle",
        r#"{"handle":"YWNtZXxrfDE.bWFj","cost":1}"#,
    );
    write(
        "check",
        "bad-content-type",
        "text/plain; charset=utf-8\n{\"tenant\":\"acme\"}",
    );
    write(
        "check",
        "bad-content-type-json",
        "application/json; charset=utf-8\n{\"key\":\"k\"}",
    );
}

fn rls() {
    copy(
        "rls",
        "ok-fixture.yaml",
        "tests/fixtures/envoy/ratelimit.yaml",
    );
    write(
        "rls",
        "ok-simple.yaml",
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n",
    );
    write(
        "rls",
        "bad-unit.yaml",
        "domain: edge\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n",
    );
    write("rls", "bad-alias.yaml", "a: &a [x, *a]\n");
    write("rls", "bad-domain.yaml", "domain: \"a:b\"\n");
    // Today's language: quota mode, shared wildcards, metadata, and what
    // envoyproxy/ratelimit's loader refuses.
    let language = "tests/fixtures/envoy/language";
    for (seed, fixture) in [
        ("ok-quota.yaml", "quota_mode.yaml"),
        ("ok-share-threshold.yaml", "share_threshold.yaml"),
        ("ok-metadata.yaml", "metadata.yaml"),
        ("ok-wildcard.yaml", "wildcard.yaml"),
        ("bad-replaces-self.yaml", "replaces_self.yaml"),
        ("bad-replaces-empty.yaml", "replaces_empty.yaml"),
        ("bad-unlimited-with-unit.yaml", "unlimited_with_unit.yaml"),
        (
            "bad-share-threshold-exact.yaml",
            "share_threshold_exact.yaml",
        ),
        ("bad-metadata-null.yaml", "metadata_null.yaml"),
    ] {
        copy("rls", seed, &format!("{language}/{fixture}"));
    }
}

fn main() {
    config();
    deltas();
    broadcasts();
    ids();
    checks();
    rls();
    println!("seeds written to {}", root().join("fuzz/corpus").display());
}
