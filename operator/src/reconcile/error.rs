//! Why a reconcile could not finish, and Kubernetes client errors in one line.

/// A reconcile that could not finish; retried with backoff by the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {}", describe(.0))]
    Kube(#[from] kube::Error),
    /// The API server refused a child object (invalid, forbidden): reported as `Degraded`.
    #[error("{object} rejected by the API server: {message}")]
    Rejected { object: String, message: String },
    #[error("{0} is missing")]
    MissingField(&'static str),
    /// The deployment changed since the cached copy this reconcile started from (typically
    /// by our own last status write, not yet in the cache): nothing more is written from it,
    /// and the reconcile runs again soon from the newer copy.
    #[error("the deployment changed since the cached copy was read")]
    Stale,
}

impl Error {
    /// Short label for the failures metric.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(_)) | Error::Rejected { .. } => "api",
            Error::Kube(_) => "transport",
            Error::MissingField(_) => "invalid_object",
            Error::Stale => "stale_copy",
        }
    }
}

/// A Kubernetes client error in one line: the API server's own message for API errors (kube's
/// `Display` of those appends a `Debug` dump).
pub fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(s) => format!("{} ({} {})", s.message, s.code, s.reason),
        other => other.to_string(),
    }
}

/// An error and its causes in one line, with [`describe`] for a Kubernetes client error among
/// them (for errors that wrap one, like the controller's watch errors).
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    if let Some(kube_error) = error.downcast_ref::<kube::Error>() {
        return describe(kube_error);
    }
    let mut cause = error.source();
    while let Some(e) = cause {
        if let Some(kube_error) = e.downcast_ref::<kube::Error>() {
            return format!("{}: {}", outer_context(error), describe(kube_error));
        }
        cause = e.source();
    }
    error.to_string()
}

/// The part of `error`'s message before its cause's (`failed to list: ApiError…` → `failed to
/// list`).
fn outer_context(error: &(dyn std::error::Error + 'static)) -> String {
    let text = error.to_string();
    match text.split_once(": ") {
        Some((context, _)) => context.to_owned(),
        None => text,
    }
}

/// Whether an API error means the object itself was refused (so retrying the same object
/// cannot help): invalid (400, 422) or forbidden (403, e.g. by a quota or a policy).
pub fn is_rejection(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(s) if [400, 403, 422].contains(&s.code))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn api_error() -> kube::Error {
        let status: kube::core::Status = serde_json::from_value(json!({
            "status": "Failure",
            "message": "Job.batch \"shop-migrate-1\" is invalid: spec.backoffLimit: Invalid value: -1",
            "reason": "Invalid",
            "code": 422
        }))
        .unwrap();
        kube::Error::Api(Box::new(status))
    }

    #[derive(Debug, thiserror::Error)]
    #[error("failed to perform initial object list: {0}")]
    struct Wrapper(#[source] kube::Error);

    #[test]
    fn api_errors_are_one_line_without_debug_dumps() {
        let e = Error::from(api_error());
        let line = e.to_string();
        assert_eq!(
            line,
            "Kubernetes API: Job.batch \"shop-migrate-1\" is invalid: spec.backoffLimit: Invalid value: -1 (422 Invalid)"
        );
        assert!(!line.contains("Status {"), "{line}");
        assert_eq!(one_line(&api_error()), describe(&api_error()));
        let wrapped = one_line(&Wrapper(api_error()));
        assert_eq!(
            wrapped,
            "failed to perform initial object list: Job.batch \"shop-migrate-1\" is invalid: spec.backoffLimit: Invalid value: -1 (422 Invalid)"
        );
        assert!(is_rejection(&api_error()));
    }
}
