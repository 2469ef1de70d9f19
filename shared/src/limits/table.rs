//! The applied limits of one process: every registered tenant's policy,
//! kept compact and read on every decision.
//!
//! Why this shape:
//! - A tenant with nothing but a plan (most of them) holds a pointer to its
//!   plan's one shared `Policy`: an entry is the id, a version and that
//!   pointer, so a million tenants cost about as much as their ids.
//!   Tenants with overrides hold a policy of their own, and their record
//!   is kept aside so a change of their plan can resolve them again.
//! - Lookups read-lock one of 64 shards; a record write-locks one shard for
//!   a map insert. Resolving a record (validation, the policy) happens
//!   before any lock.
//! - A plan change swaps the plan's policy and walks the shards once to
//!   move its tenants onto the new pointer (about 20 ns a tenant): plans
//!   change rarely, tenants often.
//! - Records apply in the topic's order (one partition), each only if its
//!   version is above the subject's current one, so replaying the topic or
//!   the region's copy over a table that has seen newer records is a no-op.
//!   `applied_version` is then a watermark: every record up to it applied.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use thiserror::Error;

use crate::config::{
    resolve_plan, resolve_tenant, ConfigError, Grant, PlanConfig, Policy, TenantConfig,
};
use crate::limits::record::{Body, LimitsRecord, Subject};

const SHARDS: usize = 64;

/// One tenant's applied state.
#[derive(Debug, Clone)]
struct Entry {
    version: u64,
    policy: Arc<Policy>,
}

/// One of the tenants' shards.
type Shard = RwLock<HashMap<Box<str>, Entry>>;

/// Why a record was not applied. The previous version stays.
#[derive(Debug, Error)]
pub enum ApplyError {
    /// Its tiers do not validate as a file's would (the error names the
    /// key, e.g. `tenants.acme.node.limit`).
    #[error("{0}")]
    Invalid(#[from] ConfigError),
}

impl ApplyError {
    /// The metric label (`tierlimit_limits_records_total{outcome}`).
    pub fn reason(&self) -> &'static str {
        match self {
            ApplyError::Invalid(_) => "invalid",
        }
    }
}

/// What applying a record did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The subject changed: for a tenant, its policy; for a plan, every
    /// tenant of it.
    Changed(Subject),
    /// A tenant whose plan no process has applied yet: kept, and treated as
    /// an unknown tenant until the plan arrives.
    Pending(String),
    /// Not newer than what the subject already has: ignored.
    Stale,
}

/// Writers' state (under one mutex; readers never take it).
#[derive(Default)]
struct Catalog {
    /// The topic's plans: version and, unless deleted, the table.
    topic_plans: HashMap<String, (u64, Option<PlanConfig>)>,
    /// The file's plans (`[plans]`), resolved.
    file_plans: BTreeMap<String, Arc<Policy>>,
    /// Tenants with overrides, for resolving them again on a plan change.
    custom: HashMap<Box<str>, (u64, TenantConfig)>,
    /// Tenants whose plan is unknown, by plan.
    pending: HashMap<Box<str>, (u64, TenantConfig)>,
    /// Deleted tenants' versions (so an older record replayed later does
    /// not bring one back).
    deleted: HashMap<Box<str>, u64>,
}

/// The applied tenants and plans of one process.
pub struct LimitsTable {
    shards: Box<[Shard]>,
    /// Effective plans by name: the topic's, else the file's.
    plans: RwLock<HashMap<String, Arc<Policy>>>,
    catalog: Mutex<Catalog>,
    applied: AtomicU64,
    tenants: AtomicU64,
    ready: AtomicBool,
    ready_notify: tokio::sync::Notify,
    /// Per partition, the offset after the last record the follower
    /// handled (every record before it applied or refused): a writer that
    /// must have seen everything committed before it writes waits for this
    /// to pass the topic's last record (`write`).
    positions: Mutex<HashMap<i32, i64>>,
    /// Notified on every record applied and every end reached.
    moved: tokio::sync::Notify,
    /// Tenants with grants (`config::Grant`), few: a lookup reads this
    /// map only while it is not empty.
    granted: RwLock<HashMap<Box<str>, Granted>>,
    granted_len: std::sync::atomic::AtomicUsize,
}

/// A tenant's grants and the policy they give, computed for the base
/// policy and the time it was computed at.
#[derive(Debug, Clone)]
struct Granted {
    grants: Vec<Grant>,
    /// What it was computed from (the tenant's policy then), and the
    /// result (`None`: no grant active), valid until `until_ms`.
    base: Option<Arc<Policy>>,
    policy: Option<Arc<Policy>>,
    until_ms: u64,
}

/// A tenant as its latest applied record says it, for reading back.
#[derive(Debug, Clone)]
pub struct TenantView {
    pub id: String,
    pub version: u64,
    pub config: TenantConfig,
    /// Its plan is not defined anywhere yet: treated as an unknown tenant.
    pub pending: bool,
}

/// Which tenants a listing returns.
#[derive(Debug, Clone, Default)]
pub struct TenantFilter {
    /// Only tenants on this plan.
    pub plan: Option<String>,
    /// Only tenants with (true) or without (false) overrides.
    pub overrides: Option<bool>,
}

impl TenantFilter {
    fn admits(&self, t: &TenantConfig) -> bool {
        self.plan.as_ref().is_none_or(|p| *p == t.plan)
            && self.overrides.is_none_or(|o| o != t.is_plain())
    }
}

impl std::fmt::Debug for LimitsTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitsTable")
            .field("tenants", &self.len())
            .field("applied_version", &self.applied_version())
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl Default for LimitsTable {
    fn default() -> Self {
        LimitsTable::new()
    }
}

fn shard_of(tenant: &str) -> usize {
    (crate::messages::partition_of(tenant, SHARDS as i32)) as usize
}

impl LimitsTable {
    pub fn new() -> LimitsTable {
        LimitsTable {
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
            plans: RwLock::new(HashMap::new()),
            catalog: Mutex::new(Catalog::default()),
            applied: AtomicU64::new(0),
            tenants: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            ready_notify: tokio::sync::Notify::new(),
            positions: Mutex::new(HashMap::new()),
            moved: tokio::sync::Notify::new(),
            granted: RwLock::new(HashMap::new()),
            granted_len: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// The policy a tenant's grants give at `now_ms` on top of `base` (its
    /// registered policy): `base` itself when none is active.
    fn granted_at(&self, tenant: &str, base: Arc<Policy>, now_ms: u64) -> Arc<Policy> {
        {
            let map = self.granted.read().unwrap_or_else(|e| e.into_inner());
            let Some(g) = map.get(tenant) else {
                return base;
            };
            if now_ms < g.until_ms && g.base.as_ref().is_some_and(|b| Arc::ptr_eq(b, &base)) {
                return g.policy.clone().unwrap_or(base);
            }
        }
        // Computed again: the first lookup, the base changed (a plan
        // change), or a grant started or ended.
        let mut map = self.granted.write().unwrap_or_else(|e| e.into_inner());
        let Some(g) = map.get_mut(tenant) else {
            return base;
        };
        let (policy, until) = match base.with_grants(&g.grants, now_ms) {
            Some((p, until)) => (Some(Arc::new(p)), until),
            None => {
                // None active: until the next one starts, if any.
                let next = g
                    .grants
                    .iter()
                    .map(|x| x.period.at(x.period_start_ms).start_ms().max(0) as u64)
                    .filter(|s| *s > now_ms)
                    .min()
                    .unwrap_or(u64::MAX);
                (None, next)
            }
        };
        g.base = Some(Arc::clone(&base));
        g.policy = policy.clone();
        g.until_ms = until;
        policy.unwrap_or(base)
    }

    /// Records a tenant's grants (none: forgets them).
    fn set_grants(&self, id: &str, grants: &[Grant]) {
        let mut map = self.granted.write().unwrap_or_else(|e| e.into_inner());
        if grants.is_empty() {
            map.remove(id);
        } else {
            map.insert(
                id.into(),
                Granted {
                    grants: grants.to_vec(),
                    base: None,
                    policy: None,
                    until_ms: 0,
                },
            );
        }
        self.granted_len.store(map.len(), Ordering::Release);
    }

    /// [`LimitsTable::tenant`] at `now_ms` (grants are time-bound).
    pub fn tenant_at(&self, tenant: &str, now_ms: u64) -> Option<Arc<Policy>> {
        let base = self.shards[shard_of(tenant)]
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(tenant)
            .map(|e| Arc::clone(&e.policy))?;
        if self.granted_len.load(Ordering::Acquire) == 0 {
            return Some(base);
        }
        Some(self.granted_at(tenant, base, now_ms))
    }

    /// The follower handled every record of `partition` before `next`.
    pub fn consumed(&self, partition: i32, next: i64) {
        self.positions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(partition, next);
        self.moved.notify_waiters();
    }

    /// The offset after the last record of `partition` the follower
    /// handled.
    pub fn position(&self, partition: i32) -> Option<i64> {
        self.positions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&partition)
            .copied()
    }

    /// Waits until `done(self)` holds, at most `timeout`; true if it does.
    pub async fn wait_until(&self, timeout: Duration, done: impl Fn(&LimitsTable) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let moved = self.moved.notified();
            if done(self) {
                return true;
            }
            if tokio::time::timeout_at(deadline, moved).await.is_err() {
                return done(self);
            }
        }
    }

    /// The current version of a subject: its applied, pending or deleting
    /// record's (0: no record).
    pub fn version_of(&self, subject: &Subject) -> u64 {
        let cat = self.catalog();
        match subject {
            Subject::Tenant(id) => self.current_version(&cat, id),
            Subject::Plan(name) => cat.topic_plans.get(name).map_or(0, |(v, _)| *v),
        }
    }

    /// A tenant's latest record (registered or pending; `None`: none, or
    /// deleted).
    pub fn tenant_view(&self, id: &str) -> Option<TenantView> {
        let cat = self.catalog();
        if let Some((version, config)) = cat.pending.get(id) {
            return Some(TenantView {
                id: id.to_owned(),
                version: *version,
                config: config.clone(),
                pending: true,
            });
        }
        if let Some((version, config)) = cat.custom.get(id) {
            return Some(TenantView {
                id: id.to_owned(),
                version: *version,
                config: config.clone(),
                pending: false,
            });
        }
        let shard = self.shards[shard_of(id)]
            .read()
            .unwrap_or_else(|e| e.into_inner());
        shard.get(id).map(|e| TenantView {
            id: id.to_owned(),
            version: e.version,
            config: plain(&e.policy.plan),
            pending: false,
        })
    }

    /// A plan the topic defines: its version and table (`None` for the
    /// table: deleted on the topic; `None` altogether: never on the topic).
    pub fn topic_plan(&self, name: &str) -> Option<(u64, Option<PlanConfig>)> {
        self.catalog().topic_plans.get(name).cloned()
    }

    /// The plans the configuration file defines (their names).
    pub fn file_plan_names(&self) -> Vec<String> {
        self.catalog().file_plans.keys().cloned().collect()
    }

    /// Tenants (registered or pending) on plan `name`.
    pub fn tenants_of_plan(&self, name: &str) -> u64 {
        let cat = self.catalog();
        let mut n = cat.pending.values().filter(|(_, t)| t.plan == name).count() as u64;
        n += cat.custom.values().filter(|(_, t)| t.plan == name).count() as u64;
        let plan = self.plan(name);
        for shard in self.shards.iter() {
            let shard = shard.read().unwrap_or_else(|e| e.into_inner());
            n += shard
                .values()
                .filter(|e| plan.as_ref().is_some_and(|p| Arc::ptr_eq(p, &e.policy)))
                .count() as u64;
        }
        n
    }

    /// Up to `limit` tenants whose id sorts after `after`, in id order,
    /// that `filter` admits. One pass over the table, keeping only the
    /// page (a heap of `limit` ids): O(tenants × log limit) a page, no
    /// copy of the table.
    pub fn list_tenants(
        &self,
        after: Option<&str>,
        limit: usize,
        filter: &TenantFilter,
    ) -> Vec<TenantView> {
        use std::collections::BinaryHeap;
        let mut page: BinaryHeap<Box<str>> = BinaryHeap::new();
        let mut offer = |id: &str| {
            if after.is_some_and(|a| id <= a) || limit == 0 {
                return;
            }
            if page.len() < limit {
                page.push(id.into());
            } else if page.peek().is_some_and(|top| id < &**top) {
                page.pop();
                page.push(id.into());
            }
        };
        {
            // The catalog, then the shards: the order `apply` locks in.
            let cat = self.catalog();
            for (id, (_, t)) in cat.custom.iter().chain(cat.pending.iter()) {
                if filter.admits(t) {
                    offer(id);
                }
            }
            if filter.overrides != Some(true) {
                for shard in self.shards.iter() {
                    let shard = shard.read().unwrap_or_else(|e| e.into_inner());
                    for (id, e) in shard.iter() {
                        // Tenants with overrides were offered above.
                        if !cat.custom.contains_key(id)
                            && filter.plan.as_ref().is_none_or(|p| *p == e.policy.plan)
                        {
                            offer(id);
                        }
                    }
                }
            }
        }
        let mut ids = page.into_vec();
        ids.sort();
        ids.iter().filter_map(|id| self.tenant_view(id)).collect()
    }

    /// The policy of a registered tenant (not pending, not deleted), its
    /// grants active now included.
    pub fn tenant(&self, tenant: &str) -> Option<Arc<Policy>> {
        if self.granted_len.load(Ordering::Acquire) == 0 {
            return self.shards[shard_of(tenant)]
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(tenant)
                .map(|e| Arc::clone(&e.policy));
        }
        self.tenant_at(tenant, crate::messages::now_ms())
    }

    /// The applied version of a tenant's record (0: none).
    pub fn tenant_version(&self, tenant: &str) -> u64 {
        self.shards[shard_of(tenant)]
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(tenant)
            .map_or(0, |e| e.version)
    }

    pub fn contains(&self, tenant: &str) -> bool {
        self.shards[shard_of(tenant)]
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(tenant)
    }

    /// The effective plan `name`: the topic's, else the file's.
    pub fn plan(&self, name: &str) -> Option<Arc<Policy>> {
        self.plans
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// Every record up to this version is applied (0: none).
    pub fn applied_version(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Registered tenants (resolved; pending ones excluded).
    pub fn len(&self) -> u64 {
        self.tenants.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tenants waiting for their plan.
    pub fn pending(&self) -> u64 {
        self.catalog().pending.len() as u64
    }

    /// Ready: the topic (or the region's copy of it) was read to its end
    /// once, so every registered tenant is known.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn mark_ready(&self) {
        if !self.ready.swap(true, Ordering::AcqRel) {
            self.ready_notify.notify_waiters();
        }
    }

    /// Waits until ready, at most `timeout`; true if ready.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let notified = self.ready_notify.notified();
        if self.is_ready() {
            return true;
        }
        let _ = tokio::time::timeout(timeout, notified).await;
        self.is_ready()
    }

    fn catalog(&self) -> std::sync::MutexGuard<'_, Catalog> {
        self.catalog.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The file's plans (at start and after every reload): tenants of a
    /// plan whose file definition changed (and that the topic does not
    /// define) move onto the new one.
    pub fn set_file_plans(&self, file: &BTreeMap<String, Arc<Policy>>) {
        let mut cat = self.catalog();
        let names: Vec<String> = cat.file_plans.keys().chain(file.keys()).cloned().collect();
        cat.file_plans = file.clone();
        for name in names {
            self.refresh_plan(&mut cat, &name);
        }
    }

    /// What the topic defines, as a configuration file's tables: its plans
    /// (not the file's) and every tenant, registered or pending, as its
    /// record said it (`plan = …` alone for a tenant without overrides).
    /// Importing it again writes the same limits (`aggregator limits
    /// export`), and a file-source configuration can hold it (moving a
    /// fleet back off the topic).
    pub fn export(&self) -> (BTreeMap<String, PlanConfig>, BTreeMap<String, TenantConfig>) {
        let cat = self.catalog();
        let plans = cat
            .topic_plans
            .iter()
            .filter_map(|(name, (_, p))| Some((name.clone(), p.clone()?)))
            .collect();
        let mut tenants: BTreeMap<String, TenantConfig> = BTreeMap::new();
        for shard in self.shards.iter() {
            let shard = shard.read().unwrap_or_else(|e| e.into_inner());
            for (id, e) in shard.iter() {
                tenants.insert(id.to_string(), plain(&e.policy.plan));
            }
        }
        for (id, (_, t)) in cat.custom.iter().chain(cat.pending.iter()) {
            tenants.insert(id.to_string(), t.clone());
        }
        (plans, tenants)
    }

    /// Applies one record, or says why not (the previous version stays).
    pub fn apply(&self, record: &LimitsRecord) -> Result<Applied, ApplyError> {
        let mut cat = self.catalog();
        let applied = match (&record.subject, &record.body) {
            (Subject::Tenant(id), body) => self.apply_tenant(&mut cat, id, record.version, body)?,
            (Subject::Plan(name), body) => {
                let current = cat.topic_plans.get(name).map_or(0, |(v, _)| *v);
                if record.version <= current {
                    Applied::Stale
                } else {
                    let config = match body {
                        Body::Plan(p) => {
                            resolve_plan(name, p)?;
                            Some(p.clone())
                        }
                        _ => None,
                    };
                    cat.topic_plans
                        .insert(name.clone(), (record.version, config));
                    self.refresh_plan(&mut cat, name);
                    Applied::Changed(record.subject.clone())
                }
            }
        };
        self.applied.fetch_max(record.version, Ordering::AcqRel);
        drop(cat);
        self.moved.notify_waiters();
        Ok(applied)
    }

    fn current_version(&self, cat: &Catalog, id: &str) -> u64 {
        let resolved = self.tenant_version(id);
        let pending = cat.pending.get(id).map_or(0, |(v, _)| *v);
        let deleted = cat.deleted.get(id).copied().unwrap_or(0);
        resolved.max(pending).max(deleted)
    }

    fn apply_tenant(
        &self,
        cat: &mut Catalog,
        id: &str,
        version: u64,
        body: &Body,
    ) -> Result<Applied, ApplyError> {
        if version <= self.current_version(cat, id) {
            return Ok(Applied::Stale);
        }
        let t = match body {
            Body::Tenant(t) => t,
            _ => {
                self.remove(cat, id);
                cat.deleted.insert(id.into(), version);
                return Ok(Applied::Changed(Subject::Tenant(id.to_owned())));
            }
        };
        let plan = self.plan(&t.plan);
        let Some(plan) = plan else {
            self.remove(cat, id);
            cat.pending.insert(id.into(), (version, t.clone()));
            return Ok(Applied::Pending(id.to_owned()));
        };
        let policy = if t.is_plain() {
            plan
        } else {
            Arc::new(resolve_tenant(&format!("tenants.{id}"), t, &plan)?)
        };
        self.remove(cat, id);
        if !t.is_plain() {
            cat.custom.insert(id.into(), (version, t.clone()));
        }
        self.insert(id, Entry { version, policy });
        self.set_grants(id, &t.grants);
        Ok(Applied::Changed(Subject::Tenant(id.to_owned())))
    }

    fn insert(&self, id: &str, entry: Entry) {
        let fresh = self.shards[shard_of(id)]
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.into(), entry)
            .is_none();
        if fresh {
            self.tenants.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets a tenant everywhere (resolved, custom, pending, deleted).
    fn remove(&self, cat: &mut Catalog, id: &str) {
        let gone = self.shards[shard_of(id)]
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
            .is_some();
        if gone {
            self.tenants.fetch_sub(1, Ordering::Relaxed);
        }
        cat.custom.remove(id);
        cat.pending.remove(id);
        cat.deleted.remove(id);
        if self.granted_len.load(Ordering::Acquire) > 0 {
            self.set_grants(id, &[]);
        }
    }

    /// Recomputes plan `name`'s effective policy and moves its tenants.
    fn refresh_plan(&self, cat: &mut Catalog, name: &str) {
        let effective = match cat.topic_plans.get(name) {
            Some((_, Some(p))) => resolve_plan(name, p).ok().map(Arc::new),
            _ => cat.file_plans.get(name).cloned(),
        };
        let old = {
            let mut plans = self.plans.write().unwrap_or_else(|e| e.into_inner());
            match &effective {
                Some(p) => plans.insert(name.to_owned(), Arc::clone(p)),
                None => plans.remove(name),
            }
        };
        if let (Some(old), Some(new)) = (&old, &effective) {
            if old == new {
                // Same limits (a reload that left it alone): nothing moves.
                let mut plans = self.plans.write().unwrap_or_else(|e| e.into_inner());
                plans.insert(name.to_owned(), Arc::clone(old));
                return;
            }
        }
        // Plain tenants of the old plan: onto the new pointer, or pending.
        let mut orphaned = Vec::new();
        if let Some(old) = &old {
            for shard in self.shards.iter() {
                let mut shard = shard.write().unwrap_or_else(|e| e.into_inner());
                shard.retain(|id, e| {
                    if !Arc::ptr_eq(&e.policy, old) {
                        return true;
                    }
                    match &effective {
                        Some(new) => {
                            e.policy = Arc::clone(new);
                            true
                        }
                        None => {
                            orphaned.push((id.clone(), e.version));
                            false
                        }
                    }
                });
            }
        }
        self.tenants
            .fetch_sub(orphaned.len() as u64, Ordering::Relaxed);
        for (id, version) in orphaned {
            cat.pending.insert(id, (version, plain(name)));
        }
        // Tenants with overrides of this plan, and pending ones now
        // resolvable: resolved again (or made pending).
        let custom: Vec<(Box<str>, (u64, TenantConfig))> = cat
            .custom
            .iter()
            .filter(|(_, (_, t))| t.plan == name)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let waiting: Vec<(Box<str>, (u64, TenantConfig))> = cat
            .pending
            .iter()
            .filter(|(_, (_, t))| t.plan == name)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (id, (version, t)) in custom.into_iter().chain(waiting) {
            let grants = t.grants.clone();
            self.remove(cat, &id);
            let resolved = match &effective {
                Some(plan) if t.is_plain() => Some(Arc::clone(plan)),
                Some(plan) => resolve_tenant(&format!("tenants.{id}"), &t, plan)
                    .ok()
                    .map(Arc::new),
                None => None,
            };
            match resolved {
                Some(policy) => {
                    if !t.is_plain() {
                        cat.custom.insert(id.clone(), (version, t));
                    }
                    self.insert(&id, Entry { version, policy });
                    self.set_grants(&id, &grants);
                }
                None => {
                    cat.pending.insert(id, (version, t));
                }
            }
        }
    }
}

/// A tenant of `plan` without overrides.
fn plain(plan: &str) -> TenantConfig {
    TenantConfig {
        plan: plan.to_owned(),
        node: None,
        region: None,
        global: None,
        on_store_error: None,
        time_zone: None,
        grants: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{GlobalLimitConfig, LimitConfig, LimitOverride};

    fn plan(limit: u64) -> PlanConfig {
        PlanConfig {
            time_zone: Default::default(),
            node: None,
            region: Some(LimitConfig {
                limit,
                window: Duration::from_secs(60),
                algorithm: crate::config::Algorithm::FixedWindow,
                burst: None,
            }),
            global: Some(GlobalLimitConfig::daily(limit * 10)),
            on_store_error: Default::default(),
            key_scoped: false,
            shadow_mode: false,
            lease_max: None,
        }
    }

    fn tenant(plan: &str) -> TenantConfig {
        TenantConfig {
            time_zone: Default::default(),
            plan: plan.into(),
            node: None,
            region: None,
            global: None,
            on_store_error: None,
            grants: Vec::new(),
        }
    }

    fn rec(subject: Subject, version: u64, body: Body) -> LimitsRecord {
        LimitsRecord {
            subject,
            version,
            writer: "t".into(),
            ts_ms: 0,
            body,
        }
    }

    fn t(id: &str) -> Subject {
        Subject::Tenant(id.into())
    }

    fn p(name: &str) -> Subject {
        Subject::Plan(name.into())
    }

    fn region_limit(table: &LimitsTable, id: &str) -> Option<u64> {
        table
            .tenant(id)
            .and_then(|p| p.region.as_ref().map(|l| l.limit))
    }

    #[test]
    fn a_grant_raises_its_period_limit_until_the_period_ends() {
        use crate::config::Grant;
        use crate::period::PeriodKind;
        let table = LimitsTable::new();
        table
            .apply(&rec(p("pro"), 1, Body::Plan(plan(100))))
            .unwrap();
        // Noon of day 10; the plan's day limit is 1000.
        let noon = 10 * 86_400_000 + 43_200_000;
        let mut t = tenant("pro");
        t.grants = vec![Grant {
            period: PeriodKind::Day,
            period_start_ms: PeriodKind::Day.at(noon).start_ms() as u64,
            extra: 500,
            reason: Some("support case".into()),
        }];
        table
            .apply(&rec(p("pro"), 1, Body::Plan(plan(100))))
            .unwrap();
        table
            .apply(&rec(self::t("acme"), 2, Body::Tenant(t)))
            .unwrap();
        table
            .apply(&rec(self::t("other"), 3, Body::Tenant(tenant("pro"))))
            .unwrap();
        let day_limit = |id: &str, at: u64| table.tenant_at(id, at).unwrap().global;
        assert_eq!(day_limit("acme", noon), Some(1500));
        assert_eq!(
            day_limit("acme", noon + 43_199_999),
            Some(1500),
            "the last ms of the day"
        );
        assert_eq!(
            day_limit("acme", noon + 43_200_000),
            Some(1000),
            "the next day: expired"
        );
        assert_eq!(
            day_limit("other", noon),
            Some(1000),
            "only the granted tenant"
        );
        // The plan changes under it: the grant applies to the new limit.
        let mut bigger = plan(100);
        bigger.global = Some(crate::config::GlobalLimitConfig::daily(2000));
        table.apply(&rec(p("pro"), 4, Body::Plan(bigger))).unwrap();
        assert_eq!(day_limit("acme", noon), Some(2500));
        // Replaced by a record without grants: gone.
        table
            .apply(&rec(self::t("acme"), 5, Body::Tenant(tenant("pro"))))
            .unwrap();
        assert_eq!(day_limit("acme", noon), Some(2000));
        // A grant for a tier the tenant does not have changes nothing.
        let mut hourly = tenant("pro");
        hourly.grants = vec![Grant {
            period: PeriodKind::Hour,
            period_start_ms: PeriodKind::Hour.at(noon).start_ms() as u64,
            extra: 9,
            reason: None,
        }];
        table
            .apply(&rec(self::t("acme"), 6, Body::Tenant(hourly)))
            .unwrap();
        assert_eq!(
            table.tenant_at("acme", noon).unwrap().global_periods,
            vec![]
        );
        assert_eq!(day_limit("acme", noon), Some(2000));
    }

    #[test]
    fn the_export_applied_again_gives_the_same_limits() {
        let table = LimitsTable::new();
        table
            .apply(&rec(p("pro"), 1, Body::Plan(plan(100))))
            .unwrap();
        table
            .apply(&rec(t("acme"), 2, Body::Tenant(tenant("pro"))))
            .unwrap();
        let mut custom = tenant("pro");
        custom.region = Some(LimitOverride {
            limit: Some(7),
            ..Default::default()
        });
        table
            .apply(&rec(t("globex"), 3, Body::Tenant(custom)))
            .unwrap();
        table
            .apply(&rec(t("waits"), 4, Body::Tenant(tenant("gold"))))
            .unwrap();
        let (plans, tenants) = table.export();
        assert_eq!(plans.keys().collect::<Vec<_>>(), ["pro"]);
        assert_eq!(
            tenants.keys().collect::<Vec<_>>(),
            ["acme", "globex", "waits"]
        );
        assert!(tenants["acme"].is_plain());
        assert_eq!(tenants["waits"].plan, "gold", "a pending tenant is kept");

        let again = LimitsTable::new();
        let mut v = 0;
        for (name, pc) in plans {
            v += 1;
            again.apply(&rec(p(&name), v, Body::Plan(pc))).unwrap();
        }
        for (id, tc) in tenants {
            v += 1;
            again.apply(&rec(t(&id), v, Body::Tenant(tc))).unwrap();
        }
        for id in ["acme", "globex"] {
            assert_eq!(again.tenant(id), table.tenant(id), "{id}");
        }
        assert_eq!(region_limit(&again, "globex"), Some(7));
        assert_eq!(again.pending(), 1);
    }

    #[test]
    fn tenants_follow_their_plan_and_versions_only_grow() {
        let table = LimitsTable::new();
        table
            .apply(&rec(p("pro"), 1, Body::Plan(plan(100))))
            .unwrap();
        table
            .apply(&rec(t("acme"), 2, Body::Tenant(tenant("pro"))))
            .unwrap();
        assert_eq!(region_limit(&table, "acme"), Some(100));
        // Plain tenants share the plan's policy.
        assert!(Arc::ptr_eq(
            &table.tenant("acme").unwrap(),
            &table.plan("pro").unwrap()
        ));
        // A plan change moves its tenants at once.
        table
            .apply(&rec(p("pro"), 3, Body::Plan(plan(50))))
            .unwrap();
        assert_eq!(region_limit(&table, "acme"), Some(50));
        // An older record replayed is ignored.
        assert_eq!(
            table
                .apply(&rec(p("pro"), 2, Body::Plan(plan(999))))
                .unwrap(),
            Applied::Stale
        );
        assert_eq!(region_limit(&table, "acme"), Some(50));
        assert_eq!(table.applied_version(), 3);
        // Overrides resolve against the plan, and again when it changes.
        let mut custom = tenant("pro");
        custom.region = Some(LimitOverride {
            limit: Some(7),
            ..Default::default()
        });
        custom.global = Some(GlobalLimitConfig {
            month: Some(1000),
            ..Default::default()
        });
        table
            .apply(&rec(t("acme"), 4, Body::Tenant(custom)))
            .unwrap();
        assert_eq!(region_limit(&table, "acme"), Some(7));
        table
            .apply(&rec(p("pro"), 5, Body::Plan(plan(60))))
            .unwrap();
        let acme = table.tenant("acme").unwrap();
        assert_eq!(acme.region.as_ref().unwrap().limit, 7);
        assert_eq!(acme.global, Some(600), "the day's tier follows the plan");
        // Deleted: gone, and an older record does not bring it back.
        table.apply(&rec(t("acme"), 6, Body::Deleted)).unwrap();
        assert!(table.tenant("acme").is_none());
        assert_eq!(
            table
                .apply(&rec(t("acme"), 4, Body::Tenant(tenant("pro"))))
                .unwrap(),
            Applied::Stale
        );
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn a_tenant_waits_for_its_plan_and_falls_back_when_it_goes() {
        let table = LimitsTable::new();
        assert_eq!(
            table
                .apply(&rec(t("acme"), 1, Body::Tenant(tenant("gold"))))
                .unwrap(),
            Applied::Pending("acme".into())
        );
        assert!(table.tenant("acme").is_none());
        assert_eq!(table.pending(), 1);
        table
            .apply(&rec(p("gold"), 2, Body::Plan(plan(10))))
            .unwrap();
        assert_eq!(region_limit(&table, "acme"), Some(10));
        assert_eq!(table.pending(), 0);
        // The file defines gold too: the topic's wins while it has one.
        let file: BTreeMap<String, Arc<Policy>> = [(
            "gold".to_string(),
            Arc::new(resolve_plan("gold", &plan(20)).unwrap()),
        )]
        .into();
        table.set_file_plans(&file);
        assert_eq!(region_limit(&table, "acme"), Some(10));
        // Deleted on the topic: the file's plan takes over.
        table.apply(&rec(p("gold"), 3, Body::Deleted)).unwrap();
        assert_eq!(region_limit(&table, "acme"), Some(20));
        // Gone from both: pending again.
        table.set_file_plans(&BTreeMap::new());
        assert!(table.tenant("acme").is_none());
        assert_eq!(table.pending(), 1);
    }

    #[test]
    fn an_invalid_record_leaves_the_previous_version() {
        let table = LimitsTable::new();
        table
            .apply(&rec(p("pro"), 1, Body::Plan(plan(100))))
            .unwrap();
        table
            .apply(&rec(t("acme"), 2, Body::Tenant(tenant("pro"))))
            .unwrap();
        let mut bad = tenant("pro");
        // A node tier override without a limit, where the plan has none.
        bad.node = Some(LimitOverride::default());
        let err = table
            .apply(&rec(t("acme"), 3, Body::Tenant(bad)))
            .unwrap_err();
        assert!(err.to_string().contains("tenants.acme.node"), "{err}");
        assert_eq!(region_limit(&table, "acme"), Some(100));
        let mut bad_plan = plan(1);
        bad_plan.region.as_mut().unwrap().limit = 0;
        assert!(table
            .apply(&rec(p("pro"), 4, Body::Plan(bad_plan)))
            .is_err());
        assert_eq!(region_limit(&table, "acme"), Some(100));
    }
}
