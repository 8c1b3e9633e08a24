//! A deadline on every statement the engine sends, and the connections they run on.
//!
//! sqlx has no client-side TCP keepalive: over a dead link (packets silently dropped, sockets
//! left open) a statement would wait until the kernel gives up, minutes later. So each statement
//! runs under a client-side deadline ([`Deadlines`], by statement class); past it the caller gets
//! a [`DeadlineExceeded`] error (see [`is_deadline_exceeded`], [`is_unreachable`]) and the
//! connection is closed, never returned to the pool: sqlx would otherwise test it on release by
//! waiting, unbounded, for the abandoned statement's answer, holding a pool slot meanwhile.
//!
//! Where the server bounds a statement itself (`wh_drain`'s `statement_timeout`), the client's
//! deadline is longer, so that with a healthy link the server's error wins.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, Postgres};
use tokio::time::Instant;

/// How long the engine waits for the answer to each class of statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// Heartbeat, stale-instance cleanup, deregistration, `claim_work`, drain cancellation and
    /// the listener's liveness probe: small statements whose failure must be noticed quickly
    /// (a heartbeat every 10 s, abandonment after 30 s).
    pub quick: Duration,
    /// Completion flush, settling drained streams, failure and dead-letter records, lifecycle
    /// records, status figures, schema checks and the size/row listings of the housekeepers.
    pub routine: Duration,
    /// Catch-up (backfill/rebuild) job steps and chunks, custom-runner groups, VACUUM and
    /// ANALYZE, and `wh_drain` when `handlerTimeoutMilliseconds` is null.
    pub long: Duration,
    /// Added to `wh_drain`'s statement timeout (twice `handlerTimeoutMilliseconds`), so that
    /// the server cancels a slow call before the client gives up on it.
    pub drain_margin: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            quick: Duration::from_secs(5),
            routine: Duration::from_secs(15),
            long: Duration::from_secs(600),
            drain_margin: Duration::from_secs(5),
        }
    }
}

impl Deadlines {
    /// The deadline of a `wh_drain` call whose statement timeout is twice `handler_timeout_ms`
    /// (None: no statement timeout, [`Deadlines::long`]).
    pub fn drain(&self, handler_timeout_ms: Option<u64>) -> Duration {
        match handler_timeout_ms {
            Some(ms) => Duration::from_millis(ms.saturating_mul(2)) + self.drain_margin,
            None => self.long,
        }
    }
}

/// A statement got no answer within its deadline (counted from asking for a connection): the
/// database is unreachable (a dead link, a server that stopped answering) or overloaded. The
/// connection it ran on, if it got one, is closed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{what}: no answer from PostgreSQL within {limit:?} (statement deadline)")]
pub struct DeadlineExceeded {
    /// The statement (or step) that timed out.
    pub what: &'static str,
    pub limit: Duration,
}

impl From<DeadlineExceeded> for sqlx::Error {
    /// An I/O error of kind `TimedOut` (what a dead socket eventually reports), carrying the
    /// deadline so that [`is_deadline_exceeded`] can tell it apart.
    fn from(e: DeadlineExceeded) -> Self {
        sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, e))
    }
}

/// Whether `err` is a statement deadline that expired ([`DeadlineExceeded`]).
pub fn is_deadline_exceeded(err: &sqlx::Error) -> bool {
    deadline_of(err).is_some()
}

/// The expired deadline `err` carries, if it is one.
pub fn deadline_of(err: &sqlx::Error) -> Option<&DeadlineExceeded> {
    match err {
        sqlx::Error::Io(io) => io.get_ref()?.downcast_ref::<DeadlineExceeded>(),
        _ => None,
    }
}

/// SQLSTATEs that mean the session is gone or cannot be had: connection exceptions (class 08),
/// the server shutting down or starting (57P01–57P03), the server ending an idle session
/// (25P03 `idle_in_transaction_session_timeout`, 57P05 `idle_session_timeout`), and a database
/// that does not exist (3D000: dropped under the running worker).
const UNREACHABLE_SQLSTATES: [&str; 6] = ["57P01", "57P02", "57P03", "57P05", "25P03", "3D000"];

/// Whether `err` says the database cannot be reached (rather than that it refused a
/// statement): an expired statement deadline, no connection within the pool's acquire timeout,
/// an I/O or TLS failure, a closed pool, or a server-side end of the session (see
/// [`UNREACHABLE_SQLSTATES`] and class 08).
pub fn is_unreachable(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => crate::db::sqlstate(err)
            .is_some_and(|s| s.starts_with("08") || UNREACHABLE_SQLSTATES.contains(&s.as_str())),
    }
}

/// Run `fut` under `limit`: its result, or [`DeadlineExceeded`] once `limit` has passed (`fut`
/// is then dropped). For statements on a [`Conn`], use [`Conn::limit`], which also closes the
/// connection.
pub fn within<'a, T, E, F>(
    limit: Duration,
    what: &'static str,
    fut: F,
) -> BoxFuture<'a, Result<T, E>>
where
    T: Send + 'a,
    E: From<sqlx::Error> + Send + 'a,
    F: Future<Output = Result<T, E>> + Send + 'a,
{
    Box::pin(tokio::time::timeout(limit, fut).map(move |outcome| {
        outcome.unwrap_or_else(|_| Err(E::from(DeadlineExceeded { what, limit }.into())))
    }))
}

/// A round trip on the otherwise idle LISTEN session, to tell a dead link: `LISTEN` again on
/// `channel`, which it already listens on (a no-op that keeps the session's last statement, in
/// `pg_stat_activity`, naming its channel). `channel` is a validated schema name plus a suffix.
pub async fn probe(
    listener: &mut sqlx::postgres::PgListener,
    channel: &str,
) -> Result<(), sqlx::Error> {
    let sql = format!(r#"LISTEN "{channel}""#);
    sqlx::Executor::execute(listener, sql.as_str())
        .await
        .map(|_| ())
}

/// A pooled connection whose statements run under deadlines. Dropped after a deadline expired,
/// it is closed and leaves the pool (which may open a fresh one); otherwise it goes back to the
/// pool.
pub struct Conn {
    inner: Option<PoolConnection<Postgres>>,
    expired: Arc<AtomicBool>,
    /// The deadline it was acquired under (see [`Conn::deadline`]).
    deadline: Instant,
    what: &'static str,
}

impl Conn {
    /// A connection of `pool`, within `limit`: the deadline counts from asking for the
    /// connection (waiting for a free one, or opening one, or testing an idle one over a dead
    /// link would otherwise be unbounded by it). The rest of `limit` is left for [`Conn::deadline`].
    pub(crate) async fn acquire(
        pool: &PgPool,
        limit: Duration,
        what: &'static str,
    ) -> Result<Conn, sqlx::Error> {
        let deadline = Instant::now() + limit;
        let inner = within(limit, what, pool.acquire()).await?;
        Ok(Conn {
            inner: Some(inner),
            expired: Arc::default(),
            deadline,
            what,
        })
    }

    /// What is left of the deadline the connection was acquired under, for its statement:
    /// `conn.deadline().run(query.fetch_one(&mut *conn))`.
    pub fn deadline(&self) -> Limit {
        let left = self.deadline.saturating_duration_since(Instant::now());
        self.limit(left, self.what)
    }

    /// A fresh deadline for a further statement on this connection:
    /// `conn.limit(d, "what").run(query.fetch_one(&mut *conn))`.
    pub fn limit(&self, limit: Duration, what: &'static str) -> Limit {
        Limit {
            limit,
            what,
            expired: self.expired.clone(),
        }
    }

    /// Whether a deadline expired on this connection (it will be closed when dropped).
    pub fn is_expired(&self) -> bool {
        self.expired.load(Ordering::Relaxed)
    }
}

impl Deref for Conn {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.inner
            .as_deref()
            .expect("a Conn holds its connection until dropped")
    }
}

impl DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.inner
            .as_deref_mut()
            .expect("a Conn holds its connection until dropped")
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let (true, Some(conn)) = (self.is_expired(), self.inner.take()) {
            // Out of the pool at once (its slot is free again), and the socket closed by the
            // drop: no waiting for an answer the abandoned statement may never get. The server
            // notices through its TCP keepalives or `client_connection_check_interval`.
            drop(conn.detach());
        }
    }
}

/// One deadline of a [`Conn`] (see [`Conn::limit`]).
pub struct Limit {
    limit: Duration,
    what: &'static str,
    expired: Arc<AtomicBool>,
}

impl Limit {
    /// `fut`'s result, or [`DeadlineExceeded`] after the limit (and the connection is marked to
    /// be closed). Boxed as a `Send` future: an opaque one would make the compiler prove `Send`
    /// for every lifetime `fut` borrows, which it cannot inside the spawned tasks.
    pub fn run<'a, T, E, F>(self, fut: F) -> BoxFuture<'a, Result<T, E>>
    where
        T: Send + 'a,
        E: From<sqlx::Error> + Send + 'a,
        F: Future<Output = Result<T, E>> + Send + 'a,
    {
        Box::pin(
            tokio::time::timeout(self.limit, fut).map(move |outcome| match outcome {
                Ok(result) => result,
                Err(_) => {
                    self.expired.store(true, Ordering::Relaxed);
                    Err(E::from(
                        DeadlineExceeded {
                            what: self.what,
                            limit: self.limit,
                        }
                        .into(),
                    ))
                }
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_told_apart_and_counts_as_unreachable() {
        let err: sqlx::Error = DeadlineExceeded {
            what: "heartbeat",
            limit: Duration::from_secs(5),
        }
        .into();
        assert!(is_deadline_exceeded(&err));
        assert!(is_unreachable(&err));
        assert_eq!(deadline_of(&err).map(|d| d.what), Some("heartbeat"));
        assert!(err
            .to_string()
            .contains("heartbeat: no answer from PostgreSQL within 5s"));
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(!is_deadline_exceeded(&io));
        assert!(is_unreachable(&io));
        assert!(is_unreachable(&sqlx::Error::PoolTimedOut));
        assert!(!is_unreachable(&sqlx::Error::RowNotFound));
    }

    #[test]
    fn sqlstates_of_lost_sessions_are_unreachable_and_refusals_are_not() {
        let with = |code: &str| -> sqlx::Error {
            crate::db::LockConflict {
                sqlstate: code.into(),
                message: "x".into(),
            }
            .into()
        };
        for code in ["08006", "08001", "57P01", "57P05", "25P03", "3D000"] {
            assert!(is_unreachable(&with(code)), "{code}");
        }
        for code in ["23505", "40P01", "57014", "42P01"] {
            assert!(!is_unreachable(&with(code)), "{code}");
        }
    }

    #[test]
    fn the_drain_deadline_outlasts_its_statement_timeout() {
        let d = Deadlines::default();
        assert_eq!(d.drain(Some(30_000)), Duration::from_secs(65));
        assert_eq!(d.drain(None), d.long);
    }
}
