//! Sliding window, the twin of `local function sliding_window` in
//! `region-node/src/lua/decide.lua`.
//!
//! It exists so that a region-node can enforce a sliding-window tier without
//! Redis (the `local` fail mode, `region-node/src/local.rs`), and so that the
//! script's section has a reference model: `tests/tests/lua_model.rs` runs
//! both over the same random operations and compares every answer.
//!
//! The script keeps a hash `w` (window index), `c` (units in it), `p` (units
//! in window `w - 1`): `State::Sliding`. The estimate is
//! `p * (w - elapsed) / w + c`, in `f64` like the script's Lua doubles. One
//! known difference, where the script is at fault: for a cost above the
//! limit the script clamps its `-1` ("never") to a retry of 1 ms; the model
//! says `None`.

use super::{after, ceil_u64, floor_u64, Change, Clock, Evaluation};
use crate::config::Limit;

pub(super) fn evaluate(
    limit: &Limit,
    clock: Clock,
    window: u64,
    current: u64,
    previous: u64,
    cost: u64,
) -> Evaluation {
    let (cur, prev) = sliding_counts(clock, window, current, previous);
    sliding_eval(limit, clock, cur, prev, cost)
}

/// The script's `commit()` (charge) and `refund()`: both roll the windows
/// forward to now first; a refund into an empty current window changes
/// nothing.
pub(super) fn change(
    clock: Clock,
    window: &mut u64,
    current: &mut u64,
    previous: &mut u64,
    cost: u64,
    change: Change,
) {
    let (cur, prev) = sliding_counts(clock, *window, *current, *previous);
    let cur = match change {
        Change::Charge => cur.saturating_add(cost),
        Change::Refund if cur > 0 => cur.saturating_sub(cost),
        Change::Refund => return,
    };
    *window = clock.idx;
    *current = cur;
    *previous = prev;
}

pub(super) fn is_idle(clock: Clock, window: u64, current: u64, previous: u64) -> bool {
    if window == clock.idx {
        current == 0 && previous == 0
    } else if window + 1 == clock.idx {
        current == 0
    } else {
        window < clock.idx || (current == 0 && previous == 0)
    }
}

/// (current, previous) counts as of `clock`'s window.
fn sliding_counts(clock: Clock, window: u64, current: u64, previous: u64) -> (u64, u64) {
    if window == clock.idx {
        (current, previous)
    } else if window + 1 == clock.idx {
        (0, current)
    } else {
        (0, 0)
    }
}

fn sliding_eval(limit: &Limit, clock: Clock, cur: u64, prev: u64, cost: u64) -> Evaluation {
    let w = clock.w as f64;
    let (lim, c) = (limit.limit as f64, cost as f64);
    let (curf, prevf) = (cur as f64, prev as f64);
    let elapsed = (clock.now_ms - clock.idx * clock.w) as f64;
    let weight = (w - elapsed) / w;
    let est = prevf * weight + curf;
    let allowed = est + c <= lim;
    let remaining = floor_u64(lim - est);
    let reset = clock.reset();
    let retry_ms = if allowed {
        Some(0)
    } else if cost > limit.limit {
        None
    } else {
        let retry = if cur.saturating_add(cost) <= limit.limit {
            // Blocked by the weighted previous window: wait until it fades.
            let need = w * (1.0 - (limit.limit - cost - cur) as f64 / prevf);
            (need - elapsed).ceil()
        } else {
            // Blocked by the current window: wait into the next one until
            // cur * (1 - t/w) + c <= limit.
            let need = w * (1.0 - (limit.limit - cost) as f64 / curf);
            reset as f64 + need.ceil()
        };
        Some(ceil_u64(retry).max(1))
    };
    Evaluation {
        allowed,
        remaining: after(allowed, remaining, cost),
        reset_ms: reset,
        retry_ms,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use crate::algorithm::test_support::*;
    use crate::algorithm::TierState;

    #[test]
    fn sliding_window_first_window_is_exact() {
        let l = sliding(4, 1000);
        let t = aligned(1000);
        let mut s = TierState::new(&l);
        for i in 0..4 {
            assert_eq!(
                check(&mut s, &l, t + i * 10 * MS, 1),
                allowed(3 - i, 1000 - i * 10)
            );
        }
        assert!(!check(&mut s, &l, t + 999 * MS, 1).allowed);
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let l = sliding(10, 1000);
        let t = aligned(1000);
        let mut s = TierState::new(&l);
        assert_eq!(check(&mut s, &l, t, 10), allowed(0, 1000));
        // A quarter into the next window, 75 % of the previous one counts: 7.5.
        let at = t + 1250 * MS;
        assert_eq!(s.evaluate(&l, at, 0), allowed(2, 750));
        assert_eq!(check(&mut s, &l, at, 1), allowed(1, 750));
        assert_eq!(check(&mut s, &l, at, 1), allowed(0, 750));
        let ev = check(&mut s, &l, at, 1);
        assert!(!ev.allowed);
        assert_eq!(ev.remaining, 0);
        // Blocked by the fading previous window: exactly 300 ms in, 10 * 0.7
        // + 2 + 1 = 10 fits; the float arithmetic (the script's) may round the
        // wait up by one ms, never down.
        let r = ev.retry_ms.unwrap();
        assert!(r == 50 || r == 51, "retry {r}");
        assert!(s.evaluate(&l, at + r * MS, 1).allowed);
        assert!(!s.evaluate(&l, at + 49 * MS, 1).allowed);
        // Two windows later nothing of it is left.
        assert_eq!(s.evaluate(&l, t + 3000 * MS, 10), allowed(0, 1000));
    }

    #[test]
    fn sliding_window_blocked_by_the_current_window_waits_into_the_next() {
        let l = sliding(10, 1000);
        let t = aligned(1000);
        let mut s = TierState::new(&l);
        check(&mut s, &l, t, 10);
        let ev = s.evaluate(&l, t + 500 * MS, 1);
        // 500 ms to the next window, then until 10 * (1 - x) + 1 <= 10: 100 ms.
        assert_eq!(ev, denied(0, 500, Some(600)));
        assert!(s.evaluate(&l, t + 1100 * MS, 1).allowed);
        assert!(!s.evaluate(&l, t + 1099 * MS, 1).allowed);
        assert_eq!(s.evaluate(&l, t, 11), denied(0, 1000, None));
    }

    #[test]
    fn sliding_window_refund_never_below_zero_nor_into_the_previous_window() {
        let l = sliding(10, 1000);
        let t = aligned(1000);
        let mut s = TierState::new(&l);
        s.commit(&l, t, 3);
        s.refund(&l, t, 5);
        assert_eq!(s.evaluate(&l, t, 0).remaining, 10);
        s.commit(&l, t, 8);
        // Half into the next window: previous 8 weighs 4; nothing current to refund.
        let at = t + 1500 * MS;
        s.refund(&l, at, 8);
        assert_eq!(s.evaluate(&l, at, 0), allowed(6, 500));
        s.commit(&l, at, 2);
        s.refund(&l, at, 1);
        assert_eq!(s.evaluate(&l, at, 0), allowed(5, 500));
    }

    #[test]
    fn sliding_window_ninety_minutes() {
        let w = 90 * 60_000;
        let l = sliding(100, w);
        let t = aligned(w);
        let mut s = TierState::new(&l);
        assert_eq!(
            check(&mut s, &l, t + 60_000 * MS, 100),
            allowed(0, w - 60_000)
        );
        // Half-way through the next window the previous 100 weigh 50.
        let at = t + (w + w / 2) * MS;
        assert_eq!(s.evaluate(&l, at, 50), allowed(0, w / 2));
        assert!(!s.evaluate(&l, at, 51).allowed);
    }

    proptest! {
        #[test]
        fn sliding_window_never_exceeds_the_limit_in_an_aligned_window(
            limit in 1u64..20,
            window_ms in 1u64..3000,
            start in 0u64..10_000_000,
            ops in steps(1_500_000, 6),
        ) {
            let l = sliding(limit, window_ms);
            let mut s = TierState::new(&l);
            let mut now = T0 + start;
            let mut per_window: HashMap<u64, u64> = HashMap::new();
            for (advance, cost) in ops {
                now += advance;
                let ev = check(&mut s, &l, now, cost);
                let used = per_window.entry(now / MS / window_ms).or_default();
                if ev.allowed {
                    *used += cost;
                }
                prop_assert!(*used <= limit);
                prop_assert!(ev.remaining <= limit);
                if !ev.allowed && cost <= limit {
                    let r = ev.retry_ms.unwrap();
                    prop_assert!(s.evaluate(&l, now + r * MS, cost).allowed, "retry {}", r);
                }
            }
        }
    }
}
