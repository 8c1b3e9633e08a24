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
