//! Lifecycle stages (with `worker.notifyApplied`): [`HookEvent::PostPerspective`] once per event
//! and perspective, by the worker that applied it, after the commit; then once per event, after
//! every subscribed perspective applied it, the worker that applied the last one fires
//! [`HookEvent::PostAllPerspectives`] then [`HookEvent::PostLifecycle`] and records the event in
//! `wh_lifecycle_completions`. The apply functions decide "last one" under a per-stream lock in
//! the apply transaction (the same check that sends the `<schema>_applied` NOTIFY), so exactly
//! one worker gets each event.
//!
//! A crash between that commit and the record leaves an orphan: at startup
//! `reconcile_orphans` finds recent events that every perspective applied but that have no
//! completion record, and fires their stages then. So does an event whose stages a lagging hook
//! subscriber did not receive (dropped, see `hooks`): it is not recorded.
//!
//! An event dead-lettered in any perspective is not applied by every perspective: its stages
//! (and the `<schema>_applied` NOTIFY) wait until its dead letter is replayed (the replay sends
//! the NOTIFY; the stages fire at the next worker start, by reconciliation).

use uuid::Uuid;

use super::hooks::HookEvent;
use super::Shared;

/// How far back startup reconciliation looks (30 minutes), and how much it does per pass.
const LOOKBACK_SECONDS: f64 = 30.0 * 60.0;
const PASS_SIZE: i64 = 100;
const MAX_PASSES: usize = 20;
/// Completion records older than this (7 days) are deleted at startup.
const RETENTION_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// Fires PostPerspective for the events `perspective` just applied on `stream`, in order.
pub(crate) fn post_perspective(ctx: &Shared, perspective: &str, stream_id: Uuid, events: &[Uuid]) {
    for &event_id in events {
        ctx.hooks.emit(HookEvent::PostPerspective {
            perspective: perspective.to_string(),
            stream_id,
            event_id,
        });
    }
}

/// Fires the stages of `completed` (stream, event) pairs, in order, and records those delivered.
pub(crate) async fn fire(ctx: &Shared, completed: &[(Uuid, Uuid)]) {
    if completed.is_empty() {
        return;
    }
    let mut ids: Vec<Uuid> = Vec::with_capacity(completed.len());
    for &(stream_id, event_id) in completed {
        // PostLifecycle only after its PostAllPerspectives was delivered.
        let delivered = ctx.hooks.emit(HookEvent::PostAllPerspectives {
            stream_id,
            event_id,
        }) && ctx.hooks.emit(HookEvent::PostLifecycle {
            stream_id,
            event_id,
        });
        if delivered {
            ids.push(event_id);
        }
    }
    if ids.is_empty() {
        return;
    }
    let recorded = ctx
        .store
        .record_lifecycle_completions(&ids, ctx.instance_id)
        .await;
    if let Err(e) = recorded {
        // The stages fired; without the record a restart fires them again (at least once).
        tracing::warn!(error = %crate::db::describe_error(&e, None), count = ids.len(),
                       "could not record lifecycle completions");
    }
}

/// Fires the stages of recent events that every subscribed perspective applied but that were
/// never recorded (their worker died in between); deletes old completion records. Best effort.
pub(crate) async fn reconcile_orphans(ctx: &Shared) {
    let _ = ctx
        .store
        .delete_old_lifecycle_completions(RETENTION_SECONDS)
        .await;
    let mut total = 0usize;
    for _ in 0..MAX_PASSES {
        let orphans = match ctx
            .store
            .orphaned_lifecycles(LOOKBACK_SECONDS, PASS_SIZE)
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
