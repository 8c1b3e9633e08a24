//! The PostgreSQL server and connections to it: connect options, errors described for people,
//! and [`embedded`], a private server for `run` and `demo` when `DATABASE_URL` is unset.

pub mod embedded;

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;

/// Server settings of every worker session, sent at connect (startup `options`). sqlx has no
/// client-side TCP keepalive; these make the *server* shed a session whose worker vanished
/// (a dead link, a partitioned or killed pod), instead of keeping the backend, and the locks of
/// its open transaction, until the kernel gives up much later:
/// - `tcp_keepalives_idle` / `_interval` / `_count`: an idle peer is probed after 10 s, every
///   5 s, and given up after 3 unanswered probes (about 25 s);
/// - `tcp_user_timeout`: data the server sent stays unacknowledged for at most 30 s;
/// - `idle_in_transaction_session_timeout`: a session idle inside an open transaction for 60 s
///   is ended (the worker's transactions never wait on anything but the database between their
///   statements).
///
/// All known to every supported server (13+). Over a Unix socket the TCP ones read 0.
pub const SESSION_SETTINGS: [(&str, &str); 5] = [
    ("tcp_keepalives_idle", "10s"),
    ("tcp_keepalives_interval", "5s"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "30s"),
    ("idle_in_transaction_session_timeout", "60s"),
];

/// Set after connecting, only when the server knows them (PostgreSQL 14+; an unknown setting in
/// the startup packet would refuse the connection): `client_connection_check_interval` makes a
/// backend running a statement check every 5 s that its client is still there, so a statement
/// the worker gave up on (its deadline expired, the connection closed) stops soon.
pub const CHECK_CLIENT_SETTINGS: [(&str, &str); 1] = [("client_connection_check_interval", "5s")];

/// `idle_session_timeout` of the engine's pooled sessions (PostgreSQL 14+): the server ends a
/// session idle for this long. The pool closes its idle connections after
/// [`POOL_IDLE_TIMEOUT`] (checked as often), well before; the server's timeout only catches
/// sessions the worker lost track of. Not set on the LISTEN session, which idles by design.
pub const IDLE_SESSION_TIMEOUT: &str = "300s";

/// The pool closes connections idle this long (sqlx's default is 10 min): below
/// [`IDLE_SESSION_TIMEOUT`] with room for the reaper's period (the same).
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the engine waits for a pooled connection: a free one, or a new one opened
/// (TCP, TLS, authentication and the post-connect settings all count). sqlx's connect has no
/// timeout of its own; this one bounds it.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection given back to the pool may take to show it is still alive and idle
/// (a round trip). sqlx tests every released connection so, without a bound: over a dead link,
/// or with a statement abandoned mid-flight (a cancelled task), the test would hold the
/// connection and its pool slot until the kernel gives up. Past this bound it is closed.
pub const RELEASE_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a one-shot command ([`connect`]) waits for its connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connection options from a URL, tagged with an `application_name` so `pg_stat_activity`
/// shows which part of the worker a session belongs to, and carrying [`SESSION_SETTINGS`].
pub fn connect_options(url: &str, application_name: &str) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(PgConnectOptions::from_str(url)?
        .application_name(application_name)
        .options(SESSION_SETTINGS))
}

/// One dedicated connection (migrations and other one-shot commands), within
/// [`CONNECT_TIMEOUT`].
pub async fn connect(url: &str, application_name: &str) -> Result<PgConnection, sqlx::Error> {
    let options = connect_options(url, application_name)?;
    tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .unwrap_or_else(|_| {
            Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection to PostgreSQL within {CONNECT_TIMEOUT:?}"),
            )))
        })
}

/// A one-line description of a database error: the server's message, its detail and hint, and,
/// when the server reports a position inside `sql`, the line it points at.
pub fn describe_error(err: &sqlx::Error, sql: Option<&str>) -> String {
    let Some(db) = err.as_database_error() else {
        return err.to_string();
    };
    let mut out = db.message().to_string();
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        if let (Some(sql), Some(sqlx::postgres::PgErrorPosition::Original(pos))) =
            (sql, pg.position())
        {
            // The server counts characters from 1.
            let line = sql
                .chars()
                .take(pos.saturating_sub(1))
                .filter(|c| *c == '\n')
                .count()
                + 1;
            out.push_str(&format!(" (line {line})"));
        }
        if let Some(detail) = pg.detail() {
            out.push_str(&format!("; {detail}"));
        }
        if let Some(hint) = pg.hint() {
            out.push_str(&format!("; hint: {hint}"));
        }
    }
    out
}

/// The SQLSTATE of a database error, if it is one.
pub fn sqlstate(err: &sqlx::Error) -> Option<String> {
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
}

/// SQLSTATEs of lock conflicts between appliers: deadlock detected (40P01), serialization
/// failure (40001), lock not available / lock timeout (55P03). They say nothing about the event
/// being applied: the same apply succeeds once the other transaction is done, so the engine
/// retries them promptly instead of counting a failure.
pub const CONTENTION_SQLSTATES: [&str; 3] = ["40P01", "40001", "55P03"];

/// Whether `sqlstate` is a lock conflict (see [`CONTENTION_SQLSTATES`]).
pub fn is_contention_sqlstate(sqlstate: &str) -> bool {
    CONTENTION_SQLSTATES.contains(&sqlstate)
}

/// The SQLSTATE of `err` if it is a lock conflict (see [`CONTENTION_SQLSTATES`]).
pub fn contention(err: &sqlx::Error) -> Option<String> {
    sqlstate(err).filter(|s| is_contention_sqlstate(s))
}

/// A lock conflict the server reported in a function's result rather than raised (a compiled
/// apply function returns it in `o_contended_sqlstate`), as a database error with that
/// SQLSTATE, for callers that expect conflicts as errors.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct LockConflict {
    pub sqlstate: String,
    pub message: String,
}

impl sqlx::error::DatabaseError for LockConflict {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        Some(std::borrow::Cow::Borrowed(&self.sqlstate))
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_conflicts_are_told_apart_by_sqlstate() {
        for code in ["40P01", "40001", "55P03"] {
            let err: sqlx::Error = LockConflict {
                sqlstate: code.into(),
                message: "conflict".into(),
            }
            .into();
            assert_eq!(contention(&err).as_deref(), Some(code));
            assert_eq!(describe_error(&err, None), "conflict");
        }
        let other: sqlx::Error = LockConflict {
            sqlstate: "23505".into(),
            message: "duplicate".into(),
        }
        .into();
        assert_eq!(contention(&other), None);
        assert_eq!(contention(&sqlx::Error::RowNotFound), None);
    }
}
