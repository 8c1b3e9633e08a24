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
}

/// The wait before the next poll: the tight interval while NOTIFY is unavailable, the relaxed
/// safety net while it is healthy (none at all without `enableSafetyNetPoll`), doubling with
/// consecutive empty polls up to the cap — never so long that our own heartbeat-based liveness
/// would look stale to peers (a third of `abandon_threshold_seconds`).
pub(crate) fn next_interval(
    opts: &ClaimWorkerOptions,
    abandon_threshold_seconds: u32,
    healthy: bool,
    empty_polls: u64,
) -> Option<Duration> {
    if healthy && !opts.enable_safety_net_poll {
        return None;
    }
    let base = if healthy {
        opts.polling_interval_milliseconds
            .max(opts.notify_healthy_polling_interval_milliseconds)
    } else {
        opts.polling_interval_milliseconds
    };
    let cap = opts
        .polling_max_interval_milliseconds
        .min(abandon_threshold_seconds as u64 * 1000 / 3)
        .max(base);
    let shift = empty_polls.saturating_sub(1).min(16) as u32;
    Some(Duration::from_millis(
        base.saturating_mul(1 << shift).min(cap),
    ))
}

impl ClaimLoop {
    /// One `claim_work` call.
    async fn claim(&self) -> Result<Vec<Uuid>, sqlx::Error> {
        let shared = &self.shared;
        let started = Instant::now();
        let streams = shared
            .store
            .claim_work(ClaimArgs {
                instance_id: shared.instance_id,
                max_streams: shared.config.claim_worker.max_streams_per_batch as i32,
                lease_seconds: shared.config.worker.lease_seconds as i32,
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
            if n == 0 {
                shared.metrics.empty_batches.inc();
            }
            for stream in streams {
                // A full channel is fine: held streams are offered again on the next poll.
                if self.drain_tx.try_send(stream).is_err() {
                    break;
                }
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
            tokio::select! {
                _ = shared.shutdown.cancelled() => return,
                _ = shared.hooks.wake_requested() => {}
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
