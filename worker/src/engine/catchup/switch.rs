//! The blue/green switch (DESIGN §12.6): once the version built beside a perspective's live one
//! has caught up, one transaction, taken by one worker, makes it the live one.
//!
//! Caught up means: its backfill (or, for a rollback, its catch-up from its kept cursors) is
//! done, it has no pending dead letter (a version whose events fail does not replace one that
//! serves), and its oldest unapplied event is less than [`SWITCH_MAX_LAG`] old — so readers,
//! who see the new tables from the switch on, see them about as current as the old ones.
//!
//! The transaction holds the schema's migration lock (tried, never waited for: `migrate` or
//! another worker's switch goes first, and this worker tries again on its next turn), bounds
//! its lock waits ([`crate::store::versions::begin_switch`]), swaps the versions' names and
//! tables (`wh_version_switch`), installs the new version's functions under the perspective's
//! name with the deployment schema first on their search_path and `wh_drain` without the
//! internal name, records the perspective, and drops the versions kept beyond
//! `keepPreviousVersions`. The functions are compiled here, from the definitions `migrate`
//! recorded, not from this worker's config (which may be older or newer).

use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::Connection;

use super::plan::JobError;
use super::JobRunner;
use crate::compile::{
    create_drain_function, create_perspective_functions, definition_hash, handlers_hash,
};
use crate::config::versions::{definition_json, home_schema, internal_name, parse_definition};
use crate::config::PerspectiveConfig;
use crate::store::names::apply_function_name;
use crate::store::schema as store_schema;
use crate::store::versions::{self, Readiness};

/// The most a version's oldest unapplied event may lag for the switch to it.
pub const SWITCH_MAX_LAG: Duration = Duration::from_secs(1);

/// Refused switches per log line: about a minute of turns at the watch interval.
const REFUSALS_PER_LOG: u64 = 240;

/// Whether a version being built may replace the live one.
pub fn caught_up(r: &Readiness) -> bool {
    r.job_state.as_deref() == Some("done")
        && r.dead_letters == 0
        && r.oldest_pending_seconds
            .is_none_or(|s| s < SWITCH_MAX_LAG.as_secs_f64())
}

/// A switch made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Switched {
    pub perspective: String,
    pub from: i32,
    pub to: i32,
    pub archived: Vec<String>,
    pub moved_in: Vec<String>,
    /// Kept versions dropped (beyond `keepPreviousVersions`).
    pub dropped: Vec<i32>,
}

impl JobRunner {
    /// Switch every version being built that caught up. Returns whether a build is left (the
    /// runner keeps watching it).
    pub(super) async fn switch_versions(
        &self,
        conn: &mut crate::store::Conn,
    ) -> Result<bool, JobError> {
        let shared = &self.shared;
        let schema = shared.store.schema();
        let routine = shared.store.deadlines().routine;
        let long = shared.store.deadlines().long;
        conn.limit(routine, "work rows of a switched version")
            .run(versions::adopt_stragglers(conn, schema))
            .await?;
        let building = conn
            .limit(routine, "versions being built")
            .run(versions::building(conn, schema))
            .await?;
        let mut left = false;
        for (perspective, next, _) in building {
            let internal = internal_name(&perspective, next as u32);
            let readiness = conn
                .limit(routine, "a version's readiness")
                .run(versions::readiness(conn, schema, &internal))
                .await?;
            if !caught_up(&readiness) {
                left = true;
                continue;
            }
            let owner = conn
                .limit(routine, "the schema owner's rights")
                .run(versions::acts_as_owner(conn, schema))
                .await?;
            if !owner {
                // Not a failure of this worker: nothing is retried or dead-lettered, the old
                // version serves, and a worker running as the owner (or this one, once its
                // role is) switches on a later turn.
                self.refuse_switch(perspective, next);
                left = true;
                continue;
            }
            let switched = conn
                .limit(long, "blue/green switch")
                .run(switch(conn, schema, &perspective, next))
                .await?;
            let Some(s) = switched else {
                left = true;
                continue;
            };
            tracing::info!(
                perspective = %s.perspective,
                from = s.from,
                to = s.to,
                archived = ?s.archived,
                moved_in = ?s.moved_in,
                dropped = ?s.dropped,
                "switched the perspective to version {}: its tables replaced the live ones, which were archived",
                s.to
            );
            shared
                .metrics
                .version_switches
                .with_label_values(&[s.perspective.as_str(), &s.to.to_string()])
                .inc();
            // Look again soon: rows of appends in flight at the switch are adopted next turn.
            left = true;
        }
        Ok(left)
    }
}

impl JobRunner {
    /// Count (and log, at the first refusal and about once a minute after) a switch this
    /// worker's role may not make.
    fn refuse_switch(&self, perspective: String, version: i32) {
        let refused = self
            .shared
            .metrics
            .version_switches_refused
            .with_label_values(&[perspective.as_str(), &version.to_string()]);
        refused.inc();
        if refused.get() % REFUSALS_PER_LOG == 1 {
            let why = JobError::SwitchNeedsOwner {
                perspective,
                version,
            };
            tracing::warn!(refusals = refused.get(), "{why}");
        }
    }
}

/// What [`switch_caught_up`] found for one version being built.
#[derive(Debug, Clone, PartialEq)]
pub enum SwitchAttempt {
    /// Switched to it.
    Switched(Switched),
    /// Not caught up yet (see [`caught_up`]).
    NotCaughtUp {
        perspective: String,
        version: i32,
        readiness: Readiness,
    },
    /// Caught up, but not switched now: `migrate` or a worker held the schema's migration lock,
    /// or the build changed meanwhile. Trying again soon settles it.
    Busy { perspective: String, version: i32 },
}

/// Switch every version being built (of `only`, when given) that has caught up, as a worker
/// running as the schema's owner does on its turn: `perspective-worker switch`, for
/// deployments whose workers run as a role that may not switch. Refused with
/// [`JobError::SwitchNeedsOwner`] unless this connection acts as the schema's owner.
pub async fn switch_caught_up(
    conn: &mut PgConnection,
    schema: &str,
    only: Option<&str>,
) -> Result<Vec<SwitchAttempt>, JobError> {
    let building: Vec<(String, i32)> = versions::building(conn, schema)
        .await?
        .into_iter()
        .filter(|(p, _, _)| only.is_none_or(|o| o == p))
        .map(|(p, v, _)| (p, v))
        .collect();
    if let Some((perspective, version)) = building.first() {
        if !versions::acts_as_owner(conn, schema).await? {
            return Err(JobError::SwitchNeedsOwner {
                perspective: perspective.clone(),
                version: *version,
            });
        }
    }
    let mut attempts = Vec::new();
    for (perspective, version) in building {
        let internal = internal_name(&perspective, version as u32);
        let readiness = versions::readiness(conn, schema, &internal).await?;
        if !caught_up(&readiness) {
            attempts.push(SwitchAttempt::NotCaughtUp {
                perspective,
                version,
                readiness,
            });
            continue;
        }
        attempts.push(match switch(conn, schema, &perspective, version).await? {
            Some(s) => SwitchAttempt::Switched(s),
            None => SwitchAttempt::Busy {
                perspective,
                version,
            },
        });
    }
    Ok(attempts)
}

/// One switch of `perspective` to version `next`, in its own transaction; None when it is not
/// this worker's to make now (the lock is taken, the build is gone or no longer caught up).
pub async fn switch(
    conn: &mut PgConnection,
    schema: &str,
    perspective: &str,
    next: i32,
) -> Result<Option<Switched>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let made = switch_in(&mut tx, schema, perspective, next).await;
    match made {
        Ok(Some(s)) => {
            tx.commit().await?;
            Ok(Some(s))
        }
        Ok(None) => {
            tx.rollback().await?;
            Ok(None)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

async fn switch_in(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    next: i32,
) -> Result<Option<Switched>, sqlx::Error> {
    if !versions::begin_switch(tx, schema).await? {
        return Ok(None);
    }
    let internal = internal_name(perspective, next as u32);
    // Under the lock: the build is still there and still caught up.
    let rows = versions::all(tx, schema).await?;
    let mut building_definition = None;
    let mut live = None;
    for r in rows.into_iter().filter(|r| r.perspective == perspective) {
        match r.state {
            versions::VersionState::Building if r.version == next => {
                building_definition = Some(r.definition)
            }
            versions::VersionState::Live => live = Some(r.version),
            _ => {}
        }
    }
    let (Some(definition), Some(live)) = (building_definition, live) else {
        return Ok(None);
    };
    if !caught_up(&versions::readiness(tx, schema, &internal).await?) {
        return Ok(None);
    }
    let Ok(next_definition) = parse_definition(&definition) else {
        tracing::error!(
            perspective,
            next,
            "the recorded definition does not parse: not switching"
        );
        return Ok(None);
    };
    let Some(after) =
        perspectives_after(tx, schema, perspective, &internal, &next_definition).await?
    else {
        tracing::error!(
            perspective,
            next,
            "a perspective's definition is not recorded (migrate with this binary): not switching"
        );
        return Ok(None);
    };
    let live_home = home_schema(schema, perspective, live as u32);
    let next_home = home_schema(schema, perspective, next as u32);
    let (archived, moved_in) = versions::switch_tables(
        tx,
        schema,
        perspective,
        (live, next),
        (&live_home, &next_home),
    )
    .await?;
    let script = create_perspective_functions(schema, &next_definition, None)
        + ";\n"
        + &create_drain_function(schema, &after);
    store_schema::execute_script(tx, &script).await?;
    versions::drop_functions(tx, schema, &internal).await?;
    store_schema::record_compiled_perspective(
        tx,
        schema,
        &store_schema::CompiledPerspective {
            name: perspective,
            definition_hash: &definition_hash(schema, &next_definition),
            function: &apply_function_name(perspective),
            version: next,
            handlers_hash: &handlers_hash(&next_definition),
            definition: &definition_json(&next_definition),
        },
    )
    .await?;
    let keep = i64::from(next_definition.keep_previous_versions());
    let dropped = versions::kept_beyond(tx, schema, perspective, keep).await?;
    for version in &dropped {
        let v = *version as u32;
        versions::forget(
            tx,
            schema,
            perspective,
            *version,
            &internal_name(perspective, v),
            &home_schema(schema, perspective, v),
        )
        .await?;
    }
    Ok(Some(Switched {
        perspective: perspective.to_string(),
        from: live,
        to: next,
        archived,
        moved_in,
        dropped,
    }))
}

/// The perspectives `wh_drain` dispatches to after the switch: every recorded one but the
/// perspective and its internal name, plus the new version under the perspective's name. None
/// when a definition is not recorded.
async fn perspectives_after(
    tx: &mut PgConnection,
    schema: &str,
    perspective: &str,
    internal: &str,
    next: &PerspectiveConfig,
) -> Result<Option<Vec<PerspectiveConfig>>, sqlx::Error> {
    let mut after = Vec::new();
    for (name, definition) in versions::definitions(tx, schema).await? {
        if name == perspective || name == internal {
            continue;
        }
        match definition.as_deref().map(parse_definition) {
            Some(Ok(p)) => after.push(p),
            _ => return Ok(None),
        }
    }
    after.push(next.clone());
    Ok(Some(after))
}
