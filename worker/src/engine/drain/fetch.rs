//! Draining for a custom [`PerspectiveRunner`](crate::contract::PerspectiveRunner): claim and
//! fetch the rows (leased), drop poison and recently applied ones, group them per (stream,
//! perspective) and apply the groups in parallel, each pair under its in-process mutex. A
//! runner's failure is recorded like a failing SQL handler's; a lock conflict with another
//! applier (a `RunnerError::Database` with a contention SQLSTATE) is not a failure: nothing is
//! recorded, and the stream is drained again after a short delay (its rows stay leased to this
//! instance meanwhile, so the retry counts no further attempt).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use tracing::Instrument;
use uuid::Uuid;

use super::report::{
    pair_outcome, pair_span, report_applied, report_contended, report_dead_lettered, report_failed,
    report_rewound, seconds_since,
};
use super::{Drainer, Round, ROWS_PER_FETCH};
use crate::contract::{ApplyMode, ApplyOutcome, Group, RunnerError, WorkItem};
use crate::engine::lifecycle;
use crate::store::drain::FetchArgs;
use crate::store::failure::Failure;

/// The in-process mutex serialising applies of one (stream, perspective) in this pod.
type PairGate = Arc<tokio::sync::Mutex<()>>;

/// The pair gates in use.
#[derive(Default)]
pub(super) struct PairGates(Mutex<HashMap<(Uuid, String), PairGate>>);

impl PairGates {
    /// The gate of one (stream, perspective).
    fn get(&self, stream: Uuid, perspective: &str) -> PairGate {
        self.0
            .lock()
            .unwrap()
            .entry((stream, perspective.to_string()))
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(())))
            .clone()
    }

    /// Forget a gate nobody else holds or waits for.
    fn release(&self, stream: Uuid, perspective: &str, gate: PairGate) {
        let mut gates = self.0.lock().unwrap();
        // Ours plus the map's reference: nobody else holds or waits for it.
        if Arc::strong_count(&gate) <= 2 {
            gates.remove(&(stream, perspective.to_string()));
        }
    }
}

/// One claim+fetch round for `streams` and the application of everything it returned through
/// the runner.
pub(super) async fn fetch_and_apply(ctx: &Drainer, streams: &[Uuid]) -> Round {
    let per_pair = ctx.shared.config.worker.perspective_batch_size.max(1) as i64;
    let max_rows = (per_pair * streams.len() as i64 * ctx.shared.config.perspectives.len() as i64)
        .clamp(100, 2 * ROWS_PER_FETCH as i64);
    let args = FetchArgs {
        instance_id: ctx.shared.instance_id,
        lease_seconds: ctx.shared.config.worker.lease_seconds as i32,
        max_rows: max_rows as i32,
        per_pair: per_pair as i32,
        debug: ctx.shared.config.worker.debug_mode,
        payloads: ctx.runner.needs_event_payloads(),
    };
    let fetched = ctx.shared.store.claim_and_fetch(streams, args).await;
    let items = match fetched {
        Ok(items) => items,
        Err(e) => {
            if let Some(sqlstate) = crate::db::contention(&e) {
                report_contended(&ctx.shared, "*", None, &sqlstate);
                return Round {
                    contended: streams.iter().copied().collect(),
                    ..Round::default()
                };
            }
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
        .filter(|(_, n)| {
            **n >= ctx.shared.config.worker.drain_loop_refetch_min_batch.max(1) as usize
        })
        .map(|(s, _)| *s)
        .collect();
    if items.is_empty() {
        return Round {
            busy,
            ..Round::default()
        };
    }

    let items = dead_letter_filter(ctx, items).await;
    let items = dedup_filter(ctx, items);
    let instant = super::completes_at_once(
        &ctx.shared.config.worker.completion_strategy,
        Some(items.len() as f64),
    );
    let groups = group(
        items,
        ctx.shared.config.worker.perspective_batch_size as usize,
    );
    let (applied, contended, progressed) = apply_groups(ctx, groups, instant).await;
    Round {
        applied,
        busy,
        contended,
        progressed,
    }
}
/// Rows already tried `maxPerspectiveEventAttempts` times (a lease counts as a try, so a worker
/// that died mid-apply counts too) go to the dead letters before they are tried again; if moving
/// them fails they stay (and are tried next time).
async fn dead_letter_filter(ctx: &Drainer, items: Vec<WorkItem>) -> Vec<WorkItem> {
    let Some(max) = ctx.shared.config.worker.max_perspective_event_attempts else {
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
    let moved = ctx
        .shared
        .store
        .move_to_dead_letters(ctx.shared.instance_id, &ids)
        .await;
    match moved {
        Ok(_) => {
            for p in &poison {
                tracing::warn!(perspective = %p.perspective_name, stream_version = p.stream_version, attempts = p.attempts,
                    error = p.error.as_deref().unwrap_or(""), "last failure of the dead-lettered event");
                report_dead_lettered(
                    &ctx.shared,
                    &p.perspective_name,
                    p.stream_id,
                    vec![p.event_work_id],
                );
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
fn dedup_filter(ctx: &Drainer, items: Vec<WorkItem>) -> Vec<WorkItem> {
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
/// order. Returns events applied, the streams whose apply met a lock conflict, and those with
/// events applied. `instant`: each apply completes its rows itself.
async fn apply_groups(
    ctx: &Drainer,
    pairs: Vec<Vec<Group>>,
    instant: bool,
) -> (u64, HashSet<Uuid>, HashSet<Uuid>) {
    let limit = ctx.shared.config.worker.max_concurrent_perspectives.max(1) as usize;
    futures::stream::iter(pairs)
        .map(|chunks| async {
            let stream = chunks.first().map(|g| g.stream_id);
            (apply_pair(ctx, chunks, instant).await, stream)
        })
        .buffer_unordered(limit)
        .fold(
            (0u64, HashSet::new(), HashSet::new()),
            |(acc, mut contended, mut progressed), ((n, conflict), stream)| async move {
                contended.extend(conflict);
                if n > 0 {
                    progressed.extend(stream);
                }
                (acc + n, contended, progressed)
            },
        )
        .await
}
/// Apply one pair's chunks in order, up to a failure or a lock conflict. Returns events
/// applied and, if a lock conflict stopped it, the stream.
async fn apply_pair(ctx: &Drainer, chunks: Vec<Group>, instant: bool) -> (u64, Option<Uuid>) {
    let Some(first) = chunks.first() else {
        return (0, None);
    };
    let gate = ctx.gates.get(first.stream_id, &first.perspective);
    let held = gate.clone().lock_owned().await;
    let mode = ApplyMode {
        instant,
        debug: ctx.shared.config.worker.debug_mode,
        force: false,
    };
    let mut applied = 0u64;
    let mut contended = None;
    for group in &chunks {
        let versions = group
            .items
            .first()
            .zip(group.items.last())
            .map(|(a, b)| (a.stream_version, b.stream_version));
        let span = pair_span(&group.perspective, group.stream_id, versions);
        let (n, stop) = async {
            match apply_group(ctx, group, mode).await {
                Applied::Ok { applied, failed } => (applied, failed.then_some(Stop::Failed)),
                // Nothing recorded: the stream comes back after a short delay.
                Applied::Contended(sqlstate) => {
                    report_contended(
                        &ctx.shared,
                        &group.perspective,
                        Some(group.stream_id),
                        &sqlstate,
                    );
                    (0, Some(Stop::Contended))
                }
                // Nothing of the group committed. Like the SQL apply functions' slow path, apply
                // it one event at a time: the good prefix commits and the failure is pinned on
                // the event that causes it (not on an innocent first event).
                Applied::Err(_) if group.items.len() > 1 => {
                    apply_one_by_one(ctx, group, mode).await
                }
                Applied::Err(error) => {
                    fail_group(ctx, group, &error).await;
                    (0, Some(Stop::Failed))
                }
            }
        }
        .instrument(span.clone())
        .await;
        span.record(
            "outcome",
            pair_outcome(
                n,
                stop == Some(Stop::Failed),
                false,
                false,
                stop == Some(Stop::Contended),
            ),
        );
        span.in_scope(|| tracing::debug!(rows = group.items.len(), applied = n, "pair drained"));
        applied += n;
        if stop == Some(Stop::Contended) {
            contended = Some(group.stream_id);
        }
        if stop.is_some() {
            break;
        }
    }
    drop(held);
    ctx.gates.release(first.stream_id, &first.perspective, gate);
    (applied, contended)
}
/// Why a pair's chunks stopped before the last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// An event failed (recorded).
    Failed,
    /// A lock conflict with another applier (nothing recorded).
    Contended,
}
/// What applying one group through the runner did.
enum Applied {
    /// Committed; `failed`: the runner reported an event it could not apply.
    Ok { applied: u64, failed: bool },
    /// A lock conflict with another applier (this SQLSTATE): nothing recorded. (What the
    /// runner committed before it is at or below the cursor: the retry skips it.)
    Contended(String),
    /// Nothing committed.
    Err(String),
}
async fn apply_group(ctx: &Drainer, group: &Group, mode: ApplyMode) -> Applied {
    let outcome = async {
        let long = ctx.shared.store.deadlines().long;
        let mut conn = ctx.shared.store.conn(long, "custom runner group").await?;
        conn.deadline()
            .run(ctx.runner.apply(&mut conn, group, mode))
            .await
    }
    .await;
    let o = match outcome {
        Ok(o) => o,
        Err(RunnerError::Database(e)) if crate::db::contention(&e).is_some() => {
            return Applied::Contended(crate::db::contention(&e).unwrap_or_default())
        }
        Err(e) => return Applied::Err(e.to_string()),
    };
    record_outcome(ctx, group, &o, mode);
    if let Some((work_id, error)) = &o.failed {
        record_failure(ctx, group, *work_id, error).await;
    }
    lifecycle::post_perspective(
        &ctx.shared,
        &group.perspective,
        group.stream_id,
        &o.applied_event_ids,
    );
    let completed: Vec<(Uuid, Uuid)> = o
        .completed_event_ids
        .iter()
        .map(|e| (group.stream_id, *e))
        .collect();
    lifecycle::fire(&ctx.shared, &completed).await;
    Applied::Ok {
        applied: o.applied as u64,
        failed: o.failed.is_some(),
    }
}
/// Apply `group` as single-event groups, in order, up to the first failure or lock conflict.
/// Returns events applied and why it stopped early.
async fn apply_one_by_one(ctx: &Drainer, group: &Group, mode: ApplyMode) -> (u64, Option<Stop>) {
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
                    return (applied, Some(Stop::Failed));
                }
            }
            Applied::Contended(sqlstate) => {
                report_contended(
                    &ctx.shared,
                    &group.perspective,
                    Some(group.stream_id),
                    &sqlstate,
                );
                return (applied, Some(Stop::Contended));
            }
            Applied::Err(error) => {
                fail_group(ctx, &single, &error).await;
                return (applied, Some(Stop::Failed));
            }
        }
    }
    (applied, None)
}
/// The runner refused `group` (nothing committed): its first event carries the failure.
async fn fail_group(ctx: &Drainer, group: &Group, error: &str) {
    let work_id = group.items[0].event_work_id;
    report_failed(
        &ctx.shared,
        &group.perspective,
        group.stream_id,
        work_id,
        error,
    );
    record_failure(ctx, group, work_id, error).await;
}
/// Record a custom runner's failed event like a failing SQL handler's (error, backoff, Failed
/// cursor); one that has now failed `maxPerspectiveEventAttempts` times goes to the dead letters
/// at once. If recording fails, the row's lease lapses and it is offered again later.
async fn record_failure(ctx: &Drainer, group: &Group, event_work_id: i64, error: &str) {
    let w = &ctx.shared.config.worker;
    let failure = Failure {
        stream_id: group.stream_id,
        perspective: &group.perspective,
        event_work_id,
        error,
    };
    let recorded = ctx
        .shared
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
            .shared
            .store
            .move_to_dead_letters(ctx.shared.instance_id, &[event_work_id])
            .await
        {
            Ok(_) => report_dead_lettered(
                &ctx.shared,
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
fn record_outcome(ctx: &Drainer, group: &Group, o: &ApplyOutcome, mode: ApplyMode) {
    let perspective = group.perspective.as_str();
    if o.rewound {
        report_rewound(&ctx.shared, perspective, group.stream_id);
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
            &ctx.shared,
            perspective,
            group.stream_id,
            o.applied,
            last,
            latencies,
        );
    }
    if let Some((work_id, error)) = &o.failed {
        report_failed(&ctx.shared, perspective, group.stream_id, *work_id, error);
    }
    if !mode.instant && !o.done_work_ids.is_empty() {
        ctx.cache.lock().unwrap().add_range(&o.done_work_ids);
        // The done rows are at or below the cursor the apply left.
        let up_to = o.last_version.unwrap_or(i64::MAX);
        ctx.completions
            .queue(group.stream_id, perspective, up_to, &o.done_work_ids);
    }
}
#[cfg(test)]
mod tests {
    use super::exhausted;

    #[test]
    fn attempts_are_exhausted_at_the_limit() {
        assert!(!exhausted(2, Some(3)));
        assert!(exhausted(3, Some(3)));
        assert!(exhausted(4, Some(3)));
        assert!(!exhausted(1000, None), "no limit: never dead-lettered");
    }
}
