//! Drain consumers: take stream ids from the drain channel, batch them (sliding window), and
//! drain each batch — in the database through `wh_drain` for compiled SQL perspectives
//! (`server`), or by claiming and fetching rows for a custom runner (`fetch`) — re-fetching
//! each stream while it keeps producing work. `report` turns outcomes into metrics, hooks and
//! logs; `contention` brings back, after a short delay, the streams whose apply met a lock
//! conflict with another applier.

pub mod completion;
mod contention;
mod fetch;
pub mod queue;
mod report;
mod server;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::Instrument;
use uuid::Uuid;

use super::drain::queue::{DrainQueue, Offer};
use super::hooks::HookEvent;
use super::Shared;
use crate::config::{CompletionStrategy, DrainBatcherOptions};
use crate::contract::PerspectiveRunner;
use completion::dedup::ProcessedEventCache;
use completion::CompletionQueue;

/// The drain channel's receiving end, shared by the consumers.
pub(crate) type SharedReceiver = Arc<tokio::sync::Mutex<mpsc::Receiver<Uuid>>>;

/// Rows one claim+fetch round trip aims for.
const ROWS_PER_FETCH: usize = crate::config::DRAIN_ROWS_PER_FETCH;

/// What the drain consumers share.
pub(crate) struct Drainer {
    shared: Arc<Shared>,
    runner: Arc<dyn PerspectiveRunner>,
    /// Rows this pod applied whose completion is not flushed yet (custom runners).
    cache: Arc<Mutex<ProcessedEventCache>>,
    /// The in-process mutex of each (stream, perspective) being applied (custom runners).
    gates: fetch::PairGates,
    /// The streams queued for or being drained (and whether signalled again meanwhile).
    queue: Arc<DrainQueue>,
    /// Batches being drained right now (the sliding window only waits while one is).
    batches_in_flight: std::sync::atomic::AtomicUsize,
    /// Rows per stream the last `wh_drain` call took (`f64` bits; [`NO_DEPTH`]: none yet),
    /// which sizes the next batches (see [`batch_limit`]).
    observed_depth: std::sync::atomic::AtomicU64,
    /// Applied rows, out to the completion flush worker (Batched).
    completions: CompletionQueue,
    /// Streams that may be drained, out to the settler.
    settle_tx: mpsc::UnboundedSender<completion::ToSettle>,
    /// The retry delay after lock conflicts between appliers.
    contention: contention::ContentionBackoff,
}

impl Drainer {
    pub(crate) fn new(
        shared: Arc<Shared>,
        runner: Arc<dyn PerspectiveRunner>,
        cache: Arc<Mutex<ProcessedEventCache>>,
        completions: CompletionQueue,
        queue: Arc<DrainQueue>,
        settle_tx: mpsc::UnboundedSender<completion::ToSettle>,
    ) -> Self {
        Drainer {
            shared,
            runner,
            cache,
            gates: fetch::PairGates::default(),
            queue,
            batches_in_flight: Default::default(),
            observed_depth: std::sync::atomic::AtomicU64::new(NO_DEPTH),
            completions,
            settle_tx,
            contention: Default::default(),
        }
    }

    /// Whether a `wh_drain` call for `streams` completes the rows it applies itself (see
    /// [`completes_at_once`]), by the depth the last call found.
    fn completes_at_once(&self, streams: &[Uuid]) -> bool {
        let expected = self
            .observed_depth()
            .map(|depth| depth * streams.len() as f64);
        completes_at_once(&self.shared.config.worker.completion_strategy, expected)
    }

    /// One consumer loop, the `index`th (from 0): it takes batches while fewer than `index + 1`
    /// consumers would leave the worker under its share of the deployment's drain consumers
    /// ([`Shared::drain_width`]), and waits otherwise.
    pub(crate) async fn consume(self: Arc<Self>, rx: SharedReceiver, index: usize) {
        let mut width = self.shared.drain_width.subscribe();
        loop {
            tokio::select! {
                _ = self.shared.shutdown.cancelled() => return,
                turn = width.wait_for(|w| index < *w) => if turn.is_err() { return },
            }
            let Some(batch) = next_batch(&self, &rx, index, &mut width).await else {
                return;
            };
            if batch.is_empty() {
                continue; // no longer its turn
            }
            // Every log line of the batch carries the instance (and its pairs' lines their pair).
            let span = tracing::info_span!("drain_batch", instance_id = %self.shared.instance_id,
                                           streams = batch.len());
            process_streams(&self, batch).instrument(span).await;
            self.batches_in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Rows a drain call (or, for custom runners, a fetch) applies at most to complete them itself,
/// in its apply transactions, under the Batched strategy.
pub(super) const COMPLETE_AT_ONCE_ROWS: f64 = 500.0;

/// Whether an apply of `rows` (expected; `None`: not known) deletes the work rows it applied in
/// its own transaction (as Instant does) rather than handing them to the flush worker: always
/// with Instant; with Batched when it is small. A stream waits for its flush before its next
/// drain (claims pass over it meanwhile), so for a drain of a few events the flush's own commit
/// and window were most of their latency (10 hot streams at 1 000 events/s: p99 35 ms against
/// 17 ms with Instant), while deep backlogs keep the flush's batched range deletes. The guess
/// comes from the depth the last call found; a `wh_drain` call guessed small takes at most this
/// many rows, so a wrong guess (a catch-up's deep streams after live ones) costs one small call,
/// not a deep call's deletes in its own transaction (that had a rolling update's p99 at 240
/// against 130 ms).
pub(crate) fn completes_at_once(strategy: &CompletionStrategy, rows: Option<f64>) -> bool {
    match strategy {
        CompletionStrategy::Instant => true,
        CompletionStrategy::Batched => rows.is_some_and(|r| r <= COMPLETE_AT_ONCE_ROWS),
    }
}

/// No `wh_drain` call has reported its depth yet.
const NO_DEPTH: u64 = u64::MAX;

impl Drainer {
    /// Record the rows per stream a `wh_drain` call took (calls that took nothing say nothing).
    pub(super) fn observe_depth(&self, rows: i64, streams: usize) {
        if rows > 0 && streams > 0 {
            let depth = rows as f64 / streams as f64;
            self.observed_depth
                .store(depth.to_bits(), Ordering::Relaxed);
        }
    }

    /// Record that a call expected small met deeper streams (it stopped at its rows): deep
    /// enough that the next call leaves its rows to the flush, which then reports the depth.
    pub(super) fn observe_deep(&self) {
        let depth = self
            .observed_depth()
            .unwrap_or(0.0)
            .max(COMPLETE_AT_ONCE_ROWS + 1.0);
        self.observed_depth
            .store(depth.to_bits(), Ordering::Relaxed);
    }

    fn observed_depth(&self) -> Option<f64> {
        match self.observed_depth.load(Ordering::Relaxed) {
            NO_DEPTH => None,
            bits => Some(f64::from_bits(bits)),
        }
    }
}

/// Stream ids one batch may hold. Until a call has reported its depth, the full-depth limit
/// (`WorkerOptions::drain_batch_limit`: every stream assumed to yield `perspectiveBatchSize`
/// rows per perspective). After, as many streams as keep a call near [`ROWS_PER_FETCH`] rows
/// at the depth the last call found, up to `drainBatcher.maxSize`: shallow streams (one event
/// each, 2 rows) fill a call with 1000 streams instead of 50. A call that meets deeper streams
/// than expected stops at its row budget and hands the rest back ("more"), and its depth sizes
/// the next batches down again.
pub(crate) fn batch_limit(
    full_depth_limit: usize,
    max_size: usize,
    observed: Option<f64>,
) -> usize {
    let floor = full_depth_limit.max(1);
    match observed {
        Some(rows) if rows > 0.0 => {
            ((ROWS_PER_FETCH as f64 / rows) as usize).clamp(floor, max_size.max(floor))
        }
        _ => floor,
    }
}

/// Pairs with at most this many pending rows may take `wh_drain`'s set-based path.
pub(crate) const SHALLOW_PAIR_ROWS: i32 = 16;

/// The `shallow_rows` of the next `wh_drain` call: the set-based path only while the last call
/// found shallow pairs (on average at most half of [`SHALLOW_PAIR_ROWS`] rows per stream and
/// perspective). That path first reads up to `SHALLOW_PAIR_ROWS + 1` rows of every pair, which
/// is wasted on deep ones; until a call has reported its depth, streams are assumed deep.
pub(crate) fn shallow_rows(observed: Option<f64>, perspectives: usize) -> i32 {
    match observed {
        Some(rows) if rows / perspectives.max(1) as f64 <= f64::from(SHALLOW_PAIR_ROWS) / 2.0 => {
            SHALLOW_PAIR_ROWS
        }
        _ => 0,
    }
}

/// The streams one batch takes of a backlog of `queued`: its share among the `idle` consumers
/// (itself included, so a claim's streams are drained side by side, not by the first consumer
/// alone), within the batch limit and never below the full-depth limit `floor`. Shared among the
/// idle ones, not among all: a claim's 1 000 streams reaching 4 idle consumers make 4 batches of
/// 250, where a share of the whole pool left after each batch made 250, 188, 141, 106, 79, …
/// — many small calls, each paying a call's fixed cost. A lone id (`queued` 1) is no backlog:
/// ids that trickle in after it may join up to the limit.
pub(crate) fn share_of_backlog(limit: usize, floor: usize, queued: usize, idle: usize) -> usize {
    if queued <= 1 {
        return limit.max(1);
    }
    queued
        .div_ceil(idle.max(1))
        .clamp(floor.min(limit).max(1), limit.max(1))
}

/// Wait for the first stream id, then gather more with the sliding window (see [`gather`]).
/// Empty when the worker's drain shrank below the `index`th consumer meanwhile: the consumers
/// that had passed their turn wait for the channel in line, and would each take one more batch.
async fn next_batch(
    ctx: &Drainer,
    rx: &SharedReceiver,
    index: usize,
    width: &mut tokio::sync::watch::Receiver<usize>,
) -> Option<Vec<Uuid>> {
    let config = &ctx.shared.config;
    let floor = config.worker.drain_batch_limit(config.perspectives.len());
    let limit = batch_limit(
        floor,
        config.worker.drain_batcher.max_size as usize,
        ctx.observed_depth(),
    );
    let mut rx = rx.lock().await;
    let first = tokio::select! {
        // Before an id that is already there.
        biased;
        _ = ctx.shared.shutdown.cancelled() => return None,
        shrunk = width.wait_for(|w| index >= *w) => return shrunk.ok().map(|_| Vec::new()),
        id = rx.recv() => id?,
    };
    let in_flight = ctx.batches_in_flight.load(Ordering::Relaxed);
    let max_size = share_of_backlog(
        limit,
        floor,
        rx.len() + 1,
        ctx.shared.drain_width().saturating_sub(in_flight),
    );
    let busy = || ctx.batches_in_flight.load(Ordering::Relaxed) > 0;
    let opts = &config.worker.drain_batcher;
    let batch = gather(&mut rx, first, opts, max_size, busy).await;
    // In flight from here, before the next consumer takes the channel and counts the idle ones
    // (`Drainer::consume` ends it).
    ctx.batches_in_flight.fetch_add(1, Ordering::Relaxed);
    Some(batch)
}

/// A batch starting with `first`, of at most `max_size` distinct ids. The sliding window only
/// applies while another batch is being processed (`busy`: an idle engine applies a lone event
/// at once, a busy one coalesces bursts for the same streams into one pass), and only to ids
/// that trickle in: ids that were already queued behind the first one came from one claim,
/// which delivers everything it found at once, so waiting after them would only delay a
/// backlog's last batch.
async fn gather(
    rx: &mut mpsc::Receiver<Uuid>,
    first: Uuid,
    opts: &DrainBatcherOptions,
    max_size: usize,
    busy: impl Fn() -> bool,
) -> Vec<Uuid> {
    let mut batch = vec![first];
    let mut seen: HashSet<Uuid> = HashSet::from([first]);
    let mut from_backlog = false;
    // Tokio's clock, like the timeouts below.
    let started = tokio::time::Instant::now();
    let window = Duration::from_millis(opts.sliding_window_milliseconds);
    let max_wait = Duration::from_millis(opts.max_wait_milliseconds);
    while batch.len() < max_size {
        // Whatever is already queued joins for free.
        match rx.try_recv() {
            Ok(id) => {
                from_backlog = true;
                if seen.insert(id) {
                    batch.push(id);
                }
                continue;
            }
            Err(_) if from_backlog || !busy() => break,
            Err(_) => {}
        }
        let left = max_wait.saturating_sub(started.elapsed()).min(window);
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some(id)) => {
                if seen.insert(id) {
                    batch.push(id);
                }
            }
            _ => break,
        }
    }
    batch
}

/// The streams of a batch being drained: the guard ends their drain on drop, so a failed drain
/// can never leave them marked as being drained.
struct InFlight<'a> {
    ctx: &'a Drainer,
    streams: Vec<Uuid>,
}
impl InFlight<'_> {
    /// End the drain of the batch's streams; returns the ones signalled again since the last
    /// look (they need another pass).
    fn finish(&mut self) -> Vec<Uuid> {
        self.ctx.queue.finish(&std::mem::take(&mut self.streams))
    }
}
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}
/// Claim, fetch and apply `streams`, re-fetching busy streams up to `drainLoopMaxIterations`
/// times; a stopping worker takes no further pass (its stop waits for this batch, and the
/// streams it still holds then go to its live peers).
async fn process_streams(ctx: &Drainer, streams: Vec<Uuid>) {
    let mine = ctx.queue.start(streams);
    if mine.is_empty() {
        return;
    }
    let mut guard = InFlight {
        ctx,
        streams: mine.clone(),
    };
    let started = Instant::now();
    let mut applied_total = 0u64;
    let mut current = mine.clone();
    // Streams with events applied in any round of this batch (the last round of a busy stream
    // often finds nothing: what came since is the settler's to find).
    let mut progressed: HashSet<Uuid> = HashSet::new();
    let mut iterations = 0;
    let max_iterations = ctx.shared.config.worker.drain_loop_max_iterations.max(1);
    while !current.is_empty()
        && iterations < max_iterations
        && (iterations == 0 || !ctx.shared.shutdown.is_cancelled())
    {
        iterations += 1;
        let Round {
            applied,
            busy,
            contended,
            progressed: applied_to,
        } = drain_once(ctx, &current).await;
        applied_total += applied;
        progressed.extend(applied_to);
        // A stream signalled again while we drained it gets another pass; one whose apply met a
        // lock conflict comes back after a short delay (`contention`), not in this loop.
        let mut next: Vec<Uuid> = busy;
        for s in ctx.queue.take_reruns(&mine) {
            if !next.contains(&s) {
                next.push(s);
            }
        }
        next.retain(|s| !contended.contains(s));
        // Streams we stop looking at may be drained: try to retire them (see `settle`). Those
        // with completions queued are settled by the flush worker once they are deleted
        // (retiring before would fail and only bring them back here).
        for s in current.iter().filter(|s| {
            !next.contains(s) && !contended.contains(s) && !ctx.completions.awaiting_flush(s)
        }) {
            let _ = ctx.settle_tx.send(completion::ToSettle {
                stream: *s,
                progressed: progressed.contains(s),
            });
        }
        if contended.is_empty() {
            ctx.contention.calm();
        } else {
            let delay = ctx.contention.next_delay();
            contention::retry_later(&ctx.queue, &ctx.shared.shutdown, contended, delay);
        }
        current = next;
    }
    // Streams still busy after the last iteration, or signalled after the last look, go back
    // to the channel for another consumer.
    for s in guard.finish() {
        if !current.contains(&s) {
            current.push(s);
        }
    }
    for s in current {
        tracing::debug!(stream = %s, iterations, "stream still busy; back to the drain channel");
        ctx.queue.offer(s, Offer::Signal);
    }
    ctx.shared.metrics.batches.inc();
    ctx.shared
        .metrics
        .batch_duration
        .observe(started.elapsed().as_secs_f64());
    tracing::debug!(applied = applied_total, iterations, "drain batch done");
    ctx.shared.hooks.emit(HookEvent::BatchCycleComplete {
        streams: mine.len(),
        events_applied: applied_total,
    });
}
/// What one drain round did.
#[derive(Default)]
struct Round {
    /// Events applied.
    applied: u64,
    /// Streams worth re-fetching.
    busy: Vec<Uuid>,
    /// Streams whose apply met a lock conflict with another applier (nothing recorded): to be
    /// drained again after a short delay.
    contended: HashSet<Uuid>,
    /// Streams with events applied.
    progressed: HashSet<Uuid>,
}
/// One drain round for `streams`.
async fn drain_once(ctx: &Drainer, streams: &[Uuid]) -> Round {
    if ctx.runner.server_side_drain() {
        server::drain(ctx, streams).await
    } else {
        fetch::fetch_and_apply(ctx, streams).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batcher(window: u64, max_wait: u64) -> DrainBatcherOptions {
        DrainBatcherOptions {
            sliding_window_milliseconds: window,
            max_wait_milliseconds: max_wait,
            max_size: 1000,
        }
    }

    #[test]
    fn small_applies_complete_their_rows_themselves_deep_ones_leave_them_to_the_flush() {
        use CompletionStrategy::{Batched, Instant};
        assert!(
            completes_at_once(&Batched, Some(3.5)),
            "a hot stream's few events"
        );
        assert!(completes_at_once(&Batched, Some(500.0)));
        assert!(!completes_at_once(&Batched, Some(501.0)));
        assert!(
            !completes_at_once(&Batched, Some(2.0 * 1000.0)),
            "1 000 one-event streams"
        );
        assert!(!completes_at_once(&Batched, None), "no depth known yet");
        assert!(completes_at_once(&Instant, None));
        assert!(completes_at_once(&Instant, Some(10_000.0)));
    }

    /// Send `ids` one by one, `gap` apart, then close the channel.
    fn trickle(tx: mpsc::Sender<Uuid>, ids: Vec<Uuid>, gap: Duration) {
        tokio::spawn(async move {
            for id in ids {
                tokio::time::sleep(gap).await;
                if tx.send(id).await.is_err() {
                    return;
                }
            }
        });
    }

    #[test]
    fn batches_grow_to_max_size_when_streams_are_shallow_and_shrink_when_deep() {
        // Defaults with 2 perspectives: full depth 200 rows per stream → 50 streams.
        assert_eq!(
            batch_limit(50, 1000, None),
            50,
            "before any call: full depth"
        );
        assert_eq!(
            batch_limit(50, 1000, Some(2.0)),
            1000,
            "one event per stream"
        );
        assert_eq!(batch_limit(50, 1000, Some(40.0)), 250);
        assert_eq!(batch_limit(50, 1000, Some(200.0)), 50, "full depth again");
        assert_eq!(
            batch_limit(50, 1000, Some(5000.0)),
            50,
            "never below full depth"
        );
        assert_eq!(
            batch_limit(50, 100, Some(1.0)),
            100,
            "never above drainBatcher.maxSize"
        );
        assert_eq!(batch_limit(0, 0, Some(1.0)), 1);
    }

    #[test]
    fn the_set_based_path_is_asked_for_only_after_shallow_calls() {
        assert_eq!(shallow_rows(None, 2), 0, "before any call: deep assumed");
        assert_eq!(
            shallow_rows(Some(2.0), 2),
            SHALLOW_PAIR_ROWS,
            "one event per pair"
        );
        assert_eq!(shallow_rows(Some(16.0), 2), SHALLOW_PAIR_ROWS, "8 per pair");
        assert_eq!(shallow_rows(Some(18.0), 2), 0, "9 per pair");
        assert_eq!(shallow_rows(Some(200.0), 2), 0, "full depth");
        assert_eq!(shallow_rows(Some(8.0), 1), SHALLOW_PAIR_ROWS);
        assert_eq!(shallow_rows(Some(8.0), 0), SHALLOW_PAIR_ROWS);
        assert_eq!(
            shallow_rows(Some(60.0), 30),
            SHALLOW_PAIR_ROWS,
            "2 per pair, 30 perspectives"
        );
    }

    #[test]
    fn a_backlog_is_shared_among_the_consumers() {
        assert_eq!(share_of_backlog(1000, 50, 1000, 4), 250);
        assert_eq!(
            share_of_backlog(1000, 50, 750, 3),
            250,
            "the next idle consumer takes as much"
        );
        assert_eq!(
            share_of_backlog(1000, 50, 315, 1),
            315,
            "the only idle consumer takes the rest"
        );
        assert_eq!(
            share_of_backlog(1000, 50, 4000, 4),
            1000,
            "never above the limit"
        );
        assert_eq!(
            share_of_backlog(1000, 50, 100, 4),
            50,
            "never below full depth"
        );
        assert_eq!(
            share_of_backlog(50, 50, 1000, 4),
            50,
            "deep streams: full depth"
        );
        assert_eq!(
            share_of_backlog(1000, 50, 1, 4),
            1000,
            "a lone id: no backlog"
        );
        assert_eq!(share_of_backlog(1000, 50, 2, 1), 50);
        assert_eq!(
            share_of_backlog(30, 50, 1000, 4),
            30,
            "the limit wins over the floor"
        );
        assert_eq!(share_of_backlog(0, 0, 0, 0), 1);
    }

    #[tokio::test]
    async fn sliding_window_milliseconds_is_the_quiet_period_that_closes_a_busy_batch() {
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
        // Ids 600 ms apart: twice the default window, well inside this one.
        let (tx, mut rx) = mpsc::channel(16);
        trickle(tx, ids[1..].to_vec(), Duration::from_millis(600));
        let batch = gather(&mut rx, ids[0], &batcher(5000, 60_000), 1000, || true).await;
        assert_eq!(
            batch, ids,
            "the channel closing ends the batch, not the window"
        );
        // A short window closes before the next id arrives.
        let (tx, mut rx) = mpsc::channel(16);
        trickle(tx, ids[1..].to_vec(), Duration::from_millis(600));
        let batch = gather(&mut rx, ids[0], &batcher(50, 60_000), 1000, || true).await;
        assert_eq!(batch, ids[..1]);
    }

    #[tokio::test]
    async fn max_wait_milliseconds_bounds_how_long_a_busy_batch_stays_open() {
        let (tx, mut rx) = mpsc::channel(16);
        let ids: Vec<Uuid> = (0..1000).map(|_| Uuid::now_v7()).collect();
        // An id every 50 ms: the 5 s window never closes the batch.
        trickle(tx, ids[1..].to_vec(), Duration::from_millis(50));
        let started = Instant::now();
        let batch = gather(&mut rx, ids[0], &batcher(5000, 400), 1000, || true).await;
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_millis(2500),
            "closed after {took:?}, expected at 400 ms (the default is 3 s)"
        );
        assert!(batch.len() > 1 && batch.len() < 60, "{} ids", batch.len());
        assert_eq!(batch[..], ids[..batch.len()]);
    }

    #[tokio::test]
    async fn an_idle_engine_or_a_backlog_does_not_wait_for_the_window() {
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
        let (tx, mut rx) = mpsc::channel(16);
        let started = Instant::now();
        let batch = gather(&mut rx, ids[0], &batcher(5000, 60_000), 1000, || false).await;
        assert_eq!(batch, ids[..1]);
        // Queued ids join, duplicates once, and the batch closes when the queue is empty.
        for id in [ids[1], ids[0], ids[2], ids[1]] {
            tx.send(id).await.unwrap();
        }
        let batch = gather(&mut rx, ids[0], &batcher(5000, 60_000), 1000, || true).await;
        assert_eq!(batch, ids);
        assert!(started.elapsed() < Duration::from_secs(4));
        drop(tx);
    }

    #[tokio::test]
    async fn a_batch_holds_at_most_max_size_ids() {
        let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
        let (tx, mut rx) = mpsc::channel(16);
        for id in &ids[1..] {
            tx.send(*id).await.unwrap();
        }
        let batch = gather(&mut rx, ids[0], &batcher(5000, 60_000), 3, || true).await;
        assert_eq!(batch, ids[..3]);
        assert_eq!(rx.try_recv().unwrap(), ids[3], "the rest stays queued");
    }
}
