//! `aggregator limits tenant|plan|status …`: the limits API from the command
//! line, for people (tables) and scripts (`--json`, the API's own bodies).
//!
//! The API key comes from the environment (`TIERLIMIT_API_KEY`), never from
//! an argument (which `ps` would show); the URL from `--url` or
//! `TIERLIMIT_API_URL`. A refusal prints the problem's detail and exits
//! non-zero.

use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::Error;

/// One API call.
pub struct Call {
    pub method: Method,
    /// Path and query, e.g. `/v1/limits/tenants/acme`.
    pub path: String,
    pub body: Option<Value>,
    pub if_match: Option<u64>,
    pub create_only: bool,
}

impl Call {
    pub fn get(path: String) -> Call {
        Call {
            method: Method::GET,
            path,
            body: None,
            if_match: None,
            create_only: false,
        }
    }
}

/// What the API answered.
pub struct Answer {
    pub status: StatusCode,
    /// The body as JSON (a string if it is not JSON).
    pub body: Value,
    /// The body as received.
    pub raw: String,
}

/// Makes the call with the environment's key.
pub async fn call(url: &str, c: Call) -> Result<Answer, Error> {
    send(url, c, None).await
}

/// [`call`] with a body of JSON Lines (`/v1/limits/import`).
pub async fn call_raw(url: &str, c: Call, jsonl: String) -> Result<Answer, Error> {
    send(url, c, Some(jsonl)).await
}

async fn send(url: &str, c: Call, jsonl: Option<String>) -> Result<Answer, Error> {
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .map_err(|e| Error::Limits(e.to_string()))?;
    let mut req = client.request(c.method, format!("{}{}", url.trim_end_matches('/'), c.path));
    if let Ok(key) = std::env::var("TIERLIMIT_API_KEY") {
        req = req.bearer_auth(key);
    }
    if let Some(v) = c.if_match {
        req = req.header("If-Match", format!("\"{v}\""));
    }
    if c.create_only {
        req = req.header("If-None-Match", "*");
    }
    if let Some(b) = c.body {
        req = req.json(&b);
    }
    if let Some(text) = jsonl {
        req = req
            .header("Content-Type", "application/x-ndjson")
            .body(text);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| Error::Limits(format!("{url}: {e}")))?;
    let status = resp.status();
    let text = resp
        .text()
        .await
        .map_err(|e| Error::Limits(e.to_string()))?;
    let body = serde_json::from_str(&text).unwrap_or_else(|_| Value::String(text.clone()));
    Ok(Answer {
        status,
        body,
        raw: text,
    })
}

/// A refusal as an error (the problem's detail), else the answer.
pub fn ok(a: Answer) -> Result<Value, Error> {
    if a.status.is_success() {
        return Ok(a.body);
    }
    let detail = a
        .body
        .get("detail")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| a.body.to_string());
    Err(Error::Limits(format!("{}: {detail}", a.status)))
}

/// A tenant's counters everywhere: the aggregator's global view (each
/// period's count and each region's part) and, for each region given, one
/// of its region-nodes' view of the node and region windows (from the
/// region's Redis). Every call with the environment's key (`read`).
pub async fn inspect(agg: &str, tenant: &str, nodes: &[(String, String)]) -> Result<Value, Error> {
    let global = ok(call(agg, Call::get(format!("/v1/global/{tenant}"))).await?)?;
    let mut regions = serde_json::Map::new();
    for (region, url) in nodes {
        let usage = ok(call(url, Call::get(format!("/v1/tenants/{tenant}"))).await?)
            .map_err(|e| Error::Limits(format!("{region} ({url}): {e}")))?;
        regions.insert(region.clone(), usage);
    }
    Ok(serde_json::json!({"tenant": tenant, "global": global, "regions": regions}))
}

/// The rows of [`inspect`]'s answer: one per region and tier, then one per
/// global period with each region's part.
fn inspect_rows(body: &Value) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    if let Some(regions) = body["regions"].as_object() {
        for (region, usage) in regions {
            for t in usage["tiers"].as_array().into_iter().flatten() {
                let (limit, remaining) = (t["limit"].as_u64(), t["remaining"].as_u64());
                let used = limit.zip(remaining).map(|(l, r)| l.saturating_sub(r));
                rows.push(vec![
                    region.clone(),
                    cell(t.get("tier")),
                    cell(t.get("period")),
                    cell(t.get("limit")),
                    used.map_or("-".into(), |u| u.to_string()),
                    "-".into(),
                ]);
            }
        }
    }
    let g = &body["global"];
    let periods = std::iter::once(("day".to_owned(), &g["today"])).chain(
        g["periods"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| (p["kind"].as_str().unwrap_or("?").to_owned(), p)),
    );
    for (kind, p) in periods {
        if p.is_null() {
            continue;
        }
        let parts = p["regions"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(r, n)| format!("{r} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "-".into());
        rows.push(vec![
            "global".into(),
            "global".into(),
            kind,
            cell(p.get("limit")),
            cell(p.get("total")),
            parts,
        ]);
    }
    rows
}

/// A value for a table cell.
fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Rows as aligned columns.
fn table(head: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    let mut out = line(head.iter().map(|h| h.to_uppercase()).collect());
    for r in rows {
        out.push('\n');
        out.push_str(&line(r));
    }
    out
}

/// The overrides of a tenant body, compact (`region.limit=5`).
fn overrides(t: &Value) -> String {
    let mut parts = Vec::new();
    for tier in ["node", "region", "global"] {
        if let Some(Value::Object(o)) = t.get(tier) {
            for (k, v) in o {
                if !v.is_null() {
                    parts.push(format!("{tier}.{k}={}", cell(Some(v))));
                }
            }
        }
    }
    if let Some(v) = t.get("on_store_error").filter(|v| !v.is_null()) {
        parts.push(format!("on_store_error={}", cell(Some(v))));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(",")
    }
}

/// How people read an answer (scripts use `--json`).
pub fn render(kind: &str, body: &Value) -> String {
    match kind {
        "tenants" => {
            table(
                &["tenant", "plan", "version", "overrides", "pending"],
                body["tenants"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| {
                        vec![
                            cell(t.get("tenant")),
                            cell(t.get("plan")),
                            cell(t.get("version")),
                            overrides(t),
                            cell(t.get("pending")),
                        ]
                    })
                    .collect(),
            ) + &match body.get("next").and_then(Value::as_str) {
                Some(n) => format!("\n(more: --after {n})"),
                None => String::new(),
            }
        }
        "tenant" => table(
            &["tenant", "plan", "version", "overrides", "pending"],
            vec![vec![
                cell(body.get("tenant")),
                cell(body.get("plan")),
                cell(body.get("version")),
                overrides(body),
                cell(body.get("pending")),
            ]],
        ),
        "plans" => table(
            &["plan", "source", "version", "tenants"],
            body["plans"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| {
                    vec![
                        cell(p.get("plan")),
                        cell(p.get("source")),
                        cell(p.get("version")),
                        cell(p.get("tenants")),
                    ]
                })
                .collect(),
        ),
        "history" => table(
            &["version", "previous", "change", "writer", "ts_ms"],
            body["changes"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    vec![
                        cell(c.get("version")),
                        cell(c.get("previous_version")),
                        cell(c.get("change")),
                        cell(c.get("writer")),
                        cell(c.get("ts_ms")),
                    ]
                })
                .collect(),
        ),
        "inspect" => table(
            &["where", "tier", "period", "limit", "used", "by region"],
            inspect_rows(body),
        ),
        "written" => format!(
            "version {}{}{}",
            cell(body.get("version")),
            if body.get("applied") == Some(&Value::Bool(true)) {
                " (applied by this aggregator)"
            } else {
                ""
            },
            match body.get("limit_now") {
                Some(l) if !l.is_null() => format!("; the period's limit is now {l}"),
                _ => String::new(),
            }
        ),
        "status" => format!(
            "version {} reached every node: {} (newest {}; behind: {}; lagging: {})",
            cell(body.get("version")),
            cell(body.get("reached")),
            cell(body.get("newest")),
            cell(body.get("behind")),
            cell(body.get("lagging")),
        ),
        _ => serde_json::to_string_pretty(body).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_show_overrides() {
        let body = serde_json::json!({"tenants": [
            {"tenant": "acme", "plan": "pro", "version": 12, "pending": false,
             "region": {"limit": 5, "window": null}},
            {"tenant": "globex-long-name", "plan": "free", "version": 3, "pending": true},
        ], "next": "globex-long-name"});
        let out = render("tenants", &body);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("TENANT"), "{out}");
        assert!(lines[1].contains("region.limit=5"), "{out}");
        assert_eq!(lines[1].find("pro"), lines[2].find("free"), "{out}");
        assert!(out.ends_with("(more: --after globex-long-name)"), "{out}");
    }

    #[test]
    fn inspect_shows_each_region_s_windows_and_the_global_parts() {
        let body = serde_json::json!({
            "tenant": "acme",
            "regions": {"eu": {"tiers": [
                {"tier": "region", "limit": 5, "remaining": 1},
                {"tier": "global", "period": "day", "limit": 100, "remaining": 90},
            ]}},
            "global": {
                "today": {"total": 10, "limit": 100, "regions": {"eu": 4, "us": 6}},
                "periods": [{"kind": "month", "total": 30, "limit": null, "regions": {"eu": 30}}],
            },
        });
        let out = render("inspect", &body);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 5, "{out}");
        assert!(
            lines[1].starts_with("eu") && lines[1].contains("region") && lines[1].contains(" 4 "),
            "{out}"
        );
        assert!(
            lines[3].contains("day") && lines[3].contains("eu 4, us 6"),
            "{out}"
        );
        assert!(
            lines[4].contains("month") && lines[4].contains("eu 30"),
            "{out}"
        );
    }

    #[test]
    fn refusals_become_errors_with_their_detail() {
        let e = ok(Answer {
            status: StatusCode::PRECONDITION_FAILED,
            body: serde_json::json!({"detail": "If-Match names version 1"}),
            raw: String::new(),
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("412") && e.contains("If-Match names version 1"),
            "{e}"
        );
    }
}
