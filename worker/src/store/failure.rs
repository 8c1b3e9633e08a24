//! Recording an event that a custom runner failed to apply, the way the compiled apply
//! functions record a failing handler: the work row keeps the error, gives up its lease and
//! waits [`retry_delay_ms`] before it is offered again; the cursor is marked Failed. `attempts`
//! already counts the lease that failed.

use uuid::Uuid;

use super::Store;

const RECORD_FAILURE: &str = "WITH w AS (
       UPDATE {schema}.wh_perspective_events w
          SET error = $4, instance_id = NULL, lease_expiry = NULL,
              scheduled_for = now() + {retry_delay}
        WHERE w.event_work_id = $3
       RETURNING w.attempts),
     c AS (
       INSERT INTO {schema}.wh_perspective_cursors AS c
           (stream_id, perspective_name, status, error, processed_at)
       VALUES ($1, $2, {cursor_failed}, $4, now())
       ON CONFLICT (stream_id, perspective_name) DO UPDATE
         SET status = {cursor_failed}, error = excluded.error, processed_at = now())
     SELECT attempts FROM w";

/// The wait before an event that has now failed `failures` times (counting this failure) is
/// offered again: `base`, then doubling per failure (1 s, 2 s, 4 s … with the default base),
/// at most `max`. [`retry_delay_sql`] is the same rule in SQL, for the statements that record a
/// failure in the database.
pub fn retry_delay_ms(base_ms: f64, max_ms: f64, failures: i32) -> f64 {
    // 2^30 × any base is past any sane max; the clamp keeps the power finite.
    let doublings = (failures - 1).clamp(0, 30);
    (base_ms * f64::from(1u32 << doublings)).min(max_ms)
}

/// [`retry_delay_ms`] as an SQL interval expression over SQL expressions for the base (ms), the
/// max (ms) and the failure count (counting this failure).
pub(crate) fn retry_delay_sql(base_ms: &str, max_ms: &str, failures: &str) -> String {
    format!(
        "make_interval(secs => least({base_ms} * power(2, least(greatest(({failures}) - 1, 0), 30)), {max_ms}) / 1000.0)"
    )
}

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
        // `attempts` already counts the failed lease: it is the failure count.
        let statement =
            RECORD_FAILURE.replace("{retry_delay}", &retry_delay_sql("$5", "$6", "w.attempts"));
        let mut c = self.conn(self.deadlines.routine, "record_failure").await?;
        c.deadline()
            .run(
                sqlx::query_scalar(&self.sql(&statement))
                    .bind(failure.stream_id)
                    .bind(failure.perspective)
                    .bind(failure.event_work_id)
                    .bind(failure.error)
                    .bind(retry_base_ms)
                    .bind(retry_max_ms)
                    .fetch_optional(&mut *c),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_are_1_2_4_seconds_up_to_the_max() {
        let delays: Vec<f64> = (1..=7)
            .map(|failures| retry_delay_ms(1000.0, 30_000.0, failures))
            .collect();
        assert_eq!(
            delays,
            [1000.0, 2000.0, 4000.0, 8000.0, 16_000.0, 30_000.0, 30_000.0]
        );
        assert_eq!(
            retry_delay_ms(1000.0, 300_000.0, 0),
            1000.0,
            "no failure yet"
        );
        assert_eq!(retry_delay_ms(1000.0, 300_000.0, i32::MAX), 300_000.0);
    }

    #[test]
    fn the_sql_rule_is_the_same_rule() {
        assert_eq!(
            retry_delay_sql("$5", "$6", "w.attempts"),
            "make_interval(secs => least($5 * power(2, least(greatest((w.attempts) - 1, 0), 30)), $6) / 1000.0)"
        );
    }
}
