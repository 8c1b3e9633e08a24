//! `perspective-worker migrate`: bring a deployment's schema to this binary's version, register
//! the perspectives' subscriptions, run their `setup`, and prove every handler prepares.
//!
//! Everything happens in one transaction under a per-schema advisory lock, so concurrent runs
//! (several pods, a Job retried by Kubernetes) serialise and each migration applies once, and a
//! failure anywhere leaves the database as it was. `dry_run` does all of it and rolls back.

use std::collections::BTreeMap;

use sqlx::postgres::{PgConnection, PgTypeInfo};
use sqlx::{Connection, Executor, Row};

use crate::compile::{
    apply_function_name, create_apply_function, create_drain_function, definition_hash,
};
use crate::config::{Config, ConfigError, Problem};
use crate::db::describe_error;
use crate::migrations::{latest_version, Migration, MIGRATIONS};

/// Oldest server we support (`gen_random_uuid()` in core, `EXECUTE FUNCTION` triggers).
const MIN_SERVER_VERSION: i32 = 130000;

#[derive(Debug, Clone, Copy, Default)]
pub struct MigrateOptions {
    /// Do everything, report it, then roll back.
    pub dry_run: bool,
}

/// What a migrate run did (or, for a dry run, would do).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MigrateReport {
    pub schema: String,
    pub dry_run: bool,
    /// Migrations applied by this run, by file name.
    pub applied: Vec<String>,
    /// Migrations that were already applied.
    pub already_applied: usize,
    /// (perspective, event type) pairs added / removed.
    pub subscriptions_added: Vec<(String, String)>,
    pub subscriptions_removed: Vec<(String, String)>,
    /// Perspectives whose `setup` ran.
    pub setups_run: Vec<String>,
    /// Handler and reset statements prepared successfully.
    pub statements_prepared: usize,
    /// Perspectives compiled into their apply functions.
    pub apply_functions: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("database error while {step}: {message}")]
    Database {
        step: String,
        message: String,
        source: sqlx::Error,
    },
    #[error("PostgreSQL server version {found} is too old: 13 or newer is required")]
    ServerTooOld { found: i32 },
    #[error(
        "schema {schema}: migration {version} ({name}) was applied with checksum {applied} but this \
         binary embeds checksum {embedded}; applied migrations must never change (add a new migration instead)"
    )]
    ChecksumMismatch {
        schema: String,
        version: i32,
        name: String,
        applied: String,
        embedded: String,
    },
    #[error(
        "schema {schema} has migration {version} applied, but this binary only knows migrations up to \
         {latest}: the database is newer than the binary; upgrade perspective-worker"
    )]
    DatabaseNewer {
        schema: String,
        version: i32,
        latest: i32,
    },
    /// A perspective's `setup`, `reset` or handler SQL does not run against the database.
    #[error("{0}")]
    InvalidPerspectives(ConfigError),
}

impl MigrateError {
    /// Whether the caller's input (the config) is at fault, as opposed to the database.
    pub fn is_invalid_input(&self) -> bool {
        matches!(self, MigrateError::InvalidPerspectives(_))
    }
}

fn db_err(step: impl Into<String>) -> impl FnOnce(sqlx::Error) -> MigrateError {
    let step = step.into();
    move |source| MigrateError::Database {
        message: describe_error(&source, None),
        step,
        source,
    }
}

/// Migrate `config.schema` on `conn`. See the module docs.
pub async fn migrate(
    conn: &mut PgConnection,
    config: &Config,
    source: &str,
    options: MigrateOptions,
) -> Result<MigrateReport, MigrateError> {
    let schema = config.schema.as_str();
    let mut report = MigrateReport {
        schema: schema.to_string(),
        dry_run: options.dry_run,
        ..Default::default()
    };

    let server_version: i32 =
        sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
            .fetch_one(&mut *conn)
            .await
            .map_err(db_err("reading the server version"))?;
    if server_version < MIN_SERVER_VERSION {
        return Err(MigrateError::ServerTooOld {
            found: server_version,
        });
    }

    let mut tx = conn
        .begin()
        .await
        .map_err(db_err("starting the migration transaction"))?;
    // Roll back explicitly on failure: a dropped sqlx transaction only rolls back when its
    // connection is next used, and until then it would keep holding the migration lock.
    let outcome = migrate_in(&mut tx, config, source, &mut report).await;
    match outcome {
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
        Ok(()) if options.dry_run => {
            tx.rollback()
                .await
                .map_err(db_err("rolling back the dry run"))?;
            Ok(report)
        }
        Ok(()) => {
            tx.commit()
                .await
                .map_err(db_err("committing the migration"))?;
            Ok(report)
        }
    }
}

async fn migrate_in(
    tx: &mut PgConnection,
    config: &Config,
    source: &str,
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let schema = config.schema.as_str();
    // Serialise migrations of this schema across processes; released at commit/rollback.
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtext('perspective-worker migrate'), hashtext($1))",
    )
    .bind(schema)
    .execute(&mut *tx)
    .await
    .map_err(db_err("waiting for the migration lock"))?;

    sqlx::raw_sql(&format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {schema}.wh_schema_migrations (
           version    integer     PRIMARY KEY,
           name       text        NOT NULL,
           checksum   text        NOT NULL,
           applied_by text        NOT NULL,
           applied_at timestamptz NOT NULL DEFAULT now()
         );"
    ))
    .execute(&mut *tx)
    .await
    .map_err(db_err(format!("creating schema {schema}")))?;

    let applied: BTreeMap<i32, (String, String)> = sqlx::query(&format!(
        "SELECT version, name, checksum FROM {schema}.wh_schema_migrations"
    ))
    .fetch_all(&mut *tx)
    .await
    .map_err(db_err("reading applied migrations"))?
    .into_iter()
    .map(|r| {
        (
            r.get::<i32, _>(0),
            (r.get::<String, _>(1), r.get::<String, _>(2)),
        )
    })
    .collect();
    check_applied(schema, &applied)?;

    for m in MIGRATIONS {
        if applied.contains_key(&m.version) {
            report.already_applied += 1;
            continue;
        }
        apply_one(tx, schema, m).await?;
        report.applied.push(m.name.to_string());
    }

    sync_subscriptions(tx, config, report).await?;
    setup_and_prepare(tx, config, source, report).await
}

/// Refuse to touch a schema whose history disagrees with this binary.
fn check_applied(
    schema: &str,
    applied: &BTreeMap<i32, (String, String)>,
) -> Result<(), MigrateError> {
    for (version, (name, checksum)) in applied {
        match MIGRATIONS.iter().find(|m| m.version == *version) {
            None => {
                return Err(MigrateError::DatabaseNewer {
                    schema: schema.to_string(),
                    version: *version,
                    latest: latest_version(),
                })
            }
            Some(m) if m.checksum() != *checksum => {
                return Err(MigrateError::ChecksumMismatch {
                    schema: schema.to_string(),
                    version: *version,
                    name: name.clone(),
                    applied: checksum.clone(),
                    embedded: m.checksum(),
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

async fn apply_one(
    conn: &mut PgConnection,
    schema: &str,
    m: &Migration,
) -> Result<(), MigrateError> {
    tracing::info!(schema, migration = m.name, "applying migration");
    sqlx::raw_sql(&m.render(schema))
        .execute(&mut *conn)
        .await
        .map_err(db_err(format!("applying migration {}", m.name)))?;
    sqlx::query(&format!(
        "INSERT INTO {schema}.wh_schema_migrations (version, name, checksum, applied_by) VALUES ($1, $2, $3, $4)"
    ))
    .bind(m.version)
    .bind(m.name)
    .bind(m.checksum())
    .bind(concat!("perspective-worker ", env!("CARGO_PKG_VERSION")))
    .execute(&mut *conn)
    .await
    .map_err(db_err(format!("recording migration {}", m.name)))?;
    Ok(())
}

/// Make `wh_perspective_subscriptions` equal to what the config declares.
async fn sync_subscriptions(
    conn: &mut PgConnection,
    config: &Config,
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let schema = &config.schema;
    let (perspectives, event_types): (Vec<String>, Vec<String>) =
        config.subscriptions().into_iter().unzip();
    let removed = sqlx::query(&format!(
        "DELETE FROM {schema}.wh_perspective_subscriptions s
         WHERE NOT EXISTS (SELECT 1 FROM unnest($1::text[], $2::text[]) AS c(p, e)
                           WHERE c.p = s.perspective_name AND c.e = s.event_type)
         RETURNING perspective_name, event_type"
    ))
    .bind(&perspectives)
    .bind(&event_types)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_err("removing stale subscriptions"))?;
    report.subscriptions_removed = removed.iter().map(|r| (r.get(0), r.get(1))).collect();
    let added = sqlx::query(&format!(
        "INSERT INTO {schema}.wh_perspective_subscriptions (perspective_name, event_type)
         SELECT p, e FROM unnest($1::text[], $2::text[]) AS c(p, e)
         ON CONFLICT DO NOTHING
         RETURNING perspective_name, event_type"
    ))
    .bind(&perspectives)
    .bind(&event_types)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_err("registering subscriptions"))?;
    report.subscriptions_added = added.iter().map(|r| (r.get(0), r.get(1))).collect();
    Ok(())
}

/// Run each perspective's `setup`, then prepare its `reset` and handler statements with the
/// parameter types the runner binds, so a typo fails here rather than on the first event.
/// Every problem is collected (each statement runs in its own savepoint) and reported together.
async fn setup_and_prepare(
    conn: &mut PgConnection,
    config: &Config,
    source: &str,
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let schema = &config.schema;
    sqlx::query(&format!("SET LOCAL search_path TO {schema}, public"))
        .execute(&mut *conn)
        .await
        .map_err(db_err("setting search_path"))?;

    let mut problems = Vec::new();
    for (index, p) in config.perspectives.iter().enumerate() {
        let at = |field: &str| format!("perspectives[{index}] ({}).{field}", p.name);
        if let Some(setup) = p.setup.as_deref().filter(|s| !s.trim().is_empty()) {
            let mut sp = conn.begin().await.map_err(db_err("opening a savepoint"))?;
            match sqlx::raw_sql(setup).execute(&mut *sp).await {
                Ok(_) => {
                    sp.commit().await.map_err(db_err("releasing a savepoint"))?;
                    report.setups_run.push(p.name.clone());
                }
                Err(e) => {
                    sp.rollback()
                        .await
                        .map_err(db_err("rolling back a savepoint"))?;
                    problems.push(Problem {
                        path: at("setup"),
                        message: describe_error(&e, Some(setup)),
                    });
                    // Its handlers would only repeat the failure (missing tables).
                    continue;
                }
            }
        }

        let mut statements = Vec::new();
        if let Some(reset) = p.reset.as_deref() {
            for stmt in crate::sql_params::parse_statements(reset).map_err(|e| {
                MigrateError::InvalidPerspectives(ConfigError {
                    source: source.to_string(),
                    problems: vec![Problem {
                        path: at("reset"),
                        message: e.to_string(),
                    }],
                })
            })? {
                statements.push((at("reset"), stmt));
            }
        }
        for (event_type, stmts) in p.compiled_handlers() {
            for stmt in stmts {
                statements.push((at(&format!("handlers.{event_type}")), stmt));
            }
        }
        for (path, stmt) in statements {
            let (sql, params) = stmt.to_positional();
            let types: Vec<PgTypeInfo> = params
                .iter()
                .map(|p| PgTypeInfo::with_name(p.pg_type()))
                .collect();
            let mut sp = conn.begin().await.map_err(db_err("opening a savepoint"))?;
            match (&mut *sp).prepare_with(&sql, &types).await {
                Ok(_) => {
                    sp.commit().await.map_err(db_err("releasing a savepoint"))?;
                    report.statements_prepared += 1;
                }
                Err(e) => {
                    sp.rollback()
                        .await
                        .map_err(db_err("rolling back a savepoint"))?;
                    problems.push(Problem {
                        path,
                        message: describe_error(&e, Some(&sql)),
                    });
                }
            }
        }
    }
    if !problems.is_empty() {
        return Err(MigrateError::InvalidPerspectives(ConfigError {
            source: source.to_string(),
            problems,
        }));
    }

    // Every statement prepares: compile each perspective into its apply function.
    for (index, p) in config.perspectives.iter().enumerate() {
        let sql = create_apply_function(schema, p);
        let mut sp = conn.begin().await.map_err(db_err("opening a savepoint"))?;
        match sqlx::raw_sql(&sql).execute(&mut *sp).await {
            Ok(_) => sp.commit().await.map_err(db_err("releasing a savepoint"))?,
            Err(e) => {
                sp.rollback()
                    .await
                    .map_err(db_err("rolling back a savepoint"))?;
                problems.push(Problem {
                    path: format!("perspectives[{index}] ({}).handlers", p.name),
                    message: format!(
                        "cannot compile the apply function: {}",
                        describe_error(&e, None)
                    ),
                });
                continue;
            }
        }
        sqlx::query(&format!(
            "INSERT INTO {schema}.wh_perspectives (perspective_name, definition_hash, apply_function)
             VALUES ($1, $2, $3)
             ON CONFLICT (perspective_name) DO UPDATE
               SET definition_hash = excluded.definition_hash, apply_function = excluded.apply_function,
                   updated_at = now()
             WHERE wh_perspectives.definition_hash <> excluded.definition_hash"
        ))
        .bind(&p.name)
        .bind(definition_hash(schema, p))
        .bind(apply_function_name(&p.name))
        .execute(&mut *conn)
        .await
        .map_err(db_err("recording the compiled perspective"))?;
        report.apply_functions += 1;
    }
    if !problems.is_empty() {
        return Err(MigrateError::InvalidPerspectives(ConfigError {
            source: source.to_string(),
            problems,
        }));
    }
    sqlx::raw_sql(&create_drain_function(schema, &config.perspectives))
        .execute(&mut *conn)
        .await
        .map_err(db_err("compiling the drain function"))?;
    Ok(())
}
