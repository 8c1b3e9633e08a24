//! The `perspective-worker` command line. Exit codes: 0 success, 2 invalid input (config,
//! arguments, event JSON), 1 any other failure.

use std::io::{BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};
use perspective_worker::config::Config;
use perspective_worker::store::status;
use perspective_worker::{append, db, dead_letters, migrate, store};
use std::net::SocketAddr;

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
    /// Create or upgrade the schema, register subscriptions, run each perspective's `setup`,
    /// prepare every handler and compile it into the perspective's apply function. Idempotent;
    /// concurrent runs serialise on an advisory lock.
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
    /// Run the engine: claim work, apply it to the perspectives, complete it. Serves /livez,
    /// /readyz and /metrics on --http-addr. Stops gracefully on SIGTERM or Ctrl-C. Without
    /// DATABASE_URL it starts an embedded PostgreSQL in --data-dir.
    Run {
        /// Run `migrate` first (handy locally; in Kubernetes the migration Job does it).
        #[arg(long)]
        migrate: bool,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Zero-setup demo: embedded PostgreSQL (unless DATABASE_URL is set), migrate the config,
    /// append sample events, run the engine until everything is applied, print the perspective
    /// tables and the status.
    Demo {
        /// JSON-lines events to append (default: none beyond what the database already has).
        #[arg(long, value_name = "FILE")]
        events: Option<PathBuf>,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Rebuild a perspective from the event store: for every stream, run its `reset`, drop its
    /// cursor and queue all its events again (running workers re-apply them). Needs `reset`.
    Rebuild {
        /// The perspective to rebuild.
        #[arg(long, value_name = "NAME")]
        perspective: String,
    },
    /// Inspect and replay dead-lettered events.
    #[command(subcommand)]
    DeadLetters(DeadLettersCommand),
    /// Show per-perspective pending work, oldest pending age, failed streams and dead letters.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args, Debug, Clone)]
struct RuntimeArgs {
    /// Address of the HTTP endpoints (/livez, /readyz, /metrics); port 0 picks a free port.
    #[arg(long, env = "PERSPECTIVE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Data directory of the embedded PostgreSQL used when DATABASE_URL is not set.
    #[arg(
        long,
        env = "PERSPECTIVE_DATA_DIR",
        default_value = ".perspective/pgdata"
    )]
    data_dir: PathBuf,
    /// Maximum database connections of the engine.
    #[arg(long, env = "PERSPECTIVE_MAX_CONNECTIONS", default_value_t = 10)]
    max_connections: u32,
}

#[derive(Subcommand, Debug)]
enum DeadLettersCommand {
    /// List dead letters (pending ones unless --all).
    List {
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Re-apply pending dead letters through their perspective (after fixing the handler and
    /// running `migrate`): the given ids, or every pending one with --all. Each replay commits
    /// with its dead letter marked `replayed`, or not at all.
    Replay {
        /// Dead letter ids (see `dead-letters list`).
        ids: Vec<i64>,
        #[arg(long, conflicts_with = "ids")]
        all: bool,
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
    match &cli.command {
        Command::Run { migrate, runtime } => {
            return run_engine(&cli, config, &source, *migrate, runtime, None).await;
        }
        Command::Demo { events, runtime } => {
            return run_engine(
                &cli,
                config,
                &source,
                true,
                runtime,
                Some(events.as_deref()),
            )
            .await;
        }
        _ => {}
    }
    let url = database_url(&cli)?;
    match &cli.command {
        Command::Run { .. } | Command::Demo { .. } => unreachable!("handled above"),
        Command::Rebuild { perspective } => {
            let mut conn = db::connect(url, "perspective-worker rebuild")
                .await
                .context("connecting to PostgreSQL")?;
            let started = Instant::now();
            let report = perspective_worker::rebuild::rebuild(
                &mut conn,
                &config,
                perspective,
                |done, total| {
                    if done % 1000 == 0 || done == total {
                        eprintln!("rebuild {perspective}: {done}/{total} streams");
                    }
                },
            )
            .await
            .map_err(|e| -> anyhow::Error {
                match e {
                    perspective_worker::rebuild::RebuildError::UnknownPerspective(_)
                    | perspective_worker::rebuild::RebuildError::NoReset(_) => {
                        InvalidInput(e.to_string()).into()
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
        }
        Command::DeadLetters(cmd) => {
            let mut conn = db::connect(url, "perspective-worker dead-letters")
                .await
                .context("connecting to PostgreSQL")?;
            match cmd {
                DeadLettersCommand::List { all, json } => {
                    let letters = store::dead_letters::list(&mut conn, &config.schema, *all)
                        .await
                        .map_err(|e| {
                            anyhow::anyhow!(
                                "listing dead letters: {}",
                                db::describe_error(&e, None)
                            )
                        })?;
                    if *json {
                        println!("{}", serde_json::to_string_pretty(&letters)?);
                    } else if letters.is_empty() {
                        println!("no dead letters in schema {}", config.schema);
                    } else {
                        println!(
                            "{:>6}  {:<24} {:<36} {:>7}  {:<20} {:>8}  {:<9} ERROR",
                            "ID",
                            "PERSPECTIVE",
                            "STREAM",
                            "VERSION",
                            "EVENT TYPE",
                            "ATTEMPTS",
                            "STATUS"
                        );
                        for d in letters {
                            println!(
                                "{:>6}  {:<24} {:<36} {:>7}  {:<20} {:>8}  {:<9} {}",
                                d.id,
                                d.perspective,
                                d.stream_id,
                                d.stream_version,
                                d.event_type,
                                d.attempts,
                                d.recovery_status,
                                d.error.unwrap_or_default()
                            );
                        }
                    }
                }
                DeadLettersCommand::Replay { ids, all } => {
                    let ids: Vec<i64> = if *all {
                        store::dead_letters::list(&mut conn, &config.schema, false)
                            .await?
                            .iter()
                            .map(|d| d.id)
                            .collect()
                    } else if ids.is_empty() {
                        return Err(InvalidInput(
                            "name dead letter ids to replay, or pass --all".into(),
                        )
                        .into());
                    } else {
                        ids.clone()
                    };
                    let runner = perspective_worker::engine::SqlRunner::new(&config);
                    let mut failed = 0;
                    for id in &ids {
                        match dead_letters::replay(&mut conn, &config.schema, &runner, *id).await {
                            Ok(()) => println!("replayed dead letter {id}"),
                            Err(e) => {
                                failed += 1;
                                eprintln!("error: {e}");
                            }
                        }
                    }
                    println!(
                        "{} of {} dead letter(s) replayed",
                        ids.len() - failed,
                        ids.len()
                    );
                    if failed > 0 {
                        anyhow::bail!("{failed} dead letter(s) could not be replayed");
                    }
                }
            }
        }
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
            .map_err(migrate_error)?;
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

/// `run` and `demo`: resolve the database (embedded when DATABASE_URL is unset), optionally
/// migrate, serve HTTP, run the engine until SIGTERM / Ctrl-C (or, for the demo, until the
/// sample events are applied).
async fn run_engine(
    cli: &Cli,
    config: Config,
    source: &str,
    do_migrate: bool,
    runtime: &RuntimeArgs,
    demo: Option<Option<&Path>>,
) -> anyhow::Result<()> {
    use perspective_worker::engine::{Engine, EngineOptions, HookEvent};
    use tokio_util::sync::CancellationToken;

    let instance_id = match std::env::var("PERSPECTIVE_INSTANCE_ID") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<uuid::Uuid>().map_err(|e| {
            InvalidInput(format!("PERSPECTIVE_INSTANCE_ID {v:?} is not a UUID: {e}"))
        })?,
        _ => uuid::Uuid::now_v7(),
    };
    let mut embedded = None;
    let url = match cli.database_url.clone() {
        Some(url) => url,
        None => {
            tracing::info!(data_dir = %runtime.data_dir.display(), "DATABASE_URL is not set: using an embedded PostgreSQL");
            let pg = perspective_worker::embedded::EmbeddedPostgres::start(&runtime.data_dir)
                .await
                .context("starting the embedded PostgreSQL")?;
            eprintln!(
                "DATABASE_URL is not set: using embedded PostgreSQL {} at {} (data directory {})",
                pg.version(),
                pg.url(),
                pg.data_dir().display()
            );
            let url = pg.url();
            embedded = Some(pg);
            url
        }
    };
    let result = async {
        if do_migrate {
            let mut conn = db::connect(&url, "perspective-worker migrate")
                .await
                .context("connecting to PostgreSQL")?;
            let report = migrate::migrate(
                &mut conn,
                &config,
                source,
                migrate::MigrateOptions::default(),
            )
            .await
            .map_err(migrate_error)?;
            print_migrate_report(&report, 0.0);
        }
        if let Some(Some(events)) = demo {
            let f = std::fs::File::open(events)
                .map_err(|e| InvalidInput(format!("cannot open {}: {e}", events.display())))?;
            let parsed = append::parse_lines(BufReader::new(f), &events.display().to_string())
                .map_err(|e| InvalidInput(e.to_string()))?;
            let mut conn = db::connect(&url, "perspective-worker demo").await?;
            let r = append::append(&mut conn, &config.schema, &parsed, |_| {}).await?;
            println!(
                "appended {} sample event(s) to {} stream(s)",
                r.events, r.streams
            );
        }

        let shutdown = CancellationToken::new();
        let mut options = EngineOptions::new(config.clone(), url.clone());
        options.instance_id = instance_id;
        options.max_connections = runtime.max_connections;
        let metrics = options.metrics.clone();
        let readiness = options.readiness.clone();
        let (addr, http) = perspective_worker::http::serve(
            runtime.http_addr,
            readiness,
            metrics,
            shutdown.clone(),
        )
        .await
        .with_context(|| format!("serving HTTP on {}", runtime.http_addr))?;
        tracing::info!(%addr, "HTTP endpoints: /livez /readyz /metrics");
        let hooks = options.hooks.clone();
        let mut events = hooks.subscribe();
        let engine =
            Engine::start(options, shutdown.clone())
                .await
                .map_err(|e| -> anyhow::Error {
                    match e {
                        perspective_worker::engine::EngineError::SchemaOutdated { .. }
                        | perspective_worker::engine::EngineError::PerspectiveOutdated { .. } => {
                            InvalidInput(e.to_string()).into()
                        }
                        other => other.into(),
                    }
                })?;
        tracing::info!(instance_id = %engine.instance_id(), "engine started");

        let stopper = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("signal received: shutting down");
            stopper.cancel();
        });
        if demo.is_some() {
            // Stop once nothing is pending and the engine has gone idle.
            let names: Vec<String> = config.perspectives.iter().map(|p| p.name.clone()).collect();
            let stopper = shutdown.clone();
            let url2 = url.clone();
            let schema = config.schema.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = db::connect(&url2, "perspective-worker demo").await else {
                    return;
                };
                loop {
                    match events.recv().await {
                        Ok(HookEvent::WorkProcessingIdle)
                        | Ok(HookEvent::CompletionsFlushed { .. })
                        | Ok(HookEvent::ClaimPolled { streams: 0 }) => {
                            if let Ok(st) =
                                status::read_status(&mut conn, &schema, &names, 30.0).await
                            {
                                if st.perspectives.iter().all(|p| p.pending_events == 0) {
                                    stopper.cancel();
                                    return;
                                }
                            }
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                        _ => {}
                    }
                }
            });
        }
        engine.run_until_stopped().await?;
        let _ = http.await;
        if demo.is_some() {
            print_demo_tables(&url, &config).await?;
        }
        anyhow::Ok(())
    }
    .await;
    if let Some(pg) = embedded {
        if let Err(e) = pg.stop().await {
            tracing::warn!(error = %e, "stopping the embedded PostgreSQL");
        }
    }
    result
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install the SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Print every table named like a perspective, then the status.
async fn print_demo_tables(url: &str, config: &Config) -> anyhow::Result<()> {
    let mut conn = db::connect(url, "perspective-worker demo").await?;
    for p in &config.perspectives {
        let Some(table) = store::demo::read_model_table(&mut conn, &config.schema, &p.name).await?
        else {
            continue;
        };
        let (columns, cells) = (table.columns, table.rows);
        let widths: Vec<usize> = (0..columns.len())
            .map(|i| {
                cells
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([columns[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        println!("\n{}.{} ({} rows)", config.schema, p.name, cells.len());
        let line = |vals: &[String]| {
            vals.iter()
                .zip(&widths)
                .map(|(v, w)| format!("{v:<w$}"))
                .collect::<Vec<_>>()
                .join(" | ")
        };
        println!("{}", line(&columns));
        println!(
            "{}",
            widths
                .iter()
                .map(|w| "-".repeat(*w))
                .collect::<Vec<_>>()
                .join("-+-")
        );
        for r in &cells {
            println!("{}", line(r));
        }
    }
    let names: Vec<String> = config.perspectives.iter().map(|p| p.name.clone()).collect();
    let st = status::read_status(&mut conn, &config.schema, &names, 30.0).await?;
    println!();
    print!("{}", st.to_table());
    Ok(())
}

/// Config problems found by `migrate` are the caller's (exit 2); the rest are failures (exit 1).
fn migrate_error(e: migrate::MigrateError) -> anyhow::Error {
    if e.is_invalid_input() {
        InvalidInput(e.to_string()).into()
    } else {
        e.into()
    }
}
