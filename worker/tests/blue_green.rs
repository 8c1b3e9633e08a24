//! Blue/green versions (issue 29, DESIGN §12.6): a version bump of a perspective with
//! `rebuild: blueGreen` builds the new version in a shadow schema while the old one serves and
//! applies live events, then one transaction switches the tables; readers see the whole old
//! model or the whole new one; a rollback to a kept version catches up only what it missed; a
//! worker killed during the build or the switch leaves exact results.

mod common;
/// A custom runner, to show it is refused.
#[path = "../../examples/stream_history_runner.rs"]
#[allow(dead_code)]
mod stream_history_runner;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use perspective_worker::admin::migrate::{migrate, MigrateOptions, MigrateReport};
use perspective_worker::store::catchup::progress::Phase;
use perspective_worker::store::status::read_status;
use uuid::Uuid;

const FAST: &str = "worker:
  abandonStaleInstanceThresholdSeconds: 3
  heartbeatIntervalSeconds: 1
claimWorker:
  pollingIntervalMilliseconds: 100
";

/// Version 1 of `orders`: one row per stream, the versions it applied in order.
const V1: &str = "    setup: CREATE TABLE IF NOT EXISTS order_totals (stream_id uuid PRIMARY KEY, events bigint NOT NULL, versions bigint[] NOT NULL)
    handlers:
      A: INSERT INTO order_totals AS o VALUES (:stream_id, 1, ARRAY[:stream_version]) ON CONFLICT (stream_id) DO UPDATE SET events = o.events + 1, versions = o.versions || :stream_version
";

/// Version 2: a changed key (one row per event) and a new column; its handler takes a little
/// time, so the build lasts long enough to be read during. It reads `lookup`, a table of the
/// deployment schema that no version owns.
const V2: &str = "    setup: |
      CREATE TABLE IF NOT EXISTS order_totals (stream_id uuid, stream_version bigint, doubled bigint NOT NULL, PRIMARY KEY (stream_id, stream_version));
      CREATE INDEX IF NOT EXISTS order_totals_doubled ON order_totals (doubled);
    handlers:
      A: SELECT pg_sleep(0.002); INSERT INTO order_totals VALUES (:stream_id, :stream_version, :stream_version * (SELECT factor FROM lookup))
";

fn yaml(schema: &str, version: u32, body: &str) -> String {
    format!(
        "schema: {schema}\nperspectives:\n  - name: orders\n    version: {version}\n    rebuild: blueGreen\n{body}{FAST}"
    )
}

async fn migrate_yaml(yaml: &str) -> MigrateReport {
    let config = parse_config(yaml);
    let mut conn = connect().await;
    migrate(&mut conn, &config, "test.yaml", MigrateOptions::default())
        .await
        .expect("migrate")
}

/// A schema with `orders` v1 migrated, `lookup` created, and `streams` × `per_stream` events
/// applied by an engine.
async fn v1_with_history(prefix: &str, streams: usize, per_stream: usize) -> (String, Vec<Uuid>) {
    let schema = unique_schema(prefix);
    let v1 = parse_config(&yaml(&schema, 1, V1));
    migrate_config(&v1).await;
    psql(&format!(
        "CREATE TABLE {schema}.lookup (factor bigint); INSERT INTO {schema}.lookup VALUES (2)"
    ));
    let ids: Vec<Uuid> = (0..streams).map(|_| Uuid::now_v7()).collect();
    let engine = RunningEngine::start(&v1).await;
    append_load(&schema, &ids, per_stream, 2, 20).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    (schema, ids)
}

/// The version `orders` runs live, once no version is being built.
async fn live_version(schema: &str) -> Option<i64> {
    let mut conn = connect().await;
    sqlx::query_scalar::<_, Option<i64>>(&format!(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM {schema}.wh_perspective_versions WHERE state = 'building')
                THEN NULL ELSE (SELECT version::int8 FROM {schema}.wh_perspectives WHERE perspective_name = 'orders') END"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap()
}

async fn wait_live(schema: &str, version: i64) {
    wait_until(
        &format!("version {version} is live"),
        Duration::from_secs(90),
        || async { live_version(schema).await == Some(version) },
    )
    .await;
}

/// Which model a read of `order_totals` saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Model {
    V1,
    V2,
}

/// Read `<table>` (any shape) and check it is one whole model: at least `streams` streams there,
/// and each stream's events an ordered prefix 1..k exactly once. Panics otherwise.
async fn read_model(conn: &mut sqlx::PgConnection, table: &str, streams: usize) -> Model {
    let rows: Vec<serde_json::Value> =
        sqlx::query_scalar(&format!("SELECT to_jsonb(o) FROM {table} o"))
            .fetch_all(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("a read of {table} failed: {e}"));
    let keys: BTreeSet<String> = rows
        .iter()
        .map(|r| {
            let mut k: Vec<&String> = r.as_object().unwrap().keys().collect();
            k.sort();
            k.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(",")
        })
        .collect();
    assert_eq!(keys.len(), 1, "a read of {table} mixed shapes: {keys:?}");
    let shape = keys.into_iter().next().unwrap();
    let mut per_stream: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let model = match shape.as_str() {
        "events,stream_id,versions" => {
            for r in &rows {
                let versions: Vec<i64> = serde_json::from_value(r["versions"].clone()).unwrap();
                assert_eq!(versions.len() as i64, r["events"].as_i64().unwrap());
                per_stream.insert(r["stream_id"].to_string(), versions);
            }
            Model::V1
        }
        "doubled,stream_id,stream_version" => {
            for r in &rows {
                let v = r["stream_version"].as_i64().unwrap();
                assert_eq!(r["doubled"].as_i64().unwrap(), 2 * v);
                per_stream
                    .entry(r["stream_id"].to_string())
                    .or_default()
                    .push(v);
            }
            for versions in per_stream.values_mut() {
                versions.sort();
            }
            Model::V2
        }
        other => panic!("a read of {table} saw an unknown shape: {other}"),
    };
    assert!(
        per_stream.len() >= streams,
        "a read of {table} ({model:?}) lacks streams: {} of {streams}",
        per_stream.len()
    );
    for (stream, versions) in &per_stream {
        let expected: Vec<i64> = (1..=versions.len() as i64).collect();
        assert_eq!(
            versions, &expected,
            "{model:?}: stream {stream} is not an ordered prefix"
        );
    }
    model
}

/// Each stream's head version.
async fn heads(schema: &str) -> BTreeMap<Uuid, i64> {
    let mut conn = connect().await;
    sqlx::query_as::<_, (Uuid, i64)>(&format!(
        "SELECT stream_id, version FROM {schema}.wh_streams"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// `table` holds exactly every event of every stream (model of either version).
async fn assert_exact(table: &str, schema: &str) {
    let heads = heads(schema).await;
    let mut conn = connect().await;
    read_model(&mut conn, table, heads.len()).await;
    let total: i64 = heads.values().sum();
    let rows: Vec<serde_json::Value> =
        sqlx::query_scalar(&format!("SELECT to_jsonb(o) FROM {table} o"))
            .fetch_all(&mut conn)
            .await
            .unwrap();
    let applied: i64 = rows
        .iter()
        .map(|r| r.get("events").and_then(|e| e.as_i64()).unwrap_or(1))
        .sum();
    assert_eq!(applied, total, "{table}: every event applied exactly once");
    let failures = scalar(&format!(
        "SELECT (SELECT count(*) FROM {schema}.wh_dead_letters) + (SELECT count(*) FROM {schema}.wh_perspective_cursors WHERE (status & 4) <> 0)"
    ))
    .await;
    assert_eq!(failures, 0, "no dead letter, no failed cursor");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shape_change_builds_beside_the_live_model_and_readers_never_see_a_mix() {
    let (schema, streams) = v1_with_history("bgshape", 20, 20).await;
    let report = migrate_yaml(&yaml(&schema, 2, V2)).await;
    assert_eq!(report.version_builds.len(), 1, "{report:?}");
    assert!(report.rebuilds.is_empty(), "not rebuilt in place");
    assert!(!report.version_builds[0].rollback);
    // The new version's setup ran in its shadow schema, not over the live table.
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = '{schema}_orders_v2' AND table_name = 'order_totals' AND column_name = 'doubled'"
        ))
        .await,
        1
    );
    // Status names the version serving and the one built beside it.
    let status = read_status(&mut connect().await, &schema, &["orders".into()], 30.0)
        .await
        .unwrap();
    let orders = &status.perspectives[0];
    assert_eq!(
        (
            orders.phase,
            orders.version,
            orders.next_version,
            orders.rollback
        ),
        (Phase::Building, Some(1), Some(2), false)
    );

    // Readers' rights on the live table carry over to the table that takes its name.
    psql(&format!("GRANT SELECT ON {schema}.order_totals TO PUBLIC"));
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let table = format!("{schema}.order_totals");
        let stop = stop.clone();
        let n = streams.len();
        tokio::spawn(async move {
            let mut conn = connect().await;
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let model = read_model(&mut conn, &table, n).await;
                if seen.last() != Some(&model) {
                    seen.push(model);
                }
            }
            seen
        })
    };
    let appenders = producers(&schema, &streams, stop.clone());
    let config = parse_config(&yaml(&schema, 2, V2));
    let engines = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];
    // While v2 builds, v1 serves and applies live events: a marker appended now reaches it.
    let marker = Uuid::now_v7();
    append_event(&schema, marker, None, serde_json::json!({})).await;
    wait_until(
        "v1 applies a live event during the build",
        Duration::from_secs(30),
        || async {
            scalar(&format!(
                "SELECT count(*) FROM {schema}.order_totals WHERE stream_id = '{marker}'"
            ))
            .await
                == 1
        },
    )
    .await;
    let building = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_versions WHERE state = 'building'"
    ))
    .await;
    assert_eq!(
        building, 1,
        "the marker was applied by v1 while v2 was being built"
    );
    wait_live(&schema, 2).await;
    stop.store(true, Ordering::Relaxed);
    for a in appenders {
        a.await.unwrap();
    }
    let seen = reader.await.unwrap();
    assert_eq!(
        seen,
        [Model::V1, Model::V2],
        "reads saw v1, then v2, never a mix"
    );
    wait_drained(&schema, Duration::from_secs(60)).await;
    let switches: u64 = engines
        .iter()
        .map(|e| {
            e.metrics
                .version_switches
                .with_label_values(&["orders", "2"])
                .get()
        })
        .sum();
    assert_eq!(switches, 1, "one worker switched");
    let status = read_status(&mut connect().await, &schema, &["orders".into()], 30.0)
        .await
        .unwrap();
    let orders = &status.perspectives[0];
    assert_eq!(
        (orders.phase, orders.version, orders.next_version),
        (Phase::Live, Some(2), None)
    );
    for engine in engines {
        engine.stop().await;
    }
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM pg_class c, aclexplode(c.relacl) a
             WHERE c.oid = '{schema}.order_totals'::regclass AND a.grantee = 0 AND a.privilege_type = 'SELECT'"
        ))
        .await,
        1,
        "PUBLIC may still read order_totals"
    );
    // The new model is exact, in the deployment schema (with its index), the old one archived.
    assert_exact(&format!("{schema}.order_totals"), &schema).await;
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = '{schema}' AND indexname = 'order_totals_doubled'"
        ))
        .await,
        1
    );
    let mut conn = connect().await;
    read_model(
        &mut conn,
        &format!("{schema}_orders_v1.order_totals"),
        streams.len() + 1,
    )
    .await;
    // The archived version's cursors say what its table holds: each event once.
    let mismatched = scalar(&format!(
        "SELECT count(*) FROM {schema}_orders_v1.order_totals o
         JOIN {schema}.wh_perspective_cursors c ON c.stream_id = o.stream_id AND c.perspective_name = 'orders__v1'
         WHERE c.last_version <> o.events"
    ))
    .await;
    assert_eq!(mismatched, 0);
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_perspective_subscriptions WHERE perspective_name <> 'orders'"
        ))
        .await,
        0,
        "the archived version stopped applying"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollback_switches_back_to_the_kept_version_catching_up_only_what_it_missed() {
    let (schema, streams) = v1_with_history("bgback", 10, 10).await;
    migrate_yaml(&yaml(&schema, 2, V2)).await;
    let v2 = parse_config(&yaml(&schema, 2, V2));
    let engine = RunningEngine::start(&v2).await;
    wait_live(&schema, 2).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    let kept_table = format!("{schema}_orders_v1.order_totals");
    let kept_oid = scalar(&format!("SELECT '{kept_table}'::regclass::oid::int8")).await;
    // Events v1 misses while v2 is live.
    append_load(&schema, &streams, 5, 2, 10).await;
    let gap = (streams.len() * 5) as u64;

    let back = yaml(&schema, 1, V1);
    let report = migrate_yaml(&back).await;
    assert_eq!(report.version_builds.len(), 1, "{report:?}");
    let build = &report.version_builds[0];
    assert_eq!((build.live, build.next, build.rollback), (2, 1, true));
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_perspective_jobs WHERE perspective_name = 'orders__v1' AND keep_cursors"
        ))
        .await,
        1,
        "the kept version catches up from its cursors"
    );
    let status = read_status(&mut connect().await, &schema, &["orders".into()], 30.0)
        .await
        .unwrap();
    let orders = &status.perspectives[0];
    assert_eq!(
        (orders.version, orders.next_version, orders.rollback),
        (Some(2), Some(1), true),
        "a rollback to v1 while v2 serves"
    );
    let engine = RunningEngine::start(&parse_config(&back)).await;
    wait_live(&schema, 1).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    let applied = engine
        .metrics
        .events_processed
        .with_label_values(&["orders__v1"])
        .get();
    engine.stop().await;
    assert_eq!(
        applied, gap,
        "only the events it missed were applied to the kept version"
    );
    // The kept table itself is back (not a rebuild), exact: a replay from scratch would have
    // appended every version twice to its arrays.
    assert_eq!(
        scalar(&format!(
            "SELECT '{schema}.order_totals'::regclass::oid::int8"
        ))
        .await,
        kept_oid
    );
    assert_exact(&format!("{schema}.order_totals"), &schema).await;
    // v2 is kept in turn (keepPreviousVersions defaults to 1), with its model.
    let mut conn = connect().await;
    assert_eq!(
        read_model(
            &mut conn,
            &format!("{schema}_orders_v2.order_totals"),
            streams.len()
        )
        .await,
        Model::V2
    );
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_perspective_versions WHERE perspective_name = 'orders' AND state = 'kept' AND version = 2"
        ))
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn versions_beyond_keep_previous_versions_are_dropped_at_the_switch() {
    let (schema, _) = v1_with_history("bgkeep", 5, 5).await;
    let none_kept = |version: u32| {
        yaml(&schema, version, V2).replace(
            "    rebuild: blueGreen\n",
            "    rebuild: blueGreen\n    keepPreviousVersions: 0\n",
        )
    };
    migrate_yaml(&none_kept(2)).await;
    let engine = RunningEngine::start(&parse_config(&none_kept(2))).await;
    wait_live(&schema, 2).await;
    engine.stop().await;
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM pg_namespace WHERE nspname = '{schema}_orders_v1'"
        ))
        .await,
        0,
        "v1's archive schema was dropped"
    );
    assert_eq!(
        scalar(&format!(
            "SELECT (SELECT count(*) FROM {schema}.wh_perspective_versions WHERE version = 1)
                  + (SELECT count(*) FROM {schema}.wh_perspective_cursors WHERE perspective_name = 'orders__v1')"
        ))
        .await,
        0,
        "and its cursors and record"
    );
    assert_exact(&format!("{schema}.order_totals"), &schema).await;
}

/// Issue 29: "a migration that fails in v3 leaves v2 serving". A new version whose `setup`
/// fails is refused by `migrate` with an error naming the perspective, the version and the
/// database's reason; nothing of it is left (no shadow schema, no version record, no job), the
/// live version stays live, and a worker of the live config goes on applying every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_version_whose_setup_fails_leaves_the_live_one_serving() {
    let (schema, streams) = v1_with_history("bgfail", 5, 5).await;
    let broken = yaml(
        &schema,
        2,
        &V2.replace(
            "doubled bigint NOT NULL,",
            "doubled bigint NOT NULL REFERENCES no_such_table (id),",
        ),
    );
    assert_ne!(broken, yaml(&schema, 2, V2));
    let mut conn = connect().await;
    let err = migrate(
        &mut conn,
        &parse_config(&broken),
        "test.yaml",
        MigrateOptions::default(),
    )
    .await
    .expect_err("a setup that fails must fail the migration");
    let message = format!("{err:#}");
    println!("migrate refused the broken version: {message}");
    for part in [
        "perspectives[0] (orders, version 2 built blue/green).setup",
        "no_such_table",
    ] {
        assert!(message.contains(part), "the error names {part}: {message}");
    }
    assert_eq!(live_version(&schema).await, Some(1), "v1 still serves");
    assert_eq!(
        scalar(&format!(
            "SELECT (SELECT count(*) FROM pg_namespace WHERE nspname = '{schema}_orders_v2')
                  + (SELECT count(*) FROM {schema}.wh_perspective_versions WHERE version = 2)
                  + (SELECT count(*) FROM {schema}.wh_perspective_jobs)"
        ))
        .await,
        0,
        "nothing of version 2 is left: no shadow schema, no version record, no job"
    );
    // The serving worker (the live config) goes on: new events reach v1's model, exactly once.
    let engine = RunningEngine::start(&parse_config(&yaml(&schema, 1, V1))).await;
    append_load(&schema, &streams, 3, 2, 10).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    let mut conn = connect().await;
    assert_eq!(
        read_model(&mut conn, &format!("{schema}.order_totals"), streams.len()).await,
        Model::V1
    );
    assert_exact(&format!("{schema}.order_totals"), &schema).await;
}

/// A worker process of `yaml`, killed when dropped.
struct Worker(std::process::Child);

impl Worker {
    fn spawn(schema: &str, yaml: &str) -> Worker {
        let path = std::env::temp_dir().join(format!("{schema}.yaml"));
        std::fs::write(&path, yaml).unwrap();
        Worker(
            worker_bin()
                .arg("--config")
                .arg(&path)
                .args(["run", "--http-addr", "127.0.0.1:0"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("spawn the worker"),
        )
    }

    fn sigkill(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }

    fn sigterm(mut self) {
        std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(self.0.wait().unwrap().success());
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// After a kill, a survivor finishes the build and the switch: both versions exact.
async fn survivor_finishes(schema: &str, v2: &str, streams: usize) {
    let survivor = Worker::spawn(schema, v2);
    wait_live(schema, 2).await;
    wait_drained(schema, Duration::from_secs(60)).await;
    survivor.sigterm();
    assert_exact(&format!("{schema}.order_totals"), schema).await;
    let mut conn = connect().await;
    assert_eq!(
        read_model(
            &mut conn,
            &format!("{schema}_orders_v1.order_totals"),
            streams
        )
        .await,
        Model::V1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_during_the_build_leaves_exact_results() {
    let (schema, _) = v1_with_history("bgkillb", 40, 25).await;
    let v2 = yaml(&schema, 2, V2);
    migrate_yaml(&v2).await;
    let victim = Worker::spawn(&schema, &v2);
    wait_until(
        "the build is under way",
        Duration::from_secs(60),
        || async {
            scalar(&format!(
            "SELECT count(*) FROM {schema}_orders_v2.order_totals
             WHERE EXISTS (SELECT 1 FROM {schema}.wh_perspective_versions WHERE state = 'building')"
        ))
            .await
                > 0
        },
    )
    .await;
    victim.sigkill();
    assert_eq!(
        live_version(&schema).await,
        None,
        "killed before the switch"
    );
    survivor_finishes(&schema, &v2, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_during_the_switch_leaves_exact_results() {
    let (schema, _) = v1_with_history("bgkills", 10, 10).await;
    let v2 = yaml(&schema, 2, V2);
    migrate_yaml(&v2).await;
    // A reader in a transaction holds the live table: the switch waits for it, under its lock
    // timeout — and the worker is killed right then.
    let mut reader = connect().await;
    sqlx::query("BEGIN").execute(&mut reader).await.unwrap();
    sqlx::query(&format!("SELECT count(*) FROM {schema}.order_totals"))
        .execute(&mut reader)
        .await
        .unwrap();
    let victim = Worker::spawn(&schema, &v2);
    wait_until(
        "the switch waits for the reader",
        Duration::from_secs(60),
        || async {
            scalar(&format!(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
             WHERE NOT l.granted AND l.mode = 'AccessExclusiveLock'
               AND c.relname = 'order_totals' AND c.relnamespace = '{schema}'::regnamespace"
            ))
            .await
                > 0
        },
    )
    .await;
    victim.sigkill();
    sqlx::query("COMMIT").execute(&mut reader).await.unwrap();
    // Nothing of the switch committed: v1 is still live, with its name and its tables.
    assert_eq!(live_version(&schema).await, None);
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = '{schema}' AND table_name = 'order_totals' AND column_name = 'events'"
        ))
        .await,
        1
    );
    survivor_finishes(&schema, &v2, 10).await;
}

/// A bump under appends with `sequencing` lines `lines` (both versions): exact results.
async fn bump_under_load(prefix: &str, lines: &str) {
    let schema = unique_schema(prefix);
    let v1 = yaml(&schema, 1, &format!("{lines}{V1}"));
    // Without the handler's sleep: one applier (serial) must keep up with the producers for the
    // version to catch up and switch.
    let v2 = yaml(
        &schema,
        2,
        &format!("{lines}{}", V2.replace("SELECT pg_sleep(0.002); ", "")),
    );
    migrate_yaml(&v1).await;
    psql(&format!(
        "CREATE TABLE {schema}.lookup (factor bigint); INSERT INTO {schema}.lookup VALUES (2)"
    ));
    let streams: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 10, 2, 20).await;
    migrate_yaml(&v2).await;
    let stop = Arc::new(AtomicBool::new(false));
    let appenders = producers(&schema, &streams, stop.clone());
    let config = parse_config(&v2);
    let engines = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];
    wait_live(&schema, 2).await;
    stop.store(true, Ordering::Relaxed);
    for a in appenders {
        a.await.unwrap();
    }
    wait_drained(&schema, Duration::from_secs(60)).await;
    for engine in engines {
        engine.stop().await;
    }
    assert_exact(&format!("{schema}.order_totals"), &schema).await;
    let mut conn = connect().await;
    read_model(
        &mut conn,
        &format!("{schema}_orders_v1.order_totals"),
        streams.len(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_sequencing_mode_builds_and_switches_exactly() {
    bump_under_load("bgserial", "    sequencing: serial\n").await;
    bump_under_load(
        "bgkey",
        "    sequencing: key\n    sequencingKey: \":stream_id::text\"\n",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn removing_a_perspective_mid_build_leaves_no_version_behind() {
    let (schema, _) = v1_with_history("bgrm", 5, 5).await;
    migrate_yaml(&yaml(&schema, 2, V2)).await;
    let other = format!(
        "schema: {schema}\nperspectives:\n  - name: other\n    handlers:\n      B: SELECT 1\n{FAST}"
    );
    let report = migrate_yaml(&other).await;
    let removed: BTreeSet<String> = report
        .perspectives_removed
        .iter()
        .map(|r| r.perspective.clone())
        .collect();
    assert_eq!(
        removed,
        BTreeSet::from(["orders".to_string(), "orders__v2".to_string()])
    );
    for (what, sql) in [
        ("versions", "SELECT count(*) FROM {schema}.wh_perspective_versions"),
        (
            "jobs",
            "SELECT count(*) FROM {schema}.wh_perspective_jobs WHERE perspective_name <> 'other'",
        ),
        (
            "subscriptions",
            "SELECT count(*) FROM {schema}.wh_perspective_subscriptions WHERE perspective_name <> 'other'",
        ),
        (
            "compiled",
            "SELECT count(*) FROM {schema}.wh_perspectives WHERE perspective_name <> 'other'",
        ),
    ] {
        assert_eq!(
            scalar(&sql.replace("{schema}", &schema)).await,
            0,
            "{what} left behind"
        );
    }
    // The engine starts with what is left.
    RunningEngine::start(&parse_config(&other))
        .await
        .stop()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_custom_runner_is_refused_with_a_blue_green_perspective() {
    use perspective_worker::engine::{Engine, EngineError, EngineOptions};
    let schema = unique_schema("bgrunner");
    let config = parse_config(&yaml(&schema, 1, V1));
    migrate_config(&config).await;
    let mut options = EngineOptions::new(config, database_url());
    options.runner = Some(Arc::new(stream_history_runner::StreamHistoryRunner::new(
        &schema, "seen_",
    )));
    let err = match Engine::start(options, tokio_util::sync::CancellationToken::new()).await {
        Ok(_) => panic!("a custom runner started with a blue/green perspective"),
        Err(e) => e,
    };
    assert!(
        matches!(&err, EngineError::BlueGreenNeedsSqlHandlers { perspective } if perspective == "orders"),
        "{err}"
    );
    assert!(err.to_string().contains("rebuild: blueGreen"), "{err}");
}

/// Version 2 built by an engine running as a worker role (`grants worker`), which may not
/// switch: returned once it has refused the switch a few times, still running. Also the config
/// file (version 2) and the role.
async fn built_by_a_worker_role(
    prefix: &str,
) -> (String, std::path::PathBuf, String, RunningEngine) {
    let (schema, _) = v1_with_history(prefix, 5, 5).await;
    let role = format!("{schema}_worker");
    assert!(psql(&format!("CREATE ROLE {role} LOGIN")).status.success());
    let file = std::env::temp_dir().join(format!("{schema}.yaml"));
    std::fs::write(&file, yaml(&schema, 1, V1)).unwrap();
    let out = worker_bin()
        .arg("--config")
        .arg(&file)
        .args(["grants", "worker", &role])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v2 = yaml(&schema, 2, V2);
    std::fs::write(&file, &v2).unwrap();
    migrate_yaml(&v2).await;
    let engine = RunningEngine::start_with(perspective_worker::engine::EngineOptions::new(
        parse_config(&v2),
        url_as(&role),
    ))
    .await;
    // The build writes its home schema's tables (migrate gave the worker role its rights there)…
    wait_until("v2 is built", Duration::from_secs(60), || async {
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_perspective_jobs WHERE perspective_name = 'orders__v2' AND state = 'done'"
        ))
        .await
            == 1
    })
    .await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    // …but the switch needs the owner: it is refused on turn after turn, v1 stays live.
    let refused = engine
        .metrics
        .version_switches_refused
        .with_label_values(&["orders", "2"]);
    let refused = &refused;
    wait_until("refused switches", Duration::from_secs(30), || async move {
        refused.get() >= 3
    })
    .await;
    assert_eq!(live_version(&schema).await, None);
    (schema, file, role, engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_role_that_is_not_the_owner_builds_but_leaves_the_switch_to_the_owner() {
    let (schema, file, _, engine) = built_by_a_worker_role("bgrole").await;
    assert_eq!(
        scalar(&format!("SELECT count(*) FROM {schema}.wh_dead_letters")).await,
        0
    );
    engine.stop().await;
    let config = parse_config(&std::fs::read_to_string(&file).unwrap());
    let owner = RunningEngine::start(&config).await;
    wait_live(&schema, 2).await;
    owner.stop().await;
    assert_exact(&format!("{schema}.order_totals"), &schema).await;
}

/// `perspective-worker switch`, run as the owner, makes the switch the workers' role may not;
/// run as that role it is refused, naming why; with nothing being built it has nothing to do.
/// The worker role's engine goes on applying, now to version 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_switch_command_run_as_the_owner_switches_what_a_worker_role_built() {
    let (schema, file, role, engine) = built_by_a_worker_role("bgswitch").await;
    let switch = |url: String, extra: &[&str]| {
        let mut cmd = worker_bin();
        cmd.env("DATABASE_URL", url)
            .arg("--config")
            .arg(&file)
            .arg("switch")
            .args(extra);
        cmd.output().unwrap()
    };
    let refused = switch(url_as(&role), &[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        stderr.contains("the switch needs the rights of the schema's owner"),
        "{stderr}"
    );
    assert_eq!(live_version(&schema).await, None);
    let unknown = switch(database_url(), &["--perspective", "nope"]);
    assert!(!unknown.status.success());
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("--perspective nope"),
        "{unknown:?}"
    );

    let out = switch(
        database_url(),
        &["--perspective", "orders", "--wait-seconds", "30"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("switched orders from version 1 to version 2"),
        "{stdout}"
    );
    assert_eq!(live_version(&schema).await, Some(2));
    let again = switch(database_url(), &[]);
    assert!(again.status.success(), "nothing left to switch: {again:?}");
    assert_eq!(
        String::from_utf8_lossy(&again.stdout).trim(),
        "nothing to switch: no version of any perspective is being built"
    );

    // The worker role's engine applies new events to version 2, exactly once.
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &ids, 4, 2, 20).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    assert_exact(&format!("{schema}.order_totals"), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_builds_version_2_beside_version_1_and_switches() {
    let example = include_str!("../../examples/bluegreen.yaml");
    let schema = unique_schema("bgexample");
    let v2 = example.replace("schema: bluegreen_shop", &format!("schema: {schema}"));
    // Version 1, from the example's comment.
    let v1 = v2
        .split("    setup: |")
        .next()
        .unwrap()
        .replace("version: 2", "version: 1")
        + "    setup: CREATE TABLE IF NOT EXISTS order_status (order_id uuid PRIMARY KEY, status text NOT NULL)
    handlers:
      OrderPlaced: INSERT INTO order_status VALUES (:stream_id, 'placed')
      OrderShipped: UPDATE order_status SET status = 'shipped' WHERE order_id = :stream_id
      OrderCancelled: UPDATE order_status SET status = 'cancelled' WHERE order_id = :stream_id
";
    assert!(
        example.contains("OrderCancelled: UPDATE order_status SET status = 'cancelled' WHERE order_id = :stream_id"),
        "the example's comment shows version 1"
    );
    migrate_yaml(&v1).await;
    let order = Uuid::now_v7();
    for event in ["OrderPlaced", "OrderShipped"] {
        psql(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ('{order}', '{event}')"
        ));
    }
    let engine = RunningEngine::start(&parse_config(&v1)).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    engine.stop().await;
    let report = migrate_yaml(&v2).await;
    assert_eq!(report.version_builds.len(), 1, "{report:?}");
    let engine = RunningEngine::start(&parse_config(&v2)).await;
    wait_until("version 2 is live", Duration::from_secs(60), || async {
        scalar(&format!(
            "SELECT count(*) FROM {schema}.wh_perspective_versions WHERE version = 2 AND state = 'live'"
        ))
        .await
            == 1
    })
    .await;
    engine.stop().await;
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}.order_status WHERE order_id = '{order}'"
        ))
        .await,
        2,
        "one row per status change"
    );
    assert_eq!(
        scalar(&format!(
            "SELECT count(*) FROM {schema}_order_status_v1.order_status WHERE status = 'shipped'"
        ))
        .await,
        1,
        "version 1 kept"
    );
}
