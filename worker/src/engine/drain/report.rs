//! Metrics, hooks and logs for what a drain did.

use uuid::Uuid;

use crate::engine::hooks::HookEvent;
use crate::engine::Shared;

/// Metrics, hook and log for events of one (stream, perspective) applied and committed;
/// `latencies` are append (`created_at`) → applied, seconds, one per event.
pub(super) fn report_applied(
    ctx: &Shared,
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
    let mut worst = 0.0f64;
    for l in latencies {
        let l = l.max(0.0);
        ctx.metrics.apply_latency.observe(l);
        worst = worst.max(l);
    }
    ctx.live_apply
        .record(perspective, worst, u64::from(applied));
    ctx.hooks.emit(HookEvent::PerspectiveEventProcessed {
        perspective: perspective.to_string(),
        stream_id,
        event_count: applied,
        last_version,
    });
}
/// Metrics, hook and log for a handler failure (the event will be retried with backoff).
pub(super) fn report_failed(
    ctx: &Shared,
    perspective: &str,
    stream_id: Uuid,
    event_work_id: i64,
    error: &str,
) {
    tracing::warn!(perspective, %stream_id, event_work_id, error, "handler failed; the event will be retried with backoff");
    ctx.metrics.failures.with_label_values(&[perspective]).inc();
    ctx.hooks.emit(HookEvent::PerspectiveEventFailed {
        perspective: perspective.to_string(),
        stream_id,
        event_work_id,
        error: error.to_string(),
    });
}
/// Metrics, hook and log for an apply stopped by a lock conflict with another applier
/// (`sqlstate`): retried soon, not a failure. Logged at debug: under contention it happens
/// many times a second, and the metric counts it (and the last minute's rate, which the
/// heartbeat publishes). `stream_id` None: a whole `wh_drain` call (`perspective` "*").
pub(super) fn report_contended(
    ctx: &Shared,
    perspective: &str,
    stream_id: Option<Uuid>,
    sqlstate: &str,
) {
    tracing::debug!(perspective, stream_id = ?stream_id, sqlstate,
                    "lock conflict with another applier; retrying soon");
    ctx.metrics
        .contention_retries
        .with_label_values(&[perspective, sqlstate])
        .inc();
    ctx.contention.record(perspective, sqlstate);
    ctx.hooks.emit(HookEvent::ContentionRetried {
        perspective: perspective.to_string(),
        stream_id,
        sqlstate: sqlstate.to_string(),
    });
}
/// Metrics, hook and log for work rows moved to the dead letters.
pub(super) fn report_dead_lettered(
    ctx: &Shared,
    perspective: &str,
    stream_id: Uuid,
    event_work_ids: Vec<i64>,
) {
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
/// The span of one (stream, perspective) group: every log line of its apply carries these
/// fields (and the batch's), so an event's path can be followed in JSON logs. `first_version`
/// and `last_version` bound the rows taken; `outcome` is recorded once known.
pub(super) fn pair_span(
    perspective: &str,
    stream_id: Uuid,
    versions: Option<(i64, i64)>,
) -> tracing::Span {
    tracing::info_span!(
        "pair",
        perspective,
        stream = %stream_id,
        first_version = versions.map(|v| v.0),
        last_version = versions.map(|v| v.1),
        outcome = tracing::field::Empty,
    )
}
/// What happened to a group, for its span and log line (debug).
pub(super) fn pair_outcome(
    applied: u64,
    failed: bool,
    dead_lettered: bool,
    rewound: bool,
    contended: bool,
) -> &'static str {
    if contended {
        "contended"
    } else if dead_lettered {
        "dead_lettered"
    } else if failed {
        "failed"
    } else if rewound {
        "rewound"
    } else if applied > 0 {
        "applied"
    } else {
        "nothing_due"
    }
}
pub(super) fn seconds_since(
    t: chrono::DateTime<chrono::Utc>,
    now: chrono::DateTime<chrono::Utc>,
) -> f64 {
    (now - t).num_microseconds().unwrap_or(0) as f64 / 1e6
}
/// Seconds from `epoch_seconds` (since the Unix epoch, as `wh_drain` reports a row's creation)
/// to `now`.
pub(super) fn seconds_since_epoch(epoch_seconds: f64, now: chrono::DateTime<chrono::Utc>) -> f64 {
    now.timestamp_micros() as f64 / 1e6 - epoch_seconds
}
/// A late event rewound a stream (ordering `eventId`): counted and logged.
pub(super) fn report_rewound(ctx: &Shared, perspective: &str, stream_id: Uuid) {
    ctx.metrics.rewinds.inc();
    tracing::info!(%perspective, %stream_id, "late event: stream rewound and replayed in event-id order");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rows_age_is_measured_from_its_epoch_seconds_to_microseconds() {
        let now = chrono::DateTime::from_timestamp_micros(1_765_100_000_123_456).unwrap();
        let created = 1_765_099_999.873_456; // 250 ms earlier
        let age = seconds_since_epoch(created, now);
        assert!((age - 0.25).abs() < 1e-6, "{age}");
        // The same instant as the timestamp form gives.
        let t = chrono::DateTime::from_timestamp_micros(1_765_099_999_873_456).unwrap();
        assert!((seconds_since(t, now) - age).abs() < 1e-6);
    }
}
