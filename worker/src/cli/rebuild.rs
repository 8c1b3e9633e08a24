//! `perspective-worker rebuild --perspective NAME`.

use std::time::Instant;

use perspective_worker::rebuild::{self, RebuildError};

use super::context::{Context, InvalidInput};

#[derive(clap::Args, Debug)]
pub struct RebuildArgs {
    /// The perspective to rebuild.
    #[arg(long, value_name = "NAME")]
    perspective: String,
}

pub async fn execute(ctx: &Context, args: &RebuildArgs) -> anyhow::Result<()> {
    let perspective = &args.perspective;
    let mut conn = ctx.connect("rebuild").await?;
    let started = Instant::now();
    let report = rebuild::rebuild(&mut conn, &ctx.config, perspective, |done, total| {
        if done % 1000 == 0 || done == total {
            eprintln!("rebuild {perspective}: {done}/{total} streams");
        }
    })
    .await
    .map_err(|e| -> anyhow::Error {
        match e {
            RebuildError::UnknownPerspective(_) | RebuildError::NoReset(_) => {
                InvalidInput::error(e.to_string())
            }
            other => other.into(),
        }
    })?;
    println!(
        "rebuild of {perspective}: {} stream(s) reset, {} event(s) queued in {:.2}s; running workers apply them",
        report.streams,
        report.work_rows,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
