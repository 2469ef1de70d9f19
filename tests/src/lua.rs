//! The decision script on a clock the test sets: `TIME` replaced by two
//! keys (`fake:s`, `fake:us`), so a test decides at any instant, in any day,
//! and the Rust model can be compared at the same microsecond.

use region_node::storage::script::{encode, DecideCall, DecideReply, ReplyError, DECIDE_LUA};

/// Loads the script with the fake clock into `con`'s server and returns
/// its SHA (`SCRIPT FLUSH` aside, `FLUSHDB` keeps it).
pub async fn load_with_fake_clock(con: &mut redis::aio::MultiplexedConnection) -> String {
    load_source_with_fake_clock(con, DECIDE_LUA).await
}

/// The same for another text of the script (the previous release's).
pub async fn load_source_with_fake_clock(
    con: &mut redis::aio::MultiplexedConnection,
    script: &str,
) -> String {
    let fake_clock =
        "local t = { redis.call('GET', 'fake:s'), redis.call('GET', 'fake:us') or '0' }";
    let source = script.replace("local t = redis.call('TIME')", fake_clock);
    assert_ne!(source, script, "the script's clock call was not found");
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(&source)
        .query_async(con)
        .await
        .expect("SCRIPT LOAD")
}

/// Sets the fake clock to `now_us` (µs since the Unix epoch).
pub async fn set_fake_clock_us(con: &mut redis::aio::MultiplexedConnection, now_us: u64) {
    redis::pipe()
        .cmd("SET")
        .arg("fake:s")
        .arg(now_us / 1_000_000)
        .ignore()
        .cmd("SET")
        .arg("fake:us")
        .arg(now_us % 1_000_000)
        .ignore()
        .query_async::<()>(con)
        .await
        .expect("SET fake:s, fake:us");
}

/// Sets the fake clock to 01:00 UTC of `day`.
pub async fn set_fake_day(con: &mut redis::aio::MultiplexedConnection, day: u32) {
    redis::cmd("SET")
        .arg("fake:s")
        .arg(u64::from(day) * 86_400 + 3600)
        .query_async::<()>(con)
        .await
        .expect("SET fake:s");
}

/// One decision by the script loaded as `sha` (no deadline), its reply
/// parsed: how a test drives a script it loaded itself (fake clock, or
/// another release's text).
pub async fn decide_by(
    con: &mut redis::aio::MultiplexedConnection,
    sha: &str,
    call: &DecideCall<'_>,
) -> DecideReply {
    try_decide_by(con, sha, call)
        .await
        .expect("the reply parses")
}

/// [`decide_by`] for the previous release's script (`decide_previous_release.lua`),
/// which reads the op's own *two* numbers where this release packs three
/// (a lease's `tail_ms` is new): the call encoded as that release's node
/// encoded it, the third op number taken out. Its reply is laid out as
/// this release's. It has no global tiers of other periods either: the
/// count of them (E, after K) is taken out, and `call` must have none.
pub async fn decide_by_previous(
    con: &mut redis::aio::MultiplexedConnection,
    sha: &str,
    call: &DecideCall<'_>,
) -> DecideReply {
    let mut ours = redis::Cmd::new();
    encode(&mut ours, call, 0);
    let args: Vec<Vec<u8>> = ours
        .args_iter()
        .map(|a| match a {
            redis::Arg::Simple(b) => b.to_vec(),
            _ => unreachable!("encode writes plain arguments"),
        })
        .collect();
    assert!(
        call.periods.is_empty(),
        "the previous release has no periods"
    );
    let keys: usize = std::str::from_utf8(&args[0]).unwrap().parse().unwrap();
    // numkeys, the keys, op, tenant, day prefix, epoch, then the numbers:
    // deadline … relaxed (9), the op's numbers, K, …
    let numbers = 1 + keys + 4;
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha);
    for (i, a) in args.iter().enumerate() {
        if i == numbers {
            let mut packed = a.clone();
            // E (0) after K, then the op's third number.
            packed.drain(13 * 8..14 * 8);
            packed.drain(11 * 8..12 * 8);
            cmd.arg(packed);
        } else {
            cmd.arg(a.as_slice());
        }
    }
    let reply: Vec<redis::Value> = cmd.query_async(con).await.expect("EVALSHA");
    DecideReply::parse(reply, call).expect("the reply parses")
}

/// The same, keeping the script's refusals as the node sees them: a check
/// built for another day than Redis' ([`ReplyError::OtherDay`]) or past
/// its deadline is an answer to compare, not a failure.
pub async fn try_decide_by(
    con: &mut redis::aio::MultiplexedConnection,
    sha: &str,
    call: &DecideCall<'_>,
) -> Result<DecideReply, ReplyError> {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha);
    encode(&mut cmd, call, 0);
    let reply: Vec<redis::Value> = cmd.query_async(con).await.expect("EVALSHA");
    DecideReply::parse(reply, call)
}
