//! `Degraded`: something needs a look — the first of: an invalid spec, a missing Secret, a
//! refused child, a failed migration, an unreachable database or a schema that has gone from it,
//! failing events, persistent lock contention between appliers (the events still apply,
//! slowly).

use perspective_worker::store::status::PerspectiveStatus;

use super::{Desired, DEGRADED};
use crate::migration_job::JobState;
use crate::status::facts::Facts;

/// `True` with the reason of the first problem found, else `False` (`AsExpected`).
pub fn desired(f: &Facts) -> Desired {
    let o = f.observed;
    let degraded = |reason: &str, message: String| Desired::new(DEGRADED, true, reason, message);
    if f.invalid {
        degraded("InvalidSpec", o.problems.join("; "))
    } else if let Some(problem) = &o.secret_problem {
        degraded("SecretMissing", problem.clone())
    } else if let Some(message) = f.rejected {
        degraded("ChildRejected", message.to_owned())
    } else if let Some(JobState::Failed {
        reason, message, ..
    }) = &o.job
    {
        degraded("MigrationFailed", format!("{reason}: {message}"))
    } else if let Some(problem) = f.database_problem {
        degraded(problem.reason(), problem.message())
    } else if f.dead_letters > 0 || f.failed_streams > 0 {
        let perspectives = f.db.map_or(&[][..], |db| &db.perspectives[..]);
        degraded(
            "EventsFailing",
            format!(
                "{} dead letter(s) waiting for replay{}, {} stream(s) retrying after a failure",
                f.dead_letters,
                dead_letter_detail(perspectives),
                f.failed_streams
            ),
        )
    } else if !f.lock_contention.is_empty() {
        degraded("LockContention", f.lock_contention.join("; "))
    } else {
        Desired::new(DEGRADED, false, "AsExpected", "")
    }
}

/// Which perspectives hold the dead letters and the newest one's error, e.g. " (order_summary:
/// 2, carts: 1; newest: order_summary OrderPlaced on stream 0190…: division by zero)"; empty
/// without dead letters.
fn dead_letter_detail(perspectives: &[PerspectiveStatus]) -> String {
    let holding: Vec<String> = perspectives
        .iter()
        .filter(|p| p.dead_letters > 0)
        .map(|p| format!("{}: {}", p.name, p.dead_letters))
        .collect();
    if holding.is_empty() {
        return String::new();
    }
    let newest = perspectives
        .iter()
        .flat_map(|p| p.newest_dead_letters.iter().map(move |d| (p, d)))
        .max_by_key(|(_, d)| d.id)
        .map(|(p, d)| {
            format!(
                "; newest: {} {} on stream {}: {}",
                p.name,
                d.event_type,
                d.stream_id,
                d.error.as_deref().unwrap_or("(no error text)")
            )
        })
        .unwrap_or_default();
    format!(" ({}{newest})", holding.join(", "))
}

#[cfg(test)]
mod tests {
    use perspective_worker::store::status::DeadLetterSummary;

    use super::*;
    use crate::status::facts::fixture;
    use crate::status::observed::DatabaseProblem;
    use crate::status::Observed;

    fn reason(o: &Observed) -> (bool, String) {
        let d = desired(&Facts::of(o));
        (d.status, d.reason)
    }

    #[test]
    fn a_healthy_deployment_is_as_expected() {
        assert_eq!(reason(&fixture::migrated(3)), (false, "AsExpected".into()));
    }

    fn contended(name: &str, per_minute: i64) -> PerspectiveStatus {
        PerspectiveStatus {
            name: name.into(),
            lock_conflicts_per_minute: per_minute,
            lock_conflict_sqlstate: Some("55P03".into()),
            ..Default::default()
        }
    }

    #[test]
    fn persistent_lock_contention_is_named_per_perspective() {
        let mut o = fixture::migrated(3);
        o.database = Some(Ok(fixture::database(
            3,
            vec![
                contended("customer_stats", 40),
                contended("daily", 9),
                contended("totals", 10),
            ],
        )));
        let d = desired(&Facts::of(&o));
        assert_eq!((d.status, d.reason.as_str()), (true, "LockContention"));
        assert_eq!(
            d.message,
            "customer_stats: 40 lock conflicts a minute between appliers; see sequencing; \
             totals: 10 lock conflicts a minute between appliers; see sequencing"
        );
        // A few conflicts a minute are no problem.
        o.database = Some(Ok(fixture::database(3, vec![contended("daily", 9)])));
        assert_eq!(reason(&o), (false, "AsExpected".into()));
    }

    #[test]
    fn the_first_problem_found_is_the_reason() {
        let mut o = fixture::migrated(3);
        o.database = Some(Ok(fixture::database(
            3,
            vec![PerspectiveStatus {
                name: "a".into(),
                dead_letters: 2,
                failed_streams: 1,
                ..contended("a", 40)
            }],
        )));
        let failing = desired(&Facts::of(&o));
        assert_eq!(failing.reason, "EventsFailing");
        assert_eq!(
            failing.message,
            "2 dead letter(s) waiting for replay (a: 2), 1 stream(s) retrying after a failure"
        );
        o.database = Some(Err(unreachable("connection refused")));
        let unreachable = desired(&Facts::of(&o));
        assert_eq!(
            (unreachable.status, unreachable.reason.as_str()),
            (true, "DatabaseUnreachable")
        );
        assert_eq!(
            unreachable.message,
            "cannot read status from the database: connection refused"
        );
        o.job = Some(JobState::Failed {
            reason: "BackoffLimitExceeded".into(),
            message: "m".into(),
            at: None,
        });
        let failed = desired(&Facts::of(&o));
        assert_eq!(failed.reason, "MigrationFailed");
        assert_eq!(failed.message, "BackoffLimitExceeded: m");
        o.rejected = Some("Job x rejected".into());
        assert_eq!(reason(&o), (true, "ChildRejected".into()));
        o.secret_problem = Some("no Secret".into());
        assert_eq!(reason(&o), (true, "SecretMissing".into()));
        o.problems = vec!["spec.a: x".into(), "spec.b: y".into()];
        let invalid = desired(&Facts::of(&o));
        assert_eq!(invalid.reason, "InvalidSpec");
        assert_eq!(invalid.message, "spec.a: x; spec.b: y");
    }

    fn letter(id: i64, event_type: &str, error: &str) -> DeadLetterSummary {
        DeadLetterSummary {
            id,
            event_type: event_type.into(),
            stream_id: uuid::Uuid::nil(),
            error: Some(error.into()),
            first_failed_at: chrono::DateTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn dead_letters_are_named_by_perspective_with_the_newest_error() {
        let mut o = fixture::migrated(3);
        o.database = Some(Ok(fixture::database(
            3,
            vec![
                PerspectiveStatus {
                    name: "carts".into(),
                    dead_letters: 1,
                    newest_dead_letters: vec![letter(7, "ItemAdded", "duplicate key")],
                    ..Default::default()
                },
                PerspectiveStatus {
                    name: "quiet".into(),
                    ..Default::default()
                },
                PerspectiveStatus {
                    name: "totals".into(),
                    dead_letters: 2,
                    newest_dead_letters: vec![
                        letter(9, "OrderPlaced", "division by zero"),
                        letter(3, "OrderPlaced", "older"),
                    ],
                    ..Default::default()
                },
            ],
        )));
        let d = desired(&Facts::of(&o));
        assert_eq!((d.status, d.reason.as_str()), (true, "EventsFailing"));
        assert_eq!(
            d.message,
            "3 dead letter(s) waiting for replay (carts: 1, totals: 2; newest: totals \
             OrderPlaced on stream 00000000-0000-0000-0000-000000000000: division by zero), \
             0 stream(s) retrying after a failure"
        );
    }

    fn unreachable(e: &str) -> DatabaseProblem {
        DatabaseProblem::Unreachable(e.into())
    }

    fn schema_missing() -> DatabaseProblem {
        DatabaseProblem::SchemaMissing("schema shop has no migration history".into())
    }

    #[test]
    fn an_unreadable_database_counts_only_once_migrated() {
        let mut o = fixture::observed();
        o.job = Some(JobState::Running);
        o.database = Some(Err(unreachable("connection refused")));
        assert_eq!(reason(&o), (false, "AsExpected".into()));
        o.database = Some(Err(schema_missing()));
        assert_eq!(reason(&o), (false, "AsExpected".into()));
    }

    #[test]
    fn a_schema_that_has_gone_is_named() {
        let mut o = fixture::migrated(3);
        o.database = Some(Err(schema_missing()));
        let d = desired(&Facts::of(&o));
        assert_eq!((d.status, d.reason.as_str()), (true, "SchemaMissing"));
        assert_eq!(d.message, "schema shop has no migration history");
        // Its Job runs again: still missing until it succeeds.
        o.job = Some(JobState::Running);
        assert_eq!(reason(&o), (true, "SchemaMissing".into()));
        o.job = None;
        assert_eq!(reason(&o), (true, "SchemaMissing".into()));
    }

    #[test]
    fn while_a_later_target_migrates_only_an_unreachable_database_counts() {
        // The status records an earlier target as migrated; the new one's Job runs.
        let mut o = fixture::migrated(3);
        o.migrated_hash = Some("earlier".into());
        o.job = Some(JobState::Running);
        o.database = Some(Err(unreachable("connection refused")));
        assert_eq!(reason(&o), (true, "DatabaseUnreachable".into()));
        // A new spec.schema has no history until its Job ran: expected.
        o.database = Some(Err(schema_missing()));
        assert_eq!(reason(&o), (false, "AsExpected".into()));
    }
}
