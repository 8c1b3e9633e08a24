//! Dead letters: poison work rows moved aside with a snapshot of their event, listed, replayed.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use super::Store;

const MOVE_TO_DEAD_LETTERS: &str = "SELECT {schema}.move_to_dead_letters($1, $2)";
const LIST: &str = "SELECT dead_letter_id, perspective_name, stream_id, stream_version, event_id,
            event_type, attempts, error, dead_lettered_at, recovery_status
     FROM {schema}.wh_dead_letters
     WHERE $1 OR recovery_status = {dead_letter_pending}
     ORDER BY dead_letter_id";
const LOCK_PENDING: &str = "SELECT event_work_id, perspective_name, event, attempts
     FROM {schema}.wh_dead_letters
     WHERE dead_letter_id = $1 AND recovery_status = {dead_letter_pending}
     FOR UPDATE";
const MARK_REPLAYED: &str = "UPDATE {schema}.wh_dead_letters
        SET recovery_status = {dead_letter_replayed}, recovered_at = now(),
            replay_count = replay_count + 1
      WHERE dead_letter_id = $1";
/// Marks pending dead letters `discarded`: those of `ids`, or all (of `perspective`, if given).
const DISCARD: &str = "UPDATE {schema}.wh_dead_letters
        SET recovery_status = {dead_letter_discarded}, recovered_at = now()
      WHERE recovery_status = {dead_letter_pending}
        AND ($1 OR dead_letter_id = ANY($2))
        AND ($3::text IS NULL OR perspective_name = $3)";

/// The `<schema>_applied` NOTIFY for a replayed event, if every subscribed perspective has now
/// applied it (see `wh_applied_by_all`).
const NOTIFY_IF_APPLIED_BY_ALL: &str = "SELECT pg_notify($1, $2::text)
     WHERE EXISTS (SELECT 1 FROM {schema}.wh_applied_by_all($3, ARRAY[$4::bigint], ARRAY[$5::text]))";

/// One dead letter, as listed.
#[derive(Debug, Clone, Serialize, PartialEq, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    #[sqlx(rename = "dead_letter_id")]
    pub id: i64,
    #[sqlx(rename = "perspective_name")]
    pub perspective: String,
    pub stream_id: Uuid,
    pub stream_version: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub attempts: i32,
    pub error: Option<String>,
    pub dead_lettered_at: DateTime<Utc>,
    pub recovery_status: String,
}

/// A pending dead letter, locked for replay.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PendingDeadLetter {
    pub event_work_id: i64,
    pub perspective_name: String,
    /// The event as it was when dead-lettered (the store row as JSON).
    pub event: serde_json::Value,
    pub attempts: i32,
}

impl Store {
    /// Move work rows to the dead letters (with a snapshot of their events). Returns how many.
    pub async fn move_to_dead_letters(
        &self,
        instance_id: Uuid,
        work_ids: &[i64],
    ) -> Result<i32, sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "move_to_dead_letters")
            .await?;
        c.deadline()
            .run(
                sqlx::query_scalar(&self.sql(MOVE_TO_DEAD_LETTERS))
                    .bind(instance_id)
                    .bind(work_ids)
                    .fetch_one(&mut *c),
            )
            .await
    }
}

/// Dead letters of `schema`, oldest first; only pending ones unless `all`.
pub async fn list(
    conn: &mut PgConnection,
    schema: &str,
    all: bool,
) -> Result<Vec<DeadLetter>, sqlx::Error> {
    sqlx::query_as(&super::sql(schema, LIST))
        .bind(all)
        .fetch_all(&mut *conn)
        .await
}

/// Mark pending dead letters `discarded` (they are never applied; their events may be pruned):
/// `ids`, or every pending one with `all`; only `perspective`'s when given. Returns how many.
pub async fn discard(
    conn: &mut PgConnection,
    schema: &str,
    ids: &[i64],
    all: bool,
    perspective: Option<&str>,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(&super::sql(schema, DISCARD))
        .bind(all)
        .bind(ids)
        .bind(perspective)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected())
}

/// Lock pending dead letter `id` for the rest of the transaction; None when it does not exist
/// or is not pending.
pub async fn lock_pending(
    tx: &mut PgConnection,
    schema: &str,
    id: i64,
) -> Result<Option<PendingDeadLetter>, sqlx::Error> {
    sqlx::query_as(&super::sql(schema, LOCK_PENDING))
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
}

/// Announce on `<schema>_applied` that `event_id` is applied by every perspective, if it now
/// is (its replay was the last one missing). Sent when the transaction commits.
pub async fn notify_if_applied_by_all(
    tx: &mut PgConnection,
    schema: &str,
    stream_id: Uuid,
    stream_version: i64,
    event_type: &str,
    event_id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, NOTIFY_IF_APPLIED_BY_ALL))
        .bind(super::names::applied_channel(schema))
        .bind(event_id)
        .bind(stream_id)
        .bind(stream_version)
        .bind(event_type)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Mark dead letter `id` replayed.
pub async fn mark_replayed(
    tx: &mut PgConnection,
    schema: &str,
    id: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, MARK_REPLAYED))
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}
