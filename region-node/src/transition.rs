//! What a limits change does to the windows already counting
//! (`limits.source = "topic"`, issue 32 item 4).
//!
//! A change of a tier's *limit* needs nothing here: the tier keeps its
//! state (same tier id, same fields), so a raise lets the tenant through in
//! the current window and a lowering denies at once against what the window
//! already spent. A change of a tier's *shape* does: the state of a tier
//! lives under an id that names its algorithm, in a place that depends on
//! the counting key and on the window (longer than a day: a key of its
//! own), and the fixed and sliding windows index their state in units of
//! the window. Without a transition a new shape would read nothing and
//! start fresh: a tenant that had spent its window would get a whole new
//! one at once.
//!
//! So when a record changes a tier's shape, this node *carries* the old
//! tier, with the **new limit**, beside the new one until the old state can
//! no longer hold anything charged before the change:
//!
//! | old tier                    | carried until (Redis' clock)                     |
//! |-----------------------------|--------------------------------------------------|
//! | fixed window                | the end of its current window                    |
//! | sliding window              | the end of the window after (the previous one's weight fades then) |
//! | token bucket (GCRA)         | `window × burst / limit` after the change (the most it can be ahead) |
//! | exact sliding log           | one window after the change                      |
//!
//! *Beside* (an extra tier of the same call, all-or-nothing) when the two
//! keep their state apart: another algorithm, `key_scoped` turned on or
//! off, a window moving across a day. Both are charged, so the new tier
//! counts from the change and the old one goes on holding what was spent
//! before it: no check passes that the old window, under the new limit,
//! would refuse.
//!
//! *Instead of* the new tier when both would read the same fields (a fixed
//! or sliding window whose length changed): the old window, under the new
//! limit, decides until its end, and the new window starts there. A fixed
//! window starts afresh at its end anyway; a sliding window loses the
//! previous window's weight at that point (at most one new limit, once:
//! README, "Changing limits").
//!
//! A plan's change is carried for every tenant that takes the changed tier
//! from the plan (not one whose override sets its own algorithm or window),
//! except tenants registered after it: they had no windows under the old
//! shape.
//!
//! A token bucket or a sliding log whose window changed keeps its state
//! (an arrival time, a log of timestamps): nothing is carried.
//!
//! What is carried lives in this node's memory: a node restarted during a
//! transition decides with the new shape only. Checks of a tenant in
//! transition take no lease and no reservation (a lease covers the tiers
//! of its call, and the carried tier is not the plan's), and a refund gives
//! back to the new tiers only (the carried one keeps the charge: never more
//! than the clients were allowed).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tierlimit_shared::config::{Algorithm, Limit, Policy};
use tierlimit_shared::day::SECS_PER_DAY;
use tierlimit_shared::limits::Subject;

use crate::storage::script::Scope;

/// One old tier a check carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    pub scope: Scope,
    /// The old shape with the new limit.
    pub limit: Limit,
    /// Counts per key under the old policy (the request's key), or the
    /// whole tenant. Whether it goes beside the new tier or replaces it is
    /// the call's business (`decision::carry`): it depends on the request's
    /// key.
    pub key_scoped: bool,
}

#[derive(Debug, Clone)]
struct Carry {
    old: Arc<Policy>,
    /// The policy the change made (for a plan: the plan's, which its plain
    /// tenants share).
    new: Arc<Policy>,
    /// Per scope (node, region): the carry's end, Redis' clock, ms.
    until_ms: [u64; 2],
}

/// The transitions in progress on this node.
#[derive(Debug, Default)]
pub struct Transitions {
    /// Whether any transition is in progress: the decision path's only
    /// cost when none is.
    any: AtomicBool,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    carries: HashMap<Subject, Carry>,
    /// Tenants registered while a plan's transition runs, until it ends:
    /// they had no windows under the plan's old shape, so they carry
    /// nothing of it (`Subject::Tenant` records without a previous policy).
    registered: HashMap<String, u64>,
}

impl Inner {
    fn expire(&mut self, now_ms: u64) {
        self.carries
            .retain(|_, c| c.until_ms.iter().any(|u| *u > now_ms));
        self.registered.retain(|_, until| *until > now_ms);
    }

    fn is_empty(&self) -> bool {
        self.carries.is_empty()
    }
}

impl Transitions {
    /// A record changed `subject` from `old` to `new` at `now_ms` (Redis'
    /// clock): starts carrying every tier whose shape changed.
    pub fn begin(
        &self,
        subject: Subject,
        old: Option<Arc<Policy>>,
        new: Option<Arc<Policy>>,
        now_ms: u64,
    ) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.expire(now_ms);
        let (old, new) = match (old, new, &subject) {
            (Some(old), Some(new), _) => (old, new),
            (None, Some(_), Subject::Tenant(id)) => {
                let plans_end = inner
                    .carries
                    .iter()
                    .filter(|(s, _)| matches!(s, Subject::Plan(_)))
                    .flat_map(|(_, c)| c.until_ms)
                    .max();
                if let Some(end) = plans_end {
                    inner.registered.insert(id.clone(), end);
                }
                return;
            }
            _ => return,
        };
        let until_ms = [
            carry_end(old.node.as_ref(), new.node.as_ref(), &old, &new, now_ms),
            carry_end(old.region.as_ref(), new.region.as_ref(), &old, &new, now_ms),
        ];
        let carries = &mut inner.carries;
        if until_ms.iter().any(|u| *u > now_ms) {
            // A second change during a transition carries the shape that
            // holds the spending, the first one's old shape, as long as the
            // later end (a shape in between counted only since the first).
            let old = match carries.get(&subject) {
                Some(c) => Arc::clone(&c.old),
                None => old,
            };
            let prev = carries.get(&subject).map_or([0, 0], |c| c.until_ms);
            carries.insert(
                subject,
                Carry {
                    old,
                    new,
                    until_ms: [until_ms[0].max(prev[0]), until_ms[1].max(prev[1])],
                },
            );
        }
        self.any.store(!inner.is_empty(), Ordering::Release);
    }

    /// The old tiers a check of `tenant` under `policy` carries at
    /// `now_ms()` (Redis' clock, asked only when a transition runs); empty
    /// when none (the common case costs one atomic load).
    pub fn carried(
        &self,
        tenant: &str,
        policy: &Policy,
        now_ms: impl FnOnce() -> u64,
    ) -> Vec<Carried> {
        if !self.any.load(Ordering::Acquire) {
            return Vec::new();
        }
        let now_ms = now_ms();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.expire(now_ms);
        self.any.store(!inner.is_empty(), Ordering::Release);
        let own = inner.carries.get(&Subject::Tenant(tenant.to_owned()));
        let plan = inner
            .carries
            .get(&Subject::Plan(policy.plan.clone()))
            .filter(|_| !inner.registered.contains_key(tenant));
        let mut out = Vec::new();
        for (i, scope) in [Scope::Node, Scope::Region].into_iter().enumerate() {
            let new = match scope {
                Scope::Node => policy.node.as_ref(),
                Scope::Region => policy.region.as_ref(),
            };
            let Some(new) = new else { continue };
            // The tenant's own change first; else its plan's, when the
            // tenant takes this tier's shape from the plan (an override of
            // the algorithm or window keeps the tenant's own).
            let carry = own.filter(|c| c.until_ms[i] > now_ms).or_else(|| {
                plan.filter(|c| c.until_ms[i] > now_ms && !shape_overridden(c, scope, policy))
            });
            let Some(c) = carry else { continue };
            let old_tier = match scope {
                Scope::Node => c.old.node.as_ref(),
                Scope::Region => c.old.region.as_ref(),
            };
            let Some(old_tier) = old_tier else { continue };
            match relation(old_tier, c.old.key_scoped, new, policy.key_scoped) {
                Relation::Same => {}
                _ => out.push(Carried {
                    scope,
                    limit: Limit {
                        limit: new.limit,
                        window_ms: old_tier.window_ms,
                        algorithm: old_tier.algorithm,
                        burst: if old_tier.algorithm == Algorithm::TokenBucket {
                            old_tier.burst.min(new.limit).max(1)
                        } else {
                            new.limit
                        },
                    },
                    key_scoped: c.old.key_scoped,
                }),
            }
        }
        out
    }
}

/// A plan's carry does not apply to a tenant whose tier no longer has the
/// plan's new shape (an override of its own decides it).
fn shape_overridden(c: &Carry, scope: Scope, policy: &Policy) -> bool {
    let shape = |p: &Policy| {
        let l = match scope {
            Scope::Node => p.node.as_ref(),
            Scope::Region => p.region.as_ref(),
        };
        (l.map(|l| (l.algorithm, l.window_ms)), p.key_scoped)
    };
    shape(&c.new) != shape(policy)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Relation {
    /// Same state, read the same way: nothing to carry.
    Same,
    /// The old state is elsewhere: carried beside the new tier.
    Apart,
    /// Same fields, read another way: carried instead of the new tier.
    SharedFields,
}

/// Whether a tier in the tenant hash (whole tenant, a day at most, not
/// the log) — the same rule as `TierCall::in_tenant_hash`.
fn in_hash(l: &Limit, key_scoped: bool) -> bool {
    !key_scoped && l.window_ms <= SECS_PER_DAY * 1000 && l.algorithm != Algorithm::SlidingLog
}

fn relation(old: &Limit, old_keyed: bool, new: &Limit, new_keyed: bool) -> Relation {
    if old.algorithm != new.algorithm
        || old_keyed != new_keyed
        || in_hash(old, old_keyed) != in_hash(new, new_keyed)
    {
        return Relation::Apart;
    }
    let indexed = matches!(
        old.algorithm,
        Algorithm::FixedWindow | Algorithm::SlidingWindow
    );
    if indexed && old.window_ms != new.window_ms {
        Relation::SharedFields
    } else {
        Relation::Same
    }
}

/// When the old tier of a scope stops being carried (0: not carried).
fn carry_end(
    old: Option<&Limit>,
    new: Option<&Limit>,
    old_p: &Policy,
    new_p: &Policy,
    now_ms: u64,
) -> u64 {
    let (Some(old), Some(new)) = (old, new) else {
        return 0;
    };
    let rel = relation(old, old_p.key_scoped, new, new_p.key_scoped);
    let w = old.window_ms.max(1);
    let window_end = (now_ms / w + 1) * w;
    match (rel, old.algorithm) {
        (Relation::Same, _) => 0,
        (Relation::SharedFields, _) => window_end,
        (_, Algorithm::FixedWindow) => window_end,
        (_, Algorithm::SlidingWindow) => window_end + w,
        (_, Algorithm::TokenBucket) => {
            let ahead = (u128::from(w) * u128::from(old.burst.max(1)))
                .div_ceil(u128::from(old.limit.max(1)));
            now_ms + u64::try_from(ahead).unwrap_or(u64::MAX / 2)
        }
        (_, Algorithm::SlidingLog) => now_ms + w,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(algorithm: Algorithm, limit: u64, window_ms: u64) -> Limit {
        Limit {
            limit,
            window_ms,
            algorithm,
            burst: limit,
        }
    }

    fn policy(
        plan: &str,
        node: Option<Limit>,
        region: Option<Limit>,
        key_scoped: bool,
    ) -> Arc<Policy> {
        Arc::new(Policy {
            time_zone: Default::default(),
            plan: plan.into(),
            node,
            region,
            global: None,
            global_periods: Vec::new(),
            on_store_error: Default::default(),
            key_scoped,
            lease_max: None,
        })
    }

    /// A plan `name` with a node tier only.
    fn node_plan(name: &str, alg: Algorithm, l: u64, window_ms: u64, keyed: bool) -> Arc<Policy> {
        policy(name, Some(limit(alg, l, window_ms)), None, keyed)
    }

    /// A plan `name` with a region tier only, counting per tenant.
    fn region_plan(name: &str, alg: Algorithm, l: u64, window_ms: u64) -> Arc<Policy> {
        policy(name, None, Some(limit(alg, l, window_ms)), false)
    }

    /// Tenant `id` changed from `old` to `new` at [`T0`].
    fn tenant_change(t: &Transitions, id: &str, old: Arc<Policy>, new: &Arc<Policy>) {
        t.begin(
            Subject::Tenant(id.into()),
            Some(old),
            Some(Arc::clone(new)),
            T0,
        );
    }

    const MIN: u64 = 60_000;
    const T0: u64 = 1_800_000_000_000 + 20_000; // 20 s into a minute

    #[test]
    fn a_limit_change_carries_nothing() {
        let t = Transitions::default();
        let old = region_plan("p", Algorithm::FixedWindow, 10, MIN);
        let new = region_plan("p", Algorithm::FixedWindow, 5, MIN);
        tenant_change(&t, "a", old, &new);
        assert!(t.carried("a", &new, || T0).is_empty());
        assert!(!t.any.load(Ordering::Acquire), "nothing kept");
        assert!(t.inner.lock().unwrap().is_empty());
    }

    #[test]
    fn another_algorithm_carries_the_old_tier_beside_with_the_new_limit_until_its_window_ends() {
        let t = Transitions::default();
        let old = region_plan("p", Algorithm::FixedWindow, 10, MIN);
        let new = region_plan("p", Algorithm::SlidingWindow, 6, MIN);
        tenant_change(&t, "a", old, &new);
        let c = t.carried("a", &new, || T0 + 1);
        assert_eq!(
            c,
            vec![Carried {
                scope: Scope::Region,
                limit: limit(Algorithm::FixedWindow, 6, MIN),
                key_scoped: false,
            }]
        );
        assert!(t.carried("b", &new, || T0 + 1).is_empty(), "another tenant");
        let end = (T0 / MIN + 1) * MIN;
        assert_eq!(t.carried("a", &new, || end - 1).len(), 1);
        assert!(
            t.carried("a", &new, || end).is_empty(),
            "the old window ended"
        );
    }

    #[test]
    fn each_old_algorithm_is_carried_as_long_as_it_can_hold_spending() {
        let end = (T0 / MIN + 1) * MIN;
        for (alg, until) in [
            (Algorithm::FixedWindow, end),
            (Algorithm::SlidingWindow, end + MIN),
            (Algorithm::TokenBucket, T0 + MIN),
            (Algorithm::SlidingLog, T0 + MIN),
        ] {
            let other = if alg == Algorithm::FixedWindow {
                Algorithm::TokenBucket
            } else {
                Algorithm::FixedWindow
            };
            let t = Transitions::default();
            let old = node_plan("p", alg, 10, MIN, false);
            let new = node_plan("p", other, 10, MIN, false);
            t.begin(
                Subject::Plan("p".into()),
                Some(old),
                Some(Arc::clone(&new)),
                T0,
            );
            assert_eq!(t.carried("any", &new, || until - 1).len(), 1, "{alg:?}");
            assert!(t.carried("any", &new, || until).is_empty(), "{alg:?}");
        }
    }

    #[test]
    fn a_window_length_change_replaces_fixed_and_sliding_and_leaves_the_others() {
        for (alg, carried) in [
            (Algorithm::FixedWindow, true),
            (Algorithm::SlidingWindow, true),
            (Algorithm::TokenBucket, false),
            (Algorithm::SlidingLog, false),
        ] {
            let t = Transitions::default();
            let old = node_plan("p", alg, 10, MIN, false);
            let new = node_plan("p", alg, 100, 10 * MIN, false);
            tenant_change(&t, "a", old, &new);
            let c = t.carried("a", &new, || T0);
            assert_eq!(!c.is_empty(), carried, "{alg:?}");
            if carried {
                assert_eq!(c[0].limit, limit(alg, 100, MIN));
            }
        }
    }

    #[test]
    fn key_scoped_either_way_carries_the_old_key() {
        for old_keyed in [false, true] {
            let t = Transitions::default();
            let l = limit(Algorithm::FixedWindow, 10, MIN);
            let old = policy("p", Some(l.clone()), None, old_keyed);
            let new = policy("p", Some(l), None, !old_keyed);
            t.begin(
                Subject::Plan("p".into()),
                Some(old),
                Some(Arc::clone(&new)),
                T0,
            );
            let c = t.carried("x", &new, || T0);
            assert_eq!(c.len(), 1);
            assert_eq!(c[0].key_scoped, old_keyed);
        }
    }

    #[test]
    fn a_plan_change_spares_a_tenant_whose_override_keeps_its_own_shape() {
        let t = Transitions::default();
        let old = node_plan("p", Algorithm::FixedWindow, 10, MIN, false);
        let new = node_plan("p", Algorithm::SlidingWindow, 10, MIN, false);
        t.begin(
            Subject::Plan("p".into()),
            Some(old),
            Some(Arc::clone(&new)),
            T0,
        );
        // A tenant of the plan with an algorithm of its own: unchanged.
        let own = node_plan("p", Algorithm::TokenBucket, 50, MIN, false);
        assert!(t.carried("custom", &own, || T0).is_empty());
        // A tenant with a limit of its own takes the plan's new shape: the
        // old tier is carried with the tenant's limit.
        let raised = node_plan("p", Algorithm::SlidingWindow, 50, MIN, false);
        let c = t.carried("raised", &raised, || T0);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].limit, limit(Algorithm::FixedWindow, 50, MIN));
        // A tenant of another plan: nothing.
        let other = node_plan("q", Algorithm::SlidingWindow, 10, MIN, false);
        assert!(t.carried("q1", &other, || T0).is_empty());
    }

    #[test]
    fn a_tenant_registered_during_its_plans_transition_carries_nothing() {
        let t = Transitions::default();
        let old = node_plan("p", Algorithm::FixedWindow, 10, MIN, false);
        let new = node_plan("p", Algorithm::FixedWindow, 10, MIN, true);
        t.begin(
            Subject::Plan("p".into()),
            Some(old),
            Some(Arc::clone(&new)),
            T0,
        );
        t.begin(
            Subject::Tenant("later".into()),
            None,
            Some(Arc::clone(&new)),
            T0 + 1,
        );
        assert!(t.carried("later", &new, || T0 + 2).is_empty());
        assert_eq!(t.carried("before", &new, || T0 + 2).len(), 1);
    }

    #[test]
    fn a_second_change_keeps_carrying_the_first_shape() {
        let t = Transitions::default();
        let a = node_plan("p", Algorithm::FixedWindow, 10, MIN, false);
        let b = node_plan("p", Algorithm::SlidingLog, 10, MIN, false);
        let c = node_plan("p", Algorithm::TokenBucket, 4, MIN, false);
        let s = Subject::Tenant("a".into());
        t.begin(s.clone(), Some(a), Some(Arc::clone(&b)), T0);
        t.begin(s, Some(b), Some(Arc::clone(&c)), T0 + 5);
        let carried = t.carried("a", &c, || T0 + 6);
        assert_eq!(carried.len(), 1);
        assert_eq!(carried[0].limit, limit(Algorithm::FixedWindow, 4, MIN));
    }
}
