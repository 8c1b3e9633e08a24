//! Events for what users wait for, decided without IO from the previous and the new status: a
//! backfill or rebuild that finished, and a perspective the last migration removed (its tables
//! kept). Each once per change.

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
                // The version built beside the live one switched in (named per version later).
                PerspectivePhase::Building | PerspectivePhase::Switching => {
                    ("VersionSwitched", "blue/green build and switch")
                }
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
