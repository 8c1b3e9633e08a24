//! After applying: the completion flush worker (Batched strategy: delete applied work rows in
//! batches, tracked pending → sent → acknowledged with backoff on failure) and the settler that
//! retires drained streams from `wh_active_streams` without losing a doorbell.

pub mod dedup;
pub mod tracker;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::engine::hooks::HookEvent;
use crate::engine::Shared;
use dedup::ProcessedEventCache;
use tracker::{CompletionTracker, RetryPolicy};

/// Applied work rows on their way to the flush worker (Batched), and per stream which ones are
/// not deleted yet: such a stream cannot be retired before the flush, which settles it after.
#[derive(Clone)]
pub(crate) struct CompletionQueue {
    tx: mpsc::UnboundedSender<(i64, Uuid)>,
    unflushed: Arc<Mutex<HashMap<Uuid, HashSet<i64>>>>,
}

impl CompletionQueue {
    /// The queue and the flush worker's end of it.
    pub(crate) fn new() -> (Self, mpsc::UnboundedReceiver<(i64, Uuid)>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = CompletionQueue {
            tx,
            unflushed: Arc::default(),
        };
        (queue, rx)
    }

    /// Hand applied work rows of `stream` to the completion flush worker.
    pub(crate) fn queue(&self, stream: Uuid, ids: &[i64]) {
        self.unflushed
            .lock()
            .unwrap()
            .entry(stream)
            .or_default()
            .extend(ids);
        for id in ids {
            let _ = self.tx.send((*id, stream));
        }
    }

    /// The flush worker deleted these rows.
    fn flushed(&self, rows: &[(i64, Uuid)]) {
        let mut unflushed = self.unflushed.lock().unwrap();
        for (id, stream) in rows {
            if let Some(ids) = unflushed.get_mut(stream) {
                ids.remove(id);
                if ids.is_empty() {
                    unflushed.remove(stream);
                }
            }
        }
    }

    /// Whether applied rows of `stream` are still waiting for the flush worker.
    pub(crate) fn awaiting_flush(&self, stream: &Uuid) -> bool {
        self.unflushed.lock().unwrap().contains_key(stream)
    }
}

/// The completion flush task.
pub(crate) struct FlushWorker {
    pub shared: Arc<Shared>,
    pub completions: CompletionQueue,
    /// Its retention starts once the rows it remembers are deleted.
    pub cache: Arc<Mutex<ProcessedEventCache>>,
    /// Streams whose rows were flushed, out: they may be drained.
    pub settle_tx: mpsc::UnboundedSender<Uuid>,
    /// Cancelled once the drain consumers have stopped (after the shutdown token): the last
    /// flush, then the task ends.
    pub stop: CancellationToken,
}

/// The settler task.
pub(crate) struct Settler {
    pub shared: Arc<Shared>,
    pub completions: CompletionQueue,
    /// Streams that could not be retired go back to the drain, out.
    pub queue: Arc<super::queue::DrainQueue>,
}

/// Coalescing of completions: wait [`flush_window`] after the first one, or until this many.
const FLUSH_WINDOW: Duration = Duration::from_millis(25);
const FLUSH_MAX: usize = 1000;

/// How long a flush waits for more completions while `live_workers` (this one included) share
/// the deployment's work: [`FLUSH_WINDOW`] for each, up to four. Each flush is followed by a
/// settle of its streams, and the workers of a deployment flush what one worker would have
/// flushed in one go: three workers each flushing every 25 ms made three times the calls of one
/// (issue 28). The cursor is the durable floor, so a later flush delays no apply; a stream
/// retired later rings no doorbell meanwhile, but its new work is re-offered by the next claim.
pub(crate) fn flush_window(live_workers: usize) -> Duration {
    FLUSH_WINDOW * live_workers.clamp(1, 4) as u32
}

/// The pause after the `attempt`-th failed round of the last flush before stopping, or `None`:
/// give up. The retry backoff of a running worker grows to `worker.retryOptions` limits (a
/// minute by default), far past a pod's termination grace; stopping tries at once and a few
/// times more within about 1.5 s. Rows left behind are retired by a later drain of their stream
/// (they are at or below its cursor), so giving up loses nothing.
pub(crate) fn final_flush_pause(attempt: u32) -> Option<Duration> {
    const PAUSES: [u64; 4] = [100, 200, 400, 800];
    PAUSES
        .get(attempt as usize)
        .map(|ms| Duration::from_millis(*ms))
}

impl FlushWorker {
    /// Completed work rows (work id, stream) → `complete_perspective_events`, in batches, until
    /// `stop` (the drain consumers are done): then a last flush of everything left.
    pub(crate) async fn run(self, mut rx: mpsc::UnboundedReceiver<(i64, Uuid)>) {
        let ctx = &self.shared;
        let mut tracker: CompletionTracker<(i64, Uuid)> =
            CompletionTracker::new(RetryPolicy::from_options(&ctx.config.worker.retry_options));
        'running: loop {
            if tracker.pending_count() == 0 && tracker.sent_count() == 0 {
                tokio::select! {
                    item = rx.recv() => match item {
                        Some(item) => tracker.add(item),
                        None => break 'running,
                    },
                    _ = self.stop.cancelled() => break 'running,
                }
            }
            // Coalesce.
            let live = ctx.live_workers.load(std::sync::atomic::Ordering::Relaxed);
            let deadline = tokio::time::Instant::now() + flush_window(live);
            while tracker.pending_count() < FLUSH_MAX {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(item)) => tracker.add(item),
                    Ok(None) | Err(_) => break,
                }
            }
            tracker.reset_stale(Instant::now());
            let batch = tracker.take_pending_up_to(FLUSH_MAX, Instant::now());
            if batch.is_empty() {
                // Waiting for the retry of a failed flush.
                tokio::select! {
                    _ = self.stop.cancelled() => break 'running,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                continue;
            }
            self.flush(&mut tracker, batch).await;
        }
        // Nothing more arrives: the drain consumers are done.
        rx.close();
        while let Ok(item) = rx.try_recv() {
            tracker.add(item);
        }
        self.final_flush(&mut tracker).await;
    }

    /// Everything the tracker holds, now, whatever its backoff; a few quick retries.
    async fn final_flush(&self, tracker: &mut CompletionTracker<(i64, Uuid)>) {
        let mut attempt = 0;
        loop {
            tracker.resend_all();
            while tracker.pending_count() > 0 {
                let batch = tracker.take_pending_up_to(FLUSH_MAX, Instant::now());
                if !self.flush(tracker, batch).await {
                    break;
                }
            }
            let left = tracker.pending_count() + tracker.sent_count();
            if left == 0 {
                return;
            }
            match final_flush_pause(attempt) {
                Some(pause) => tokio::time::sleep(pause).await,
                None => {
                    tracing::warn!(
                        rows = left,
                        "stopping with completed work rows not deleted; later drains of their \
                         streams retire them (they are at or below the cursors)"
                    );
                    return;
                }
            }
            attempt += 1;
        }
    }

    /// One flush of `batch` (taken from `tracker` as Sent); whether it went through.
    async fn flush(
        &self,
        tracker: &mut CompletionTracker<(i64, Uuid)>,
        batch: Vec<(i64, Uuid)>,
    ) -> bool {
        let ctx = &self.shared;
        let ids: Vec<i64> = batch.iter().map(|(id, _)| *id).collect();
        let result = ctx
            .store
            .complete_events(&ids, ctx.config.worker.debug_mode)
            .await;
        match result {
            Ok(_) => {
                tracker.mark_acknowledged(batch.len());
                self.completions.flushed(&batch);
                tracker.clear_acknowledged();
                self.cache
                    .lock()
                    .unwrap()
                    .activate_retention(Instant::now());
                ctx.metrics.completions_flushed.inc_by(batch.len() as u64);
                ctx.hooks
                    .emit(HookEvent::CompletionsFlushed { count: batch.len() });
                // A stream whose rows went out in several flushes settles after the last.
                let streams: HashSet<Uuid> = batch.iter().map(|(_, s)| *s).collect();
                for s in streams {
                    if !self.completions.awaiting_flush(&s) {
                        let _ = self.settle_tx.send(s);
                    }
                }
                true
            }
            Err(e) => {
                // They stay Sent; reset_stale re-queues them after the backoff. If the process
                // dies first, the rows are re-offered and the cursor skips them.
                ctx.metrics.completion_flush_failures.inc();
                tracing::warn!(error = %crate::db::describe_error(&e, None), count = batch.len(), "completion flush failed; will retry");
                false
            }
        }
    }
}

impl Settler {
    /// Streams that may be drained → `cleanup_completed_streams`. A stream that could not be
    /// retired (a producer was mid-append, or completions are not flushed yet, or it has work
    /// waiting for a retry) is handed back to the drain channel after a growing delay, a few times;
    /// after that the claim loop's own polls look after it. A stream this instance no longer
    /// holds (retired already, e.g. by a claim, or taken over) is settled: draining it again
    /// would find nothing it owns. So is one whose only work a backfill gates: a drain cannot
    /// apply that work, and the job's chunk that takes the stream rings the doorbell.
    pub(crate) async fn run(self, mut rx: mpsc::UnboundedReceiver<Uuid>) {
        let ctx = &self.shared;
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
            let settled = ctx.store.settle_streams(ctx.instance_id, &list).await;
            let settled: HashSet<Uuid> = match settled {
                Ok(r) => r.into_iter().collect(),
                Err(e) => {
                    tracing::warn!(error = %crate::db::describe_error(&e, None), "cleanup_completed_streams failed");
                    HashSet::new()
                }
            };
            for s in list {
                if settled.contains(&s) {
                    retries.remove(&s);
                    continue;
                }
                if self.completions.awaiting_flush(&s) {
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
                let queue = self.queue.clone();
                let shutdown = ctx.shutdown.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = tokio::time::sleep(delay) => {
                            queue.offer(s, super::queue::Offer::Signal);
                        }
                    }
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workers_of_a_deployment_flush_as_often_as_one_would() {
        let ms = |n| flush_window(n).as_millis();
        assert_eq!(ms(1), 25, "one worker");
        assert_eq!(ms(0), 25, "0 counts as 1");
        assert_eq!(ms(3), 75);
        assert_eq!(ms(40), 100, "never longer than four windows");
    }

    #[test]
    fn the_last_flush_retries_a_few_times_within_two_seconds_then_gives_up() {
        let pauses: Vec<Duration> = (0..).map_while(final_flush_pause).collect();
        assert_eq!(pauses.len(), 4, "four retries after the first attempt");
        assert!(
            pauses.windows(2).all(|w| w[0] < w[1]),
            "growing: {pauses:?}"
        );
        let total: Duration = pauses.iter().sum();
        assert!(
            total <= Duration::from_secs(2),
            "{total:?}: well inside a pod's termination grace, after the drain's 5 s"
        );
        assert_eq!(final_flush_pause(4), None);
        assert_eq!(final_flush_pause(u32::MAX), None);
    }
}
