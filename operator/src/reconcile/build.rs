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
use crate::pod;
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
        let mut desired = workers::statefulset(
            name,
            namespace,
            spec,
            &r.image,
            &r.config_map_name,
            &r.config_hash,
            &r.target.hash,
        );
        if let Some(pod_spec) = desired.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            pod::harden(pod_spec, r.app_armor_runtime_default);
        }
        Some(desired)
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
            let mut job = migration_job::build(
                name,
                namespace,
                spec,
                &r.image,
                &r.config_map_name,
                &r.target,
            );
            if let Some(pod_spec) = job.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
                pod::harden(pod_spec, r.app_armor_runtime_default);
            }
            job
        }),
        config_map: config_map::build(name, namespace, &r.config),
        service: workers::service(name, namespace),
        disruption_budget: workers::disruption_budget(name, namespace),
        statefulset,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::crd::PerspectiveDeployment;
    use crate::reconcile::context::Options;

    fn options() -> Options {
        Options {
            default_worker_image: "worker:1".into(),
            status_interval: Duration::from_secs(30),
            migration_retry_base: Duration::from_secs(30),
            allowed_image_prefixes: vec![],
            pod_policy: Default::default(),
            app_armor_runtime_default: false,
        }
    }

    fn deployment(replicas: i32) -> (PerspectiveDeployment, Resolved) {
        let pd: PerspectiveDeployment = serde_yaml::from_str(&format!(
            r#"
apiVersion: perspectives.dev/v1alpha1
kind: PerspectiveDeployment
metadata: {{name: shop, namespace: ns, uid: u1}}
spec:
  schema: shop
  replicas: {replicas}
  database: {{secretRef: {{name: shop-db}}}}
  perspectives:
    - name: order_count
      handlers:
        OrderPlaced: SELECT 1
"#
        ))
        .unwrap();
        let resolved = Resolved::new(&pd, "ns", &options());
        (pd, resolved)
    }

    /// `--apparmor-runtime-default` reaches the Job's and the workers' pods; without it, no
    /// AppArmor profile is set (kubelet would refuse the pods on a node without AppArmor).
    #[test]
    fn app_armor_runtime_default_follows_the_operators_flag() {
        let profile = |on: bool| {
            let (pd, mut r) = deployment(1);
            r.app_armor_runtime_default = on;
            let job = children(&pd.spec, &r, None, None).job.unwrap();
            let sts = children(&pd.spec, &r, Some(&JobState::Succeeded), None)
                .statefulset
                .unwrap();
            [
                job.spec.unwrap().template.spec.unwrap(),
                sts.spec.unwrap().template.spec.unwrap(),
            ]
            .map(|p| {
                p.security_context
                    .unwrap()
                    .app_armor_profile
                    .map(|a| a.type_)
            })
        };
        assert_eq!(
            profile(true),
            [
                Some("RuntimeDefault".to_owned()),
                Some("RuntimeDefault".to_owned())
            ]
        );
        assert_eq!(profile(false), [None, None]);
        let mut on = options();
        on.app_armor_runtime_default = true;
        let (pd, _) = deployment(1);
        assert!(Resolved::new(&pd, "ns", &on).app_armor_runtime_default);
    }

    fn template_hash(sts: &StatefulSet) -> Option<String> {
        workers::template_migration_hash(&sts.spec.as_ref()?.template)
    }

    #[test]
    fn the_job_is_built_only_when_none_exists() {
        let (pd, r) = deployment(3);
        let new = children(&pd.spec, &r, None, None);
        let job = new.job.expect("a Job");
        assert_eq!(
            job.metadata.name.as_deref(),
            Some(r.target.job_name.as_str())
        );
        assert!(
            new.statefulset.is_none(),
            "no StatefulSet before the migration"
        );
        let running = children(&pd.spec, &r, Some(&JobState::Running), None);
        assert!(running.job.is_none());
        assert_eq!(
            running.config_map.metadata.name.as_deref(),
            Some(r.config_map_name.as_str())
        );
    }

    #[test]
    fn the_new_template_waits_for_its_migration_and_only_replicas_follow() {
        let (old_pd, old) = deployment(3);
        let running = children(&old_pd.spec, &old, Some(&JobState::Succeeded), None)
            .statefulset
            .expect("the StatefulSet once migrated");
        assert_eq!(template_hash(&running), Some(old.target.hash.clone()));

        // A new target (another image) with 5 replicas while its Job runs: the running
        // template stays, the replica count follows.
        let (mut pd, _) = deployment(5);
        pd.spec.image = Some("worker:2".into());
        let new = Resolved::new(&pd, "ns", &options());
        assert_ne!(new.target, old.target);
        let waiting = children(&pd.spec, &new, Some(&JobState::Running), Some(&running));
        let scaled = waiting.statefulset.expect("scaled");
        assert_eq!(scaled.spec.as_ref().unwrap().replicas, Some(5));
        assert_eq!(template_hash(&scaled), Some(old.target.hash.clone()));
        // Same replica count: nothing to apply until the migration succeeds.
        let mut same = running.clone();
        same.spec.as_mut().unwrap().replicas = Some(5);
        let idle = children(&pd.spec, &new, Some(&JobState::Running), Some(&same));
        assert!(idle.statefulset.is_none());
        let done = children(&pd.spec, &new, Some(&JobState::Succeeded), Some(&same));
        assert_eq!(
            template_hash(&done.statefulset.unwrap()),
            Some(new.target.hash.clone())
        );
    }
}
