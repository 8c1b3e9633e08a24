//! Lifecycle stages (with `worker.notifyApplied`): [`HookEvent::PostPerspective`] once per event
//! and perspective, by the worker that applied it, after the commit; then once per event, after
//! every subscribed perspective applied it, the worker that applied the last one fires
//! [`HookEvent::PostAllPerspectives`] then [`HookEvent::PostLifecycle`] and records the event in
//! `wh_lifecycle_completions`. The apply functions decide "last one" under a per-stream lock in
//! the apply transaction (the same check that sends the `<schema>_applied` NOTIFY), so exactly
//! one worker gets each event.
//!
//! A crash between that commit and the record leaves an orphan: at startup
//! [`reconcile_orphans`] finds recent events that every perspective applied but that have no
//! completion record, and fires their stages then.

use uuid::Uuid;

use super::hooks::HookEvent;
use super::Ctx;

/// How far back startup reconciliation looks, and how much it does per pass.
const LOOKBACK: &str = "30 minutes";
const PASS_SIZE: i64 = 100;
const MAX_PASSES: usize = 20;
/// Completion records older than this are deleted at startup.
const RETENTION: &str = "7 days";

/// Fires PostPerspective for the events `perspective` just applied on `stream`, in order.
pub(crate) fn post_perspective(ctx: &Ctx, perspective: &str, stream_id: Uuid, events: &[Uuid]) {
    for &event_id in events {
        ctx.hooks.emit(HookEvent::PostPerspective {
            perspective: perspective.to_string(),
            stream_id,
            event_id,
        });
    }
}

/// Fires the stages of `completed` (stream, event) pairs, in order, and records them.
pub(crate) async fn fire(ctx: &Ctx, completed: &[(Uuid, Uuid)]) {
    if completed.is_empty() {
        return;
    }
    for &(stream_id, event_id) in completed {
        ctx.hooks.emit(HookEvent::PostAllPerspectives {
            stream_id,
            event_id,
        });
        ctx.hooks.emit(HookEvent::PostLifecycle {
            stream_id,
            event_id,
        });
    }
    let ids: Vec<Uuid> = completed.iter().map(|(_, e)| *e).collect();
    let recorded = sqlx::query(&format!(
        "INSERT INTO {}.wh_lifecycle_completions (event_id, instance_id)
         SELECT unnest($1::uuid[]), $2 ON CONFLICT (event_id) DO NOTHING",
        ctx.schema
    ))
    .bind(&ids)
    .bind(ctx.instance_id)
    .execute(&ctx.pool)
    .await;
    if let Err(e) = recorded {
        // The stages fired; without the record a restart fires them again (at least once).
        tracing::warn!(error = %crate::db::describe_error(&e, None), count = ids.len(),
                       "could not record lifecycle completions");
    }
}

/// Fires the stages of recent events that every subscribed perspective applied but that were
/// never recorded (their worker died in between); deletes old completion records. Best effort.
pub(crate) async fn reconcile_orphans(ctx: &Ctx) {
    let s = &ctx.schema;
    let _ = sqlx::query(&format!(
        "DELETE FROM {s}.wh_lifecycle_completions WHERE completed_at < now() - interval '{RETENTION}'"
    ))
    .execute(&ctx.pool)
    .await;
    let sql = format!(
        "SELECT e.stream_id, e.event_id FROM {s}.wh_event_store e
         WHERE e.created_at > now() - interval '{LOOKBACK}'
           AND EXISTS (SELECT 1 FROM {s}.wh_perspective_subscriptions s WHERE s.event_type = e.event_type)
           AND NOT EXISTS (SELECT 1 FROM {s}.wh_lifecycle_completions l WHERE l.event_id = e.event_id)
           AND NOT EXISTS (
             SELECT 1 FROM {s}.wh_perspective_subscriptions s
             LEFT JOIN {s}.wh_perspective_cursors c
                    ON c.stream_id = e.stream_id AND c.perspective_name = s.perspective_name
             WHERE s.event_type = e.event_type AND coalesce(c.last_version, 0) < e.stream_version)
         ORDER BY e.stream_id, e.stream_version
         LIMIT $1"
    );
    let mut total = 0usize;
    for _ in 0..MAX_PASSES {
        let orphans: Vec<(Uuid, Uuid)> = match sqlx::query_as(&sql)
            .bind(PASS_SIZE)
            .fetch_all(&ctx.pool)
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %crate::db::describe_error(&e, None),
                               "orphaned-lifecycle reconciliation failed");
                return;
            }
        };
        total += orphans.len();
        fire(ctx, &orphans).await;
        if (orphans.len() as i64) < PASS_SIZE {
            break;
        }
    }
    if total > 0 {
        tracing::info!(
            events = total,
            "fired the lifecycle stages of orphaned events"
        );
    }
}
