//! Read-only status figures: how far behind each perspective is, whether it is catching up,
//! what failed, who is alive.
//! Used by `perspective-worker status`, the worker's pending gauge and the operator's status.

use serde::Serialize;
use sqlx::postgres::PgConnection;
use sqlx::Row;

use crate::store::catchup::progress::{Phase, Progress};

/// Status of one perspective.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PerspectiveStatus {
    pub name: String,
    /// Whether the perspective is in the config (work of a removed perspective may remain).
    pub configured: bool,
    /// Work rows not yet applied.
    pub pending_events: i64,
    /// Age of the oldest pending work row, seconds.
    pub oldest_pending_seconds: Option<f64>,
    /// Streams whose cursor is in the Failed state.
    pub failed_streams: i64,
    /// Dead letters not yet replayed or discarded.
    pub dead_letters: i64,
    /// Live, or catching up (Backfilling, Rebuilding).
    pub phase: Phase,
    /// While catching up: streams done, events remaining, time left.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
}

/// Status of a deployment's schema.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub schema: String,
    pub schema_version: Option<i32>,
    pub perspectives: Vec<PerspectiveStatus>,
    /// Worker instances whose heartbeat is younger than the staleness threshold.
    pub live_instances: i64,
    /// Streams with work not yet completed.
    pub active_streams: i64,
}

const PERSPECTIVES: &str = "WITH names AS (
       SELECT unnest($1::text[]) AS name
       UNION SELECT perspective_name FROM {schema}.wh_perspective_events WHERE processed_at IS NULL
       UNION SELECT perspective_name FROM {schema}.wh_dead_letters
             WHERE recovery_status = {dead_letter_pending}
       UNION SELECT perspective_name FROM {schema}.wh_perspective_cursors
             WHERE (status & {cursor_failed}) <> 0
     ),
     pending AS (
       SELECT perspective_name AS name, count(*) AS n,
              extract(epoch FROM now() - min(created_at))::float8 AS oldest
       FROM {schema}.wh_perspective_events WHERE processed_at IS NULL GROUP BY 1
     ),
     failed AS (
       SELECT perspective_name AS name, count(*) AS n
       FROM {schema}.wh_perspective_cursors WHERE (status & {cursor_failed}) <> 0 GROUP BY 1
     ),
     dead AS (
       SELECT perspective_name AS name, count(*) AS n
       FROM {schema}.wh_dead_letters WHERE recovery_status = {dead_letter_pending} GROUP BY 1
     )
     SELECT names.name, names.name = ANY($1) AS configured,
            coalesce(pending.n, 0), pending.oldest, coalesce(failed.n, 0), coalesce(dead.n, 0)
     FROM names
     LEFT JOIN pending USING (name) LEFT JOIN failed USING (name) LEFT JOIN dead USING (name)
     ORDER BY names.name";
const INSTANCES_AND_STREAMS: &str = "SELECT
       (SELECT count(*) FROM {schema}.wh_service_instances
        WHERE last_heartbeat_at > now() - make_interval(secs => $1)),
       (SELECT count(*) FROM {schema}.wh_active_streams)";
const PENDING_PER_PERSPECTIVE: &str = "SELECT perspective_name, count(*),
            extract(epoch FROM now() - min(created_at))::float8
     FROM {schema}.wh_perspective_events WHERE processed_at IS NULL GROUP BY perspective_name";

/// Read the status of `schema`. `configured` lists the config's perspectives (so a perspective
/// with no work still shows, with zeros); `stale_after_seconds` is the heartbeat age after
/// which an instance no longer counts as live.
pub async fn read_status(
    conn: &mut PgConnection,
    schema: &str,
    configured: &[String],
    stale_after_seconds: f64,
) -> Result<Status, sqlx::Error> {
    let schema_version = super::schema::latest_migration(&mut *conn, schema).await?;
    let rows = sqlx::query(&super::sql(schema, PERSPECTIVES))
        .bind(configured)
        .fetch_all(&mut *conn)
        .await?;
    let jobs = super::catchup::progress(&mut *conn, schema).await?;
    let perspectives = rows
        .iter()
        .map(|r| {
            let name: String = r.get(0);
            let (phase, progress) = match jobs.iter().find(|j| j.perspective == name) {
                Some(job) => {
                    let (phase, progress) = Progress::of(job);
                    (phase, Some(progress))
                }
                None => (Phase::Live, None),
            };
            PerspectiveStatus {
                name,
                configured: r.get(1),
                pending_events: r.get(2),
                oldest_pending_seconds: r.get(3),
                failed_streams: r.get(4),
                dead_letters: r.get(5),
                phase,
                progress,
            }
        })
        .collect();
    let row = sqlx::query(&super::sql(schema, INSTANCES_AND_STREAMS))
        .bind(stale_after_seconds)
        .fetch_one(&mut *conn)
        .await?;
    Ok(Status {
        schema: schema.to_string(),
        schema_version,
        perspectives,
        live_instances: row.get(0),
        active_streams: row.get(1),
    })
}

impl super::Store {
    /// Work rows not yet applied, and the age in seconds of the oldest, per perspective that has
    /// any.
    pub async fn pending_per_perspective(&self) -> Result<Vec<(String, i64, f64)>, sqlx::Error> {
        sqlx::query_as(&self.sql(PENDING_PER_PERSPECTIVE))
            .fetch_all(self.pool())
            .await
    }
}
