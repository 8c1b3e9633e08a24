//! A perspective written in Rust: `StreamHistoryRunner` keeps, per stream, the list of versions
//! it has applied (`<prefix><perspective>`: `stream_id uuid PRIMARY KEY, versions bigint[]`),
//! and refuses events whose `event_data` is not a JSON object — a poison event, which the
//! engine then retries with backoff and dead-letters like a failing SQL handler.
//!
//! It shows the whole contract of [`PerspectiveRunner`]: in one transaction, lock the cursor,
//! skip what it already covers, apply, advance the cursor, commit; report what was applied and
//! which work rows are done. Run it against a migrated config whose `setup` creates the tables,
//! such as `examples/stream_history.yaml` (migrate it and append events as its comment shows):
//!
//! ```sh
//! DATABASE_URL=postgres://… cargo run -p perspective-worker --example stream_history_runner -- \
//!     examples/stream_history.yaml history_
//! ```

use std::sync::Arc;

use futures::future::BoxFuture;
use perspective_worker::config::Config;
use perspective_worker::engine::{
    ApplyMode, ApplyOutcome, Engine, EngineOptions, Group, PerspectiveRunner, RunnerError,
};
use perspective_worker::store::cursor;
use sqlx::postgres::PgConnection;
use sqlx::Connection;

/// Records the versions of every stream's events, per perspective.
pub struct StreamHistoryRunner {
    schema: String,
    table_prefix: String,
}

impl StreamHistoryRunner {
    /// A runner for the perspectives of `schema`, writing to `<table_prefix><perspective>`.
    pub fn new(schema: &str, table_prefix: &str) -> Self {
        StreamHistoryRunner {
            schema: schema.to_string(),
            table_prefix: table_prefix.to_string(),
        }
    }
}

impl PerspectiveRunner for StreamHistoryRunner {
    fn apply<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        group: &'a Group,
        mode: ApplyMode,
    ) -> BoxFuture<'a, Result<ApplyOutcome, RunnerError>> {
        Box::pin(async move {
            let (schema, stream) = (self.schema.as_str(), group.stream_id);
            let mut tx = conn.begin().await?;
            // The cursor lock serialises every apply of this (stream, perspective).
            let last = if mode.force {
                0
            } else {
                cursor::lock(&mut tx, schema, stream, &group.perspective).await?
            };
            let todo: Vec<_> = group
                .items
                .iter()
                .filter(|i| mode.force || i.stream_version > last)
                .collect();
            if let Some(bad) = todo.iter().find(|i| !i.event_data.is_object()) {
                // Rolled back on drop: nothing of the group is applied.
                return Err(RunnerError::Rejected(format!(
                    "event {} (version {}): event_data must be a JSON object, got {}",
                    bad.event_id, bad.stream_version, bad.event_data
                )));
            }
            let insert = format!(
                "INSERT INTO {schema}.\"{}{}\" AS s (stream_id, versions) VALUES ($1, ARRAY[$2::bigint])
                 ON CONFLICT (stream_id) DO UPDATE SET versions = s.versions || $2::bigint",
                self.table_prefix, group.perspective
            );
            for item in &todo {
                sqlx::query(&insert)
                    .bind(stream)
                    .bind(item.stream_version)
                    .execute(&mut *tx)
                    .await?;
            }
            let newest = todo.last();
            if let (Some(item), false) = (newest, mode.force) {
                cursor::advance(
                    &mut tx,
                    schema,
                    stream,
                    &group.perspective,
                    item.stream_version,
                    item.event_id,
                )
                .await?;
            }
            tx.commit().await?;
            let last_version = newest.map_or(last, |i| i.stream_version.max(last));
            Ok(ApplyOutcome {
                applied: todo.len() as u32,
                last_version: Some(last_version),
                // Everything at or below the cursor is done, applied now or earlier.
                done_work_ids: group
                    .items
                    .iter()
                    .filter(|i| i.stream_version <= last_version)
                    .map(|i| i.event_work_id)
                    .collect(),
                ..ApplyOutcome::default()
            })
        })
    }
}

#[allow(dead_code)] // the tests include this file for the runner alone
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(config), Some(prefix)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: stream_history_runner CONFIG TABLE_PREFIX (and DATABASE_URL)");
    };
    let config = Config::load(std::path::Path::new(&config))?;
    let url = std::env::var("DATABASE_URL")?;
    let mut options = EngineOptions::new(config.clone(), url);
    options.runner = Some(Arc::new(StreamHistoryRunner::new(&config.schema, &prefix)));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let engine = Engine::start(options, shutdown.clone()).await?;
    tokio::signal::ctrl_c().await?;
    shutdown.cancel();
    engine.run_until_stopped().await?;
    Ok(())
}
