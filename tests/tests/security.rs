//! Who gets in, over real sockets to the real binaries: API keys with
//! scopes and tenants (401/403 problem+json that charge nothing), keys
//! reloaded on SIGHUP, TLS and mTLS, the admin listener apart from the API,
//! and the listener's own defences (slow-loris connections, header and URI
//! limits, request timeouts).
//!
//! Kafka is pointed at a closed port: none of this depends on it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{temp_dir, wait_until, write_config, Aggregator, Redis, RegionNode};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use serde_json::{json, Value};
use tierlimit_shared::auth::KeyDigest;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

const CHECKER: &str = "k-checker-5b0f0c7e2d9a4e81b6c3";
const REFUNDER: &str = "k-refunder-91d2a7c4e6f80b35";
const READER: &str = "k-reader-0e4f6a8b2c1d3e5f7a9b";
const LATE: &str = "k-late-6c8e0a2b4d6f8a0c2e4f";

fn digest(key: &str) -> String {
    KeyDigest::of(key.as_bytes()).to_hex()
}

/// A node config with two tenants and `auth` appended.
fn config(redis: &Redis, auth: &str) -> String {
    format!(
        r#"
cluster = "security"
[kafka]
brokers = "127.0.0.1:1"
[node]
refund_secret = "a-region-secret-of-at-least-32-bytes-for-tests"
# Generous: a loaded test machine must not turn a check into the fail mode.
store_timeout = "2s"
store_retry_interval = "50ms"
# Kafka is detached: no view to wait for (node.view_wait).
view_wait = "0s"
[regions.eu]
redis_url = "{}"
[plans.p]
region = {{ limit = 100, window = "1h" }}
[tenants.acme]
plan = "p"
[tenants.globex]
plan = "p"
[unknown_tenants]
policy = "deny"
{auth}
"#,
        redis.url()
    )
}

fn keys(checker: &str) -> String {
    format!(
        r#"
[auth.keys.checker]
sha256 = "{}"
scopes = ["check"]
tenants = ["acme"]
[auth.keys.refunder]
sha256 = "{}"
scopes = ["refund"]
[auth.keys.reader]
sha256 = "{}"
scopes = ["read"]
"#,
        digest(checker),
        digest(REFUNDER),
        digest(READER)
    )
}

/// A client that sends no key (the harness's own client sends its key).
fn bare() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn check_with(n: &RegionNode, key: Option<&str>, tenant: &str) -> (u16, String, Value) {
    let mut req = bare()
        .post(n.url("/v1/check"))
        .json(&json!({ "tenant": tenant }));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, ct, r.json().await.unwrap_or(Value::Null))
}

/// The region tier's remaining units of `tenant`, read with the harness key.
async fn remaining(n: &RegionNode, tenant: &str) -> u64 {
    let v = harness::get_json(&n.http, &n.url(&format!("/v1/tenants/{tenant}"))).await;
    v["tiers"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["tier"] == "region"))
        .and_then(|t| t["remaining"].as_u64())
        .unwrap_or_else(|| panic!("no region tier in {v}"))
}

async fn rejected(n: &RegionNode, problem: &str) -> f64 {
    let m = harness::get_text(&n.http, &n.admin_url("/metrics")).await;
    harness::metric_sample(
        &m,
        &format!("tierlimit_bad_requests_total{{problem=\"{problem}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn keys_scopes_and_tenants_refuse_without_charging() {
    let redis = Redis::start();
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &config(&redis, &keys(CHECKER)));
    let n = RegionNode::start(&cfg, "eu", "a").await;

    // 401: no key, a wrong key, a key in the wrong scheme.
    for key in [None, Some("not-a-key")] {
        let (status, ct, body) = check_with(&n, key, "acme").await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(ct, "application/problem+json");
        assert_eq!(body["type"], "https://tierlimit.dev/problems/unauthorized");
    }
    let r = bare()
        .get(n.url("/v1/check?tenant=acme"))
        .header("authorization", "Basic Zm9vOmJhcg==")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .starts_with("Bearer"));
    // 403: the checker for another tenant, the reader for a check.
    let (status, ct, body) = check_with(&n, Some(CHECKER), "globex").await;
    assert_eq!((status, ct.as_str()), (403, "application/problem+json"));
    assert_eq!(body["tenant"], "globex");
    let (status, _, body) = check_with(&n, Some(READER), "acme").await;
    assert_eq!(status, 403);
    assert_eq!(body["scope"], "check");
    // Nothing was charged by any of them.
    assert_eq!(remaining(&n, "acme").await, 100);
    assert_eq!(remaining(&n, "globex").await, 100);
    assert_eq!(rejected(&n, "unauthorized").await, 3.0);
    assert_eq!(rejected(&n, "forbidden").await, 2.0);

    // Allowed with the key, by bearer or x-api-key; never cached.
    let (status, _, body) = check_with(&n, Some(CHECKER), "acme").await;
    assert_eq!(status, 200, "{body}");
    let handle = body["refund_handle"].as_str().unwrap().to_string();
    let r = bare()
        .get(n.url("/v1/check?tenant=acme"))
        .header("x-api-key", CHECKER)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["cache-control"], "no-store");
    assert_eq!(remaining(&n, "acme").await, 98);

    // Refunds: by handle needs `refund`; free-form needs `admin`.
    let refund = |key: &'static str, body: Value| {
        let url = n.url("/v1/refund");
        async move {
            let r = bare()
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, body) = refund(CHECKER, json!({ "handle": handle })).await;
    assert_eq!((status, &body["scope"]), (403, &json!("refund")));
    let (status, body) = refund(REFUNDER, json!({ "tenant": "acme", "cost": 5 })).await;
    assert_eq!((status, &body["scope"]), (403, &json!("admin")), "{body}");
    assert_eq!(
        remaining(&n, "acme").await,
        98,
        "refused refunds give nothing"
    );
    let (status, body) = refund(REFUNDER, json!({ "handle": handle })).await;
    assert_eq!((status, &body["refunded"]), (200, &json!(1)), "{body}");
    assert_eq!(remaining(&n, "acme").await, 99);

    // Probes are open; /metrics is only on the admin listener.
    assert_eq!(
        bare().get(n.url("/healthz")).send().await.unwrap().status(),
        200
    );
    let readyz = bare().get(n.url("/readyz")).send().await.unwrap().status();
    assert!(
        readyz == 200 || readyz == 503,
        "readyz is a probe, not 401: {readyz}"
    );
    let r = bare().get(n.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let r = bare().delete(n.url("/v1/check")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let admin = bare().get(n.admin_url("/metrics")).send().await.unwrap();
    assert_eq!(admin.status(), 200);
    assert!(admin
        .text()
        .await
        .unwrap()
        .contains("tierlimit_decisions_total"));
    assert_eq!(
        bare()
            .post(n.admin_url("/v1/check"))
            .send()
            .await
            .unwrap()
            .status(),
        404,
        "the admin listener serves no API"
    );

    // SIGHUP: the checker's key is replaced by another, and check is left
    // open on this (trusted) interface.
    write_config(
        dir.path(),
        &config(
            &redis,
            &format!("{}\n[auth]\nopen_scopes = [\"check\"]\n", keys(LATE)),
        ),
    );
    n.proc.hup();
    wait_until(
        "the new key is accepted",
        Duration::from_secs(10),
        || async { check_with(&n, Some(LATE), "acme").await.0 == 200 },
    )
    .await;
    assert_eq!(
        check_with(&n, Some(CHECKER), "acme").await.0,
        401,
        "the old key is revoked"
    );
    assert_eq!(check_with(&n, None, "globex").await.0, 200, "check is open");
    let r = bare().get(n.url("/v1/tenants/acme")).send().await.unwrap();
    assert_eq!(r.status(), 401, "reading is not");
}

// --- TLS ---------------------------------------------------------------

struct Pki {
    ca: rcgen::Certificate,
    server: (String, String),
    billing: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
    rogue: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
}

fn pki() -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        SanType,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "tierlimit test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();

    let server_key = KeyPair::generate().unwrap();
    let mut sp = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    sp.subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server = sp.signed_by(&server_key, &ca_cert, &ca_key).unwrap();

    let client = |name: &str, signer: Option<(&rcgen::Certificate, &KeyPair)>| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec![name.to_string()]).unwrap();
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = match signer {
            Some((ca, ca_key)) => p.signed_by(&key, ca, ca_key).unwrap(),
            None => p.self_signed(&key).unwrap(),
        };
        (
            vec![cert.der().clone()],
            PrivateKeyDer::from(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    };
    Pki {
        billing: client("billing.internal", Some((&ca_cert, &ca_key))),
        rogue: client("billing.internal", None),
        server: (server.pem(), server_key.serialize_pem()),
        ca: ca_cert,
    }
}

fn tls_connector(
    ca: &rcgen::Certificate,
    client: Option<&(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let config = match client {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// `POST /v1/check` for `tenant` as raw HTTP/1.1 (`Connection: close`).
fn check_request(tenant: &str, key: Option<&str>) -> String {
    let body = format!(r#"{{"tenant":"{tenant}"}}"#);
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    format!(
        "POST /v1/check HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n{auth}\r\n{body}",
        body.len()
    )
}

/// Writes `request`, reads until the server closes; the status code, or
/// `None` if no HTTP response came back.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(s: S, request: &str) -> Option<u16> {
    exchange_body(s, request).await.map(|(status, _)| status)
}

/// [`exchange`], with the response's body.
async fn exchange_body<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    request: &str,
) -> Option<(u16, String)> {
    s.write_all(request.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(k)) => buf.extend_from_slice(&chunk[..k]),
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let status = text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Some((status, body.to_string()))
}

async fn over_tls(port: u16, connector: &tokio_rustls::TlsConnector, request: &str) -> Option<u16> {
    over_tls_body(port, connector, request)
        .await
        .map(|(s, _)| s)
}

async fn over_tls_body(
    port: u16,
    connector: &tokio_rustls::TlsConnector,
    request: &str,
) -> Option<(u16, String)> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.ok()?;
    exchange_body(tls, request).await
}

#[tokio::test]
async fn tls_round_trip_and_client_certificates() {
    let redis = Redis::start();
    let dir = temp_dir();
    let pki = pki();
    let path = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let cert = path("server.pem", &pki.server.0);
    let key = path("server.key", &pki.server.1);
    let ca = path("ca.pem", &pki.ca.pem());
    let auth = format!(
        r#"
[http]
tls_cert = "{cert}"
tls_key = "{key}"
tls_client_ca = "{ca}"
[auth.clients.billing]
dns_name = "billing.internal"
scopes = ["check"]
tenants = ["acme"]
"#
    );
    let cfg = write_config(dir.path(), &config(&redis, &auth));
    let n = RegionNode::start(&cfg, "eu", "a").await;
    let port = n.port();

    // TLS with a key, no client certificate.
    let plain_tls = tls_connector(&pki.ca, None);
    let req = check_request("globex", Some(harness::HARNESS_KEY));
    assert_eq!(over_tls(port, &plain_tls, &req).await, Some(200));
    assert_eq!(
        over_tls(port, &plain_tls, &check_request("acme", None)).await,
        Some(401)
    );
    // mTLS: the billing certificate is a principal of its own.
    let billing = tls_connector(&pki.ca, Some(&pki.billing));
    assert_eq!(
        over_tls(port, &billing, &check_request("acme", None)).await,
        Some(200)
    );
    assert_eq!(
        over_tls(port, &billing, &check_request("globex", None)).await,
        Some(403)
    );
    // The same name, signed by nobody the node trusts: no answer at all.
    let rogue = tls_connector(&pki.ca, Some(&pki.rogue));
    assert_eq!(
        over_tls(port, &rogue, &check_request("acme", None)).await,
        None
    );
    // Plain HTTP to the TLS port gets no HTTP answer.
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    assert_eq!(exchange(tcp, &check_request("acme", None)).await, None);
    // Charged: globex once (key), acme once (billing); read over TLS.
    for tenant in ["acme", "globex"] {
        let get = format!(
            "GET /v1/tenants/{tenant} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Authorization: Bearer {}\r\n\r\n",
            harness::HARNESS_KEY
        );
        let (status, body) = over_tls_body(port, &plain_tls, &get).await.unwrap();
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let region = v["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == "region")
            .unwrap();
        assert_eq!(region["remaining"], 99, "{tenant}: {v}");
    }
}

// --- listener defences -------------------------------------------------

#[tokio::test]
async fn slow_loris_limits_and_timeouts() {
    let redis = Redis::start();
    let dir = temp_dir();
    let http = r#"
[http]
header_read_timeout = "1s"
request_timeout = "1s"
max_header_bytes = 8192
max_uri_bytes = 2048
"#;
    let cfg = write_config(dir.path(), &config(&redis, http));
    let n = Arc::new(RegionNode::start(&cfg, "eu", "a").await);
    let port = n.port();

    // 300 connections that trickle a header line every 100 ms.
    const SLOW: usize = 300;
    let closed = Arc::new(AtomicUsize::new(0));
    let opened = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..SLOW {
        let (closed, opened) = (closed.clone(), opened.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            opened.fetch_add(1, Ordering::Relaxed);
            let _ = s.write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\n").await;
            let mut buf = [0u8; 256];
            for i in 0..300 {
                // The attacker's pace, not a synchronisation: the server
                // must close the socket, which ends the loop.
                tokio::select! {
                    r = s.read(&mut buf) => {
                        if matches!(r, Ok(0) | Err(_)) { break; }
                    }
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {
                        if s.write_all(format!("X-{i}: y\r\n").as_bytes()).await.is_err() {
                            break;
                        }
                    }
                }
            }
            closed.fetch_add(1, Ordering::Relaxed);
        }));
    }
    wait_until(
        "every slow connection is open",
        Duration::from_secs(10),
        || {
            let o = opened.clone();
            async move { o.load(Ordering::Relaxed) == SLOW }
        },
    )
    .await;
    // Checks are answered meanwhile, promptly.
    let mut worst = Duration::ZERO;
    for _ in 0..20 {
        let t = Instant::now();
        let (status, _, body) = check_with(&n, Some(harness::HARNESS_KEY), "acme").await;
        assert_eq!(status, 200, "{body}");
        worst = worst.max(t.elapsed());
    }
    eprintln!("security: slowest of 20 checks beside {SLOW} slow-loris connections: {worst:?}");
    assert!(worst < Duration::from_secs(1), "a check took {worst:?}");
    // The server closes every trickling connection (header_read_timeout).
    wait_until(
        "the server closes the slow-loris connections",
        Duration::from_secs(15),
        || {
            let c = closed.clone();
            async move { c.load(Ordering::Relaxed) == SLOW }
        },
    )
    .await;

    // Header and URI limits: problem+json, counted.
    let r = n
        .http
        .get(n.url("/v1/check?tenant=acme"))
        .header("x-padding", "p".repeat(10_000))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 431);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let long = format!("/v1/check?tenant=acme&key={}", "k".repeat(3000));
    let r = n.http.get(n.url(&long)).send().await.unwrap();
    assert_eq!(r.status(), 414);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    // A body that never completes: 408 after request_timeout, not a
    // handler held forever.
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let partial = format!(
        "POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\nAuthorization: Bearer {}\r\n\r\n{{\"tenant\"",
        harness::HARNESS_KEY
    );
    let t = Instant::now();
    assert_eq!(exchange(tcp, &partial).await, Some(408));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(rejected(&n, "headers-too-large").await, 1.0);
    assert_eq!(rejected(&n, "uri-too-long").await, 1.0);
    assert_eq!(rejected(&n, "request-timeout").await, 1.0);
    assert_eq!(
        remaining(&n, "acme").await,
        80,
        "only the 20 checks charged"
    );
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn aggregator_api_needs_a_key_and_its_dashboard_is_on_the_admin_listener() {
    let dir = temp_dir();
    let cfg = format!(
        r#"
cluster = "security"
[kafka]
brokers = "127.0.0.1:1"
[regions.eu]
redis_url = "redis://127.0.0.1:1"
[plans.p]
global = {{ limit = 10 }}
[tenants.acme]
plan = "p"
[auth.keys.acme]
sha256 = "{}"
scopes = ["read"]
tenants = ["acme"]
"#,
        digest(READER)
    );
    let cfg = write_config(dir.path(), &cfg);
    let a = Aggregator::start(&cfg).await;
    let get = |url: String, key: Option<&'static str>| async move {
        let mut r = bare().get(url);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let r = r.send().await.unwrap();
        let ct = r
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        (r.status().as_u16(), ct)
    };
    let problem = "application/problem+json".to_string();
    assert_eq!(
        get(a.url("/v1/global/acme"), None).await,
        (401, problem.clone())
    );
    assert_eq!(get(a.url("/v1/global/acme"), Some(READER)).await.0, 200);
    assert_eq!(
        get(a.url("/v1/global/globex"), Some(READER)).await,
        (403, problem)
    );
    assert_eq!(get(a.url("/v1/over-limit"), Some(READER)).await.0, 200);
    assert_eq!(get(a.url("/healthz"), None).await.0, 200);
    assert_eq!(get(a.url("/metrics"), None).await.0, 404);
    assert_eq!(get(a.url("/"), None).await.0, 404);
    let (status, ct) = get(a.admin_url("/?refresh=0"), None).await;
    assert_eq!((status, ct.as_str()), (200, "text/html; charset=utf-8"));
    let m = harness::get_text(&a.http, &a.admin_url("/metrics")).await;
    assert_eq!(
        harness::metric_sample(
            &m,
            "tierlimit_aggregator_http_rejections_total{reason=\"unauthorized\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        get(a.admin_url("/v1/global/acme"), Some(READER)).await.0,
        404,
        "the admin listener serves no API"
    );
}
