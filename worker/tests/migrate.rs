//! `migrate` against a real PostgreSQL: idempotence, concurrency, refusal of changed or newer
//! histories, subscription sync, and configs whose SQL does not run.

mod common;

use std::process::Output;
use std::time::Duration;

use common::*;
use perspective_worker::admin::migrate::{migrate, MigrateError, MigrateOptions};
use perspective_worker::store::functions::FUNCTIONS;
use perspective_worker::store::migrations::{latest_version, MIGRATIONS};

fn write_config(yaml: &str) -> tempfile_path::TempPath {
    tempfile_path::write(yaml)
}

/// Minimal temp-file helper (std only), removed on drop.
mod tempfile_path {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub struct TempPath(PathBuf);
    impl TempPath {
        pub fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    pub fn write(content: &str) -> TempPath {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "perspective-test-{}-{}.yaml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, content).unwrap();
        TempPath(path)
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every object of the schema with its oid: a second migrate must leave all of them alone.
async fn catalog_snapshot(schema: &str) -> Vec<(String, i64)> {
    let mut conn = connect().await;
    sqlx::query_as(
        "SELECT c.relname::text, c.oid::int8 FROM pg_class c WHERE c.relnamespace = $1::regnamespace
         UNION ALL
         SELECT p.proname::text, p.oid::int8 FROM pg_proc p WHERE p.pronamespace = $1::regnamespace
         UNION ALL
         SELECT t.tgname::text, t.oid::int8 FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
           WHERE c.relnamespace = $1::regnamespace
         ORDER BY 1, 2",
    )
    .bind(schema)
    .fetch_all(&mut conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn second_migrate_changes_nothing() {
    let (schema, config) = migrated_schema("idem").await;
    let before = catalog_snapshot(&schema).await;
    assert!(
        before.iter().any(|(n, _)| n == "alpha_seen"),
        "setup created the perspective's table"
    );
    let mut conn = connect().await;
    let report = migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .unwrap();
    assert!(report.applied.is_empty());
    assert_eq!(report.already_applied, MIGRATIONS.len());
    assert!(
        !report.functions_installed,
        "the engine functions were current"
    );
    assert!(report.subscriptions_added.is_empty() && report.subscriptions_removed.is_empty());
    assert_eq!(report.statements_prepared, 4);
    assert_eq!(catalog_snapshot(&schema).await, before);
    let recorded: Vec<(i32, String)> = sqlx::query_as(&format!(
        "SELECT version, checksum FROM {schema}.wh_schema_migrations ORDER BY version"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let expected: Vec<(i32, String)> = MIGRATIONS
        .iter()
        .map(|m| (m.version, m.checksum()))
        .collect();
    assert_eq!(recorded, expected);
}

/// An older binary's compiled functions with another argument list (or other result columns)
/// would linger beside the new ones as overloads: migrate drops them and keeps only the current
/// shape.
#[tokio::test]
async fn migrate_drops_apply_functions_of_an_older_shape() {
    let (schema, config) = migrated_schema("shape").await;
    let mut conn = connect().await;
    // What an earlier format left behind: one argument fewer, one result column fewer.
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {schema}.wh_apply_alpha(p_stream_id uuid, p_work_ids bigint[], p_event_ids uuid[],
             p_versions bigint[], p_instant boolean, p_debug boolean, p_force boolean,
             p_retry_base_ms double precision, p_retry_max_ms double precision,
             p_notify_applied boolean DEFAULT false, p_count_failure boolean DEFAULT false)
         RETURNS TABLE (o_applied integer) LANGUAGE sql AS 'SELECT 0';
         DROP FUNCTION {schema}.wh_drain;
         CREATE FUNCTION {schema}.wh_drain(p_instance_id uuid, p_stream_ids uuid[], p_per_pair integer,
             p_max_rows integer, p_instant boolean, p_debug boolean, p_retry_base_ms double precision,
             p_retry_max_ms double precision, p_notify_applied boolean, p_max_attempts integer)
         RETURNS TABLE (o_stream_id uuid) LANGUAGE sql AS 'SELECT NULL::uuid';
         UPDATE {schema}.wh_perspectives SET definition_hash = 'older';"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .unwrap();
    let shapes: Vec<(String, String)> = sqlx::query_as(
        "SELECT p.proname::text, pg_get_function_result(p.oid) FROM pg_proc p
         WHERE p.pronamespace = $1::regnamespace AND p.proname IN ('wh_apply_alpha', 'wh_drain')
         ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        shapes.len(),
        2,
        "one function each, no overload left: {shapes:?}"
    );
    assert!(shapes[0].1.contains("o_completed_event_ids"), "{shapes:?}");
    assert!(shapes[1].1.contains("o_more"), "{shapes:?}");
}

/// `run` refuses apply functions compiled from another definition: every input of the compiled
/// code counts (reset, ordering, setup, handlers), not only the handlers. Each step changes one
/// of them, starts the engine without migrating (refused, naming the perspective), then migrates
/// and starts it (accepted).
#[tokio::test]
async fn run_refuses_a_perspective_changed_without_migrate() {
    use perspective_worker::config::{Ordering, PerspectiveConfig};
    use perspective_worker::engine::{Engine, EngineError, EngineOptions};

    let schema = unique_schema("stale");
    let mut config = parse_config(&two_perspective_yaml(&schema));
    config.perspectives[0].reset =
        Some("DELETE FROM alpha_seen WHERE stream_id = :stream_id".into());
    migrate_config(&config).await;
    type Edit = (&'static str, fn(&mut PerspectiveConfig));
    let edits: [Edit; 4] = [
        ("reset", |p| {
            p.reset = Some("DELETE FROM alpha_seen WHERE alpha_seen.stream_id = :stream_id".into())
        }),
        ("ordering", |p| p.ordering = Ordering::EventId),
        ("setup", |p| {
            p.setup = Some("CREATE TABLE IF NOT EXISTS alpha_seen (stream_id uuid, stream_version bigint, event_type text, note text);".into())
        }),
        ("handlers", |p| {
            p.handlers.insert(
                "A".into(),
                "INSERT INTO alpha_seen (stream_id) VALUES (:stream_id)".into(),
            );
        }),
    ];
    let mut started_stale = Vec::new();
    for (what, edit) in edits {
        edit(&mut config.perspectives[0]);
        let options = EngineOptions::new(config.clone(), database_url());
        let shutdown = tokio_util::sync::CancellationToken::new();
        match Engine::start(options, shutdown.clone()).await {
            Err(EngineError::PerspectiveOutdated { perspective, .. }) => {
                assert_eq!(perspective, "alpha", "after changing {what}")
            }
            Err(e) => panic!("after changing {what}: unexpected error {e}"),
            Ok(engine) => {
                started_stale.push(what);
                shutdown.cancel();
                engine.run_until_stopped().await.unwrap();
            }
        }
        migrate_config(&config).await;
        RunningEngine::start(&config).await.stop().await;
    }
    assert!(
        started_stale.is_empty(),
        "the engine started on functions compiled before these changed: {started_stale:?}"
    );
}

#[tokio::test]
async fn three_concurrent_migrate_processes_apply_each_migration_once() {
    let schema = unique_schema("conc");
    let file = write_config(&two_perspective_yaml(&schema));
    let children: Vec<_> = (0..3)
        .map(|_| {
            worker_bin()
                .arg("--config")
                .arg(file.path())
                .args(["migrate", "--json"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut applied_total = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "migrate failed: {}", text(&out));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        applied_total += report["applied"].as_array().unwrap().len();
    }
    assert_eq!(
        applied_total,
        MIGRATIONS.len(),
        "each migration applied by exactly one process"
    );
    let mut conn = connect().await;
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_schema_migrations"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(n as usize, MIGRATIONS.len());
    let subs: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_subscriptions"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(subs, 4);
}

#[tokio::test]
async fn an_edited_applied_migration_is_refused() {
    let (schema, config) = migrated_schema("edited").await;
    let mut conn = connect().await;
    sqlx::query(&format!(
        "UPDATE {schema}.wh_schema_migrations SET checksum = 'deadbeef' WHERE version = 1"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let err = migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, MigrateError::ChecksumMismatch { version: 1, .. }),
        "{err}"
    );

    // The CLI says so and exits 1.
    let file = write_config(&two_perspective_yaml(&schema));
    let out = worker_bin()
        .arg("--config")
        .arg(file.path())
        .arg("migrate")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains("migration 1 (0001_event_store.sql) was applied with checksum deadbeef"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_database_newer_than_the_binary_is_refused() {
    let (schema, config) = migrated_schema("newer").await;
    let mut conn = connect().await;
    let future = latest_version() + 1;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_schema_migrations (version, name, checksum, applied_by) VALUES ($1, 'future.sql', 'x', 'test')"
    ))
    .bind(future)
    .execute(&mut conn)
    .await
    .unwrap();
    let err = migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, MigrateError::DatabaseNewer { version, .. } if version == future),
        "{err}"
    );
    assert!(err
        .to_string()
        .contains("the database is newer than the binary"));
}

#[tokio::test]
async fn subscriptions_follow_the_config() {
    let (schema, _) = migrated_schema("subs").await;
    // Drop beta, give alpha a new event type.
    let yaml = format!(
        "schema: {schema}\nperspectives:\n  - name: alpha\n    handlers:\n      A: SELECT 1\n      E: SELECT :stream_id\n"
    );
    let config = parse_config(&yaml);
    let mut conn = connect().await;
    let report = migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .unwrap();
    let mut removed = report.subscriptions_removed.clone();
    removed.sort();
    assert_eq!(
        removed,
        vec![
            ("alpha".to_string(), "B".to_string()),
            ("beta".to_string(), "B".to_string()),
            ("beta".to_string(), "C".to_string())
        ]
    );
    assert_eq!(
        report.subscriptions_added,
        vec![("alpha".to_string(), "E".to_string())]
    );
    let subs: Vec<(String, String)> = sqlx::query_as(&format!(
        "SELECT perspective_name, event_type FROM {schema}.wh_perspective_subscriptions ORDER BY 1, 2"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        subs,
        vec![("alpha".into(), "A".into()), ("alpha".into(), "E".into())]
    );
}

#[tokio::test]
async fn dry_run_validates_and_leaves_nothing() {
    let schema = unique_schema("dry");
    let file = write_config(&two_perspective_yaml(&schema));
    let out = worker_bin()
        .arg("--config")
        .arg(file.path())
        .args(["migrate", "--dry-run"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("dry run, rolled back"),
        "{}",
        text(&out)
    );
    let mut conn = connect().await;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(&schema)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(!exists, "a dry run leaves no schema behind");
}

/// Configs that are well-formed YAML but whose SQL does not run against the database. Each is
/// rejected by `migrate --dry-run` with exit code 2 and a message naming file, perspective and
/// field; all problems of one config are reported together.
#[tokio::test]
async fn handler_sql_that_does_not_prepare_is_rejected_with_its_location() {
    let cases: &[(&str, &[&str])] = &[
        (
            "  - name: alpha\n    setup: CREATE TABLE IF NOT EXISTS t (id uuid)\n    handlers:\n      A: INSERT INTO t VALUS (:stream_id)\n",
            &["perspectives[0] (alpha).handlers.A: syntax error at or near \"VALUS\" (line 1)"],
        ),
        (
            "  - name: alpha\n    setup: CREATE TABLE IF NOT EXISTS t (id uuid)\n    handlers:\n      A: |\n        UPDATE t\n        SET nope = 1 WHERE id = :stream_id\n",
            &["perspectives[0] (alpha).handlers.A: column \"nope\" of relation \"t\" does not exist"],
        ),
        (
            "  - name: alpha\n    handlers:\n      A: INSERT INTO missing_table VALUES (:stream_id)\n",
            &["perspectives[0] (alpha).handlers.A: relation \"missing_table\" does not exist"],
        ),
        (
            "  - name: alpha\n    setup: CREATE TABLEE t (id uuid)\n    handlers:\n      A: SELECT 1\n",
            &["perspectives[0] (alpha).setup: syntax error at or near \"TABLEE\""],
        ),
        (
            "  - name: alpha\n    setup: CREATE TABLE IF NOT EXISTS t (id uuid)\n    reset: DELETE FROM t WHERE idd = :stream_id\n    handlers:\n      A: SELECT 1\n",
            &["perspectives[0] (alpha).reset: column \"idd\" does not exist"],
        ),
        (
            "  - name: alpha\n    setup: CREATE TABLE IF NOT EXISTS t (id uuid, n int)\n    handlers:\n      A: UPDATE t SET n = :data WHERE id = :stream_id\n",
            &["perspectives[0] (alpha).handlers.A: column \"n\" is of type integer but expression is of type jsonb"],
        ),
        (
            "  - name: alpha\n    handlers:\n      A: SELECT 1\n  - name: beta\n    handlers:\n      B: SELEC 2\n      C: DELETE FROM nowhere\n",
            &[
                "perspectives[1] (beta).handlers.B: syntax error at or near \"SELEC\"",
                "perspectives[1] (beta).handlers.C: relation \"nowhere\" does not exist",
            ],
        ),
    ];
    for (perspectives, expected) in cases {
        let schema = unique_schema("badsql");
        let file = write_config(&format!("schema: {schema}\nperspectives:\n{perspectives}"));
        let out = worker_bin()
            .arg("--config")
            .arg(file.path())
            .args(["migrate", "--dry-run"])
            .output()
            .unwrap();
        let msg = text(&out);
        assert_eq!(
            out.status.code(),
            Some(2),
            "expected exit 2 for\n{perspectives}\ngot: {msg}"
        );
        assert!(
            msg.contains(&file.path().display().to_string()),
            "message names the file: {msg}"
        );
        for fragment in *expected {
            assert!(msg.contains(fragment), "expected `{fragment}` in:\n{msg}");
        }
    }
}

/// Static config errors are rejected before any connection is made, with exit code 2.
#[tokio::test]
async fn invalid_config_files_exit_2_naming_the_field() {
    let cases: &[(&str, &str)] = &[
        (
            "schema: Bad-Name\nperspectives:\n  - name: a\n    handlers:\n      A: SELECT 1\n",
            "schema",
        ),
        (
            "schema: s\nperspectives:\n  - name: a\n    handlers:\n      A: SELECT :nope\n",
            "unknown parameter :nope",
        ),
        (
            "schema: s\nperspectives:\n  - name: a\n    handlrs:\n      A: SELECT 1\n",
            "handlrs",
        ),
        ("schema: s\nperspectives: [\n", "s"),
        (
            "schema: s\nperspectives:\n  - name: a\n    handlers:\n      A: SELECT 1\nworker:\n  partitionCount: 100\n",
            "worker.partitionCount: was removed: streams are hashed into a fixed 10000 partitions",
        ),
    ];
    for (yaml, fragment) in cases {
        let file = write_config(yaml);
        let out = worker_bin()
            .arg("--config")
            .arg(file.path())
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
            .args(["migrate", "--dry-run"])
            .output()
            .unwrap();
        let msg = text(&out);
        assert_eq!(out.status.code(), Some(2), "{yaml}\n{msg}");
        assert!(msg.contains(fragment), "expected `{fragment}` in {msg}");
        assert!(msg.contains(&file.path().display().to_string()), "{msg}");
    }
}

/// Migration 0003 drops what nothing used: the `complete_perspective_cursor_work` function, the
/// never-written cursor columns and the index of a cursor state that is never stored.
/// The columns of `schema.table`, in order.
async fn columns_of(conn: &mut sqlx::PgConnection, schema: &str, table: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn unused_columns_indexes_and_functions_are_dropped() {
    let (schema, _) = migrated_schema("unused").await;
    let mut conn = connect().await;
    let functions: Vec<String> = sqlx::query_scalar(
        "SELECT proname::text FROM pg_proc WHERE pronamespace = $1::regnamespace ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(functions.contains(&"complete_perspective_events".to_owned()));
    assert!(!functions.contains(&"complete_perspective_cursor_work".to_owned()));
    assert_eq!(
        columns_of(&mut conn, &schema, "wh_perspective_cursors").await,
        [
            "stream_id",
            "perspective_name",
            "last_version",
            "last_event_id",
            "status",
            "error",
            "processed_at",
            "rewind_trigger_event_id",
            "rewind_flagged_at",
            "rewind_first_flagged_at",
        ]
    );
    let rewind_index: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{schema}.wh_perspective_cursors_rewind"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(rewind_index, None);
    // 0005: streams are owned while their owner heartbeats; no stream lease is kept.
    assert_eq!(
        columns_of(&mut conn, &schema, "wh_active_streams").await,
        [
            "stream_id",
            "partition_number",
            "assigned_instance_id",
            "created_at"
        ]
    );
    let claim_args: Vec<String> = sqlx::query_scalar(
        "SELECT oidvectortypes(proargtypes) FROM pg_proc
         WHERE pronamespace = $1::regnamespace AND proname = 'claim_work'",
    )
    .bind(&schema)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    // 0013: one claim_work, with the count of streams the caller has offered already; since
    // issue 28's breadth work, the streams themselves too.
    assert_eq!(
        claim_args,
        ["uuid, integer, double precision, integer, uuid[]"]
    );
}

/// Acceptance 4 of the perspective lifecycle: a perspective removed from the config with work
/// pending leaves nothing behind after `migrate` but its tables, and the worker goes idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_perspective_leaves_no_work_cursors_or_pinned_streams() {
    let (schema, config) = migrated_schema("removed").await;
    let stream = uuid::Uuid::now_v7();
    let append = |types: &'static [&'static str]| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            for t in types {
                sqlx::query(&format!(
                    "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, $2)"
                ))
                .bind(stream)
                .bind(*t)
                .execute(&mut conn)
                .await
                .unwrap();
            }
        }
    };
    // Both perspectives apply some events (cursors), then more wait (pending work).
    let engine = RunningEngine::start(&config).await;
    append(&["A", "B", "C"]).await;
    wait_drained(&schema, std::time::Duration::from_secs(30)).await;
    engine.stop().await;
    append(&["B", "C", "A"]).await;

    // beta leaves the config.
    let alpha_only = two_perspective_yaml(&schema);
    let alpha_only = &alpha_only[..alpha_only.find("  - name: beta").unwrap()];
    let file = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&file, alpha_only).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .arg("migrate")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "removed perspective beta (no longer in the config): 2 pending work row(s) and 1 cursor(s) deleted; its tables are yours and were kept"
        ),
        "{stdout}"
    );
    let mut conn = connect().await;
    let left: (i64, i64, i64, bool, bool) = sqlx::query_as(&format!(
        "SELECT (SELECT count(*) FROM {schema}.wh_perspective_events WHERE perspective_name = 'beta'),
                (SELECT count(*) FROM {schema}.wh_perspective_cursors WHERE perspective_name = 'beta'),
                (SELECT count(*) FROM {schema}.wh_perspectives WHERE perspective_name = 'beta'),
                to_regproc('{schema}.wh_apply_beta') IS NULL,
                to_regclass('{schema}.beta_seen') IS NOT NULL"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        left,
        (0, 0, 0, true, true),
        "work, cursors, record, function gone; table kept"
    );

    // The worker applies alpha's event, retires the stream and goes idle.
    let alpha = parse_config(alpha_only);
    let engine = RunningEngine::start(&alpha).await;
    let mut hooks = engine.hooks.subscribe();
    wait_drained(&schema, std::time::Duration::from_secs(30)).await;
    wait_until(
        "the stream is unpinned",
        std::time::Duration::from_secs(30),
        || async {
            let mut conn = connect().await;
            sqlx::query_scalar::<_, i64>(&format!(
                "SELECT count(*) FROM {schema}.wh_active_streams"
            ))
            .fetch_one(&mut conn)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    let idle = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        loop {
            if let Ok(perspective_worker::engine::HookEvent::WorkProcessingIdle) =
                hooks.recv().await
            {
                return;
            }
        }
    })
    .await;
    assert!(
        idle.is_ok() || engine.hooks.is_idle(),
        "the worker goes idle"
    );
    engine.stop().await;
    let versions: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT stream_version FROM {schema}.alpha_seen WHERE stream_id = $1 ORDER BY 1"
    ))
    .bind(stream)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        versions,
        vec![1, 2, 4, 6],
        "alpha applied each of its events once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_in_flight_while_a_perspective_is_removed_pins_nothing() {
    let (schema, _config) = migrated_schema("removeflight").await;
    let stream = uuid::Uuid::now_v7();
    // An append of a type only beta handles, in flight (its trigger has read the subscriptions,
    // beta's included) while migrate removes beta.
    let mut producer = connect().await;
    sqlx::query("BEGIN").execute(&mut producer).await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'C')"
    ))
    .bind(stream)
    .execute(&mut producer)
    .await
    .unwrap();
    let alpha_only = two_perspective_yaml(&schema);
    let alpha_only = alpha_only[..alpha_only.find("  - name: beta").unwrap()].to_string();
    let alpha = parse_config(&alpha_only);
    migrate_config(&alpha).await;
    sqlx::query("COMMIT").execute(&mut producer).await.unwrap();
    let beta_rows = format!(
        "SELECT count(*) FROM {schema}.wh_perspective_events WHERE perspective_name = 'beta'"
    );
    let pinned = format!("SELECT count(*) FROM {schema}.wh_active_streams");
    assert_eq!(
        scalar(&beta_rows).await,
        1,
        "the append left a row for beta"
    );
    assert_eq!(scalar(&pinned).await, 1, "which pins its stream");

    // A worker drops the row and unpins the stream.
    let engine = RunningEngine::start(&alpha).await;
    wait_until(
        "the removed perspective's row is gone and the stream unpinned",
        std::time::Duration::from_secs(30),
        || async { scalar(&beta_rows).await == 0 && scalar(&pinned).await == 0 },
    )
    .await;
    engine.stop().await;
}

/// Every function of the schema but the compiled ones (`wh_drain`, `wh_apply_*`, `wh_batch_*`, `wh_key_*`),
/// each as the server prints it, with the schema's name replaced by `S`.
async fn engine_function_defs(conn: &mut sqlx::PgConnection, schema: &str) -> Vec<String> {
    let defs: Vec<String> = sqlx::query_scalar(
        r"SELECT pg_get_functiondef(p.oid) FROM pg_proc p
          WHERE p.pronamespace = $1::regnamespace AND p.proname <> 'wh_drain'
            AND p.proname NOT LIKE 'wh\_apply\_%' AND p.proname NOT LIKE 'wh\_batch\_%'
            AND p.proname NOT LIKE 'wh\_key\_%'
          ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)",
    )
    .bind(schema)
    .fetch_all(conn)
    .await
    .unwrap();
    defs.into_iter().map(|d| d.replace(schema, "S")).collect()
}

/// `found` and `expected` hold the same definitions; else the ones that differ, one side each.
fn assert_same_functions(found: &[String], expected: &[String], what: &str) {
    let only = |a: &[String], b: &[String]| -> Vec<String> {
        a.iter()
            .filter(|d| !b.contains(d))
            .map(|d| d.lines().next().unwrap_or_default().to_string())
            .collect()
    };
    assert!(
        found == expected,
        "{what}: found only {:#?}, expected only {:#?}",
        only(found, expected),
        only(expected, found)
    );
}

/// One home per function: every function a migrated schema has (but the compiled ones) is one
/// file of worker/src/store/functions/, with no other overload, and every file is installed.
#[tokio::test]
async fn every_function_of_a_migrated_schema_has_one_file() {
    let (schema, _) = migrated_schema("fnfiles").await;
    let mut conn = connect().await;
    let installed: Vec<String> = sqlx::query_scalar(
        r"SELECT p.proname::text FROM pg_proc p
          WHERE p.pronamespace = $1::regnamespace AND p.proname <> 'wh_drain'
            AND p.proname NOT LIKE 'wh\_apply\_%' AND p.proname NOT LIKE 'wh\_batch\_%'
            AND p.proname NOT LIKE 'wh\_key\_%'
          ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mut files: Vec<String> = FUNCTIONS.iter().map(|f| f.name.to_string()).collect();
    files.sort();
    assert_eq!(installed, files);
    // The compiled ones are there too, and were left out above by name only.
    let compiled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_proc WHERE pronamespace = $1::regnamespace
           AND proname IN ('wh_drain', 'wh_apply_alpha', 'wh_batch_alpha', 'wh_apply_beta', 'wh_batch_beta')",
    )
    .bind(&schema)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(compiled, 5);
}

/// `run` starts only on the engine functions `migrate` installed from this binary's files: a
/// record of another binary's set, no record, or functions changed, dropped or overloaded since
/// are refused (naming `migrate`); `migrate` then puts the files' functions back (dropping an
/// overload or an older shape it cannot replace) and `run` starts.
#[tokio::test]
async fn run_refuses_engine_functions_migrate_did_not_install() {
    use perspective_worker::engine::{Engine, EngineError, EngineOptions};

    let (schema, config) = migrated_schema("fntamper").await;
    let mut conn = connect().await;
    let installed = engine_function_defs(&mut conn, &schema).await;
    let tampers = [
        (
            "another binary's hash",
            format!("UPDATE {schema}.wh_schema_functions SET hash = 'older'"),
        ),
        (
            "no record",
            format!("DELETE FROM {schema}.wh_schema_functions"),
        ),
        (
            "a changed body",
            format!(
                "CREATE OR REPLACE FUNCTION {schema}.wh_uuid_v7() RETURNS uuid
                 LANGUAGE sql VOLATILE PARALLEL SAFE AS 'SELECT gen_random_uuid()'"
            ),
        ),
        (
            "a changed setting",
            format!("ALTER FUNCTION {schema}.cleanup_completed_streams(uuid, uuid[]) RESET jit"),
        ),
        (
            "a dropped function",
            format!("DROP FUNCTION {schema}.wh_delete_applied_events(interval)"),
        ),
        (
            "an extra overload",
            format!(
                "CREATE FUNCTION {schema}.claim_work(p_instance_id uuid) RETURNS TABLE (stream_id uuid)
                 LANGUAGE sql AS 'SELECT NULL::uuid'"
            ),
        ),
        (
            "an older result type",
            format!(
                "DROP FUNCTION {schema}.wh_job_advance(text);
                 CREATE FUNCTION {schema}.wh_job_advance(p_perspective text) RETURNS integer
                 LANGUAGE sql AS 'SELECT 0'"
            ),
        ),
        (
            "older parameter names",
            format!(
                "DROP FUNCTION {schema}.wh_queue_stream(uuid, text, bigint);
                 CREATE FUNCTION {schema}.wh_queue_stream(s uuid, p text, v bigint DEFAULT 0)
                 RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint'"
            ),
        ),
    ];
    for (what, sql) in tampers {
        sqlx::raw_sql(&sql).execute(&mut conn).await.unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        match Engine::start(
            EngineOptions::new(config.clone(), database_url()),
            shutdown.clone(),
        )
        .await
        {
            Err(e @ EngineError::FunctionsOutdated { .. }) => assert!(
                e.to_string().contains("run `perspective-worker migrate`"),
                "{what}: {e}"
            ),
            Err(e) => panic!("{what}: unexpected error {e}"),
            Ok(engine) => {
                shutdown.cancel();
                engine.run_until_stopped().await.unwrap();
                panic!("the engine started on {what}");
            }
        }
        let report = migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
            .await
            .unwrap();
        assert!(report.functions_installed, "{what}: migrate reinstalls");
        assert_same_functions(
            &engine_function_defs(&mut conn, &schema).await,
            &installed,
            &format!("after {what}, migrate installs the files' functions and only those"),
        );
        RunningEngine::start(&config).await.stop().await;
    }
}

/// A schema that an earlier binary migrated to 0017 (every engine function defined by the
/// migrations, no record of installed functions), with history and pending work its trigger
/// created: `run` refuses it; `migrate` applies 0018, installs the files over the migrations'
/// functions in place, leaving exactly what a fresh schema has; the engine then applies the history,
/// the pending work and new events exactly once; a second `migrate` installs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_migrated_to_0017_upgrades_to_the_function_files() {
    use perspective_worker::engine::{Engine, EngineError, EngineOptions};
    use perspective_worker::store::schema as store;
    use sqlx::Connection;

    let schema = unique_schema("upg17");
    let config = parse_config(&two_perspective_yaml(&schema));
    let mut conn = connect().await;
    let mut tx = conn.begin().await.unwrap();
    store::create_schema(&mut tx, &schema).await.unwrap();
    for m in MIGRATIONS.iter().filter(|m| m.version <= 17) {
        store::apply_migration(&mut tx, &schema, m, "perspective-worker 0.1.0")
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let stream = uuid::Uuid::now_v7();
    let append = |types: &'static [&'static str]| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            for t in types {
                sqlx::query(&format!(
                    "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
                     VALUES ($1, $2, '{{\"total\": 1}}')"
                ))
                .bind(stream)
                .bind(t)
                .execute(&mut conn)
                .await
                .unwrap();
            }
        }
    };
    // History (nothing subscribed yet), then work rows made by 0017's trigger.
    append(&["A"]).await;
    sqlx::raw_sql(&format!(
        "INSERT INTO {schema}.wh_perspective_subscriptions (perspective_name, event_type)
         VALUES ('alpha', 'A'), ('alpha', 'B'), ('beta', 'B'), ('beta', 'C')"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    append(&["B", "D"]).await;
    let oids = |schema: String| async move {
        let mut conn = connect().await;
        sqlx::query_as::<_, (String, i64)>(
            "SELECT proname::text, oid::int8 FROM pg_proc WHERE pronamespace = $1::regnamespace
             ORDER BY 1, 2",
        )
        .bind(schema)
        .fetch_all(&mut conn)
        .await
        .unwrap()
    };
    let before = oids(schema.clone()).await;

    let refused = Engine::start(
        EngineOptions::new(config.clone(), database_url()),
        tokio_util::sync::CancellationToken::new(),
    )
    .await;
    assert!(
        matches!(
            refused,
            Err(EngineError::SchemaOutdated {
                found: Some(17),
                ..
            })
        ),
        "{:?}",
        refused.err()
    );

    let report = migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .unwrap();
    assert_eq!(
        report.applied,
        [
            "0018_engine_functions_installed_by_migrate.sql",
            "0019_retention_guard_checks_each_row.sql",
            "0020_blue_green_versions.sql",
            "0021_stopping_instances.sql",
            "0022_instances_awake.sql"
        ]
    );
    assert!(report.functions_installed);
    // Replaced in place (same oids, so grants on them stay); the compiled ones, engine
    // functions added since 0017 (complete_applied_events, wh_run_events, wh_job_blockers,
    // wh_version_*, wh_settled_without_retry, hand_over_streams, wh_claim_awake), and claim_work, whose
    // arguments changed since (the older overload is dropped), are new.
    let after: Vec<(String, i64)> = oids(schema.clone())
        .await
        .into_iter()
        .filter(|(name, _)| FUNCTIONS.iter().any(|f| f.name == name))
        .filter(|(name, _)| {
            ![
                "complete_applied_events",
                "wh_run_events",
                "wh_job_blockers",
                "wh_version_move",
                "wh_version_adopt_work",
                "wh_version_switch",
                "wh_settled_without_retry",
                "hand_over_streams",
                "wh_claim_awake",
                "claim_work",
            ]
            .contains(&name.as_str())
        })
        .collect();
    let kept: Vec<(String, i64)> = before
        .into_iter()
        .filter(|(name, _)| name != "claim_work")
        .collect();
    assert_eq!(after, kept);
    let (fresh, _) = migrated_schema("upg17fresh").await;
    let upgraded = engine_function_defs(&mut conn, &schema).await;
    assert_same_functions(
        &upgraded,
        &engine_function_defs(&mut conn, &fresh).await,
        "an upgraded schema has the functions of a fresh one",
    );

    let engine = RunningEngine::start(&config).await;
    append(&["C"]).await;
    let seen = || async {
        scalar(&format!(
            "SELECT (SELECT count(*) FROM {schema}.alpha_seen) * 10 + (SELECT count(*) FROM {schema}.beta_seen)"
        ))
        .await
    };
    wait_until(
        "history, old work and new events applied",
        Duration::from_secs(30),
        || async { seen().await == 22 },
    )
    .await;
    engine.stop().await;
    let applied: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT 'alpha ' || event_type, stream_version FROM {schema}.alpha_seen
         UNION ALL SELECT 'beta', stream_version FROM {schema}.beta_seen ORDER BY 1, 2"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        applied,
        [
            ("alpha A".to_string(), 1),
            ("alpha B".to_string(), 2),
            ("beta".to_string(), 2),
            ("beta".to_string(), 4)
        ]
    );

    let again = migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .unwrap();
    assert!(again.applied.is_empty() && !again.functions_installed);
}
