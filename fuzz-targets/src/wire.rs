//! The two Kafka topics' records (wire v2, and v1 JSON in upgrade mode):
//! anyone who can write to a topic controls these bytes.
//!
//! Random bytes never carry a valid HMAC or Ed25519 signature, so besides
//! decoding the input as it is, each target re-signs whatever decoded with
//! the fixture's real keys: the verifiers' code past the signature check
//! (region checks, the Merkle path, the root cache) then runs on every
//! message shape the fuzzer finds, and must accept exactly what the real
//! signer wrote.

use tierlimit_shared::messages::{actor_region, Delta, GlobalUpdate};
use tierlimit_shared::validate;
use tierlimit_shared::wire::codec::{self, Auth};
use tierlimit_shared::wire::{
    Broadcast, BroadcastSigner, BroadcastVerifier, DeltaSigner, DeltaVerifier, Version,
};

use crate::fixture;

/// What every accepted delta satisfies, whatever decoded it.
fn check_delta(d: &Delta) {
    assert!(d.n <= d.p, "accepted delta with n {} > p {}", d.n, d.p);
    assert!(validate::tenant(&d.tenant).is_ok(), "tenant {:?}", d.tenant);
    let (region, epoch) = d.actor.split_once('/').expect("actor is region/epoch");
    assert!(validate::name("region", region).is_ok());
    assert!(validate::name("epoch", epoch).is_ok());
}

fn check_update(u: &GlobalUpdate) {
    assert!(validate::tenant(&u.tenant).is_ok(), "tenant {:?}", u.tenant);
    for p in &u.parts {
        assert!(p.n <= p.p, "accepted part with n {} > p {}", p.n, p.p);
        assert!(p.actor.split_once('/').is_some(), "actor {:?}", p.actor);
    }
}

/// `tierlimit.deltas`: the aggregator's [`DeltaVerifier`] (signed and
/// upgrade mode) and the v2 codec under it.
pub fn delta(data: &[u8]) -> bool {
    let signed = DeltaVerifier::new(fixture::signed()).expect("fixture keys");
    let open = DeltaVerifier::new(fixture::open()).expect("fixture keys");
    let accepted = signed.decode(data);
    if let Ok(d) = &accepted {
        check_delta(d);
    }
    if let Ok(d) = open.decode(data) {
        check_delta(&d);
    }
    let frame = match codec::decode_delta(data) {
        Ok(f) => f,
        Err(_) => return accepted.is_ok(),
    };
    let d = frame.message;
    check_delta(&d);
    // The signed part is a prefix of the record, the auth the rest.
    assert!(data.starts_with(frame.signed));
    // Re-encoding gives the same message back.
    // Re-encoded in its own version (a v3 record carries what v2 cannot).
    let (body, version): (fn(&Delta) -> Vec<u8>, _) = if d.v >= 3 {
        (codec::delta_body_v3, Version::V3)
    } else {
        (codec::delta_body, Version::V2)
    };
    let again = codec::seal(body(&d), &frame.auth);
    let f2 = codec::decode_delta(&again).expect("a re-encoded delta decodes");
    assert_eq!(f2.message, d);
    assert_eq!(f2.auth, frame.auth);
    // Signed with its region's real key, it verifies iff the region is
    // configured; with the other region's key it never does.
    let region = actor_region(&d.actor);
    for (r, secret) in [("eu", fixture::EU_SECRET), ("us", fixture::US_SECRET)] {
        let signer = DeltaSigner::with_key(version, Some((&format!("{r}-1"), secret.as_slice())));
        let record = signer.encode(&d);
        let got = signed.decode(&record);
        if r == region {
            assert_eq!(got.expect("a delta its region signed verifies"), d);
        } else {
            let e = got.expect_err("another region's key verified a delta");
            assert_eq!(e.reason(), "wrong_region");
        }
    }
    // Unsigned: refused by default, accepted in upgrade mode iff the
    // region is known.
    let unsigned = DeltaSigner::with_key(version, None).encode(&d);
    assert_eq!(signed.decode(&unsigned).unwrap_err().reason(), "unsigned");
    assert_eq!(
        open.decode(&unsigned).is_ok(),
        matches!(region, "eu" | "us")
    );
    accepted.is_ok()
}

/// `tierlimit.global`: the nodes' [`BroadcastVerifier`] (signed and
/// upgrade mode), global updates and heartbeats, and the Merkle proofs.
pub fn broadcast(data: &[u8]) -> bool {
    let mut signed = BroadcastVerifier::new(fixture::signed()).expect("fixture keys");
    let mut open = BroadcastVerifier::new(fixture::open()).expect("fixture keys");
    let accepted = signed.decode_any(data);
    match &accepted {
        Ok(Broadcast::Update(u)) => check_update(u),
        Ok(Broadcast::Heartbeat(_)) => {}
        Err(_) => {}
    }
    if let Ok(Broadcast::Update(u)) = open.decode_any(data) {
        check_update(&u);
    }
    let signer = BroadcastSigner::new(fixture::signed()).expect("fixture keys");
    if let Ok(frame) = codec::decode_global(data) {
        let u = frame.message;
        check_update(&u);
        assert!(data.starts_with(frame.signed));
        let body: fn(&GlobalUpdate) -> Vec<u8> = if u.v >= 3 {
            codec::global_body_v3
        } else {
            codec::global_body
        };
        let again = codec::seal(body(&u), &frame.auth);
        let f2 = codec::decode_global(&again).expect("a re-encoded update decodes");
        assert_eq!(f2.message, u);
        assert_eq!(f2.auth, frame.auth);
        // A batch of the update and two others, signed for real: each
        // record verifies on its own, in any order, and gives the update
        // back; a record whose proof is moved to another record does not.
        let mut other = u.clone();
        other.total = other.total.wrapping_add(1);
        let batch = [u.clone(), other.clone(), u.clone()];
        let records = signer.encode(&batch);
        assert_eq!(records.len(), batch.len());
        let mut fresh = BroadcastVerifier::new(fixture::signed()).expect("fixture keys");
        for i in [2, 0, 1] {
            let got = fresh.decode(&records[i]).expect("a signed record verifies");
            // The fixture's signer writes the configured version (v3).
            assert_eq!(
                got,
                GlobalUpdate {
                    v: got.v,
                    ..batch[i].clone()
                }
            );
        }
        let first = codec::decode_global(&records[0]).expect("a signed record decodes");
        let forged = codec::seal(body(&other), &first.auth);
        assert!(fresh.decode(&forged).is_err(), "a moved proof verified");
        // Unsigned: refused by default, accepted in upgrade mode.
        let unsigned = codec::seal(body(&u), &Auth::None);
        assert_eq!(signed.decode(&unsigned).unwrap_err().reason(), "unsigned");
        assert_eq!(open.decode(&unsigned).expect("upgrade mode"), u);
    }
    if let Ok(frame) = codec::decode_heartbeat(data) {
        let h = frame.message;
        let records = signer.encode_heartbeats(std::slice::from_ref(&h));
        let mut fresh = BroadcastVerifier::new(fixture::signed()).expect("fixture keys");
        match fresh.decode_any(&records[0]) {
            Ok(Broadcast::Heartbeat(got)) => assert_eq!(got, h),
            other => panic!("a signed heartbeat gave {other:?}"),
        }
    }
    accepted.is_ok()
}
