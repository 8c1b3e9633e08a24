//! Issue 24: lock conflicts between appliers are transient, never failures. A read model whose
//! rows many streams share (one row per customer) makes concurrent `wh_drain` calls take those
//! rows' locks in different orders; PostgreSQL breaks the cycles (deadlock, 40P01). Such a
//! conflict is retried promptly: no attempt counted, no backoff, no Failed cursor, never a dead
//! letter. Real PostgreSQL, see `common`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use prometheus::core::Collector;
use uuid::Uuid;

const CUSTOMERS: usize = 20;
const STREAMS: usize = 240;
const EVENTS_PER_STREAM: usize = 12;
const PRODUCERS: usize = 4;
/// Streams one producer transaction appends to (one event each).
const STREAMS_PER_APPEND: usize = 12;

/// One perspective: a per-customer aggregate every stream updates (the shared rows), and a
/// per-stream row recording the versions applied, in order. Each event takes a millisecond, so
/// the appliers' transactions overlap whether or not the producers outrun them: in a CI run
/// (three suites beside each other) the engines kept up with the appends, applied them a few
/// at a time and never conflicted, and the tests below, which need conflicts, failed.
fn contention_yaml(schema: &str) -> String {
    format!(
        "schema: {schema}
perspectives:
  - name: customer_stats
    setup: |
      CREATE TABLE IF NOT EXISTS customer_stats (customer int PRIMARY KEY, orders bigint NOT NULL, total bigint NOT NULL);
      CREATE TABLE IF NOT EXISTS order_versions (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL);
    handlers:
      OrderPlaced: >-
        SELECT pg_sleep(0.001);
        INSERT INTO customer_stats AS c VALUES ((:data->>'customer')::int, 1, (:data->>'amount')::bigint)
        ON CONFLICT (customer) DO UPDATE SET orders = c.orders + 1, total = c.total + excluded.total;
        INSERT INTO order_versions AS o VALUES (:stream_id, ARRAY[:stream_version])
        ON CONFLICT (stream_id) DO UPDATE SET versions = o.versions || :stream_version
worker:
  maxPerspectiveEventAttempts: 2
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 100
"
    )
}

/// The customer and amount of event `version` of stream number `stream`: every customer's row
/// is hit by many streams, and a stream's consecutive events hit different customers.
fn order(stream: usize, version: usize) -> (usize, i64) {
    let customer = (stream * 7 + version * 13 + stream * version) % CUSTOMERS;
    let amount = 1 + ((stream * 31 + version * 17) % 97) as i64;
    (customer, amount)
}

/// Append every stream's events, live: `PRODUCERS` tasks, each owning a share of the streams,
/// append one event to each of `STREAMS_PER_APPEND` of its streams per transaction (in
/// stream-id order), pausing a little between transactions.
async fn produce(schema: &str, streams: &[Uuid]) {
    let pool = pool(PRODUCERS as u32).await;
    let sql = format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
         SELECT x.s, 'OrderPlaced', x.d FROM unnest($1::uuid[], $2::jsonb[]) AS x(s, d) ORDER BY x.s"
    );
    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let mine: Vec<(usize, Uuid)> = streams
            .iter()
            .copied()
            .enumerate()
            .filter(|(i, _)| i % PRODUCERS == p)
            .collect();
        let (pool, sql) = (pool.clone(), sql.clone());
        tasks.push(tokio::spawn(async move {
            for version in 1..=EVENTS_PER_STREAM {
                for chunk in mine.chunks(STREAMS_PER_APPEND) {
                    let mut chunk = chunk.to_vec();
                    chunk.sort_by_key(|(_, s)| *s);
                    let ids: Vec<Uuid> = chunk.iter().map(|(_, s)| *s).collect();
                    let data: Vec<serde_json::Value> = chunk
                        .iter()
                        .map(|(i, _)| {
                            let (customer, amount) = order(*i, version);
                            serde_json::json!({"customer": customer, "amount": amount})
                        })
                        .collect();
                    sqlx::query(&sql)
                        .bind(&ids)
                        .bind(&data)
                        .execute(&pool)
                        .await
                        .expect("append");
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Deadlocks the server detected in the test database so far (each session reports its own
/// when its transaction ends; read after the engines stopped).
async fn deadlocks() -> i64 {
    scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").await
}

/// Acceptance (issue 24): 3 engines with default options (but 2 attempts and a short failure
/// backoff, so a conflict counted as a failure dead-letters fast), one perspective with a row
/// per customer that hundreds of streams update, events appended while the engines run. Every
/// aggregate is exact, every stream applied in order exactly once, nothing failed, nothing
/// dead-lettered, and the conflicts really happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_conflicts_between_appliers_are_retried_never_failed() {
    let schema = unique_schema("contend");
    let config = parse_config(&contention_yaml(&schema));
    migrate_config(&config).await;
    let deadlocks_before = deadlocks().await;
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(RunningEngine::start(&config).await);
    }

    // Watch the work rows while the engines run: a conflict must never count an attempt.
    let watch = {
        let sql = format!(
            "SELECT count(*) FROM {schema}.wh_perspective_events WHERE attempts > 0 OR error IS NOT NULL"
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut most = 0;
            while !token.is_cancelled() {
                most = most.max(scalar(&sql).await);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            most
        });
        (stop, task)
    };

    let streams: Vec<Uuid> = (0..STREAMS).map(|_| Uuid::now_v7()).collect();
    produce(&schema, &streams).await;
    // Until every work row is applied and retired (checked after the failure figures below,
    // which say more when it is not).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let left = format!("SELECT count(*) FROM {schema}.wh_perspective_events");
    let mut work_rows_left = scalar(&left).await;
    let started = tokio::time::Instant::now();
    while work_rows_left > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        work_rows_left = scalar(&left).await;
    }
    let took = started.elapsed();
    watch.0.cancel();
    let failing_rows_seen = watch.1.await.unwrap();
    let failures: u64 = engines
        .iter()
        .map(|e| {
            e.metrics
                .failures
                .with_label_values(&["customer_stats"])
                .get()
        })
        .sum();
    // perspective_contention_retries_total, every perspective and SQLSTATE, all engines.
    let retries: u64 = engines
        .iter()
        .flat_map(|e| e.metrics.contention_retries.collect())
        .flat_map(|family| family.get_metric().to_vec())
        .map(|m| m.get_counter().get_value() as u64)
        .sum();
    // (Before the engines stop: today's code leaves them stuck in lock queues.)
    let deadlocks = deadlocks().await - deadlocks_before;
    eprintln!("drained in {took:?}: {retries} contention retries, {deadlocks} deadlock(s)");

    let dead_letters = scalar(&format!("SELECT count(*) FROM {schema}.wh_dead_letters")).await;
    let failed_cursors = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_perspective_cursors WHERE status = {}",
        perspective_worker::store::names::cursor_status::FAILED
    ))
    .await;
    assert_eq!(
        (dead_letters, failed_cursors, failing_rows_seen, failures),
        (0, 0, 0, 0),
        "(dead letters, Failed cursors, most work rows seen with attempts or an error, \
         failures counted) after {deadlocks} deadlock(s)"
    );

    assert_eq!(work_rows_left, 0, "work rows left after 120 s");
    for e in engines {
        e.stop().await;
    }

    // Every aggregate is exact.
    let mut expected: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
    for s in 0..STREAMS {
        for v in 1..=EVENTS_PER_STREAM {
            let (customer, amount) = order(s, v);
            let e = expected.entry(customer as i32).or_default();
            e.0 += 1;
            e.1 += amount;
        }
    }
    let mut conn = connect().await;
    let actual: BTreeMap<i32, (i64, i64)> = sqlx::query_as::<_, (i32, i64, i64)>(&format!(
        "SELECT customer, orders, total FROM {schema}.customer_stats"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .map(|(c, n, t)| (c, (n, t)))
    .collect();
    assert_eq!(actual, expected, "per-customer (orders, total)");
    // Every stream applied once, in order, without a gap or a repeat.
    let bad: Vec<(Uuid, Vec<i64>)> = sqlx::query_as(&format!(
        "SELECT stream_id, versions FROM {schema}.order_versions
         WHERE versions <> ARRAY(SELECT generate_series(1, {EVENTS_PER_STREAM}::bigint))"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        bad.is_empty(),
        "{} stream(s) out of order, e.g. {:?}",
        bad.len(),
        bad.first()
    );
    let applied_streams = scalar(&format!("SELECT count(*) FROM {schema}.order_versions")).await;
    assert_eq!(applied_streams as usize, STREAMS);

    // The conflicts really happened, and were retried rather than failed. (wh_drain gives up a
    // lock wait after 100 ms, before PostgreSQL looks for a deadlock after 1 s: the conflicts
    // show as lock timeouts, 55P03, rather than deadlocks; today's code counted 40P01s.)
    assert!(
        retries > 0,
        "the workload must make the appliers conflict: {retries} retries, {deadlocks} deadlock(s)"
    );
}

/// A lock conflict raised where the apply function does not catch it (the cursor move, after
/// the handlers) and inside a handler: each time nothing is recorded — no attempt, no error,
/// no Failed cursor, no dead letter even with `maxPerspectiveEventAttempts: 1` — and the pair
/// is retried promptly (no failure backoff) until it applies, counted by SQLSTATE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_conflict_is_retried_promptly_and_never_recorded() {
    let schema = unique_schema("conflict");
    let config = parse_config(&recording_yaml(
        &schema,
        "worker:
  maxPerspectiveEventAttempts: 1
  failureRetryBaseMilliseconds: 60000
",
    ));
    migrate_config(&config).await;
    // p2's cursor move fails with a serialization failure the first 3 times, p1's handler with
    // a deadlock the first 3 times.
    let trigger = psql(&format!(
        "CREATE SEQUENCE {schema}.conflicts_p2; CREATE SEQUENCE {schema}.conflicts_p1;
         CREATE FUNCTION {schema}.conflict() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF nextval('{schema}.conflicts_p2') <= 3 THEN
             RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER conflict BEFORE INSERT OR UPDATE ON {schema}.wh_perspective_cursors FOR EACH ROW
         WHEN (NEW.perspective_name = 'p2' AND NEW.status = 2) EXECUTE FUNCTION {schema}.conflict();
         CREATE FUNCTION {schema}.deadlock() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF nextval('{schema}.conflicts_p1') <= 3 THEN
             RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER deadlock BEFORE INSERT OR UPDATE ON {schema}.seen_p1 FOR EACH ROW
         EXECUTE FUNCTION {schema}.deadlock();"
    ));
    assert!(trigger.status.success(), "{trigger:?}");
    let engine = RunningEngine::start(&config).await;
    let stream = Uuid::now_v7();
    let mut conn = connect().await;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A'), ($1, 'A')"
    ))
    .bind(stream)
    .execute(&mut conn)
    .await
    .unwrap();
    // Well before the 60 s failure backoff would let a recorded failure retry.
    wait_until(
        "both perspectives applied the stream",
        Duration::from_secs(20),
        || async {
            scalar(&format!(
                "SELECT count(*) FROM {schema}.seen_p1 s JOIN {schema}.seen_p2 t USING (stream_id)
             WHERE s.versions = '{{1,2}}' AND t.versions = '{{1,2}}'"
            ))
            .await
                == 1
        },
    )
    .await;
    let counted = |state: &str| {
        engine
            .metrics
            .contention_retries
            .with_label_values(&[if state == "40001" { "p2" } else { "p1" }, state])
            .get()
    };
    assert!(
        counted("40001") >= 1 && counted("40P01") >= 1,
        "{}",
        engine.metrics.render()
    );
    assert_eq!(
        engine.metrics.failures.with_label_values(&["p1"]).get()
            + engine.metrics.failures.with_label_values(&["p2"]).get(),
        0
    );
    assert_eq!(
        scalar(&format!(
            "SELECT (SELECT count(*) FROM {schema}.wh_dead_letters)
                  + (SELECT count(*) FROM {schema}.wh_perspective_cursors WHERE status <> 2 OR error IS NOT NULL)
                  + (SELECT count(*) FROM {schema}.wh_perspective_events WHERE attempts > 0 OR error IS NOT NULL)"
        ))
        .await,
        0,
        "dead letters, Failed cursors or failing work rows"
    );
    engine.stop().await;
}

/// What the last heartbeat of `instance` recorded in `wh_service_instances.metadata`.
async fn published(schema: &str, instance: Uuid) -> serde_json::Value {
    let mut conn = connect().await;
    sqlx::query_scalar(&format!(
        "SELECT metadata FROM {schema}.wh_service_instances WHERE instance_id = $1"
    ))
    .bind(instance)
    .fetch_one(&mut conn)
    .await
    .unwrap()
}

/// Issue 24: contention that persists is named. Each instance's heartbeat publishes its lock
/// conflicts of the last minute by perspective in `wh_service_instances.metadata` (beside the
/// config's `instanceMetadata`), and `perspective-worker status` sums them over the live
/// instances, with a hint naming `sequencing` from 10 a minute. The same workload as above,
/// with a heartbeat every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_conflicts_of_the_last_minute_are_in_the_heartbeat_and_in_status() {
    let schema = unique_schema("contended");
    let yaml = format!(
        "{}  heartbeatIntervalSeconds: 1\n  instanceMetadata: {{ zone: eu-1 }}\n",
        contention_yaml(&schema)
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(RunningEngine::start(&config).await);
    }
    let streams: Vec<Uuid> = (0..STREAMS).map(|_| Uuid::now_v7()).collect();
    let started = tokio::time::Instant::now();
    produce(&schema, &streams).await;
    wait_until("every work row applied", Duration::from_secs(120), || {
        let sql = format!("SELECT count(*) FROM {schema}.wh_perspective_events");
        async move { scalar(&sql).await == 0 }
    })
    .await;
    let took = started.elapsed();
    // Each engine's conflicts of customer_stats, by SQLSTATE (its metric).
    let counted: Vec<BTreeMap<String, u64>> = engines
        .iter()
        .map(|e| {
            perspective_worker::db::CONTENTION_SQLSTATES
                .iter()
                .map(|s| {
                    let n = e
                        .metrics
                        .contention_retries
                        .with_label_values(&["customer_stats", s])
                        .get();
                    (s.to_string(), n)
                })
                .filter(|(_, n)| *n > 0)
                .collect()
        })
        .collect();
    let total: u64 = counted.iter().flat_map(|c| c.values()).sum();
    assert!(total > 0, "the workload must make the appliers conflict");
    // Every conflict is younger than a minute (unless the machine was very slow): each
    // heartbeat after the last one publishes them all.
    let exact = took < Duration::from_secs(40);
    for (engine, counted) in engines.iter().zip(&counted) {
        let want: u64 = counted.values().sum();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let metadata = loop {
            let metadata = published(&schema, engine.instance_id).await;
            let got = metadata["contention"]["customer_stats"]["perMinute"].as_u64();
            let done = match got {
                Some(got) if exact => got == want,
                Some(got) => got > 0 && got <= want,
                None => want == 0,
            };
            if done || tokio::time::Instant::now() > deadline {
                break metadata;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(metadata["zone"], "eu-1", "the config's metadata is kept");
        let entry = &metadata["contention"]["customer_stats"];
        if want == 0 {
            assert!(entry.is_null(), "{metadata}");
            continue;
        }
        let got = entry["perMinute"].as_u64().unwrap_or_default();
        if exact {
            assert_eq!(got, want, "{metadata} vs {counted:?} after {took:?}");
        } else {
            assert!(got > 0 && got <= want, "{metadata} vs {counted:?}");
        }
        // The SQLSTATE most of them had.
        let most = counted.values().max().unwrap();
        let sqlstate = entry["sqlstate"].as_str().unwrap_or_default();
        assert_eq!(
            counted.get(sqlstate),
            Some(most),
            "{metadata} vs {counted:?}"
        );
    }

    // `status` sums them over the live instances.
    let path = std::env::temp_dir().join(format!("perspective-{schema}.yaml"));
    std::fs::write(&path, &yaml).unwrap();
    let status = |args: &[&str]| {
        let out = worker_bin()
            .arg("--config")
            .arg(&path)
            .arg("status")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let json: serde_json::Value = serde_json::from_str(&status(&["--json"])).unwrap();
    let p = &json["perspectives"][0];
    assert_eq!(p["name"], "customer_stats");
    let per_minute = p["lockConflictsPerMinute"].as_u64().unwrap();
    if exact {
        assert_eq!(per_minute, total, "{json}");
    } else {
        assert!(per_minute > 0 && per_minute <= total, "{json}");
    }
    assert!(p["lockConflictSqlstate"].is_string(), "{json}");
    let table = status(&[]);
    assert!(table.contains("LOCK CONFLICTS/MIN"), "{table}");
    let hint = format!(
        "customer_stats: {per_minute} lock conflicts a minute between appliers; see sequencing"
    );
    let persistent = per_minute
        >= perspective_worker::store::status::PERSISTENT_LOCK_CONFLICTS_PER_MINUTE as u64;
    assert_eq!(
        table.contains(&hint),
        persistent,
        "{per_minute} a minute: {table}"
    );
    eprintln!("{took:?}, {total} conflicts:\n{table}");
    for e in engines {
        e.stop().await;
    }
    let _ = std::fs::remove_file(&path);
}

/// `read_status` sums the published conflicts of the live instances only, per perspective, with
/// the SQLSTATE of the instance that had the most; metadata of another shape (an old worker's,
/// a hand-written one) counts as none rather than failing the status.
#[tokio::test]
async fn status_sums_the_conflicts_of_live_instances_and_ignores_other_shapes() {
    let (schema, _) = migrated_schema("conflictsum").await;
    let mut conn = connect().await;
    let heartbeat = format!("SELECT {schema}.record_heartbeat($1, 'w', 'h', 1, $2::jsonb)");
    for metadata in [
        r#"{"zone": "a", "contention": {"alpha": {"perMinute": 30, "sqlstate": "55P03"}, "*": {"perMinute": 7, "sqlstate": "55P03"}}}"#,
        r#"{"contention": {"alpha": {"perMinute": 12, "sqlstate": "40P01"}, "beta": {"perMinute": 2.6, "sqlstate": "40001"}}}"#,
        r#"{"contention": {"alpha": {"perMinute": "many"}, "beta": 5}}"#,
        r#"{"contention": "none"}"#,
        r#"{"contention": {"alpha": {"perMinute": -4, "sqlstate": "55P03"}}}"#,
    ] {
        sqlx::query(&heartbeat)
            .bind(Uuid::now_v7())
            .bind(metadata)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    // A silent instance: no longer counted.
    let silent = Uuid::now_v7();
    sqlx::query(&heartbeat)
        .bind(silent)
        .bind(r#"{"contention": {"alpha": {"perMinute": 1000, "sqlstate": "40001"}}}"#)
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {schema}.wh_service_instances SET last_heartbeat_at = now() - interval '1 hour'
         WHERE instance_id = $1"
    ))
    .bind(silent)
    .execute(&mut conn)
    .await
    .unwrap();
    let st = perspective_worker::store::status::read_status(
        &mut conn,
        &schema,
        &["alpha".into(), "beta".into()],
        30.0,
    )
    .await
    .unwrap();
    let figures: Vec<(&str, i64, Option<&str>)> = st
        .perspectives
        .iter()
        .map(|p| {
            (
                p.name.as_str(),
                p.lock_conflicts_per_minute,
                p.lock_conflict_sqlstate.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        figures,
        [("alpha", 42, Some("55P03")), ("beta", 3, Some("40001"))]
    );
    assert_eq!(st.live_instances, 5);
    assert!(st.perspectives[0].lock_contention());
    assert!(!st.perspectives[1].lock_contention());
}
