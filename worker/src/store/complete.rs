//! After applying: completion of applied work rows and retirement of drained streams.

use uuid::Uuid;

use super::Store;

const COMPLETE_PERSPECTIVE_EVENTS: &str = "SELECT {schema}.complete_perspective_events($1, $2)";
/// The retired streams, and those the instance does not hold (any more): retired already (by
/// an earlier call, or by `claim_work`), or held by another instance. Neither needs another
/// try; new work re-creates the stream's active row and rings the doorbell. (One snapshot for
/// the statement: a stream the function retires is in its result, not seen gone by the second
/// branch.)
const SETTLE_STREAMS: &str =
    "SELECT r.stream_id FROM {schema}.cleanup_completed_streams($1, $2) AS r(stream_id)
    UNION
    SELECT x.stream_id FROM unnest($2::uuid[]) AS x(stream_id)
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.wh_active_streams a
                      WHERE a.stream_id = x.stream_id AND a.assigned_instance_id = $1)";

impl Store {
    /// Delete applied work rows (stamp them instead in debug mode). Returns how many.
    pub async fn complete_events(&self, work_ids: &[i64], debug: bool) -> Result<i32, sqlx::Error> {
        sqlx::query_scalar(&self.sql(COMPLETE_PERSPECTIVE_EVENTS))
            .bind(work_ids)
            .bind(debug)
            .fetch_one(self.pool())
            .await
    }

    /// Retire those of `streams` (owned by `instance_id`) that have no pending work left;
    /// returns the settled ones: retired now, or not held by `instance_id` (retired before, or
    /// another instance's). The others still hold work (or were locked by a producer).
    pub async fn settle_streams(
        &self,
        instance_id: Uuid,
        streams: &[Uuid],
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        sqlx::query_scalar(&self.sql(SETTLE_STREAMS))
            .bind(instance_id)
            .bind(streams)
            .fetch_all(self.pool())
            .await
    }
}
