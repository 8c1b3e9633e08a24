//! One epoch of an engine: a pool, a registration and the set of tasks that use them. An
//! abandoned epoch is dropped whole (its queued streams, unflushed completions and dedup cache
//! with it) and a new one connects and registers; a stopped one finishes its work, bounded so
//! that a worker that cannot reach its database still exits within the pod's grace period.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::backoff::FailureStreak;
use super::drain::queue::DrainQueue;
use super::health::Health;
use super::{connect, db, heartbeat, lifecycle, spawn_tasks, verify_schema};
use super::{EngineError, EngineOptions, Shared};
use crate::store::Store;

/// When each step of a shutdown must be over, from its start: the tasks (then aborted), the
/// completion flush, the deregistration, closing the pool. Well inside the pod's default 30 s
/// termination grace period, database or not.
#[derive(Debug, Clone, Copy)]
struct StopBudget {
    /// How long in-flight `wh_drain` calls may run on before they are cancelled.
    drain_grace: Duration,
    tasks_by: Duration,
    flush_by: Duration,
    deregister_by: Duration,
    close_by: Duration,
}

impl StopBudget {
    /// The database answers: in-flight drains get 5 s, the whole stop at most 13 s.
    const REACHABLE: StopBudget = StopBudget {
        drain_grace: Duration::from_secs(5),
        tasks_by: Duration::from_secs(8),
        flush_by: Duration::from_secs(10),
        deregister_by: Duration::from_secs(12),
        close_by: Duration::from_secs(13),
    };
    /// The last claim or heartbeat failed or hangs: waiting on the link helps nothing, but the
    /// flush and the deregistration still get a chance (at most 5 s in all).
    const UNREACHABLE: StopBudget = StopBudget {
        drain_grace: Duration::from_secs(1),
        tasks_by: Duration::from_secs(2),
        flush_by: Duration::from_secs(3),
        deregister_by: Duration::from_secs(4),
        close_by: Duration::from_secs(5),
    };
}

/// One attempt at cancelling the in-flight drains (it needs the database too).
const CANCEL_DRAINS_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the tasks of an abandoned epoch may take to stop before they are aborted: the
/// ones waiting on a dead link never would.
const ABANDON_GRACE: Duration = Duration::from_secs(1);

/// A registered instance's running tasks.
pub(super) struct Epoch {
    shared: Arc<Shared>,
    /// The listener's pool (the listener owns a clone).
    listen_pool: PgPool,
    tasks: Vec<JoinHandle<()>>,
    flush_task: JoinHandle<()>,
    /// Ends the flush task once the other tasks (the drain consumers) have stopped.
    flush_stop: CancellationToken,
    /// What the drain consumers are draining: a stop keeps those streams until they are done.
    queue: Arc<DrainQueue>,
}

impl Epoch {
    /// Registers the instance on `store` and starts every task; `shutdown` is the engine's.
    pub(super) async fn start(
        options: &EngineOptions,
        health: &Arc<Health>,
        shutdown: &CancellationToken,
        store: Store,
        listen_pool: PgPool,
    ) -> Result<Epoch, EngineError> {
        let config = &options.config;
        let shared = Arc::new(Shared {
            config: config.clone(),
            instance_id: options.instance_id,
            store,
            hooks: options.hooks.clone(),
            metrics: options.metrics.clone(),
            contention: super::contention_rate::ContentionRate::default(),
            live_apply: super::live_apply::LiveApply::default(),
            health: health.clone(),
            shutdown: shutdown.child_token(),
            drain_width: tokio::sync::watch::Sender::new(config.worker.drain_consumers(1)),
            live_workers: std::sync::atomic::AtomicUsize::new(1),
            recount: tokio::sync::Notify::new(),
        });
        // Register before the first claim, so it ranks us among the live instances.
        let mut heartbeat = heartbeat::Heartbeat::new(shared.clone(), &options.service_name);
        let started = std::time::Instant::now();
        heartbeat
            .register()
            .await
            .map_err(|e| db("registering the instance", e))?;
        health.registered(started);
        tracing::info!(instance_id = %shared.instance_id, schema = %config.schema, "worker instance registered");
        if config.worker.notify_applied {
            lifecycle::reconcile_orphans(&shared).await;
        }
        let tasks = spawn_tasks(&shared, options, listen_pool.clone(), heartbeat);
        Ok(Epoch {
            shared,
            listen_pool,
            tasks: tasks.running,
            flush_task: tasks.flush,
            flush_stop: tasks.flush_stop,
            queue: tasks.queue,
        })
    }

    /// Drops the epoch: its streams may be other instances' now. Nothing is flushed (a late
    /// completion is fenced by the cursor; the rows are retired by later drains), statements
    /// stuck on a dead link are abandoned with their connections.
    pub(super) async fn abandon(self) {
        self.shared.shutdown.cancel();
        self.flush_task.abort();
        // Closed first, so that connections given back by aborted tasks are closed rather than
        // pinged (a ping on a dead link would wait for the kernel to give up, minutes).
        drop(self.shared.store.pool().close());
        drop(self.listen_pool.close());
        let mut tasks = self.tasks;
        let stopped = futures::future::join_all(tasks.iter_mut());
        if tokio::time::timeout(ABANDON_GRACE, stopped).await.is_err() {
            tracing::warn!(
                "aborting the tasks of the abandoned registration still waiting on the database"
            );
            for task in &tasks {
                task.abort();
            }
        }
    }

    /// Graceful shutdown (the engine's token is cancelled): no new claims, the streams not being
    /// drained go to the live peers at once, in-flight batches finish and their streams follow,
    /// completions are flushed, leases and any streams left are released, the instance
    /// deregisters — each step bounded (see [`StopBudget`]).
    pub(super) async fn stop(self) {
        let started = Instant::now();
        let shared = self.shared;
        let budget = if shared.health.unreachable() {
            tracing::warn!("stopping while the database does not answer: short deadlines");
            StopBudget::UNREACHABLE
        } else {
            StopBudget::REACHABLE
        };
        shared.shutdown.cancel();
        let reachable = !shared.health.unreachable();
        if reachable {
            hand_over(&shared, &self.queue, HAND_OVER_TIMEOUT).await;
        }
        stop_tasks(&shared, self.tasks, started, budget).await;
        // Again once the drains are over: the streams they held need not wait for the last
        // flush and the deregistration (measured 130 ms after a catch-up's drains).
        if reachable {
            hand_over(&shared, &self.queue, HAND_OVER_AGAIN_TIMEOUT).await;
        }
        // Last: the completions the drain consumers queued, flushed at once (not after their
        // retry backoff).
        self.flush_stop.cancel();
        let mut flush_task = self.flush_task;
        if tokio::time::timeout_at(started + budget.flush_by, &mut flush_task)
            .await
            .is_err()
        {
            flush_task.abort();
            tracing::warn!("the completion flush did not finish in time; later drains of those streams retire the rows");
        }
        let deregistered = tokio::time::timeout_at(
            started + budget.deregister_by,
            shared.store.deregister_instance(shared.instance_id),
        )
        .await;
        match deregistered {
            Ok(Ok(())) => tracing::info!(instance_id = %shared.instance_id, "stopped; leases released and instance deregistered"),
            Ok(Err(e)) => tracing::warn!(error = %crate::db::describe_error(&e, None),
                "stopped without deregistering; peers abandon this instance after the stale threshold"),
            Err(_) => tracing::warn!(
                "stopped without deregistering (no answer from the database); peers abandon this instance after the stale threshold"),
        }
        let closed = async {
            tokio::join!(shared.store.close(), self.listen_pool.close());
        };
        if tokio::time::timeout_at(started + budget.close_by, closed)
            .await
            .is_err()
        {
            tracing::warn!("closing the connection pool timed out");
        }
    }
}

/// How long a stop waits for its streams to be handed over before it goes on without (the
/// deregistration gives them back in any case): first while the drains run on, then (shorter,
/// so that the last flush keeps its share of the budget) once they are over.
const HAND_OVER_TIMEOUT: Duration = Duration::from_secs(2);
const HAND_OVER_AGAIN_TIMEOUT: Duration = Duration::from_secs(1);

/// A step of a stop, once nothing new is claimed or taken from the drain channel: the held
/// streams not being drained go to the live peers at once (`hand_over_streams`), so their events
/// are applied while this worker finishes its drains and flushes; done first, and again once the
/// drains are over. In a rolling update the new pod's peer otherwise waited for the whole stop:
/// measured at 500 live events/s, events then waited up to 420 ms while the old worker took
/// 330 ms to stop.
async fn hand_over(shared: &Shared, queue: &DrainQueue, timeout: Duration) {
    let keep = queue.in_flight();
    let stale = shared
        .config
        .worker
        .abandon_stale_instance_threshold_seconds as f64;
    let handed = tokio::time::timeout(
        timeout,
        shared
            .store
            .hand_over_streams(shared.instance_id, &keep, stale),
    )
    .await;
    match handed {
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => tracing::info!(
            streams = n,
            draining = keep.len(),
            "handed the streams not being drained over to the live peers"
        ),
        Ok(Err(e)) => tracing::warn!(error = %crate::db::describe_error(&e, None),
            "could not hand the streams over; the deregistration gives them back"),
        Err(_) => {
            tracing::warn!("no answer handing the streams over; the deregistration gives them back")
        }
    }
}

/// Waits for the tasks of a stopping epoch. A drain stuck in a hung handler would hold the
/// worker until its statement timeout (twice handlerTimeoutMilliseconds, or never): past a short
/// grace, cancel it (the cancelled event fails like a timed-out one; the rest of its call
/// commits). Tasks still running at `budget.tasks_by` (a dead link) are aborted.
async fn stop_tasks(
    shared: &Shared,
    tasks: Vec<JoinHandle<()>>,
    started: Instant,
    budget: StopBudget,
) {
    let mut tasks = tasks;
    {
        let all = futures::future::join_all(tasks.iter_mut());
        tokio::pin!(all);
        let mut next_cancel = started + budget.drain_grace;
        loop {
            tokio::select! {
                _ = &mut all => return,
                _ = tokio::time::sleep_until(started + budget.tasks_by) => break,
                _ = tokio::time::sleep_until(next_cancel) => {}
            }
            let cancelled = tokio::time::timeout(
                CANCEL_DRAINS_TIMEOUT,
                shared.store.cancel_drains(shared.instance_id),
            )
            .await;
            match cancelled {
                Ok(Ok(0)) => {}
                Ok(Ok(n)) => tracing::warn!(
                    cancelled = n,
                    "in-flight wh_drain calls did not finish in time; cancelled"
                ),
                Ok(Err(e)) => {
                    tracing::warn!(error = %crate::db::describe_error(&e, None), "could not cancel in-flight wh_drain calls")
                }
                Err(_) => tracing::warn!(
                    "could not cancel in-flight wh_drain calls: no answer from the database"
                ),
            }
            next_cancel = Instant::now() + Duration::from_secs(1);
        }
    }
    tracing::warn!(
        "tasks still waiting on the database {} s after shutdown began; aborting them",
        budget.tasks_by.as_secs()
    );
    for task in &tasks {
        task.abort();
    }
}

/// After an abandoned epoch: connects, verifies the schema and registers again until that
/// works (`None`: shutdown came first), each attempt bounded by the stale threshold (1–10 s).
/// Not ready meanwhile. When the attempts get no answer at all for one more stale threshold (a
/// dead link: something local may be broken), `/livez` fails too, so the kubelet restarts the
/// worker; an answer, even an error (the database is down, gone or not migrated: a restart
/// would not help, and every pod would restart at once), keeps it live, waiting.
pub(super) async fn reregister(
    options: &EngineOptions,
    health: &Arc<Health>,
    shutdown: &CancellationToken,
    reason: String,
) -> Option<Epoch> {
    health.reregistering(reason);
    // The start of the current run of attempts that got no answer at all.
    let mut unanswered_since = Instant::now();
    let stale = health.stale();
    let attempt_timeout = stale.clamp(Duration::from_secs(1), Duration::from_secs(10));
    let mut failures = FailureStreak::new(
        "registering again",
        Duration::from_millis(200),
        Duration::from_secs(5),
    );
    loop {
        let attempt = async {
            let (store, listen_pool) = connect(options).await?;
            verify_schema(&store, &options.config).await?;
            Epoch::start(options, health, shutdown, store, listen_pool).await
        };
        let outcome = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = tokio::time::timeout(attempt_timeout, attempt) => r,
        };
        let error = match outcome {
            Ok(Ok(epoch)) => {
                failures.succeeded();
                health.readiness().set_live();
                options.metrics.reregistrations.inc();
                tracing::info!(instance_id = %options.instance_id, "registered again after being abandoned");
                return Some(epoch);
            }
            Ok(Err(e)) => {
                // An answer (an error, a refused connection): the database is down or changed,
                // which a restart would not mend; the worker waits for it, live.
                unanswered_since = Instant::now();
                health.readiness().set_live();
                e.to_string()
            }
            Err(_) => format!(
                "connecting and registering got no answer within {} s",
                attempt_timeout.as_secs_f64()
            ),
        };
        health.reregistering(error.clone());
        if unanswered_since.elapsed() >= stale {
            health.readiness().set_not_live(format!(
                "abandoned by its peers and no answer from the database for {} s while registering again: {error}",
                unanswered_since.elapsed().as_secs()
            ));
        }
        let wait = failures.failed(&error);
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
