//! The contract between the layers: what a claimed event looks like ([`WorkItem`], [`Group`]),
//! how it is applied ([`ApplyMode`]), what applying did ([`ApplyOutcome`], [`RunnerError`]) and
//! who applies it ([`PerspectiveRunner`]); and the event a producer appends ([`NewEvent`]). The store reads and writes these types and the engine
//! schedules them; this module sits below both and imports neither.

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use serde::Deserialize;
use serde_json::Value;
use sqlx::postgres::PgConnection;
use uuid::Uuid;

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
/// retried with backoff, and is dead-lettered after `maxPerspectiveEventAttempts`. Except a
/// lock conflict with another applier — a [`RunnerError::Database`] whose SQLSTATE is one of
/// [`crate::db::CONTENTION_SQLSTATES`] (deadlock, serialization failure, lock timeout): nothing
/// is recorded and the group is applied again after a short delay (what the runner committed
/// before it must be at or below the cursor, which the retry skips).
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
/// delivery exactly-once (the store's `cursor` module has the statements for it). Implement it to
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

/// An event to append through the producer contract: one line of `perspective-worker append`'s
/// JSON-lines input, as the store inserts it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NewEvent {
    pub stream_id: Uuid,
    pub event_type: String,
    /// The event's payload; `{}` when absent.
    #[serde(default = "empty_object")]
    pub event_data: Value,
    #[serde(default = "empty_object")]
    pub metadata: Value,
    #[serde(default = "empty_object")]
    pub scope: Value,
    /// Fixed id (idempotent imports); a UUIDv7 is generated when absent.
    #[serde(default)]
    pub event_id: Option<Uuid>,
    /// Expected version of this event (optimistic concurrency); assigned when absent.
    #[serde(default)]
    pub stream_version: Option<i64>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}
