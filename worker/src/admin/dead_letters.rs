//! Replaying dead letters (`perspective-worker dead-letters replay`): re-apply poison events
//! once their handler is fixed. Listing them is [`crate::store::dead_letters::list`].
//!
//! A replay applies the dead letter's event through the perspective's runner in force mode
//! (regardless of the cursor, which has long moved past it, and without moving it) and marks the
//! dead letter `replayed` in the same transaction, so a replay happens once or not at all. A
//! custom runner gets the dead letter's snapshot of the event; the compiled SQL handlers read
//! the event from the store, which keeps it (it is append-only, and the retention function
//! `wh_delete_applied_events` spares events with a pending dead letter).
//!
//! Until then the event is not "applied by every perspective". If the replay makes it so, the
//! replay sends its `<schema>_applied` NOTIFY; its PostAllPerspectives / PostLifecycle hooks fire
//! at the next worker start (orphan reconciliation looks at recent replays).

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;
use sqlx::Connection;
use uuid::Uuid;

use crate::contract::{ApplyMode, Group, PerspectiveRunner, WorkItem};
use crate::store::dead_letters as store;

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
    let letter = store::lock_pending(&mut tx, schema, id)
        .await?
        .ok_or(ReplayError::NotPending(id))?;
    let event = &letter.event;
    let field = |k: &str| event.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let parse_uuid = |k: &str| {
        field(k)
            .as_str()
            .and_then(|s| s.parse::<Uuid>().ok())
            .unwrap_or_default()
    };
    let item = WorkItem {
        event_work_id: letter.event_work_id,
        stream_id: parse_uuid("stream_id"),
        perspective_name: letter.perspective_name.clone(),
        event_id: parse_uuid("event_id"),
        stream_version: field("stream_version").as_i64().unwrap_or_default(),
        attempts: letter.attempts,
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
        Err(e) => Some(e.to_string()),
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
    store::mark_replayed(&mut tx, schema, id).await?;
    let item = &group.items[0];
    store::notify_if_applied_by_all(
        &mut tx,
        schema,
        item.stream_id,
        item.stream_version,
        &item.event_type,
        item.event_id,
    )
    .await?;
    tx.commit().await?;
    Ok(())
}
