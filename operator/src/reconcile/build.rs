//! The desired children of a deployment, from the pure builders ([`config_map`],
//! [`migration_job`], [`workers`]). Pure.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;

use super::resolve::Resolved;
use crate::config_map;
use crate::crd::PerspectiveDeploymentSpec;
use crate::migration_job::{self, JobState};
use crate::workers;

/// The children to apply.
#[derive(Debug, Clone)]
pub struct Children {
    /// The current target's migration Job, when none exists yet.
    pub job: Option<Job>,
    pub config_map: ConfigMap,
    pub service: Service,
    pub disruption_budget: PodDisruptionBudget,
    /// The StatefulSet to apply (`None`: leave it as it is). It takes the new template only
    /// once its migration succeeded; until then the running template stays and only the
    /// replica count follows the spec.
    pub statefulset: Option<StatefulSet>,
}

/// The children of `spec` as `resolved`, given the current target's Job and the StatefulSet
/// as they exist.
pub fn children(
    spec: &PerspectiveDeploymentSpec,
    r: &Resolved,
    job: Option<&JobState>,
    existing: Option<&StatefulSet>,
) -> Children {
    let (name, namespace) = (r.name.as_str(), r.namespace.as_str());
    let statefulset = if job == Some(&JobState::Succeeded) {
        Some(workers::statefulset(
            name,
            namespace,
            spec,
            &r.image,
            &r.config_map_name,
            &r.config_hash,
            &r.target.hash,
        ))
    } else {
        existing
            .and_then(|sts| sts.spec.as_ref())
            .filter(|s| s.replicas != Some(spec.replicas))
            .map(|s| {
                workers::statefulset_with_template(
                    name,
                    namespace,
                    spec.replicas,
                    s.template.clone(),
                )
            })
    };
    Children {
        job: job.is_none().then(|| {
            migration_job::build(
                name,
                namespace,
                spec,
                &r.image,
                &r.config_map_name,
                &r.target,
            )
        }),
        config_map: config_map::build(name, namespace, &r.config),
        service: workers::service(name, namespace),
        disruption_budget: workers::disruption_budget(name, namespace),
        statefulset,
    }
}
