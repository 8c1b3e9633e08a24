//! The claim loop: the only part of the worker that polls the database for new work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use uuid::Uuid;

use super::Shared;
use crate::config::ClaimWorkerOptions;
use crate::http::Readiness;
use crate::store::claim::ClaimArgs;

/// The claim task: polls, feeds the drain channel, marks the engine ready after its first claim.
pub(crate) struct ClaimLoop {
    pub shared: Arc<Shared>,
    /// Streams to drain, out.
    pub drain_tx: mpsc::Sender<Uuid>,
    /// Whether the LISTEN connection is up (set by the listener).
    pub listener_healthy: Arc<AtomicBool>,
    pub readiness: Readiness,
    /// When a claim last found work, out (the job runner paces itself by it).
    pub last_work: Arc<super::jobs::LastWork>,
}

/// The wait before the next poll: the tight interval while NOTIFY is unavailable, however long
/// the polls have been empty (the poll is then the only way to see new work, so backing off
/// would add the outage to every event's latency); while it is healthy the relaxed safety net
/// (none at all without `enableSafetyNetPoll`), doubling with consecutive empty polls up to the
/// cap — never so long that our own heartbeat-based liveness would look stale to peers (a third
/// of `abandon_threshold_seconds`).
pub(crate) fn next_interval(
    opts: &ClaimWorkerOptions,
    abandon_threshold_seconds: u32,
    healthy: bool,
    empty_polls: u64,
) -> Option<Duration> {
    if !healthy {
        return Some(Duration::from_millis(opts.polling_interval_milliseconds));
    }
    if !opts.enable_safety_net_poll {
        return None;
    }
    let base = opts
        .polling_interval_milliseconds
        .max(opts.notify_healthy_polling_interval_milliseconds);
    let cap = opts
        .polling_max_interval_milliseconds
        .min(abandon_threshold_seconds as u64 * 1000 / 3)
        .max(base);
    let shift = empty_polls.saturating_sub(1).min(16) as u32;
    Some(Duration::from_millis(
        base.saturating_mul(1 << shift).min(cap),
    ))
}

/// Whether more work is waiting than this claim handed out (it returned a full batch, or the
/// drain channel could not take all of it): then claim again as soon as the drain has taken what
/// it has, rather than after the safety-net interval (no doorbell rings for streams that were
/// already pinned).
pub(crate) fn claim_again_when_drained(claimed: usize, sent: usize, max_streams: usize) -> bool {
    claimed > 0 && (claimed >= max_streams || sent < claimed)
}

impl ClaimLoop {
    /// Returns once the drain consumers have taken every stream id from the channel.
    async fn drained(&self) {
        while self.drain_tx.capacity() < self.drain_tx.max_capacity() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// One `claim_work` call.
    async fn claim(&self) -> Result<Vec<Uuid>, sqlx::Error> {
        let shared = &self.shared;
        let started = Instant::now();
        let streams = shared
            .store
            .claim_work(ClaimArgs {
                instance_id: shared.instance_id,
                max_streams: shared.config.claim_worker.max_streams_per_batch as i32,
                stale_seconds: shared
                    .config
                    .worker
                    .abandon_stale_instance_threshold_seconds as f64,
            })
            .await;
        shared
            .metrics
            .claim_duration
            .observe(started.elapsed().as_secs_f64());
        streams
    }

    pub(crate) async fn run(self) {
        let shared = &self.shared;
        let idle_threshold = shared.config.worker.idle_threshold_polls as u64;
        let mut ready = false;
        loop {
            if shared.shutdown.is_cancelled() {
                return;
            }
            let streams = match self.claim().await {
                Ok(s) => {
                    if !ready {
                        ready = true;
                        self.readiness.set_ready();
                        tracing::info!(instance_id = %shared.instance_id, "first claim succeeded; ready");
                    }
                    s
                }
                Err(e) => {
                    tracing::warn!(error = %crate::db::describe_error(&e, None), "claim_work failed");
                    Vec::new()
                }
            };
            let n = streams.len();
            if n > 0 {
                self.last_work.record();
            }
            if n == 0 {
                shared.metrics.empty_batches.inc();
            }
            let mut sent = 0;
            for stream in streams {
                // A full channel is fine: held streams are offered again on the next poll.
                if self.drain_tx.try_send(stream).is_err() {
                    break;
                }
                sent += 1;
            }
            shared.hooks.record_poll(n, idle_threshold);
            let wait = next_interval(
                &shared.config.claim_worker,
                shared
                    .config
                    .worker
                    .abandon_stale_instance_threshold_seconds,
                self.listener_healthy.load(Ordering::Relaxed),
                shared.hooks.consecutive_empty_polls(),
            );
            let backlog = claim_again_when_drained(
                n,
                sent,
                shared.config.claim_worker.max_streams_per_batch as usize,
            );
            tokio::select! {
                _ = shared.shutdown.cancelled() => return,
                _ = shared.hooks.wake_requested() => {}
                _ = self.drained(), if backlog => {}
                _ = async {
                    match wait {
                        Some(d) => tokio::time::sleep(d).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Option<Duration> {
        Some(Duration::from_millis(v))
    }

    /// The waits after 0, 1, 2, … consecutive empty polls.
    fn waits(
        opts: &ClaimWorkerOptions,
        stale_seconds: u32,
        healthy: bool,
    ) -> Vec<Option<Duration>> {
        (0..7)
            .map(|empty| next_interval(opts, stale_seconds, healthy, empty))
            .collect()
    }

    #[test]
    fn a_full_claim_or_a_full_channel_claims_again_once_drained() {
        assert!(claim_again_when_drained(1000, 1000, 1000), "a full batch");
        assert!(
            claim_again_when_drained(300, 120, 1000),
            "the channel took only part"
        );
        assert!(
            !claim_again_when_drained(300, 300, 1000),
            "everything was handed out"
        );
        assert!(!claim_again_when_drained(0, 0, 1000), "nothing to do");
    }

    #[test]
    fn polling_interval_stays_tight_while_notify_is_down() {
        let opts = ClaimWorkerOptions {
            polling_interval_milliseconds: 100,
            polling_max_interval_milliseconds: 1000,
            ..Default::default()
        };
        assert_eq!(waits(&opts, 30, false), [ms(100); 7]);
        assert_eq!(next_interval(&opts, 30, false, u64::MAX), ms(100));
        // Also without the safety net: the poll is the only way to see work.
        let no_net = ClaimWorkerOptions {
            enable_safety_net_poll: false,
            ..opts
        };
        assert_eq!(waits(&no_net, 30, false), [ms(100); 7]);
    }

    #[test]
    fn polling_max_interval_milliseconds_caps_the_backoff() {
        let opts = |max| ClaimWorkerOptions {
            polling_interval_milliseconds: 100,
            notify_healthy_polling_interval_milliseconds: 100,
            polling_max_interval_milliseconds: max,
            ..Default::default()
        };
        assert_eq!(
            waits(&opts(1000), 30, true),
            [
                ms(100),
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1000),
                ms(1000)
            ]
        );
        // Many empty polls do not overflow.
        assert_eq!(next_interval(&opts(1000), 30, true, u64::MAX), ms(1000));
        assert_eq!(next_interval(&opts(300), 30, true, 6), ms(300));
        assert_eq!(next_interval(&opts(5000), 30, true, 6), ms(3200));
        // A cap below the base interval does not shorten the base.
        assert_eq!(next_interval(&opts(50), 30, true, 6), ms(100));
        // Nor may the backoff outgrow a third of the abandon threshold.
        assert_eq!(next_interval(&opts(5000), 1, true, 6), ms(333));
    }

    #[test]
    fn notify_healthy_polling_interval_milliseconds_is_the_base_while_notify_is_healthy() {
        let opts = ClaimWorkerOptions {
            polling_interval_milliseconds: 100,
            notify_healthy_polling_interval_milliseconds: 700,
            polling_max_interval_milliseconds: 5000,
            ..Default::default()
        };
        assert_eq!(
            waits(&opts, 30, true),
            [
                ms(700),
                ms(700),
                ms(1400),
                ms(2800),
                ms(5000),
                ms(5000),
                ms(5000)
            ]
        );
        // Without NOTIFY the tight interval applies.
        assert_eq!(next_interval(&opts, 30, false, 1), ms(100));
        // It never makes polling tighter than pollingIntervalMilliseconds.
        let tighter = ClaimWorkerOptions {
            notify_healthy_polling_interval_milliseconds: 10,
            ..opts
        };
        assert_eq!(next_interval(&tighter, 30, true, 1), ms(100));
    }

    #[test]
    fn enable_safety_net_poll_false_stops_timed_polls_only_while_notify_is_healthy() {
        let opts = ClaimWorkerOptions {
            polling_interval_milliseconds: 100,
            enable_safety_net_poll: false,
            ..Default::default()
        };
        assert_eq!(waits(&opts, 30, true), [None; 7]);
        assert_eq!(next_interval(&opts, 30, false, 1), ms(100));
        let on = ClaimWorkerOptions {
            enable_safety_net_poll: true,
            ..opts
        };
        assert_eq!(next_interval(&on, 30, true, 1), ms(5000));
    }
}
