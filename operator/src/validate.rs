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
    let secret = &spec.database.secret_ref;
    if secret.name.is_empty() {
        out.push("spec.database.secretRef.name: must name a Secret".to_owned());
    }
    if secret.key.is_empty()
        || !secret
            .key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
    {
        out.push(format!(
            "spec.database.secretRef.key: {:?} is not a valid Secret key",
            secret.key
        ));
    }
    out
}
