//! How far the worker StatefulSet is, and what is left before the current spec is rolled out:
//! the step `Ready` and `Progressing` both name.

use perspective_worker::store::status::Status as DbStatus;

use super::observed::Observed;
use crate::workers;

/// How far the worker StatefulSet is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rollout {
    pub exists: bool,
    /// Its template is the one for the current config and migration target.
    pub current_template: bool,
    /// All pods run the current template revision.
    pub rolled: bool,
    pub replicas: i32,
    pub ready: i32,
}

impl Rollout {
    /// The rollout of the observed StatefulSet (none: nothing exists, nothing is ready).
    pub fn of(o: &Observed) -> Rollout {
        let Some(sts) = &o.statefulset else {
            return Rollout {
                exists: false,
                current_template: false,
                rolled: false,
                replicas: 0,
                ready: 0,
            };
        };
        let template = sts.spec.as_ref().map(|s| &s.template);
        let current_template = template.is_some_and(|t| {
            workers::template_migration_hash(t).as_deref() == Some(o.target.hash.as_str())
                && workers::template_config_hash(t).as_deref() == Some(o.config_hash.as_str())
        });
        let status = sts.status.clone().unwrap_or_default();
        let observed =
            status.observed_generation.unwrap_or(0) >= sts.metadata.generation.unwrap_or(0);
        let rolled = observed
            && status.update_revision.is_some()
            && status.current_revision == status.update_revision
            && status.updated_replicas.unwrap_or(0) == status.replicas;
        Rollout {
            exists: true,
            current_template,
            rolled,
            replicas: status.replicas,
            ready: status.ready_replicas.unwrap_or(0),
        }
    }

    /// As many pods as desired, all of them ready.
    pub fn pods_ready(&self, desired: i32) -> bool {
        self.exists && self.replicas == desired && self.ready >= desired
    }
}

/// A step of the rollout still to come: its reason (a condition reason) and what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub reason: &'static str,
    pub message: String,
}

impl Step {
    fn new(reason: &'static str, message: impl Into<String>) -> Option<Step> {
        Some(Step {
            reason,
            message: message.into(),
        })
    }
}

/// What is left before the current spec is fully rolled out (`None`: it is). While paused
/// nothing is created or changed, so each step says it waits for the unpause.
pub fn remaining_step(
    o: &Observed,
    r: &Rollout,
    migrated: bool,
    db: Option<&DbStatus>,
) -> Option<Step> {
    let desired = o.desired_replicas;
    if !migrated && o.paused && o.job.is_none() {
        Step::new(
            "Paused",
            format!(
                "spec.paused is true: migration Job {} for the current spec is created when it is false",
                o.target.job_name
            ),
        )
    } else if !migrated {
        Step::new(
            "MigrationPending",
            format!("waiting for migration Job {}", o.target.job_name),
        )
    } else if !(r.current_template && r.rolled) {
        if o.paused {
            Step::new(
                "Paused",
                "spec.paused is true: the worker pods keep their template until it is false",
            )
        } else {
            Step::new(
                "RollingOut",
                "worker pods are not all running the current template",
            )
        }
    } else if !r.pods_ready(desired) {
        if o.paused && r.replicas != desired {
            Step::new(
                "Paused",
                format!(
                    "spec.paused is true: {} worker pods ({} ready), scaled to {desired} when it is false",
                    r.replicas, r.ready
                ),
            )
        } else {
            Step::new(
                "WaitingForPods",
                format!("{}/{desired} worker pods ready", r.ready),
            )
        }
    } else if let Some(live) = db
        .map(|d| d.live_instances)
        .filter(|live| *live < i64::from(desired))
    {
        // Pods can look ready before their workers heartbeat: trust the database too. (When it
        // cannot be read, Degraded says so and readiness rests on the pods alone.)
        Step::new(
            "WaitingForWorkers",
            format!("{live}/{desired} workers registered in the database"),
        )
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration_job::JobState;
    use crate::status::facts::fixture;

    #[test]
    fn a_statefulset_is_current_and_rolled_only_for_this_target_and_config() {
        let none = Rollout::of(&fixture::observed());
        assert!(!none.exists && !none.pods_ready(0));
        let o = fixture::migrated(3);
        let r = Rollout::of(&o);
        assert!(r.exists && r.current_template && r.rolled && r.pods_ready(3));
        let mut other = fixture::observed();
        other.statefulset = Some(fixture::statefulset("mh", "other", 3, false));
        let r = Rollout::of(&other);
        assert!(!r.current_template && !r.rolled);
    }

    #[test]
    fn the_remaining_step_names_what_waits() {
        let step = |o: &Observed| {
            let r = Rollout::of(o);
            let migrated = o.job == Some(JobState::Succeeded);
            remaining_step(o, &r, migrated, None).map(|s| s.reason)
        };
        let mut o = fixture::observed();
        assert_eq!(step(&o), Some("MigrationPending"));
        o.paused = true;
        assert_eq!(step(&o), Some("Paused"));
        let mut o = fixture::migrated(3);
        assert_eq!(step(&o), None);
        o.statefulset = Some(fixture::statefulset("mh", "ch", 3, false));
        assert_eq!(step(&o), Some("RollingOut"));
        o.statefulset = Some(fixture::statefulset("mh", "ch", 2, true));
        assert_eq!(step(&o), Some("WaitingForPods"));
    }
}
