//! Repeated failures of one task: how long to wait before the next try (exponential, capped)
//! and what to log — the first failure, a reminder at most once a minute while they last, and
//! the recovery — instead of a line per try (with the database gone, a claim loop polling
//! every 250 ms logged four errors a second per pod).

use std::time::{Duration, Instant};

/// How often a lasting streak is logged again.
const REMIND_EVERY: Duration = Duration::from_secs(60);

/// The failures in a row of one task (e.g. "claim_work").
#[derive(Debug)]
pub(crate) struct FailureStreak {
    what: &'static str,
    base: Duration,
    cap: Duration,
    failures: u32,
    since: Option<Instant>,
    last_logged: Option<Instant>,
}

impl FailureStreak {
    /// Waits start at `base` and double up to `cap`.
    pub(crate) fn new(what: &'static str, base: Duration, cap: Duration) -> Self {
        FailureStreak {
            what,
            base,
            cap: cap.max(base),
            failures: 0,
            since: None,
            last_logged: None,
        }
    }

    /// The wait after `failures` failures in a row (1 = the first).
    pub(crate) fn delay_after(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(16);
        self.base.saturating_mul(1 << shift).min(self.cap)
    }

    /// Records a failure (`error` already described); logs it if it starts a streak or the last
    /// line is a minute old. Returns the wait before the next try.
    pub(crate) fn failed(&mut self, error: &str) -> Duration {
        let now = Instant::now();
        self.failures += 1;
        let since = *self.since.get_or_insert(now);
        let delay = self.delay_after(self.failures);
        match self.last_logged {
            None if delay.is_zero() => {
                // A streak that only paces the logs (the caller has its own waits).
                tracing::warn!(
                    task = self.what,
                    error,
                    "{} failed; retrying (logged again once a minute while it fails)",
                    self.what
                );
                self.last_logged = Some(now);
            }
            None => {
                tracing::warn!(task = self.what, error, retry_in = ?delay,
                    "{} failed; retrying with backoff (logged again once a minute while it fails)", self.what);
                self.last_logged = Some(now);
            }
            Some(at) if now.duration_since(at) >= REMIND_EVERY => {
                tracing::warn!(
                    task = self.what,
                    error,
                    failures = self.failures,
                    failing_for_seconds = now.duration_since(since).as_secs(),
                    "{} still failing: {} failures since {} s ago",
                    self.what,
                    self.failures,
                    now.duration_since(since).as_secs()
                );
                self.last_logged = Some(now);
            }
            Some(_) => {
                tracing::debug!(
                    task = self.what,
                    error,
                    failures = self.failures,
                    "{} failed again",
                    self.what
                );
            }
        }
        delay
    }

    /// Records a success; logs the recovery when it ends a streak.
    pub(crate) fn succeeded(&mut self) {
        if let Some(since) = self.since.take() {
            tracing::info!(
                task = self.what,
                failures = self.failures,
                failing_for_seconds = since.elapsed().as_secs(),
                "{} succeeded after {} failures in a row; database reachable",
                self.what,
                self.failures
            );
        }
        self.failures = 0;
        self.last_logged = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_and_reset_on_success() {
        let ms = Duration::from_millis;
        let mut s = FailureStreak::new("claim_work", ms(250), ms(5000));
        let waits: Vec<Duration> = (0..8).map(|_| s.failed("down")).collect();
        assert_eq!(
            waits,
            [250, 500, 1000, 2000, 4000, 5000, 5000, 5000].map(ms)
        );
        assert_eq!(s.failures, 8);
        s.succeeded();
        assert_eq!(s.failures, 0);
        assert_eq!(s.failed("down"), ms(250));
        // Many failures do not overflow.
        assert_eq!(s.delay_after(u32::MAX), ms(5000));
    }

    #[test]
    fn only_the_first_failure_of_a_streak_is_logged_at_once() {
        let mut s = FailureStreak::new("heartbeat", Duration::ZERO, Duration::ZERO);
        s.failed("a");
        let first = s.last_logged;
        assert!(first.is_some());
        s.failed("b");
        assert_eq!(s.last_logged, first, "the second is not logged again");
        s.succeeded();
        assert_eq!(s.last_logged, None);
        s.failed("c");
        assert_ne!(s.last_logged, first, "a new streak is logged");
    }
}
