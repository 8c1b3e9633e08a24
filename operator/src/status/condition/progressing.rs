//! `Progressing`: whether something is under way — a migration, a rollout step, perspectives
//! catching up — or why nothing is (stalled, paused, waiting for the Secret, complete). While it
//! is, persistent lock contention is named too (it slows what is under way).

use perspective_worker::store::catchup::progress::Phase;
use perspective_worker::store::status::PerspectiveStatus;

use super::{Desired, PROGRESSING};
use crate::status::facts::Facts;
use crate::status::observed::SECRET_RECHECK;

/// `Progressing`, with one line per catching-up perspective, then one per perspective whose
/// lock conflicts persist, appended while it is `True`.
pub fn desired(f: &Facts) -> Desired {
    let o = f.observed;
    let catching_up =
        f.db.map_or_else(Vec::new, |d| catch_up_messages(&d.perspectives));
    let (progressing, reason, message) = if f.invalid || f.rejected.is_some() {
        (false, "Stalled", "waiting for a spec change".to_owned())
    } else if f.failed && !f.secret_missing {
        (false, "MigrationRetryScheduled", retry_message(f))
    } else if f.secret_missing {
        (
            false,
            "SecretMissing",
            format!(
                "waiting for the database Secret (checked every {} s)",
                SECRET_RECHECK.as_secs()
            ),
        )
    } else if o.paused {
        let message = match &f.step {
            Some(step) => format!("reconciliation is paused; {}", step.message),
            None => "reconciliation is paused".to_owned(),
        };
        (false, "Paused", message)
    } else if !f.migrated {
        (
            true,
            "MigrationRunning",
            format!("migration Job {}", o.target.job_name),
        )
    } else if let Some(step) = &f.step {
        (true, step.reason, step.message.clone())
    } else if !catching_up.is_empty() {
        (true, "CatchingUp", String::new())
    } else {
        (
            false,
            "Complete",
            "the current spec is rolled out".to_owned(),
        )
    };
    let message = if progressing {
        std::iter::once(message)
            .filter(|m| !m.is_empty())
            .chain(catching_up)
            .chain(f.lock_contention.iter().cloned())
            .collect::<Vec<_>>()
            .join("; ")
    } else {
        message
    };
    Desired::new(PROGRESSING, progressing, reason, message)
}

/// What waits after a failed migration: when the Job runs again (a spec change runs the new
/// target's Job at once).
fn retry_message(f: &Facts) -> String {
    let o = f.observed;
    let failures = o.migration_failures.max(1);
    let when = match o.next_migration_attempt {
        Some(at) => format!(
            "the next attempt runs at {}",
            at.strftime("%Y-%m-%dT%H:%M:%SZ")
        ),
        None => "the next attempt is being scheduled".to_owned(),
    };
    format!(
        "migration Job {} failed ({failures} failure(s)); {when}, or at once for a changed spec",
        o.target.job_name
    )
}

/// One line per perspective that is catching up, e.g. "order_totals backfilling: 61% (…),
/// about 40 s left"; empty when all are live.
pub fn catch_up_messages(perspectives: &[PerspectiveStatus]) -> Vec<String> {
    perspectives
        .iter()
        .filter(|p| p.phase != Phase::Live)
        .filter_map(|p| p.phase_message())
        .collect()
}

#[cfg(test)]
mod tests {
    use perspective_worker::store::catchup::progress::Progress;

    use super::*;
    use crate::migration_job::JobState;
    use crate::status::facts::fixture;
    use crate::status::Observed;

    fn progressing(o: &Observed) -> (bool, String, String) {
        let d = desired(&Facts::of(o));
        (d.status, d.reason, d.message)
    }

    fn backfilling() -> PerspectiveStatus {
        PerspectiveStatus {
            name: "totals".into(),
            phase: Phase::Backfilling,
            progress: None::<Progress>,
            ..Default::default()
        }
    }

    #[test]
    fn under_way_a_migration_then_a_rollout_then_a_catch_up() {
        let mut o = fixture::observed();
        o.job = Some(JobState::Running);
        assert_eq!(
            progressing(&o),
            (
                true,
                "MigrationRunning".into(),
                "migration Job shop-migrate-mh".into()
            )
        );
        o.job = Some(JobState::Succeeded);
        o.statefulset = Some(fixture::statefulset("mh", "ch", 3, false));
        assert_eq!(progressing(&o).1, "RollingOut");
        o.database = Some(Ok(fixture::database(3, vec![backfilling()])));
        assert_eq!(
            progressing(&o).2,
            "worker pods are not all running the current template; totals backfilling"
        );
        o.statefulset = Some(fixture::statefulset("mh", "ch", 3, true));
        assert_eq!(
            progressing(&o),
            (true, "CatchingUp".into(), "totals backfilling".into())
        );
        o.database = Some(Ok(fixture::database(3, vec![])));
        assert_eq!(
            progressing(&o),
            (
                false,
                "Complete".into(),
                "the current spec is rolled out".into()
            )
        );
    }

    #[test]
    fn while_progressing_persistent_lock_contention_is_named() {
        let contended = PerspectiveStatus {
            name: "customer_stats".into(),
            lock_conflicts_per_minute: 40,
            ..Default::default()
        };
        let mut o = fixture::migrated(3);
        o.database = Some(Ok(fixture::database(
            3,
            vec![backfilling(), contended.clone()],
        )));
        assert_eq!(
            progressing(&o),
            (
                true,
                "CatchingUp".into(),
                "totals backfilling; customer_stats: 40 lock conflicts a minute between \
                 appliers; see sequencing"
                    .into()
            )
        );
        o.statefulset = Some(fixture::statefulset("mh", "ch", 3, false));
        assert_eq!(
            progressing(&o).2,
            "worker pods are not all running the current template; totals backfilling; \
             customer_stats: 40 lock conflicts a minute between appliers; see sequencing"
        );
        // Nothing under way: Degraded names it, Progressing does not.
        o.statefulset = Some(fixture::statefulset("mh", "ch", 3, true));
        o.database = Some(Ok(fixture::database(3, vec![contended])));
        assert_eq!(
            progressing(&o),
            (
                false,
                "Complete".into(),
                "the current spec is rolled out".into()
            )
        );
    }

    #[test]
    fn stalled_paused_or_waiting_for_the_secret() {
        let mut o = fixture::migrated(3);
        o.paused = true;
        assert_eq!(
            progressing(&o),
            (false, "Paused".into(), "reconciliation is paused".into())
        );
        o.secret_problem = Some("no Secret".into());
        assert_eq!(
            progressing(&o),
            (
                false,
                "SecretMissing".into(),
                "waiting for the database Secret (checked every 3 s)".into()
            )
        );
        o.problems = vec!["spec.a: x".into()];
        assert_eq!(
            progressing(&o),
            (false, "Stalled".into(), "waiting for a spec change".into())
        );
    }

    #[test]
    fn a_failed_migration_says_when_it_runs_again() {
        let mut o = fixture::migrated(3);
        o.job = Some(JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: "m".into(),
            at: None,
        });
        o.migration_failures = 2;
        o.next_migration_attempt =
            Some(k8s_openapi::jiff::Timestamp::from_second(1_800_000_060).unwrap());
        assert_eq!(
            progressing(&o),
            (
                false,
                "MigrationRetryScheduled".into(),
                "migration Job shop-migrate-mh failed (2 failure(s)); the next attempt runs at \
                 2027-01-15T08:01:00Z, or at once for a changed spec"
                    .into()
            )
        );
        // A spec error found by validation is still for the author to fix.
        o.problems = vec!["spec.a: x".into()];
        assert_eq!(progressing(&o).1, "Stalled");
    }
}
