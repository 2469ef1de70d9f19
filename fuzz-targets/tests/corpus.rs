//! Replays the seed corpus (`fuzz/corpus/<target>/`) and every crash the
//! fuzzer ever found (`fuzz/regressions/<target>/`) through the targets,
//! as plain tests: no libFuzzer, no instrumented build.
//!
//! A seed named `ok-…` must be accepted and one named `bad-…` refused (any
//! other name only must not panic), so that the seeds keep covering both
//! the accepting and the refusing paths, and a parser that starts refusing
//! the real example configuration, or accepting a forged record, fails
//! here. A regression only has to run without a panic.

use std::fs;
use std::path::{Path, PathBuf};

use tierlimit_fuzz_targets::{target, TARGETS};

fn dir(kind: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz")
        .join(kind)
        .join(name)
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

fn replay(name: &str) {
    let run = target(name).expect("a target of that name");
    let seeds = files(&dir("corpus", name));
    let (mut ok, mut bad) = (0, 0);
    for path in &seeds {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = fs::read(path).expect("seed readable");
        let accepted = run(&bytes);
        if file.starts_with("ok-") {
            assert!(accepted, "{name}: seed {file} was refused");
            ok += 1;
        } else if file.starts_with("bad-") {
            assert!(!accepted, "{name}: seed {file} was accepted");
            bad += 1;
        }
    }
    assert!(
        ok > 0 && bad > 0,
        "{name}: the corpus needs ok- and bad- seeds ({ok} and {bad} in {})",
        dir("corpus", name).display()
    );
    for path in files(&dir("regressions", name)) {
        let bytes = fs::read(&path).expect("regression readable");
        run(&bytes);
    }
}

#[test]
fn every_target_has_a_fuzz_target_file() {
    for (name, _) in TARGETS {
        let path = dir("fuzz_targets", &format!("{name}.rs"));
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        assert!(
            text.contains(&format!("tierlimit_fuzz_targets::{name}(data)")),
            "{path:?} does not call the {name} target"
        );
    }
}

#[test]
fn config() {
    replay("config");
}

#[test]
fn delta() {
    replay("delta");
}

#[test]
fn broadcast() {
    replay("broadcast");
}

#[test]
fn ids() {
    replay("ids");
}

#[test]
fn check() {
    replay("check");
}

#[test]
fn rls() {
    replay("rls");
}
