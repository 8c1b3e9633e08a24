//! `migrate`'s part of blue/green versions (DESIGN §12.6): a `version` bump of a perspective
//! with `rebuild: blueGreen` starts building the new version beside the live one (or, for a
//! kept version, catching it up from its cursors: a rollback), instead of rebuilding in place; a
//! build the config no longer asks for is cancelled. The workers switch once it caught up
//! (`engine::catchup::switch`).

use std::collections::HashMap;

use sqlx::postgres::PgConnection;

use crate::config::versions::{home_schema, internal_name, parse_definition, Building};
use crate::config::{Config, PerspectiveConfig, Problem, Rebuild};
use crate::store::catchup::{self, JobKind};
use crate::store::versions::{self, VersionRow, VersionState};

/// What `migrate` did about a perspective's versions.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct VersionBuild {
    pub perspective: String,
    /// The live version, which keeps serving until the switch.
    pub live: i32,
    /// The version built beside it.
    pub next: i32,
    /// Whether `next` is a kept version caught up from its cursors (a rollback).
    pub rollback: bool,
}

/// Why the builds could not be planned.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("database error while {step}: {source}")]
    Database { step: String, source: sqlx::Error },
    /// Builds the config asks for that cannot start, each naming its field.
    #[error("{} perspective(s) cannot be built beside their live version", .0.len())]
    Invalid(Vec<Problem>),
}

fn db_err(step: impl Into<String>) -> impl FnOnce(sqlx::Error) -> PlanError {
    let step = step.into();
    move |source| PlanError::Database { step, source }
}

/// Start, keep or cancel each blue/green perspective's build (recording what it started in
/// `builds` and what it cancelled in `warnings`); returns the versions being built (with their
/// live versions' definitions), which decide the perspectives the deployment runs.
pub async fn plan(
    tx: &mut PgConnection,
    config: &Config,
    recorded: &HashMap<String, (i32, Option<String>)>,
    builds: &mut Vec<VersionBuild>,
    warnings: &mut Vec<String>,
) -> Result<Vec<Building>, PlanError> {
    let schema = config.schema.as_str();
    let configured: Vec<String> = config.perspectives.iter().map(|p| p.name.clone()).collect();
    versions::delete_rows_of_removed(tx, schema, &configured)
        .await
        .map_err(db_err("forgetting the versions of removed perspectives"))?;
    let rows = versions::all(tx, schema)
        .await
        .map_err(db_err("reading the perspectives' versions"))?;
    let definitions: HashMap<String, Option<String>> = versions::definitions(tx, schema)
        .await
        .map_err(db_err("reading the recorded definitions"))?
        .into_iter()
        .collect();
    let mut building = Vec::new();
    let mut problems = Vec::new();
    for (index, p) in config.perspectives.iter().enumerate() {
        let mine: Vec<&VersionRow> = rows.iter().filter(|r| r.perspective == p.name).collect();
        let next = p.version as i32;
        let live = recorded.get(&p.name).map(|(v, _)| *v);
        let wanted = p.rebuild == Rebuild::BlueGreen && live.is_some_and(|v| v != next);
        if let Some(current) = mine.iter().find(|r| r.state == VersionState::Building) {
            if wanted && current.version == next {
                building.push(live_of(p, definitions.get(&p.name))?);
                continue;
            }
            cancel(tx, schema, current).await?;
            warnings.push(format!(
                "perspective {}: the build of version {} was cancelled (the config asks for version {next})",
                p.name, current.version
            ));
        }
        let (Some(live), true) = (live, wanted) else {
            continue;
        };
        let Some(Some(live_definition)) = definitions.get(&p.name) else {
            problems.push(Problem {
                path: format!("perspectives[{index}] ({}).version", p.name),
                message: format!(
                    "changed from {live} to {next} with rebuild: blueGreen, but the running version's definition \
                     was recorded by an older perspective-worker: migrate once with version {live}, then raise it"
                ),
            });
            continue;
        };
        let rollback = mine
            .iter()
            .any(|r| r.version == next && r.state == VersionState::Kept);
        start(tx, config, p, (live, live_definition), rollback).await?;
        builds.push(VersionBuild {
            perspective: p.name.clone(),
            live,
            next,
            rollback,
        });
        building.push(live_of(p, Some(&Some(live_definition.clone())))?);
    }
    if problems.is_empty() {
        Ok(building)
    } else {
        Err(PlanError::Invalid(problems))
    }
}

/// The build of `p`'s configured version, with its live version's recorded definition.
fn live_of(
    p: &PerspectiveConfig,
    definition: Option<&Option<String>>,
) -> Result<Building, PlanError> {
    let json = definition.cloned().flatten().unwrap_or_default();
    let live = parse_definition(&json).map_err(|e| PlanError::Database {
        step: format!("reading the recorded definition of {}", p.name),
        source: sqlx::Error::Decode(Box::new(e)),
    })?;
    Ok(Building {
        perspective: p.name.clone(),
        version: p.version,
        live,
    })
}

/// Record the live version, then build `p`'s configured version in its home schema: a fresh
/// backfill, or (a kept version) a catch-up from its cursors. Its setup, subscriptions and
/// functions follow with the others' (it runs under its internal name from now on).
async fn start(
    tx: &mut PgConnection,
    config: &Config,
    p: &PerspectiveConfig,
    (live, live_definition): (i32, &str),
    rollback: bool,
) -> Result<(), PlanError> {
    let schema = config.schema.as_str();
    let next = p.version as i32;
    let internal = internal_name(&p.name, p.version);
    let home = home_schema(schema, &p.name, p.version);
    versions::set_state(
        tx,
        schema,
        &p.name,
        live,
        VersionState::Live,
        live_definition,
    )
    .await
    .map_err(db_err("recording the live version"))?;
    let definition = crate::config::versions::definition_json(p);
    versions::set_state(
        tx,
        schema,
        &p.name,
        next,
        VersionState::Building,
        &definition,
    )
    .await
    .map_err(db_err("recording the version to build"))?;
    versions::create_home(tx, &home)
        .await
        .map_err(db_err(format!("creating schema {home}")))?;
    versions::share_home(tx, schema, &home)
        .await
        .map_err(db_err(format!(
            "granting the worker roles their rights in {home}"
        )))?;
    catchup::start(tx, schema, &internal, JobKind::Backfill)
        .await
        .map_err(db_err(format!("starting the build of {internal}")))?;
    if rollback {
        versions::keep_cursors(tx, schema, &internal)
            .await
            .map_err(db_err(format!("starting the catch-up of {internal}")))?;
    }
    tracing::info!(
        schema,
        perspective = %p.name,
        live,
        next,
        rollback,
        "building a version beside the live one"
    );
    Ok(())
}

/// Cancel a build: a version that was live before goes back to being kept (its cursors match
/// its tables); one that never was is dropped with its home schema.
async fn cancel(tx: &mut PgConnection, schema: &str, row: &VersionRow) -> Result<(), PlanError> {
    let version = row.version as u32;
    let internal = internal_name(&row.perspective, version);
    let home = home_schema(schema, &row.perspective, version);
    let step = || db_err(format!("cancelling the build of {internal}"));
    if row.was_live {
        versions::retire(tx, schema, &internal)
            .await
            .map_err(step())?;
        versions::set_state(
            tx,
            schema,
            &row.perspective,
            row.version,
            VersionState::Kept,
            &row.definition,
        )
        .await
        .map_err(step())
    } else {
        versions::forget(tx, schema, &row.perspective, row.version, &internal, &home)
            .await
            .map_err(step())
    }
}

/// Internal names of the kept versions of configured perspectives: not "removed" perspectives.
pub async fn kept_internal_names(
    tx: &mut PgConnection,
    schema: &str,
) -> Result<Vec<String>, PlanError> {
    Ok(versions::all(tx, schema)
        .await
        .map_err(db_err("reading the perspectives' versions"))?
        .into_iter()
        .filter(|r| r.state != VersionState::Live)
        .map(|r| internal_name(&r.perspective, r.version as u32))
        .collect())
}
