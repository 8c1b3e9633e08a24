//! Computing a deployment's status from what the reconciler observed: a pure function, so every
//! combination of spec problems, migration state, StatefulSet progress and database lag is
//! unit-tested without a cluster.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use perspective_worker::store::catchup::progress::Phase;
use perspective_worker::store::status::{PerspectiveStatus, Status as DbStatus};

use crate::conditions::{self, Desired};
use crate::crd::{
    PerspectiveDeploymentStatus, PerspectiveLag, PerspectivePhase, PerspectiveProgress,
};
use crate::labels;
use crate::migration_job::{JobState, MigrationTarget};
use crate::workers;

/// Everything the status is computed from.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The deployment's name.
    pub instance: String,
    pub generation: Option<i64>,
    pub paused: bool,
    /// Spec problems, each naming its field; non-empty means nothing was changed.
    pub problems: Vec<String>,
    /// Why the database Secret could not be read (missing, or without the key); nothing was
    /// changed either, and it is looked at again within seconds.
    pub secret_problem: Option<String>,
    /// A child object the API server refused, with its message.
    pub rejected: Option<String>,
    pub target: MigrationTarget,
    pub config_hash: String,
    /// The current target's Job, if it exists.
    pub job: Option<JobState>,
    pub migration_failures: i32,
    pub statefulset: Option<StatefulSet>,
    pub desired_replicas: i32,
    /// The database's view, when it was read (`Err` says why it could not be).
    pub database: Option<Result<DbStatus, String>>,
}

/// How far the worker StatefulSet is.
struct Rollout {
    exists: bool,
    /// Its template is the one for the current config and migration target.
    current_template: bool,
    /// All pods run the current template revision.
    rolled: bool,
    replicas: i32,
    ready: i32,
}

fn rollout(o: &Observed) -> Rollout {
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
    let observed = status.observed_generation.unwrap_or(0) >= sts.metadata.generation.unwrap_or(0);
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

/// The new status: `previous` updated with what was observed at `now`.
pub fn compute(
    previous: &PerspectiveDeploymentStatus,
    o: &Observed,
    now: Timestamp,
) -> PerspectiveDeploymentStatus {
    let r = rollout(o);
    let mut desired = Vec::new();
    let invalid = !o.problems.is_empty();
    let secret_missing = !invalid && o.secret_problem.is_some();
    // Nothing was applied for this spec.
    let blocked = invalid || secret_missing;
    let rejected = o.rejected.as_deref().filter(|_| !blocked);
    let failed = matches!(o.job, Some(JobState::Failed { .. }));
    let migrated = matches!(o.job, Some(JobState::Succeeded));

    desired.push(Desired::new(
        conditions::RECONCILIATION_PAUSED,
        o.paused,
        if o.paused { "Paused" } else { "Active" },
        if o.paused {
            "spec.paused is true: children are not changed"
        } else {
            ""
        },
    ));

    // A spec that fails validation leaves MigrationsApplied as it was: nothing ran for it.
    if !blocked {
        desired.push(match &o.job {
            Some(JobState::Succeeded) => Desired::new(
                conditions::MIGRATIONS_APPLIED,
                true,
                "Succeeded",
                format!("migration Job {} completed", o.target.job_name),
            ),
            Some(JobState::Failed {
                reason, message, ..
            }) => Desired::new(
                conditions::MIGRATIONS_APPLIED,
                false,
                reason,
                format!(
                    "migration Job {} failed ({} failure(s)): {message}",
                    o.target.job_name, o.migration_failures
                ),
            ),
            Some(JobState::Running) => Desired::new(
                conditions::MIGRATIONS_APPLIED,
                false,
                "Running",
                format!("migration Job {} is running", o.target.job_name),
            ),
            None if o.paused => Desired::new(
                conditions::MIGRATIONS_APPLIED,
                false,
                "Paused",
                format!(
                    "migration Job {} will be created when spec.paused is false",
                    o.target.job_name
                ),
            ),
            None => Desired::new(
                conditions::MIGRATIONS_APPLIED,
                false,
                "Pending",
                format!("migration Job {} has not been created", o.target.job_name),
            ),
        });
    }

    let database_error = match &o.database {
        Some(Err(e)) if migrated => Some(e.clone()),
        _ => None,
    };
    let db = match &o.database {
        Some(Ok(s)) => Some(s),
        _ => None,
    };
    let dead_letters: i64 = db.map_or(0, |s| s.perspectives.iter().map(|p| p.dead_letters).sum());
    let failed_streams: i64 =
        db.map_or(0, |s| s.perspectives.iter().map(|p| p.failed_streams).sum());

    desired.push(if invalid {
        Desired::new(conditions::DEGRADED, true, "InvalidSpec", o.problems.join("; "))
    } else if let Some(problem) = o.secret_problem.as_deref() {
        Desired::new(conditions::DEGRADED, true, "SecretMissing", problem)
    } else if let Some(message) = rejected {
        Desired::new(conditions::DEGRADED, true, "ChildRejected", message)
    } else if let Some(JobState::Failed { reason, message, .. }) = &o.job {
        Desired::new(
            conditions::DEGRADED,
            true,
            "MigrationFailed",
            format!("{reason}: {message}"),
        )
    } else if let Some(e) = &database_error {
        Desired::new(
            conditions::DEGRADED,
            true,
            "DatabaseUnreachable",
            format!("cannot read status from the database: {e}"),
        )
    } else if dead_letters > 0 || failed_streams > 0 {
        Desired::new(
            conditions::DEGRADED,
            true,
            "EventsFailing",
            format!(
                "{dead_letters} dead letter(s) waiting for replay, {failed_streams} stream(s) retrying after a failure"
            ),
        )
    } else {
        Desired::new(conditions::DEGRADED, false, "AsExpected", "")
    });

    let pods_ready = r.exists && r.replicas == o.desired_replicas && r.ready >= o.desired_replicas;
    // What is left before the current spec is fully rolled out (None: it is).
    // While paused nothing is created or changed, so each step says it waits for the unpause.
    let rollout_step: Option<(&str, String)> = if !migrated && o.paused && o.job.is_none() {
        Some((
            "Paused",
            format!(
                "spec.paused is true: migration Job {} for the current spec is created when it is false",
                o.target.job_name
            ),
        ))
    } else if !migrated {
        Some((
            "MigrationPending",
            format!("waiting for migration Job {}", o.target.job_name),
        ))
    } else if !(r.current_template && r.rolled) {
        if o.paused {
            Some((
                "Paused",
                "spec.paused is true: the worker pods keep their template until it is false"
                    .to_owned(),
            ))
        } else {
            Some((
                "RollingOut",
                "worker pods are not all running the current template".to_owned(),
            ))
        }
    } else if !pods_ready {
        if o.paused && r.replicas != o.desired_replicas {
            Some((
                "Paused",
                format!(
                    "spec.paused is true: {} worker pods ({} ready), scaled to {} when it is false",
                    r.replicas, r.ready, o.desired_replicas
                ),
            ))
        } else {
            Some((
                "WaitingForPods",
                format!("{}/{} worker pods ready", r.ready, o.desired_replicas),
            ))
        }
    } else if let Some(live) = db
        .map(|d| d.live_instances)
        .filter(|live| *live < i64::from(o.desired_replicas))
    {
        // Pods can look ready before their workers heartbeat: trust the database too. (When it
        // cannot be read, Degraded says so and readiness rests on the pods alone.)
        Some((
            "WaitingForWorkers",
            format!(
                "{live}/{} workers registered in the database",
                o.desired_replicas
            ),
        ))
    } else {
        None
    };
    let was_ready = conditions::is_true(&previous.conditions, conditions::READY);
    let (ready, ready_reason, ready_message) = if invalid {
        (
            false,
            "InvalidSpec",
            "the spec is invalid (see Degraded)".to_owned(),
        )
    } else if secret_missing {
        (
            false,
            "SecretMissing",
            "the database Secret cannot be read (see Degraded)".to_owned(),
        )
    } else if rejected.is_some() {
        (
            false,
            "ChildRejected",
            "the API server refused a child object (see Degraded)".to_owned(),
        )
    } else if failed {
        (
            false,
            "MigrationFailed",
            "the migration failed (see MigrationsApplied)".to_owned(),
        )
    } else {
        match &rollout_step {
            None => (
                true,
                "Available",
                match db {
                    Some(d) => format!(
                        "{}/{} worker pods ready, {} workers registered",
                        r.ready, o.desired_replicas, d.live_instances
                    ),
                    None => format!("{}/{} worker pods ready", r.ready, o.desired_replicas),
                },
            ),
            // A later spec migrating or rolling out (a new perspective, a version bump), or a
            // pod restarting: the running workers keep applying events, so a deployment that was
            // ready stays ready while enough of them are (Progressing says what is under way).
            Some((_, step))
                if was_ready && r.exists && r.ready >= min_available(o.desired_replicas) =>
            {
                (
                    true,
                    "MinimumAvailable",
                    if o.paused {
                        // The count the spec asks for waits for the unpause: the step says so.
                        step.clone()
                    } else {
                        format!(
                            "{}/{} worker pods ready; {step}",
                            r.ready, o.desired_replicas
                        )
                    },
                )
            }
            Some((reason, step)) => (false, *reason, step.clone()),
        }
    };
    desired.push(Desired::new(
        conditions::READY,
        ready,
        ready_reason,
        ready_message,
    ));

    let catching_up = db.map_or_else(Vec::new, |d| catch_up_messages(&d.perspectives));
    let (progressing, p_reason, mut p_message) = if invalid || failed || rejected.is_some() {
        (false, "Stalled", "waiting for a spec change".to_owned())
    } else if secret_missing {
        (
            false,
            "SecretMissing",
            format!(
                "waiting for the database Secret (checked every {} s)",
                crate::reconcile::SECRET_RECHECK.as_secs()
            ),
        )
    } else if o.paused {
        (
            false,
            "Paused",
            match &rollout_step {
                Some((_, step)) => format!("reconciliation is paused; {step}"),
                None => "reconciliation is paused".to_owned(),
            },
        )
    } else if !migrated {
        (
            true,
            "MigrationRunning",
            format!("migration Job {}", o.target.job_name),
        )
    } else if let Some((reason, step)) = &rollout_step {
        (true, *reason, step.clone())
    } else if !catching_up.is_empty() {
        (true, "CatchingUp", String::new())
    } else {
        (
            false,
            "Complete",
            "the current spec is rolled out".to_owned(),
        )
    };
    if progressing && !catching_up.is_empty() {
        p_message = std::iter::once(p_message)
            .filter(|m| !m.is_empty())
            .chain(catching_up)
            .collect::<Vec<_>>()
            .join("; ");
    }
    desired.push(Desired::new(
        conditions::PROGRESSING,
        progressing,
        p_reason,
        p_message,
    ));

    let mut status = previous.clone();
    status.observed_generation = o.generation;
    status.conditions = conditions::merge(&previous.conditions, &desired, o.generation, now);
    status.replicas = r.replicas;
    status.ready_replicas = r.ready;
    status.replicas_summary = Some(format!("{}/{}", r.ready, o.desired_replicas));
    status.selector = Some(labels::selector_string(&labels::worker_selector(
        &o.instance,
    )));
    if !blocked {
        status.migration_job = Some(o.target.job_name.clone());
        status.migration_failures = o.migration_failures;
        if migrated {
            status.migrated_hash = Some(o.target.hash.clone());
        }
    }
    if let Some(db) = db {
        status.perspectives = db
            .perspectives
            .iter()
            .map(|p| PerspectiveLag {
                name: p.name.clone(),
                pending_events: p.pending_events,
                oldest_pending_seconds: p.oldest_pending_seconds.map(|s| s.floor() as i64),
                failed_streams: p.failed_streams,
                dead_letters: p.dead_letters,
                phase: p.phase.into(),
                progress: p.progress.as_ref().map(PerspectiveProgress::from),
            })
            .collect();
        status.phase = Some(phase_summary(&status.perspectives));
        status.pending_events = Some(db.perspectives.iter().map(|p| p.pending_events).sum());
        let oldest = db
            .perspectives
            .iter()
            .filter_map(|p| p.oldest_pending_seconds)
            .fold(0.0_f64, f64::max)
            .floor() as i64;
        status.oldest_pending_seconds = Some(oldest);
        status.lag = Some(format_lag(oldest));
        status.dead_letters = Some(dead_letters);
        status.live_instances = Some(db.live_instances);
    }
    status.summary = Some(summary(
        &status.conditions,
        o.paused,
        status.phase.as_deref(),
    ));
    status
}

/// The `Status` column of `kubectl get pd`: what a `False` in `Ready` means, in a word or two —
/// `Degraded: <reason>` first (something needs a look), then `Paused`, `Migrating`, a catch-up
/// (`Backfilling 61%`), a rollout step (`RollingOut`), `Ready`, else why it is not ready.
pub fn summary(conditions: &[Condition], paused: bool, phase: Option<&str>) -> String {
    let get = |type_: &str| conditions.iter().find(|c| c.type_ == type_);
    let is_true = |type_: &str| get(type_).is_some_and(|c| c.status == "True");
    let reason = |type_: &str| get(type_).map_or("", |c| c.reason.as_str());
    if is_true(conditions::DEGRADED) {
        return format!("Degraded: {}", reason(conditions::DEGRADED));
    }
    if paused {
        return "Paused".to_owned();
    }
    if get(conditions::MIGRATIONS_APPLIED).is_some_and(|c| c.status == "False")
        && ["Running", "Pending"].contains(&reason(conditions::MIGRATIONS_APPLIED))
    {
        return "Migrating".to_owned();
    }
    if let Some(phase) = phase.filter(|p| *p != PerspectivePhase::Live.as_str()) {
        return phase.to_owned();
    }
    if is_true(conditions::PROGRESSING) {
        return reason(conditions::PROGRESSING).to_owned();
    }
    if is_true(conditions::READY) {
        return "Ready".to_owned();
    }
    match reason(conditions::READY) {
        "" => "Pending".to_owned(),
        other => other.to_owned(),
    }
}

/// `42s`, `3m5s`, `2h0m`: short enough for a `kubectl get` column.
pub fn format_lag(seconds: i64) -> String {
    match seconds {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{}s", s / 60, s % 60),
        s => format!("{}h{}m", s / 3600, (s % 3600) / 60),
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

/// One line per perspective that is catching up, e.g. "order_totals backfilling: 61% (…),
/// about 40 s left"; empty when all are live.
pub fn catch_up_messages(perspectives: &[PerspectiveStatus]) -> Vec<String> {
    perspectives
        .iter()
        .filter(|p| p.phase != Phase::Live)
        .map(|p| match &p.progress {
            Some(progress) => progress.message(&p.name, p.phase),
            None => format!("{} {}", p.name, p.phase.as_str().to_lowercase()),
        })
        .collect()
}

/// The `Phase` column: `Live`, or the phase and percent of each catching-up perspective
/// (`Backfilling 61%`, `Backfilling 61%, Rebuilding 5%`).
pub fn phase_summary(perspectives: &[PerspectiveLag]) -> String {
    let catching_up: Vec<String> = perspectives
        .iter()
        .filter(|p| p.phase != PerspectivePhase::Live)
        .map(|p| match &p.progress {
            Some(progress) => format!("{} {}%", p.phase.as_str(), progress.percent),
            None => p.phase.as_str().to_owned(),
        })
        .collect();
    if catching_up.is_empty() {
        PerspectivePhase::Live.as_str().to_owned()
    } else {
        catching_up.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use perspective_worker::store::catchup::progress::Progress;

    fn catching_up(name: &str, phase: Phase, percent: f64) -> PerspectiveStatus {
        PerspectiveStatus {
            name: name.into(),
            phase,
            progress: Some(Progress {
                step: "applying".into(),
                streams_done: 6_100,
                streams_total: 10_000,
                events_total: 1_000,
                events_remaining: 1_000 - (percent * 10.0) as i64,
                percent,
                eta_seconds: Some(40.0),
            }),
            ..Default::default()
        }
    }

    fn lag(p: &PerspectiveStatus) -> PerspectiveLag {
        PerspectiveLag {
            name: p.name.clone(),
            phase: p.phase.into(),
            progress: p.progress.as_ref().map(PerspectiveProgress::from),
            ..Default::default()
        }
    }

    #[test]
    fn live_perspectives_have_nothing_to_report() {
        let live = PerspectiveStatus {
            name: "a".into(),
            ..Default::default()
        };
        assert!(catch_up_messages(std::slice::from_ref(&live)).is_empty());
        assert_eq!(phase_summary(&[lag(&live)]), "Live");
        assert_eq!(phase_summary(&[]), "Live");
    }

    #[test]
    fn each_catching_up_perspective_gets_a_line_and_a_column_entry() {
        let ps = [
            PerspectiveStatus {
                name: "a".into(),
                ..Default::default()
            },
            catching_up("order_totals", Phase::Backfilling, 61.7),
            catching_up("carts", Phase::Rebuilding, 5.0),
        ];
        assert_eq!(
            catch_up_messages(&ps),
            [
                "order_totals backfilling: 61% (617/1 000 events, 6 100/10 000 streams), about 40 s left",
                "carts rebuilding: 5% (50/1 000 events, 6 100/10 000 streams), about 40 s left",
            ]
        );
        let lags: Vec<PerspectiveLag> = ps.iter().map(lag).collect();
        assert_eq!(lags[1].progress.as_ref().unwrap().percent, 61);
        assert_eq!(lags[1].progress.as_ref().unwrap().eta_seconds, Some(40));
        assert_eq!(phase_summary(&lags), "Backfilling 61%, Rebuilding 5%");
    }

    #[test]
    fn a_phase_without_figures_is_still_named() {
        let p = PerspectiveStatus {
            name: "carts".into(),
            phase: Phase::Rebuilding,
            ..Default::default()
        };
        assert_eq!(
            catch_up_messages(std::slice::from_ref(&p)),
            ["carts rebuilding"]
        );
        assert_eq!(phase_summary(&[lag(&p)]), "Rebuilding");
    }

    #[test]
    fn one_pod_may_be_replaced_at_a_time_but_never_the_last() {
        assert_eq!([0, 1, 2, 3, 5].map(min_available), [0, 1, 1, 2, 4]);
    }
}
