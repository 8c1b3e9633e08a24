//! A deployment's status, computed from what the reconciler observed: pure functions, so every
//! combination of spec problems, migration state, StatefulSet progress and database lag is
//! unit-tested without a cluster.
//!
//! - [`observed`]: the input ([`Observed`]); [`facts`]: what follows from it, worked out once;
//!   [`rollout`]: how far the StatefulSet is and the step still to come
//! - [`condition`]: one builder per condition (`Ready`, `Degraded`, `MigrationsApplied`,
//!   `Progressing`, `ReconciliationPaused`) and the merge that keeps transition times
//! - [`summary`](mod@summary): the words of the printer columns (`Status`, `Phase`, `Lag`)
//! - [`compute`] (here): the conditions, the replica counts and the database's figures together

pub mod condition;
pub mod facts;
pub mod observed;
pub mod rollout;
pub mod summary;

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use perspective_worker::store::status::{DeadLetterSummary, Status as DbStatus};

use crate::crd::{
    DatabaseState, DeadLetterSample, PerspectiveDeploymentStatus, PerspectiveLag, PerspectivePhase,
    PerspectiveProgress,
};
use crate::labels;
use condition::{degraded, merge, migrations_applied, progressing, ready, reconciliation_paused};
use facts::Facts;
use observed::DatabaseProblem;
pub use observed::{Observed, SECRET_RECHECK};
pub use summary::{format_lag, phase_summary, summary};

/// The new status: `previous` updated with what was observed at `now`.
pub fn compute(
    previous: &PerspectiveDeploymentStatus,
    o: &Observed,
    now: Timestamp,
) -> PerspectiveDeploymentStatus {
    let f = Facts::of(o);
    let desired: Vec<_> = [
        Some(reconciliation_paused::desired(&f)),
        migrations_applied::desired(&f),
        Some(degraded::desired(&f)),
        Some(ready::desired(&f, &previous.conditions)),
        Some(progressing::desired(&f)),
    ]
    .into_iter()
    .flatten()
    .collect();

    let mut status = previous.clone();
    status.observed_generation = o.generation;
    status.conditions = merge(&previous.conditions, &desired, o.generation, now);
    status.replicas = f.rollout.replicas;
    status.ready_replicas = f.rollout.ready;
    status.replicas_summary = Some(format!("{}/{}", f.rollout.ready, o.desired_replicas));
    status.selector = Some(labels::selector_string(&labels::worker_selector(
        &o.instance,
    )));
    if !f.blocked {
        status.migration_job = Some(o.target.job_name.clone());
        status.migration_failures = o.migration_failures;
        if f.migrated {
            status.migrated_hash = Some(o.target.hash.clone());
        }
    }
    match (&o.database, f.db) {
        (_, Some(db)) => {
            database_figures(&mut status, db, f.dead_letters);
            status.database = Some(DatabaseState::Reachable);
        }
        (Some(Err(_)), _) => {
            unknown_figures(&mut status);
            status.database = f.database_problem.map(|p| match p {
                DatabaseProblem::Unreachable(_) => DatabaseState::Unreachable,
                DatabaseProblem::SchemaMissing(_) => DatabaseState::SchemaMissing,
            });
        }
        // Not read (nothing migrated yet, or no Secret): as before.
        (None, None) | (Some(Ok(_)), None) => {}
    }
    status.summary = Some(summary(
        &status.conditions,
        o.paused,
        status.phase.as_deref(),
    ));
    status
}

/// What a perspective still has to apply: its work rows, or while it catches up what the
/// catch-up has left (streams not queued yet included), so `PENDING` is not 0 during a backfill.
fn pending(p: &perspective_worker::store::status::PerspectiveStatus) -> i64 {
    p.progress.as_ref().map_or(p.pending_events, |c| {
        c.events_remaining.max(p.pending_events)
    })
}

/// How often status is refreshed while a perspective catches up, whatever
/// `--status-interval-seconds` says: its progress should move at least every 5 s.
pub const CATCH_UP_REFRESH: Duration = Duration::from_secs(3);

/// When to refresh `status` again: within `interval`, or [`CATCH_UP_REFRESH`] while a
/// perspective catches up (idle deployments keep the longer interval).
pub fn refresh_within(status: &PerspectiveDeploymentStatus, interval: Duration) -> Duration {
    let catching_up = status
        .perspectives
        .iter()
        .any(|p| p.phase != PerspectivePhase::Live);
    if catching_up {
        interval.min(CATCH_UP_REFRESH)
    } else {
        interval
    }
}

/// What `lag` and `phase` say while the database cannot be read.
pub const UNKNOWN: &str = "Unknown";

/// No figures while the database cannot be read: the counts absent (`kubectl get` shows
/// `<none>`, never a stale 0), `lag` and `phase` [`UNKNOWN`].
fn unknown_figures(status: &mut PerspectiveDeploymentStatus) {
    status.perspectives.clear();
    status.pending_events = None;
    status.oldest_pending_seconds = None;
    status.dead_letters = None;
    status.live_instances = None;
    status.lag = Some(UNKNOWN.to_owned());
    status.phase = Some(UNKNOWN.to_owned());
}

/// The database's figures in `status`: per perspective, and the totals of the columns.
fn database_figures(status: &mut PerspectiveDeploymentStatus, db: &DbStatus, dead_letters: i64) {
    status.perspectives = db
        .perspectives
        .iter()
        .map(|p| PerspectiveLag {
            name: p.name.clone(),
            pending_events: pending(p),
            oldest_pending_seconds: p.oldest_pending_seconds.map(|s| s.floor() as i64),
            failed_streams: p.failed_streams,
            dead_letters: p.dead_letters,
            phase: p.phase.into(),
            progress: p.progress.as_ref().map(PerspectiveProgress::from),
            version: p.version.map(i64::from),
            next_version: p.next_version.map(i64::from),
            rollback: p.rollback,
            lock_conflicts_per_minute: p.lock_conflicts_per_minute,
            newest_dead_letters: p.newest_dead_letters.iter().map(dead_letter).collect(),
        })
        .collect();
    status.phase = Some(phase_summary(&status.perspectives));
    status.pending_events = Some(db.perspectives.iter().map(pending).sum());
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

/// A dead letter as status shows it.
fn dead_letter(d: &DeadLetterSummary) -> DeadLetterSample {
    let at = Timestamp::from_millisecond(d.first_failed_at.timestamp_millis())
        .unwrap_or(Timestamp::UNIX_EPOCH);
    DeadLetterSample {
        id: d.id,
        event_type: d.event_type.clone(),
        stream_id: d.stream_id.to_string(),
        error: d.error.clone(),
        first_failed_at: Time(at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use condition::progressing::catch_up_messages;
    use perspective_worker::store::catchup::progress::Phase;
    use perspective_worker::store::catchup::progress::Progress;
    use perspective_worker::store::status::PerspectiveStatus;

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
                version: None,
                waiting_for: None,
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
    fn figures_are_unknown_while_the_database_cannot_be_read() {
        use crate::status::facts::fixture;
        let mut o = fixture::migrated(3);
        let busy = PerspectiveStatus {
            name: "a".into(),
            pending_events: 7,
            oldest_pending_seconds: Some(3.5),
            ..Default::default()
        };
        o.database = Some(Ok(fixture::database(3, vec![busy])));
        let read = compute(&Default::default(), &o, Timestamp::UNIX_EPOCH);
        assert_eq!(read.pending_events, Some(7));
        assert_eq!(read.lag.as_deref(), Some("3s"));
        assert_eq!(read.database, Some(DatabaseState::Reachable));

        o.database = Some(Err(DatabaseProblem::Unreachable("refused".into())));
        let lost = compute(&read, &o, Timestamp::UNIX_EPOCH);
        assert_eq!(lost.database, Some(DatabaseState::Unreachable));
        assert_eq!(
            (lost.pending_events, lost.oldest_pending_seconds),
            (None, None)
        );
        assert_eq!((lost.dead_letters, lost.live_instances), (None, None));
        assert!(lost.perspectives.is_empty());
        assert_eq!(lost.lag.as_deref(), Some(UNKNOWN));
        assert_eq!(lost.phase.as_deref(), Some(UNKNOWN));
        assert_eq!(
            lost.summary.as_deref(),
            Some("Degraded: DatabaseUnreachable")
        );

        o.database = Some(Err(DatabaseProblem::SchemaMissing("gone".into())));
        let missing = compute(&lost, &o, Timestamp::UNIX_EPOCH);
        assert_eq!(missing.database, Some(DatabaseState::SchemaMissing));
        assert_eq!(missing.pending_events, None);

        o.database = Some(Ok(fixture::database(3, vec![])));
        let back = compute(&missing, &o, Timestamp::UNIX_EPOCH);
        assert_eq!(back.database, Some(DatabaseState::Reachable));
        assert_eq!(
            (back.pending_events, back.lag.as_deref()),
            (Some(0), Some("0s"))
        );
        assert_eq!(back.phase.as_deref(), Some("Live"));
    }

    #[test]
    fn pending_counts_what_a_catch_up_still_has_to_apply() {
        use crate::status::facts::fixture;
        let mut o = fixture::migrated(3);
        // 383 events left in the backfill, none of them queued as work rows yet.
        let mut backfilling = catching_up("order_totals", Phase::Backfilling, 61.7);
        backfilling.pending_events = 0;
        let live = PerspectiveStatus {
            name: "a".into(),
            pending_events: 2,
            ..Default::default()
        };
        o.database = Some(Ok(fixture::database(3, vec![live, backfilling])));
        let s = compute(&Default::default(), &o, Timestamp::UNIX_EPOCH);
        assert_eq!(s.perspectives[1].pending_events, 383);
        assert_eq!(s.pending_events, Some(385));
    }

    #[test]
    fn status_is_refreshed_every_few_seconds_only_while_a_perspective_catches_up() {
        let fifteen = Duration::from_secs(15);
        let mut s = PerspectiveDeploymentStatus {
            perspectives: vec![lag(&PerspectiveStatus {
                name: "a".into(),
                ..Default::default()
            })],
            ..Default::default()
        };
        assert_eq!(refresh_within(&s, fifteen), fifteen);
        s.perspectives
            .push(lag(&catching_up("b", Phase::Rebuilding, 5.0)));
        assert_eq!(refresh_within(&s, fifteen), CATCH_UP_REFRESH);
        let one = Duration::from_secs(1);
        assert_eq!(refresh_within(&s, one), one);
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
}
