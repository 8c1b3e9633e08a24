//! Perspective jobs: catching a perspective up with the event store.
//!
//! - A *backfill* starts when `migrate` meets a perspective new to the schema: each stream's
//!   stored history is queued for it, while its live work on a stream waits until that stream is
//!   queued (so nothing is applied before an older event of its stream).
//! - A *rebuild* starts when a perspective's `version` changes, or with `perspective-worker
//!   rebuild`: each stream's share of the model is `reset`, then its history queued.
//!
//! Either way the work is the same: the job lists the streams (once every transaction older than
//! the job has ended, see `wh_job_advance`), then whoever runs it — every worker instance, and the
//! `rebuild` command — takes a chunk of streams per transaction ([`run_chunk`]): their heads and
//! cursors are locked (a producer of one of them waits for this chunk only), reset for a rebuild,
//! their cursors and pending work for the perspective dropped and every stored event of a
//! subscribed type queued again, in the one commit that strikes them from the list. A worker
//! running the compiled SQL perspectives also applies the queued history in that transaction
//! ([`Requeue::Apply`]), so a rebuilt stream is never seen reset but not replayed; otherwise (a
//! custom runner, the `rebuild` command, a perspective with sequencing key or serial, whose
//! events only `wh_drain` keeps apart) the workers apply it like any other work. Either way in
//! order and exactly once; a worker killed mid-chunk rolls the chunk back and its streams are
//! taken again.

use sqlx::postgres::PgConnection;
use sqlx::Connection;
use uuid::Uuid;

use crate::config::sql_params::ParsedStatement;
use crate::config::{Config, PerspectiveConfig};
use crate::store::catchup as store;
pub use crate::store::catchup::{JobKind, JobRow, JobState, Requeue};

/// Streams per chunk transaction: enough to amortise the commit, few enough that a producer of
/// one of them never waits long.
pub const CHUNK_STREAMS: i32 = 16;

/// How often a chunk is tried when PostgreSQL picks it as a deadlock victim: its deletes of a
/// pair's work rows can cross a completion deleting some of the same rows in another order, and
/// a producer appending to several streams in one transaction can lock heads in another order.
/// The other side committed, so a retry goes through.
const DEADLOCK_ATTEMPTS: u32 = 5;

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("perspective {0} is not in the config")]
    UnknownPerspective(String),
    #[error("perspective {0} has no `reset`, so its model cannot be cleared stream by stream; add one to rebuild it")]
    NoReset(String),
    #[error("perspective {perspective}, stream {stream}: reset failed: {message}")]
    Reset {
        perspective: String,
        stream: Uuid,
        message: String,
    },
    #[error(
        "perspective {perspective}: version {version} is built, but the switch needs the rights of the schema's owner (it moves tables and replaces functions) and this database role does not have them; run `perspective-worker switch` as the owner (on Kubernetes: annotate the deployment perspectives.dev/switch=<perspective>), or the workers as the owner role (the old version keeps serving meanwhile)"
    )]
    SwitchNeedsOwner { perspective: String, version: i32 },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// One chunk's outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Chunk {
    pub streams: usize,
    /// Work rows queued for the workers (the whole history when queueing; when applying, only
    /// what a failing apply left).
    pub work_rows: i64,
    /// Events applied in the chunk's transaction.
    pub applied: i64,
}

/// Run one chunk of `perspective`'s job: None when no listed stream is free (all queued, or
/// taken by others).
pub async fn run_chunk(
    conn: &mut PgConnection,
    schema: &str,
    perspective: &PerspectiveConfig,
    kind: JobKind,
    how: Requeue,
) -> Result<Option<Chunk>, JobError> {
    let reset = match kind {
        JobKind::Backfill => None,
        JobKind::Rebuild => Some(
            perspective
                .compiled_reset()
                .ok_or_else(|| JobError::NoReset(perspective.name.clone()))?,
        ),
    };
    let mut attempt = 1;
    loop {
        match chunk_once(conn, schema, &perspective.name, reset.as_deref(), how).await {
            Err(JobError::Database(e)) if is_deadlock(&e) && attempt < DEADLOCK_ATTEMPTS => {
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn is_deadlock(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "40P01")
}

async fn chunk_once(
    conn: &mut PgConnection,
    schema: &str,
    perspective: &str,
    reset: Option<&[ParsedStatement]>,
    how: Requeue,
) -> Result<Option<Chunk>, JobError> {
    let mut tx = conn.begin().await?;
    let streams = store::take_streams(&mut tx, schema, perspective, CHUNK_STREAMS).await?;
    if streams.is_empty() {
        tx.rollback().await?;
        return Ok(None);
    }
    for stream in &streams {
        for stmt in reset.unwrap_or_default() {
            store::run_reset(&mut tx, stmt, *stream)
                .await
                .map_err(|(e, sql)| JobError::Reset {
                    perspective: perspective.to_string(),
                    stream: *stream,
                    message: crate::db::describe_error(&e, Some(&sql)),
                })?;
        }
    }
    let (work_rows, applied) =
        store::requeue_streams(&mut tx, schema, perspective, &streams, how).await?;
    tx.commit().await?;
    Ok(Some(Chunk {
        streams: streams.len(),
        work_rows,
        applied,
    }))
}

/// What `rebuild` did.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RebuildReport {
    /// Streams listed for the rebuild.
    pub streams: i64,
    /// Streams this command reset and queued (running workers take the others).
    pub streams_by_this_command: usize,
    /// Work rows this command queued.
    pub work_rows: i64,
}

/// `perspective-worker rebuild`: start a rebuild job for `perspective` and run its chunks here,
/// alongside any running workers; returns once every stream is queued (the workers apply the
/// history: the command cannot know whether they run the compiled SQL or a custom runner, so it
/// only queues). `progress(done, total)` after each chunk.
pub async fn rebuild(
    conn: &mut PgConnection,
    config: &Config,
    perspective: &str,
    mut progress: impl FnMut(i64, i64),
) -> Result<RebuildReport, JobError> {
    let schema = &config.schema;
    let p = config
        .perspective(perspective)
        .ok_or_else(|| JobError::UnknownPerspective(perspective.to_string()))?;
    if p.compiled_reset().is_none() {
        return Err(JobError::NoReset(perspective.to_string()));
    }
    store::start(conn, schema, perspective, JobKind::Rebuild).await?;
    let mut report = RebuildReport::default();
    loop {
        match store::advance(conn, schema, perspective).await? {
            // Another session listed the streams or is queueing: take chunks too.
            JobState::Queueing | JobState::Busy => {}
            JobState::Waiting => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
            JobState::Applying | JobState::Done | JobState::None => break,
        }
        while let Some(chunk) = run_chunk(conn, schema, p, JobKind::Rebuild, Requeue::Queue).await?
        {
            report.streams_by_this_command += chunk.streams;
            report.work_rows += chunk.work_rows;
            if let Some((Some(total), left)) =
                store::streams_done(conn, schema, perspective).await?
            {
                progress(total - left, total);
            }
        }
        // Chunks other sessions hold are still in flight: wait for them to commit.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    report.streams = store::streams_done(conn, schema, perspective)
        .await?
        .and_then(|(total, _)| total)
        .unwrap_or(report.streams_by_this_command as i64);
    progress(report.streams, report.streams);
    Ok(report)
}
