//! Bulk changes of tenants and plans: the file formats an import reads
//! and an export writes, and what an import changes against a table.
//!
//! Two formats: TOML (`[plans]` and `[tenants]` tables, so a whole
//! configuration file can be imported) and JSON Lines, one subject a line:
//! `{"kind":"tenant","name":"acme","limits":{"plan":"pro"}}` or
//! `{"kind":"plan","name":"pro","limits":{…}}`. An import is idempotent:
//! each subject is compared with what the table holds and written only if
//! it differs, so running it again writes nothing, and running it again
//! after an interruption writes what the first run did not.

// Refusals are the API's problem+json (it names the field), built only
// on a refusal path.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;

use serde::{Deserialize, Serialize};

use tierlimit_shared::config::{PlanConfig, TenantConfig};
use tierlimit_shared::limits::{Body, LimitsTable, Subject};
use tierlimit_shared::problem::Problem;

use crate::limits_api::{check_plan, check_tenant, invalid};

/// A file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Toml,
    Jsonl,
}

impl Format {
    /// By the file name: `.jsonl`/`.ndjson` are JSON Lines, the rest TOML.
    pub fn of(file: &Path) -> Format {
        match file.extension().and_then(|e| e.to_str()) {
            Some("jsonl" | "ndjson") => Format::Jsonl,
            _ => Format::Toml,
        }
    }
}

/// The tables an import reads (anything else in the file is ignored).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct Tables {
    #[serde(default)]
    pub plans: BTreeMap<String, PlanConfig>,
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantConfig>,
}

/// One line of JSON Lines.
#[derive(Debug, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Line {
    Plan { name: String, limits: PlanConfig },
    Tenant { name: String, limits: TenantConfig },
}

/// Reads a file of either format (`Err`: why, naming the line or key).
pub fn read_file(file: &Path, format: Format) -> Result<Tables, String> {
    let err = |e: String| format!("{}: {e}", file.display());
    match format {
        Format::Toml => {
            let text = std::fs::read_to_string(file).map_err(|e| err(e.to_string()))?;
            toml::from_str(&text).map_err(|e| err(e.to_string()))
        }
        Format::Jsonl => {
            let f = std::fs::File::open(file).map_err(|e| err(e.to_string()))?;
            let mut t = Tables::default();
            for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
                let line = line.map_err(|e| err(e.to_string()))?;
                t.add_line(n + 1, &line).map_err(err)?;
            }
            Ok(t)
        }
    }
}

impl Tables {
    /// Parses JSON Lines (`Err`: the line and field that fail).
    pub fn from_jsonl(text: &str) -> Result<Tables, String> {
        let mut t = Tables::default();
        for (n, line) in text.lines().enumerate() {
            t.add_line(n + 1, line)?;
        }
        Ok(t)
    }

    fn add_line(&mut self, n: usize, line: &str) -> Result<(), String> {
        if line.trim().is_empty() {
            return Ok(());
        }
        let parsed = parse_line(line).map_err(|e| format!("line {n}: {e}"))?;
        let dup = match parsed {
            Line::Plan { name, limits } => self.plans.insert(name.clone(), limits).map(|_| name),
            Line::Tenant { name, limits } => {
                self.tenants.insert(name.clone(), limits).map(|_| name)
            }
        };
        match dup {
            Some(name) => Err(format!("line {n}: {name:?} appears twice")),
            None => Ok(()),
        }
    }

    pub fn len(&self) -> usize {
        self.plans.len() + self.tenants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// As JSON Lines, plans first.
    pub fn to_jsonl(&self) -> Vec<String> {
        let plans = self.plans.iter().map(|(name, limits)| {
            serde_json::to_string(&Line::Plan {
                name: name.clone(),
                limits: limits.clone(),
            })
        });
        let tenants = self.tenants.iter().map(|(name, limits)| {
            serde_json::to_string(&Line::Tenant {
                name: name.clone(),
                limits: limits.clone(),
            })
        });
        plans
            .chain(tenants)
            .map(|l| l.expect("tables serialize"))
            .collect()
    }
}

/// One line, its errors naming the field (`limits.region.limit`): the
/// envelope first, then the tables from it, so the path survives.
pub fn parse_line(line: &str) -> Result<Line, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Envelope {
        kind: String,
        name: String,
        limits: serde_json::Value,
    }
    let e: Envelope = serde_json::from_str(line).map_err(|e| e.to_string())?;
    fn tables<T: for<'de> Deserialize<'de>>(v: serde_json::Value) -> Result<T, String> {
        serde_path_to_error::deserialize(v)
            .map_err(|e| format!("limits.{}: {}", e.path(), e.inner()))
    }
    match e.kind.as_str() {
        "plan" => Ok(Line::Plan {
            name: e.name,
            limits: tables(e.limits)?,
        }),
        "tenant" => Ok(Line::Tenant {
            name: e.name,
            limits: tables(e.limits)?,
        }),
        other => Err(format!(
            "kind: {other:?} is neither \"plan\" nor \"tenant\""
        )),
    }
}

/// What an import does to one subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Create,
    Update,
}

/// The changes of `tables` against `table`: plans first (a tenant's plan
/// is applied before it by every follower: one partition, one order), then
/// tenants; unchanged subjects are skipped. A tenant's plan may be one the
/// same file defines.
pub fn plan_import(
    table: &LimitsTable,
    tables: &Tables,
) -> Result<Vec<(Action, Subject, Body)>, Problem> {
    // The field a refusal names is the file's key (`tenants.acme.plan`).
    let refuse = |at: String, p: Problem| {
        let detail = p.detail().to_owned();
        Problem::bad_field(&at, detail)
    };
    let same = |a: &dyn erased::Json, b: &dyn erased::Json| a.json() == b.json();
    let mut out = Vec::new();
    for (name, p) in &tables.plans {
        check_plan(name, p).map_err(|e| refuse(format!("plans.{name}"), e))?;
        match table.topic_plan(name) {
            Some((_, Some(current))) if same(&current, p) => {}
            Some((_, Some(_))) => out.push((
                Action::Update,
                Subject::Plan(name.clone()),
                Body::Plan(p.clone()),
            )),
            _ => out.push((
                Action::Create,
                Subject::Plan(name.clone()),
                Body::Plan(p.clone()),
            )),
        }
    }
    for (id, t) in &tables.tenants {
        // The file's own plan, else what the topic or configuration has.
        match tables.plans.get(&t.plan) {
            Some(p) => {
                let at = format!("tenants.{id}");
                tierlimit_shared::validate::tenant(id)
                    .map_err(|e| Problem::bad_field(&at, e.to_string()))?;
                let policy = tierlimit_shared::config::resolve_plan(&t.plan, p).map_err(invalid)?;
                tierlimit_shared::config::resolve_tenant(&at, t, &policy).map_err(invalid)?;
            }
            None => check_tenant(table, id, t).map_err(|e| refuse(format!("tenants.{id}"), e))?,
        }
        match table.tenant_view(id) {
            Some(v) if same(&v.config, t) => {}
            Some(_) => out.push((
                Action::Update,
                Subject::Tenant(id.clone()),
                Body::Tenant(t.clone()),
            )),
            None => out.push((
                Action::Create,
                Subject::Tenant(id.clone()),
                Body::Tenant(t.clone()),
            )),
        }
    }
    Ok(out)
}

/// Comparing two tables by their JSON (what a record holds).
mod erased {
    pub trait Json {
        fn json(&self) -> serde_json::Value;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> serde_json::Value {
            serde_json::to_value(self).unwrap_or_default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_round_trip_and_name_the_bad_line() {
        let dir = std::env::temp_dir().join(format!("tl-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("a.jsonl");
        std::fs::write(
            &good,
            "{\"kind\":\"plan\",\"name\":\"pro\",\"limits\":{\"region\":{\"limit\":10,\"window\":\"1m\"}}}\n\
             \n{\"kind\":\"tenant\",\"name\":\"acme\",\"limits\":{\"plan\":\"pro\"}}\n",
        )
        .unwrap();
        let t = read_file(&good, Format::of(&good)).unwrap();
        assert_eq!((t.plans.len(), t.tenants.len()), (1, 1));
        let bad = dir.join("b.jsonl");
        std::fs::write(
            &bad,
            "{\"kind\":\"tenant\",\"name\":\"acme\",\"limits\":{\"plan\":\"pro\"}}\n\
             {\"kind\":\"tenant\",\"name\":\"x\",\"limits\":{\"plan\":\"pro\",\"region\":{\"limit\":\"ten\"}}}\n",
        )
        .unwrap();
        let e = read_file(&bad, Format::Jsonl).unwrap_err();
        assert!(e.contains("line 2") && e.contains("region.limit"), "{e}");
        let dup = dir.join("c.jsonl");
        std::fs::write(
            &dup,
            "{\"kind\":\"tenant\",\"name\":\"a\",\"limits\":{\"plan\":\"p\"}}\n\
             {\"kind\":\"tenant\",\"name\":\"a\",\"limits\":{\"plan\":\"q\"}}\n",
        )
        .unwrap();
        assert!(read_file(&dup, Format::Jsonl)
            .unwrap_err()
            .contains("twice"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
