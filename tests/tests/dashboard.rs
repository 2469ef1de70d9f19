//! The aggregator's dashboard (`GET /`) in a real headless Chromium, against
//! a real aggregator fed by real region-nodes of three regions (real Tansu,
//! one real redis-server per region).
//!
//! The test saves a screenshot (its path is printed; run with
//! `-- --nocapture` to see it) and the DOM Chromium built, and asserts on the
//! DOM: tenant rows with their exact totals and per-region parts, the
//! over-limit marker and list, and one row per region with its newest delta.
//!
//! Chromium is `$CHROMIUM_BIN`, else `/usr/bin/chromium` (Debian package
//! `chromium`, installed by scripts/setup).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harness::{temp_dir, wait_until, write_config, Aggregator, Redis, RegionNode, Tansu};
use serde_json::{json, Value};

const PARTITIONS: i32 = 4;
const DEADLINE: Duration = Duration::from_secs(30);
const REGIONS: [&str; 3] = ["eu-west", "us-east", "ap-south"];
const HOT_LIMIT: u64 = 40;

fn chromium_bin() -> PathBuf {
    let p = std::env::var_os("CHROMIUM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        p.is_file(),
        "{} not found: run scripts/setup (Debian package chromium) or set CHROMIUM_BIN",
        p.display()
    );
    p
}

/// Runs headless Chromium with `args` then `url`, in a fresh profile, and
/// returns its stdout. Killed after 90 s.
fn chromium(args: &[&str], url: &str) -> String {
    let profile = temp_dir();
    let out_dir = temp_dir();
    let stdout_path = out_dir.path().join("stdout");
    let stderr_path = out_dir.path().join("stderr");
    let mut child = Command::new(chromium_bin())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-proxy-server",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("start chromium");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish within 90 s; stderr:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "chromium {args:?} failed ({status}); stderr:\n{}",
        std::fs::read_to_string(&stderr_path).unwrap_or_default()
    );
    std::fs::read_to_string(&stdout_path).unwrap()
}

async fn post(http: &reqwest::Client, url: &str, tenant: &str) -> (u16, Value) {
    let r = http
        .post(url)
        .json(&json!({ "tenant": tenant }))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

async fn ready(http: &reqwest::Client, url: String) -> bool {
    http.get(url).send().await.is_ok_and(|r| r.status() == 200)
}

/// The `<tr …>…</tr>` of a tenant in the DOM.
fn tenant_row<'a>(dom: &'a str, tenant: &str) -> &'a str {
    let needle = format!("data-tenant=\"{tenant}\" data-total=");
    let at = dom
        .find(&needle)
        .unwrap_or_else(|| panic!("no row for tenant {tenant} in the DOM"));
    let start = dom[..at].rfind("<tr").expect("row start");
    let end = at + dom[at..].find("</tr>").expect("row end");
    &dom[start..end]
}

fn attr<'a>(element: &'a str, name: &str) -> &'a str {
    let needle = format!("{name}=\"");
    let at = element
        .find(&needle)
        .unwrap_or_else(|| panic!("no {name} in {element}"))
        + needle.len();
    &element[at..at + element[at..].find('"').unwrap()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dashboard_in_headless_chromium() {
    let chromium_path = chromium_bin();
    let tansu = Tansu::start();
    tansu
        .create_topics(&["tierlimit.deltas", "tierlimit.global"], PARTITIONS)
        .await;
    let redis: Vec<Redis> = REGIONS.iter().map(|_| Redis::start()).collect();
    let mut toml = format!(
        r#"
cluster = "dashboard-test"
[kafka]
brokers = "{}"
partitions = {PARTITIONS}
[node]
# This suite checks the Redis path decision by decision: no leases.
lease_max = 0
flush_interval = "100ms"
store_timeout = "500ms"
[aggregator]
broadcast_interval = "100ms"
group_id = "agg-dashboard"
[plans.capped]
global = {{ limit = {HOT_LIMIT} }}
[plans.big]
global = {{ limit = 100000 }}
[tenants.hot]
plan = "capped"
[tenants.acme]
plan = "big"
[tenants.globex]
plan = "big"
[unknown_tenants]
policy = "deny"
"#,
        tansu.brokers()
    );
    for (name, r) in REGIONS.iter().zip(&redis) {
        toml += &format!(
            "[regions.{name}]\nredis_url = \"{}\"\nexpected_nodes = 1\n",
            r.url()
        );
    }
    let dir = temp_dir();
    let cfg = write_config(dir.path(), &toml);
    let agg = Aggregator::start(&cfg).await;
    let mut nodes = Vec::new();
    for r in REGIONS {
        nodes.push(RegionNode::start(&cfg, r, "n1").await);
    }
    let http = harness::http_client();
    for url in nodes
        .iter()
        .map(|n| n.url("/readyz"))
        .chain([agg.url("/readyz")])
    {
        wait_until(&format!("{url} ready"), DEADLINE, || {
            ready(&http, url.clone())
        })
        .await;
    }

    // acme: 30 in eu-west, 20 in us-east, 10 in ap-south; globex: 5 in eu-west.
    let mut want: Vec<(&str, &str, u64)> = vec![
        ("acme", "eu-west", 30),
        ("acme", "us-east", 20),
        ("acme", "ap-south", 10),
        ("globex", "eu-west", 5),
    ];
    for (tenant, region, n) in &want {
        let url = nodes[REGIONS.iter().position(|r| r == region).unwrap()].url("/v1/check");
        for _ in 0..*n {
            let (s, body) = post(&http, &url, tenant).await;
            assert_eq!(s, 200, "{tenant} in {region}: {body}");
        }
    }
    // hot: round robin over the regions until every region denies it.
    let mut hot = [0u64; 3];
    let mut denied = [false; 3];
    let mut i = 0;
    let start = Instant::now();
    while !denied.iter().all(|d| *d) {
        assert!(start.elapsed() < DEADLINE, "every region denies hot");
        let k = i % 3;
        let (s, body) = post(&http, &nodes[k].url("/v1/check"), "hot").await;
        match s {
            200 => hot[k] += 1,
            429 => {
                assert_eq!(body["violated-policy"], "global", "{body}");
                denied[k] = true;
            }
            other => panic!("unexpected {other}: {body}"),
        }
        i += 1;
        if hot.iter().sum::<u64>() >= HOT_LIMIT {
            // Let the broadcast catch up instead of spinning.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let hot_total: u64 = hot.iter().sum();
    assert!(
        hot_total >= HOT_LIMIT,
        "hot reached its limit ({hot_total})"
    );
    for (k, r) in REGIONS.iter().enumerate() {
        if hot[k] > 0 {
            want.push(("hot", r, hot[k]));
        }
    }

    // The aggregator has every count exactly.
    for (tenant, total) in [("acme", 60), ("globex", 5), ("hot", hot_total)] {
        let url = agg.url(&format!("/v1/global/{tenant}"));
        wait_until(
            &format!("the aggregator counts {total} for {tenant}"),
            DEADLINE,
            || {
                let (http, url) = (http.clone(), url.clone());
                async move {
                    let Ok(r) = http.get(url).send().await else {
                        return false;
                    };
                    let v: Value = r.json().await.unwrap_or(Value::Null);
                    v["today"]["total"].as_u64() == Some(total)
                }
            },
        )
        .await;
    }

    // Chromium: screenshot and DOM.
    let url = agg.admin_url("/?refresh=0");
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&shots).unwrap();
    let png = shots.join("tierlimit-dashboard.png");
    let _ = std::fs::remove_file(&png);
    let screenshot_arg = format!("--screenshot={}", png.display());
    let (png_arg, url2) = (screenshot_arg.clone(), url.clone());
    tokio::task::spawn_blocking(move || chromium(&[&png_arg, "--window-size=1280,900"], &url2))
        .await
        .unwrap();
    let bytes = std::fs::read(&png).unwrap_or_else(|e| panic!("screenshot {}: {e}", png.display()));
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    assert!(
        bytes.len() > 20_000,
        "a screenshot with content ({} bytes)",
        bytes.len()
    );
    println!(
        "dashboard screenshot ({}, {} bytes): {}",
        chromium_path.display(),
        bytes.len(),
        png.display()
    );
    let url3 = url.clone();
    let dom = tokio::task::spawn_blocking(move || chromium(&["--dump-dom"], &url3))
        .await
        .unwrap();
    let dom_path = shots.join("tierlimit-dashboard.html");
    std::fs::write(&dom_path, &dom).unwrap();
    println!("dashboard DOM: {}", dom_path.display());
    check_dom(&dom, &want, hot_total);
}

fn check_dom(dom: &str, want: &[(&str, &str, u64)], hot_total: u64) {
    assert!(dom.contains("<title>tierlimit · dashboard-test"), "title");
    assert!(
        dom.contains("id=\"status\">ready<"),
        "the instance is ready"
    );
    assert!(!dom.contains("<script"), "no script on the page");

    // Totals and limits, exact.
    let acme = tenant_row(dom, "acme");
    assert_eq!(attr(acme, "data-total"), "60");
    assert_eq!(attr(acme, "data-limit"), "100000");
    assert_eq!(attr(acme, "class"), "tenant", "acme is not over its limit");
    assert!(acme.contains("<td class=\"n total\">60</td>"), "{acme}");
    assert!(!acme.contains("over-limit"));
    let globex = tenant_row(dom, "globex");
    assert_eq!(attr(globex, "data-total"), "5");
    let hot = tenant_row(dom, "hot");
    assert_eq!(
        attr(hot, "class"),
        "tenant over",
        "hot is marked over its limit"
    );
    assert_eq!(attr(hot, "data-total"), hot_total.to_string());
    assert_eq!(attr(hot, "data-limit"), HOT_LIMIT.to_string());
    assert!(
        hot.contains("<span class=\"badge over-limit\">over limit</span>"),
        "{hot}"
    );
    assert!(hot.contains("<td class=\"plan\">capped</td>"));
    assert_eq!(
        dom.matches("badge over-limit").count(),
        1,
        "only hot is over"
    );

    // Over-limit tenants come first, and are listed.
    assert!(
        dom.find("data-tenant=\"hot\" data-total").unwrap()
            < dom.find("data-tenant=\"acme\" data-total").unwrap()
    );
    assert!(dom.contains("id=\"over-limit-count\">1<"));
    let list = &dom[dom.find("id=\"over-limit\"").unwrap()..dom.find("id=\"usage\"").unwrap()];
    assert!(
        list.contains(&format!(
            "<li data-tenant=\"hot\"><b>hot</b>: {hot_total} of {HOT_LIMIT} ("
        )),
        "{list}"
    );
    assert!(dom.contains("id=\"tenant-count\">3<"));

    // Per-region parts as bar segments, exact.
    for (tenant, region, n) in want {
        let row = tenant_row(dom, tenant);
        assert!(
            row.contains(&format!(
                "class=\"seg\" data-region=\"{region}\" data-units=\"{n}\""
            )),
            "{tenant} has a {region} segment of {n}: {row}"
        );
    }
    let acme_width: f64 = {
        let seg = &acme[acme
            .find("data-region=\"eu-west\" data-units=\"30\"")
            .unwrap()..];
        let style = attr(seg, "style");
        style["width:".len()..style.find('%').unwrap()]
            .parse()
            .unwrap()
    };
    assert!(
        (acme_width - 0.03).abs() < 0.001,
        "30 of 100000 is 0.03%: {acme_width}"
    );

    // One row per region, each with its newest delta.
    for region in REGIONS {
        let at = dom
            .find(&format!("<tr class=\"region\" data-region=\"{region}\""))
            .unwrap_or_else(|| panic!("no region row for {region}"));
        let row = &dom[at..at + dom[at..].find("</tr>").unwrap()];
        let ms: u64 = attr(row, "data-last-delta-ms")
            .parse()
            .unwrap_or_else(|_| panic!("{region} has a newest delta: {row}"));
        let now = tierlimit_shared::messages::now_ms();
        assert!(
            ms <= now + 1000 && now - ms < 120_000,
            "{region}: {ms} vs {now}"
        );
        assert!(row.contains(" ago</span>"), "{row}");
    }
}
