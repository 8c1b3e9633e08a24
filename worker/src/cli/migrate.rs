//! `perspective-worker migrate`, and the migration `run --migrate` and `demo` do first.

use std::time::Instant;

use perspective_worker::admin::migrate::{self, MigrateError, MigrateOptions, MigrateReport};

use super::context::{connect, Context, InvalidInput};
use super::out::outln;

#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// Do everything, report it, then roll back: validates the config against the database.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn execute(ctx: &Context, args: &MigrateArgs) -> anyhow::Result<()> {
    let mut conn = ctx.connect("migrate").await?;
    let started = Instant::now();
    let options = MigrateOptions {
        dry_run: args.dry_run,
    };
    let report = migrate::migrate(&mut conn, &ctx.config, &ctx.config_source, options)
        .await
        .map_err(migrate_error)?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        print_report(&report, started.elapsed().as_secs_f64())?;
    }
    Ok(())
}

/// Migrate the database at `url` before the engine starts (`run --migrate`, `demo`).
pub async fn migrate_before_start(ctx: &Context, url: &str) -> anyhow::Result<()> {
    let mut conn = connect(url, "migrate").await?;
    let report = migrate::migrate(
        &mut conn,
        &ctx.config,
        &ctx.config_source,
        MigrateOptions::default(),
    )
    .await
    .map_err(migrate_error)?;
    print_report(&report, 0.0)
}

fn print_report(r: &MigrateReport, seconds: f64) -> anyhow::Result<()> {
    let verb = if r.dry_run {
        "dry run, rolled back:"
    } else {
        "migrated"
    };
    outln!(
        "{verb} schema {}: {} migration(s) applied, {} already applied; {} statement(s) prepared; {:.2}s",
        r.schema,
        r.applied.len(),
        r.already_applied,
        r.statements_prepared,
        seconds
    )?;
    for m in &r.applied {
        outln!("  applied {m}")?;
    }
    if r.functions_installed {
        outln!("  installed the engine functions")?;
    }
    for (p, e) in &r.subscriptions_added {
        outln!("  subscribed {p} to {e}")?;
    }
    for (p, e) in &r.subscriptions_removed {
        outln!("  unsubscribed {p} from {e}")?;
    }
    for p in &r.setups_run {
        outln!("  ran setup of {p}")?;
    }
    for removed in &r.perspectives_removed {
        outln!(
            "  removed perspective {} (no longer in the config): {} pending work row(s) and {} cursor(s) deleted; its tables are yours and were kept",
            removed.perspective, removed.work_rows, removed.cursors
        )?;
    }
    for p in &r.backfills {
        outln!(
            "  backfilling {p} from the event store: running workers apply its history, oldest first per stream \
             (`perspective-worker status` shows the progress)"
        )?;
    }
    for c in &r.rebuilds {
        outln!(
            "  rebuilding {} (version {} -> {}): running workers reset and replay it stream by stream \
             (`perspective-worker status` shows the progress)",
            c.perspective, c.from, c.to
        )?;
    }
    for b in &r.version_builds {
        if b.rollback {
            outln!(
                "  rolling back {} to its kept version {} (version {} stays live until then): running workers \
                 catch it up from where it stopped, then switch its tables in",
                b.perspective, b.next, b.live
            )?;
        } else {
            outln!(
                "  building {} version {} beside the live version {} (blue/green): running workers backfill it, \
                 then switch its tables in (`perspective-worker status` shows the progress)",
                b.perspective, b.next, b.live
            )?;
        }
    }
    for w in &r.warnings {
        outln!("  warning: {w}")?;
    }
    if r.streams_unpinned > 0 {
        outln!(
            "  unpinned {} stream(s) with nothing left to apply",
            r.streams_unpinned
        )?;
    }
    Ok(())
}

/// Config problems found by `migrate` are the caller's (exit 2); the rest are failures (exit 1).
fn migrate_error(e: MigrateError) -> anyhow::Error {
    if e.is_invalid_input() {
        InvalidInput::error(e.to_string())
    } else {
        e.into()
    }
}
