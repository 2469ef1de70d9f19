//! How fast a follower verifies signed broadcasts: one Ed25519 signature
//! per record versus one per batch of `MAX_BATCH` (Merkle proofs), as a
//! rebuild of many records would.
//!
//! `cargo run --release -p tierlimit-shared --example wire_verify_speed [records]`

use std::time::Instant;

use ed25519_dalek::SigningKey;
use tierlimit_shared::messages::{ActorPart, GlobalUpdate};
use tierlimit_shared::wire::broadcast_auth::MAX_BATCH;
use tierlimit_shared::wire::{keys, BroadcastSigner, BroadcastVerifier, Version};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let (private, public) = keys::ed25519_pair_from_seed([3; 32]);
    let config = tierlimit_shared::Config::from_toml(&format!(
        "cluster = \"b\"\n[kafka]\nbrokers = \"x:1\"\n[regions.eu]\nredis_url = \"redis://x\"\n[plans.p]\n\
         [wire]\nbroadcast_key = \"k\"\nbroadcast_private_key = \"{private}\"\n[wire.broadcast_public_keys]\nk = \"{public}\"\n\
         [wire.delta_keys.eu]\nsign_with = \"e\"\nkeys = {{ e = \"{}\" }}\n",
        keys::encode(&[1; 32])
    ))
    .expect("valid config")
    .config;
    let updates: Vec<GlobalUpdate> = (0..n)
        .map(|i| GlobalUpdate {
            v: 3,
            tenant: format!("tenant-{i}"),
            period: tierlimit_shared::period::Period::day(20_000),
            total: i as u64,
            parts: (0..3)
                .map(|r| ActorPart {
                    actor: format!("region-{r}/epoch{i}"),
                    p: i as u64,
                    n: 0,
                })
                .collect(),
            limit: Some(1_000_000),
            over_limit: false,
            ts_ms: 1_700_000_000_000,
            limits_version: 0,
        })
        .collect();
    let key = keys::ed25519_private(&private).unwrap();
    for (label, batch) in [("per batch", MAX_BATCH), ("per record", 1)] {
        let signer = BroadcastSigner::with_key(
            Version::V2,
            Some(("k", SigningKey::from_bytes(&key.to_bytes()))),
        );
        let t = Instant::now();
        let records: Vec<Vec<u8>> = updates
            .chunks(batch)
            .flat_map(|c| signer.encode(c))
            .collect();
        let sign = t.elapsed();
        let bytes: usize = records.iter().map(Vec::len).sum();
        let mut verifier = BroadcastVerifier::new(&config).unwrap();
        let t = Instant::now();
        for r in &records {
            verifier.decode(r).expect("verifies");
        }
        let verify = t.elapsed();
        println!(
            "{label:>10} ({batch:>2} records/signature): {n} records, sign {:.2} s, verify+decode {:.2} s ({:.1} µs/record), {:.0} B/record",
            sign.as_secs_f64(),
            verify.as_secs_f64(),
            verify.as_secs_f64() * 1e6 / n as f64,
            bytes as f64 / n as f64
        );
    }
    let json: usize = updates.iter().map(|u| u.encode().len()).sum();
    println!(
        "  v1 JSON: {:.0} B/record (unsigned)",
        json as f64 / n as f64
    );
}
