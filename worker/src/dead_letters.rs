//! `perspective-worker dead-letters list|replay`: inspect poison events and re-apply them once
//! their handler is fixed.
//!
//! A replay applies the dead letter's event snapshot through the perspective's runner in force
//! mode (regardless of the cursor, which has long moved past it, and without moving it) and
//! marks the dead letter `replayed` in the same transaction, so a replay happens once or not at
//! all.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Row};
use uuid::Uuid;

use crate::engine::{ApplyMode, Group, PerspectiveRunner, WorkItem};

/// One dead letter, as listed.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    pub id: i64,
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

/// Dead letters of `schema`, oldest first; only pending ones unless `all`.
pub async fn list(
    conn: &mut PgConnection,
    schema: &str,
    all: bool,
) -> Result<Vec<DeadLetter>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT dead_letter_id, perspective_name, stream_id, stream_version, event_id, event_type, attempts,
                error, dead_lettered_at, recovery_status
         FROM {schema}.wh_dead_letters
         WHERE $1 OR recovery_status = 'pending'
         ORDER BY dead_letter_id"
    ))
    .bind(all)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .iter()
        .map(|r| DeadLetter {
            id: r.get(0),
            perspective: r.get(1),
            stream_id: r.get(2),
            stream_version: r.get(3),
            event_id: r.get(4),
            event_type: r.get(5),
            attempts: r.get(6),
            error: r.get(7),
            dead_lettered_at: r.get(8),
            recovery_status: r.get(9),
        })
        .collect())
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("dead letter {0} does not exist or is not pending")]
    NotPending(i64),
    #[error("dead letter {id} ({perspective}, stream {stream_id} version {version}) failed again: {error}")]
    FailedAgain {
        id: i64,
        perspective: String,
        stream_id: Uuid,
        version: i64,
        error: String,
    },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Replay pending dead letter `id`. Each replay is its own transaction.
pub async fn replay(
    conn: &mut PgConnection,
    schema: &str,
    runner: &dyn PerspectiveRunner,
    id: i64,
) -> Result<(), ReplayError> {
    let mut tx = conn.begin().await?;
    let row = sqlx::query(&format!(
        "SELECT event_work_id, perspective_name, event, attempts
         FROM {schema}.wh_dead_letters WHERE dead_letter_id = $1 AND recovery_status = 'pending'
         FOR UPDATE"
    ))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(ReplayError::NotPending(id))?;
    let event: serde_json::Value = row.get(2);
    let field = |k: &str| event.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let parse_uuid = |k: &str| {
        field(k)
            .as_str()
            .and_then(|s| s.parse::<Uuid>().ok())
            .unwrap_or_default()
    };
    let item = WorkItem {
        event_work_id: row.get(0),
        stream_id: parse_uuid("stream_id"),
        perspective_name: row.get(1),
        event_id: parse_uuid("event_id"),
        stream_version: field("stream_version").as_i64().unwrap_or_default(),
        attempts: row.get(3),
        error: None,
        event_type: field("event_type").as_str().unwrap_or_default().to_string(),
        event_data: field("event_data"),
        metadata: field("metadata"),
        scope: field("scope"),
        created_at: field("created_at")
            .as_str()
            .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
            .map(|d| d.with_timezone(&Utc))
            .unwrap_or_else(Utc::now),
    };
    let group = Group {
        stream_id: item.stream_id,
        perspective: item.perspective_name.clone(),
        items: vec![item],
    };
    let mode = ApplyMode {
        instant: false,
        debug: false,
        force: true,
    };
    let outcome = runner.apply(&mut tx, &group, mode).await;
    let failure = match outcome {
        Ok(o) => o.failed.map(|(_, e)| e),
        Err(e) => Some(crate::db::describe_error(&e, None)),
    };
    if let Some(error) = failure {
        tx.rollback().await?;
        return Err(ReplayError::FailedAgain {
            id,
            perspective: group.perspective,
            stream_id: group.stream_id,
            version: group.items[0].stream_version,
            error,
        });
    }
    sqlx::query(&format!(
        "UPDATE {schema}.wh_dead_letters
            SET recovery_status = 'replayed', recovered_at = now(), replay_count = replay_count + 1
          WHERE dead_letter_id = $1"
    ))
    .bind(id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}
