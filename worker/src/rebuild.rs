//! `perspective-worker rebuild --perspective NAME`: rebuild a perspective from the event store.
//!
//! Stream by stream, in one transaction each: lock the stream's cursor, run the perspective's
//! `reset` for that stream, drop its cursor and its pending work, and create one work row per
//! stored event of a subscribed type (ringing the doorbell). Running workers then re-apply the
//! stream from version 1; an apply racing the rebuild waits on the cursor lock and afterwards
//! finds the new rows ahead of it, so nothing is applied out of order or twice.

use sqlx::postgres::{PgConnection, PgTypeInfo};
use sqlx::{Connection, Executor, Statement};
use uuid::Uuid;

use crate::config::Config;
use crate::sql_params::Param;

#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    #[error("perspective {0} is not in the config")]
    UnknownPerspective(String),
    #[error("perspective {0} has no `reset`, so its model cannot be cleared stream by stream; add one to rebuild it")]
    NoReset(String),
    #[error("stream {stream}: {message}")]
    Stream { stream: Uuid, message: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// What a rebuild did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RebuildReport {
    pub streams: usize,
    pub work_rows: u64,
}

/// Rebuild `perspective`; `progress(done, total)` after each stream.
pub async fn rebuild(
    conn: &mut PgConnection,
    config: &Config,
    perspective: &str,
    mut progress: impl FnMut(usize, usize),
) -> Result<RebuildReport, RebuildError> {
    let schema = &config.schema;
    let p = config
        .perspective(perspective)
        .ok_or_else(|| RebuildError::UnknownPerspective(perspective.to_string()))?;
    let reset = p
        .compiled_reset()
        .ok_or_else(|| RebuildError::NoReset(perspective.to_string()))?;
    let event_types: Vec<String> = p.event_types().map(str::to_string).collect();
    sqlx::query(&format!("SET search_path TO {schema}, public"))
        .execute(&mut *conn)
        .await?;

    let streams: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT DISTINCT stream_id FROM {schema}.wh_event_store WHERE event_type = ANY ($1) ORDER BY stream_id"
    ))
    .bind(&event_types)
    .fetch_all(&mut *conn)
    .await?;

    let mut report = RebuildReport {
        streams: streams.len(),
        work_rows: 0,
    };
    for (i, stream) in streams.iter().enumerate() {
        let mut tx = conn.begin().await?;
        sqlx::query(&format!(
            "SELECT 1 FROM {schema}.wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE"
        ))
        .bind(stream)
        .bind(perspective)
        .execute(&mut *tx)
        .await?;
        for stmt in &reset {
            let (sql, params) = stmt.to_positional();
            let types: Vec<PgTypeInfo> = params
                .iter()
                .map(|p| PgTypeInfo::with_name(p.pg_type()))
                .collect();
            let prepared = (&mut *tx).prepare_with(&sql, &types).await?;
            let mut q = prepared.query();
            for p in &params {
                // A reset concerns the whole stream; no single event's fields apply.
                q = match p {
                    Param::StreamId => q.bind(*stream),
                    Param::EventId => q.bind(None::<Uuid>),
                    Param::StreamVersion => q.bind(None::<i64>),
                    Param::Data | Param::Metadata | Param::Scope => {
                        q.bind(None::<serde_json::Value>)
                    }
                    Param::CreatedAt => q.bind(None::<chrono::DateTime<chrono::Utc>>),
                    Param::EventType | Param::UserId | Param::TenantId => q.bind(None::<String>),
                };
            }
            q.execute(&mut *tx)
                .await
                .map_err(|e| RebuildError::Stream {
                    stream: *stream,
                    message: crate::db::describe_error(&e, Some(&sql)),
                })?;
        }
        sqlx::query(&format!(
            "DELETE FROM {schema}.wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2"
        ))
        .bind(stream)
        .bind(perspective)
        .execute(&mut *tx)
        .await?;
        sqlx::query(&format!(
            "DELETE FROM {schema}.wh_perspective_events WHERE stream_id = $1 AND perspective_name = $2"
        ))
        .bind(stream)
        .bind(perspective)
        .execute(&mut *tx)
        .await?;
        let rows = sqlx::query(&format!(
            "INSERT INTO {schema}.wh_perspective_events (stream_id, perspective_name, event_id, stream_version, partition_number)
             SELECT e.stream_id, $2, e.event_id, e.stream_version, {schema}.compute_partition(e.stream_id)
             FROM {schema}.wh_event_store e
             WHERE e.stream_id = $1 AND e.event_type = ANY ($3)
             ORDER BY e.stream_version"
        ))
        .bind(stream)
        .bind(perspective)
        .bind(&event_types)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        report.work_rows += rows;
        sqlx::raw_sql(&format!(
            "INSERT INTO {schema}.wh_active_streams (stream_id, partition_number)
             VALUES ('{stream}', {schema}.compute_partition('{stream}')) ON CONFLICT (stream_id) DO NOTHING;
             SELECT pg_notify('{schema}_work', '');"
        ))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        progress(i + 1, streams.len());
    }
    Ok(report)
}
