//! After applying: completion of applied work rows and retirement of drained streams.

use uuid::Uuid;

use super::Store;

/// A (stream, perspective) whose rows up to `version` were applied: what a completion flush
/// retires.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AppliedUpTo {
    pub stream_id: Uuid,
    pub perspective: std::sync::Arc<str>,
    pub version: i64,
}

/// Fenced by the cursors (a late completion cannot delete an unapplied row); skips rows another
/// transaction holds (a drain retiring them, a rebuild re-queueing them) after 10 ms: waiting
/// for them made deadlock cycles (see `functions/complete_applied_events.sql`).
const COMPLETE_APPLIED_EVENTS: &str = "SELECT {schema}.complete_applied_events($1, $2, $3, $4)";
const CLEANUP_COMPLETED_STREAMS: &str = "SELECT * FROM {schema}.cleanup_completed_streams($1, $2)";
/// Those of `$2` that another try would not change (see `functions/wh_settled_without_retry.sql`).
const NO_RETRY: &str = "SELECT * FROM {schema}.wh_settled_without_retry($1, $2)";

impl Store {
    /// Delete the work rows of each (stream, perspective) up to its version, applied in earlier
    /// transactions (stamp them instead in debug mode): only those at or below the pair's
    /// cursor, so a row whose apply was lost in a failover is left alone. Skips rows another
    /// transaction holds for more than 10 ms (they are being deleted, or are left at or below
    /// their cursor for the next drain to retire). Returns how many.
    pub async fn complete_events(
        &self,
        applied: &[AppliedUpTo],
        debug: bool,
    ) -> Result<i32, sqlx::Error> {
        let streams: Vec<Uuid> = applied.iter().map(|a| a.stream_id).collect();
        let perspectives: Vec<&str> = applied.iter().map(|a| a.perspective.as_ref()).collect();
        let versions: Vec<i64> = applied.iter().map(|a| a.version).collect();
        let mut c = self
            .conn(self.deadlines.routine, "complete_applied_events")
            .await?;
        c.deadline()
            .run(
                sqlx::query_scalar(&self.sql(COMPLETE_APPLIED_EVENTS))
                    .bind(&streams)
                    .bind(&perspectives)
                    .bind(&versions)
                    .bind(debug)
                    .fetch_one(&mut *c),
            )
            .await
    }

    /// Retire those of `streams` (owned by `instance_id`) that have no pending work left;
    /// returns the settled ones: retired now, not held by `instance_id` (retired before, or
    /// another instance's), or held with only work a backfill gates (see [`NO_RETRY`]). None
    /// needs another try: new work re-creates a stream's active row and rings the doorbell, and
    /// the chunk that lifts a stream's gate rings it too. The others still hold ungated work (or
    /// were locked by a producer).
    pub async fn settle_streams(
        &self,
        instance_id: Uuid,
        streams: &[Uuid],
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "cleanup_completed_streams")
            .await?;
        let mut settled: Vec<Uuid> = c
            .deadline()
            .run(
                sqlx::query_scalar(&self.sql(CLEANUP_COMPLETED_STREAMS))
                    .bind(instance_id)
                    .bind(streams)
                    .fetch_all(&mut *c),
            )
            .await?;
        if settled.len() < streams.len() {
            let retired: std::collections::HashSet<&Uuid> = settled.iter().collect();
            let rest: Vec<Uuid> = streams
                .iter()
                .filter(|s| !retired.contains(s))
                .copied()
                .collect();
            let no_retry: Vec<Uuid> = c
                .limit(
                    self.deadlines.routine,
                    "streams another try would not change",
                )
                .run(
                    sqlx::query_scalar(&self.sql(NO_RETRY))
                        .bind(instance_id)
                        .bind(&rest)
                        .fetch_all(&mut *c),
                )
                .await?;
            settled.extend(no_retry);
        }
        Ok(settled)
    }
}
