//! Blue/green versions (DESIGN §12.6): the version rows of `wh_perspective_versions`, building a
//! version beside the live one, retiring and forgetting versions, and the switch's statements.
//! Names and the perspectives a deployment runs are in [`crate::config::versions`].

use sqlx::postgres::PgConnection;
use sqlx::Row;

use super::names::{apply_function_name, batch_function_name, key_function_name};

const ALL: &str = "SELECT perspective_name, version, state, definition, switched_at IS NOT NULL
     FROM {schema}.wh_perspective_versions ORDER BY perspective_name, version";
/// Versions being built, each with the definition its live version was compiled from.
const BUILDING: &str = "SELECT v.perspective_name, v.version, p.definition
     FROM {schema}.wh_perspective_versions v
     JOIN {schema}.wh_perspectives p ON p.perspective_name = v.perspective_name
     WHERE v.state = 'building' AND p.definition IS NOT NULL
     ORDER BY v.perspective_name";
const DEFINITIONS: &str =
    "SELECT perspective_name, definition FROM {schema}.wh_perspectives ORDER BY perspective_name";
const SET_STATE: &str = "INSERT INTO {schema}.wh_perspective_versions
         (perspective_name, version, state, definition)
     VALUES ($1, $2, $3, $4)
     ON CONFLICT (perspective_name, version) DO UPDATE
       SET state = excluded.state, definition = excluded.definition";
const DELETE_ROW: &str =
    "DELETE FROM {schema}.wh_perspective_versions WHERE perspective_name = $1 AND version = $2";
const DELETE_ROWS_OF_REMOVED: &str = "DELETE FROM {schema}.wh_perspective_versions
     WHERE perspective_name <> ALL ($1)";
const KEEP_CURSORS: &str =
    "UPDATE {schema}.wh_perspective_jobs SET keep_cursors = true WHERE perspective_name = $1";
/// What a version that stops applying leaves: its pending work, subscriptions, job and record
/// (its cursors and dead letters stay, for a rollback).
const RETIRE: [&str; 5] = [
    "DELETE FROM {schema}.wh_perspective_events WHERE perspective_name = $1",
    "DELETE FROM {schema}.wh_perspective_subscriptions WHERE perspective_name = $1",
    "DELETE FROM {schema}.wh_perspective_job_streams WHERE perspective_name = $1",
    "DELETE FROM {schema}.wh_perspective_jobs WHERE perspective_name = $1",
    "DELETE FROM {schema}.wh_perspectives WHERE perspective_name = $1",
];
const FORGET: [&str; 2] = [
    "DELETE FROM {schema}.wh_perspective_cursors WHERE perspective_name = $1",
    "DELETE FROM {schema}.wh_dead_letters WHERE perspective_name = $1",
];
const TRY_LOCK_MIGRATIONS: &str =
    "SELECT pg_try_advisory_xact_lock(hashtext('perspective-worker migrate'), hashtext($1))";
/// A switch waits at most this long for a lock (readers queue behind it meanwhile); past it,
/// it gives up and tries again later.
const SWITCH_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '2s'";
/// Whether the version being built has caught up: its job's state, the age of its oldest
/// unapplied work row, its pending dead letters.
const READINESS: &str = "SELECT
       (SELECT j.state FROM {schema}.wh_perspective_jobs j WHERE j.perspective_name = $1),
       (SELECT extract(epoch FROM now() - min(w.created_at))::float8
        FROM {schema}.wh_perspective_events w
        WHERE w.perspective_name = $1 AND w.processed_at IS NULL),
       (SELECT count(*) FROM {schema}.wh_dead_letters d
        WHERE d.perspective_name = $1 AND d.recovery_status = {dead_letter_pending})";
const SWITCH: &str =
    "SELECT o_archived, o_moved_in FROM {schema}.wh_version_switch($1, $2, $3, $4, $5)";
/// Work rows that producers in flight at a switch created under the new live version's internal
/// name, given to the perspective (for a few minutes after each switch).
const ADOPT_STRAGGLERS: &str = "SELECT coalesce(sum({schema}.wh_version_adopt_work(
         v.perspective_name || '__v' || v.version, v.perspective_name)), 0)::int8
     FROM {schema}.wh_perspective_versions v
     WHERE v.state = 'live' AND v.switched_at > now() - interval '5 minutes'";
/// Cursors under the new live version's internal name, written after a switch by an applier
/// whose `wh_drain` call began before it (it recorded the missing function as a failure): the
/// version's cursors are the perspective's now.
const DROP_STALE_CURSORS: &str = "DELETE FROM {schema}.wh_perspective_cursors c
     USING {schema}.wh_perspective_versions v
     WHERE v.state = 'live' AND v.switched_at > now() - interval '5 minutes'
       AND c.perspective_name = v.perspective_name || '__v' || v.version";
/// Roles other than the owner that may queue work (the worker roles `grants` made): they write
/// the model tables, so they get the same rights in a version's home schema.
const WORKER_ROLES: &str = "SELECT DISTINCT quote_ident(pg_get_userbyid(a.grantee))
     FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
     WHERE c.oid = '{schema}.wh_perspective_events'::regclass
       AND a.privilege_type = 'INSERT' AND a.grantee <> c.relowner AND a.grantee <> 0
     ORDER BY 1";
/// What each of them gets in a home schema (`{home}`, `{role}`): what `grants worker` gives in
/// the deployment schema, for the tables there and those `setup` creates.
const SHARE_HOME: [&str; 5] = [
    "GRANT USAGE ON SCHEMA {home} TO {role}",
    "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA {home} TO {role}",
    "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {home} TO {role}",
    "ALTER DEFAULT PRIVILEGES IN SCHEMA {home} GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLES TO {role}",
    "ALTER DEFAULT PRIVILEGES IN SCHEMA {home} GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {role}",
];

/// Whether this session may act as the schema's owner (a switch moves tables, replaces functions).
const ACTS_AS_OWNER: &str = "SELECT coalesce(
       (SELECT pg_has_role(n.nspowner, 'USAGE') FROM pg_namespace n WHERE n.nspname = $1), false)";
const KEPT_BEYOND: &str = "SELECT version FROM {schema}.wh_perspective_versions
     WHERE perspective_name = $1 AND state = 'kept'
     ORDER BY switched_at DESC, version DESC OFFSET $2";

/// Where a version is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionState {
    Live,
    Building,
    Kept,
}

impl VersionState {
    pub fn as_str(self) -> &'static str {
        match self {
            VersionState::Live => "live",
            VersionState::Building => "building",
            VersionState::Kept => "kept",
        }
    }

    fn parse(s: &str) -> VersionState {
        match s {
            "building" => VersionState::Building,
            "kept" => VersionState::Kept,
            _ => VersionState::Live,
        }
    }
}

/// One row of `wh_perspective_versions`.
#[derive(Debug, Clone, PartialEq)]
pub struct VersionRow {
    pub perspective: String,
    pub version: i32,
    pub state: VersionState,
    /// The version's config, as JSON.
    pub definition: String,
    /// Whether it was ever live (a never-live version is dropped when its build is cancelled).
    pub was_live: bool,
}

/// Every version row.
pub async fn all(conn: &mut PgConnection, schema: &str) -> Result<Vec<VersionRow>, sqlx::Error> {
    let rows = sqlx::query(&super::sql(schema, ALL))
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows
        .iter()
        .map(|r| VersionRow {
            perspective: r.get(0),
            version: r.get(1),
            state: VersionState::parse(r.get::<&str, _>(2)),
            definition: r.get(3),
            was_live: r.get(4),
        })
        .collect())
}

/// Versions being built: (perspective, version, its live version's definition as JSON).
pub async fn building(
    conn: &mut PgConnection,
    schema: &str,
) -> Result<Vec<(String, i32, String)>, sqlx::Error> {
    sqlx::query_as(&super::sql(schema, BUILDING))
        .fetch_all(&mut *conn)
        .await
}

/// Every compiled perspective's recorded definition (None: compiled before 0020).
pub async fn definitions(
    conn: &mut PgConnection,
    schema: &str,
) -> Result<Vec<(String, Option<String>)>, sqlx::Error> {
    sqlx::query_as(&super::sql(schema, DEFINITIONS))
        .fetch_all(&mut *conn)
        .await
}

/// Record `version` of `perspective` in `state` with its definition.
pub async fn set_state(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    version: i32,
    state: VersionState,
    definition: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, SET_STATE))
        .bind(perspective)
        .bind(version)
        .bind(state.as_str())
        .bind(definition)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Create a version's home schema (its tables' place while it is not live).
pub async fn create_home(tx: &mut PgConnection, home: &str) -> Result<(), sqlx::Error> {
    // A generated identifier (config::versions::home_schema): no quoting needed.
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {home}"))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Give the worker roles of `schema` their rights in `home` (the build writes its tables there).
pub async fn share_home(
    tx: &mut PgConnection,
    schema: &str,
    home: &str,
) -> Result<(), sqlx::Error> {
    let roles: Vec<String> = sqlx::query_scalar(&super::sql(schema, WORKER_ROLES))
        .fetch_all(&mut *tx)
        .await?;
    for role in roles {
        for statement in SHARE_HOME {
            // A generated schema name and a quoted role name.
            let sql = statement.replace("{home}", home).replace("{role}", &role);
            sqlx::query(&sql).execute(&mut *tx).await?;
        }
    }
    Ok(())
}

/// Make `internal`'s (just started) job keep its cursors: a kept version catching up.
pub async fn keep_cursors(
    tx: &mut PgConnection,
    schema: &str,
    internal: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(&super::sql(schema, KEEP_CURSORS))
        .bind(internal)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Stop `internal` applying: its pending work, subscriptions, job, record and compiled
/// functions go; its cursors, dead letters and tables stay.
pub async fn retire(
    tx: &mut PgConnection,
    schema: &str,
    internal: &str,
) -> Result<(), sqlx::Error> {
    for statement in RETIRE {
        sqlx::query(&super::sql(schema, statement))
            .bind(internal)
            .execute(&mut *tx)
            .await?;
    }
    drop_functions(tx, schema, internal).await
}

/// Drop `perspective`'s compiled functions (generated identifiers: no quoting needed).
pub async fn drop_functions(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
) -> Result<(), sqlx::Error> {
    for function in [
        apply_function_name(perspective),
        batch_function_name(perspective),
        key_function_name(perspective),
    ] {
        sqlx::query(&format!("DROP FUNCTION IF EXISTS {schema}.{function}"))
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Forget a version that is not live: retire it, delete its cursors, dead letters and row, and
/// drop its home schema with its tables.
pub async fn forget(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    version: i32,
    internal: &str,
    home: &str,
) -> Result<(), sqlx::Error> {
    retire(tx, schema, internal).await?;
    for statement in FORGET {
        sqlx::query(&super::sql(schema, statement))
            .bind(internal)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query(&super::sql(schema, DELETE_ROW))
        .bind(perspective)
        .bind(version)
        .execute(&mut *tx)
        .await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {home} CASCADE"))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Delete the version rows of perspectives not in `configured` (their tables stay).
pub async fn delete_rows_of_removed(
    tx: &mut PgConnection,
    schema: &str,
    configured: &[String],
) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(&super::sql(schema, DELETE_ROWS_OF_REMOVED))
        .bind(configured)
        .execute(&mut *tx)
        .await?
        .rows_affected())
}

/// In a switch's transaction: take the schema's migration lock if it is free (a switch never
/// runs beside `migrate` or another switch) and bound its lock waits. False: not now.
pub async fn begin_switch(tx: &mut PgConnection, schema: &str) -> Result<bool, sqlx::Error> {
    let locked: bool = sqlx::query_scalar(TRY_LOCK_MIGRATIONS)
        .bind(schema)
        .fetch_one(&mut *tx)
        .await?;
    if locked {
        sqlx::query(SWITCH_LOCK_TIMEOUT).execute(&mut *tx).await?;
    }
    Ok(locked)
}

/// How far a version being built (`internal`) is from switching.
#[derive(Debug, Clone, PartialEq)]
pub struct Readiness {
    /// Its catch-up job's state (None: no job).
    pub job_state: Option<String>,
    /// Age of its oldest unapplied work row, in seconds (None: nothing pending).
    pub oldest_pending_seconds: Option<f64>,
    /// Its pending dead letters.
    pub dead_letters: i64,
}

pub async fn readiness(
    conn: &mut PgConnection,
    schema: &str,
    internal: &str,
) -> Result<Readiness, sqlx::Error> {
    let (job_state, oldest_pending_seconds, dead_letters) =
        sqlx::query_as(&super::sql(schema, READINESS))
            .bind(internal)
            .fetch_one(&mut *conn)
            .await?;
    Ok(Readiness {
        job_state,
        oldest_pending_seconds,
        dead_letters,
    })
}

/// The data half of the switch (`wh_version_switch`): returns (relations archived, relations
/// moved in).
pub async fn switch_tables(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    (live, next): (i32, i32),
    (live_home, next_home): (&str, &str),
) -> Result<(Vec<String>, Vec<String>), sqlx::Error> {
    sqlx::query_as(&super::sql(schema, SWITCH))
        .bind(perspective)
        .bind(live)
        .bind(next)
        .bind(live_home)
        .bind(next_home)
        .fetch_one(&mut *tx)
        .await
}

/// Kept versions of `perspective` beyond the newest `keep`.
pub async fn kept_beyond(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    keep: i64,
) -> Result<Vec<i32>, sqlx::Error> {
    sqlx::query_scalar(&super::sql(schema, KEPT_BEYOND))
        .bind(perspective)
        .bind(keep)
        .fetch_all(&mut *tx)
        .await
}

/// Give the perspectives the work rows producers in flight at a recent switch created under
/// the new live version's internal name (and drop cursors written under it since); returns how
/// many rows.
pub async fn adopt_stragglers(conn: &mut PgConnection, schema: &str) -> Result<i64, sqlx::Error> {
    sqlx::query(&super::sql(schema, DROP_STALE_CURSORS))
        .execute(&mut *conn)
        .await?;
    sqlx::query_scalar(&super::sql(schema, ADOPT_STRAGGLERS))
        .fetch_one(&mut *conn)
        .await
}

/// Whether this session has the rights of `schema`'s owner (which a switch needs).
pub async fn acts_as_owner(conn: &mut PgConnection, schema: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(ACTS_AS_OWNER)
        .bind(schema)
        .fetch_one(&mut *conn)
        .await
}
