//! The migration Job: `perspective-worker migrate` for one migration target.
//!
//! The Job is named by the hash of what a migration depends on: the worker image, the worker's
//! embedded migrations, and each perspective's definition hash as the worker computes it
//! (`perspective_worker::compile::definition_hash`, the same hash `run` checks, so the two
//! cannot disagree about what needs a migration). It is never patched: a new target is a new
//! Job, and superseded Jobs are deleted. Worker-only options (batch sizes, intervals) are not
//! part of the target, so changing them rolls the pods without a migration.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use k8s_openapi::jiff::Timestamp;
use kube::api::ObjectMeta;
use perspective_worker::compile::definition_hash;
use perspective_worker::store::migrations::MIGRATIONS;
use sha2::{Digest, Sha256};

use crate::crd::PerspectiveDeploymentSpec;
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
    let container = pod::container("migrate", image, spec, &["migrate"], pod::base_env(spec));
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
    /// the condition and the failed pod's termination message, and when it failed.
    Failed {
        reason: String,
        message: String,
        at: Option<Timestamp>,
    },
}

/// Reads a Job's state from its conditions; `pods` are its pods, for a termination message.
pub fn state(job: &Job, pods: &[Pod]) -> JobState {
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
        Some(failed) => {
            let reason = failed.reason.clone().unwrap_or_else(|| "Failed".to_owned());
            let mut message = failed.message.clone().unwrap_or_default();
            if let Some(output) = termination_message(pods) {
                if !message.is_empty() {
                    message.push_str(": ");
                }
                message.push_str(&failure_detail(&output, OUTPUT_LIMIT));
                message.push_str(&format!(
                    " (full output: kubectl logs job/{})",
                    job.metadata.name.as_deref().unwrap_or_default()
                ));
            }
            JobState::Failed {
                reason,
                message,
                at: failed.last_transition_time.as_ref().map(|t| t.0),
            }
        }
    }
}

/// Bytes of a failed pod's output that go into the condition and the Event: the Event's note
/// (1 kB) must still hold the Job's name and reason around it.
pub const OUTPUT_LIMIT: usize = 640;

/// The newest failed pod's termination message (its last log lines, with
/// `FallbackToLogsOnError`).
fn termination_message(pods: &[Pod]) -> Option<String> {
    let mut terminated: Vec<_> = pods
        .iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref()?.first())
        .filter_map(|cs| cs.state.as_ref()?.terminated.as_ref())
        .filter(|t| t.exit_code != 0)
        .collect();
    terminated.sort_by_key(|t| t.finished_at.as_ref().map(|f| f.0));
    let message = terminated.last()?.message.as_ref()?.trim();
    (!message.is_empty()).then(|| message.to_owned())
}

/// What a failed pod's `output` may show in status and Events: credentials redacted (the
/// output is raw container output, and status and Events are readable by people who may not
/// read the Secret: DESIGN §11), then its end — where the error is — within `limit` bytes,
/// starting at a line when it was cut.
pub fn failure_detail(output: &str, limit: usize) -> String {
    let clean = redact_credentials(output.trim());
    if clean.len() <= limit {
        return clean;
    }
    let mut start = clean.len() - (limit - "…".len());
    while !clean.is_char_boundary(start) {
        start += 1;
    }
    let tail = &clean[start..];
    // Start at the next line if there is one, rather than mid-word.
    let tail = match tail.find('\n') {
        Some(i) if i + 1 < tail.len() => &tail[i + 1..],
        _ => tail,
    };
    format!("…{tail}")
}

/// Shown instead of a URL that could carry a password.
pub const REDACTED_URL: &str = "<redacted URL>";

/// `text` with every URL that carries credentials (`scheme://user:password@…`) or points at
/// PostgreSQL (`postgres://…`, `postgresql://…`) replaced by [`REDACTED_URL`], and every
/// libpq `password=…` value replaced by `<redacted>`.
pub fn redact_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let before = &rest[..at];
        let scheme_start = before
            .char_indices()
            .rev()
            .take_while(|(_, c)| c.is_ascii_alphanumeric() || "+-.".contains(*c))
            .last()
            .map_or(at, |(i, _)| i);
        let scheme = &before[scheme_start..];
        let after = &rest[at + 3..];
        let end = after
            .find(|c: char| c.is_whitespace() || "\"'<>`".contains(c))
            .unwrap_or(after.len());
        // Sentence punctuation after a URL is not part of it.
        let end = after[..end]
            .trim_end_matches(['.', ',', ';', ':', ')', ']'])
            .len();
        let authority = after[..end].split('/').next().unwrap_or_default();
        let secret = authority.contains('@') || scheme.to_ascii_lowercase().starts_with("postgres");
        out.push_str(&rest[..scheme_start]);
        if secret {
            out.push_str(REDACTED_URL);
        } else {
            out.push_str(&rest[scheme_start..at + 3 + end]);
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    redact_password_values(&out)
}

/// libpq keyword/value connection strings: `password=secret` → `password=<redacted>`.
fn redact_password_values(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut from = 0;
    while let Some(i) = lower[from..].find("password=") {
        let value_start = from + i + "password=".len();
        let value_end = text[value_start..]
            .find(|c: char| c.is_whitespace())
            .map_or(text.len(), |e| value_start + e);
        out.push_str(&text[copied..value_start]);
        out.push_str("<redacted>");
        copied = value_end;
        from = value_end;
    }
    out.push_str(&text[copied..]);
    out
}

/// Delay before a failed migration target is retried: `base` doubling per failure, at most
/// 20 × `base` (30 s … 10 min with the default base of 30 s).
pub fn retry_delay(failures: i32, base: std::time::Duration) -> std::time::Duration {
    let exp = failures.clamp(1, 6) - 1;
    (base * (1u32 << exp)).min(base * 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_urls_and_conninfo_are_redacted() {
        let text = "connecting to postgres://app:s3cret@db:5432/shop failed; \
                    DATABASE_URL=postgresql://db/shop; see https://example.com/docs and \
                    'https://user:tok@git.example.com/x' host=db password=hunter2 user=app";
        let clean = redact_credentials(text);
        for secret in ["s3cret", "hunter2", "tok@", "postgresql://db"] {
            assert!(!clean.contains(secret), "{secret} left in {clean}");
        }
        assert!(
            clean.contains("connecting to <redacted URL> failed"),
            "{clean}"
        );
        assert!(clean.contains("DATABASE_URL=<redacted URL>;"), "{clean}");
        assert!(clean.contains("'<redacted URL>'"), "{clean}");
        assert!(clean.contains("password=<redacted> user=app"), "{clean}");
        // URLs without credentials are kept: they help.
        assert!(clean.contains("https://example.com/docs"), "{clean}");
        assert_eq!(redact_credentials("no urls here"), "no urls here");
    }

    #[test]
    fn the_detail_keeps_the_end_where_the_error_is() {
        let slow = "WARN slow statement: SELECT … FROM shop.wh_apply_order_totals …\n".repeat(40);
        let output = format!(
            "{slow}Error: perspective order_totals: handlers.OrderPlaced: division by zero\n"
        );
        let detail = failure_detail(&output, OUTPUT_LIMIT);
        assert!(detail.len() <= OUTPUT_LIMIT, "{}", detail.len());
        assert!(
            detail.ends_with("handlers.OrderPlaced: division by zero"),
            "{detail}"
        );
        // Cut at a line start, marked.
        assert!(detail.starts_with("…WARN slow statement"), "{detail}");
        assert_eq!(failure_detail("  short\n", OUTPUT_LIMIT), "short");
        // A secret near the end is redacted before the cut, never half-kept.
        let leaky = format!("{slow}cannot connect to postgres://app:pw@db/shop");
        let detail = failure_detail(&leaky, OUTPUT_LIMIT);
        assert!(
            detail.ends_with("cannot connect to <redacted URL>"),
            "{detail}"
        );
        assert!(!detail.contains("pw@"));
    }
}
