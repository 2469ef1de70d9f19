//! Scenario 9b, before and after: region-node as it was before the hot-path
//! issue (`BENCH_BASELINE_REV`, default [`DEFAULT_REV`]: the decision
//! script of twelve commands that the issue measured) and today's, both
//! built and measured in this one run. The same closed loop as scenario 9
//! (bench plan, uniform tenants, Kafka detached) through three region-nodes,
//! each on a Redis of its own, in alternating rounds: the old one, today's
//! with leases off, today's with its defaults (adaptive leases,
//! `node.lease_max` = [`LEASE_MAX`]). CPU per
//! decision (region-node + Redis, from `/proc`) and decisions/s, today ÷
//! before, with and without leases: what came from the rest of the decision
//! path and what from leases.
//!
//! The old code is exported with `git archive` into the bench cache
//! (`~/.cache/tierlimit/baseline/<rev>`) and built there once with its own
//! `Cargo.lock` (`cargo build --release --locked -p region-node`, a few
//! minutes the first time); later runs reuse the binary.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::run::Run;
use crate::scenario::leases::{round, variant, Round, Variant, LEASE_MAX};
use crate::world::{redis_servers, solo_config, start_node, write_config_in};

/// The last commit before the round that redesigned the decision path: its
/// script runs TIME, 3 HMGET, 3 HSET, 2 PEXPIRE, EXPIRE and ZADD per
/// check, as the issue measured.
pub const DEFAULT_REV: &str = "fa857dc";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct BaselineBench {
    /// The old code's commit, as given and as resolved.
    pub rev: String,
    pub commit: String,
    pub rounds: u64,
    pub duration: u64,
    pub connections: u64,
    pub tenants: u64,
    pub lease_max: u64,
    pub before: Variant,
    pub after: Variant,
    pub after_leases: Variant,
    /// (region-node + Redis CPU per decision) today ÷ before.
    pub cpu_ratio: f64,
    pub cpu_ratio_leases: f64,
    /// Decisions/s today ÷ before.
    pub rps_ratio: f64,
    pub rps_ratio_leases: f64,
}

/// The old region-node binary, built once per commit (release mode, in
/// `~/.cache/tierlimit/baseline`): scenario 9b's baseline and scenario 9's
/// previous release.
pub fn build(rev: &str) -> anyhow::Result<(String, PathBuf)> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("git")
        .args(["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
        .current_dir(&repo)
        .output()
        .context("git rev-parse")?;
    if !out.status.success() {
        bail!(
            "BENCH_BASELINE_REV {rev:?} is not a commit of this repository: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let commit = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    let cache = PathBuf::from(home).join(".cache/tierlimit/baseline");
    let bin = cache.join(format!("region-node-{commit}"));
    if bin.is_file() {
        return Ok((commit, bin));
    }
    let src = cache.join(&commit);
    if !src.join("Cargo.toml").is_file() {
        std::fs::create_dir_all(&src)?;
        let status = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "git archive {commit} | tar -x -C '{}'",
                src.display()
            ))
            .current_dir(&repo)
            .status()
            .context("git archive")?;
        if !status.success() {
            bail!("git archive {commit} failed");
        }
    }
    let target = cache.join("target");
    let status = Command::new("cargo")
        .args(["build", "--release", "--locked", "-p", "region-node"])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&src)
        .status()
        .context("cargo build of the baseline")?;
    if !status.success() {
        bail!("building region-node at {commit} failed");
    }
    std::fs::copy(target.join("release/region-node"), &bin)?;
    Ok((commit, bin))
}

/// The one-region bench configuration as the old region-node reads it: it
/// refuses unknown keys, and has no newcomer gate (`max_new_per_second`)
/// and no `[wire]` section.
fn old_config(redis_url: &str) -> String {
    solo_config("9b", redis_url, "", "")
        .replace("max_new_per_second = 1000000\n", "")
        .replace(crate::world::VIEW_WAIT_DETACHED, "")
}

/// Whether the old release signs its deltas (`wire.delta_keys`, from
/// issue 29 on): its source, kept beside its binary, says.
fn signs_deltas(bin: &Path, commit: &str) -> bool {
    bin.parent()
        .map(|cache| cache.join(commit).join("shared/src/config.rs"))
        .and_then(|p| std::fs::read_to_string(p).ok())
        .is_some_and(|text| text.contains("delta_keys"))
}

/// The old region-node: no admin listener, `/healthz` on its API port.
async fn start_old(
    run: &Run,
    bin: &Path,
    config: &Path,
    env: &[(&str, &str)],
) -> anyhow::Result<(testkit::Proc, u16)> {
    let port = testkit::free_port();
    let port_arg = format!("127.0.0.1:{port}");
    let args: [&std::ffi::OsStr; 8] = [
        "--config".as_ref(),
        config.as_os_str(),
        "--region".as_ref(),
        "eu".as_ref(),
        "--node-id".as_ref(),
        "eu-1".as_ref(),
        "--listen".as_ref(),
        port_arg.as_ref(),
    ];
    let mut all = vec![("RUST_LOG", "warn")];
    all.extend_from_slice(env);
    let mut proc = testkit::Proc::spawn(bin, args, &all);
    run.record("# the baseline region-node:");
    run.record_spawned(&proc);
    let http = reqwest::Client::new();
    let started = Instant::now();
    loop {
        if let Some(status) = proc.poll_exit() {
            bail!("the baseline region-node exited: {status}\n{}", proc.log());
        }
        let ok = http
            .get(format!("http://{port_arg}/healthz"))
            .timeout(Duration::from_secs(1))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return Ok((proc, port));
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the baseline region-node did not answer /healthz within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn run(run: &Run, k: &Knobs) -> anyhow::Result<BaselineBench> {
    let rev = k.baseline_rev.as_str();
    run.scenario(&format!(
        "9b before and after: region-node at {rev} vs today's, leases off and with the defaults (lease_max = {LEASE_MAX})"
    ));
    run.say(&format!("building region-node at {rev} (once per commit)"));
    let (commit, old_bin) = tokio::task::spawn_blocking({
        let rev = rev.to_string();
        move || build(&rev)
    })
    .await??;
    let dir = testkit::temp_dir();
    let (redis, conns) = redis_servers::<3>(run).await?;
    let write = |name: &str, toml: String| write_config_in(dir.path(), name, &toml);
    // A release before signed deltas reads the configuration as is
    // (testkit's write_config would add `[wire]` keys it refuses); a later
    // one needs them, and knows everything today's bench configuration says.
    let signs = signs_deltas(&old_bin, &commit);
    let cfg_old = if signs {
        write("before", solo_config("9b", &redis[0].url(), "", ""))?
    } else {
        let cfg = dir.path().join("before.toml");
        std::fs::write(&cfg, old_config(&redis[0].url()))?;
        cfg
    };
    let cfg_off = write(
        "after",
        solo_config("9b", &redis[1].url(), "lease_max = 0", ""),
    )?;
    // Today's defaults: adaptive leases (lease_max = LEASE_MAX).
    let cfg_on = write("after-leases", solo_config("9b", &redis[2].url(), "", ""))?;
    run.record(format!("# scenario 9b: {}", cfg_old.display()));
    // A release with API keys (every one that signs deltas) leaves check
    // open to the load generator as today's nodes do.
    let old_env: &[(&str, &str)] = if signs {
        &[crate::world::BENCH_OPEN_SCOPES]
    } else {
        &[]
    };
    let (old, old_port) = start_old(run, &old_bin, &cfg_old, old_env).await?;
    let off = start_node(run, &cfg_off, "eu", "eu-1", "/healthz", &[]).await;
    let on = start_node(run, &cfg_on, "eu", "eu-1", "/healthz", &[]).await;
    let old_url = format!("http://127.0.0.1:{old_port}/v1/check");
    let (off_url, on_url) = (off.url("/v1/check"), on.url("/v1/check"));
    let (mut before, mut after, mut after_leases): (Vec<Round>, Vec<Round>, Vec<Round>) =
        (vec![], vec![], vec![]);
    for i in 0..k.rounds {
        let pids = [old.pid(), off.proc.pid(), on.proc.pid()];
        let urls = [&old_url, &off_url, &on_url];
        let names = ["before", "after", "after_leases"];
        for (j, out) in [&mut before, &mut after, &mut after_leases]
            .into_iter()
            .enumerate()
        {
            let name = format!("s9b_{}_{i}", names[j]);
            let r = round(
                run,
                k,
                &name,
                urls[j],
                pids[j],
                redis[j].proc.pid(),
                &conns[j],
                false,
            )
            .await?;
            out.push(r);
        }
    }
    let (before, after, after_leases) = (variant(before), variant(after), variant(after_leases));
    // A node that answered without calling its script refused the checks
    // (a key it wanted, a tenant it did not know): nothing to compare.
    for (name, v) in [
        ("before", &before),
        ("after", &after),
        ("after_leases", &after_leases),
    ] {
        if v.calls_per_decision <= 0.0 {
            bail!("9b: {name} answered {} checks/s without one script call: it refused them, see its log", v.rps);
        }
    }
    let cpu = |v: &Variant| v.node_cpu_us + v.redis_cpu_us;
    let r = BaselineBench {
        rev: rev.to_string(),
        commit,
        rounds: k.rounds,
        duration: k.duration,
        connections: k.connections,
        tenants: k.tenants,
        lease_max: LEASE_MAX,
        cpu_ratio: cpu(&after) / cpu(&before).max(0.001),
        cpu_ratio_leases: cpu(&after_leases) / cpu(&before).max(0.001),
        rps_ratio: after.rps / before.rps.max(1.0),
        rps_ratio_leases: after_leases.rps / before.rps.max(1.0),
        before,
        after,
        after_leases,
    };
    drop(old);
    run.save("s9b_baseline", &r)?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_old_configuration_has_only_keys_the_old_code_knows() {
        let toml = old_config("redis://127.0.0.1:1");
        let tree: toml::Table = toml.parse().unwrap();
        let top: Vec<&str> = tree.keys().map(String::as_str).collect();
        for key in &top {
            assert!(
                [
                    "cluster",
                    "kafka",
                    "node",
                    "regions",
                    "plans",
                    "unknown_tenants"
                ]
                .contains(key),
                "{key} is not a key of the old configuration"
            );
        }
        let unknown = tree["unknown_tenants"].as_table().unwrap();
        let keys: Vec<&str> = unknown.keys().map(String::as_str).collect();
        assert_eq!(keys, ["plan", "policy"], "no newcomer gate");
        let node = tree["node"].as_table().unwrap();
        let keys: Vec<&str> = node.keys().map(String::as_str).collect();
        assert_eq!(keys, ["store_retry_interval", "store_timeout"]);
    }
}
