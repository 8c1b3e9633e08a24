//! The claim loop: the only part of the worker that polls the database for new work.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::Ctx;
use crate::config::ClaimWorkerOptions;
use crate::store::claim::ClaimArgs;

/// The wait before the next poll: the tight interval while NOTIFY is unavailable, the relaxed
/// safety net while it is healthy (none when the safety net is off), doubling with consecutive
/// empty polls up to the cap. `stale_seconds` is the abandon threshold: never sleep so long that
/// our own liveness looks stale to peers' claims.
pub(crate) fn next_interval(
    opts: &ClaimWorkerOptions,
    stale_seconds: u32,
    listener_healthy: bool,
    empty_polls: u64,
) -> Option<Duration> {
    if listener_healthy && !opts.enable_safety_net_poll {
        return None;
    }
    let base = if listener_healthy {
        opts.polling_interval_milliseconds
            .max(opts.notify_healthy_polling_interval_milliseconds)
    } else {
        opts.polling_interval_milliseconds
    };
    let cap = opts
        .polling_max_interval_milliseconds
        .min(stale_seconds as u64 * 1000 / 3)
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
        let wait = next_interval(
            &ctx.config.claim_worker,
            ctx.config.worker.abandon_stale_instance_threshold_seconds,
            ctx.listener_healthy.load(Ordering::Relaxed),
            ctx.hooks.consecutive_empty_polls(),
        );
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
    fn polling_interval_doubles_per_empty_poll_up_to_the_max_interval() {
        let opts = ClaimWorkerOptions {
            polling_interval_milliseconds: 100,
            polling_max_interval_milliseconds: 1000,
            ..Default::default()
        };
        assert_eq!(
            waits(&opts, 30, false),
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
        assert_eq!(next_interval(&opts, 30, false, u64::MAX), ms(1000));
    }

    #[test]
    fn polling_max_interval_milliseconds_caps_the_backoff() {
        let opts = |max| ClaimWorkerOptions {
            polling_interval_milliseconds: 100,
            polling_max_interval_milliseconds: max,
            ..Default::default()
        };
        assert_eq!(next_interval(&opts(300), 30, false, 6), ms(300));
        assert_eq!(next_interval(&opts(5000), 30, false, 6), ms(3200));
        // A cap below the base interval does not shorten the base.
        assert_eq!(next_interval(&opts(50), 30, false, 6), ms(100));
        // Nor may the backoff outgrow a third of the abandon threshold.
        assert_eq!(next_interval(&opts(5000), 1, false, 6), ms(333));
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
