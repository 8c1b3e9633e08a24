//! `Ready`: the data plane serves — the current spec migrated, its database readable, its pods
//! ready and its workers registered; a deployment that was ready stays ready (`MinimumAvailable`) while a later spec
//! migrates or rolls out, and (`PreviousSpecServing`) while a spec error — invalid, refused,
//! its migration failed — leaves the previous spec's workers running, as long as enough of its
//! pods are. A lost database makes it unready whatever the pods say.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::{is_true, Desired, READY};
use crate::status::facts::Facts;

/// `Ready` from the facts and the previous conditions (was it ready?).
pub fn desired(f: &Facts, previous: &[Condition]) -> Desired {
    let o = f.observed;
    let r = &f.rollout;
    let was_ready = is_true(previous, READY);
    if let Some(problem) = f.database_problem {
        // Pods may still pass their probes; without the database nothing is applied.
        let message = format!("{} (see Degraded)", problem.message());
        return Desired::new(READY, false, problem.reason(), message);
    }
    if let Some((reason, message)) = spec_error(f) {
        // A spec error changes no running pod: the previous spec's workers keep applying
        // events, so a deployment that served goes on serving (Degraded says what is wrong).
        if was_ready && r.exists && r.ready >= min_available(o.desired_replicas) {
            let message = format!(
                "{}/{} worker pods of the previous spec ready and applying events; the \
                 current spec is not applied: {message}",
                r.ready, o.desired_replicas
            );
            return Desired::new(READY, true, "PreviousSpecServing", message);
        }
        return Desired::new(READY, false, reason, message);
    }
    if f.secret_missing {
        return Desired::new(
            READY,
            false,
            "SecretMissing",
            "the database Secret cannot be read (see Degraded)",
        );
    }
    let Some(step) = &f.step else {
        let message = match f.db {
            Some(d) => format!(
                "{}/{} worker pods ready, {} workers registered",
                r.ready, o.desired_replicas, d.live_instances
            ),
            None => format!("{}/{} worker pods ready", r.ready, o.desired_replicas),
        };
        return Desired::new(READY, true, "Available", message);
    };
    // A later spec migrating or rolling out (a new perspective, a version bump), or a pod
    // restarting: the running workers keep applying events, so a deployment that was ready
    // stays ready while enough of them are (Progressing says what is under way).
    if was_ready && r.exists && r.ready >= min_available(o.desired_replicas) {
        let message = if o.paused {
            // The count the spec asks for waits for the unpause: the step says so.
            step.message.clone()
        } else {
            format!(
                "{}/{} worker pods ready; {}",
                r.ready, o.desired_replicas, step.message
            )
        };
        return Desired::new(READY, true, "MinimumAvailable", message);
    }
    Desired::new(READY, false, step.reason, step.message.clone())
}

/// The reason and message of a spec error: an invalid spec, a child the API server refused,
/// a failed migration (a typo in a handler that only the migration finds).
fn spec_error(f: &Facts) -> Option<(&'static str, &'static str)> {
    if f.invalid {
        Some(("InvalidSpec", "the spec is invalid (see Degraded)"))
    } else if f.secret_missing {
        None
    } else if f.rejected.is_some() {
        Some((
            "ChildRejected",
            "the API server refused a child object (see Degraded)",
        ))
    } else if f.failed {
        Some((
            "MigrationFailed",
            "the migration failed (see MigrationsApplied)",
        ))
    } else {
        None
    }
}

/// Ready pods a ready deployment needs to stay ready while pods are replaced: one fewer than
/// desired (the disruption budget's one at a time), but at least one.
pub fn min_available(desired: i32) -> i32 {
    if desired <= 1 {
        desired
    } else {
        desired - 1
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::migration_job::JobState;
    use crate::status::condition::merge;
    use crate::status::facts::fixture;
    use crate::status::observed::DatabaseProblem;
    use crate::status::Observed;

    fn ready(o: &Observed, was_ready: bool) -> Desired {
        let previous = merge(
            &[],
            &[Desired::new(READY, was_ready, "Earlier", "")],
            Some(1),
            Timestamp::UNIX_EPOCH,
        );
        desired(&Facts::of(o), &previous)
    }

    #[test]
    fn available_when_migrated_rolled_out_and_registered() {
        let mut o = fixture::migrated(3);
        let r = ready(&o, false);
        assert_eq!((r.status, r.reason.as_str()), (true, "Available"));
        assert_eq!(r.message, "3/3 worker pods ready");
        o.database = Some(Ok(fixture::database(3, vec![])));
        assert_eq!(
            ready(&o, false).message,
            "3/3 worker pods ready, 3 workers registered"
        );
        o.database = Some(Ok(fixture::database(2, vec![])));
        let waiting = ready(&o, false);
        assert_eq!(
            (waiting.status, waiting.reason.as_str()),
            (false, "WaitingForWorkers")
        );
    }

    #[test]
    fn a_problem_before_it_ever_served_makes_it_unready() {
        let mut o = fixture::migrated(3);
        o.job = Some(JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: "m".into(),
            at: None,
        });
        assert_eq!(ready(&o, false).reason, "MigrationFailed");
        o.rejected = Some("x".into());
        assert_eq!(ready(&o, false).reason, "ChildRejected");
        o.secret_problem = Some("x".into());
        assert_eq!(ready(&o, false).reason, "SecretMissing");
        o.problems = vec!["spec.a: x".into()];
        let r = ready(&o, false);
        assert_eq!((r.status, r.reason.as_str()), (false, "InvalidSpec"));
    }

    #[test]
    fn a_spec_error_leaves_a_serving_deployment_ready_while_its_pods_are() {
        let mut o = fixture::migrated(3);
        o.problems = vec!["spec.perspectives[0].handlers.Tick: syntax error".into()];
        let kept = ready(&o, true);
        assert_eq!(
            (kept.status, kept.reason.as_str()),
            (true, "PreviousSpecServing")
        );
        assert_eq!(
            kept.message,
            "3/3 worker pods of the previous spec ready and applying events; the current spec \
             is not applied: the spec is invalid (see Degraded)"
        );
        o.problems.clear();
        o.job = Some(JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: "m".into(),
            at: None,
        });
        assert_eq!(ready(&o, true).reason, "PreviousSpecServing");
        o.job = Some(JobState::Succeeded);
        o.rejected = Some("x".into());
        assert_eq!(ready(&o, true).reason, "PreviousSpecServing");
        // Too few of the previous spec's pods left: not serving.
        o.statefulset = Some(fixture::statefulset("old", "ch", 1, true));
        let gone = ready(&o, true);
        assert_eq!(
            (gone.status, gone.reason.as_str()),
            (false, "ChildRejected")
        );
        // A missing Secret is not a spec error: the workers cannot restart without it.
        o.rejected = None;
        o.statefulset = Some(fixture::statefulset("old", "ch", 3, true));
        o.secret_problem = Some("x".into());
        assert_eq!(ready(&o, true).reason, "SecretMissing");
        // A lost database is not serving, whatever the spec.
        o.secret_problem = None;
        o.problems = vec!["spec.a: x".into()];
        o.migrated_hash = Some("mh".into());
        o.database = Some(Err(DatabaseProblem::Unreachable("refused".into())));
        assert_eq!(ready(&o, true).reason, "DatabaseUnreachable");
    }

    #[test]
    fn a_lost_database_makes_it_unready_until_it_is_back() {
        let mut o = fixture::migrated(3);
        o.database = Some(Err(DatabaseProblem::Unreachable(
            "database \"shop\" does not exist".into(),
        )));
        let lost = ready(&o, true);
        assert_eq!(
            (lost.status, lost.reason.as_str()),
            (false, "DatabaseUnreachable")
        );
        assert_eq!(
            lost.message,
            "cannot read status from the database: database \"shop\" does not exist (see Degraded)"
        );
        o.database = Some(Err(DatabaseProblem::SchemaMissing("gone".into())));
        assert_eq!(ready(&o, true).reason, "SchemaMissing");
        // Its Job runs again: a deployment that was ready does not stay ready meanwhile.
        o.job = Some(JobState::Running);
        assert_eq!(ready(&o, true).reason, "SchemaMissing");
        // Migrated again, the database read: ready by itself.
        o.job = Some(JobState::Succeeded);
        o.database = Some(Ok(fixture::database(3, vec![])));
        let back = ready(&o, false);
        assert_eq!((back.status, back.reason.as_str()), (true, "Available"));
    }

    #[test]
    fn a_ready_deployment_stays_ready_while_enough_pods_are() {
        let mut o = fixture::migrated(2);
        let kept = ready(&o, true);
        assert_eq!(
            (kept.status, kept.reason.as_str()),
            (true, "MinimumAvailable")
        );
        assert_eq!(kept.message, "2/3 worker pods ready; 2/3 worker pods ready");
        let first = ready(&o, false);
        assert_eq!(
            (first.status, first.reason.as_str()),
            (false, "WaitingForPods")
        );
        o.statefulset = Some(fixture::statefulset("mh", "ch", 1, true));
        assert_eq!(ready(&o, true).reason, "WaitingForPods");
    }

    #[test]
    fn a_new_target_keeps_a_ready_deployment_ready_and_says_what_waits() {
        let mut o = fixture::observed();
        o.job = Some(JobState::Running);
        o.statefulset = Some(fixture::statefulset("old", "ch", 3, true));
        let r = ready(&o, true);
        assert_eq!((r.status, r.reason.as_str()), (true, "MinimumAvailable"));
        assert_eq!(
            r.message,
            "3/3 worker pods ready; waiting for migration Job shop-migrate-mh"
        );
        o.paused = true;
        o.job = None;
        let paused = ready(&o, true);
        assert!(
            paused.message.starts_with("spec.paused is true"),
            "{}",
            paused.message
        );
        assert_eq!(ready(&o, false).reason, "Paused");
    }

    #[test]
    fn a_version_built_beside_the_live_one_leaves_it_ready() {
        use perspective_worker::store::catchup::progress::Phase;
        use perspective_worker::store::status::PerspectiveStatus;
        // The old version serves throughout a blue/green build and its switch.
        for phase in [Phase::Building, Phase::Switching, Phase::Live] {
            let mut o = fixture::migrated(3);
            o.database = Some(Ok(fixture::database(
                3,
                vec![PerspectiveStatus {
                    name: "orders".into(),
                    configured: true,
                    phase,
                    version: Some(2),
                    next_version: (phase != Phase::Live).then_some(3),
                    ..Default::default()
                }],
            )));
            for was_ready in [true, false] {
                let r = ready(&o, was_ready);
                assert_eq!(
                    (r.status, r.reason.as_str()),
                    (true, "Available"),
                    "{phase:?}"
                );
            }
        }
    }

    #[test]
    fn one_pod_may_be_replaced_at_a_time_but_never_the_last() {
        assert_eq!([0, 1, 2, 3, 5].map(min_available), [0, 1, 1, 2, 4]);
    }
}
