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
