//! `aggregator limits import|delete`: writing tenants and plans to the
//! limits topic from the command line (the API is the second issue of the
//! pair). Every table is checked by the same functions the configuration
//! loader and every follower use (`config::resolve_plan`,
//! `config::resolve_tenant`), before anything is written.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use tierlimit_shared::config::{resolve_plan, resolve_tenant, Config, PlanConfig, TenantConfig};
use tierlimit_shared::limits::follow::{self, Hooks};
use tierlimit_shared::limits::write::Writer;
use tierlimit_shared::limits::{Body, LimitsTable, LimitsVerifier, Subject};

use crate::Error;

/// The tables an import reads (anything else in the file is ignored, so a
/// whole configuration file can be imported).
#[derive(Debug, Deserialize)]
struct ImportFile {
    #[serde(default)]
    plans: BTreeMap<String, PlanConfig>,
    #[serde(default)]
    tenants: BTreeMap<String, TenantConfig>,
}

/// How long the command waits to read the topic to its end.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

struct Quiet;

impl Hooks for Quiet {
    fn outcome(&self, _outcome: &'static str) {}
}

/// What the topic holds now, read to its end, with the configuration's
/// plans beside it (the topic's win, as in every process): a file may
/// name a plan that only the topic defines. Works with a configuration of
/// either `limits.source` (moving a fleet onto the topic starts from a
/// file-source one).
async fn current(config: &Config) -> Result<Arc<LimitsTable>, Error> {
    LimitsVerifier::new(config)
        .map_err(|e| Error::Limits(format!("wire.limits_public_keys: {e}")))?;
    let table = Arc::new(LimitsTable::new());
    let mut file = BTreeMap::new();
    for (name, p) in &config.plans {
        file.insert(name.clone(), Arc::new(resolve_plan(name, p)?));
    }
    table.set_file_plans(&file);
    let task = tokio::spawn(follow::run(
        config.clone(),
        format!("cli-{}", std::process::id()),
        Arc::clone(&table),
        HashMap::new(),
        Arc::new(Quiet),
    ));
    let ready = table.wait_ready(READ_TIMEOUT).await;
    task.abort();
    if !ready {
        return Err(Error::Limits(format!(
            "could not read {} to its end within {READ_TIMEOUT:?} (kafka.brokers)",
            config.kafka.limits_topic
        )));
    }
    Ok(table)
}

/// The changes of `file`: plans first (a tenant's plan is applied before
/// it by every follower: one partition, one order), then tenants. A
/// tenant's plan is the file's, else the one the topic or the
/// configuration defines (`known`).
fn changes(known: &LimitsTable, file: &Path) -> Result<Vec<(Subject, Body)>, Error> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| Error::Limits(format!("cannot read {}: {e}", file.display())))?;
    let parsed: ImportFile =
        toml::from_str(&text).map_err(|e| Error::Limits(format!("{}: {e}", file.display())))?;
    let mut plans = BTreeMap::new();
    for (name, p) in &parsed.plans {
        plans.insert(name.clone(), resolve_plan(name, p)?);
    }
    let mut out: Vec<(Subject, Body)> = parsed
        .plans
        .into_iter()
        .map(|(name, p)| (Subject::Plan(name), Body::Plan(p)))
        .collect();
    for (id, t) in parsed.tenants {
        let at = format!("tenants.{id}");
        tierlimit_shared::validate::tenant(&id).map_err(|e| Error::Limits(format!("{at}: {e}")))?;
        let base = match plans.get(&t.plan) {
            Some(p) => p.clone(),
            None => match known.plan(&t.plan) {
                Some(p) => (*p).clone(),
                None => {
                    return Err(Error::Limits(format!(
                        "{at}.plan: no plan named {:?} in the file, on the topic or in the configuration",
                        t.plan
                    )))
                }
            },
        };
        resolve_tenant(&at, &t, &base)?;
        out.push((Subject::Tenant(id), Body::Tenant(t)));
    }
    Ok(out)
}

/// Publishes a file's plans and tenants; the summary names the versions.
pub async fn import(
    config_path: &Path,
    file: &Path,
    writer: &str,
    dry_run: bool,
) -> Result<String, Error> {
    let loaded = Config::load(config_path)?;
    let known = current(&loaded.config).await?;
    let changes = changes(&known, file)?;
    let (plans, tenants) = changes
        .iter()
        .partition::<Vec<_>, _>(|(s, _)| matches!(s, Subject::Plan(_)));
    if dry_run {
        return Ok(format!(
            "dry run: would write {} plans and {} tenants to {}",
            plans.len(),
            tenants.len(),
            loaded.config.kafka.limits_topic
        ));
    }
    let (plans, tenants) = (plans.len(), tenants.len());
    let mut w = Writer::connect(&loaded.config, writer)
        .await
        .map_err(Error::Limits)?;
    let written = w.publish(changes).await.map_err(Error::Limits)?;
    let first = written.first().map_or(0, |r| r.version);
    let last = written.last().map_or(0, |r| r.version);
    Ok(format!(
        "wrote {plans} plans and {tenants} tenants to {} (versions {first}..={last})",
        loaded.config.kafka.limits_topic
    ))
}

/// The topic's plans and tenants as a TOML file's `[plans]` and
/// `[tenants]`: importing it again writes the same limits, and a
/// file-source configuration can hold it (moving a fleet back off the
/// topic). The configuration's own plans are not repeated.
pub async fn export(config_path: &Path) -> Result<String, Error> {
    #[derive(serde::Serialize)]
    struct Tables {
        plans: BTreeMap<String, PlanConfig>,
        tenants: BTreeMap<String, TenantConfig>,
    }
    let loaded = Config::load(config_path)?;
    let (plans, tenants) = current(&loaded.config).await?.export();
    toml::to_string(&Tables { plans, tenants })
        .map_err(|e| Error::Limits(format!("cannot write the tables as TOML: {e}")))
}

/// Deletes one tenant or plan.
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
    let mut w = Writer::connect(&loaded.config, writer)
        .await
        .map_err(Error::Limits)?;
    let written = w
        .publish(vec![(subject.clone(), Body::Deleted)])
        .await
        .map_err(Error::Limits)?;
    Ok(format!(
        "deleted {} at version {}",
        subject.key(),
        written[0].version
    ))
}
