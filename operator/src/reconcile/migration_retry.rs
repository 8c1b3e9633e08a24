//! What to do about the current target's migration Job, decided without IO: create it when
//! there is none, announce its success once, and when it failed, count the failure once and
//! run it again (the same name, created anew) after [`migration_job::retry_delay`] from when
//! it failed. Failures are counted per target: a new target starts from zero.
//!
//! A Job that succeeded runs again when the database answers but the schema has gone from it
//! (dropped, or a recreated database): the first time at once, each later time for the same
//! target [`migration_job::retry_delay`] after the previous rerun, so a schema that stays missing
//! after its migration (say, the Job migrates another database than the one status is read
//! from) is not a loop of Jobs. An unreachable database never starts a Job.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::crd::PerspectiveDeploymentStatus;
use crate::migration_job::{self, JobState, MigrationTarget};

/// The failures of the current target's Job so far, as the status records them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Failures {
    pub count: i32,
    /// When the last counted failure happened (the Job's `Failed` condition).
    pub last: Option<Time>,
}

impl Failures {
    /// The failures `previous` recorded, when they are `target`'s; none for a new target.
    pub fn carried(previous: &PerspectiveDeploymentStatus, target: &MigrationTarget) -> Failures {
        if previous.migration_job.as_deref() == Some(target.job_name.as_str()) {
            Failures {
                count: previous.migration_failures,
                last: previous.last_migration_failure.clone(),
            }
        } else {
            Failures::default()
        }
    }
}

/// The reruns of the current target's Job because the schema had gone, as the status records
/// them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recreations {
    pub count: i32,
    /// When the last rerun started.
    pub last: Option<Time>,
}

impl Recreations {
    /// The reruns `previous` recorded, when they are `target`'s; none for a new target.
    pub fn carried(
        previous: &PerspectiveDeploymentStatus,
        target: &MigrationTarget,
    ) -> Recreations {
        if previous.migration_job.as_deref() == Some(target.job_name.as_str()) {
            Recreations {
                count: previous.schema_recreations,
                last: previous.last_schema_recreation.clone(),
            }
        } else {
            Recreations::default()
        }
    }
}

/// The next step for the current target's Job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// No Job exists for the target: create it.
    Create,
    /// It is running: wait for it.
    Wait,
    /// It succeeded; `announce`: for the first time for this target (the status has not
    /// recorded the target as migrated).
    Succeeded { announce: bool },
    /// It succeeded but the schema has gone: run it again (`Now`: the reruns with this one
    /// counted), or wait.
    SchemaMissing {
        recreations: Recreations,
        retry: Retry,
    },
    /// It failed: the failures with this one counted, whether it was newly counted (announce
    /// it), and when to run it again.
    Failed {
        failures: Failures,
        newly_counted: bool,
        retry: Retry,
    },
}

/// When a failed Job runs again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Now: delete the failed Job so the next reconcile creates it anew.
    Now,
    /// After this long.
    In(Duration),
}

/// What the reconcile knows besides the Job's state: the failures and reruns recorded so far,
/// the hash the status records as migrated, whether the database answered without the
/// schema, the time and the retry delay's base.
#[derive(Debug, Clone)]
pub struct Known<'a> {
    pub failures: &'a Failures,
    pub recreations: &'a Recreations,
    pub target: &'a MigrationTarget,
    pub migrated_hash: Option<&'a str>,
    pub schema_missing: bool,
    pub now: Timestamp,
    pub base: Duration,
}

/// The next step for the Job in state `job`.
pub fn next(job: Option<&JobState>, k: &Known) -> Next {
    match job {
        None => Next::Create,
        Some(JobState::Running) => Next::Wait,
        Some(JobState::Succeeded) if k.schema_missing => recreate(k.recreations, k.now, k.base),
        Some(JobState::Succeeded) => Next::Succeeded {
            announce: k.migrated_hash != Some(k.target.hash.as_str()),
        },
        Some(JobState::Failed { at, .. }) => failed(*at, k.failures, k.now, k.base),
    }
}

/// A succeeded Job whose schema has gone: rerun now if it never was for this target or
/// `retry_delay(count)` has passed since the last rerun; else wait for that.
fn recreate(so_far: &Recreations, now: Timestamp, base: Duration) -> Next {
    let due = so_far.last.as_ref().map_or(now.as_second(), |last| {
        let delay = migration_job::retry_delay(so_far.count, base);
        last.0.as_second() + delay.as_secs() as i64
    });
    let wait = u64::try_from(due - now.as_second()).unwrap_or(0);
    if wait > 0 {
        return Next::SchemaMissing {
            recreations: so_far.clone(),
            retry: Retry::In(Duration::from_secs(wait)),
        };
    }
    Next::SchemaMissing {
        recreations: Recreations {
            count: so_far.count + 1,
            last: Some(Time(now)),
        },
        retry: Retry::Now,
    }
}

/// A Job that failed at `at` (unknown: taken as `now`): each failure is counted once (a new
/// failure time, or none counted yet), and retried `retry_delay(count)` after it happened.
fn failed(at: Option<Timestamp>, failures: &Failures, now: Timestamp, base: Duration) -> Next {
    let at_time = at.map(Time);
    let newly_counted = failures.last != at_time || failures.count == 0;
    let failures = if newly_counted {
        Failures {
            count: failures.count + 1,
            last: at_time,
        }
    } else {
        failures.clone()
    };
    let retry_at = retry_at(at, failures.count, now, base).as_second();
    let wait = Duration::from_secs(u64::try_from(retry_at - now.as_second()).unwrap_or(0));
    Next::Failed {
        failures,
        newly_counted,
        retry: if wait.is_zero() {
            Retry::Now
        } else {
            Retry::In(wait)
        },
    }
}

/// When a Job that failed at `at` (unknown: `now`), with `count` failures counted, runs again:
/// `retry_delay(count)` after it failed.
pub fn retry_at(at: Option<Timestamp>, count: i32, now: Timestamp, base: Duration) -> Timestamp {
    let delay = migration_job::retry_delay(count, base);
    let second = at.unwrap_or(now).as_second() + delay.as_secs() as i64;
    Timestamp::from_second(second).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: Duration = Duration::from_secs(30);

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    fn target() -> MigrationTarget {
        MigrationTarget {
            hash: "abc".into(),
            job_name: "shop-migrate-abc".into(),
        }
    }

    fn failed_at(secs: Option<i64>) -> JobState {
        JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: "m".into(),
            at: secs.map(at),
        }
    }

    fn failures(count: i32, last: Option<i64>) -> Failures {
        Failures {
            count,
            last: last.map(|s| Time(at(s))),
        }
    }

    fn known<'a>(
        failures: &'a Failures,
        recreations: &'a Recreations,
        target: &'a MigrationTarget,
        now: i64,
    ) -> Known<'a> {
        Known {
            failures,
            recreations,
            target,
            migrated_hash: None,
            schema_missing: false,
            now: at(now),
            base: BASE,
        }
    }

    fn decide(job: Option<&JobState>, so_far: &Failures, now: i64) -> Next {
        next(job, &known(so_far, &Recreations::default(), &target(), now))
    }

    fn recreations(count: i32, last: Option<i64>) -> Recreations {
        Recreations {
            count,
            last: last.map(|s| Time(at(s))),
        }
    }

    /// The step for a succeeded Job whose schema is missing, after `so_far` reruns.
    fn missing(so_far: &Recreations, now: i64) -> Next {
        let t = target();
        let none = Failures::default();
        let k = Known {
            migrated_hash: Some("abc"),
            schema_missing: true,
            ..known(&none, so_far, &t, now)
        };
        next(Some(&JobState::Succeeded), &k)
    }

    #[test]
    fn a_schema_that_has_gone_is_migrated_again_at_once_the_first_time() {
        assert_eq!(
            missing(&Recreations::default(), 5_000),
            Next::SchemaMissing {
                recreations: recreations(1, Some(5_000)),
                retry: Retry::Now,
            }
        );
        // Found again long after the last rerun: at once too.
        assert_eq!(
            missing(&recreations(3, Some(1_000)), 9_000),
            Next::SchemaMissing {
                recreations: recreations(4, Some(9_000)),
                retry: Retry::Now,
            }
        );
    }

    #[test]
    fn a_schema_still_missing_after_its_rerun_waits_longer_each_time() {
        // Rerun at 5 000 (the first); missing again at 5 010: wait for 5 000 + 30 s.
        assert_eq!(
            missing(&recreations(1, Some(5_000)), 5_010),
            Next::SchemaMissing {
                recreations: recreations(1, Some(5_000)),
                retry: Retry::In(Duration::from_secs(20)),
            }
        );
        let Next::SchemaMissing {
            retry,
            recreations: r,
        } = missing(&recreations(1, Some(5_000)), 5_030)
        else {
            panic!("not missing")
        };
        assert_eq!((retry, r), (Retry::Now, recreations(2, Some(5_030))));
        // After the second: 60 s.
        let Next::SchemaMissing { retry, .. } = missing(&recreations(2, Some(5_030)), 5_060) else {
            panic!("not missing")
        };
        assert_eq!(retry, Retry::In(Duration::from_secs(30)));
    }

    #[test]
    fn only_a_succeeded_job_is_rerun_for_a_missing_schema() {
        let t = target();
        let none = Failures::default();
        let r = Recreations::default();
        let k = Known {
            schema_missing: true,
            ..known(&none, &r, &t, 100)
        };
        assert_eq!(next(None, &k), Next::Create);
        assert_eq!(next(Some(&JobState::Running), &k), Next::Wait);
        assert!(matches!(
            next(Some(&failed_at(Some(90))), &k),
            Next::Failed { .. }
        ));
        // Present (or not known to be missing: an unreachable database): nothing to do.
        let present = Known {
            schema_missing: false,
            migrated_hash: Some("abc"),
            ..k
        };
        assert_eq!(
            next(Some(&JobState::Succeeded), &present),
            Next::Succeeded { announce: false }
        );
    }

    #[test]
    fn reruns_carry_over_only_for_the_same_target() {
        let previous = PerspectiveDeploymentStatus {
            migration_job: Some("shop-migrate-abc".into()),
            schema_recreations: 2,
            last_schema_recreation: Some(Time(at(7))),
            ..Default::default()
        };
        assert_eq!(
            Recreations::carried(&previous, &target()),
            recreations(2, Some(7))
        );
        let other = MigrationTarget {
            hash: "def".into(),
            job_name: "shop-migrate-def".into(),
        };
        assert_eq!(
            Recreations::carried(&previous, &other),
            Recreations::default()
        );
    }

    #[test]
    fn a_missing_job_is_created_and_a_running_one_waited_for() {
        assert_eq!(decide(None, &Failures::default(), 100), Next::Create);
        assert_eq!(
            decide(Some(&JobState::Running), &failures(2, Some(10)), 100),
            Next::Wait
        );
    }

    #[test]
    fn success_is_announced_once_per_target() {
        let t = target();
        let ok = Some(&JobState::Succeeded);
        let (none, r) = (Failures::default(), Recreations::default());
        let with = |migrated_hash| Known {
            migrated_hash,
            ..known(&none, &r, &t, 1)
        };
        let first = next(ok, &with(Some("older")));
        assert_eq!(first, Next::Succeeded { announce: true });
        let unknown = next(ok, &with(None));
        assert_eq!(unknown, Next::Succeeded { announce: true });
        let again = next(ok, &with(Some("abc")));
        assert_eq!(again, Next::Succeeded { announce: false });
    }

    #[test]
    fn a_new_failure_is_counted_and_retried_after_the_base_delay() {
        let job = failed_at(Some(1_000));
        assert_eq!(
            decide(Some(&job), &Failures::default(), 1_010),
            Next::Failed {
                failures: failures(1, Some(1_000)),
                newly_counted: true,
                retry: Retry::In(Duration::from_secs(20)),
            }
        );
    }

    #[test]
    fn a_failure_already_counted_is_not_counted_again() {
        let job = failed_at(Some(1_000));
        let Next::Failed {
            failures: f,
            newly_counted,
            retry,
        } = decide(Some(&job), &failures(1, Some(1_000)), 1_025)
        else {
            panic!("not failed")
        };
        assert_eq!(f, failures(1, Some(1_000)));
        assert!(!newly_counted);
        assert_eq!(retry, Retry::In(Duration::from_secs(5)));
    }

    #[test]
    fn the_retry_is_due_once_the_delay_has_passed() {
        let job = failed_at(Some(1_000));
        let so_far = failures(1, Some(1_000));
        for now in [1_030, 1_031, 5_000] {
            let Next::Failed { retry, .. } = decide(Some(&job), &so_far, now) else {
                panic!("not failed")
            };
            assert_eq!(retry, Retry::Now, "at {now}");
        }
    }

    #[test]
    fn a_later_failure_of_the_recreated_job_doubles_the_delay() {
        // The first run failed at 1 000 and was retried; the new Job failed at 2 000.
        let job = failed_at(Some(2_000));
        assert_eq!(
            decide(Some(&job), &failures(1, Some(1_000)), 2_000),
            Next::Failed {
                failures: failures(2, Some(2_000)),
                newly_counted: true,
                retry: Retry::In(Duration::from_secs(60)),
            }
        );
    }

    #[test]
    fn a_failure_without_a_time_is_counted_once_and_waits_from_now() {
        let job = failed_at(None);
        let first = decide(Some(&job), &Failures::default(), 500);
        assert_eq!(
            first,
            Next::Failed {
                failures: failures(1, None),
                newly_counted: true,
                retry: Retry::In(BASE),
            }
        );
        let Next::Failed { newly_counted, .. } = decide(Some(&job), &failures(1, None), 900) else {
            panic!("not failed")
        };
        assert!(!newly_counted);
    }

    #[test]
    fn failures_carry_over_only_for_the_same_target() {
        let previous = PerspectiveDeploymentStatus {
            migration_job: Some("shop-migrate-abc".into()),
            migration_failures: 3,
            last_migration_failure: Some(Time(at(7))),
            ..Default::default()
        };
        assert_eq!(
            Failures::carried(&previous, &target()),
            failures(3, Some(7))
        );
        let other = MigrationTarget {
            hash: "def".into(),
            job_name: "shop-migrate-def".into(),
        };
        assert_eq!(Failures::carried(&previous, &other), Failures::default());
    }
}
