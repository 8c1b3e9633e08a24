//! `perspective-worker demo`: migrate, append the sample events, run the engine until nothing is
//! pending, then print the read-model tables and the status.

use std::path::PathBuf;

use perspective_worker::admin::append;
use perspective_worker::engine::{HookEvent, Hooks};
use perspective_worker::store::demo::read_model_tables;
use perspective_worker::store::status::read_status;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::append::read_file;
use super::context::{connect, Context};
use super::migrate::migrate_before_start;
use super::out::{out, outln};
use super::run::{instance_id, Database, RunningEngine, RuntimeArgs};
use super::status;
use super::table::{Column, Style, Table};

/// Heartbeat age after which the demo's status stops counting an instance as live.
const STALE_AFTER_SECONDS: f64 = 30.0;

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// JSON-lines events to append (default: none beyond what the database already has).
    #[arg(long, value_name = "FILE")]
    events: Option<PathBuf>,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

pub async fn execute(ctx: &Context, args: &DemoArgs) -> anyhow::Result<()> {
    let instance_id = instance_id()?;
    let database = Database::open(ctx, &args.runtime).await?;
    let result = demo(ctx, database.url(), args, instance_id).await;
    database.close().await;
    result
}

async fn demo(ctx: &Context, url: &str, args: &DemoArgs, instance_id: Uuid) -> anyhow::Result<()> {
    migrate_before_start(ctx, url).await?;
    if let Some(path) = &args.events {
        let events = read_file(path)?;
        let mut conn = connect(url, "demo").await?;
        let r = append::append(&mut conn, &ctx.config.schema, &events, |_| {}).await?;
        outln!(
            "appended {} sample event(s) to {} stream(s)",
            r.events,
            r.streams
        )?;
    }
    let hooks = Hooks::new();
    let events = hooks.subscribe();
    let engine = RunningEngine::start(ctx, url, &args.runtime, instance_id, hooks).await?;
    tokio::spawn(stop_when_applied(
        url.to_string(),
        ctx.config.schema.clone(),
        ctx.perspective_names(),
        events,
        engine.shutdown(),
    ));
    engine.wait().await?;
    print_tables(ctx, url).await
}

/// Stop the engine once nothing is pending and it has gone idle.
async fn stop_when_applied(
    url: String,
    schema: String,
    names: Vec<String>,
    mut events: broadcast::Receiver<HookEvent>,
    shutdown: CancellationToken,
) {
    let Ok(mut conn) = connect(&url, "demo").await else {
        return;
    };
    loop {
        match events.recv().await {
            Ok(HookEvent::WorkProcessingIdle)
            | Ok(HookEvent::CompletionsFlushed { .. })
            | Ok(HookEvent::ClaimPolled { streams: 0, .. }) => {
                if let Ok(st) = read_status(&mut conn, &schema, &names, STALE_AFTER_SECONDS).await {
                    if st.perspectives.iter().all(|p| p.pending_events == 0) {
                        shutdown.cancel();
                        return;
                    }
                }
            }
            Err(broadcast::error::RecvError::Closed) => return,
            _ => {}
        }
    }
}

/// Every table named like a perspective, then the status.
async fn print_tables(ctx: &Context, url: &str) -> anyhow::Result<()> {
    let mut conn = connect(url, "demo").await?;
    let schema = &ctx.config.schema;
    let names = ctx.perspective_names();
    for model in read_model_tables(&mut conn, schema, &names).await? {
        let columns = model.columns.iter().map(|c| Column::left(c)).collect();
        let mut table = Table::new(Style::Grid, columns);
        let count = model.rows.len();
        for row in model.rows {
            table.row(row);
        }
        outln!("\n{schema}.{} ({count} rows)", model.name)?;
        out!("{}", table.render())?;
    }
    let st = read_status(&mut conn, schema, &names, STALE_AFTER_SECONDS).await?;
    outln!()?;
    out!("{}", status::render(&st))?;
    Ok(())
}
