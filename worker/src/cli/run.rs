//! `perspective-worker run`, and the engine start it shares with `demo`: the database (embedded
//! when DATABASE_URL is unset), the HTTP endpoints, the engine, and the stop on SIGTERM / Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use perspective_worker::db::embedded::EmbeddedPostgres;
use perspective_worker::engine::{Engine, EngineError, EngineOptions, Hooks};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::context::{Context, InvalidInput};
use super::migrate::migrate_before_start;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Run `migrate` first (handy locally; in Kubernetes the migration Job does it).
    #[arg(long)]
    migrate: bool,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

/// The options of an engine process (`run` and `demo`).
#[derive(clap::Args, Debug, Clone)]
pub struct RuntimeArgs {
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
    /// Connections of the engine's statement pool, 2 to 1000; overrides the config's
    /// worker.database.maxConnections (default 10).
    #[arg(long, env = "PERSPECTIVE_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(2..=1000))]
    max_connections: Option<u32>,
}

pub async fn execute(ctx: &Context, args: &RunArgs) -> anyhow::Result<()> {
    let instance_id = instance_id()?;
    let database = Database::open(ctx, &args.runtime).await?;
    let result = async {
        if args.migrate {
            migrate_before_start(ctx, database.url()).await?;
        }
        let engine = RunningEngine::start(
            ctx,
            database.url(),
            &args.runtime,
            instance_id,
            Hooks::new(),
        )
        .await?;
        engine.wait().await
    }
    .await;
    database.close().await;
    result
}

/// `PERSPECTIVE_INSTANCE_ID` (the pod's UID in Kubernetes), else a fresh UUIDv7.
pub fn instance_id() -> anyhow::Result<Uuid> {
    match std::env::var("PERSPECTIVE_INSTANCE_ID") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<Uuid>().map_err(|e| {
            InvalidInput::error(format!("PERSPECTIVE_INSTANCE_ID {v:?} is not a UUID: {e}"))
        }),
        _ => Ok(Uuid::now_v7()),
    }
}

/// The database of an engine process: DATABASE_URL, else an embedded PostgreSQL in --data-dir
/// that [`Database::close`] stops.
pub struct Database {
    url: String,
    embedded: Option<EmbeddedPostgres>,
}

impl Database {
    pub async fn open(ctx: &Context, runtime: &RuntimeArgs) -> anyhow::Result<Self> {
        if let Some(url) = ctx.database_url_if_set() {
            return Ok(Database {
                url: url.to_string(),
                embedded: None,
            });
        }
        tracing::info!(data_dir = %runtime.data_dir.display(), "DATABASE_URL is not set: using an embedded PostgreSQL");
        let pg = EmbeddedPostgres::start(&runtime.data_dir)
            .await
            .context("starting the embedded PostgreSQL")?;
        eprintln!(
            "DATABASE_URL is not set: using embedded PostgreSQL {} at {} (data directory {})",
            pg.version(),
            pg.url(),
            pg.data_dir().display()
        );
        Ok(Database {
            url: pg.url(),
            embedded: Some(pg),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn close(self) {
        if let Some(pg) = self.embedded {
            if let Err(e) = pg.stop().await {
                tracing::warn!(error = %e, "stopping the embedded PostgreSQL");
            }
        }
    }
}

/// A started engine with its HTTP endpoints, stopping on SIGTERM / Ctrl-C or when its
/// shutdown token is cancelled.
pub struct RunningEngine {
    engine: Engine,
    http: tokio::task::JoinHandle<()>,
    shutdown: CancellationToken,
}

impl RunningEngine {
    /// Serve HTTP and start the engine on `url`. `hooks` lets the caller subscribe to the
    /// engine's events before it starts.
    pub async fn start(
        ctx: &Context,
        url: &str,
        runtime: &RuntimeArgs,
        instance_id: Uuid,
        hooks: Hooks,
    ) -> anyhow::Result<Self> {
        let shutdown = CancellationToken::new();
        let mut options = EngineOptions::new(ctx.config.clone(), url);
        options.instance_id = instance_id;
        options.max_connections = max_connections(runtime.max_connections, &ctx.config);
        options.hooks = hooks;
        let (addr, http) = perspective_worker::engine::http::serve(
            runtime.http_addr,
            options.readiness.clone(),
            options.metrics.clone(),
            shutdown.clone(),
        )
        .await
        .with_context(|| format!("serving HTTP on {}", runtime.http_addr))?;
        tracing::info!(%addr, "HTTP endpoints: /livez /readyz /metrics");
        let engine = Engine::start(options, shutdown.clone())
            .await
            .map_err(start_error)?;
        tracing::info!(instance_id = %engine.instance_id(), "engine started");
        let stopper = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("signal received: shutting down");
            stopper.cancel();
        });
        Ok(RunningEngine {
            engine,
            http,
            shutdown,
        })
    }

    /// Cancelling it stops the engine as a signal would.
    pub fn shutdown(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Run until stopped, then wait for the HTTP server to close.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.engine.run_until_stopped().await?;
        let _ = self.http.await;
        Ok(())
    }
}

/// A schema, its functions or a perspective not migrated to this config is the caller's to fix
/// (exit 2).
fn start_error(e: EngineError) -> anyhow::Error {
    match e {
        EngineError::SchemaOutdated { .. }
        | EngineError::PerspectiveOutdated { .. }
        | EngineError::FunctionsOutdated { .. } => InvalidInput::error(e.to_string()),
        other => other.into(),
    }
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

/// The engine's pool size: `--max-connections` (`PERSPECTIVE_MAX_CONNECTIONS`) when given,
/// else the config's `worker.database.maxConnections`.
fn max_connections(flag: Option<u32>, config: &perspective_worker::config::Config) -> u32 {
    flag.unwrap_or(config.worker.database.max_connections)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_overrides_the_configs_pool_size() {
        let mut config = perspective_worker::config::Config::from_yaml_str(
            "schema: s\nperspectives:\n  - name: p\n    handlers:\n      A: SELECT 1\n",
            "test.yaml",
        )
        .unwrap();
        config.worker.database.max_connections = 7;
        assert_eq!(max_connections(None, &config), 7);
        assert_eq!(max_connections(Some(3), &config), 3);
    }
}
