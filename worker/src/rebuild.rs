//! `perspective-worker rebuild --perspective NAME`: rebuild a perspective from the event store.
//!
//! Stream by stream, in one transaction each: lock the stream's cursor, run the perspective's
//! `reset` for that stream, drop its cursor and its pending work, and create one work row per
//! stored event of a subscribed type (ringing the doorbell). Running workers then re-apply the
//! stream from version 1. An apply racing the rebuild waits on the cursor lock (created first
//! when missing, so there always is one to hold); if it was handed rows the rebuild replaced,
//! their first row is gone and it applies nothing (see apply_body.sql), so nothing is applied
//! out of order, twice, or lost (tests/rebuild.rs).

use sqlx::postgres::PgConnection;
use sqlx::Connection;
use uuid::Uuid;

use crate::config::Config;
use crate::store::rebuild as store;

#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    #[error("perspective {0} is not in the config")]
    UnknownPerspective(String),
    #[error("perspective {0} has no `reset`, so its model cannot be cleared stream by stream; add one to rebuild it")]
    NoReset(String),
    #[error("stream {stream}: {message}")]
    Stream { stream: Uuid, message: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// What a rebuild did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RebuildReport {
    pub streams: usize,
    pub work_rows: u64,
}

/// Rebuild `perspective`; `progress(done, total)` after each stream.
pub async fn rebuild(
    conn: &mut PgConnection,
    config: &Config,
    perspective: &str,
    mut progress: impl FnMut(usize, usize),
) -> Result<RebuildReport, RebuildError> {
    let schema = &config.schema;
    let p = config
        .perspective(perspective)
        .ok_or_else(|| RebuildError::UnknownPerspective(perspective.to_string()))?;
    let reset = p
        .compiled_reset()
        .ok_or_else(|| RebuildError::NoReset(perspective.to_string()))?;
    store::set_search_path(conn, schema).await?;
    let streams = store::streams_of(conn, schema, perspective).await?;

    let mut report = RebuildReport {
        streams: streams.len(),
        work_rows: 0,
    };
    for (i, stream) in streams.iter().enumerate() {
        let mut attempt = 1;
        report.work_rows += loop {
            match rebuild_stream(conn, schema, &reset, *stream, perspective).await {
                Err(RebuildError::Database(e))
                    if is_deadlock(&e) && attempt < DEADLOCK_ATTEMPTS =>
                {
                    attempt += 1;
                }
                other => break other?,
            }
        };
        progress(i + 1, streams.len());
    }
    Ok(report)
}

/// How often one stream's transaction is tried when PostgreSQL picks it as a deadlock victim.
/// Its deletes of the pair's work rows can cross a worker's completion deleting some of the same
/// rows in another order; the worker's side committed, so a retry goes through.
const DEADLOCK_ATTEMPTS: u32 = 5;

fn is_deadlock(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "40P01")
}

/// One stream, in one transaction: returns the work rows queued.
async fn rebuild_stream(
    conn: &mut PgConnection,
    schema: &str,
    reset: &[crate::sql_params::ParsedStatement],
    stream: Uuid,
    perspective: &str,
) -> Result<u64, RebuildError> {
    let mut tx = conn.begin().await?;
    store::lock_stream(&mut tx, schema, stream).await?;
    store::lock_cursor(&mut tx, schema, stream, perspective).await?;
    for stmt in reset {
        store::run_reset(&mut tx, stmt, stream)
            .await
            .map_err(|(e, sql)| RebuildError::Stream {
                stream,
                message: crate::db::describe_error(&e, Some(&sql)),
            })?;
    }
    let queued = store::requeue_stream(&mut tx, schema, stream, perspective).await? as u64;
    tx.commit().await?;
    Ok(queued)
}
