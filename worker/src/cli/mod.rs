//! The `perspective-worker` command line: its arguments, and one module per subcommand that
//! turns them into library calls and prints the result. Nothing here talks SQL.

mod append;
mod context;
mod dead_letters;
mod demo;
mod grants;
mod migrate;
mod out;
mod rebuild;
mod run;
mod status;
mod switch;
mod table;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use context::Context;
pub use context::InvalidInput;
pub use out::StdoutClosed;

const ABOUT: &str = "Materializes perspectives (read models) from a PostgreSQL event store.

Applications append events with plain SQL (INSERT INTO <schema>.wh_event_store ...); each
perspective declared in the config gets one work row per subscribed event in the same
transaction. This binary creates the schema and compiles the perspectives (migrate), runs the
engine that applies the work exactly once and in order (run), and inspects it (status,
dead-letters).";

const AFTER: &str = "Environment:
  DATABASE_URL        PostgreSQL URL, e.g. postgres://app@127.0.0.1:5432/app
  PERSPECTIVE_CONFIG  config file, instead of --config
  RUST_LOG            log filter (default: info); logs are JSON when stderr is not a terminal

Examples:
  perspective-worker --config examples/shop.yaml migrate --dry-run
  perspective-worker --config examples/shop.yaml migrate
  echo '{\"stream_id\":\"0190f5c2-6c1a-7000-8000-000000000001\",\"event_type\":\"OrderPlaced\",\"event_data\":{\"total\":42}}' \\
    | perspective-worker --config examples/shop.yaml append
  perspective-worker --config examples/shop.yaml status --json";

#[derive(Parser, Debug)]
#[command(name = "perspective-worker", version, about = ABOUT, after_help = AFTER)]
pub struct Cli {
    /// Perspective config (YAML; the same document as a PerspectiveDeployment's spec).
    #[arg(
        long,
        short = 'c',
        env = "PERSPECTIVE_CONFIG",
        global = true,
        value_name = "FILE"
    )]
    config: Option<PathBuf>,

    /// PostgreSQL connection URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        hide_env_values = true,
        value_name = "URL"
    )]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create or upgrade the schema, register subscriptions, run each perspective's `setup`,
    /// prepare every handler and compile it into the perspective's apply function; start a
    /// backfill for a perspective new to a schema with history and a rebuild for one whose
    /// `version` changed (running workers do them; with `rebuild: blueGreen` the new version is
    /// built in a schema of its own beside the serving one, or a kept version caught up for a
    /// rollback, and the workers switch once it has caught up), and warn about changes that
    /// need a rebuild. Idempotent; concurrent runs serialise on an advisory lock.
    Migrate(migrate::MigrateArgs),
    /// Append events read as JSON lines: {"stream_id": uuid, "event_type": text,
    /// "event_data"?: json, "metadata"?: object, "scope"?: object, "event_id"?: uuid,
    /// "stream_version"?: expected version}. All lines are checked first and written in one
    /// transaction: a bad line appends nothing.
    Append(append::AppendArgs),
    /// Run the engine: claim work, apply it to the perspectives, complete it. Serves /livez,
    /// /readyz and /metrics on --http-addr. Stops gracefully on SIGTERM or Ctrl-C. Without
    /// DATABASE_URL it starts an embedded PostgreSQL in --data-dir.
    Run(run::RunArgs),
    /// Zero-setup demo: embedded PostgreSQL (unless DATABASE_URL is set), migrate the config,
    /// append sample events, run the engine until everything is applied, print the perspective
    /// tables and the status.
    Demo(demo::DemoArgs),
    /// Rebuild a perspective online from the event store, as raising its `version` does: a chunk
    /// of streams per transaction, run its `reset`, drop its cursor and queue all its events
    /// again; running workers help with the chunks and re-apply the events. A progress bar on a
    /// terminal; returns once every stream is queued. Needs `reset`.
    Rebuild(rebuild::RebuildArgs),
    /// Inspect and replay dead-lettered events.
    #[command(subcommand)]
    DeadLetters(dead_letters::DeadLettersCommand),
    /// Show per perspective its phase (Live, Backfilling, Rebuilding) with the progress of a
    /// catch-up, pending work, oldest pending age, failed streams, dead letters and lock
    /// conflicts between appliers over the last minute (from the live workers' heartbeats;
    /// from 10 a minute a hint names the perspective's `sequencing`).
    Status(status::StatusArgs),
    /// Grant a database role the rights of a producer, a worker or a reader of this
    /// deployment's schema, and nothing more (run it as the schema's owner, after `migrate`).
    /// --print shows the statements instead of running them.
    Grants(grants::GrantsArgs),
    /// Switch each blue/green perspective whose new version has caught up (`status` shows it
    /// `Switching`), as a worker running as the schema's owner would: run it as the owner when
    /// the workers run as a role that may not switch. Fails, naming what is missing, if a version
    /// has not caught up within --wait-seconds.
    Switch(switch::SwitchArgs),
}

/// Load the config and run the command.
pub async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let ctx = Context::load(cli.config.as_deref(), cli.database_url)?;
    match &cli.command {
        Command::Migrate(args) => migrate::execute(&ctx, args).await,
        Command::Append(args) => append::execute(&ctx, args).await,
        Command::Run(args) => run::execute(&ctx, args).await,
        Command::Demo(args) => demo::execute(&ctx, args).await,
        Command::Rebuild(args) => rebuild::execute(&ctx, args).await,
        Command::DeadLetters(command) => dead_letters::execute(&ctx, command).await,
        Command::Status(args) => status::execute(&ctx, args).await,
        Command::Grants(args) => grants::execute(&ctx, args).await,
        Command::Switch(args) => switch::execute(&ctx, args).await,
    }
}

/// `error` and its causes in one line, `a: b: c`, leaving out a cause whose text the message
/// before it already ends with (many errors print their source in their own message, and
/// `{:#}` would then say it twice: "X: X").
pub fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.ends_with(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_does_not_repeat_its_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let sqlx = sqlx::Error::Io(io);
        let error = anyhow::Error::new(sqlx).context("connecting to PostgreSQL");
        assert_eq!(
            error_text(&error),
            "connecting to PostgreSQL: error communicating with database: refused"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_text(&plain), "outer: inner");
    }
}
