//! The planner's statistics of the schema's tables: how many rows each holds against how many
//! its statistics say, and `ANALYZE`.

use super::Store;

/// Every table (and materialized view) of the schema: the live rows the cumulative statistics
/// count, the rows its planner statistics assume (`reltuples`, -1 when never analyzed), and
/// whether this role may `ANALYZE` it (owner, database owner or superuser; PostgreSQL 17 adds
/// the MAINTAIN privilege). A table another role owns would only get a warning from `ANALYZE`.
const TABLE_SIZES: &str = "
SELECT c.relname::text, coalesce(s.n_live_tup, 0)::bigint, c.reltuples::float8,
       (pg_has_role(c.relowner, 'USAGE')
        OR (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
        OR pg_has_role((SELECT d.datdba FROM pg_database d WHERE d.datname = current_database()), 'USAGE')
        OR CASE WHEN current_setting('server_version_num')::int >= 170000
                THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = $1 AND c.relkind IN ('r', 'm')
ORDER BY 1";

/// Held by the transaction that analyzes a table: one worker of a deployment at a time.
const ANALYZE_LOCK: &str =
    "SELECT pg_try_advisory_xact_lock(hashtext($1 || '.wh_analyze'), hashtext($2))";

/// One table's live rows and the rows its statistics assume, as in [`TABLE_SIZES`].
const TABLE_SIZE: &str = "
SELECT coalesce(s.n_live_tup, 0)::bigint, c.reltuples::float8
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = $1 AND c.relname = $2";

/// The statistics target of the worker's ANALYZE: a bridge until autovacuum's, which uses the
/// server's (100 by default) once a tenth of the table changed. What the plans need from it is
/// the table's size and a rough spread of its keys; 10 samples 3 000 rows rather than 30 000
/// and costs about a tenth (measured: 4 against 40 ms for a 40 000-event store, 6 against 48 ms
/// for its 80 000 work rows, and a busy server took 270 ms for the two in the middle of a
/// drain). A column given its own target (`ALTER TABLE … SET STATISTICS`) keeps it.
pub const BRIDGE_STATISTICS_TARGET: u32 = 10;

/// One table's size as the statistics collector and the planner see it.
#[derive(Debug, Clone, PartialEq)]
pub struct TableSize {
    pub table: String,
    /// `n_live_tup`: rows the cumulative statistics count now (a second or so behind).
    pub live_rows: i64,
    /// `reltuples`: rows the planner assumes, from the last ANALYZE or VACUUM (-1: never).
    pub analyzed_rows: f64,
    /// Whether this role may analyze it.
    pub may_analyze: bool,
}

impl Store {
    /// The size of every table of the schema.
    pub async fn table_sizes(&self) -> Result<Vec<TableSize>, sqlx::Error> {
        let mut c = self.conn(self.deadlines.routine, "table sizes").await?;
        let rows: Vec<(String, i64, f64, bool)> = c
            .deadline()
            .run(
                sqlx::query_as(TABLE_SIZES)
                    .bind(self.schema())
                    .fetch_all(&mut *c),
            )
            .await?;
        Ok(rows
            .into_iter()
            .map(|(table, live_rows, analyzed_rows, may_analyze)| TableSize {
                table,
                live_rows,
                analyzed_rows,
                may_analyze,
            })
            .collect())
    }

    /// `ANALYZE` one table of the schema if `due(live rows, rows the statistics assume)` still
    /// holds once no other worker of the deployment is analyzing it; returns whether it did.
    /// The workers of a deployment check their tables on the same beat, so each found the same
    /// table outgrown and analyzed it in turn: three ANALYZEs of a 90 000-row work table, 1.8 s
    /// of the server's time in a 3.5 s drain (`tests/bench/crossstream.sh`). One transaction
    /// takes an advisory lock per table (busy: another worker is at it), reads the table's size
    /// again (another worker's ANALYZE may have committed since it was read) and analyzes it, at
    /// [`BRIDGE_STATISTICS_TARGET`].
    /// SKIP_LOCKED: a table autovacuum is analyzing or vacuuming right now, or `migrate` is
    /// changing, is left alone rather than waited for.
    pub async fn analyze_if_due(
        &self,
        table: &str,
        due: impl Fn(i64, f64) -> bool + Send,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "SET LOCAL default_statistics_target = {BRIDGE_STATISTICS_TARGET}; ANALYZE (SKIP_LOCKED) {}.{}",
            self.schema(),
            quote_ident(table)
        );
        let mut c = self.conn(self.deadlines.long, "ANALYZE").await?;
        let limit = c.deadline();
        let schema = self.schema().to_string();
        limit
            .run(async move {
                let mut tx = sqlx::Connection::begin(&mut *c).await?;
                let locked: bool = sqlx::query_scalar(ANALYZE_LOCK)
                    .bind(&schema)
                    .bind(table)
                    .fetch_one(&mut *tx)
                    .await?;
                if !locked {
                    return Ok(false);
                }
                let size: Option<(i64, f64)> = sqlx::query_as(TABLE_SIZE)
                    .bind(&schema)
                    .bind(table)
                    .fetch_optional(&mut *tx)
                    .await?;
                match size {
                    Some((live, analyzed)) if due(live, analyzed) => {
                        sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&sql)).await?;
                        tx.commit().await?;
                        Ok(true)
                    }
                    _ => Ok(false),
                }
            })
            .await
    }
}

/// `name` as a quoted SQL identifier (users' tables may have any name).
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_any_table_name() {
        assert_eq!(quote_ident("orders"), "\"orders\"");
        assert_eq!(quote_ident("Odd \"name\""), "\"Odd \"\"name\"\"\"");
    }
}
