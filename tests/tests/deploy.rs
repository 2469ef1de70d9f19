//! `deploy/` is checked, not trusted: every file parses (YAML, JSON, TOML,
//! Dockerfiles, systemd units), the configurations embedded in the compose
//! setup and the Kubernetes ConfigMap validate with the real config loader,
//! the manifests have what the deployment needs (probes, one Deployment +
//! Service + PodDisruptionBudget per region, …), and every metric that the
//! Grafana dashboard and the alert rules use is exported by a real running
//! region-node or aggregator.
//!
//! No Docker engine runs here, so Dockerfiles and compose are checked by
//! parsing, not by building.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use harness::{temp_dir, wait_until, write_config, Aggregator, Redis, RegionNode, Tansu};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use serde_norway::Value as Yaml;
use tierlimit_shared::config::Config;

const DEADLINE: Duration = Duration::from_secs(30);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the repository")
        .to_path_buf()
}

fn deploy() -> PathBuf {
    repo().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Every YAML document of a file (`---` separated), merge keys applied.
fn yaml_docs(path: &Path) -> Vec<Yaml> {
    let text = read(path);
    let mut docs = Vec::new();
    for de in serde_norway::Deserializer::from_str(&text) {
        let mut v: Yaml = serde::Deserialize::deserialize(de)
            .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
        v.apply_merge()
            .unwrap_or_else(|e| panic!("{}: merge keys: {e}", path.display()));
        if !v.is_null() {
            docs.push(v);
        }
    }
    docs
}

fn s<'a>(v: &'a Yaml, path: &[&str]) -> &'a Yaml {
    let mut cur = v;
    for k in path {
        cur = &cur[*k];
    }
    cur
}

fn str_at<'a>(v: &'a Yaml, path: &[&str]) -> &'a str {
    s(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string in {v:?}"))
}

fn validate_toml(what: &str, text: &str) -> tierlimit_shared::config::Loaded {
    Config::from_toml(text).unwrap_or_else(|e| panic!("{what} does not validate: {e}"))
}

// ---------------------------------------------------------------------------
// Parsing every file
// ---------------------------------------------------------------------------

/// Dockerfile instructions (logical lines), comments and continuations
/// resolved.
fn dockerfile_instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if current.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if !current.is_empty() && t.starts_with('#') {
            continue; // comment inside a continued instruction
        }
        if let Some(rest) = t.strip_suffix('\\') {
            current.push_str(rest);
            current.push(' ');
            continue;
        }
        current.push_str(t);
        let (word, args) = current
            .split_once(char::is_whitespace)
            .unwrap_or((&current, ""));
        out.push((word.to_ascii_uppercase(), args.trim().to_string()));
        current.clear();
    }
    assert!(current.is_empty(), "a continued instruction never ends");
    out
}

fn check_dockerfile(path: &Path, binary: &str) {
    const KNOWN: &[&str] = &[
        "FROM",
        "RUN",
        "CMD",
        "LABEL",
        "EXPOSE",
        "ENV",
        "ADD",
        "COPY",
        "ENTRYPOINT",
        "VOLUME",
        "USER",
        "WORKDIR",
        "ARG",
        "ONBUILD",
        "STOPSIGNAL",
        "HEALTHCHECK",
        "SHELL",
    ];
    let ins = dockerfile_instructions(&read(path));
    for (word, _) in &ins {
        assert!(
            KNOWN.contains(&word.as_str()),
            "{}: unknown instruction {word}",
            path.display()
        );
    }
    let args: BTreeMap<String, String> = ins
        .iter()
        .filter(|(w, _)| w == "ARG")
        .filter_map(|(_, a)| a.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let resolve = |s: &str| -> String {
        let mut out = s.to_string();
        for (k, v) in &args {
            out = out.replace(&format!("${{{k}}}"), v);
        }
        out
    };
    let froms: Vec<String> = ins
        .iter()
        .filter(|(w, _)| w == "FROM")
        .map(|(_, a)| resolve(a))
        .collect();
    assert!(
        froms.len() >= 2,
        "{}: multi-stage ({froms:?})",
        path.display()
    );
    assert!(
        froms[0].starts_with("rust:1") && froms[0].ends_with(" AS build"),
        "{}: builder is rust:1 … AS build: {:?}",
        path.display(),
        froms[0]
    );
    assert_eq!(
        froms.last().unwrap(),
        "debian:bookworm-slim",
        "{}: runtime image",
        path.display()
    );
    // The builder's Debian release matches the runtime's (glibc).
    assert!(
        froms[0].contains("bookworm"),
        "{}: builder on bookworm",
        path.display()
    );
    let runs: Vec<&String> = ins
        .iter()
        .filter(|(w, _)| w == "RUN")
        .map(|(_, a)| a)
        .collect();
    assert!(
        runs.iter()
            .any(|r| r.contains(&format!("cargo build --release --locked -p {binary}"))),
        "{}: builds {binary}",
        path.display()
    );
    assert!(
        ins.iter()
            .any(|(w, a)| w == "COPY" && a.starts_with("--from=build") && a.contains(binary)),
        "{}: copies {binary} from the builder",
        path.display()
    );
    assert!(
        ins.iter()
            .any(|(w, a)| w == "ENTRYPOINT" && a.contains(&format!("/usr/local/bin/{binary}"))),
        "{}: runs {binary}",
        path.display()
    );
    assert!(
        ins.iter()
            .any(|(w, a)| w == "USER" && !a.starts_with("0") && a != "root"),
        "{}: runs as a non-root user",
        path.display()
    );
    // Exec-form JSON arrays must be valid JSON.
    for (w, a) in &ins {
        let exec = match w.as_str() {
            "ENTRYPOINT" | "CMD" => Some(a.as_str()),
            "HEALTHCHECK" => a.find("CMD ").map(|i| &a[i + 4..]),
            _ => None,
        };
        if let Some(json) = exec.map(str::trim).filter(|e| e.starts_with('[')) {
            serde_json::from_str::<Vec<String>>(json)
                .unwrap_or_else(|e| panic!("{}: {w} {json}: {e}", path.display()));
        }
    }
    let ignore = PathBuf::from(format!("{}.dockerignore", path.display()));
    assert!(
        read(&ignore).lines().any(|l| l.trim() == "target/"),
        "{} keeps target/ out of the build context",
        ignore.display()
    );
}

/// A systemd unit: `[Section]` headers and `Key=Value` lines only.
fn systemd_unit(path: &Path) -> BTreeMap<String, Vec<(String, String)>> {
    let mut sections: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut current = None;
    for (i, line) in read(path).lines().enumerate() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') || t.starts_with(';') {
            continue;
        }
        if let Some(name) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            current = Some(name.to_string());
            sections.entry(name.to_string()).or_default();
            continue;
        }
        let (k, v) = t
            .split_once('=')
            .unwrap_or_else(|| panic!("{}:{}: not Key=Value: {t}", path.display(), i + 1));
        assert!(
            k.chars().all(|c| c.is_ascii_alphanumeric()),
            "{}:{}: bad key {k}",
            path.display(),
            i + 1
        );
        let section = current
            .clone()
            .unwrap_or_else(|| panic!("{}:{}: key outside a section", path.display(), i + 1));
        sections
            .get_mut(&section)
            .unwrap()
            .push((k.to_string(), v.to_string()));
    }
    sections
}

#[test]
fn every_deploy_file_parses() {
    let all = files(&deploy());
    assert!(!all.is_empty());
    let mut kinds = BTreeMap::new();
    for path in &all {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let kind = if name.ends_with(".yml") || name.ends_with(".yaml") {
            let docs = yaml_docs(path);
            assert!(!docs.is_empty(), "{} has a document", path.display());
            "yaml"
        } else if name.ends_with(".json") {
            serde_json::from_str::<serde_json::Value>(&read(path))
                .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()));
            "json"
        } else if name.ends_with(".toml") {
            read(path)
                .parse::<toml::Table>()
                .unwrap_or_else(|e| panic!("{} is not valid TOML: {e}", path.display()));
            validate_toml(&path.display().to_string(), &read(path));
            "toml"
        } else if name.ends_with(".Dockerfile") {
            let binary = name.trim_end_matches(".Dockerfile");
            check_dockerfile(path, binary);
            "dockerfile"
        } else if name.ends_with(".service") {
            let unit = systemd_unit(path);
            for section in ["Unit", "Service", "Install"] {
                assert!(
                    unit.contains_key(section),
                    "{}: [{section}]",
                    path.display()
                );
            }
            "systemd"
        } else if name.ends_with(".dockerignore")
            || name.ends_with(".md")
            || name.ends_with(".env.example")
        {
            "text"
        } else {
            panic!(
                "{}: unknown kind of deploy file; teach tests/tests/deploy.rs to check it",
                path.display()
            );
        };
        *kinds.entry(kind).or_insert(0) += 1;
    }
    println!("deploy files checked: {kinds:?}");
    for kind in ["yaml", "json", "toml", "dockerfile", "systemd"] {
        assert!(kinds.contains_key(kind), "deploy/ has {kind} files");
    }
}

// ---------------------------------------------------------------------------
// docker compose
// ---------------------------------------------------------------------------

#[test]
fn compose_runs_three_regions_with_their_config() {
    let path = deploy().join("docker-compose.yml");
    let docs = yaml_docs(&path);
    let compose = &docs[0];
    let services = compose["services"].as_mapping().expect("services");
    let names: BTreeSet<String> = services
        .keys()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    for required in ["aggregator", "create-topics", "prometheus", "grafana"] {
        assert!(names.contains(required), "compose runs {required}");
    }
    assert!(
        names.contains("redpanda") || names.contains("tansu"),
        "compose runs a Kafka-protocol broker"
    );

    let config_text = read(&deploy().join("compose/tierlimit.toml"));
    let loaded = validate_toml("deploy/compose/tierlimit.toml", &config_text);
    let regions: BTreeSet<&String> = loaded.config.regions.keys().collect();
    assert_eq!(regions.len(), 3, "three regions");
    assert!(
        names
            .iter()
            .any(|n| loaded.config.kafka.brokers.starts_with(&format!("{n}:"))),
        "kafka.brokers names a compose service: {}",
        loaded.config.kafka.brokers
    );

    let mut nodes_per_region: BTreeMap<String, u32> = BTreeMap::new();
    for (name, svc) in services {
        let name = name.as_str().unwrap();
        // Build contexts and Dockerfiles exist.
        if let Some(build) = svc.get("build") {
            let context = path.parent().unwrap().join(str_at(build, &["context"]));
            let dockerfile = context.join(str_at(build, &["dockerfile"]));
            assert!(
                dockerfile.is_file(),
                "{name}: {} exists",
                dockerfile.display()
            );
        }
        // Bind mounts of files in deploy/ exist.
        if let Some(vols) = svc.get("volumes").and_then(|v| v.as_sequence()) {
            for v in vols {
                let v = v.as_str().unwrap();
                if let Some(rel) = v.strip_prefix("./") {
                    let host = path.parent().unwrap().join(rel.split(':').next().unwrap());
                    assert!(host.exists(), "{name}: mounts {}", host.display());
                }
            }
        }
        if let Some(region) = svc
            .get("environment")
            .and_then(|e| e.get("TIERLIMIT_REGION"))
            .and_then(|r| r.as_str())
        {
            let rc = loaded
                .config
                .regions
                .get(region)
                .unwrap_or_else(|| panic!("{name}: region {region} is configured"));
            *nodes_per_region.entry(region.to_string()).or_default() += 1;
            let redis_host = rc
                .redis_url
                .trim_start_matches("redis://")
                .split(':')
                .next()
                .unwrap();
            assert!(
                names.contains(redis_host),
                "{name}: its Redis {redis_host} runs"
            );
            let deps = svc["depends_on"].as_mapping().expect("depends_on");
            assert!(
                deps.contains_key(redis_host),
                "{name} waits for its Redis {redis_host}"
            );
            assert!(
                deps.contains_key("create-topics"),
                "{name} waits for the topics"
            );
            let mounts: Vec<&str> = svc["volumes"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert!(
                mounts.contains(&"./compose/tierlimit.toml:/etc/tierlimit/tierlimit.toml:ro"),
                "{name} mounts the config"
            );
            assert!(svc["environment"]["TIERLIMIT_NODE_ID"].as_str().is_some());
        }
    }
    for (region, rc) in &loaded.config.regions {
        assert_eq!(
            nodes_per_region.get(region).copied(),
            Some(rc.expected_nodes),
            "region {region}: as many region-nodes as expected_nodes"
        );
    }
}

// ---------------------------------------------------------------------------
// Kubernetes
// ---------------------------------------------------------------------------

fn k8s_objects() -> Vec<(PathBuf, Yaml)> {
    let dir = deploy().join("k8s");
    let mut out = Vec::new();
    for path in files(&dir) {
        if path.file_name().unwrap() == "kustomization.yaml" {
            continue;
        }
        for doc in yaml_docs(&path) {
            assert!(
                doc["apiVersion"].as_str().is_some(),
                "{}: apiVersion",
                path.display()
            );
            assert!(doc["kind"].as_str().is_some(), "{}: kind", path.display());
            out.push((path.clone(), doc));
        }
    }
    out
}

fn probe_path<'a>(container: &'a Yaml, probe: &str) -> &'a str {
    str_at(container, &[probe, "httpGet", "path"])
}

#[test]
fn kubernetes_manifests() {
    let objects = k8s_objects();
    let kind_of = |o: &Yaml| o["kind"].as_str().unwrap().to_string();
    let name_of = |o: &Yaml| str_at(o, &["metadata", "name"]).to_string();

    // The kustomization lists every manifest.
    let kust = &yaml_docs(&deploy().join("k8s/kustomization.yaml"))[0];
    let listed: BTreeSet<String> = kust["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let present: BTreeSet<String> = files(&deploy().join("k8s"))
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|n| n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present, "kustomization.yaml lists every manifest");

    // The ConfigMap's TOML is a valid configuration.
    let cm = objects
        .iter()
        .map(|(_, o)| o)
        .find(|o| kind_of(o) == "ConfigMap")
        .expect("a ConfigMap");
    let cm_name = name_of(cm);
    let loaded = validate_toml(
        "the ConfigMap's tierlimit.toml",
        str_at(cm, &["data", "tierlimit.toml"]),
    );

    let container = |d: &Yaml| -> Yaml { d["spec"]["template"]["spec"]["containers"][0].clone() };
    let env_of = |c: &Yaml, name: &str| -> Option<Yaml> {
        c["env"]
            .as_sequence()?
            .iter()
            .find(|e| e["name"].as_str() == Some(name))
            .cloned()
    };
    let mounts_config = |d: &Yaml| {
        d["spec"]["template"]["spec"]["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|v| v["configMap"]["name"].as_str() == Some(cm_name.as_str()))
    };

    // Per region: Deployment + Service + PodDisruptionBudget.
    for (region, rc) in &loaded.config.regions {
        let of_region: Vec<&Yaml> = objects
            .iter()
            .map(|(_, o)| o)
            .filter(|o| {
                o["metadata"]["labels"]["tierlimit.dev/region"].as_str() == Some(region.as_str())
            })
            .collect();
        let kinds: BTreeSet<String> = of_region.iter().map(|o| kind_of(o)).collect();
        for k in ["Deployment", "Service", "PodDisruptionBudget"] {
            assert!(kinds.contains(k), "region {region} has a {k} ({kinds:?})");
        }
        let dep = of_region
            .iter()
            .find(|o| kind_of(o) == "Deployment")
            .unwrap();
        let c = container(dep);
        assert!(str_at(&c, &["image"]).contains("region-node"));
        assert_eq!(
            probe_path(&c, "readinessProbe"),
            "/readyz",
            "region {region}"
        );
        assert_eq!(
            probe_path(&c, "livenessProbe"),
            "/healthz",
            "region {region}"
        );
        let r = env_of(&c, "TIERLIMIT_REGION").expect("TIERLIMIT_REGION");
        assert_eq!(r["value"].as_str(), Some(region.as_str()));
        assert!(env_of(&c, "TIERLIMIT_NODE_ID").is_some());
        assert_eq!(
            dep["spec"]["replicas"].as_u64(),
            Some(u64::from(rc.expected_nodes)),
            "region {region}: replicas = expected_nodes"
        );
        assert!(mounts_config(dep), "region {region} mounts the ConfigMap");
        // Selectors select the pods.
        let pod_labels = dep["spec"]["template"]["metadata"]["labels"]
            .as_mapping()
            .unwrap();
        for o in &of_region {
            let sel = match kind_of(o).as_str() {
                "Service" => o["spec"]["selector"].clone(),
                "PodDisruptionBudget" | "Deployment" => {
                    o["spec"]["selector"]["matchLabels"].clone()
                }
                _ => continue,
            };
            for (k, v) in sel.as_mapping().unwrap() {
                assert_eq!(
                    pod_labels.get(k),
                    Some(v),
                    "{} selects region {region}'s pods",
                    name_of(o)
                );
            }
        }
    }

    // The aggregator: Deployment with probes, its Service and PDB, and the
    // topic-creation Job.
    let agg = objects
        .iter()
        .map(|(_, o)| o)
        .find(|o| {
            kind_of(o) == "Deployment"
                && container(o)["image"]
                    .as_str()
                    .unwrap_or("")
                    .contains("aggregator")
        })
        .expect("an aggregator Deployment");
    let c = container(agg);
    assert_eq!(probe_path(&c, "readinessProbe"), "/readyz");
    assert_eq!(probe_path(&c, "livenessProbe"), "/healthz");
    assert!(mounts_config(agg));
    let job = objects
        .iter()
        .map(|(_, o)| o)
        .find(|o| kind_of(o) == "Job")
        .expect("a create-topics Job");
    let args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_sequence()
        .unwrap();
    assert_eq!(args[0].as_str(), Some("create-topics"));
    for k in ["Service", "PodDisruptionBudget"] {
        assert!(
            objects
                .iter()
                .any(|(_, o)| kind_of(o) == k && name_of(o) == name_of(agg)),
            "the aggregator has a {k}"
        );
    }
    // Every namespaced object is in the namespace the manifests create.
    let ns = objects
        .iter()
        .find(|(_, o)| kind_of(o) == "Namespace")
        .map(|(_, o)| name_of(o))
        .expect("a Namespace");
    for (path, o) in &objects {
        if kind_of(o) != "Namespace" {
            assert_eq!(
                o["metadata"]["namespace"].as_str(),
                Some(ns.as_str()),
                "{}: {} {}",
                path.display(),
                kind_of(o),
                name_of(o)
            );
        }
    }
}

#[test]
fn systemd_units_run_the_binaries() {
    let dir = deploy().join("systemd");
    let mut seen = BTreeSet::new();
    for path in files(&dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "service"))
    {
        let unit = systemd_unit(&path);
        let service: BTreeMap<&str, Vec<&str>> =
            unit["Service"]
                .iter()
                .fold(BTreeMap::new(), |mut m, (k, v)| {
                    m.entry(k.as_str()).or_default().push(v.as_str());
                    m
                });
        let exec = service["ExecStart"][0];
        let binary = Path::new(exec.split_whitespace().next().unwrap())
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            ["region-node", "aggregator"].contains(&binary.as_str()),
            "{exec}"
        );
        seen.insert(binary.clone());
        assert_eq!(
            service["ExecReload"],
            vec!["/bin/kill -HUP $MAINPID"],
            "reload = SIGHUP"
        );
        assert!(service["Environment"]
            .iter()
            .any(|e| e.starts_with("TIERLIMIT_CONFIG=")));
        if binary == "region-node" {
            assert!(
                path.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .ends_with("@.service"),
                "region-nodes are instances (one per node id)"
            );
            assert!(service["Environment"].contains(&"TIERLIMIT_NODE_ID=%i"));
        }
    }
    assert_eq!(seen.len(), 2, "units for both binaries: {seen:?}");
}

// ---------------------------------------------------------------------------
// Metric names: the dashboard and the alerts use what the binaries export
// ---------------------------------------------------------------------------

/// `tierlimit_…` identifiers in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("tierlimit_") {
        let start = i + at;
        let ok_before =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if ok_before {
            out.insert(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Every PromQL expression of the Grafana dashboard (panel targets,
/// template queries) and of the alert rules, by source.
fn referenced_metrics() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    fn walk(v: &serde_json::Value, names: &mut BTreeSet<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    if k == "expr" || k == "query" || k == "definition" {
                        if let Some(s) = v.as_str() {
                            names.extend(metric_names(s));
                        }
                    }
                    walk(v, names);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, names)),
            _ => {}
        }
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&read(&deploy().join("grafana/dashboards/tierlimit.json"))).unwrap();
    let mut names = BTreeSet::new();
    walk(&dashboard, &mut names);
    assert!(
        names.len() > 10,
        "the dashboard queries tierlimit metrics: {names:?}"
    );
    out.insert("grafana/dashboards/tierlimit.json".into(), names);

    let alerts = &yaml_docs(&deploy().join("prometheus/alerts.yml"))[0];
    let mut names = BTreeSet::new();
    let mut alert_names = BTreeSet::new();
    for group in alerts["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            alert_names.insert(str_at(rule, &["alert"]).to_string());
            let expr = str_at(rule, &["expr"]);
            let found = metric_names(expr);
            assert!(
                !found.is_empty(),
                "alert {:?} uses a tierlimit metric",
                rule["alert"]
            );
            names.extend(found);
        }
    }
    for needed in [
        "tierlimit_store_up",
        "tierlimit_fail_mode_decisions_total",
        "tierlimit_store_writes_refused_total",
        "tierlimit_view_age_seconds",
        "tierlimit_deltas_failed_total",
        "tierlimit_aggregator_consumer_lag",
    ] {
        assert!(names.contains(needed), "an alert rule watches {needed}");
    }
    out.insert("prometheus/alerts.yml".into(), names);
    out
}

/// Metric families in a Prometheus text exposition, from its `# TYPE`
/// lines, with histogram families expanded to their `_bucket`, `_sum` and
/// `_count` series.
fn exported(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            out.insert(name.to_string());
            if kind == "histogram" || kind == "summary" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{suffix}"));
                }
            }
        }
    }
    out
}

/// Envoy's rate limit service: allowed descriptors near their limit, a
/// denial, and a compensation (two tenants in one request, one denies).
async fn rls_traffic(port: u16) {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let mut c = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .expect("connecting to the RLS");
    let d = |t: &str| RateLimitDescriptor {
        entries: vec![Entry {
            key: "tenant".into(),
            value: t.into(),
        }],
        ..Default::default()
    };
    for tenants in [["x", "y"], ["x2", "y"]] {
        c.should_rate_limit(RateLimitRequest {
            domain: "edge".into(),
            descriptors: tenants.iter().map(|t| d(t)).collect(),
            hits_addend: 0,
        })
        .await
        .expect("ShouldRateLimit");
    }
}

/// The Envoy example is a configuration a real Envoy accepts, its rate
/// limit filter calls the gRPC cluster of the region-nodes over HTTP/2, and
/// its domain is one regions.example.toml configures; the Istio snippet
/// inserts the same filter.
#[test]
fn envoy_examples_point_envoy_at_the_rate_limit_service() {
    let path = deploy().join("envoy/envoy.yaml");
    let out = std::process::Command::new(harness::envoy_bin())
        .args(["--mode", "validate", "--log-level", "warn", "-c"])
        .arg(&path)
        .output()
        .expect("running envoy --mode validate");
    assert!(
        out.status.success(),
        "envoy refuses {}: {}{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let doc = &yaml_docs(&path)[0];
    let hcm =
        s(doc, &["static_resources", "listeners"])[0]["filter_chains"][0]["filters"][0].clone();
    let filters = hcm["typed_config"]["http_filters"].as_sequence().unwrap();
    let rl = filters
        .iter()
        .find(|f| f["name"] == "envoy.filters.http.ratelimit")
        .expect("the ratelimit filter");
    let domain = str_at(rl, &["typed_config", "domain"]);
    let cluster = str_at(
        rl,
        &[
            "typed_config",
            "rate_limit_service",
            "grpc_service",
            "envoy_grpc",
            "cluster_name",
        ],
    );
    let clusters = s(doc, &["static_resources", "clusters"])
        .as_sequence()
        .unwrap();
    let c = clusters
        .iter()
        .find(|c| c["name"] == cluster)
        .expect("the RLS cluster");
    assert!(
        !s(c, &["typed_extension_protocol_options"]).is_null(),
        "gRPC needs HTTP/2 to the region-nodes"
    );
    let example = validate_toml(
        "regions.example.toml",
        &read(&repo().join("regions.example.toml")),
    );
    assert!(
        example.rls.domain(domain).is_some(),
        "regions.example.toml configures the domain {domain:?} the Envoy example sends"
    );

    let istio = &yaml_docs(&deploy().join("envoy/istio-envoyfilter.yaml"))[0];
    assert_eq!(str_at(istio, &["kind"]), "EnvoyFilter");
    let patches = s(istio, &["spec", "configPatches"]).as_sequence().unwrap();
    let filter = patches
        .iter()
        .find(|p| p["applyTo"] == "HTTP_FILTER")
        .expect("an HTTP_FILTER patch");
    assert_eq!(
        str_at(filter, &["patch", "value", "name"]),
        "envoy.filters.http.ratelimit"
    );
    assert_eq!(
        str_at(filter, &["patch", "value", "typed_config", "domain"]),
        domain
    );
}

async fn post(http: &reqwest::Client, url: String, body: serde_json::Value) -> u16 {
    http.post(url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dashboard_and_alert_metrics_are_exported() {
    let referenced = referenced_metrics();

    let tansu = Tansu::start();
    tansu
        .create_topics(&["tierlimit.deltas", "tierlimit.global"], 2)
        .await;
    let mut redis = Redis::start();
    let dir = temp_dir();
    let toml = format!(
        r#"
cluster = "metrics"
[kafka]
brokers = "{}"
partitions = 2
[node]
flush_interval = "100ms"
store_timeout = "100ms"
store_retry_interval = "100ms"
[aggregator]
broadcast_interval = "100ms"
group_id = "agg-metrics"
# Six checks in a row against a limit of 5 in one region: with the default
# fraction the region would wait for t's entry at 5 − 1 (global.rs tests
# that); here every limited tenant is broadcast.
broadcast_fraction = 0
[regions.eu]
redis_url = "{}"
[plans.p]
on_store_error = "local"
global = {{ limit = 5 }}
node = {{ limit = 1000, window = "1s" }}
[unknown_tenants]
policy = "plan"
plan = "p"
[plans.gw]
[rls]
plan = "gw"
[[rls.domains]]
domain = "edge"
tenant_entry = "tenant"
[[rls.domains.descriptors]]
key = "tenant"
rate_limit = {{ unit = "day", requests_per_unit = 1 }}
"#,
        tansu.brokers(),
        redis.url()
    );
    let cfg = write_config(dir.path(), &toml);
    let agg = Aggregator::start(&cfg).await;
    let grpc = harness::free_port();
    let node = RegionNode::start_with_env(
        &cfg,
        "eu",
        "n1",
        &[("TIERLIMIT_GRPC_LISTEN", &format!("127.0.0.1:{grpc}"))],
    )
    .await;
    let http = harness::http_client();
    for url in [node.url("/readyz"), agg.url("/readyz")] {
        wait_until(&format!("{url} ready"), DEADLINE, || {
            let (http, url) = (http.clone(), url.clone());
            async move { http.get(url).send().await.is_ok_and(|r| r.status() == 200) }
        })
        .await;
    }

    // Ordinary traffic: allowed checks, a refund, a global denial.
    let check = node.url("/v1/check");
    for _ in 0..6 {
        post(&http, check.clone(), json!({"tenant": "t"})).await;
    }
    assert_eq!(
        post(&http, node.url("/v1/refund"), json!({"tenant": "t"})).await,
        200
    );
    rls_traffic(grpc).await;
    let agg_url = agg.url("/v1/global/t");
    wait_until("the aggregator counts t", DEADLINE, || {
        let (http, url) = (http.clone(), agg_url.clone());
        async move {
            let v: serde_json::Value = http.get(url).send().await.unwrap().json().await.unwrap();
            v["today"]["total"].as_u64() == Some(4)
        }
    })
    .await;

    let all_referenced: BTreeSet<String> = referenced.values().flatten().cloned().collect();
    let exported_now = || async {
        let mut names = exported(&harness::get_text(&http, &node.admin_url("/metrics")).await);
        names.extend(exported(
            &harness::get_text(&http, &agg.admin_url("/metrics")).await,
        ));
        names
    };
    // Labelled families without a sample yet are absent from the text
    // exposition: name the ones that appear only after their first event.
    let before = exported_now().await;
    let late: Vec<&String> = all_referenced
        .iter()
        .filter(|n| !before.contains(*n))
        .collect();
    println!(
        "referenced families absent after ordinary traffic (not initialised until their first event): {late:?}"
    );

    // The events behind them: a bad request, a reload of each process, a
    // decision without Redis (Redis frozen past store_timeout), and a delta
    // the aggregator ignores (a day far in the future).
    assert_eq!(
        post(&http, check.clone(), json!({"tenant": "a:b"})).await,
        400
    );
    node.proc.hup();
    agg.proc.hup();
    redis.proc.stop();
    for _ in 0..3 {
        post(&http, check.clone(), json!({"tenant": "u"})).await;
    }
    redis.proc.cont();
    let producer: FutureProducer = tansu.client_config().create().unwrap();
    let day = tierlimit_shared::day::today() + 30;
    let delta = tierlimit_shared::messages::Delta::new(
        "t",
        day,
        tierlimit_shared::messages::actor("eu", "future"),
        1,
        0,
        tierlimit_shared::messages::now_ms(),
    );
    // Signed with eu's test key (harness::write_config added the keys).
    let signer = tierlimit_shared::wire::DeltaSigner::with_key(
        tierlimit_shared::wire::Version::V2,
        Some((
            &harness::wire_keys::delta_key_id("eu"),
            &harness::wire_keys::delta_secret("eu"),
        )),
    );
    let (key, payload) = (delta.key(), signer.encode(&delta));
    producer
        .send(
            FutureRecord::to("tierlimit.deltas")
                .partition(tierlimit_shared::messages::partition_of("t", 2))
                .key(&key)
                .payload(&payload),
            Duration::from_secs(10),
        )
        .await
        .unwrap();

    let mut missing = BTreeMap::new();
    let start = std::time::Instant::now();
    loop {
        let names = exported_now().await;
        missing.clear();
        for (source, refs) in &referenced {
            let m: Vec<&String> = refs.iter().filter(|n| !names.contains(*n)).collect();
            if !m.is_empty() {
                missing.insert(source.clone(), m.into_iter().cloned().collect::<Vec<_>>());
            }
        }
        if missing.is_empty() || start.elapsed() > DEADLINE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        missing.is_empty(),
        "metrics used by deploy/ but not exported by region-node or aggregator: {missing:?}"
    );
    let unused: Vec<String> = exported_now()
        .await
        .into_iter()
        .filter(|n| n.starts_with("tierlimit_") && !all_referenced.contains(n))
        .filter(|n| !n.ends_with("_bucket") && !n.ends_with("_sum") && !n.ends_with("_count"))
        .filter(|n| !all_referenced.contains(&format!("{n}_bucket")))
        .collect();
    println!(
        "{} metric names referenced by deploy/ all exported; exported but not on the dashboard or in alerts: {unused:?}",
        all_referenced.len()
    );
    redis.kill();
}
