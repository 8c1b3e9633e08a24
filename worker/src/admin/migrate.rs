//! `perspective-worker migrate`: bring a deployment's schema to this binary's version, register
//! the perspectives' subscriptions, run their `setup`, and prove every handler prepares.
//!
//! It also starts the perspectives' jobs (see [`crate::engine::catchup::plan`]): a backfill for a perspective new
//! to a schema that has history, a rebuild for one whose `version` changed; and it warns when
//! a perspective's handlers changed without a new version, or when it gained an event type of
//! which events are already stored (rows built before did not see them).
//!
//! Everything happens in one transaction under a per-schema advisory lock, so concurrent runs
//! (several pods, a Job retried by Kubernetes) serialise and each migration applies once, and a
//! failure anywhere leaves the database as it was. `dry_run` does all of it and rolls back.

use std::collections::{BTreeMap, HashMap};

use sqlx::postgres::{PgConnection, PgTypeInfo};
use sqlx::Connection;

use super::blue_green;
use crate::compile::{
    create_drain_function, create_perspective_functions, definition_hash, handlers_hash,
    runs_as_perform, sequencing_key_check,
};
use crate::config::sql_params::ParsedStatement;
use crate::config::versions::{self, Running};
use crate::config::{Config, ConfigError, Problem};
use crate::db::describe_error;
use crate::store::catchup::{self, JobKind};
use crate::store::functions;
use crate::store::migrations::{latest_version, Migration, MIGRATIONS};
use crate::store::names::apply_function_name;
use crate::store::removal::{self, Removed};
use crate::store::schema as store;

/// Who applied a migration or installed the functions, as recorded in the schema.
const APPLIED_BY: &str = concat!("perspective-worker ", env!("CARGO_PKG_VERSION"));

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
    /// Whether this run installed the engine functions (false: the schema already had this
    /// binary's, unchanged).
    pub functions_installed: bool,
    /// (perspective, event type) pairs added / removed.
    pub subscriptions_added: Vec<(String, String)>,
    pub subscriptions_removed: Vec<(String, String)>,
    /// Perspectives that left the config, with the work rows and cursors removed for each
    /// (their model tables are kept).
    pub perspectives_removed: Vec<Removed>,
    /// Streams unpinned because nothing is pending for them any more.
    pub streams_unpinned: u64,
    /// Perspectives whose `setup` ran.
    pub setups_run: Vec<String>,
    /// Handler and reset statements prepared successfully.
    pub statements_prepared: usize,
    /// Perspectives compiled into their apply functions.
    pub apply_functions: usize,
    /// Perspectives new to a schema with history: the workers backfill them.
    pub backfills: Vec<String>,
    /// Perspectives whose version changed: the workers rebuild them.
    pub rebuilds: Vec<VersionChange>,
    /// Blue/green perspectives whose version changed: the new version is built beside the live
    /// one (or a kept one caught up), and the workers switch once it caught up.
    pub version_builds: Vec<blue_green::VersionBuild>,
    /// What the user should know: handlers changed without a new version, event types gained
    /// with events already stored.
    pub warnings: Vec<String>,
}

/// A perspective's version change.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct VersionChange {
    pub perspective: String,
    pub from: i32,
    pub to: i32,
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

/// A blue/green plan's error as migrate's.
fn plan_error(e: blue_green::PlanError, source: &str) -> MigrateError {
    match e {
        blue_green::PlanError::Database { step, source } => db_err(step)(source),
        blue_green::PlanError::Invalid(problems) => {
            MigrateError::InvalidPerspectives(ConfigError {
                source: source.to_string(),
                problems,
            })
        }
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

    let server_version = store::server_version(conn)
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
    store::lock_migrations(tx, schema)
        .await
        .map_err(db_err("waiting for the migration lock"))?;
    store::create_schema(tx, schema)
        .await
        .map_err(db_err(format!("creating schema {schema}")))?;
    let applied = store::applied_migrations(tx, schema)
        .await
        .map_err(db_err("reading applied migrations"))?;
    check_applied(schema, &applied)?;

    for m in MIGRATIONS {
        if applied.contains_key(&m.version) {
            report.already_applied += 1;
            continue;
        }
        apply_one(tx, schema, m).await?;
        report.applied.push(m.name.to_string());
    }
    install_functions(tx, schema, report).await?;
    // An event store created by this run has no history to backfill.
    let fresh_store = !applied.contains_key(&1);
    let recorded = store::recorded_perspectives(tx, schema)
        .await
        .map_err(db_err("reading the compiled perspectives"))?;

    // What the deployment runs: a blue/green perspective whose next version is built runs as
    // its live version and the next one (under its internal name, in its home schema).
    let building = blue_green::plan(
        tx,
        config,
        &recorded,
        &mut report.version_builds,
        &mut report.warnings,
    )
    .await
    .map_err(|e| plan_error(e, source))?;
    let running = versions::running(config, &building);
    let run_config = versions::running_config(config, &running);
    sync_subscriptions(tx, &run_config, report).await?;
    let kept = blue_green::kept_internal_names(tx, schema)
        .await
        .map_err(|e| plan_error(e, source))?;
    remove_perspectives(tx, &run_config, &kept, report).await?;
    start_jobs(
        tx,
        config,
        source,
        &recorded,
        fresh_store,
        &building,
        report,
    )
    .await?;
    setup_and_prepare(tx, config, &running, source, report).await
}

/// Start a backfill for each perspective new to a schema with history and a rebuild for each
/// whose version changed (in this transaction, so the workers see the job with the
/// subscriptions); warn about changes a rebuild would be needed for.
async fn start_jobs(
    tx: &mut PgConnection,
    config: &Config,
    source: &str,
    recorded: &HashMap<String, (i32, Option<String>)>,
    fresh_store: bool,
    building: &[versions::Building],
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let schema = config.schema.as_str();
    let mut problems = Vec::new();
    for (index, p) in config.perspectives.iter().enumerate() {
        // Built beside the live version (blue/green), not rebuilt in place.
        if building.iter().any(|b| b.perspective == p.name) {
            continue;
        }
        let version = p.version as i32;
        let kind = match recorded.get(&p.name) {
            None if fresh_store => None,
            None => {
                report.backfills.push(p.name.clone());
                Some(JobKind::Backfill)
            }
            Some((from, _)) if *from != version => {
                if p.reset.is_none() {
                    problems.push(Problem {
                        path: format!("perspectives[{index}] ({}).version", p.name),
                        message: format!(
                            "changed from {from} to {version}, which rebuilds the perspective stream by stream, \
                             but it has no `reset` to clear a stream's share of the model: add one"
                        ),
                    });
                    continue;
                }
                report.rebuilds.push(VersionChange {
                    perspective: p.name.clone(),
                    from: *from,
                    to: version,
                });
                Some(JobKind::Rebuild)
            }
            Some((_, Some(hash))) if *hash != handlers_hash(p) => {
                report.warnings.push(format!(
                    "perspective {name}: its handlers changed but its version stayed at {version}, so rows \
                     already in its tables were built by the old handlers (only events applied from now on \
                     use the new ones); to rebuild them, set `version: {next}` and migrate, or run \
                     `perspective-worker rebuild --perspective {name}`",
                    name = p.name,
                    next = version + 1
                ));
                None
            }
            Some(_) => None,
        };
        if let Some(kind) = kind {
            catchup::start(tx, schema, &p.name, kind)
                .await
                .map_err(db_err(format!(
                    "starting the {} of {}",
                    kind.as_str(),
                    p.name
                )))?;
            continue;
        }
        // An event type gained by a perspective that already applied newer events of the same
        // streams: its stored events can only be applied in order by a rebuild.
        let gained: Vec<String> = report
            .subscriptions_added
            .iter()
            .filter(|(name, _)| *name == p.name)
            .map(|(_, event_type)| event_type.clone())
            .collect();
        if gained.is_empty() || !recorded.contains_key(&p.name) {
            continue;
        }
        let stored = store::count_events_of_types(tx, schema, &gained)
            .await
            .map_err(db_err("counting stored events of new event types"))?;
        if stored > 0 {
            report.warnings.push(format!(
                "perspective {name} now handles {types}, of which {stored} event(s) are already stored; \
                 they are not applied to it (it has applied newer events of their streams, and events are \
                 applied in order); set `version: {next}` and migrate to rebuild {name} with them",
                name = p.name,
                types = gained.join(", "),
                next = version + 1
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(MigrateError::InvalidPerspectives(ConfigError {
            source: source.to_string(),
            problems,
        }))
    }
}

/// Perspectives that left the config leave nothing behind but their model tables (the user's):
/// pending work, cursors, compiled function and record are removed, and streams left with
/// nothing pending are unpinned.
async fn remove_perspectives(
    tx: &mut PgConnection,
    config: &Config,
    kept: &[String],
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let schema = config.schema.as_str();
    let configured: Vec<String> = config
        .perspectives
        .iter()
        .map(|p| p.name.clone())
        .chain(kept.iter().cloned())
        .collect();
    let gone = removal::removed_perspectives(tx, schema, &configured)
        .await
        .map_err(db_err("looking for removed perspectives"))?;
    if gone.is_empty() {
        return Ok(());
    }
    for perspective in gone {
        let removed = removal::remove_perspective(tx, schema, &perspective)
            .await
            .map_err(db_err(format!("removing perspective {perspective}")))?;
        tracing::info!(
            schema,
            perspective,
            work_rows = removed.work_rows,
            cursors = removed.cursors,
            "removed a perspective that left the config; its tables are kept"
        );
        report.perspectives_removed.push(removed);
    }
    report.streams_unpinned = removal::unpin_drained_streams(tx, schema)
        .await
        .map_err(db_err("unpinning drained streams"))?;
    Ok(())
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
    store::apply_migration(conn, schema, m, APPLIED_BY)
        .await
        .map_err(db_err(format!("applying migration {}", m.name)))
}

/// Install the engine functions after the migrations, unless the schema has this binary's set,
/// unchanged since it was installed.
async fn install_functions(
    tx: &mut PgConnection,
    schema: &str,
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let current = functions::up_to_date(tx, schema)
        .await
        .map_err(db_err("reading the installed engine functions"))?;
    if current {
        return Ok(());
    }
    tracing::info!(schema, "installing the engine functions");
    functions::install(tx, schema, APPLIED_BY)
        .await
        .map_err(db_err("installing the engine functions"))?;
    report.functions_installed = true;
    Ok(())
}

/// Make `wh_perspective_subscriptions` equal to what the config declares.
async fn sync_subscriptions(
    conn: &mut PgConnection,
    config: &Config,
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let (removed, added) = store::sync_subscriptions(conn, &config.schema, &config.subscriptions())
        .await
        .map_err(db_err("registering subscriptions"))?;
    report.subscriptions_removed = removed;
    report.subscriptions_added = added;
    Ok(())
}

/// Run each perspective's `setup`, then prepare its `reset` and handler statements with the
/// parameter types the runner binds (and its `sequencingKey` over the event store), so a typo
/// fails here rather than on the first event, then compile every perspective. Every problem is
/// collected (each statement runs in its own savepoint) and reported together.
async fn setup_and_prepare(
    conn: &mut PgConnection,
    config: &Config,
    running: &[Running],
    source: &str,
    report: &mut MigrateReport,
) -> Result<(), MigrateError> {
    let mut problems = Vec::new();
    for r in running {
        let p = &r.perspective;
        let index = config
            .perspectives
            .iter()
            .position(|c| c.name == r.configured)
            .unwrap_or_default();
        // A version built beside the live one says so: its failure leaves the live one serving.
        let label = match r.home {
            Some(_) => format!("{}, version {} built blue/green", r.configured, p.version),
            None => r.configured.clone(),
        };
        let at = |field: &str| format!("perspectives[{index}] ({label}).{field}");
        // A version built beside the live one creates and reads its own tables first.
        store::set_local_search_path_in(conn, r.home.as_deref(), &config.schema)
            .await
            .map_err(db_err("setting search_path"))?;
        if let Some(setup) = p.setup.as_deref().filter(|s| !s.trim().is_empty()) {
            match in_savepoint(conn, Step::Script(setup)).await? {
                Ok(_) => report.setups_run.push(p.name.clone()),
                Err(e) => {
                    problems.push(Problem {
                        path: at("setup"),
                        message: describe_error(&e, Some(setup)),
                    });
                    // Its handlers would only repeat the failure (missing tables).
                    continue;
                }
            }
        }
        for (path, stmt) in statements(p, &at, source)? {
            let (sql, params) = stmt.to_positional();
            let types: Vec<PgTypeInfo> = params
                .iter()
                .map(|p| PgTypeInfo::with_name(p.pg_type()))
                .collect();
            match in_savepoint(conn, Step::Prepare(&sql, &types)).await? {
                Ok(columns) if returns_rows_nowhere(columns, &stmt) => problems.push(Problem {
                    path,
                    message: format!(
                        "returns rows, which a handler has nowhere to put (every event would fail \
                         with \"query has no destination for result data\"): drop its RETURNING \
                         clause, or make a query a plain SELECT (its rows are discarded): {}",
                        sql.trim()
                    ),
                }),
                Ok(_) => report.statements_prepared += 1,
                Err(e) => problems.push(Problem {
                    path,
                    message: describe_error(&e, Some(&sql)),
                }),
            }
        }
        if let Some(sql) = sequencing_key_check(&config.schema, p) {
            if let Err(e) = in_savepoint(conn, Step::Prepare(&sql, &[])).await? {
                problems.push(Problem {
                    path: at("sequencingKey"),
                    message: format!(
                        "does not compile over the event store: {}",
                        describe_error(&e, None)
                    ),
                });
            }
        }
    }
    if problems.is_empty() {
        // Every statement prepares: compile each perspective into its apply function.
        problems = compile(conn, config, running, report).await?;
    }
    if !problems.is_empty() {
        return Err(MigrateError::InvalidPerspectives(ConfigError {
            source: source.to_string(),
            problems,
        }));
    }
    Ok(())
}

/// The `reset` and handler statements of `p`, each with its field path.
fn statements(
    p: &crate::config::PerspectiveConfig,
    at: &dyn Fn(&str) -> String,
    source: &str,
) -> Result<Vec<(String, ParsedStatement)>, MigrateError> {
    let mut statements = Vec::new();
    if let Some(reset) = p.reset.as_deref() {
        let parsed = crate::config::sql_params::parse_statements(reset).map_err(|e| {
            MigrateError::InvalidPerspectives(ConfigError {
                source: source.to_string(),
                problems: vec![Problem {
                    path: at("reset"),
                    message: e.to_string(),
                }],
            })
        })?;
        statements.extend(parsed.into_iter().map(|stmt| (at("reset"), stmt)));
    }
    for (event_type, stmts) in p.compiled_handlers() {
        let path = at(&format!("handlers.{event_type}"));
        statements.extend(stmts.into_iter().map(|stmt| (path.clone(), stmt)));
    }
    Ok(statements)
}

/// Compile each perspective into its apply function and record its definition hash, then the
/// drain function. Returns the perspectives that did not compile.
async fn compile(
    conn: &mut PgConnection,
    config: &Config,
    running: &[Running],
    report: &mut MigrateReport,
) -> Result<Vec<Problem>, MigrateError> {
    let schema = &config.schema;
    let mut problems = Vec::new();
    for r in running {
        let p = &r.perspective;
        let sql = create_perspective_functions(schema, p, r.home.as_deref());
        if let Err(e) = in_savepoint(conn, Step::Script(&sql)).await? {
            let index = config
                .perspectives
                .iter()
                .position(|c| c.name == r.configured)
                .unwrap_or_default();
            problems.push(Problem {
                path: format!("perspectives[{index}] ({}).handlers", r.configured),
                message: format!(
                    "cannot compile the apply function: {}",
                    describe_error(&e, None)
                ),
            });
            continue;
        }
        store::record_compiled_perspective(
            conn,
            schema,
            &store::CompiledPerspective {
                name: &p.name,
                definition_hash: &definition_hash(schema, p),
                function: &apply_function_name(&p.name),
                version: p.version as i32,
                handlers_hash: &handlers_hash(p),
                definition: &versions::definition_json(p),
            },
        )
        .await
        .map_err(db_err("recording the compiled perspective"))?;
        report.apply_functions += 1;
    }
    if problems.is_empty() {
        let perspectives: Vec<_> = running.iter().map(|r| r.perspective.clone()).collect();
        store::execute_script(conn, &create_drain_function(schema, &perspectives))
            .await
            .map_err(db_err("compiling the drain function"))?;
    }
    Ok(problems)
}

/// Whether a handler or reset statement whose result has `columns` columns returns rows the
/// compiled function cannot run: only a bare SELECT is run as PERFORM (rows discarded); any
/// other statement with a result (`INSERT … RETURNING`, `WITH … SELECT`, `VALUES`) fails in
/// PL/pgSQL on every event.
fn returns_rows_nowhere(columns: usize, stmt: &ParsedStatement) -> bool {
    columns > 0 && !runs_as_perform(stmt)
}

/// A statement run in its own savepoint.
enum Step<'a> {
    Script(&'a str),
    Prepare(&'a str, &'a [PgTypeInfo]),
}

/// Run `step` in a savepoint: released when it succeeds, rolled back when it fails (so the
/// migration transaction stays usable), with the step's own error as the inner result.
/// A prepared statement's result is its column count (0: no rows; a script's is 0).
async fn in_savepoint(
    conn: &mut PgConnection,
    step: Step<'_>,
) -> Result<Result<usize, sqlx::Error>, MigrateError> {
    let mut sp = conn.begin().await.map_err(db_err("opening a savepoint"))?;
    let result = match step {
        Step::Script(script) => store::execute_script(&mut sp, script).await.map(|()| 0),
        Step::Prepare(sql, types) => store::prepare(&mut sp, sql, types).await,
    };
    match result {
        Ok(_) => sp.commit().await.map_err(db_err("releasing a savepoint"))?,
        Err(_) => sp
            .rollback()
            .await
            .map_err(db_err("rolling back a savepoint"))?,
    }
    Ok(result)
}
