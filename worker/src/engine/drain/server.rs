//! Draining in the database: one `wh_drain` call per batch of streams claims and applies
//! through the compiled apply functions; no rows travel to the worker and no leases are written.

use std::collections::{BTreeMap, HashSet};

use uuid::Uuid;

use super::report::{
    pair_outcome, pair_span, report_applied, report_contended, report_dead_lettered, report_failed,
    report_rewound, seconds_since_epoch,
};
use super::{shallow_rows, Drainer, Round, ROWS_PER_FETCH};
use crate::config::{CompletionStrategy, Config, Sequencing};
use crate::engine::lifecycle;
use crate::store::drain::{DrainArgs, PairOutcome};
use crate::store::names::{SEQUENCING_BUSY, SWITCHED_AWAY};

/// One `wh_drain` round for `streams`, reported.
pub(super) async fn drain(ctx: &Drainer, streams: &[Uuid]) -> Round {
    let instant = ctx.completes_at_once(streams);
    let mut outcomes = Vec::new();
    let mut whole_call_contended = false;
    for call in calls(&ctx.shared.config) {
        let args = call.args(drain_args(ctx, streams.len(), instant));
        match ctx.shared.store.drain(streams, args).await {
            Ok(o) => outcomes.extend(o),
            Err(e) => {
                if let Some(sqlstate) = crate::db::contention(&e) {
                    // A lock conflict outside every pair's subtransaction: that call is undone
                    // and nothing was recorded; its streams come back after a short delay.
                    report_contended(&ctx.shared, "*", None, &sqlstate);
                    whole_call_contended = true;
                } else {
                    tracing::warn!(error = %crate::db::describe_error(&e, None), "wh_drain failed");
                }
            }
        }
    }
    let mut round = report_round(ctx, streams, &outcomes, instant).await;
    if whole_call_contended {
        round.contended.extend(streams.iter().copied());
    }
    round
}

/// One `wh_drain` call of a round: the perspectives it applies.
#[derive(Debug, PartialEq)]
enum Call {
    /// Every perspective (none is key- or serial-sequenced).
    All,
    /// The stream-sequenced perspectives.
    Streams(Vec<String>),
    /// Key- or serial-sequenced perspectives: the key ones together, each serial one alone.
    Sequenced(Vec<String>),
}

/// The `wh_drain` calls of one round: one for every perspective, but key- and serial-sequenced
/// perspectives apply in transactions of their own, after the others: their keys' locks then
/// never hold back (or keep the rows of) the perspectives that need none, and a serial
/// perspective's one lock is held only while that perspective applies.
fn calls(config: &Config) -> Vec<Call> {
    let names = |mode: Sequencing| -> Vec<String> {
        config
            .perspectives
            .iter()
            .filter(|p| p.sequencing == mode)
            .map(|p| p.name.clone())
            .collect()
    };
    let (stream, key, serial) = (
        names(Sequencing::Stream),
        names(Sequencing::Key),
        names(Sequencing::Serial),
    );
    if stream.len() == config.perspectives.len() {
        return vec![Call::All];
    }
    let mut calls = Vec::new();
    if !stream.is_empty() {
        calls.push(Call::Streams(stream));
    }
    if !key.is_empty() {
        calls.push(Call::Sequenced(key));
    }
    calls.extend(serial.into_iter().map(|p| Call::Sequenced(vec![p])));
    calls
}

/// Rows a call that applies key- or serial-sequenced perspectives takes at most.
///
/// Their handlers write rows that many events share, and PostgreSQL makes a row updated many
/// times in one transaction slower to update again with every version (each update walks the
/// row's versions, and a version made in another subtransaction costs a subtransaction lookup):
/// 3 000 updates of one row took 137 ms in one subtransaction and 6 s in one each. So such a
/// call applies set-based (one subtransaction for all its pairs; a pair that fails is then
/// isolated as usual) and commits after this many rows; the next call takes the rest. (400
/// and 3 000 drained the cross-stream benchmark's global counter slower than 1 000.)
const SEQUENCED_MAX_ROWS: i32 = 1000;

impl Call {
    /// The arguments of this call, from those of the round.
    fn args(&self, args: DrainArgs) -> DrainArgs {
        match self {
            Call::All => args,
            Call::Streams(names) => DrainArgs {
                perspectives: Some(names.clone()),
                ..args
            },
            Call::Sequenced(names) => DrainArgs {
                perspectives: Some(names.clone()),
                max_rows: args.max_rows.min(SEQUENCED_MAX_ROWS),
                shallow_rows: args.per_pair,
                ..args
            },
        }
    }
}

/// Report what one round's calls did, pair by pair, and which streams to drain again.
async fn report_round(
    ctx: &Drainer,
    streams: &[Uuid],
    outcomes: &[PairOutcome],
    instant: bool,
) -> Round {
    let mut applied = 0u64;
    let mut rows_per_stream: BTreeMap<Uuid, i64> = BTreeMap::new();
    let mut more: HashSet<Uuid> = HashSet::new();
    let mut contended: HashSet<Uuid> = HashSet::new();
    let mut progressed: HashSet<Uuid> = HashSet::new();
    let now = chrono::Utc::now();
    let mut completed: Vec<(Uuid, Uuid)> = Vec::new();
    for o in outcomes {
        *rows_per_stream.entry(o.stream_id).or_default() += o.rows as i64;
        if o.more {
            more.insert(o.stream_id);
        }
        if o.contended_sqlstate.is_some() {
            contended.insert(o.stream_id);
        }
        if o.applied > 0 {
            progressed.insert(o.stream_id);
        }
        applied += o.applied.max(0) as u64;
        report_pair(ctx, o, now, instant, &mut completed);
    }
    let min_batch = ctx.shared.config.worker.drain_loop_refetch_min_batch.max(1) as i64;
    let rows = rows_per_stream.values().sum::<i64>();
    ctx.observe_depth(rows, rows_per_stream.values().filter(|r| **r > 0).count());
    if guessed_small(ctx, instant) && rows >= super::COMPLETE_AT_ONCE_ROWS as i64 {
        // A call expected small stopped at its rows: the next one leaves them to the flush.
        // (Not `more`: a live stream has more whenever events came during the call.)
        ctx.observe_deep();
    }
    lifecycle::fire(&ctx.shared, &completed).await;
    tracing::debug!(
        streams = streams.len(),
        streams_with_work = rows_per_stream.len(),
        rows = rows_per_stream.values().sum::<i64>(),
        streams_with_more = more.len(),
        streams_contended = contended.len(),
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
    Round {
        applied,
        busy,
        contended,
        progressed,
    }
}

/// Whether a call completing its rows itself (`instant`) does so because it was guessed small
/// (Batched), not because the strategy is Instant.
fn guessed_small(ctx: &Drainer, instant: bool) -> bool {
    instant && ctx.shared.config.worker.completion_strategy == CompletionStrategy::Batched
}

/// The rows a `wh_drain` call may take, given what its streams could yield at full depth
/// (`full`). A call guessed small (`guessed_small`: Batched, see `completes_at_once`) takes no
/// more than a small one: if its streams are deeper than the last call found (a catch-up's after
/// live ones), it stops there and reports them deep, instead of deleting a deep call's rows in
/// its own transaction.
fn row_budget(full: i64, guessed_small: bool) -> i64 {
    let budget = full.clamp(100, 2 * ROWS_PER_FETCH as i64);
    match guessed_small {
        true => budget.min(super::COMPLETE_AT_ONCE_ROWS as i64),
        false => budget,
    }
}

/// The arguments of one `wh_drain` call for `streams` streams.
fn drain_args(ctx: &Drainer, streams: usize, instant: bool) -> DrainArgs {
    let w = &ctx.shared.config.worker;
    let perspectives = ctx.shared.config.perspectives.len();
    let per_pair = w.perspective_batch_size.max(1) as i64;
    let max_rows = row_budget(
        per_pair * streams as i64 * perspectives as i64,
        guessed_small(ctx, instant),
    );
    DrainArgs {
        instance_id: ctx.shared.instance_id,
        per_pair: per_pair as i32,
        max_rows: max_rows as i32,
        instant,
        debug: w.debug_mode,
        retry_base_ms: w.failure_retry_base_milliseconds as f64,
        retry_max_ms: w.failure_retry_max_milliseconds as f64,
        notify_applied: w.notify_applied,
        max_attempts: w.max_perspective_event_attempts.map(|m| m as i32),
        handler_timeout_ms: w.handler_timeout_milliseconds,
        shallow_rows: shallow_rows(ctx.observed_depth(), perspectives),
        perspectives: None,
    }
}

/// Report what `wh_drain` did to one (stream, perspective) pair: span, metrics, hooks and logs,
/// PostPerspective, the events whose lifecycle is due (into `completed`) and, Batched, the rows
/// to complete.
fn report_pair(
    ctx: &Drainer,
    o: &PairOutcome,
    now: chrono::DateTime<chrono::Utc>,
    instant: bool,
    completed: &mut Vec<(Uuid, Uuid)>,
) {
    let perspective = o.perspective.as_str();
    let versions = o
        .versions
        .first()
        .zip(o.versions.last())
        .map(|(a, b)| (*a, *b));
    let outcome = pair_outcome(
        o.applied.max(0) as u64,
        o.failed_work_id.is_some(),
        !o.dead_lettered.is_empty(),
        o.rewound,
        o.contended_sqlstate.is_some(),
    );
    let span = pair_span(perspective, o.stream_id, versions);
    span.record("outcome", outcome);
    let _pair = span.entered();
    tracing::debug!(
        rows = o.rows,
        applied = o.applied,
        cursor = o.last_version,
        "pair drained"
    );
    if o.rewound {
        report_rewound(&ctx.shared, perspective, o.stream_id);
    }
    match o.contended_sqlstate.as_deref() {
        // Another applier has the pair's keys: its turn comes (retried like contention).
        Some(SEQUENCING_BUSY) => ctx
            .shared
            .metrics
            .sequencing_waits
            .with_label_values(&[perspective])
            .inc(),
        // Its version was switched away under this call: the next call applies it.
        Some(SWITCHED_AWAY) => tracing::debug!("the version was switched while applying; retried"),
        Some(sqlstate) => report_contended(&ctx.shared, perspective, Some(o.stream_id), sqlstate),
        None => {}
    }
    lifecycle::post_perspective(&ctx.shared, perspective, o.stream_id, &o.applied_event_ids);
    completed.extend(o.completed_event_ids.iter().map(|e| (o.stream_id, *e)));
    if !o.dead_lettered.is_empty() {
        report_dead_lettered(
            &ctx.shared,
            perspective,
            o.stream_id,
            o.dead_lettered.clone(),
        );
    }
    if o.applied > 0 {
        report_applied(
            &ctx.shared,
            perspective,
            o.stream_id,
            o.applied as u32,
            o.last_version.unwrap_or_default(),
            // The rows applied: up to the new cursor, a dead-lettered head excepted.
            o.versions
                .iter()
                .zip(&o.created_epoch)
                .skip(o.dead_lettered.len())
                .filter(|(v, _)| Some(**v) <= o.last_version)
                .map(|(_, t)| seconds_since_epoch(*t, now)),
        );
    }
    if let Some(work_id) = o.failed_work_id {
        report_failed(
            &ctx.shared,
            perspective,
            o.stream_id,
            work_id,
            o.error.as_deref().unwrap_or_default(),
        );
    } else if let Some(error) = o.error.as_deref() {
        // The pair failed, but no row of it could carry the failure.
        tracing::warn!(perspective, stream = %o.stream_id, error, "applying a (stream, perspective) failed");
    }
    if !instant && !o.done_work_ids.is_empty() {
        // The done rows are at or below the cursor the call left.
        let up_to = o.last_version.unwrap_or(i64::MAX);
        ctx.completions
            .queue(o.stream_id, perspective, up_to, &o.done_work_ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_guessed_small_takes_no_more_rows_than_a_small_one() {
        assert_eq!(row_budget(67 * 100 * 2, false), 13_400, "67 deep streams");
        assert_eq!(row_budget(67 * 100 * 2, true), 500, "guessed small: capped");
        assert_eq!(row_budget(200, true), 200, "a small call keeps its budget");
        assert_eq!(row_budget(10, true), 100, "at least 100");
        assert_eq!(row_budget(1_000_000, false), 2 * ROWS_PER_FETCH as i64);
    }

    fn config(modes: &[&str]) -> Config {
        let mut yaml = String::from("schema: s\nperspectives:\n");
        for (i, mode) in modes.iter().enumerate() {
            yaml.push_str(&format!("  - name: p{i}\n    sequencing: {mode}\n"));
            if *mode == "key" {
                yaml.push_str("    sequencingKey: \":data->>'k'\"\n");
            }
            yaml.push_str("    handlers:\n      A: SELECT 1\n");
        }
        Config::from_yaml_str(&yaml, "t").unwrap()
    }

    #[test]
    fn sequenced_perspectives_get_calls_of_their_own() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(calls(&config(&["stream", "stream"])), [Call::All]);
        assert_eq!(
            calls(&config(&["stream", "key", "serial", "key", "serial"])),
            [
                Call::Streams(names(&["p0"])),
                Call::Sequenced(names(&["p1", "p3"])),
                Call::Sequenced(names(&["p2"])),
                Call::Sequenced(names(&["p4"])),
            ]
        );
        assert_eq!(
            calls(&config(&["serial"])),
            [Call::Sequenced(names(&["p0"]))]
        );
    }
}
