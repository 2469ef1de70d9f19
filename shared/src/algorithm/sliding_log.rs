//! Exact sliding log, the twin of `local function sliding_log` in
//! `region-node/src/lua/decide.lua`.
//!
//! It exists so that a region-node can enforce a sliding-log tier without
//! Redis (the `local` fail mode, `region-node/src/local.rs`), and so that the
//! script's section has a reference model: `tests/tests/lua_model.rs` runs
//! both over the same random operations and compares every answer.
//!
//! The script keeps a zset with one member per unit scored by its time in ms,
//! pruned of scores `<= now_ms - window_ms`; here it is `State::Log`, (ms,
//! units) runs in ascending ms. One known difference, where the script is at
//! fault: two commits within one microsecond with a refund between them can
//! collide in the script's member names (`now_us:n`) and lose a unit; the
//! model counts it.

use std::collections::VecDeque;

use super::{after, Clock, Evaluation};
use crate::config::Limit;

pub(super) fn evaluate(
    limit: &Limit,
    clock: Clock,
    runs: &VecDeque<(u64, u64)>,
    cost: u64,
) -> Evaluation {
    let live = || runs.iter().filter(|&&(ms, _)| !clock.expired(ms));
    let used: u64 = live().map(|&(_, n)| n).sum();
    let allowed = used.saturating_add(cost) <= limit.limit;
    let remaining = limit.limit.saturating_sub(used);
    let reset = match live().next_back() {
        // Denied: until the newest unit leaves (live, so `newest + w > now_ms`).
        Some(&(newest, _)) if !allowed => newest + clock.w - clock.now_ms,
        _ => clock.w,
    };
    let retry_ms = if allowed {
        Some(0)
    } else if cost > limit.limit {
        None
    } else {
        // The (used + cost - limit)-th oldest unit must leave the window.
        let nth = used.saturating_add(cost) - limit.limit - 1;
        let mut seen = 0;
        let score = live()
            .find(|&&(_, n)| {
                seen += n;
                seen > nth
            })
            .map(|&(ms, _)| ms)
            .unwrap_or(clock.now_ms);
        Some((score + clock.w).saturating_sub(clock.now_ms).max(1))
    };
    Evaluation {
        allowed,
        remaining: after(allowed, remaining, cost),
        reset_ms: reset,
        retry_ms,
    }
}

pub(super) fn commit(clock: Clock, runs: &mut VecDeque<(u64, u64)>, cost: u64) {
    prune(runs, clock);
    add_units(runs, clock.now_ms, cost);
}

/// A refund tied to no charge (free-form): the oldest units go back first
/// (the script's `ZPOPMIN`), those that would leave the window first. The
/// newest would give the refund a whole new window of room (issue 29,
/// item 5).
pub(super) fn refund(clock: Clock, runs: &mut VecDeque<(u64, u64)>, cost: u64) {
    prune(runs, clock);
    let mut left = cost;
    while left > 0 {
        let Some(first) = runs.front_mut() else { break };
        let take = first.1.min(left);
        first.1 -= take;
        left -= take;
        if first.1 == 0 {
            runs.pop_front();
        }
    }
}

/// The refund of one charge (by handle): its own units, scored at its time
/// `charged_at_ms`, at most `cost` of them; nothing once they left the
/// window. The script finds them by the handle's id in their names; here
/// every unit of that millisecond is alike, and a handle gives back at
/// most what its charge holds.
pub(super) fn refund_charge(
    clock: Clock,
    runs: &mut VecDeque<(u64, u64)>,
    cost: u64,
    charged_at_ms: u64,
) {
    prune(runs, clock);
    if let Some(at) = runs.iter().position(|&(ms, _)| ms == charged_at_ms) {
        runs[at].1 -= runs[at].1.min(cost);
        if runs[at].1 == 0 {
            runs.remove(at);
        }
    }
}

pub(super) fn is_idle(clock: Clock, runs: &VecDeque<(u64, u64)>) -> bool {
    runs.iter().all(|&(ms, _)| clock.expired(ms))
}

/// Drops the runs that left the window (they are in ascending ms).
fn prune(runs: &mut VecDeque<(u64, u64)>, clock: Clock) {
    runs.retain(|&(ms, _)| !clock.expired(ms));
}

/// Adds `units` scored `ms`, keeping runs in ascending ms.
fn add_units(runs: &mut VecDeque<(u64, u64)>, ms: u64, units: u64) {
    if units == 0 {
        return;
    }
    let at = runs.partition_point(|&(t, _)| t < ms);
    match runs.get_mut(at) {
        Some(run) if run.0 == ms => run.1 += units,
        _ => runs.insert(at, (ms, units)),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::algorithm::test_support::*;
    use crate::algorithm::TierState;

    #[test]
    fn sliding_log_is_exact() {
        let l = log(3, 1000);
        let t = T0 + 456;
        let mut s = TierState::new(&l);
        for i in 0..3 {
            assert_eq!(check(&mut s, &l, t + i * 100 * MS, 1), allowed(2 - i, 1000));
        }
        let at = t + 300 * MS;
        // The oldest unit leaves when its score is <= now_ms - window.
        assert_eq!(s.evaluate(&l, at, 1), denied(0, 900, Some(700)));
        assert_eq!(assert_retry_exact(&s, &l, at, 1), 700);
        assert!(!s.evaluate(&l, t + 999 * MS, 1).allowed);
        assert_eq!(s.evaluate(&l, t + 1000 * MS, 1), allowed(0, 1000));
        assert_eq!(s.evaluate(&l, t + 1200 * MS, 3), allowed(0, 1000));
        assert_eq!(s.evaluate(&l, t, 4), denied(0, 1200, None));
    }

    #[test]
    fn sliding_log_cost_above_one_waits_for_the_right_entry() {
        let l = log(5, 1000);
        let t = T0;
        let mut s = TierState::new(&l);
        check(&mut s, &l, t, 2);
        check(&mut s, &l, t + 100 * MS, 2);
        // 4 used + 3 > 5: the 2nd oldest unit (scored t) must leave.
        assert_eq!(s.evaluate(&l, t + 200 * MS, 3), denied(1, 900, Some(800)));
        assert_eq!(assert_retry_exact(&s, &l, t + 200 * MS, 3), 800);
        // 4 used + 5 > 5: the 4th oldest (scored t + 100 ms) must leave.
        assert_eq!(assert_retry_exact(&s, &l, t + 200 * MS, 5), 900);
        assert_eq!(s.evaluate(&l, t + 200 * MS, 6).retry_ms, None);
    }

    #[test]
    fn sliding_log_free_form_refund_pops_the_oldest_and_never_below_zero() {
        let l = log(4, 1000);
        let t = T0;
        let mut s = TierState::new(&l);
        s.refund(&l, t, 2);
        assert_eq!(s, TierState::new(&l));
        s.commit(&l, t, 2);
        s.commit(&l, t + 500 * MS, 2);
        s.refund(&l, t + 600 * MS, 1);
        // Left: 1 at t, 2 at t + 500 ms (the oldest went back).
        assert_eq!(s.evaluate(&l, t + 600 * MS, 0).remaining, 1);
        assert_eq!(s.evaluate(&l, t + 1000 * MS, 0).remaining, 2);
        s.refund(&l, t + 600 * MS, 10);
        assert_eq!(s.evaluate(&l, t + 600 * MS, 4), allowed(0, 1000));
        assert!(s.is_idle(&l, t + 600 * MS));
    }

    /// Issue 29, item 5: limit 2 per 60 s, A at 0 s, B at 59 s; A refunded
    /// by handle at 59.5 s gives back A's own unit, not B's; C at 59.6 s is
    /// admitted; at 60.001 s A would have left anyway, and D is denied (B
    /// and C fill the window). Popping the newest admitted D: three in one
    /// window.
    #[test]
    fn sliding_log_refund_by_handle_gives_back_the_charges_own_units() {
        let l = log(2, 60_000);
        let t = T0 - T0 % (60_000 * MS);
        let a_ms = t / MS;
        let mut s = TierState::new(&l);
        assert!(check(&mut s, &l, t, 1).allowed);
        assert!(check(&mut s, &l, t + 59_000 * MS, 1).allowed);
        s.refund_charge(&l, t + 59_500 * MS, 1, a_ms);
        assert!(check(&mut s, &l, t + 59_600 * MS, 1).allowed, "C");
        assert!(!s.evaluate(&l, t + 60_001 * MS, 1).allowed, "D");
        let d = t + 60_001 * MS;
        // A charge whose units left the window gives nothing back, nor
        // does a handle of a millisecond that holds no units.
        s.refund_charge(&l, d, 1, a_ms);
        s.refund_charge(&l, d, 1, a_ms + 1);
        assert_eq!(s.evaluate(&l, d, 0).remaining, 0);
        // B's handle gives back B's unit.
        s.refund_charge(&l, d, 1, a_ms + 59_000);
        assert_eq!(s.evaluate(&l, d, 0).remaining, 1);
    }

    #[test]
    fn sliding_log_unusual_windows() {
        for w in [7000, 90 * 60_000] {
            let l = log(2, w);
            let mut s = TierState::new(&l);
            check(&mut s, &l, T0, 1);
            check(&mut s, &l, T0 + 1000 * MS, 1);
            assert_eq!(assert_retry_exact(&s, &l, T0 + 2000 * MS, 1), w - 2000);
            assert_eq!(s.evaluate(&l, T0 + w * MS, 1), allowed(0, w));
        }
    }

    proptest! {
        /// The sliding log is exact: a request passes iff the units allowed in
        /// (now_ms - w, now_ms] plus its cost fit, so no window of length w
        /// ever holds more than the limit; and `retry_ms` is exact.
        #[test]
        fn sliding_log_never_exceeds_the_limit_in_any_window(
            limit in 1u64..30,
            window_ms in 1u64..3000,
            ops in steps(400_000, 6),
        ) {
            let l = log(limit, window_ms);
            let mut s = TierState::new(&l);
            let mut now = T0;
            let mut passed: Vec<(u64, u64)> = Vec::new();
            for (advance, cost) in ops {
                now += advance;
                let now_ms = now / MS;
                let in_window: u64 = passed
                    .iter()
                    .filter(|&&(ms, _)| ms + window_ms > now_ms)
                    .map(|&(_, c)| c)
                    .sum();
                let ev = s.evaluate(&l, now, cost);
                prop_assert_eq!(ev.allowed, in_window + cost <= limit);
                if ev.allowed {
                    s.commit(&l, now, cost);
                    passed.push((now_ms, cost));
                } else if cost <= limit {
                    let r = ev.retry_ms.unwrap();
                    prop_assert!(s.evaluate(&l, now + r * MS, cost).allowed);
                    prop_assert!(!s.evaluate(&l, now + (r - 1) * MS, cost).allowed);
                }
            }
        }
    }
}
