//! `infra` (scripts/infra): servers started by hand outlive the command,
//! are found again by `up` and `status`, and are gone after `down`.

use std::process::Command;

fn infra(dir: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_infra"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run infra");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn port_of(env: &str, var: &str) -> u16 {
    let line = env
        .lines()
        .find(|l| l.starts_with(&format!("export {var}=")))
        .unwrap_or_else(|| panic!("{var} not exported:\n{env}"));
    line.rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

#[test]
fn up_outlives_the_command_status_finds_it_down_stops_it() {
    let dir = testkit::temp_dir();
    let (ok, env, err) = infra(dir.path(), &["up", "--redis", "1", "--partitions", "2"]);
    assert!(ok, "{err}");
    let redis = port_of(&env, "TIERLIMIT_REDIS_URL_1");
    let kafka = port_of(&env, "TIERLIMIT_KAFKA_BROKERS");
    assert!(
        testkit::redis_server::ping(redis),
        "redis answers after infra exited"
    );
    assert!(testkit::tansu::answers_metadata(&format!(
        "127.0.0.1:{kafka}"
    )));

    let (ok, again, err) = infra(dir.path(), &["up"]);
    assert!(ok && err.contains("already up"), "{err}");
    assert_eq!(again, env, "the same servers, nothing started");
    let (_, status, err) = infra(dir.path(), &["status"]);
    assert_eq!(err.matches("running").count(), 2, "{err}");
    assert_eq!(status, env);

    let (ok, _, err) = infra(dir.path(), &["down"]);
    assert!(ok, "{err}");
    testkit::wait_until_blocking("redis stops", std::time::Duration::from_secs(10), || {
        !testkit::redis_server::ping(redis)
    });
    assert!(!dir.path().join(".tierlimit/infra").exists());
    let (_, _, err) = infra(dir.path(), &["status"]);
    assert!(err.contains("down"), "{err}");
}
