//! The `perspective-worker` command line. Exit codes: 0 success, 2 invalid input (config,
//! arguments, event JSON), 1 any other failure.

use std::io::{BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};
use perspective_worker::config::Config;
use perspective_worker::{append, db, migrate, status};

const ABOUT: &str = "Materializes perspectives (read models) from a PostgreSQL event store.

Applications append events with plain SQL (INSERT INTO <schema>.wh_event_store ...); each
perspective declared in the config gets one work row per subscribed event in the same
transaction. This binary creates the schema, registers the perspectives and appends events.";

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
struct Cli {
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
    /// Create or upgrade the schema, register subscriptions, run each perspective's `setup`
    /// and prepare every handler. Idempotent; concurrent runs serialise on an advisory lock.
    Migrate {
        /// Do everything, report it, then roll back: validates the config against the database.
        #[arg(long)]
        dry_run: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Append events read as JSON lines: {"stream_id": uuid, "event_type": text,
    /// "event_data"?: json, "metadata"?: object, "scope"?: object, "event_id"?: uuid,
    /// "stream_version"?: expected version}. All lines are checked first and written in one
    /// transaction: a bad line appends nothing.
    Append {
        /// Read from this file instead of standard input.
        #[arg(long, short = 'f', value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Show per-perspective pending work, oldest pending age, failed streams and dead letters.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Errors that are the caller's fault map to exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct InvalidInput(String);

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<InvalidInput>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::io::stderr().is_terminal() {
        builder.init();
    } else {
        builder.json().init();
    }
}

fn load_config(path: Option<&Path>) -> anyhow::Result<(Config, String)> {
    let path = path.ok_or_else(|| {
        InvalidInput("no config: pass --config FILE or set PERSPECTIVE_CONFIG".into())
    })?;
    let source = path.display().to_string();
    let config = Config::load(path).map_err(|e| InvalidInput(e.to_string()))?;
    Ok((config, source))
}

fn database_url(cli: &Cli) -> anyhow::Result<&str> {
    cli.database_url.as_deref().ok_or_else(|| {
        InvalidInput("no database: set DATABASE_URL or pass --database-url".into()).into()
    })
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let (config, source) = load_config(cli.config.as_deref())?;
    let url = database_url(&cli)?;
    match &cli.command {
        Command::Migrate { dry_run, json } => {
            let mut conn = db::connect(url, "perspective-worker migrate")
                .await
                .context("connecting to PostgreSQL")?;
            let started = Instant::now();
            let report = migrate::migrate(
                &mut conn,
                &config,
                &source,
                migrate::MigrateOptions { dry_run: *dry_run },
            )
            .await
            .map_err(|e| -> anyhow::Error {
                if e.is_invalid_input() {
                    InvalidInput(e.to_string()).into()
                } else {
                    e.into()
                }
            })?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_migrate_report(&report, started.elapsed().as_secs_f64());
            }
        }
        Command::Append { file } => {
            let (events, name) = match file {
                Some(path) => {
                    let f = std::fs::File::open(path).map_err(|e| {
                        InvalidInput(format!("cannot open {}: {e}", path.display()))
                    })?;
                    (
                        append::parse_lines(BufReader::new(f), &path.display().to_string()),
                        path.display().to_string(),
                    )
                }
                None => (
                    append::parse_lines(std::io::stdin().lock(), "stdin"),
                    "stdin".to_string(),
                ),
            };
            let events = events.map_err(|e| InvalidInput(e.to_string()))?;
            let mut conn = db::connect(url, "perspective-worker append")
                .await
                .context("connecting to PostgreSQL")?;
            let started = Instant::now();
            let total = events.len();
            let report = append::append(&mut conn, &config.schema, &events, |done| {
                if total > 10_000 {
                    eprintln!("appended {done}/{total} events");
                }
            })
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "appending events from {name} to schema {}: {}",
                    config.schema,
                    db::describe_error(&e, None)
                )
            })?;
            println!(
                "appended {} event(s) to {} stream(s) in schema {} in {:.2}s",
                report.events,
                report.streams,
                config.schema,
                started.elapsed().as_secs_f64()
            );
        }
        Command::Status { json } => {
            let mut conn = db::connect(url, "perspective-worker status")
                .await
                .context("connecting to PostgreSQL")?;
            let names: Vec<String> = config.perspectives.iter().map(|p| p.name.clone()).collect();
            let stale = config.worker.abandon_stale_instance_threshold_seconds as f64;
            let st = status::read_status(&mut conn, &config.schema, &names, stale)
                .await
                .map_err(|e| {
                    anyhow::anyhow!(
                        "reading status of schema {}: {}",
                        config.schema,
                        db::describe_error(&e, None)
                    )
                })?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&st)?);
            } else {
                print!("{}", st.to_table());
            }
        }
    }
    Ok(())
}

fn print_migrate_report(r: &migrate::MigrateReport, seconds: f64) {
    let verb = if r.dry_run {
        "dry run, rolled back:"
    } else {
        "migrated"
    };
    println!(
        "{verb} schema {}: {} migration(s) applied, {} already applied; {} statement(s) prepared; {:.2}s",
        r.schema,
        r.applied.len(),
        r.already_applied,
        r.statements_prepared,
        seconds
    );
    for m in &r.applied {
        println!("  applied {m}");
    }
    for (p, e) in &r.subscriptions_added {
        println!("  subscribed {p} to {e}");
    }
    for (p, e) in &r.subscriptions_removed {
        println!("  unsubscribed {p} from {e}");
    }
    for p in &r.setups_run {
        println!("  ran setup of {p}");
    }
}
