//! Lag, failures and dead letters of a deployment, read from its database.
//!
//! Read-only: one pooled connection per deployment, each read in a `READ ONLY` transaction with
//! a statement timeout, so a slow or unreachable database delays nothing but the status. A read
//! that fails says why ([`DatabaseProblem`]): unreachable, or the schema's migration history
//! missing (the migration Job then runs again). What it says is for the deployment's author
//! and so never the server's error text, which can name hosts, users and databases: that goes
//! to the operator's log, once per change ([`summary`]).

use std::collections::HashMap;
use std::time::Duration;

use perspective_worker::db::{connect_options, describe_error};
use perspective_worker::store::schema::latest_migration;
use perspective_worker::store::status::{read_status, Status};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Connection;
use tokio::sync::Mutex;
use tracing::warn;

use crate::status::observed::DatabaseProblem;

/// How long one status read may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Database pools of the deployments, by `namespace/name`, rebuilt when the URL changes.
#[derive(Default)]
pub struct LagReader {
    pools: Mutex<HashMap<String, (String, PgPool)>>,
    /// The last server error logged per deployment, so that each is logged once.
    logged: Mutex<HashMap<String, String>>,
}

/// What the status says about a failed read: the kind of failure and, for an error the server
/// answered with, its SQLSTATE (e.g. `3D000`: no such database; `28P01`: wrong password).
pub fn summary(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("the server refused the read (SQLSTATE {code})"),
            None => "the server refused the read".to_owned(),
        },
        sqlx::Error::PoolTimedOut => {
            format!("could not connect within {}s", READ_TIMEOUT.as_secs())
        }
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolClosed => {
            "could not connect".to_owned()
        }
        _ => "the read failed".to_owned(),
    }
}

impl LagReader {
    /// Status of `schema` for deployment `key` at `url`; `perspectives` are the configured
    /// ones (shown with zeros when idle); instances whose heartbeat is older than
    /// `stale_after_seconds` do not count as live.
    pub async fn read(
        &self,
        key: &str,
        url: &str,
        schema: &str,
        perspectives: &[String],
        stale_after_seconds: f64,
    ) -> Result<Status, DatabaseProblem> {
        let pool = self
            .pool(key, url)
            .await
            .map_err(DatabaseProblem::Unreachable)?;
        let read = async {
            let mut conn = pool.acquire().await?;
            let mut tx = conn.begin().await?;
            sqlx::query("SET TRANSACTION READ ONLY")
                .execute(&mut *tx)
                .await?;
            sqlx::query("SET LOCAL statement_timeout = '5s'")
                .execute(&mut *tx)
                .await?;
            if latest_migration(&mut tx, schema).await?.is_none() {
                return Ok(None);
            }
            let status = read_status(&mut tx, schema, perspectives, stale_after_seconds).await?;
            tx.rollback().await?;
            Ok::<_, sqlx::Error>(Some(status))
        };
        let result = tokio::time::timeout(READ_TIMEOUT + Duration::from_secs(1), read).await;
        let mut logged = self.logged.lock().await;
        match &result {
            Ok(Err(err)) => {
                let text = describe_error(err, None);
                if logged.get(key) != Some(&text) {
                    warn!(deployment = key, error = %text, "cannot read status from the database");
                    logged.insert(key.to_owned(), text);
                }
            }
            _ => {
                logged.remove(key);
            }
        }
        match result {
            Ok(Ok(Some(status))) => Ok(status),
            Ok(Ok(None)) => Err(DatabaseProblem::SchemaMissing(format!(
                "schema {schema} has no migration history in the database (dropped, or the \
                 database was recreated); the migration Job runs again"
            ))),
            Ok(Err(err)) => Err(DatabaseProblem::Unreachable(summary(&err))),
            Err(_) => Err(DatabaseProblem::Unreachable(format!(
                "no answer within {}s",
                READ_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Forgets a deleted deployment's pool.
    pub async fn forget(&self, key: &str) {
        self.logged.lock().await.remove(key);
        if let Some((_, pool)) = self.pools.lock().await.remove(key) {
            pool.close().await;
        }
    }

    async fn pool(&self, key: &str, url: &str) -> Result<PgPool, String> {
        let mut pools = self.pools.lock().await;
        if let Some((known, pool)) = pools.get(key) {
            if known == url {
                return Ok(pool.clone());
            }
        }
        let options = connect_options(url, "perspective-operator")
            // Never echo the URL: it holds the password.
            .map_err(|_| {
                "the database URL in the Secret is not a valid PostgreSQL URL".to_owned()
            })?;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(READ_TIMEOUT)
            .idle_timeout(Duration::from_secs(120))
            .connect_lazy_with(options);
        if let Some((_, old)) = pools.insert(key.to_owned(), (url.to_owned(), pool.clone())) {
            old.close().await;
        }
        Ok(pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finding_7_a_failed_read_is_summarized_without_the_servers_text() {
        let io = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connect to db.internal.example:5432 as user shop_owner refused",
        ));
        assert_eq!(summary(&io), "could not connect");
        assert_eq!(
            summary(&sqlx::Error::PoolTimedOut),
            "could not connect within 5s"
        );
        let protocol = sqlx::Error::Protocol("role \"shop_owner\" at db.internal".into());
        assert_eq!(summary(&protocol), "the read failed");
    }
}
