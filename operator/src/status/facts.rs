//! What follows from an [`Observed`], worked out once for all the condition builders.

use perspective_worker::store::status::Status as DbStatus;

use super::observed::Observed;
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
    /// Why the database could not be read, once the schema is migrated.
    pub database_error: Option<&'a str>,
    pub dead_letters: i64,
    pub failed_streams: i64,
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
        let database_error = match &o.database {
            Some(Err(e)) if migrated => Some(e.as_str()),
            _ => None,
        };
        let sum = |field: fn(&perspective_worker::store::status::PerspectiveStatus) -> i64| {
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
            database_error,
            dead_letters: sum(|p| p.dead_letters),
            failed_streams: sum(|p| p.failed_streams),
            step: rollout::remaining_step(o, &rollout, migrated, db),
        }
    }
}
