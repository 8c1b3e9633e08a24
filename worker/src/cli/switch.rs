//! `perspective-worker switch [--perspective NAME] [--wait-seconds N]`: the blue/green switch,
//! run as the schema's owner, for deployments whose workers run as a role that may not switch.

use std::time::{Duration, Instant};

use perspective_worker::engine::catchup::plan::JobError;
use perspective_worker::engine::catchup::switch::{
    switch_caught_up, SwitchAttempt, SWITCH_MAX_LAG,
};

use super::context::{Context, InvalidInput};
use super::out::outln;

/// How often `--wait-seconds` looks again.
const RETRY: Duration = Duration::from_millis(500);

#[derive(clap::Args, Debug)]
pub struct SwitchArgs {
    /// Only this perspective (default: every perspective with a version being built).
    #[arg(long, value_name = "NAME")]
    perspective: Option<String>,
    /// Keep trying for this long while a version is not caught up yet (its catch-up still
    /// running, or its oldest unapplied event more than a second old); 0 tries once.
    #[arg(long, value_name = "N", default_value_t = 0)]
    wait_seconds: u64,
}

pub async fn execute(ctx: &Context, args: &SwitchArgs) -> anyhow::Result<()> {
    if let Some(p) = &args.perspective {
        if !ctx.perspective_names().contains(p) {
            return Err(InvalidInput::error(format!(
                "--perspective {p}: no perspective of that name in the config"
            )));
        }
    }
    let schema = &ctx.config.schema;
    let mut conn = ctx.connect("switch").await?;
    let deadline = Instant::now() + Duration::from_secs(args.wait_seconds);
    let mut first = true;
    let mut waiting = loop {
        let attempts = switch_caught_up(&mut conn, schema, args.perspective.as_deref())
            .await
            .map_err(|e| -> anyhow::Error {
                match e {
                    JobError::SwitchNeedsOwner { .. } => InvalidInput::error(e.to_string()),
                    other => other.into(),
                }
            })?;
        if attempts.is_empty() && first {
            outln!(
                "nothing to switch: no version of {} is being built",
                args.perspective.as_deref().unwrap_or("any perspective")
            )?;
        }
        first = false;
        let mut waiting = Vec::new();
        for attempt in attempts {
            match attempt {
                SwitchAttempt::Switched(s) => outln!(
                    "switched {} from version {} to version {}: its tables replaced the live ones \
                     ({}), which were archived{}",
                    s.perspective,
                    s.from,
                    s.to,
                    s.moved_in.join(", "),
                    if s.dropped.is_empty() {
                        String::new()
                    } else {
                        format!("; dropped kept version(s) {:?}", s.dropped)
                    }
                )?,
                other => waiting.push(other),
            }
        }
        if waiting.is_empty() || Instant::now() >= deadline {
            break waiting;
        }
        tokio::time::sleep(RETRY).await;
    };
    if waiting.is_empty() {
        return Ok(());
    }
    waiting.sort_by_key(|a| match a {
        SwitchAttempt::NotCaughtUp { perspective, .. }
        | SwitchAttempt::Busy { perspective, .. } => perspective.clone(),
        SwitchAttempt::Switched(s) => s.perspective.clone(),
    });
    let reasons: Vec<String> = waiting.iter().map(not_switched).collect();
    anyhow::bail!(
        "not switched after {} s: {}",
        args.wait_seconds,
        reasons.join("; ")
    )
}

/// Why a version was not switched, for the error line.
fn not_switched(attempt: &SwitchAttempt) -> String {
    match attempt {
        SwitchAttempt::NotCaughtUp {
            perspective,
            version,
            readiness,
        } => {
            let mut why = Vec::new();
            match readiness.job_state.as_deref() {
                Some("done") => {}
                Some(state) => why.push(format!("its catch-up is {state}")),
                None => why.push("it has no catch-up job".to_owned()),
            }
            if readiness.dead_letters > 0 {
                why.push(format!(
                    "{} dead letter(s) wait for a replay",
                    readiness.dead_letters
                ));
            }
            if let Some(s) = readiness.oldest_pending_seconds {
                if s >= SWITCH_MAX_LAG.as_secs_f64() {
                    why.push(format!("its oldest unapplied event is {s:.1} s old"));
                }
            }
            format!(
                "{perspective} version {version} has not caught up ({})",
                why.join(", ")
            )
        }
        SwitchAttempt::Busy {
            perspective,
            version,
        } => format!(
            "{perspective} version {version} is caught up, but migrate or a worker held the \
             schema's migration lock; try again"
        ),
        SwitchAttempt::Switched(s) => format!("{} switched", s.perspective),
    }
}
