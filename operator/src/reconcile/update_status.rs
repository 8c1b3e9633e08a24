//! The status step: the status computed from everything observed ([`status::compute`]), a
//! Warning Event when `Degraded` turns to a problem of the operator's part, when the database
//! is lost (and a Normal one when it is back) or a perspective's lock conflicts turn
//! persistent, a Normal one when a backfill or rebuild finished, and the status written when it
//! changed; then when to refresh it (sooner while a perspective catches up).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::ResourceExt;
use perspective_worker::store::status::{
    lock_contention_message, PERSISTENT_LOCK_CONFLICTS_PER_MINUTE,
};
use serde_json::json;
use tracing::{info, warn};

use super::announcements;
use super::apply::Outcome;
use super::context::Context;
use super::error::Error;
use super::migration_retry;
use super::resolve::Resolved;
use super::validate::Validated;
use crate::crd::{DatabaseState, PerspectiveDeployment, PerspectiveDeploymentStatus};
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
    validated: Validated,
    outcome: Outcome,
) -> Result<Duration, Error> {
    let next_migration_attempt = match &outcome.job {
        Some(JobState::Failed { at, .. }) => Some(migration_retry::retry_at(
            *at,
            outcome.failures.count,
            Timestamp::now(),
            ctx.options.migration_retry_base,
        )),
        _ => None,
    };
    // The image is reported once the spec was accepted (an invalid one changed nothing).
    let observed_image = validated.may_apply();
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
        next_migration_attempt,
        statefulset: outcome.statefulset,
        desired_replicas: pd.spec.replicas,
        migrated_hash: previous.migrated_hash.clone(),
        database: outcome.database,
    };
    let mut new_status = status::compute(previous, &observed, Timestamp::now());
    new_status.last_migration_failure = outcome.failures.last;
    new_status.schema_recreations = outcome.recreations.count;
    new_status.last_schema_recreation = outcome.recreations.last;
    if observed_image {
        new_status.image = Some(r.image.clone());
    }
    if new_status.migrated_hash.as_deref() == Some(r.target.hash.as_str()) {
        new_status.migrated_perspectives = announcements::qualified(&pd.spec);
    }
    new_status.last_action = outcome.last_action;
    let outcome_version = outcome.resource_version;

    if new_status != *previous {
        let pds: Api<PerspectiveDeployment> = Api::namespaced(ctx.client.clone(), &r.namespace);
        let patch = status_patch(previous, &new_status, outcome_version);
        match pds
            .patch_status(&r.name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => {}
            // `previous` came from a cache that had not seen our last write yet: the figures
            // carried from it (reruns, failures) and the Events it would announce are stale.
            // Announce nothing; the next reconcile starts from the newer copy.
            Err(kube::Error::Api(s)) if s.code == 409 => return Err(Error::Stale),
            Err(e) => return Err(e.into()),
        }
    }
    report_degraded_change(ctx, pd, previous, &new_status).await;
    report_database_change(ctx, pd, previous, &new_status).await;
    report_lock_contention(ctx, pd, previous, &new_status).await;
    for event in announcements::catch_up_finished(previous, &new_status) {
        info!(namespace = pd.namespace().unwrap_or_default(), name = %pd.name_any(), note = %event.note, "catch-up finished");
        ctx.publish(pd, event).await;
    }
    for event in announcements::version_changes(previous, &new_status) {
        info!(namespace = pd.namespace().unwrap_or_default(), name = %pd.name_any(), reason = event.reason, note = %event.note, "blue/green version");
        ctx.publish(pd, event).await;
    }
    report_new_dead_letters(ctx, pd, previous, &new_status).await;
    Ok(status::refresh_within(&new_status, outcome.requeue))
}

/// The merge patch from `previous` to `new`: a field `new` leaves out (figures that became
/// unknown, a new `lastAction` not finished yet) is `null`, so that the merge removes it instead
/// of keeping the stale value; at every depth, since a merge patch merges objects field by field
/// (lists it replaces whole). It is conditional on `resource_version`, the version `previous`
/// was read from: the API server refuses it (409) when the object changed since, so that a
/// reconcile that started from a stale cached copy never writes back figures carried from it.
fn status_patch(
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
    resource_version: Option<String>,
) -> serde_json::Value {
    let mut status = serde_json::to_value(new).unwrap_or_default();
    if let Ok(old) = serde_json::to_value(previous) {
        null_what_is_gone(&mut status, &old);
    }
    json!({ "metadata": { "resourceVersion": resource_version }, "status": status })
}

/// Adds `null` to `new` for each field of `old` it lacks, in objects that both have at the same
/// place.
fn null_what_is_gone(new: &mut serde_json::Value, old: &serde_json::Value) {
    let (Some(fields), Some(old)) = (new.as_object_mut(), old.as_object()) else {
        return;
    };
    for (key, before) in old {
        match fields.get_mut(key) {
            Some(now) => null_what_is_gone(now, before),
            None => {
                fields.insert(key.clone(), serde_json::Value::Null);
            }
        }
    }
}

/// The Event of a change of what the database read found: a Warning when it became
/// unreachable or its schema went missing (the note is `Degraded`'s message), a Normal one when
/// it is read again after either; once per change (nothing while it stays so, nor at the first
/// read).
fn database_change(
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) -> Option<Event> {
    let (before, now) = (previous.database, new.database?);
    if before == Some(now) {
        return None;
    }
    let degraded = |reason: &str, otherwise: &str| {
        new.conditions
            .iter()
            .find(|c| c.type_ == DEGRADED && c.reason == reason)
            .map_or_else(|| otherwise.to_owned(), |c| c.message.clone())
    };
    let (type_, reason, note) = match now {
        DatabaseState::Reachable if before.is_none() => return None,
        DatabaseState::Reachable => (
            EventType::Normal,
            "DatabaseReachable",
            "the database is read again; status figures are current".to_owned(),
        ),
        DatabaseState::Unreachable => (
            EventType::Warning,
            "DatabaseUnreachable",
            degraded(
                "DatabaseUnreachable",
                "cannot read status from the database",
            ),
        ),
        DatabaseState::SchemaMissing => (
            EventType::Warning,
            "SchemaMissing",
            degraded("SchemaMissing", "the schema has gone from the database"),
        ),
    };
    Some(Event {
        type_,
        reason,
        note,
        related: None,
    })
}

/// Publishes [`database_change`]'s Event, with a log line.
async fn report_database_change(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) {
    let Some(event) = database_change(previous, new) else {
        return;
    };
    if event.type_ == EventType::Warning {
        warn!(namespace = pd.namespace().unwrap_or_default(), name = %pd.name_any(), reason = event.reason, problem = %event.note, "PerspectiveDeployment lost its database");
    } else {
        info!(namespace = pd.namespace().unwrap_or_default(), name = %pd.name_any(), "PerspectiveDeployment reads its database again");
    }
    ctx.publish(pd, event).await;
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

/// The note of the Warning Event `DeadLetters`: one line per perspective whose dead letters
/// grew since the previous status, with the newest one's event type, stream and error. Once per
/// increase: nothing while the count stays or falls (a replay), nor on the first read after
/// the database could not be read (the earlier count is unknown).
fn new_dead_letters_note(
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) -> Option<String> {
    if matches!(
        previous.database,
        Some(DatabaseState::Unreachable | DatabaseState::SchemaMissing)
    ) {
        return None;
    }
    let lines: Vec<String> = new
        .perspectives
        .iter()
        .filter_map(|p| {
            let before = previous
                .perspectives
                .iter()
                .find(|q| q.name == p.name)
                .map_or(0, |q| q.dead_letters);
            let added = p.dead_letters - before;
            (added > 0).then(|| {
                let newest = p.newest_dead_letters.first().map_or_else(String::new, |d| {
                    format!(
                        "; newest: {} on stream {}: {}",
                        d.event_type,
                        d.stream_id,
                        d.error.as_deref().unwrap_or("(no error text)")
                    )
                });
                format!(
                    "{}: {added} new dead letter(s), {} waiting for replay{newest}",
                    p.name, p.dead_letters
                )
            })
        })
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

/// A Warning Event (and a log line) when dead letters appear (see [`new_dead_letters_note`]).
async fn report_new_dead_letters(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) {
    let Some(note) = new_dead_letters_note(previous, new) else {
        return;
    };
    warn!(
        namespace = pd.namespace().unwrap_or_default(),
        name = %pd.name_any(),
        dead_letters = %note,
        "events were dead-lettered"
    );
    let event = Event {
        type_: EventType::Warning,
        reason: "DeadLetters",
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

    /// A new action's `lastAction` has no `finishedAt`: the patch must remove the previous
    /// one's (a merge patch keeps a field of a nested object it does not name), or a Running
    /// action shows when the one before it finished.
    #[test]
    fn the_status_patch_removes_fields_gone_from_nested_objects() {
        use crate::crd::{ActionPhase, LastAction};
        let action = |phase, finished: Option<i64>| PerspectiveDeploymentStatus {
            last_action: Some(LastAction {
                annotation: "perspectives.dev/switch".into(),
                target: "orders".into(),
                phase,
                job: Some("shop-switch-1".into()),
                started_at: Time(Timestamp::UNIX_EPOCH),
                finished_at: finished.map(|s| Time(Timestamp::from_second(s).unwrap())),
                message: String::new(),
            }),
            ..Default::default()
        };
        let done = action(ActionPhase::Succeeded, Some(60));
        let running = action(ActionPhase::Running, None);
        let patch = status_patch(&done, &running, Some("7".into()));
        assert_eq!(
            patch["status"]["lastAction"]["finishedAt"],
            serde_json::Value::Null
        );
        assert!(patch["status"]["lastAction"]
            .as_object()
            .unwrap()
            .contains_key("finishedAt"));
        assert_eq!(patch["status"]["lastAction"]["phase"], "Running");
        assert_eq!(patch["metadata"]["resourceVersion"], "7");
        // Top-level fields gone are removed too; present ones are not touched.
        let patch = status_patch(&done, &PerspectiveDeploymentStatus::default(), None);
        assert_eq!(patch["status"]["lastAction"], serde_json::Value::Null);
        let patch = status_patch(&running, &done, None);
        assert!(patch["status"]["lastAction"]["finishedAt"].is_string());
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

    fn dead(figures: &[(&str, i64)]) -> PerspectiveDeploymentStatus {
        PerspectiveDeploymentStatus {
            database: Some(DatabaseState::Reachable),
            perspectives: figures
                .iter()
                .map(|(name, n)| crate::crd::PerspectiveLag {
                    name: (*name).into(),
                    dead_letters: *n,
                    newest_dead_letters: (*n > 0)
                        .then(|| crate::crd::DeadLetterSample {
                            id: *n,
                            event_type: "OrderPlaced".into(),
                            stream_id: "s1".into(),
                            error: Some("division by zero".into()),
                            first_failed_at: Time(Timestamp::UNIX_EPOCH),
                        })
                        .into_iter()
                        .collect(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn new_dead_letters_are_reported_once_per_increase() {
        let none = dead(&[("totals", 0), ("carts", 0)]);
        let two = dead(&[("totals", 2), ("carts", 0)]);
        assert_eq!(new_dead_letters_note(&none, &none), None);
        assert_eq!(
            new_dead_letters_note(&none, &two).as_deref(),
            Some(
                "totals: 2 new dead letter(s), 2 waiting for replay; newest: OrderPlaced on \
                 stream s1: division by zero"
            )
        );
        // The same count again, or fewer (a replay): nothing.
        assert_eq!(new_dead_letters_note(&two, &two), None);
        let one = dead(&[("totals", 1), ("carts", 0)]);
        assert_eq!(new_dead_letters_note(&two, &one), None);
        // One more: reported, naming only the perspective that grew.
        let more = dead(&[("totals", 1), ("carts", 3)]);
        assert!(new_dead_letters_note(&one, &more)
            .unwrap()
            .starts_with("carts: 3 new dead letter(s), 3 waiting"));
        // After an unreadable database the earlier count is unknown: no Event.
        let lost = PerspectiveDeploymentStatus {
            database: Some(DatabaseState::Unreachable),
            ..Default::default()
        };
        assert_eq!(new_dead_letters_note(&lost, &two), None);
    }

    fn with_database(state: Option<DatabaseState>) -> PerspectiveDeploymentStatus {
        PerspectiveDeploymentStatus {
            database: state,
            ..degraded(
                "True",
                "DatabaseUnreachable",
                "cannot read status from the database: x",
            )
        }
    }

    #[test]
    fn a_lost_database_and_its_return_are_reported_once_per_change() {
        use DatabaseState::*;
        let event = |before, now| {
            database_change(&with_database(before), &with_database(now))
                .map(|e| (e.type_, e.reason, e.note))
        };
        let lost = event(Some(Reachable), Some(Unreachable)).expect("an Event");
        assert_eq!(
            lost,
            (
                EventType::Warning,
                "DatabaseUnreachable",
                "cannot read status from the database: x".into()
            )
        );
        // Still unreachable, or not read: nothing.
        assert!(event(Some(Unreachable), Some(Unreachable)).is_none());
        assert!(event(Some(Unreachable), None).is_none());
        let (type_, reason, _) = event(Some(Unreachable), Some(SchemaMissing)).unwrap();
        assert_eq!((type_, reason), (EventType::Warning, "SchemaMissing"));
        let (type_, reason, _) = event(Some(SchemaMissing), Some(Reachable)).unwrap();
        assert_eq!((type_, reason), (EventType::Normal, "DatabaseReachable"));
        assert!(event(Some(Unreachable), Some(Reachable)).is_some());
        // The first read finds it reachable: nothing to report; unreachable: a Warning.
        assert!(event(None, Some(Reachable)).is_none());
        assert!(event(None, Some(Unreachable)).is_some());
    }

    #[test]
    fn figures_that_became_unknown_are_removed_by_the_patch() {
        let before = PerspectiveDeploymentStatus {
            pending_events: Some(0),
            lag: Some("0s".into()),
            ..Default::default()
        };
        let after = PerspectiveDeploymentStatus {
            lag: Some("Unknown".into()),
            ..Default::default()
        };
        let patch = status_patch(&before, &after, Some("42".into()));
        // Conditional on the version `before` was read from.
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        assert_eq!(patch["status"]["pendingEvents"], serde_json::Value::Null);
        assert!(patch["status"]
            .as_object()
            .unwrap()
            .contains_key("pendingEvents"));
        assert_eq!(patch["status"]["lag"], "Unknown");
        // Nothing else is nulled.
        assert!(!patch["status"]
            .as_object()
            .unwrap()
            .contains_key("deadLetters"));
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
