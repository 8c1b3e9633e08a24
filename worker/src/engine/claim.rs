//! The claim loop: the only part of the worker that polls the database for new work.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::Ctx;
use crate::store::claim::ClaimArgs;

/// The wait before the next poll: the tight interval while NOTIFY is unavailable, the relaxed
/// safety net while it is healthy, growing with consecutive empty polls up to the cap.
pub(crate) fn next_interval(ctx: &Ctx, empty_polls: u64) -> Option<Duration> {
    let opts = &ctx.config.claim_worker;
    let healthy = ctx.listener_healthy.load(Ordering::Relaxed);
    if healthy && !opts.enable_safety_net_poll {
        return None;
    }
    let base = if healthy {
        opts.polling_interval_milliseconds
            .max(opts.notify_healthy_polling_interval_milliseconds)
    } else {
        opts.polling_interval_milliseconds
    };
    // Never sleep so long that our own heartbeat-based liveness looks stale to peers' claims.
    let cap = opts
        .polling_max_interval_milliseconds
        .min(ctx.config.worker.abandon_stale_instance_threshold_seconds as u64 * 1000 / 3)
        .max(base);
    let shift = empty_polls.saturating_sub(1).min(16) as u32;
    Some(Duration::from_millis(
        base.saturating_mul(1 << shift).min(cap),
    ))
}

/// One `claim_work` call.
pub(crate) async fn claim(ctx: &Ctx) -> Result<Vec<Uuid>, sqlx::Error> {
    let started = Instant::now();
    let streams = ctx
        .store
        .claim_work(ClaimArgs {
            instance_id: ctx.instance_id,
            max_streams: ctx.config.claim_worker.max_streams_per_batch as i32,
            lease_seconds: ctx.config.worker.lease_seconds as i32,
            stale_seconds: ctx.config.worker.abandon_stale_instance_threshold_seconds as f64,
        })
        .await;
    ctx.metrics
        .claim_duration
        .observe(started.elapsed().as_secs_f64());
    streams
}

pub(crate) async fn run(ctx: Arc<Ctx>) {
    let idle_threshold = ctx.config.worker.idle_threshold_polls as u64;
    loop {
        if ctx.shutdown.is_cancelled() {
            return;
        }
        let streams = match claim(&ctx).await {
            Ok(s) => {
                ctx.first_claim_done();
                s
            }
            Err(e) => {
                tracing::warn!(error = %crate::db::describe_error(&e, None), "claim_work failed");
                Vec::new()
            }
        };
        let n = streams.len();
        if n == 0 {
            ctx.metrics.empty_batches.inc();
        }
        for stream in streams {
            // A full channel is fine: held streams are offered again on the next poll.
            if ctx.drain_tx.try_send(stream).is_err() {
                break;
            }
        }
        ctx.hooks.record_poll(n, idle_threshold);
        let wait = next_interval(&ctx, ctx.hooks.consecutive_empty_polls());
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = ctx.hooks.wake_requested() => {}
            _ = async {
                match wait {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}
