//! Fixed window, the twin of `local function fixed_window` in
//! `region-node/src/lua/decide.lua`.
//!
//! It exists so that a region-node can enforce a fixed-window tier without
//! Redis (the `local` fail mode, `region-node/src/local.rs`), and so that the
//! script's section has a reference model: `tests/tests/lua_model.rs` runs
//! both over the same random operations and compares every answer.
//!
//! The script keeps a hash `w` (window index), `c` (units charged in that
//! window): `State::Fixed`. A window is `floor(now_ms / window_ms)`, aligned
//! to the Unix epoch; a count of an earlier window reads as 0.

use super::{after, Clock, Evaluation};
use crate::config::Limit;

pub(super) fn evaluate(
    limit: &Limit,
    clock: Clock,
    window: u64,
    count: u64,
    cost: u64,
) -> Evaluation {
    let used = if window == clock.idx { count } else { 0 };
    let reset = clock.reset();
    let allowed = used.saturating_add(cost) <= limit.limit;
    let remaining = limit.limit.saturating_sub(used);
    let retry_ms = if allowed {
        Some(0)
    } else if cost > limit.limit {
        None
    } else {
        Some(reset)
    };
    Evaluation {
        allowed,
        remaining: after(allowed, remaining, cost),
        reset_ms: reset,
        retry_ms,
    }
}

pub(super) fn commit(clock: Clock, window: &mut u64, count: &mut u64, cost: u64) {
    let used = if *window == clock.idx { *count } else { 0 };
    *window = clock.idx;
    *count = used.saturating_add(cost);
}

pub(super) fn refund(clock: Clock, window: &mut u64, count: &mut u64, cost: u64) {
    // Only the current window can be refunded.
    if *window == clock.idx && *count > 0 {
        *count = count.saturating_sub(cost);
    }
}

pub(super) fn is_idle(clock: Clock, window: u64, count: u64) -> bool {
    // A later window (a clock that went back) still matters.
    count == 0 || window < clock.idx
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use crate::algorithm::test_support::*;
    use crate::algorithm::TierState;

    #[test]
    fn fixed_window_allows_exactly_limit_per_window() {
        let l = fixed(5, 1000);
        let t = aligned(1000);
        let mut s = TierState::new(&l);
        for i in 0..5 {
            let ev = check(&mut s, &l, t + i * 100 * MS, 1);
            assert_eq!(ev, allowed(4 - i, 1000 - i * 100), "request {i}");
        }
        // The last µs of the window still belongs to it.
        assert_eq!(check(&mut s, &l, t + 999_999, 1), denied(0, 1, Some(1)));
        assert_eq!(check(&mut s, &l, t + 1000 * MS, 1), allowed(4, 1000));
    }

    #[test]
    fn fixed_window_cost_above_one() {
        let l = fixed(10, 1000);
        let t = aligned(1000) + 200 * MS;
        let mut s = TierState::new(&l);
        assert_eq!(check(&mut s, &l, t, 4), allowed(6, 800));
        assert_eq!(check(&mut s, &l, t, 4), allowed(2, 800));
        assert_eq!(check(&mut s, &l, t, 4), denied(2, 800, Some(800)));
        assert_eq!(check(&mut s, &l, t, 2), allowed(0, 800));
        // More than the limit can never pass.
        assert_eq!(s.evaluate(&l, t, 11), denied(0, 800, None));
        let fresh = TierState::new(&l);
        assert_eq!(fresh.evaluate(&l, t, 11), denied(10, 800, None));
        assert_eq!(fresh.evaluate(&l, t, 10), allowed(0, 800));
    }

    #[test]
    fn fixed_window_refund_never_below_zero() {
        let l = fixed(5, 1000);
        let t = aligned(1000);
        let mut s = TierState::new(&l);
        // Refund into a fresh state changes nothing.
        s.refund(&l, t, 3);
        assert_eq!(s, TierState::new(&l));
        s.commit(&l, t, 3);
        s.refund(&l, t, 1);
        assert_eq!(s.evaluate(&l, t, 0).remaining, 3);
        s.refund(&l, t, 10);
        assert_eq!(s.evaluate(&l, t, 0).remaining, 5);
        assert_eq!(s.evaluate(&l, t, 5), allowed(0, 1000));
        // A refund in a later window does not touch the earlier one's count
        // and does not credit the new window.
        s.commit(&l, t, 5);
        s.refund(&l, t + 1000 * MS, 5);
        assert_eq!(s.evaluate(&l, t + 1000 * MS, 6), denied(5, 1000, None));
        assert!(!s.evaluate(&l, t + 999 * MS, 1).allowed);
    }

    #[test]
    fn fixed_window_seven_seconds_aligns_to_the_epoch() {
        let l = fixed(3, 7000);
        // Some instant inside a 7 s window: windows start at multiples of 7000 ms.
        let now = T0 + 123_456;
        let now_ms = now / MS;
        let start_ms = now_ms - now_ms % 7000;
        let reset = start_ms + 7000 - now_ms;
        let mut s = TierState::new(&l);
        assert_eq!(check(&mut s, &l, now, 3), allowed(0, reset));
        assert_eq!(check(&mut s, &l, now, 1), denied(0, reset, Some(reset)));
        let last_us = (start_ms + 7000) * MS - 1;
        assert!(!s.evaluate(&l, last_us, 1).allowed);
        assert_eq!(s.evaluate(&l, last_us + 1, 3), allowed(0, 7000));
        assert_retry_exact(&s, &l, now, 1);
    }

    #[test]
    fn fixed_window_ninety_minutes() {
        let w = 90 * 60_000;
        let l = fixed(100, w);
        // 86 400 000 is a multiple of 5 400 000: a UTC day starts a window.
        let day_us = 86_400_000 * MS;
        let start = T0.div_ceil(day_us) * day_us;
        let mut s = TierState::new(&l);
        let at = start + 89 * 60_000 * MS;
        assert_eq!(check(&mut s, &l, at, 60), allowed(40, 60_000));
        assert_eq!(check(&mut s, &l, at, 50), denied(40, 60_000, Some(60_000)));
        assert_eq!(assert_retry_exact(&s, &l, at, 50), 60_000);
        assert_eq!(s.evaluate(&l, start + w * MS, 100), allowed(0, w));
    }

    #[test]
    fn fixed_window_retry_is_exact() {
        let l = fixed(4, 1000);
        for offset_ms in [0, 1, 500, 998, 999] {
            let t = aligned(1000) + offset_ms * MS + 321;
            let mut s = TierState::new(&l);
            check(&mut s, &l, t, 3);
            assert_eq!(assert_retry_exact(&s, &l, t, 2), 1000 - offset_ms);
        }
    }

    proptest! {
        #[test]
        fn fixed_window_never_exceeds_the_limit_in_a_window(
            limit in 1u64..20,
            window_ms in 1u64..3000,
            start in 0u64..10_000_000,
            ops in steps(1_500_000, 6),
        ) {
            let l = fixed(limit, window_ms);
            let mut s = TierState::new(&l);
            let mut now = T0 + start;
            let mut per_window: HashMap<u64, u64> = HashMap::new();
            for (advance, cost) in ops {
                now += advance;
                let ev = check(&mut s, &l, now, cost);
                let used = per_window.entry(now / MS / window_ms).or_default();
                prop_assert_eq!(ev.allowed, *used + cost <= limit);
                if ev.allowed {
                    *used += cost;
                }
                prop_assert!(*used <= limit);
                prop_assert_eq!(ev.remaining, limit - *used);
            }
        }
    }
}
