//! Which counters a configuration reload changes: those whose tenant's
//! global limits (any period kind) differ between the configuration the
//! broadcasts were made under and the one now in force.
//!
//! Since wire v3 the deltas carry the limit each node enforced, and a
//! counter is judged under that ([`crate::merge::Carried`]): the
//! aggregator's configuration is only the fallback for counters no delta
//! carried a limit for (v2 writers during a rolling upgrade). A reload still
//! marks the changed tenants' current counters; those judged under a carried
//! limit go out unchanged, which costs one record each, only on a reload.
//!
//! A broadcast carries the tenant's limit and over-limit flag, so a reload
//! must re-broadcast exactly the counters whose limit changed, and nothing
//! else: re-broadcasting all of the current periods at every SIGHUP made a reload cost
//! one record per active tenant on every node. The diff is computed from the
//! two configurations, outside the state lock, in O(configured tenants):
//! each named tenant's resolved policy (plans included) is compared. Only a
//! change of the unknown-tenant policy's limit concerns tenants the
//! configuration does not name, and then the current counters of every such
//! tenant are marked (one pass, on that reload only). A reload that
//! switches the broadcast signing key marks all the current periods, so that every
//! counter is on the topic signed with the new key before the old public
//! key is retired (README, "Signed deltas and broadcasts").

use std::sync::Arc;

use tierlimit_shared::config::Loaded;
use tierlimit_shared::period::PeriodKind;

use crate::merge::{Merged, TenantPeriod};
use crate::state::configured_limit;

/// The tenants whose global limit a reload changed.
#[derive(Debug)]
pub struct LimitChanges {
    /// Named (in either configuration) tenants whose limit changed.
    tenants: Vec<String>,
    /// The unknown-tenant policy's limit changed: every tenant `now` does
    /// not name is concerned.
    unknown: bool,
    /// The broadcast key changed: every counter is signed again.
    all: bool,
    now: Arc<Loaded>,
}

/// Every kind's configured limit of `tenant`.
fn limits(c: &Loaded, tenant: &str) -> [Option<u64>; 4] {
    PeriodKind::ALL.map(|k| configured_limit(c, tenant, k))
}

impl LimitChanges {
    /// What changed from `before` to `now`.
    pub fn between(before: &Loaded, now: Arc<Loaded>) -> LimitChanges {
        let mut tenants: Vec<String> = before
            .policies()
            .chain(now.policies())
            .map(|(t, _)| t)
            .filter(|t| limits(before, t) != limits(&now, t))
            .map(str::to_owned)
            .collect();
        tenants.sort();
        tenants.dedup();
        let global = |c: &Loaded| {
            c.unknown_policy()
                .map(|p| (p.global, p.global_periods.clone()))
        };
        let unknown = global(before) != global(&now);
        let key = |c: &Loaded| {
            let w = &c.config.wire;
            (w.broadcast_key.clone(), w.broadcast_private_key.clone())
        };
        let all = key(before) != key(&now);
        LimitChanges {
            tenants,
            unknown,
            all,
            now,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty() && !self.unknown && !self.all
    }

    /// Marks the concerned counters of the current period of every kind at
    /// `now_ms` dirty; returns how many.
    pub fn mark(&self, merged: &mut Merged, now_ms: u64) -> usize {
        merged
            .current(now_ms)
            .into_iter()
            .map(|period| self.mark_period(merged, period))
            .sum()
    }

    fn mark_period(&self, merged: &mut Merged, period: tierlimit_shared::period::Period) -> usize {
        if self.all {
            return merged.mark_period_dirty(period, None);
        }
        let mut marked = 0;
        for t in &self.tenants {
            if merged.mark_dirty(&TenantPeriod::new(t.as_str(), period)) {
                marked += 1;
            }
        }
        if self.unknown {
            marked += merged.mark_period_dirty_where(period, |t| self.now.is_unknown(t));
        }
        marked
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierlimit_shared::config::Config;
    use tierlimit_shared::messages::{actor, Delta};

    const BASE: &str = r#"
cluster = "test"
[kafka]
brokers = "127.0.0.1:1"
[regions.eu]
redis_url = "redis://127.0.0.1:6379"
[plans.small]
global = { limit = 100 }
[plans.big]
global = { limit = 1000 }
[tenants.a]
plan = "small"
[tenants.b]
plan = "big"
[tenants.c]
plan = "small"
[unknown_tenants]
policy = "plan"
plan = "small"
[wire]
accept_unsigned = true
"#;

    fn load(text: &str) -> Arc<Loaded> {
        Arc::new(Config::from_toml(text).expect("valid"))
    }

    /// Noon of day 10.
    const NOW: u64 = 10 * 86_400_000 + 43_200_000;

    fn merged(tenants: &[&str]) -> Merged {
        let mut m = Merged::new(2);
        for t in tenants {
            m.apply(0, &Delta::new(t, 10, actor("eu", "e"), 1, 0, 0), NOW);
        }
        m.take_dirty(false, |_| true, |_, _| true);
        m
    }

    #[test]
    fn nothing_changed_marks_nothing() {
        let c = LimitChanges::between(&load(BASE), load(BASE));
        assert!(c.is_empty());
        let mut m = merged(&["a", "b", "stranger"]);
        assert_eq!(c.mark(&mut m, NOW), 0);
        assert_eq!(m.dirty_len(), 0);
    }

    #[test]
    fn a_tenant_moved_to_another_plan_is_the_only_one_marked() {
        let now = BASE.replace(
            "[tenants.c]\nplan = \"small\"",
            "[tenants.c]\nplan = \"big\"",
        );
        let c = LimitChanges::between(&load(BASE), load(&now));
        let mut m = merged(&["a", "b", "c", "stranger"]);
        assert_eq!(c.mark(&mut m, NOW), 1);
        assert_eq!(m.dirty_len(), 1);
        // Not held on another day: nothing to mark.
        assert_eq!(c.mark(&mut m, NOW + 86_400_000), 0);
    }

    #[test]
    fn a_plan_change_marks_its_named_tenants_and_the_unknown_ones_on_it() {
        let now = BASE.replace("global = { limit = 100 }", "global = { limit = 150 }");
        let c = LimitChanges::between(&load(BASE), load(&now));
        let mut m = merged(&["a", "b", "c", "stranger"]);
        // a and c (named, on small) and stranger (unknown → small); not b.
        assert_eq!(c.mark(&mut m, NOW), 3);
    }

    #[test]
    fn a_new_broadcast_key_marks_everything() {
        let signing = |seed: u8| {
            let (private, public) =
                tierlimit_shared::wire::keys::ed25519_pair_from_seed([seed; 32]);
            BASE.replace(
                "[wire]\naccept_unsigned = true",
                &format!(
                    "[wire]\naccept_unsigned = true\nbroadcast_key = \"k\"\n\
                     broadcast_private_key = \"{private}\"\n\
                     [wire.broadcast_public_keys]\nk = \"{public}\""
                ),
            )
        };
        let same = LimitChanges::between(&load(&signing(1)), load(&signing(1)));
        assert!(same.is_empty());
        let c = LimitChanges::between(&load(&signing(1)), load(&signing(2)));
        assert!(!c.is_empty());
        let mut m = merged(&["a", "b", "stranger"]);
        assert_eq!(c.mark(&mut m, NOW), 3);
    }

    #[test]
    fn a_tenant_removed_from_the_file_falls_to_the_unknown_policy() {
        let now = BASE.replace("[tenants.b]\nplan = \"big\"\n", "");
        let c = LimitChanges::between(&load(BASE), load(&now));
        let mut m = merged(&["a", "b"]);
        assert_eq!(c.mark(&mut m, NOW), 1);
    }

    #[test]
    fn a_month_tier_change_marks_the_current_month() {
        let now = BASE.replace(
            "[plans.big]\nglobal = { limit = 1000 }",
            "[plans.big]\nglobal = { limit = 1000, month = 20000 }",
        );
        let c = LimitChanges::between(&load(BASE), load(&now));
        let mut m = merged(&["a", "b"]);
        let month = PeriodKind::Month.at(NOW);
        m.apply(0, &Delta::of("b", month, actor("eu", "e"), 1, 0, 0), NOW);
        m.take_dirty(false, |_| true, |_, _| true);
        // b's day and month counters; not a's.
        assert_eq!(c.mark(&mut m, NOW), 2);
    }
}
