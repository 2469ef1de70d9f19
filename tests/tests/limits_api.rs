//! The limits API and CLI end to end (limits as data, 2 of 2): real
//! aggregators serving `/v1/limits/…`, the real `aggregator limits …`
//! commands, real Tansu and region-nodes with their regions' real Redis.
//!
//! What would fail if the feature broke: a write through the API or the
//! CLI that no region applies; a stale `If-Match` that overwrites a newer
//! change (two aggregators racing on one tenant must give one success and
//! one 412, and the survivor's body); a tenant's own key that can raise its
//! limits; bad input that writes anything; an import that is not
//! idempotent, or an export that does not re-import with no change.

use std::path::{Path, PathBuf};
use std::time::Duration;

use harness::limits::{allowed_until_refused, check, reached, ready};
use harness::{temp_dir, wait_for, write_config, Aggregator, Redis, RegionNode, Tansu};
use serde_json::{json, Value};
use tierlimit_shared::auth::KeyDigest;

const PARTITIONS: i32 = 2;
const LIMITS: &str = "tierlimit.limits";
const DEADLINE: Duration = Duration::from_secs(30);
/// An operator's key: `read` and `limits:write`.
const OPS_KEY: &str = "tl-test-ops-9d1c4b7e2a5f8c3e6b9d2a5f8c1e4b7a";
/// acme's own key: `check` and `read`, for acme only.
const ACME_KEY: &str = "tl-test-acme-4e7a1d9c3b6f2e8a5d1c7b4e9a3f6c2d";

struct World {
    tansu: Tansu,
    redis: Vec<(String, Redis)>,
    cfg: PathBuf,
    toml: String,
    dir: harness::tempfile::TempDir,
}

impl World {
    async fn new(regions: &[&str]) -> World {
        let tansu = Tansu::start();
        tansu
            .create_topics(&["tierlimit.deltas", "tierlimit.global"], PARTITIONS)
            .await;
        tansu
            .create_topics_with_config(&[LIMITS], 1, &[("cleanup.policy", "compact")])
            .await;
        let redis = regions
            .iter()
            .map(|r| (r.to_string(), Redis::start()))
            .collect();
        let mut w = World {
            tansu,
            redis,
            cfg: PathBuf::new(),
            toml: String::new(),
            dir: temp_dir(),
        };
        let mut toml = format!(
            r#"
cluster = "test"
[kafka]
brokers = "{}"
partitions = {PARTITIONS}
[node]
flush_interval = "100ms"
view_wait = "1s"
[aggregator]
broadcast_interval = "100ms"
group_id = "agg-limits-api"
# Every limited tenant is broadcast: a node's global tier is exact from
# the first unit (the grant's count below).
broadcast_fraction = 0.0
[limits]
source = "topic"
status_interval = "200ms"
[unknown_tenants]
policy = "deny"
[auth.keys.ops]
sha256 = "{}"
scopes = ["read", "limits:write"]
[auth.keys.acme]
sha256 = "{}"
scopes = ["check", "read"]
tenants = ["acme"]
"#,
            w.tansu.brokers(),
            KeyDigest::of(OPS_KEY.as_bytes()).to_hex(),
            KeyDigest::of(ACME_KEY.as_bytes()).to_hex(),
        );
        for (name, r) in &w.redis {
            toml += &format!(
                "[regions.{name}]\nredis_url = \"{}\"\nexpected_nodes = 1\n",
                r.url()
            );
        }
        w.cfg = write_config(w.dir.path(), &toml);
        w.toml = toml;
        w
    }

    /// Gives every aggregator the others' API (`aggregator.peers`, by a
    /// reload: their ports are known once they run).
    async fn peer(&self, aggs: &[&Aggregator]) {
        let peers: Vec<String> = aggs.iter().map(|a| format!("\"{}\"", a.url(""))).collect();
        let toml = self.toml.replace(
            "[aggregator]\n",
            &format!("[aggregator]\npeers = [{}]\n", peers.join(", ")),
        );
        write_config(self.dir.path(), &toml);
        for a in aggs {
            a.proc.hup();
            let url = a.admin_url("/metrics");
            wait_for("the reload", DEADLINE, || {
                let (http, url) = (a.http.clone(), url.clone());
                async move {
                    let text = http.get(url).send().await.ok()?.text().await.ok()?;
                    let n = harness::metric_sample(
                        &text,
                        "tierlimit_aggregator_config_reloads_total{result=\"ok\"}",
                    )?;
                    (n >= 1.0).then_some(())
                }
            })
            .await;
        }
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

/// A client sending `key`.
fn client(key: &str) -> reqwest::Client {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {key}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(h)
        .build()
        .unwrap()
}

/// A request's status, ETag and JSON body.
async fn send(req: reqwest::RequestBuilder) -> (u16, Option<u64>, Value) {
    let resp = req.send().await.expect("the aggregator answers");
    let status = resp.status().as_u16();
    let etag = resp
        .headers()
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_matches('"').parse().ok());
    let body = resp.json().await.unwrap_or(Value::Null);
    (status, etag, body)
}

/// `aggregator <args>` with the ops key in the environment: stdout, or
/// the failure's stderr.
fn cli(agg: &Aggregator, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(harness::bin_path("aggregator"))
        .args(args)
        .env("TIERLIMIT_API_URL", agg.url(""))
        .env("TIERLIMIT_API_KEY", OPS_KEY)
        .output()
        .expect("aggregator runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{stdout}{stderr}"))
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

async fn applied_version(agg: &Aggregator) -> u64 {
    let (_, _, v) = send(agg.http.get(agg.url("/v1/limits/status"))).await;
    v["aggregator"]["applied_version"].as_u64().unwrap()
}

const PRO: &str = r#"{"region": {"limit": 3, "window": "1h", "algorithm": "fixed_window"}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_and_the_cli_write_read_and_delete_and_every_region_applies_it() {
    let w = World::new(&["eu", "us", "ap"]).await;
    let agg = Aggregator::start(&w.cfg).await;
    let eu = RegionNode::start(&w.cfg, "eu", "e1").await;
    let us = RegionNode::start(&w.cfg, "us", "u1").await;
    let ap = RegionNode::start(&w.cfg, "ap", "a1").await;
    ready(&eu).await;
    ready(&us).await;
    ready(&ap).await;
    let ops = client(OPS_KEY);
    let pro: Value = serde_json::from_str(PRO).unwrap();

    // 1. A plan and a tenant through the API: 201 with the version as the
    //    ETag; applied in both regions (3 allowed, then 429).
    let (s, v_plan, body) = send(ops.put(agg.url("/v1/limits/plans/pro")).json(&pro)).await;
    assert_eq!(s, 201, "{body}");
    let (s, v1, body) = send(
        ops.put(agg.url("/v1/limits/tenants/acme"))
            .header("If-None-Match", "*")
            .json(&json!({"plan": "pro"})),
    )
    .await;
    assert_eq!(s, 201, "{body}");
    let v1 = v1.unwrap();
    assert!(v1 > v_plan.unwrap());
    assert_eq!(body["applied"], true, "{body}");
    reached(&agg, v1, 3).await;
    for n in [&eu, &us, &ap] {
        assert_eq!(allowed_until_refused(n, "acme", 10).await, (3, 429));
    }
    let (s, etag, t) = send(ops.get(agg.url("/v1/limits/tenants/acme"))).await;
    assert_eq!((s, etag, t["plan"].as_str()), (200, Some(v1), Some("pro")));
    // Creating it again is refused: it exists.
    let (s, _, p) = send(
        ops.put(agg.url("/v1/limits/tenants/acme"))
            .header("If-None-Match", "*")
            .json(&json!({"plan": "pro"})),
    )
    .await;
    assert_eq!((s, p["current_version"].as_u64()), (412, Some(v1)), "{p}");

    // 2. Bad input: a problem naming the field, and nothing written.
    let before = applied_version(&agg).await;
    for (body, field) in [
        (json!({"plan": "gold"}), "plan"),
        (
            json!({"plan": "pro", "region": {"limit": "ten"}}),
            "region.limit",
        ),
        (json!({"plan": "pro", "bogus": 1}), "bogus"),
        (
            json!({"plan": "pro", "region": {"limit": 0}}),
            "tenants.acme.region.limit",
        ),
    ] {
        let (s, _, p) = send(ops.put(agg.url("/v1/limits/tenants/acme")).json(&body)).await;
        assert_eq!(s, 400, "{body}: {p}");
        assert!(
            p["field"].as_str().unwrap_or("").contains(field)
                || p["detail"].as_str().unwrap_or("").contains(field),
            "{body}: {p}"
        );
    }
    let (s, _, p) = send(
        ops.put(agg.url("/v1/limits/plans/bad"))
            .json(&json!({"region": {"limit": 5, "window": "0s"}})),
    )
    .await;
    assert_eq!(s, 400, "{p}");
    assert_eq!(applied_version(&agg).await, before, "a refused write wrote");

    // 3. The tenant's own key reads itself, not others, and cannot write.
    let acme = client(ACME_KEY);
    let (s, _, _) = send(acme.get(agg.url("/v1/limits/tenants/acme"))).await;
    assert_eq!(s, 200);
    let (s, _, p) = send(
        acme.put(agg.url("/v1/limits/tenants/acme"))
            .json(&json!({"plan": "pro", "region": {"limit": 1000000}})),
    )
    .await;
    assert_eq!((s, p["scope"].as_str()), (403, Some("limits:write")), "{p}");
    let (s, _, _) = send(acme.get(agg.url("/v1/limits/tenants/globex"))).await;
    assert_eq!(s, 403);

    // 4. The CLI: an update with If-Match raises acme to 5 (2 more in
    //    the current window), then a stale If-Match fails and changes
    //    nothing.
    let out = cli(
        &agg,
        &[
            "limits",
            "tenant",
            "put",
            "acme",
            "--body",
            r#"{"plan":"pro","region":{"limit":5}}"#,
            "--if-match",
            &v1.to_string(),
        ],
    )
    .unwrap();
    let v2: u64 = out
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no version in {out:?}"));
    reached(&agg, v2, 3).await;
    for n in [&eu, &us, &ap] {
        assert_eq!(allowed_until_refused(n, "acme", 10).await, (2, 429));
    }
    let stale = cli(
        &agg,
        &[
            "limits",
            "tenant",
            "put",
            "acme",
            "--plan",
            "pro",
            "--if-match",
            &v1.to_string(),
        ],
    )
    .unwrap_err();
    assert!(stale.contains("412"), "{stale}");
    let json_out = cli(&agg, &["limits", "tenant", "get", "acme", "--json"]).unwrap();
    let t: Value = serde_json::from_str(&json_out).unwrap();
    assert_eq!(
        (t["version"].as_u64(), &t["region"]["limit"]),
        (Some(v2), &json!(5))
    );
    let listed = cli(&agg, &["limits", "tenant", "list", "--overrides", "true"]).unwrap();
    assert!(
        listed.starts_with("TENANT") && listed.contains("region.limit=5"),
        "{listed}"
    );
    let plans = cli(&agg, &["limits", "plan", "list"]).unwrap();
    assert!(plans.contains("pro") && plans.contains("topic"), "{plans}");

    // 5. History: both writes, newest first, with who wrote them.
    let (_, _, h) = send(ops.get(agg.url("/v1/limits/tenants/acme/history"))).await;
    let changes = h["changes"].as_array().unwrap();
    assert_eq!(changes.len(), 2, "{h}");
    assert_eq!(
        (
            changes[0]["version"].as_u64(),
            changes[0]["previous_version"].as_u64()
        ),
        (Some(v2), Some(v1))
    );
    assert_eq!(changes[0]["writer"], "key:ops");

    // 6. A grant: a tenant at its month limit gets extra units for the
    //    current month (its plan unchanged), through the CLI; every region
    //    lets them through; the record says until when.
    let monthly = json!({"global": {"month": 4}});
    let (s, _, p) = send(ops.put(agg.url("/v1/limits/plans/monthly")).json(&monthly)).await;
    assert_eq!(s, 201, "{p}");
    let (s, v, p) = send(
        ops.put(agg.url("/v1/limits/tenants/gm"))
            .json(&json!({"plan": "monthly"})),
    )
    .await;
    assert_eq!(s, 201, "{p}");
    reached(&agg, v.unwrap(), 3).await;
    assert_eq!(allowed_until_refused(&eu, "gm", 10).await, (4, 429));
    let (s, _, p) = send(
        ops.post(agg.url("/v1/limits/tenants/gm/grants"))
            .json(&json!({"period": "hour", "extra": 3})),
    )
    .await;
    assert_eq!(
        (s, p["field"].as_str()),
        (400, Some("period")),
        "no hour tier: {p}"
    );
    let out = cli(
        &agg,
        &[
            "limits",
            "tenant",
            "grant",
            "gm",
            "--period",
            "month",
            "--extra",
            "3",
            "--reason",
            "support case 42",
        ],
    )
    .unwrap();
    assert!(out.contains("limit is now 7"), "{out}");
    let v_grant: u64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    reached(&agg, v_grant, 3).await;
    assert_eq!(allowed_until_refused(&eu, "gm", 10).await, (3, 429));
    let (_, _, t) = send(ops.get(agg.url("/v1/limits/tenants/gm"))).await;
    let grant = &t["grants"][0];
    assert_eq!(
        (grant["extra"].as_u64(), grant["period"].as_str()),
        (Some(3), Some("month")),
        "{t}"
    );
    assert_eq!(grant["reason"], "support case 42");
    let month_end = {
        let start = grant["period_start_ms"].as_u64().unwrap();
        tierlimit_shared::period::PeriodKind::Month
            .at(start)
            .end_ms() as u64
    };
    assert!(month_end > tierlimit_shared::messages::now_ms());

    // 7. Inspected across the three regions: acme spent its region limit
    //    (5) in each; the aggregator counts 15, 5 from each region.
    wait_for("acme's global count", DEADLINE, || {
        let (http, url) = (agg.http.clone(), agg.url("/v1/global/acme"));
        async move {
            let v: Value = http.get(url).send().await.ok()?.json().await.ok()?;
            (v["today"]["total"] == 15).then_some(())
        }
    })
    .await;
    let out = cli(
        &agg,
        &[
            "limits",
            "tenant",
            "inspect",
            "acme",
            "--json",
            "--node",
            &format!("eu={}", eu.url("")),
            "--node",
            &format!("us={}", us.url("")),
            "--node",
            &format!("ap={}", ap.url("")),
        ],
    )
    .unwrap();
    let seen: Value = serde_json::from_str(&out).unwrap();
    for region in ["eu", "us", "ap"] {
        let region_tier = seen["regions"][region]["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == "region")
            .cloned()
            .unwrap_or_else(|| panic!("{seen}"));
        assert_eq!(
            (
                region_tier["limit"].as_u64(),
                region_tier["remaining"].as_u64()
            ),
            (Some(5), Some(0)),
            "{region}: {seen}"
        );
        assert_eq!(seen["global"]["today"]["regions"][region], 5, "{seen}");
    }
    let table = cli(
        &agg,
        &[
            "limits",
            "tenant",
            "inspect",
            "acme",
            "--node",
            &format!("eu={}", eu.url("")),
        ],
    )
    .unwrap();
    assert!(
        table.starts_with("WHERE") && table.contains("global") && table.contains("eu 5"),
        "{table}"
    );

    // 8. A plan with tenants cannot be deleted; the tenant can, and is
    //    then unknown (denied) everywhere.
    let (s, _, p) = send(ops.delete(agg.url("/v1/limits/plans/pro"))).await;
    assert_eq!((s, p["tenants"].as_u64()), (409, Some(1)), "{p}");
    let out = cli(
        &agg,
        &[
            "limits",
            "tenant",
            "delete",
            "acme",
            "--if-match",
            &v2.to_string(),
        ],
    )
    .unwrap();
    let v3: u64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    reached(&agg, v3, 3).await;
    assert_eq!(check(&eu, "acme").await, 403);
    assert_eq!(check(&us, "acme").await, 403);
    assert_eq!(check(&ap, "acme").await, 403);
    let (s, _, _) = send(ops.get(agg.url("/v1/limits/tenants/acme"))).await;
    assert_eq!(s, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_aggregators_racing_on_one_tenant_give_one_success_and_one_412() {
    let w = World::new(&["eu"]).await;
    let a = Aggregator::start(&w.cfg).await;
    let b = Aggregator::start(&w.cfg).await;
    w.peer(&[&a, &b]).await;
    let ops = client(OPS_KEY);
    let pro: Value = serde_json::from_str(PRO).unwrap();
    let (s, _, body) = send(ops.put(a.url("/v1/limits/plans/pro")).json(&pro)).await;
    assert_eq!(s, 201, "{body}");
    let (s, mut version, _) = send(
        ops.put(a.url("/v1/limits/tenants/acme"))
            .json(&json!({"plan": "pro"})),
    )
    .await;
    assert_eq!(s, 201);
    for round in 0..8u64 {
        let v = version.unwrap();
        // b must have read v too, or its 412 would prove nothing.
        wait_for("b has read the version", DEADLINE, || {
            let (http, url) = (ops.clone(), b.url("/v1/limits/tenants/acme"));
            async move {
                let (_, etag, _) = send(http.get(url)).await;
                (etag == Some(v)).then_some(())
            }
        })
        .await;
        let put = |agg: &Aggregator, limit: u64| {
            ops.put(agg.url("/v1/limits/tenants/acme"))
                .header("If-Match", format!("\"{v}\""))
                .json(&json!({"plan": "pro", "region": {"limit": limit}}))
        };
        let (ra, rb) = tokio::join!(send(put(&a, 100 + round)), send(put(&b, 200 + round)));
        let mut statuses = [ra.0, rb.0];
        statuses.sort();
        assert_eq!(statuses, [200, 412], "round {round}: {ra:?} {rb:?}");
        let (winner, loser, limit) = if ra.0 == 200 {
            (ra, rb, 100 + round)
        } else {
            (rb, ra, 200 + round)
        };
        assert_eq!(loser.2["current_version"].as_u64(), winner.1, "{loser:?}");
        // Both aggregators end on the winner's record.
        for agg in [&a, &b] {
            let t = wait_for("the winner's record", DEADLINE, || {
                let (http, url) = (ops.clone(), agg.url("/v1/limits/tenants/acme"));
                let want = winner.1;
                async move {
                    let (_, etag, t) = send(http.get(url)).await;
                    (etag == want).then_some(t)
                }
            })
            .await;
            assert_eq!(t["region"]["limit"], json!(limit));
        }
        version = winner.1;
    }
    // Unconditional writes from both at once all land, each at a version
    // of its own.
    let tasks: Vec<_> = (0..6u64)
        .map(|i| {
            let agg = if i % 2 == 0 { &a } else { &b };
            let req = ops
                .put(agg.url(&format!("/v1/limits/tenants/t{i}")))
                .json(&json!({"plan": "pro"}));
            tokio::spawn(send(req))
        })
        .collect();
    let mut versions = Vec::new();
    for t in tasks {
        let (s, v, body) = t.await.unwrap();
        assert_eq!(s, 201, "{body}");
        versions.push(v.unwrap());
    }
    versions.sort();
    versions.dedup();
    assert_eq!(versions.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn imports_are_idempotent_and_exports_import_again_with_no_change() {
    let w = World::new(&["eu"]).await;
    let agg = Aggregator::start(&w.cfg).await;
    // Through the API (in batches, serialised by the one writer).
    let import = |file: &Path, extra: &[&str]| {
        let mut args = vec!["limits", "import", "--file", path(file)];
        args.extend_from_slice(extra);
        cli(&agg, &args)
    };

    // 1. The example configuration's plans and tenants, straight to the
    //    topic (a fleet's first import needs no aggregator), then again
    //    through the API: the second run writes nothing.
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../regions.example.toml");
    let out = cli(
        &agg,
        &[
            "limits",
            "import",
            "--config",
            path(&w.cfg),
            "--file",
            path(&example),
        ],
    )
    .unwrap();
    assert!(
        out.contains("6 subjects") && out.contains("6 created, 0 updated"),
        "{out}"
    );
    let again = import(&example, &[]).unwrap();
    assert!(again.contains("0 created, 0 updated"), "{again}");

    // 2. 100 000 tenants as JSON Lines (1 % with an override); a dry run
    //    first writes nothing.
    const N: usize = 100_000;
    let mut lines = String::with_capacity(N * 60);
    for i in 0..N {
        if i % 100 == 0 {
            lines += &format!(
                "{{\"kind\":\"tenant\",\"name\":\"c{i:06}\",\"limits\":{{\"plan\":\"pro\",\"region\":{{\"limit\":{}}}}}}}\n",
                10 + i
            );
        } else {
            lines += &format!(
                "{{\"kind\":\"tenant\",\"name\":\"c{i:06}\",\"limits\":{{\"plan\":\"free\"}}}}\n"
            );
        }
    }
    let big = w.file("tenants.jsonl", &lines);
    let before = applied_version(&agg).await;
    let dry = import(&big, &["--dry-run"]).unwrap();
    assert!(
        dry.contains(&format!("{N} of {N} subjects would change")),
        "{dry}"
    );
    assert_eq!(applied_version(&agg).await, before, "a dry run wrote");
    let out = import(&big, &[]).unwrap();
    assert!(out.contains(&format!("{N} created")), "{out}");

    // 3. Exported as JSON Lines and as TOML, each imported again: nothing
    //    changes; a dry run of one changed line says so.
    let jsonl = cli(&agg, &["limits", "export", "--format", "jsonl"]).unwrap();
    assert!(
        jsonl.lines().count() >= N,
        "{} lines",
        jsonl.lines().count()
    );
    let exported = w.file("export.jsonl", &jsonl);
    let out = import(&exported, &[]).unwrap();
    assert!(out.contains("0 created, 0 updated"), "{out}");
    let toml = cli(&agg, &["limits", "export", "--format", "toml"]).unwrap();
    let exported = w.file("export.toml", &toml);
    let out = import(&exported, &[]).unwrap();
    assert!(out.contains("0 created, 0 updated"), "{out}");
    let one = w.file(
        "one.jsonl",
        "{\"kind\":\"tenant\",\"name\":\"c000001\",\"limits\":{\"plan\":\"pro\"}}\n",
    );
    let dry = import(&one, &["--dry-run"]).unwrap();
    assert!(dry.contains("would update t|c000001"), "{dry}");

    // 4. A bad line refuses the whole file, naming the line and field.
    let bad = w.file(
        "bad.jsonl",
        "{\"kind\":\"tenant\",\"name\":\"ok\",\"limits\":{\"plan\":\"pro\"}}\n\
         {\"kind\":\"tenant\",\"name\":\"x\",\"limits\":{\"plan\":\"nope\"}}\n",
    );
    let before = applied_version(&agg).await;
    let e = import(&bad, &[]).unwrap_err();
    assert!(e.contains("tenants.x") && e.contains("nope"), "{e}");
    assert_eq!(applied_version(&agg).await, before);
}
