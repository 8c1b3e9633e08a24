//! The (stream, perspective) cursor, for custom [`crate::contract::PerspectiveRunner`]s: lock it,
//! skip what it covers, advance it in the same transaction as the model change. The compiled
//! SQL apply functions do the same inside the database.

use sqlx::postgres::PgConnection;
use uuid::Uuid;

const CREATE: &str = "INSERT INTO {schema}.wh_perspective_cursors (stream_id, perspective_name)
     VALUES ($1, $2) ON CONFLICT DO NOTHING";
const LOCK: &str = "SELECT last_version FROM {schema}.wh_perspective_cursors
     WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE";
const ADVANCE: &str = "UPDATE {schema}.wh_perspective_cursors
        SET last_version = $3, last_event_id = $4, status = {cursor_completed}, error = NULL,
            processed_at = now()
      WHERE stream_id = $1 AND perspective_name = $2";

/// Lock the cursor of (`stream`, `perspective`) until the transaction ends, creating it when
/// missing; returns the last version applied (0: none). Every apply of the pair, in any process,
/// serialises on this lock.
pub async fn lock(
    tx: &mut PgConnection,
    schema: &str,
    stream: Uuid,
    perspective: &str,
) -> Result<i64, sqlx::Error> {
    // A concurrent creator makes the INSERT wait for its commit; the SELECT then locks its row.
    sqlx::query(&super::sql(schema, CREATE))
        .bind(stream)
        .bind(perspective)
        .execute(&mut *tx)
        .await?;
    sqlx::query_scalar(&super::sql(schema, LOCK))
        .bind(stream)
        .bind(perspective)
        .fetch_one(&mut *tx)
        .await
}

/// Move the locked cursor to `last_version` / `last_event_id` (status Completed, error cleared).
pub async fn advance(
    tx: &mut PgConnection,
    schema: &str,
    stream: Uuid,
    perspective: &str,
    last_version: i64,
    last_event_id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, ADVANCE))
        .bind(stream)
        .bind(perspective)
        .bind(last_version)
        .bind(last_event_id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}
