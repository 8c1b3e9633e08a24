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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::facts::fixture;

    #[test]
    fn paused_follows_the_spec() {
        let mut o = fixture::observed();
        let active = desired(&Facts::of(&o));
        assert_eq!((active.status, active.reason.as_str()), (false, "Active"));
        o.paused = true;
        let paused = desired(&Facts::of(&o));
        assert_eq!((paused.status, paused.reason.as_str()), (true, "Paused"));
        assert!(paused.message.contains("spec.paused"), "{}", paused.message);
    }
}
