//! Every SQL statement the worker sends at run time, one file per concern, each a typed
//! function. Nothing outside this module builds or sends SQL text (the generated apply functions
//! come from the `compile` module's templates and are executed by [`schema`]).
//!
//! Statements are written as constants with a `{schema}` placeholder, filled by `sql` with the
//! deployment's (validated) schema name; sqlx prepares and caches each one per connection.
//! The names shared with the SQL side (channels, cursor status flags, dead-letter states, job
//! kinds) are defined once in [`names`].
//!
//! - [`deadline`]: the deadline on every statement, and what tells its expiry apart
//! - [`names`]: channels, cursor status flags, dead-letter recovery states
//! - [`pool`]: the engine's connection pools, and the settings applied to each new connection
//! - [`migrations`]: the embedded, versioned schema SQL (tables, indexes, types, data)
//! - [`functions`]: the engine's server-side functions, one `.sql` file each in `functions/`,
//!   installed by `migrate` and verified by `run` with one hash
//! - [`schema`]: migrate's statements and the engine's schema verification
//! - [`instances`]: heartbeats, stale-instance abandonment, deregistration
//! - [`claim`]: `claim_work`, the only polled query
//! - [`drain`]: `wh_drain` (claim and apply in the database) and the custom-runner fetch
//! - [`apply`]: one call of a perspective's compiled apply function
//! - [`complete`]: completion of applied work rows and retirement of drained streams
//! - [`cursor`]: locking and advancing a (stream, perspective) cursor, for custom runners
//! - [`failure`]: recording an event a custom runner failed to apply (backoff, Failed cursor)
//! - [`dead_letters`]: moving poison rows aside, listing and replaying them
//! - [`lifecycle`]: lifecycle completion records and orphan reconciliation
//! - [`catchup`]: backfill and rebuild jobs: their life, their streams, their progress
//! - [`removal`]: removing what a perspective that left the config leaves behind
//! - [`versions`]: blue/green versions: building beside the live one, the switch, retiring
//! - [`statistics`]: the tables' sizes against their planner statistics, and ANALYZE
//! - [`status`]: read-only lag / failure / dead-letter figures
//! - [`vacuum`]: the queue tables' dead rows, and vacuuming them
//! - [`append`]: the producer INSERT used by the `append` command
//! - [`demo`]: reading a perspective's model table for the demo
//! - [`grants`]: the rights of the producer, worker and reader roles

pub mod append;
pub mod apply;
pub mod catchup;
pub mod claim;
pub mod complete;
pub mod cursor;
pub mod dead_letters;
pub mod deadline;
pub mod demo;
pub mod drain;
pub mod failure;
pub mod functions;
pub mod grants;
pub mod instances;
pub mod lifecycle;
pub mod migrations;
pub mod names;
pub mod pool;
pub mod removal;
pub mod schema;
pub mod statistics;
pub mod status;
pub mod vacuum;
pub mod versions;

use std::sync::Arc;

use sqlx::postgres::PgPool;

pub use deadline::{is_deadline_exceeded, is_unreachable, Conn, DeadlineExceeded, Deadlines};

/// `template` with its placeholders filled: `{schema}` by `schema` (a validated identifier: no
/// quoting needed) and the shared flags of [`names`] by their values.
pub(crate) fn sql(schema: &str, template: &str) -> String {
    use names::{cursor_status, recovery_status};
    template
        .replace("{schema}", schema)
        .replace("{cursor_completed}", &cursor_status::COMPLETED.to_string())
        .replace("{cursor_failed}", &cursor_status::FAILED.to_string())
        .replace(
            "{dead_letter_pending}",
            &format!("'{}'", recovery_status::PENDING),
        )
        .replace(
            "{dead_letter_replayed}",
            &format!("'{}'", recovery_status::REPLAYED),
        )
        .replace(
            "{dead_letter_discarded}",
            &format!("'{}'", recovery_status::DISCARDED),
        )
}

/// The engine's handle on its deployment's schema: its connection pools, the schema name, and
/// the deadlines of its statements.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    /// The quick statements' pool (heartbeat, abandonment, claim, deregistration, drain
    /// cancellation), so they never wait behind long applies for a connection.
    quick_pool: PgPool,
    schema: Arc<str>,
    deadlines: Deadlines,
}

impl Store {
    /// A store on one pool (for every statement class).
    pub fn new(pool: PgPool, schema: &str) -> Self {
        Store {
            quick_pool: pool.clone(),
            pool,
            schema: schema.into(),
            deadlines: Deadlines::default(),
        }
    }

    /// The same store with a pool of its own for the quick statements.
    pub fn with_quick_pool(mut self, pool: PgPool) -> Self {
        self.quick_pool = pool;
        self
    }

    /// The same store with other statement deadlines (tests use short ones).
    pub fn with_deadlines(mut self, deadlines: Deadlines) -> Self {
        self.deadlines = deadlines;
        self
    }

    pub fn deadlines(&self) -> &Deadlines {
        &self.deadlines
    }

    /// A connection of the pool within `limit`, for statements under that same deadline
    /// (`conn.deadline().run(query.execute(&mut *conn))`, see [`Conn`]).
    pub async fn conn(
        &self,
        limit: std::time::Duration,
        what: &'static str,
    ) -> Result<Conn, sqlx::Error> {
        Conn::acquire(&self.pool, limit, what).await
    }

    /// A connection of the quick statements' pool, within [`Deadlines::quick`].
    async fn quick_conn(&self, what: &'static str) -> Result<Conn, sqlx::Error> {
        Conn::acquire(&self.quick_pool, self.deadlines.quick, what).await
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// `template` for this store's schema.
    fn sql(&self, template: &str) -> String {
        sql(&self.schema, template)
    }

    /// Close the pools (after deregistering).
    pub async fn close(&self) {
        self.pool.close().await;
        self.quick_pool.close().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_every_placeholder() {
        assert_eq!(
            sql("shop", "SELECT {schema}.f() FROM {schema}.t WHERE x = '{}'"),
            "SELECT shop.f() FROM shop.t WHERE x = '{}'"
        );
        assert_eq!(
            sql(
                "s",
                "(status & {cursor_failed}) <> 0 AND r = {dead_letter_pending}"
            ),
            "(status & 4) <> 0 AND r = 'pending'"
        );
    }
}
