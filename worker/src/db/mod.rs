//! The PostgreSQL server and connections to it: connect options, errors described for people,
//! and [`embedded`], a private server for `run` and `demo` when `DATABASE_URL` is unset.

pub mod embedded;

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;

/// Connection options from a URL, tagged with an `application_name` so `pg_stat_activity`
/// shows which part of the worker a session belongs to.
pub fn connect_options(url: &str, application_name: &str) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(PgConnectOptions::from_str(url)?.application_name(application_name))
}

/// One dedicated connection (migrations and other one-shot commands).
pub async fn connect(url: &str, application_name: &str) -> Result<PgConnection, sqlx::Error> {
    PgConnection::connect_with(&connect_options(url, application_name)?).await
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
