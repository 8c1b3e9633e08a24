//! `perspective-worker rebuild --perspective NAME`.

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use perspective_worker::engine::catchup::plan::{self, JobError};

use super::context::{Context, InvalidInput};
use super::out::outln;

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
    // A bar on a terminal; nothing on a pipe or in a log (the summary line says it all).
    let bar = ProgressBar::with_draw_target(
        None,
        if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template(
            "rebuild {msg} [{bar:30}] {pos}/{len} streams queued ({per_sec}, about {eta} left)",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(perspective.clone());
    let report = plan::rebuild(&mut conn, &ctx.config, perspective, |done, total| {
        bar.set_length(total.max(0) as u64);
        bar.set_position(done.max(0) as u64);
    })
    .await
    .map_err(|e| -> anyhow::Error {
        match e {
            JobError::UnknownPerspective(_) | JobError::NoReset(_) => {
                InvalidInput::error(e.to_string())
            }
            other => other.into(),
        }
    });
    bar.finish_and_clear();
    let report = report?;
    outln!(
        "rebuild of {perspective}: {} stream(s) reset and queued ({} by this command, the rest by running workers), \
         {} event(s) queued by this command in {:.2}s; running workers apply them \
         (`perspective-worker status` shows the progress)",
        report.streams,
        report.streams_by_this_command,
        report.work_rows,
        started.elapsed().as_secs_f64()
    )?;
    Ok(())
}
