//! Rebuilding a perspective: per stream, reset its share of the model and queue its history
//! again (`wh_queue_stream`, which reads the same subscriptions as the insert trigger).

use sqlx::postgres::{PgConnection, PgTypeInfo};
use sqlx::{Executor, Statement};
use uuid::Uuid;

use crate::sql_params::{Param, ParsedStatement};

const SET_SEARCH_PATH: &str = "SET search_path TO {schema}, public";
const STREAMS_OF: &str = "SELECT DISTINCT e.stream_id FROM {schema}.wh_event_store e
     JOIN {schema}.wh_perspective_subscriptions s
       ON s.event_type = e.event_type AND s.perspective_name = $1
     ORDER BY e.stream_id";
const LOCK_STREAM: &str = "SELECT 1 FROM {schema}.wh_streams WHERE stream_id = $1 FOR UPDATE";
const CREATE_CURSOR: &str =
    "INSERT INTO {schema}.wh_perspective_cursors (stream_id, perspective_name)
     VALUES ($1, $2) ON CONFLICT DO NOTHING";
const LOCK_CURSOR: &str = "SELECT 1 FROM {schema}.wh_perspective_cursors
     WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE";
const DELETE_CURSOR: &str = "DELETE FROM {schema}.wh_perspective_cursors
     WHERE stream_id = $1 AND perspective_name = $2";
const DELETE_WORK: &str = "DELETE FROM {schema}.wh_perspective_events
     WHERE stream_id = $1 AND perspective_name = $2";
const QUEUE_STREAM: &str = "SELECT {schema}.wh_queue_stream($1, $2)";

/// Resolve the perspective's tables (named as `setup` created them) for this session.
pub async fn set_search_path(conn: &mut PgConnection, schema: &str) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, SET_SEARCH_PATH))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Streams holding at least one event `perspective` subscribes to, in id order.
pub async fn streams_of(
    conn: &mut PgConnection,
    schema: &str,
    perspective: &str,
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(&super::sql(schema, STREAMS_OF))
        .bind(perspective)
        .fetch_all(&mut *conn)
        .await
}

/// Hold the stream's head row like a producer does: the cleanup of drained streams skips a
/// stream whose head is locked, so it cannot drop the stream from `wh_active_streams` after
/// looking past the rows this transaction re-queues (the queue's insert there finds the row
/// still present and adds nothing, and the rows would wait for an owner forever).
pub async fn lock_stream(
    tx: &mut PgConnection,
    schema: &str,
    stream: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, LOCK_STREAM))
        .bind(stream)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Lock the (stream, perspective) cursor for the rest of the transaction, so no apply runs
/// concurrently. A pair not applied yet has no cursor row, and locking nothing would let a
/// first apply commit between the reset and the requeue (its events then applied twice): the
/// row is created first (an apply creating it concurrently makes the insert wait for its commit,
/// and the lock then takes its row).
pub async fn lock_cursor(
    tx: &mut PgConnection,
    schema: &str,
    stream: Uuid,
    perspective: &str,
) -> Result<(), sqlx::Error> {
    for statement in [CREATE_CURSOR, LOCK_CURSOR] {
        sqlx::query(&super::sql(schema, statement))
            .bind(stream)
            .bind(perspective)
            .execute(&mut *tx)
            .await?;
    }
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

/// Drop the (stream, perspective) cursor and pending work, then queue the stream's history for
/// the perspective again (which rings the doorbell). Returns the rows queued.
pub async fn requeue_stream(
    tx: &mut PgConnection,
    schema: &str,
    stream: Uuid,
    perspective: &str,
) -> Result<i64, sqlx::Error> {
    for delete in [DELETE_CURSOR, DELETE_WORK] {
        sqlx::query(&super::sql(schema, delete))
            .bind(stream)
            .bind(perspective)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query_scalar(&super::sql(schema, QUEUE_STREAM))
        .bind(stream)
        .bind(perspective)
        .fetch_one(&mut *tx)
        .await
}
