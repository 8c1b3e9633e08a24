//! Pieces shared by the migration Job's and the worker StatefulSet's pod templates.

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, EnvVar, EnvVarSource, ObjectFieldSelector,
    PodSpec, SeccompProfile, SecretKeySelector, SecurityContext, Volume, VolumeMount,
};

use crate::config_map::{CONFIG_DIR, CONFIG_FILE};
use crate::crd::PerspectiveDeploymentSpec;

/// Name of the config volume.
const CONFIG_VOLUME: &str = "config";

/// Environment every worker container gets: the config path and the database URL, which comes
/// from the Secret and so never appears in a pod spec, a ConfigMap or a log.
pub fn base_env(spec: &PerspectiveDeploymentSpec) -> Vec<EnvVar> {
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
                    name: spec.database.secret_ref.name.clone(),
                    key: spec.database.secret_ref.key.clone(),
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
        ..PodSpec::default()
    }
}
