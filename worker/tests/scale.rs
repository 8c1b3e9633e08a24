//! Issue 14: what keeps the engine's cost flat as the work grows (the figures are `make
//! bench-scale`'s; these tests check the mechanisms).

mod common;

use std::time::Duration;

use common::*;
use uuid::Uuid;

/// Autovacuum visits a database once a minute; under churn that is hundreds of megabytes of
/// dead work rows. The engine vacuums its queue tables itself once they hold as many dead rows
/// as live ones (and at least 20 000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_vacuums_its_queue_tables_between_autovacuum_visits() {
    let schema = unique_schema("vacuum");
    let config = parse_config(&recording_yaml(&schema, ""));
    migrate_config(&config).await;
    let vacuums = format!(
        "SELECT vacuum_count FROM pg_stat_user_tables
         WHERE schemaname = '{schema}' AND relname = 'wh_perspective_events'"
    );
    assert_eq!(scalar(&vacuums).await, 0);
    let engine = RunningEngine::start(&config).await;

    // 12 000 events, 2 perspectives: 24 000 work rows applied and deleted.
    let streams: Vec<Uuid> = (0..200).map(|_| Uuid::now_v7()).collect();
    append_load(&schema, &streams, 60, 2, 500).await;
    wait_drained(&schema, Duration::from_secs(60)).await;
    assert_exactly_once(&schema, streams.len()).await;

    // `vacuum_count` counts manual vacuums only (autovacuum's are `autovacuum_count`).
    wait_until(
        "the worker vacuumed wh_perspective_events",
        Duration::from_secs(30),
        || async { scalar(&vacuums).await >= 1 },
    )
    .await;
    let counted = engine
        .metrics
        .queue_vacuums
        .with_label_values(&["wh_perspective_events"])
        .get();
    assert!(
        counted >= 1,
        "perspective_queue_vacuums_total{{table=\"wh_perspective_events\"}} is {counted}"
    );
    engine.stop().await;
}
