//! The worker StatefulSet, its headless Service and its PodDisruptionBudget.
//!
//! A StatefulSet gives each worker pod a stable name (useful in logs and `status`), while the
//! worker's instance id comes from the pod's `metadata.uid`, so a replaced pod is a new instance
//! and the old one's leases are reclaimed after its heartbeat goes stale.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetSpec};
use k8s_openapi::api::core::v1::{
    ContainerPort, HTTPGetAction, PodTemplateSpec, Probe, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ObjectMeta;

use crate::crd::{DatabaseRole, PerspectiveDeploymentSpec};
use crate::labels;
use crate::pod;

/// The worker's HTTP port (`/livez`, `/readyz`, `/metrics`).
pub const HTTP_PORT: i32 = 8080;
const DEFAULT_GRACE_SECONDS: i64 = 30;

/// The desired StatefulSet: `replicas` workers running the config in ConfigMap `config_map`,
/// migrated for `migration_hash`.
#[allow(clippy::too_many_arguments)]
pub fn statefulset(
    instance: &str,
    namespace: &str,
    spec: &PerspectiveDeploymentSpec,
    image: &str,
    config_map: &str,
    config_hash: &str,
    migration_hash: &str,
) -> StatefulSet {
    let template = pod_template(
        instance,
        spec,
        image,
        config_map,
        config_hash,
        migration_hash,
    );
    statefulset_with_template(instance, namespace, spec.replicas, template)
}

/// A StatefulSet with a given pod template: the desired one, or the running one kept while a
/// migration for a new template has not succeeded yet (only `replicas` follows the spec then).
pub fn statefulset_with_template(
    instance: &str,
    namespace: &str,
    replicas: i32,
    template: PodTemplateSpec,
) -> StatefulSet {
    StatefulSet {
        metadata: ObjectMeta {
            name: Some(labels::workers_name(instance)),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels::labels(instance, labels::WORKER)),
            ..ObjectMeta::default()
        },
        spec: Some(StatefulSetSpec {
            replicas: Some(replicas),
            service_name: Some(labels::service_name(instance)),
            // Workers share nothing on disk and coordinate in the database: start and stop
            // them all at once instead of one by one.
            pod_management_policy: Some("Parallel".to_owned()),
            selector: LabelSelector {
                match_labels: Some(labels::worker_selector(instance)),
                ..LabelSelector::default()
            },
            template,
            ..StatefulSetSpec::default()
        }),
        ..StatefulSet::default()
    }
}

/// The worker pod template.
pub fn pod_template(
    instance: &str,
    spec: &PerspectiveDeploymentSpec,
    image: &str,
    config_map: &str,
    config_hash: &str,
    migration_hash: &str,
) -> PodTemplateSpec {
    let mut env = pod::base_env(spec, DatabaseRole::Worker);
    env.push(pod::field_env("PERSPECTIVE_INSTANCE_ID", "metadata.uid"));
    env.push(k8s_openapi::api::core::v1::EnvVar {
        name: "PERSPECTIVE_HTTP_ADDR".to_owned(),
        value: Some(format!("0.0.0.0:{HTTP_PORT}")),
        ..Default::default()
    });
    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    let mut container = pod::container("worker", image, spec, &["run"], env);
    container.ports = Some(vec![ContainerPort {
        name: Some("http".to_owned()),
        container_port: HTTP_PORT,
        protocol: Some("TCP".to_owned()),
        ..ContainerPort::default()
    }]);
    container.readiness_probe = Some(probe("/readyz", 5, 3));
    container.liveness_probe = Some(probe("/livez", 10, 6));

    let mut pod_spec = pod::pod_spec(spec, config_map, container, "Always");
    pod_spec.affinity = spec.affinity.clone();
    pod_spec.priority_class_name = spec.priority_class_name.clone();
    pod_spec.termination_grace_period_seconds = Some(
        spec.termination_grace_period_seconds
            .unwrap_or(DEFAULT_GRACE_SECONDS),
    );

    let mut annotations = spec.pod_annotations.clone().unwrap_or_default();
    annotations.insert(labels::CONFIG_HASH.to_owned(), config_hash.to_owned());
    annotations.insert(labels::MIGRATION_HASH.to_owned(), migration_hash.to_owned());
    annotations.insert("prometheus.io/scrape".to_owned(), "true".to_owned());
    annotations.insert("prometheus.io/port".to_owned(), HTTP_PORT.to_string());
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels::labels(instance, labels::WORKER)),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        }),
        spec: Some(pod_spec),
    }
}

/// The headless Service naming the worker pods (the StatefulSet's `serviceName`).
pub fn service(instance: &str, namespace: &str) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(labels::service_name(instance)),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels::labels(instance, labels::WORKER)),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            selector: Some(labels::worker_selector(instance)),
            ports: Some(vec![ServicePort {
                name: Some("http".to_owned()),
                port: HTTP_PORT,
                target_port: Some(IntOrString::String("http".to_owned())),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            // Metrics scrapers see pods before they are ready.
            publish_not_ready_addresses: Some(true),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// At most one worker pod voluntarily disrupted at a time: the others keep applying events.
pub fn disruption_budget(instance: &str, namespace: &str) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: ObjectMeta {
            name: Some(labels::workers_name(instance)),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels::labels(instance, labels::WORKER)),
            ..ObjectMeta::default()
        },
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(labels::worker_selector(instance)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}

/// The ConfigMap a pod template mounts (to keep it alive while that template runs).
pub fn template_config_map(template: &PodTemplateSpec) -> Option<String> {
    template
        .spec
        .as_ref()?
        .volumes
        .as_ref()?
        .iter()
        .find_map(|v| v.config_map.as_ref().map(|c| c.name.clone()))
}

/// The migration hash a pod template was built for.
pub fn template_migration_hash(template: &PodTemplateSpec) -> Option<String> {
    annotation(template, labels::MIGRATION_HASH)
}

/// The config hash a pod template was built for.
pub fn template_config_hash(template: &PodTemplateSpec) -> Option<String> {
    annotation(template, labels::CONFIG_HASH)
}

fn annotation(template: &PodTemplateSpec, key: &str) -> Option<String> {
    let annotations: &BTreeMap<String, String> =
        template.metadata.as_ref()?.annotations.as_ref()?;
    annotations.get(key).cloned()
}
