//! The previous release's `region-node` and `aggregator`, for the upgrade
//! tests: they run it beside this tree's binaries on the same Redis and
//! Kafka, instead of imitating what it writes.
//!
//! Which release: the commit in `testkit/PREVIOUS_RELEASE` (the previous
//! round's landing on main), the one file both this module and
//! `scripts/setup` read. `scripts/setup` builds it once per machine from that
//! commit of the clone (`git archive`, a debug build with its own target
//! dir) and keeps only the two binaries, in
//! `${XDG_CACHE_HOME:-~/.cache}/tierlimit/releases/<commit>/`; the build is
//! never part of a test's time. A test that needs them and finds them missing
//! panics naming `scripts/setup`: an upgrade test that skipped itself would
//! prove nothing while looking green.

use std::path::PathBuf;

/// The previous release's commit (full hash), from `testkit/PREVIOUS_RELEASE`.
pub fn commit() -> &'static str {
    include_str!("../PREVIOUS_RELEASE").trim()
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/tierlimit/releases/<commit>`: where
/// `scripts/setup` puts the previous release's binaries.
pub fn dir() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache")
        });
    cache.join("tierlimit").join("releases").join(commit())
}

/// Path of the previous release's binary `name` (`region-node`,
/// `aggregator`).
///
/// # Panics
///
/// If it is not there: run `scripts/setup`, which builds it once.
pub fn bin(name: &str) -> PathBuf {
    let path = dir().join(name);
    assert!(
        path.is_file(),
        "the previous release's {name} ({}) is not at {}: run scripts/setup \
         (it builds the previous release once per machine)",
        &commit()[..7],
        path.display()
    );
    path
}
