//! The `perspective-worker` binary as a process: SIGKILL while holding leases, SIGTERM during
//! load, and the zero-setup demo on an embedded PostgreSQL.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use uuid::Uuid;

/// Slow enough that a kill lands mid-work, with fast liveness so a dead instance is abandoned
/// within seconds.
fn slow_yaml(schema: &str) -> String {
    recording_yaml(schema, "").replace(
        "      A: INSERT",
        "      A: SELECT pg_sleep(0.0005); INSERT",
    ) + "worker:
  abandonStaleInstanceThresholdSeconds: 3
  heartbeatIntervalSeconds: 1
  perspectiveBatchSize: 20
claimWorker:
  pollingIntervalMilliseconds: 100
"
}

fn spawn_worker(config: &std::path::Path, instance: Uuid) -> Child {
    worker_bin()
        .arg("--config")
        .arg(config)
        .args(["run", "--http-addr", "127.0.0.1:0"])
        .env("PERSPECTIVE_INSTANCE_ID", instance.to_string())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the worker")
}

fn write_config(schema: &str, yaml: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_leases_and_unflushed_completions_loses_and_repeats_nothing() {
    let schema = unique_schema("sigkill");
    let yaml = slow_yaml(&schema);
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let path = write_config(&schema, &yaml);
    let streams: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 50, 4, 25).await;

    let a = Uuid::now_v7();
    let mut victim = spawn_worker(&path, a);
    // Kill it once it has applied some work, still holds streams (its lease on their work)
    // with events left to apply, and has applied rows whose deletion has not been flushed.
    // Both in one statement (one snapshot) on one connection: the work lasts about a second, and
    // polling with a new connection per query under a loaded CI machine missed it (the worker
    // had drained everything before two separate reads agreed).
    let kill_point = format!(
        "SELECT EXISTS (SELECT 1 FROM {schema}.wh_perspective_events w
                        JOIN {schema}.wh_active_streams a USING (stream_id)
                        JOIN {schema}.wh_perspective_cursors c USING (stream_id, perspective_name)
                        WHERE a.assigned_instance_id = '{a}' AND w.stream_version > c.last_version)
            AND EXISTS (SELECT 1 FROM {schema}.wh_perspective_events w
                        JOIN {schema}.wh_perspective_cursors c USING (stream_id, perspective_name)
                        WHERE w.stream_version <= c.last_version)"
    );
    let mut poll = connect().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "the worker never reached the kill point"
        );
        assert!(
            victim.try_wait().unwrap().is_none(),
            "the worker exited early"
        );
        let reached: bool = sqlx::query_scalar(&kill_point)
            .fetch_one(&mut poll)
            .await
            .unwrap();
        if reached {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();
    let applied_before = scalar(&format!(
        "SELECT sum(cardinality(versions))::int8 FROM {schema}.seen_p1"
    ))
    .await;
    assert!(
        applied_before > 0 && applied_before < 2000,
        "killed mid-work ({applied_before} applied)"
    );

    let b = Uuid::now_v7();
    let mut survivor = spawn_worker(&path, b);
    wait_drained(&schema, Duration::from_secs(120)).await;
    Command::new("kill")
        .args(["-TERM", &survivor.id().to_string()])
        .status()
        .unwrap();
    assert!(survivor.wait().unwrap().success());
    assert_exactly_once(&schema, 40).await;
    let dead_row = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_service_instances WHERE instance_id = '{a}'"
    ))
    .await;
    assert_eq!(dead_row, 0, "the killed instance was abandoned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_load_exits_cleanly_and_hands_over() {
    let schema = unique_schema("sigterm");
    let yaml = slow_yaml(&schema);
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let path = write_config(&schema, &yaml);
    let streams: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 50, 4, 25).await;

    let a = Uuid::now_v7();
    let mut worker = spawn_worker(&path, a);
    let applied = format!("SELECT sum(cardinality(versions))::int8 FROM {schema}.seen_p1");
    let deadline = Instant::now() + Duration::from_secs(60);
    while scalar(&applied).await < 50 {
        assert!(Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .unwrap();
    let status = loop {
        if let Some(s) = worker.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "did not stop within the grace period"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let stderr = {
        use std::io::Read;
        let mut s = String::new();
        worker
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        s
    };
    assert!(status.success(), "exit status {status:?}: {stderr}");
    println!("stopped {:?} after SIGTERM", started.elapsed());
    let instance_rows = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_service_instances WHERE instance_id = '{a}'"
    ))
    .await;
    assert_eq!(instance_rows, 0, "deregistered");
    let leased = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_events WHERE instance_id = '{a}'"
    ))
    .await;
    assert_eq!(leased, 0, "leases released");

    // Another instance picks up at once (no lease expiry to wait for) and finishes.
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(120)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 40).await;
}

#[tokio::test]
async fn demo_runs_on_an_embedded_postgres_without_database_url() {
    let dir = std::env::temp_dir().join(format!("perspective-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new(env!("CARGO_BIN_EXE_perspective-worker"))
        .current_dir(root)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .args([
            "--config",
            "examples/shop.yaml",
            "demo",
            "--events",
            "examples/shop-events.jsonl",
            "--http-addr",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(dir.join("pgdata"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("using embedded PostgreSQL"), "{text}");
    assert!(text.contains("shop.order_summary (5 rows)"), "{text}");
    assert!(text.contains("shop.customer_stats (3 rows)"), "{text}");
    // alice: one shipped order of 42.50 counts, her cancelled 120.00 does not.
    assert!(
        text.lines()
            .any(|l| l.starts_with("alice ") && l.contains("| 1 ") && l.contains("42.50")),
        "{text}"
    );
}
