//! The words of `kubectl get pd`'s columns: `Status` ([`summary`]), `Phase` ([`phase_summary`])
//! and `Lag` ([`format_lag`]).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::condition::{DEGRADED, MIGRATIONS_APPLIED, PROGRESSING, READY};
use crate::crd::{PerspectiveLag, PerspectivePhase};

/// The `Status` column of `kubectl get pd`: what a `False` in `Ready` means, in a word or two —
/// `Degraded: <reason>` first (something needs a look), then `Paused`, `Migrating`, a catch-up
/// (`Backfilling 61%`), a rollout step (`RollingOut`), `Ready`, else why it is not ready.
pub fn summary(conditions: &[Condition], paused: bool, phase: Option<&str>) -> String {
    let get = |type_: &str| conditions.iter().find(|c| c.type_ == type_);
    let is_true = |type_: &str| get(type_).is_some_and(|c| c.status == "True");
    let reason = |type_: &str| get(type_).map_or("", |c| c.reason.as_str());
    if is_true(DEGRADED) {
        return format!("Degraded: {}", reason(DEGRADED));
    }
    if paused {
        return "Paused".to_owned();
    }
    if get(MIGRATIONS_APPLIED).is_some_and(|c| c.status == "False")
        && ["Running", "Pending"].contains(&reason(MIGRATIONS_APPLIED))
    {
        return "Migrating".to_owned();
    }
    if let Some(phase) = phase.filter(|p| *p != PerspectivePhase::Live.as_str()) {
        return phase.to_owned();
    }
    if is_true(PROGRESSING) {
        return reason(PROGRESSING).to_owned();
    }
    if is_true(READY) {
        return "Ready".to_owned();
    }
    match reason(READY) {
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
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::status::condition::{merge, Desired};

    fn conditions(list: &[(&'static str, bool, &str)]) -> Vec<Condition> {
        let desired: Vec<Desired> = list
            .iter()
            .map(|(t, s, r)| Desired::new(t, *s, r, ""))
            .collect();
        merge(&[], &desired, Some(1), Timestamp::UNIX_EPOCH)
    }

    #[test]
    fn degraded_comes_first_then_paused_then_migrating() {
        let c = conditions(&[
            (DEGRADED, true, "EventsFailing"),
            (MIGRATIONS_APPLIED, false, "Running"),
        ]);
        assert_eq!(summary(&c, true, None), "Degraded: EventsFailing");
        let c = conditions(&[(MIGRATIONS_APPLIED, false, "Running")]);
        assert_eq!(summary(&c, true, None), "Paused");
        assert_eq!(summary(&c, false, None), "Migrating");
    }

    #[test]
    fn then_the_phase_the_rollout_step_ready_or_why_not() {
        let c = conditions(&[
            (PROGRESSING, true, "RollingOut"),
            (READY, true, "Available"),
        ]);
        assert_eq!(
            summary(&c, false, Some("Backfilling 61%")),
            "Backfilling 61%"
        );
        assert_eq!(summary(&c, false, Some("Live")), "RollingOut");
        let c = conditions(&[(READY, true, "Available")]);
        assert_eq!(summary(&c, false, None), "Ready");
        let c = conditions(&[(READY, false, "WaitingForPods")]);
        assert_eq!(summary(&c, false, None), "WaitingForPods");
        assert_eq!(summary(&[], false, None), "Pending");
    }

    #[test]
    fn lag_is_short() {
        assert_eq!([42, 185, 7_200].map(format_lag), ["42s", "3m5s", "2h0m"]);
    }
}
