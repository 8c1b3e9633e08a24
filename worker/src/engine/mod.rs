//! The perspective engine: claim → drain → apply → complete.
//!
//! Tasks, joined by channels and stopped by one cancellation token. Each owns what it uses (its
//! channels in, its handles out) plus the `Shared` part: config, instance id, store, hooks,
//! metrics, health, shutdown. One set of tasks with its pool is an *epoch*: a worker that finds
//! its peers may have abandoned it (see [`health`]) ends the epoch — dropping its queued
//! streams and unflushed completions, aborting statements stuck on a dead link —, connects
//! again and registers anew, and `/livez` fails if it cannot for one more stale threshold.
//! - [`claim`]: polls `claim_work` (tight while NOTIFY is down, relaxed while it is healthy),
//!   woken at once by the doorbell or [`Hooks::request_immediate_poll`]; feeds stream ids into
//!   the drain queue; marks the engine ready after its first claim;
//! - [`listener`]: the LISTEN connection (doorbell → claim wake-up; health; reconnects);
//! - [`drain`]: this worker's share of `drainConsumersPerDeployment` (at most
//!   `maxConcurrentDrainConsumers`) consumers: sliding-window batches of stream ids,
//!   drained by `wh_drain` in the database or, for a custom [`PerspectiveRunner`], fetched and
//!   applied group by group; its `queue` holds the streams queued for or being drained, each at
//!   most once;
//! - [`completion`]: the Batched completion flush worker with its tracker (pending → sent →
//!   acknowledged), the settler that retires drained streams, and the custom-runner path's
//!   dedup cache;
//! - [`catchup`]: backfill and rebuild jobs: starting them, their chunks (shared with the other
//!   instances), and their progress;
//! - [`heartbeat`]: liveness in `wh_service_instances` and abandonment of silent peers;
//!   [`contention_rate`]: the lock conflicts of the last minute each heartbeat publishes;
//! - [`health`]: whether the database answers the claims and heartbeats (`/readyz`) and
//!   whether peers may have abandoned this instance; `backoff`: the waits and the logs of
//!   repeated failures;
//! - [`statistics`]: while busy, ANALYZE of the schema's tables that outgrew their planner
//!   statistics (so cached plans of tables that grew from empty stop scanning them);
//! - [`lifecycle`]: PostPerspective per event and perspective, PostAllPerspectives / PostLifecycle
//!   once per event, orphan reconciliation;
//! - [`vacuum`]: while busy, vacuums the queue tables between autovacuum's visits;
//! - [`wake_limit`]: the pace of claims doorbells may start (anyone may NOTIFY);
//! - [`hooks`]: what the engine did, for tests and embedding applications;
//! - [`runner`]: the SQL runner, the [`PerspectiveRunner`] of compiled perspectives;
//! - [`http`] and [`metrics`]: `/livez`, `/readyz` and `/metrics`, and the collectors behind them.

mod backoff;
pub mod catchup;
pub mod claim;
pub mod contention_rate;
pub mod drain;
mod epoch;
pub(crate) mod health;
pub mod heartbeat;
pub mod hooks;
pub mod http;
pub mod lifecycle;
pub mod listener;
pub(crate) mod live_apply;
pub mod metrics;
pub mod runner;
pub mod statistics;
pub mod vacuum;
pub mod wake_limit;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use crate::contract::{
    ApplyMode, ApplyOutcome, Group, PerspectiveRunner, RunnerError, WorkItem,
};
pub use hooks::{HookEvent, Hooks};
pub use runner::SqlRunner;

use crate::compile::definition_hash;
use crate::config::{versions, Config};
use crate::engine::drain::completion::dedup::ProcessedEventCache;
use crate::engine::http::Readiness;
use crate::engine::metrics::WorkerMetrics;
use crate::store::migrations::latest_version;
use crate::store::Store;

/// How to run an engine.
#[derive(Clone)]
pub struct EngineOptions {
    pub config: Arc<Config>,
    pub database_url: String,
    /// Unique per process: `PERSPECTIVE_INSTANCE_ID`, else a fresh UUIDv7.
    pub instance_id: Uuid,
    pub service_name: String,
    /// Size of the statements' pool (at least 2); `worker.database.maxConnections` by default.
    pub max_connections: u32,
    /// How long each class of statement may wait for its answer (tests shorten them).
    pub deadlines: crate::store::Deadlines,
    pub runner: Option<Arc<dyn PerspectiveRunner>>,
    pub metrics: Arc<WorkerMetrics>,
    pub readiness: Readiness,
    pub hooks: Hooks,
}

impl EngineOptions {
    pub fn new(config: Config, database_url: impl Into<String>) -> Self {
        EngineOptions {
            max_connections: config.worker.database.max_connections,
            config: Arc::new(config),
            database_url: database_url.into(),
            instance_id: Uuid::now_v7(),
            service_name: "perspective-worker".into(),
            deadlines: crate::store::Deadlines::default(),
            runner: None,
            metrics: Arc::new(WorkerMetrics::new()),
            readiness: Readiness::new("starting"),
            hooks: Hooks::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("database error while {step}: {message}")]
    Database { step: &'static str, message: String },
    #[error(
        "schema {schema} is at migration {found:?} but this worker needs {expected}: run `perspective-worker migrate` first"
    )]
    SchemaOutdated {
        schema: String,
        found: Option<i32>,
        expected: i32,
    },
    #[error(
        "perspective {perspective} in schema {schema} was compiled from a different definition than the config's (handlers, reset, ordering or setup): run `perspective-worker migrate` to compile the current one"
    )]
    PerspectiveOutdated { schema: String, perspective: String },
    #[error(
        "schema {schema} {problem}: run `perspective-worker migrate` to install this worker's engine functions"
    )]
    FunctionsOutdated { schema: String, problem: String },
    #[error(
        "perspective {perspective} has sequencing: {sequencing}, which only the compiled SQL handlers support: a custom runner applies streams in parallel (sequencing: stream); remove the runner or the sequencing"
    )]
    SequencingNeedsSqlHandlers {
        perspective: String,
        sequencing: &'static str,
    },
    #[error(
        "perspective {perspective} has rebuild: blueGreen, which only the compiled SQL handlers support: a custom runner does not write a version's own tables; remove the runner or use rebuild: inPlace"
    )]
    BlueGreenNeedsSqlHandlers { perspective: String },
}

/// What every task of one engine uses: who it is, where its schema is, where it reports, and
/// when to stop. Each task owns the rest of what it needs (its channels in, its handles out).
pub(crate) struct Shared {
    pub config: Arc<Config>,
    pub instance_id: Uuid,
    pub store: Store,
    pub hooks: Hooks,
    pub metrics: Arc<WorkerMetrics>,
    /// Lock conflicts of the last minute, by perspective, for the heartbeat.
    pub contention: contention_rate::ContentionRate,
    /// What each perspective applied lately (worst latency, rate), for a catch-up's pace.
    pub live_apply: live_apply::LiveApply,
    /// The engine's (not the epoch's): readiness, abandonment.
    pub health: Arc<health::Health>,
    /// This epoch's: a child of the engine's shutdown token.
    pub shutdown: CancellationToken,
    /// Drain consumers (and catch-up chunk loops) to run now: this worker's share of
    /// `drainConsumersPerDeployment`, set by each heartbeat from the live workers it counts.
    pub drain_width: tokio::sync::watch::Sender<usize>,
    /// The workers of the deployment the last heartbeat counted live, this one included.
    pub live_workers: std::sync::atomic::AtomicUsize,
    /// Rung by the listener on an `orphan` doorbell (a peer began its stop, deregistered or was
    /// abandoned): the heartbeat recounts the live workers soon, not at its next interval.
    pub recount: tokio::sync::Notify,
}

impl Shared {
    /// Drain consumers to run now (see [`Shared::drain_width`]).
    pub(crate) fn drain_width(&self) -> usize {
        *self.drain_width.borrow()
    }
}

/// A custom runner applies the groups the worker fetches, stream by stream: it cannot keep
/// the events of one key (or of the whole perspective) from applying concurrently.
fn refuse_sequencing_with_a_custom_runner(options: &EngineOptions) -> Result<(), EngineError> {
    let custom = options
        .runner
        .as_ref()
        .is_some_and(|r| !r.server_side_drain());
    match options
        .config
        .perspectives
        .iter()
        .find(|p| p.sequencing != crate::config::Sequencing::Stream)
    {
        Some(p) if custom => Err(EngineError::SequencingNeedsSqlHandlers {
            perspective: p.name.clone(),
            sequencing: p.sequencing.as_str(),
        }),
        _ => Ok(()),
    }
}

/// A custom runner does not run the compiled functions whose search_path points a version being
/// built at its own tables.
fn refuse_blue_green_with_a_custom_runner(options: &EngineOptions) -> Result<(), EngineError> {
    let custom = options
        .runner
        .as_ref()
        .is_some_and(|r| !r.server_side_drain());
    match options
        .config
        .perspectives
        .iter()
        .find(|p| p.rebuild == crate::config::Rebuild::BlueGreen)
    {
        Some(p) if custom => Err(EngineError::BlueGreenNeedsSqlHandlers {
            perspective: p.name.clone(),
        }),
        _ => Ok(()),
    }
}

/// The perspectives the deployment runs: the config's, plus, for each version being built
/// beside a live one, the live version as `migrate` recorded it and the new one under its
/// internal name (see [`crate::config::versions`]).
async fn running_config(store: &Store, config: &Config) -> Result<Config, EngineError> {
    let schema = store.schema();
    let mut conn = store
        .conn(store.deadlines().routine, "versions being built")
        .await
        .map_err(|e| db("reading the versions being built", e))?;
    let rows = conn
        .deadline()
        .run(crate::store::versions::building(&mut conn, schema))
        .await
        .map_err(|e| db("reading the versions being built", e))?;
    let building: Vec<versions::Building> = rows
        .into_iter()
        .filter_map(|(perspective, version, live)| {
            Some(versions::Building {
                perspective,
                version: version as u32,
                live: versions::parse_definition(&live).ok()?,
            })
        })
        .collect();
    Ok(versions::running_config(
        config,
        &versions::running(config, &building),
    ))
}

/// A running engine.
pub struct Engine {
    options: EngineOptions,
    health: Arc<health::Health>,
    /// The caller's: cancelling it stops the engine.
    shutdown: CancellationToken,
    epoch: epoch::Epoch,
}

impl Engine {
    /// Verify the schema, register the instance and start every task.
    pub async fn start(
        mut options: EngineOptions,
        shutdown: CancellationToken,
    ) -> Result<Engine, EngineError> {
        refuse_sequencing_with_a_custom_runner(&options)?;
        refuse_blue_green_with_a_custom_runner(&options)?;
        let (store, listen_pool) = connect(&options).await?;
        verify_migration(&store, &options.config).await?;
        // A blue/green version being built runs beside the live one, as a perspective of its own.
        options.config = Arc::new(running_config(&store, &options.config).await?);
        let config = options.config.clone();
        verify_schema(&store, &config).await?;
        for p in &config.perspectives {
            options.metrics.init_perspective(&p.name);
        }
        options
            .hooks
            .count_drops_in(options.metrics.hook_events_dropped.clone());
        let health = Arc::new(health::Health::new(
            options.readiness.clone(),
            Duration::from_secs(config.worker.heartbeat_interval_seconds.max(1) as u64),
            Duration::from_secs(config.worker.abandon_stale_instance_threshold_seconds as u64),
        ));
        let epoch = epoch::Epoch::start(&options, &health, &shutdown, store, listen_pool).await?;
        Ok(Engine {
            options,
            health,
            shutdown,
            epoch,
        })
    }

    pub fn hooks(&self) -> &Hooks {
        &self.options.hooks
    }

    pub fn instance_id(&self) -> Uuid {
        self.options.instance_id
    }

    /// Run until the shutdown token is cancelled, then stop: no new claims, the streams not
    /// being drained go to the live peers, in-flight batches finish and their streams follow,
    /// completions are flushed, leases and any streams left are released, the instance
    /// deregisters — within 13 s even when the database cannot be reached (a deregistration
    /// that fails or gets no answer is logged, not returned: peers abandon the instance after
    /// the stale threshold). Meanwhile, if peers may have abandoned this instance (see
    /// [`health`]), drop everything it holds, connect and register again.
    pub async fn run_until_stopped(self) -> Result<(), EngineError> {
        let Engine {
            options,
            health,
            shutdown,
            mut epoch,
        } = self;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                reason = health.until_abandoned() => {
                    tracing::warn!(instance_id = %options.instance_id, reason,
                        "this instance may have been abandoned by its peers: dropping the work it holds, \
                         reconnecting and registering again");
                    epoch.abandon().await;
                    match epoch::reregister(&options, &health, &shutdown, reason).await {
                        Some(next) => epoch = next,
                        None => {
                            health.stopping();
                            tracing::info!("stopped while registering again");
                            return Ok(());
                        }
                    }
                }
            }
        }
        tracing::info!("stopping: finishing in-flight work");
        health.stopping();
        epoch.stop().await;
        Ok(())
    }
}

/// The engine's pool (connected, so a bad URL fails here) and the listener's (lazy); see
/// [`crate::store::pool::pool_options`] for their timeouts and session settings.
async fn connect(options: &EngineOptions) -> Result<(Store, PgPool), EngineError> {
    use crate::store::pool::{pool_options, PoolRole};
    let connect = |app: &str| crate::db::connect_options(&options.database_url, app);
    let pool = pool_options(PoolRole::Statements {
        max_connections: options.max_connections.max(2),
    })
    .connect_with(connect("perspective-worker").map_err(|e| db("parsing DATABASE_URL", e))?)
    .await
    .map_err(|e| db("connecting to PostgreSQL", e))?;
    let control_pool = pool_options(PoolRole::Control).connect_lazy_with(
        connect("perspective-worker control").map_err(|e| db("parsing DATABASE_URL", e))?,
    );
    let listen_pool = pool_options(PoolRole::Listen).connect_lazy_with(
        connect("perspective-worker listen").map_err(|e| db("parsing DATABASE_URL", e))?,
    );
    let store = Store::new(pool, &options.config.schema)
        .with_quick_pool(control_pool)
        .with_deadlines(options.deadlines);
    Ok((store, listen_pool))
}

/// The tasks of a started engine (see [`spawn_tasks`]).
struct Tasks {
    /// The listener, the job runner, the heartbeat, the vacuum, the settler, the drain
    /// consumers, the statistics keeper and the claim loop.
    running: Vec<JoinHandle<()>>,
    /// The completion flush, apart: it stops last (see [`Engine::run_until_stopped`]).
    flush: JoinHandle<()>,
    /// Ends the flush.
    flush_stop: CancellationToken,
    /// The streams handed to the drain consumers (a stop hands the others over at once).
    queue: Arc<drain::queue::DrainQueue>,
}

/// Every task of a started engine, joined by their channels.
fn spawn_tasks(
    shared: &Arc<Shared>,
    options: &EngineOptions,
    listen_pool: PgPool,
    heartbeat: heartbeat::Heartbeat,
) -> Tasks {
    let config = &shared.config;
    let (drain_tx, drain_rx) =
        mpsc::channel(config.worker.drain_batcher.max_size.max(16) as usize * 4);
    let (completions, completion_rx) = drain::completion::CompletionQueue::new();
    let (settle_tx, settle_rx) = mpsc::unbounded_channel();
    let listener_healthy = Arc::new(AtomicBool::new(false));
    let jobs_wake = Arc::new(tokio::sync::Notify::new());
    let last_work = Arc::new(catchup::LastWork::new());
    let cache = Arc::new(Mutex::new(ProcessedEventCache::new(Duration::from_secs(
        config.worker.lease_seconds as u64,
    ))));
    let runner = options
        .runner
        .clone()
        .unwrap_or_else(|| Arc::new(SqlRunner::new(config)));

    let mut tasks = Vec::new();
    let listener = listener::Listener {
        shared: shared.clone(),
        pool: listen_pool,
        healthy: listener_healthy.clone(),
        jobs_wake: jobs_wake.clone(),
    };
    tasks.push(tokio::spawn(listener.run()));
    let job_runner = catchup::JobRunner {
        shared: shared.clone(),
        wake: jobs_wake,
        apply_in_chunks: options.runner.is_none(),
        last_work: last_work.clone(),
        pace: catchup::pace::Pace::new(options.config.worker.max_concurrent_drain_consumers),
        published: std::sync::Mutex::new(None),
    };
    tasks.push(tokio::spawn(job_runner.run()));
    tasks.push(tokio::spawn(heartbeat.run()));
    let vacuum = vacuum::Vacuum {
        shared: shared.clone(),
        last_work: last_work.clone(),
    };
    tasks.push(tokio::spawn(vacuum.run()));
    let queue = Arc::new(drain::queue::DrainQueue::new(drain_tx));
    let settler = drain::completion::Settler {
        shared: shared.clone(),
        completions: completions.clone(),
        queue: queue.clone(),
    };
    tasks.push(tokio::spawn(settler.run(settle_rx)));
    let drainer = Arc::new(drain::Drainer::new(
        shared.clone(),
        runner,
        cache.clone(),
        completions.clone(),
        queue.clone(),
        settle_tx.clone(),
    ));
    let rx: drain::SharedReceiver = Arc::new(tokio::sync::Mutex::new(drain_rx));
    for index in 0..config.worker.max_concurrent_drain_consumers.max(1) as usize {
        tasks.push(tokio::spawn(drainer.clone().consume(rx.clone(), index)));
    }
    let statistics = statistics::StatisticsKeeper {
        shared: shared.clone(),
        last_work: last_work.clone(),
    };
    tasks.push(tokio::spawn(statistics.run()));
    let claim_loop = claim::ClaimLoop {
        shared: shared.clone(),
        queue: queue.clone(),
        listener_healthy,
        last_work,
        completions: completions.clone(),
    };
    tasks.push(tokio::spawn(claim_loop.run()));
    let flush_stop = CancellationToken::new();
    let flush = drain::completion::FlushWorker {
        shared: shared.clone(),
        completions,
        cache,
        settle_tx,
        stop: flush_stop.clone(),
    };
    Tasks {
        running: tasks,
        flush: tokio::spawn(flush.run(completion_rx)),
        flush_stop,
        queue,
    }
}

fn db(step: &'static str, e: sqlx::Error) -> EngineError {
    EngineError::Database {
        step,
        message: crate::db::describe_error(&e, None),
    }
}

/// The schema must be at this binary's migration.
async fn verify_migration(store: &Store, config: &Config) -> Result<(), EngineError> {
    let schema = &config.schema;
    let found = store
        .latest_migration()
        .await
        .map_err(|e| db("checking the schema", e))?;
    if found != Some(latest_version()) {
        return Err(EngineError::SchemaOutdated {
            schema: schema.clone(),
            found,
            expected: latest_version(),
        });
    }
    Ok(())
}

/// The schema must be at this binary's migration, have this binary's engine functions as
/// `migrate` installed them, and every perspective compiled from the config's current definition.
async fn verify_schema(store: &Store, config: &Config) -> Result<(), EngineError> {
    let schema = &config.schema;
    verify_migration(store, config).await?;
    let problem = store
        .functions_problem()
        .await
        .map_err(|e| db("checking the engine functions", e))?;
    if let Some(problem) = problem {
        return Err(EngineError::FunctionsOutdated {
            schema: schema.clone(),
            problem,
        });
    }
    let compiled = store
        .compiled_definitions()
        .await
        .map_err(|e| db("checking compiled perspectives", e))?;
    for p in &config.perspectives {
        if compiled.get(&p.name) != Some(&definition_hash(schema, p)) {
            return Err(EngineError::PerspectiveOutdated {
                schema: schema.clone(),
                perspective: p.name.clone(),
            });
        }
    }
    Ok(())
}
