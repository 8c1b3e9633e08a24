//! Perspective jobs (issue 10): a perspective added to a schema with history is backfilled, one
//! whose `version` changes is rebuilt online, both exactly once and in order per stream, by
//! several instances, through a SIGKILL, with producers appending throughout; and `migrate`
//! says what it started and what it could not do.

mod common;
/// The example Rust perspective: a backfill through a custom runner's fetch path.
#[path = "../../examples/stream_history_runner.rs"]
#[allow(dead_code)]
mod stream_history_runner;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use perspective_worker::store::catchup::progress::Phase;
use perspective_worker::store::status::read_status;
use uuid::Uuid;

const FAST: &str = "worker:
  abandonStaleInstanceThresholdSeconds: 3
  heartbeatIntervalSeconds: 1
claimWorker:
  pollingIntervalMilliseconds: 100
";

/// (p1 only, p1 and p2) configs of the recording perspectives; p2's handler of A takes a little
/// time, so a backfill of it lasts long enough to be watched and interrupted.
fn configs(schema: &str) -> (String, String) {
    let both = recording_yaml(schema, "").replacen(
        "      A: INSERT INTO seen_p2",
        "      A: SELECT pg_sleep(0.002); INSERT INTO seen_p2",
        1,
    );
    let p1_only = both[..both.find("  - name: p2").unwrap()].to_string();
    (p1_only + FAST, both + FAST)
}

/// A worker process that a failing assertion must not leave running.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Wait (two minutes at most) until the schema's jobs are done.
async fn wait_jobs_done(schema: &str) {
    wait_until("the jobs are done", Duration::from_secs(120), || async {
        jobs_left(schema).await == 0
    })
    .await;
}

async fn jobs_left(schema: &str) -> i64 {
    scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_jobs WHERE state <> 'done'"
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_perspective_is_backfilled_by_three_instances_while_producers_append() {
    let schema = unique_schema("backfill");
    let (p1_only, both) = configs(&schema);
    let first = parse_config(&p1_only);
    migrate_config(&first).await;
    let streams: Vec<Uuid> = (0..200).map(|_| Uuid::now_v7()).collect();
    // The deployment has run for a while: p1 applied 200 streams x 50 events.
    let engine = RunningEngine::start(&first).await;
    append_load(&schema, &streams, 50, 4, 50).await;
    wait_drained(&schema, Duration::from_secs(120)).await;
    engine.stop().await;
    let p1_applied_before = scalar(&format!(
        "SELECT sum(cardinality(versions))::int8 FROM {schema}.seen_p1"
    ))
    .await;
    assert_eq!(p1_applied_before, 10_000);

    // p2 joins: migrate starts its backfill.
    let config = parse_config(&both);
    let mut conn = connect().await;
    let report = perspective_worker::admin::migrate::migrate(
        &mut conn,
        &config,
        "both.yaml",
        Default::default(),
    )
    .await
    .expect("migrate");
    assert_eq!(report.backfills, vec!["p2".to_string()]);
    assert!(report.rebuilds.is_empty() && report.warnings.is_empty());
    let status = read_status(&mut conn, &schema, &["p1".into(), "p2".into()], 30.0)
        .await
        .unwrap();
    assert_eq!(status.perspectives[0].phase, Phase::Live);
    assert_eq!(status.perspectives[1].phase, Phase::Backfilling);

    // Three instances share the backfill while producers keep appending.
    let stop = Arc::new(AtomicBool::new(false));
    let appenders = producers(&schema, &streams, stop.clone());
    let engines = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];

    // While it runs, status and /metrics show the phase and the progress.
    let mut seen_progress = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while jobs_left(&schema).await > 0 {
        assert!(Instant::now() < deadline, "the backfill never finished");
        let status = read_status(&mut conn, &schema, &["p1".into(), "p2".into()], 30.0)
            .await
            .unwrap();
        let p2 = &status.perspectives[1];
        if let Some(progress) = &p2.progress {
            if progress.step != "waiting" && progress.percent < 100.0 && progress.events_total > 0 {
                assert_eq!(p2.phase, Phase::Backfilling);
                assert_eq!(progress.streams_total, 200);
                assert!(progress.events_total >= 10_000, "{progress:?}");
                assert!(progress.events_remaining > 0, "{progress:?}");
                let metrics = engines[0].metrics.render();
                if metrics.contains(r#"perspective_phase{perspective="p2",phase="Backfilling"} 1"#)
                {
                    assert!(
                        metrics.contains(r#"perspective_phase{perspective="p1",phase="Live"} 1"#),
                        "{metrics}"
                    );
                    seen_progress = true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        seen_progress,
        "the progress was visible while the backfill ran"
    );
    stop.store(true, Ordering::Relaxed);
    let mut appended = 0;
    for a in appenders {
        appended += a.await.unwrap();
    }
    assert!(appended > 0);
    wait_drained(&schema, Duration::from_secs(120)).await;

    // Every stream exact in both perspectives: p2 got the history and the live events in order,
    // p1 got each live event once and none of the history again.
    assert_exactly_once(&schema, 200).await;
    let status = read_status(&mut conn, &schema, &["p1".into(), "p2".into()], 30.0)
        .await
        .unwrap();
    assert!(status
        .perspectives
        .iter()
        .all(|p| p.phase == Phase::Live && p.progress.is_none()));
    wait_until(
        "every instance reports p2 live",
        Duration::from_secs(10),
        || async {
            engines.iter().all(|e| {
                e.metrics
                    .render()
                    .contains(r#"perspective_phase{perspective="p2",phase="Live"} 1"#)
            })
        },
    )
    .await;
    // Each instance took part.
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_backfill_loses_and_repeats_nothing() {
    let schema = unique_schema("bfkill");
    let (p1_only, both) = configs(&schema);
    migrate_config(&parse_config(&p1_only)).await;
    let streams: Vec<Uuid> = (0..100).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 50, 4, 50).await;
    // p1 never ran: both are caught up below, p1 from its queued work, p2 by the backfill.
    let config = parse_config(&both);
    migrate_config(&config).await;
    let path = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&path, &both).unwrap();
    let spawn = || {
        worker_bin()
            .arg("--config")
            .arg(&path)
            .args(["run", "--http-addr", "127.0.0.1:0"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the worker")
    };
    let mut victim = KillOnDrop(spawn());
    // Kill it mid-backfill: some streams queued but not all, or p2's history partly applied.
    // (Two minutes at most: the worker's start and p1's queued work come first, and CI runs
    // other suites beside this one.)
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut conn = connect().await;
    let mut seen = (None, 0, 0);
    loop {
        assert!(
            Instant::now() < deadline,
            "never reached the kill point; last seen (streams listed, not queued, applied): \
             {seen:?}"
        );
        assert!(
            victim.0.try_wait().unwrap().is_none(),
            "the worker exited early"
        );
        let (listed, left, applied): (Option<i64>, i64, i64) = sqlx::query_as(&format!(
            "SELECT (SELECT streams_total FROM {schema}.wh_perspective_jobs),
                    (SELECT count(*) FROM {schema}.wh_perspective_job_streams),
                    (SELECT coalesce(sum(cardinality(versions)), 0)::int8 FROM {schema}.seen_p2)"
        ))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        seen = (listed, left, applied);
        // Queueing (chunks commit stream by stream) or applying (a drain call commits many
        // streams' history at once, so a partial count is rare to catch).
        if listed == Some(100) && ((left > 0 && left < 100) || (applied > 0 && applied < 5_000)) {
            eprintln!("killing with {left} stream(s) not queued and {applied} event(s) applied");
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    victim.0.kill().unwrap(); // SIGKILL
    victim.0.wait().unwrap();
    let applied_at_kill = scalar(&format!(
        "SELECT sum(cardinality(versions))::int8 FROM {schema}.seen_p2"
    ))
    .await;
    assert!(
        applied_at_kill < 5_000,
        "killed mid-backfill ({applied_at_kill} applied)"
    );

    let mut survivor = KillOnDrop(spawn());
    wait_jobs_done(&schema).await;
    wait_drained(&schema, Duration::from_secs(120)).await;
    Command::new("kill")
        .args(["-TERM", &survivor.0.id().to_string()])
        .status()
        .unwrap();
    assert!(survivor.0.wait().unwrap().success());
    assert_exactly_once(&schema, 100).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_bump_rebuilds_online_and_every_read_sees_an_ordered_prefix() {
    let schema = unique_schema("verbump");
    let yaml = recording_yaml(&schema, FAST).replacen(
        "    handlers:",
        "    reset: DELETE FROM seen_p1 WHERE stream_id = :stream_id\n    handlers:",
        1,
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let streams: Vec<Uuid> = (0..60).map(|_| Uuid::now_v7()).collect();
    let engine = RunningEngine::start(&config).await;
    append_load(&schema, &streams, 30, 4, 30).await;
    wait_drained(&schema, Duration::from_secs(120)).await;
    engine.stop().await;
    // Damage p1's model: only a rebuild puts it right.
    let mut conn = connect().await;
    sqlx::query(&format!("UPDATE {schema}.seen_p1 SET versions = '{{42}}'"))
        .execute(&mut conn)
        .await
        .unwrap();

    let bumped = yaml.replacen("  - name: p1\n", "  - name: p1\n    version: 2\n", 1);
    let config = parse_config(&bumped);
    let report = perspective_worker::admin::migrate::migrate(
        &mut conn,
        &config,
        "bumped.yaml",
        Default::default(),
    )
    .await
    .expect("migrate");
    assert_eq!(report.rebuilds.len(), 1);
    assert_eq!(
        (
            report.rebuilds[0].perspective.as_str(),
            report.rebuilds[0].from,
            report.rebuilds[0].to
        ),
        ("p1", 1, 2)
    );

    // A reader: every stream keeps its row throughout (the workers reset and replay a stream in
    // one commit), holding either the old model (the rebuild has not reached it: the damaged
    // value, with the events appended since applied on top) or an ordered prefix 1..k.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let schema = schema.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut conn = connect().await;
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                let (rows, bad): (i64, Option<String>) = sqlx::query_as(&format!(
                    "SELECT count(*),
                            min(stream_id::text || ' ' || versions::text) FILTER (
                              WHERE versions[1] <> 42
                                AND versions <> ARRAY(SELECT generate_series(1, cardinality(versions)::int8)))
                     FROM {schema}.seen_p1"
                ))
                .fetch_one(&mut conn)
                .await
                .unwrap();
                assert_eq!(rows, 60, "a read found a stream's row missing");
                assert!(bad.is_none(), "a read saw an inconsistent stream: {bad:?}");
                reads += 1;
            }
            reads
        })
    };
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
    assert!(reader.await.unwrap() > 0);
    wait_drained(&schema, Duration::from_secs(120)).await;
    for e in engines {
        e.stop().await;
    }
    assert_exactly_once(&schema, 60).await;

    // The same version again rebuilds nothing.
    let again = perspective_worker::admin::migrate::migrate(
        &mut conn,
        &config,
        "bumped.yaml",
        Default::default(),
    )
    .await
    .expect("migrate");
    assert!(again.rebuilds.is_empty() && again.backfills.is_empty());
    assert_eq!(jobs_left(&schema).await, 0);
}

#[tokio::test]
async fn migrate_says_what_a_change_without_a_version_bump_leaves_behind() {
    let schema = unique_schema("verwarn");
    let yaml = recording_yaml(&schema, "");
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type)
         SELECT gen_random_uuid(), t FROM unnest(ARRAY['A', 'C', 'C', 'C']) AS t"
    ))
    .execute(&mut conn)
    .await
    .unwrap();

    // p1's handler of A changes and p2 gains C, both at version 1.
    let changed = yaml
        .replacen(
            "      A: INSERT INTO seen_p1 AS s VALUES (:stream_id, ARRAY[:stream_version])",
            "      A: INSERT INTO seen_p1 AS s VALUES (:stream_id, ARRAY[:stream_version * 10])",
            1,
        )
        .replacen(
            "      B: INSERT INTO seen_p2",
            "      C: SELECT 1\n      B: INSERT INTO seen_p2",
            1,
        );
    assert_ne!(changed, yaml);
    let file = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&file, &changed).unwrap();
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
            "warning: perspective p1: its handlers changed but its version stayed at 1, so rows already in its tables were built by the old handlers"
        ) && stdout.contains("set `version: 2` and migrate, or run `perspective-worker rebuild --perspective p1`"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "warning: perspective p2 now handles C, of which 3 event(s) are already stored"
        ) && stdout.contains("set `version: 2` and migrate to rebuild p2 with them"),
        "{stdout}"
    );
    assert_eq!(jobs_left(&schema).await, 0, "warnings start nothing");
    // Said once: a second run has nothing to say.
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .arg("migrate")
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("warning"));

    // A version bump on a perspective without `reset` is refused, naming the field.
    let bump = changed.replacen("  - name: p2\n", "  - name: p2\n    version: 2\n", 1);
    std::fs::write(&file, &bump).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .arg("migrate")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("perspectives[1] (p2).version")
            && stderr.contains("changed from 1 to 2")
            && stderr.contains("no `reset`"),
        "{stderr}"
    );
}

#[tokio::test]
async fn removing_a_perspective_mid_backfill_leaves_no_job_behind() {
    let schema = unique_schema("bfremove");
    let (p1_only, both) = configs(&schema);
    migrate_config(&parse_config(&p1_only)).await;
    let streams: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 5, 1, 10).await;
    migrate_config(&parse_config(&both)).await;
    assert_eq!(jobs_left(&schema).await, 1);
    // p2 leaves again before any worker ran its backfill.
    migrate_config(&parse_config(&p1_only)).await;
    let left = scalar(&format!(
        "SELECT (SELECT count(*) FROM {schema}.wh_perspective_jobs)
              + (SELECT count(*) FROM {schema}.wh_perspective_job_streams)
              + (SELECT count(*) FROM {schema}.wh_perspective_events WHERE perspective_name = 'p2')"
    ))
    .await;
    assert_eq!(left, 0);
    // p1 drains and the worker idles with nothing pinned.
    let engine = RunningEngine::start(&parse_config(&p1_only)).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    wait_until("no stream pinned", Duration::from_secs(30), || async {
        scalar(&format!("SELECT count(*) FROM {schema}.wh_active_streams")).await == 0
    })
    .await;
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rust_runner_backfills_a_new_perspective_in_order_while_producers_append() {
    let schema = unique_schema("bfrust");
    let (p1_only, both) = configs(&schema);
    migrate_config(&parse_config(&p1_only)).await;
    let streams: Vec<Uuid> = (0..60).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 20, 2, 30).await;
    let config = parse_config(&both);
    migrate_config(&config).await;

    let stop = Arc::new(AtomicBool::new(false));
    let appenders = producers(&schema, &streams, stop.clone());
    let mut engines = Vec::new();
    for _ in 0..2 {
        let mut options =
            perspective_worker::engine::EngineOptions::new(config.clone(), database_url());
        options.runner = Some(Arc::new(stream_history_runner::StreamHistoryRunner::new(
            &schema, "seen_",
        )));
        engines.push(RunningEngine::start_with(options).await);
    }
    wait_jobs_done(&schema).await;
    stop.store(true, Ordering::Relaxed);
    for a in appenders {
        a.await.unwrap();
    }
    wait_drained(&schema, Duration::from_secs(120)).await;
    for e in engines {
        e.stop().await;
    }
    assert_exactly_once(&schema, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_in_the_history_is_retried_then_dead_lettered_and_the_rest_applied() {
    let schema = unique_schema("bfpoison");
    let extra = "worker:
  maxPerspectiveEventAttempts: 2
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 100
claimWorker:
  pollingIntervalMilliseconds: 100
";
    let both = poisonable(&recording_yaml(&schema, extra), "p2");
    let p1_only = both[..both.find("  - name: p2").unwrap()].to_string() + extra;
    migrate_config(&parse_config(&p1_only)).await;
    let stream = Uuid::now_v7();
    let mut conn = connect().await;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         SELECT $1, 'A', CASE WHEN v = 4 THEN '{{\"poison\": \"yes\"}}'::jsonb ELSE '{{}}' END
         FROM generate_series(1, 8) v ORDER BY v"
    ))
    .bind(stream)
    .execute(&mut conn)
    .await
    .unwrap();
    let config = parse_config(&both);
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    wait_jobs_done(&schema).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    let (p1, p2): (Vec<i64>, Vec<i64>) = sqlx::query_as(&format!(
        "SELECT (SELECT versions FROM {schema}.seen_p1), (SELECT versions FROM {schema}.seen_p2)"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(p1, (1..=8).collect::<Vec<i64>>(), "p1 is not touched");
    assert_eq!(
        p2,
        vec![1, 2, 3, 5, 6, 7, 8],
        "p2 skips only the poison event, in order"
    );
    let dead: (String, i64, i32) = sqlx::query_as(&format!(
        "SELECT perspective_name, stream_version, attempts FROM {schema}.wh_dead_letters"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(dead, ("p2".to_string(), 4, 2));
}

/// A backfill runs at full pace (a chunk loop per drain consumer) without live work; beside live
/// events that wait (a live perspective whose handler takes 250 ms, so its append → applied
/// latency is over the 200 ms target at any pace) it drops to one chunk loop at half duty and
/// stays there; once the live work stops it runs at full pace again. Every event is applied once
/// throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backfill_slows_down_while_live_events_wait_and_speeds_up_after() {
    let schema = unique_schema("bfpace");
    let live = format!(
        "schema: {schema}
perspectives:
  - name: live
    setup: CREATE TABLE IF NOT EXISTS live_seen (event_id uuid PRIMARY KEY)
    handlers:
      L: SELECT pg_sleep(0.25); INSERT INTO live_seen VALUES (:event_id)
"
    );
    let both = format!(
        "{live}  - name: p2
    setup: CREATE TABLE IF NOT EXISTS seen_p2 (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL)
    handlers:
      A: SELECT pg_sleep(0.002); INSERT INTO seen_p2 AS s VALUES (:stream_id, ARRAY[:stream_version]) ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version
{FAST}"
    );
    migrate_config(&parse_config(&live)).await;
    let streams: Vec<Uuid> = (0..200).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 50, 4, 50).await;
    let config = parse_config(&both);
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let pace = |value: &str| format!("perspective_catchup_pace{{perspective=\"p2\"}} {value}\n");
    let seen = |value: String| {
        let metrics = engine.metrics.clone();
        move || {
            let metrics = metrics.clone();
            let value = value.clone();
            async move { metrics.render().contains(&value) }
        }
    };
    wait_until(
        "the backfill at full pace (4 chunk loops)",
        Duration::from_secs(60),
        seen(pace("4")),
    )
    .await;

    // Live events, each applied 250 ms after its append at best (the target is 200 ms).
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let stop = stop.clone();
        let pool = pool(1).await;
        let sql =
            format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'L')");
        tokio::spawn(async move {
            let mut appended = 0i64;
            while !stop.load(Ordering::Relaxed) {
                sqlx::query(&sql)
                    .bind(Uuid::now_v7())
                    .execute(&pool)
                    .await
                    .expect("append a live event");
                appended += 1;
                // 3 a second: 0.75 s of handler time a second, which the live perspective keeps
                // up with, each event still over the target.
                tokio::time::sleep(Duration::from_millis(333)).await;
            }
            appended
        })
    };
    // Held at half duty while the live events wait (it would climb under 50 ms): seen for 3 s.
    wait_until(
        "the backfill at half of one chunk loop",
        Duration::from_secs(30),
        seen(pace("0.5")),
    )
    .await;
    let held = Instant::now() + Duration::from_secs(3);
    while Instant::now() < held {
        assert!(
            engine.metrics.render().contains(&pace("0.5")),
            "the pace rose while the live events waited:\n{}",
            engine.metrics.render()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        jobs_left(&schema).await > 0,
        "the backfill must still run for the rest to mean anything"
    );
    stop.store(true, Ordering::Relaxed);
    let appended = producer.await.unwrap();
    wait_until(
        "the backfill back at full pace once the live work stopped",
        Duration::from_secs(30),
        seen(pace("4")),
    )
    .await;

    wait_jobs_done(&schema).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    let wrong = scalar(&format!(
        "SELECT count(*) FROM {schema}.seen_p2
         WHERE versions <> ARRAY(SELECT generate_series(1, 50)::bigint)"
    ))
    .await;
    assert_eq!(wrong, 0, "streams of p2 not applied exactly once in order");
    assert_eq!(
        scalar(&format!("SELECT count(*) FROM {schema}.seen_p2")).await,
        200
    );
    assert_eq!(
        scalar(&format!("SELECT count(*) FROM {schema}.live_seen")).await,
        appended
    );
}

/// `perspective`'s job advanced once, as a worker's turn does.
/// `per_stream` events on each of `streams`, applied by p1 alone; then p2 added and its job
/// advanced to `queueing`, so nothing is pending but p2's listed history. Returns the config
/// with both perspectives and a connection.
async fn p2_queueing_after_p1_applied(
    schema: &str,
    streams: &[Uuid],
    per_stream: usize,
) -> (String, sqlx::PgConnection) {
    let (p1_only, both) = configs(schema);
    migrate_config(&parse_config(&p1_only)).await;
    append_load(schema, streams, per_stream, 2, streams.len()).await;
    let engine = RunningEngine::start(&parse_config(&p1_only)).await;
    wait_drained(schema, Duration::from_secs(60)).await;
    engine.stop().await;
    migrate_config(&parse_config(&both)).await;
    let mut conn = connect().await;
    assert_eq!(advance(&mut conn, schema, "p2").await, "queueing");
    (both, conn)
}

async fn advance(conn: &mut sqlx::PgConnection, schema: &str, perspective: &str) -> String {
    sqlx::query_scalar(&format!("SELECT {schema}.wh_job_advance($1)"))
        .bind(perspective)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A new perspective's job waits for the transactions that appended to the event store before
/// it started (their events may lack its work rows, and its stream listing cannot see them yet),
/// and for no other: a long transaction that wrote another table of the schema, another schema
/// or another database used to hold every backfill of the cluster until it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_waits_for_transactions_that_appended_before_it_and_for_no_other() {
    let schema = unique_schema("bfwait");
    let (p1_only, both) = configs(&schema);
    migrate_config(&parse_config(&p1_only)).await;
    let stream = Uuid::now_v7();
    let mut conn = connect().await;
    // Open before the job: one appended, one wrote elsewhere in the same database.
    let mut appender = connect().await;
    sqlx::query("BEGIN").execute(&mut appender).await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A')"
    ))
    .bind(stream)
    .execute(&mut appender)
    .await
    .unwrap();
    let mut unrelated = connect().await;
    for sql in [
        "BEGIN".to_string(),
        format!("CREATE TABLE {schema}.unrelated (x int)"),
        format!("INSERT INTO {schema}.unrelated VALUES (1)"),
    ] {
        sqlx::query(&sql).execute(&mut unrelated).await.unwrap();
    }
    migrate_config(&parse_config(&both)).await;

    assert_eq!(advance(&mut conn, &schema, "p2").await, "waiting");
    assert_eq!(
        advance(&mut conn, &schema, "p2").await,
        "waiting",
        "the appender is still open"
    );
    // `status` names what the job waits for: the appender's backend, not the other one.
    let pid = "SELECT pg_backend_pid()";
    let appender_pid: i32 = sqlx::query_scalar(pid)
        .fetch_one(&mut appender)
        .await
        .unwrap();
    let unrelated_pid: i32 = sqlx::query_scalar(pid)
        .fetch_one(&mut unrelated)
        .await
        .unwrap();
    let phases = perspective_worker::store::catchup::Phases::read(&mut conn, &schema)
        .await
        .unwrap();
    let (phase, progress) = phases.of("p2");
    let message = progress.unwrap().message("p2", phase);
    assert!(
        message.contains(&format!("pid {appender_pid} ("))
            && !message.contains(&format!("pid {unrelated_pid}")),
        "appender {appender_pid}, unrelated {unrelated_pid}: {message}"
    );
    sqlx::query("COMMIT").execute(&mut appender).await.unwrap();
    assert_eq!(
        advance(&mut conn, &schema, "p2").await,
        "queueing",
        "the appender has ended; the transaction that wrote another table is not waited for"
    );
    let listed: i64 = scalar(&format!(
        "SELECT events FROM {schema}.wh_perspective_job_streams WHERE stream_id = '{stream}'"
    ))
    .await;
    assert_eq!(listed, 1, "the appender's event is in the job's listing");

    let engine = RunningEngine::start(&parse_config(&both)).await;
    wait_jobs_done(&schema).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    sqlx::query("ROLLBACK")
        .execute(&mut unrelated)
        .await
        .unwrap();
    assert_exactly_once(&schema, 1).await;
}

/// A listed stream with live work goes into the first chunk, whatever its place in the
/// listing: its live events wait behind the backfill's gate until its chunk commits, so such a
/// stream taken last kept them waiting (and every claim re-read its gated rows) for the whole
/// job — the blue/green build beside live load of issue 29.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_stream_with_live_work_is_taken_in_the_first_chunk() {
    let schema = unique_schema("bffirst");
    let streams: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    let (both, mut conn) = p2_queueing_after_p1_applied(&schema, &streams, 5).await;
    // Live traffic on the stream the listing holds last.
    let hot = *streams.iter().max().unwrap();
    append_event(&schema, hot, None, serde_json::json!({})).await;
    let gated: bool = sqlx::query_scalar(&format!("SELECT {schema}.wh_backfill_gated('p2', $1)"))
        .bind(hot)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(
        gated,
        "p2's live work on a listed stream waits for its chunk"
    );

    let take = format!("SELECT {schema}.wh_job_take_streams('p2', 3)");
    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    let first: Vec<Uuid> = sqlx::query_scalar(&take).fetch_all(&mut *tx).await.unwrap();
    let mut sorted = streams.clone();
    sorted.sort();
    assert_eq!(
        first,
        vec![sorted[0], sorted[1], hot],
        "the stream with live work first, then the listing's order; the chunk in stream order"
    );
    tx.rollback().await.unwrap();

    // The job still ends exactly once and in order.
    let engine = RunningEngine::start(&parse_config(&both)).await;
    wait_jobs_done(&schema).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 20).await;
}

/// A chunk that lifts the gate on a stream a worker holds rings the doorbell. The worker's settler
/// leaves a held stream whose only work is gated alone (draining it again cannot apply that
/// work), and a producer rings only for a stream nobody holds; without the ring such a stream
/// waited for the claim loop's next poll (up to the 5 s safety net) to be retired or drained —
/// live events on it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_that_lifts_the_gate_on_a_held_stream_rings_the_doorbell() {
    let schema = unique_schema("bfring");
    let streams: Vec<Uuid> = (0..4).map(|_| Uuid::now_v7()).collect();
    let (_, mut conn) = p2_queueing_after_p1_applied(&schema, &streams, 3).await;
    let mut listener = sqlx::postgres::PgListener::connect(&database_url())
        .await
        .unwrap();
    listener.listen(&format!("{schema}_work")).await.unwrap();
    let take_and_apply = format!(
        "SELECT (SELECT o_applied FROM {schema}.wh_job_requeue_streams('p2', ARRAY(SELECT {schema}.wh_job_take_streams('p2', 2)), true))"
    );

    // Streams nobody holds: no ring (a producer rings for those).
    let applied: i64 = sqlx::query_scalar(&take_and_apply)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(applied, 6, "two streams' history applied");
    let quiet = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(quiet.is_err(), "rang for streams nobody holds: {quiet:?}");

    // A stream held by a worker, with live work: the chunk that takes it rings.
    let me = Uuid::now_v7();
    sqlx::raw_sql(&format!(
        "INSERT INTO {schema}.wh_service_instances (instance_id, service_name, host_name, process_id, last_heartbeat_at)
           VALUES ('{me}', 'test', 'h', 1, now());
         INSERT INTO {schema}.wh_event_store (stream_id, event_type) SELECT stream_id, 'A'
           FROM {schema}.wh_perspective_job_streams WHERE perspective_name = 'p2' ORDER BY stream_id LIMIT 1;
         UPDATE {schema}.wh_active_streams SET assigned_instance_id = '{me}';"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    // The producer rang for its stream (nobody held it then); take that ring first.
    let producer = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    assert!(matches!(producer, Ok(Ok(_))), "{producer:?}");
    let quiet = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(quiet.is_err(), "{quiet:?}");
    let applied: i64 = sqlx::query_scalar(&take_and_apply)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(applied, 7, "the rest, with the live event");
    let rang = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    assert!(
        matches!(rang, Ok(Ok(_))),
        "no ring for a held stream the chunk ungated: {rang:?}"
    );
}

/// A catch-up's progress (read by every worker's job runner while a job runs, and by `status`)
/// counts each job's pending work; while the jobs table's statistics are stale the planner
/// guesses hundreds of jobs and costs the counts past `jit_above_cost`. JIT then compiled the
/// query on every read: 1.3 s of CPU for 25 ms of work, which on 2 cores stalled the live
/// perspectives' applies at the start of a blue/green build. It is read with JIT off.
#[tokio::test]
async fn catch_up_progress_is_read_without_jit() {
    let schema = unique_schema("bfjit");
    let (p1_only, both) = configs(&schema);
    migrate_config(&parse_config(&p1_only)).await;
    append_load(&schema, &[Uuid::now_v7()], 10, 1, 10).await;
    migrate_config(&parse_config(&both)).await;
    let mut conn = connect().await;
    for sql in [
        "SET jit = on",
        "SET jit_above_cost = 0",
        "SET jit_inline_above_cost = 0",
        "SET jit_optimize_above_cost = 0",
    ] {
        sqlx::query(sql).execute(&mut conn).await.unwrap();
    }
    // JIT works in this session, so what follows can tell.
    let plan: Vec<String> =
        sqlx::query_scalar("EXPLAIN ANALYZE SELECT count(*) FROM generate_series(1, 10)")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    assert!(
        plan.iter().any(|l| l.starts_with("JIT:")),
        "this PostgreSQL does not JIT-compile (pg_jit_available()), so the test cannot tell: {plan:?}"
    );
    async fn fastest_read(conn: &mut sqlx::PgConnection, schema: &str) -> Duration {
        let mut fastest = Duration::MAX;
        for _ in 0..3 {
            let started = Instant::now();
            let phases = perspective_worker::store::catchup::Phases::read(conn, schema)
                .await
                .unwrap();
            fastest = fastest.min(started.elapsed());
            assert_eq!(phases.of("p2").0, Phase::Backfilling);
        }
        fastest
    }
    let forced = fastest_read(&mut conn, &schema).await;
    sqlx::query("SET jit = off")
        .execute(&mut conn)
        .await
        .unwrap();
    let without = fastest_read(&mut conn, &schema).await;
    // JIT-compiled with inlining and optimisation it took 110 ms, against 0.3 ms without, on a
    // quiet machine.
    assert!(
        forced < without * 4 + Duration::from_millis(20),
        "the progress read took {forced:?} at best with JIT forced on, {without:?} with it off: JIT-compiled?"
    );
}

/// A chunk applies its streams' history through the perspective's batch function, in one call
/// for all its streams, and writes their cursors; an apply call per stream cost as much for a
/// stream of a few events as for one of a hundred (a blue/green build beside live load lists
/// every stream with live traffic).
#[tokio::test]
async fn a_chunk_applies_its_streams_in_one_batch_call() {
    let schema = unique_schema("bfbatch");
    let (p1_only, both) = configs(&schema);
    migrate_config(&parse_config(&p1_only)).await;
    let streams: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 5, 2, 20).await;
    migrate_config(&parse_config(&both)).await;
    let mut conn = connect().await;
    assert_eq!(advance(&mut conn, &schema, "p2").await, "queueing");

    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let taken: Vec<Uuid> =
        sqlx::query_scalar(&format!("SELECT {schema}.wh_job_take_streams('p2', 16)"))
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    assert_eq!(taken.len(), 16);
    let (queued, applied): (i64, i64) = sqlx::query_as(&format!(
        "SELECT * FROM {schema}.wh_job_requeue_streams('p2', $1, true)"
    ))
    .bind(&taken)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!((queued, applied), (0, 80));
    let calls: Vec<(String, i64)> = sqlx::query_as(
        "SELECT funcname::text, calls FROM pg_stat_xact_user_functions
         WHERE schemaname = $1 AND funcname IN ('wh_apply_p2', 'wh_batch_p2') ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    assert_eq!(calls, vec![("wh_batch_p2".to_string(), 1)]);
    tx.commit().await.unwrap();
    let cursors = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_cursors
         WHERE perspective_name = 'p2' AND last_version = 5 AND status = 2"
    ))
    .await;
    assert_eq!(
        cursors, 16,
        "the chunk's cursors at the end of their streams, Completed"
    );

    // The rest, and p1's queued work, by a worker: exactly once, in order.
    let engine = RunningEngine::start(&parse_config(&both)).await;
    wait_jobs_done(&schema).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 20).await;
}
