//! Vacuuming the queue tables between autovacuum's visits (see `engine::vacuum`).

use sqlx::Row;

use super::Store;

/// The tables whose rows live only until they are applied: every applied event leaves one dead
/// work row per perspective, every drained stream a dead `wh_active_streams` row.
pub const QUEUE_TABLES: &[&str] = &["wh_perspective_events", "wh_active_streams"];

/// Live and dead row counts of the queue tables, from the statistics collector (no table scan).
const QUEUE_TABLE_ROWS: &str =
    "SELECT c.relname::text, coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
        pg_has_role(c.relowner, 'USAGE')
 FROM pg_class c
 JOIN pg_namespace n ON n.oid = c.relnamespace
 LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
 WHERE n.nspname = $1 AND c.relname = ANY ($2)";

/// One worker of the deployment vacuums at a time; the others skip their turn.
const TRY_LOCK: &str = "SELECT pg_try_advisory_lock(hashtext($1 || '.wh_vacuum'))";
const UNLOCK: &str = "SELECT pg_advisory_unlock(hashtext($1 || '.wh_vacuum'))";
/// SKIP_LOCKED: an autovacuum worker already on the table makes this a no-op, not a wait.
const VACUUM: &str = "VACUUM (SKIP_LOCKED) {schema}.{table}";

/// What the statistics say about one queue table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRows {
    pub table: String,
    pub live: i64,
    pub dead: i64,
    /// Whether this role may vacuum it (owns it, directly or through a role it belongs to).
    pub owned: bool,
}

impl Store {
    /// Live and dead rows of each of [`QUEUE_TABLES`].
    pub async fn queue_table_rows(&self) -> Result<Vec<TableRows>, sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "queue table rows")
            .await?;
        let rows = c
            .deadline()
            .run(
                sqlx::query(QUEUE_TABLE_ROWS)
                    .bind(self.schema())
                    .bind(QUEUE_TABLES)
                    .fetch_all(&mut *c),
            )
            .await?;
        Ok(rows
            .into_iter()
            .map(|r| TableRows {
                table: r.get(0),
                live: r.get(1),
                dead: r.get(2),
                owned: r.get(3),
            })
            .collect())
    }

    /// `VACUUM` one queue table unless another worker of the deployment is vacuuming (then
    /// `false`). VACUUM cannot run in a transaction, so it goes alone (its own implicit
    /// transaction) on one pooled connection, between taking and releasing a session advisory
    /// lock.
    pub async fn vacuum_queue_table(&self, table: &str) -> Result<bool, sqlx::Error> {
        debug_assert!(QUEUE_TABLES.contains(&table));
        let mut conn = self.conn(self.deadlines.routine, "vacuum lock").await?;
        let locked: bool = conn
            .deadline()
            .run(
                sqlx::query_scalar(TRY_LOCK)
                    .bind(self.schema())
                    .fetch_one(&mut *conn),
            )
            .await?;
        if !locked {
            return Ok(false);
        }
        let statement = self.sql(VACUUM).replace("{table}", table);
        let vacuumed = conn
            .limit(self.deadlines.long, "VACUUM")
            .run(
                sqlx::query(&statement)
                    .persistent(false)
                    .execute(&mut *conn),
            )
            .await;
        if conn.is_expired() {
            // Past its deadline the connection is closed, and its advisory lock goes with it.
            return vacuumed.map(|_| true);
        }
        let unlocked = conn
            .limit(self.deadlines.quick, "vacuum unlock")
            .run(
                sqlx::query_scalar::<_, bool>(UNLOCK)
                    .bind(self.schema())
                    .fetch_one(&mut *conn),
            )
            .await;
        vacuumed?;
        unlocked?;
        Ok(true)
    }
}
