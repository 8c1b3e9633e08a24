//! Options whose effect is specific to the custom `PerspectiveRunner` path (rows fetched by the
//! worker and applied through the runner), shown through the real engine: `leaseSeconds` is the
//! lease on the rows the runner gets, `maxConcurrentPerspectives` bounds the groups it applies
//! at once.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use futures::future::BoxFuture;
use perspective_worker::config::Config;
use perspective_worker::engine::{
    ApplyMode, ApplyOutcome, EngineOptions, Group, PerspectiveRunner, RunnerError, SqlRunner,
};
use sqlx::postgres::PgConnection;
use uuid::Uuid;

/// A custom runner (the engine fetches rows for it) that applies through the SQL runner and
/// records, per call, how long the rows' leases have left and how many calls run at once.
struct Probe {
    inner: SqlRunner,
    schema: String,
    /// Calls wait (up to a timeout) until this many run at once, so that a limit above it
    /// would show as more.
    rendezvous: usize,
    running: AtomicUsize,
    most_running: AtomicUsize,
    lease_left_seconds: Mutex<Vec<f64>>,
}

impl Probe {
    fn new(config: &Config, rendezvous: usize) -> Arc<Probe> {
        Arc::new(Probe {
            inner: SqlRunner::new(config),
            schema: config.schema.clone(),
            rendezvous,
            running: AtomicUsize::new(0),
            most_running: AtomicUsize::new(0),
            lease_left_seconds: Mutex::new(Vec::new()),
        })
    }
}

impl PerspectiveRunner for Probe {
    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        group: &'a Group,
        mode: ApplyMode,
    ) -> BoxFuture<'a, Result<ApplyOutcome, RunnerError>> {
        Box::pin(async move {
            let now_running = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_running.fetch_max(now_running, Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_millis(300);
            while self.running.load(Ordering::SeqCst) < self.rendezvous && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let ids: Vec<i64> = group.items.iter().map(|i| i.event_work_id).collect();
            let left: Vec<f64> = sqlx::query_scalar(&format!(
                "SELECT extract(epoch FROM lease_expiry - clock_timestamp())::float8
                 FROM {}.wh_perspective_events WHERE event_work_id = ANY ($1)",
                self.schema
            ))
            .bind(&ids)
            .fetch_all(&mut *conn)
            .await?;
            self.lease_left_seconds.lock().unwrap().extend(left);
            let outcome = self.inner.apply(conn, group, mode).await;
            self.running.fetch_sub(1, Ordering::SeqCst);
            outcome
        })
    }
}

/// Append one event to each of `streams` streams, then run an engine with `probe` until every
/// row is applied (exactly once, in order).
async fn run_through(schema: &str, config: &Config, probe: Arc<Probe>, streams: usize) {
    let streams: Vec<Uuid> = (0..streams).map(|_| Uuid::now_v7()).collect();
    append_load(schema, &streams, 1, 1, streams.len()).await;
    let mut options = EngineOptions::new(config.clone(), database_url());
    options.runner = Some(probe);
    let engine = RunningEngine::start_with(options).await;
    wait_drained(schema, Duration::from_secs(60)).await;
    engine.stop().await;
    assert_exactly_once(schema, streams.len()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_seconds_is_the_lease_on_rows_handed_to_a_custom_runner() {
    let schema = unique_schema("opt_lease");
    let config = parse_config(&recording_yaml(&schema, "worker:\n  leaseSeconds: 7\n"));
    migrate_config(&config).await;
    let probe = Probe::new(&config, 1);
    run_through(&schema, &config, probe.clone(), 3).await;
    let left = probe.lease_left_seconds.lock().unwrap().clone();
    assert_eq!(left.len(), 6, "3 streams × 2 perspectives, one row each");
    for l in left {
        assert!(
            l > 4.0 && l <= 7.0,
            "a row's lease had {l} s left, expected ≤ 7"
        );
    }
}

async fn most_concurrent_applies(limit: usize) -> usize {
    let schema = unique_schema(&format!("opt_conc{limit}"));
    let config = parse_config(&recording_yaml(
        &schema,
        &format!(
            "worker:\n  maxConcurrentPerspectives: {limit}\n  maxConcurrentDrainConsumers: 1\n"
        ),
    ));
    migrate_config(&config).await;
    // Calls wait for `limit + 1` partners: only a limit that is not honoured reaches it.
    let probe = Probe::new(&config, limit + 1);
    // 6 streams × 2 perspectives: 12 groups; even a batch of one stream has two.
    run_through(&schema, &config, probe.clone(), 6).await;
    probe.most_running.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrent_perspectives_bounds_the_groups_a_custom_runner_applies_at_once() {
    assert_eq!(most_concurrent_applies(1).await, 1);
    assert_eq!(most_concurrent_applies(2).await, 2);
}
