//! envoyproxy/ratelimit's configuration language, file by file: the
//! fixtures in `tests/fixtures/envoy/language/` (one per rule of its loader
//! and per configuration of its `test/config` suite, written for this
//! project in its format) go through both roads a user has, loaded directly
//! (`rls.envoy_configs`) and imported (`EnvoyFile::check` and `to_toml`, what
//! `region-node import-envoy-config` prints, read back as TOML); each must
//! be accepted into the same rules or refused with its key named, and what
//! an accepted one matches is checked after envoyproxy/ratelimit's
//! `test/config/config_test.go`. Pure logic: no Redis, a few milliseconds.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tierlimit_shared::config::ConfigError;
use tierlimit_shared::rls::{
    compile, Compiled, DomainConfig, EnvoyFile, MetaValue, RlsConfig, Rule, Unit,
};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/envoy/language")
}

fn path(name: &str) -> PathBuf {
    dir().join(name)
}

/// What a fixture's first line says tierlimit does with it.
#[derive(Debug)]
enum Expect {
    Accepted,
    /// The message names `key` (relative to the file's root) and contains
    /// `phrase`.
    Refused {
        key: String,
        phrase: String,
    },
}

fn expectation(name: &str, text: &str) -> Expect {
    let first = text.lines().next().unwrap_or_default();
    if first == "# accepted" {
        return Expect::Accepted;
    }
    let rest = first.strip_prefix("# refused: ").unwrap_or_else(|| {
        panic!("{name}: the first line says neither `# accepted` nor `# refused: KEY: PHRASE`")
    });
    let (key, phrase) = rest
        .split_once(": ")
        .unwrap_or_else(|| panic!("{name}: `# refused: KEY: PHRASE`"));
    Expect::Refused {
        key: key.into(),
        phrase: phrase.into(),
    }
}

/// Loaded directly: `[rls] envoy_configs = [...]`.
fn direct(names: &[&str], merge: bool) -> Result<Compiled, ConfigError> {
    compile(
        &RlsConfig {
            envoy_configs: names
                .iter()
                .map(|n| path(n).display().to_string())
                .collect(),
            merge_domain_configs: merge,
            ..Default::default()
        },
        |_| true,
    )
}

/// Imported: checked, written as TOML, read back and compiled; also the
/// domain as the TOML holds it.
fn imported(name: &str) -> Result<(Compiled, DomainConfig), String> {
    let p = path(name);
    let shown = p.display().to_string();
    let file = EnvoyFile::read(&p).map_err(|e| e.to_string())?;
    file.check(&shown).map_err(|e| e.to_string())?;
    let text = file.to_toml(&shown).map_err(|e| e.to_string())?;
    #[derive(serde::Deserialize)]
    struct W {
        rls: RlsConfig,
    }
    let w: W = toml::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}\n{text}"));
    let domain = w.rls.domains[0].clone();
    let c = compile(&w.rls, |_| true).map_err(|e| e.to_string())?;
    Ok((c, domain))
}

/// Every fixture of the directory, by name.
fn fixtures() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// The fixtures the suite must hold: envoyproxy/ratelimit's test/config
/// configurations and its loader's refusals (a deleted one fails here).
const EXPECTED: &[&str] = &[
    "bad_unit.yaml",
    "bad_yaml.yaml",
    "basic.yaml",
    "duplicate_key.yaml",
    "empty_domain.yaml",
    "empty_key.yaml",
    "merge_first.yaml",
    "merge_second.yaml",
    "metadata.yaml",
    "metadata_null.yaml",
    "misspelled_key.yaml",
    "misspelled_key2.yaml",
    "non_map_list.yaml",
    "non_string_key.yaml",
    "quota_mode.yaml",
    "replaces_empty.yaml",
    "replaces_self.yaml",
    "shadow_mode.yaml",
    "share_threshold.yaml",
    "share_threshold_exact.yaml",
    "shop_again.yaml",
    "unlimited_with_unit.yaml",
    "wildcard.yaml",
];

#[test]
fn rls_every_fixture_is_accepted_or_refused_on_both_roads() {
    let all = fixtures();
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    for e in EXPECTED {
        assert!(names.contains(e), "fixture {e} is missing");
    }
    for (name, text) in &all {
        match expectation(name, text) {
            Expect::Accepted => {
                direct(&[name], false).unwrap_or_else(|e| panic!("{name} loaded directly: {e}"));
                let (_, domain) = imported(name).unwrap_or_else(|e| panic!("{name} imported: {e}"));
                // The same rules: the TOML holds exactly the file's domain.
                let file = EnvoyFile::read(&path(name)).unwrap();
                assert_eq!(domain, file.into_domain(), "{name}");
            }
            Expect::Refused { key, phrase } => {
                let d = direct(&[name], false)
                    .err()
                    .unwrap_or_else(|| panic!("{name} loaded directly"))
                    .to_string();
                let i = imported(name)
                    .err()
                    .unwrap_or_else(|| panic!("{name} imported"));
                for (road, msg) in [("directly", &d), ("imported", &i)] {
                    assert!(
                        msg.contains(&key) && msg.contains(&phrase),
                        "{name} {road}: {msg:?} should name {key:?} and say {phrase:?}"
                    );
                }
                // Imported, the key is named from the file's root.
                if key != "." {
                    assert!(i.contains(&format!(": {key}: ")), "{name} imported: {i:?}");
                }
            }
        }
    }
}

/// The rule `entries` reach in `domain`, and what each entry counts by.
fn lookup(
    c: &Compiled,
    domain: &str,
    entries: &[(&str, &str)],
) -> Option<(Arc<Rule>, Vec<String>)> {
    let m = c.domain(domain)?.rule(entries.iter().copied())?;
    let counted = entries
        .iter()
        .enumerate()
        .map(|(i, (_, v))| m.counted(i, v).to_string())
        .collect();
    Some((Arc::clone(m.rule), counted))
}

fn limit_of(c: &Compiled, domain: &str, entries: &[(&str, &str)]) -> Option<(u64, Unit)> {
    let (r, _) = lookup(c, domain, entries)?;
    Some((r.requests_per_unit, r.unit?))
}

#[test]
fn rls_basic_matches_as_envoyproxy_ratelimit() {
    let c = direct(&["basic.yaml"], false).unwrap();
    let l = |e: &[(&str, &str)]| limit_of(&c, "shop", e);
    assert!(c.domain("elsewhere").is_none());
    // A key and value without a rule, values no rule names, entries past
    // the tree: nothing limits.
    assert_eq!(l(&[("client", "web")]), None);
    assert_eq!(l(&[("client", "mobile")]), None);
    assert_eq!(l(&[("country", "nl"), ("city", "x")]), None);
    assert_eq!(l(&[("store", "main"), ("shelf", "bottom")]), None);
    // The key-only default and the value's override, at two levels.
    assert_eq!(
        l(&[("client", "mobile"), ("endpoint", "search")]),
        Some((4, Unit::Second))
    );
    assert_eq!(
        l(&[("client", "mobile"), ("endpoint", "checkout")]),
        Some((9, Unit::Second))
    );
    assert_eq!(l(&[("country", "fr")]), Some((50, Unit::Minute)));
    assert_eq!(l(&[("country", "nl")]), Some((80, Unit::Minute)));
    // A value listed without a limit is not limited.
    assert_eq!(l(&[("country", "internal")]), None);
    assert_eq!(l(&[("batch", "x")]), Some((3, Unit::Hour)));
    let (report, _) = lookup(&c, "shop", &[("report", "x")]).unwrap();
    assert_eq!(
        (report.name.as_deref(), report.label.as_str()),
        (Some("daily_report"), "daily_report")
    );
    let (batch, _) = lookup(&c, "shop", &[("batch", "x")]).unwrap();
    assert_eq!(
        (batch.name.as_deref(), batch.label.as_str()),
        (None, "batch")
    );
    assert_eq!(l(&[("store", "main")]), Some((12, Unit::Day)));
    assert_eq!(
        l(&[("store", "main"), ("shelf", "top")]),
        Some((30, Unit::Day))
    );
    let (health, _) = lookup(&c, "shop", &[("health", "x")]).unwrap();
    assert!(health.limit.is_none(), "unlimited");
    // detailed_metric: one rule, each value its own counter.
    let (a, ka) = lookup(&c, "shop", &[("sku", "a")]).unwrap();
    let (b, kb) = lookup(&c, "shop", &[("sku", "b")]).unwrap();
    assert_eq!((a.id.as_str(), a.requests_per_unit), (b.id.as_str(), 60));
    assert_ne!(ka, kb);
    // 30-day month, 365-day year.
    let (m, _) = lookup(&c, "shop", &[("plan", "monthly")]).unwrap();
    assert_eq!(m.limit.as_ref().unwrap().window_ms, 30 * 86_400_000);
    let (y, _) = lookup(&c, "shop", &[("plan", "yearly")]).unwrap();
    assert_eq!(y.limit.as_ref().unwrap().window_ms, 365 * 86_400_000);
    // The import keeps them, and says so.
    let toml = EnvoyFile::read(&path("basic.yaml"))
        .unwrap()
        .to_toml("basic.yaml")
        .unwrap();
    for unit in [
        "# month: a fixed window of 2592000 s",
        "# year: a fixed window of 31536000 s",
    ] {
        assert!(toml.contains(unit), "{unit}\n{toml}");
    }
}

#[test]
fn rls_shadow_mode_is_per_rule() {
    let c = direct(&["shadow_mode.yaml"], false).unwrap();
    let shadow = |e: &[(&str, &str)]| lookup(&c, "trial", e).unwrap().0.shadow;
    assert!(!shadow(&[("team", "red"), ("action", "build")]));
    assert!(shadow(&[("team", "red"), ("action", "deploy")]));
    assert!(shadow(&[("feature", "x")]));
    assert!(!shadow(&[("feature", "search")]));
}

#[test]
fn rls_wildcards_anywhere_first_written_wins() {
    let c = direct(&["wildcard.yaml"], false).unwrap();
    let rule = |e: &[(&str, &str)]| lookup(&c, "media", e);
    // Values of one wildcard: one rule, each value counted apart.
    let (a, ka) = rule(&[("image", "img-1")]).unwrap();
    let (b, kb) = rule(&[("image", "img-2")]).unwrap();
    assert_eq!(a.id, b.id);
    assert_ne!(ka, kb);
    assert_eq!(a.label, "image=img-*");
    // The first wildcard written wins, not the longest.
    assert_eq!(rule(&[("image", "img-large-1")]).unwrap().0.id, a.id);
    assert!(rule(&[("image", "photo")]).is_none());
    // A value without `*` is exact.
    assert!(rule(&[("video", "clip2")]).is_none());
    assert!(rule(&[("video", "clip")]).is_some());
    // Key only: every value.
    assert_eq!(
        rule(&[("album", "x")]).unwrap().0.id,
        rule(&[("album", "y")]).unwrap().0.id
    );
    // Middle and several wildcards; `*` matches nothing too.
    for v in ["/v1/items", "/v22/items", "/v/items"] {
        assert!(rule(&[("route", v)]).is_some(), "{v}");
    }
    for v in ["/v1/item", "x/v1/items", "/v1/items/"] {
        assert!(rule(&[("route", v)]).is_none(), "{v}");
    }
    for v in ["svcA.getB.json", "svc.get.json"] {
        assert!(rule(&[("rpc", v)]).is_some(), "{v}");
    }
    for v in ["svcA.json", "svcA.put.json"] {
        assert!(rule(&[("rpc", v)]).is_none(), "{v}");
    }
    // Nested.
    assert!(rule(&[("bucket", "eu"), ("object", "cat.png")]).is_some());
    assert!(rule(&[("bucket", "eu"), ("object", "cat.jpg")]).is_none());
}

#[test]
fn rls_share_threshold_counts_every_value_of_the_wildcard_once() {
    let c = direct(&["share_threshold.yaml"], false).unwrap();
    let rule =
        |e: &[(&str, &str)]| lookup(&c, "files", e).unwrap_or_else(|| panic!("no rule for {e:?}"));
    // Shared: one rule and one counter for every matching value.
    let same = |a: &[(&str, &str)], b: &[(&str, &str)], counted: &[&str]| {
        let (ra, ka) = rule(a);
        let (rb, kb) = rule(b);
        assert_eq!(ra.id, rb.id, "{a:?} {b:?}");
        assert_eq!(ka, kb, "{a:?} {b:?}");
        assert_eq!(ka, counted, "{a:?}");
        ra
    };
    let docs = same(
        &[("file", "docs/a.pdf")],
        &[("file", "docs/b.csv")],
        &["docs/*"],
    );
    assert_eq!(docs.requests_per_unit, 3);
    // Not shared: one rule, a counter per value.
    let (t1, k1) = rule(&[("file", "tmp/a")]);
    let (t2, k2) = rule(&[("file", "tmp/b")]);
    assert_eq!(t1.id, t2.id);
    assert_ne!(k1, k2);
    let nested = same(
        &[("owner", "ops"), ("file", "logs/1.txt")],
        &[("owner", "ops"), ("file", "logs/2.txt")],
        &["ops", "logs/*"],
    );
    assert_eq!(nested.requests_per_unit, 200);
    same(
        &[("file", "top/a"), ("file", "inner/x")],
        &[("file", "top/b"), ("file", "inner/y")],
        &["top/*", "inner/*"],
    );
    // With value_to_metric / detailed_metric: still the pattern.
    same(
        &[("route", "api/v1"), ("method", "GET")],
        &[("route", "api/v2"), ("method", "GET")],
        &["api/*", "GET"],
    );
    same(
        &[("service", "svc/user"), ("endpoint", "get")],
        &[("service", "svc/order"), ("endpoint", "get")],
        &["svc/*", "get"],
    );
    // A shared parent, an unshared wildcard child: the child's value counts.
    let (_, k) = rule(&[("path", "path/a"), ("part", "part/doc1"), ("type", "pdf")]);
    assert_eq!(k, ["path/*", "part/doc1", "pdf"]);
    // The exact value wins over the shared wildcard that matches it too.
    let (g1, k) = rule(&[("doc", "guide1")]);
    assert_eq!((g1.requests_per_unit, k), (50, vec!["guide1".to_string()]));
    let g = same(&[("doc", "guide2")], &[("doc", "guide123")], &["guide*"]);
    assert_eq!(g.requests_per_unit, 100);
    same(
        &[("endpoint", "/api/v1")],
        &[("endpoint", "/api-beta-v1")],
        &["/api*v1"],
    );
    assert!(lookup(&c, "files", &[("endpoint", "/api/v2")]).is_none());
    same(
        &[("call", "svcAepBrpc")],
        &[("call", "svceprpc")],
        &["svc*ep*rpc"],
    );
    same(
        &[("tenant", "t1prod"), ("resource", "resAv2")],
        &[("tenant", "t99prod"), ("resource", "resBBBv2")],
        &["t*prod", "res*v2"],
    );
}

#[test]
fn rls_metadata_and_quota_mode_reach_the_rules() {
    let c = direct(&["metadata.yaml"], false).unwrap();
    let (pool_a, _) = lookup(&c, "routing", &[("region", "west"), ("backend", "x")]).unwrap();
    let m = pool_a.metadata.as_deref().unwrap();
    assert_eq!(m["name"], MetaValue::String("pool_a".into()));
    let (fast, _) = lookup(&c, "routing", &[("region", "west"), ("backend", "fast")]).unwrap();
    assert!(fast.metadata.is_none());
    let (pool_b, _) = lookup(&c, "routing", &[("upstream", "u")]).unwrap();
    let MetaValue::Struct(s) = &pool_b.metadata.as_deref().unwrap()["service_with_quota"] else {
        panic!("{pool_b:?}")
    };
    assert_eq!(s["name"], MetaValue::String("pool_b".into()));
    assert_eq!(s["weight"], MetaValue::Number(3.0));
    assert_eq!(s["ratio"], MetaValue::Number(0.25));
    assert_eq!(s["canary"], MetaValue::Bool(false));
    assert_eq!(
        s["zones"],
        MetaValue::List(vec![
            MetaValue::String("a".into()),
            MetaValue::String("b".into())
        ])
    );

    let c = direct(&["quota_mode.yaml"], false).unwrap();
    let quota = |e: &[(&str, &str)]| lookup(&c, "services", e).unwrap().0.quota;
    assert!(quota(&[("service", "alpha")]) && quota(&[("service", "beta")]));
    assert!(!quota(&[("client", "c1")]));
}

#[test]
fn rls_a_domain_twice_is_refused_unless_merged() {
    let e = direct(&["basic.yaml", "shop_again.yaml"], false).unwrap_err();
    assert!(
        e.key()
            .is_some_and(|k| k.ends_with("shop_again.yaml).domain")),
        "{e}"
    );
    assert!(e.to_string().contains("configured twice"), "{e}");
    direct(&["basic.yaml", "shop_again.yaml"], true).unwrap();
    let c = direct(&["merge_first.yaml", "merge_second.yaml"], true).unwrap();
    assert_eq!(
        limit_of(&c, "merged", &[("alpha", "one")]),
        Some((10, Unit::Minute))
    );
    assert_eq!(
        limit_of(&c, "merged", &[("beta", "two")]),
        Some((20, Unit::Minute))
    );
    assert!(direct(&["merge_first.yaml", "merge_second.yaml"], false).is_err());
    // The same file twice, merged: its key and value twice at one level.
    let e = direct(&["merge_first.yaml", "merge_first.yaml"], true).unwrap_err();
    assert!(
        e.key()
            .is_some_and(|k| k.ends_with("merge_first.yaml).descriptors[0]")),
        "{e}"
    );
    assert!(e.to_string().contains("appears twice"), "{e}");
}
