//! What follows from an [`Observed`], worked out once for all the condition builders.

use perspective_worker::store::status::{PerspectiveStatus, Status as DbStatus};

use super::observed::{DatabaseProblem, Observed};
use super::rollout::{self, Rollout, Step};
use crate::migration_job::JobState;

/// The observations and what they mean, as the condition builders read them.
#[derive(Debug, Clone)]
pub struct Facts<'a> {
    pub observed: &'a Observed,
    pub rollout: Rollout,
    /// The spec failed validation.
    pub invalid: bool,
    /// The spec is valid but the database Secret cannot be read.
    pub secret_missing: bool,
    /// Nothing was applied for this spec (invalid, or no Secret).
    pub blocked: bool,
    /// The API server's message about a refused child, when something was applied.
    pub rejected: Option<&'a str>,
    /// The current target's migration Job failed.
    pub failed: bool,
    /// The current target's migration Job succeeded.
    pub migrated: bool,
    /// The database's view, when it could be read.
    pub db: Option<&'a DbStatus>,
    /// Why the database could not be read, when that is a problem: once the current target
    /// is migrated, or was before (a re-run after the schema had gone); an unreachable
    /// database also while a later target migrates. Not before the first migration, when no
    /// schema is expected yet.
    pub database_problem: Option<&'a DatabaseProblem>,
    pub dead_letters: i64,
    pub failed_streams: i64,
    /// One line per perspective whose lock conflicts persist (see
    /// [`PerspectiveStatus::lock_contention_message`]), e.g. "customer_stats: 40 lock conflicts
    /// a minute between appliers; see sequencing".
    pub lock_contention: Vec<String>,
    /// What is left before the current spec is rolled out ([`rollout::remaining_step`]).
    pub step: Option<Step>,
}

impl<'a> Facts<'a> {
    pub fn of(o: &'a Observed) -> Facts<'a> {
        let rollout = Rollout::of(o);
        let invalid = !o.problems.is_empty();
        let secret_missing = !invalid && o.secret_problem.is_some();
        let blocked = invalid || secret_missing;
        let migrated = matches!(o.job, Some(JobState::Succeeded));
        let db = match &o.database {
            Some(Ok(s)) => Some(s),
            _ => None,
        };
        let database_problem = match &o.database {
            Some(Err(p)) if counts(o, migrated, p) => Some(p),
            _ => None,
        };
        let sum = |field: fn(&PerspectiveStatus) -> i64| {
            db.map_or(0, |s| s.perspectives.iter().map(field).sum())
        };
        Facts {
            observed: o,
            rollout,
            invalid,
            secret_missing,
            blocked,
            rejected: o.rejected.as_deref().filter(|_| !blocked),
            failed: matches!(o.job, Some(JobState::Failed { .. })),
            migrated,
            db,
            database_problem,
            dead_letters: sum(|p| p.dead_letters),
            failed_streams: sum(|p| p.failed_streams),
            lock_contention: db.map_or_else(Vec::new, |s| {
                s.perspectives
                    .iter()
                    .filter_map(PerspectiveStatus::lock_contention_message)
                    .collect()
            }),
            step: rollout::remaining_step(o, &rollout, migrated, db),
        }
    }
}

/// Whether `problem` is one: once migrated, or when the status records this target as
/// migrated before (its Job runs again); an unreachable database too while a later target
/// migrates (the running workers need it), but a missing schema then is expected (a new
/// `spec.schema`).
fn counts(o: &Observed, migrated: bool, problem: &DatabaseProblem) -> bool {
    let this_target_was_migrated = o.migrated_hash.as_deref() == Some(o.target.hash.as_str());
    match problem {
        DatabaseProblem::Unreachable(_) => migrated || o.migrated_hash.is_some(),
        DatabaseProblem::SchemaMissing(_) => migrated || this_target_was_migrated,
    }
}

/// Observations for the unit tests of the condition builders.
#[cfg(test)]
pub mod fixture {
    use std::collections::BTreeMap;

    use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetSpec, StatefulSetStatus};
    use k8s_openapi::api::core::v1::PodTemplateSpec;
    use kube::api::ObjectMeta;
    use perspective_worker::store::status::{PerspectiveStatus, Status as DbStatus};

    use crate::labels;
    use crate::migration_job::{JobState, MigrationTarget};
    use crate::status::observed::Observed;

    /// A valid, unpaused deployment of 3 replicas whose Job does not exist yet.
    pub fn observed() -> Observed {
        Observed {
            instance: "shop".into(),
            generation: Some(2),
            paused: false,
            problems: vec![],
            secret_problem: None,
            rejected: None,
            target: MigrationTarget {
                hash: "mh".into(),
                job_name: "shop-migrate-mh".into(),
            },
            config_hash: "ch".into(),
            job: None,
            migration_failures: 0,
            next_migration_attempt: None,
            statefulset: None,
            desired_replicas: 3,
            migrated_hash: None,
            database: None,
        }
    }

    /// Migrated, with `ready` of 3 pods ready on the current template, all rolled.
    pub fn migrated(ready: i32) -> Observed {
        let mut o = observed();
        o.job = Some(JobState::Succeeded);
        o.migrated_hash = Some("mh".into());
        o.statefulset = Some(statefulset("mh", "ch", ready, true));
        o
    }

    /// A StatefulSet of 3 replicas built for `migration_hash` and `config_hash`.
    pub fn statefulset(
        migration_hash: &str,
        config_hash: &str,
        ready: i32,
        rolled: bool,
    ) -> StatefulSet {
        let annotations = BTreeMap::from([
            (labels::MIGRATION_HASH.to_owned(), migration_hash.to_owned()),
            (labels::CONFIG_HASH.to_owned(), config_hash.to_owned()),
        ]);
        StatefulSet {
            metadata: ObjectMeta {
                generation: Some(1),
                ..ObjectMeta::default()
            },
            spec: Some(StatefulSetSpec {
                template: PodTemplateSpec {
                    metadata: Some(ObjectMeta {
                        annotations: Some(annotations),
                        ..ObjectMeta::default()
                    }),
                    spec: None,
                },
                ..StatefulSetSpec::default()
            }),
            status: Some(StatefulSetStatus {
                observed_generation: Some(1),
                replicas: 3,
                ready_replicas: Some(ready),
                updated_replicas: Some(3),
                current_revision: Some("r1".into()),
                update_revision: Some(if rolled { "r1" } else { "r2" }.into()),
                ..StatefulSetStatus::default()
            }),
        }
    }

    /// The database's view: `live` workers, and these perspectives.
    pub fn database(live: i64, perspectives: Vec<PerspectiveStatus>) -> DbStatus {
        DbStatus {
            live_instances: live,
            perspectives,
            ..DbStatus::default()
        }
    }
}
