//! In-process twins of the Lua algorithms in `region-node/src/lua/decide.lua`.
//!
//! Used by the `local` fail mode (Redis unreachable), and as the reference
//! model the Lua script is tested against. Semantics match the script:
//! `evaluate` never mutates, `commit` charges, `refund` gives back without
//! going below zero.
//!
//! The arithmetic is the script's, operation for operation: window index
//! `floor(now_ms / window_ms)`, the sliding window's weight in `f64` (Lua
//! numbers are doubles), GCRA in `f64` microseconds with the stored TAT
//! rounded up, the sliding log keyed by whole milliseconds and pruned of
//! entries with `score <= now_ms - window_ms`. Given the same sequence of
//! operations at the same times, the script and this model give the same
//! answers, with two known exceptions where the script is at fault:
//! - sliding window, cost above the limit: the script clamps its `-1`
//!   ("never") to a retry of 1 ms; the model says `None`;
//! - sliding log, two commits within one microsecond with a refund between
//!   them: the script's member names (`now_us:n`) can collide and a unit is
//!   lost; the model counts it.
//!
//! The GCRA's float rounding, on the other hand, is reproduced on purpose
//! (see `token_bucket_full_burst_on_an_empty_bucket_passes`).
//!
//! Redis expiries (`PEXPIRE`/`PX`) are not modelled: every key outlives the
//! time during which its content can matter, so an expired key and a stale
//! one read the same. [`TierState::is_idle`] tells when a state can be dropped
//! for the same reason.

use std::collections::VecDeque;

use crate::config::{Algorithm, Limit};

/// The outcome of evaluating one tier for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evaluation {
    pub allowed: bool,
    /// Units left after this request (if allowed) or now (if denied).
    pub remaining: u64,
    /// Milliseconds until the window resets / the bucket is full again.
    pub reset_ms: u64,
    /// When denied: milliseconds until the same request could pass;
    /// `None` when it never can (cost above limit or burst).
    /// `Some(0)` when allowed.
    pub retry_ms: Option<u64>,
}

/// State of one tier for one tenant (or tenant and key).
///
/// The state belongs to one algorithm. Used with a [`Limit`] of another
/// algorithm (the configuration was reloaded), it reads as fresh and the next
/// `commit` or `refund` replaces it, rather than misreading one algorithm's
/// state as another's.
#[derive(Debug, Clone, PartialEq)]
pub struct TierState {
    state: State,
}

/// Per-algorithm state, mirroring what the script keeps in Redis.
#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Hash `w` (window index), `c` (units charged in that window).
    Fixed { window: u64, count: u64 },
    /// Hash `w` (window index), `c` (units in it), `p` (units in window `w - 1`).
    Sliding {
        window: u64,
        current: u64,
        previous: u64,
    },
    /// Hash `t` (theoretical arrival time, whole µs) and `f` (its fraction
    /// of a µs). `t = 0` reads as "no key": anything below now is now.
    Gcra { t_us: u64, frac: f64 },
    /// Zset with one member per unit scored by its time in ms; kept here as
    /// (ms, units) runs in ascending ms, so memory is O(distinct ms) and a
    /// large cost is one entry.
    Log { runs: VecDeque<(u64, u64)> },
}

impl State {
    fn fresh(algorithm: Algorithm) -> State {
        match algorithm {
            Algorithm::FixedWindow => State::Fixed {
                window: 0,
                count: 0,
            },
            Algorithm::SlidingWindow => State::Sliding {
                window: 0,
                current: 0,
                previous: 0,
            },
            Algorithm::TokenBucket => State::Gcra { t_us: 0, frac: 0.0 },
            Algorithm::SlidingLog => State::Log {
                runs: VecDeque::new(),
            },
        }
    }

    fn algorithm(&self) -> Algorithm {
        match self {
            State::Fixed { .. } => Algorithm::FixedWindow,
            State::Sliding { .. } => Algorithm::SlidingWindow,
            State::Gcra { .. } => Algorithm::TokenBucket,
            State::Log { .. } => Algorithm::SlidingLog,
        }
    }
}

/// Times and sizes of one evaluation, as the script computes them.
#[derive(Clone, Copy)]
struct Clock {
    now_us: u64,
    now_ms: u64,
    /// Window length in ms (never 0, so divisions cannot panic).
    w: u64,
    /// `floor(now_ms / w)`.
    idx: u64,
}

impl Clock {
    fn new(limit: &Limit, now_us: u64) -> Clock {
        let w = limit.window_ms.max(1);
        let now_ms = now_us / 1000;
        Clock {
            now_us,
            now_ms,
            w,
            idx: now_ms / w,
        }
    }

    /// Milliseconds until the current aligned window ends.
    fn reset(&self) -> u64 {
        (self.idx + 1) * self.w - self.now_ms
    }

    /// Whether a sliding-log entry scored `ms` has left the window
    /// (`ZREMRANGEBYSCORE key -inf (now_ms - w)`).
    fn expired(&self, ms: u64) -> bool {
        ms.saturating_add(self.w) <= self.now_ms
    }
}

/// What `remaining` reports: the algorithm computes the units left before
/// the request; the script subtracts the cost (not below zero) once it has
/// charged it.
fn after(allowed: bool, before: u64, cost: u64) -> u64 {
    if allowed {
        before.saturating_sub(cost)
    } else {
        before
    }
}

/// `floor(x)` clamped to `0..`, as the script's `remaining`.
fn floor_u64(x: f64) -> u64 {
    if x > 0.0 {
        x.floor() as u64
    } else {
        0
    }
}

/// `ceil(x)` clamped to `0..`.
fn ceil_u64(x: f64) -> u64 {
    if x > 0.0 {
        x.ceil() as u64
    } else {
        0
    }
}

impl TierState {
    pub fn new(limit: &Limit) -> Self {
        TierState {
            state: State::fresh(limit.algorithm),
        }
    }

    /// The algorithm this state belongs to.
    pub fn algorithm(&self) -> Algorithm {
        self.state.algorithm()
    }

    /// Evaluates a request of `cost` at `now_us` (µs since Unix epoch); never mutates.
    pub fn evaluate(&self, limit: &Limit, now_us: u64, cost: u64) -> Evaluation {
        let fresh;
        let state = if self.state.algorithm() == limit.algorithm {
            &self.state
        } else {
            fresh = State::fresh(limit.algorithm);
            &fresh
        };
        let clock = Clock::new(limit, now_us);
        match state {
            State::Fixed { window, count } => fixed_eval(limit, clock, *window, *count, cost),
            State::Sliding {
                window,
                current,
                previous,
            } => {
                let (cur, prev) = sliding_counts(clock, *window, *current, *previous);
                sliding_eval(limit, clock, cur, prev, cost)
            }
            State::Gcra { t_us, frac } => {
                gcra_eval(limit, gcra_ahead(clock, *t_us, *frac), cost).evaluation
            }
            State::Log { runs } => log_eval(limit, clock, runs, cost),
        }
    }

    /// Charges `cost` at `now_us`, whatever `evaluate` said (the caller
    /// commits only what every tier allowed, like the script).
    pub fn commit(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        self.reset_if_changed(limit);
        let clock = Clock::new(limit, now_us);
        match &mut self.state {
            State::Fixed { window, count } => {
                let used = if *window == clock.idx { *count } else { 0 };
                *window = clock.idx;
                *count = used.saturating_add(cost);
            }
            State::Sliding {
                window,
                current,
                previous,
            } => {
                let (cur, prev) = sliding_counts(clock, *window, *current, *previous);
                *window = clock.idx;
                *current = cur.saturating_add(cost);
                *previous = prev;
            }
            State::Gcra { t_us, frac } => {
                let g = gcra_eval(limit, gcra_ahead(clock, *t_us, *frac), cost);
                (*t_us, *frac) = gcra_store(clock, g.new_ahead);
            }
            State::Log { runs } => {
                prune(runs, clock);
                add_units(runs, clock.now_ms, cost);
            }
        }
    }

    /// Gives `cost` back at `now_us`; never below zero, never ahead of now.
    pub fn refund(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        self.reset_if_changed(limit);
        let clock = Clock::new(limit, now_us);
        match &mut self.state {
            State::Fixed { window, count } => {
                // Only the current window can be refunded.
                if *window == clock.idx && *count > 0 {
                    *count = count.saturating_sub(cost);
                }
            }
            State::Sliding {
                window,
                current,
                previous,
            } => {
                let (cur, prev) = sliding_counts(clock, *window, *current, *previous);
                if cur > 0 {
                    *window = clock.idx;
                    *current = cur.saturating_sub(cost);
                    *previous = prev;
                }
            }
            State::Gcra { t_us, frac } => {
                let (e, _) = gcra_params(limit);
                let back = (gcra_ahead(clock, *t_us, *frac) - cost as f64 * e).max(0.0);
                (*t_us, *frac) = gcra_store(clock, back);
            }
            State::Log { runs } => {
                prune(runs, clock);
                // ZPOPMAX: the newest units go back first.
                let mut left = cost;
                while left > 0 {
                    let Some(last) = runs.back_mut() else { break };
                    let take = last.1.min(left);
                    last.1 -= take;
                    left -= take;
                    if last.1 == 0 {
                        runs.pop_back();
                    }
                }
            }
        }
    }

    /// True when the state holds nothing that affects future decisions at `now_us` (so a map of states can be pruned).
    ///
    /// A state of another algorithm than `limit`'s is idle: it would be reset.
    pub fn is_idle(&self, limit: &Limit, now_us: u64) -> bool {
        if self.state.algorithm() != limit.algorithm {
            return true;
        }
        let clock = Clock::new(limit, now_us);
        match &self.state {
            // A later window (a clock that went back) still matters.
            State::Fixed { window, count } => *count == 0 || *window < clock.idx,
            State::Sliding {
                window,
                current,
                previous,
            } => {
                if *window == clock.idx {
                    *current == 0 && *previous == 0
                } else if *window + 1 == clock.idx {
                    *current == 0
                } else {
                    *window < clock.idx || (*current == 0 && *previous == 0)
                }
            }
            State::Gcra { t_us, frac } => gcra_ahead(clock, *t_us, *frac) == 0.0,
            State::Log { runs } => runs.iter().all(|&(ms, _)| clock.expired(ms)),
        }
    }

    fn reset_if_changed(&mut self, limit: &Limit) {
        if self.state.algorithm() != limit.algorithm {
            self.state = State::fresh(limit.algorithm);
        }
    }
}

fn fixed_eval(limit: &Limit, clock: Clock, window: u64, count: u64, cost: u64) -> Evaluation {
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

/// Emission interval `e` (µs per unit) and tolerance `tau` (µs), as doubles.
fn gcra_params(limit: &Limit) -> (f64, f64) {
    let e = (limit.window_ms as f64 * 1000.0) / limit.limit as f64;
    (e, e * limit.burst as f64)
}

struct Gcra {
    evaluation: Evaluation,
    new_ahead: f64,
}

/// How far the TAT is ahead of now, in µs (0 when it is in the past). The
/// script works on this small number, never on absolute doubles, so that
/// a full burst is not lost to rounding.
fn gcra_ahead(clock: Clock, t_us: u64, frac: f64) -> f64 {
    if t_us >= clock.now_us {
        (t_us - clock.now_us) as f64 + frac
    } else {
        0.0
    }
}

/// The stored form of `now + ahead`: whole µs and fraction.
fn gcra_store(clock: Clock, ahead: f64) -> (u64, f64) {
    let whole = ahead.floor();
    (clock.now_us + whole as u64, ahead - whole)
}

fn gcra_eval(limit: &Limit, ahead: f64, cost: u64) -> Gcra {
    let (e, tau) = gcra_params(limit);
    let new_ahead = ahead + cost as f64 * e;
    let allowed = new_ahead <= tau;
    let remaining = floor_u64((tau - ahead) / e);
    let retry_ms = if allowed {
        Some(0)
    } else if cost > limit.burst {
        None
    } else {
        Some(ceil_u64((new_ahead - tau) / 1000.0).max(1))
    };
    let full_in = if allowed { new_ahead } else { ahead };
    Gcra {
        evaluation: Evaluation {
            allowed,
            remaining: after(allowed, remaining, cost),
            reset_ms: ceil_u64(full_in / 1000.0),
            retry_ms,
        },
        new_ahead,
    }
}

fn log_eval(limit: &Limit, clock: Clock, runs: &VecDeque<(u64, u64)>, cost: u64) -> Evaluation {
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
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// 2023-11-14T22:13:20Z in µs: a whole second, not a whole minute.
    const T0: u64 = 1_700_000_000_000_000;
    /// µs per ms.
    const MS: u64 = 1000;

    fn lim(algorithm: Algorithm, limit: u64, window_ms: u64) -> Limit {
        Limit {
            limit,
            window_ms,
            algorithm,
            burst: limit,
        }
    }

    fn fixed(limit: u64, window_ms: u64) -> Limit {
        lim(Algorithm::FixedWindow, limit, window_ms)
    }

    fn sliding(limit: u64, window_ms: u64) -> Limit {
        lim(Algorithm::SlidingWindow, limit, window_ms)
    }

    fn bucket(limit: u64, window_ms: u64, burst: u64) -> Limit {
        Limit {
            burst,
            ..lim(Algorithm::TokenBucket, limit, window_ms)
        }
    }

    fn log(limit: u64, window_ms: u64) -> Limit {
        lim(Algorithm::SlidingLog, limit, window_ms)
    }

    /// The first µs of a `window_ms` window at or after `T0`.
    fn aligned(window_ms: u64) -> u64 {
        let w = window_ms * MS;
        T0.div_ceil(w) * w
    }

    /// One single-tier decision: evaluate, and commit when allowed.
    fn check(s: &mut TierState, l: &Limit, now_us: u64, cost: u64) -> Evaluation {
        let ev = s.evaluate(l, now_us, cost);
        if ev.allowed {
            s.commit(l, now_us, cost);
        }
        ev
    }

    /// Denied at `now_us`; passes after exactly `retry_ms`, not 1 ms earlier.
    fn assert_retry_exact(s: &TierState, l: &Limit, now_us: u64, cost: u64) -> u64 {
        let ev = s.evaluate(l, now_us, cost);
        assert!(!ev.allowed, "expected a denial: {ev:?}");
        let r = ev.retry_ms.expect("the request can pass later");
        assert!(r >= 1);
        assert!(
            s.evaluate(l, now_us + r * MS, cost).allowed,
            "still denied after retry_ms = {r}"
        );
        assert!(
            !s.evaluate(l, now_us + (r - 1) * MS, cost).allowed,
            "already allowed 1 ms before retry_ms = {r}"
        );
        r
    }

    fn denied(remaining: u64, reset_ms: u64, retry_ms: Option<u64>) -> Evaluation {
        Evaluation {
            allowed: false,
            remaining,
            reset_ms,
            retry_ms,
        }
    }

    fn allowed(remaining: u64, reset_ms: u64) -> Evaluation {
        Evaluation {
            allowed: true,
            remaining,
            reset_ms,
            retry_ms: Some(0),
        }
    }

    // ----- fixed window -------------------------------------------------

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
    fn evaluate_never_mutates() {
        for l in [
            fixed(3, 1000),
            sliding(3, 1000),
            bucket(3, 1000, 3),
            log(3, 1000),
        ] {
            let mut s = TierState::new(&l);
            s.commit(&l, T0, 2);
            let before = s.clone();
            for cost in [0, 1, 2, 5] {
                s.evaluate(&l, T0 + 10 * MS, cost);
            }
            assert_eq!(s, before, "{:?}", l.algorithm);
        }
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

    // ----- sliding window -----------------------------------------------

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

    // ----- token bucket (GCRA) ------------------------------------------

    #[test]
    fn token_bucket_burst_then_rate() {
        // 10 per second: one unit every 100 ms, 10 at once.
        let l = bucket(10, 1000, 10);
        let t = T0 + 7;
        let mut s = TierState::new(&l);
        for i in 0..10 {
            let ev = check(&mut s, &l, t, 1);
            assert_eq!(ev, allowed(9 - i, (i + 1) * 100), "request {i}");
        }
        assert_eq!(check(&mut s, &l, t, 1), denied(0, 1000, Some(100)));
        assert_eq!(assert_retry_exact(&s, &l, t, 1), 100);
        // Sustained: one per 100 ms passes, a second one in the same 100 ms not.
        for k in 1..=20 {
            let at = t + k * 100 * MS;
            assert!(check(&mut s, &l, at, 1).allowed, "tick {k}");
            assert!(!check(&mut s, &l, at + 99 * MS, 1).allowed, "tick {k}");
        }
        assert_eq!(s.evaluate(&l, t, 11).retry_ms, None);
    }

    #[test]
    fn token_bucket_burst_differs_from_limit() {
        let small = bucket(10, 1000, 3);
        let mut s = TierState::new(&small);
        for _ in 0..3 {
            assert!(check(&mut s, &small, T0, 1).allowed);
        }
        assert_eq!(assert_retry_exact(&s, &small, T0, 1), 100);
        assert_eq!(s.evaluate(&small, T0, 4).retry_ms, None);
        assert_eq!(
            TierState::new(&small).evaluate(&small, T0, 4).retry_ms,
            None
        );

        let big = bucket(10, 1000, 25);
        let mut s = TierState::new(&big);
        assert_eq!(check(&mut s, &big, T0, 25), allowed(0, 2500));
        assert_eq!(assert_retry_exact(&s, &big, T0, 5), 500);
    }

    #[test]
    fn token_bucket_cost_above_one() {
        let l = bucket(10, 1000, 10);
        let mut s = TierState::new(&l);
        assert_eq!(check(&mut s, &l, T0, 5), allowed(5, 500));
        assert_eq!(check(&mut s, &l, T0, 5), allowed(0, 1000));
        assert_eq!(check(&mut s, &l, T0, 5), denied(0, 1000, Some(500)));
        assert_eq!(assert_retry_exact(&s, &l, T0 + 250 * MS, 5), 250);
    }

    #[test]
    fn token_bucket_refund_never_ahead_of_now() {
        let l = bucket(10, 1000, 10);
        let mut s = TierState::new(&l);
        s.commit(&l, T0, 6);
        s.refund(&l, T0, 2);
        assert_eq!(s.evaluate(&l, T0, 0), allowed(6, 400));
        s.refund(&l, T0, 100);
        assert_eq!(s.evaluate(&l, T0, 0), allowed(10, 0));
        assert_eq!(s.evaluate(&l, T0, 11).retry_ms, None);
        assert!(s.is_idle(&l, T0));
        // Refund on a fresh bucket: still full.
        let mut f = TierState::new(&l);
        f.refund(&l, T0, 5);
        assert_eq!(f.evaluate(&l, T0, 10), allowed(0, 1000));
    }

    #[test]
    fn token_bucket_keeps_the_fraction_of_the_tat() {
        // 3 per second: e = 333 333.33… µs; three units fit exactly.
        let l = bucket(3, 1000, 3);
        let mut s = TierState::new(&l);
        for _ in 0..3 {
            assert!(s.evaluate(&l, T0, 1).allowed);
            s.commit(&l, T0, 1);
        }
        assert!(
            matches!(s.state, State::Gcra { t_us, .. } if t_us == T0 + 999_999 || t_us == T0 + 1_000_000)
        );
        assert!(!s.evaluate(&l, T0, 1).allowed);
    }

    #[test]
    fn token_bucket_long_windows() {
        // 90 per 90 minutes (one a minute), burst 5.
        let l = bucket(90, 90 * 60_000, 5);
        let mut s = TierState::new(&l);
        assert_eq!(check(&mut s, &l, T0, 5), allowed(0, 300_000));
        assert_eq!(assert_retry_exact(&s, &l, T0, 2), 120_000);
        assert_eq!(assert_retry_exact(&s, &l, T0 + 1234, 2), 119_999);
        // 7 per 7 s, burst 1.
        let l = bucket(7, 7000, 1);
        let mut s = TierState::new(&l);
        assert!(check(&mut s, &l, T0, 1).allowed);
        assert_eq!(assert_retry_exact(&s, &l, T0 + 1, 1), 1000);
    }

    /// Documents a defect of `decide.lua` that this model reproduces
    /// faithfully: with a non-integer emission interval, `new_tat - now_us`
    /// is computed from `now_us + c * e` at ~1.7e15, where doubles are 0.25 µs
    /// apart, and can exceed `tau` for `c == burst` on an empty bucket. Such a
    /// request is then denied forever with `retry_ms = 1`. To be fixed in the
    /// script and here together (compare `(tat - now_us) + c * e`, exact in
    /// the integer part, with `tau`).
    #[test]
    fn token_bucket_full_burst_on_an_empty_bucket_passes() {
        let l = bucket(3, 1000, 2);
        let s = TierState::new(&l);
        for k in 0..100 {
            assert!(s.evaluate(&l, T0 + k, 2).allowed, "at T0 + {k} µs");
        }
    }

    // ----- sliding log --------------------------------------------------

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
    fn sliding_log_refund_pops_the_newest_and_never_below_zero() {
        let l = log(4, 1000);
        let t = T0;
        let mut s = TierState::new(&l);
        s.refund(&l, t, 2);
        assert_eq!(s, TierState::new(&l));
        s.commit(&l, t, 2);
        s.commit(&l, t + 500 * MS, 2);
        s.refund(&l, t + 600 * MS, 1);
        // Left: 2 at t, 1 at t + 500 ms.
        assert_eq!(s.evaluate(&l, t + 600 * MS, 0).remaining, 1);
        assert_eq!(s.evaluate(&l, t + 1000 * MS, 0).remaining, 3);
        s.refund(&l, t + 600 * MS, 10);
        assert_eq!(s.evaluate(&l, t + 600 * MS, 4), allowed(0, 1000));
        assert!(s.is_idle(&l, t + 600 * MS));
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

    // ----- all algorithms -----------------------------------------------

    #[test]
    fn a_changed_algorithm_resets_the_state() {
        let old = fixed(2, 1000);
        let mut s = TierState::new(&old);
        s.commit(&old, T0, 2);
        assert!(!s.evaluate(&old, T0, 1).allowed);
        for new in [sliding(2, 1000), bucket(2, 1000, 2), log(2, 1000)] {
            assert!(s.is_idle(&new, T0));
            assert_eq!(s.evaluate(&new, T0, 2).remaining, 0);
            assert!(s.evaluate(&new, T0, 2).allowed);
            let mut t = s.clone();
            t.refund(&new, T0, 1);
            assert_eq!(t.algorithm(), new.algorithm);
            assert!(t.is_idle(&new, T0));
            assert_eq!(
                t.evaluate(&new, T0, 2),
                TierState::new(&new).evaluate(&new, T0, 2)
            );
            t.commit(&new, T0, 2);
            assert_eq!(t.algorithm(), new.algorithm);
            assert!(!t.evaluate(&new, T0, 1).allowed);
        }
    }

    #[test]
    fn idle_states() {
        let t = aligned(1000);
        let l = fixed(5, 1000);
        let mut s = TierState::new(&l);
        assert!(s.is_idle(&l, t));
        s.commit(&l, t, 1);
        assert!(!s.is_idle(&l, t + 999 * MS));
        assert!(s.is_idle(&l, t + 1000 * MS));
        s.refund(&l, t, 1);
        assert!(s.is_idle(&l, t));

        let l = sliding(5, 1000);
        let mut s = TierState::new(&l);
        assert!(s.is_idle(&l, t));
        s.commit(&l, t, 1);
        assert!(!s.is_idle(&l, t));
        assert!(!s.is_idle(&l, t + 1999 * MS));
        assert!(s.is_idle(&l, t + 2000 * MS));

        let l = bucket(10, 1000, 10);
        let mut s = TierState::new(&l);
        assert!(s.is_idle(&l, t));
        s.commit(&l, t, 2);
        assert!(!s.is_idle(&l, t + 199 * MS));
        assert!(s.is_idle(&l, t + 200 * MS));

        let l = log(5, 1000);
        let mut s = TierState::new(&l);
        assert!(s.is_idle(&l, t));
        s.commit(&l, t, 1);
        assert!(!s.is_idle(&l, t + 999 * MS));
        assert!(s.is_idle(&l, t + 1000 * MS));
    }

    #[test]
    fn idle_means_indistinguishable_from_fresh() {
        let t = aligned(1000);
        for l in [
            fixed(3, 1000),
            sliding(3, 1000),
            bucket(3, 1000, 3),
            log(3, 1000),
        ] {
            let mut s = TierState::new(&l);
            s.commit(&l, t, 2);
            let mut at = t;
            while !s.is_idle(&l, at) {
                at += 50 * MS;
            }
            let fresh = TierState::new(&l);
            for later in [at, at + 1, at + 777 * MS, at + 5000 * MS] {
                for cost in [0, 1, 3, 4] {
                    assert_eq!(
                        s.evaluate(&l, later, cost),
                        fresh.evaluate(&l, later, cost),
                        "{:?}",
                        l.algorithm
                    );
                }
            }
        }
    }

    // ----- properties ---------------------------------------------------

    /// (µs to advance, cost) steps.
    fn steps(max_advance_us: u64, max_cost: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
        prop::collection::vec((0..max_advance_us, 1..=max_cost), 1..150)
    }

    fn any_algorithm() -> impl Strategy<Value = Algorithm> {
        prop_oneof![
            Just(Algorithm::FixedWindow),
            Just(Algorithm::SlidingWindow),
            Just(Algorithm::TokenBucket),
            Just(Algorithm::SlidingLog),
        ]
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

        /// GCRA: the units allowed between two instants never exceed
        /// `burst + elapsed / e` (slack for the script's float rounding).
        #[test]
        fn token_bucket_never_exceeds_burst_plus_rate(
            limit in 1u64..60,
            window_ms in 1u64..5000,
            burst in 1u64..80,
            ops in steps(300_000, 5),
        ) {
            let l = bucket(limit, window_ms, burst);
            let (e, tau) = gcra_params(&l);
            let mut s = TierState::new(&l);
            let mut now = T0;
            let mut passed: Vec<(u64, u64)> = Vec::new();
            for (advance, cost) in ops {
                now += advance;
                if check(&mut s, &l, now, cost).allowed {
                    passed.push((now, cost));
                    let mut units = 0;
                    for (i, &(at, c)) in passed.iter().enumerate().rev() {
                        units += c;
                        let slack = 1.0 + 0.25 * (passed.len() - i) as f64;
                        prop_assert!(
                            units as f64 * e <= (now - at) as f64 + tau + slack,
                            "{} units in {} µs (e = {}, tau = {})", units, now - at, e, tau
                        );
                    }
                }
            }
        }

        /// With a whole number of µs per unit the arithmetic is exact: no
        /// slack, and `retry_ms` is exact.
        #[test]
        fn token_bucket_exact_with_whole_emission_intervals(
            limit in 1u64..60,
            ms_per_unit in 1u64..200,
            burst in 1u64..80,
            ops in steps(300_000, 5),
        ) {
            let l = bucket(limit, limit * ms_per_unit, burst);
            let e = ms_per_unit * MS;
            let mut s = TierState::new(&l);
            let mut now = T0;
            let mut passed: Vec<(u64, u64)> = Vec::new();
            for (advance, cost) in ops {
                now += advance;
                let ev = s.evaluate(&l, now, cost);
                if ev.allowed {
                    s.commit(&l, now, cost);
                    passed.push((now, cost));
                    let mut units = 0;
                    for &(at, c) in passed.iter().rev() {
                        units += c;
                        prop_assert!(units * e <= now - at + burst * e);
                    }
                } else if cost <= burst {
                    let r = ev.retry_ms.unwrap();
                    prop_assert!(s.evaluate(&l, now + r * MS, cost).allowed);
                    prop_assert!(!s.evaluate(&l, now + (r - 1) * MS, cost).allowed);
                } else {
                    prop_assert_eq!(ev.retry_ms, None);
                }
            }
        }

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

        /// Whatever is committed and refunded, `remaining` never exceeds the
        /// capacity (the limit; the burst for a token bucket).
        #[test]
        fn refund_never_makes_remaining_exceed_the_capacity(
            algorithm in any_algorithm(),
            limit in 1u64..20,
            window_ms in 1u64..3000,
            burst in 1u64..30,
            ops in prop::collection::vec((0u64..1_000_000, 0u64..25, any::<bool>()), 1..150),
        ) {
            let l = Limit {
                burst: if algorithm == Algorithm::TokenBucket { burst } else { limit },
                ..lim(algorithm, limit, window_ms)
            };
            let capacity = l.burst;
            let mut s = TierState::new(&l);
            let mut now = T0;
            for (advance, cost, refund) in ops {
                now += advance;
                if refund {
                    s.refund(&l, now, cost);
                } else {
                    check(&mut s, &l, now, cost);
                }
                for c in [0, 1] {
                    let ev = s.evaluate(&l, now, c);
                    prop_assert!(ev.remaining <= capacity, "{:?} > {}", ev, capacity);
                }
            }
        }

        /// Refunding at once what was just committed restores every answer.
        /// (A token bucket only with a whole number of µs per unit: the stored
        /// TAT is rounded up, so otherwise up to 1 µs of it stays behind.)
        #[test]
        fn commit_then_refund_is_a_no_op(
            algorithm in any_algorithm(),
            limit in 1u64..20,
            window_ms in 1u64..3000,
            ops in steps(1_000_000, 5),
            cost in 1u64..10,
        ) {
            let window_ms = if algorithm == Algorithm::TokenBucket {
                limit * (window_ms % 200 + 1)
            } else {
                window_ms
            };
            let l = lim(algorithm, limit, window_ms);
            let mut s = TierState::new(&l);
            let mut now = T0;
            for (advance, c) in ops {
                now += advance;
                check(&mut s, &l, now, c);
            }
            let before = s.clone();
            s.commit(&l, now, cost);
            s.refund(&l, now, cost);
            for later in [now, now + 1, now + 333 * MS, now + 2 * window_ms * MS] {
                for c in [0, 1, cost] {
                    prop_assert_eq!(s.evaluate(&l, later, c), before.evaluate(&l, later, c));
                }
            }
        }
    }
}
