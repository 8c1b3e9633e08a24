//! Whether the reconciler may change anything: the spec's problems ([`crate::validate`], plus
//! the image allow-list and [`crate::pod_policy`]) and the Secret's. An invalid spec changes no child and is reported as
//! `Degraded`, never as an error loop. Pure.

use std::time::Duration;

use super::context::Options;
use super::dereference::Found;
use super::resolve::Resolved;
use crate::crd::{PerspectiveDeployment, PerspectiveDeploymentSpec};
use crate::pod_policy;
use crate::status::SECRET_RECHECK;
use crate::validate;

/// The verdict on one deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Validated {
    /// Spec problems, each naming its field.
    pub problems: Vec<String>,
    /// Why the database Secret cannot be read.
    pub secret_problem: Option<String>,
    /// `spec.paused`: nothing is changed while it is set.
    pub paused: bool,
}

impl Validated {
    /// Children may be built and applied: a valid spec, a readable Secret, not paused.
    pub fn may_apply(&self) -> bool {
        self.problems.is_empty() && self.secret_problem.is_none() && !self.paused
    }

    /// How soon to look again at the latest: `interval`, or sooner while the Secret is missing
    /// ([`SECRET_RECHECK`]).
    pub fn requeue_within(&self, interval: Duration) -> Duration {
        if self.secret_problem.is_some() {
            interval.min(SECRET_RECHECK)
        } else {
            interval
        }
    }
}

/// The problems of `pd`'s spec and image, and the Secret's as found.
pub fn validate(
    pd: &PerspectiveDeployment,
    resolved: &Resolved,
    found: &Found,
    options: &Options,
) -> Validated {
    Validated {
        problems: spec_problems(&resolved.name, &pd.spec, options),
        secret_problem: found.secret_problem.clone(),
        paused: pd.spec.paused,
    }
}

/// Every problem of deployment `name`'s spec under the operator's `options`, each naming its
/// field: what makes it `InvalidSpec`, and what the admission webhook refuses.
pub fn spec_problems(
    name: &str,
    spec: &PerspectiveDeploymentSpec,
    options: &Options,
) -> Vec<String> {
    let mut problems = validate::problems(name, spec);
    problems.extend(validate::image_problem(
        &options.image_of(spec),
        spec.image.is_none(),
        &options.allowed_image_prefixes,
    ));
    problems.extend(pod_policy::problems(spec, &options.pod_policy));
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(problems: &[&str], secret: Option<&str>, paused: bool) -> Validated {
        Validated {
            problems: problems.iter().map(|p| p.to_string()).collect(),
            secret_problem: secret.map(str::to_owned),
            paused,
        }
    }

    #[test]
    fn only_a_valid_unpaused_deployment_with_its_secret_is_applied() {
        assert!(verdict(&[], None, false).may_apply());
        assert!(!verdict(&["spec.schema: bad"], None, false).may_apply());
        assert!(!verdict(&[], Some("Secret \"db\" not found"), false).may_apply());
        assert!(!verdict(&[], None, true).may_apply());
    }

    #[test]
    fn a_missing_secret_is_looked_at_again_within_seconds() {
        let minute = Duration::from_secs(60);
        assert_eq!(verdict(&[], None, false).requeue_within(minute), minute);
        let missing = verdict(&[], Some("no Secret"), false);
        assert_eq!(missing.requeue_within(minute), SECRET_RECHECK);
        let second = Duration::from_secs(1);
        assert_eq!(missing.requeue_within(second), second);
    }
}
