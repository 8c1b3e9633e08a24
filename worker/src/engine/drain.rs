//! Drain consumers: take stream ids from the drain channel, batch them, claim and fetch their
//! work in one round trip, and apply every (stream, perspective) group through the runner —
//! groups in parallel, each pair under its in-process mutex, each stream re-fetched while it
//! keeps producing work.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::mpsc;
use uuid::Uuid;

use super::hooks::HookEvent;
use super::runner::{ApplyMode, Group, WorkItem};
use super::Ctx;
use crate::config::{CompletionStrategy, DrainBatcherOptions};
use crate::store::drain::{DrainArgs, FetchArgs};
use crate::store::failure::Failure;

pub(crate) type SharedReceiver = Arc<tokio::sync::Mutex<mpsc::Receiver<Uuid>>>;

/// Rows one claim+fetch round trip aims for.
const ROWS_PER_FETCH: usize = crate::config::DRAIN_ROWS_PER_FETCH;

/// One consumer loop.
pub(crate) async fn consumer(ctx: Arc<Ctx>, rx: SharedReceiver) {
    loop {
        let Some(batch) = next_batch(&ctx, &rx).await else {
            return;
        };
        process_streams(&ctx, batch).await;
    }
}

/// Wait for the first stream id, then gather more with the sliding window (see [`gather`]).
async fn next_batch(ctx: &Ctx, rx: &SharedReceiver) -> Option<Vec<Uuid>> {
    let max_size = ctx
        .config
        .worker
        .drain_batch_limit(ctx.config.perspectives.len());
    let mut rx = rx.lock().await;
    let first = tokio::select! {
        _ = ctx.shutdown.cancelled() => return None,
        id = rx.recv() => id?,
    };
    let busy = || {
        ctx.batches_in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    };
    Some(
        gather(
            &mut rx,
            first,
            &ctx.config.worker.drain_batcher,
            max_size,
            busy,
        )
        .await,
    )
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

/// Streams this pod is draining right now; a signal for one of them asks the running drain to
/// look once more instead of starting a second one. The guard removes the entry on drop, so it
/// can never be left set by a failed drain.
struct InFlight<'a> {
    ctx: &'a Ctx,
    streams: Vec<Uuid>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut map = self.ctx.in_flight.lock().unwrap();
        for s in &self.streams {
            map.remove(s);
        }
    }
}

/// Claim, fetch and apply `streams`, re-fetching busy streams up to `drainLoopMaxIterations`.
pub(crate) async fn process_streams(ctx: &Ctx, streams: Vec<Uuid>) {
    let mine: Vec<Uuid> = {
        let mut map = ctx.in_flight.lock().unwrap();
        streams
            .into_iter()
            .filter(|s| match map.get_mut(s) {
                Some(rerun) => {
                    *rerun = true;
                    false
                }
                None => {
                    map.insert(*s, false);
                    true
                }
            })
            .collect()
    };
    if mine.is_empty() {
        return;
    }
    let _guard = InFlight {
        ctx,
        streams: mine.clone(),
    };
    ctx.batches_in_flight
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let started = Instant::now();
    let mut applied_total = 0u64;
    let mut current = mine.clone();
    let mut iterations = 0;
    let max_iterations = ctx.config.worker.drain_loop_max_iterations.max(1);
    while !current.is_empty() && iterations < max_iterations {
        iterations += 1;
        let Round { applied, busy } = drain_once(ctx, &current).await;
        applied_total += applied;
        // A stream signalled again while we drained it gets another pass.
        let reruns: Vec<Uuid> = {
            let mut map = ctx.in_flight.lock().unwrap();
            mine.iter()
                .filter(|s| {
                    map.get_mut(s)
                        .map(|r| std::mem::replace(r, false))
                        .unwrap_or(false)
                })
                .copied()
                .collect()
        };
        let mut next: Vec<Uuid> = busy;
        for s in reruns {
            if !next.contains(&s) {
                next.push(s);
            }
        }
        // Streams we stop looking at may be drained: try to retire them (see `settle`). Those
        // with completions queued are settled by the flush worker once they are deleted
        // (retiring before would fail and only bring them back here).
        for s in current
            .iter()
            .filter(|s| !next.contains(s) && !ctx.awaiting_flush(s))
        {
            let _ = ctx.settle_tx.send(*s);
        }
        current = next;
    }
    // Streams still busy after the last iteration go back to the channel for another consumer.
    for s in current {
        tracing::debug!(stream = %s, iterations, "stream still busy; back to the drain channel");
        let _ = ctx.drain_tx.try_send(s);
    }
    ctx.batches_in_flight
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    ctx.metrics.batches.inc();
    ctx.metrics
        .batch_duration
        .observe(started.elapsed().as_secs_f64());
    ctx.hooks.emit(HookEvent::BatchCycleComplete {
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
}

/// One drain round for `streams`.
async fn drain_once(ctx: &Ctx, streams: &[Uuid]) -> Round {
    if ctx.runner.server_side_drain() {
        server_drain(ctx, streams).await
    } else {
        fetch_and_apply(ctx, streams).await
    }
}

/// Claim and apply in the database, one round trip per batch of streams (compiled SQL
/// perspectives): no rows travel to the worker and no leases are written.
async fn server_drain(ctx: &Ctx, streams: &[Uuid]) -> Round {
    let per_pair = ctx.config.worker.perspective_batch_size.max(1) as i64;
    let max_rows = (per_pair * streams.len() as i64 * ctx.config.perspectives.len() as i64)
        .clamp(100, 2 * ROWS_PER_FETCH as i64);
    let instant = ctx.config.worker.completion_strategy == CompletionStrategy::Instant;
    let w = &ctx.config.worker;
    let args = DrainArgs {
        instance_id: ctx.instance_id,
        per_pair: per_pair as i32,
        max_rows: max_rows as i32,
        instant,
        debug: w.debug_mode,
        retry_base_ms: w.failure_retry_base_milliseconds as f64,
        retry_max_ms: w.failure_retry_max_milliseconds as f64,
        notify_applied: w.notify_applied,
        max_attempts: w.max_perspective_event_attempts.map(|m| m as i32),
    };
    let outcomes = ctx.store.drain(streams, args).await;
    let outcomes = match outcomes {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(error = %crate::db::describe_error(&e, None), "wh_drain failed");
            return Round::default();
        }
    };
    let mut applied = 0u64;
    let mut rows_per_stream: BTreeMap<Uuid, i64> = BTreeMap::new();
    let mut more: HashSet<Uuid> = HashSet::new();
    let now = chrono::Utc::now();
    let mut completed: Vec<(Uuid, Uuid)> = Vec::new();
    for o in outcomes {
        *rows_per_stream.entry(o.stream_id).or_default() += o.rows as i64;
        if o.more {
            more.insert(o.stream_id);
        }
        let perspective = o.perspective.as_str();
        if o.rewound {
            report_rewound(ctx, perspective, o.stream_id);
        }
        super::lifecycle::post_perspective(ctx, perspective, o.stream_id, &o.applied_event_ids);
        completed.extend(o.completed_event_ids.iter().map(|e| (o.stream_id, *e)));
        if !o.dead_lettered.is_empty() {
            report_dead_lettered(ctx, perspective, o.stream_id, o.dead_lettered.clone());
        }
        if o.applied > 0 {
            applied += o.applied as u64;
            let latency = o.oldest.map(|t| seconds_since(t, now));
            report_applied(
                ctx,
                perspective,
                o.stream_id,
                o.applied as u32,
                o.last_version.unwrap_or_default(),
                latency.into_iter(),
            );
        }
        if let Some(work_id) = o.failed_work_id {
            report_failed(
                ctx,
                perspective,
                o.stream_id,
                work_id,
                o.error.as_deref().unwrap_or_default(),
            );
        }
        if !instant && !o.done_work_ids.is_empty() {
            ctx.queue_completions(o.stream_id, &o.done_work_ids);
        }
    }
    let min_batch = ctx.config.worker.drain_loop_refetch_min_batch.max(1) as i64;
    super::lifecycle::fire(ctx, &completed).await;
    tracing::debug!(
        streams = streams.len(),
        streams_with_work = rows_per_stream.len(),
        rows = rows_per_stream.values().sum::<i64>(),
        streams_with_more = more.len(),
        "wh_drain round"
    );
    // The drain loop's rule (a stream that yielded at least drainLoopRefetchMinBatch rows is
    // fetched again), except that the database has just said whether anything is left: a
    // refetch that would find nothing is skipped, and the stream goes to the settler instead.
    // A pair the row budget did not reach (0 rows, more) is always fetched again.
    let busy = streams
        .iter()
        .filter(|s| {
            let rows = rows_per_stream.get(s).copied().unwrap_or(0);
            more.contains(s) && (rows >= min_batch || rows == 0)
        })
        .copied()
        .collect();
    Round { applied, busy }
}

/// One claim+fetch round for `streams` and the application of everything it returned through
/// the runner.
async fn fetch_and_apply(ctx: &Ctx, streams: &[Uuid]) -> Round {
    let per_pair = ctx.config.worker.perspective_batch_size.max(1) as i64;
    let max_rows = (per_pair * streams.len() as i64 * ctx.config.perspectives.len() as i64)
        .clamp(100, 2 * ROWS_PER_FETCH as i64);
    let args = FetchArgs {
        instance_id: ctx.instance_id,
        lease_seconds: ctx.config.worker.lease_seconds as i32,
        max_rows: max_rows as i32,
        per_pair: per_pair as i32,
        debug: ctx.config.worker.debug_mode,
        payloads: ctx.runner.needs_event_payloads(),
    };
    let fetched = ctx.store.claim_and_fetch(streams, args).await;
    let items = match fetched {
        Ok(items) => items,
        Err(e) => {
            tracing::warn!(error = %crate::db::describe_error(&e, None), "claim_and_fetch failed");
            return Round::default();
        }
    };
    let mut per_stream: BTreeMap<Uuid, usize> = streams.iter().map(|s| (*s, 0)).collect();
    for i in &items {
        *per_stream.entry(i.stream_id).or_default() += 1;
    }
    let busy: Vec<Uuid> = per_stream
        .iter()
        .filter(|(_, n)| **n >= ctx.config.worker.drain_loop_refetch_min_batch.max(1) as usize)
        .map(|(s, _)| *s)
        .collect();
    if items.is_empty() {
        return Round { applied: 0, busy };
    }

    let items = dead_letter_filter(ctx, items).await;
    let items = dedup_filter(ctx, items);
    let groups = group(items, ctx.config.worker.perspective_batch_size as usize);
    let applied = apply_groups(ctx, groups).await;
    Round { applied, busy }
}

/// Rows already tried `maxPerspectiveEventAttempts` times (a lease counts as a try, so a worker
/// that died mid-apply counts too) go to the dead letters before they are tried again; if moving
/// them fails they stay (and are tried next time).
async fn dead_letter_filter(ctx: &Ctx, items: Vec<WorkItem>) -> Vec<WorkItem> {
    let Some(max) = ctx.config.worker.max_perspective_event_attempts else {
        return items;
    };
    // The lease that fetched them counted an attempt that has not run.
    let (poison, good): (Vec<WorkItem>, Vec<WorkItem>) = items
        .into_iter()
        .partition(|i| exhausted(i.attempts - 1, Some(max)));
    if poison.is_empty() {
        return good;
    }
    let ids: Vec<i64> = poison.iter().map(|i| i.event_work_id).collect();
    let moved = ctx.store.move_to_dead_letters(ctx.instance_id, &ids).await;
    match moved {
        Ok(_) => {
            for p in &poison {
                tracing::warn!(perspective = %p.perspective_name, stream_version = p.stream_version, attempts = p.attempts,
                    error = p.error.as_deref().unwrap_or(""), "last failure of the dead-lettered event");
                report_dead_lettered(ctx, &p.perspective_name, p.stream_id, vec![p.event_work_id]);
            }
            good
        }
        Err(e) => {
            tracing::warn!(error = %crate::db::describe_error(&e, None), "moving to dead letters failed; keeping the rows");
            // Without the poison rows their pairs cannot advance past them anyway.
            let blocked: HashSet<(Uuid, String)> = poison
                .iter()
                .map(|p| (p.stream_id, p.perspective_name.clone()))
                .collect();
            good.into_iter()
                .filter(|i| !blocked.contains(&(i.stream_id, i.perspective_name.clone())))
                .collect()
        }
    }
}

/// Drop rows this pod applied recently whose completion is not flushed yet.
fn dedup_filter(ctx: &Ctx, items: Vec<WorkItem>) -> Vec<WorkItem> {
    let now = Instant::now();
    let mut cache = ctx.cache.lock().unwrap();
    cache.evict_expired(now);
    if cache.is_empty() {
        return items;
    }
    items
        .into_iter()
        .filter(|i| !cache.contains(i.event_work_id, now))
        .collect()
}

/// Group by (stream, perspective) in version order, in chunks of at most `batch_size`.
fn group(items: Vec<WorkItem>, batch_size: usize) -> Vec<Vec<Group>> {
    let mut pairs: BTreeMap<(Uuid, String), Vec<WorkItem>> = BTreeMap::new();
    for i in items {
        pairs
            .entry((i.stream_id, i.perspective_name.clone()))
            .or_default()
            .push(i);
    }
    pairs
        .into_iter()
        .map(|((stream_id, perspective), mut items)| {
            items.sort_by_key(|i| i.stream_version);
            items
                .chunks(batch_size.max(1))
                .map(|c| Group {
                    stream_id,
                    perspective: perspective.clone(),
                    items: c.to_vec(),
                })
                .collect()
        })
        .collect()
}

/// Apply the pairs in parallel (up to `maxConcurrentPerspectives`), the chunks of one pair in
/// order. Returns events applied.
async fn apply_groups(ctx: &Ctx, pairs: Vec<Vec<Group>>) -> u64 {
    let limit = ctx.config.worker.max_concurrent_perspectives.max(1) as usize;
    futures::stream::iter(pairs)
        .map(|chunks| apply_pair(ctx, chunks))
        .buffer_unordered(limit)
        .fold(0u64, |acc, n| async move { acc + n })
        .await
}

async fn apply_pair(ctx: &Ctx, chunks: Vec<Group>) -> u64 {
    let Some(first) = chunks.first() else {
        return 0;
    };
    let gate = ctx.pair_gate(first.stream_id, &first.perspective);
    let held = gate.clone().lock_owned().await;
    let mode = ApplyMode {
        instant: ctx.config.worker.completion_strategy == CompletionStrategy::Instant,
        debug: ctx.config.worker.debug_mode,
        force: false,
    };
    let mut applied = 0u64;
    for group in &chunks {
        let (n, failed) = match apply_group(ctx, group, mode).await {
            Applied::Ok { applied, failed } => (applied, failed),
            // Nothing of the group committed. Like the SQL apply functions' slow path, apply it
            // one event at a time: the good prefix commits and the failure is pinned on the
            // event that causes it (not on an innocent first event).
            Applied::Err(_) if group.items.len() > 1 => apply_one_by_one(ctx, group, mode).await,
            Applied::Err(error) => {
                fail_group(ctx, group, &error).await;
                (0, true)
            }
        };
        applied += n;
        if failed {
            break;
        }
    }
    drop(held);
    ctx.release_pair_gate(first.stream_id, &first.perspective, gate);
    applied
}

/// What applying one group through the runner did.
enum Applied {
    /// Committed; `failed`: the runner reported an event it could not apply.
    Ok { applied: u64, failed: bool },
    /// Nothing committed.
    Err(String),
}

async fn apply_group(ctx: &Ctx, group: &Group, mode: ApplyMode) -> Applied {
    let outcome = async {
        let mut conn = ctx.store.pool().acquire().await?;
        ctx.runner.apply(&mut conn, group, mode).await
    }
    .await;
    let o = match outcome {
        Ok(o) => o,
        Err(e) => return Applied::Err(e.to_string()),
    };
    record_outcome(ctx, group, &o, mode);
    if let Some((work_id, error)) = &o.failed {
        record_failure(ctx, group, *work_id, error).await;
    }
    super::lifecycle::post_perspective(
        ctx,
        &group.perspective,
        group.stream_id,
        &o.applied_event_ids,
    );
    let completed: Vec<(Uuid, Uuid)> = o
        .completed_event_ids
        .iter()
        .map(|e| (group.stream_id, *e))
        .collect();
    super::lifecycle::fire(ctx, &completed).await;
    Applied::Ok {
        applied: o.applied as u64,
        failed: o.failed.is_some(),
    }
}

/// Apply `group` as single-event groups, in order, up to the first failure. Returns (events
/// applied, whether one failed).
async fn apply_one_by_one(ctx: &Ctx, group: &Group, mode: ApplyMode) -> (u64, bool) {
    let mut applied = 0;
    for item in &group.items {
        let single = Group {
            stream_id: group.stream_id,
            perspective: group.perspective.clone(),
            items: vec![item.clone()],
        };
        match apply_group(ctx, &single, mode).await {
            Applied::Ok { applied: n, failed } => {
                applied += n;
                if failed {
                    return (applied, true);
                }
            }
            Applied::Err(error) => {
                fail_group(ctx, &single, &error).await;
                return (applied, true);
            }
        }
    }
    (applied, false)
}

/// The runner refused `group` (nothing committed): its first event carries the failure.
async fn fail_group(ctx: &Ctx, group: &Group, error: &str) {
    let work_id = group.items[0].event_work_id;
    report_failed(ctx, &group.perspective, group.stream_id, work_id, error);
    record_failure(ctx, group, work_id, error).await;
}

/// Record a custom runner's failed event like a failing SQL handler's (error, backoff, Failed
/// cursor); one that has now failed `maxPerspectiveEventAttempts` times goes to the dead letters
/// at once. If recording fails, the row's lease lapses and it is offered again later.
async fn record_failure(ctx: &Ctx, group: &Group, event_work_id: i64, error: &str) {
    let w = &ctx.config.worker;
    let failure = Failure {
        stream_id: group.stream_id,
        perspective: &group.perspective,
        event_work_id,
        error,
    };
    let recorded = ctx
        .store
        .record_failure(
            failure,
            w.failure_retry_base_milliseconds as f64,
            w.failure_retry_max_milliseconds as f64,
        )
        .await;
    let attempts = match recorded {
        Ok(attempts) => attempts,
        Err(e) => {
            tracing::warn!(error = %crate::db::describe_error(&e, None), event_work_id,
                           "could not record the failure; the event is retried when its lease lapses");
            return;
        }
    };
    if attempts.is_some_and(|a| exhausted(a, w.max_perspective_event_attempts)) {
        match ctx
            .store
            .move_to_dead_letters(ctx.instance_id, &[event_work_id])
            .await
        {
            Ok(_) => report_dead_lettered(
                ctx,
                &group.perspective,
                group.stream_id,
                vec![event_work_id],
            ),
            // Still scheduled for a retry: the next lease moves it (see dead_letter_filter).
            Err(e) => tracing::warn!(error = %crate::db::describe_error(&e, None), event_work_id,
                                     "moving to dead letters failed"),
        }
    }
}

/// Whether a row that has been tried `attempts` times may not be tried again.
fn exhausted(attempts: i32, max_attempts: Option<u32>) -> bool {
    max_attempts.is_some_and(|max| attempts >= max as i32)
}

fn record_outcome(ctx: &Ctx, group: &Group, o: &super::runner::ApplyOutcome, mode: ApplyMode) {
    let perspective = group.perspective.as_str();
    if o.rewound {
        report_rewound(ctx, perspective, group.stream_id);
    }
    if o.applied > 0 {
        let now = chrono::Utc::now();
        let last = o.last_version.unwrap_or(i64::MIN);
        let latencies = group
            .items
            .iter()
            .filter(|i| i.stream_version <= last)
            .map(|i| seconds_since(i.created_at, now));
        report_applied(
            ctx,
            perspective,
            group.stream_id,
            o.applied,
            last,
            latencies,
        );
    }
    if let Some((work_id, error)) = &o.failed {
        report_failed(ctx, perspective, group.stream_id, *work_id, error);
    }
    if !mode.instant && !o.done_work_ids.is_empty() {
        ctx.cache.lock().unwrap().add_range(&o.done_work_ids);
        ctx.queue_completions(group.stream_id, &o.done_work_ids);
    }
}

/// Metrics, hook and log for events of one (stream, perspective) applied and committed;
/// `latencies` are append-commit → applied, seconds.
fn report_applied(
    ctx: &Ctx,
    perspective: &str,
    stream_id: Uuid,
    applied: u32,
    last_version: i64,
    latencies: impl Iterator<Item = f64>,
) {
    ctx.metrics
        .events_processed
        .with_label_values(&[perspective])
        .inc_by(applied as u64);
    for l in latencies {
        ctx.metrics.apply_latency.observe(l.max(0.0));
    }
    ctx.hooks.emit(HookEvent::PerspectiveEventProcessed {
        perspective: perspective.to_string(),
        stream_id,
        event_count: applied,
        last_version,
    });
}

/// Metrics, hook and log for a handler failure (the event will be retried with backoff).
fn report_failed(ctx: &Ctx, perspective: &str, stream_id: Uuid, event_work_id: i64, error: &str) {
    tracing::warn!(perspective, %stream_id, event_work_id, error, "handler failed; the event will be retried with backoff");
    ctx.metrics.failures.with_label_values(&[perspective]).inc();
    ctx.hooks.emit(HookEvent::PerspectiveEventFailed {
        perspective: perspective.to_string(),
        stream_id,
        event_work_id,
        error: error.to_string(),
    });
}

/// Metrics, hook and log for work rows moved to the dead letters.
fn report_dead_lettered(ctx: &Ctx, perspective: &str, stream_id: Uuid, event_work_ids: Vec<i64>) {
    tracing::warn!(perspective, %stream_id, ?event_work_ids, "event moved to dead letters after too many attempts");
    ctx.metrics
        .dead_letters
        .with_label_values(&[perspective])
        .inc_by(event_work_ids.len() as u64);
    ctx.hooks.emit(HookEvent::DeadLettered {
        perspective: perspective.to_string(),
        stream_id,
        event_work_ids,
    });
}

fn seconds_since(t: chrono::DateTime<chrono::Utc>, now: chrono::DateTime<chrono::Utc>) -> f64 {
    (now - t).num_microseconds().unwrap_or(0) as f64 / 1e6
}

/// A late event rewound a stream (ordering `eventId`): counted and logged.
fn report_rewound(ctx: &Ctx, perspective: &str, stream_id: Uuid) {
    ctx.metrics.rewinds.inc();
    tracing::info!(%perspective, %stream_id, "late event: stream rewound and replayed in event-id order");
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

    #[test]
    fn attempts_are_exhausted_at_the_limit() {
        assert!(!exhausted(2, Some(3)));
        assert!(exhausted(3, Some(3)));
        assert!(exhausted(4, Some(3)));
        assert!(!exhausted(1000, None), "no limit: never dead-lettered");
    }
}
