//! The perspective engine: claim → drain → apply → complete.
//!
//! Tasks, joined by channels and stopped by one cancellation token:
//! - [`claim`]: polls `claim_work` (tight while NOTIFY is down, relaxed while it is healthy),
//!   woken at once by the doorbell or [`Hooks::request_immediate_poll`]; feeds stream ids into
//!   the bounded drain channel;
//! - [`listener`]: the LISTEN connection (doorbell → claim wake-up; health; reconnects);
//! - [`drain`]: `maxConcurrentDrainConsumers` consumers: sliding-window batches of stream ids,
//!   one round trip per batch: `wh_drain` for compiled SQL perspectives, or a claim+fetch whose
//!   groups a custom [`PerspectiveRunner`] applies;
//! - [`completion`]: the Batched completion flush worker and the settler that retires drained
//!   streams;
//! - [`heartbeat`]: liveness in `wh_service_instances` and abandonment of silent peers;
//! - [`lifecycle`]: PostPerspective per event and perspective, PostAllPerspectives / PostLifecycle
//!   once per event, orphan reconciliation.

pub mod claim;
pub mod completion;
pub mod drain;
pub mod heartbeat;
pub mod hooks;
pub mod lifecycle;
pub mod listener;
pub mod runner;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use hooks::{HookEvent, Hooks};
pub use runner::{
    ApplyMode, ApplyOutcome, Group, PerspectiveRunner, RunnerError, SqlRunner, WorkItem,
};

use crate::compile::definition_hash;
use crate::config::Config;
use crate::dedup::ProcessedEventCache;
use crate::http::Readiness;
use crate::metrics::WorkerMetrics;
use crate::store::instances::InstanceInfo;
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
    pub max_connections: u32,
    pub runner: Option<Arc<dyn PerspectiveRunner>>,
    pub metrics: Arc<WorkerMetrics>,
    pub readiness: Readiness,
    pub hooks: Hooks,
}

impl EngineOptions {
    pub fn new(config: Config, database_url: impl Into<String>) -> Self {
        EngineOptions {
            config: Arc::new(config),
            database_url: database_url.into(),
            instance_id: Uuid::now_v7(),
            service_name: "perspective-worker".into(),
            max_connections: 10,
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
        "perspective {perspective} in schema {schema} was compiled from a different definition than the config's: run `perspective-worker migrate` to compile the current handlers"
    )]
    PerspectiveOutdated { schema: String, perspective: String },
}

/// The in-process mutex serialising applies of one (stream, perspective).
pub(crate) type PairGate = Arc<tokio::sync::Mutex<()>>;

/// Shared state of the engine's tasks.
pub(crate) struct Ctx {
    pub config: Arc<Config>,
    pub instance_id: Uuid,
    /// Who this instance is, as recorded with each heartbeat.
    pub instance: InstanceInfo,
    pub store: Store,
    pub listen_pool: PgPool,
    pub runner: Arc<dyn PerspectiveRunner>,
    pub hooks: Hooks,
    pub metrics: Arc<WorkerMetrics>,
    pub readiness: Readiness,
    pub cache: Mutex<ProcessedEventCache>,
    pub drain_tx: mpsc::Sender<Uuid>,
    pub completion_tx: mpsc::UnboundedSender<(i64, Uuid)>,
    pub settle_tx: mpsc::UnboundedSender<Uuid>,
    /// Applied work rows per stream queued for the completion flush worker (Batched): such a
    /// stream cannot be retired before the flush, and the flush settles it afterwards.
    pub unflushed: Mutex<HashMap<Uuid, HashSet<i64>>>,
    pub in_flight: Mutex<HashMap<Uuid, bool>>,
    pub pair_gates: Mutex<HashMap<(Uuid, String), PairGate>>,
    pub listener_healthy: AtomicBool,
    pub batches_in_flight: AtomicUsize,
    pub first_claim: AtomicBool,
    pub shutdown: CancellationToken,
}

impl Ctx {
    /// Hand applied work rows of `stream` to the completion flush worker.
    pub(crate) fn queue_completions(&self, stream: Uuid, ids: &[i64]) {
        self.unflushed
            .lock()
            .unwrap()
            .entry(stream)
            .or_default()
            .extend(ids);
        for id in ids {
            let _ = self.completion_tx.send((*id, stream));
        }
    }

    /// The flush worker deleted these rows.
    pub(crate) fn completions_flushed(&self, rows: &[(i64, Uuid)]) {
        let mut unflushed = self.unflushed.lock().unwrap();
        for (id, stream) in rows {
            if let Some(ids) = unflushed.get_mut(stream) {
                ids.remove(id);
                if ids.is_empty() {
                    unflushed.remove(stream);
                }
            }
        }
    }

    /// Whether applied rows of `stream` are still waiting for the flush worker.
    pub(crate) fn awaiting_flush(&self, stream: &Uuid) -> bool {
        self.unflushed.lock().unwrap().contains_key(stream)
    }

    /// The in-process mutex of one (stream, perspective).
    pub(crate) fn pair_gate(&self, stream: Uuid, perspective: &str) -> PairGate {
        self.pair_gates
            .lock()
            .unwrap()
            .entry((stream, perspective.to_string()))
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(())))
            .clone()
    }

    /// Forget a gate nobody else holds or waits for.
    pub(crate) fn release_pair_gate(
        &self,
        stream: Uuid,
        perspective: &str,
        gate: Arc<tokio::sync::Mutex<()>>,
    ) {
        let mut gates = self.pair_gates.lock().unwrap();
        // Ours plus the map's reference: nobody else holds or waits for it.
        if Arc::strong_count(&gate) <= 2 {
            gates.remove(&(stream, perspective.to_string()));
        }
    }

    pub(crate) fn first_claim_done(&self) {
        if !self.first_claim.swap(true, Ordering::Relaxed) {
            self.readiness.set_ready();
            tracing::info!(instance_id = %self.instance_id, "first claim succeeded; ready");
        }
    }
}

/// A running engine.
pub struct Engine {
    ctx: Arc<Ctx>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    flush_task: Option<tokio::task::JoinHandle<()>>,
}

impl Engine {
    /// Verify the schema, register the instance and start every task.
    pub async fn start(
        options: EngineOptions,
        shutdown: CancellationToken,
    ) -> Result<Engine, EngineError> {
        let config = options.config.clone();
        let schema = config.schema.clone();
        let connect = |app: &str| crate::db::connect_options(&options.database_url, app);
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(2))
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(connect("perspective-worker").map_err(|e| db("parsing DATABASE_URL", e))?)
            .await
            .map_err(|e| db("connecting to PostgreSQL", e))?;
        let listen_pool = PgPoolOptions::new().max_connections(1).connect_lazy_with(
            connect("perspective-worker listen").map_err(|e| db("parsing DATABASE_URL", e))?,
        );

        let store = Store::new(pool, &schema);
        verify_schema(&store, &config).await?;

        let (drain_tx, drain_rx) =
            mpsc::channel(config.worker.drain_batcher.max_size.max(16) as usize * 4);
        let (completion_tx, completion_rx) = mpsc::unbounded_channel();
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        for p in &config.perspectives {
            options.metrics.init_perspective(&p.name);
        }
        let runner = options
            .runner
            .clone()
            .unwrap_or_else(|| Arc::new(SqlRunner::new(&config)));
        let instance = InstanceInfo {
            instance_id: options.instance_id,
            service_name: options.service_name.clone(),
            host_name: std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()),
            process_id: std::process::id() as i32,
            metadata: serde_json::to_value(&config.worker.instance_metadata).unwrap_or_default(),
        };
        let ctx = Arc::new(Ctx {
            instance_id: options.instance_id,
            instance,
            store,
            listen_pool,
            runner,
            hooks: options.hooks.clone(),
            metrics: options.metrics.clone(),
            readiness: options.readiness.clone(),
            cache: Mutex::new(ProcessedEventCache::new(Duration::from_secs(
                config.worker.lease_seconds as u64,
            ))),
            drain_tx,
            completion_tx,
            settle_tx,
            unflushed: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            pair_gates: Mutex::new(HashMap::new()),
            listener_healthy: AtomicBool::new(false),
            batches_in_flight: AtomicUsize::new(0),
            first_claim: AtomicBool::new(false),
            shutdown,
            config,
        });
        ctx.readiness.set_not_ready("first claim pending");

        // Register before the first claim, so it ranks us among the live instances.
        heartbeat::beat(&ctx)
            .await
            .map_err(|e| db("registering the instance", e))?;
        tracing::info!(instance_id = %ctx.instance_id, schema = %ctx.store.schema(), "worker instance registered");

        if ctx.config.worker.notify_applied {
            lifecycle::reconcile_orphans(&ctx).await;
        }
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(listener::run(ctx.clone())));
        tasks.push(tokio::spawn(heartbeat::run(ctx.clone())));
        tasks.push(tokio::spawn(completion::settler(ctx.clone(), settle_rx)));
        let rx: drain::SharedReceiver = Arc::new(tokio::sync::Mutex::new(drain_rx));
        for _ in 0..ctx.config.worker.max_concurrent_drain_consumers.max(1) {
            tasks.push(tokio::spawn(drain::consumer(ctx.clone(), rx.clone())));
        }
        tasks.push(tokio::spawn(claim::run(ctx.clone())));
        let flush_task = Some(tokio::spawn(completion::flush_worker(
            ctx.clone(),
            completion_rx,
        )));
        Ok(Engine {
            ctx,
            tasks,
            flush_task,
        })
    }

    pub fn hooks(&self) -> &Hooks {
        &self.ctx.hooks
    }

    pub fn instance_id(&self) -> Uuid {
        self.ctx.instance_id
    }

    /// Wait for the shutdown token, then stop: no new claims, in-flight batches finish,
    /// completions are flushed, leases and streams are released, the instance deregisters.
    pub async fn run_until_stopped(mut self) -> Result<(), EngineError> {
        self.ctx.shutdown.cancelled().await;
        tracing::info!("stopping: finishing in-flight work");
        self.ctx.readiness.set_not_ready("shutting down");
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        if let Some(t) = self.flush_task.take() {
            let _ = t.await;
        }
        self.ctx
            .store
            .deregister_instance(self.ctx.instance_id)
            .await
            .map_err(|e| db("deregistering the instance", e))?;
        self.ctx.store.close().await;
        tracing::info!(instance_id = %self.ctx.instance_id, "stopped; leases released and instance deregistered");
        Ok(())
    }
}

fn db(step: &'static str, e: sqlx::Error) -> EngineError {
    EngineError::Database {
        step,
        message: crate::db::describe_error(&e, None),
    }
}

/// The schema must be at this binary's migration and every perspective compiled from the
/// config's current definition.
async fn verify_schema(store: &Store, config: &Config) -> Result<(), EngineError> {
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
