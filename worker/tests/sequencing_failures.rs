//! Issue 24, DESIGN §12.2: in `key` and `serial` sequencing, failures stay isolated: a poison
//! event fails and is dead-lettered on its own pair (and replays), a custom runner is refused,
//! a killed worker loses and repeats nothing, and `migrate` refuses a `sequencingKey` that does
//! not compile. Each test of both modes runs once per mode (`<test>::key`, `<test>::serial`)
//! on perspective `agg` of [`sequenced_perspective`], whose handlers' probe records any two
//! transactions applying events of one key at once.

#[macro_use]
mod common;
/// The example Rust perspective: a custom runner.
#[path = "../../examples/stream_history_runner.rs"]
#[allow(dead_code)]
mod stream_history_runner;

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use perspective_worker::engine::HookEvent;
use perspective_worker::store::status::read_status;
use uuid::Uuid;

in_both_modes!(
    a_poison_event_fails_only_its_pair_and_is_dead_lettered_then_replayed,
    a_custom_runner_is_refused_naming_the_perspective_and_mode,
    a_killed_worker_loses_and_repeats_nothing,
);

/// `agg` of `mode` whose handler fails on events whose data has `"poison": "yes"` (a cast
/// error: an exception only for that event), beside `plain`, with `worker` options.
fn poisoned_yaml(schema: &str, mode: Sequenced, worker: &str) -> String {
    let agg = sequenced_perspective(schema, mode, "").replacen(
        "      A: >-\n",
        "      A: >-\n        SELECT (coalesce(:data->>'poison', '0'))::int;\n",
        1,
    );
    sequenced_yaml(schema, &[PLAIN_PERSPECTIVE, &agg], worker)
}

/// A poison event in one stream fails `agg` of that stream only: its attempts are counted with
/// backoff, then it is dead-lettered with its error and the stream goes on. Meanwhile other
/// streams, of the same key and of another, and `plain` of the same stream keep applying.
/// Fixed, the dead letter is replayed into the shared rows.
async fn a_poison_event_fails_only_its_pair_and_is_dead_lettered_then_replayed(mode: Sequenced) {
    let schema = unique_schema(&format!("dl_{}", mode.name()));
    // Two attempts 2 s apart: the other streams are applied well within them.
    let worker = "worker:
  maxPerspectiveEventAttempts: 2
  failureRetryBaseMilliseconds: 2000
  failureRetryMaxMilliseconds: 2000
  drainBatcher: { slidingWindowMilliseconds: 20, maxWaitMilliseconds: 200 }
claimWorker:
  pollingIntervalMilliseconds: 100
";
    let config = parse_config(&poisoned_yaml(&schema, mode, worker));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let mut hooks = engine.hooks.subscribe();
    let (bad, same, other) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    append_event(&schema, bad, None, serde_json::json!({"k": "x"})).await;
    append_event(
        &schema,
        bad,
        None,
        serde_json::json!({"k": "x", "poison": "yes"}),
    )
    .await;
    append_event(&schema, bad, None, serde_json::json!({"k": "x"})).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let error = loop {
        match tokio::time::timeout_at(deadline, hooks.recv())
            .await
            .expect("the poison event fails in time")
            .unwrap()
        {
            HookEvent::PerspectiveEventFailed {
                perspective,
                stream_id,
                error,
                ..
            } => {
                assert_eq!((perspective.as_str(), stream_id), ("agg", bad), "{error}");
                break error;
            }
            HookEvent::DeadLettered { .. } => panic!("dead-lettered before it failed"),
            _ => {}
        }
    };
    assert!(
        error.contains("invalid input syntax for type integer"),
        "{error}"
    );

    // While it waits for its second attempt, the others apply.
    for stream in [same, other] {
        let k = if stream == same { "x" } else { "y" };
        for _ in 0..3 {
            append_event(&schema, stream, None, serde_json::json!({"k": k})).await;
        }
    }
    let names = ["agg".to_string(), "plain".to_string()];
    let agg_status = || {
        let (schema, names) = (schema.clone(), names.clone());
        async move {
            let mut conn = connect().await;
            let status = read_status(&mut conn, &schema, &names, 30.0).await.unwrap();
            let agg = &status.perspectives[0];
            (agg.pending_events, agg.failed_streams, agg.dead_letters)
        }
    };
    // (Applied rows count as pending until their completion is flushed.)
    wait_until(
        "the other streams and plain applied, only bad's versions 2 and 3 pending",
        Duration::from_secs(30),
        || async {
            agg_seen(&schema, same).await.0 == [1, 2, 3]
                && agg_seen(&schema, other).await.0 == [1, 2, 3]
                && plain_seen(&schema, bad).await == [1, 2, 3]
                && agg_status().await.0 == 2
        },
    )
    .await;
    assert_eq!(
        agg_status().await,
        (2, 1, 0),
        "(pending, failed streams, dead letters) while the poison event waits for its second attempt"
    );
    assert_eq!(agg_seen(&schema, bad).await.0, [1]);

    // Then it is dead-lettered, and the stream goes on.
    wait_until(
        "agg applied bad's version 3",
        Duration::from_secs(30),
        || async { agg_seen(&schema, bad).await.0 == [1, 3] },
    )
    .await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let mut conn = connect().await;
    let letters: Vec<(i64, String, Uuid, i64, i32, String)> = sqlx::query_as(&format!(
        "SELECT dead_letter_id, perspective_name, stream_id, stream_version, attempts, error
         FROM {schema}.wh_dead_letters"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let (id, perspective, stream, version, attempts, error) = letters[0].clone();
    assert_eq!(
        (perspective.as_str(), stream, version, attempts),
        ("agg", bad, 2, 2)
    );
    assert!(
        error.contains("invalid input syntax for type integer"),
        "{error}"
    );
    assert_eq!(agg_status().await, (0, 0, 1));
    let rows = || {
        let sql = format!("SELECT array_agg(k || '=' || events ORDER BY k) FROM {schema}.agg_rows");
        async move {
            let mut conn = connect().await;
            sqlx::query_scalar::<_, Vec<String>>(&sql)
                .fetch_one(&mut conn)
                .await
                .unwrap()
        }
    };
    assert_eq!(rows().await, ["x=5", "y=3"]);
    assert_eq!(plain_seen(&schema, bad).await, [1, 2, 3]);
    assert_no_overlap(&schema).await;

    // The handler fixed, the dead letter is replayed: applied once, into the shared row.
    let fixed = parse_config(&sequenced_yaml(
        &schema,
        &[PLAIN_PERSPECTIVE, &sequenced_perspective(&schema, mode, "")],
        worker,
    ));
    migrate_config(&fixed).await;
    // A replay applies outside wh_drain, so it takes its event's key like any applier: while
    // another transaction holds that key, it waits (without it, it applied at once).
    let mut holder = connect().await;
    let slot = match mode {
        Sequenced::Key => format!("{schema}.wh_key_agg(e)"),
        Sequenced::Serial => "0".to_string(),
    };
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query(&format!(
        "SELECT pg_advisory_xact_lock(hashtext('{schema}.agg'), {slot})
         FROM {schema}.wh_event_store e WHERE e.stream_id = $1 AND e.stream_version = $2"
    ))
    .bind(bad)
    .bind(version)
    .execute(&mut holder)
    .await
    .unwrap();
    let replay = {
        let (schema, runner) = (
            schema.clone(),
            perspective_worker::engine::SqlRunner::new(&fixed),
        );
        tokio::spawn(async move {
            let mut conn = connect().await;
            perspective_worker::admin::dead_letters::replay(&mut conn, &schema, &runner, id).await
        })
    };
    let waiting = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
           AND wait_event = 'advisory' AND strpos(query, '{schema}.') > 0"
    );
    wait_until(
        "the replay waiting for its event's key",
        Duration::from_secs(10),
        || async { scalar(&waiting).await == 1 },
    )
    .await;
    assert_eq!(
        rows().await,
        ["x=5", "y=3"],
        "nothing applied while the key is held"
    );
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    replay.await.unwrap().expect("replay");
    let runner = perspective_worker::engine::SqlRunner::new(&fixed);
    assert_eq!(agg_seen(&schema, bad).await.0, [1, 3, 2]);
    assert_eq!(rows().await, ["x=6", "y=3"]);
    assert_eq!(agg_status().await, (0, 0, 0));
    let again =
        perspective_worker::admin::dead_letters::replay(&mut conn, &schema, &runner, id).await;
    assert!(
        matches!(
            again,
            Err(perspective_worker::admin::dead_letters::ReplayError::NotPending(_))
        ),
        "{again:?}"
    );
}

/// A custom runner applies stream by stream and cannot keep a key's events apart: the engine
/// refuses to start with one and a sequenced perspective, naming both; the compiled SQL
/// handlers, passed as the runner, start.
async fn a_custom_runner_is_refused_naming_the_perspective_and_mode(mode: Sequenced) {
    use perspective_worker::engine::{Engine, EngineError, EngineOptions};
    let schema = unique_schema(&format!("cr_{}", mode.name()));
    let agg = sequenced_perspective(&schema, mode, "");
    let config = parse_config(&sequenced_yaml(
        &schema,
        &[PLAIN_PERSPECTIVE, &agg],
        QUICK_OPTIONS,
    ));
    migrate_config(&config).await;
    let mut options = EngineOptions::new(config.clone(), database_url());
    options.runner = Some(Arc::new(stream_history_runner::StreamHistoryRunner::new(
        &schema, "seen_",
    )));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let err = match Engine::start(options, shutdown).await {
        Ok(_) => panic!("a custom runner started with a {} perspective", mode.name()),
        Err(e) => e,
    };
    let message = err.to_string();
    assert!(
        matches!(&err, EngineError::SequencingNeedsSqlHandlers { perspective, sequencing }
                 if perspective == "agg" && *sequencing == mode.name()),
        "{message}"
    );
    assert!(
        message.contains(&format!("perspective agg has sequencing: {}", mode.name()))
            && message.contains("custom runner"),
        "{message}"
    );
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_service_instances"
        ))
        .await,
        0,
        "refused before registering"
    );

    let mut options = EngineOptions::new(config.clone(), database_url());
    options.runner = Some(Arc::new(perspective_worker::engine::SqlRunner::new(
        &config,
    )));
    let engine = RunningEngine::start_with(options).await;
    let stream = Uuid::now_v7();
    append_event(&schema, stream, None, serde_json::json!({})).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_sequenced_exact(&schema, 1, true).await;
}

/// A worker process that a failing assertion must not leave running.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A worker process SIGKILLed in the middle of a sequenced backlog, beside an in-process
/// engine: what it applied and committed stays applied once, what it had in flight is rolled
/// back with its locks, and once it is found dead the other instance applies its streams.
/// Every stream exact and in order, the shared rows exact, no key applied twice at once.
async fn a_killed_worker_loses_and_repeats_nothing(mode: Sequenced) {
    let schema = unique_schema(&format!("kill_{}", mode.name()));
    // Each event of agg takes half a millisecond, so that a kill lands mid-work.
    let agg = sequenced_perspective(&schema, mode, "").replacen(
        "(:data->>'sleep')::float8, 0)",
        "(:data->>'sleep')::float8, 0.0005)",
        1,
    );
    let yaml = sequenced_yaml(
        &schema,
        &[PLAIN_PERSPECTIVE, &agg],
        "worker:
  abandonStaleInstanceThresholdSeconds: 3
  heartbeatIntervalSeconds: 1
  perspectiveBatchSize: 20
claimWorker:
  pollingIntervalMilliseconds: 100
",
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let path = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&path, &yaml).unwrap();
    let streams: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 30, 2, 40).await;

    let victim_id = Uuid::now_v7();
    let mut victim = KillOnDrop(
        worker_bin()
            .arg("--config")
            .arg(&path)
            .args(["run", "--http-addr", "127.0.0.1:0"])
            .env("PERSPECTIVE_INSTANCE_ID", victim_id.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the worker"),
    );
    // Kill it once agg has applied some of the backlog and the victim holds streams with agg's
    // work still to apply; the other instance starts once the victim holds its streams.
    let held = format!(
        "SELECT count(*) FROM {schema}.wh_perspective_events w
         JOIN {schema}.wh_active_streams a USING (stream_id)
         WHERE a.assigned_instance_id = '{victim_id}' AND w.perspective_name = 'agg'
           AND w.processed_at IS NULL"
    );
    let applied =
        format!("SELECT coalesce(sum(cardinality(versions)), 0)::int8 FROM {schema}.agg_seen");
    wait_until(
        "the victim holds streams",
        Duration::from_secs(30),
        || async { scalar(&held).await > 0 },
    )
    .await;
    let survivor = RunningEngine::start(&config).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "never reached the kill point");
        assert!(
            victim.0.try_wait().unwrap().is_none(),
            "the worker exited early"
        );
        if scalar(&held).await > 0 && scalar(&applied).await > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    victim.0.kill().unwrap(); // SIGKILL
    victim.0.wait().unwrap();
    let at_kill = scalar(&applied).await;
    assert!(
        at_kill < 1200,
        "killed mid-backlog ({at_kill} of agg's 1200 applied)"
    );

    wait_drained(&schema, Duration::from_secs(60)).await;
    survivor.stop().await;
    assert_sequenced_exact(&schema, 40, true).await;
    assert_eq!(
        scalar(&format!("SELECT count(*) FROM {schema}.wh_dead_letters")).await,
        0
    );
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_service_instances WHERE instance_id = '{victim_id}'"
        ))
        .await,
        0,
        "the killed instance was abandoned"
    );
}

/// `plain` and `agg`, `agg` sequenced by `key` (an SQL expression without `"`) and recording the versions it applied per
/// stream, with `worker` options.
fn keyed_yaml(schema: &str, key: &str, worker: &str) -> String {
    let agg = format!(
        "  - name: agg
    sequencing: key
    sequencingKey: \"{key}\"
    setup: CREATE TABLE IF NOT EXISTS agg_seen (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL)
    handlers:
      A: INSERT INTO agg_seen AS s VALUES (:stream_id, ARRAY[:stream_version]) ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version
"
    );
    sequenced_yaml(schema, &[PLAIN_PERSPECTIVE, &agg], worker)
}

/// `migrate` compiles a `sequencingKey` over the event store as `wh_drain` uses it, and refuses
/// one that does not compile, naming the field (`wh_drain` would compile it only when called,
/// and fail every call: nothing of the key's perspective would ever apply).
#[tokio::test]
async fn migrate_rejects_a_sequencing_key_that_does_not_compile() {
    let cases = [
        (
            "(:data->>'c') + 1",
            "operator does not exist: text + integer",
        ),
        (
            "lowerr(:data->>'c')",
            "function lowerr(text) does not exist",
        ),
        (":data->>'c' || nosuch", r#"column "nosuch" does not exist"#),
        (
            "jsonb_array_elements(:data)",
            "set-returning functions are not allowed in WHERE",
        ),
        (
            "count(:stream_id)",
            "aggregate functions are not allowed in WHERE",
        ),
        ("(:data->>'c'", "syntax error"),
    ];
    for (key, error) in cases {
        let schema = unique_schema("badkey");
        let path = std::env::temp_dir().join(format!("{schema}.yaml"));
        std::fs::write(&path, keyed_yaml(&schema, key, "")).unwrap();
        let out = worker_bin()
            .arg("--config")
            .arg(&path)
            .args(["migrate", "--dry-run"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{key}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "perspectives[1] (agg).sequencingKey: does not compile over the event store: {error}"
            )),
            "{key}: {stderr}"
        );
    }
    // Keys of every parameter, and of other types than text, compile.
    let schema = unique_schema("goodkey");
    let key = "(:data->>'c')::int + hashtext(:stream_id::text || :event_id::text || :stream_version || :event_type || :metadata::text || :scope::text || :created_at || :user_id || :tenant_id)";
    let config = parse_config(&keyed_yaml(&schema, key, ""));
    migrate_config(&config).await;
}

/// A `sequencingKey` that compiles but fails on one event (here a cast of its data) does not
/// stall anything: the key function gives such an event the empty key's lock, and it is applied
/// like any event (its handler, which does not use the key, succeeds), in its stream's order.
/// Before the key function, the error failed every sequenced `wh_drain` call that included the
/// stream ("wh_drain failed", nothing recorded): the stream and every stream drained with it
/// stalled for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_fails_on_one_event_stalls_nothing() {
    let schema = unique_schema("keyfail");
    let worker = "worker:
  maxPerspectiveEventAttempts: 2
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 100
claimWorker:
  pollingIntervalMilliseconds: 100
";
    let config = parse_config(&keyed_yaml(&schema, "(:data->>'c')::int", worker));
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let streams: Vec<Uuid> = (0..4).map(|_| Uuid::now_v7()).collect();
    let bad = streams[0];
    for (i, stream) in streams.iter().enumerate() {
        for v in 1..=3 {
            let c = if *stream == bad && v == 2 {
                "oops".into()
            } else {
                (i % 2).to_string()
            };
            append_event(&schema, *stream, None, serde_json::json!({ "c": c })).await;
        }
    }
    wait_until(
        "everything applied, the event whose key fails too",
        Duration::from_secs(30),
        || async {
            let mut ok = plain_seen(&schema, bad).await == [1, 2, 3];
            for s in &streams {
                ok &= agg_versions(&schema, *s).await == [1, 2, 3];
            }
            ok
        },
    )
    .await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let letters = scalar(&format!("SELECT count(*) FROM {schema}.wh_dead_letters")).await;
    assert_eq!(letters, 0, "dead letters");
}

/// The versions `agg` of [`keyed_yaml`] applied to `stream`.
async fn agg_versions(schema: &str, stream: Uuid) -> Vec<i64> {
    let mut conn = connect().await;
    sqlx::query_scalar(&format!(
        "SELECT versions FROM {schema}.agg_seen WHERE stream_id = $1"
    ))
    .bind(stream)
    .fetch_optional(&mut conn)
    .await
    .unwrap()
    .unwrap_or_default()
}
