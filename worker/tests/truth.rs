//! Issue 12 ("Engine"): what the engine says and records is true — identities, lifecycle
//! stages, latencies, logs — and the event store stays append-only.

mod common;

use std::time::Duration;

use common::*;
use uuid::Uuid;

const FAST: &str = "worker:
  failureRetryBaseMilliseconds: 20
  failureRetryMaxMilliseconds: 200
  drainBatcher: { slidingWindowMilliseconds: 20, maxWaitMilliseconds: 200 }
claimWorker:
  pollingIntervalMilliseconds: 100
";

/// `perspective.user_id` and `perspective.tenant_id` (and `:user_id` / `:tenant_id`) come from
/// `metadata`, else `scope`, for both keys, and only from JSON strings.
#[tokio::test]
async fn identity_is_read_from_metadata_then_scope_and_only_from_strings() {
    let schema = unique_schema("identity");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: audit
    setup: CREATE TABLE IF NOT EXISTS audit (stream_version bigint, user_id text, tenant_id text, param_user text, param_tenant text)
    handlers:
      A: INSERT INTO audit VALUES (:stream_version, current_setting('perspective.user_id', true), current_setting('perspective.tenant_id', true), :user_id, :tenant_id)
{FAST}"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    let stream = Uuid::now_v7();
    // (metadata, scope) → expected (user, tenant); '' is "no identity".
    let cases: [(&str, &str, &str, &str); 5] = [
        (r#"{"user_id": "m-u", "tenant_id": "m-t"}"#, r#"{"user_id": "s-u", "tenant_id": "s-t"}"#, "m-u", "m-t"),
        (r#"{}"#, r#"{"user_id": "s-u", "tenant_id": "s-t"}"#, "s-u", "s-t"),
        (r#"{"user_id": {"id": "x"}, "tenant_id": ["m-t"]}"#, r#"{"user_id": "s-u"}"#, "s-u", ""),
        (r#"{"user_id": 42, "tenant_id": true}"#, r#"{"tenant_id": {"a": 1}}"#, "", ""),
        (r#"{"user_id": null}"#, r#"{"user_id": "s-u", "tenant_id": "s-t"}"#, "s-u", "s-t"),
    ];
    for (metadata, scope, _, _) in &cases {
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_event_store (stream_id, event_type, metadata, scope)
             VALUES ($1, 'A', $2::jsonb, $3::jsonb)"
        ))
        .bind(stream)
        .bind(metadata)
        .bind(scope)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    type Row = (i64, Option<String>, Option<String>, Option<String>, Option<String>);
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "SELECT stream_version, user_id, tenant_id, param_user, param_tenant FROM {schema}.audit ORDER BY 1"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(rows.len(), cases.len());
    for ((v, user, tenant, param_user, param_tenant), (m, s, want_user, want_tenant)) in
        rows.into_iter().zip(cases)
    {
        let none = |x: &str| (!x.is_empty()).then(|| x.to_string());
        assert_eq!(
            (user.unwrap_or_default().as_str(), tenant.unwrap_or_default().as_str()),
            (want_user, want_tenant),
            "event {v}: metadata {m}, scope {s}"
        );
        assert_eq!((param_user, param_tenant), (none(want_user), none(want_tenant)), "event {v}");
    }
}

/// A rewind's `reset` runs under the identity of the event that triggered it, not under the
/// identity an earlier group of the same transaction (or nothing) left set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_resets_under_the_identity_of_the_triggering_event() {
    let schema = unique_schema("reset_identity");
    let yaml = format!(
        "schema: {schema}
perspectives:
  - name: by_id
    ordering: eventId
    setup: |
      CREATE TABLE IF NOT EXISTS seen (stream_id uuid PRIMARY KEY, labels text[] NOT NULL);
      CREATE TABLE IF NOT EXISTS resets (stream_id uuid, user_id text, tenant_id text)
    reset: |
      DELETE FROM seen WHERE stream_id = :stream_id;
      INSERT INTO resets VALUES (:stream_id, current_setting('perspective.user_id', true), current_setting('perspective.tenant_id', true))
    handlers:
      A: INSERT INTO seen AS s VALUES (:stream_id, ARRAY[:data->>'n']) ON CONFLICT (stream_id) DO UPDATE SET labels = s.labels || (:data->>'n')
{FAST}"
    );
    let config = parse_config(&yaml);
    migrate_config(&config).await;
    let mut conn = connect().await;
    let id = |n: u32| Uuid::parse_str(&format!("00000000-0000-7000-8000-{n:012}")).unwrap();
    let stream = Uuid::now_v7();
    let append = |stream: Uuid, n: u32, user: &'static str, tenant: &'static str| {
        let schema = schema.clone();
        async move {
            let mut conn = connect().await;
            sqlx::query(&format!(
                "INSERT INTO {schema}.wh_event_store (event_id, stream_id, event_type, event_data, metadata, scope)
                 VALUES ($1, $2, 'A', jsonb_build_object('n', $3::text), jsonb_build_object('user_id', $4::text),
                         jsonb_build_object('tenant_id', $5::text))"
            ))
            .bind(id(n))
            .bind(stream)
            .bind(n.to_string())
            .bind(user)
            .bind(tenant)
            .execute(&mut conn)
            .await
            .unwrap();
        }
    };
    append(stream, 10, "u-10", "t-10").await;
    append(stream, 30, "u-30", "t-30").await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    // While no worker runs: another stream's event (applied first in the same drain when the
    // batch holds both) and the late event 20 that rewinds `stream`.
    let other = Uuid::nil();
    append(other, 1, "u-other", "t-other").await;
    append(stream, 20, "u-20", "t-20").await;
    let engine = RunningEngine::start(&config).await;
    wait_drained(&schema, Duration::from_secs(30)).await;
    engine.stop().await;
    let labels: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT labels FROM {schema}.seen WHERE stream_id = $1"
    ))
    .bind(stream)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(labels, ["10", "20", "30"], "the stream was rewound");
    let resets: Vec<(Option<String>, Option<String>)> = sqlx::query_as(&format!(
        "SELECT user_id, tenant_id FROM {schema}.resets WHERE stream_id = $1"
    ))
    .bind(stream)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        resets,
        [(Some("u-20".to_string()), Some("t-20".to_string()))],
        "one reset, as the late event 20"
    );
}
