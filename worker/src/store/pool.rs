//! The engine's connection pools: their sizes and timeouts (constants of [`crate::db`]), and
//! the statement that applies the settings PostgreSQL 14 added to each new connection where the
//! server knows them (an unknown setting in the startup packet would refuse the connection).

use sqlx::postgres::{PgConnection, PgPoolOptions};
use sqlx::Connection;

use crate::db::{
    ACQUIRE_TIMEOUT, CHECK_CLIENT_SETTINGS, IDLE_SESSION_TIMEOUT, POOL_IDLE_TIMEOUT,
    RELEASE_CHECK_TIMEOUT,
};

/// Which of the engine's pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolRole {
    /// The statements' pool: up to `max_connections`, with `idle_session_timeout`.
    Statements { max_connections: u32 },
    /// The quick statements' pool (heartbeat, abandonment, claim, deregistration): two
    /// connections of their own, so they never wait behind long applies.
    Control,
    /// The LISTEN session: one connection that idles between notifications.
    Listen,
}

/// The options of an engine pool: size, [`ACQUIRE_TIMEOUT`], [`POOL_IDLE_TIMEOUT`],
/// [`RELEASE_CHECK_TIMEOUT`], and the settings PostgreSQL 14 added ([`CHECK_CLIENT_SETTINGS`],
/// and [`IDLE_SESSION_TIMEOUT`] for the statements' pool) applied to each new connection where the server knows them.
pub fn pool_options(role: PoolRole) -> PgPoolOptions {
    let (max, idle_session) = match role {
        PoolRole::Statements { max_connections } => (max_connections, true),
        PoolRole::Control => (2, true),
        PoolRole::Listen => (1, false),
    };
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .idle_timeout(POOL_IDLE_TIMEOUT)
        .after_connect(move |conn, _| {
            Box::pin(async move { apply_newer_settings(conn, idle_session).await })
        })
        .after_release(|conn, _| {
            Box::pin(async move {
                match tokio::time::timeout(RELEASE_CHECK_TIMEOUT, conn.ping()).await {
                    Ok(alive) => alive.map(|()| true),
                    // An error: sqlx closes the connection without a goodbye.
                    Err(_) => Err(sqlx::Error::Io(std::io::ErrorKind::TimedOut.into())),
                }
            })
        })
}

/// `SET` each setting the server knows, in one statement.
const SET_KNOWN_SETTINGS: &str = "SELECT set_config(v.name, v.setting, false)
    FROM unnest($1::text[], $2::text[]) AS v(name, setting)
    JOIN pg_settings s ON s.name = v.name";

async fn apply_newer_settings(
    conn: &mut PgConnection,
    idle_session: bool,
) -> Result<(), sqlx::Error> {
    let mut settings = CHECK_CLIENT_SETTINGS.to_vec();
    if idle_session {
        settings.push(("idle_session_timeout", IDLE_SESSION_TIMEOUT));
    }
    let (names, values): (Vec<&str>, Vec<&str>) = settings.into_iter().unzip();
    sqlx::query(SET_KNOWN_SETTINGS)
        .bind(names)
        .bind(values)
        .execute(conn)
        .await?;
    Ok(())
}
