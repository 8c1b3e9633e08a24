//! The engine's server-side functions: one file each in `functions/`, holding its current
//! definition (`CREATE OR REPLACE`, `{{schema}}` placeholders as in the migrations). Migrations
//! hold tables, indexes, types and data; the functions they defined before 0018 are history.
//!
//! `migrate` installs the whole set after the migrations, in the same transaction
//! ([`install`]): it drops an older overload of a name whose argument list or result differs from
//! the file's (CREATE OR REPLACE can change neither, and a stale overload would linger), replaces
//! the rest in place (so their grants and oids stay), and records [`hash`] in
//! `wh_schema_functions` with a digest of the functions as the server then prints them. `run`
//! refuses a schema whose recorded hash is not its binary's, or whose functions no longer print
//! as recorded ([`Store::functions_problem`]).

use sha2::{Digest, Sha256};
use sqlx::postgres::PgConnection;
use sqlx::Connection;

use super::migrations::PLACEHOLDER;
use super::Store;

/// One engine function (or trigger function): its name and its file.
#[derive(Debug, Clone, Copy)]
pub struct Function {
    pub name: &'static str,
    pub template: &'static str,
}

macro_rules! functions {
    ($($name:literal),* $(,)?) => {
        &[$(Function {
            name: $name,
            template: include_str!(concat!("functions/", $name, ".sql")),
        }),*]
    };
}

/// Every engine function, in install order: what others call first (PL/pgSQL resolves calls at
/// run time, so the order only matters for SQL-language bodies, which are checked at creation).
pub const FUNCTIONS: &[Function] = functions![
    "wh_uuid_v7",
    "wh_run_events",
    "compute_partition",
    "wh_backfill_gated",
    "wh_applied_by_all",
    "complete_perspective_events",
    "complete_applied_events",
    "cleanup_completed_streams",
    "wh_settled_without_retry",
    "wh_queue_stream",
    // The producer path.
    "wh_event_store_before_insert",
    "wh_event_store_immutable",
    "append_events",
    "wh_delete_applied_events",
    // Instances.
    "record_heartbeat",
    "cleanup_stale_instances",
    "hand_over_streams",
    "deregister_instance",
    // Claiming, fetching, dead letters.
    "claim_work",
    "wh_claim_awake",
    "claim_and_fetch_pending_perspective_events",
    "move_to_dead_letters",
    // Backfill and rebuild jobs.
    "wh_job_start",
    "wh_job_blockers",
    "wh_job_advance",
    "wh_job_take_streams",
    "wh_job_requeue_streams",
    // Blue/green versions.
    "wh_version_move",
    "wh_version_adopt_work",
    "wh_version_switch",
];

impl Function {
    /// The SQL for `schema` (a validated identifier: no quoting needed).
    pub fn render(&self, schema: &str) -> String {
        self.template.replace(PLACEHOLDER, schema)
    }

    /// The definition header, exactly as the file spells it.
    fn header(&self) -> String {
        format!("CREATE OR REPLACE FUNCTION {PLACEHOLDER}.{}(", self.name)
    }

    /// The SQL for `schema`, defining the function under the name `name`.
    fn render_as(&self, schema: &str, name: &str) -> String {
        let header = format!("CREATE OR REPLACE FUNCTION {PLACEHOLDER}.{name}(");
        self.template
            .replacen(&self.header(), &header, 1)
            .replace(PLACEHOLDER, schema)
    }
}

/// SHA-256 (hex) of every function rendered for `schema`, in order: what `migrate` records and
/// `run` expects.
pub fn hash(schema: &str) -> String {
    let mut h = Sha256::new();
    for f in FUNCTIONS {
        let sql = f.render(schema);
        // Length-prefixed, so no two different sets hash alike.
        for part in [f.name, sql.as_str()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
    }
    hex::encode(h.finalize())
}

fn names() -> Vec<&'static str> {
    FUNCTIONS.iter().map(|f| f.name).collect()
}

/// Prefix of the name a function is created under to read its signature (see [`signatures`]).
const PROBE_PREFIX: &str = "wh_probe_";
const PROBE_UNCHECKED: &str = "SET LOCAL check_function_bodies = off";
/// Row: name, arguments (names, types, defaults), result, as PostgreSQL prints them.
const PROBE_SIGNATURES: &str =
    "SELECT substr(p.proname, length($3::text) + 1), pg_get_function_arguments(p.oid),
         pg_get_function_result(p.oid)
     FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE n.nspname = $1 AND p.proname = ANY ($2)";
/// `DROP FUNCTION` for each function of the schema named like one of the files whose arguments
/// or result differ from the file's (an older binary's shape).
const OLDER_OVERLOADS: &str = "SELECT format('DROP FUNCTION %I.%I(%s)', n.nspname, p.proname,
         pg_get_function_identity_arguments(p.oid))
     FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE n.nspname = $1 AND p.proname = ANY ($2)
       AND NOT EXISTS (SELECT 1 FROM unnest($2::text[], $3::text[], $4::text[]) AS f(name, args, result)
                       WHERE f.name = p.proname AND f.args = pg_get_function_arguments(p.oid)
                         AND f.result = pg_get_function_result(p.oid))";
/// The schema's functions of these names as the server prints them, hashed: changes when any
/// is replaced, altered, dropped or overloaded. Ordered without `regprocedure` (whose text
/// depends on the search_path).
const CATALOG_DIGEST: &str = "SELECT encode(sha256(convert_to(coalesce(string_agg(
         pg_get_functiondef(p.oid), E'\\n' ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)),
         ''), 'UTF8')), 'hex')
     FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE n.nspname = $1 AND p.proname = ANY ($2)";
const RECORDED: &str = "SELECT hash, catalog_digest FROM {schema}.wh_schema_functions";
const RECORD: &str = "INSERT INTO {schema}.wh_schema_functions (hash, catalog_digest, installed_by)
     VALUES ($1, $2, $3)
     ON CONFLICT (singleton) DO UPDATE
       SET hash = excluded.hash, catalog_digest = excluded.catalog_digest,
           installed_by = excluded.installed_by, installed_at = now()";
/// `append_events` runs as its owner (SECURITY DEFINER): only the roles granted EXECUTE (the
/// producers) may call it, not every role (PostgreSQL grants EXECUTE to PUBLIC by default).
const PRODUCERS_ONLY: &str =
    "REVOKE ALL ON FUNCTION {schema}.append_events(uuid, bigint, jsonb) FROM PUBLIC";
const TABLE_EXISTS: &str = "SELECT to_regclass($1) IS NOT NULL";

/// What `wh_schema_functions` records: the hash of the installed set and the catalog digest
/// taken right after installing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub hash: String,
    pub catalog_digest: String,
}

/// The recorded installation, None when the schema has none (no table, or no row).
pub async fn recorded(
    conn: &mut PgConnection,
    schema: &str,
) -> Result<Option<Recorded>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar(TABLE_EXISTS)
        .bind(format!("{schema}.wh_schema_functions"))
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(None);
    }
    let row: Option<(String, String)> = sqlx::query_as(&super::sql(schema, RECORDED))
        .fetch_optional(&mut *conn)
        .await?;
    Ok(row.map(|(hash, catalog_digest)| Recorded {
        hash,
        catalog_digest,
    }))
}

/// Digest of the schema's engine functions as the server prints them now.
pub async fn catalog_digest(conn: &mut PgConnection, schema: &str) -> Result<String, sqlx::Error> {
    sqlx::query_scalar(CATALOG_DIGEST)
        .bind(schema)
        .bind(names())
        .fetch_one(&mut *conn)
        .await
}

/// Whether the schema's functions are this binary's, untouched since they were installed.
pub async fn up_to_date(conn: &mut PgConnection, schema: &str) -> Result<bool, sqlx::Error> {
    Ok(match recorded(conn, schema).await? {
        Some(r) => {
            r.hash == hash(schema) && r.catalog_digest == catalog_digest(conn, schema).await?
        }
        None => false,
    })
}

/// Install every function for `schema` in the caller's transaction and record the set (see the
/// module docs). The migrations must have run (tables, and `wh_schema_functions`).
pub async fn install(
    tx: &mut PgConnection,
    schema: &str,
    installed_by: &str,
) -> Result<(), sqlx::Error> {
    let (names, args, results) = signatures(tx, schema).await?;
    let drops: Vec<String> = sqlx::query_scalar(OLDER_OVERLOADS)
        .bind(schema)
        .bind(&names)
        .bind(&args)
        .bind(&results)
        .fetch_all(&mut *tx)
        .await?;
    for drop in drops {
        tracing::info!(schema, statement = %drop, "dropping an engine function of an older shape");
        sqlx::raw_sql(&drop).execute(&mut *tx).await?;
    }
    for f in FUNCTIONS {
        sqlx::raw_sql(&f.render(schema)).execute(&mut *tx).await?;
    }
    sqlx::raw_sql(&super::sql(schema, PRODUCERS_ONLY))
        .execute(&mut *tx)
        .await?;
    let digest = catalog_digest(tx, schema).await?;
    sqlx::query(&super::sql(schema, RECORD))
        .bind(hash(schema))
        .bind(digest)
        .bind(installed_by)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// The files' signatures (names, arguments, results) as PostgreSQL prints them, read from the
/// files themselves: each is created under a probe name in the schema (bodies unchecked) inside a
/// savepoint that is then rolled back, so nothing of it stays and no table is locked.
async fn signatures(
    tx: &mut PgConnection,
    schema: &str,
) -> Result<(Vec<String>, Vec<String>, Vec<String>), sqlx::Error> {
    let mut sp = tx.begin().await?;
    sqlx::raw_sql(PROBE_UNCHECKED).execute(&mut *sp).await?;
    let mut probes = Vec::new();
    for f in FUNCTIONS {
        let probe = format!("{PROBE_PREFIX}{}", f.name);
        sqlx::raw_sql(&f.render_as(schema, &probe))
            .execute(&mut *sp)
            .await?;
        probes.push(probe);
    }
    let rows: Vec<(String, String, String)> = sqlx::query_as(PROBE_SIGNATURES)
        .bind(schema)
        .bind(&probes)
        .bind(PROBE_PREFIX)
        .fetch_all(&mut *sp)
        .await?;
    sp.rollback().await?;
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for (name, args, result) in rows {
        out.0.push(name);
        out.1.push(args);
        out.2.push(result);
    }
    Ok(out)
}

impl Store {
    /// Why the schema's engine functions are not the ones this binary runs with, if they are
    /// not: none recorded, recorded by another binary, or changed since they were installed.
    pub async fn functions_problem(&self) -> Result<Option<String>, sqlx::Error> {
        let limit = self.deadlines.routine;
        let mut conn = self.conn(limit, "recorded engine functions").await?;
        let schema = self.schema();
        let Some(recorded) = conn.deadline().run(recorded(&mut conn, schema)).await? else {
            return Ok(Some("has no engine functions recorded as installed".into()));
        };
        let expected = hash(schema);
        if recorded.hash != expected {
            return Ok(Some(format!(
                "has engine functions installed by another binary (hash {}, this binary's is {expected})",
                recorded.hash
            )));
        }
        if recorded.catalog_digest
            != conn
                .limit(limit, "engine functions' catalog digest")
                .run(catalog_digest(&mut conn, schema))
                .await?
        {
            return Ok(Some(
                "has engine functions that were changed, dropped or overloaded since `migrate` installed them"
                    .into(),
            ));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_file_and_each_file_defines_its_name() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store/functions");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        let mut listed: Vec<String> = FUNCTIONS
            .iter()
            .map(|f| format!("{}.sql", f.name))
            .collect();
        listed.sort();
        assert_eq!(
            files,
            listed,
            "every file in {} is listed once in FUNCTIONS",
            dir.display()
        );
        for f in FUNCTIONS {
            let upper = f.template.to_uppercase();
            assert_eq!(
                upper.matches("CREATE OR REPLACE FUNCTION").count(),
                1,
                "{}.sql defines one function",
                f.name
            );
            assert_eq!(
                f.template.matches(&f.header()).count(),
                1,
                "{}.sql starts its definition with `{}`",
                f.name,
                f.header()
            );
            assert!(
                !upper.contains("CREATE FUNCTION"),
                "{}.sql: CREATE OR REPLACE",
                f.name
            );
            assert!(
                !f.render("shop").contains("{{"),
                "{}.sql keeps a placeholder",
                f.name
            );
            assert!(
                f.render_as("shop", "p").contains("FUNCTION shop.p("),
                "{}.sql",
                f.name
            );
        }
    }

    #[test]
    fn hash_covers_the_schema_and_is_hex() {
        assert_eq!(hash("shop"), hash("shop"));
        assert_ne!(hash("shop"), hash("shop2"));
        assert_eq!(hash("shop").len(), 64);
    }

    #[test]
    fn no_comment_points_at_a_migration() {
        for f in FUNCTIONS {
            for line in f
                .template
                .lines()
                .filter(|l| l.trim_start().starts_with("--"))
            {
                let numbered = line.split(|c: char| !c.is_ascii_alphanumeric()).any(|w| {
                    w.len() == 4 && w.starts_with("00") && w.bytes().all(|b| b.is_ascii_digit())
                });
                assert!(
                    !numbered && !line.to_lowercase().contains("migration"),
                    "{}.sql: {line}",
                    f.name
                );
            }
        }
    }
}
