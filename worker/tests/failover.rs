//! Failover and fenced completions (issue 25, DESIGN §12.4).
//!
//! - The test proxy holds traffic while cut and delivers it after the heal.
//! - The completion flush deletes only work rows their cursor proves applied: a work id is an
//!   identity value that a promoted standby issues again, so a late completion by id alone could
//!   delete a new, unapplied row.
//! - A primary with a streaming standby: workers and producers through a proxy, the primary
//!   killed under load, the standby promoted, the proxy repointed; every stream is exact
//!   relative to the new primary.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::cluster::Server;
use common::proxy::Proxy;
use common::*;
use perspective_worker::engine::EngineOptions;
use perspective_worker::store::complete::AppliedUpTo;
use perspective_worker::store::Store;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::Connection;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_holds_traffic_while_cut_and_delivers_it_after_the_heal() {
    let upstream = common::proxy::address_of(&database_url());
    let proxy = Proxy::start(upstream).await;
    let mut conn = PgConnection::connect(&proxy.url_for(&database_url()))
        .await
        .expect("connect through the proxy");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(one, 1);
    proxy.cut();
    let query = tokio::spawn(async move {
        let n: i32 = sqlx::query_scalar("SELECT 2")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        n
    });
    // A cut is silent: the query neither answers nor fails.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!query.is_finished(), "a query went through a cut proxy");
    proxy.heal();
    let n = tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("the held query answers after the heal")
        .unwrap();
    assert_eq!(n, 2);
}

/// The ranges of `stream` a flush would send: every perspective up to `version`.
fn up_to(stream: Uuid, perspectives: &[&str], version: i64) -> Vec<AppliedUpTo> {
    perspectives
        .iter()
        .map(|p| AppliedUpTo {
            stream_id: stream,
            perspective: (*p).into(),
            version,
        })
        .collect()
}

/// A completion deletes only the rows of its (stream, perspective) up to its version that the
/// pair's cursor proves applied; rows past the cursor, or past the version, stay. (Before the
/// fence, the flush deleted by id alone: this failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_completion_deletes_only_rows_the_cursor_proves_applied() {
    let schema = unique_schema("fence");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let store = Store::new(pool(2).await, &schema);
    let stream = Uuid::now_v7();
    for _ in 0..4 {
        append_event(&schema, stream, None, serde_json::json!({})).await;
    }
    let rows = || async {
        let mut conn = connect().await;
        sqlx::query_as::<_, (i64, String, i64)>(&format!(
            "SELECT event_work_id, perspective_name, stream_version
             FROM {schema}.wh_perspective_events ORDER BY 2, 3"
        ))
        .fetch_all(&mut conn)
        .await
        .unwrap()
    };
    let before = rows().await;
    assert_eq!(before.len(), 8, "4 events × 2 perspectives queued");
    let all = up_to(stream, &["p1", "p2"], 4);

    // Nothing applied: a completion of every row (as a retry against a promoted standby that
    // never saw the apply would send) deletes nothing.
    assert_eq!(store.complete_events(&all, false).await.unwrap(), 0);
    assert_eq!(rows().await, before, "unapplied work rows deleted");

    // p1's cursor at version 2: exactly p1's rows 1 and 2 go.
    psql(&format!(
        "INSERT INTO {schema}.wh_perspective_cursors (stream_id, perspective_name, last_version, status)
         VALUES ('{stream}', 'p1', 2, 2)"
    ));
    assert_eq!(store.complete_events(&all, false).await.unwrap(), 2);
    let left = || async {
        rows()
            .await
            .into_iter()
            .map(|r| (r.1, r.2))
            .collect::<Vec<(String, i64)>>()
    };
    let expected = |kept: &[(&str, i64)]| -> Vec<(String, i64)> {
        kept.iter().map(|(p, v)| (p.to_string(), *v)).collect()
    };
    assert_eq!(
        left().await,
        expected(&[
            ("p1", 3),
            ("p1", 4),
            ("p2", 1),
            ("p2", 2),
            ("p2", 3),
            ("p2", 4)
        ])
    );

    // p2's cursor at 4, a completion of p2 up to 1: only row 1 (the rest is some later
    // completion's).
    psql(&format!(
        "INSERT INTO {schema}.wh_perspective_cursors (stream_id, perspective_name, last_version, status)
         VALUES ('{stream}', 'p2', 4, 2)"
    ));
    assert_eq!(
        store
            .complete_events(&up_to(stream, &["p2"], 1), false)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        left().await,
        expected(&[("p1", 3), ("p1", 4), ("p2", 2), ("p2", 3), ("p2", 4)])
    );

    // Debug mode stamps instead of deleting, with the same fence.
    psql(&format!(
        "UPDATE {schema}.wh_perspective_cursors SET last_version = 3 WHERE perspective_name = 'p1'"
    ));
    assert_eq!(
        store
            .complete_events(&up_to(stream, &["p1"], 4), true)
            .await
            .unwrap(),
        1
    );
    let stamped = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_events WHERE processed_at IS NOT NULL"
    ))
    .await;
    assert_eq!(stamped, 1);
}

/// A work id issued again (as by a promoted standby that never received the WAL of the first
/// issue) names a new row of another stream; the late completion of the first rows (by their
/// stream, perspective and version) leaves it, and the worker applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reissued_work_id_survives_the_late_completion_of_its_first_row() {
    let schema = unique_schema("reissue");
    let config = parse_config(&recording_yaml(&schema, QUICK_OPTIONS));
    migrate_config(&config).await;
    let first = Uuid::now_v7();
    for _ in 0..3 {
        append_event(&schema, first, None, serde_json::json!({})).await;
    }
    let ids: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT event_work_id FROM {schema}.wh_perspective_events ORDER BY 1"
    ))
    .fetch_all(&mut connect().await)
    .await
    .unwrap();
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_perspective_events"
        ))
        .await,
        0
    );

    // The identity goes back, as on a standby promoted before it saw these ids.
    psql(&format!(
        "ALTER TABLE {schema}.wh_perspective_events ALTER COLUMN event_work_id RESTART WITH {}",
        ids[0]
    ));
    let second = Uuid::now_v7();
    for _ in 0..3 {
        append_event(&schema, second, None, serde_json::json!({})).await;
    }
    let reissued =
        scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_events WHERE event_work_id = ANY('{{{}}}')",
        ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
    ))
        .await;
    assert!(reissued > 0, "the test did not reissue any id");
    let store = Store::new(pool(2).await, &schema);
    assert_eq!(
        store
            .complete_events(&up_to(first, &["p1", "p2"], 3), false)
            .await
            .unwrap(),
        0,
        "a late completion deleted new, unapplied work rows"
    );
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 2).await;
}

/// Appends A events to `streams` through `url` until `stop`, reconnecting after errors (the
/// primary going away): what the store acknowledged is the truth on whichever server has it.
fn failover_producer(
    url: String,
    schema: String,
    streams: Vec<Uuid>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut acknowledged = 0u64;
        let mut i = 0usize;
        let mut conn: Option<PgConnection> = None;
        while !stop.load(Ordering::Relaxed) {
            if conn.is_none() {
                conn = PgConnection::connect(&url).await.ok();
                if conn.is_none() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
            let stream = streams[i % streams.len()];
            i += 1;
            let sql = format!(
                "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A')"
            );
            match sqlx::query(&sql)
                .bind(stream)
                .execute(conn.as_mut().unwrap())
                .await
            {
                Ok(_) => acknowledged += 1,
                Err(_) => conn = None,
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        acknowledged
    })
}

async fn pool_at(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .expect("connect")
}

async fn count_at(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, Option<i64>>(sql)
        .fetch_one(pool)
        .await
        .unwrap()
        .unwrap_or(0)
}

/// Every stream of `schema` on `pool`'s server applied exactly once, in order, by both
/// perspectives, relative to the events that server has.
async fn assert_exact_on(pool: &PgPool, schema: &str) {
    for p in ["p1", "p2"] {
        let bad: Vec<(Uuid, Option<Vec<i64>>, i64)> = sqlx::query_as(&format!(
            "SELECT h.stream_id, s.versions, h.version
             FROM {schema}.wh_streams h LEFT JOIN {schema}.seen_{p} s USING (stream_id)
             WHERE s.versions IS DISTINCT FROM ARRAY(SELECT generate_series(1, h.version))"
        ))
        .fetch_all(pool)
        .await
        .unwrap();
        assert!(
            bad.is_empty(),
            "{p}: {} stream(s) not exact on the new primary, e.g. {:?}",
            bad.len(),
            bad.first()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_resume_on_a_promoted_standby_and_every_stream_is_exact() {
    init_test_logs();
    let primary = Server::primary();
    let schema = unique_schema("failover");
    let config = parse_config(&recording_yaml(&schema, QUICK_OPTIONS));
    {
        let mut conn = PgConnection::connect(&primary.url()).await.unwrap();
        perspective_worker::admin::migrate::migrate(
            &mut conn,
            &config,
            "test.yaml",
            Default::default(),
        )
        .await
        .expect("migrate the primary");
    }
    let standby = Server::standby_of(&primary);
    let proxy = Proxy::start(primary.addr()).await;
    let url = proxy.url_for(&primary.url());

    let mut engines = Vec::new();
    for _ in 0..2 {
        let mut options = EngineOptions::new(config.clone(), url.clone());
        options.max_connections = 4;
        engines.push(RunningEngine::start_with(options).await);
    }
    let streams: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..2)
        .map(|_| failover_producer(url.clone(), schema.clone(), streams.clone(), stop.clone()))
        .collect();

    // Load on the primary, applied as it comes.
    let primary_pool = pool_at(&primary.url()).await;
    let applied = format!("SELECT count(*) FROM {schema}.seen_p1");
    wait_until(
        "the workers apply on the primary",
        Duration::from_secs(30),
        || {
            let pool = primary_pool.clone();
            let sql = applied.clone();
            async move { count_at(&pool, &sql).await >= 10 }
        },
    )
    .await;
    primary_pool.close().await;

    // The primary dies under load; the standby is promoted; the proxy points at it.
    primary.kill();
    standby.promote();
    proxy.set_upstream(standby.addr());
    proxy.reset_connections();

    // Load goes on against the new primary, then stops.
    let new_primary = pool_at(&standby.url()).await;
    let events = format!("SELECT count(*) FROM {schema}.wh_event_store");
    let at_promotion = count_at(&new_primary, &events).await;
    wait_until(
        "producers append to the new primary",
        Duration::from_secs(30),
        || {
            let pool = new_primary.clone();
            let sql = events.clone();
            async move { count_at(&pool, &sql).await >= at_promotion + 100 }
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await.unwrap();
    }
    let pending =
        format!("SELECT count(*) FROM {schema}.wh_perspective_events WHERE processed_at IS NULL");
    wait_until(
        "every event applied on the new primary",
        Duration::from_secs(60),
        || {
            let pool = new_primary.clone();
            let sql = pending.clone();
            async move { count_at(&pool, &sql).await == 0 }
        },
    )
    .await;
    for engine in engines {
        engine.stop().await;
    }
    assert_exact_on(&new_primary, &schema).await;
    let dead_letters = count_at(
        &new_primary,
        &format!("SELECT count(*) FROM {schema}.wh_dead_letters"),
    )
    .await;
    assert_eq!(dead_letters, 0, "events dead-lettered across the failover");
}
