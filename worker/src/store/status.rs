//! Read-only status figures: how far behind each perspective is, whether it is catching up,
//! what failed, how often its appliers hit lock conflicts, who is alive.
//! Used by `perspective-worker status`, the worker's pending gauge and the operator's status.

use serde::Serialize;
use sqlx::postgres::PgConnection;
use sqlx::{FromRow, Row};

use crate::store::catchup::progress::{Phase, Progress};
use crate::store::instances::CONTENTION_METADATA_KEY;

/// Lock conflicts a minute between a perspective's appliers (summed over the live instances) at
/// which the contention counts as persistent: `status` prints a hint naming `sequencing`, and
/// the operator sets `Degraded` (`LockContention`) and sends a Warning Event. A few conflicts a
/// minute cost little (each is retried within milliseconds); ten and more mean appliers keep
/// queueing on the same rows.
pub const PERSISTENT_LOCK_CONFLICTS_PER_MINUTE: i64 = 10;

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
    /// Live, or catching up (Backfilling, Rebuilding), or a new version built beside it
    /// (Building, Switching).
    pub phase: Phase,
    /// While catching up: streams done, events remaining, time left.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// The version serving (the one its functions were compiled from), once migrated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<i32>,
    /// While `Building` or `Switching`: the version built beside the serving one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_version: Option<i32>,
    /// Whether `next_version` is a kept version caught up from its cursors (a rollback).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub rollback: bool,
    /// Applies stopped by a lock conflict with another applier (and retried) over the last
    /// minute, summed over the live instances' last heartbeats.
    pub lock_conflicts_per_minute: i64,
    /// The SQLSTATE most of those conflicts had (40P01, 40001, 55P03), when there were any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lock_conflict_sqlstate: Option<String>,
    /// The newest pending dead letters, newest first (at most [`NEWEST_DEAD_LETTERS`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub newest_dead_letters: Vec<DeadLetterSummary>,
}

/// How many of a perspective's pending dead letters the status shows.
pub const NEWEST_DEAD_LETTERS: i64 = 3;

/// The longest error text of a [`DeadLetterSummary`], in characters (the full text is in
/// `perspective-worker dead-letters list`).
pub const DEAD_LETTER_ERROR_CHARS: i32 = 200;

/// One pending dead letter, as status shows it.
#[derive(Debug, Clone, Serialize, PartialEq, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSummary {
    #[sqlx(rename = "dead_letter_id")]
    pub id: i64,
    pub event_type: String,
    pub stream_id: uuid::Uuid,
    /// The handler's error, cut to [`DEAD_LETTER_ERROR_CHARS`].
    pub error: Option<String>,
    /// When the event first failed (when it was dead-lettered, for rows that lack it).
    pub first_failed_at: chrono::DateTime<chrono::Utc>,
}

impl PerspectiveStatus {
    /// One line while it is not `Live`: its catch-up's progress ("order_totals backfilling:
    /// 61% (…), about 40 s left"), or what a switch waits for.
    pub fn phase_message(&self) -> Option<String> {
        match (&self.progress, self.phase, self.next_version) {
            (Some(progress), phase, _) => Some(progress.message(&self.name, phase)),
            (None, Phase::Live, _) => None,
            (None, Phase::Switching, Some(next)) => Some(format!(
                "{} switching: v{next} is built and switches once caught up (its oldest unapplied \
                 event under 1 s old, no pending dead letter) by a worker running as the schema \
                 owner; v{} serves until then (workers running as a role that may not switch: \
                 run `perspective-worker switch --perspective {0}` as the owner, or `kubectl pd \
                 switch <deployment> {0}`)",
                self.name,
                self.version.unwrap_or_default()
            )),
            (None, phase, _) => Some(format!("{} {}", self.name, phase.as_str().to_lowercase())),
        }
    }

    /// Whether its lock conflicts persist: at least [`PERSISTENT_LOCK_CONFLICTS_PER_MINUTE`].
    pub fn lock_contention(&self) -> bool {
        self.lock_conflicts_per_minute >= PERSISTENT_LOCK_CONFLICTS_PER_MINUTE
    }

    /// What persistent lock contention means, e.g. "customer_stats: 40 lock conflicts a minute
    /// between appliers; see sequencing"; None below the threshold.
    pub fn lock_contention_message(&self) -> Option<String> {
        self.lock_contention()
            .then(|| lock_contention_message(&self.name, self.lock_conflicts_per_minute))
    }
}

/// "NAME: N lock conflicts a minute between appliers; see sequencing" (the perspective's
/// `sequencing` option decides which of its events may apply concurrently).
pub fn lock_contention_message(perspective: &str, per_minute: i64) -> String {
    format!("{perspective}: {per_minute} lock conflicts a minute between appliers; see sequencing")
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
/// Lock conflicts of the last minute per perspective, summed over the live instances'
/// heartbeats (see [`CONTENTION_METADATA_KEY`]), with the SQLSTATE of the instance that had
/// the most. Metadata of another shape counts as none.
const LOCK_CONFLICTS: &str = "SELECT name, sum(n)::bigint, (array_agg(sqlstate ORDER BY n DESC))[1]
     FROM (SELECT c.key AS name, left(c.value->>'sqlstate', 5) AS sqlstate,
                  CASE WHEN jsonb_typeof(c.value->'perMinute') = 'number'
                       THEN least(round((c.value->>'perMinute')::numeric), 1e12) END AS n
           FROM {schema}.wh_service_instances i,
                jsonb_each(CASE WHEN jsonb_typeof(i.metadata->$2) = 'object'
                                THEN i.metadata->$2 ELSE '{}' END) AS c
           WHERE i.last_heartbeat_at > now() - make_interval(secs => $1)) AS x
     WHERE n >= 1
     GROUP BY name";
/// The newest [`NEWEST_DEAD_LETTERS`] pending dead letters of each of the perspectives `$1`
/// (those with any; the partial index `wh_dead_letters_pending` finds each one's).
const NEWEST: &str = "SELECT p.name, d.dead_letter_id, d.event_type, d.stream_id,
            left(d.error, $2) AS error,
            coalesce(d.first_failed_at, d.dead_lettered_at) AS first_failed_at
     FROM unnest($1::text[]) AS p(name)
     CROSS JOIN LATERAL (
       SELECT * FROM {schema}.wh_dead_letters
       WHERE perspective_name = p.name AND recovery_status = {dead_letter_pending}
       ORDER BY dead_letter_id DESC LIMIT $3) AS d
     ORDER BY p.name, d.dead_letter_id DESC";
/// The version each perspective serves.
const SERVING: &str = "SELECT perspective_name, version FROM {schema}.wh_perspectives";
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
    let phases = super::catchup::Phases::read(&mut *conn, schema).await?;
    let serving: Vec<(String, i32)> = sqlx::query_as(&super::sql(schema, SERVING))
        .fetch_all(&mut *conn)
        .await?;
    let conflicts: Vec<(String, i64, Option<String>)> =
        sqlx::query_as(&super::sql(schema, LOCK_CONFLICTS))
            .bind(stale_after_seconds)
            .bind(CONTENTION_METADATA_KEY)
            .fetch_all(&mut *conn)
            .await?;
    let holding: Vec<String> = rows
        .iter()
        .filter(|r| r.get::<i64, _>(5) > 0)
        .map(|r| r.get(0))
        .collect();
    let newest = newest_dead_letters(&mut *conn, schema, &holding).await?;
    let perspectives = rows
        .iter()
        .map(|r| {
            let name: String = r.get(0);
            let (phase, progress) = phases.of(&name);
            let next = phases.next_version(&name);
            let (lock_conflicts_per_minute, lock_conflict_sqlstate) = conflicts
                .iter()
                .find(|(p, _, _)| *p == name)
                .map_or((0, None), |(_, n, state)| (*n, state.clone()));
            PerspectiveStatus {
                configured: r.get(1),
                pending_events: r.get(2),
                oldest_pending_seconds: r.get(3),
                failed_streams: r.get(4),
                dead_letters: r.get(5),
                phase,
                progress,
                version: serving.iter().find(|(p, _)| *p == name).map(|(_, v)| *v),
                next_version: next.map(|(v, _)| v),
                rollback: next.is_some_and(|(_, rollback)| rollback),
                lock_conflicts_per_minute,
                lock_conflict_sqlstate,
                newest_dead_letters: newest
                    .iter()
                    .filter(|(p, _)| *p == name)
                    .map(|(_, d)| d.clone())
                    .collect(),
                name,
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

/// The newest pending dead letters of `perspectives`, with the perspective's name; no query
/// when there are none.
async fn newest_dead_letters(
    conn: &mut PgConnection,
    schema: &str,
    perspectives: &[String],
) -> Result<Vec<(String, DeadLetterSummary)>, sqlx::Error> {
    if perspectives.is_empty() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(&super::sql(schema, NEWEST))
        .bind(perspectives)
        .bind(DEAD_LETTER_ERROR_CHARS)
        .bind(NEWEST_DEAD_LETTERS)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, DeadLetterSummary::from_row(r)?)))
        .collect()
}

impl super::Store {
    /// Work rows not yet applied, and the age in seconds of the oldest, per perspective that has
    /// any.
    pub async fn pending_per_perspective(&self) -> Result<Vec<(String, i64, f64)>, sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "pending per perspective")
            .await?;
        c.deadline()
            .run(sqlx::query_as(&self.sql(PENDING_PER_PERSPECTIVE)).fetch_all(&mut *c))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_says_which_version_waits_and_which_serves() {
        let mut p = PerspectiveStatus {
            name: "orders".into(),
            phase: Phase::Switching,
            version: Some(2),
            next_version: Some(3),
            ..Default::default()
        };
        let line = p.phase_message().unwrap();
        assert!(
            line.starts_with("orders switching: v3 is built and switches once caught up"),
            "{line}"
        );
        assert!(line.contains("v2 serves until then"), "{line}");
        assert!(
            line.ends_with(
                "run `perspective-worker switch --perspective orders` as the owner, or \
                 `kubectl pd switch <deployment> orders`)"
            ),
            "{line}"
        );
        p.phase = Phase::Live;
        assert_eq!(p.phase_message(), None);
        p.phase = Phase::Rebuilding;
        assert_eq!(p.phase_message().as_deref(), Some("orders rebuilding"));
    }
}
