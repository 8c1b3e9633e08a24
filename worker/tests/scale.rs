//! Issue 14: what keeps the engine's cost flat as the work grows (the figures are `make
//! bench-scale`'s; these tests check the mechanisms).

mod common;

use std::time::Duration;

use common::*;
use uuid::Uuid;

/// Autovacuum visits a database once a minute; under churn that is hundreds of megabytes of
/// dead work rows. The engine vacuums its queue tables itself once they hold as many dead rows
/// as live ones (and at least 20 000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_vacuums_its_queue_tables_between_autovacuum_visits() {
    let schema = unique_schema("vacuum");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let vacuums = format!(
        "SELECT vacuum_count FROM pg_stat_user_tables
         WHERE schemaname = '{schema}' AND relname = 'wh_perspective_events'"
    );
    assert_eq!(scalar(&vacuums).await, 0);
    let engine = RunningEngine::start(&config).await;

    // 12 000 events, 2 perspectives: 24 000 work rows applied and deleted.
    let streams: Vec<Uuid> = (0..200).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 60, 2, 500).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    assert_exactly_once(&schema, streams.len()).await;

    // `vacuum_count` counts manual vacuums only (autovacuum's are `autovacuum_count`). A
    // trickle of events meanwhile, as under churn: the worker looks at the statistics only
    // while its claims find work (and 10 s after), and a backend that goes idle publishes its
    // last deletions up to 10 s late: a CI run on a loaded machine timed out here, most likely
    // because the last of the 24 000 were counted after the worker had stopped looking.
    let trickle = format!(
        "WITH e AS (INSERT INTO {schema}.wh_event_store (stream_id, event_type)
                    VALUES (gen_random_uuid(), 'A') RETURNING 1)
         SELECT count(*) FROM e"
    );
    wait_until(
        "the worker vacuumed wh_perspective_events",
        Duration::from_secs(30),
        || async { scalar(&trickle).await == 1 && scalar(&vacuums).await >= 1 },
    )
    .await;
    // The statistics see the VACUUM before the worker has its reply and counts it.
    let counter = engine
        .metrics
        .queue_vacuums
        .with_label_values(&["wh_perspective_events"]);
    wait_until(
        "perspective_queue_vacuums_total{table=\"wh_perspective_events\"} counted it",
        Duration::from_secs(10),
        || {
            let counter = counter.clone();
            async move { counter.get() >= 1 }
        },
    )
    .await;
    engine.stop().await;
}

/// Retiring streams (`cleanup_completed_streams`, called by the settler and `claim_work` for
/// streams that may still have work) reads a few rows of a stream with a deep backlog, not the
/// whole backlog: one hot stream holding 20 000 events used to cost a read of all of its work
/// rows on every call.
#[tokio::test]
async fn retiring_a_stream_with_a_deep_backlog_does_not_read_the_backlog() {
    let (schema, _config) = migrated_schema("retire_hot").await;
    let mut conn = connect().await;
    let hot = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type)
         SELECT $1, 'B' FROM generate_series(1, 20000)"
    ))
    .bind(hot)
    .execute(&mut conn)
    .await
    .unwrap();
    let work = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_events WHERE stream_id = '{hot}'"
    ))
    .await;
    assert_eq!(work, 40_000, "B is handled by both perspectives");

    // Rows of the work table this session read, by any scan, inside one transaction.
    let table = format!("{schema}.wh_perspective_events");
    sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
    let before: i64 = rows_read_so_far(&mut conn, &table).await;
    let retired: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT * FROM {schema}.cleanup_completed_streams($1, ARRAY[$2]::uuid[])"
    ))
    .bind(Uuid::now_v7())
    .bind(hot)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let read = rows_read_so_far(&mut conn, &table).await - before;
    sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
    assert!(retired.is_empty(), "a stream with work is not retired");
    assert!(read < 100, "read {read} of the stream's 40 000 work rows");
}

/// A claim returns every held stream with due work, the ones still queued for or being drained
/// included. The claim loop offers only the others, and after a full claim waits for the drain
/// to make room instead of claiming again as soon as the channel is empty: before, it re-read
/// (and re-offered) the same in-flight streams in a tight loop, hundreds of claims competing
/// with the drain for the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wide_backlog_is_claimed_a_batch_at_a_time_not_re_offered_while_in_flight() {
    let schema = unique_schema("wide_claims");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let claims_before = engine.metrics.claim_duration.get_sample_count();

    // 4 000 streams with one event each, in one transaction: 4 claims' worth (maxStreamsPerBatch
    // 1000).
    let streams: Vec<Uuid> = (0..4000).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 1, 1, 4000).await;
    wait_drained(&schema, Duration::from_secs(120)).await;
    let claims = engine.metrics.claim_duration.get_sample_count() - claims_before;
    assert_exactly_once(&schema, streams.len()).await;
    engine.stop().await;
    assert!(
        claims <= 20,
        "{claims} claims for 4 000 streams (4 full claims, a few refills and polls expected)"
    );
}

/// `wh_drain` pays a dozen statements per (stream, perspective) on the per-pair path, which is
/// what a wide backlog of shallow streams costs. Once a call has found the streams shallow, the
/// worker asks for the set-based path: one subtransaction and one loop per perspective for all
/// the shallow pairs of a call. Rows a subtransaction writes carry its transaction id, so the
/// model rows of pairs applied one by one have one `xmin` each, and set-based ones share it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shallow_streams_are_applied_set_based_once_a_call_has_found_them_shallow() {
    let schema = unique_schema("shallow_set");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;

    let streams: Vec<Uuid> = (0..2000).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 1, 1, 2000).await;
    wait_drained(&schema, Duration::from_secs(120)).await;
    assert_exactly_once(&schema, streams.len()).await;
    engine.stop().await;
    for p in ["p1", "p2"] {
        let writers = scalar(&format!(
            "SELECT count(DISTINCT xmin::text) FROM {schema}.seen_{p}"
        ))
        .await;
        // The first calls (4 consumers, 50 streams each at most) know no depth yet.
        assert!(
            writers <= 400,
            "{p}: {writers} subtransactions wrote the 2 000 streams' rows"
        );
    }
}

/// The set-based path's probe is costed high enough that JIT compiled it on every call, for
/// longer than the call's work: a call that takes that path turns JIT off for itself (its
/// handlers see it), while the per-pair path keeps the server's setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_set_based_path_runs_without_jit_and_the_per_pair_path_with_the_servers_setting() {
    let schema = unique_schema("shallow_jit");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: j
    setup: CREATE TABLE IF NOT EXISTS jit_seen (stream_id uuid PRIMARY KEY, jit text NOT NULL)
    handlers:
      A: INSERT INTO jit_seen VALUES (:stream_id, current_setting('jit'))
"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let server =
        scalar("SELECT count(*) FROM pg_settings WHERE name = 'jit' AND setting = 'on'").await;
    assert_eq!(server, 1, "the test cluster runs with the default jit = on");
    let engine = RunningEngine::start(&config).await;
    let streams: Vec<Uuid> = (0..2000).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 1, 1, 2000).await;
    wait_drained(&schema, Duration::from_secs(120)).await;
    engine.stop().await;
    let count = |setting: &'static str| {
        let schema = schema.clone();
        async move {
            scalar(&format!(
                "SELECT count(*) FROM {schema}.jit_seen WHERE jit = '{setting}'"
            ))
            .await
        }
    };
    let (off, on) = (count("off").await, count("on").await);
    assert_eq!(off + on, 2000);
    // The first calls (no depth known yet: 4 consumers, 100 streams each at most) go pair by pair.
    assert!((1..=400).contains(&on), "{on} applied pair by pair");
    assert!(off >= 1600, "{off} applied set-based");
}

/// A drain call reads the cursors and active rows of the streams it was given, one primary-key
/// probe each, not the whole cursor table (one row per stream and perspective ever applied) nor
/// every stream its instance holds. Joined plainly, the planner (which cannot see how few
/// streams a call lists) hashed the entire cursor table on every call: at 100 000 streams that
/// was 240 ms of a 250 ms call, and the wide case ran 3× slower than with the probe. Checked for
/// both paths of `wh_drain` and for the custom runners' fetch.
#[tokio::test]
async fn a_drain_call_reads_its_streams_rows_not_whole_tables() {
    let (schema, _config) = migrated_schema("cursor_probe").await;
    let mut conn = connect().await;
    // 20 000 streams applied before, by both perspectives.
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_perspective_cursors (stream_id, perspective_name, last_version, status)
         SELECT gen_random_uuid(), p, 1, 2 FROM generate_series(1, 20000), unnest(ARRAY['alpha', 'beta']) p"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    // Three streams with one pending event each (B: both perspectives), held by one instance.
    let instance = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_service_instances (instance_id, service_name, host_name, process_id)
         VALUES ($1, 'test', 'h', 1)"
    ))
    .bind(instance)
    .execute(&mut conn)
    .await
    .unwrap();
    let streams: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         SELECT s, 'B', '{{\"total\": 1}}' FROM unnest($1::uuid[]) s"
    ))
    .bind(&streams)
    .execute(&mut conn)
    .await
    .unwrap();
    // And 20 000 other streams, claimed since the statistics last saw them all unowned (as when
    // autovacuum analyzed a fresh backlog before the claims took it).
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_active_streams (stream_id, partition_number)
         SELECT gen_random_uuid(), 0 FROM generate_series(1, 20000)"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query(&format!("ANALYZE {schema}.wh_active_streams"))
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {schema}.wh_active_streams SET assigned_instance_id = $1"
    ))
    .bind(instance)
    .execute(&mut conn)
    .await
    .unwrap();

    // Rows of a table this session read, by any scan, inside one transaction (rolled back, so
    // every call sees the same pending work).
    let tables = [
        format!("{schema}.wh_perspective_cursors"),
        format!("{schema}.wh_active_streams"),
    ];
    let calls = [
        (
            "wh_drain, per-pair path",
            format!("SELECT count(*) FROM {schema}.wh_drain($1, $2, 100, 10000, false, false, 1000, 60000, false, 10, 60000, 0)"),
        ),
        (
            "wh_drain, set-based path",
            format!("SELECT count(*) FROM {schema}.wh_drain($1, $2, 100, 10000, false, false, 1000, 60000, false, 10, 60000, 16)"),
        ),
        (
            "claim_and_fetch_pending_perspective_events",
            format!("SELECT count(*) FROM {schema}.claim_and_fetch_pending_perspective_events($1, $2, 300, 1000)"),
        ),
    ];
    for (name, call) in calls {
        sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
        let mut before = Vec::new();
        for table in &tables {
            let n: i64 = rows_read_so_far(&mut conn, table).await;
            before.push(n);
        }
        let rows: i64 = sqlx::query_scalar(&call)
            .bind(instance)
            .bind(&streams)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        for (table, before) in tables.iter().zip(before) {
            let read = rows_read_so_far(&mut conn, table).await - before;
            assert!(
                read < 100,
                "{name} read {read} rows of {table} for 3 streams (40 000 cursors, 20 003 streams held)"
            );
        }
        sqlx::raw_sql("ROLLBACK").execute(&mut conn).await.unwrap();
        assert_eq!(rows, 6, "{name}: one row per (stream, perspective)");
    }
}

/// The settler retires a batch of streams with `cleanup_completed_streams`, asking each stream
/// whether any work is left. Without column statistics (the engine's own VACUUM sets row counts,
/// and the planner then guesses 200 distinct streams) each probe is costed as reading a
/// thousand rows, the statement past `jit_above_cost`, and JIT compiled it on every call:
/// 200–380 ms a call in the breadth benchmark, for a statement that runs in milliseconds.
/// None of it, `claim_work` and the completion runs user code: all run without JIT. Nor does
/// the listing of a deep drain call's pairs (costed for hundreds of guessed perspectives, it
/// was compiled on every call, 40–110 ms, in the backfill benchmark); the handlers after it
/// keep the server's setting (`the_set_based_path_runs_without_jit_and_the_per_pair_path_with_
/// the_servers_setting`).
#[tokio::test]
async fn engine_statements_over_many_streams_run_without_jit() {
    let (schema, _config) = migrated_schema("retire_jit").await;
    let mut conn = connect().await;
    // 1 000 streams × 50 events of B (both perspectives: 100 000 work rows).
    let streams: Vec<Uuid> = (0..1000).map(|_| Uuid::now_v7()).collect();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         SELECT s, 'B', '{{\"total\": 1}}' FROM unnest($1::uuid[]) s, generate_series(1, 50)"
    ))
    .bind(&streams)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::raw_sql(&format!(
        "VACUUM {schema}.wh_perspective_events, {schema}.wh_active_streams"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let server =
        scalar("SELECT count(*) FROM pg_settings WHERE name = 'jit' AND setting = 'on'").await;
    assert_eq!(server, 1, "the test cluster runs with the default jit = on");

    // auto_explain prints the plan of every statement, nested ones included, to the client.
    let explained = |call: String| {
        let out = psql(&format!(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;
             SET auto_explain.log_nested_statements = on; SET client_min_messages = log;
             {call}"
        ));
        assert!(
            out.status.success(),
            "{call}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let no_jit = |what: &str, plans: &str| {
        assert!(!plans.contains("JIT:"), "{what} compiled with JIT: {plans}");
    };
    let list = streams
        .iter()
        .map(|s| format!("'{s}'"))
        .collect::<Vec<_>>()
        .join(",");
    let instance = Uuid::now_v7();
    let retire = explained(format!(
        "SELECT count(*) FROM {schema}.cleanup_completed_streams('{instance}', ARRAY[{list}]::uuid[]);"
    ));
    assert!(
        retire.contains("Function Scan on unnest"),
        "the nested probe was explained: {retire}"
    );
    no_jit("retiring", &retire);
    let claim = explained(format!(
        "SELECT count(*) FROM {schema}.claim_work('{instance}', 1000, 30, 0);"
    ));
    assert!(
        claim.contains("wh_active_streams"),
        "the claim was explained: {claim}"
    );
    no_jit("claiming", &claim);
    let complete = explained(format!(
        "SELECT {schema}.complete_perspective_events(ARRAY(SELECT event_work_id FROM {schema}.wh_perspective_events ORDER BY 1 LIMIT 10000), false, true);"
    ));
    no_jit("completing", &complete);
    let flush = explained(format!(
        "SELECT {schema}.complete_applied_events(x.s, x.p, x.v, false)
         FROM (SELECT array_agg(stream_id) s, array_agg(perspective_name::text) p, array_agg(stream_version) v
               FROM (SELECT * FROM {schema}.wh_perspective_events ORDER BY 1 LIMIT 10000) w) x;"
    ));
    no_jit("flushing completions", &flush);
    // A deep drain call (p_shallow_rows 0: every pair takes the per-pair path) of 100 streams
    // the claim above gave this instance.
    let drain = explained(format!(
        "SELECT count(*) FROM {schema}.wh_drain('{instance}',
           ARRAY(SELECT stream_id FROM {schema}.wh_active_streams ORDER BY stream_id LIMIT 100),
           100, 10000, false, false, 1000, 60000, false, 10, 60000, 0);"
    ));
    let listing = drain
        .split("LOG:  duration")
        .find(|plan| plan.contains("array_agg(y.last_version)"))
        .unwrap_or_else(|| panic!("the pair listing was explained: {drain}"));
    no_jit("listing a deep call's pairs", listing);
}

/// Retiring a few thousand streams at once (the settler's batches), or completing a few thousand
/// work rows, probes their rows by key. Past a thousand or so ids the planner preferred
/// sequential scans of the whole stream-head and work tables, 25–160 ms per call at 100 000
/// streams (migration 0014).
#[tokio::test]
async fn retiring_thousands_of_streams_probes_their_rows_not_whole_tables() {
    let (schema, _config) = migrated_schema("retire_many").await;
    let mut conn = connect().await;
    // 20 000 streams with one event each (B: 2 work rows); the first 2 500 are applied and their
    // work rows deleted, as the completion flush leaves them for the settler.
    let streams: Vec<Uuid> = (0..20_000).map(|_| Uuid::now_v7()).collect();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         SELECT s, 'B', '{{\"total\": 1}}' FROM unnest($1::uuid[]) s"
    ))
    .bind(&streams)
    .execute(&mut conn)
    .await
    .unwrap();
    let done = &streams[..2_500];
    sqlx::query(&format!(
        "DELETE FROM {schema}.wh_perspective_events WHERE stream_id = ANY ($1)"
    ))
    .bind(done)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query(&format!(
        "ANALYZE {schema}.wh_streams, {schema}.wh_perspective_events"
    ))
    .execute(&mut conn)
    .await
    .unwrap();

    let tables = [
        format!("{schema}.wh_streams"),
        format!("{schema}.wh_perspective_events"),
    ];
    sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
    let mut before = Vec::new();
    for table in &tables {
        let n: i64 = rows_read_so_far(&mut conn, table).await;
        before.push(n);
    }
    let retired: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT * FROM {schema}.cleanup_completed_streams($1, $2)"
    ))
    .bind(Uuid::now_v7())
    .bind(done)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    for (table, before) in tables.iter().zip(before) {
        let read = rows_read_so_far(&mut conn, table).await - before;
        assert!(
            read <= 2 * 2_500,
            "retiring 2 500 streams read {read} rows of {table} (20 000 streams, 35 000 work rows)"
        );
    }
    sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
    assert_eq!(retired.len(), 2_500, "every applied stream is retired");

    // Completing thousands of work rows at once (an Instant drain call's, or a flush's) deletes
    // them by key too.
    let ids: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT event_work_id FROM {schema}.wh_perspective_events ORDER BY random() LIMIT 6000"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let table = format!("{schema}.wh_perspective_events");
    sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
    let before: i64 = rows_read_so_far(&mut conn, &table).await;
    let completed: i32 = sqlx::query_scalar(&format!(
        "SELECT {schema}.complete_perspective_events($1, false)"
    ))
    .bind(&ids)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let read = rows_read_so_far(&mut conn, &table).await - before;
    sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
    assert_eq!(completed, 6000);
    assert!(
        read <= 2 * 6000,
        "completing 6 000 work rows read {read} of the table's 35 000"
    );

    // The flush's fenced completion too, by (stream, perspective) range: one probe of the
    // cursor and one index range per pair. The pairs left of 3 000 streams (some lost one to the
    // completion above), their cursors covering their one event.
    let (streams, perspectives, versions): (Vec<Uuid>, Vec<String>, Vec<i64>) =
        sqlx::query_as(&format!(
        "SELECT array_agg(stream_id), array_agg(perspective_name::text), array_agg(stream_version)
         FROM {schema}.wh_perspective_events
         WHERE stream_id IN (SELECT DISTINCT stream_id FROM {schema}.wh_perspective_events
                             ORDER BY 1 LIMIT 3000)"
    ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_perspective_cursors (stream_id, perspective_name, last_version, status)
         SELECT * , 2 FROM unnest($1::uuid[], $2::text[], $3::bigint[])"
    ))
    .bind(&streams)
    .bind(&perspectives)
    .bind(&versions)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
    let before: i64 = rows_read_so_far(&mut conn, &table).await;
    let flushed: i32 = sqlx::query_scalar(&format!(
        "SELECT {schema}.complete_applied_events($1, $2, $3, false)"
    ))
    .bind(&streams)
    .bind(&perspectives)
    .bind(&versions)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let read = rows_read_so_far(&mut conn, &table).await - before;
    sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
    assert_eq!(
        flushed as usize,
        streams.len(),
        "every covered row is deleted"
    );
    assert!(
        streams.len() > 3000,
        "{} rows of 3 000 streams",
        streams.len()
    );
    assert!(
        read <= 2 * streams.len() as i64,
        "the fenced completion of {} work rows read {read} of the table's 29 000",
        streams.len()
    );
}
