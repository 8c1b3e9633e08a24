//! The admission decision on one `admission.k8s.io/v1` `AdmissionReview` of a
//! `PerspectiveDeployment`: allowed, or denied with the problems the reconciler would report as
//! `Degraded` `InvalidSpec`, word for word (joined by `; ` as there). Pure.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::crd::{PerspectiveDeployment, PerspectiveDeploymentSpec};

/// The part of a review request the decision reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    uid: String,
    #[serde(default)]
    operation: String,
    #[serde(default)]
    object: Option<Value>,
    #[serde(default)]
    old_object: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Review {
    request: Option<Request>,
}

/// Why a body is not a review this webhook can answer (answered with HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("not an admission.k8s.io/v1 AdmissionReview with a request: {0}")]
    Malformed(String),
}

/// The `AdmissionReview` answering `body`. `problems(name, spec)` lists what is wrong with a
/// deployment's spec (the reconciler's own check). Creates are checked, and updates that change
/// the spec; an update that leaves the spec as it was (labels, annotations such as the day-2
/// actions, finalizers) is allowed, so that a deployment made invalid by a change of the
/// operator's options can still be annotated or cleaned up. Anything else is allowed.
pub fn answer(
    body: &[u8],
    problems: impl Fn(&str, &PerspectiveDeploymentSpec) -> Vec<String>,
) -> Result<Value, ReviewError> {
    let review: Review =
        serde_json::from_slice(body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
    let request = review
        .request
        .ok_or_else(|| ReviewError::Malformed("no request".to_owned()))?;
    let denial = match (request.operation.as_str(), &request.object) {
        ("CREATE" | "UPDATE", Some(object)) => {
            let unchanged = request.operation == "UPDATE"
                && request.old_object.as_ref().and_then(|o| o.get("spec")) == object.get("spec");
            if unchanged {
                None
            } else {
                denial(object, &problems)
            }
        }
        _ => None,
    };
    let response = match denial {
        None => json!({"uid": request.uid, "allowed": true}),
        Some(message) => json!({
            "uid": request.uid,
            "allowed": false,
            "status": {"code": 422, "reason": "Invalid", "message": message},
        }),
    };
    Ok(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    }))
}

/// Why `object` may not be stored, if it may not.
fn denial(
    object: &Value,
    problems: &impl Fn(&str, &PerspectiveDeploymentSpec) -> Vec<String>,
) -> Option<String> {
    let pd: PerspectiveDeployment = match serde_json::from_value(object.clone()) {
        Ok(pd) => pd,
        Err(e) => return Some(format!("spec: cannot be read: {e}")),
    };
    let name = pd.metadata.name.as_deref().unwrap_or_default();
    let found = problems(name, &pd.spec);
    (!found.is_empty()).then(|| found.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(operation: &str, object: Option<Value>, old: Option<Value>) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "operation": operation,
                "object": object,
                "oldObject": old,
            }
        }))
        .unwrap()
    }

    fn pd(handler: &str) -> Value {
        json!({
            "apiVersion": "perspectives.dev/v1alpha1",
            "kind": "PerspectiveDeployment",
            "metadata": {"name": "shop", "namespace": "ns"},
            "spec": {
                "schema": "shop",
                "database": {"secretRef": {"name": "db"}},
                "perspectives": [{"name": "orders", "handlers": {"OrderPlaced": handler}}],
            }
        })
    }

    fn the_checks(name: &str, spec: &PerspectiveDeploymentSpec) -> Vec<String> {
        crate::validate::problems(name, spec)
    }

    #[test]
    fn a_valid_deployment_is_allowed_with_the_requests_uid() {
        let out = answer(
            &review("CREATE", Some(pd("SELECT :data")), None),
            the_checks,
        )
        .unwrap();
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(
            out["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(out["response"]["allowed"], true);
    }

    #[test]
    fn a_handler_typo_is_denied_with_the_workers_message_naming_the_field() {
        let out = answer(
            &review("CREATE", Some(pd("SELECT\n  :totl")), None),
            the_checks,
        )
        .unwrap();
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["code"], 422);
        let message = out["response"]["status"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(
                "spec.perspectives[0] (orders).handlers.OrderPlaced: unknown parameter :totl"
            ),
            "{message}"
        );
        // Word for word what the reconciler reports as InvalidSpec.
        let spec: PerspectiveDeployment = serde_json::from_value(pd("SELECT\n  :totl")).unwrap();
        assert_eq!(message, the_checks("shop", &spec.spec).join("; "));
    }

    #[test]
    fn an_update_is_checked_only_when_it_changes_the_spec() {
        let invalid = pd("SELECT :totl");
        let mut annotated = invalid.clone();
        annotated["metadata"]["annotations"] = json!({"perspectives.dev/rebuild": "orders"});
        let out = answer(
            &review("UPDATE", Some(annotated), Some(invalid.clone())),
            the_checks,
        )
        .unwrap();
        assert_eq!(out["response"]["allowed"], true);
        let out = answer(
            &review("UPDATE", Some(invalid), Some(pd("SELECT 1"))),
            the_checks,
        )
        .unwrap();
        assert_eq!(out["response"]["allowed"], false);
    }

    #[test]
    fn deletes_are_allowed_and_garbage_is_an_error() {
        let out = answer(
            &review("DELETE", None, Some(pd("SELECT :totl"))),
            the_checks,
        )
        .unwrap();
        assert_eq!(out["response"]["allowed"], true);
        assert!(answer(b"{}", the_checks).is_err());
        assert!(answer(b"not json", the_checks).is_err());
    }

    #[test]
    fn an_unreadable_object_is_denied_naming_the_problem() {
        let mut bad = pd("SELECT 1");
        bad["spec"]["perspectives"] = json!("not a list");
        let out = answer(&review("CREATE", Some(bad), None), the_checks).unwrap();
        assert_eq!(out["response"]["allowed"], false);
        let message = out["response"]["status"]["message"].as_str().unwrap();
        assert!(message.starts_with("spec: cannot be read: "), "{message}");
    }
}
