//! Waiting for a condition with a deadline, never for a fixed time, and
//! per-suite time budgets.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often the wait helpers re-check their condition.
pub const POLL: Duration = Duration::from_millis(20);

/// How long a server may take to become ready before the caller fails.
/// Generous because CI builds in debug on 2 cores, often while compiling.
pub const START_DEADLINE: Duration = Duration::from_secs(60);

/// Polls `f` every [`POLL`] until it returns true; panics with `what` once
/// `deadline` has passed.
///
/// Each call of `f` is itself bounded by what remains of the deadline, so a
/// condition that hangs (an HTTP call to a SIGSTOPped server) still fails in
/// time instead of hanging the test.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(what, deadline, move || {
        let fut = f();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Like [`wait_until`], for a condition that produces a value: polls `f`
/// until it returns `Some(v)` and returns `v`.
pub async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        let remaining = deadline.saturating_sub(start.elapsed()).max(POLL);
        if let Ok(Some(v)) = tokio::time::timeout(remaining, f()).await {
            return v;
        }
        if start.elapsed() >= deadline {
            panic!("timed out after {deadline:?} waiting until {what}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The blocking form of [`wait_until`], for code outside an async context
/// (and for the synchronous `start` functions here).
pub fn wait_until_blocking(what: &str, deadline: Duration, mut f: impl FnMut() -> bool) {
    wait_for_blocking(what, deadline, || f().then_some(()))
}

/// The blocking form of [`wait_for`]: polls `f` until it returns `Some(v)`
/// and returns `v`; panics with `what` once `deadline` has passed.
pub fn wait_for_blocking<T>(what: &str, deadline: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() >= deadline {
            panic!("timed out after {deadline:?} waiting until {what}");
        }
        std::thread::sleep(POLL);
    }
}

/// A suite's share of the test time.
///
/// The whole test suite must stay under 15 minutes on 2 cores, and every
/// suite that starts heavy infrastructure (a partitioned cluster, a Redis
/// Cluster, Envoy) is given a share. Waits inside the suite are capped by
/// what is left of its budget ([`Budget::cap`]), so a suite that hangs fails
/// at its budget, naming what it waited for, instead of eating the other
/// suites' time. It is not a speed assertion: budgets are generous (several
/// times the usual run), and speed is measured by the benchmarks.
///
/// `TIERLIMIT_BUDGET_SCALE` (a float, default 1) stretches every budget for
/// a slower machine.
#[derive(Debug)]
pub struct Budget {
    name: &'static str,
    started: Instant,
    total: Duration,
}

impl Budget {
    /// Starts the clock of suite `name`, allowed `total`.
    pub fn start(name: &'static str, total: Duration) -> Budget {
        let scale = std::env::var("TIERLIMIT_BUDGET_SCALE")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .unwrap_or(1.0);
        Budget {
            name,
            started: Instant::now(),
            total: total.mul_f64(scale),
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// What is left (zero once spent).
    pub fn remaining(&self) -> Duration {
        self.total.saturating_sub(self.started.elapsed())
    }

    /// `deadline`, or what is left of the budget if that is less. Panics once
    /// the budget is spent: the suite has overrun its share.
    pub fn cap(&self, deadline: Duration) -> Duration {
        let left = self.remaining();
        assert!(
            !left.is_zero(),
            "suite {} overran its budget of {:?} (set TIERLIMIT_BUDGET_SCALE on a slow machine)",
            self.name,
            self.total
        );
        deadline.min(left).max(POLL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_caps_deadlines_to_what_is_left() {
        let b = Budget::start("unit", Duration::from_secs(60));
        assert_eq!(b.cap(Duration::from_secs(1)), Duration::from_secs(1));
        assert!(b.cap(Duration::from_secs(600)) <= Duration::from_secs(60));
    }

    #[test]
    #[should_panic(expected = "overran its budget")]
    fn a_spent_budget_fails_the_suite() {
        let b = Budget::start("unit", Duration::ZERO);
        b.cap(Duration::from_secs(1));
    }

    #[test]
    fn blocking_wait_returns_once_true() {
        let mut n = 0;
        wait_until_blocking("n reaches 3", Duration::from_secs(5), || {
            n += 1;
            n >= 3
        });
        assert_eq!(n, 3);
    }
}
