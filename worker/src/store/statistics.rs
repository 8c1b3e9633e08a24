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

    /// `ANALYZE` one table of the schema. SKIP_LOCKED: a table another session is analyzing or
    /// vacuuming right now (another worker, autovacuum) or changing (`migrate`) is left alone
    /// rather than waited for; its statistics are being refreshed anyway, or are checked again
    /// on the next round.
    pub async fn analyze(&self, table: &str) -> Result<(), sqlx::Error> {
        let sql = format!(
            "ANALYZE (SKIP_LOCKED) {}.{}",
            self.schema(),
            quote_ident(table)
        );
        let mut c = self.conn(self.deadlines.long, "ANALYZE").await?;
        c.deadline()
            .run(sqlx::Executor::execute(&mut *c, sqlx::raw_sql(&sql)))
            .await?;
        Ok(())
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
