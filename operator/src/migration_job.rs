//! The migration Job: `perspective-worker migrate` for one migration target.
//!
//! The Job is named by the hash of what a migration depends on: the worker image, the worker's
//! embedded migrations, the hash of its engine functions and each perspective's definition hash
//! as the worker computes them (`perspective_worker::store::functions::hash`,
//! `perspective_worker::compile::definition_hash`: the hashes `run` checks, so the two cannot
//! disagree about what needs a migration). It is never patched: a new target is a new
//! Job, and superseded Jobs are deleted. Worker-only options (batch sizes, intervals) are not
//! part of the target, so changing them rolls the pods without a migration.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::jiff::Timestamp;
use kube::api::ObjectMeta;
use perspective_worker::compile::definition_hash;
use perspective_worker::store::functions;
use perspective_worker::store::migrations::MIGRATIONS;
use sha2::{Digest, Sha256};

use crate::crd::{DatabaseRole, PerspectiveDeploymentSpec};
use crate::labels;
use crate::pod;

/// What a migration Job is for: its hash and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationTarget {
    pub hash: String,
    pub job_name: String,
}

/// The migration target of `spec` running `image`.
pub fn target(instance: &str, spec: &PerspectiveDeploymentSpec, image: &str) -> MigrationTarget {
    let mut h = Sha256::new();
    // Length-prefixed fields, so no two different inputs hash alike.
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"migration-target-v2");
    field(image.as_bytes());
    for migration in MIGRATIONS {
        field(migration.checksum().as_bytes());
    }
    field(spec.schema.as_bytes());
    field(functions::hash(&spec.schema).as_bytes());
    for p in &spec.perspectives {
        field(definition_hash(&spec.schema, p).as_bytes());
    }
    let hash = hex::encode(h.finalize());
    MigrationTarget {
        job_name: labels::migration_job_name(instance, &hash),
        hash,
    }
}

/// The desired Job for `target`, reading its config from ConfigMap `config_map`.
pub fn build(
    instance: &str,
    namespace: &str,
    spec: &PerspectiveDeploymentSpec,
    image: &str,
    config_map: &str,
    target: &MigrationTarget,
) -> Job {
    let labels = labels::labels(instance, labels::MIGRATION);
    let annotations = BTreeMap::from([(labels::MIGRATION_HASH.to_owned(), target.hash.clone())]);
    let container = pod::container(
        "migrate",
        image,
        spec,
        &["migrate"],
        pod::base_env(spec, DatabaseRole::Migration),
    );
    Job {
        metadata: ObjectMeta {
            name: Some(target.job_name.clone()),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels.clone()),
            annotations: Some(annotations.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(spec.migrations.backoff_limit),
            active_deadline_seconds: Some(spec.migrations.active_deadline_seconds),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod::pod_spec(spec, config_map, container, "Never")),
            },
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// Where a migration Job stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    Running,
    Succeeded,
    /// The Job failed: its condition reason (e.g. `BackoffLimitExceeded`), a message built from
    /// the condition and where the output is ([`failure_message`]), and when it failed.
    Failed {
        reason: String,
        message: String,
        at: Option<Timestamp>,
    },
}

/// Reads a Job's state from its conditions.
pub fn state(job: &Job) -> JobState {
    let conditions = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let true_condition = |t: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == t && c.status == "True")
    };
    if true_condition("Complete").is_some() {
        return JobState::Succeeded;
    }
    match true_condition("Failed") {
        None => JobState::Running,
        Some(failed) => JobState::Failed {
            reason: failed.reason.clone().unwrap_or_else(|| "Failed".to_owned()),
            message: failure_message(
                failed.message.as_deref().unwrap_or_default(),
                job.metadata.name.as_deref().unwrap_or_default(),
            ),
            at: failed.last_transition_time.as_ref().map(|t| t.0),
        },
    }
}

/// What status and Events say about failed Job `job_name`: the Job controller's `condition`
/// message and where the output is — never the output itself. The container runs an image the
/// deployment's author chose, with the database Secret in its environment; whatever it prints
/// (its log, its termination message) could be that Secret in any encoding, and status and
/// Events are read by people who may not read the Secret or the pod's logs (README, "Trust
/// model"). Who may read the logs reads them there.
pub fn failure_message(condition: &str, job_name: &str) -> String {
    let pointer = format!("its output: kubectl logs job/{job_name}");
    let condition = condition.trim();
    if condition.is_empty() {
        pointer
    } else {
        format!("{condition}; {pointer}")
    }
}

/// Delay before a failed migration target is retried: `base` doubling per failure, at most
/// 20 × `base` (30 s … 10 min with the default base of 30 s).
pub fn retry_delay(failures: i32, base: std::time::Duration) -> std::time::Duration {
    let exp = failures.clamp(1, 6) - 1;
    (base * (1u32 << exp)).min(base * 20)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};

    use super::*;

    fn failed_job(name: &str, message: &str) -> Job {
        Job {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            status: Some(JobStatus {
                conditions: Some(vec![JobCondition {
                    type_: "Failed".to_owned(),
                    status: "True".to_owned(),
                    reason: Some("BackoffLimitExceeded".to_owned()),
                    message: Some(message.to_owned()),
                    ..JobCondition::default()
                }]),
                ..JobStatus::default()
            }),
            ..Job::default()
        }
    }

    #[test]
    fn a_failed_job_is_reported_by_its_condition_and_a_pointer_to_its_logs() {
        let job = failed_job(
            "shop-migrate-ab12",
            "Job has reached the specified backoff limit",
        );
        assert_eq!(
            state(&job),
            JobState::Failed {
                reason: "BackoffLimitExceeded".to_owned(),
                message: "Job has reached the specified backoff limit; \
                          its output: kubectl logs job/shop-migrate-ab12"
                    .to_owned(),
                at: None,
            }
        );
        assert_eq!(failure_message(" ", "j"), "its output: kubectl logs job/j");
    }
}
