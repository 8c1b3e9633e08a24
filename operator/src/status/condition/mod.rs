//! Status conditions, following the Kubernetes API conventions: one entry per type (a list-map
//! keyed by `type`), each with `observedGeneration`, a CamelCase reason, a message, and a
//! `lastTransitionTime` that moves only when the condition's status changes.
//!
//! One pure builder per condition type, each deciding its [`Desired`] value from the
//! [`Facts`](super::facts::Facts): [`ready`], [`degraded`], [`migrations_applied`],
//! [`progressing`], [`reconciliation_paused`]; [`merge`] (here) turns them into the list,
//! keeping transition times.

pub mod degraded;
pub mod migrations_applied;
pub mod progressing;
pub mod ready;
pub mod reconciliation_paused;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

pub const READY: &str = "Ready";
pub const MIGRATIONS_APPLIED: &str = "MigrationsApplied";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
pub const RECONCILIATION_PAUSED: &str = "ReconciliationPaused";

/// The order conditions are listed in.
pub const TYPES: [&str; 5] = [
    READY,
    MIGRATIONS_APPLIED,
    PROGRESSING,
    DEGRADED,
    RECONCILIATION_PAUSED,
];

/// A condition's new value, before transition times are worked out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    pub type_: &'static str,
    pub status: bool,
    pub reason: String,
    pub message: String,
}

impl Desired {
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: &str,
        message: impl Into<String>,
    ) -> Self {
        Desired {
            type_,
            status,
            reason: reason.to_owned(),
            message: message.into(),
        }
    }
}

/// The full condition list: `desired` values, keeping `lastTransitionTime` of every condition
/// whose status did not change, and keeping previous conditions `desired` says nothing about.
pub fn merge(
    previous: &[Condition],
    desired: &[Desired],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let mut out = Vec::new();
    for type_ in TYPES {
        let old = previous.iter().find(|c| c.type_ == type_);
        match desired.iter().find(|d| d.type_ == type_) {
            Some(d) => {
                let status = if d.status { "True" } else { "False" }.to_owned();
                let last_transition_time = match old {
                    Some(o) if o.status == status => o.last_transition_time.clone(),
                    _ => Time(now),
                };
                out.push(Condition {
                    type_: type_.to_owned(),
                    status,
                    reason: d.reason.clone(),
                    message: truncate(&d.message, 4096),
                    observed_generation: generation,
                    last_transition_time,
                });
            }
            None => out.extend(old.cloned()),
        }
    }
    out
}

/// Whether `type_` is `True` in `conditions`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

fn truncate(message: &str, limit: usize) -> String {
    if message.len() <= limit {
        return message.to_owned();
    }
    let mut end = limit;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let first = merge(
            &[],
            &[Desired::new(READY, false, "Waiting", "a")],
            Some(1),
            at(10),
        );
        assert_eq!(first[0].last_transition_time.0, at(10));
        // Same status, new reason and message: time kept, the rest updated.
        let second = merge(
            &first,
            &[Desired::new(READY, false, "Rolling", "b")],
            Some(2),
            at(20),
        );
        assert_eq!(second[0].last_transition_time.0, at(10));
        assert_eq!(second[0].reason, "Rolling");
        assert_eq!(second[0].observed_generation, Some(2));
        let third = merge(
            &second,
            &[Desired::new(READY, true, "Available", "c")],
            Some(2),
            at(30),
        );
        assert_eq!(third[0].last_transition_time.0, at(30));
    }

    #[test]
    fn conditions_not_decided_are_kept_and_ordered() {
        let first = merge(
            &[],
            &[
                Desired::new(DEGRADED, false, "AsExpected", ""),
                Desired::new(READY, true, "Available", ""),
            ],
            Some(1),
            at(1),
        );
        assert_eq!(
            first.iter().map(|c| c.type_.as_str()).collect::<Vec<_>>(),
            [READY, DEGRADED]
        );
        let second = merge(
            &first,
            &[Desired::new(DEGRADED, true, "InvalidSpec", "x")],
            Some(2),
            at(2),
        );
        assert!(is_true(&second, READY));
        assert!(is_true(&second, DEGRADED));
    }
}
