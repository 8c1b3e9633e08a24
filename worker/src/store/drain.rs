//! Fetching work to apply: `wh_drain` (claim and apply in the database, for compiled SQL
//! perspectives) and `claim_and_fetch_pending_perspective_events` (lease and fetch rows for a
//! custom [`crate::engine::PerspectiveRunner`]).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::Store;
use crate::engine::WorkItem;

const DRAIN: &str = "SELECT * FROM {schema}.wh_drain($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";
const CLAIM_AND_FETCH: &str = "SELECT * FROM \
    {schema}.claim_and_fetch_pending_perspective_events($1, $2, $3, $4, $5, $6, $7)";

/// The arguments of one `wh_drain` call.
#[derive(Debug, Clone, Copy)]
pub struct DrainArgs {
    pub instance_id: Uuid,
    /// Events applied per (stream, perspective) at most.
    pub per_pair: i32,
    /// Work rows the whole call takes at most.
    pub max_rows: i32,
    /// Delete applied rows in the apply transaction (Instant completion).
    pub instant: bool,
    /// Keep retired rows, stamped, instead of deleting them.
    pub debug: bool,
    pub retry_base_ms: f64,
    pub retry_max_ms: f64,
    /// Lifecycle stages and the `<schema>_applied` NOTIFY.
    pub notify_applied: bool,
    /// Failures after which the head row of a pair is dead-lettered (None: never).
    pub max_attempts: Option<i32>,
}

/// One row of `wh_drain`: what happened to one (stream, perspective).
#[derive(Debug, sqlx::FromRow)]
pub struct PairOutcome {
    #[sqlx(rename = "o_stream_id")]
    pub stream_id: Uuid,
    #[sqlx(rename = "o_perspective")]
    pub perspective: String,
    /// Work rows the call took for this pair.
    #[sqlx(rename = "o_rows")]
    pub rows: i32,
    #[sqlx(rename = "o_applied")]
    pub applied: i32,
    #[sqlx(rename = "o_last_version")]
    pub last_version: Option<i64>,
    #[sqlx(rename = "o_failed_work_id")]
    pub failed_work_id: Option<i64>,
    #[sqlx(rename = "o_error")]
    pub error: Option<String>,
    /// Work rows at or below the cursor: ready to be completed.
    #[sqlx(rename = "o_done_work_ids")]
    pub done_work_ids: Vec<i64>,
    #[sqlx(rename = "o_dead_lettered")]
    pub dead_lettered: Vec<i64>,
    /// Versions of the rows this call took, ascending (a dead-lettered head first).
    #[sqlx(rename = "o_versions")]
    pub versions: Vec<i64>,
    /// When each of those rows was created: when its event was appended (the appending
    /// transaction's `now()`, as the event's `created_at`), or queued by a backfill or rebuild.
    #[sqlx(rename = "o_created_at")]
    pub created_at: Vec<DateTime<Utc>>,
    #[sqlx(rename = "o_rewound")]
    pub rewound: bool,
    /// Events every subscribed perspective has now applied (lifecycle due).
    #[sqlx(rename = "o_completed_event_ids")]
    pub completed_event_ids: Vec<Uuid>,
    /// Due work is left past what this call applied (or the call's row budget ran out first),
    /// seen by a statement after the apply.
    #[sqlx(rename = "o_more")]
    pub more: bool,
    /// Events this call applied, in order (PostPerspective due).
    #[sqlx(rename = "o_applied_event_ids")]
    pub applied_event_ids: Vec<Uuid>,
}

/// The arguments of one claim-and-fetch call.
#[derive(Debug, Clone, Copy)]
pub struct FetchArgs {
    pub instance_id: Uuid,
    /// Seconds the fetched rows stay leased to this instance.
    pub lease_seconds: i32,
    pub max_rows: i32,
    pub per_pair: i32,
    pub debug: bool,
    /// Whether rows carry `event_data`, `metadata` and `scope`.
    pub payloads: bool,
}

impl Store {
    /// Claim and apply, in one call and one transaction, the pending work of `streams` that this
    /// instance owns; one outcome per (stream, perspective).
    pub async fn drain(
        &self,
        streams: &[Uuid],
        args: DrainArgs,
    ) -> Result<Vec<PairOutcome>, sqlx::Error> {
        sqlx::query_as(&self.sql(DRAIN))
            .bind(args.instance_id)
            .bind(streams)
            .bind(args.per_pair)
            .bind(args.max_rows)
            .bind(args.instant)
            .bind(args.debug)
            .bind(args.retry_base_ms)
            .bind(args.retry_max_ms)
            .bind(args.notify_applied)
            .bind(args.max_attempts)
            .fetch_all(self.pool())
            .await
    }

    /// Lease and fetch the due work rows of `streams`, in version order per pair.
    pub async fn claim_and_fetch(
        &self,
        streams: &[Uuid],
        args: FetchArgs,
    ) -> Result<Vec<WorkItem>, sqlx::Error> {
        sqlx::query_as(&self.sql(CLAIM_AND_FETCH))
            .bind(args.instance_id)
            .bind(streams)
            .bind(args.lease_seconds)
            .bind(args.max_rows)
            .bind(args.per_pair)
            .bind(args.debug)
            .bind(args.payloads)
            .fetch_all(self.pool())
            .await
    }
}
