//! Validation of a `PerspectiveDeployment` beyond what the CRD's schema enforces: the worker's
//! own config checks (the same ones `perspective-worker migrate` runs) and the operator's.
//! Every problem names the field under `spec.` it concerns.

use perspective_worker::config::Problem;

use crate::crd::PerspectiveDeploymentSpec;
use crate::labels::MAX_NAME_LEN;

/// Every problem found in deployment `name`'s spec, as `spec.<path>: <message>`.
pub fn problems(name: &str, spec: &PerspectiveDeploymentSpec) -> Vec<String> {
    let mut out: Vec<String> = spec
        .worker_config()
        .problems()
        .into_iter()
        .map(|Problem { path, message }| {
            if path.is_empty() {
                format!("spec: {message}")
            } else {
                format!("spec.{path}: {message}")
            }
        })
        .collect();
    // The worker reads the rendered config through its own limits (size, aliases, nesting):
    // a spec they refuse would be accepted here and then fail every pod.
    let (yaml, _) = crate::config_map::render(&spec.worker_config());
    if let Some(refusal) = perspective_worker::config::yaml_limits::refusal(&yaml) {
        out.push(format!(
            "spec: the worker would refuse the config rendered from this spec: {refusal}"
        ));
    }
    if name.len() > MAX_NAME_LEN || name.contains('.') {
        out.push(format!(
            "metadata.name: {name:?} must be a DNS label of at most {MAX_NAME_LEN} characters \
             (it names the worker StatefulSet, its pods and the migration Jobs)"
        ));
    }
    if let Some(image) = &spec.image {
        if image.trim().is_empty() || image.chars().any(char::is_whitespace) {
            out.push(format!("spec.image: {image:?} is not an image reference"));
        }
    }
    if let Some(policy) = &spec.image_pull_policy {
        if !["Always", "IfNotPresent", "Never"].contains(&policy.as_str()) {
            out.push(format!(
                "spec.imagePullPolicy: {policy:?} is not one of Always, IfNotPresent, Never"
            ));
        }
    }
    let db = &spec.database;
    let named = [
        (Some(&db.secret_ref), "spec.database.secretRef"),
        (
            db.migration_secret_ref.as_ref(),
            "spec.database.migrationSecretRef",
        ),
        (
            db.worker_secret_ref.as_ref(),
            "spec.database.workerSecretRef",
        ),
        (
            db.status_secret_ref.as_ref(),
            "spec.database.statusSecretRef",
        ),
    ];
    for (secret, field) in named {
        let Some(secret) = secret else { continue };
        if secret.name.is_empty() {
            out.push(format!("{field}.name: must name a Secret"));
        }
        if secret.key.is_empty()
            || !secret
                .key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
        {
            out.push(format!(
                "{field}.key: {:?} is not a valid Secret key",
                secret.key
            ));
        }
    }
    out
}

/// The problem with running worker image `image` when the operator runs only images that start
/// with one of `allowed` (`--allowed-image-prefix`); none when `allowed` is empty. `defaulted`:
/// the spec names no image, so `image` is the operator's default.
pub fn image_problem(image: &str, defaulted: bool, allowed: &[String]) -> Option<String> {
    if allowed.is_empty() || allowed.iter().any(|p| image.starts_with(p.as_str())) {
        return None;
    }
    let allowed: Vec<String> = allowed.iter().map(|p| format!("{p:?}")).collect();
    Some(format!(
        "spec.image: {image:?}{} is not allowed: this operator runs only images starting with {} \
         (--allowed-image-prefix)",
        if defaulted {
            " (the operator's default)"
        } else {
            ""
        },
        allowed.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 26, finding 7: a spec the worker's YAML limits refuse is refused here too (it was
    /// accepted, and every pod then failed to read its config). The worker counts unclosed `[`
    /// and `{` over the raw text, strings included.
    #[test]
    fn finding_7_a_spec_the_worker_would_refuse_is_refused() {
        let deep = "[".repeat(70);
        let spec: PerspectiveDeploymentSpec = serde_yaml::from_value(serde_yaml::Value::Mapping(
            serde_yaml::from_str(&format!(
                "schema: shop\ndatabase: {{secretRef: {{name: db}}}}\n\
                 perspectives: [{{name: p, handlers: {{A: \"SELECT '{deep}'\"}}}}]\n"
            ))
            .unwrap(),
        ))
        .unwrap();
        let found = problems("shop", &spec);
        assert!(
            found
                .iter()
                .any(|p| p.starts_with("spec: the worker would refuse the config rendered")),
            "{found:?}"
        );
        let plain: PerspectiveDeploymentSpec = serde_yaml::from_str(
            "schema: shop\ndatabase: {secretRef: {name: db}}\n\
             perspectives: [{name: p, handlers: {A: SELECT 1}}]\n",
        )
        .unwrap();
        assert!(problems("shop", &plain).is_empty());
    }

    #[test]
    fn only_images_with_an_allowed_prefix_run_when_prefixes_are_set() {
        let allowed = vec![
            "registry.example/perspective-worker:".to_owned(),
            "registry.example/team/".to_owned(),
        ];
        assert_eq!(image_problem("anything:1", false, &[]), None);
        assert_eq!(
            image_problem("registry.example/perspective-worker:1.2", false, &allowed),
            None
        );
        assert_eq!(
            image_problem("registry.example/team/worker@sha256:ab", false, &allowed),
            None
        );
        let refused = image_problem("evil.example/perspective-worker:1", false, &allowed).unwrap();
        assert!(
            refused.starts_with(
                "spec.image: \"evil.example/perspective-worker:1\" is not allowed: this operator \
                 runs only images starting with \"registry.example/perspective-worker:\", \
                 \"registry.example/team/\""
            ),
            "{refused}"
        );
        // A prefix is matched as written: `registry.example/perspective-worker` (no colon)
        // would also allow `registry.example/perspective-worker-evil`.
        assert!(image_problem(
            "registry.example/perspective-worker-evil:1",
            false,
            &allowed
        )
        .is_some());
        let defaulted = image_problem("perspective-worker:0.1.0", true, &allowed).unwrap();
        assert!(
            defaulted.contains("(the operator's default)"),
            "{defaulted}"
        );
    }
}
