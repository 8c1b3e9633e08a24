//! Perspective jobs: backfilling a perspective new to the schema, rebuilding one whose version
//! changed or that `rebuild` names. The life of a job (waiting → queueing → applying → done) is
//! decided in SQL (`wh_job_advance`; the `wh_job_*` functions are in `store/functions/`); the
//! workers and the `rebuild` command take its streams a chunk per transaction.

pub mod progress;

use sqlx::postgres::{PgConnection, PgTypeInfo};
use sqlx::{Connection, Executor, Row, Statement};
use uuid::Uuid;

use super::names::job_kind;
use crate::config::sql_params::{Param, ParsedStatement};

const START: &str = "SELECT {schema}.wh_job_start($1, $2)";
const ADVANCE: &str = "SELECT {schema}.wh_job_advance($1)";
const ACTIVE: &str = "SELECT perspective_name, kind FROM {schema}.wh_perspective_jobs
     WHERE state <> 'done' ORDER BY created_at";
/// A job's listed streams and those not done yet: two index probes, nothing counted in the
/// work table (unlike [`PROGRESS`]), so cheap enough after every chunk.
const STREAMS_DONE: &str = "SELECT j.streams_total,
            (SELECT count(*) FROM {schema}.wh_perspective_job_streams s
             WHERE s.perspective_name = j.perspective_name)
     FROM {schema}.wh_perspective_jobs j WHERE j.perspective_name = $1";
const TAKE_STREAMS: &str = "SELECT {schema}.wh_job_take_streams($1, $2)";
const REQUEUE_STREAMS: &str =
    "SELECT o_queued, o_applied FROM {schema}.wh_job_requeue_streams($1, $2, $3, $4, $5, $6)";
const SET_LOCAL_SEARCH_PATH: &str = "SET LOCAL search_path TO {schema}, public";
/// Each job with what is left: listed streams not queued yet (and their events), plus the
/// perspective's pending work rows (queued, not applied).
const PROGRESS: &str =
    "SELECT j.perspective_name, j.kind, j.state, j.streams_total, j.events_total,
            (SELECT count(*) FROM {schema}.wh_perspective_job_streams s
             WHERE s.perspective_name = j.perspective_name),
            (SELECT coalesce(sum(s.events), 0)::bigint FROM {schema}.wh_perspective_job_streams s
             WHERE s.perspective_name = j.perspective_name),
            (SELECT count(*) FROM {schema}.wh_perspective_events w
             WHERE w.perspective_name = j.perspective_name AND w.processed_at IS NULL),
            extract(epoch FROM now() - j.started_at)::float8,
            (SELECT string_agg(format('pid %s%s', b.pid,
                                      coalesce(' (' || concat_ws(', ',
                                          nullif(b.application_name, ''),
                                          'user ' || b.usename,
                                          'open ' || round(extract(epoch FROM now() - b.xact_start))::text || ' s')
                                        || ')', '')),
                               '; ' ORDER BY b.pid)
             FROM {schema}.wh_job_blockers(j.wait_for) b WHERE j.state = 'waiting')
     FROM {schema}.wh_perspective_jobs j WHERE j.state <> 'done' ORDER BY j.perspective_name";

/// Versions being built beside a live one (blue/green), by perspective, and whether each was
/// live before (a rollback catches it up from its kept cursors).
const BUILDING: &str = "SELECT perspective_name, version, switched_at IS NOT NULL
     FROM {schema}.wh_perspective_versions WHERE state = 'building'";

/// Every perspective's phase and progress, read at once: its jobs' figures, and the versions
/// built beside live ones.
#[derive(Debug, Clone, Default)]
pub struct Phases {
    jobs: Vec<JobRow>,
    building: Vec<(String, i32, bool)>,
}

impl Phases {
    pub async fn read(conn: &mut PgConnection, schema: &str) -> Result<Phases, sqlx::Error> {
        let mut tx = conn.begin().await?;
        let jobs = progress(&mut tx, schema).await?;
        let building = sqlx::query_as(&super::sql(schema, BUILDING))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Phases { jobs, building })
    }

    /// The version built beside `perspective`'s live one, and whether it is a rollback.
    pub fn next_version(&self, perspective: &str) -> Option<(i32, bool)> {
        self.building
            .iter()
            .find(|(p, _, _)| p == perspective)
            .map(|(_, version, rollback)| (*version, *rollback))
    }

    /// `perspective`'s phase: `Building` (with the new version's progress) while a version is
    /// built beside it, `Switching` once that version's catch-up is done; else its own job's
    /// phase, or `Live`.
    pub fn of(&self, perspective: &str) -> (progress::Phase, Option<progress::Progress>) {
        if let Some((_, version, _)) = self.building.iter().find(|(p, _, _)| p == perspective) {
            let internal = crate::config::versions::internal_name(perspective, *version as u32);
            return match self.jobs.iter().find(|j| j.perspective == internal) {
                Some(job) => {
                    let (_, mut p) = progress::Progress::of(job);
                    p.version = Some(*version as u32);
                    (progress::Phase::Building, Some(p))
                }
                None => (progress::Phase::Switching, None),
            };
        }
        match self.jobs.iter().find(|j| j.perspective == perspective) {
            Some(job) => {
                let (phase, p) = progress::Progress::of(job);
                (phase, Some(p))
            }
            None => (progress::Phase::Live, None),
        }
    }
}

/// What a job does to each stream before queueing its history again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum JobKind {
    /// A perspective new to the schema: queue the history; its live work waits for it.
    Backfill,
    /// Reset the stream's share of the model, then queue the history.
    Rebuild,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Backfill => job_kind::BACKFILL,
            JobKind::Rebuild => job_kind::REBUILD,
        }
    }

    fn parse(s: &str) -> Option<JobKind> {
        match s {
            job_kind::BACKFILL => Some(JobKind::Backfill),
            job_kind::REBUILD => Some(JobKind::Rebuild),
            _ => None,
        }
    }
}

/// Where a job stands after `wh_job_advance`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum JobState {
    /// For transactions older than the job to end (their appends may lack work rows).
    Waiting,
    /// Streams are listed and being queued.
    Queueing,
    /// Every stream is queued; the workers are applying the history.
    Applying,
    /// The job is over (a done job is kept, with its figures, until the perspective's next).
    Done,
    /// There is no job for the perspective.
    None,
    /// Another session is advancing it right now.
    Busy,
}

impl JobState {
    fn parse(s: &str) -> JobState {
        match s {
            "waiting" => JobState::Waiting,
            "queueing" => JobState::Queueing,
            "applying" => JobState::Applying,
            "done" => JobState::Done,
            "busy" => JobState::Busy,
            _ => JobState::None,
        }
    }
}

/// A job's figures, as stored (see [`progress`]).
#[derive(Debug, Clone, PartialEq)]
pub struct JobRow {
    pub perspective: String,
    pub kind: JobKind,
    pub state: JobState,
    /// Streams and events listed when queueing started (None while waiting).
    pub streams_total: Option<i64>,
    pub events_total: Option<i64>,
    /// Listed streams not queued yet, and the events they held.
    pub streams_left: i64,
    pub events_unqueued: i64,
    /// The perspective's work rows not applied yet (history and live).
    pub pending_events: i64,
    /// Seconds since queueing started.
    pub running_seconds: Option<f64>,
    /// While waiting: the transactions waited for ("pid 4242 (psql, user app, open 310 s)"),
    /// None when none is left.
    pub waiting_for: Option<String>,
}

/// Start (or restart) `perspective`'s job of `kind` (replacing any job it has).
pub async fn start(
    conn: &mut PgConnection,
    schema: &str,
    perspective: &str,
    kind: JobKind,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, START))
        .bind(perspective)
        .bind(kind.as_str())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Move `perspective`'s job as far as it can go now.
pub async fn advance(
    conn: &mut PgConnection,
    schema: &str,
    perspective: &str,
) -> Result<JobState, sqlx::Error> {
    let state: String = sqlx::query_scalar(&super::sql(schema, ADVANCE))
        .bind(perspective)
        .fetch_one(&mut *conn)
        .await?;
    Ok(JobState::parse(&state))
}

/// Every job not done yet, oldest first: (perspective, kind).
pub async fn active(
    conn: &mut PgConnection,
    schema: &str,
) -> Result<Vec<(String, JobKind)>, sqlx::Error> {
    let rows = sqlx::query(&super::sql(schema, ACTIVE))
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows
        .iter()
        .filter_map(|r| Some((r.get(0), JobKind::parse(r.get::<&str, _>(1))?)))
        .collect())
}

/// `perspective`'s job (done or not): (streams listed — None before it listed them —, streams
/// not done yet). None without a job.
pub async fn streams_done(
    conn: &mut PgConnection,
    schema: &str,
    perspective: &str,
) -> Result<Option<(Option<i64>, i64)>, sqlx::Error> {
    sqlx::query_as(&super::sql(schema, STREAMS_DONE))
        .bind(perspective)
        .fetch_optional(&mut *conn)
        .await
}

/// The figures of each job not done yet. In a transaction: JIT is off for it.
pub async fn progress(conn: &mut PgConnection, schema: &str) -> Result<Vec<JobRow>, sqlx::Error> {
    // A count per job, costed per job row guessed from the jobs table's statistics (hundreds
    // while they are stale), passes jit_above_cost: JIT compiled it for 1.3 s of CPU on every
    // read, 25 ms of work, and on 2 cores that stalled the live perspectives' applies.
    sqlx::query("SET LOCAL jit = off")
        .execute(&mut *conn)
        .await?;
    let rows = sqlx::query(&super::sql(schema, PROGRESS))
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            Some(JobRow {
                perspective: r.get(0),
                kind: JobKind::parse(r.get::<&str, _>(1))?,
                state: JobState::parse(r.get::<&str, _>(2)),
                streams_total: r.get(3),
                events_total: r.get(4),
                streams_left: r.get(5),
                events_unqueued: r.get(6),
                pending_events: r.get(7),
                running_seconds: r.get(8),
                waiting_for: r.get(9),
            })
        })
        .collect())
}

/// In a transaction: take up to `max_streams` listed streams of `perspective`'s job that nobody
/// else holds, locking their heads and cursors until the transaction ends. Also resolves the
/// perspective's tables (for `reset`) for the rest of the transaction.
pub async fn take_streams(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    max_streams: i32,
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query(&super::sql(schema, SET_LOCAL_SEARCH_PATH))
        .execute(&mut *tx)
        .await?;
    sqlx::query_scalar(&super::sql(schema, TAKE_STREAMS))
        .bind(perspective)
        .bind(max_streams)
        .fetch_all(&mut *tx)
        .await
}

/// How a chunk's streams are caught up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Requeue {
    /// Queue their history; the workers apply it (any runner).
    Queue,
    /// Queue and apply it in the same transaction through the perspective's compiled apply
    /// function (SQL perspectives only), leaving only what failed for the workers.
    Apply {
        debug: bool,
        retry_base_ms: f64,
        retry_max_ms: f64,
    },
}

/// Queue the history of streams taken by [`take_streams`] (after their reset, for a rebuild) and
/// strike them from the job's list. Returns (work rows queued, events applied).
pub async fn requeue_streams(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    streams: &[Uuid],
    how: Requeue,
) -> Result<(i64, i64), sqlx::Error> {
    let (apply, debug, base, max) = match how {
        Requeue::Queue => (false, false, 0.0, 0.0),
        Requeue::Apply {
            debug,
            retry_base_ms,
            retry_max_ms,
        } => (true, debug, retry_base_ms, retry_max_ms),
    };
    sqlx::query_as(&super::sql(schema, REQUEUE_STREAMS))
        .bind(perspective)
        .bind(streams)
        .bind(apply)
        .bind(debug)
        .bind(base)
        .bind(max)
        .fetch_one(&mut *tx)
        .await
}

/// Run one `reset` statement for `stream`. A reset concerns the whole stream: parameters other
/// than `:stream_id` are NULL. On failure, also returns the statement's SQL (for the message).
pub async fn run_reset(
    tx: &mut PgConnection,
    stmt: &ParsedStatement,
    stream: Uuid,
) -> Result<(), (sqlx::Error, String)> {
    let (sql, params) = stmt.to_positional();
    let types: Vec<PgTypeInfo> = params
        .iter()
        .map(|p| PgTypeInfo::with_name(p.pg_type()))
        .collect();
    let result = async {
        let prepared = (&mut *tx).prepare_with(&sql, &types).await?;
        let mut q = prepared.query();
        for p in &params {
            q = match p {
                Param::StreamId => q.bind(stream),
                Param::EventId => q.bind(None::<Uuid>),
                Param::StreamVersion => q.bind(None::<i64>),
                Param::Data | Param::Metadata | Param::Scope => q.bind(None::<serde_json::Value>),
                Param::CreatedAt => q.bind(None::<chrono::DateTime<chrono::Utc>>),
                Param::EventType | Param::UserId | Param::TenantId => q.bind(None::<String>),
                // Spelled into the SQL, never a placeholder (and refused in a reset).
                Param::Events => q,
            };
        }
        q.execute(&mut *tx).await
    }
    .await;
    result.map(|_| ()).map_err(|e| (e, sql))
}
