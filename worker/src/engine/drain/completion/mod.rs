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
use crate::store::complete::AppliedUpTo;
use dedup::ProcessedEventCache;
use tracker::{CompletionTracker, RetryPolicy};

/// One applied work row on its way to the flush worker: its id (tracked until the flush that
/// deletes it), and the (stream, perspective) range it was applied in, which the flush deletes
/// (shared by the rows of one apply).
#[derive(Debug, Clone)]
pub(crate) struct AppliedRow {
    pub id: i64,
    pub range: Arc<AppliedUpTo>,
}

/// The ranges a flush of `rows` deletes: one per (stream, perspective), up to the highest
/// version applied, in a fixed order (every flush locks rows in the same order).
pub(crate) fn ranges_of(rows: &[AppliedRow]) -> Vec<AppliedUpTo> {
    let mut highest: HashMap<(Uuid, &str), &AppliedUpTo> = HashMap::new();
    for row in rows {
        let r = row.range.as_ref();
        highest
            .entry((r.stream_id, r.perspective.as_ref()))
            .and_modify(|h| {
                if r.version > h.version {
                    *h = r;
                }
            })
            .or_insert(r);
    }
    let mut ranges: Vec<AppliedUpTo> = highest.into_values().cloned().collect();
    ranges.sort_by(|a, b| (a.stream_id, &a.perspective).cmp(&(b.stream_id, &b.perspective)));
    ranges
}

/// Applied work rows on their way to the flush worker (Batched), and per stream which ones are
/// not deleted yet: such a stream cannot be retired before the flush, which settles it after.
#[derive(Clone)]
pub(crate) struct CompletionQueue {
    tx: mpsc::UnboundedSender<AppliedRow>,
    unflushed: Arc<Mutex<HashMap<Uuid, HashSet<i64>>>>,
    /// Streams of `unflushed` whose flush failed (the database unreachable, a failover) and
    /// waits for its retry: claims do not wait for that (see `streams_awaiting_flush`).
    retrying: Arc<Mutex<HashSet<Uuid>>>,
}

impl CompletionQueue {
    /// The queue and the flush worker's end of it.
    pub(crate) fn new() -> (Self, mpsc::UnboundedReceiver<AppliedRow>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = CompletionQueue {
            tx,
            unflushed: Arc::default(),
            retrying: Arc::default(),
        };
        (queue, rx)
    }

    /// Hand applied work rows `ids` of (`stream`, `perspective`) to the completion flush
    /// worker: they are at or below `up_to`, the pair's cursor after their apply.
    pub(crate) fn queue(&self, stream: Uuid, perspective: &str, up_to: i64, ids: &[i64]) {
        self.unflushed
            .lock()
            .unwrap()
            .entry(stream)
            .or_default()
            .extend(ids);
        let range = Arc::new(AppliedUpTo {
            stream_id: stream,
            perspective: perspective.into(),
            version: up_to,
        });
        for id in ids {
            let _ = self.tx.send(AppliedRow {
                id: *id,
                range: range.clone(),
            });
        }
    }

    /// The flush worker deleted these rows.
    fn flushed(&self, rows: &[AppliedRow]) {
        let mut unflushed = self.unflushed.lock().unwrap();
        for row in rows {
            let stream = &row.range.stream_id;
            if let Some(ids) = unflushed.get_mut(stream) {
                ids.remove(&row.id);
                if ids.is_empty() {
                    unflushed.remove(stream);
                    self.retrying.lock().unwrap().remove(stream);
                }
            }
        }
    }

    /// Whether applied rows of `stream` are still waiting for the flush worker.
    pub(crate) fn awaiting_flush(&self, stream: &Uuid) -> bool {
        self.unflushed.lock().unwrap().contains_key(stream)
    }

    /// The streams with applied rows still waiting for the flush worker, but for those whose
    /// flush failed. Their rows look pending to a claim until the flush deletes them; after it,
    /// the settler takes each one (and hands it back to the drain if it has new work). A failed
    /// flush's retry may be long in coming (its backoff), and after a failover to a standby
    /// that had not received the applies, its streams have work to redo: claims return them.
    pub(crate) fn streams_awaiting_flush(&self) -> Vec<Uuid> {
        let unflushed = self.unflushed.lock().unwrap();
        let retrying = self.retrying.lock().unwrap();
        unflushed
            .keys()
            .filter(|s| !retrying.contains(s))
            .copied()
            .collect()
    }

    /// The flush of `rows` failed; they wait for its retry.
    fn flush_failed(&self, rows: &[AppliedRow]) {
        let unflushed = self.unflushed.lock().unwrap();
        let mut retrying = self.retrying.lock().unwrap();
        for row in rows {
            if unflushed.contains_key(&row.range.stream_id) {
                retrying.insert(row.range.stream_id);
            }
        }
    }
}

/// The completion flush task.
pub(crate) struct FlushWorker {
    pub shared: Arc<Shared>,
    pub completions: CompletionQueue,
    /// Its retention starts once the rows it remembers are deleted.
    pub cache: Arc<Mutex<ProcessedEventCache>>,
    /// Streams whose rows were flushed, out: they may be drained.
    pub settle_tx: mpsc::UnboundedSender<ToSettle>,
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

/// Coalescing of completions: wait [`flush_window`] after the first one, or until a flush is
/// full ([`FlushBudget`]).
const FLUSH_WINDOW: Duration = Duration::from_millis(25);

/// What one flush takes at most: rows, and (stream, perspective) ranges. A flush deletes one
/// index range per pair, so its cost follows the pairs more than the rows: a deep drain call's
/// 10 000 rows of 100 pairs go in one statement of a few milliseconds (in flushes of 1 000
/// rows, the last call's ten flushes were the Batched apply benchmark's tail). At breadth (a
/// row per pair) a range costs a little more than an id did, and flushes of up to 10 000 pairs left the
/// wide rate 5–15% lower in three rounds: there a flush stays at 1 000 (issue 28).
#[derive(Debug)]
pub(crate) struct FlushBudget {
    rows: usize,
    ranges: usize,
    last: Option<Arc<AppliedUpTo>>,
}

impl FlushBudget {
    const MAX_ROWS: usize = 10_000;
    const MAX_RANGES: usize = 1_000;

    pub(crate) fn new() -> Self {
        FlushBudget {
            rows: 0,
            ranges: 0,
            last: None,
        }
    }

    /// Counts `row` in, if the flush has room for it. (Rows of one apply share their range and
    /// arrive together: a range counts when it differs from the previous row's.)
    pub(crate) fn admit(&mut self, row: &AppliedRow) -> bool {
        let new_range = !self
            .last
            .as_ref()
            .is_some_and(|last| Arc::ptr_eq(last, &row.range));
        let ranges = self.ranges + usize::from(new_range);
        if self.rows + 1 > Self::MAX_ROWS || ranges > Self::MAX_RANGES {
            return false;
        }
        self.rows += 1;
        self.ranges = ranges;
        self.last = Some(row.range.clone());
        true
    }

    /// The budget of the next flush as far as the rows `tracker` holds Pending fill it.
    pub(crate) fn of_pending(tracker: &CompletionTracker<AppliedRow>) -> Self {
        let mut budget = FlushBudget::new();
        for pending in tracker
            .iter()
            .filter(|t| t.state() == tracker::CompletionState::Pending)
        {
            if !budget.admit(pending.item()) {
                break;
            }
        }
        budget
    }

    /// Whether it can take no more.
    pub(crate) fn is_full(&self) -> bool {
        self.rows >= Self::MAX_ROWS || self.ranges >= Self::MAX_RANGES
    }
}

/// How long a flush waits for more completions while `live_workers` (this one included) share
/// the deployment's work: [`FLUSH_WINDOW`] for each, up to four. Each flush is followed by a
/// settle of its streams, and the workers of a deployment flush what one worker would have
/// flushed in one go: three workers each flushing every 25 ms made three times the calls of one
/// (issue 28). The cursor is the durable floor, so a later flush delays no other stream's apply;
/// the stream itself waits for it (claims pass over streams awaiting their flush), which is why
/// small drain calls complete their rows themselves (`Drainer::completes_at_once`).
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
    /// Applied work rows → `complete_applied_events`, by (stream, perspective) range, in
    /// batches, until `stop` (the drain consumers are done): then a last flush of everything left.
    pub(crate) async fn run(self, mut rx: mpsc::UnboundedReceiver<AppliedRow>) {
        let ctx = &self.shared;
        let mut tracker: CompletionTracker<AppliedRow> =
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
            // Until the next flush is full, counting what waits already (a flush that fell
            // behind goes again at once) and then what arrives (counted here: the tracker
            // counts by walking every item it holds, and thousands arrive at once from a deep
            // drain call).
            let mut next = FlushBudget::of_pending(&tracker);
            while !next.is_full() {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(item)) => {
                        next.admit(&item);
                        tracker.add(item);
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            tracker.reset_stale(Instant::now());
            let mut budget = FlushBudget::new();
            let batch = tracker.take_pending_while(Instant::now(), |row| budget.admit(row));
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
    async fn final_flush(&self, tracker: &mut CompletionTracker<AppliedRow>) {
        let mut attempt = 0;
        loop {
            tracker.resend_all();
            while tracker.pending_count() > 0 {
                let mut budget = FlushBudget::new();
                let batch = tracker.take_pending_while(Instant::now(), |row| budget.admit(row));
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
        tracker: &mut CompletionTracker<AppliedRow>,
        batch: Vec<AppliedRow>,
    ) -> bool {
        let ctx = &self.shared;
        let result = ctx
            .store
            .complete_events(&ranges_of(&batch), ctx.config.worker.debug_mode)
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
                let streams: HashSet<Uuid> = batch.iter().map(|r| r.range.stream_id).collect();
                for s in streams {
                    if !self.completions.awaiting_flush(&s) {
                        let _ = self.settle_tx.send(ToSettle {
                            stream: s,
                            progressed: true,
                        });
                    }
                }
                true
            }
            Err(e) => {
                // They stay Sent; reset_stale re-queues them after the backoff. If the process
                // dies first, the rows are re-offered and the cursor skips them.
                self.completions.flush_failed(&batch);
                ctx.metrics.completion_flush_failures.inc();
                tracing::warn!(error = %crate::db::describe_error(&e, None), count = batch.len(), "completion flush failed; will retry");
                false
            }
        }
    }
}

/// A stream for the settler to retire, and whether the drain that left it applied events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ToSettle {
    pub stream: Uuid,
    /// Events applied (in any round of the drain batch that left it, or in the rows its flush
    /// deleted): if it cannot be retired it most likely has new work (a hot stream), so it is
    /// drained again at once.
    pub progressed: bool,
}

/// How many times in a row a stream that makes no progress is handed back to the drain.
const SETTLE_RETRIES: u32 = 8;

/// What to do with a stream `cleanup_completed_streams` did not retire.
#[derive(Debug, PartialEq, Eq)]
enum Unsettled {
    /// Its flush will bring it back to the settler.
    AwaitFlush,
    /// Back to the drain after this delay.
    DrainAgain(Duration),
    /// Tried enough: the claim loop's polls look after it.
    GiveUp,
}

/// The rule for an unsettled stream, given the tries it has had without progress (`tries`,
/// updated). A stream whose drain applied events starts again at no delay: a hot stream's
/// producers find its active row and ring no doorbell, so this is the only thing that brings it
/// back soon (with a growing delay it waited up to 1.3 s, then for a poll: a p99 of 120-600 ms
/// with 10 streams at 1 000 events/s).
fn unsettled(tries: &mut u32, progressed: bool, awaiting_flush: bool) -> Unsettled {
    if awaiting_flush {
        *tries = 0;
        return Unsettled::AwaitFlush;
    }
    if progressed {
        *tries = 0;
        return Unsettled::DrainAgain(Duration::ZERO);
    }
    *tries += 1;
    if *tries > SETTLE_RETRIES {
        *tries = 0;
        return Unsettled::GiveUp;
    }
    Unsettled::DrainAgain(Duration::from_millis(10u64 << (*tries - 1).min(7)))
}

impl Settler {
    /// Streams that may be drained → `cleanup_completed_streams`. A stream that could not be
    /// retired (it has new work, a producer was mid-append, completions are not flushed yet, or
    /// it has work waiting for a retry) is handed back to the drain channel: at once if its
    /// drain applied events, else after a growing delay, a few times; after that the claim
    /// loop's own polls look after it (see [`unsettled`]). A stream this instance no longer
    /// holds (retired already, e.g. by a claim, or taken over) is settled: draining it again
    /// would find nothing it owns. So is one whose only work a backfill gates: a drain cannot
    /// apply that work, and the job's chunk that takes the stream rings the doorbell.
    pub(crate) async fn run(self, mut rx: mpsc::UnboundedReceiver<ToSettle>) {
        let ctx = &self.shared;
        let mut tries: HashMap<Uuid, u32> = HashMap::new();
        loop {
            let first = tokio::select! {
                _ = ctx.shutdown.cancelled() => return,
                s = rx.recv() => match s { Some(s) => s, None => return },
            };
            let mut streams: HashMap<Uuid, bool> =
                HashMap::from([(first.stream, first.progressed)]);
            let deadline = tokio::time::Instant::now() + Duration::from_millis(5);
            while let Ok(Some(s)) = tokio::time::timeout_at(deadline, rx.recv()).await {
                *streams.entry(s.stream).or_default() |= s.progressed;
            }
            let list: Vec<Uuid> = streams.keys().copied().collect();
            let settled = ctx.store.settle_streams(ctx.instance_id, &list).await;
            let settled: HashSet<Uuid> = match settled {
                Ok(r) => r.into_iter().collect(),
                Err(e) => {
                    tracing::warn!(error = %crate::db::describe_error(&e, None), "cleanup_completed_streams failed");
                    HashSet::new()
                }
            };
            for (s, progressed) in streams {
                if settled.contains(&s) {
                    tries.remove(&s);
                    continue;
                }
                let n = tries.entry(s).or_insert(0);
                let rule = unsettled(n, progressed, self.completions.awaiting_flush(&s));
                if *n == 0 {
                    tries.remove(&s);
                }
                match rule {
                    Unsettled::AwaitFlush | Unsettled::GiveUp => {}
                    Unsettled::DrainAgain(delay) => self.drain_again(s, delay),
                }
            }
        }
    }

    /// Hands `stream` back to the drain channel after `delay`.
    fn drain_again(&self, stream: Uuid, delay: Duration) {
        tracing::debug!(%stream, delay_ms = delay.as_millis() as u64, "stream not retired; draining it again");
        if delay.is_zero() {
            self.queue.offer(stream, super::queue::Offer::Signal);
            return;
        }
        let queue = self.queue.clone();
        let shutdown = self.shared.shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(delay) => {
                    queue.offer(stream, super::queue::Offer::Signal);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsettled_stream_that_progressed_is_drained_again_at_once_others_back_off() {
        let mut tries = 0;
        let ms = |r: Unsettled| match r {
            Unsettled::DrainAgain(d) => Some(d.as_millis() as u64),
            _ => None,
        };
        let delays: Vec<_> = (0..4)
            .map(|_| ms(unsettled(&mut tries, false, false)))
            .collect();
        assert_eq!(delays, [Some(10), Some(20), Some(40), Some(80)]);
        assert_eq!(
            ms(unsettled(&mut tries, true, false)),
            Some(0),
            "progress: at once"
        );
        assert_eq!(tries, 0, "and the delays start again");
        assert_eq!(ms(unsettled(&mut tries, false, false)), Some(10));
        assert_eq!(unsettled(&mut tries, true, true), Unsettled::AwaitFlush);
        for _ in 0..SETTLE_RETRIES {
            assert!(ms(unsettled(&mut tries, false, false)).is_some());
        }
        assert_eq!(unsettled(&mut tries, false, false), Unsettled::GiveUp);
        assert_eq!(tries, 0);
    }

    #[test]
    fn the_workers_of_a_deployment_flush_as_often_as_one_would() {
        let ms = |n| flush_window(n).as_millis();
        assert_eq!(ms(1), 25, "one worker");
        assert_eq!(ms(0), 25, "0 counts as 1");
        assert_eq!(ms(3), 75);
        assert_eq!(ms(40), 100, "never longer than four windows");
    }

    #[test]
    fn a_flush_deletes_one_range_per_pair_up_to_its_highest_applied_version() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let (queue, mut rx) = CompletionQueue::new();
        queue.queue(b, "p", 3, &[10, 11, 12]);
        queue.queue(a, "p", 2, &[20, 21]);
        queue.queue(a, "q", 2, &[30, 31]);
        queue.queue(b, "p", 5, &[13, 14]);
        let mut rows = Vec::new();
        while let Ok(row) = rx.try_recv() {
            rows.push(row);
        }
        assert_eq!(rows.len(), 9, "every row is tracked on its own");
        let ranges: Vec<(Uuid, String, i64)> = ranges_of(&rows)
            .into_iter()
            .map(|r| (r.stream_id, r.perspective.to_string(), r.version))
            .collect();
        assert_eq!(
            ranges,
            [(a, "p".into(), 2), (a, "q".into(), 2), (b, "p".into(), 5)],
            "one per pair, its highest version, in stream then perspective order"
        );
        // Part of a stream's rows flushed: it still awaits the flush of the rest.
        queue.flushed(&rows[..3]);
        assert!(queue.awaiting_flush(&b));
        queue.flushed(&rows[3..]);
        assert!(!queue.awaiting_flush(&a) && !queue.awaiting_flush(&b));
    }

    #[test]
    fn a_flush_takes_ten_thousand_rows_or_a_thousand_pairs() {
        let (queue, mut rx) = CompletionQueue::new();
        let rows = |rx: &mut mpsc::UnboundedReceiver<AppliedRow>| {
            let mut rows = Vec::new();
            while let Ok(row) = rx.try_recv() {
                rows.push(row);
            }
            rows
        };
        // Deep: 100 pairs of 150 rows. The budget fills at 10 000 rows (67 pairs).
        for s in 0..100u128 {
            let ids: Vec<i64> = (0..150).map(|i| (s * 1000 + i) as i64).collect();
            queue.queue(Uuid::from_u128(s), "p", 150, &ids);
        }
        let deep = rows(&mut rx);
        let mut budget = FlushBudget::new();
        let taken = deep.iter().take_while(|r| budget.admit(r)).count();
        assert_eq!(taken, 10_000);
        assert!(budget.is_full());
        assert_eq!(ranges_of(&deep[..taken]).len(), 67);
        // Wide: one row per pair. The budget fills at 1 000 pairs.
        for s in 0..3000u128 {
            queue.queue(Uuid::from_u128(s), "p", 1, &[s as i64]);
        }
        let wide = rows(&mut rx);
        let mut budget = FlushBudget::new();
        let taken = wide.iter().take_while(|r| budget.admit(r)).count();
        assert_eq!(taken, 1_000);
        assert!(budget.is_full() && !budget.admit(&wide[taken]));

        // A flush that fell behind goes again at once: the rows waiting fill the next one.
        // (Counting only what arrived since, each flush at breadth waited for its window: the
        // wide rate fell by a tenth.)
        let mut tracker = CompletionTracker::new(RetryPolicy::default());
        for row in &wide[..999] {
            tracker.add(row.clone());
        }
        assert!(!FlushBudget::of_pending(&tracker).is_full());
        tracker.add(wide[999].clone());
        assert!(FlushBudget::of_pending(&tracker).is_full());
        tracker.take_pending_up_to(10, Instant::now());
        assert!(
            !FlushBudget::of_pending(&tracker).is_full(),
            "rows sent are not waiting"
        );
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
