//! The fuzz targets of tierlimit: one function per input the outside world
//! controls, each taking arbitrary bytes.
//!
//! Every target must never panic, whatever the bytes, and asserts
//! invariants where they are cheap (a decoded record re-encodes to the same
//! message, a re-signed one verifies, an accepted id builds keys in its
//! tenant's slot). A broken invariant is a panic, which libFuzzer reports
//! as a crash like any other.
//!
//! They live here, as plain functions of a normal crate, so that:
//! - `fuzz/` (cargo-fuzz, libFuzzer, excluded from the workspace) is one
//!   line per target, built only by `scripts/fuzz`;
//! - `cargo test` replays the seed corpus (`fuzz/corpus/<target>/`) and
//!   every crash ever found (`fuzz/regressions/<target>/`) without an
//!   instrumented build (tests/corpus.rs).
//!
//! The shared crate is used without its `kafka` and `http` features: no
//! librdkafka, no axum, nothing the targets do not parse with.
//!
//! Each target returns whether the input was *accepted* (parsed and
//! validated); the corpus replay uses it to check that seeds named `ok-…`
//! are accepted and `bad-…` refused, so the seeds keep exercising both
//! paths. libFuzzer ignores it.

pub mod check;
pub mod config;
pub mod fixture;
pub mod ids;
pub mod rls;
pub mod wire;

pub use check::check;
pub use config::config;
pub use ids::ids;
pub use rls::rls;
pub use wire::{broadcast, delta};

/// A fuzz target: arbitrary bytes in, accepted or not out; never panics.
pub type Target = fn(&[u8]) -> bool;

/// Every target by name: the names of `fuzz/fuzz_targets/*.rs`, of the
/// corpus and regression directories, and of `scripts/fuzz`'s arguments.
pub const TARGETS: &[(&str, Target)] = &[
    ("config", config::config),
    ("delta", wire::delta),
    ("broadcast", wire::broadcast),
    ("ids", ids::ids),
    ("check", check::check),
    ("rls", rls::rls),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}
