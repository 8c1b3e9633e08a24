//! The planner's statistics of a schema whose tables grew from empty: a busy worker analyzes
//! them (autovacuum would take a minute or more, and plans cached meanwhile scan the tables).

mod common;

use std::time::Duration;

use common::*;
use perspective_worker::store::Store;
use uuid::Uuid;

/// Manual ANALYZEs of `schema.table` (autovacuum's are counted apart).
async fn analyze_count(schema: &str, table: &str) -> i64 {
    scalar(&format!(
        "SELECT analyze_count FROM pg_stat_user_tables WHERE schemaname = '{schema}' AND relname = '{table}'"
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_analyzes_the_tables_that_outgrew_their_statistics() {
    let schema = unique_schema("stats");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    // Only the worker may analyze them here.
    let out = psql(&format!(
        "DO $$ DECLARE t text; BEGIN
           FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = '{schema}' LOOP
             EXECUTE format('ALTER TABLE {schema}.%I SET (autovacuum_enabled = false)', t);
           END LOOP; END $$"
    ));
    assert!(out.status.success(), "{out:?}");
    let tables = [
        "wh_perspective_cursors",
        "wh_event_store",
        "seen_p1",
        "seen_p2",
    ];
    let mut before = Vec::new();
    for t in tables {
        before.push(analyze_count(&schema, t).await);
    }

    let engine = RunningEngine::start(&config).await;
    // Several thousand streams, then a trickle for as long as it takes: the worker analyzes
    // while claims find work, once the statistics counted the rows (about a second behind).
    let streams: Vec<Uuid> = (0..3000).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 1, 2, 500).await;
    let trickle = {
        let schema = schema.clone();
        tokio::spawn(async move {
            loop {
                append_load(&schema, &[Uuid::now_v7()], 1, 1, 1).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    for (t, before) in tables.iter().zip(before) {
        wait_until(
            &format!("an ANALYZE of {t}"),
            Duration::from_secs(60),
            || async { analyze_count(&schema, t).await > before },
        )
        .await;
        let statistics_rows = scalar(&format!(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = '{schema}.{t}'::regclass"
        ))
        .await;
        assert!(
            statistics_rows > 1000,
            "{t}: the planner assumes {statistics_rows} rows"
        );
    }
    trickle.abort();
    let analyzed = engine
        .metrics
        .tables_analyzed
        .with_label_values(&["wh_perspective_cursors"])
        .get();
    assert!(analyzed >= 1, "tables_analyzed for the cursors: {analyzed}");
    // A table that grew by less than the threshold since is left alone: one ANALYZE each.
    wait_drained(&schema, Duration::from_secs(60)).await;
    assert_eq!(
        engine
            .metrics
            .tables_analyzed
            .with_label_values(&["seen_p1"])
            .get(),
        1
    );
    engine.stop().await;
}

#[tokio::test]
async fn a_table_another_role_owns_is_not_analyzed_by_this_one() {
    let (schema, _config) = migrated_schema("stats_own").await;
    let role = format!("{schema}_r");
    let out = psql(&format!(
        "CREATE ROLE {role} NOLOGIN;
         GRANT USAGE ON SCHEMA {schema} TO {role};
         CREATE TABLE {schema}.mine (id int);
         ALTER TABLE {schema}.mine OWNER TO {role};"
    ));
    assert!(out.status.success(), "{out:?}");
    // This role's session, as a worker deployed with a role that owns only its own tables.
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.options([("role", role.as_str())]))
        .await
        .unwrap();
    let sizes = Store::new(pool.clone(), &schema)
        .table_sizes()
        .await
        .unwrap();
    let may = |t: &str| {
        sizes
            .iter()
            .find(|s| s.table == t)
            .unwrap_or_else(|| panic!("{t} listed in {sizes:?}"))
            .may_analyze
    };
    assert!(may("mine"));
    assert!(!may("wh_perspective_cursors"));
    assert!(!may("alpha_seen"));
    pool.close().await;
    let out = psql(&format!(
        "DROP TABLE {schema}.mine; REVOKE ALL ON SCHEMA {schema} FROM {role}; DROP ROLE {role};"
    ));
    assert!(out.status.success(), "{out:?}");
}

/// The workers of a deployment check their tables on the same beat and each found the same
/// table outgrown: each analyzed it in turn (two or three ANALYZEs of a 90 000-row work table in
/// `tests/bench/crossstream.sh`). A worker whose reading is stale leaves alone a table another
/// has analyzed since, or is analyzing now.
#[tokio::test]
async fn a_table_another_worker_analyzed_since_or_is_analyzing_is_left_alone() {
    let (schema, _config) = migrated_schema("stats_once").await;
    let store = Store::new(pool(1).await, &schema);
    let outgrew = |live: i64, analyzed: f64| live as f64 > 4.0 * analyzed.max(250.0);
    let out = psql(&format!(
        "ALTER TABLE {schema}.wh_event_store SET (autovacuum_enabled = false);
         INSERT INTO {schema}.wh_event_store (stream_id, event_type)
           SELECT gen_random_uuid(), 'A' FROM generate_series(1, 3000);"
    ));
    assert!(out.status.success(), "{out:?}");
    let event_store = || async {
        store
            .table_sizes()
            .await
            .unwrap()
            .into_iter()
            .find(|t| t.table == "wh_event_store")
            .unwrap()
    };
    wait_until(
        "the statistics to count the rows",
        Duration::from_secs(30),
        || async { event_store().await.live_rows >= 3000 },
    )
    .await;
    let stale = event_store().await;
    assert!(outgrew(stale.live_rows, stale.analyzed_rows), "{stale:?}");

    // Another worker is analyzing it: its transaction holds the table's lock.
    let mut other = connect().await;
    let mut tx = sqlx::Connection::begin(&mut other).await.unwrap();
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtext($1 || '.wh_analyze'), hashtext('wh_event_store'))",
    )
    .bind(&schema)
    .execute(&mut *tx)
    .await
    .unwrap();
    let before = analyze_count(&schema, "wh_event_store").await;
    assert!(!store
        .analyze_if_due("wh_event_store", outgrew)
        .await
        .unwrap());
    tx.rollback().await.unwrap();
    assert_eq!(analyze_count(&schema, "wh_event_store").await, before);

    // Another worker analyzed it since this one's reading: nothing left to do.
    let out = psql(&format!("ANALYZE {schema}.wh_event_store"));
    assert!(out.status.success(), "{out:?}");
    let before = analyze_count(&schema, "wh_event_store").await;
    assert!(!store
        .analyze_if_due("wh_event_store", outgrew)
        .await
        .unwrap());
    assert_eq!(analyze_count(&schema, "wh_event_store").await, before);
    let bounds = || async {
        scalar(&format!(
            "SELECT coalesce(array_length(histogram_bounds, 1), 0)::bigint FROM pg_stats
             WHERE schemaname = '{schema}' AND tablename = 'wh_event_store' AND attname = 'event_id'"
        ))
        .await
    };
    assert_eq!(
        bounds().await,
        101,
        "the server's statistics target: 100 buckets"
    );

    // Outgrown again, and nobody at it: this worker analyzes it.
    let out = psql(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type)
           SELECT gen_random_uuid(), 'A' FROM generate_series(1, 20000);"
    ));
    assert!(out.status.success(), "{out:?}");
    wait_until(
        "the statistics to count the new rows",
        Duration::from_secs(30),
        || async { event_store().await.live_rows >= 23000 },
    )
    .await;
    assert!(store
        .analyze_if_due("wh_event_store", outgrew)
        .await
        .unwrap());
    let statistics_rows = scalar(&format!(
        "SELECT reltuples::bigint FROM pg_class WHERE oid = '{schema}.wh_event_store'::regclass"
    ))
    .await;
    assert_eq!(statistics_rows, 23000);
    // The worker's ANALYZE is a bridge until autovacuum's: a tenth of the buckets, and of the
    // rows sampled.
    assert_eq!(bounds().await, 11);
}
