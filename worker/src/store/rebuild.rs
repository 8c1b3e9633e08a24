//! Rebuilding a perspective: per stream, reset its share of the model and queue every stored
//! event of a subscribed type again.

use sqlx::postgres::{PgConnection, PgTypeInfo};
use sqlx::{Executor, Statement};
use uuid::Uuid;

use crate::sql_params::{Param, ParsedStatement};

const SET_SEARCH_PATH: &str = "SET search_path TO {schema}, public";
const STREAMS_WITH_TYPES: &str = "SELECT DISTINCT stream_id FROM {schema}.wh_event_store
     WHERE event_type = ANY ($1) ORDER BY stream_id";
const LOCK_CURSOR: &str = "SELECT 1 FROM {schema}.wh_perspective_cursors
     WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE";
const DELETE_CURSOR: &str = "DELETE FROM {schema}.wh_perspective_cursors
     WHERE stream_id = $1 AND perspective_name = $2";
const DELETE_WORK: &str = "DELETE FROM {schema}.wh_perspective_events
     WHERE stream_id = $1 AND perspective_name = $2";
const QUEUE_EVENTS: &str = "INSERT INTO {schema}.wh_perspective_events
         (stream_id, perspective_name, event_id, stream_version, partition_number)
     SELECT e.stream_id, $2, e.event_id, e.stream_version, {schema}.compute_partition(e.stream_id)
     FROM {schema}.wh_event_store e
     WHERE e.stream_id = $1 AND e.event_type = ANY ($3)
     ORDER BY e.stream_version";
/// The stream needs an active-stream row to be claimed; the doorbell wakes idle workers.
const ACTIVATE_STREAM: &str = "INSERT INTO {schema}.wh_active_streams (stream_id, partition_number)
     VALUES ($1, {schema}.compute_partition($1)) ON CONFLICT (stream_id) DO NOTHING";
const RING_DOORBELL: &str = "SELECT pg_notify($1, '')";

/// Resolve the perspective's tables (named as `setup` created them) for this session.
pub async fn set_search_path(conn: &mut PgConnection, schema: &str) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, SET_SEARCH_PATH))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Streams holding at least one event of `event_types`, in id order.
pub async fn streams_with_types(
    conn: &mut PgConnection,
    schema: &str,
    event_types: &[String],
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(&super::sql(schema, STREAMS_WITH_TYPES))
        .bind(event_types)
        .fetch_all(&mut *conn)
        .await
}

/// Lock the (stream, perspective) cursor for the rest of the transaction, so no apply runs
/// concurrently.
pub async fn lock_cursor(
    tx: &mut PgConnection,
    schema: &str,
    stream: Uuid,
    perspective: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, LOCK_CURSOR))
        .bind(stream)
        .bind(perspective)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Run one `reset` statement for `stream`. A reset concerns the whole stream: parameters other
/// than `:stream_id` are NULL. On failure, also returns the statement's SQL (for the message).
pub async fn run_reset(
    tx: &mut PgConnection,
    stmt: &ParsedStatement,
    stream: Uuid,
) -> Result<(), (sqlx::Error, String)> {
    let (sql, params) = stmt.to_positional();
    let types: Vec<PgTypeInfo> = params
        .iter()
        .map(|p| PgTypeInfo::with_name(p.pg_type()))
        .collect();
    let result = async {
        let prepared = (&mut *tx).prepare_with(&sql, &types).await?;
        let mut q = prepared.query();
        for p in &params {
            q = match p {
                Param::StreamId => q.bind(stream),
                Param::EventId => q.bind(None::<Uuid>),
                Param::StreamVersion => q.bind(None::<i64>),
                Param::Data | Param::Metadata | Param::Scope => q.bind(None::<serde_json::Value>),
                Param::CreatedAt => q.bind(None::<chrono::DateTime<chrono::Utc>>),
                Param::EventType | Param::UserId | Param::TenantId => q.bind(None::<String>),
            };
        }
        q.execute(&mut *tx).await
    }
    .await;
    result.map(|_| ()).map_err(|e| (e, sql))
}

/// Drop the (stream, perspective) cursor and pending work, queue one work row per stored event
/// of `event_types`, and ring the doorbell. Returns the rows queued.
pub async fn requeue_stream(
    tx: &mut PgConnection,
    schema: &str,
    stream: Uuid,
    perspective: &str,
    event_types: &[String],
) -> Result<u64, sqlx::Error> {
    let sql = |t| super::sql(schema, t);
    for delete in [DELETE_CURSOR, DELETE_WORK] {
        sqlx::query(&sql(delete))
            .bind(stream)
            .bind(perspective)
            .execute(&mut *tx)
            .await?;
    }
    let rows = sqlx::query(&sql(QUEUE_EVENTS))
        .bind(stream)
        .bind(perspective)
        .bind(event_types)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    sqlx::query(&sql(ACTIVATE_STREAM))
        .bind(stream)
        .execute(&mut *tx)
        .await?;
    sqlx::query(RING_DOORBELL)
        .bind(super::names::work_channel(schema))
        .execute(&mut *tx)
        .await?;
    Ok(rows)
}
