//! Shared helpers for the integration tests. They need a real PostgreSQL: `make test` starts a
//! throwaway cluster and sets TEST_DATABASE_URL. Every test works in its own schema, so tests
//! run in parallel against one cluster.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use perspective_worker::admin::migrate::{migrate, MigrateOptions};
use perspective_worker::config::Config;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::Connection;

pub fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "TEST_DATABASE_URL is not set: these tests need a real PostgreSQL. Run `make test`, \
             or `tests/pg/pg.sh with cargo test` to start a throwaway cluster"
        )
    })
}

/// A schema name no other test (or test process) uses.
pub fn unique_schema(prefix: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = format!("t_{prefix}_{}_{n}", std::process::id());
    assert!(
        name.len() <= 40,
        "schema name {name} too long; shorten the prefix"
    );
    name
}

/// Two perspectives: `alpha` handles A and B, `beta` handles B and C. Event type D has no
/// subscriber. Each handler records the event it saw.
pub fn two_perspective_yaml(schema: &str) -> String {
    format!(
        r#"
schema: {schema}
perspectives:
  - name: alpha
    setup: |
      CREATE TABLE IF NOT EXISTS alpha_seen (stream_id uuid, stream_version bigint, event_type text);
    handlers:
      A: INSERT INTO alpha_seen VALUES (:stream_id, :stream_version, :event_type)
      B: INSERT INTO alpha_seen VALUES (:stream_id, :stream_version, :event_type)
  - name: beta
    setup: |
      CREATE TABLE IF NOT EXISTS beta_seen (stream_id uuid, stream_version bigint, total numeric);
    handlers:
      B: INSERT INTO beta_seen VALUES (:stream_id, :stream_version, (:data->>'total')::numeric)
      C: INSERT INTO beta_seen VALUES (:stream_id, :stream_version, NULL)
"#
    )
}

pub fn parse_config(yaml: &str) -> Config {
    Config::from_yaml_str(yaml, "test.yaml").unwrap_or_else(|e| panic!("test config invalid: {e}"))
}

pub async fn connect() -> PgConnection {
    PgConnection::connect(&database_url())
        .await
        .expect("connect to the test database")
}

pub async fn pool(max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .connect(&database_url())
        .await
        .expect("test pool")
}

/// A fresh schema with the two-perspective config migrated into it.
pub async fn migrated_schema(prefix: &str) -> (String, Config) {
    let schema = unique_schema(prefix);
    let config = parse_config(&two_perspective_yaml(&schema));
    let mut conn = connect().await;
    migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .expect("migrate");
    (schema, config)
}

/// Run SQL through the real `psql` client (not through Rust), stopping at the first error.
pub fn psql(sql: &str) -> Output {
    Command::new("psql")
        .arg(database_url())
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
        .output()
        .expect("run psql")
}

/// The worker binary built for this test run.
pub fn worker_bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_perspective-worker"));
    cmd.env("DATABASE_URL", database_url())
        .env("RUST_LOG", "warn");
    cmd
}

/// One number from the test database (NULL reads as 0).
pub async fn scalar(sql: &str) -> i64 {
    let mut conn = connect().await;
    sqlx::query_scalar::<_, Option<i64>>(sql)
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .unwrap_or(0)
}

/// Poll `check` until it returns true or `timeout` passes.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A running in-process engine; stop it with [`RunningEngine::stop`].
pub struct RunningEngine {
    pub hooks: perspective_worker::engine::Hooks,
    pub instance_id: uuid::Uuid,
    pub metrics: std::sync::Arc<perspective_worker::engine::metrics::WorkerMetrics>,
    shutdown: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Result<(), perspective_worker::engine::EngineError>>,
}

impl RunningEngine {
    pub async fn start(config: &Config) -> RunningEngine {
        let options =
            perspective_worker::engine::EngineOptions::new(config.clone(), database_url());
        Self::start_with(options).await
    }

    pub async fn start_with(options: perspective_worker::engine::EngineOptions) -> RunningEngine {
        init_test_logs();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let hooks = options.hooks.clone();
        let metrics = options.metrics.clone();
        let engine = perspective_worker::engine::Engine::start(options, shutdown.clone())
            .await
            .expect("engine starts");
        let instance_id = engine.instance_id();
        let task = tokio::spawn(engine.run_until_stopped());
        RunningEngine {
            hooks,
            instance_id,
            metrics,
            shutdown,
            task,
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        match tokio::time::timeout(Duration::from_secs(30), self.task).await {
            Ok(stopped) => stopped.expect("engine task").expect("engine stops cleanly"),
            Err(_) => panic!(
                "engine {} did not stop within 30 s; server sessions:\n{}",
                self.instance_id,
                server_sessions().await
            ),
        }
    }
}

/// The engines' logs, captured per test (shown when it fails): `TEST_LOG` filters them
/// (default `perspective_worker=info`).
pub fn init_test_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = std::env::var("TEST_LOG").unwrap_or_else(|_| "perspective_worker=info".into());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .with_ansi(false)
            .try_init();
    });
}

/// What every other session of the test server is doing (state, wait, query head), to say
/// where a stuck engine waits.
pub async fn server_sessions() -> String {
    let mut conn = connect().await;
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT format('  [%s] wait=%s:%s app=%s %s', state, wait_event_type, wait_event,
                       application_name, left(regexp_replace(query, '\\s+', ' ', 'g'), 160))
         FROM pg_stat_activity
         WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default();
    rows.join("\n")
}

/// Config with perspectives `p1` and `p2`, each recording, per stream, the versions it applied
/// (in `seen_p1` / `seen_p2`), for event types A and B. `extra` is appended to the YAML
/// (worker/claimWorker options).
pub fn recording_yaml(schema: &str, extra: &str) -> String {
    let mut y = format!("schema: {schema}\nperspectives:\n");
    for p in ["p1", "p2"] {
        y.push_str(&format!(
            "  - name: {p}
    setup: CREATE TABLE IF NOT EXISTS seen_{p} (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL)
    handlers:
      A: INSERT INTO seen_{p} AS s VALUES (:stream_id, ARRAY[:stream_version]) ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version
      B: INSERT INTO seen_{p} AS s VALUES (:stream_id, ARRAY[:stream_version]) ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version
"
        ));
    }
    y.push_str(extra);
    y
}

/// `yaml` (from [`recording_yaml`]) with `perspective`'s handler of A failing on every event
/// whose data has `"poison": "yes"` (a cast error: an exception only for that event).
pub fn poisonable(yaml: &str, perspective: &str) -> String {
    yaml.replacen(
        &format!("      A: INSERT INTO seen_{perspective}"),
        &format!(
            "      A: SELECT (coalesce(:data->>'poison', '0'))::int; INSERT INTO seen_{perspective}"
        ),
        1,
    )
}

/// Migrate a config into the test database.
pub async fn migrate_config(config: &Config) {
    let mut conn = connect().await;
    migrate(&mut conn, config, "test.yaml", MigrateOptions::default())
        .await
        .expect("migrate");
}

/// Append `per_stream` events of type A to each stream, from `writers` concurrent tasks, in
/// transactions of `per_tx` events. Each transaction appends in stream-id order: a transaction
/// holds every stream head it wrote until it commits, so writers touching several streams must
/// agree on an order or deadlock.
pub async fn append_load(
    schema: &str,
    streams: &[uuid::Uuid],
    per_stream: usize,
    writers: usize,
    per_tx: usize,
) {
    let pool = pool(writers as u32).await;
    let mut jobs: Vec<uuid::Uuid> = Vec::new();
    for _ in 0..per_stream {
        jobs.extend_from_slice(streams);
    }
    let chunks: Vec<Vec<uuid::Uuid>> = jobs.chunks(per_tx).map(|c| c.to_vec()).collect();
    let chunks = std::sync::Arc::new(std::sync::Mutex::new(chunks.into_iter()));
    let mut tasks = Vec::new();
    for _ in 0..writers {
        let pool = pool.clone();
        let chunks = chunks.clone();
        let sql = format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type, metadata)
             SELECT s, 'A', '{{\"user_id\": \"load\"}}' FROM unnest($1::uuid[]) WITH ORDINALITY AS x(s, o) ORDER BY s, o"
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let next = chunks.lock().unwrap().next();
                let Some(chunk) = next else { break };
                sqlx::query(&sql)
                    .bind(&chunk)
                    .execute(&pool)
                    .await
                    .expect("append");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Wait until no work row is pending in `schema`.
pub async fn wait_drained(schema: &str, timeout: Duration) {
    let pool = pool(1).await;
    let sql =
        format!("SELECT count(*) FROM {schema}.wh_perspective_events WHERE processed_at IS NULL");
    wait_until("all work applied", timeout, || {
        let pool = pool.clone();
        let sql = sql.clone();
        async move {
            sqlx::query_scalar::<_, i64>(&sql)
                .fetch_one(&pool)
                .await
                .unwrap()
                == 0
        }
    })
    .await;
}

/// Every stream's recorded versions in both perspectives must be exactly 1..n, n being the
/// stream's event count.
pub async fn assert_exactly_once(schema: &str, expected_streams: usize) {
    let mut conn = connect().await;
    for p in ["p1", "p2"] {
        let bad: Vec<(uuid::Uuid, Vec<i64>, i64)> = sqlx::query_as(&format!(
            "SELECT s.stream_id, s.versions, h.version
             FROM {schema}.seen_{p} s JOIN {schema}.wh_streams h USING (stream_id)
             WHERE s.versions <> ARRAY(SELECT generate_series(1, h.version))"
        ))
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert!(
            bad.is_empty(),
            "{p}: {} stream(s) not applied exactly once in order, e.g. {:?}",
            bad.len(),
            bad.first()
        );
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.seen_{p}"))
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(n as usize, expected_streams, "{p}: every stream has a row");
    }
}
