//! The engine against a real PostgreSQL: exactly-once and in order with several instances,
//! redelivery, poison events and dead letters, per-event security context, NOTIFY wake-up
//! latency, LISTEN loss, and idle load.

mod common;
/// The example Rust perspective, run through the real engine below.
#[path = "../../examples/stream_history_runner.rs"]
#[allow(dead_code)]
mod stream_history_runner;

use std::time::{Duration, Instant};

use common::*;
use perspective_worker::config::Config;
use perspective_worker::engine::{
    ApplyMode, Group, HookEvent, PerspectiveRunner, SqlRunner, WorkItem,
};
use sqlx::Row;
use uuid::Uuid;

const FAST: &str = "worker:
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 200
  drainBatcher: { slidingWindowMilliseconds: 20, maxWaitMilliseconds: 200 }
claimWorker:
  pollingIntervalMilliseconds: 100
";

/// Which runner the engines use: the compiled SQL handlers, or the example Rust runner writing
/// the same `seen_<perspective>` tables.
#[derive(Clone, Copy, PartialEq)]
enum Runner {
    Sql,
    Rust,
}

fn engine_options(config: &Config, runner: Runner) -> perspective_worker::engine::EngineOptions {
    let mut options =
        perspective_worker::engine::EngineOptions::new(config.clone(), database_url());
    if runner == Runner::Rust {
        options.runner = Some(std::sync::Arc::new(
            stream_history_runner::StreamHistoryRunner::new(&config.schema, "seen_"),
        ));
    }
    options
}

async fn exactly_once_with_three_instances(strategy: &str, runner: Runner) {
    let kind = if runner == Runner::Rust { "rs" } else { "sql" };
    let schema = unique_schema(&format!("eo_{}_{kind}", &strategy[..4].to_lowercase()));
    let config = {
        let mut c = parse_config(&recording_yaml(&schema, FAST));
        c.worker.completion_strategy = match strategy {
            "Instant" => perspective_worker::config::CompletionStrategy::Instant,
            _ => perspective_worker::config::CompletionStrategy::Batched,
        };
        c
    };
    migrate_config(&config).await;
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(RunningEngine::start_with(engine_options(&config, runner)).await);
    }
    let streams: Vec<Uuid> = (0..300).map(|_| Uuid::now_v7()).collect();
    // 30 000 events while the three instances race for them.
    append_load(&schema, &streams, 100, 6, 50).await;
    wait_drained(&schema, Duration::from_secs(180)).await;
    // The last flush deletes the last rows; its streams are retired by the settler right after.
    wait_until(
        "drained streams retired",
        Duration::from_secs(30),
        || async { scalar(&format!("SELECT count(*) FROM {schema}.wh_active_streams")).await == 0 },
    )
    .await;
    for e in engines {
        e.stop().await;
    }
    assert_exactly_once(&schema, 300).await;
    let mut conn = connect().await;
    let (events, cursors_behind): (i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT count(*) FROM {schema}.wh_event_store),
                (SELECT count(*) FROM {schema}.wh_perspective_cursors c JOIN {schema}.wh_streams s USING (stream_id)
                 WHERE c.last_version <> s.version)"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(events, 30_000);
    assert_eq!(cursors_behind, 0);
    let (instances, active): (i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT count(*) FROM {schema}.wh_service_instances), (SELECT count(*) FROM {schema}.wh_active_streams)"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(instances, 0, "stopped instances deregister");
    assert_eq!(active, 0, "drained streams are retired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_apply_every_event_exactly_once_in_order_batched() {
    exactly_once_with_three_instances("Batched", Runner::Sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_with_a_rust_runner_apply_every_event_exactly_once_in_order() {
    exactly_once_with_three_instances("Batched", Runner::Rust).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_apply_every_event_exactly_once_in_order_instant() {
    exactly_once_with_three_instances("Instant", Runner::Sql).await;
}

/// Claim and fetch like a worker would, without applying.
async fn fetch(schema: &str, instance: Uuid, streams: &[Uuid]) -> Vec<WorkItem> {
    let mut conn = connect().await;
    sqlx::query(&format!(
        "SELECT {schema}.record_heartbeat($1, 't', 'h', 1)"
    ))
    .bind(instance)
    .execute(&mut conn)
    .await
    .unwrap();
    let _: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT stream_id FROM {schema}.claim_work($1, 100, 30)"
    ))
    .bind(instance)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    sqlx::query_as(&format!(
        "SELECT * FROM {schema}.claim_and_fetch_pending_perspective_events($1, $2, 300, 1000)"
    ))
    .bind(instance)
    .bind(streams)
    .fetch_all(&mut conn)
    .await
    .unwrap()
}

fn groups(items: Vec<WorkItem>) -> Vec<Group> {
    let mut out: Vec<Group> = Vec::new();
    for i in items {
        match out
            .iter_mut()
            .find(|g| g.stream_id == i.stream_id && g.perspective == i.perspective_name)
        {
            Some(g) => g.items.push(i),
            None => out.push(Group {
                stream_id: i.stream_id,
                perspective: i.perspective_name.clone(),
                items: vec![i],
            }),
        }
    }
    out
}

#[tokio::test]
async fn redelivered_work_is_never_applied_twice() {
    let schema = unique_schema("redeliver");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let runner = SqlRunner::new(&config);
    let instance = Uuid::now_v7();
    let (s1, s2) = (Uuid::now_v7(), Uuid::now_v7());
    append_load(&schema, &[s1, s2], 3, 1, 10).await;

    // Cycle 1: apply everything, but do not complete (a Batched flush that has not run yet).
    let first = fetch(&schema, instance, &[s1, s2]).await;
    assert_eq!(first.len(), 12, "2 streams × 3 events × 2 perspectives");
    let mut conn = connect().await;
    let mut done = Vec::new();
    for g in groups(first.clone()) {
        let o = runner
            .apply(&mut conn, &g, ApplyMode::default())
            .await
            .unwrap();
        assert_eq!(o.applied, 3);
        done.extend(o.done_work_ids);
    }
    assert_eq!(
        done.len(),
        12,
        "every applied row is reported for completion"
    );

    // Cycle 2: the same rows are still there; the fetch does not hand them out again...
    assert!(fetch(&schema, instance, &[s1, s2]).await.is_empty());
    // ...and even handed to the runner again (same work ids), nothing is re-applied.
    for g in groups(first.clone()) {
        let o = runner
            .apply(&mut conn, &g, ApplyMode::default())
            .await
            .unwrap();
        assert_eq!(o.applied, 0, "redelivered work is skipped by the cursor");
        assert_eq!(
            o.done_work_ids.len(),
            3,
            "and reported done so its rows get deleted"
        );
    }
    assert_exactly_once(&schema, 2).await;

    // New work for one stream (different work ids) is applied; the other stream is untouched.
    append_load(&schema, &[s1], 1, 1, 1).await;
    let next = fetch(&schema, instance, &[s1, s2]).await;
    assert_eq!(next.len(), 2);
    assert!(next
        .iter()
        .all(|i| i.stream_id == s1 && i.stream_version == 4));
    for g in groups(next) {
        assert_eq!(
            runner
                .apply(&mut conn, &g, ApplyMode::default())
                .await
                .unwrap()
                .applied,
            1
        );
    }
    assert_exactly_once(&schema, 2).await;
}

#[tokio::test]
async fn a_group_never_applies_past_a_missing_earlier_row() {
    let schema = unique_schema("ordering");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let runner = SqlRunner::new(&config);
    let instance = Uuid::now_v7();
    let s = Uuid::now_v7();
    append_load(&schema, &[s], 4, 1, 1).await;
    let items = fetch(&schema, instance, &[s]).await;
    // Hand the runner versions 1, 3 and 4 of p1 only: it must stop before 3.
    let g = Group {
        stream_id: s,
        perspective: "p1".into(),
        items: items
            .into_iter()
            .filter(|i| i.perspective_name == "p1" && i.stream_version != 2)
            .collect(),
    };
    let mut conn = connect().await;
    let o = runner
        .apply(&mut conn, &g, ApplyMode::default())
        .await
        .unwrap();
    assert_eq!((o.applied, o.last_version), (1, Some(1)));
    let versions: Vec<i64> = sqlx::query_scalar(&format!("SELECT versions FROM {schema}.seen_p1"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(versions, vec![1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_event_retries_then_dead_letters_and_replays_after_the_fix() {
    let schema = unique_schema("poison");
    let broken = |fixed: bool| {
        let guard = if fixed {
            ""
        } else {
            "\n        SELECT 1 / (CASE WHEN :data->>'poison' = 'yes' THEN 0 ELSE 1 END)"
        };
        format!(
            "schema: {schema}
perspectives:
  - name: p1
    setup: CREATE TABLE IF NOT EXISTS seen_p1 (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL)
    handlers:
      A: |{guard}
        ;INSERT INTO seen_p1 AS s VALUES (:stream_id, ARRAY[:stream_version]) ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version
worker:
  maxPerspectiveEventAttempts: 3
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 100
  drainBatcher: {{ slidingWindowMilliseconds: 10 }}
claimWorker:
  pollingIntervalMilliseconds: 50
"
        )
    };
    let config = parse_config(&broken(false));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let mut hooks = engine.hooks.subscribe();
    let (bad, good) = (Uuid::now_v7(), Uuid::now_v7());
    let mut conn = connect().await;
    for (stream, poison) in [
        (bad, false),
        (bad, true),
        (bad, false),
        (good, false),
        (good, false),
    ] {
        sqlx::query(&format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data) VALUES ($1, 'A', $2)"))
            .bind(stream)
            .bind(serde_json::json!({ "poison": if poison { "yes" } else { "no" } }))
            .execute(&mut conn)
            .await
            .unwrap();
    }

    // Three failed attempts (with growing backoff), then the dead letter.
    let mut failures = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ev = tokio::time::timeout_at(deadline.into(), hooks.recv())
            .await
            .expect("dead letter in time")
            .unwrap();
        match ev {
            HookEvent::PerspectiveEventFailed {
                stream_id, error, ..
            } => {
                assert_eq!(stream_id, bad, "only the poisoned stream fails: {error}");
                assert!(error.contains("division by zero"), "{error}");
                failures += 1;
            }
            HookEvent::DeadLettered { stream_id, .. } => {
                assert_eq!(stream_id, bad);
                break;
            }
            _ => {}
        }
    }
    assert_eq!(
        failures, 3,
        "maxPerspectiveEventAttempts attempts before dead-lettering"
    );
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;

    let seen = |stream: Uuid| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query_scalar::<_, Vec<i64>>(&format!(
                "SELECT versions FROM {schema}.seen_p1 WHERE stream_id = $1"
            ))
            .bind(stream)
            .fetch_one(&mut conn)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        seen(bad).await,
        vec![1, 3],
        "the rest of the poisoned stream is applied"
    );
    assert_eq!(seen(good).await, vec![1, 2], "other streams are unaffected");
    let dl = sqlx::query(&format!(
        "SELECT dead_letter_id, stream_version, attempts, error, event->>'event_type' FROM {schema}.wh_dead_letters"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let dl_id: i64 = dl.get(0);
    assert_eq!(dl.get::<i64, _>(1), 2);
    assert_eq!(
        dl.get::<i32, _>(2),
        3,
        "failed maxPerspectiveEventAttempts times, then dead-lettered"
    );
    assert!(dl
        .get::<Option<String>, _>(3)
        .unwrap()
        .contains("division by zero"));
    assert_eq!(dl.get::<String, _>(4), "A");
    // Status shows it (the operator's status reads this): the newest per perspective.
    let status = perspective_worker::store::status::read_status(
        &mut conn,
        &schema,
        &["p1".to_owned()],
        30.0,
    )
    .await
    .unwrap();
    let p1 = status.perspectives.iter().find(|p| p.name == "p1").unwrap();
    assert_eq!(p1.dead_letters, 1);
    assert_eq!(p1.newest_dead_letters.len(), 1, "{p1:?}");
    let newest = &p1.newest_dead_letters[0];
    assert_eq!((newest.id, newest.event_type.as_str()), (dl_id, "A"));
    assert_eq!(newest.stream_id, bad);
    assert!(newest
        .error
        .as_deref()
        .unwrap()
        .contains("division by zero"));

    // Replay with the broken handler fails and changes nothing.
    let file = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&file, broken(false)).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["dead-letters", "replay", &dl_id.to_string()])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("failed again"));

    // Fix the handler, migrate, replay.
    std::fs::write(&file, broken(true)).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .arg("migrate")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["dead-letters", "list"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("division by zero"));
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["dead-letters", "replay", "--all"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        seen(bad).await,
        vec![1, 3, 2],
        "the replayed event is applied once"
    );
    let status: String = sqlx::query_scalar(&format!(
        "SELECT recovery_status FROM {schema}.wh_dead_letters"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(status, "replayed");
    // A second replay finds nothing pending.
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["dead-letters", "replay", &dl_id.to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(seen(bad).await, vec![1, 3, 2]);
    // Nor does a discard: the id named is no pending dead letter.
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["dead-letters", "discard", &dl_id.to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1 of the 1 id(s) named were not pending"),
        "{out:?}"
    );
    // A perspective not in the config is refused, naming it.
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args([
            "dead-letters",
            "discard",
            "--all",
            "--perspective",
            "nosuch",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--perspective nosuch: no such perspective in the config"),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_runner_refusing_an_event_retries_it_with_backoff_then_dead_letters_it() {
    let schema = unique_schema("poison_rs");
    let config = parse_config(&recording_yaml(
        &schema,
        "worker:
  maxPerspectiveEventAttempts: 3
  failureRetryBaseMilliseconds: 150
  failureRetryMaxMilliseconds: 2000
  drainBatcher: { slidingWindowMilliseconds: 10 }
claimWorker:
  pollingIntervalMilliseconds: 20
",
    ));
    migrate_config(&config).await;
    let engine = RunningEngine::start_with(engine_options(&config, Runner::Rust)).await;
    let mut hooks = engine.hooks.subscribe();
    let (bad, good) = (Uuid::now_v7(), Uuid::now_v7());
    let mut conn = connect().await;
    for (stream, data) in [
        (bad, serde_json::json!({})),
        (bad, serde_json::json!("not an object")),
        (bad, serde_json::json!({})),
        (good, serde_json::json!({})),
        (good, serde_json::json!({})),
    ] {
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data) VALUES ($1, 'A', $2)"
        ))
        .bind(stream)
        .bind(data)
        .execute(&mut conn)
        .await
        .unwrap();
    }

    // Per perspective: three failures spaced by the backoff (150 ms, then 300 ms), then the
    // dead letter. A hot retry would fail again within milliseconds.
    let mut failures: std::collections::HashMap<String, Vec<Instant>> = Default::default();
    let mut dead = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while dead < 2 {
        let ev = tokio::time::timeout_at(deadline.into(), hooks.recv())
            .await
            .expect("dead letters in time")
            .unwrap();
        match ev {
            HookEvent::PerspectiveEventFailed {
                perspective,
                stream_id,
                error,
                ..
            } => {
                assert_eq!(stream_id, bad, "only the poisoned stream fails: {error}");
                assert!(error.contains("must be a JSON object"), "{error}");
                failures
                    .entry(perspective)
                    .or_default()
                    .push(Instant::now());
            }
            HookEvent::DeadLettered { stream_id, .. } => {
                assert_eq!(stream_id, bad);
                dead += 1;
            }
            _ => {}
        }
    }
    for (perspective, at) in &failures {
        assert_eq!(
            at.len(),
            3,
            "{perspective}: maxPerspectiveEventAttempts failures"
        );
        for (n, pair) in at.windows(2).enumerate() {
            let gap = pair[1] - pair[0];
            let backoff = Duration::from_millis(150 << n);
            assert!(
                gap >= backoff - Duration::from_millis(20),
                "{perspective}: retry {} after {gap:?}, before its backoff {backoff:?}",
                n + 1
            );
        }
    }
    assert_eq!(failures.len(), 2, "both perspectives refused the event");
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;

    for p in ["p1", "p2"] {
        let versions = |stream: Uuid| {
            let sql = format!("SELECT versions FROM {schema}.seen_{p} WHERE stream_id = $1");
            async move {
                let mut conn = connect().await;
                sqlx::query_scalar::<_, Vec<i64>>(&sql)
                    .bind(stream)
                    .fetch_one(&mut conn)
                    .await
                    .unwrap()
            }
        };
        assert_eq!(
            versions(bad).await,
            vec![1, 3],
            "{p}: the rest of the stream is applied"
        );
        assert_eq!(
            versions(good).await,
            vec![1, 2],
            "{p}: other streams are unaffected"
        );
    }
    let letters: Vec<(i64, i64, i32, String)> = sqlx::query_as(&format!(
        "SELECT dead_letter_id, stream_version, attempts, error FROM {schema}.wh_dead_letters ORDER BY 1"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(letters.len(), 2);
    for (_, version, attempts, error) in &letters {
        assert_eq!((*version, *attempts), (2, 3));
        assert!(error.contains("must be a JSON object"), "{error}");
    }
    // Replaying through the same runner refuses the same payload again and changes nothing.
    let runner = stream_history_runner::StreamHistoryRunner::new(&schema, "seen_");
    let replay =
        perspective_worker::admin::dead_letters::replay(&mut conn, &schema, &runner, letters[0].0)
            .await;
    assert!(
        matches!(
            replay,
            Err(perspective_worker::admin::dead_letters::ReplayError::FailedAgain { .. })
        ),
        "{replay:?}"
    );
}

/// Migrates `yaml`, appends to one new stream with `insert` (`{schema}` replaced, `$1` the
/// stream id) while no engine runs, then starts one, waits until everything is applied and stops
/// it. Returns a connection for the checks.
async fn append_one_stream_and_apply(yaml: &str, schema: &str, insert: &str) -> sqlx::PgConnection {
    let config = parse_config(yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    sqlx::query(&insert.replace("{schema}", schema))
        .bind(Uuid::now_v7())
        .execute(&mut conn)
        .await
        .unwrap();
    let engine = RunningEngine::start(&config).await;
    wait_drained(schema, Duration::from_secs(30)).await;
    engine.stop().await;
    conn
}

#[tokio::test]
async fn each_event_runs_with_its_own_user_and_tenant() {
    let schema = unique_schema("security");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: audit
    setup: CREATE TABLE IF NOT EXISTS audit (stream_version bigint, user_id text, tenant_id text, param_user text)
    handlers:
      A: INSERT INTO audit VALUES (:stream_version, current_setting('perspective.user_id', true), current_setting('perspective.tenant_id', true), :user_id)
{FAST}"
    );
    // All events of one stream, appended in one transaction, so they are applied in one batch.
    let mut conn = append_one_stream_and_apply(
        &yaml,
        &schema,
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, metadata, scope)
         SELECT $1, 'A', jsonb_build_object('user_id', 'user-' || (i % 2)), jsonb_build_object('tenant_id', 'tenant-' || (i % 3))
         FROM generate_series(1, 12) i ORDER BY i",
    )
    .await;
    let rows: Vec<(i64, String, String, String)> = sqlx::query_as(&format!(
        "SELECT stream_version, user_id, tenant_id, param_user FROM {schema}.audit ORDER BY 1"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(rows.len(), 12);
    for (v, user, tenant, param) in rows {
        assert_eq!(user, format!("user-{}", v % 2), "version {v}");
        assert_eq!(tenant, format!("tenant-{}", v % 3), "version {v}");
        assert_eq!(param, user);
    }
}

/// A perspective subscribed to some of a stream's event types sees a group with gaps in its
/// versions: each event must still be applied with its own type, version, data and identity
/// (the apply function reads the events by version; a misalignment would shift them).
#[tokio::test]
async fn a_perspective_handling_some_types_gets_each_event_with_its_own_fields() {
    let schema = unique_schema("subset");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: everything
    setup: CREATE TABLE IF NOT EXISTS everything (stream_version bigint PRIMARY KEY)
    handlers:
      A: INSERT INTO everything VALUES (:stream_version)
      B: INSERT INTO everything VALUES (:stream_version)
      C: INSERT INTO everything VALUES (:stream_version)
  - name: some
    setup: CREATE TABLE IF NOT EXISTS some_seen (stream_version bigint PRIMARY KEY, event_type text, n int, user_id text)
    handlers:
      A: INSERT INTO some_seen VALUES (:stream_version, :event_type, (:data->>'n')::int, current_setting('perspective.user_id', true))
      C: INSERT INTO some_seen VALUES (:stream_version, :event_type, (:data->>'n')::int, current_setting('perspective.user_id', true))
{FAST}"
    );
    // Types cycle A B C B B A C …, so `some` sees versions with irregular gaps; data and user
    // are functions of the version.
    let mut conn = append_one_stream_and_apply(
        &yaml,
        &schema,
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data, metadata)
         SELECT $1, (ARRAY['A', 'B', 'C', 'B', 'B', 'A', 'C'])[1 + i % 7],
                jsonb_build_object('n', i * 10), jsonb_build_object('user_id', 'user-' || (i % 4))
         FROM generate_series(1, 60) i ORDER BY i",
    )
    .await;
    let rows: Vec<(i64, String, i32, String)> = sqlx::query_as(&format!(
        "SELECT stream_version, event_type, n, user_id FROM {schema}.some_seen ORDER BY 1"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let types = ["A", "B", "C", "B", "B", "A", "C"];
    let expected: Vec<(i64, String, i32, String)> = (1..=60i64)
        .filter(|i| types[(*i % 7) as usize] != "B")
        .map(|i| {
            (
                i,
                types[(i % 7) as usize].to_string(),
                (i * 10) as i32,
                format!("user-{}", i % 4),
            )
        })
        .collect();
    assert_eq!(rows, expected);
    let everything: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.everything"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(everything, 60);
}

/// A group of consecutive versions reads its events as one range of the store's index, a group
/// with gaps (a perspective handling some of the stream's types) by its versions; both come in
/// version order, so neither is read again sorted. Each event still meets its own fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_consecutive_versions_reads_its_events_as_one_range() {
    let schema = unique_schema("eventrange");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: every
    setup: CREATE TABLE IF NOT EXISTS seen_every (seq bigserial PRIMARY KEY, stream_id uuid, stream_version bigint, n int)
    handlers:
      A: INSERT INTO seen_every (stream_id, stream_version, n) VALUES (:stream_id, :stream_version, (:data->>'n')::int)
      B: INSERT INTO seen_every (stream_id, stream_version, n) VALUES (:stream_id, :stream_version, (:data->>'n')::int)
  - name: odd
    setup: CREATE TABLE IF NOT EXISTS seen_odd (seq bigserial PRIMARY KEY, stream_id uuid, stream_version bigint, n int)
    handlers:
      A: INSERT INTO seen_odd (stream_id, stream_version, n) VALUES (:stream_id, :stream_version, (:data->>'n')::int)
{FAST}"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let (mut conn, url) = counting_statements().await;
    // Twenty events a stream, A at odd versions and B at even ones: `every` holds each stream's
    // versions 1..20, `odd` its odd ones (both deeper than a shallow pair).
    let streams: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
    for stream in &streams {
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
             SELECT $1, CASE WHEN i % 2 = 1 THEN 'A' ELSE 'B' END, jsonb_build_object('n', i * 10)
             FROM generate_series(1, 20) i ORDER BY i"
        ))
        .bind(stream)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    let engine = RunningEngine::start_with(perspective_worker::engine::EngineOptions::new(
        config.clone(),
        url,
    ))
    .await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;

    let store = format!("FROM {schema}.wh_event_store e");
    let range = [store.clone(), "e.stream_version BETWEEN a_versions[".into()];
    let by_versions = [
        store.clone(),
        "array_agg(e.event_type),".into(),
        "e.stream_version = ANY (a_versions)".into(),
    ];
    let sorted = [
        store,
        "array_agg(e.event_type ORDER BY e.stream_version)".into(),
    ];
    assert_eq!(
        (
            statement_calls(&mut conn, &range).await,
            statement_calls(&mut conn, &by_versions).await,
            statement_calls(&mut conn, &sorted).await
        ),
        (10, 10, 0),
        "event reads: by range (every), by versions (odd), again sorted"
    );
    for (table, versions) in [
        ("seen_every", (1..=20).collect::<Vec<i64>>()),
        ("seen_odd", (1..=20).filter(|v| v % 2 == 1).collect()),
    ] {
        let rows: Vec<(Uuid, i64, i32)> = sqlx::query_as(&format!(
            "SELECT stream_id, stream_version, n FROM {schema}.{table} ORDER BY seq"
        ))
        .fetch_all(&mut conn)
        .await
        .unwrap();
        for stream in &streams {
            let seen: Vec<(i64, i32)> = rows
                .iter()
                .filter(|(s, _, _)| s == stream)
                .map(|(_, v, n)| (*v, *n))
                .collect();
            let expected: Vec<(i64, i32)> = versions.iter().map(|v| (*v, *v as i32 * 10)).collect();
            assert_eq!(seen, expected, "{table}, stream {stream}");
        }
    }
}

/// The apply function reads a group's events in one scan and checks that they came in the
/// group's version order (it does not sort them by default). Here the scan cannot use an index
/// and the stream's odd versions lie after its even ones on disk (as after retention freed earlier
/// pages): the events must still be applied in version order, each with its own data.
#[tokio::test]
async fn events_stored_out_of_version_order_are_applied_in_version_order() {
    let schema = unique_schema("heaporder");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: log
    setup: CREATE TABLE IF NOT EXISTS seen_log (seq bigserial PRIMARY KEY, stream_version bigint, n int)
    handlers:
      A: INSERT INTO seen_log (stream_version, n) VALUES (:stream_version, (:data->>'n')::int)
{FAST}"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    let stream = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         SELECT $1, 'A', jsonb_build_object('n', i * 10) FROM generate_series(1, 40) i ORDER BY i"
    ))
    .bind(stream)
    .execute(&mut conn)
    .await
    .unwrap();
    // Rewrite the odd versions in place (the store's append-only trigger is off for this session
    // only): their new tuples go after the even ones, where a sequential scan finds them.
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {schema}.wh_event_store SET event_data = event_data
         WHERE stream_id = $1 AND stream_version % 2 = 1"
    ))
    .bind(stream)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("RESET session_replication_role")
        .execute(&mut conn)
        .await
        .unwrap();
    let versions_on_disk: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT stream_version FROM {schema}.wh_event_store WHERE stream_id = $1 ORDER BY ctid"
    ))
    .bind(stream)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_ne!(
        versions_on_disk,
        (1..=40).collect::<Vec<i64>>(),
        "the setup did not reorder"
    );
    // The engine's sessions may not use an index, so the events come in heap order.
    let url = database_url_with(&[
        ("enable_indexscan", "off"),
        ("enable_indexonlyscan", "off"),
        ("enable_bitmapscan", "off"),
    ]);
    let engine = RunningEngine::start_with(perspective_worker::engine::EngineOptions::new(
        config.clone(),
        url,
    ))
    .await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let rows: Vec<(i64, i32)> = sqlx::query_as(&format!(
        "SELECT stream_version, n FROM {schema}.seen_log ORDER BY seq"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let expected: Vec<(i64, i32)> = (1..=40).map(|v| (v, v as i32 * 10)).collect();
    assert_eq!(rows, expected);
}

/// A connection to count statements with [`statement_calls`], and the URL an engine's sessions
/// use for every statement they run, nested ones included, to be counted (`track = all`).
async fn counting_statements() -> (sqlx::PgConnection, String) {
    let mut conn = connect().await;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&mut conn)
        .await
        .expect("pg_stat_statements: the test cluster preloads it (tests/pg/pg.sh)");
    (
        conn,
        database_url_with(&[("pg_stat_statements.track", "all")]),
    )
}

/// Calls recorded by pg_stat_statements (`track = all` in the engine's sessions) of the
/// statements whose text contains every part.
async fn statement_calls(conn: &mut sqlx::PgConnection, parts: &[String]) -> i64 {
    // (Not the migration's CREATE FUNCTION statements, whose bodies hold the same text.)
    let mut sql = "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
                   WHERE query NOT LIKE '%CREATE %FUNCTION%'"
        .to_string();
    for i in 1..=parts.len() {
        sql.push_str(&format!(" AND query LIKE '%' || ${i} || '%'"));
    }
    let mut q = sqlx::query_scalar::<_, i64>(&sql);
    for part in parts {
        q = q.bind(part);
    }
    q.fetch_one(conn).await.unwrap()
}

/// The apply functions' statements on the cursor so far: its inserts that return the row
/// (`RETURNING`), and its lookups that lock a row (`FOR UPDATE`).
async fn assert_cursor_statements(
    conn: &mut sqlx::PgConnection,
    schema: &str,
    inserts: i64,
    lookups: i64,
    when: &str,
) {
    let insert = [
        format!("INSERT INTO {schema}.wh_perspective_cursors"),
        "RETURNING last_version".to_string(),
    ];
    let lookup = [
        format!("{schema}.wh_perspective_cursors c"),
        "FOR UPDATE".to_string(),
    ];
    assert_eq!(
        (
            statement_calls(conn, &insert).await,
            statement_calls(conn, &lookup).await
        ),
        (inserts, lookups),
        "cursor inserts and lookups {when}"
    );
}

/// A group from a stream's first version inserts the pair's cursor row and holds it, one
/// statement, where finding no row, inserting it and locking it took three; a later group
/// locks the row it finds; and a creator that got there first is waited for, not overwritten.
/// Only a later group looks for rows left under the cursor it followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_apply_creates_its_cursor_in_one_statement_and_waits_for_another_creator() {
    let schema = unique_schema("firstcursor");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: log
    setup: CREATE TABLE IF NOT EXISTS seen_log (seq bigserial PRIMARY KEY, stream_id uuid, stream_version bigint)
    handlers:
      A: INSERT INTO seen_log (stream_id, stream_version) VALUES (:stream_id, :stream_version)
{FAST}"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let (mut conn, url) = counting_statements().await;
    // (Ten events a stream: more than a shallow pair holds, so they take the per-pair path and
    // its apply function, whatever depth the engine saw before.)
    let append = |streams: Vec<Uuid>, events: i32| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            for stream in streams {
                sqlx::query(&format!(
                    "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
                     SELECT $1, 'A', '{{}}' FROM generate_series(1, $2)"
                ))
                .bind(stream)
                .bind(events)
                .execute(&mut conn)
                .await
                .unwrap();
            }
        }
    };
    let streams: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();

    let start = || {
        RunningEngine::start_with(perspective_worker::engine::EngineOptions::new(
            config.clone(),
            url.clone(),
        ))
    };
    // First applies: each creates its cursor, and none looks for a row first.
    append(streams.clone(), 10).await;
    let engine = start().await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_cursor_statements(&mut conn, &schema, 20, 0, "after 20 first applies").await;
    // Nothing can be left under a first window's cursor: no retire statement after the apply.
    let retire = [
        format!("FROM {schema}.wh_perspective_events w"),
        "AND w.stream_version <= v_last".to_string(),
    ];
    assert_eq!(
        statement_calls(&mut conn, &retire).await,
        0,
        "retires after first applies"
    );

    // Later events: each group locks the row it finds.
    append(streams.clone(), 10).await;
    let engine = start().await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    assert_cursor_statements(&mut conn, &schema, 20, 20, "after 20 later groups").await;
    assert_eq!(
        statement_calls(&mut conn, &retire).await,
        20,
        "retires after later groups"
    );

    // Another creator holds a new pair's cursor row, not yet committed: the first apply's insert
    // waits for it, inserts nothing, and then locks that row and applies after it.
    let raced = Uuid::now_v7();
    let mut other = connect().await;
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, 'log')"
    ))
    .bind(raced)
    .execute(&mut other)
    .await
    .unwrap();
    append(vec![raced], 10).await;
    wait_until("the first apply waits for the other creator", Duration::from_secs(30), || {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '.wh_drain%'",
            )
            .bind(schema)
            .fetch_one(&mut conn)
            .await
            .unwrap()
                > 0
        }
    })
    .await;
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    // The raced insert ran and inserted nothing, and the row it waited for was locked.
    assert_cursor_statements(&mut conn, &schema, 21, 21, "after the raced first apply").await;
    let rows: Vec<(Uuid, i64)> = sqlx::query_as(&format!(
        "SELECT stream_id, stream_version FROM {schema}.seen_log ORDER BY seq"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mut expected: Vec<(Uuid, i64)> = streams
        .iter()
        .flat_map(|s| (1..=20).map(move |v| (*s, v)))
        .collect();
    expected.extend((1..=10).map(|v| (raced, v)));
    let mut sorted = rows.clone();
    sorted.sort();
    expected.sort();
    assert_eq!(sorted, expected, "every event applied once");
    for stream in streams.iter().chain([&raced]) {
        let versions: Vec<i64> = rows
            .iter()
            .filter(|(s, _)| s == stream)
            .map(|(_, v)| *v)
            .collect();
        assert!(
            versions.is_sorted(),
            "{stream}: applied out of order: {versions:?}"
        );
    }
    let cursor: i64 = sqlx::query_scalar(&format!(
        "SELECT last_version FROM {schema}.wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = 'log'"
    ))
    .bind(raced)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(cursor, 10, "the raced pair's cursor moved past its events");
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_an_idle_worker_at_once_and_polling_covers_a_lost_listener() {
    let schema = unique_schema("wake");
    // Relaxed safety net (5 s) so only the doorbell can explain fast applies.
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let mut hooks = engine.hooks.subscribe();
    let pool = pool(2).await;
    wait_until("LISTEN connected", Duration::from_secs(10), || {
        let m = engine.metrics.clone();
        async move { m.listener_connected.get() == 1 }
    })
    .await;
    let insert =
        format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A')");
    let mut latencies = Vec::new();
    for _ in 0..1000 {
        let s = Uuid::now_v7();
        let started = Instant::now();
        sqlx::query(&insert).bind(s).execute(&pool).await.unwrap();
        let mut done = 0;
        while done < 2 {
            match tokio::time::timeout(Duration::from_secs(10), hooks.recv())
                .await
                .expect("applied in time")
                .unwrap()
            {
                HookEvent::PerspectiveEventProcessed { stream_id, .. } if stream_id == s => {
                    done += 1
                }
                _ => {}
            }
        }
        latencies.push(started.elapsed());
    }
    latencies.sort();
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    println!(
        "append → applied by both perspectives, 1000 single appends: p50 {p50:?}, p99 {p99:?}"
    );
    assert!(
        p99 < Duration::from_secs(1),
        "p99 {p99:?} is not well under the 5 s safety net"
    );

    // Kill the LISTEN connection: the tight poll still applies new work, and it reconnects.
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE application_name = 'perspective-worker listen' AND query LIKE '%' || $1 || '%'",
    )
    .bind(format!("{schema}_work"))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "found this engine's LISTEN session");
    let s = Uuid::now_v7();
    sqlx::query(&insert).bind(s).execute(&pool).await.unwrap();
    let started = Instant::now();
    let mut done = 0;
    while done < 2 {
        if let HookEvent::PerspectiveEventProcessed { stream_id, .. } =
            tokio::time::timeout(Duration::from_secs(10), hooks.recv())
                .await
                .expect("applied without LISTEN")
                .unwrap()
        {
            if stream_id == s {
                done += 1;
            }
        }
    }
    println!(
        "applied {:?} after the LISTEN connection was killed",
        started.elapsed()
    );
    wait_until("LISTEN reconnected", Duration::from_secs(10), || {
        let pool = pool.clone();
        let channel = format!("{schema}_work");
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'perspective-worker listen' AND query LIKE '%' || $1 || '%'",
            )
            .bind(channel)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        }
    })
    .await;
    engine.stop().await;
    assert_exactly_once(&schema, 1001).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_sends_few_statements() {
    let schema = unique_schema("idle");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let mut conn = connect().await;
    let has_pss: bool = sqlx::query_scalar(
        "SELECT count(*) > 0 FROM pg_extension WHERE extname = 'pg_stat_statements'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    if !has_pss {
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(&mut conn).await.expect(
            "pg_stat_statements: the test cluster preloads it (tests/pg/pg.sh); without it idle load cannot be measured",
        );
    }
    let calls_like = |pattern: String| async move {
        let mut conn = connect().await;
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT sum(calls)::int8 FROM pg_stat_statements WHERE query LIKE $1",
        )
        .bind(pattern)
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .unwrap_or(0)
    };
    // Each statement and its calls, to name the ones that broke the budget.
    let per_statement = |schema: String| async move {
        let mut conn = connect().await;
        sqlx::query_as::<_, (String, i64)>(
            "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 120), sum(calls)::int8
               FROM pg_stat_statements WHERE query LIKE $1 GROUP BY 1",
        )
        .bind(format!("%{schema}.%"))
        .fetch_all(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .collect::<std::collections::HashMap<_, _>>()
    };
    let sweeps = || calls_like(format!("%{schema}.cleanup_stale_instances%"));
    let engine = RunningEngine::start(&config).await;
    wait_until("LISTEN connected", Duration::from_secs(10), || {
        let m = engine.metrics.clone();
        async move { m.listener_connected.get() == 1 }
    })
    .await;
    // The catch-up turns twice at start-up (on starting, and woken by the LISTEN connecting),
    // each ending with its read of the versions being built: the window starts after both, so
    // that it holds its idle cadence only (a start-up turn split across its edge counted once
    // more than that cadence).
    let versions_read = || calls_like(format!("%{schema}.wh_perspective_versions WHERE state%"));
    wait_until(
        "the catch-up's start-up turns",
        Duration::from_secs(30),
        || async { versions_read().await >= 2 },
    )
    .await;
    let statements_before = per_statement(schema.clone()).await;
    let sweeps_before = sweeps().await;
    let window = Duration::from_secs(30);
    tokio::time::sleep(window).await; // the measurement itself: nothing to wait for but time
    let sent: Vec<(String, i64)> = per_statement(schema.clone())
        .await
        .into_iter()
        .map(|(query, calls)| {
            let before = statements_before.get(&query).copied().unwrap_or(0);
            (query, calls - before)
        })
        .filter(|(_, calls)| *calls > 0)
        .collect();
    let swept = sweeps().await - sweeps_before;
    engine.stop().await;
    let total: i64 = sent.iter().map(|(_, calls)| calls).sum();
    println!(
        "idle worker: {total} statements in {window:?} = {:.2}/s",
        total as f64 / window.as_secs_f64()
    );
    for (query, calls) in &sent {
        println!("  {calls:>3} × {query}");
    }
    // The budget, one cadence at a time. A 30 s window holds n or n + 1 beats of a cadence,
    // depending on where it falls: the claim safety net (every 5 s growing to 10 s while idle:
    // 3, at most 4 once grown), the heartbeat and the pending gauge (10 s: at most 4 each), and
    // the catch-up's idle turn (30 s: at most 2 of each of its statements). 12 on average, 0.4/s;
    // at most 18 when every cadence has its extra beat in the window. The stale sweep runs only
    // when a heartbeat saw a silent peer: here none. Any other statement breaks the budget.
    assert_eq!(swept, 0, "no peer is silent: no sweep");
    let budget = [
        ("claim_work(", 4),
        ("last_heartbeat_at", 4),
        ("SELECT perspective_name, count(*), extract(", 4),
        ("wh_perspective_jobs WHERE state", 2),
        ("SELECT j.perspective_name, j.kind, j.state", 2),
        ("wh_perspective_versions WHERE state", 2),
    ];
    for (query, calls) in &sent {
        let Some((_, most)) = budget.iter().find(|(marker, _)| query.contains(marker)) else {
            panic!("an idle worker sent a statement outside its cadences: {calls} × {query}");
        };
        assert!(
            calls <= most,
            "{calls} × {query}: more than its cadence explains in 30 s (at most {most})"
        );
    }
    assert!(total >= 3, "the safety net and heartbeats must still run");
}

/// The heartbeat sweeps only when it sees a silent peer (so an idle worker sends one statement
/// less per interval), but it does see one: a peer that falls silent after the worker started
/// is abandoned by a later heartbeat, and its stream released.
#[tokio::test]
async fn a_peer_that_falls_silent_is_abandoned_by_a_heartbeat() {
    let schema = unique_schema("sweep");
    let config = parse_config(&recording_yaml(
        &schema,
        "worker:\n  heartbeatIntervalSeconds: 1\n  abandonStaleInstanceThresholdSeconds: 3\n",
    ));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let mut conn = connect().await;
    // A live peer owning a stream (no events: nothing for the engine to drain or claim).
    let peer = Uuid::now_v7();
    let stream = Uuid::now_v7();
    sqlx::query(&format!(
        "SELECT {schema}.record_heartbeat($1, 'peer', 'h', 1)"
    ))
    .bind(peer)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_active_streams (stream_id, partition_number, assigned_instance_id)
         VALUES ($1, 0, $2)"
    ))
    .bind(stream)
    .bind(peer)
    .execute(&mut conn)
    .await
    .unwrap();
    // It falls silent: its last heartbeat ages past the threshold.
    sqlx::query(&format!(
        "UPDATE {schema}.wh_service_instances SET last_heartbeat_at = now() - interval '1 minute'
         WHERE instance_id = $1"
    ))
    .bind(peer)
    .execute(&mut conn)
    .await
    .unwrap();
    let gone = format!(
        "SELECT NOT EXISTS (SELECT 1 FROM {schema}.wh_service_instances WHERE instance_id = '{peer}')
            AND NOT EXISTS (SELECT 1 FROM {schema}.wh_active_streams WHERE assigned_instance_id = '{peer}')"
    );
    wait_until("the silent peer abandoned", Duration::from_secs(10), || {
        let gone = gone.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query_scalar::<_, bool>(&gone)
                .fetch_one(&mut conn)
                .await
                .unwrap()
        }
    })
    .await;
    engine.stop().await;
}

#[tokio::test]
async fn drained_streams_left_pinned_are_retired_so_the_doorbell_rings_again() {
    let schema = unique_schema("retire");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let mut conn = connect().await;
    let mut listener = sqlx::postgres::PgListener::connect(&database_url())
        .await
        .unwrap();
    let channel = format!("{schema}_work");
    listener.listen(&channel).await.unwrap();
    let insert =
        format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A')");
    let active = format!("SELECT count(*) FROM {schema}.wh_active_streams WHERE stream_id = $1");

    for how in ["deregister", "claim"] {
        let (owner, s) = (Uuid::now_v7(), Uuid::now_v7());
        sqlx::query(&format!(
            "SELECT {schema}.record_heartbeat($1, 't', 'h', 1)"
        ))
        .bind(owner)
        .execute(&mut conn)
        .await
        .unwrap();
        sqlx::query(&insert)
            .bind(s)
            .execute(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), listener.recv())
                .await
                .unwrap()
                .unwrap()
                .payload(),
            ""
        );
        let claimed: Vec<Uuid> = sqlx::query_scalar(&format!(
            "SELECT stream_id FROM {schema}.claim_work($1, 100, 30)"
        ))
        .bind(owner)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert!(claimed.contains(&s));
        // The owner applied and deleted the work but stopped before retiring the stream.
        sqlx::query(&format!(
            "DELETE FROM {schema}.wh_perspective_events WHERE stream_id = $1"
        ))
        .bind(s)
        .execute(&mut conn)
        .await
        .unwrap();
        match how {
            "deregister" => {
                sqlx::query(&format!("SELECT {schema}.deregister_instance($1)"))
                    .bind(owner)
                    .execute(&mut conn)
                    .await
                    .unwrap();
                assert_eq!(
                    tokio::time::timeout(Duration::from_secs(5), listener.recv())
                        .await
                        .unwrap()
                        .unwrap()
                        .payload(),
                    "orphan"
                );
            }
            _ => {
                let again: Vec<Uuid> = sqlx::query_scalar(&format!(
                    "SELECT stream_id FROM {schema}.claim_work($1, 100, 30)"
                ))
                .bind(owner)
                .fetch_all(&mut conn)
                .await
                .unwrap();
                assert!(
                    !again.contains(&s),
                    "a stream with nothing pending is not offered"
                );
            }
        }
        let n: i64 = sqlx::query_scalar(&active)
            .bind(s)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(n, 0, "{how}: the drained stream was retired");
        sqlx::query(&insert)
            .bind(s)
            .execute(&mut conn)
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("doorbell rings again")
            .unwrap();
        assert_eq!((n.channel(), n.payload()), (channel.as_str(), ""), "{how}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_replays_a_perspective_from_the_event_store_while_workers_run() {
    let schema = unique_schema("rebuild");
    let yaml = recording_yaml(&schema, FAST).replacen(
        "    handlers:",
        "    reset: DELETE FROM seen_p1 WHERE stream_id = :stream_id\n    handlers:",
        1,
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let streams: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 6, 2, 5).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    assert_exactly_once(&schema, 5).await;

    // Damage the model, then rebuild it from the store while the engine keeps running.
    let mut conn = connect().await;
    sqlx::query(&format!("UPDATE {schema}.seen_p1 SET versions = '{{42}}'"))
        .execute(&mut conn)
        .await
        .unwrap();
    let file = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&file, &yaml).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["rebuild", "--perspective", "p1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("rebuild of p1: 5 stream(s) reset and queued"),
        "{stdout}"
    );
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 5).await;

    // p2 has no reset: refused, naming the reason.
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["rebuild", "--perspective", "p2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no `reset`"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_notification_fires_once_per_event_after_every_perspective() {
    let schema = unique_schema("applied");
    let mut config = parse_config(&recording_yaml(&schema, FAST));
    config.worker.notify_applied = true;
    migrate_config(&config).await;
    let mut listener = sqlx::postgres::PgListener::connect(&database_url())
        .await
        .unwrap();
    listener.listen(&format!("{schema}_applied")).await.unwrap();
    let engine = RunningEngine::start(&config).await;
    let streams: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 4, 2, 3).await;
    let mut conn = connect().await;
    let mut seen = std::collections::HashSet::new();
    while seen.len() < 20 {
        let n = tokio::time::timeout(Duration::from_secs(20), listener.recv())
            .await
            .expect("all 20 notified")
            .unwrap();
        let id: Uuid = n.payload().parse().unwrap();
        assert!(seen.insert(id), "event {id} notified twice");
        // Read-your-writes: when the notification arrives, both perspectives show the event.
        let (stream, version): (Uuid, i64) = sqlx::query_as(&format!(
            "SELECT stream_id, stream_version FROM {schema}.wh_event_store WHERE event_id = $1"
        ))
        .bind(id)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        for p in ["p1", "p2"] {
            let versions: Vec<i64> = sqlx::query_scalar(&format!(
                "SELECT versions FROM {schema}.seen_{p} WHERE stream_id = $1"
            ))
            .bind(stream)
            .fetch_one(&mut conn)
            .await
            .unwrap();
            assert!(
                versions.contains(&version),
                "{p} has not applied {stream}@{version} yet"
            );
        }
    }
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 5).await;
}

/// `ordering: eventId`: an event that arrives after a newer one (by event id) rewinds the
/// stream — reset, then replay in event-id order — in the apply transaction; a commit-ordered
/// perspective of the same events keeps commit order and is never rewound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_event_rewinds_an_event_id_ordered_perspective() {
    let schema = unique_schema("rewind");
    let mut yaml = format!("schema: {schema}\nperspectives:\n");
    for (name, ordering) in [("by_id", "eventId"), ("by_commit", "commit")] {
        yaml.push_str(&format!(
            "  - name: {name}
    ordering: {ordering}
    setup: CREATE TABLE IF NOT EXISTS seen_{name} (stream_id uuid PRIMARY KEY, labels text[] NOT NULL)
    reset: DELETE FROM seen_{name} WHERE stream_id = :stream_id
    handlers:
      A: INSERT INTO seen_{name} AS s VALUES (:stream_id, ARRAY[:data->>'n']) ON CONFLICT (stream_id) DO UPDATE SET labels = s.labels || (:data->>'n')
"
        ));
    }
    yaml.push_str(FAST);
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let mut conn = connect().await;
    let stream = Uuid::now_v7();
    let other = Uuid::now_v7();
    // Event ids chosen so that their order differs from the order of appending.
    let id = |n: u32| Uuid::parse_str(&format!("00000000-0000-7000-8000-{n:012}")).unwrap();
    let append = |stream: Uuid, n: u32| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query(&format!(
                "INSERT INTO {schema}.wh_event_store (event_id, stream_id, event_type, event_data)
                 VALUES ($1, $2, 'A', jsonb_build_object('n', $3::text))"
            ))
            .bind(id(n))
            .bind(stream)
            .bind(n.to_string())
            .execute(&mut conn)
            .await
            .unwrap();
        }
    };
    let labels = |name: &'static str, stream: Uuid| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query_scalar::<_, Vec<String>>(&format!(
                "SELECT labels FROM {schema}.seen_{name} WHERE stream_id = $1"
            ))
            .bind(stream)
            .fetch_optional(&mut conn)
            .await
            .unwrap()
            .unwrap_or_default()
        }
    };
    let wait_labels = |name: &'static str, stream: Uuid, want: &'static [&'static str]| {
        let labels = &labels;
        async move {
            wait_until(
                &format!("{name} = {want:?}"),
                Duration::from_secs(30),
                || async { labels(name, stream).await == want },
            )
            .await
        }
    };

    append(stream, 10).await;
    append(stream, 30).await;
    append(other, 40).await;
    wait_labels("by_id", stream, &["10", "30"]).await;
    wait_labels("by_commit", stream, &["10", "30"]).await;
    assert_eq!(engine.metrics.rewinds.get(), 0);

    // 20 is older than 30, which was applied already: by_id rewinds, by_commit appends.
    append(stream, 20).await;
    wait_labels("by_id", stream, &["10", "20", "30"]).await;
    wait_labels("by_commit", stream, &["10", "30", "20"]).await;
    // A later event continues normally after the rewind, and other streams are untouched.
    append(stream, 50).await;
    wait_labels("by_id", stream, &["10", "20", "30", "50"]).await;
    wait_labels("by_commit", stream, &["10", "30", "20", "50"]).await;
    wait_labels("by_id", other, &["40"]).await;
    assert_eq!(engine.metrics.rewinds.get(), 1, "exactly one rewind");
    let trigger: Option<Uuid> = sqlx::query_scalar(&format!(
        "SELECT rewind_trigger_event_id FROM {schema}.wh_perspective_cursors
         WHERE stream_id = $1 AND perspective_name = 'by_id'"
    ))
    .bind(stream)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        trigger,
        Some(id(20)),
        "the cursor records what triggered the rewind"
    );
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;

    // eventId ordering without a reset is refused up front.
    let no_reset = yaml.replacen(
        "    reset: DELETE FROM seen_by_id WHERE stream_id = :stream_id\n",
        "",
        1,
    );
    let err = Config::from_yaml_str(&no_reset, "test.yaml").unwrap_err();
    assert!(
        err.to_string().contains("perspectives[0] (by_id).reset"),
        "{err}"
    );
}

fn without_receivers(stages: &Stages) -> std::collections::HashMap<Uuid, Vec<String>> {
    stages
        .iter()
        .map(|(e, s)| (*e, s.iter().map(|(_, st)| st.clone()).collect()))
        .collect()
}

type Stages = std::collections::HashMap<Uuid, Vec<(usize, String)>>;

/// Collects lifecycle hook events per event id as (receiver index, stage), each receiver in its
/// own order, until `n` events have `per_event` stages (`PostPerspective:<name>`,
/// `PostAllPerspectives`, `PostLifecycle`).
async fn collect_lifecycle(
    rxs: &mut [tokio::sync::broadcast::Receiver<HookEvent>],
    n: usize,
    per_event: usize,
) -> Stages {
    let mut stages: Stages = Default::default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while stages.values().filter(|s| s.len() >= per_event).count() < n {
        assert!(Instant::now() < deadline, "lifecycle stages: {stages:?}");
        for (index, rx) in rxs.iter_mut().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                let (event_id, stage) = match ev {
                    HookEvent::PostPerspective {
                        event_id,
                        perspective,
                        ..
                    } => (event_id, format!("PostPerspective:{perspective}")),
                    HookEvent::PostAllPerspectives { event_id, .. } => {
                        (event_id, "PostAllPerspectives".to_string())
                    }
                    HookEvent::PostLifecycle { event_id, .. } => {
                        (event_id, "PostLifecycle".to_string())
                    }
                    _ => continue,
                };
                stages.entry(event_id).or_default().push((index, stage));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stages
}

/// Lifecycle stages: with two instances and two perspectives, every event gets PostPerspective
/// once per perspective, then PostAllPerspectives then PostLifecycle exactly once, recorded in
/// `wh_lifecycle_completions`; events whose record was lost (a crash between apply and record)
/// fire again at startup (their perspectives are not applied again, so no PostPerspective).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_stages_fire_once_per_event_and_orphans_are_reconciled() {
    let schema = unique_schema("lifecycle");
    let mut config = parse_config(&recording_yaml(&schema, FAST));
    config.worker.notify_applied = true;
    migrate_config(&config).await;
    let a = RunningEngine::start(&config).await;
    let b = RunningEngine::start(&config).await;
    let mut rxs = vec![a.hooks.subscribe(), b.hooks.subscribe()];
    let streams: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 4, 2, 3).await;
    let ordered = collect_lifecycle(&mut rxs, 20, 4).await;
    let stages = without_receivers(&ordered);
    wait_drained(&schema, Duration::from_secs(30)).await;
    // Nothing more arrived for an event already complete.
    for rx in rxs.iter_mut() {
        while let Ok(ev) = rx.try_recv() {
            assert!(
                !matches!(
                    ev,
                    HookEvent::PostPerspective { .. }
                        | HookEvent::PostAllPerspectives { .. }
                        | HookEvent::PostLifecycle { .. }
                ),
                "a stage fired twice: {ev:?}"
            );
        }
    }
    assert_eq!(stages.len(), 20);
    for (event, s) in &stages {
        // Each receiver keeps its engine's order, and the two engines interleave: what must hold
        // is one PostPerspective per perspective, and PostAllPerspectives then PostLifecycle
        // after them.
        let mut perspectives: Vec<&str> = s
            .iter()
            .filter_map(|st| st.strip_prefix("PostPerspective:"))
            .collect();
        perspectives.sort();
        assert_eq!(perspectives, ["p1", "p2"], "event {event}: {s:?}");
        let rest: Vec<&str> = s
            .iter()
            .map(String::as_str)
            .filter(|st| !st.starts_with("PostPerspective:"))
            .collect();
        assert_eq!(
            rest,
            ["PostAllPerspectives", "PostLifecycle"],
            "event {event}"
        );
    }
    // In the order of the engine that fired them: its PostPerspective before the event's
    // PostAllPerspectives.
    for (event, s) in &ordered {
        let firing = s
            .iter()
            .find(|(_, st)| st == "PostAllPerspectives")
            .map(|(rx, _)| *rx)
            .unwrap();
        let own: Vec<&str> = s
            .iter()
            .filter(|(rx, _)| *rx == firing)
            .map(|(_, st)| st.as_str())
            .collect();
        assert!(own.len() >= 3, "event {event}: {s:?}");
        assert!(
            own[0].starts_with("PostPerspective:"),
            "event {event}: {s:?}"
        );
        assert_eq!(
            own[own.len() - 2..],
            ["PostAllPerspectives", "PostLifecycle"]
        );
    }
    // Recorded after PostLifecycle fired (the hook comes first).
    let recorded = format!("SELECT count(*) FROM {schema}.wh_lifecycle_completions");
    wait_until(
        "20 lifecycles recorded",
        Duration::from_secs(10),
        || async { scalar(&recorded).await == 20 },
    )
    .await;
    let mut conn = connect().await;
    a.stop().await;
    b.stop().await;

    // Lose 5 records, as if the worker had died right after applying: the next start fires
    // exactly those again.
    let lost: Vec<Uuid> = sqlx::query_scalar(&format!(
        "DELETE FROM {schema}.wh_lifecycle_completions
         WHERE event_id IN (SELECT event_id FROM {schema}.wh_lifecycle_completions ORDER BY event_id LIMIT 5)
         RETURNING event_id"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let options = perspective_worker::engine::EngineOptions::new(config.clone(), database_url());
    let mut rx = vec![options.hooks.subscribe()];
    let c = RunningEngine::start_with(options).await;
    let again = without_receivers(&collect_lifecycle(&mut rx, 5, 2).await);
    assert!(
        again
            .values()
            .all(|s| s == &["PostAllPerspectives", "PostLifecycle"]),
        "{again:?}"
    );
    let mut again_ids: Vec<Uuid> = again.keys().copied().collect();
    let mut lost_sorted = lost.clone();
    again_ids.sort();
    lost_sorted.sort();
    assert_eq!(again_ids, lost_sorted, "exactly the orphans fire again");
    let recorded: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_lifecycle_completions"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(recorded, 20);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_last_event_leaves_no_stream_failed_and_a_replay_clears_everything() {
    let schema = unique_schema("dlclear");
    let extra = "worker:
  maxPerspectiveEventAttempts: 2
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 100
claimWorker:
  pollingIntervalMilliseconds: 100
";
    let fixed = recording_yaml(&schema, extra);
    let broken = poisonable(&fixed, "p1");
    let config = parse_config(&broken);
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let stream = Uuid::now_v7();
    let mut conn = connect().await;
    // The stream's last event is the poison one: nothing after it clears the failure.
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         SELECT $1, 'A', CASE WHEN v = 3 THEN '{{\"poison\": \"yes\"}}'::jsonb ELSE '{{}}' END
         FROM generate_series(1, 3) v ORDER BY v"
    ))
    .bind(stream)
    .execute(&mut conn)
    .await
    .unwrap();
    let dead = format!("SELECT count(*) FROM {schema}.wh_dead_letters");
    wait_until("the dead letter", Duration::from_secs(30), || async {
        scalar(&dead).await == 1
    })
    .await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let names = ["p1".to_string(), "p2".to_string()];
    let status = perspective_worker::store::status::read_status(&mut conn, &schema, &names, 30.0)
        .await
        .unwrap();
    let p1 = &status.perspectives[0];
    assert_eq!(
        (p1.failed_streams, p1.dead_letters),
        (0, 1),
        "the failure is the dead letter's now, not a stream retrying"
    );

    // Fixed and replayed: nothing is left failing.
    let file = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&file, &fixed).unwrap();
    for args in [&["migrate"][..], &["dead-letters", "replay", "--all"][..]] {
        let out = worker_bin()
            .arg("--config")
            .arg(&file)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let status = perspective_worker::store::status::read_status(&mut conn, &schema, &names, 30.0)
        .await
        .unwrap();
    let p1 = &status.perspectives[0];
    assert_eq!((p1.failed_streams, p1.dead_letters), (0, 0));
    let versions: Vec<i64> = sqlx::query_scalar(&format!("SELECT versions FROM {schema}.seen_p1"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
}

/// The value of `name{perspective="…"}` in a /metrics text.
fn metric(text: &str, name: &str, perspective: &str) -> Option<f64> {
    let prefix = format!("{name}{{perspective=\"{perspective}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_seconds_is_the_age_of_the_oldest_unapplied_event() {
    let schema = unique_schema("lagsec");
    let yaml = poisonable(
        &recording_yaml(
            &schema,
            "worker:
  heartbeatIntervalSeconds: 1
  maxPerspectiveEventAttempts: 1000
  failureRetryBaseMilliseconds: 50
  failureRetryMaxMilliseconds: 100
claimWorker:
  pollingIntervalMilliseconds: 100
",
        ),
        "p1",
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let mut conn = connect().await;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         VALUES (gen_random_uuid(), 'A', '{{\"poison\": \"yes\"}}')"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    // p1 keeps failing on it (its row stays pending and ages); p2 applies it.
    wait_until(
        "p1's lag past 1.5 s and p2's at 0",
        Duration::from_secs(30),
        || async {
            let text = engine.metrics.render();
            metric(&text, "perspective_lag_seconds", "p1").is_some_and(|v| v >= 1.5)
                && metric(&text, "perspective_pending_events", "p1") == Some(1.0)
                && metric(&text, "perspective_lag_seconds", "p2") == Some(0.0)
        },
    )
    .await;
    engine.stop().await;
}

/// `hand_over_streams`: a stopping instance's streams go to its live peers by partition (the
/// claim's share), except those it keeps (being drained) and those another session has locked;
/// with no live peer they are released; the doorbell says 'orphan'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_over_streams_gives_held_streams_to_the_live_peers_by_partition() {
    let schema = unique_schema("handover_sql");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let mut conn = connect().await;
    let mut listener = sqlx::postgres::PgListener::connect(&database_url())
        .await
        .unwrap();
    listener.listen(&format!("{schema}_work")).await.unwrap();
    let (stopping, stale) = (Uuid::now_v7(), Uuid::now_v7());
    let mut peers = [Uuid::now_v7(), Uuid::now_v7()];
    peers.sort();
    for id in [stopping, stale, peers[0], peers[1]] {
        sqlx::query(&format!(
            "SELECT {schema}.record_heartbeat($1, 't', 'h', 1)"
        ))
        .bind(id)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    sqlx::query(&format!(
        "UPDATE {schema}.wh_service_instances SET last_heartbeat_at = now() - interval '1 hour'
         WHERE instance_id = $1"
    ))
    .bind(stale)
    .execute(&mut conn)
    .await
    .unwrap();
    let streams: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    for s in &streams {
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A')"
        ))
        .bind(s)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    sqlx::query(&format!(
        "UPDATE {schema}.wh_active_streams SET assigned_instance_id = $1"
    ))
    .bind(stopping)
    .execute(&mut conn)
    .await
    .unwrap();
    // One kept (being drained), one locked by another session (a settle, say).
    let (kept, locked) = (streams[0], streams[1]);
    let mut other = connect().await;
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {schema}.wh_active_streams WHERE stream_id = $1 FOR UPDATE"
    ))
    .bind(locked)
    .execute(&mut other)
    .await
    .unwrap();
    let hand_over = format!("SELECT {schema}.hand_over_streams($1, $2, 30)");
    let moved: i32 = sqlx::query_scalar(&hand_over)
        .bind(stopping)
        .bind(vec![kept])
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(moved, 38, "all but the kept and the locked stream");
    let rows: Vec<(Uuid, Option<Uuid>, i32)> = sqlx::query_as(&format!(
        "SELECT stream_id, assigned_instance_id, partition_number FROM {schema}.wh_active_streams"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    for (s, owner, partition) in rows {
        let expected = if s == kept || s == locked {
            stopping
        } else {
            peers[partition as usize % 2]
        };
        assert_eq!(owner, Some(expected), "stream {s} (partition {partition})");
    }
    // (The appends rang it with an empty payload first.)
    let orphan = async { while listener.recv().await.unwrap().payload() != "orphan" {} };
    tokio::time::timeout(Duration::from_secs(5), orphan)
        .await
        .expect("the doorbell rings with 'orphan'");
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();

    // With no live peer, the streams are released to nobody.
    sqlx::query(&format!(
        "DELETE FROM {schema}.wh_service_instances WHERE instance_id <> $1"
    ))
    .bind(stopping)
    .execute(&mut conn)
    .await
    .unwrap();
    let moved: i32 = sqlx::query_scalar(&hand_over)
        .bind(stopping)
        .bind(Vec::<Uuid>::new())
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(moved, 2, "the kept and the locked stream");
    let unowned: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_active_streams WHERE assigned_instance_id IS NULL"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(unowned, 2);
}

/// `hand_over_streams` retires the held streams with nothing pending rather than hand them over:
/// handed to nobody (no live peer), such a stream kept its active row, so the next event on it
/// rang no doorbell and waited for a claim's poll (seen as a flaky backfill test, whose stopped
/// engine's drained streams were retired or not as its settler happened to have reached them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_over_streams_retires_drained_streams_so_their_next_event_rings() {
    let schema = unique_schema("handover_idle");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let mut conn = connect().await;
    let stopping = Uuid::now_v7();
    sqlx::query(&format!(
        "SELECT {schema}.record_heartbeat($1, 't', 'h', 1)"
    ))
    .bind(stopping)
    .execute(&mut conn)
    .await
    .unwrap();
    let (drained, busy) = (Uuid::now_v7(), Uuid::now_v7());
    for s in [drained, busy] {
        append_event(&schema, s, None, serde_json::json!({})).await;
    }
    // One stream's work applied and deleted (as an Instant completion leaves it), both held.
    sqlx::raw_sql(&format!(
        "DELETE FROM {schema}.wh_perspective_events WHERE stream_id = '{drained}';
         UPDATE {schema}.wh_active_streams SET assigned_instance_id = '{stopping}';"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let moved: i32 = sqlx::query_scalar(&format!(
        "SELECT {schema}.hand_over_streams($1, '{{}}', 30)"
    ))
    .bind(stopping)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(moved, 1, "only the stream with pending work is handed over");
    let active: Vec<(Uuid, Option<Uuid>)> = sqlx::query_as(&format!(
        "SELECT stream_id, assigned_instance_id FROM {schema}.wh_active_streams"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        active,
        vec![(busy, None)],
        "the drained stream retired, the other released"
    );

    let mut listener = sqlx::postgres::PgListener::connect(&database_url())
        .await
        .unwrap();
    listener.listen(&format!("{schema}_work")).await.unwrap();
    append_event(&schema, drained, None, serde_json::json!({})).await;
    let rang = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    assert!(
        matches!(&rang, Ok(Ok(n)) if n.payload().is_empty()),
        "the producer rings for the retired stream's next event: {rang:?}"
    );
}

/// A stopping worker hands the streams it holds but is not draining to its live peer at once:
/// their events are applied while it still waits for an in-flight drain, not after it
/// deregisters (in a rolling update the new pod's worker otherwise waited for the old one's
/// whole stop). Here the old worker's only drain consumer is in a handler that sleeps past the
/// 5 s drain grace of a stop, so its stop takes 5 s; the peer must apply the other stream well
/// before that.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_worker_hands_the_streams_it_is_not_draining_to_a_live_peer_at_once() {
    let schema = unique_schema("handover");
    let yaml = recording_yaml(
        &schema,
        "worker:\n  maxConcurrentDrainConsumers: 1\n  drainConsumersPerDeployment: 1\n  failureRetryBaseMilliseconds: 20\n",
    )
    .replacen(
        "      A: INSERT INTO seen_p1",
        "      A: SELECT pg_sleep(h.secs) FROM hold h WHERE :data->>'hold' = 'yes'; INSERT INTO seen_p1",
        1,
    )
    .replacen(
        "versions bigint[] NOT NULL)\n",
        "versions bigint[] NOT NULL); CREATE TABLE IF NOT EXISTS hold (secs float8 NOT NULL)\n",
        1,
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    sqlx::query(&format!("INSERT INTO {schema}.hold VALUES (8)"))
        .execute(&mut conn)
        .await
        .unwrap();
    let old = RunningEngine::start(&config).await;
    let (stuck, idle) = (Uuid::now_v7(), Uuid::now_v7());
    append_event(&schema, stuck, None, serde_json::json!({"hold": "yes"})).await;
    let sleeping = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'
           AND query LIKE '%{schema}.wh_drain%'"
    );
    wait_until(
        "the old worker's drain sleeps in the handler",
        Duration::from_secs(10),
        || {
            let sql = sleeping.clone();
            async move { scalar(&sql).await == 1 }
        },
    )
    .await;
    append_event(&schema, idle, None, serde_json::json!({})).await;
    let held_by = format!(
        "SELECT count(*) FROM {schema}.wh_active_streams WHERE stream_id = '{idle}'
           AND assigned_instance_id = '{}'",
        old.instance_id
    );
    wait_until(
        "the old worker holds the second stream",
        Duration::from_secs(10),
        || {
            let sql = held_by.clone();
            async move { scalar(&sql).await == 1 }
        },
    )
    .await;
    let peer = RunningEngine::start(&config).await;
    let stopping = Instant::now();
    let old_stop = tokio::spawn(old.stop());
    let applied = format!("SELECT count(*) FROM {schema}.seen_p2 WHERE stream_id = '{idle}'");
    wait_until(
        "the peer applies the stream the old worker held but was not draining",
        Duration::from_secs(3),
        || {
            let sql = applied.clone();
            async move { scalar(&sql).await == 1 }
        },
    )
    .await;
    assert!(
        !old_stop.is_finished(),
        "applied while the old worker was still stopping (after {:?})",
        stopping.elapsed()
    );
    // The stop cancels the sleeping drain after its grace; the event's retry sleeps no more.
    sqlx::query(&format!("UPDATE {schema}.hold SET secs = 0"))
        .execute(&mut conn)
        .await
        .unwrap();
    old_stop.await.unwrap();
    wait_drained(&schema, Duration::from_secs(30)).await;
    peer.stop().await;
    assert_exactly_once(&schema, 2).await;
}

/// A stopping worker's in-flight `wh_drain` call takes no further pair once the stop has begun
/// (`hand_over_streams` marks the instance stopping): the pairs it has not reached go to a live
/// peer at once, rather than waiting for the whole call (a catch-up's calls, over deep streams,
/// run for hundreds of milliseconds). Here one call holds 12 deep streams whose p1 windows take
/// 100 ms each; the stop comes while the second is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_worker_takes_no_further_pair_in_its_drain_call() {
    let schema = unique_schema("stoppair");
    let yaml = recording_yaml(
        &schema,
        "worker:\n  perspectiveBatchSize: 10\n  maxConcurrentDrainConsumers: 1\n  drainConsumersPerDeployment: 1\n",
    )
    .replacen(
        "      A: INSERT INTO seen_p1",
        "      A: SELECT nextval('progress'), pg_sleep(0.01); INSERT INTO seen_p1",
        1,
    )
    .replacen(
        "versions bigint[] NOT NULL)\n",
        "versions bigint[] NOT NULL); CREATE SEQUENCE IF NOT EXISTS progress\n",
        1,
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let streams: Vec<Uuid> = (0..12).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 20, 1, 240).await;
    let engine = RunningEngine::start(&config).await;
    // (A sequence moves outside the transaction: the call's progress, before it commits.)
    let progress =
        format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {schema}.progress");
    wait_until(
        "the call is past its first p1 window",
        Duration::from_secs(30),
        || {
            let sql = progress.clone();
            async move { scalar(&sql).await >= 13 }
        },
    )
    .await;
    engine.stop().await;
    let reached = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_cursors
         WHERE perspective_name = 'p1' AND last_version > 0"
    ))
    .await;
    assert!(
        (1..=3).contains(&reached),
        "the stopping worker applied p1 on {reached} of 12 streams: pairs after the stop began"
    );
    let next = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    next.stop().await;
    assert_exactly_once(&schema, 12).await;
}

/// A stopping worker finishes the pass its batch is in, not the batch's further passes over a
/// deep stream (`drainLoopMaxIterations`): its stop would wait for them, and the stream it
/// holds goes to a live peer (or the next worker) once the pass is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_worker_takes_no_further_pass_over_a_deep_stream() {
    let schema = unique_schema("stoppass");
    let yaml = recording_yaml(&schema, "worker:\n  perspectiveBatchSize: 10\n").replacen(
        "      A: INSERT INTO seen_p1",
        "      A: SELECT pg_sleep(0.02); INSERT INTO seen_p1",
        1,
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let stream = Uuid::now_v7();
    append_load(&schema, &[stream], 200, 1, 200).await;
    let engine = RunningEngine::start(&config).await;
    let cursor = format!(
        "SELECT coalesce(max(last_version), 0) FROM {schema}.wh_perspective_cursors
         WHERE stream_id = '{stream}' AND perspective_name = 'p1'"
    );
    wait_until("the first pass is applied", Duration::from_secs(30), || {
        let sql = cursor.clone();
        async move { scalar(&sql).await >= 10 }
    })
    .await;
    // The second pass (10 events of 20 ms) is under way; the batch would take three more.
    engine.stop().await;
    let applied = scalar(&cursor).await;
    assert!(
        applied <= 20,
        "the stopping worker applied {applied} events: passes after the one under way"
    );
    let next = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    next.stop().await;
    assert_exactly_once(&schema, 1).await;
}

/// Claims only on doorbells (polls 60 s apart): nothing but the settler brings a hot stream
/// back to the drain.
const DOORBELLS_ONLY: &str = "claimWorker:
  pollingIntervalMilliseconds: 60000
  notifyHealthyPollingIntervalMilliseconds: 60000
  pollingMaxIntervalMilliseconds: 60000
";

/// A hot stream's producers find its active row and ring no doorbell, so each time the settler
/// cannot retire it (new work came) it hands it back to the drain. It did so after a growing
/// delay (10 ms, doubling, 8 times) and then left it to the claim loop's polls: a stream that
/// kept getting events stalled until the next poll (p99 0.2-1.1 s with 10 streams at 1 000
/// events/s). A stream whose drain applied events is now drained again at once. Here the test
/// appends the stream's next event as soon as an apply commits (told by a NOTIFY from a
/// trigger on `seen_p1`), before the settler looks, so every settle finds new work; all 40
/// events are applied within 20 s (the next poll is a minute away).
async fn a_hot_stream_keeps_up(
    strategy: perspective_worker::config::CompletionStrategy,
    runner: Runner,
) {
    const EVENTS: usize = 40;
    let schema = unique_schema("hot");
    let mut config = parse_config(&recording_yaml(&schema, DOORBELLS_ONLY));
    config.worker.completion_strategy = strategy;
    migrate_config(&config).await;
    let mut conn = connect().await;
    let channel = format!("{schema}_applied_p1");
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {schema}.tell_applied() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $$;
         CREATE TRIGGER tell_applied AFTER INSERT OR UPDATE ON {schema}.seen_p1
           FOR EACH ROW EXECUTE FUNCTION {schema}.tell_applied();"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let mut applies = sqlx::postgres::PgListener::connect(&database_url())
        .await
        .unwrap();
    applies.listen(&channel).await.unwrap();
    let engine = RunningEngine::start_with(engine_options(&config, runner)).await;
    let metrics = engine.metrics.clone();
    // (The first event's doorbell is the only way in.)
    wait_until("listening", Duration::from_secs(10), || async {
        metrics.listener_connected.get() == 1
    })
    .await;
    let stream = Uuid::now_v7();
    let append =
        format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A')");
    let deadline = Instant::now() + Duration::from_secs(20);
    for n in 1..=EVENTS {
        sqlx::query(&append)
            .bind(stream)
            .execute(&mut conn)
            .await
            .unwrap();
        let left = deadline.saturating_duration_since(Instant::now());
        let told = tokio::time::timeout(left, applies.recv()).await;
        assert!(
            matches!(told, Ok(Ok(_))),
            "event {n} of the hot stream applied within 20 s of the first"
        );
    }
    engine.stop().await;
    assert_exactly_once(&schema, 1).await;
    let p2 = format!("SELECT cardinality(versions)::bigint FROM {schema}.seen_p2");
    assert_eq!(scalar(&p2).await, EVENTS as i64, "p2 applied them all too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_stream_keeps_up_batched_sql() {
    a_hot_stream_keeps_up(
        perspective_worker::config::CompletionStrategy::Batched,
        Runner::Sql,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_stream_keeps_up_instant_rust() {
    a_hot_stream_keeps_up(
        perspective_worker::config::CompletionStrategy::Instant,
        Runner::Rust,
    )
    .await;
}
