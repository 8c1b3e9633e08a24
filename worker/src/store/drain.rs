//! Fetching work to apply: `wh_drain` (claim and apply in the database, for compiled SQL
//! perspectives) and `claim_and_fetch_pending_perspective_events` (lease and fetch rows for a
//! custom [`crate::contract::PerspectiveRunner`]).

use sqlx::FromRow;
use uuid::Uuid;

use super::Store;
use crate::contract::WorkItem;

const CLAIM_AND_FETCH: &str = "SELECT * FROM \
    {schema}.claim_and_fetch_pending_perspective_events($1, $2, $3, $4, $5, $6, $7)";

const CANCEL_DRAINS: &str = "SELECT count(*) FILTER (WHERE pg_cancel_backend(a.pid))
    FROM pg_stat_activity a
    WHERE a.pid <> pg_backend_pid() AND a.state = 'active' AND strpos(a.query, $1) > 0";

/// The arguments of one `wh_drain` call.
#[derive(Debug, Clone)]
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
    /// `worker.handlerTimeoutMilliseconds`: the call starts no event after this long, and is
    /// cancelled (statement timeout) after twice this long (None: no limit).
    pub handler_timeout_ms: Option<u64>,
    /// Pairs with at most this many pending rows are applied set-based, all together; 0: none
    /// (deep streams expected, so no pair is probed for it).
    pub shallow_rows: i32,
    /// The perspectives the call applies (None: all). Key- and serial-sequenced perspectives
    /// take their keys' locks first, so they get transactions of their own.
    pub perspectives: Option<Vec<String>>,
}

/// The text of one `wh_drain` call, preceded by its statement timeout. Sent as one simple
/// query: `SET LOCAL` then lasts exactly for the call (the two statements share an implicit
/// transaction, and PostgreSQL arms a statement's timer when the statement starts, never from
/// inside a function). Every value is a number, a boolean or a UUID, so literals are safe. The
/// text starts the call with [`drain_marker`], by which shutdown finds and cancels it.
pub(crate) fn drain_sql(schema: &str, streams: &[Uuid], args: &DrainArgs) -> String {
    let mut sql = String::new();
    if let Some(t) = args.handler_timeout_ms {
        sql.push_str(&format!(
            "SET LOCAL statement_timeout = {}; ",
            t.saturating_mul(2)
        ));
    }
    let streams: Vec<String> = streams.iter().map(Uuid::to_string).collect();
    let or_null = |v: Option<String>, ty: &str| v.unwrap_or_else(|| format!("NULL::{ty}"));
    sql.push_str(&format!(
        "SELECT * FROM {schema}.{marker}, '{{{streams}}}'::uuid[], {per_pair}, {max_rows}, {instant}, {debug}, \
         {base}::float8, {max}::float8, {notify}, {attempts}, {timeout}, {shallow}{sequenced})",
        marker = drain_marker(args.instance_id),
        streams = streams.join(","),
        per_pair = args.per_pair,
        max_rows = args.max_rows,
        instant = args.instant,
        debug = args.debug,
        base = args.retry_base_ms,
        max = args.retry_max_ms,
        notify = args.notify_applied,
        attempts = or_null(args.max_attempts.map(|m| m.to_string()), "integer"),
        timeout = or_null(args.handler_timeout_ms.map(|t| t.to_string()), "integer"),
        shallow = args.shallow_rows,
        sequenced = args
            .perspectives
            .as_ref()
            .map(|names| {
                // Perspective names are identifiers (validated): plain literals.
                let literals: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
                format!(", p_perspectives => ARRAY[{}]::text[]", literals.join(", "))
            })
            .unwrap_or_default(),
    ));
    sql
}

/// How the text of `instance_id`'s `wh_drain` calls begins (after the schema).
pub(crate) fn drain_marker(instance_id: Uuid) -> String {
    format!("wh_drain('{instance_id}'::uuid")
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
    /// When each of those rows was created, in seconds since the Unix epoch: when its event was
    /// appended (the appending transaction's `now()`, as the event's `created_at`), or queued by
    /// a backfill or rebuild. (Numbers rather than timestamps: the call's result comes as text,
    /// and parsing 80 000 timestamps took a quarter of the worker's CPU in a deep drain.)
    #[sqlx(rename = "o_created_epoch")]
    pub created_epoch: Vec<f64>,
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
    /// The pair met a lock conflict with another applier (its SQLSTATE: deadlock, serialization
    /// failure, lock timeout): not a failure, nothing recorded; what is left is due again
    /// (`more`), to be retried soon.
    #[sqlx(rename = "o_contended_sqlstate")]
    pub contended_sqlstate: Option<String>,
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
        let sql = drain_sql(self.schema(), streams, &args);
        let limit = self.deadlines.drain(args.handler_timeout_ms);
        let mut c = self.conn(limit, "wh_drain").await?;
        let rows = c
            .deadline()
            .run(sqlx::Executor::fetch_all(&mut *c, sqlx::raw_sql(&sql)))
            .await?;
        rows.iter().map(PairOutcome::from_row).collect()
    }

    /// Cancel the `wh_drain` calls `instance_id` is running (shutdown: a hung handler must not
    /// hold the worker past its grace period). Returns how many were cancelled.
    pub async fn cancel_drains(&self, instance_id: Uuid) -> Result<i64, sqlx::Error> {
        let mut c = self.quick_conn("cancel_drains").await?;
        c.deadline()
            .run(
                sqlx::query_scalar(CANCEL_DRAINS)
                    .bind(format!("{}.{}", self.schema(), drain_marker(instance_id)))
                    .fetch_one(&mut *c),
            )
            .await
    }

    /// Lease and fetch the due work rows of `streams`, in version order per pair.
    pub async fn claim_and_fetch(
        &self,
        streams: &[Uuid],
        args: FetchArgs,
    ) -> Result<Vec<WorkItem>, sqlx::Error> {
        let mut c = self
            .conn(
                self.deadlines.routine,
                "claim_and_fetch_pending_perspective_events",
            )
            .await?;
        c.deadline()
            .run(
                sqlx::query_as(&self.sql(CLAIM_AND_FETCH))
                    .bind(args.instance_id)
                    .bind(streams)
                    .bind(args.lease_seconds)
                    .bind(args.max_rows)
                    .bind(args.per_pair)
                    .bind(args.debug)
                    .bind(args.payloads)
                    .fetch_all(&mut *c),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(handler_timeout_ms: Option<u64>, max_attempts: Option<i32>) -> DrainArgs {
        DrainArgs {
            instance_id: Uuid::nil(),
            per_pair: 100,
            max_rows: 1000,
            instant: false,
            debug: true,
            retry_base_ms: 1000.0,
            retry_max_ms: 0.5,
            notify_applied: false,
            max_attempts,
            handler_timeout_ms,
            shallow_rows: 16,
            perspectives: None,
        }
    }

    #[test]
    fn the_call_is_bounded_by_twice_the_handler_timeout() {
        let s = Uuid::from_u128(1);
        let sql = drain_sql("shop", &[s, s], &args(Some(30_000), Some(10)));
        assert_eq!(
            sql,
            format!(
                "SET LOCAL statement_timeout = 60000; SELECT * FROM shop.wh_drain('{nil}'::uuid, \
                 '{{{s},{s}}}'::uuid[], 100, 1000, false, true, 1000::float8, 0.5::float8, false, 10, 30000, 16)",
                nil = Uuid::nil()
            )
        );
        assert!(sql.contains(&format!("shop.{}", drain_marker(Uuid::nil()))));
        let unbounded = drain_sql("shop", &[s], &args(None, None));
        assert!(
            unbounded.starts_with("SELECT * FROM shop.wh_drain("),
            "{unbounded}"
        );
        assert!(
            unbounded.ends_with(", false, NULL::integer, NULL::integer, 16)"),
            "{unbounded}"
        );
        let sequenced = drain_sql(
            "shop",
            &[s],
            &DrainArgs {
                perspectives: Some(vec!["a".into(), "b".into()]),
                ..args(None, None)
            },
        );
        assert!(
            sequenced.ends_with(", 16, p_perspectives => ARRAY['a', 'b']::text[])"),
            "{sequenced}"
        );
    }
}
