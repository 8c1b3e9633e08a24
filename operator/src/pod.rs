//! Pieces shared by the migration Job's and the worker StatefulSet's pod templates.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    AppArmorProfile, Capabilities, ConfigMapVolumeSource, Container, EnvVar, EnvVarSource,
    ObjectFieldSelector, PodSecurityContext, PodSpec, ResourceRequirements, SeccompProfile,
    SecretKeySelector, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::config_map::{CONFIG_DIR, CONFIG_FILE};
use crate::crd::{DatabaseRole, PerspectiveDeploymentSpec};

/// Name of the config volume.
const CONFIG_VOLUME: &str = "config";

/// Environment every worker container gets: the config path and the database URL of `role`
/// (the migration Job's or the workers' Secret), which comes from the Secret and so never
/// appears in a pod spec, a ConfigMap or a log.
pub fn base_env(spec: &PerspectiveDeploymentSpec, role: DatabaseRole) -> Vec<EnvVar> {
    let (secret, _) = spec.database.secret_for(role);
    vec![
        EnvVar {
            name: "PERSPECTIVE_CONFIG".to_owned(),
            value: Some(format!("{CONFIG_DIR}/{CONFIG_FILE}")),
            ..EnvVar::default()
        },
        EnvVar {
            name: "DATABASE_URL".to_owned(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: secret.name.clone(),
                    key: secret.key.clone(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        },
    ]
}

/// An env var read from the pod's own metadata (downward API).
pub fn field_env(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.to_owned(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// What a worker or migration container requests and may use when the spec sets no
/// `resources` (README, "Resources"): (cpu, memory) requested, (cpu, memory) at most.
pub const DEFAULT_REQUESTS: (&str, &str) = ("100m", "128Mi");
pub const DEFAULT_LIMITS: (&str, &str) = ("1", "512Mi");

/// `spec.resources`, or [`DEFAULT_REQUESTS`] and [`DEFAULT_LIMITS`] when the spec sets none, so
/// that no pod runs unbounded.
pub fn resources(spec: &PerspectiveDeploymentSpec) -> ResourceRequirements {
    let pair = |(cpu, memory): (&str, &str)| {
        BTreeMap::from([
            ("cpu".to_owned(), Quantity(cpu.to_owned())),
            ("memory".to_owned(), Quantity(memory.to_owned())),
        ])
    };
    spec.resources
        .clone()
        .unwrap_or_else(|| ResourceRequirements {
            requests: Some(pair(DEFAULT_REQUESTS)),
            limits: Some(pair(DEFAULT_LIMITS)),
            ..ResourceRequirements::default()
        })
}

/// A worker container running `perspective-worker <args>` with the config mounted.
pub fn container(
    name: &str,
    image: &str,
    spec: &PerspectiveDeploymentSpec,
    args: &[&str],
    env: Vec<EnvVar>,
) -> Container {
    Container {
        name: name.to_owned(),
        image: Some(image.to_owned()),
        image_pull_policy: spec.image_pull_policy.clone(),
        command: Some(vec!["perspective-worker".to_owned()]),
        args: Some(args.iter().map(|a| (*a).to_owned()).collect()),
        env: Some(env),
        resources: Some(resources(spec)),
        volume_mounts: Some(vec![VolumeMount {
            name: CONFIG_VOLUME.to_owned(),
            mount_path: CONFIG_DIR.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        }]),
        // Only what the container writes to its termination-log file, never its log lines: the
        // pod status is readable by more people than the log (README, "Trust model").
        termination_message_policy: Some("File".to_owned()),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                ..Capabilities::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

/// The pod spec around `container`, with the config volume and the spec's scheduling fields.
pub fn pod_spec(
    spec: &PerspectiveDeploymentSpec,
    config_map: &str,
    container: Container,
    restart_policy: &str,
) -> PodSpec {
    PodSpec {
        containers: vec![container],
        restart_policy: Some(restart_policy.to_owned()),
        volumes: Some(vec![Volume {
            name: CONFIG_VOLUME.to_owned(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map.to_owned(),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        }]),
        node_selector: spec.node_selector.clone(),
        tolerations: spec.tolerations.clone(),
        service_account_name: spec.service_account_name.clone(),
        image_pull_secrets: spec.image_pull_secrets.clone(),
        // The workers talk to PostgreSQL only; no API token in the pods.
        automount_service_account_token: Some(false),
        // Pod-wide too, so that no container the pod gets later runs unconfined.
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        ..PodSpec::default()
    }
}

/// Gives `pod` AppArmor `RuntimeDefault` when `app_armor` (`--apparmor-runtime-default`): the
/// container runtime's default profile even where the node's default would be unconfined.
pub fn harden(pod: &mut PodSpec, app_armor: bool) {
    if !app_armor {
        return;
    }
    let context = pod.security_context.get_or_insert_with(Default::default);
    context.app_armor_profile = Some(AppArmorProfile {
        type_: "RuntimeDefault".to_owned(),
        ..AppArmorProfile::default()
    });
}
