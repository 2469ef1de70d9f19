//! Test harness for tierlimit's integration tests.
//!
//! The real parts (processes killed on drop, free ports, readiness waits,
//! `redis-server`, Tansu, the workspace binaries) live in the `testkit`
//! crate, shared with the demo and the bench runner, and are re-exported
//! here so a test says `harness::Redis::start()`. What only the tests need
//! lives beside, one concept a module:
//!
//! - [`config`]: the one-region configuration single-node suites share;
//! - [`topology`]: hosts in network namespaces, partitions and delays;
//! - [`cluster`]: a whole deployment on a topology, with its faults;
//! - [`load`]: paced per-region traffic recorded into a history, and
//!   metric samples taken while it runs;
//! - [`limits`]: a node's readiness, a check's status, a limits version
//!   reaching every node (the limits suites);
//! - [`history`]: the history checker (no tier over its limit beyond what
//!   the faults explain, the global count exact once drained);
//! - [`lua`]: the decision script on a clock the test sets.

pub use testkit::*;

pub mod cluster;
pub mod config;
pub mod history;
pub mod limits;
pub mod load;
pub mod lua;
pub mod topology;
