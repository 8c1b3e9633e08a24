//! Lock conflicts between appliers (deadlocks, serialization failures, lock timeouts: see
//! [`crate::db::CONTENTION_SQLSTATES`]) are transient: the streams whose apply met one go back
//! to the drain after a short jittered delay — 10 ms, growing by half while conflicts persist,
//! at most 250 ms — never after the failure backoff, and nothing is counted against their
//! events. The other streams of the batch carry on at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::queue::{DrainQueue, Offer};

/// The first retry delay after a conflict.
const FIRST: Duration = Duration::from_millis(10);
/// The longest retry delay while conflicts persist.
const MAX: Duration = Duration::from_millis(250);

/// How long conflicts have persisted: drain rounds in a row (any consumer's) that met one.
#[derive(Default)]
pub(super) struct ContentionBackoff {
    streak: AtomicU32,
}

impl ContentionBackoff {
    /// A round met a conflict: the delay before its contended streams are drained again.
    pub(super) fn next_delay(&self) -> Duration {
        let streak = self.streak.fetch_add(1, Ordering::Relaxed);
        // Uniform in [0, 1): 53 random bits of a v4 UUID (its low 62 bits are all random).
        let bits = Uuid::new_v4().as_u128() as u64 & ((1u64 << 53) - 1);
        let unit = bits as f64 / (1u64 << 53) as f64;
        delay(streak, unit)
    }

    /// A round met no conflict: the next one starts from the first delay again.
    pub(super) fn calm(&self) {
        self.streak.store(0, Ordering::Relaxed);
    }
}

/// The delay after `streak` earlier conflicted rounds in a row: `FIRST` × 1.5^streak, at most
/// `MAX`, jittered down by up to half (`unit` in [0, 1)) so that appliers that conflicted with
/// each other do not come back in step.
fn delay(streak: u32, unit: f64) -> Duration {
    let grown = FIRST.as_secs_f64() * 1.5f64.powi(streak.min(32) as i32);
    let base = grown.min(MAX.as_secs_f64());
    Duration::from_secs_f64(base * (1.0 - 0.5 * unit.clamp(0.0, 1.0)))
}

/// Offer `streams` to the drain again after `delay` (a running drain of one takes another
/// pass), unless the worker is stopping by then.
pub(super) fn retry_later(
    queue: &Arc<DrainQueue>,
    shutdown: &CancellationToken,
    streams: impl IntoIterator<Item = Uuid> + Send + 'static,
    delay: Duration,
) {
    let (queue, shutdown) = (queue.clone(), shutdown.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(delay) => {
                for s in streams {
                    queue.offer(s, Offer::Signal);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_starts_at_tens_of_milliseconds_and_grows_gently_to_a_cap() {
        let ms = |streak, unit| delay(streak, unit).as_secs_f64() * 1000.0;
        assert!((ms(0, 0.0) - 10.0).abs() < 1e-6);
        assert!((ms(0, 0.999) - 5.0).abs() < 0.01, "jitter: down to half");
        assert!((ms(1, 0.0) - 15.0).abs() < 1e-6);
        assert!((ms(4, 0.0) - 50.625).abs() < 1e-6);
        assert_eq!(ms(9, 0.0), 250.0, "capped");
        assert_eq!(ms(u32::MAX, 0.0), 250.0);
        let b = ContentionBackoff::default();
        let first = b.next_delay();
        assert!(
            first >= Duration::from_millis(5) && first <= FIRST,
            "{first:?}"
        );
        for _ in 0..20 {
            assert!(b.next_delay() <= MAX);
        }
        b.calm();
        assert!(b.next_delay() <= FIRST);
    }
}
