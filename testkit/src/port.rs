//! Free loopback ports, temporary directories and config files.

use std::collections::HashSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use tempfile::TempDir;

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// The kernel picks it (bind to port 0), so parallel tests and parallel test
/// processes rarely collide; the port is remembered so that this process
/// never hands the same one out twice (the kernel may offer a just-released
/// port again while the first server is still starting). There is an
/// unavoidable window between releasing the port and the server binding it:
/// the `start` functions here retry with a fresh port when a server reports
/// its address already in use.
pub fn free_port() -> u16 {
    static HANDED_OUT: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let handed = HANDED_OUT.get_or_init(|| Mutex::new(HashSet::new()));
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local_addr").port();
        if handed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port)
        {
            return port;
        }
    }
}

/// A fresh temporary directory (removed on drop), named so that leftovers
/// are recognisable in /tmp.
pub fn temp_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("tierlimit-")
        .tempdir()
        .expect("create temp dir")
}

/// Creates `root/name` (one directory per server of a cluster or a
/// Sentinel group, inside one temporary directory) and returns its path.
pub fn sub_dir(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    dir
}

/// Writes `toml` to `dir/tierlimit.toml` and returns the path.
///
/// The write is atomic (temporary file + rename), so a process reloading on
/// SIGHUP never reads a half-written file; calling it again on the same `dir`
/// replaces the config, which is how reload tests change it. The text is not
/// validated here: tests of invalid configuration need to write one.
///
/// Signed wire records are required by default, so a configuration with
/// regions and no `[wire]` section gets the test keys of its regions
/// ([`crate::wire_keys::toml`]), and the limits writer's keys if it has a
/// `[limits]` section; one that has a `[wire]` section is written as it is.
pub fn write_config(dir: &Path, toml: &str) -> PathBuf {
    let path = dir.join("tierlimit.toml");
    let tmp = dir.join(".tierlimit.toml.tmp");
    let text = with_wire_keys(toml);
    std::fs::write(&tmp, text).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
    path
}

/// `toml` plus the `[wire]` test keys of its regions, if it has regions and
/// no `[wire]` section (see [`write_config`]).
pub fn with_wire_keys(toml: &str) -> String {
    let Ok(tree) = toml.parse::<toml::Table>() else {
        return toml.to_owned();
    };
    match tree.get("regions").and_then(|r| r.as_table()) {
        Some(regions) if !tree.contains_key("wire") => {
            let names: Vec<&str> = regions.keys().map(String::as_str).collect();
            // The limits writer's keys only where the file has a `[limits]`
            // section: the previous release (upgrade tests) refuses them.
            let limits = tree.contains_key("limits");
            format!("{toml}\n{}", crate::wire_keys::toml(&names, limits))
        }
        _ => toml.to_owned(),
    }
}
