//! Recording an event that a custom runner failed to apply, the way the compiled apply
//! functions record a failing handler: the work row keeps the error, gives up its lease and
//! waits `base × 2^(attempts − 1)` (at most `max`) before it is offered again; the cursor is
//! marked Failed. `attempts` already counts the lease that failed.

use uuid::Uuid;

use super::Store;

const RECORD_FAILURE: &str = "WITH w AS (
       UPDATE {schema}.wh_perspective_events w
          SET error = $4, instance_id = NULL, lease_expiry = NULL,
              scheduled_for = now() + make_interval(secs =>
                least($5 * power(2, greatest(w.attempts - 1, 0)), $6) / 1000.0)
        WHERE w.event_work_id = $3
       RETURNING w.attempts),
     c AS (
       INSERT INTO {schema}.wh_perspective_cursors AS c
           (stream_id, perspective_name, status, error, processed_at)
       VALUES ($1, $2, {cursor_failed}, $4, now())
       ON CONFLICT (stream_id, perspective_name) DO UPDATE
         SET status = {cursor_failed}, error = excluded.error, processed_at = now())
     SELECT attempts FROM w";

/// One failed event.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    pub stream_id: Uuid,
    pub perspective: &'a str,
    pub event_work_id: i64,
    pub error: &'a str,
}

impl Store {
    /// Record `failure` with the retry backoff `retry_base_ms` doubling up to `retry_max_ms`;
    /// returns the row's attempts (None when the row is gone).
    pub async fn record_failure(
        &self,
        failure: Failure<'_>,
        retry_base_ms: f64,
        retry_max_ms: f64,
    ) -> Result<Option<i32>, sqlx::Error> {
        sqlx::query_scalar(&self.sql(RECORD_FAILURE))
            .bind(failure.stream_id)
            .bind(failure.perspective)
            .bind(failure.event_work_id)
            .bind(failure.error)
            .bind(retry_base_ms)
            .bind(retry_max_ms)
            .fetch_optional(self.pool())
            .await
    }
}
