//! Applying a (stream, perspective) group of events: the `PerspectiveRunner` trait and the SQL
//! runner that calls the perspective's compiled apply function (see `compile`).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use serde_json::Value;
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use crate::compile::apply_function_name;
use crate::config::Config;
use crate::store::apply::ApplyArgs;

/// One claimed work row with its event (payload fields are JSON null when the runner does not
/// need them, see [`PerspectiveRunner::needs_event_payloads`]).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct WorkItem {
    pub event_work_id: i64,
    pub stream_id: Uuid,
    pub perspective_name: String,
    pub event_id: Uuid,
    pub stream_version: i64,
    pub attempts: i32,
    pub error: Option<String>,
    pub event_type: String,
    pub event_data: Value,
    pub metadata: Value,
    pub scope: Value,
    pub created_at: DateTime<Utc>,
}

/// Events of one (stream, perspective), in stream-version order.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub stream_id: Uuid,
    pub perspective: String,
    pub items: Vec<WorkItem>,
}

/// How a group is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ApplyMode {
    /// Retire the applied work rows inside the apply transaction (Instant completion).
    pub instant: bool,
    /// Keep retired rows, stamped, instead of deleting them.
    pub debug: bool,
    /// Apply regardless of the cursor and without moving it (dead-letter replay).
    pub force: bool,
}

/// What applying a group did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ApplyOutcome {
    /// Events applied now.
    pub applied: u32,
    /// The cursor after the call.
    pub last_version: Option<i64>,
    /// The event that failed (its work id) and why; events after it were not applied.
    pub failed: Option<(i64, String)>,
    /// Work rows at or below the cursor (applied now or earlier): ready to be completed.
    pub done_work_ids: Vec<i64>,
    /// The stream was rewound (ordering `eventId`: a late event made the runner reset the
    /// stream's share of the model and replay its events in event-id order).
    pub rewound: bool,
    /// Events that every subscribed perspective has now applied (only with `notifyApplied`):
    /// their lifecycle stages are due.
    pub completed_event_ids: Vec<Uuid>,
    /// Events this call applied, in order (only with `notifyApplied`): PostPerspective is due
    /// for each.
    pub applied_event_ids: Vec<Uuid>,
}

/// Why a runner could not apply a group. Either way nothing of the group committed, and the
/// engine treats it like a failing SQL handler: the group's first event records the error, is
/// retried with backoff, and is dead-lettered after `maxPerspectiveEventAttempts`.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The database refused a statement (or the connection broke).
    #[error("{}", crate::db::describe_error(.0, None))]
    Database(#[from] sqlx::Error),
    /// The runner refused the event (a payload it cannot apply, a rule it enforces).
    #[error("{0}")]
    Rejected(String),
}

/// Applies groups of events to perspectives. The model change and the cursor advance must
/// commit together, and events at or below the cursor must be skipped: that is what makes
/// delivery exactly-once ([`crate::store::cursor`] has the statements for it). Implement it to
/// compile your own perspectives into your own worker; `examples/stream_history_runner.rs` is a
/// complete one.
///
/// For runners that do not drain server-side, the engine records failures itself: an `Err`, or
/// an outcome whose `failed` names an event, sets that event's error, backoff and attempts, and
/// marks the cursor Failed, exactly as a failing SQL handler does.
pub trait PerspectiveRunner: Send + Sync {
    /// Whether [`WorkItem`]s must carry `event_data`, `metadata` and `scope`. The SQL runner
    /// reads them inside the database and says no, which keeps payloads off the wire.
    fn needs_event_payloads(&self) -> bool {
        true
    }

    /// Whether the engine may claim and apply through the schema's `wh_drain` function (the
    /// compiled SQL perspectives) instead of fetching rows and calling [`Self::apply`].
    fn server_side_drain(&self) -> bool {
        false
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        group: &'a Group,
        mode: ApplyMode,
    ) -> BoxFuture<'a, Result<ApplyOutcome, RunnerError>>;
}

/// The runner for SQL handlers: one call of the perspective's apply function per group.
#[derive(Debug, Clone)]
pub struct SqlRunner {
    schema: String,
    functions: HashMap<String, String>,
    args: ApplyArgs,
}

impl SqlRunner {
    pub fn new(config: &Config) -> Self {
        SqlRunner {
            schema: config.schema.clone(),
            functions: config
                .perspectives
                .iter()
                .map(|p| (p.name.clone(), apply_function_name(&p.name)))
                .collect(),
            args: ApplyArgs {
                retry_base_ms: config.worker.failure_retry_base_milliseconds as f64,
                retry_max_ms: config.worker.failure_retry_max_milliseconds as f64,
                notify_applied: config.worker.notify_applied,
            },
        }
    }
}

impl PerspectiveRunner for SqlRunner {
    fn needs_event_payloads(&self) -> bool {
        false
    }

    fn server_side_drain(&self) -> bool {
        true
    }

    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        group: &'a Group,
        mode: ApplyMode,
    ) -> BoxFuture<'a, Result<ApplyOutcome, RunnerError>> {
        Box::pin(async move {
            let Some(function) = self.functions.get(&group.perspective) else {
                return Err(RunnerError::Rejected(format!(
                    "perspective {} is not in the config",
                    group.perspective
                )));
            };
            crate::store::apply::call_apply_function(
                conn,
                &self.schema,
                function,
                group,
                mode,
                self.args,
            )
            .await
            .map_err(RunnerError::from)
        })
    }
}
