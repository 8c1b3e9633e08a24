//! Lag, failures and dead letters of a deployment, read from its database.
//!
//! Read-only: one pooled connection per deployment, each read in a `READ ONLY` transaction with
//! a statement timeout, so a slow or unreachable database delays nothing but the status. A read
//! that fails says why ([`DatabaseProblem`]): unreachable, or the schema's migration history
//! missing (the migration Job then runs again).

use std::collections::HashMap;
use std::time::Duration;

use perspective_worker::db::{connect_options, describe_error};
use perspective_worker::store::schema::latest_migration;
use perspective_worker::store::status::{read_status, Status};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Connection;
use tokio::sync::Mutex;

use crate::status::observed::DatabaseProblem;

/// How long one status read may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Database pools of the deployments, by `namespace/name`, rebuilt when the URL changes.
#[derive(Default)]
pub struct LagReader {
    pools: Mutex<HashMap<String, (String, PgPool)>>,
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
        match tokio::time::timeout(READ_TIMEOUT + Duration::from_secs(1), read).await {
            Ok(Ok(Some(status))) => Ok(status),
            Ok(Ok(None)) => Err(DatabaseProblem::SchemaMissing(format!(
                "schema {schema} has no migration history in the database (dropped, or the \
                 database was recreated); the migration Job runs again"
            ))),
            Ok(Err(err)) => Err(DatabaseProblem::Unreachable(describe_error(&err, None))),
            Err(_) => Err(DatabaseProblem::Unreachable(format!(
                "no answer within {}s",
                READ_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Forgets a deleted deployment's pool.
    pub async fn forget(&self, key: &str) {
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
