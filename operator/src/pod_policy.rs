//! What a deployment's author may set on the pods the operator runs for them, beyond what the
//! CRD's schema allows: a priority class and a service account only from the operator's
//! allow-lists, no pod annotation in Kubernetes' own key namespaces (AppArmor and seccomp
//! annotations among them), no toleration of every taint or of the control-plane's. Every
//! problem names its field; a deployment with one is `InvalidSpec` and gets no child. Pure.

use crate::crd::PerspectiveDeploymentSpec;

/// The operator's allow-lists (`--allowed-priority-class`, `--allowed-service-account`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodPolicy {
    /// Priority classes a deployment may name; empty: none (the pods get the cluster's
    /// default priority).
    pub priority_classes: Vec<String>,
    /// Service accounts a deployment may name besides `default`; empty: only `default`.
    pub service_accounts: Vec<String>,
}

/// The namespace's own service account, always allowed (the pods run as it when none is named;
/// its token is not mounted either way).
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// Key prefixes of taints that only control-plane nodes carry.
const CONTROL_PLANE_TAINTS: [&str; 1] = ["node-role.kubernetes.io/"];

/// The problems of `spec`'s pod-level fields under `policy`, each as `spec.<field>: <why>`.
pub fn problems(spec: &PerspectiveDeploymentSpec, policy: &PodPolicy) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(class) = &spec.priority_class_name {
        if !policy.priority_classes.contains(class) {
            out.push(format!(
                "spec.priorityClassName: {class:?} is not allowed: {} (--allowed-priority-class)",
                allowed("priority classes", &policy.priority_classes)
            ));
        }
    }
    if let Some(account) = &spec.service_account_name {
        if account != DEFAULT_SERVICE_ACCOUNT && !policy.service_accounts.contains(account) {
            out.push(format!(
                "spec.serviceAccountName: {account:?} is not allowed: {} besides \
                 \"default\" (--allowed-service-account)",
                allowed("service accounts", &policy.service_accounts)
            ));
        }
    }
    for key in spec.pod_annotations.iter().flatten().map(|(k, _)| k) {
        if reserved_annotation(key) {
            out.push(format!(
                "spec.podAnnotations: key {key:?} is refused: keys under kubernetes.io and k8s.io \
                 (and their subdomains) are Kubernetes' own and can change how the pod is \
                 confined (AppArmor, seccomp)"
            ));
        }
    }
    for (i, t) in spec.tolerations.iter().flatten().enumerate() {
        let key = t.key.as_deref().unwrap_or("");
        if key.is_empty() {
            out.push(format!(
                "spec.tolerations[{i}]: a toleration without a key tolerates every taint, \
                 the control plane's too; name the taint"
            ));
        } else if CONTROL_PLANE_TAINTS.iter().any(|p| key.starts_with(p)) {
            out.push(format!(
                "spec.tolerations[{i}]: {key:?} is refused: workers do not run on \
                 control-plane nodes"
            ));
        }
    }
    out
}

/// Whether annotation `key` is in a namespace Kubernetes reserves for itself: its prefix (the
/// part before `/`) is `kubernetes.io` or `k8s.io` or a subdomain of either.
pub fn reserved_annotation(key: &str) -> bool {
    let Some((prefix, _)) = key.split_once('/') else {
        return false;
    };
    let prefix = prefix.to_ascii_lowercase();
    ["kubernetes.io", "k8s.io"]
        .iter()
        .any(|d| prefix == *d || prefix.ends_with(&format!(".{d}")))
}

fn allowed(what: &str, list: &[String]) -> String {
    if list.is_empty() {
        format!("this operator allows no {what}")
    } else {
        let names: Vec<String> = list.iter().map(|n| format!("{n:?}")).collect();
        format!("this operator allows only {what} {}", names.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: &str) -> PerspectiveDeploymentSpec {
        serde_yaml::from_str(&format!(
            "schema: shop\ndatabase: {{secretRef: {{name: db}}}}\n\
             perspectives: [{{name: p, handlers: {{A: SELECT 1}}}}]\n{extra}"
        ))
        .unwrap()
    }

    fn policy(classes: &[&str], accounts: &[&str]) -> PodPolicy {
        PodPolicy {
            priority_classes: classes.iter().map(|s| s.to_string()).collect(),
            service_accounts: accounts.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn finding_2_priority_classes_come_from_the_allow_list_only() {
        let critical = spec("priorityClassName: system-node-critical");
        assert_eq!(
            problems(&critical, &PodPolicy::default()),
            vec![
                "spec.priorityClassName: \"system-node-critical\" is not allowed: this operator \
                 allows no priority classes (--allowed-priority-class)"
            ]
        );
        let listed = policy(&["workers-low"], &[]);
        assert!(problems(&critical, &listed)[0]
            .contains("allows only priority classes \"workers-low\""));
        assert!(problems(&spec("priorityClassName: workers-low"), &listed).is_empty());
        assert!(problems(&spec(""), &PodPolicy::default()).is_empty());
    }

    #[test]
    fn finding_2_service_accounts_come_from_the_allow_list_only() {
        let admin = spec("serviceAccountName: cluster-admin-sa");
        let refused = problems(&admin, &PodPolicy::default());
        assert_eq!(
            refused,
            vec![
                "spec.serviceAccountName: \"cluster-admin-sa\" is not allowed: this operator \
                 allows no service accounts besides \"default\" (--allowed-service-account)"
            ]
        );
        assert!(problems(&admin, &policy(&[], &["cluster-admin-sa"])).is_empty());
        assert!(problems(&spec("serviceAccountName: default"), &PodPolicy::default()).is_empty());
    }

    #[test]
    fn finding_2_kubernetes_annotation_keys_are_refused() {
        for key in [
            "container.apparmor.security.beta.kubernetes.io/worker",
            "seccomp.security.alpha.kubernetes.io/pod",
            "kubernetes.io/anything",
            "cluster-autoscaler.kubernetes.io/safe-to-evict",
            "Sub.K8S.io/x",
        ] {
            assert!(reserved_annotation(key), "{key}");
        }
        for key in [
            "example.com/team",
            "prometheus.io/path",
            "kubernetes.io",
            "notkubernetes.io/x",
        ] {
            assert!(!reserved_annotation(key), "{key}");
        }
        let unconfined = spec(
            "podAnnotations:\n  container.apparmor.security.beta.kubernetes.io/worker: unconfined\n  team: a",
        );
        let refused = problems(&unconfined, &PodPolicy::default());
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].starts_with(
            "spec.podAnnotations: key \"container.apparmor.security.beta.kubernetes.io/worker\" \
             is refused"
        ));
    }

    #[test]
    fn finding_2_tolerations_of_every_or_control_plane_taints_are_refused() {
        let everything = spec("tolerations: [{operator: Exists}]");
        assert!(problems(&everything, &PodPolicy::default())[0]
            .starts_with("spec.tolerations[0]: a toleration without a key"));
        let control_plane = spec(
            "tolerations:\n- {key: dedicated, value: db, effect: NoSchedule}\n\
             - {key: node-role.kubernetes.io/control-plane, operator: Exists}",
        );
        let refused = problems(&control_plane, &PodPolicy::default());
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].starts_with(
            "spec.tolerations[1]: \"node-role.kubernetes.io/control-plane\" is refused"
        ));
    }
}
