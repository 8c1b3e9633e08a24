//! After applying: completion of applied work rows and retirement of drained streams.

use uuid::Uuid;

use super::Store;

const COMPLETE_PERSPECTIVE_EVENTS: &str = "SELECT {schema}.complete_perspective_events($1, $2)";
const CLEANUP_COMPLETED_STREAMS: &str = "SELECT * FROM {schema}.cleanup_completed_streams($1, $2)";

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
    /// returns the retired ones.
    pub async fn cleanup_completed_streams(
        &self,
        instance_id: Uuid,
        streams: &[Uuid],
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        sqlx::query_scalar(&self.sql(CLEANUP_COMPLETED_STREAMS))
            .bind(instance_id)
            .bind(streams)
            .fetch_all(self.pool())
            .await
    }
}
