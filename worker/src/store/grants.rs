//! The rights of each database role of a deployment (DESIGN §12.3), as `GRANT` statements the
//! schema's owner runs (`perspective-worker grants`):
//!
//! - **producer**: `USAGE` on the schema, `INSERT` on `wh_event_store`, `EXECUTE` on
//!   `append_events`. The insert trigger and `append_events` run as the owner, so nothing else.
//! - **worker** (`perspective-worker run`): reads the store; reads and writes the engine's other
//!   tables and the read models (`TRUNCATE` too, for a rebuild's `reset`); runs the engine and
//!   compiled functions. Tables the owner creates later in the schema (a new perspective's
//!   `setup`) get the same rights through default privileges. Not `UPDATE` or `DELETE` on the
//!   store, and no DDL: `migrate` runs as the owner.
//! - **reader** (`perspective-worker status`, the operator's status queries): `SELECT` on the
//!   engine tables those read, not the store and not the read models. (The dead letters it
//!   counts hold a snapshot of their events.)

use sqlx::postgres::PgConnection;
use sqlx::Connection;

/// A role of a deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Producer,
    Worker,
    Reader,
}

/// The engine tables a reader needs (`status`, the operator's status and progress queries).
const READER_TABLES: &[&str] = &[
    "wh_schema_migrations",
    "wh_schema_functions",
    "wh_perspectives",
    "wh_perspective_subscriptions",
    "wh_perspective_events",
    "wh_perspective_cursors",
    "wh_perspective_jobs",
    "wh_perspective_job_streams",
    "wh_perspective_versions",
    "wh_dead_letters",
    "wh_service_instances",
    "wh_active_streams",
];

/// `name` as a quoted SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The statements that give `role` (a role name, quoted here) the rights of `kind` in `schema`
/// (a validated identifier), in order.
pub fn statements(schema: &str, kind: Role, role: &str) -> Vec<String> {
    let r = quote_ident(role);
    let mut out = vec![format!("GRANT USAGE ON SCHEMA {schema} TO {r}")];
    match kind {
        Role::Producer => {
            out.push(format!("GRANT INSERT ON {schema}.wh_event_store TO {r}"));
            out.push(format!(
                "GRANT EXECUTE ON FUNCTION {schema}.append_events(uuid, bigint, jsonb) TO {r}"
            ));
        }
        Role::Worker => {
            out.push(format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA {schema} TO {r}"
            ));
            // The store is append-only for the worker too (its trigger refuses the rest anyway).
            out.push(format!(
                "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON {schema}.wh_event_store FROM {r}"
            ));
            out.push(format!(
                "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {r}"
            ));
            out.push(format!(
                "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {r}"
            ));
            out.push(format!(
                "ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLES TO {r}"
            ));
            out.push(format!(
                "ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {r}"
            ));
        }
        Role::Reader => {
            out.extend(
                READER_TABLES
                    .iter()
                    .map(|t| format!("GRANT SELECT ON {schema}.{t} TO {r}")),
            );
        }
    }
    out
}

/// Run `statements` in one transaction on `conn` (all or none).
pub async fn apply(conn: &mut PgConnection, statements: &[String]) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    for statement in statements {
        sqlx::raw_sql(statement).execute(&mut *tx).await?;
    }
    tx.commit().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_producer_gets_the_store_insert_and_append_events_only() {
        assert_eq!(
            statements("shop", Role::Producer, "orders"),
            [
                "GRANT USAGE ON SCHEMA shop TO \"orders\"",
                "GRANT INSERT ON shop.wh_event_store TO \"orders\"",
                "GRANT EXECUTE ON FUNCTION shop.append_events(uuid, bigint, jsonb) TO \"orders\"",
            ]
        );
    }

    #[test]
    fn a_worker_never_gets_to_change_the_store() {
        let sql = statements("shop", Role::Worker, "w").join(";\n");
        assert!(sql.contains("REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON shop.wh_event_store"));
        assert!(sql.contains("ALTER DEFAULT PRIVILEGES IN SCHEMA shop GRANT"));
    }

    #[test]
    fn a_reader_reads_neither_the_store_nor_the_models() {
        let sql = statements("shop", Role::Reader, "r");
        assert!(sql
            .iter()
            .skip(1)
            .all(|s| s.starts_with("GRANT SELECT ON shop.wh_")));
        assert!(!sql.iter().any(|s| s.contains("wh_event_store")));
    }

    #[test]
    fn role_names_are_quoted() {
        assert_eq!(quote_ident("a\"b; DROP"), "\"a\"\"b; DROP\"");
    }
}
