//! `perspective-worker append`: JSON-lines events from a file or standard input.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Instant;

use perspective_worker::admin::append::{self, NewEvent};
use perspective_worker::db;

use super::context::{Context, InvalidInput};
use super::out::outln;

#[derive(clap::Args, Debug)]
pub struct AppendArgs {
    /// Read from this file instead of standard input.
    #[arg(long, short = 'f', value_name = "FILE")]
    file: Option<PathBuf>,
}

pub async fn execute(ctx: &Context, args: &AppendArgs) -> anyhow::Result<()> {
    // Without a database there is no point reading (possibly a lot of) input.
    ctx.database_url()?;
    let (events, name) = match &args.file {
        Some(path) => (read_file(path)?, path.display().to_string()),
        None => (
            append::parse_lines(std::io::stdin().lock(), "stdin")
                .map_err(|e| InvalidInput::error(e.to_string()))?,
            "stdin".to_string(),
        ),
    };
    let mut conn = ctx.connect("append").await?;
    let schema = &ctx.config.schema;
    let started = Instant::now();
    let total = events.len();
    let report = append::append(&mut conn, schema, &events, |done| {
        if total > 10_000 {
            eprintln!("appended {done}/{total} events");
        }
    })
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "appending events from {name} to schema {schema}: {}",
            db::describe_error(&e, None)
        )
    })?;
    outln!(
        "appended {} event(s) to {} stream(s) in schema {schema} in {:.2}s",
        report.events,
        report.streams,
        started.elapsed().as_secs_f64()
    )?;
    Ok(())
}

/// Every event of a JSON-lines file; an unreadable file or a bad line is invalid input.
pub fn read_file(path: &Path) -> anyhow::Result<Vec<NewEvent>> {
    let name = path.display().to_string();
    let f = std::fs::File::open(path)
        .map_err(|e| InvalidInput::error(format!("cannot open {name}: {e}")))?;
    append::parse_lines(BufReader::new(f), &name).map_err(|e| InvalidInput::error(e.to_string()))
}
