//! In-process twins of the Lua algorithms in `region-node/src/lua/decide.lua`.
//!
//! Used by the `local` fail mode (Redis unreachable), and as the reference
//! model the Lua script is tested against. Semantics match the script:
//! `evaluate` never mutates, `commit` charges, `refund` gives back without
//! going below zero.
//!
//! This module holds what the four algorithms share: [`TierState`], whose
//! methods dispatch on the algorithm, [`Evaluation`], the per-algorithm
//! state, and the script's window arithmetic (`Clock`). Each algorithm, with
//! its tests, is in its own module, one per section of the script:
//! `fixed_window`, `sliding_window`, `token_bucket` (GCRA), `sliding_log`.
//! Tests that run every algorithm are here.
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
//! (see `token_bucket_full_burst_on_an_empty_bucket_passes` in
//! `token_bucket`).
//!
//! Redis expiries (`PEXPIRE`/`PX`) are not modelled: every key outlives the
//! time during which its content can matter, so an expired key and a stale
//! one read the same. [`TierState::is_idle`] tells when a state can be dropped
//! for the same reason.

use std::collections::VecDeque;

use crate::config::{Algorithm, Limit};

mod fixed_window;
mod sliding_log;
mod sliding_window;
mod token_bucket;

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

/// What a commit does to a tier's state: the script's `commit()` and
/// `refund()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Charge,
    Refund,
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
            State::Fixed { window, count } => {
                fixed_window::evaluate(limit, clock, *window, *count, cost)
            }
            State::Sliding {
                window,
                current,
                previous,
            } => sliding_window::evaluate(limit, clock, *window, *current, *previous, cost),
            State::Gcra { t_us, frac } => token_bucket::evaluate(limit, clock, *t_us, *frac, cost),
            State::Log { runs } => sliding_log::evaluate(limit, clock, runs, cost),
        }
    }

    /// Charges `cost` at `now_us`, whatever `evaluate` said (the caller
    /// commits only what every tier allowed, like the script).
    pub fn commit(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        self.change(limit, now_us, cost, Change::Charge)
    }

    /// Gives `cost` back at `now_us`; never below zero, never ahead of now.
    pub fn refund(&mut self, limit: &Limit, now_us: u64, cost: u64) {
        self.change(limit, now_us, cost, Change::Refund)
    }

    /// Gives back the charge of `cost` made at `charged_at_ms` (a refund
    /// by handle, as the script does it): only into a window the charge
    /// was in (the same aligned window for fixed and sliding windows, one
    /// window length after it for the token bucket and the log), and for
    /// the sliding log the charge's own units, not any.
    pub fn refund_charge(&mut self, limit: &Limit, now_us: u64, cost: u64, charged_at_ms: u64) {
        self.reset_if_changed(limit);
        let clock = Clock::new(limit, now_us);
        let same_window = match limit.algorithm {
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                charged_at_ms / clock.w == clock.idx
            }
            Algorithm::TokenBucket | Algorithm::SlidingLog => {
                clock.now_ms.saturating_sub(charged_at_ms) < clock.w
            }
        };
        if !same_window {
            return;
        }
        match &mut self.state {
            State::Log { runs } => sliding_log::refund_charge(clock, runs, cost, charged_at_ms),
            _ => self.change(limit, now_us, cost, Change::Refund),
        }
    }

    fn change(&mut self, limit: &Limit, now_us: u64, cost: u64, change: Change) {
        self.reset_if_changed(limit);
        let clock = Clock::new(limit, now_us);
        match (&mut self.state, change) {
            (State::Fixed { window, count }, Change::Charge) => {
                fixed_window::commit(clock, window, count, cost)
            }
            (State::Fixed { window, count }, Change::Refund) => {
                fixed_window::refund(clock, window, count, cost)
            }
            (
                State::Sliding {
                    window,
                    current,
                    previous,
                },
                change,
            ) => sliding_window::change(clock, window, current, previous, cost, change),
            (State::Gcra { t_us, frac }, Change::Charge) => {
                token_bucket::commit(limit, clock, t_us, frac, cost)
            }
            (State::Gcra { t_us, frac }, Change::Refund) => {
                token_bucket::refund(limit, clock, t_us, frac, cost)
            }
            (State::Log { runs }, Change::Charge) => sliding_log::commit(clock, runs, cost),
            (State::Log { runs }, Change::Refund) => sliding_log::refund(clock, runs, cost),
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
            State::Fixed { window, count } => fixed_window::is_idle(clock, *window, *count),
            State::Sliding {
                window,
                current,
                previous,
            } => sliding_window::is_idle(clock, *window, *current, *previous),
            State::Gcra { t_us, frac } => token_bucket::is_idle(clock, *t_us, *frac),
            State::Log { runs } => sliding_log::is_idle(clock, runs),
        }
    }

    fn reset_if_changed(&mut self, limit: &Limit) {
        if self.state.algorithm() != limit.algorithm {
            self.state = State::fresh(limit.algorithm);
        }
    }
}

/// What the tests of every algorithm module use: instants, limits, and
/// the checks that a denial's `retry_ms` is exact.
#[cfg(test)]
mod test_support {
    use proptest::prelude::*;

    use super::*;

    /// 2023-11-14T22:13:20Z in µs: a whole second, not a whole minute.
    pub(super) const T0: u64 = 1_700_000_000_000_000;
    /// µs per ms.
    pub(super) const MS: u64 = 1000;

    pub(super) fn lim(algorithm: Algorithm, limit: u64, window_ms: u64) -> Limit {
        Limit {
            limit,
            window_ms,
            algorithm,
            burst: limit,
        }
    }

    pub(super) fn fixed(limit: u64, window_ms: u64) -> Limit {
        lim(Algorithm::FixedWindow, limit, window_ms)
    }

    pub(super) fn sliding(limit: u64, window_ms: u64) -> Limit {
        lim(Algorithm::SlidingWindow, limit, window_ms)
    }

    pub(super) fn bucket(limit: u64, window_ms: u64, burst: u64) -> Limit {
        Limit {
            burst,
            ..lim(Algorithm::TokenBucket, limit, window_ms)
        }
    }

    pub(super) fn log(limit: u64, window_ms: u64) -> Limit {
        lim(Algorithm::SlidingLog, limit, window_ms)
    }

    /// The first µs of a `window_ms` window at or after `T0`.
    pub(super) fn aligned(window_ms: u64) -> u64 {
        let w = window_ms * MS;
        T0.div_ceil(w) * w
    }

    /// One single-tier decision: evaluate, and commit when allowed.
    pub(super) fn check(s: &mut TierState, l: &Limit, now_us: u64, cost: u64) -> Evaluation {
        let ev = s.evaluate(l, now_us, cost);
        if ev.allowed {
            s.commit(l, now_us, cost);
        }
        ev
    }

    /// Denied at `now_us`; passes after exactly `retry_ms`, not 1 ms earlier.
    pub(super) fn assert_retry_exact(s: &TierState, l: &Limit, now_us: u64, cost: u64) -> u64 {
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

    pub(super) fn denied(remaining: u64, reset_ms: u64, retry_ms: Option<u64>) -> Evaluation {
        Evaluation {
            allowed: false,
            remaining,
            reset_ms,
            retry_ms,
        }
    }

    pub(super) fn allowed(remaining: u64, reset_ms: u64) -> Evaluation {
        Evaluation {
            allowed: true,
            remaining,
            reset_ms,
            retry_ms: Some(0),
        }
    }

    /// (µs to advance, cost) steps.
    pub(super) fn steps(
        max_advance_us: u64,
        max_cost: u64,
    ) -> impl Strategy<Value = Vec<(u64, u64)>> {
        prop::collection::vec((0..max_advance_us, 1..=max_cost), 1..150)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::test_support::*;
    use super::*;

    // ----- all algorithms -----------------------------------------------

    /// 3 units a second under each algorithm (burst 3).
    fn every_algorithm() -> [Limit; 4] {
        [
            fixed(3, 1000),
            sliding(3, 1000),
            bucket(3, 1000, 3),
            log(3, 1000),
        ]
    }

    #[test]
    fn evaluate_never_mutates() {
        for l in every_algorithm() {
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
        for l in every_algorithm() {
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

    fn any_algorithm() -> impl Strategy<Value = Algorithm> {
        prop_oneof![
            Just(Algorithm::FixedWindow),
            Just(Algorithm::SlidingWindow),
            Just(Algorithm::TokenBucket),
            Just(Algorithm::SlidingLog),
        ]
    }

    proptest! {
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

        /// Refunding at once what was just committed (by its handle)
        /// restores every answer.
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
            // By its handle: a sliding log gives back the charge's own
            // units (a free-form refund gives back the oldest instead).
            s.refund_charge(&l, now, cost, now / MS);
            for later in [now, now + 1, now + 333 * MS, now + 2 * window_ms * MS] {
                for c in [0, 1, cost] {
                    prop_assert_eq!(s.evaluate(&l, later, c), before.evaluate(&l, later, c));
                }
            }
        }
    }
}
