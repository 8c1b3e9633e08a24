//! `MigrationsApplied`: where the current migration target's Job stands.

use super::{Desired, MIGRATIONS_APPLIED};
use crate::migration_job::JobState;
use crate::status::facts::Facts;

/// The condition for the current target's Job; `None` (left as it was) when nothing was
/// applied for this spec (invalid, or no Secret): nothing ran for it.
pub fn desired(f: &Facts) -> Option<Desired> {
    if f.blocked {
        return None;
    }
    let o = f.observed;
    let job = &o.target.job_name;
    let (status, reason, message) = match &o.job {
        Some(JobState::Succeeded) => (true, "Succeeded", format!("migration Job {job} completed")),
        Some(JobState::Failed {
            reason, message, ..
        }) => (
            false,
            reason.as_str(),
            format!(
                "migration Job {job} failed ({} failure(s)): {message}",
                o.migration_failures
            ),
        ),
        Some(JobState::Running) => (false, "Running", format!("migration Job {job} is running")),
        None if o.paused => (
            false,
            "Paused",
            format!("migration Job {job} will be created when spec.paused is false"),
        ),
        None => (
            false,
            "Pending",
            format!("migration Job {job} has not been created"),
        ),
    };
    Some(Desired::new(MIGRATIONS_APPLIED, status, reason, message))
}
