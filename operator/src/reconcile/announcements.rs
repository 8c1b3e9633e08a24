//! Events for what users wait for, decided without IO from the previous and the new status: a
//! backfill or rebuild that finished, a blue/green version built, switched to or rolled back to,
//! and a perspective the last migration removed (its tables kept). Each once per change.

use crate::crd::{PerspectiveDeploymentSpec, PerspectiveDeploymentStatus, PerspectivePhase};
use crate::events::{Event, EventType};

/// One Normal Event per perspective that was catching up at the previous status read and is
/// live at this one (`BackfillFinished`, `RebuildFinished`). Nothing when either read did not
/// reach the database (its perspectives are then absent).
pub fn catch_up_finished(
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) -> Vec<Event> {
    new.perspectives
        .iter()
        .filter(|p| p.phase == PerspectivePhase::Live)
        .filter_map(|p| {
            let before = previous.perspectives.iter().find(|b| b.name == p.name)?;
            let (reason, what) = match before.phase {
                PerspectivePhase::Live => return None,
                PerspectivePhase::Backfilling => ("BackfillFinished", "backfill"),
                PerspectivePhase::Rebuilding => ("RebuildFinished", "rebuild"),
                // Announced per version by `version_changes`.
                PerspectivePhase::Building | PerspectivePhase::Switching => return None,
            };
            let size = before
                .progress
                .as_ref()
                .map(|c| format!(" of {} events", c.events_total))
                .unwrap_or_default();
            Some(Event {
                type_: EventType::Normal,
                reason,
                note: format!(
                    "perspective {}: its {what}{size} finished; it is live",
                    p.name
                ),
                related: None,
            })
        })
        .collect()
}

/// Normal Events for the blue/green versions (`rebuild: blueGreen`) that moved on between the
/// previous status read and this one: `VersionBuilt` when a new version's build is done (it
/// switches once caught up), then `VersionSwitched` when it serves, or `VersionRolledBack` when
/// a kept version serves again. A read that missed the `Switching` phase announces both. A
/// build cancelled (the spec asks for another version) announces nothing. Nothing when either
/// read did not reach the database.
pub fn version_changes(
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) -> Vec<Event> {
    let mut events = Vec::new();
    for p in &new.perspectives {
        let Some(before) = previous.perspectives.iter().find(|b| b.name == p.name) else {
            continue;
        };
        let Some(next) = before.next_version else {
            continue;
        };
        let serves = p.next_version.is_none() && p.version == Some(next);
        let built = before.phase == PerspectivePhase::Building
            && (serves || (p.phase == PerspectivePhase::Switching && p.next_version == Some(next)));
        // A rollback's version was built before: it only catches up.
        if built && !before.rollback {
            events.push(version_event(
                "VersionBuilt",
                format!(
                    "{}: v{next} built; it switches once caught up, v{} serves until then",
                    p.name,
                    before.version.unwrap_or_default()
                ),
            ));
        }
        if serves {
            let (reason, verb) = if before.rollback {
                ("VersionRolledBack", "rolled back to")
            } else {
                ("VersionSwitched", "switched to")
            };
            events.push(version_event(reason, format!("{}: {verb} v{next}", p.name)));
        }
    }
    events
}

fn version_event(reason: &'static str, note: String) -> Event {
    Event {
        type_: EventType::Normal,
        reason,
        note,
        related: None,
    }
}

/// The perspectives of `spec` as `schema.name` (what `status.migratedPerspectives` holds).
pub fn qualified(spec: &PerspectiveDeploymentSpec) -> Vec<String> {
    spec.perspectives
        .iter()
        .map(|p| format!("{}.{}", spec.schema, p.name))
        .collect()
}

/// The names of the perspectives the previously migrated target had in the schema of
/// `configured` (the spec whose migration just succeeded, [`qualified`]) that it no longer
/// has: the migration removed their work and cursors. A perspective of another schema (the
/// spec moved to a new one) was not removed: that schema is left as it was.
pub fn removed_perspectives(previously_migrated: &[String], configured: &[String]) -> Vec<String> {
    let schema_of = |q: &str| q.rsplit_once('.').map(|(s, _)| s.to_owned());
    let Some(schema) = configured.first().and_then(|q| schema_of(q)) else {
        return Vec::new();
    };
    previously_migrated
        .iter()
        .filter(|q| !configured.contains(q) && schema_of(q).as_deref() == Some(schema.as_str()))
        .filter_map(|q| q.rsplit_once('.').map(|(_, name)| name.to_owned()))
        .collect()
}

/// The Normal Event `PerspectiveRemoved` for `name`, removed by migration Job `job`.
pub fn removed(name: &str, job: &str) -> Event {
    Event {
        type_: EventType::Normal,
        reason: "PerspectiveRemoved",
        note: format!(
            "perspective {name} is no longer in the spec: migration Job {job} deleted its pending \
             work and cursors; its tables were kept (drop them yourself when no longer needed)"
        ),
        related: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{PerspectiveLag, PerspectiveProgress};

    fn status(perspectives: &[(&str, PerspectivePhase)]) -> PerspectiveDeploymentStatus {
        PerspectiveDeploymentStatus {
            perspectives: perspectives
                .iter()
                .map(|(name, phase)| PerspectiveLag {
                    name: (*name).into(),
                    phase: *phase,
                    progress: (*phase != PerspectivePhase::Live).then(|| PerspectiveProgress {
                        events_total: 90_000,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_finished_catch_up_is_announced_once() {
        use PerspectivePhase::*;
        let during = status(&[("a", Backfilling), ("b", Rebuilding), ("c", Live)]);
        let after = status(&[("a", Live), ("b", Live), ("c", Live)]);
        let events = catch_up_finished(&during, &after);
        let said: Vec<(&str, &str)> = events.iter().map(|e| (e.reason, e.note.as_str())).collect();
        assert_eq!(
            said,
            [
                (
                    "BackfillFinished",
                    "perspective a: its backfill of 90000 events finished; it is live"
                ),
                (
                    "RebuildFinished",
                    "perspective b: its rebuild of 90000 events finished; it is live"
                ),
            ]
        );
        // Not again at the next read, nor for figures that went unknown and came back.
        assert!(catch_up_finished(&after, &after).is_empty());
        assert!(catch_up_finished(&status(&[]), &after).is_empty());
        assert!(catch_up_finished(&during, &status(&[])).is_empty());
    }

    /// `orders` serving `version`, with `next` built beside it in `phase`.
    fn versions(
        phase: PerspectivePhase,
        version: i64,
        next: Option<i64>,
        rollback: bool,
    ) -> PerspectiveDeploymentStatus {
        let mut s = status(&[("orders", phase)]);
        s.perspectives[0].version = Some(version);
        s.perspectives[0].next_version = next;
        s.perspectives[0].rollback = rollback;
        s
    }

    fn said(events: &[Event]) -> Vec<(&str, &str)> {
        events.iter().map(|e| (e.reason, e.note.as_str())).collect()
    }

    #[test]
    fn a_version_is_announced_built_then_switched_to_each_once() {
        use PerspectivePhase::*;
        let building = versions(Building, 2, Some(3), false);
        let switching = versions(Switching, 2, Some(3), false);
        let live = versions(Live, 3, None, false);
        assert!(version_changes(&building, &building).is_empty());
        assert_eq!(
            said(&version_changes(&building, &switching)),
            [(
                "VersionBuilt",
                "orders: v3 built; it switches once caught up, v2 serves until then"
            )]
        );
        assert!(version_changes(&switching, &switching).is_empty());
        assert_eq!(
            said(&version_changes(&switching, &live)),
            [("VersionSwitched", "orders: switched to v3")]
        );
        assert!(version_changes(&live, &live).is_empty());
        // A read that missed Switching: both, in order.
        let both = version_changes(&building, &live);
        assert_eq!(
            said(&both).iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            ["VersionBuilt", "VersionSwitched"]
        );
        // Nor is it a finished catch-up.
        assert!(catch_up_finished(&switching, &live).is_empty());
    }

    #[test]
    fn a_rollback_is_announced_once_and_a_cancelled_build_not_at_all() {
        use PerspectivePhase::*;
        let catching_up = versions(Building, 3, Some(2), true);
        let back = versions(Live, 2, None, false);
        assert_eq!(
            said(&version_changes(&catching_up, &back)),
            [("VersionRolledBack", "orders: rolled back to v2")]
        );
        assert!(version_changes(
            &versions(Switching, 3, Some(2), true),
            &versions(Switching, 3, Some(2), true)
        )
        .is_empty());
        // The spec went back to v2 during v3's build: v2 still serves, nothing switched.
        let cancelled = versions(Live, 2, None, false);
        assert!(version_changes(&versions(Building, 2, Some(3), false), &cancelled).is_empty());
        // A read that did not reach the database.
        assert!(version_changes(&catching_up, &status(&[])).is_empty());
    }

    #[test]
    fn only_perspectives_gone_from_the_migrated_spec_are_removed() {
        let q = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let before = q(&["shop.a", "shop.b"]);
        assert_eq!(
            removed_perspectives(&before, &q(&["shop.a", "shop.c"])),
            ["b"]
        );
        assert!(removed_perspectives(&[], &q(&["shop.a"])).is_empty());
        // A new schema: the old one's perspectives were not removed.
        assert!(removed_perspectives(&before, &q(&["shop2.a"])).is_empty());
        assert!(removed("b", "shop-migrate-1")
            .note
            .contains("its tables were kept"));
    }
}
