//! Catch-up: backfills of new perspectives and rebuilds of new versions, in one place.
//! - [`plan`]: starting jobs (from `migrate` and `rebuild`) and running one chunk of streams;
//! - the store's `catchup` module: the jobs table's statements, and `progress`, a perspective's
//!   phase (Live, Backfilling, Rebuilding) and catch-up figures read from its job's row;
//! - this module: the job runner. Every instance helps with the schema's perspective jobs. Each
//!   turn it advances every job it has the perspective for, takes chunks of streams while a job
//!   is queueing (as many chunks at a time as it runs drain consumers, each on its own
//!   connection; beside live work as many as the live perspectives' latency and rate allow: see
//!   [`pace`]; with the compiled SQL
//!   perspectives each chunk also applies its streams' history; a custom runner, or a
//!   perspective with sequencing key or serial, gets it queued), and publishes each job's
//!   progress in `/metrics` (every few seconds: counting a job's pending work reads the work
//!   table). It sleeps while there is no job; `wh_job_start` rings the doorbell
//!   with the `jobs` payload, which the listener turns into a wake-up here.

pub mod pace;
pub mod plan;
pub mod switch;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::Shared;
use crate::config::{PerspectiveConfig, Rebuild, Sequencing};
use crate::store::catchup as store;
use plan::{JobError, JobKind, JobState, Requeue};

/// Between turns while a job waits for older transactions or its history is being applied.
const WATCH_INTERVAL: Duration = Duration::from_millis(250);
/// Between turns while there is no job: a safety net for a missed doorbell.
const IDLE_INTERVAL: Duration = Duration::from_secs(30);
/// At most this often the jobs' progress is read for `/metrics` while a job runs (each read
/// counts the job's pending work rows: a second or more under load).
const PUBLISH_INTERVAL: Duration = Duration::from_secs(5);
/// Chunks each chunk loop takes in one turn before looking at the other jobs (and at shutdown)
/// again.
const CHUNKS_PER_TURN: usize = 16;

/// What a turn found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// No job.
    Idle,
    /// Jobs, none with a free chunk.
    Watching,
    /// Queued at least one chunk: go again at once.
    Worked,
}

/// The wait before the next turn after `turn`, or after `failures` failed turns in a row.
fn next_wait(turn: Result<Turn, ()>, failures: u32) -> Duration {
    match turn {
        Ok(Turn::Worked) => Duration::ZERO,
        Ok(Turn::Watching) => WATCH_INTERVAL,
        Ok(Turn::Idle) => IDLE_INTERVAL,
        Err(()) => (WATCH_INTERVAL * 2u32.saturating_pow(failures.min(7))).min(IDLE_INTERVAL),
    }
}

/// For how long after the claim loop last found work the instance counts as having live work.
const LIVE_GRACE: Duration = Duration::from_secs(2);

/// When the claim loop last handed out work (it records, the job runner reads).
#[derive(Debug)]
pub(crate) struct LastWork {
    start: Instant,
    /// Milliseconds after `start`, plus one (0: never).
    at: AtomicU64,
}

impl LastWork {
    pub(crate) fn new() -> Self {
        LastWork {
            start: Instant::now(),
            at: AtomicU64::new(0),
        }
    }

    pub(crate) fn record(&self) {
        let ms = self.start.elapsed().as_millis() as u64 + 1;
        self.at.store(ms, Ordering::Relaxed);
    }

    /// Whether work was found within [`LIVE_GRACE`].
    pub(crate) fn recent(&self) -> bool {
        self.within(LIVE_GRACE)
    }

    /// Whether work was found within `grace`.
    pub(crate) fn within(&self, grace: Duration) -> bool {
        match self.at.load(Ordering::Relaxed) {
            0 => false,
            at => {
                self.start
                    .elapsed()
                    .saturating_sub(Duration::from_millis(at - 1))
                    < grace
            }
        }
    }
}

/// The job runner task.
pub(crate) struct JobRunner {
    pub shared: Arc<Shared>,
    /// Rung by the listener on a `jobs` doorbell.
    pub wake: Arc<Notify>,
    /// Whether chunks apply the history they queue (the compiled SQL perspectives run here);
    /// with a custom runner they only queue it.
    pub apply_in_chunks: bool,
    /// Live work seen by the claim loop, in (for pacing).
    pub last_work: Arc<LastWork>,
    /// How hard chunks run beside live work.
    pub pace: pace::Pace,
    /// When the jobs' progress was last published.
    pub published: Mutex<Option<Instant>>,
}

impl JobRunner {
    pub(crate) async fn run(self) {
        let mut failures = 0u32;
        // Only its logs: the waits are next_wait's.
        let mut streak = super::backoff::FailureStreak::new(
            "perspective job turn",
            Duration::ZERO,
            Duration::ZERO,
        );
        loop {
            if self.shared.shutdown.is_cancelled() {
                return;
            }
            let turn = match self.turn().await {
                Ok(turn) => {
                    failures = 0;
                    streak.succeeded();
                    Ok(turn)
                }
                Err(e) => {
                    failures += 1;
                    streak.failed(&e.to_string());
                    Err(())
                }
            };
            let wait = next_wait(turn, failures);
            if wait.is_zero() {
                continue;
            }
            tokio::select! {
                _ = self.shared.shutdown.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    async fn turn(&self) -> Result<Turn, JobError> {
        let shared = &self.shared;
        let schema = shared.store.schema();
        let long = shared.store.deadlines().long;
        let mut conn = shared.store.conn(long, "active catch-up jobs").await?;
        let active = conn
            .deadline()
            .run(store::active(&mut conn, schema))
            .await?;
        if !active.is_empty() {
            // Before the chunks too: a turn can last long.
            self.publish(&mut conn, false).await?;
        }
        let mut worked = false;
        for (name, kind) in &active {
            // A job of a perspective this instance's config lacks (a rollout in progress) is
            // left to the instances that have it.
            let Some(perspective) = shared.config.perspective(name) else {
                continue;
            };
            let state = conn
                .limit(long, "advancing a catch-up job")
                .run(store::advance(&mut conn, schema, name))
                .await?;
            match state {
                JobState::Queueing => {
                    let loops = shared.drain_width().max(1) as u32;
                    let catching_up: Vec<&str> = active.iter().map(|(p, _)| p.as_str()).collect();
                    let results = futures::future::join_all(
                        (0..loops).map(|i| self.chunk_loop(i, perspective, *kind, &catching_up)),
                    )
                    .await;
                    for chunks in results {
                        worked |= chunks? > 0;
                    }
                }
                JobState::Done => {
                    tracing::info!(perspective = %name, "{} complete: the perspective is live", kind.as_str());
                }
                JobState::Waiting | JobState::Applying | JobState::Busy | JobState::None => {}
            }
        }
        // Once no job is left, at once: the perspectives show Live.
        self.publish(&mut conn, active.is_empty()).await?;
        // A version built beside a live one switches once caught up; until then, watch it.
        // (Only a config with a blue/green perspective can have one: the others spend no
        // statement on it, which an idle worker would send every turn.)
        let building = if self
            .shared
            .config
            .perspectives
            .iter()
            .any(|p| p.rebuild == Rebuild::BlueGreen)
        {
            self.switch_versions(&mut conn).await?
        } else {
            false
        };
        Ok(if worked {
            Turn::Worked
        } else if active.is_empty() && !building {
            Turn::Idle
        } else {
            Turn::Watching
        })
    }

    /// Take up to [`CHUNKS_PER_TURN`] chunks of `perspective`'s job on one connection, paced by
    /// [`pace`] against what the perspectives not `catching_up` applied lately; returns how many it
    /// took. `index` numbers the loops of a turn.
    async fn chunk_loop(
        &self,
        index: u32,
        perspective: &PerspectiveConfig,
        kind: JobKind,
        catching_up: &[&str],
    ) -> Result<usize, JobError> {
        let shared = &self.shared;
        let worker = &shared.config.worker;
        // A perspective with sequencing key or serial gets its history queued: applied by
        // wh_drain, which keeps the events of one key from applying concurrently (a chunk
        // applies the history of many streams, of many keys, beside the drain and other chunks).
        let how = if self.apply_in_chunks && perspective.sequencing == Sequencing::Stream {
            Requeue::Apply {
                debug: worker.debug_mode,
                retry_base_ms: worker.failure_retry_base_milliseconds as f64,
                retry_max_ms: worker.failure_retry_max_milliseconds as f64,
            }
        } else {
            Requeue::Queue
        };
        let long = shared.store.deadlines().long;
        let mut conn = shared.store.conn(long, "catch-up chunk").await?;
        let mut taken = 0;
        while taken < CHUNKS_PER_TURN && !shared.shutdown.is_cancelled() {
            let live = if !self.last_work.recent() {
                pace::Live::Idle
            } else {
                match shared
                    .live_apply
                    .measure_except(|p| catching_up.contains(&p))
                {
                    Some(measure) => pace::Live::Measured(measure),
                    None => pace::Live::Unmeasured,
                }
            };
            let (loops, pause) = self.pace.next(live);
            if index == 0 {
                shared
                    .metrics
                    .catchup_pace
                    .with_label_values(&[perspective.name.as_str()])
                    .set(f64::from(loops) / (1.0 + pause));
            }
            if index >= loops {
                break;
            }
            let schema = shared.store.schema();
            let started = std::time::Instant::now();
            let chunk = conn
                .limit(long, "catch-up chunk")
                .run(plan::run_chunk(&mut conn, schema, perspective, kind, how))
                .await?;
            match chunk {
                Some(chunk) => {
                    taken += 1;
                    if pause > 0.0 {
                        tokio::time::sleep(started.elapsed().mul_f64(pause)).await;
                    }
                    shared
                        .metrics
                        .events_processed
                        .with_label_values(&[perspective.name.as_str()])
                        .inc_by(chunk.applied.max(0) as u64);
                }
                None => break,
            }
        }
        Ok(taken)
    }

    /// Each configured perspective's phase and progress, in `/metrics`: when [`PUBLISH_INTERVAL`]
    /// has passed since the last time, or `now`.
    async fn publish(&self, conn: &mut crate::store::Conn, now: bool) -> Result<(), sqlx::Error> {
        {
            let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
            if !now && published.is_some_and(|at| at.elapsed() < PUBLISH_INTERVAL) {
                return Ok(());
            }
            *published = Some(Instant::now());
        }
        let shared = &self.shared;
        let phases = conn
            .limit(shared.store.deadlines().routine, "catch-up progress")
            .run(store::Phases::read(conn, shared.store.schema()))
            .await?;
        for p in &shared.config.perspectives {
            let (phase, progress) = phases.of(&p.name);
            shared
                .metrics
                .set_catchup(&p.name, phase, progress.as_ref());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_goes_on_at_once_watching_is_relaxed_and_idle_is_a_safety_net() {
        assert_eq!(next_wait(Ok(Turn::Worked), 0), Duration::ZERO);
        assert_eq!(next_wait(Ok(Turn::Watching), 0), WATCH_INTERVAL);
        assert_eq!(next_wait(Ok(Turn::Idle), 0), IDLE_INTERVAL);
    }

    #[test]
    fn last_work_is_recent_for_the_grace_period() {
        let w = LastWork::new();
        assert!(!w.recent(), "never");
        w.record();
        assert!(w.recent());
        let old = LastWork {
            start: Instant::now() - LIVE_GRACE * 2,
            at: AtomicU64::new(1),
        };
        assert!(!old.recent(), "longer ago than the grace period");
    }

    #[test]
    fn failures_back_off_up_to_the_idle_interval() {
        assert_eq!(next_wait(Err(()), 1), Duration::from_millis(500));
        assert_eq!(next_wait(Err(()), 2), Duration::from_millis(1000));
        assert_eq!(next_wait(Err(()), 50), IDLE_INTERVAL);
    }
}
