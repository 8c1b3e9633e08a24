//! The schema's own statements: what `migrate` runs (history, migrations, subscriptions,
//! perspective setup, handler preparation, compiled functions) and what `run` checks before it
//! starts (migration level, compiled definitions).

use std::collections::{BTreeMap, HashMap};

use sqlx::postgres::{PgConnection, PgTypeInfo};
use sqlx::{Executor, Row, Statement};

use super::migrations::Migration;
use super::Store;

const SERVER_VERSION: &str = "SELECT current_setting('server_version_num')::int";
/// Serialises migrations of one schema across processes; released at commit or rollback.
const LOCK_MIGRATIONS: &str =
    "SELECT pg_advisory_xact_lock(hashtext('perspective-worker migrate'), hashtext($1))";
const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS {schema};
     CREATE TABLE IF NOT EXISTS {schema}.wh_schema_migrations (
       version    integer     PRIMARY KEY,
       name       text        NOT NULL,
       checksum   text        NOT NULL,
       applied_by text        NOT NULL,
       applied_at timestamptz NOT NULL DEFAULT now()
     );";
const HISTORY_EXISTS: &str = "SELECT to_regclass($1) IS NOT NULL";
const APPLIED_MIGRATIONS: &str =
    "SELECT version, name, checksum FROM {schema}.wh_schema_migrations";
const LATEST_MIGRATION: &str = "SELECT max(version) FROM {schema}.wh_schema_migrations";
const RECORD_MIGRATION: &str = "INSERT INTO {schema}.wh_schema_migrations
     (version, name, checksum, applied_by) VALUES ($1, $2, $3, $4)";
const REMOVE_SUBSCRIPTIONS: &str = "DELETE FROM {schema}.wh_perspective_subscriptions s
     WHERE NOT EXISTS (SELECT 1 FROM unnest($1::text[], $2::text[]) AS c(p, e)
                       WHERE c.p = s.perspective_name AND c.e = s.event_type)
     RETURNING perspective_name, event_type";
const ADD_SUBSCRIPTIONS: &str = "INSERT INTO {schema}.wh_perspective_subscriptions
         (perspective_name, event_type)
     SELECT p, e FROM unnest($1::text[], $2::text[]) AS c(p, e)
     ON CONFLICT DO NOTHING
     RETURNING perspective_name, event_type";
const SET_LOCAL_SEARCH_PATH: &str = "SET LOCAL search_path TO {schema}, public";
const RECORD_COMPILED: &str = "INSERT INTO {schema}.wh_perspectives
         (perspective_name, definition_hash, apply_function, version, handlers_hash, definition)
     VALUES ($1, $2, $3, $4, $5, $6)
     ON CONFLICT (perspective_name) DO UPDATE
       SET definition_hash = excluded.definition_hash, apply_function = excluded.apply_function,
           version = excluded.version, handlers_hash = excluded.handlers_hash,
           definition = excluded.definition, updated_at = now()
     WHERE wh_perspectives.definition_hash <> excluded.definition_hash
        OR wh_perspectives.handlers_hash IS DISTINCT FROM excluded.handlers_hash
        OR wh_perspectives.definition IS DISTINCT FROM excluded.definition";
const RECORDED_PERSPECTIVES: &str =
    "SELECT perspective_name, version, handlers_hash FROM {schema}.wh_perspectives";
const COUNT_EVENTS_OF_TYPES: &str =
    "SELECT count(*) FROM {schema}.wh_event_store WHERE event_type = ANY ($1)";
const COMPILED_DEFINITIONS: &str =
    "SELECT perspective_name, definition_hash FROM {schema}.wh_perspectives";

/// (perspective, event type) pairs.
pub type Subscriptions = Vec<(String, String)>;

/// `server_version_num` of the server.
pub async fn server_version(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar(SERVER_VERSION)
        .fetch_one(&mut *conn)
        .await
}

/// Wait for the schema's migration lock (held until the transaction ends).
pub async fn lock_migrations(tx: &mut PgConnection, schema: &str) -> Result<(), sqlx::Error> {
    sqlx::query(LOCK_MIGRATIONS)
        .bind(schema)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Create the schema and its migration history table if missing.
pub async fn create_schema(tx: &mut PgConnection, schema: &str) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(&super::sql(schema, CREATE_SCHEMA))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Applied migrations: version → (file name, checksum).
pub async fn applied_migrations(
    tx: &mut PgConnection,
    schema: &str,
) -> Result<BTreeMap<i32, (String, String)>, sqlx::Error> {
    let rows = sqlx::query(&super::sql(schema, APPLIED_MIGRATIONS))
        .fetch_all(&mut *tx)
        .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect())
}

/// The highest applied migration, None when the schema has no migration history.
pub async fn latest_migration(
    conn: &mut PgConnection,
    schema: &str,
) -> Result<Option<i32>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar(HISTORY_EXISTS)
        .bind(format!("{schema}.wh_schema_migrations"))
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(None);
    }
    sqlx::query_scalar(&super::sql(schema, LATEST_MIGRATION))
        .fetch_one(&mut *conn)
        .await
}

/// Run migration `m` for `schema` and record it in the history.
pub async fn apply_migration(
    tx: &mut PgConnection,
    schema: &str,
    m: &Migration,
    applied_by: &str,
) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(&m.render(schema)).execute(&mut *tx).await?;
    sqlx::query(&super::sql(schema, RECORD_MIGRATION))
        .bind(m.version)
        .bind(m.name)
        .bind(m.checksum())
        .bind(applied_by)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Make `wh_perspective_subscriptions` equal to `wanted`; returns (removed, added).
pub async fn sync_subscriptions(
    tx: &mut PgConnection,
    schema: &str,
    wanted: &[(String, String)],
) -> Result<(Subscriptions, Subscriptions), sqlx::Error> {
    let (perspectives, event_types): (Vec<String>, Vec<String>) = wanted.iter().cloned().unzip();
    let mut changed = Vec::new();
    for statement in [REMOVE_SUBSCRIPTIONS, ADD_SUBSCRIPTIONS] {
        let rows = sqlx::query(&super::sql(schema, statement))
            .bind(&perspectives)
            .bind(&event_types)
            .fetch_all(&mut *tx)
            .await?;
        changed.push(rows.iter().map(|r| (r.get(0), r.get(1))).collect());
    }
    let added = changed.pop().unwrap_or_default();
    let removed = changed.pop().unwrap_or_default();
    Ok((removed, added))
}

/// Resolve unqualified names in the schema first for the rest of the transaction (perspective
/// `setup` and handlers name their tables that way).
/// `SET LOCAL search_path` to `home` (a blue/green version's own schema), if any, then
/// `schema`, then public.
pub async fn set_local_search_path_in(
    tx: &mut PgConnection,
    home: Option<&str>,
    schema: &str,
) -> Result<(), sqlx::Error> {
    let path = match home {
        Some(home) => format!("{home}, {schema}"),
        None => schema.to_string(),
    };
    // Validated and generated identifiers: no quoting needed.
    sqlx::raw_sql(&format!("SET LOCAL search_path TO {path}, public"))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

pub async fn set_local_search_path(tx: &mut PgConnection, schema: &str) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, SET_LOCAL_SEARCH_PATH))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Run a script of one or more statements (a perspective's `setup`, a compiled function).
pub async fn execute_script(conn: &mut PgConnection, script: &str) -> Result<(), sqlx::Error> {
    // A bare string without arguments goes as a simple query: several statements are fine.
    // (Not `raw_sql`: its future cannot be proven `Send` in the engine's blue/green switch.)
    sqlx::Executor::execute(&mut *conn, script).await?;
    Ok(())
}

/// Prepare `sql` with parameter `types` (proves a handler statement is valid; nothing runs).
/// Returns how many columns its result rows have (0: it returns no rows).
pub async fn prepare(
    conn: &mut PgConnection,
    sql: &str,
    types: &[PgTypeInfo],
) -> Result<usize, sqlx::Error> {
    let statement = conn.prepare_with(sql, types).await?;
    Ok(statement.columns().len())
}

/// What `migrate` records of a compiled perspective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledPerspective<'a> {
    pub name: &'a str,
    pub definition_hash: &'a str,
    pub function: &'a str,
    pub version: i32,
    pub handlers_hash: &'a str,
    /// The perspective's config as JSON (handlers in file order), for blue/green versions.
    pub definition: &'a str,
}

/// Record that a perspective is compiled into its function from its definition.
pub async fn record_compiled_perspective(
    tx: &mut PgConnection,
    schema: &str,
    p: &CompiledPerspective<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, RECORD_COMPILED))
        .bind(p.name)
        .bind(p.definition_hash)
        .bind(p.function)
        .bind(p.version)
        .bind(p.handlers_hash)
        .bind(p.definition)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Perspectives compiled by earlier runs: name → (version, handlers hash; None when recorded before 0006).
pub async fn recorded_perspectives(
    tx: &mut PgConnection,
    schema: &str,
) -> Result<HashMap<String, (i32, Option<String>)>, sqlx::Error> {
    let rows: Vec<(String, i32, Option<String>)> =
        sqlx::query_as(&super::sql(schema, RECORDED_PERSPECTIVES))
            .fetch_all(&mut *tx)
            .await?;
    Ok(rows.into_iter().map(|(n, v, h)| (n, (v, h))).collect())
}

/// Stored events of any of `event_types`.
pub async fn count_events_of_types(
    tx: &mut PgConnection,
    schema: &str,
    event_types: &[String],
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(&super::sql(schema, COUNT_EVENTS_OF_TYPES))
        .bind(event_types)
        .fetch_one(&mut *tx)
        .await
}

impl Store {
    /// The highest applied migration, None when the schema has none.
    pub async fn latest_migration(&self) -> Result<Option<i32>, sqlx::Error> {
        let mut conn = self
            .conn(self.deadlines.routine, "latest migration")
            .await?;
        conn.deadline()
            .run(latest_migration(&mut conn, self.schema()))
            .await
    }

    /// Definition hash of every compiled perspective, by name.
    pub async fn compiled_definitions(&self) -> Result<HashMap<String, String>, sqlx::Error> {
        let mut c = self
            .conn(self.deadlines.routine, "compiled definitions")
            .await?;
        let rows: Vec<(String, String)> = c
            .deadline()
            .run(sqlx::query_as(&self.sql(COMPILED_DEFINITIONS)).fetch_all(&mut *c))
            .await?;
        Ok(rows.into_iter().collect())
    }
}
