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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::facts::fixture;

    fn of(o: &crate::status::Observed) -> Desired {
        desired(&Facts::of(o)).expect("decided")
    }

    #[test]
    fn each_job_state_has_its_reason() {
        let mut o = fixture::observed();
        let pending = of(&o);
        assert_eq!(
            (pending.status, pending.reason.as_str()),
            (false, "Pending")
        );
        assert_eq!(
            pending.message,
            "migration Job shop-migrate-mh has not been created"
        );
        o.paused = true;
        assert_eq!(of(&o).reason, "Paused");
        o.paused = false;
        o.job = Some(JobState::Running);
        assert_eq!(of(&o).reason, "Running");
        o.job = Some(JobState::Succeeded);
        let done = of(&o);
        assert_eq!((done.status, done.reason.as_str()), (true, "Succeeded"));
    }

    #[test]
    fn a_failure_carries_the_jobs_reason_and_the_count() {
        let mut o = fixture::observed();
        o.migration_failures = 2;
        o.job = Some(JobState::Failed {
            reason: "DeadlineExceeded".into(),
            message: "too slow".into(),
            at: None,
        });
        let failed = of(&o);
        assert_eq!(
            (failed.status, failed.reason.as_str()),
            (false, "DeadlineExceeded")
        );
        assert_eq!(
            failed.message,
            "migration Job shop-migrate-mh failed (2 failure(s)): too slow"
        );
    }

    #[test]
    fn nothing_is_said_when_nothing_was_applied() {
        let mut o = fixture::observed();
        o.problems = vec!["spec.schema: bad".into()];
        assert_eq!(desired(&Facts::of(&o)), None);
        o.problems.clear();
        o.secret_problem = Some("no Secret".into());
        assert_eq!(desired(&Facts::of(&o)), None);
    }
}
