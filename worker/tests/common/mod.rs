//! Shared helpers for the integration tests. They need a real PostgreSQL: `make test` starts a
//! throwaway cluster and sets TEST_DATABASE_URL. Every test works in its own schema, so tests
//! run in parallel against one cluster.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use perspective_worker::admin::migrate::{migrate, MigrateOptions};
use perspective_worker::config::Config;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::Connection;

pub mod cluster;
pub mod proxy;

/// The database of this test binary when it asked for one of its own (`use_own_database`).
static OWN_DATABASE: OnceLock<String> = OnceLock::new();

pub fn database_url() -> String {
    if let Some(url) = OWN_DATABASE.get() {
        return url.clone();
    }
    shared_database_url()
}

/// `database_url()` with server settings for the sessions it opens (`options[name]=value`).
pub fn database_url_with(settings: &[(&str, &str)]) -> String {
    let url = database_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let options: Vec<String> = settings
        .iter()
        .map(|(name, value)| format!("options[{name}]={value}"))
        .collect();
    format!("{url}{sep}{}", options.join("&"))
}

fn shared_database_url() -> String {
    std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "TEST_DATABASE_URL is not set: these tests need a real PostgreSQL. Run `make test`, \
             or `tests/pg/pg.sh with cargo test` to start a throwaway cluster"
        )
    })
}

/// Moves every helper of this test binary into a database of its own, created now, for a test
/// that reads database-wide statistics (`pg_stat_database.deadlocks`): `make test` runs other
/// suites beside it against the shared database, and their deadlocks would count. The binary
/// must hold that one test, and call this before anything else.
pub async fn use_own_database(prefix: &str) {
    let shared = shared_database_url();
    let name = format!("{prefix}_{}", std::process::id());
    let mut conn = PgConnection::connect(&shared)
        .await
        .expect("connect to the test database");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("create database {name}: {e}"));
    let (base, query) = shared
        .split_once('?')
        .map_or((shared.as_str(), None), |(b, q)| (b, Some(q)));
    let (server, _) = base
        .rsplit_once('/')
        .filter(|(server, _)| server.contains("://") && !server.ends_with('/'))
        .expect("TEST_DATABASE_URL names a database: postgres://user@host:port/db");
    let url = match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    };
    OWN_DATABASE
        .set(url)
        .expect("use_own_database is called once per test binary");
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

/// Wait until no work row is pending in `schema`; past `timeout`, panic with the first pending
/// rows and their streams' cursors.
pub async fn wait_drained(schema: &str, timeout: Duration) {
    let pool = pool(1).await;
    let sql =
        format!("SELECT count(*) FROM {schema}.wh_perspective_events WHERE processed_at IS NULL");
    let deadline = Instant::now() + timeout;
    loop {
        let pending: i64 = sqlx::query_scalar(&sql).fetch_one(&pool).await.unwrap();
        if pending == 0 {
            return;
        }
        if Instant::now() >= deadline {
            let stuck = stuck_rows(&pool, schema).await;
            panic!(
                "timed out after {timeout:?} waiting for all work applied: {pending} row(s) pending; the first ones, each with its stream's cursors:\n{}",
                stuck.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The first pending work rows, each with its error and every cursor of its stream (of any
/// perspective name, a version's internal ones too): what a failed drain leaves to read.
async fn stuck_rows(pool: &sqlx::PgPool, schema: &str) -> Vec<String> {
    let rows: Vec<(String,)> = sqlx::query_as(&format!(
        "SELECT format('%s %s v%s attempts %s error %s; cursors: %s', w.stream_id, w.perspective_name,
                       w.stream_version, w.attempts, coalesce(w.error, '-'),
                       coalesce((SELECT string_agg(format('%s@%s (status %s)', c.perspective_name,
                                                          coalesce(c.last_version::text, '-'), c.status),
                                                   ', ' ORDER BY c.perspective_name)
                                 FROM {schema}.wh_perspective_cursors c WHERE c.stream_id = w.stream_id),
                                'none'))
         FROM {schema}.wh_perspective_events w WHERE w.processed_at IS NULL
         ORDER BY w.stream_id, w.perspective_name, w.stream_version LIMIT 12"
    ))
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| vec![(format!("(could not read them: {e})"),)]);
    rows.into_iter().map(|(r,)| r).collect()
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

/// A sequencing mode that puts events of different streams in line (DESIGN §12.2): the
/// lifecycle tests of `key` and `serial` run once per mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sequenced {
    Key,
    Serial,
}

/// The key of the events of [`sequenced_perspective`]: the event's `k` when it has one, else
/// one of 8 values shared by many streams.
pub const SEQUENCING_KEY: &str = "coalesce(:data->>'k', (hashtext(:stream_id::text) & 7)::text)";
/// [`SEQUENCING_KEY`] over a row `e` of the event store.
pub const SEQUENCING_KEY_OF_STORED_EVENT: &str =
    "coalesce(e.event_data->>'k', (hashtext(e.stream_id::text) & 7)::text)";

impl Sequenced {
    pub fn name(self) -> &'static str {
        match self {
            Sequenced::Key => "key",
            Sequenced::Serial => "serial",
        }
    }

    /// The perspective's `sequencing` lines.
    pub fn yaml(self) -> String {
        match self {
            Sequenced::Key => {
                format!("    sequencing: key\n    sequencingKey: \"{SEQUENCING_KEY}\"\n")
            }
            Sequenced::Serial => "    sequencing: serial\n".into(),
        }
    }

    /// The slot of the concurrency probe: what must never be applied by two open transactions
    /// at once (the key; for serial, anything).
    fn probe(self) -> &'static str {
        match self {
            Sequenced::Key => {
                "hashtext(coalesce(:data->>'k', (hashtext(:stream_id::text) & 7)::text))"
            }
            Sequenced::Serial => "0",
        }
    }
}

/// SQL true when another transaction, still running, applied an event whose probe `slot` is
/// `slot` (an int expression): a handler's probe for concurrency. It takes a transaction-scoped
/// advisory lock of its own for the slot (named by the schema: locks are database-wide) with
/// `pg_try_advisory_xact_lock`, which fails while another transaction holds it. A committing
/// transaction releases its locks one by one after it has ended, so an applier waiting for its
/// sequencing lock may get that one and run before the probe's is released: a holder counts
/// only while its transaction is still running (has a `backend_xid`; every applier has one,
/// it writes its cursors first).
pub fn overlap_probe(schema: &str, slot: &str) -> String {
    one_line(&format!(
        "CASE WHEN pg_try_advisory_xact_lock(hashtext('probe {schema}'), {slot}) THEN false
         ELSE EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                      WHERE {held} AND a.backend_xid IS NOT NULL) END",
        held = probe_lock_held(schema, slot),
    ))
}

/// SQL naming the sessions that hold the probe lock of `slot` (see [`overlap_probe`]), to say
/// who applied alongside.
pub fn overlap_holders(schema: &str, slot: &str) -> String {
    one_line(&format!(
        "(SELECT string_agg(a.pid || ' xid ' || coalesce(a.backend_xid::text, '-') || ': ' || left(a.query, 160), ' | ')
          FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE {held})",
        held = probe_lock_held(schema, slot),
    ))
}

/// `sql` on one line (it goes into YAML).
fn one_line(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// SQL over `pg_locks l`: another session holds the probe lock of `slot`. (An advisory lock on
/// two int4 keys shows as classid and objid, the keys as unsigned, and objsubid 2.)
fn probe_lock_held(schema: &str, slot: &str) -> String {
    one_line(&format!(
        "l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
         AND l.classid::int8 = (hashtext('probe {schema}')::int8 + 4294967296) % 4294967296
         AND l.objid::int8 = (({slot})::int8 + 4294967296) % 4294967296"
    ))
}

/// Perspective `agg`, sequenced by `mode`, with `lines` (e.g. `ordering`, `version`) added: one
/// row per key shared by many streams (`agg_rows`), and per stream the versions, keys and labels
/// (`:data->>'n'`) it applied, in order (`agg_seen`). Its `reset` takes a stream's share out of
/// the shared rows. Each handler first probes for concurrency ([`overlap_probe`], keyed by the
/// event's key; for serial, one slot) and records what it sees in `overlap_log`, with the
/// appliers alongside.
pub fn sequenced_perspective(schema: &str, mode: Sequenced, lines: &str) -> String {
    let key = SEQUENCING_KEY;
    let (overlap, holders) = (
        overlap_probe(schema, mode.probe()),
        overlap_holders(schema, mode.probe()),
    );
    format!(
        "  - name: agg
{sequencing}{lines}    setup: |
      CREATE TABLE IF NOT EXISTS agg_rows (k text PRIMARY KEY, events bigint NOT NULL);
      CREATE TABLE IF NOT EXISTS agg_seen (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL, keys text[] NOT NULL, labels text[] NOT NULL);
      CREATE TABLE IF NOT EXISTS overlap_log (k text NOT NULL, stream_id uuid NOT NULL, stream_version bigint NOT NULL, holder text);
    reset: |
      UPDATE agg_rows r SET events = r.events - c.n
      FROM (SELECT k, count(*) AS n FROM agg_seen, unnest(keys) AS k WHERE stream_id = :stream_id GROUP BY k) c
      WHERE r.k = c.k;
      DELETE FROM agg_seen WHERE stream_id = :stream_id
    handlers:
      A: >-
        INSERT INTO overlap_log SELECT {key}, :stream_id, :stream_version, {holders} WHERE {overlap};
        SELECT pg_sleep(coalesce((:data->>'sleep')::float8, 0));
        INSERT INTO agg_rows AS r VALUES ({key}, 1) ON CONFLICT (k) DO UPDATE SET events = r.events + 1;
        INSERT INTO agg_seen AS s VALUES (:stream_id, ARRAY[:stream_version], ARRAY[{key}], ARRAY[coalesce(:data->>'n', '')])
        ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version, keys = s.keys || {key}, labels = s.labels || coalesce(:data->>'n', '')
",
        sequencing = mode.yaml(),
    )
}

/// Perspective `plain` (`sequencing: stream`): the versions it applied per stream, in
/// `plain_seen`.
pub const PLAIN_PERSPECTIVE: &str = "  - name: plain
    setup: CREATE TABLE IF NOT EXISTS plain_seen (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL)
    handlers:
      A: INSERT INTO plain_seen AS s VALUES (:stream_id, ARRAY[:stream_version]) ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version
";

/// A config of `perspectives` (from [`sequenced_perspective`], [`PLAIN_PERSPECTIVE`]) with
/// `extra` (worker / claimWorker options) appended.
pub fn sequenced_yaml(schema: &str, perspectives: &[&str], extra: &str) -> String {
    format!(
        "schema: {schema}\nperspectives:\n{}{extra}",
        perspectives.concat()
    )
}

/// `agg` (and `plain`, when `plain`) applied every event of the store exactly once, each stream
/// in order (versions 1..n of `streams` streams); each shared row of `agg` counts exactly the
/// events of its key; and no two transactions ever applied events of one key of `agg` at once.
pub async fn assert_sequenced_exact(schema: &str, streams: usize, plain: bool) {
    assert_sequenced_exact_in(schema, streams, plain, "e.stream_version").await
}

/// [`assert_sequenced_exact`], `agg` having applied each stream's events in the order of
/// `order_by` (over a row `e` of the store; `e.event_id` for `ordering: eventId`).
pub async fn assert_sequenced_exact_in(schema: &str, streams: usize, plain: bool, order_by: &str) {
    let mut conn = connect().await;
    let tables: &[(&str, &str)] = if plain {
        &[("agg_seen", order_by), ("plain_seen", "e.stream_version")]
    } else {
        &[("agg_seen", order_by)]
    };
    for (table, order_by) in tables {
        let (count, bad): (i64, Option<String>) = sqlx::query_as(&format!(
            "SELECT count(*), min(s.stream_id::text || ' ' || s.versions::text) FILTER (
                      WHERE s.versions <> ARRAY(SELECT e.stream_version FROM {schema}.wh_event_store e
                                                WHERE e.stream_id = s.stream_id ORDER BY {order_by}))
             FROM {schema}.{table} s"
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            (count as usize, bad),
            (streams, None),
            "{table}: (streams, a stream not applied exactly once in order)"
        );
    }
    let wrong: Vec<(Option<String>, Option<i64>, Option<i64>)> = sqlx::query_as(&format!(
        "SELECT coalesce(r.k, s.k), r.events, s.n
         FROM {schema}.agg_rows r
         FULL JOIN (SELECT {SEQUENCING_KEY_OF_STORED_EVENT} AS k, count(*) AS n
                    FROM {schema}.wh_event_store e WHERE e.event_type = 'A' GROUP BY 1) s USING (k)
         WHERE coalesce(r.events, 0) <> coalesce(s.n, 0)"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        wrong.is_empty(),
        "agg_rows: (key, events counted, events stored) {wrong:?}"
    );
    assert_no_overlap(schema).await;
}

/// No two transactions applied events of one key of `agg` at once (see
/// [`sequenced_perspective`]).
pub async fn assert_no_overlap(schema: &str) {
    let mut conn = connect().await;
    let overlaps: Vec<(String, uuid::Uuid, i64, Option<String>)> = sqlx::query_as(&format!(
        "SELECT k, stream_id, stream_version, holder FROM {schema}.overlap_log"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        overlaps.is_empty(),
        "events applied while another transaction applied one of the same key (key, stream, version): {overlaps:?}"
    );
}

/// Runs `$test(mode)` once per [`Sequenced`] mode, as tests `$test::key` and `$test::serial`
/// (the test file declares `#[macro_use] mod common;`).
#[allow(unused_macros)]
macro_rules! in_both_modes {
    ($($test:ident),* $(,)?) => {$(
        mod $test {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn key() {
                super::$test(super::Sequenced::Key).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn serial() {
                super::$test(super::Sequenced::Serial).await
            }
        }
    )*};
}

/// Append one event of type A to `stream` with `data`, and the event id `id` if given.
pub async fn append_event(
    schema: &str,
    stream: uuid::Uuid,
    id: Option<uuid::Uuid>,
    data: serde_json::Value,
) {
    let mut conn = connect().await;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (event_id, stream_id, event_type, event_data)
         VALUES (coalesce($1, gen_random_uuid()), $2, 'A', $3)"
    ))
    .bind(id)
    .bind(stream)
    .bind(data)
    .execute(&mut conn)
    .await
    .unwrap();
}

/// What `agg` of [`sequenced_perspective`] recorded for `stream`: (versions, keys, labels).
pub async fn agg_seen(schema: &str, stream: uuid::Uuid) -> (Vec<i64>, Vec<String>, Vec<String>) {
    let mut conn = connect().await;
    sqlx::query_as(&format!(
        "SELECT versions, keys, labels FROM {schema}.agg_seen WHERE stream_id = $1"
    ))
    .bind(stream)
    .fetch_optional(&mut conn)
    .await
    .unwrap()
    .unwrap_or_default()
}

/// The versions [`PLAIN_PERSPECTIVE`] applied to `stream`.
pub async fn plain_seen(schema: &str, stream: uuid::Uuid) -> Vec<i64> {
    let mut conn = connect().await;
    sqlx::query_scalar(&format!(
        "SELECT versions FROM {schema}.plain_seen WHERE stream_id = $1"
    ))
    .bind(stream)
    .fetch_optional(&mut conn)
    .await
    .unwrap()
    .unwrap_or_default()
}

/// Producers appending A events to `streams` (in id order per transaction) until `stop`.
pub fn producers(
    schema: &str,
    streams: &[uuid::Uuid],
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<usize>> {
    (0..2)
        .map(|w| {
            let schema = schema.to_string();
            let streams = streams.to_vec();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut conn = connect().await;
                let mut appended = 0;
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let mut pick = vec![
                        streams[i % streams.len()],
                        streams[(i * 7 + 3) % streams.len()],
                    ];
                    pick.sort();
                    pick.dedup();
                    sqlx::query(&format!(
                        "INSERT INTO {schema}.wh_event_store (stream_id, event_type)
                         SELECT s, 'A' FROM unnest($1::uuid[]) AS s ORDER BY s"
                    ))
                    .bind(&pick)
                    .execute(&mut conn)
                    .await
                    .expect("append");
                    appended += pick.len();
                    i += 2;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                appended
            })
        })
        .collect()
}

/// Worker options that make failures, batching and polling quick, for tests that wait on them.
pub const QUICK_OPTIONS: &str = "worker:
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 200
  drainBatcher: { slidingWindowMilliseconds: 20, maxWaitMilliseconds: 200 }
claimWorker:
  pollingIntervalMilliseconds: 100
";

/// The test database's URL as `role` (trust authentication: no password).
pub fn url_as(role: &str) -> String {
    let url = database_url();
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{role}@{host}")
}

/// A connection to the test database as `role`.
pub async fn connect_as(role: &str) -> PgConnection {
    PgConnection::connect(&url_as(role))
        .await
        .unwrap_or_else(|e| panic!("connect as {role}: {e}"))
}

/// The SQLSTATE `sql` fails with on `conn` (it must fail).
pub async fn refused(conn: &mut PgConnection, sql: &str) -> String {
    let err = sqlx::raw_sql(sql)
        .execute(&mut *conn)
        .await
        .expect_err(&format!("allowed: {sql}"));
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
        .unwrap_or_else(|| panic!("{sql}: {err}"))
}

/// Rows of `table` this session has read, by any scan, in its current transaction (the
/// statistics see them only inside it: call it in one transaction, before and after).
pub async fn rows_read_so_far(conn: &mut PgConnection, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0))::bigint
         FROM pg_stat_xact_user_tables WHERE relid = $1::regclass",
    )
    .bind(table)
    .fetch_one(conn)
    .await
    .unwrap()
}
