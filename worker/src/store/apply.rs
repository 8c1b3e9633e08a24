//! One call of a perspective's compiled apply function (see [`crate::compile`]) for a group of
//! events: the SQL runner's only statement.

use sqlx::postgres::PgConnection;
use sqlx::Row;

use crate::engine::{ApplyMode, ApplyOutcome, Group};

/// `{function}` is the perspective's apply function name (a generated identifier).
const CALL_APPLY_FUNCTION: &str = "SELECT o_applied, o_last_version, o_failed_work_id, o_error, \
    o_done_work_ids, o_rewound, o_completed_event_ids, o_applied_event_ids \
    FROM {schema}.{function}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// Failure backoff and lifecycle flags passed to every apply call.
#[derive(Debug, Clone, Copy)]
pub struct ApplyArgs {
    pub retry_base_ms: f64,
    pub retry_max_ms: f64,
    pub notify_applied: bool,
}

/// Apply `group` through `function` in `schema` on `conn` (its own transaction unless `conn` is
/// inside one).
pub async fn call_apply_function(
    conn: &mut PgConnection,
    schema: &str,
    function: &str,
    group: &Group,
    mode: ApplyMode,
    args: ApplyArgs,
) -> Result<ApplyOutcome, sqlx::Error> {
    let items = &group.items;
    let sql = super::sql(schema, CALL_APPLY_FUNCTION).replace("{function}", function);
    let row = sqlx::query(&sql)
        .bind(group.stream_id)
        .bind(items.iter().map(|i| i.event_work_id).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.event_id).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.stream_version).collect::<Vec<_>>())
        .bind(mode.instant)
        .bind(mode.debug)
        .bind(mode.force)
        .bind(args.retry_base_ms)
        .bind(args.retry_max_ms)
        .bind(args.notify_applied && !mode.force)
        .fetch_one(&mut *conn)
        .await?;
    let failed_id: Option<i64> = row.get(2);
    let error: Option<String> = row.get(3);
    Ok(ApplyOutcome {
        applied: row.get::<i32, _>(0) as u32,
        last_version: row.get(1),
        failed: failed_id.map(|id| (id, error.unwrap_or_default())),
        done_work_ids: row.get(4),
        rewound: row.get(5),
        completed_event_ids: row.get(6),
        applied_event_ids: row.get(7),
    })
}
