//! The status step: the database's view (once the schema exists), the status computed from
//! everything observed ([`status::compute`]), a Warning Event when `Degraded` turns to a
//! problem of the operator's part or a perspective's lock conflicts turn persistent, and the
//! status written when it changed.

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::ResourceExt;
use perspective_worker::store::status::{
    lock_contention_message, Status as DbStatus, PERSISTENT_LOCK_CONFLICTS_PER_MINUTE,
};
use serde_json::json;
use tracing::warn;

use super::apply::Outcome;
use super::context::Context;
use super::error::Error;
use super::resolve::Resolved;
use super::validate::Validated;
use crate::crd::{PerspectiveDeployment, PerspectiveDeploymentStatus};
use crate::events::{Event, EventType};
use crate::migration_job::JobState;
use crate::status::condition::DEGRADED;
use crate::status::{self, Observed};

/// Writes the status of `pd` from what this reconcile found, validated and applied.
pub async fn update_status(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    r: &Resolved,
    previous: &PerspectiveDeploymentStatus,
    database_url: Option<&str>,
    validated: Validated,
    outcome: Outcome,
) -> Result<(), Error> {
    let migrated = outcome.job == Some(JobState::Succeeded) || previous.migrated_hash.is_some();
    let database = match database_url {
        Some(url) if migrated => Some(read_database(ctx, pd, r, url).await),
        _ => None,
    };
    let observed = Observed {
        instance: r.name.clone(),
        generation: pd.metadata.generation,
        paused: validated.paused,
        problems: validated.problems,
        secret_problem: validated.secret_problem,
        rejected: outcome.rejected,
        target: r.target.clone(),
        config_hash: r.config_hash.clone(),
        job: outcome.job,
        migration_failures: outcome.failures.count,
        statefulset: outcome.statefulset,
        desired_replicas: pd.spec.replicas,
        database,
    };
    let mut new_status = status::compute(previous, &observed, Timestamp::now());
    new_status.last_migration_failure = outcome.failures.last;

    report_degraded_change(ctx, pd, previous, &new_status).await;
    report_lock_contention(ctx, pd, previous, &new_status).await;
    if new_status != *previous {
        let pds: Api<PerspectiveDeployment> = Api::namespaced(ctx.client.clone(), &r.namespace);
        pds.patch_status(
            &r.name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": new_status })),
        )
        .await?;
    }
    Ok(())
}

/// The database's view of the deployment's schema (`Err` says why it could not be read).
async fn read_database(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    r: &Resolved,
    url: &str,
) -> Result<DbStatus, String> {
    let spec = &pd.spec;
    let names: Vec<String> = spec.perspectives.iter().map(|p| p.name.clone()).collect();
    let stale_after = f64::from(spec.worker.abandon_stale_instance_threshold_seconds);
    ctx.lag
        .read(&r.key, url, &spec.schema, &names, stale_after)
        .await
}

/// Degraded reasons that say the operator could not do its part; each new message is a Warning
/// Event (the other reasons — a failed migration, failing events — have their own).
const REPORTED_DEGRADED: [&str; 3] = ["InvalidSpec", "SecretMissing", "ChildRejected"];

/// The reason and message of a `Degraded=True` that is one of [`REPORTED_DEGRADED`].
fn reported_degraded(s: &PerspectiveDeploymentStatus) -> Option<(&'static str, &str)> {
    let c = s.conditions.iter().find(|c| {
        c.type_ == DEGRADED && c.status == "True" && REPORTED_DEGRADED.contains(&c.reason.as_str())
    })?;
    let reason = REPORTED_DEGRADED.into_iter().find(|r| *r == c.reason)?;
    Some((reason, c.message.as_str()))
}

/// A Warning Event (and a log line) when Degraded turns to one of [`REPORTED_DEGRADED`] or its
/// message changes.
async fn report_degraded_change(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) {
    let Some((reason, problem)) = reported_degraded(new) else {
        return;
    };
    if reported_degraded(previous) == Some((reason, problem)) {
        return;
    }
    warn!(
        namespace = pd.namespace().unwrap_or_default(),
        name = %pd.name_any(),
        reason,
        problem = %problem,
        "PerspectiveDeployment degraded"
    );
    let event = Event {
        type_: EventType::Warning,
        reason,
        note: problem.to_owned(),
        related: None,
    };
    ctx.publish(pd, event).await;
}

/// The Warning Event `LockContention`, when perspectives' lock conflicts turned persistent
/// (at least [`PERSISTENT_LOCK_CONFLICTS_PER_MINUTE`] a minute) since the previous status: one
/// line per such perspective. Once per change — not again while they stay persistent, however
/// their count moves, but again if they calm down and come back.
fn lock_contention_note(
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) -> Option<String> {
    let persistent = |n: i64| n >= PERSISTENT_LOCK_CONFLICTS_PER_MINUTE;
    let lines: Vec<String> = new
        .perspectives
        .iter()
        .filter(|p| persistent(p.lock_conflicts_per_minute))
        .filter(|p| {
            !previous
                .perspectives
                .iter()
                .any(|q| q.name == p.name && persistent(q.lock_conflicts_per_minute))
        })
        .map(|p| lock_contention_message(&p.name, p.lock_conflicts_per_minute))
        .collect();
    (!lines.is_empty()).then(|| lines.join("; "))
}

/// A Warning Event (and a log line) when a perspective's lock conflicts turn persistent (see
/// [`lock_contention_note`]).
async fn report_lock_contention(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) {
    let Some(note) = lock_contention_note(previous, new) else {
        return;
    };
    warn!(
        namespace = pd.namespace().unwrap_or_default(),
        name = %pd.name_any(),
        contention = %note,
        "lock conflicts between appliers persist"
    );
    let event = Event {
        type_: EventType::Warning,
        reason: "LockContention",
        note,
        related: None,
    };
    ctx.publish(pd, event).await;
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    use super::*;

    fn degraded(status: &str, reason: &str, message: &str) -> PerspectiveDeploymentStatus {
        PerspectiveDeploymentStatus {
            conditions: vec![Condition {
                type_: DEGRADED.into(),
                status: status.into(),
                reason: reason.into(),
                message: message.into(),
                observed_generation: None,
                last_transition_time: Time(Timestamp::UNIX_EPOCH),
            }],
            ..Default::default()
        }
    }

    fn conflicts(figures: &[(&str, i64)]) -> PerspectiveDeploymentStatus {
        PerspectiveDeploymentStatus {
            perspectives: figures
                .iter()
                .map(|(name, n)| crate::crd::PerspectiveLag {
                    name: (*name).into(),
                    lock_conflicts_per_minute: *n,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn lock_contention_is_reported_once_per_change() {
        let calm = conflicts(&[("customer_stats", 3), ("daily", 0)]);
        let contended = conflicts(&[("customer_stats", 40), ("daily", 0)]);
        assert_eq!(lock_contention_note(&calm, &calm), None);
        assert_eq!(
            lock_contention_note(&calm, &contended).as_deref(),
            Some("customer_stats: 40 lock conflicts a minute between appliers; see sequencing")
        );
        // Still persistent, another count: nothing new.
        let still = conflicts(&[("customer_stats", 12), ("daily", 9)]);
        assert_eq!(lock_contention_note(&contended, &still), None);
        // Another perspective joins: only it is named.
        let both = conflicts(&[("customer_stats", 12), ("daily", 10)]);
        assert_eq!(
            lock_contention_note(&still, &both).as_deref(),
            Some("daily: 10 lock conflicts a minute between appliers; see sequencing")
        );
        // Calm, then back: reported again; from a status without figures (first read) too.
        assert_eq!(lock_contention_note(&both, &calm), None);
        assert!(lock_contention_note(&calm, &contended).is_some());
        assert!(
            lock_contention_note(&PerspectiveDeploymentStatus::default(), &contended).is_some()
        );
    }

    #[test]
    fn only_the_operators_own_problems_are_reported() {
        let invalid = degraded("True", "InvalidSpec", "spec.schema: bad");
        assert_eq!(
            reported_degraded(&invalid),
            Some(("InvalidSpec", "spec.schema: bad"))
        );
        let failing = degraded("True", "MigrationFailed", "x");
        assert_eq!(reported_degraded(&failing), None);
        let fine = degraded("False", "AsExpected", "");
        assert_eq!(reported_degraded(&fine), None);
        assert_eq!(
            reported_degraded(&PerspectiveDeploymentStatus::default()),
            None
        );
    }
}
