//! Issue 12 ("Engine"): what the engine says and records is true — identities, lifecycle
//! stages, latencies, logs — and the event store stays append-only.

mod common;

use std::time::Duration;

use common::*;
use uuid::Uuid;

const FAST: &str = "worker:
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 200
  drainBatcher: { slidingWindowMilliseconds: 20, maxWaitMilliseconds: 200 }
claimWorker:
  pollingIntervalMilliseconds: 100
";

/// `perspective.user_id` and `perspective.tenant_id` (and `:user_id` / `:tenant_id`) come from
/// `metadata`, else `scope`, for both keys, and only from JSON strings.
#[tokio::test]
async fn identity_is_read_from_metadata_then_scope_and_only_from_strings() {
    let schema = unique_schema("identity");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: audit
    setup: CREATE TABLE IF NOT EXISTS audit (stream_version bigint, user_id text, tenant_id text, param_user text, param_tenant text)
    handlers:
      A: INSERT INTO audit VALUES (:stream_version, current_setting('perspective.user_id', true), current_setting('perspective.tenant_id', true), :user_id, :tenant_id)
{FAST}"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    let stream = Uuid::now_v7();
    // (metadata, scope) → expected (user, tenant); '' is "no identity".
    let cases: [(&str, &str, &str, &str); 5] = [
        (
            r#"{"user_id": "m-u", "tenant_id": "m-t"}"#,
            r#"{"user_id": "s-u", "tenant_id": "s-t"}"#,
            "m-u",
            "m-t",
        ),
        (
            r#"{}"#,
            r#"{"user_id": "s-u", "tenant_id": "s-t"}"#,
            "s-u",
            "s-t",
        ),
        (
            r#"{"user_id": {"id": "x"}, "tenant_id": ["m-t"]}"#,
            r#"{"user_id": "s-u"}"#,
            "s-u",
            "",
        ),
        (
            r#"{"user_id": 42, "tenant_id": true}"#,
            r#"{"tenant_id": {"a": 1}}"#,
            "",
            "",
        ),
        (
            r#"{"user_id": null}"#,
            r#"{"user_id": "s-u", "tenant_id": "s-t"}"#,
            "s-u",
            "s-t",
        ),
    ];
    for (metadata, scope, _, _) in &cases {
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type, metadata, scope)
             VALUES ($1, 'A', $2::jsonb, $3::jsonb)"
        ))
        .bind(stream)
        .bind(metadata)
        .bind(scope)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    type Row = (
        i64,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "SELECT stream_version, user_id, tenant_id, param_user, param_tenant FROM {schema}.audit ORDER BY 1"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(rows.len(), cases.len());
    for ((v, user, tenant, param_user, param_tenant), (m, s, want_user, want_tenant)) in
        rows.into_iter().zip(cases)
    {
        let none = |x: &str| (!x.is_empty()).then(|| x.to_string());
        assert_eq!(
            (
                user.unwrap_or_default().as_str(),
                tenant.unwrap_or_default().as_str()
            ),
            (want_user, want_tenant),
            "event {v}: metadata {m}, scope {s}"
        );
        assert_eq!(
            (param_user, param_tenant),
            (none(want_user), none(want_tenant)),
            "event {v}"
        );
    }
}

/// A rewind's `reset` runs under the identity of the event that triggered it, not under the
/// identity an earlier group of the same transaction (or nothing) left set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_resets_under_the_identity_of_the_triggering_event() {
    let schema = unique_schema("reset_identity");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: by_id
    ordering: eventId
    setup: |
      CREATE TABLE IF NOT EXISTS seen (stream_id uuid PRIMARY KEY, labels text[] NOT NULL);
      CREATE TABLE IF NOT EXISTS resets (stream_id uuid, user_id text, tenant_id text)
    reset: |
      DELETE FROM seen WHERE stream_id = :stream_id;
      INSERT INTO resets VALUES (:stream_id, current_setting('perspective.user_id', true), current_setting('perspective.tenant_id', true))
    handlers:
      A: INSERT INTO seen AS s VALUES (:stream_id, ARRAY[:data->>'n']) ON CONFLICT (stream_id) DO UPDATE SET labels = s.labels || (:data->>'n')
{FAST}"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    let id = |n: u32| Uuid::parse_str(&format!("00000000-0000-7000-8000-{n:012}")).unwrap();
    let stream = Uuid::now_v7();
    let append = |stream: Uuid, n: u32, user: &'static str, tenant: &'static str| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query(&format!(
                "INSERT INTO {schema}.wh_event_store (event_id, stream_id, event_type, event_data, metadata, scope)
                 VALUES ($1, $2, 'A', jsonb_build_object('n', $3::text), jsonb_build_object('user_id', $4::text),
                         jsonb_build_object('tenant_id', $5::text))"
            ))
            .bind(id(n))
            .bind(stream)
            .bind(n.to_string())
            .bind(user)
            .bind(tenant)
            .execute(&mut conn)
            .await
            .unwrap();
        }
    };
    append(stream, 10, "u-10", "t-10").await;
    append(stream, 30, "u-30", "t-30").await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    // While no worker runs: another stream's event (applied first in the same drain when the
    // batch holds both) and the late event 20 that rewinds `stream`.
    let other = Uuid::nil();
    append(other, 1, "u-other", "t-other").await;
    append(stream, 20, "u-20", "t-20").await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let labels: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT labels FROM {schema}.seen WHERE stream_id = $1"
    ))
    .bind(stream)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(labels, ["10", "20", "30"], "the stream was rewound");
    let resets: Vec<(Option<String>, Option<String>)> = sqlx::query_as(&format!(
        "SELECT user_id, tenant_id FROM {schema}.resets WHERE stream_id = $1"
    ))
    .bind(stream)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        resets,
        [(Some("u-20".to_string()), Some("t-20".to_string()))],
        "one reset, as the late event 20"
    );
}

/// `FAST` plus `worker` options (each line indented by two spaces).
fn fast_with(worker_lines: &str) -> String {
    FAST.replacen("worker:\n", &format!("worker:\n{worker_lines}"), 1)
}

/// Lifecycle stages seen on `rx` so far: (stage, event id).
fn drain_stages(
    rx: &mut tokio::sync::broadcast::Receiver<perspective_worker::engine::HookEvent>,
) -> Vec<(&'static str, Uuid)> {
    use perspective_worker::engine::HookEvent;
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            HookEvent::PostAllPerspectives { event_id, .. } => out.push(("all", event_id)),
            HookEvent::PostLifecycle { event_id, .. } => out.push(("lifecycle", event_id)),
            _ => {}
        }
    }
    out
}

async fn lifecycle_recorded(schema: &str, event: Uuid) -> bool {
    scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_lifecycle_completions WHERE event_id = '{event}'"
    ))
    .await
        == 1
}

/// An event dead-lettered by p1 (and applied by p2) is not "applied by every perspective": no
/// `<schema>_applied` NOTIFY, no PostAllPerspectives / PostLifecycle, not even from the orphan
/// reconciliation of a restart (p1's cursor has moved past it). Once its dead letter is
/// replayed, it is: the replay notifies, and the next start fires and records its stages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_event_is_not_applied_by_every_perspective_until_replayed() {
    let schema = unique_schema("dl_lifecycle");
    let extra = fast_with("  maxPerspectiveEventAttempts: 2\n  notifyApplied: true\n");
    let config = parse_config(&poisonable(&recording_yaml(&schema, &extra), "p1"));
    migrate_config(&config).await;
    let mut listener = sqlx::postgres::PgListener::connect(&database_url())
        .await
        .unwrap();
    listener.listen(&format!("{schema}_applied")).await.unwrap();
    let stream = Uuid::now_v7();
    let mut conn = connect().await;
    let ids: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT event_id FROM {schema}.append_events($1, 0, $2)"
    ))
    .bind(stream)
    .bind(serde_json::json!([
        {"event_type": "A", "event_data": {"poison": "yes"}},
        {"event_type": "A"}
    ]))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let (poison, good) = (ids[0], ids[1]);

    // Applied by p2, dead-lettered by p1, and the next event applied by both.
    let engine = RunningEngine::start(&config).await;
    let mut rx = engine.hooks.subscribe();
    wait_drained(&schema, Duration::from_secs(30)).await;
    wait_until(
        "the good event's lifecycle recorded",
        Duration::from_secs(30),
        || lifecycle_recorded(&schema, good),
    )
    .await;
    engine.stop().await;
    assert_eq!(
        scalar(&format!("SELECT count(*) FROM {schema}.wh_dead_letters")).await,
        1
    );
    // A restart reconciles orphans: the dead-lettered event must not be one.
    let engine = RunningEngine::start(&config).await;
    engine.stop().await;
    let stages = drain_stages(&mut rx);
    assert!(
        stages.iter().all(|(_, e)| *e != poison),
        "stages fired for the dead-lettered event: {stages:?}"
    );
    assert!(!lifecycle_recorded(&schema, poison).await);
    // What arrived (NOTIFYs are delivered at commit; both engines have stopped).
    let mut payloads = Vec::new();
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await {
        payloads.push(n.payload().to_string());
    }
    assert_eq!(
        payloads,
        [good.to_string()],
        "only the good event is announced"
    );

    // Fix the handler and replay: now it is applied by every perspective.
    let fixed = parse_config(&recording_yaml(&schema, &extra));
    migrate_config(&fixed).await;
    let id: i64 = sqlx::query_scalar(&format!(
        "SELECT dead_letter_id FROM {schema}.wh_dead_letters"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let runner = perspective_worker::engine::SqlRunner::new(&fixed);
    perspective_worker::admin::dead_letters::replay(&mut conn, &schema, &runner, id)
        .await
        .expect("replay");
    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a NOTIFY after the replay")
        .unwrap();
    assert_eq!(n.payload(), poison.to_string());
    let options = perspective_worker::engine::EngineOptions::new(fixed.clone(), database_url());
    let mut rx = options.hooks.subscribe();
    let engine = RunningEngine::start_with(options).await;
    engine.stop().await;
    assert_eq!(
        drain_stages(&mut rx),
        [("all", poison), ("lifecycle", poison)],
        "the replayed event's stages fire at the next start"
    );
    assert!(lifecycle_recorded(&schema, poison).await);
}

/// A hook subscriber that falls the channel's capacity behind: the events it cannot take are
/// dropped and counted (not evicted from under it), and lifecycle stages it did not get are not
/// recorded as done — the next start fires them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_stages_a_lagging_subscriber_missed_are_counted_and_not_recorded() {
    let schema = unique_schema("hook_drops");
    let config = parse_config(&recording_yaml(
        &schema,
        &fast_with("  notifyApplied: true\n"),
    ));
    migrate_config(&config).await;
    let mut options =
        perspective_worker::engine::EngineOptions::new(config.clone(), database_url());
    // Room for one event: the first one the engine emits (a claim poll, before any apply)
    // fills it for good, as the subscriber reads nothing.
    options.hooks = perspective_worker::engine::Hooks::with_capacity(1);
    let lagging = options.hooks.subscribe();
    let engine = RunningEngine::start_with(options).await;
    let hooks = engine.hooks.clone();
    let streams: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 2, 1, 2).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    let applied_by_both = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_cursors WHERE last_version = 2"
    ))
    .await;
    assert_eq!(applied_by_both, 6, "3 streams × 2 perspectives applied");
    // 6 events × (PostAllPerspectives + 2 PostPerspective) at least, all counted.
    let dropped = engine.metrics.hook_events_dropped.get();
    assert!(dropped >= 18, "{dropped} drops counted");
    assert!(hooks.dropped() >= dropped);
    assert!(engine
        .metrics
        .render()
        .contains("perspective_hook_events_dropped_total"),);
    engine.stop().await;
    drop(lagging);
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_lifecycle_completions"
        ))
        .await,
        0,
        "nothing the subscriber missed is recorded as done"
    );
    // The next start fires all 6 events' stages, to a subscriber that keeps up.
    let options = perspective_worker::engine::EngineOptions::new(config.clone(), database_url());
    let mut rx = options.hooks.subscribe();
    let engine = RunningEngine::start_with(options).await;
    engine.stop().await;
    assert_eq!(drain_stages(&mut rx).len(), 12);
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_lifecycle_completions"
        ))
        .await,
        6
    );
}

/// `perspective_apply_latency_seconds` gets one observation per event and perspective (not one
/// per group), each at least as old as the event's `created_at`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_latency_is_observed_once_per_event_from_its_created_at() {
    let schema = unique_schema("latency");
    let config = parse_config(&recording_yaml(&schema, FAST));
    migrate_config(&config).await;
    // Five events of one stream in one transaction: one group per perspective.
    let stream = Uuid::now_v7();
    append_load(&schema, &[stream], 5, 1, 5).await;
    let appended = std::time::Instant::now();
    // A deliberate age, so every observation has a known floor.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    let floor = appended
        .elapsed()
        .min(Duration::from_millis(300))
        .as_secs_f64();
    let latency = &engine.metrics.apply_latency;
    assert_eq!(latency.get_sample_count(), 10, "5 events × 2 perspectives");
    assert!(
        latency.get_sample_sum() >= 10.0 * floor,
        "sum {} below 10 × {floor}",
        latency.get_sample_sum()
    );
    engine.stop().await;
}

/// A schema whose store holds three events: one applied, one whose dead letter waits for a
/// replay (p1 fails it once and dead-letters it), one pending (appended after the engine stopped).
async fn retention_fixture(prefix: &str) -> (String, String, sqlx::PgConnection, Uuid, Uuid, Uuid) {
    let schema = unique_schema(prefix);
    let extra = fast_with("  maxPerspectiveEventAttempts: 1\n");
    let config = parse_config(&poisonable(&recording_yaml(&schema, &extra), "p1"));
    migrate_config(&config).await;
    let conn = connect().await;
    let append = format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data) VALUES ($1, 'A', $2) RETURNING event_id"
    );
    let event = |data: serde_json::Value| {
        let append = append.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query_scalar::<_, Uuid>(&append)
                .bind(Uuid::now_v7())
                .bind(data)
                .fetch_one(&mut conn)
                .await
                .unwrap()
        }
    };
    let applied = event(serde_json::json!({})).await;
    let poison = event(serde_json::json!({"poison": "yes"})).await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let pending = event(serde_json::json!({})).await;
    (schema, extra, conn, applied, poison, pending)
}

/// `wh_event_store` refuses DELETE and TRUNCATE (SQLSTATE WH405) like UPDATE; the retention
/// function deletes old events nothing needs any more, and keeps those with pending work or a
/// pending dead letter (a replay reads its event from the store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_store_refuses_delete_and_truncate_and_retention_keeps_what_is_needed() {
    let (schema, extra, mut conn, applied, poison, pending) = retention_fixture("retention").await;

    for statement in [
        format!("DELETE FROM {schema}.wh_event_store"),
        format!("DELETE FROM {schema}.wh_event_store WHERE event_id = '{applied}'"),
        format!("TRUNCATE {schema}.wh_event_store"),
        format!("TRUNCATE {schema}.wh_event_store CASCADE"),
        format!("UPDATE {schema}.wh_event_store SET event_type = 'B'"),
    ] {
        let err = sqlx::query(&statement)
            .execute(&mut conn)
            .await
            .unwrap_err();
        let db = err.as_database_error().expect("a database error");
        assert_eq!(db.code().as_deref(), Some("WH405"), "{statement}: {db}");
        assert!(db.message().contains("append-only"), "{statement}: {db}");
    }
    let count = format!("SELECT count(*) FROM {schema}.wh_event_store");
    assert_eq!(scalar(&count).await, 3, "nothing deleted");
    let deleted: i64 = sqlx::query_scalar(&format!(
        "SELECT {schema}.wh_delete_applied_events(interval '0')"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(deleted, 1);
    let left: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT event_id FROM {schema}.wh_event_store ORDER BY stream_version, event_id"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mut want = vec![poison, pending];
    want.sort();
    let mut left_sorted = left.clone();
    left_sorted.sort();
    assert_eq!(left_sorted, want, "the applied event went; the others stay");
    // The setting the retention function uses is not left set after it.
    assert!(sqlx::query(&format!("DELETE FROM {schema}.wh_event_store"))
        .execute(&mut conn)
        .await
        .is_err());
    // Younger than the age given: kept.
    let young: i64 = sqlx::query_scalar(&format!(
        "SELECT {schema}.wh_delete_applied_events(interval '1 hour')"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(young, 0);
    let err = sqlx::query(&format!(
        "SELECT {schema}.wh_delete_applied_events(interval '-1 day')"
    ))
    .execute(&mut conn)
    .await
    .unwrap_err();
    assert!(err.to_string().contains("non-negative"), "{err}");
    // The dead letter's event is still there to be replayed.
    let fixed = parse_config(&recording_yaml(&schema, &extra));
    migrate_config(&fixed).await;
    let id: i64 = sqlx::query_scalar(&format!(
        "SELECT dead_letter_id FROM {schema}.wh_dead_letters"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    perspective_worker::admin::dead_letters::replay(
        &mut conn,
        &schema,
        &perspective_worker::engine::SqlRunner::new(&fixed),
        id,
    )
    .await
    .expect("replay");
}

/// The span fields of a JSON log line, by span name.
fn spans(line: &serde_json::Value) -> std::collections::HashMap<String, serde_json::Value> {
    line.get("spans")
        .and_then(|s| s.as_array())
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s.get("name")?.as_str()?.to_string(), s.clone())))
        .collect()
}

/// A worker process's JSON logs follow one event: the drain batch (with the instance id) and,
/// inside it, each (stream, perspective) group with its versions and outcome — a failure, then
/// the dead letter for the perspective whose handler refuses it, applied for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_follow_one_event_through_its_batches_and_pairs() {
    let schema = unique_schema("spans");
    let extra = fast_with("  maxPerspectiveEventAttempts: 2\n");
    let yaml = poisonable(&recording_yaml(&schema, &extra), "p1");
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let dir = std::env::temp_dir();
    let config_path = dir.join(format!("{schema}.yaml"));
    std::fs::write(&config_path, &yaml).unwrap();
    let log_path = dir.join(format!("{schema}.log"));
    let instance = Uuid::now_v7();
    let mut worker = worker_bin()
        .arg("--config")
        .arg(&config_path)
        .args(["run", "--http-addr", "127.0.0.1:0"])
        .env("PERSPECTIVE_INSTANCE_ID", instance.to_string())
        .env("RUST_LOG", "warn,perspective_worker=debug")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .expect("spawn the worker");
    let stream = Uuid::now_v7();
    let mut conn = connect().await;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data) VALUES ($1, 'A', '{{\"poison\": \"yes\"}}')"
    ))
    .bind(stream)
    .execute(&mut conn)
    .await
    .unwrap();
    wait_drained(&schema, Duration::from_secs(30)).await;
    std::process::Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Some(s) = worker.try_wait().unwrap() {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the worker stops");
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(status.success(), "{status:?}: {log}");
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    // Per perspective, the outcomes of the pair (this stream, version 1), in log order.
    let mut outcomes: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for line in &lines {
        let spans = spans(line);
        let Some(pair) = spans.get("pair") else {
            continue;
        };
        if pair["stream"] != stream.to_string() {
            continue;
        }
        let batch = spans
            .get("drain_batch")
            .expect("a pair inside a drain batch");
        assert_eq!(batch["instance_id"], instance.to_string(), "{line}");
        assert_eq!(pair["first_version"], 1, "{line}");
        assert_eq!(pair["last_version"], 1, "{line}");
        if line["fields"]["message"] == "pair drained" {
            outcomes
                .entry(pair["perspective"].as_str().unwrap().to_string())
                .or_default()
                .push(pair["outcome"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(outcomes["p2"], ["applied"], "{log}");
    assert_eq!(
        outcomes["p1"],
        ["failed", "failed", "dead_lettered"],
        "{log}"
    );
    // The handler's failure is logged inside its pair's span.
    assert!(
        lines.iter().any(|l| l["level"] == "WARN"
            && spans(l)
                .get("pair")
                .is_some_and(|p| p["perspective"] == "p1")
            && l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("handler failed"))),
        "{log}"
    );
    let _ = std::fs::remove_file(&config_path);
    let _ = std::fs::remove_file(&log_path);
}

/// Issue 26, finding 5: the `perspective.retention` setting that wh_delete_applied_events sets
/// is no key to the store. A session that sets it itself still cannot delete an event whose
/// dead letter waits for a replay, or one with pending work (before the fix, both went).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_5_the_retention_setting_does_not_open_the_store() {
    let (schema, _, mut conn, applied, poison, pending) = retention_fixture("retset").await;
    for event in [poison, pending] {
        sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
        sqlx::raw_sql(&format!("SET LOCAL perspective.retention = '{schema}'"))
            .execute(&mut conn)
            .await
            .unwrap();
        let err = sqlx::query(&format!(
            "DELETE FROM {schema}.wh_event_store WHERE event_id = '{event}'"
        ))
        .execute(&mut conn)
        .await
        .unwrap_err();
        sqlx::raw_sql("ROLLBACK").execute(&mut conn).await.unwrap();
        let db = err.as_database_error().expect("a database error");
        assert_eq!(db.code().as_deref(), Some("WH405"), "{db}");
        assert!(
            db.message().contains(&event.to_string()) && db.message().contains("still needed"),
            "{db}"
        );
    }
    // An applied event nothing needs is what retention may delete, with or without the function.
    sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
    sqlx::raw_sql(&format!("SET LOCAL perspective.retention = '{schema}'"))
        .execute(&mut conn)
        .await
        .unwrap();
    let deleted = sqlx::query(&format!(
        "DELETE FROM {schema}.wh_event_store WHERE event_id = '{applied}'"
    ))
    .execute(&mut conn)
    .await
    .unwrap()
    .rows_affected();
    sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
    assert_eq!(deleted, 1);
    let left = scalar(&format!("SELECT count(*) FROM {schema}.wh_event_store")).await;
    assert_eq!(left, 2, "the needed events stay");
}
