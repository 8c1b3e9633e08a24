//! What every command starts from: the loaded config, where it came from, the database URL, and
//! the error type that makes the process exit with 2.

use std::path::Path;

use anyhow::Context as _;
use perspective_worker::config::Config;
use perspective_worker::db;
use sqlx::postgres::PgConnection;

/// An error that is the caller's fault (config, arguments, input): the process exits with 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidInput(pub String);

impl InvalidInput {
    pub fn error(message: impl Into<String>) -> anyhow::Error {
        InvalidInput(message.into()).into()
    }
}

/// The config and database every command works on.
pub struct Context {
    pub config: Config,
    /// The config file's path, as `migrate` records it.
    pub config_source: String,
    database_url: Option<String>,
}

impl Context {
    /// Load the config; a missing or invalid one is invalid input. The database URL is only
    /// checked when a command needs it (`run` and `demo` can do without).
    pub fn load(config: Option<&Path>, database_url: Option<String>) -> anyhow::Result<Self> {
        let path = config.ok_or_else(|| {
            InvalidInput::error("no config: pass --config FILE or set PERSPECTIVE_CONFIG")
        })?;
        if let Some(url) = &database_url {
            check_database_url(url)?;
        }
        Ok(Context {
            config: Config::load(path).map_err(|e| InvalidInput::error(e.to_string()))?,
            config_source: path.display().to_string(),
            database_url,
        })
    }

    /// DATABASE_URL, which the one-shot commands require.
    pub fn database_url(&self) -> anyhow::Result<&str> {
        self.database_url.as_deref().ok_or_else(|| {
            InvalidInput::error("no database: set DATABASE_URL or pass --database-url")
        })
    }

    /// DATABASE_URL if set: `run` and `demo` start an embedded PostgreSQL without it.
    pub fn database_url_if_set(&self) -> Option<&str> {
        self.database_url.as_deref()
    }

    /// A connection to DATABASE_URL for `command`.
    pub async fn connect(&self, command: &str) -> anyhow::Result<PgConnection> {
        connect(self.database_url()?, command).await
    }

    pub fn perspective_names(&self) -> Vec<String> {
        self.config
            .perspectives
            .iter()
            .map(|p| p.name.clone())
            .collect()
    }
}

/// A database URL must be a PostgreSQL URL; what else it is is not printed (it may hold a
/// password).
fn check_database_url(url: &str) -> anyhow::Result<()> {
    let scheme = url.split_once("://").map(|(scheme, _)| scheme);
    match scheme {
        Some("postgres" | "postgresql") => Ok(()),
        Some(other) if !other.is_empty() && other.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) => {
            Err(InvalidInput::error(format!(
                "DATABASE_URL (or --database-url) is a {other}:// URL; it must be a PostgreSQL URL, \
                 postgres://USER:PASSWORD@HOST:PORT/DATABASE"
            )))
        }
        _ => Err(InvalidInput::error(
            "DATABASE_URL (or --database-url) is not a URL; it must be a PostgreSQL URL, \
             postgres://USER:PASSWORD@HOST:PORT/DATABASE",
        )),
    }
}

/// One connection, named `perspective-worker <command>` in `pg_stat_activity`.
pub async fn connect(url: &str, command: &str) -> anyhow::Result<PgConnection> {
    db::connect(url, &format!("perspective-worker {command}"))
        .await
        .context("connecting to PostgreSQL")
}
