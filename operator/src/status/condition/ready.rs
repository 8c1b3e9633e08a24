//! `Ready`: the data plane serves — the current spec migrated, its pods ready and its workers
//! registered; a deployment that was ready stays ready (`MinimumAvailable`) while a later spec
//! migrates or rolls out, as long as enough of its pods are.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::{is_true, Desired, READY};
use crate::status::facts::Facts;

/// `Ready` from the facts and the previous conditions (was it ready?).
pub fn desired(f: &Facts, previous: &[Condition]) -> Desired {
    let o = f.observed;
    let r = &f.rollout;
    let not_ready = |reason: &str, message: &str| Desired::new(READY, false, reason, message);
    if f.invalid {
        return not_ready("InvalidSpec", "the spec is invalid (see Degraded)");
    }
    if f.secret_missing {
        return not_ready(
            "SecretMissing",
            "the database Secret cannot be read (see Degraded)",
        );
    }
    if f.rejected.is_some() {
        return not_ready(
            "ChildRejected",
            "the API server refused a child object (see Degraded)",
        );
    }
    if f.failed {
        return not_ready(
            "MigrationFailed",
            "the migration failed (see MigrationsApplied)",
        );
    }
    let Some(step) = &f.step else {
        let message = match f.db {
            Some(d) => format!(
                "{}/{} worker pods ready, {} workers registered",
                r.ready, o.desired_replicas, d.live_instances
            ),
            None => format!("{}/{} worker pods ready", r.ready, o.desired_replicas),
        };
        return Desired::new(READY, true, "Available", message);
    };
    // A later spec migrating or rolling out (a new perspective, a version bump), or a pod
    // restarting: the running workers keep applying events, so a deployment that was ready
    // stays ready while enough of them are (Progressing says what is under way).
    let was_ready = is_true(previous, READY);
    if was_ready && r.exists && r.ready >= min_available(o.desired_replicas) {
        let message = if o.paused {
            // The count the spec asks for waits for the unpause: the step says so.
            step.message.clone()
        } else {
            format!(
                "{}/{} worker pods ready; {}",
                r.ready, o.desired_replicas, step.message
            )
        };
        return Desired::new(READY, true, "MinimumAvailable", message);
    }
    Desired::new(READY, false, step.reason, step.message.clone())
}

/// Ready pods a ready deployment needs to stay ready while pods are replaced: one fewer than
/// desired (the disruption budget's one at a time), but at least one.
pub fn min_available(desired: i32) -> i32 {
    if desired <= 1 {
        desired
    } else {
        desired - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_pod_may_be_replaced_at_a_time_but_never_the_last() {
        assert_eq!([0, 1, 2, 3, 5].map(min_available), [0, 1, 1, 2, 4]);
    }
}
