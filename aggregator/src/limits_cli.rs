//! `aggregator limits import|export|delete`: bulk changes of tenants and
//! plans from the command line.
//!
//! An import goes through the limits API (`--url`, the key in
//! `TIERLIMIT_API_KEY`) in batches of [`BATCH`] subjects, so it is
//! serialised with every other write by the one limits writer
//! (`limits_api.rs`); each batch is idempotent (only what differs is
//! written), so an interrupted import run again writes only what is
//! missing. With `--config` instead, the command writes straight to the
//! topic with the limits key and needs no aggregator: for a fleet's first
//! import (moving onto the topic) and for recovery. It reads the topic to
//! its end and writes only what differs, but it is not the elected writer:
//! run it while no one writes through the API.
//!
//! Export asks the API (the aggregator's table), or with `--config` reads
//! the topic itself: every tenant and plan as TOML tables or JSON Lines,
//! which import reads back with no change.

// Refusals are the API's problem+json (it names the field), built only
// on a refusal path.
#![allow(clippy::result_large_err)]

use std::io::Write as _;
use std::path::Path;

use tierlimit_shared::config::Config;
use tierlimit_shared::limits::write::{Standalone, WriteError};
use tierlimit_shared::limits::{Body, Subject};

use crate::limits_api::check_plan_unused;
use crate::limits_import::{plan_import, read_file, Action, Format, Tables};
use crate::Error;

/// Subjects per API call of an import (each call must finish within the
/// API's request timeout: about 1 s a batch on a 2-core test machine).
pub const BATCH: usize = 5000;

/// A failed write as a command-line error (`refused`: the check's own).
fn write_error<R>(e: WriteError<R>, refused: impl FnOnce(R) -> Error) -> Error {
    match e {
        WriteError::Refused(r) => refused(r),
        WriteError::Kafka(e) => Error::Limits(format!("kafka: {e}")),
        WriteError::Behind => Error::Limits("the limits topic could not be read to its end".into()),
    }
}

/// A problem as a command-line error: the field and what is wrong.
fn problem(p: tierlimit_shared::problem::Problem) -> Error {
    Error::Limits(p.detail().to_owned())
}

/// Imports a file through the API at `url`, in batches; the summary sums
/// them.
pub async fn import_via_api(
    url: &str,
    file: &Path,
    format: Option<Format>,
    dry_run: bool,
) -> Result<String, Error> {
    use crate::limits_client::{call_raw, ok, Call};
    let tables =
        read_file(file, format.unwrap_or_else(|| Format::of(file))).map_err(Error::Limits)?;
    let lines = tables.to_jsonl();
    let (mut created, mut updated, mut unchanged) = (0u64, 0u64, 0u64);
    let (mut first, mut last) = (None, None);
    let mut listed = Vec::new();
    for batch in lines.chunks(BATCH) {
        let body = batch.join("\n");
        let c = Call {
            method: reqwest::Method::POST,
            path: format!("/v1/limits/import?dry_run={dry_run}"),
            body: None,
            if_match: None,
            create_only: false,
        };
        let answer = ok(call_raw(url, c, body).await?)?;
        let n = |k: &str| answer[k].as_u64().unwrap_or(0);
        created += n("created");
        updated += n("updated");
        unchanged += n("unchanged");
        if first.is_none() {
            first = answer["first_version"].as_u64();
        }
        last = answer["last_version"].as_u64().or(last);
        if let Some(changes) = answer["changes"].as_array() {
            for c in changes {
                listed.push(format!(
                    "would {} {}",
                    c["action"].as_str().unwrap_or("?"),
                    c["subject"].as_str().unwrap_or("?")
                ));
            }
        }
    }
    Ok(summary(
        &SummaryIn {
            total: tables.len(),
            created,
            updated,
            unchanged,
            first,
            last,
            dry_run,
            listed,
        },
        url,
    ))
}

struct SummaryIn {
    total: usize,
    created: u64,
    updated: u64,
    unchanged: u64,
    first: Option<u64>,
    last: Option<u64>,
    dry_run: bool,
    listed: Vec<String>,
}

fn summary(s: &SummaryIn, target: &str) -> String {
    if s.dry_run {
        let mut out = String::new();
        for l in s.listed.iter().take(1000) {
            out.push_str(l);
            out.push('\n');
        }
        if s.listed.len() > 1000 {
            out.push_str(&format!("… and {} more\n", s.listed.len() - 1000));
        }
        out.push_str(&format!(
            "dry run: {} of {} subjects would change on {target} ({} created, {} updated, {} unchanged); nothing written",
            s.created + s.updated,
            s.total,
            s.created,
            s.updated,
            s.unchanged
        ));
        return out;
    }
    let versions = match (s.first, s.last) {
        (Some(a), Some(b)) => format!(" (versions {a}..={b})"),
        _ => String::new(),
    };
    format!(
        "imported {} subjects to {target}: {} created, {} updated, {} unchanged{versions}",
        s.total, s.created, s.updated, s.unchanged
    )
}

/// Imports a file straight to the topic (no aggregator needed; see the
/// module doc for when).
pub async fn import(
    config_path: &Path,
    file: &Path,
    format: Option<Format>,
    writer: &str,
    dry_run: bool,
) -> Result<String, Error> {
    let loaded = Config::load(config_path)?;
    let tables =
        read_file(file, format.unwrap_or_else(|| Format::of(file))).map_err(Error::Limits)?;
    let mut w = Standalone::connect(&loaded.config, writer)
        .await
        .map_err(Error::Limits)?;
    let topic = loaded.config.kafka.limits_topic.clone();
    let count = |changes: &[(Action, Subject, Body)]| {
        let created = changes.iter().filter(|c| c.0 == Action::Create).count() as u64;
        (created, changes.len() as u64 - created)
    };
    if dry_run {
        let changes = plan_import(w.table(), &tables).map_err(problem)?;
        let (created, updated) = count(&changes);
        let listed = changes
            .iter()
            .map(|(a, s, _)| {
                let verb = match a {
                    Action::Create => "create",
                    Action::Update => "update",
                };
                format!("would {verb} {}", s.key())
            })
            .collect();
        return Ok(summary(
            &SummaryIn {
                total: tables.len(),
                created,
                updated,
                unchanged: tables.len() as u64 - created - updated,
                first: None,
                last: None,
                dry_run,
                listed,
            },
            &topic,
        ));
    }
    let mut counts = (0, 0);
    let written = w
        .writer
        .write(None, |table| {
            let changes = plan_import(table, &tables)?;
            counts = count(&changes);
            Ok(changes.into_iter().map(|(_, s, b)| (s, b)).collect())
        })
        .await
        .map_err(|e| write_error(e, problem))?;
    Ok(summary(
        &SummaryIn {
            total: tables.len(),
            created: counts.0,
            updated: counts.1,
            unchanged: tables.len() as u64 - counts.0 - counts.1,
            first: written.records.first().map(|r| r.version),
            last: written.records.last().map(|r| r.version),
            dry_run,
            listed: Vec::new(),
        },
        &topic,
    ))
}

/// The export of the API at `url` (see `limits_api::export`).
pub async fn export_via_api(url: &str, format: Format) -> Result<String, Error> {
    use crate::limits_client::{call, ok, Call};
    let f = match format {
        Format::Toml => "toml",
        Format::Jsonl => "jsonl",
    };
    let answer = call(url, Call::get(format!("/v1/limits/export?format={f}"))).await?;
    if answer.status.is_success() {
        Ok(answer.raw)
    } else {
        ok(answer).map(|_| String::new())
    }
}

/// The topic's plans and tenants (the configuration's own plans are not
/// repeated), in `format`: importing it again changes nothing, and a
/// file-source configuration can hold the TOML (moving a fleet back off the
/// topic).
pub async fn export(
    config_path: &Path,
    format: Format,
    out: &mut dyn std::io::Write,
) -> Result<(), Error> {
    let loaded = Config::load(config_path)?;
    let w = Standalone::connect(&loaded.config, "export")
        .await
        .map_err(Error::Limits)?;
    let (plans, tenants) = w.table().export();
    let tables = Tables { plans, tenants };
    let io = |e: std::io::Error| Error::Limits(format!("cannot write the export: {e}"));
    match format {
        Format::Toml => {
            let text = toml::to_string(&tables)
                .map_err(|e| Error::Limits(format!("cannot write the tables as TOML: {e}")))?;
            out.write_all(text.as_bytes()).map_err(io)?;
        }
        Format::Jsonl => {
            let mut buf = std::io::BufWriter::new(out);
            for line in tables.to_jsonl() {
                buf.write_all(line.as_bytes()).map_err(io)?;
                buf.write_all(b"\n").map_err(io)?;
            }
            buf.flush().map_err(io)?;
        }
    }
    Ok(())
}

/// Deletes one tenant or plan straight on the topic (a plan only once no
/// tenant uses it).
pub async fn delete(
    config_path: &Path,
    tenant: Option<String>,
    plan: Option<String>,
    writer: &str,
) -> Result<String, Error> {
    let loaded = Config::load(config_path)?;
    let subject = match (tenant, plan) {
        (Some(t), _) => Subject::Tenant(t),
        (None, Some(p)) => Subject::Plan(p),
        (None, None) => return Err(Error::Limits("name a --tenant or a --plan".into())),
    };
    let file_defines = matches!(&subject, Subject::Plan(p) if loaded.config.plans.contains_key(p));
    let mut w = Standalone::connect(&loaded.config, writer)
        .await
        .map_err(Error::Limits)?;
    let written = w
        .writer
        .write(None, |table| {
            let exists = match &subject {
                Subject::Tenant(t) => table.tenant_view(t).is_some(),
                Subject::Plan(p) => matches!(table.topic_plan(p), Some((_, Some(_)))),
            };
            if !exists {
                return Err(format!("{} is not on the topic", subject.key()));
            }
            if let Subject::Plan(p) = &subject {
                if !file_defines {
                    check_plan_unused(table, p).map_err(|e| e.detail().to_owned())?;
                }
            }
            Ok(vec![(subject.clone(), Body::Deleted)])
        })
        .await
        .map_err(|e| write_error(e, Error::Limits))?;
    Ok(format!(
        "deleted {} at version {}",
        subject.key(),
        written.records[0].version
    ))
}
