//! After applying: the completion flush worker (Batched strategy: delete applied work rows in
//! batches, tracked pending → sent → acknowledged with backoff on failure) and the settler that
//! retires drained streams from `wh_active_streams` without losing a doorbell.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use uuid::Uuid;

use super::hooks::HookEvent;
use super::Ctx;
use crate::completion_tracker::{CompletionTracker, RetryPolicy};

/// Coalescing of completions: wait this long after the first one, or until this many.
const FLUSH_WINDOW: Duration = Duration::from_millis(25);
const FLUSH_MAX: usize = 1000;

/// Completed work rows (work id, stream) → `complete_perspective_events`, in batches.
pub(crate) async fn flush_worker(ctx: Arc<Ctx>, mut rx: mpsc::UnboundedReceiver<(i64, Uuid)>) {
    let mut tracker: CompletionTracker<(i64, Uuid)> =
        CompletionTracker::new(RetryPolicy::from_options(&ctx.config.worker.retry_options));
    let mut closed = false;
    loop {
        if tracker.pending_count() == 0 && tracker.sent_count() == 0 {
            if closed {
                return;
            }
            // Wait for work (or shutdown: then drain what is queued and stop).
            tokio::select! {
                item = rx.recv() => match item {
                    Some(item) => tracker.add(item),
                    None => closed = true,
                },
                _ = ctx.shutdown.cancelled() => {
                    rx.close();
                }
            }
        }
        // Coalesce.
        let deadline = tokio::time::Instant::now() + FLUSH_WINDOW;
        while !closed && tracker.pending_count() < FLUSH_MAX {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(item)) => tracker.add(item),
                Ok(None) => closed = true,
                Err(_) => break,
            }
        }
        tracker.reset_stale(Instant::now());
        let batch = tracker.take_pending_up_to(FLUSH_MAX, Instant::now());
        if batch.is_empty() {
            if tracker.sent_count() > 0 {
                // Waiting for a retry of a failed flush.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            continue;
        }
        let ids: Vec<i64> = batch.iter().map(|(id, _)| *id).collect();
        let result = ctx
            .store
            .complete_events(&ids, ctx.config.worker.debug_mode)
            .await;
        match result {
            Ok(_) => {
                tracker.mark_acknowledged(batch.len());
                ctx.completions_flushed(&batch);
                tracker.clear_acknowledged();
                ctx.cache.lock().unwrap().activate_retention(Instant::now());
                ctx.metrics.completions_flushed.inc_by(batch.len() as u64);
                ctx.hooks
                    .emit(HookEvent::CompletionsFlushed { count: batch.len() });
                let streams: HashSet<Uuid> = batch.iter().map(|(_, s)| *s).collect();
                for s in streams {
                    let _ = ctx.settle_tx.send(s);
                }
            }
            Err(e) => {
                // They stay Sent; reset_stale re-queues them after the backoff. If the process
                // dies first, the rows are re-offered and the cursor skips them.
                tracing::warn!(error = %crate::db::describe_error(&e, None), count = batch.len(), "completion flush failed; will retry");
            }
        }
    }
}

/// Streams that may be drained → `cleanup_completed_streams`. A stream that could not be
/// retired (a producer was mid-append, or completions are not flushed yet, or it has work
/// waiting for a retry) is handed back to the drain channel after a growing delay, a few times;
/// after that the claim loop's own polls look after it.
pub(crate) async fn settler(ctx: Arc<Ctx>, mut rx: mpsc::UnboundedReceiver<Uuid>) {
    const RETRIES: u32 = 8;
    let mut retries: HashMap<Uuid, u32> = HashMap::new();
    loop {
        let first = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            s = rx.recv() => match s { Some(s) => s, None => return },
        };
        let mut streams: HashSet<Uuid> = HashSet::from([first]);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(5);
        while let Ok(Some(s)) = tokio::time::timeout_at(deadline, rx.recv()).await {
            streams.insert(s);
        }
        let list: Vec<Uuid> = streams.iter().copied().collect();
        let removed = ctx
            .store
            .cleanup_completed_streams(ctx.instance_id, &list)
            .await;
        let removed: HashSet<Uuid> = match removed {
            Ok(r) => r.into_iter().collect(),
            Err(e) => {
                tracing::warn!(error = %crate::db::describe_error(&e, None), "cleanup_completed_streams failed");
                HashSet::new()
            }
        };
        for s in list {
            if removed.contains(&s) {
                retries.remove(&s);
                continue;
            }
            if ctx.awaiting_flush(&s) {
                // Its flush will bring it back here.
                retries.remove(&s);
                continue;
            }
            let n = retries.entry(s).or_insert(0);
            *n += 1;
            if *n > RETRIES {
                retries.remove(&s);
                continue;
            }
            let delay = Duration::from_millis(10u64 << (*n - 1).min(7));
            tracing::debug!(stream = %s, attempt = *n, delay_ms = delay.as_millis() as u64, "stream not retired; draining it again");
            let tx = ctx.drain_tx.clone();
            let shutdown = ctx.shutdown.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(delay) => { let _ = tx.try_send(s); }
                }
            });
        }
    }
}
