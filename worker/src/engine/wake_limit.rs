//! The pace of claims a doorbell may start: a token bucket.
//!
//! Any role that may connect can `NOTIFY <schema>_work` (PostgreSQL has no rights on channels),
//! and each notification wakes the claim loop at once: 20 000 spoofed notifications made 2 768
//! claims in 4 s. Genuine doorbells ring once per stream going from no pending work to some
//! (none while every worker is awake: the claim loop then takes a token as if they had), and
//! the loop folds the ones that arrive while it claims, so they rarely come faster than a claim
//! takes; the bucket lets [`BURST`] through at once and then [`PER_SECOND`] a second, which costs
//! a genuine doorbell nothing unless it comes in such a flood (and then at most 1/[`PER_SECOND`]
//! of waiting, while the claim that follows takes every stream that rang meanwhile).
//!
//! Doorbells after a claim that found work are paced too, though genuine ones on idle streams
//! come faster than [`PER_SECOND`] at a few hundred events a second (each event then waits about
//! half a token for its claim). Measured on 2026-12-03: unpaced, the live p50 at 500 events/s
//! with fsync off fell from 9 to 6 ms, but with durable commits every claim's own commit competed
//! with the producers' (1 000 events/s asked: 520 reached against 700–860, p50 24.5 against
//! 20–22 ms, 3 workers worse as well).
//!
//! The pace is the deployment's: each of its live workers (as its last heartbeat counted them)
//! refills at its share of [`PER_SECOND`] and holds its share of [`BURST`]. Every worker hears
//! every doorbell, and each claim is followed by a `wh_drain` call: three workers at the full
//! pace made three times the calls of one for the same events, each with a third of the events,
//! and on 2 cores left the producers at 300–650 of 1 000 events/s asked (issue 28). A worker that
//! died without deregistering counts until the stale threshold; the survivors' pace is lower for
//! that long.

use std::time::{Duration, Instant};

/// Wake-ups let through at once.
pub const BURST: f64 = 20.0;
/// Wake-ups let through per second after the burst.
pub const PER_SECOND: f64 = 100.0;

#[derive(Debug)]
pub struct WakeLimiter {
    tokens: f64,
    refilled: Instant,
}

impl WakeLimiter {
    pub fn new(now: Instant) -> Self {
        WakeLimiter {
            tokens: BURST,
            refilled: now,
        }
    }

    /// How long a wake-up at `now` waits before its claim (zero while tokens are left); takes
    /// its token.
    pub fn take(&mut self, now: Instant) -> Duration {
        self.take_share(now, 1)
    }

    /// As [`WakeLimiter::take`], for one of `workers` live workers of a deployment: each refills
    /// at its share of the rate and holds its share of the burst.
    pub fn take_share(&mut self, now: Instant, workers: usize) -> Duration {
        let workers = workers.max(1) as f64;
        let (rate, burst) = (PER_SECOND / workers, (BURST / workers).max(1.0));
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(burst);
        self.refilled = now;
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / rate)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rate_holds() {
        let t0 = Instant::now();
        let mut limiter = WakeLimiter::new(t0);
        for _ in 0..BURST as usize {
            assert_eq!(limiter.take(t0), Duration::ZERO);
        }
        // The next waits one token's refill, the one after two.
        let wait = limiter.take(t0);
        assert!(
            (wait.as_secs_f64() - 1.0 / PER_SECOND).abs() < 1e-9,
            "{wait:?}"
        );
        let wait = limiter.take(t0);
        assert!(
            (wait.as_secs_f64() - 2.0 / PER_SECOND).abs() < 1e-9,
            "{wait:?}"
        );
    }

    #[test]
    fn each_of_the_live_workers_holds_its_share_of_the_burst_and_the_rate() {
        let t0 = Instant::now();
        let mut limiter = WakeLimiter::new(t0);
        // Two live workers: 10 at once, then one every 20 ms.
        for _ in 0..(BURST / 2.0) as usize {
            assert_eq!(limiter.take_share(t0, 2), Duration::ZERO);
        }
        let wait = limiter.take_share(t0, 2);
        assert!(
            (wait.as_secs_f64() - 2.0 / PER_SECOND).abs() < 1e-9,
            "{wait:?}"
        );
        // Four: a token every 40 ms.
        let mut limiter = WakeLimiter::new(t0);
        for i in 0..100u64 {
            let at = t0 + Duration::from_secs_f64(i as f64 * 4.0 / PER_SECOND);
            assert_eq!(limiter.take_share(at, 4), Duration::ZERO, "wake-up {i}");
        }
        // However many workers, a lone doorbell is never held back.
        let mut limiter = WakeLimiter::new(t0);
        assert_eq!(limiter.take_share(t0, 1000), Duration::ZERO);
        let mut limiter = WakeLimiter::new(t0);
        for _ in 0..BURST as usize {
            assert_eq!(limiter.take_share(t0, 0), Duration::ZERO, "0 counts as 1");
        }
    }

    #[test]
    fn wake_ups_at_the_rate_never_wait() {
        let t0 = Instant::now();
        let mut limiter = WakeLimiter::new(t0);
        for i in 0..1000u64 {
            let at = t0 + Duration::from_secs_f64(i as f64 / PER_SECOND);
            assert_eq!(limiter.take(at), Duration::ZERO, "wake-up {i}");
        }
    }

    #[test]
    fn a_flood_is_held_to_the_rate() {
        let t0 = Instant::now();
        let mut limiter = WakeLimiter::new(t0);
        // 20 000 wake-ups within a millisecond: the claims they start (each after its wait)
        // spread over 200 s, not 4.
        let mut last = Duration::ZERO;
        for _ in 0..20_000 {
            last = limiter.take(t0 + Duration::from_millis(1));
        }
        assert!(last.as_secs_f64() > 199.0, "{last:?}");
    }
}
