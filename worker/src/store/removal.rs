//! Removing a perspective that left the config: its pending work, its cursors, its job, its
//! compiled functions and its record go; its model tables are the user's and stay. Streams left with
//! nothing pending are unpinned.

use sqlx::postgres::PgConnection;
use sqlx::Row;

/// Perspectives the schema knows (compiled, with work or with cursors) that `configured` lacks.
const REMOVED: &str = "SELECT name FROM (
       SELECT perspective_name AS name FROM {schema}.wh_perspectives
       UNION SELECT DISTINCT perspective_name FROM {schema}.wh_perspective_events
       UNION SELECT DISTINCT perspective_name FROM {schema}.wh_perspective_cursors) known
     WHERE name <> ALL ($1) ORDER BY name";
const DELETE_WORK: &str = "DELETE FROM {schema}.wh_perspective_events WHERE perspective_name = $1";
const DELETE_CURSORS: &str =
    "DELETE FROM {schema}.wh_perspective_cursors WHERE perspective_name = $1";
/// Its job (backfill or rebuild), if one was running.
const DELETE_JOB: &str = "WITH streams AS (
       DELETE FROM {schema}.wh_perspective_job_streams WHERE perspective_name = $1)
     DELETE FROM {schema}.wh_perspective_jobs WHERE perspective_name = $1";
const FORGET: &str = "DELETE FROM {schema}.wh_perspectives WHERE perspective_name = $1
     RETURNING apply_function";
/// Streams with nothing pending, unpinned the way `cleanup_completed_streams` does it: only
/// those whose head no producer holds (one that does will ring the doorbell itself).
const UNPIN_DRAINED: &str = "WITH free AS (
       SELECT s.stream_id FROM {schema}.wh_streams s
       JOIN {schema}.wh_active_streams a USING (stream_id)
       ORDER BY s.stream_id
       FOR SHARE OF s SKIP LOCKED)
     DELETE FROM {schema}.wh_active_streams a USING free
     WHERE a.stream_id = free.stream_id
       AND NOT EXISTS (SELECT 1 FROM {schema}.wh_perspective_events w
                       WHERE w.stream_id = a.stream_id AND w.processed_at IS NULL)";

/// What was removed for one perspective.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Removed {
    pub perspective: String,
    /// Pending (or, in debug mode, kept) work rows deleted.
    pub work_rows: u64,
    /// Stream cursors deleted.
    pub cursors: u64,
}

/// Perspectives known to `schema` that are not in `configured`.
pub async fn removed_perspectives(
    tx: &mut PgConnection,
    schema: &str,
    configured: &[String],
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(&super::sql(schema, REMOVED))
        .bind(configured)
        .fetch_all(&mut *tx)
        .await
}

/// Delete `perspective`'s work rows, cursors, job, record and compiled apply and batch functions.
pub async fn remove_perspective(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
) -> Result<Removed, sqlx::Error> {
    let mut deleted = [0u64; 3];
    for (n, statement) in [DELETE_WORK, DELETE_CURSORS, DELETE_JOB]
        .into_iter()
        .enumerate()
    {
        deleted[n] = sqlx::query(&super::sql(schema, statement))
            .bind(perspective)
            .execute(&mut *tx)
            .await?
            .rows_affected();
    }
    let function: Option<String> = sqlx::query(&super::sql(schema, FORGET))
        .bind(perspective)
        .fetch_optional(&mut *tx)
        .await?
        .map(|r| r.get(0));
    // Generated identifiers (see compile::apply_function_name), so no quoting.
    let batch = crate::store::names::batch_function_name(perspective);
    let key = crate::store::names::key_function_name(perspective);
    for function in function.into_iter().chain([batch, key]) {
        sqlx::query(&format!("DROP FUNCTION IF EXISTS {schema}.{function}"))
            .execute(&mut *tx)
            .await?;
    }
    Ok(Removed {
        perspective: perspective.to_string(),
        work_rows: deleted[0],
        cursors: deleted[1],
    })
}

/// Unpin streams left with nothing pending; returns how many.
pub async fn unpin_drained_streams(
    tx: &mut PgConnection,
    schema: &str,
) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(&super::sql(schema, UNPIN_DRAINED))
        .execute(&mut *tx)
        .await?
        .rows_affected())
}
