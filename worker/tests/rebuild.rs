//! `rebuild` racing draining workers: rounds of rebuilds while producers append and engines
//! apply, and afterwards every stream's recorded versions are exactly 1..n.
//!
//! The race (issue 10): `wh_drain` reads a pair's window of work rows before the apply function
//! locks the cursor. A rebuild of the stream committing in between (it holds the cursor lock
//! while it resets the model, drops the cursor and re-queues the history under new work ids)
//! left the apply a fresh cursor at 0 and the old window N..M: it applied N..M onto the reset
//! model and moved the cursor to M, and the replayed rows 1..M were then retired as "at or below
//! the cursor" — 1..N-1 lost. The same happened through the cursor value wh_drain's loop read
//! at the start of the call (its retire and window used it long after). Without the fix this
//! test loses versions (e.g. p1 of a stream `[51, 52, 53]`); with it, the window and the retire
//! read the cursor in their own statement, the apply function applies nothing when the window's
//! first row is gone (a rebuild replaced it), and `rebuild` creates a missing cursor row before
//! locking it. The test also caught a rebuild racing the cleanup of drained streams (re-queued
//! rows left without an active stream, never drained): `rebuild` now holds the stream's head row.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use uuid::Uuid;

/// Small groups and quick retries, so a drain call crosses many (stream, perspective) pairs and
/// a rebuild lands between its reads and its applies often.
const BUSY: &str = "worker:
  perspectiveBatchSize: 5
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 200
  drainBatcher: { slidingWindowMilliseconds: 5, maxWaitMilliseconds: 50 }
claimWorker:
  pollingIntervalMilliseconds: 100
";

const STREAMS: usize = 40;
const ROUNDS: usize = 10;
/// Appends while the rebuilds run, at most: each round re-queues the whole history.
const MAX_APPENDS: usize = 1200;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebuilds_racing_draining_workers_leave_every_stream_exactly_once_in_order() {
    // Its own database: the deadlock count below is database-wide (make test runs other suites
    // beside this one; a deadlock of theirs failed it in CI).
    use_own_database("rbrace").await;
    let schema = unique_schema("rbrace");
    // p1 can be rebuilt; p2 is never rebuilt and must not notice.
    let yaml = recording_yaml(&schema, BUSY).replacen(
        "    handlers:",
        "    reset: |\n      DELETE FROM seen_p1 WHERE stream_id = :stream_id;\n      SELECT pg_sleep(0.002)\n    handlers:",
        1,
    );
    // p0 sorts first, so a drain call applies it before p1 of the same stream; its handler
    // sleeps, so the call's snapshot of the cursors ages while rebuilds of p1 commit.
    let yaml = yaml.replacen(
        "perspectives:\n",
        "perspectives:
  - name: p0
    setup: CREATE TABLE IF NOT EXISTS slow_p0 (stream_id uuid, stream_version bigint)
    handlers:
      A: INSERT INTO slow_p0 SELECT :stream_id, :stream_version FROM pg_sleep(0.001)
",
        1,
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let deadlocks_before = deadlocks().await;
    let streams: Vec<Uuid> = (0..STREAMS).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 3, 2, 10).await;

    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(RunningEngine::start(&config).await);
    }

    // Producers: one event to each of a few streams per transaction, until the rebuilds end.
    let stop = Arc::new(AtomicBool::new(false));
    let producers_pool = pool(2).await;
    let mut producers = Vec::new();
    for w in 0..2 {
        let pool = producers_pool.clone();
        let stop = stop.clone();
        let streams = streams.clone();
        let sql = format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type)
             SELECT s, 'A' FROM unnest($1::uuid[]) AS x(s) ORDER BY s"
        );
        producers.push(tokio::spawn(async move {
            let mut i = w;
            for _ in 0..MAX_APPENDS / 4 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let mut chunk: Vec<Uuid> = (0..2)
                    .map(|k| streams[(i * 7 + k * 11) % STREAMS])
                    .collect();
                chunk.sort();
                chunk.dedup();
                sqlx::query(&sql)
                    .bind(&chunk)
                    .execute(&pool)
                    .await
                    .expect("append");
                i += 2;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }

    // Rebuild rounds back to back, while the engines drain what the producers and the previous
    // round queued.
    let started = Instant::now();
    let mut conn = connect().await;
    for _ in 0..ROUNDS {
        let report =
            perspective_worker::engine::catchup::plan::rebuild(&mut conn, &config, "p1", |_, _| {})
                .await
                .expect("rebuild");
        assert_eq!(report.streams, STREAMS as i64);
    }
    let rebuilding = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await.unwrap();
    }
    wait_drained(&schema, Duration::from_secs(60)).await;
    for e in engines {
        e.stop().await;
    }
    eprintln!("{ROUNDS} rebuild rounds in {rebuilding:?}");
    assert_exactly_once(&schema, STREAMS).await;
    // Nothing here waits on another in a cycle: completions skip rows others hold, and wh_drain
    // retires the rows of pairs it applied nothing to after its last cursor lock. (Before, the
    // flush, wh_drain and the job chunks deadlocked several times a run, a second each.)
    assert_eq!(
        deadlocks().await - deadlocks_before,
        0,
        "deadlocks while rebuilding (in this test's own database)"
    );
}

/// Deadlocks the server detected in the test database so far (each engine session reports
/// its own when it ends, so read this after the engines stopped).
async fn deadlocks() -> i64 {
    // (A fresh session: no cached statistics snapshot to clear.)
    let mut conn = connect().await;
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut conn)
        .await
        .unwrap()
}
