//! Issue 24, DESIGN §12.2: in `key` and `serial` sequencing, a perspective's lifecycle still
//! works: rewind, backfill, rebuild, progress and removal. Each test runs once per mode
//! (`<test>::key`, `<test>::serial`) on perspective `agg` of [`sequenced_perspective`]: rows
//! shared by many streams, and a probe in its handlers that records any two transactions
//! applying events of one key at once. Failures, dead letters, custom runners and crashes:
//! `sequencing_failures.rs`.

#[macro_use]
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use perspective_worker::store::catchup::progress::Phase;
use perspective_worker::store::status::read_status;
use uuid::Uuid;

in_both_modes!(
    a_late_event_rewinds_and_replays_under_the_keys_locks,
    a_new_perspective_is_backfilled_exactly_once_in_order,
    a_version_bump_rebuilds_it_exactly,
    status_and_metrics_report_its_progress_until_caught_up,
    removing_it_leaves_no_work_and_the_worker_idles,
);

/// Whether some session holds the probe's advisory lock of key `k` (see
/// [`sequenced_perspective`]): an event of that key is being applied. Read from `pg_locks`
/// (taking the lock to find out would disturb the probe).
async fn probe_held(schema: &str, mode: Sequenced, k: &str) -> bool {
    let slot = match mode {
        Sequenced::Key => format!("hashtext('{k}')"),
        Sequenced::Serial => "0".into(),
    };
    // An advisory lock on two int4 keys is (classid, objid) = the keys as unsigned, objsubid 2.
    scalar(&format!(
        "SELECT count(*) FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND objsubid = 2
           AND classid::int8 = (hashtext('probe {schema}')::int8 + 4294967296) % 4294967296
           AND objid::int8 = ({slot}::int8 + 4294967296) % 4294967296"
    ))
    .await
        > 0
}

/// `ordering: eventId`: an event older (by id) than one applied rewinds its stream (reset, then
/// replay in event-id order). The replay applies the stream's earlier events again, of other
/// keys too: while another applier is in the middle of an event of one of those keys (here a
/// slow one, in another stream), the rewind must wait for it, not apply its key alongside.
async fn a_late_event_rewinds_and_replays_under_the_keys_locks(mode: Sequenced) {
    let schema = unique_schema(&format!("rw_{}", mode.name()));
    // agg alone: the drain calls apply every perspective (no stream-sequenced one to split off).
    let yaml = sequenced_yaml(
        &schema,
        &[&sequenced_perspective(
            &schema,
            mode,
            "    ordering: eventId\n",
        )],
        QUICK_OPTIONS,
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let engines = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];
    let stream = Uuid::now_v7();
    let slow = Uuid::now_v7();
    // Event ids chosen so that their order differs from the order of appending.
    let id = |n: u32| Uuid::parse_str(&format!("00000000-0000-7000-8000-{n:012}")).unwrap();
    let event = |n: u32, k: &str| serde_json::json!({"n": n.to_string(), "k": k});
    let labels = |want: &'static [&'static str]| {
        let schema = schema.clone();
        async move {
            wait_until(
                &format!("agg labels {want:?}"),
                Duration::from_secs(30),
                || async { agg_seen(&schema, stream).await.2 == want },
            )
            .await
        }
    };

    append_event(&schema, stream, Some(id(10)), event(10, "a")).await;
    append_event(&schema, stream, Some(id(30)), event(30, "b")).await;
    labels(&["10", "30"]).await;

    // Another stream's event of key b takes a second to apply; while it does, 20 arrives: older
    // than 30, so the stream rewinds and replays 10 (a), 20 (a) and 30 (b).
    let mut slow_event = event(99, "b");
    slow_event["sleep"] = serde_json::json!(1.0);
    append_event(&schema, slow, Some(id(99)), slow_event).await;
    wait_until(
        "the slow event of key b is being applied",
        Duration::from_secs(30),
        || probe_held(&schema, mode, "b"),
    )
    .await;
    append_event(&schema, stream, Some(id(20)), event(20, "a")).await;
    assert!(
        probe_held(&schema, mode, "b").await,
        "the late event arrived while the slow one was being applied (a second)"
    );
    labels(&["10", "20", "30"]).await;
    // A later event continues normally after the rewind.
    append_event(&schema, stream, Some(id(50)), event(50, "b")).await;
    labels(&["10", "20", "30", "50"]).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    let rewinds: u64 = engines.iter().map(|e| e.metrics.rewinds.get()).sum();
    for e in engines {
        e.stop().await;
    }
    assert_eq!(rewinds, 1, "exactly one rewind");
    let trigger: Option<Uuid> = {
        let mut conn = connect().await;
        sqlx::query_scalar(&format!(
            "SELECT rewind_trigger_event_id FROM {schema}.wh_perspective_cursors
             WHERE stream_id = $1 AND perspective_name = 'agg'"
        ))
        .bind(stream)
        .fetch_one(&mut conn)
        .await
        .unwrap()
    };
    assert_eq!(trigger, Some(id(20)), "the cursor records the trigger");
    // The reset took the stream's share out of the shared rows: a = 10, 20; b = 30, 99, 50.
    assert_eq!(
        agg_seen(&schema, stream).await.1,
        ["a", "a", "b", "b"],
        "keys in event-id order"
    );
    assert_sequenced_exact_in(&schema, 2, false, "e.event_id").await;
}

/// Wait (a minute at most) until the schema's perspective jobs (backfills, rebuilds) are done.
async fn wait_jobs_done(schema: &str) {
    let left = format!("SELECT count(*) FROM {schema}.wh_perspective_jobs WHERE state <> 'done'");
    wait_until("the jobs are done", Duration::from_secs(60), || async {
        scalar(&left).await == 0
    })
    .await;
}

/// A sequenced perspective added to a deployment with history is backfilled by two instances
/// while producers append: the history and the live events exactly once, each stream in order,
/// the shared rows exact, no key applied by two transactions at once; `plain`, which applied
/// the history before, applies none of it again.
async fn a_new_perspective_is_backfilled_exactly_once_in_order(mode: Sequenced) {
    let schema = unique_schema(&format!("bf_{}", mode.name()));
    let plain_only = parse_config(&sequenced_yaml(
        &schema,
        &[PLAIN_PERSPECTIVE],
        QUICK_OPTIONS,
    ));
    migrate_config(&plain_only).await;
    let streams: Vec<Uuid> = (0..60).map(|_| Uuid::now_v7()).collect();
    let engine = RunningEngine::start(&plain_only).await;
    append_load(&schema, &streams, 10, 2, 30).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;

    // agg joins: migrate starts its backfill.
    let agg = sequenced_perspective(&schema, mode, "");
    let config = parse_config(&sequenced_yaml(
        &schema,
        &[PLAIN_PERSPECTIVE, &agg],
        QUICK_OPTIONS,
    ));
    let mut conn = connect().await;
    let report = perspective_worker::admin::migrate::migrate(
        &mut conn,
        &config,
        "t.yaml",
        Default::default(),
    )
    .await
    .expect("migrate");
    assert_eq!(report.backfills, ["agg"]);
    let names = ["agg".to_string(), "plain".to_string()];
    let status = read_status(&mut conn, &schema, &names, 30.0).await.unwrap();
    assert_eq!(status.perspectives[0].phase, Phase::Backfilling);

    let stop = Arc::new(AtomicBool::new(false));
    let appenders = producers(&schema, &streams, stop.clone());
    let engines = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];
    wait_jobs_done(&schema).await;
    stop.store(true, Ordering::Relaxed);
    let mut appended = 0;
    for a in appenders {
        appended += a.await.unwrap();
    }
    assert!(appended > 0, "events were appended during the backfill");
    wait_drained(&schema, Duration::from_secs(60)).await;
    for e in engines {
        e.stop().await;
    }
    assert_sequenced_exact(&schema, 60, true).await;
    let status = read_status(&mut conn, &schema, &names, 30.0).await.unwrap();
    assert!(
        status
            .perspectives
            .iter()
            .all(|p| p.phase == Phase::Live && p.progress.is_none() && p.dead_letters == 0),
        "{status:?}"
    );
}

/// `version: 2` rebuilds a sequenced perspective online, by two instances while producers
/// append: each stream's share is taken out of the shared rows (`reset`) and its history
/// replayed, so the damaged per-stream records are whole again, the shared rows still exact,
/// and no key applied by two transactions at once.
async fn a_version_bump_rebuilds_it_exactly(mode: Sequenced) {
    let schema = unique_schema(&format!("rb_{}", mode.name()));
    let yaml = |version: &str| {
        let agg = sequenced_perspective(&schema, mode, version);
        sequenced_yaml(&schema, &[PLAIN_PERSPECTIVE, &agg], QUICK_OPTIONS)
    };
    let config = parse_config(&yaml(""));
    migrate_config(&config).await;
    let streams: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    let engine = RunningEngine::start(&config).await;
    append_load(&schema, &streams, 10, 2, 20).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    assert_sequenced_exact(&schema, 40, true).await;
    // Damage what each stream recorded (not its keys, which the reset needs): only a rebuild
    // puts it right.
    let mut conn = connect().await;
    sqlx::query(&format!("UPDATE {schema}.agg_seen SET versions = '{{42}}'"))
        .execute(&mut conn)
        .await
        .unwrap();

    let config = parse_config(&yaml("    version: 2\n"));
    let report = perspective_worker::admin::migrate::migrate(
        &mut conn,
        &config,
        "t.yaml",
        Default::default(),
    )
    .await
    .expect("migrate");
    let rebuilds: Vec<_> = report
        .rebuilds
        .iter()
        .map(|r| (r.perspective.as_str(), r.from, r.to))
        .collect();
    assert_eq!(rebuilds, [("agg", 1, 2)]);
    let stop = Arc::new(AtomicBool::new(false));
    let appenders = producers(&schema, &streams, stop.clone());
    let engines = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];
    wait_jobs_done(&schema).await;
    stop.store(true, Ordering::Relaxed);
    for a in appenders {
        a.await.unwrap();
    }
    wait_drained(&schema, Duration::from_secs(60)).await;
    for e in engines {
        e.stop().await;
    }
    assert_sequenced_exact(&schema, 40, true).await;
}

/// A value of the engine's /metrics, e.g. `perspective_pending_events{perspective="agg"}`.
fn metric(engine: &RunningEngine, series: &str) -> Option<f64> {
    engine.metrics.render().lines().find_map(|line| {
        line.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
    })
}

/// `perspective-worker status --json` of `config`: pending events per perspective.
fn cli_pending(schema: &str, yaml: &str) -> Vec<(String, i64)> {
    let path = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&path)
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    status["perspectives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["pendingEvents"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// Status (`status --json`, the store's status) and /metrics show a sequenced perspective's
/// backlog and lag while its appliers are held up (here: by a session holding every lock of its
/// sequencing, as a long apply of the same keys would), the stream-sequenced one beside it
/// caught up; and both caught up, with every event counted, once it is released.
async fn status_and_metrics_report_its_progress_until_caught_up(mode: Sequenced) {
    let schema = unique_schema(&format!("pg_{}", mode.name()));
    let yaml = sequenced_yaml(
        &schema,
        &[PLAIN_PERSPECTIVE, &sequenced_perspective(&schema, mode, "")],
        &QUICK_OPTIONS.replacen("worker:\n", "worker:\n  heartbeatIntervalSeconds: 1\n", 1),
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    // Every lock of agg's sequencing (compile/sequencing.rs: the class names the perspective,
    // the slot is 0 for serial, one of KEY_LOCK_SLOTS = 64 for a key), held by a session.
    let mut holder = connect().await;
    sqlx::query(&format!(
        "SELECT pg_advisory_lock(hashtext('{schema}.agg'), s) FROM generate_series(0, 63) s"
    ))
    .execute(&mut holder)
    .await
    .unwrap();
    let streams: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 4, 2, 20).await;
    let pending =
        |agg: i64, plain: i64| vec![("agg".to_string(), agg), ("plain".to_string(), plain)];
    assert_eq!(cli_pending(&schema, &yaml), pending(120, 120));

    let engine = RunningEngine::start(&config).await;
    wait_until(
        "/metrics: agg's 120 events pending, plain's none",
        Duration::from_secs(30),
        || async {
            metric(&engine, r#"perspective_pending_events{perspective="agg"}"#) == Some(120.0)
                && metric(
                    &engine,
                    r#"perspective_pending_events{perspective="plain"}"#,
                ) == Some(0.0)
        },
    )
    .await;
    let lag = metric(&engine, r#"perspective_lag_seconds{perspective="agg"}"#).unwrap();
    assert!(lag > 0.0, "agg's lag {lag}");
    // Held up, not failing: its pairs are busy (retried), not lock conflicts.
    let waits = metric(
        &engine,
        r#"perspective_sequencing_waits_total{perspective="agg"}"#,
    );
    assert!(waits.unwrap_or(0.0) > 0.0, "sequencing waits {waits:?}");
    assert_eq!(cli_pending(&schema, &yaml), pending(120, 0));
    let mut conn = connect().await;
    let names = ["agg".to_string(), "plain".to_string()];
    let status = read_status(&mut conn, &schema, &names, 30.0).await.unwrap();
    let agg = &status.perspectives[0];
    assert_eq!(
        (
            agg.pending_events,
            agg.failed_streams,
            agg.dead_letters,
            agg.lock_conflicts_per_minute
        ),
        (120, 0, 0, 0)
    );
    assert!(agg.oldest_pending_seconds.unwrap() > 0.0, "{agg:?}");
    assert_eq!(agg.phase, Phase::Live);
    assert_eq!(status.active_streams, 30);

    // Released, it catches up.
    sqlx::Connection::close(holder).await.unwrap();
    wait_until(
        "/metrics: caught up, every event of agg counted",
        Duration::from_secs(30),
        || async {
            metric(&engine, r#"perspective_pending_events{perspective="agg"}"#) == Some(0.0)
                && metric(&engine, r#"perspective_lag_seconds{perspective="agg"}"#) == Some(0.0)
        },
    )
    .await;
    assert_eq!(
        metric(
            &engine,
            r#"perspective_events_processed_total{perspective="agg"}"#
        ),
        Some(120.0)
    );
    engine.stop().await;
    assert_eq!(cli_pending(&schema, &yaml), pending(0, 0));
    let status = read_status(&mut conn, &schema, &names, 30.0).await.unwrap();
    assert!(
        status.perspectives.iter().all(|p| p.pending_events == 0
            && p.oldest_pending_seconds.is_none()
            && p.failed_streams == 0),
        "{status:?}"
    );
    assert_sequenced_exact(&schema, 30, true).await;
}

/// The definition of `schema.wh_drain`, as the server prints it.
async fn drain_function(schema: &str) -> String {
    let mut conn = connect().await;
    sqlx::query_scalar(&format!(
        "SELECT pg_get_functiondef('{schema}.wh_drain'::regproc)"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap()
}

/// A sequenced perspective removed from the config with work pending: `migrate` deletes its
/// work and cursors, drops its apply function and recompiles `wh_drain` without its locks; the
/// worker then applies the rest, unpins the streams and idles. Its tables are kept.
async fn removing_it_leaves_no_work_and_the_worker_idles(mode: Sequenced) {
    let schema = unique_schema(&format!("rm_{}", mode.name()));
    let agg = sequenced_perspective(&schema, mode, "");
    let options = format!("{QUICK_OPTIONS}  notifyHealthyPollingIntervalMilliseconds: 100\n");
    let config = parse_config(&sequenced_yaml(
        &schema,
        &[PLAIN_PERSPECTIVE, &agg],
        &options,
    ));
    migrate_config(&config).await;
    let streams: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
    let engine = RunningEngine::start(&config).await;
    append_load(&schema, &streams, 3, 1, 10).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    append_load(&schema, &streams, 2, 1, 10).await;
    let lock = format!("hashtext('{schema}.agg')");
    assert!(drain_function(&schema).await.contains(&lock));

    let plain_yaml = sequenced_yaml(&schema, &[PLAIN_PERSPECTIVE], &options);
    let path = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&path, &plain_yaml).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&path)
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
            "removed perspective agg (no longer in the config): 20 pending work row(s) and 10 cursor(s) deleted; its tables are yours and were kept"
        ),
        "{stdout}"
    );
    let left: (i64, i64, i64, bool, bool) = {
        let mut conn = connect().await;
        sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {schema}.wh_perspective_events WHERE perspective_name = 'agg'),
                    (SELECT count(*) FROM {schema}.wh_perspective_cursors WHERE perspective_name = 'agg'),
                    (SELECT count(*) FROM {schema}.wh_perspectives WHERE perspective_name = 'agg'),
                    to_regproc('{schema}.wh_apply_agg') IS NULL,
                    to_regclass('{schema}.agg_rows') IS NOT NULL"
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap()
    };
    assert_eq!(
        left,
        (0, 0, 0, true, true),
        "work, cursors, record, function gone; tables kept"
    );
    let drain = drain_function(&schema).await;
    assert!(
        !drain.contains(&lock) && !drain.contains("pg_advisory_xact_lock"),
        "wh_drain still takes agg's locks: {drain}"
    );

    let engine = RunningEngine::start(&parse_config(&plain_yaml)).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    wait_until("no stream pinned", Duration::from_secs(30), || async {
        scalar(&format!("SELECT count(*) FROM {schema}.wh_active_streams")).await == 0
    })
    .await;
    wait_until("the worker idles", Duration::from_secs(30), || async {
        engine.hooks.is_idle()
    })
    .await;
    engine.stop().await;
    let (plain_ok, agg_kept): (i64, i64) = {
        let mut conn = connect().await;
        sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {schema}.plain_seen WHERE versions = '{{1,2,3,4,5}}'),
                    (SELECT count(*) FROM {schema}.agg_seen WHERE versions = '{{1,2,3}}')"
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap()
    };
    assert_eq!(
        (plain_ok, agg_kept),
        (10, 10),
        "plain applied all, agg's model kept as it was"
    );
}
