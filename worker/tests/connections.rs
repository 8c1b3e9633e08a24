//! The worker's connections to PostgreSQL: a deadline on every statement (a dead link or a
//! statement that never answers returns a deadline error in time, and the connection is closed
//! rather than reused), the per-session server settings, and the pool's size.

mod common;

use std::time::{Duration, Instant};

use common::proxy::{address_of, Proxy};
use common::{database_url, migrated_schema, wait_until};
use perspective_worker::db::connect_options;
use perspective_worker::store::instances::InstanceInfo;
use perspective_worker::store::pool::{pool_options, PoolRole};
use perspective_worker::store::{is_deadline_exceeded, is_unreachable, Deadlines, Store};
use sqlx::postgres::PgPool;
use sqlx::Connection;
use uuid::Uuid;

/// Short deadlines, so a test waits fractions of a second for them.
fn short() -> Deadlines {
    Deadlines {
        quick: Duration::from_millis(400),
        routine: Duration::from_millis(400),
        long: Duration::from_secs(2),
        drain_margin: Duration::from_millis(200),
    }
}

async fn worker_pool(url: &str, app: &str, max_connections: u32) -> PgPool {
    pool_options(PoolRole::Statements { max_connections })
        .connect_with(connect_options(url, app).unwrap())
        .await
        .expect("worker pool")
}

fn instance(id: Uuid) -> InstanceInfo {
    InstanceInfo {
        instance_id: id,
        service_name: "connections-test".into(),
        host_name: "test".into(),
        process_id: 1,
        metadata: serde_json::json!({}),
    }
}

/// Waits until the pool's one connection is idle in it. While sqlx still tests a released
/// connection, the next acquire opens a second one, which stays in the pool after a test's
/// abandoned connection has left it.
async fn back_in_the_pool(pool: &PgPool) {
    let pool = pool.clone();
    wait_until(
        "the connection back in the pool",
        Duration::from_secs(5),
        || {
            let pool = pool.clone();
            async move { pool.size() == 1 && pool.num_idle() == 1 }
        },
    )
    .await;
}

/// The statement's outcome, or a failure if it hung past `bound` (instead of hanging the test).
async fn bounded<T>(
    bound: Duration,
    fut: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> (Result<T, sqlx::Error>, Duration) {
    let started = Instant::now();
    let outcome = tokio::time::timeout(bound, fut)
        .await
        .unwrap_or_else(|_| panic!("the statement hung for {bound:?}: no deadline"));
    (outcome, started.elapsed())
}

#[tokio::test]
async fn a_heartbeat_over_a_cut_link_returns_the_deadline_error_in_time_and_drops_the_connection() {
    let (schema, _config) = migrated_schema("dl_cut").await;
    let proxy = Proxy::start(address_of(&database_url())).await;
    let pool = worker_pool(&proxy.url_for(&database_url()), "deadline-cut", 2).await;
    let store = Store::new(pool, &schema).with_deadlines(short());
    let me = instance(Uuid::now_v7());
    store
        .record_heartbeat(&me, 30.0)
        .await
        .expect("heartbeat through the proxy");
    back_in_the_pool(store.pool()).await;

    // Cut: testing the idle connection before handing it out, and then opening a new one,
    // would each wait for the kernel; the deadline counts from asking for the connection.
    proxy.cut();
    let (outcome, took) = bounded(Duration::from_secs(10), store.record_heartbeat(&me, 30.0)).await;
    let err = outcome.expect_err("a heartbeat over a cut link must fail");
    assert!(is_deadline_exceeded(&err), "not a deadline error: {err}");
    assert!(is_unreachable(&err));
    assert!(
        took >= short().quick && took < short().quick + Duration::from_secs(2),
        "answered after {took:?}, the deadline is {:?}",
        short().quick
    );
    // Closed and out of the pool at once: sqlx would otherwise hold it (and its slot) while
    // waiting, unbounded, for the lost statement's answer.
    assert_eq!(
        store.pool().size(),
        0,
        "the cut connection is still in the pool"
    );

    // The other classes too, on fresh connections of the same cut link.
    let (claim, _) = bounded(
        Duration::from_secs(10),
        store.cleanup_stale_instances(me.instance_id, 30.0),
    )
    .await;
    assert!(is_deadline_exceeded(&claim.unwrap_err()));
    assert_eq!(store.pool().size(), 0);

    proxy.heal();
    let (healed, took) = bounded(Duration::from_secs(10), store.record_heartbeat(&me, 30.0)).await;
    healed.expect("heartbeat after the heal");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[tokio::test]
async fn a_statement_past_its_deadline_is_abandoned_and_the_server_ends_its_backend() {
    let (schema, _config) = migrated_schema("dl_lock").await;
    let pool = worker_pool(&database_url(), "deadline-lock", 2).await;
    let store = Store::new(pool, &schema).with_deadlines(short());
    let me = instance(Uuid::now_v7());
    store.record_heartbeat(&me, 30.0).await.unwrap();
    // Its connection back in the pool first (a CI run saw the pool at 1 below without it).
    back_in_the_pool(store.pool()).await;

    // Another session holds the instances table: the heartbeat waits on its lock, on a healthy
    // link, until its deadline.
    let mut holder = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query(&format!(
        "LOCK TABLE {schema}.wh_service_instances IN ACCESS EXCLUSIVE MODE"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let (outcome, took) = bounded(Duration::from_secs(10), store.record_heartbeat(&me, 30.0)).await;
    let err = outcome.expect_err("the heartbeat waits on the lock");
    assert!(is_deadline_exceeded(&err), "not a deadline error: {err}");
    assert!(
        took < short().quick + Duration::from_secs(2),
        "took {took:?}"
    );
    assert_eq!(
        store.pool().size(),
        0,
        "the abandoned connection is still in the pool"
    );

    // A statement dropped mid-flight some other way (a cancelled task): the pool's test of the
    // released connection is bounded, and the connection closed past it.
    let dropped = tokio::time::timeout(
        Duration::from_millis(300),
        sqlx::query(&format!(
            "SELECT count(*) FROM {schema}.wh_service_instances"
        ))
        .execute(store.pool()),
    )
    .await;
    assert!(dropped.is_err(), "the query waits on the lock");
    let pool = store.pool().clone();
    wait_until(
        "the dropped statement's connection to leave the pool",
        perspective_worker::db::RELEASE_CHECK_TIMEOUT + Duration::from_secs(2),
        || {
            let pool = pool.clone();
            async move { pool.size() == 0 }
        },
    )
    .await;

    // Its backend, still waiting on the lock, notices its client has gone
    // (client_connection_check_interval) and ends, while the lock is still held.
    let waiting = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'deadline-lock' \
         AND wait_event_type = 'Lock' AND query LIKE '%{schema}.%'"
    );
    wait_until(
        "the abandoned backend to end",
        Duration::from_secs(15),
        || {
            let q = waiting.clone();
            async move { common::scalar(&q).await == 0 }
        },
    )
    .await;
    tx.rollback().await.unwrap();
    store
        .record_heartbeat(&me, 30.0)
        .await
        .expect("heartbeat after the lock");
}

#[tokio::test]
async fn worker_sessions_carry_the_server_settings() {
    let pool = worker_pool(&database_url(), "settings-test", 3).await;
    let show = "SELECT current_setting('tcp_keepalives_idle'), \
        current_setting('tcp_keepalives_interval'), current_setting('tcp_keepalives_count'), \
        current_setting('tcp_user_timeout'), current_setting('idle_in_transaction_session_timeout'), \
        current_setting('idle_session_timeout'), current_setting('client_connection_check_interval')";
    type Settings = (String, String, String, String, String, String, String);
    let statements: Settings = sqlx::query_as(show).fetch_one(&pool).await.unwrap();
    assert_eq!(
        statements,
        (
            "10".into(),
            "5".into(),
            "3".into(),
            "30000".into(),
            "1min".into(),
            "5min".into(),
            "5s".into()
        )
    );
    assert_eq!(pool.options().get_max_connections(), 3);
    // The LISTEN session idles by design: no idle_session_timeout there.
    let listen = pool_options(PoolRole::Listen)
        .connect_with(connect_options(&database_url(), "settings-listen").unwrap())
        .await
        .unwrap();
    let listen_settings: Settings = sqlx::query_as(show).fetch_one(&listen).await.unwrap();
    assert_eq!(listen_settings.0, "10");
    assert_eq!(listen_settings.4, "1min");
    assert_eq!(
        listen_settings.5, "0",
        "idle_session_timeout on the LISTEN session"
    );
    assert_eq!(listen_settings.6, "5s");
    assert_eq!(listen.options().get_max_connections(), 1);
}

#[tokio::test]
async fn the_engine_pool_is_the_configured_size() {
    // Slow handlers and one stream per drain batch: the four drain consumers each want a
    // connection at once (with a pool of 10 the engine holds 7).
    let schema = common::unique_schema("dl_pool");
    let config = common::parse_config(&format!(
        r#"
schema: {schema}
perspectives:
  - name: slow
    setup: CREATE TABLE IF NOT EXISTS slow_seen (stream_id uuid)
    handlers:
      A: INSERT INTO slow_seen SELECT :stream_id FROM pg_sleep(0.05)
worker:
  drainBatcher: {{ maxSize: 1 }}
  database: {{ maxConnections: 2 }}
"#
    ));
    common::migrate_config(&config).await;
    let options = perspective_worker::engine::EngineOptions::new(config, database_url());
    assert_eq!(
        options.max_connections, 2,
        "from worker.database.maxConnections"
    );
    let engine = common::RunningEngine::start_with(options).await;
    let streams: Vec<Uuid> = (0..16).map(|_| Uuid::now_v7()).collect();
    common::append_load(&schema, &streams, 2, 2, 8).await;
    // This engine's sessions: other tests' engines run beside it under the same
    // application_name, but every statement of this one names its schema.
    let sessions = format!(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = 'perspective-worker' AND datname = current_database() \
           AND query LIKE '%{schema}.%'"
    );
    let applied = format!("SELECT count(*) FROM {schema}.slow_seen");
    let most = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    wait_until("every event applied", Duration::from_secs(30), || {
        let (applied, most, sessions) = (applied.clone(), most.clone(), sessions.clone());
        async move {
            let now = common::scalar(&sessions).await;
            most.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
            common::scalar(&applied).await == 32
        }
    })
    .await;
    let most = most.load(std::sync::atomic::Ordering::Relaxed);
    assert!(most <= 2, "{most} engine sessions at once, 2 configured");
    assert!(most >= 1);
    engine.stop().await;
}

#[tokio::test]
async fn a_cut_listen_session_is_noticed_and_reopened_after_the_heal() {
    let (_schema, config) = migrated_schema("dl_listen").await;
    let proxy = Proxy::start(address_of(&database_url())).await;
    let mut options =
        perspective_worker::engine::EngineOptions::new(config, proxy.url_for(&database_url()));
    options.deadlines = short();
    let engine = common::RunningEngine::start_with(options).await;
    let listening = |up: i64| {
        let metrics = engine.metrics.clone();
        move || {
            let metrics = metrics.clone();
            async move { metrics.listener_connected.get() == up }
        }
    };
    wait_until("LISTEN up", Duration::from_secs(5), listening(1)).await;
    // Cut, the idle LISTEN session hears nothing, and would count as healthy for ever: its
    // probe (every two quick deadlines) notices.
    proxy.cut();
    wait_until(
        "the cut LISTEN session noticed",
        short().quick * 3 + Duration::from_secs(4),
        listening(0),
    )
    .await;
    proxy.heal();
    wait_until("LISTEN up again", Duration::from_secs(10), listening(1)).await;
    engine.stop().await;
}
