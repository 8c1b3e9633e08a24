//! `ReconciliationPaused`: whether `spec.paused` holds the children as they are.

use super::{Desired, RECONCILIATION_PAUSED};
use crate::status::facts::Facts;

/// `True` (`Paused`) while `spec.paused` is set, else `False` (`Active`).
pub fn desired(f: &Facts) -> Desired {
    if f.observed.paused {
        Desired::new(
            RECONCILIATION_PAUSED,
            true,
            "Paused",
            "spec.paused is true: children are not changed",
        )
    } else {
        Desired::new(RECONCILIATION_PAUSED, false, "Active", "")
    }
}
