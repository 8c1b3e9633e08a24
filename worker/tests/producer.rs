//! The producer contract against a real PostgreSQL: plain INSERTs create work rows in the same
//! transaction, stream versions follow commit order, the doorbell NOTIFY, optimistic
//! concurrency, duplicate ids and schema isolation.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use sqlx::postgres::PgListener;
use sqlx::{Connection, Row};
use uuid::Uuid;

/// (event_type, stream_version, perspectives with a work row) for every event of `stream`.
async fn fan_out(schema: &str, stream: Uuid) -> Vec<(String, i64, Vec<String>)> {
    let mut conn = connect().await;
    sqlx::query(&format!(
        "SELECT e.event_type, e.stream_version,
                coalesce(array_agg(w.perspective_name ORDER BY w.perspective_name)
                         FILTER (WHERE w.perspective_name IS NOT NULL), '{{}}')
         FROM {schema}.wh_event_store e
         LEFT JOIN {schema}.wh_perspective_events w
                ON w.event_id = e.event_id AND w.stream_id = e.stream_id AND w.stream_version = e.stream_version
         WHERE e.stream_id = $1
         GROUP BY e.event_id, e.event_type, e.stream_version
         ORDER BY e.stream_version"
    ))
    .bind(stream)
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

fn assert_psql_ok(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "psql failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn plain_insert_through_psql_creates_one_work_row_per_subscribed_perspective() {
    let (schema, _) = migrated_schema("fanout").await;
    let stream = Uuid::now_v7();
    // An empty search_path and a decoy table in public prove the trigger never resolves names
    // through the caller's search_path.
    let out = psql(&format!(
        "CREATE TABLE IF NOT EXISTS public.wh_streams (stream_id uuid, version bigint);
         SET search_path TO '';
         BEGIN;
         INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
           VALUES ('{stream}', 'A', '{{}}'), ('{stream}', 'B', '{{\"total\": 5}}');
         INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ('{stream}', 'C');
         INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ('{stream}', 'D');
         COMMIT;"
    ));
    assert_psql_ok(&out);

    let rows = fan_out(&schema, stream).await;
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        rows,
        vec![
            ("A".to_string(), 1, s(&["alpha"])),
            ("B".to_string(), 2, s(&["alpha", "beta"])),
            ("C".to_string(), 3, s(&["beta"])),
            ("D".to_string(), 4, s(&[])),
        ]
    );

    let mut conn = connect().await;
    let (head, work, partitions): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT version FROM {schema}.wh_streams WHERE stream_id = $1),
                (SELECT count(*) FROM {schema}.wh_perspective_events),
                (SELECT count(DISTINCT partition_number) FROM {schema}.wh_perspective_events
                 WHERE partition_number = {schema}.compute_partition($1))"
    ))
    .bind(stream)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(head, 4, "wh_streams holds the stream head");
    assert_eq!(work, 4, "A→alpha, B→alpha+beta, C→beta, D→nothing");
    assert_eq!(
        partitions, 1,
        "work rows carry compute_partition(stream_id)"
    );
    let public_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM public.wh_streams")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(public_rows, 0, "the decoy table in public was not touched");

    // Event ids are UUIDv7 (version nibble 7) and increase with time.
    let ids: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT event_id FROM {schema}.wh_event_store WHERE stream_id = $1 ORDER BY stream_version"
    ))
    .bind(stream)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(ids.iter().all(|id| id.get_version_num() == 7), "{ids:?}");
}

/// Waits until backend `pid` is blocked on a lock.
async fn wait_for_lock_wait(pid: i32) {
    let pool = pool(1).await;
    wait_until("the second writer to block on the stream lock", Duration::from_secs(10), || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1",
            )
            .bind(pid)
            .fetch_optional(&pool)
            .await
            .unwrap()
            .unwrap_or(false)
        }
    })
    .await;
}

#[tokio::test]
async fn stream_versions_follow_commit_order_and_stay_gapless_after_rollback() {
    let (schema, _) = migrated_schema("commitord").await;
    let stream = Uuid::now_v7();
    let insert = format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A') RETURNING stream_version");

    for t1_commits in [true, false] {
        let before: i64 = {
            let mut c = connect().await;
            sqlx::query_scalar(&format!("SELECT coalesce(max(stream_version), 0) FROM {schema}.wh_event_store WHERE stream_id = $1"))
                .bind(stream)
                .fetch_one(&mut c)
                .await
                .unwrap()
        };
        let mut c1 = connect().await;
        let mut t1 = c1.begin().await.unwrap();
        let v1: i64 = sqlx::query_scalar(&insert)
            .bind(stream)
            .fetch_one(&mut *t1)
            .await
            .unwrap();
        assert_eq!(v1, before + 1);

        let mut c2 = connect().await;
        let pid2: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut c2)
            .await
            .unwrap();
        let insert2 = insert.clone();
        let t2 = tokio::spawn(async move {
            let v: i64 = sqlx::query_scalar(&insert2)
                .bind(stream)
                .fetch_one(&mut c2)
                .await
                .unwrap();
            v
        });
        wait_for_lock_wait(pid2).await;
        assert!(!t2.is_finished(), "T2 must wait for T1");
        if t1_commits {
            t1.commit().await.unwrap();
            assert_eq!(t2.await.unwrap(), v1 + 1, "T2 gets the version after T1's");
        } else {
            t1.rollback().await.unwrap();
            assert_eq!(
                t2.await.unwrap(),
                v1,
                "T1 rolled back: T2 takes its version, no gap"
            );
        }
    }
}

#[tokio::test]
async fn concurrent_appenders_leave_unique_gapless_versions() {
    let (schema, _) = migrated_schema("concur").await;
    let streams: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    let pool = pool(8).await;
    let mut tasks = Vec::new();
    for writer in 0..8usize {
        let pool = pool.clone();
        let schema = schema.clone();
        let streams = streams.clone();
        tasks.push(tokio::spawn(async move {
            let sql = format!(
                "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data) VALUES ($1, 'B', $2)"
            );
            for i in 0..500usize {
                let stream = streams[(writer * 7 + i * 3) % streams.len()];
                sqlx::query(&sql)
                    .bind(stream)
                    .bind(serde_json::json!({"writer": writer, "seq": i, "total": 1}))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    let mut conn = connect().await;
    let rows = sqlx::query(&format!(
        "SELECT stream_id, count(*), min(stream_version), max(stream_version), count(DISTINCT stream_version)
         FROM {schema}.wh_event_store GROUP BY stream_id"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mut total = 0;
    for r in &rows {
        let (n, lo, hi, distinct): (i64, i64, i64, i64) = (r.get(1), r.get(2), r.get(3), r.get(4));
        assert_eq!(
            (lo, hi, distinct),
            (1, n, n),
            "stream {} is not 1..{n} without gaps",
            r.get::<Uuid, _>(0)
        );
        total += n;
    }
    assert_eq!(total, 4000);
    assert_eq!(rows.len(), 5);

    // Each writer's own events are in increasing version order per stream (a writer commits
    // one event before starting the next, so commit order must show in the versions).
    let per_writer = sqlx::query(&format!(
        "SELECT stream_id, (event_data->>'writer')::int, array_agg(stream_version ORDER BY (event_data->>'seq')::int)
         FROM {schema}.wh_event_store GROUP BY 1, 2"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    for r in per_writer {
        let versions: Vec<i64> = r.get(2);
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "versions out of commit order: {versions:?}"
        );
    }

    // B is subscribed by both perspectives: two work rows per event, all distinct.
    let (work, distinct): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(DISTINCT (stream_id, perspective_name, stream_version)) FROM {schema}.wh_perspective_events"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((work, distinct), (8000, 8000));
}

/// A listener on the schema's doorbell channel and on its sentinel channel; the doorbell's name.
async fn doorbell_listener(schema: &str) -> (PgListener, String) {
    let channel = perspective_worker::store::names::work_channel(schema);
    let mut listener = PgListener::connect(&database_url()).await.unwrap();
    listener.listen(&channel).await.unwrap();
    listener
        .listen(&format!("{channel}_sentinel"))
        .await
        .unwrap();
    (listener, channel)
}

/// Sentinels make "nothing arrived" deterministic: notifications reach a listener in commit
/// order, so if the next message is the sentinel, nothing was sent before it.
async fn sentinel(conn: &mut sqlx::PgConnection, channel: &str, tag: &str) {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(format!("{channel}_sentinel"))
        .bind(tag)
        .execute(conn)
        .await
        .unwrap();
}

/// The next notification: (channel, payload).
async fn next(listener: &mut PgListener) -> (String, String) {
    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    (n.channel().to_string(), n.payload().to_string())
}

#[tokio::test]
async fn doorbell_notifies_once_per_transaction_after_commit_and_never_on_rollback() {
    let (schema, _) = migrated_schema("notify").await;
    let (mut listener, channel) = doorbell_listener(&schema).await;
    let mut conn = connect().await;
    let mut other = connect().await;
    let insert =
        format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, $2)");

    // One transaction, three events on two new streams.
    let (s1, s2) = (Uuid::now_v7(), Uuid::now_v7());
    let mut tx = conn.begin().await.unwrap();
    for (s, t) in [(s1, "A"), (s1, "B"), (s2, "C")] {
        sqlx::query(&insert)
            .bind(s)
            .bind(t)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    sentinel(&mut other, &channel, "before-commit").await;
    assert_eq!(
        next(&mut listener).await,
        (format!("{channel}_sentinel"), "before-commit".into()),
        "nothing before commit"
    );
    tx.commit().await.unwrap();
    assert_eq!(
        next(&mut listener).await,
        (channel.clone(), String::new()),
        "doorbell after commit"
    );
    sentinel(&mut other, &channel, "after-commit").await;
    assert_eq!(
        next(&mut listener).await.1,
        "after-commit",
        "exactly one doorbell for the transaction"
    );

    // A rolled-back transaction rings nothing.
    let s3 = Uuid::now_v7();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(&insert)
        .bind(s3)
        .bind("A")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    sentinel(&mut other, &channel, "after-rollback").await;
    assert_eq!(
        next(&mut listener).await.1,
        "after-rollback",
        "no doorbell for a rollback"
    );

    // Edge-triggered: s1 already has pending work, so more work for it rings nothing; an
    // unsubscribed event type creates no work and rings nothing.
    sqlx::query(&insert)
        .bind(s1)
        .bind("A")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(&insert)
        .bind(Uuid::now_v7())
        .bind("D")
        .execute(&mut conn)
        .await
        .unwrap();
    sentinel(&mut other, &channel, "edge").await;
    assert_eq!(
        next(&mut listener).await.1,
        "edge",
        "no doorbell while the stream already has work"
    );

    // Once the stream's queue is drained (work rows and its active-stream row gone, as a
    // worker leaves it), the next event rings again.
    sqlx::raw_sql(&format!(
        "DELETE FROM {schema}.wh_perspective_events WHERE stream_id = '{s1}';
         DELETE FROM {schema}.wh_active_streams WHERE stream_id = '{s1}';"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query(&insert)
        .bind(s1)
        .bind("B")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        next(&mut listener).await,
        (channel.clone(), String::new()),
        "doorbell on the empty→non-empty edge"
    );
}

#[tokio::test]
async fn append_events_checks_the_expected_version_and_writes_all_or_nothing() {
    let (schema, _) = migrated_schema("appendev").await;
    let mut conn = connect().await;
    let stream = Uuid::now_v7();
    let call = format!("SELECT event_id, stream_version FROM {schema}.append_events($1, $2, $3)");

    let rows = sqlx::query(&call)
        .bind(stream)
        .bind(0i64)
        .bind(serde_json::json!([
            {"event_type": "A", "event_data": {"n": 1}, "metadata": {"user_id": "u-1"}},
            {"event_type": "B", "event_data": {"total": 2}, "scope": {"tenant_id": "t-1"}}
        ]))
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let versions: Vec<i64> = rows.iter().map(|r| r.get(1)).collect();
    assert_eq!(versions, vec![1, 2]);

    let stale = sqlx::query(&call)
        .bind(stream)
        .bind(1i64)
        .bind(serde_json::json!([{"event_type": "A"}, {"event_type": "C"}]))
        .fetch_all(&mut conn)
        .await
        .unwrap_err();
    let db = stale.as_database_error().expect("a database error");
    assert_eq!(db.code().as_deref(), Some("WH409"));
    let msg = db.message();
    assert!(msg.contains(&stream.to_string()), "{msg}");
    assert!(msg.contains("expected version 1"), "{msg}");
    assert!(msg.contains("at version 2"), "{msg}");

    let (events, work, head): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT count(*) FROM {schema}.wh_event_store), (SELECT count(*) FROM {schema}.wh_perspective_events),
                (SELECT version FROM {schema}.wh_streams WHERE stream_id = $1)"
    ))
    .bind(stream)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        (events, work, head),
        (2, 3, 2),
        "the stale append wrote nothing"
    );

    // NULL expected version appends at the head.
    let v: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT stream_version FROM {schema}.append_events($1, NULL, $2)"
    ))
    .bind(stream)
    .bind(serde_json::json!([{"event_type": "C"}]))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(v, vec![3]);

    // Malformed batches name the bad element.
    let bad = sqlx::query(&call)
        .bind(stream)
        .bind(3i64)
        .bind(serde_json::json!([{"event_type": "A"}, {"event_data": {}}]))
        .fetch_all(&mut conn)
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("event 2 of 2"), "{bad}");

    // Two writers racing to create the same stream with expected version 0: one wins.
    let fresh = Uuid::now_v7();
    let pool = pool(2).await;
    let attempts = (0..2).map(|_| {
        let q = call.clone();
        let pool = pool.clone();
        tokio::spawn(async move {
            sqlx::query(&q)
                .bind(fresh)
                .bind(0i64)
                .bind(serde_json::json!([{"event_type": "A"}]))
                .fetch_all(&pool)
                .await
        })
    });
    let mut ok = 0;
    for a in attempts {
        match a.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) => assert_eq!(
                perspective_worker::db::sqlstate(&e).as_deref(),
                Some("WH409"),
                "{e}"
            ),
        }
    }
    assert_eq!(ok, 1);

    // A plain INSERT that states its stream_version gets the same check.
    let wrong = psql(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, stream_version, event_type) VALUES ('{stream}', 9, 'A')"
    ));
    assert!(!wrong.status.success());
    assert!(String::from_utf8_lossy(&wrong.stderr)
        .contains("expected version 8 but the stream is at version 3"));
}

#[tokio::test]
async fn reinserting_an_event_id_is_an_error_and_never_a_second_work_row() {
    let (schema, _) = migrated_schema("dupid").await;
    let stream = Uuid::now_v7();
    let id = Uuid::now_v7();
    let insert =
        format!("INSERT INTO {schema}.wh_event_store (event_id, stream_id, event_type) VALUES ('{id}', '{stream}', 'B')");
    assert_psql_ok(&psql(&insert));
    for attempt in [
        insert.clone(),
        format!("{insert} ON CONFLICT DO NOTHING"),
        {
            // Same id on another stream.
            insert.replace(&stream.to_string(), &Uuid::now_v7().to_string())
        },
    ] {
        let out = psql(&attempt);
        assert!(!out.status.success(), "{attempt} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("event {id} already exists")), "{err}");
    }
    let mut conn = connect().await;
    let (events, work, head): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT count(*) FROM {schema}.wh_event_store), (SELECT count(*) FROM {schema}.wh_perspective_events),
                (SELECT max(version) FROM {schema}.wh_streams)"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((events, work, head), (1, 2, 1));

    // A duplicate inside one multi-row statement is caught too.
    let id2 = Uuid::now_v7();
    let out = psql(&format!(
        "INSERT INTO {schema}.wh_event_store (event_id, stream_id, event_type) VALUES ('{id2}', '{stream}', 'A'), ('{id2}', '{stream}', 'A')"
    ));
    assert!(!out.status.success());

    // History is append-only.
    let out = psql(&format!(
        "UPDATE {schema}.wh_event_store SET event_type = 'X'"
    ));
    assert!(String::from_utf8_lossy(&out.stderr).contains("append-only"));
}

#[tokio::test]
async fn two_schemas_in_one_database_are_independent() {
    let (one, _) = migrated_schema("iso_a").await;
    let (two, _) = migrated_schema("iso_b").await;
    let stream = Uuid::now_v7();
    assert_psql_ok(&psql(&format!(
        "INSERT INTO {one}.wh_event_store (stream_id, event_type) VALUES ('{stream}', 'B')"
    )));
    let mut conn = connect().await;
    let counts = |schema: &str| {
        format!(
            "SELECT (SELECT count(*) FROM {schema}.wh_event_store), (SELECT count(*) FROM {schema}.wh_perspective_events),
                    (SELECT count(*) FROM {schema}.wh_active_streams)"
        )
    };
    let a: (i64, i64, i64) = sqlx::query_as(&counts(&one))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let b: (i64, i64, i64) = sqlx::query_as(&counts(&two))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(a, (1, 2, 1));
    assert_eq!(b, (0, 0, 0));

    // The same stream id appended in the second schema starts its own version sequence.
    assert_psql_ok(&psql(&format!(
        "INSERT INTO {two}.wh_event_store (stream_id, event_type) VALUES ('{stream}', 'A')"
    )));
    let v: i64 = sqlx::query_scalar(&format!("SELECT stream_version FROM {two}.wh_event_store"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, 1);
    let actives: HashSet<String> = sqlx::query_scalar(
        "SELECT table_schema::text FROM information_schema.tables WHERE table_name = 'wh_active_streams' AND table_schema = ANY($1)",
    )
    .bind(vec![one.clone(), two.clone()])
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(actives, HashSet::from([one.clone(), two.clone()]));
}

/// Issue 26, finding 4: a producer role with exactly USAGE on the schema, INSERT on the store
/// and EXECUTE on `append_events` appends both ways, its events are applied, and every engine
/// table refuses it (before, a plain INSERT failed with "permission denied for table
/// wh_streams", and the grants that made it work let a producer stall or gap other streams).
/// A role without EXECUTE cannot call `append_events`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_4_a_producer_needs_only_insert_and_execute_and_touches_nothing_else() {
    let schema = unique_schema("prodrole");
    let config = parse_config(&recording_yaml(&schema, QUICK_OPTIONS));
    migrate_config(&config).await;
    let (producer, bystander) = (format!("{schema}_producer"), format!("{schema}_reader"));
    let out = psql(&format!(
        "CREATE ROLE {producer} LOGIN; CREATE ROLE {bystander} LOGIN;
         GRANT USAGE ON SCHEMA {schema} TO {producer}, {bystander};
         GRANT INSERT ON {schema}.wh_event_store TO {producer};
         GRANT EXECUTE ON FUNCTION {schema}.append_events(uuid, bigint, jsonb) TO {producer};"
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut conn = connect_as(&producer).await;
    let (plain, batch) = (Uuid::now_v7(), Uuid::now_v7());
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A'), ($1, 'B')"
    ))
    .bind(plain)
    .execute(&mut conn)
    .await
    .expect("a plain INSERT as the producer");
    let versions: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT stream_version FROM {schema}.append_events($1, 0, '[{{\"event_type\": \"A\"}}, {{\"event_type\": \"B\"}}]')"
    ))
    .bind(batch)
    .fetch_all(&mut conn)
    .await
    .expect("append_events as the producer");
    assert_eq!(versions, [1, 2]);

    let tables = [
        "wh_streams",
        "wh_perspective_events",
        "wh_active_streams",
        "wh_perspective_cursors",
        "wh_dead_letters",
        "wh_service_instances",
        "wh_perspective_subscriptions",
        "seen_p1",
    ];
    for table in tables {
        for sql in [
            format!("SELECT * FROM {schema}.{table}"),
            format!("DELETE FROM {schema}.{table}"),
        ] {
            assert_eq!(refused(&mut conn, &sql).await, "42501", "{sql}");
        }
    }
    for sql in [
        format!("SELECT * FROM {schema}.wh_event_store"),
        format!("UPDATE {schema}.wh_streams SET version = 0"),
        format!(
            "INSERT INTO {schema}.wh_perspective_events (stream_id, perspective_name, event_id, stream_version, partition_number)
             VALUES ('{plain}', 'p1', gen_random_uuid(), 3, 0)"
        ),
        format!("INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ('{plain}', 'A') RETURNING event_data"),
    ] {
        assert_eq!(refused(&mut conn, &sql).await, "42501", "{sql}");
    }
    let mut other = connect_as(&bystander).await;
    let sql = format!(
        "SELECT {schema}.append_events(gen_random_uuid(), 0, '[{{\"event_type\": \"A\"}}]')"
    );
    assert_eq!(refused(&mut other, &sql).await, "42501", "{sql}");

    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    assert_exactly_once(&schema, 2).await;
    drop((conn, other));
    let out = psql(&format!(
        "DROP OWNED BY {producer}, {bystander}; DROP ROLE {producer}; DROP ROLE {bystander};"
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// While every worker that is not stopping is awake (claiming at its pace under load), a
/// stream's first row rings no doorbell; an asleep worker, or a REPEATABLE READ producer (whose
/// look at the workers would be older than its lock), makes it ring. A worker goes back to sleep
/// only when no producer is between such a row and its commit: otherwise it stays awake.
#[tokio::test]
async fn doorbell_is_silent_while_every_worker_is_awake_and_a_worker_sleeps_only_between_edges() {
    let (schema, _) = migrated_schema("awake").await;
    let (mut listener, channel) = doorbell_listener(&schema).await;
    let mut conn = connect().await;
    let mut other = connect().await;
    // Whether the doorbell rang before a sentinel sent now.
    async fn rang(
        listener: &mut PgListener,
        other: &mut sqlx::PgConnection,
        channel: &str,
    ) -> bool {
        sentinel(other, channel, "sentinel").await;
        if next(listener).await.0 == channel {
            assert_eq!(
                next(listener).await.1,
                "sentinel",
                "one doorbell, then the sentinel"
            );
            true
        } else {
            false
        }
    }
    async fn append(conn: &mut sqlx::PgConnection, schema: &str) {
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type) VALUES ($1, 'A')"
        ))
        .bind(Uuid::now_v7())
        .execute(conn)
        .await
        .unwrap();
    }
    async fn set(conn: &mut sqlx::PgConnection, schema: &str, id: Uuid, to: bool) -> bool {
        sqlx::query_scalar(&format!("SELECT {schema}.wh_claim_awake($1, $2)"))
            .bind(id)
            .bind(to)
            .fetch_one(conn)
            .await
            .unwrap()
    }
    let register = format!(
        "INSERT INTO {schema}.wh_service_instances (instance_id, service_name, host_name, process_id)
         VALUES ($1, 't', 'h', 1)"
    );

    // No worker registered, or one asleep: rings.
    append(&mut conn, &schema).await;
    assert!(
        rang(&mut listener, &mut other, &channel).await,
        "no worker: rings"
    );
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    sqlx::query(&register)
        .bind(a)
        .execute(&mut conn)
        .await
        .unwrap();
    append(&mut conn, &schema).await;
    assert!(
        rang(&mut listener, &mut other, &channel).await,
        "a worker asleep: rings"
    );

    // Awake: silent.
    assert!(set(&mut conn, &schema, a, true).await);
    append(&mut conn, &schema).await;
    assert!(
        !rang(&mut listener, &mut other, &channel).await,
        "every worker awake: silent"
    );
    // A REPEATABLE READ producer rings all the same.
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    append(&mut tx, &schema).await;
    tx.commit().await.unwrap();
    assert!(
        rang(&mut listener, &mut other, &channel).await,
        "REPEATABLE READ: rings"
    );
    // A second worker, asleep: rings; once it is stopping it no longer counts.
    sqlx::query(&register)
        .bind(b)
        .execute(&mut conn)
        .await
        .unwrap();
    append(&mut conn, &schema).await;
    assert!(
        rang(&mut listener, &mut other, &channel).await,
        "one worker asleep: rings"
    );
    sqlx::query(&format!(
        "UPDATE {schema}.wh_service_instances SET stopping_since = now() WHERE instance_id = $1"
    ))
    .bind(b)
    .execute(&mut conn)
    .await
    .unwrap();
    append(&mut conn, &schema).await;
    assert!(
        !rang(&mut listener, &mut other, &channel).await,
        "the asleep one is stopping: silent"
    );

    // A producer between a new stream's first row and its commit keeps the worker awake.
    let mut tx = conn.begin().await.unwrap();
    append(&mut tx, &schema).await;
    assert!(
        set(&mut other, &schema, a, false).await,
        "a producer is mid-edge: stays awake"
    );
    tx.commit().await.unwrap();
    assert!(
        !rang(&mut listener, &mut other, &channel).await,
        "it saw the worker awake"
    );
    assert!(
        !set(&mut other, &schema, a, false).await,
        "no producer mid-edge: asleep"
    );
    append(&mut conn, &schema).await;
    assert!(
        rang(&mut listener, &mut other, &channel).await,
        "asleep again: rings"
    );
    // The doorbell lock (a bigint key: classid is its high half, objid its low) is released at
    // commit.
    let held: i64 = scalar(&format!(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
           AND ((classid::bigint << 32) | objid::bigint) = hashtextextended('{schema}.wh_doorbell', 0)"
    ))
    .await;
    assert_eq!(
        held, 0,
        "no producer holds the doorbell lock after its commit"
    );
}
