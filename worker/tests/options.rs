//! Each worker option's documented effect, shown through the real engine against a real
//! PostgreSQL (the claim loop's interval options and the drain batcher's window are unit-tested
//! next to their code, in engine/claim.rs and engine/drain.rs). Some options only concern the
//! custom `PerspectiveRunner` path (rows fetched by the worker and applied through the runner):
//! `leaseSeconds` is the lease on the rows the runner gets, `maxConcurrentPerspectives` bounds
//! the groups it applies at once.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use futures::future::BoxFuture;
use perspective_worker::config::Config;
use perspective_worker::engine::{
    ApplyMode, ApplyOutcome, EngineOptions, Group, HookEvent, PerspectiveRunner, RunnerError,
    SqlRunner,
};
use sqlx::postgres::PgConnection;
use tokio::sync::broadcast;
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

/// The most batches one worker applied at once with the `worker:` options `options` (one
/// stream per batch and one group at a time per batch, so concurrent applies are batches), where
/// calls wait for a third partner: only more than two consumers reach it.
async fn most_concurrent_batches(name: &str, options: &str, streams: usize) -> usize {
    let schema = unique_schema(name);
    let config = parse_config(&recording_yaml(
        &schema,
        &format!(
            "worker:\n{options}  maxConcurrentPerspectives: 1\n  drainBatcher: {{ maxSize: 1 }}\n"
        ),
    ));
    migrate_config(&config).await;
    let probe = Probe::new(&config, 3);
    run_through(&schema, &config, probe.clone(), streams).await;
    probe.most_running.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrent_drain_consumers_bounds_the_batches_applied_at_once() {
    let options = "  maxConcurrentDrainConsumers: 2\n";
    assert_eq!(
        most_concurrent_batches("opt_consumers", options, 4).await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_consumers_per_deployment_leaves_one_worker_its_share_of_the_consumers() {
    let options = "  maxConcurrentDrainConsumers: 4\n  drainConsumersPerDeployment: 2\n";
    assert_eq!(most_concurrent_batches("opt_deploy1", options, 6).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_consumers_per_deployment_is_shared_among_the_live_workers() {
    let schema = unique_schema("opt_deploy2");
    let config = parse_config(&recording_yaml(
        &schema,
        "worker:
  maxConcurrentDrainConsumers: 4
  drainConsumersPerDeployment: 2
  maxConcurrentPerspectives: 1
  drainBatcher: { maxSize: 1 }
  heartbeatIntervalSeconds: 2
",
    ));
    migrate_config(&config).await;
    // Two workers, one probe: calls wait for a third partner, which only more than one
    // consumer per worker reaches.
    let probe = Probe::new(&config, 3);
    let mut engines = Vec::new();
    for _ in 0..2 {
        let mut options = EngineOptions::new(config.clone(), database_url());
        options.runner = Some(probe.clone());
        engines.push(RunningEngine::start_with(options).await);
    }
    for (i, engine) in engines.iter().enumerate() {
        let metrics = engine.metrics.clone();
        wait_until(
            &format!("worker {i} counting both workers and running 1 consumer"),
            Duration::from_secs(10),
            || async { metrics.drain_consumers.get() == 1 },
        )
        .await;
    }
    let streams: Vec<Uuid> = (0..8).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 1, 1, streams.len()).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    let first = engines.remove(0);
    first.stop().await;
    assert_exactly_once(&schema, streams.len()).await;
    assert!(
        probe.most_running.load(Ordering::SeqCst) <= 2,
        "one consumer per worker: {} applies at once",
        probe.most_running.load(Ordering::SeqCst)
    );
    // The other worker, alone now (the stopped one deregistered), takes the whole share at its
    // next heartbeat.
    let second = engines.remove(0);
    let metrics = second.metrics.clone();
    wait_until(
        "the remaining worker running both consumers",
        Duration::from_secs(15),
        || async { metrics.drain_consumers.get() == 2 },
    )
    .await;
    second.stop().await;
}

/// When a peer begins its stop, the remaining worker recounts the live workers at once (the
/// `orphan` doorbell of `hand_over_streams`), not at its next heartbeat: in a rolling update the
/// new worker otherwise drained with half its share until then. Here heartbeats are 20 s apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_takes_the_whole_share_as_soon_as_its_peer_begins_to_stop() {
    let schema = unique_schema("opt_recount");
    let config = parse_config(&recording_yaml(
        &schema,
        "worker:
  maxConcurrentDrainConsumers: 4
  drainConsumersPerDeployment: 2
  heartbeatIntervalSeconds: 20
  abandonStaleInstanceThresholdSeconds: 60
",
    ));
    migrate_config(&config).await;
    let first = RunningEngine::start(&config).await;
    let second = RunningEngine::start(&config).await;
    for (name, engine) in [("first", &first), ("second", &second)] {
        let metrics = engine.metrics.clone();
        // (The first counts the second at its first beat, a second after registering.)
        wait_until(
            &format!("the {name} worker counting both and running 1 consumer"),
            Duration::from_secs(10),
            || async { metrics.drain_consumers.get() == 1 },
        )
        .await;
    }
    // Both past their first beat (the early one), so that only the recount can come next.
    let beaten = format!(
        "SELECT count(*) FROM {schema}.wh_service_instances WHERE last_heartbeat_at > started_at"
    );
    wait_until("both workers' first beat", Duration::from_secs(10), || {
        let sql = beaten.clone();
        async move { scalar(&sql).await == 2 }
    })
    .await;
    let stopping = tokio::time::Instant::now();
    first.stop().await;
    let metrics = second.metrics.clone();
    wait_until(
        "the remaining worker running both consumers",
        Duration::from_secs(5),
        || async { metrics.drain_consumers.get() == 2 },
    )
    .await;
    println!("recounted {:?} after the stop began", stopping.elapsed());
    second.stop().await;
}

/// The next hook event, or a panic naming `what` after 10 s.
async fn next_hook(rx: &mut broadcast::Receiver<HookEvent>, what: &str) -> HookEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .expect("hook channel")
}

/// Start an engine whose hooks are subscribed before its first poll.
async fn start_subscribed(config: &Config) -> (RunningEngine, broadcast::Receiver<HookEvent>) {
    let options = EngineOptions::new(config.clone(), database_url());
    let hooks = options.hooks.subscribe();
    (RunningEngine::start_with(options).await, hooks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perspective_batch_size_bounds_events_per_apply_transaction() {
    let schema = unique_schema("opt_pbs");
    let config = parse_config(&format!(
        "schema: {schema}
perspectives:
  - name: tx
    setup: CREATE TABLE IF NOT EXISTS tx_seen (stream_version bigint, txid bigint)
    handlers:
      A: INSERT INTO tx_seen VALUES (:stream_version, txid_current())
worker:
  perspectiveBatchSize: 3
"
    ));
    migrate_config(&config).await;
    // Ten events in one stream, all due before the engine starts.
    append_load(&schema, &[Uuid::now_v7()], 10, 1, 10).await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let mut conn = connect().await;
    let per_transaction: Vec<Vec<i64>> = sqlx::query_scalar(&format!(
        "SELECT array_agg(stream_version ORDER BY stream_version) FROM {schema}.tx_seen
         GROUP BY txid ORDER BY min(stream_version)"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        per_transaction,
        [vec![1, 2, 3], vec![4, 5, 6], vec![7, 8, 9], vec![10]]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_mode_keeps_completed_work_rows_stamped_with_processed_at() {
    let schema = unique_schema("opt_debug");
    let config = parse_config(&recording_yaml(&schema, "worker:\n  debugMode: true\n"));
    migrate_config(&config).await;
    let streams: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 2, 1, 6).await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 3).await;
    let mut conn = connect().await;
    let (kept, stamped): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(processed_at) FROM {schema}.wh_perspective_events"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        (kept, stamped),
        (12, 12),
        "3 streams × 2 events × 2 perspectives, kept and stamped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_metadata_is_recorded_with_the_instance() {
    let schema = unique_schema("opt_meta");
    let config = parse_config(&recording_yaml(
        &schema,
        "worker:\n  instanceMetadata: { zone: eu-1, build: \"42\" }\n",
    ));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let mut conn = connect().await;
    let metadata: serde_json::Value = sqlx::query_scalar(&format!(
        "SELECT metadata FROM {schema}.wh_service_instances WHERE instance_id = $1"
    ))
    .bind(engine.instance_id)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    engine.stop().await;
    assert_eq!(metadata, serde_json::json!({"zone": "eu-1", "build": "42"}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_streams_per_batch_bounds_the_streams_one_claim_offers() {
    let schema = unique_schema("opt_msb");
    // Fast polls: a full claim does not poll again at once, the rest waits for the next one.
    let config = parse_config(&recording_yaml(
        &schema,
        "claimWorker:
  maxStreamsPerBatch: 2
  pollingIntervalMilliseconds: 20
  notifyHealthyPollingIntervalMilliseconds: 20
  pollingMaxIntervalMilliseconds: 50
",
    ));
    migrate_config(&config).await;
    let streams: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 1, 1, 5).await;
    let (engine, mut hooks) = start_subscribed(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 5).await;
    let offered: Vec<usize> = std::iter::from_fn(|| hooks.try_recv().ok())
        .filter_map(|e| match e {
            HookEvent::ClaimPolled { queued, .. } => Some(queued),
            _ => None,
        })
        .collect();
    assert_eq!(
        offered.iter().find(|n| **n > 0),
        Some(&2),
        "the first claim found 5 streams and offered 2; polls: {offered:?}"
    );
    assert!(offered.iter().all(|n| *n <= 2), "polls: {offered:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_threshold_polls_is_the_number_of_empty_polls_before_idle() {
    let schema = unique_schema("opt_idle");
    // Fast polls whether or not NOTIFY is up, so the empty polls come quickly.
    let config = parse_config(&recording_yaml(
        &schema,
        "worker:
  idleThresholdPolls: 5
claimWorker:
  pollingIntervalMilliseconds: 10
  notifyHealthyPollingIntervalMilliseconds: 10
  pollingMaxIntervalMilliseconds: 20
",
    ));
    migrate_config(&config).await;
    append_load(&schema, &[Uuid::now_v7()], 1, 1, 1).await;
    let (engine, mut hooks) = start_subscribed(&config).await;
    let (mut worked, mut empty_polls) = (false, 0);
    loop {
        match next_hook(&mut hooks, "the engine to go idle").await {
            HookEvent::ClaimPolled { streams: 0, .. } => empty_polls += 1,
            HookEvent::ClaimPolled { .. } => {
                worked = true;
                empty_polls = 0;
            }
            // Emitted by the threshold's poll, before that poll's ClaimPolled.
            HookEvent::WorkProcessingIdle => break,
            _ => {}
        }
    }
    engine.stop().await;
    assert!(worked, "idle only after having had work");
    assert_eq!(
        empty_polls + 1,
        5,
        "the 5th consecutive empty poll went idle"
    );
}

/// Events applied by the first batch of an engine started on one stream with 10 due events,
/// applied 2 at a time per perspective (`extra` sets the drain-loop options).
async fn first_batch_events(prefix: &str, extra: &str) -> u64 {
    let schema = unique_schema(prefix);
    let config = parse_config(&recording_yaml(
        &schema,
        &format!("worker:\n  perspectiveBatchSize: 2\n{extra}"),
    ));
    migrate_config(&config).await;
    append_load(&schema, &[Uuid::now_v7()], 10, 1, 10).await;
    let (engine, mut hooks) = start_subscribed(&config).await;
    let applied = loop {
        if let HookEvent::BatchCycleComplete { events_applied, .. } =
            next_hook(&mut hooks, "the first batch").await
        {
            break events_applied;
        }
    };
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 1).await;
    applied
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_loop_max_iterations_bounds_the_rounds_of_one_batch() {
    // Rounds of 2 events × 2 perspectives.
    let applied = first_batch_events("opt_iter", "  drainLoopMaxIterations: 2\n").await;
    assert_eq!(applied, 8, "2 rounds");
    let applied = first_batch_events("opt_iter1", "  drainLoopMaxIterations: 1\n").await;
    assert_eq!(applied, 4, "single pass");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_loop_refetch_min_batch_is_the_round_size_that_earns_a_refetch() {
    // A round takes 4 rows of the stream (2 per perspective); up to 5 rounds per batch.
    let applied = first_batch_events("opt_refetch4", "  drainLoopRefetchMinBatch: 4\n").await;
    assert_eq!(
        applied, 20,
        "4 rows are enough: fetched again until drained"
    );
    let applied = first_batch_events("opt_refetch5", "  drainLoopRefetchMinBatch: 5\n").await;
    assert_eq!(applied, 4, "4 rows are too few: no refetch");
}
