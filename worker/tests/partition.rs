//! Partitions between a worker and PostgreSQL (issue 25): a worker connected through a proxy the
//! test owns, which stops forwarding both ways without closing a socket (packets silently
//! dropped). Heartbeat 1 s, stale threshold 4 s, so each scenario takes seconds.
//!
//! - One worker: `/readyz` fails within 3 s of the cut (on the old code it answered 200 for the
//!   whole partition) and is 200 again after the heal.
//! - Three workers, one cut: not ready within 3 s; its streams applied by the others within the
//!   stale threshold plus 4 s; never ready while cut, and `/livez` fails once its attempts to
//!   register again got no answer for a further stale threshold; after the heal it registers again, is ready
//!   and takes new streams; cut again, it stops within the grace period; every read model exact.
//! - A link that is fine, but the instance swept by a peer: it registers again, once.
//! - A database that refuses connections: not ready, live all along, back by itself.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::{address_of, Proxy};
use common::*;
use perspective_worker::config::Config;
use perspective_worker::engine::http::Readiness;
use perspective_worker::engine::EngineOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const STALE: Duration = Duration::from_secs(4);

fn partition_config(schema: &str) -> Config {
    parse_config(&recording_yaml(
        schema,
        "worker:
  heartbeatIntervalSeconds: 1
  abandonStaleInstanceThresholdSeconds: 4
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 200
  drainBatcher: { slidingWindowMilliseconds: 20, maxWaitMilliseconds: 200 }
claimWorker:
  pollingIntervalMilliseconds: 100
",
    ))
}

/// A worker whose database link runs through a proxy, with its HTTP endpoints.
struct CutWorker {
    proxy: Proxy,
    http: SocketAddr,
    http_stop: CancellationToken,
    engine: RunningEngine,
}

impl CutWorker {
    async fn start(config: &Config) -> CutWorker {
        let proxy = Proxy::start(address_of(&database_url())).await;
        let mut options = EngineOptions::new(config.clone(), proxy.url_for(&database_url()));
        options.readiness = Readiness::new("starting");
        let http_stop = CancellationToken::new();
        let (http, _task) = perspective_worker::engine::http::serve(
            "127.0.0.1:0".parse().unwrap(),
            options.readiness.clone(),
            options.metrics.clone(),
            http_stop.clone(),
        )
        .await
        .expect("serve HTTP");
        let engine = RunningEngine::start_with(options).await;
        CutWorker {
            proxy,
            http,
            http_stop,
            engine,
        }
    }

    /// `path`'s status and body.
    async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.http, path).await
    }

    /// Waits until `path` answers `status`; returns how long that took.
    async fn wait_status(&self, path: &str, status: u16, within: Duration) -> Duration {
        let started = Instant::now();
        wait_until(
            &format!("{path} answering {status}"),
            within,
            || async move { self.get(path).await.0 == status },
        )
        .await;
        started.elapsed()
    }

    fn applied(&self) -> u64 {
        ["p1", "p2"]
            .iter()
            .map(|p| {
                self.engine
                    .metrics
                    .events_processed
                    .with_label_values(&[p])
                    .get()
            })
            .sum()
    }
}

/// A minimal HTTP/1.1 GET (`Connection: close`): status and body.
async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .unwrap_or_else(|_| panic!("{path} did not answer within 2 s"))
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {raw:?}"));
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// One event of type A on each of `streams`.
async fn append_one_each(schema: &str, streams: &[Uuid]) {
    let mut conn = connect().await;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_event_store (stream_id, event_type)
         SELECT s, 'A' FROM unnest($1::uuid[]) AS s ORDER BY s"
    ))
    .bind(streams)
    .execute(&mut conn)
    .await
    .expect("append");
}

fn new_streams(n: usize) -> Vec<Uuid> {
    (0..n).map(|_| Uuid::now_v7()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_fails_within_seconds_of_a_cut_and_recovers_after_the_heal() {
    let schema = unique_schema("part_ready");
    let config = partition_config(&schema);
    migrate_config(&config).await;
    let worker = CutWorker::start(&config).await;
    worker
        .wait_status("/readyz", 200, Duration::from_secs(10))
        .await;

    worker.proxy.cut();
    let took = worker
        .wait_status("/readyz", 503, Duration::from_secs(3))
        .await;
    let (_, body) = worker.get("/readyz").await;
    eprintln!("/readyz failed {took:?} after the cut: {body}");
    assert!(body.contains("database unreachable"), "{body}");
    assert_eq!(
        worker.get("/livez").await.0,
        200,
        "a short cut keeps it live"
    );

    worker.proxy.heal();
    let took = worker
        .wait_status("/readyz", 200, Duration::from_secs(10))
        .await;
    eprintln!("/readyz 200 again {took:?} after the heal");
    let streams = new_streams(10);
    append_one_each(&schema, &streams).await;
    wait_drained(&schema, Duration::from_secs(20)).await;
    assert_exactly_once(&schema, streams.len()).await;
    worker.engine.stop().await;
    worker.http_stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_worker_is_taken_over_comes_back_and_stops_within_the_grace_period() {
    let schema = unique_schema("part_three");
    let config = partition_config(&schema);
    migrate_config(&config).await;
    let others = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];
    let worker = CutWorker::start(&config).await;
    let cut_id = worker.engine.instance_id;
    let streams = new_streams(40);
    let stop_producing = Arc::new(AtomicBool::new(false));
    let producers = producers(&schema, &streams, stop_producing.clone());
    let owned_sql =
        format!("SELECT stream_id FROM {schema}.wh_active_streams WHERE assigned_instance_id = $1");
    let mut conn = connect().await;
    let (w, owned_sql_ref) = (&worker, &owned_sql);
    wait_until(
        "the cut worker applying its streams",
        Duration::from_secs(20),
        || async move {
            w.applied() > 0 && {
                let mut c = connect().await;
                let owned: Vec<Uuid> = sqlx::query_scalar(owned_sql_ref)
                    .bind(cut_id)
                    .fetch_all(&mut c)
                    .await
                    .unwrap();
                !owned.is_empty()
            }
        },
    )
    .await;

    // The cut: not ready within seconds.
    worker.proxy.cut();
    let cut_at = Instant::now();
    let owned: Vec<Uuid> = sqlx::query_scalar(&owned_sql)
        .bind(cut_id)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let heads: Vec<(Uuid, i64)> = sqlx::query_as(&format!(
        "SELECT stream_id, version FROM {schema}.wh_streams WHERE stream_id = ANY($1)"
    ))
    .bind(&owned)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let took = worker
        .wait_status("/readyz", 503, Duration::from_secs(3))
        .await;
    eprintln!("/readyz failed {took:?} after the cut");

    // Its streams, up to where they were at the cut, are applied by the others.
    let applied_sql = format!(
        "SELECT count(*) FROM unnest($1::uuid[], $2::bigint[]) AS h(stream_id, version)
         WHERE (SELECT coalesce(cardinality(s.versions), 0) FROM {schema}.seen_p1 s
                WHERE s.stream_id = h.stream_id) >= h.version
           AND (SELECT coalesce(cardinality(s.versions), 0) FROM {schema}.seen_p2 s
                WHERE s.stream_id = h.stream_id) >= h.version"
    );
    let (ids, versions): (Vec<Uuid>, Vec<i64>) = heads.iter().copied().unzip();
    let (applied_sql, ids, versions, expected) = (&applied_sql, &ids, &versions, heads.len());
    wait_until(
        "the cut worker's streams applied by the others",
        (STALE + Duration::from_secs(4)).saturating_sub(cut_at.elapsed()),
        || async move {
            let mut c = connect().await;
            let n: i64 = sqlx::query_scalar(applied_sql)
                .bind(ids)
                .bind(versions)
                .fetch_one(&mut c)
                .await
                .unwrap();
            n as usize == expected
        },
    )
    .await;
    eprintln!(
        "its {} streams applied by the others {:?} after the cut",
        heads.len(),
        cut_at.elapsed()
    );

    // Never ready while cut; it gives up on registering again: /livez fails.
    let deadline = cut_at + STALE * 4;
    loop {
        let (ready, body) = worker.get("/readyz").await;
        assert_eq!(ready, 503, "ready while cut off: {body}");
        if worker.get("/livez").await.0 == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/livez still 200 {:?} after the cut",
            cut_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, livez) = worker.get("/livez").await;
    eprintln!(
        "/livez failed {:?} after the cut: {livez}",
        cut_at.elapsed()
    );
    assert!(livez.contains("no answer from the database"), "{livez}");

    // The heal: it registers again, is ready and live, and takes new streams.
    worker.proxy.heal();
    let took = worker
        .wait_status("/readyz", 200, Duration::from_secs(10))
        .await;
    eprintln!("ready again {took:?} after the heal");
    assert_eq!(worker.get("/livez").await.0, 200);
    let age: f64 = sqlx::query_scalar(&format!(
        "SELECT extract(epoch FROM now() - last_heartbeat_at)::float8
         FROM {schema}.wh_service_instances WHERE instance_id = $1"
    ))
    .bind(cut_id)
    .fetch_one(&mut conn)
    .await
    .expect("registered again");
    assert!(age < STALE.as_secs_f64(), "heartbeat {age} s old");
    let before = worker.applied();
    let fresh = new_streams(30);
    append_one_each(&schema, &fresh).await;
    let w = &worker;
    wait_until(
        "the worker applying new streams",
        Duration::from_secs(15),
        || async move { w.applied() > before },
    )
    .await;

    // Cut again, and SIGTERM: it stops within the grace period.
    worker.proxy.cut();
    worker
        .wait_status("/readyz", 503, Duration::from_secs(3))
        .await;
    let stopping = Instant::now();
    worker.engine.stop().await;
    let took = stopping.elapsed();
    eprintln!("stopped {took:?} after the shutdown began, while cut");
    assert!(took < Duration::from_secs(20), "stopping took {took:?}");
    worker.http_stop.cancel();

    // Exact: nothing lost, nothing applied twice.
    stop_producing.store(true, Ordering::Relaxed);
    for p in producers {
        p.await.unwrap();
    }
    wait_drained(&schema, Duration::from_secs(30)).await;
    assert_exactly_once(&schema, streams.len() + fresh.len()).await;
    for engine in others {
        engine.stop().await;
    }
    drop(worker.proxy);
}

/// The link is fine but a peer's sweep abandoned the instance (its row deleted, its streams
/// released): the next heartbeat notices (it used to re-insert the row and carry on with the
/// streams it no longer owned), and the worker drops its work and registers again, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_instance_was_swept_registers_again() {
    let schema = unique_schema("part_swept");
    let config = partition_config(&schema);
    migrate_config(&config).await;
    let engine = RunningEngine::start(&config).await;
    let first = new_streams(5);
    append_one_each(&schema, &first).await;
    wait_drained(&schema, Duration::from_secs(20)).await;

    // As cleanup_stale_instances does for a silent instance, in one transaction.
    let mut conn = connect().await;
    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    sqlx::query(&format!(
        "UPDATE {schema}.wh_service_instances SET last_heartbeat_at = now() - interval '1 hour'
         WHERE instance_id = $1"
    ))
    .bind(engine.instance_id)
    .execute(&mut *tx)
    .await
    .unwrap();
    let swept: i32 = sqlx::query_scalar(&format!("SELECT {schema}.cleanup_stale_instances($1, 4)"))
        .bind(Uuid::now_v7())
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(swept, 1);

    let metrics = engine.metrics.clone();
    wait_until("registering again", Duration::from_secs(5), || {
        let metrics = metrics.clone();
        async move { metrics.reregistrations.get() == 1 }
    })
    .await;
    let rows = scalar(&format!(
        "SELECT count(*) FROM {schema}.wh_service_instances
         WHERE instance_id = '{}' AND last_heartbeat_at > now() - interval '4 seconds'",
        engine.instance_id
    ))
    .await;
    assert_eq!(rows, 1, "registered again");
    let second = new_streams(5);
    append_one_each(&schema, &second).await;
    append_one_each(&schema, &first).await;
    wait_drained(&schema, Duration::from_secs(20)).await;
    assert_exactly_once(&schema, 10).await;
    // Heartbeats two seconds on: no second re-registration.
    let later = format!(
        "SELECT count(*) FROM {schema}.wh_service_instances
         WHERE instance_id = '{}' AND last_heartbeat_at > $1::timestamptz + interval '2 seconds'",
        engine.instance_id
    );
    let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    wait_until("heartbeats two seconds on", Duration::from_secs(10), || {
        let later = later.clone();
        async move {
            let mut c = connect().await;
            sqlx::query_scalar::<_, i64>(&later)
                .bind(since)
                .fetch_one(&mut c)
                .await
                .unwrap()
                == 1
        }
    })
    .await;
    assert_eq!(engine.metrics.reregistrations.get(), 1);
    engine.stop().await;
}

/// A database that answers with errors (here: connections refused, like a server that is down)
/// is not a dead link: the worker is not ready, starts over once abandoned and waits, live — a
/// restart would not help, and every pod would restart at once — and registers again by itself
/// when the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_refuses_connections_keeps_the_worker_live_until_it_is_back() {
    let schema = unique_schema("part_down");
    let config = partition_config(&schema);
    migrate_config(&config).await;
    let worker = CutWorker::start(&config).await;
    worker
        .wait_status("/readyz", 200, Duration::from_secs(10))
        .await;

    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    worker.proxy.set_upstream(closed);
    worker.proxy.reset_connections();
    let down_at = Instant::now();
    let took = worker
        .wait_status("/readyz", 503, Duration::from_secs(3))
        .await;
    eprintln!("/readyz failed {took:?} after the database went down");
    // Abandoned after the stale threshold, then refused for longer than one more (a dead link
    // fails /livez then): still live.
    while down_at.elapsed() < STALE * 5 / 2 {
        let (live, body) = worker.get("/livez").await;
        assert_eq!(
            live,
            200,
            "{:?} after the database went down: {body}",
            down_at.elapsed()
        );
        assert_eq!(worker.get("/readyz").await.0, 503);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, body) = worker.get("/readyz").await;
    assert!(body.contains("abandoned, registering again"), "{body}");

    worker.proxy.set_upstream(address_of(&database_url()));
    let took = worker
        .wait_status("/readyz", 200, Duration::from_secs(10))
        .await;
    eprintln!("ready again {took:?} after the database came back");
    assert_eq!(worker.engine.metrics.reregistrations.get(), 1);
    let streams = new_streams(5);
    append_one_each(&schema, &streams).await;
    wait_drained(&schema, Duration::from_secs(20)).await;
    assert_exactly_once(&schema, streams.len()).await;
    worker.engine.stop().await;
    worker.http_stop.cancel();
}
