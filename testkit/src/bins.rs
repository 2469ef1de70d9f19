//! Paths of the workspace binaries (`region-node`, `aggregator`, `loadgen`).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

static BIN_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Makes [`bin_path`] take binaries from `dir` as they are (no build): the
/// demo and the bench runner use release binaries that their scripts built.
/// The first call wins.
pub fn set_bin_dir(dir: impl Into<PathBuf>) {
    let _ = BIN_DIR.set(dir.into());
}

/// Path of a workspace binary (`region-node`, `aggregator`).
///
/// With [`set_bin_dir`] called, or `TIERLIMIT_BIN_DIR` set, that directory
/// is used as is (no build).
/// Otherwise the binary is looked up in the same target directory and profile
/// as this test executable (`target/debug/deps/xxx` → `target/debug/NAME`),
/// after running `cargo build --workspace --bins` once per test process.
///
/// Why build at all: `cargo test -p tierlimit-tests` does not rebuild other
/// packages' binaries, so after an edit to region-node the tests would
/// silently run the old binary. `scripts/test` builds the binaries first with
/// the same command, so there this build is a no-op that takes a moment.
/// If that build fails (another crate mid-edit) but the binary exists, it is
/// used with a warning on stderr; if it does not exist, this panics with
/// cargo's errors. Set `TIERLIMIT_SKIP_BUILD=1` to use whatever binary is
/// there without building.
pub fn bin_path(name: &str) -> PathBuf {
    if let Some(dir) = BIN_DIR.get() {
        let path = dir.join(name);
        assert!(path.is_file(), "{} does not exist", path.display());
        return path;
    }
    if let Some(dir) = std::env::var_os("TIERLIMIT_BIN_DIR") {
        let path = PathBuf::from(dir).join(name);
        assert!(
            path.is_file(),
            "{} does not exist (TIERLIMIT_BIN_DIR is set)",
            path.display()
        );
        return path;
    }
    let profile_dir = profile_dir();
    let path = profile_dir.join(name);
    let skip = std::env::var_os("TIERLIMIT_SKIP_BUILD").is_some_and(|v| !v.is_empty() && v != "0");
    if !skip || !path.is_file() {
        if let Err(e) = build_binaries_once(&profile_dir) {
            // Another crate of the workspace may be mid-edit: a binary that
            // exists is still worth testing, with a warning that it may be
            // older than the source.
            if !path.is_file() {
                panic!("{e}");
            }
            eprintln!(
                "harness: WARNING: using {} as it is, it may be stale: {e}",
                path.display()
            );
        }
    }
    assert!(
        path.is_file(),
        "binary {name} not found at {} even after `cargo build --workspace --bins`; \
         is `{name}` a [[bin]] of the workspace?",
        path.display()
    );
    path
}

/// `target/<profile>` of the running test executable.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("test executable has a directory");
    if dir.file_name() == Some(OsStr::new("deps")) {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

fn build_binaries_once(profile_dir: &Path) -> Result<(), String> {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let result = BUILT.get_or_init(|| {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("testkit/ is inside the workspace");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace)
            .args(["build", "--workspace", "--bins", "--manifest-path"])
            .arg(workspace.join("Cargo.toml"));
        if let Some(target_dir) = profile_dir.parent() {
            cmd.arg("--target-dir").arg(target_dir);
        }
        // What cargo sets for the running test (the package's manifest dir,
        // name, version…) is not the environment of `scripts/test`'s build:
        // build scripts that watch such a variable (ring watches
        // CARGO_MANIFEST_DIR) would make both builds rebuild half the
        // workspace, each time the other ran.
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            let set_for_tests = [
                "CARGO_MANIFEST_",
                "CARGO_PKG_",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
            ];
            if set_for_tests.iter().any(|p| key.starts_with(p)) {
                cmd.env_remove(key.as_ref());
            }
        }
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
        }
        eprintln!("harness: running {cmd:?}");
        match cmd.output() {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(format!(
                "`cargo build --workspace --bins` failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )),
            Err(e) => Err(format!("cannot run cargo: {e}")),
        }
    });
    result.clone()
}
