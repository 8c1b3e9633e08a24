//! Issue 24, DESIGN §12.2: a sequencing choice per perspective. `key`: events with the same key
//! never apply concurrently; `serial`: one applier at a time. Per-stream order and exactly-once
//! hold in every mode. Real PostgreSQL, several engines, events appended while they run.
//!
//! Each handler probes for concurrency itself ([`overlap_probe`]): it takes a transaction-scoped
//! advisory lock of its own (named by the schema) for the event's key with
//! `pg_try_advisory_xact_lock`, which fails when another transaction applied an event of the
//! same key and is still running, and records the overlap.

mod common;

use std::time::Duration;

use common::*;
use uuid::Uuid;

const STREAMS: usize = 160;
const EVENTS_PER_STREAM: usize = 8;
/// The key of a stream's events: one of 8 "customers", shared by many streams.
const KEY: &str = "hashtext(:stream_id::text) & 7";

/// Three perspectives over the same events: one row per key (`by_key`), one global row
/// (`global`), one row per stream (`per_stream`); each records the versions it applied per
/// stream, and the two shared-row ones record every overlap their probe saw.
fn sequencing_yaml(schema: &str, by_key: &str, global: &str) -> String {
    let perspective = |name: &str, sequencing: &str, row: &str| {
        let overlap = overlap_probe(schema, row);
        format!(
            "  - name: {name}
{sequencing}    setup: |
      CREATE TABLE IF NOT EXISTS {name}_rows (k int PRIMARY KEY, events bigint NOT NULL);
      CREATE TABLE IF NOT EXISTS {name}_seen (stream_id uuid PRIMARY KEY, versions bigint[] NOT NULL);
      CREATE TABLE IF NOT EXISTS overlap_log (perspective text NOT NULL, k int NOT NULL);
    handlers:
      A: >-
        INSERT INTO overlap_log SELECT '{name}', {row} WHERE {overlap};
        INSERT INTO {name}_rows AS r VALUES ({row}, 1) ON CONFLICT (k) DO UPDATE SET events = r.events + 1;
        INSERT INTO {name}_seen AS s VALUES (:stream_id, ARRAY[:stream_version])
        ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || :stream_version
"
        )
    };
    format!(
        "schema: {schema}\nperspectives:\n{}{}{}worker:\n  maxPerspectiveEventAttempts: 2\n",
        perspective("by_key", by_key, KEY),
        perspective("global", global, "1000"),
        perspective("per_stream", "", "hashtext(:stream_id::text)"),
    )
}

const KEYED: &str = "    sequencing: key\n    sequencingKey: \"hashtext(:stream_id::text) & 7\"\n";
const SERIAL: &str = "    sequencing: serial\n";

/// Run 3 engines over `STREAMS` streams appended live, until drained; returns the overlaps
/// each shared-row perspective's probe saw.
async fn run(schema: &str, yaml: &str) -> (i64, i64) {
    let config = parse_config(yaml);
    migrate_config(&config).await;
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(RunningEngine::start(&config).await);
    }
    let streams: Vec<Uuid> = (0..STREAMS).map(|_| Uuid::now_v7()).collect();
    append_load(schema, &streams, EVENTS_PER_STREAM, 4, 20).await;
    wait_drained(schema, Duration::from_secs(120)).await;
    for e in engines {
        e.stop().await;
    }
    let overlaps =
        |p: &str| format!("SELECT count(*) FROM {schema}.overlap_log WHERE perspective = '{p}'");
    (
        scalar(&overlaps("by_key")).await,
        scalar(&overlaps("global")).await,
    )
}

/// Every perspective applied every stream exactly once, in order, and its shared rows add up.
async fn assert_exact(schema: &str) {
    for p in ["by_key", "global", "per_stream"] {
        let bad = scalar(&format!(
            "SELECT count(*) FROM {schema}.{p}_seen
             WHERE versions <> ARRAY(SELECT generate_series(1, {EVENTS_PER_STREAM}::bigint))"
        ))
        .await;
        let streams = scalar(&format!("SELECT count(*) FROM {schema}.{p}_seen")).await;
        let total = scalar(&format!(
            "SELECT sum(events)::bigint FROM {schema}.{p}_rows"
        ))
        .await;
        assert_eq!(
            (bad, streams as usize, total as usize),
            (0, STREAMS, STREAMS * EVENTS_PER_STREAM),
            "{p}: (streams out of order, streams applied, events counted)"
        );
    }
    let by_key_rows = scalar(&format!("SELECT count(*) FROM {schema}.by_key_rows")).await;
    assert!(by_key_rows > 1 && by_key_rows <= 8, "{by_key_rows} keys");
    let dead = scalar(&format!("SELECT count(*) FROM {schema}.wh_dead_letters")).await;
    assert_eq!(dead, 0, "dead letters");
}

/// `key` and `serial`: no two transactions ever apply events of the same key (of the
/// perspective) at once, with 3 engines of 4 drain consumers each and live appends; exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_and_serial_never_apply_the_same_key_concurrently() {
    let schema = unique_schema("seq");
    let (by_key, global) = run(&schema, &sequencing_yaml(&schema, KEYED, SERIAL)).await;
    assert_exact(&schema).await;
    assert_eq!((by_key, global), (0, 0), "overlaps seen (by_key, global)");
}

/// The probe can see overlaps: the same perspectives with `sequencing: stream` apply events of
/// one key in several transactions at once (and stay exact: contention is retried).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_stream_sequencing_the_probe_sees_overlaps() {
    let schema = unique_schema("seqoff");
    let (by_key, global) = run(&schema, &sequencing_yaml(&schema, "", "")).await;
    assert_exact(&schema).await;
    assert!(
        by_key + global > 0,
        "overlaps seen (by_key {by_key}, global {global})"
    );
}

/// `examples/sequencing.yaml` (one perspective of each mode) migrates and, with two engines
/// and orders of a few customers appended while they run, builds exact models.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sequencing_example_builds_exact_models() {
    let schema = unique_schema("seqex");
    let example = include_str!("../../examples/sequencing.yaml")
        .replace("schema: sales", &format!("schema: {schema}"));
    let config = parse_config(&example);
    migrate_config(&config).await;
    let engines = [
        RunningEngine::start(&config).await,
        RunningEngine::start(&config).await,
    ];
    let mut conn = connect().await;
    // 60 orders over 6 customers, 5 lines each, in 5 transactions of 60 lines.
    let orders: Vec<Uuid> = (0..60).map(|_| Uuid::now_v7()).collect();
    for line in 0..5 {
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type, event_data)
             SELECT o, 'LineAdded', jsonb_build_object('customer', 'c' || (i % 6), 'price', i + $1)
             FROM unnest($2::uuid[]) WITH ORDINALITY AS x(o, i) ORDER BY o"
        ))
        .bind(line as i64)
        .bind(&orders)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    wait_drained(&schema, Duration::from_secs(60)).await;
    for e in engines {
        e.stop().await;
    }
    let wrong = |sql: String| async move { scalar(&sql).await };
    let per_order = wrong(format!(
        "SELECT count(*) FROM (SELECT stream_id, count(*) n, sum((event_data->>'price')::numeric) t
           FROM {schema}.wh_event_store GROUP BY 1) e FULL JOIN {schema}.order_lines o ON o.order_id = e.stream_id
         WHERE o.lines IS DISTINCT FROM e.n OR o.total IS DISTINCT FROM e.t"
    ))
    .await;
    let per_customer = wrong(format!(
        "SELECT count(*) FROM (SELECT event_data->>'customer' c, count(*) n, sum((event_data->>'price')::numeric) t
           FROM {schema}.wh_event_store GROUP BY 1) e FULL JOIN {schema}.customer_totals x ON x.customer = e.c
         WHERE x.lines IS DISTINCT FROM e.n OR x.total IS DISTINCT FROM e.t"
    ))
    .await;
    let dashboard = wrong(format!(
        "SELECT count(*) FROM {schema}.sales_dashboard d,
           (SELECT count(*) n, sum((event_data->>'price')::numeric) t FROM {schema}.wh_event_store) e
         WHERE d.lines IS DISTINCT FROM e.n OR d.revenue IS DISTINCT FROM e.t"
    ))
    .await
        + 1
        - scalar(&format!("SELECT count(*) FROM {schema}.sales_dashboard")).await;
    let customers = scalar(&format!("SELECT count(*) FROM {schema}.customer_totals")).await;
    assert_eq!(
        (per_order, per_customer, dashboard, customers),
        (0, 0, 0, 6),
        "(wrong order rows, wrong customer rows, wrong dashboard, customers)"
    );
}
