//! Lifecycle completion records (`wh_lifecycle_completions`) and orphan reconciliation.

use uuid::Uuid;

use super::Store;

const RECORD_COMPLETIONS: &str =
    "INSERT INTO {schema}.wh_lifecycle_completions (event_id, instance_id)
     SELECT unnest($1::uuid[]), $2 ON CONFLICT (event_id) DO NOTHING";
const DELETE_OLD_COMPLETIONS: &str = "DELETE FROM {schema}.wh_lifecycle_completions
     WHERE completed_at < now() - make_interval(secs => $1)";
/// Recent events (appended, or their dead letter replayed, in the lookback) of a subscribed type
/// that every subscribed perspective has applied but whose lifecycle was never recorded.
const ORPHANED_EVENTS: &str = "SELECT e.stream_id, e.event_id FROM {schema}.wh_event_store e
     WHERE (e.created_at > now() - make_interval(secs => $1)
            OR e.event_id IN (SELECT d.event_id FROM {schema}.wh_dead_letters d
                              WHERE d.recovered_at > now() - make_interval(secs => $1)))
       AND EXISTS (SELECT 1 FROM {schema}.wh_perspective_subscriptions s WHERE s.event_type = e.event_type)
       AND NOT EXISTS (SELECT 1 FROM {schema}.wh_lifecycle_completions l WHERE l.event_id = e.event_id)
       AND EXISTS (SELECT 1 FROM {schema}.wh_applied_by_all(
                     e.stream_id, ARRAY[e.stream_version], ARRAY[e.event_type]))
     ORDER BY e.stream_id, e.stream_version
     LIMIT $2";

impl Store {
    /// Record that the lifecycle stages of `event_ids` fired (on `instance_id`).
    pub async fn record_lifecycle_completions(
        &self,
        event_ids: &[Uuid],
        instance_id: Uuid,
    ) -> Result<(), sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "record_lifecycle_completions")
            .await?;
        c.deadline()
            .run(
                sqlx::query(&self.sql(RECORD_COMPLETIONS))
                    .bind(event_ids)
                    .bind(instance_id)
                    .execute(&mut *c),
            )
            .await?;
        Ok(())
    }

    /// Delete completion records older than `retention_seconds`.
    pub async fn delete_old_lifecycle_completions(
        &self,
        retention_seconds: f64,
    ) -> Result<u64, sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "delete_old_lifecycle_completions")
            .await?;
        Ok(c.deadline()
            .run(
                sqlx::query(&self.sql(DELETE_OLD_COMPLETIONS))
                    .bind(retention_seconds)
                    .execute(&mut *c),
            )
            .await?
            .rows_affected())
    }

    /// Up to `limit` (stream, event) pairs appended (or replayed from a dead letter) in the last
    /// `lookback_seconds` whose lifecycle is complete but unrecorded, in stream order.
    pub async fn orphaned_lifecycles(
        &self,
        lookback_seconds: f64,
        limit: i64,
    ) -> Result<Vec<(Uuid, Uuid)>, sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "orphaned_lifecycles")
            .await?;
        c.deadline()
            .run(
                sqlx::query_as(&self.sql(ORPHANED_EVENTS))
                    .bind(lookback_seconds)
                    .bind(limit)
                    .fetch_all(&mut *c),
            )
            .await
    }
}
