//! The claim loop: the only part of the worker that polls the database for new work.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::backoff::FailureStreak;
use super::drain::completion::CompletionQueue;
use super::drain::queue::{DrainQueue, Offer, Offered};
use super::health::Probe;
use super::wake_limit::WakeLimiter;
use super::Shared;
use crate::config::ClaimWorkerOptions;
use crate::store::claim::ClaimArgs;

/// The longest wait after failed claims (they double from `pollingIntervalMilliseconds`).
const FAILURE_BACKOFF_CAP: Duration = Duration::from_secs(5);

/// The claim task: polls, feeds the drain channel, reports each claim's outcome to the engine's
/// health (the first success makes it ready; a failure, or a claim unanswered for a few seconds,
/// not ready), backs off while claims fail.
pub(crate) struct ClaimLoop {
    pub shared: Arc<Shared>,
    /// Streams to drain, out.
    pub queue: Arc<DrainQueue>,
    /// Whether the LISTEN connection is up (set by the listener).
    pub listener_healthy: Arc<AtomicBool>,
    /// When a claim last found work, out (the job runner paces itself by it).
    pub last_work: Arc<super::catchup::LastWork>,
    /// Applied rows not flushed yet (Batched): their streams are not the claim's to offer.
    pub completions: CompletionQueue,
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

/// Whether more work is waiting than this claim handed out: it queued `maxStreamsPerBatch`
/// streams that were not queued or being drained already (the claim takes at most that many
/// unowned streams, so there may be more), or the drain channel could not take all of them.
/// Then claim again as soon as the drain has room, rather than after the safety-net interval
/// (no doorbell rings for streams that were already pinned). Streams it returned that were
/// already offered do not count: they are the oldest held, returned on every claim.
pub(crate) fn claim_again_when_room(queued: usize, max_streams: usize, channel_full: bool) -> bool {
    channel_full || (queued > 0 && queued >= max_streams.max(1))
}

impl ClaimLoop {
    /// The streams a claim passes over: queued, being drained, or drained with applied rows
    /// the flush has not deleted yet. Those rows still look pending, so a claim returned such
    /// a stream and the loop queued it again, for a drain that found only rows to retire (at
    /// 100 000 one-event streams, 44 000 of the 144 000 streams one run's claims returned).
    /// The flush hands each to the settler, which queues it again if new work came meanwhile
    /// (a stream whose flush failed is not passed over: see `streams_awaiting_flush`).
    fn offered(&self) -> Vec<Uuid> {
        let mut offered = self.queue.offered();
        let unflushed = self.completions.streams_awaiting_flush();
        if !unflushed.is_empty() {
            let known: HashSet<Uuid> = offered.iter().copied().collect();
            offered.extend(unflushed.into_iter().filter(|s| !known.contains(s)));
        }
        offered
    }

    /// One `claim_work` call, passing over the `offered` streams (see [`ClaimLoop::offered`]).
    async fn claim(
        &self,
        max_streams: usize,
        offered: Vec<Uuid>,
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        let shared = &self.shared;
        let started = Instant::now();
        let claim = shared.store.claim_work(ClaimArgs {
            instance_id: shared.instance_id,
            max_streams: max_streams.max(1).min(i32::MAX as usize) as i32,
            offered,
            stale_seconds: shared
                .config
                .worker
                .abandon_stale_instance_threshold_seconds as f64,
        });
        let streams = shared.health.watch(Probe::Claim, claim).await;
        shared
            .metrics
            .claim_duration
            .observe(started.elapsed().as_secs_f64());
        streams
    }

    pub(crate) async fn run(self) {
        let shared = &self.shared;
        let idle_threshold = shared.config.worker.idle_threshold_polls as u64;
        let max_streams = shared.config.claim_worker.max_streams_per_batch as usize;
        let mut first = true;
        // Awake as the database has it (wh_claim_awake), and whether the last wake-up was paced.
        let (mut awake, mut paced) = (false, false);
        let mut wakes = WakeLimiter::new(Instant::now());
        let mut failures = FailureStreak::new(
            "claim_work",
            Duration::from_millis(shared.config.claim_worker.polling_interval_milliseconds),
            FAILURE_BACKOFF_CAP,
        );
        loop {
            if shared.shutdown.is_cancelled() {
                return;
            }
            let offered = self.offered();
            let streams = match self.claim(max_streams, offered).await {
                Ok(s) => {
                    failures.succeeded();
                    if first {
                        first = false;
                        tracing::info!(instance_id = %shared.instance_id, "first claim succeeded; ready");
                    }
                    s
                }
                Err(e) => {
                    let wait = failures.failed(&crate::db::describe_error(&e, None));
                    tokio::select! {
                        _ = shared.shutdown.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    continue;
                }
            };
            let n = streams.len();
            if n > 0 {
                self.last_work.record();
            }
            if n == 0 {
                shared.metrics.empty_batches.inc();
            }
            let (mut queued, mut channel_full) = (0, false);
            for stream in streams {
                // At most maxStreamsPerBatch new ones (one that left the drain since the claim
                // counted the offered ones comes back as new). The rest, like a full channel's
                // leftovers, are offered again by the next claim.
                if queued >= max_streams {
                    break;
                }
                match self.queue.offer(stream, Offer::Poll) {
                    Offered::Queued => queued += 1,
                    Offered::Present => {}
                    Offered::Full => {
                        channel_full = true;
                        break;
                    }
                }
            }
            shared.hooks.record_poll(n, queued, idle_threshold);
            // Awake or asleep (functions/wh_claim_awake.sql). Gone back to sleep, claim once
            // more before waiting: a producer that saw this worker awake did not ring.
            let want = want_awake(queued, paced);
            if want != awake {
                let was_awake = awake;
                awake = self.set_awake(want).await;
                if was_awake && !awake {
                    continue;
                }
            }
            let wait = next_interval(
                &shared.config.claim_worker,
                shared
                    .config
                    .worker
                    .abandon_stale_instance_threshold_seconds,
                self.listener_healthy.load(Ordering::Relaxed),
                shared.hooks.consecutive_empty_polls(),
            );
            let room = claim_again_when_room(queued, max_streams, channel_full)
                .then_some(max_streams.max(1));
            match self.wait_for_claim(&mut wakes, awake, room, wait).await {
                Some(p) => paced = p,
                None => return,
            }
        }
    }

    /// Waits for the next claim. `None`: shutdown. Otherwise whether the wake-up waited for a
    /// token of the deployment's doorbell pace (see wake_limit): after a doorbell, or at once
    /// while awake (as if every producer had rung, which is the cadence ringing would give);
    /// `false` after the safety-net interval or, with a backlog (`room`), once fewer than `room`
    /// streams are queued or being drained.
    async fn wait_for_claim(
        &self,
        wakes: &mut WakeLimiter,
        awake: bool,
        room: Option<usize>,
        wait: Option<Duration>,
    ) -> Option<bool> {
        let shared = &self.shared;
        let rang = tokio::select! {
            biased;
            _ = shared.shutdown.cancelled() => return None,
            // Paced: anyone may ring the doorbell (see wake_limit).
            _ = shared.hooks.wake_requested() => true,
            _ = std::future::ready(()), if awake => true,
            _ = self.queue.room_below(room.unwrap_or(1)), if room.is_some() => false,
            _ = async {
                match wait {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            } => false,
        };
        if !rang {
            return Some(false);
        }
        let live = shared.live_workers.load(Ordering::Relaxed);
        let pause = wakes.take_share(Instant::now(), live);
        if !pause.is_zero() {
            tokio::select! {
                _ = shared.shutdown.cancelled() => return None,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        Some(!pause.is_zero())
    }

    /// Says whether this worker is awake; returns the state it is in now. After an error the
    /// state is unknown: taken as awake, the safe belief (an awake worker claims at its pace, so
    /// a producer that did not ring for it is served; the next doze settles it).
    async fn set_awake(&self, awake: bool) -> bool {
        let shared = &self.shared;
        let now = match shared
            .store
            .set_claim_awake(shared.instance_id, awake)
            .await
        {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!(error = %crate::db::describe_error(&e, None), awake,
                               "could not record whether the claim loop is awake; claiming at its pace");
                true
            }
        };
        let was = shared.metrics.claim_awake.get() == 1;
        if now && !was {
            tracing::debug!("claim loop awake: claiming at its pace, producers need not ring");
            shared.metrics.claim_awake_total.inc();
        } else if !now && was {
            tracing::debug!("claim loop asleep: waiting for doorbells");
        } else if now && !awake {
            tracing::debug!(
                "staying awake: a producer is between a new stream's first row and its commit"
            );
        }
        shared.metrics.claim_awake.set(now as i64);
        now
    }
}

/// Whether the claim loop should be awake after a claim that queued `queued` new streams, its
/// wake-up having waited for a token of the pace (`paced`): new streams come faster than the
/// pace lets claims through, so a doorbell would not have made it claim any sooner. Otherwise
/// asleep: a doorbell then starts a claim at once, and an idle worker makes no claims.
pub(crate) fn want_awake(queued: usize, paced: bool) -> bool {
    queued > 0 && paced
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
    fn awake_only_while_new_streams_come_faster_than_the_pace() {
        assert!(want_awake(3, true));
        assert!(
            !want_awake(0, true),
            "a claim that found nothing new goes to sleep"
        );
        assert!(
            !want_awake(3, false),
            "new streams the doorbells keep up with: asleep"
        );
        assert!(!want_awake(0, false));
    }

    #[test]
    fn a_full_claim_or_a_full_channel_claims_again_once_there_is_room() {
        assert!(claim_again_when_room(1000, 1000, false), "a full batch");
        assert!(
            claim_again_when_room(120, 1000, true),
            "the channel took only part"
        );
        assert!(
            !claim_again_when_room(300, 1000, false),
            "everything was handed out"
        );
        assert!(!claim_again_when_room(0, 1000, false), "nothing to do");
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
