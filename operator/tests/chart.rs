//! The Helm chart `charts/perspective-operator`, checked with the real helm and kubectl.
//!
//! Offline: `helm lint --strict`, rendering (defaults, one watched namespace, options),
//! values.schema.json rejecting bad values, and the chart's CRD being a byte-identical copy of
//! `crds/perspectivedeployment.yaml`; the observability pack (ServiceMonitor, worker PodMonitor,
//! PrometheusRule, dashboard ConfigMap) rendered only when enabled, its PodMonitor selecting
//! what the operator's builders label worker pods with.
//!
//! Against a control plane (`cluster_*` tests; KUBECONFIG from `tests/e2e/with-control-plane.sh`
//! or `eval "$(tests/e2e/control-plane.sh env DIR)"`): `helm install` into a fresh namespace
//! enforcing the `restricted` Pod Security Standard, the Deployment rolls out (kwok plays the
//! kubelet), every permission of the operator's ServiceAccount is checked with
//! `kubectl auth can-i` (granted ones and all other verbs on the same resources), then
//! `helm uninstall` removes the grants; the observability pack passes a server-side dry-run
//! against the Prometheus Operator's CRDs. Each test uses its own namespaces and release, so they
//! run in parallel.

mod support;

use std::collections::BTreeSet;
use std::env;
use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use perspective_operator::crd::PerspectiveDeploymentSpec;
use perspective_operator::{labels, workers};
use serde::Deserialize;
use serde_yaml::Value;
use support::{repo_root, tool};

const CHART_NAME: &str = "perspective-operator";
const CRD_NAME: &str = "perspectivedeployments.perspectives.dev";

/// Every verb checked on each resource the operator may touch: whatever is not granted must be
/// denied.
const ALL_VERBS: &[&str] = &[
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
];

/// (API group, resource[/subresource], verbs): exactly the calls the operator makes in every
/// watched namespace (server-side apply is `patch`, and `create` too when it creates the
/// object), and nothing more.
const OPERATOR_RULES: &[(&str, &str, &[&str])] = &[
    (
        "perspectives.dev",
        "perspectivedeployments",
        &["get", "list", "watch", "patch"],
    ),
    (
        "perspectives.dev",
        "perspectivedeployments/status",
        &["patch"],
    ),
    (
        "perspectives.dev",
        "perspectivedeployments/finalizers",
        &["update"],
    ),
    (
        "",
        "configmaps",
        &["get", "list", "create", "patch", "delete"],
    ),
    ("", "services", &["get", "create", "patch"]),
    ("", "secrets", &["get"]),
    ("", "pods", &[]),
    ("", "events", &[]),
    ("events.k8s.io", "events", &["create", "patch"]),
    (
        "apps",
        "statefulsets",
        &["get", "list", "watch", "create", "patch"],
    ),
    (
        "batch",
        "jobs",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    (
        "policy",
        "poddisruptionbudgets",
        &["get", "create", "patch"],
    ),
];

/// Leader election, in the release namespace only.
const LEASE_RULES: &[(&str, &str, &[&str])] =
    &[("coordination.k8s.io", "leases", &["get", "create", "patch"])];

/// Cluster-scoped things the operator must never be able to do.
const CLUSTER_DENIED: &[(&str, &str, &str)] = &[
    (
        "create",
        "apiextensions.k8s.io",
        "customresourcedefinitions",
    ),
    ("patch", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("list", "", "nodes"),
    ("create", "rbac.authorization.k8s.io", "clusterrolebindings"),
];

/// Namespaced things outside its rules it must never be able to do.
const NAMESPACE_DENIED: &[(&str, &str, &str)] = &[
    ("create", "apps", "deployments"),
    ("create", "rbac.authorization.k8s.io", "rolebindings"),
    ("create", "", "serviceaccounts"),
    ("create", "", "pods/exec"),
];

// ---------------------------------------------------------------------------------------------
// Paths and tools

fn chart_dir() -> PathBuf {
    repo_root().join("charts").join(CHART_NAME)
}

/// State helm and kubectl would otherwise keep in $HOME.
fn state_dir() -> PathBuf {
    match env::var_os("E2E_DIR") {
        Some(dir) => PathBuf::from(dir).join("chart-test"),
        None => PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chart-test"),
    }
}

fn helm() -> Command {
    let state = state_dir();
    let mut cmd = Command::new(tool("helm"));
    // The e2e wrapper sets these; otherwise keep them out of $HOME too.
    for (var, sub) in [
        ("HELM_CACHE_HOME", "helm/cache"),
        ("HELM_CONFIG_HOME", "helm/config"),
        ("HELM_DATA_HOME", "helm/data"),
    ] {
        if env::var_os(var).is_none() {
            cmd.env(var, state.join(sub));
        }
    }
    cmd.env("KUBECACHEDIR", state.join("kube-cache"));
    cmd
}

fn kubectl() -> Command {
    let mut cmd = Command::new(tool("kubectl"));
    cmd.env("KUBECACHEDIR", state_dir().join("kube-cache"))
        // A hung apiserver fails the test instead of hanging it.
        .arg("--request-timeout=30s");
    cmd
}

fn describe(cmd: &Command) -> String {
    let args: Vec<_> = cmd.get_args().map(OsStr::to_string_lossy).collect();
    format!("{} {}", cmd.get_program().to_string_lossy(), args.join(" "))
}

fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", describe(cmd)))
}

/// Runs `cmd`, panics with its output unless it succeeds, returns stdout.
fn ok(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        describe(cmd),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("stdout is UTF-8")
}

// ---------------------------------------------------------------------------------------------
// Rendering

/// `helm template` with `args`, as a list of objects.
fn render(namespace: &str, args: &[&str]) -> Vec<Value> {
    let text = ok(helm()
        .args(["template", "rel"])
        .arg(chart_dir())
        .args(["--namespace", namespace])
        .args(args));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("helm template emits valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// Follows a dotted path of mapping keys and sequence indexes; Null when absent.
fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    path.split('.')
        .fold(v, |v, key| match key.parse::<usize>() {
            Ok(i) => v.get(i).unwrap_or(&NULL),
            Err(_) => v.get(key).unwrap_or(&NULL),
        })
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path} is not a string in:\n{}", to_yaml(v)))
}

fn to_yaml(v: &Value) -> String {
    serde_yaml::to_string(v).unwrap_or_default()
}

fn kinds(docs: &[Value]) -> BTreeSet<String> {
    docs.iter().map(|d| str_at(d, "kind").to_string()).collect()
}

/// The single object of `kind` named `name`.
fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<_> = docs
        .iter()
        .filter(|d| str_at(d, "kind") == kind && str_at(d, "metadata.name") == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} {name}, rendered kinds: {:?}",
        kinds(docs)
    );
    found[0]
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .unwrap_or_else(|| panic!("not a list: {}", to_yaml(v)))
        .iter()
        .map(|s| s.as_str().expect("a string").to_string())
        .collect()
}

type Grant = (String, String, String);

/// A role's rules flattened into (group, resource, verb).
fn grants_of_role(role: &Value) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for rule in at(role, "rules").as_sequence().expect("rules") {
        for group in strings(at(rule, "apiGroups")) {
            for resource in strings(at(rule, "resources")) {
                for verb in strings(at(rule, "verbs")) {
                    out.insert((group.clone(), resource.clone(), verb));
                }
            }
        }
    }
    out
}

fn grants(rules: &[(&str, &str, &[&str])]) -> BTreeSet<Grant> {
    rules
        .iter()
        .flat_map(|(group, resource, verbs)| {
            verbs
                .iter()
                .map(move |verb| (group.to_string(), resource.to_string(), verb.to_string()))
        })
        .collect()
}

/// Compares a rendered role with the expected rules, naming only the differences.
fn assert_grants(role: &Value, rules: &[(&str, &str, &[&str])]) {
    let actual = grants_of_role(role);
    let expected = grants(rules);
    let missing: Vec<_> = expected.difference(&actual).collect();
    let extra: Vec<_> = actual.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{} {}: missing {missing:?}, not needed {extra:?}",
        str_at(role, "kind"),
        str_at(role, "metadata.name")
    );
}

fn assert_binding(binding: &Value, role_kind: &str, role: &str, sa: &str, sa_namespace: &str) {
    assert_eq!(str_at(binding, "roleRef.kind"), role_kind);
    assert_eq!(str_at(binding, "roleRef.name"), role);
    assert_eq!(
        str_at(binding, "roleRef.apiGroup"),
        "rbac.authorization.k8s.io"
    );
    let subjects = at(binding, "subjects").as_sequence().expect("subjects");
    assert_eq!(subjects.len(), 1, "{}", to_yaml(binding));
    assert_eq!(str_at(&subjects[0], "kind"), "ServiceAccount");
    assert_eq!(str_at(&subjects[0], "name"), sa);
    assert_eq!(str_at(&subjects[0], "namespace"), sa_namespace);
}

fn operator_container(deployment: &Value) -> &Value {
    let containers = at(deployment, "spec.template.spec.containers");
    assert_eq!(containers.as_sequence().map(Vec::len), Some(1));
    &containers[0]
}

fn args_of(deployment: &Value) -> Vec<String> {
    strings(at(operator_container(deployment), "args"))
}

/// `helm lint` cannot declare API versions, so the monitoring pack (which needs the Prometheus
/// Operator's kinds) is linted for its hint only; its rendering is checked by the render tests.
#[test]
fn lint_is_clean_in_strict_mode() {
    for extra in [
        &[][..],
        &["--set", "watchNamespace=apps"][..],
        &[
            "--set",
            "webhook.enabled=true",
            "--set",
            "networkPolicy.enabled=true",
        ][..],
    ] {
        let out = ok(helm()
            .args(["lint", "--strict"])
            .arg(chart_dir())
            .args(extra));
        assert!(out.contains("0 chart(s) failed"), "{out}");
    }
    let pack: Vec<&str> = PACK
        .chunks(2)
        .filter(|f| f[0] == "--set")
        .flatten()
        .copied()
        .collect();
    let out = output(
        helm()
            .args(["lint", "--strict"])
            .arg(chart_dir())
            .args(&pack),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("this cluster does not serve monitoring.coreos.com/v1"),
        "{text}"
    );
}

#[test]
fn renders_cluster_wide_by_default() {
    let docs = render("ops", &[]);
    let name = "rel-perspective-operator";
    assert_eq!(
        kinds(&docs),
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Lease",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount"
        ]
        .map(String::from)
        .into(),
    );
    for doc in &docs {
        let kind = str_at(doc, "kind");
        let expected = if kind.starts_with("Cluster") {
            None
        } else {
            Some("ops")
        };
        assert_eq!(at(doc, "metadata.namespace").as_str(), expected, "{kind}");
        let labels = at(doc, "metadata.labels");
        assert_eq!(
            labels.get("app.kubernetes.io/name"),
            Some(&Value::from(CHART_NAME)),
            "{kind}"
        );
    }

    let sa = object(&docs, "ServiceAccount", name);
    assert_eq!(str_at(sa, "metadata.name"), name);

    let cluster_role = object(&docs, "ClusterRole", name);
    assert_grants(cluster_role, OPERATOR_RULES);
    let binding = object(&docs, "ClusterRoleBinding", name);
    assert_binding(binding, "ClusterRole", name, name, "ops");

    let lease_role = object(&docs, "Role", &format!("{name}-leader-election"));
    assert_grants(lease_role, LEASE_RULES);
    // The release owns its Lease, so `helm uninstall` removes it.
    object(&docs, "Lease", name);
    let lease_binding = object(&docs, "RoleBinding", &format!("{name}-leader-election"));
    assert_binding(
        lease_binding,
        "Role",
        &format!("{name}-leader-election"),
        name,
        "ops",
    );

    let deployment = object(&docs, "Deployment", name);
    assert_eq!(at(deployment, "spec.replicas").as_u64(), Some(2));
    let pod = at(deployment, "spec.template.spec");
    assert_eq!(str_at(pod, "serviceAccountName"), name);
    assert_eq!(at(pod, "terminationGracePeriodSeconds").as_u64(), Some(30));
    assert_eq!(
        at(pod, "securityContext.runAsNonRoot").as_bool(),
        Some(true)
    );
    assert_eq!(
        str_at(pod, "securityContext.seccompProfile.type"),
        "RuntimeDefault"
    );

    let c = operator_container(deployment);
    // The images `make images` builds, so the README's quickstart needs no --set.
    assert_eq!(str_at(c, "image"), "localhost/perspective-operator:0.1.0");
    assert_eq!(strings(at(c, "command")), ["perspective-operator", "run"]);
    assert_eq!(
        args_of(deployment),
        [
            "--http-addr=0.0.0.0:8080",
            "--leader-election",
            "--lease-name=rel-perspective-operator",
            "--lease-namespace=ops",
            "--default-worker-image=localhost/perspective-worker:0.1.0",
            "--status-interval-seconds=15",
            "--log-format=json",
        ]
    );
    for (i, (var, field)) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ]
    .into_iter()
    .enumerate()
    {
        let env = at(c, &format!("env.{i}"));
        assert_eq!(str_at(env, "name"), var);
        assert_eq!(str_at(env, "valueFrom.fieldRef.fieldPath"), field);
    }
    assert_eq!(str_at(c, "ports.0.name"), "http");
    assert_eq!(at(c, "ports.0.containerPort").as_u64(), Some(8080));
    assert_eq!(str_at(c, "livenessProbe.httpGet.path"), "/livez");
    assert_eq!(str_at(c, "livenessProbe.httpGet.port"), "http");
    assert_eq!(str_at(c, "readinessProbe.httpGet.path"), "/readyz");
    assert_eq!(str_at(c, "readinessProbe.httpGet.port"), "http");
    let sc = at(c, "securityContext");
    assert_eq!(at(sc, "runAsNonRoot").as_bool(), Some(true));
    assert_eq!(at(sc, "readOnlyRootFilesystem").as_bool(), Some(true));
    assert_eq!(at(sc, "allowPrivilegeEscalation").as_bool(), Some(false));
    assert_eq!(strings(at(sc, "capabilities.drop")), ["ALL"]);
    assert_eq!(str_at(sc, "seccompProfile.type"), "RuntimeDefault");
    assert_eq!(str_at(c, "resources.requests.cpu"), "50m");
    assert_eq!(str_at(c, "resources.requests.memory"), "64Mi");
    assert_eq!(str_at(c, "resources.limits.memory"), "256Mi");

    // The Service and the Deployment select the pods by the same labels.
    let selector = at(deployment, "spec.selector.matchLabels");
    let pod_labels = at(deployment, "spec.template.metadata.labels")
        .as_mapping()
        .expect("pod labels");
    for (k, v) in selector.as_mapping().expect("selector") {
        assert_eq!(pod_labels.get(k), Some(v), "pod label {k:?}");
    }
    let service = object(&docs, "Service", &format!("{name}-metrics"));
    assert_eq!(at(service, "spec.selector"), selector);
    assert_eq!(str_at(service, "spec.ports.0.name"), "http");
    assert_eq!(at(service, "spec.ports.0.port").as_u64(), Some(8080));
    assert_eq!(str_at(service, "spec.ports.0.targetPort"), "http");
}

#[test]
fn renders_role_in_the_watched_namespace() {
    let docs = render("ops", &["--set", "watchNamespace=apps"]);
    let name = "rel-perspective-operator";
    let found = kinds(&docs);
    assert!(
        !found.contains("ClusterRole") && !found.contains("ClusterRoleBinding"),
        "nothing cluster-scoped when one namespace is watched: {found:?}"
    );
    let role = object(&docs, "Role", name);
    assert_eq!(str_at(role, "metadata.namespace"), "apps");
    assert_grants(role, OPERATOR_RULES);
    let binding = object(&docs, "RoleBinding", name);
    assert_eq!(str_at(binding, "metadata.namespace"), "apps");
    assert_binding(binding, "Role", name, name, "ops");

    // Leader election stays in the release namespace.
    let lease_role = object(&docs, "Role", &format!("{name}-leader-election"));
    assert_eq!(str_at(lease_role, "metadata.namespace"), "ops");
    assert_grants(lease_role, LEASE_RULES);

    let args = args_of(object(&docs, "Deployment", name));
    assert!(args.contains(&"--watch-namespace=apps".into()), "{args:?}");
    assert!(args.contains(&"--lease-namespace=ops".into()), "{args:?}");
}

#[test]
fn renders_options() {
    let docs = render(
        "ops",
        &[
            "--set",
            "replicaCount=1,leaderElection.enabled=false,logFormat=text",
            "--set",
            "image.repository=registry.example/op,image.tag=1.2.3,workerImage=registry.example/w:9",
            "--set",
            "allowedImagePrefixes={registry.example/w:,registry.example/team/}",
            "--set",
            "allowedPriorityClasses={workers-low},allowedServiceAccounts={shop-sa,other-sa}",
            "--set",
            "appArmorRuntimeDefault=true",
            // Large integers must not come out as 1e+06.
            "--set",
            "statusIntervalSeconds=1000000",
            "--set",
            "serviceAccount.create=false,serviceAccount.name=existing,metrics.service.enabled=false",
            "--set",
            "podLabels.team=search,podAnnotations.note=hi,nodeSelector.disk=ssd",
            // A pod label may not steal the selector.
            "--set",
            "podLabels.app\\.kubernetes\\.io/instance=other",
        ],
    );
    let name = "rel-perspective-operator";
    let found = kinds(&docs);
    for absent in ["ServiceAccount", "Service", "Role", "RoleBinding"] {
        assert!(!found.contains(absent), "{absent} rendered: {found:?}");
    }
    assert_binding(
        object(&docs, "ClusterRoleBinding", name),
        "ClusterRole",
        name,
        "existing",
        "ops",
    );
    let deployment = object(&docs, "Deployment", name);
    assert_eq!(at(deployment, "spec.replicas").as_u64(), Some(1));
    let pod = at(deployment, "spec.template");
    assert_eq!(str_at(pod, "spec.serviceAccountName"), "existing");
    assert_eq!(str_at(pod, "metadata.labels.team"), "search");
    assert_eq!(
        at(pod, "metadata.labels").get("app.kubernetes.io/instance"),
        Some(&Value::from("rel"))
    );
    assert_eq!(str_at(pod, "metadata.annotations.note"), "hi");
    assert_eq!(str_at(pod, "spec.nodeSelector.disk"), "ssd");
    assert_eq!(
        str_at(operator_container(deployment), "image"),
        "registry.example/op:1.2.3"
    );
    assert_eq!(
        args_of(deployment),
        [
            "--http-addr=0.0.0.0:8080",
            "--default-worker-image=registry.example/w:9",
            "--allowed-image-prefix=registry.example/w:",
            "--allowed-image-prefix=registry.example/team/",
            "--allowed-priority-class=workers-low",
            "--allowed-service-account=shop-sa",
            "--allowed-service-account=other-sa",
            "--apparmor-runtime-default",
            "--status-interval-seconds=1000000",
            "--log-format=text",
        ]
    );
}

#[test]
fn several_replicas_need_leader_election() {
    let out = output(
        helm()
            .args(["template", "rel"])
            .arg(chart_dir())
            .args(["--set", "leaderElection.enabled=false"]),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs leaderElection.enabled"), "{stderr}");
}

#[test]
fn schema_rejects_bad_values() {
    // (helm flags, text the error must contain: the offending key)
    let cases: &[(&[&str], &str)] = &[
        (&["--set", "replicaCount=abc"], "replicaCount"),
        (&["--set", "replicaCount=-1"], "replicaCount"),
        (&["--set", "logFormat=xml"], "logFormat"),
        (
            &["--set", "statusIntervalSeconds=0"],
            "statusIntervalSeconds",
        ),
        (
            &["--set-string", "statusIntervalSeconds=15"],
            "statusIntervalSeconds",
        ),
        (&["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (&["--set", "leaderElection.enabled=maybe"], "enabled"),
        (
            &["--set", "watchNamespace=Not_A_Namespace"],
            "watchNamespace",
        ),
        (&["--set", "metrics.service.port=70000"], "port"),
        (&["--set", "workerImage="], "workerImage"),
        (&["--set", "podLabels.team=1"], "team"),
        // Typos are errors, not silently ignored keys.
        (&["--set", "replicaCont=1"], "replicaCont"),
        (&["--set", "image.tagg=1"], "tagg"),
        (&["--set", "metrics.service.enable=false"], "enable"),
        (&["--set", "resources.request.cpu=1"], "request"),
        (
            &["--set", "metrics.prometheusRule.lagFor=10 minutes"],
            "lagFor",
        ),
        (
            &["--set", "metrics.prometheusRule.lagThresholdSeconds=0"],
            "lagThresholdSeconds",
        ),
        (
            &["--set", "metrics.prometheusRule.lagThreshold=1"],
            "lagThreshold",
        ),
        (
            &["--set", "metrics.workerPodMonitor.intervall=1m"],
            "intervall",
        ),
        (&["--set", "metrics.grafanaDashboard.label.x=1"], "label"),
    ];
    let mut failures = Vec::new();
    for (flags, key) in cases {
        let out = output(
            helm()
                .args(["template", "rel"])
                .arg(chart_dir())
                .args(*flags),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            failures.push(format!("{flags:?} was accepted"));
        } else if !stderr.contains(key) || !stderr.contains("schema") {
            failures.push(format!("{flags:?} failed without naming {key:?}: {stderr}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// The observability pack: monitors, rules, dashboard (operator/tests/monitoring.rs tests the
// rules and the dashboard's queries with promtool)

/// Every part of the pack enabled.
const PACK: &[&str] = &[
    // As on a cluster with the Prometheus Operator's CRDs (without them the install fails).
    "--api-versions",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PodMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PrometheusRule",
    "--set",
    "metrics.serviceMonitor.enabled=true",
    "--set",
    "metrics.workerPodMonitor.enabled=true",
    "--set",
    "metrics.prometheusRule.enabled=true",
    "--set",
    "metrics.grafanaDashboard.enabled=true",
];
const PACK_KINDS: [&str; 4] = [
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
    "ConfigMap",
];

fn rule<'a>(docs: &'a [Value], alert: &str) -> &'a Value {
    let rules = object(docs, "PrometheusRule", "rel-perspective-operator");
    at(rules, "spec.groups")
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| at(g, "rules").as_sequence().unwrap())
        .find(|r| str_at(r, "alert") == alert)
        .unwrap_or_else(|| panic!("no alert {alert}"))
}

/// Issue 12: the optional NetworkPolicy admits only the operator pods' HTTP port, from the
/// configured peers; off by default.
#[test]
fn renders_the_network_policy_only_when_enabled() {
    assert!(!kinds(&render("ops", &[])).contains("NetworkPolicy"));
    let docs = render(
        "ops",
        &[
            "--set",
            "networkPolicy.enabled=true",
            "--set-json",
            r#"networkPolicy.from=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#,
        ],
    );
    let name = "rel-perspective-operator";
    let policy = object(&docs, "NetworkPolicy", name);
    assert_eq!(str_at(policy, "metadata.namespace"), "ops");
    let deployment = object(&docs, "Deployment", name);
    assert_eq!(
        at(policy, "spec.podSelector.matchLabels"),
        at(deployment, "spec.selector.matchLabels")
    );
    assert_eq!(strings(at(policy, "spec.policyTypes")), ["Ingress"]);
    let rules = at(policy, "spec.ingress").as_sequence().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(str_at(&rules[0], "ports.0.port"), "http");
    assert_eq!(
        str_at(operator_container(deployment), "ports.0.name"),
        "http"
    );
    assert_eq!(
        at(&rules[0], "from.0.namespaceSelector.matchLabels").get("kubernetes.io/metadata.name"),
        Some(&Value::from("monitoring"))
    );
    // Without peers: the port from anywhere.
    let open = render("ops", &["--set", "networkPolicy.enabled=true"]);
    let rule = &at(object(&open, "NetworkPolicy", name), "spec.ingress")
        .as_sequence()
        .unwrap()[0];
    assert!(rule.get("from").is_none(), "{}", to_yaml(rule));
}

#[test]
fn renders_the_monitoring_pack_only_when_enabled() {
    let defaults = kinds(&render("ops", &[]));
    for kind in PACK_KINDS {
        assert!(!defaults.contains(kind), "{kind} rendered by default");
    }

    let docs = render("ops", PACK);
    let name = "rel-perspective-operator";
    // The ServiceMonitor scrapes the operator's metrics Service.
    let monitor = object(&docs, "ServiceMonitor", name);
    let service = object(&docs, "Service", &format!("{name}-metrics"));
    for (key, value) in at(monitor, "spec.selector.matchLabels")
        .as_mapping()
        .unwrap()
    {
        assert_eq!(
            at(service, "metadata.labels").get(key),
            Some(value),
            "{key:?}"
        );
    }
    assert_eq!(
        str_at(monitor, "spec.endpoints.0.port"),
        str_at(service, "spec.ports.0.name")
    );
    assert_eq!(
        strings(at(monitor, "spec.namespaceSelector.matchNames")),
        ["ops"]
    );

    // The PodMonitor finds the workers of every deployment, in every namespace, on the port
    // the operator's pod template names.
    let pods = object(&docs, "PodMonitor", &format!("{name}-workers"));
    let selector: std::collections::BTreeMap<String, String> =
        serde_yaml::from_value(at(pods, "spec.selector.matchLabels").clone()).unwrap();
    assert_eq!(selector, labels::all_workers_selector());
    assert_eq!(at(pods, "spec.namespaceSelector.any"), &Value::Bool(true));
    let spec: PerspectiveDeploymentSpec = serde_yaml::from_str(
        "database: {secretRef: {name: db}}\nschema: s\nperspectives: [{name: p, handlers: {A: SELECT 1}}]",
    )
    .unwrap();
    let template = workers::pod_template("shop", &spec, "w:1", "cm", "c", "m");
    let port = template.spec.unwrap().containers[0].ports.clone().unwrap()[0]
        .name
        .clone()
        .unwrap();
    assert_eq!(str_at(pods, "spec.podMetricsEndpoints.0.port"), port);
    assert_eq!(
        str_at(pods, "spec.podMetricsEndpoints.0.relabelings.0.targetLabel"),
        "deployment"
    );

    // The dashboard, discoverable by Grafana's sidecar.
    let dashboard = object(&docs, "ConfigMap", &format!("{name}-dashboard"));
    assert_eq!(str_at(dashboard, "metadata.labels.grafana_dashboard"), "1");
    let json: serde_json::Value = serde_json::from_str(
        dashboard["data"]["perspective-operator.json"]
            .as_str()
            .unwrap(),
    )
    .expect("the dashboard is JSON");
    assert_eq!(json["uid"], "perspective-workers");

    // Thresholds reach the rules; watching one namespace narrows the PodMonitor.
    let tuned = [
        PACK,
        &[
            "--set",
            "metrics.prometheusRule.lagThresholdSeconds=42",
            "--set",
            "metrics.prometheusRule.lagFor=3m",
            "--set",
            "metrics.prometheusRule.severity=critical",
            "--set",
            "watchNamespace=shop",
        ],
    ]
    .concat();
    let docs = render("ops", &tuned);
    let lagging = rule(&docs, "PerspectiveLagging");
    assert!(
        str_at(lagging, "expr").ends_with("> 42"),
        "{}",
        to_yaml(lagging)
    );
    assert_eq!(str_at(lagging, "for"), "3m");
    assert_eq!(str_at(lagging, "labels.severity"), "critical");
    let pods = object(&docs, "PodMonitor", &format!("{name}-workers"));
    assert_eq!(
        strings(at(pods, "spec.namespaceSelector.matchNames")),
        ["shop"]
    );
}

#[test]
fn service_monitor_needs_the_metrics_service() {
    let out = output(helm().args(["template", "rel"]).arg(chart_dir()).args([
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.service.enabled=false",
    ]));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs metrics.service.enabled"), "{stderr}");
}

/// Issue 27 polish: on a cluster without the Prometheus Operator's CRDs each part of the pack
/// fails the install naming the missing kind and what to do, instead of the API server's "no
/// matches for kind".
#[test]
fn the_monitoring_pack_without_its_crds_fails_with_a_hint() {
    for (key, kind) in [
        ("serviceMonitor", "ServiceMonitor"),
        ("workerPodMonitor", "PodMonitor"),
        ("prometheusRule", "PrometheusRule"),
    ] {
        let out = output(
            helm()
                .args(["template", "rel"])
                .arg(chart_dir())
                .args(["--set", &format!("metrics.{key}.enabled=true")]),
        );
        assert!(!out.status.success(), "{key} rendered without its CRD");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!(
                "metrics.{key}.enabled: this cluster does not serve monitoring.coreos.com/v1 {kind}"
            )) && stderr.contains("Install the Prometheus Operator's CRDs"),
            "{stderr}"
        );
    }
}

/// Every alert links its runbook, `docs/runbooks/<alert>.md`, and that file exists.
#[test]
fn every_alert_has_a_runbook() {
    let docs = render("ops", PACK);
    let rules = object(&docs, "PrometheusRule", "rel-perspective-operator");
    let alerts: Vec<&Value> = at(rules, "spec.groups")
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| at(g, "rules").as_sequence().unwrap())
        .collect();
    assert_eq!(alerts.len(), 6);
    for rule in alerts {
        let alert = str_at(rule, "alert");
        let url = str_at(rule, "annotations.runbook_url");
        assert_eq!(url, format!("docs/runbooks/{alert}.md"));
        let runbook = repo_root().join(url);
        let text = std::fs::read_to_string(&runbook)
            .unwrap_or_else(|e| panic!("{}: {e}", runbook.display()));
        assert!(
            text.starts_with(&format!("# {alert}")),
            "{}",
            runbook.display()
        );
    }
    let moved = render(
        "ops",
        &[
            PACK,
            &[
                "--set",
                "metrics.prometheusRule.runbookBaseUrl=https://git.example/rb/",
            ],
        ]
        .concat(),
    );
    let rules = object(&moved, "PrometheusRule", "rel-perspective-operator");
    assert!(to_yaml(rules).contains("runbook_url: https://git.example/rb/PerspectiveLagging.md"));
}

#[test]
fn chart_crd_is_a_copy_of_the_generated_crd() {
    let generated = repo_root().join("crds/perspectivedeployment.yaml");
    let copy = chart_dir().join("crds/perspectivedeployment.yaml");
    let generated_text = std::fs::read(&generated).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; generate it with `perspective-operator crd`",
            generated.display()
        )
    });
    let copy_text = std::fs::read(&copy).unwrap_or_else(|e| panic!("{}: {e}", copy.display()));
    assert!(
        generated_text == copy_text,
        "charts/{CHART_NAME}/crds/perspectivedeployment.yaml differs from \
         crds/perspectivedeployment.yaml: copy crds/perspectivedeployment.yaml into the chart \
         (cp crds/perspectivedeployment.yaml charts/{CHART_NAME}/crds/)"
    );
}

// ---------------------------------------------------------------------------------------------
// Against the control plane

/// Fails (never skips) without a control plane, saying how to get one.
fn require_cluster() {
    let set = env::var_os("KUBECONFIG").is_some_and(|k| !k.is_empty());
    assert!(
        set,
        "KUBECONFIG is not set: the cluster_* tests need the e2e control plane. Run them with \
         `tests/e2e/with-control-plane.sh cargo test -p perspective-operator --test chart`, or \
         start one with `tests/e2e/control-plane.sh start DIR` and \
         `eval \"$(tests/e2e/control-plane.sh env DIR)\"` first"
    );
}

/// A DNS-label name unique to this test in this run.
fn unique(tag: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .subsec_nanos();
    format!("chart-{tag}-{}-{:x}", std::process::id(), nanos & 0xfffff)
}

/// A helm release and its namespaces; uninstalled and deleted on drop, also when the test
/// fails half-way.
struct Release {
    name: String,
    namespace: String,
    /// Other namespaces this test created.
    extra: Vec<String>,
}

impl Release {
    fn new(tag: &str) -> Self {
        let name = unique(tag);
        let release = Release {
            namespace: name.clone(),
            name,
            extra: Vec::new(),
        };
        create_namespace(&release.namespace);
        // The operator's pods must pass the strictest Pod Security Standard.
        ok(kubectl().args([
            "label",
            "namespace",
            &release.namespace,
            "pod-security.kubernetes.io/enforce=restricted",
        ]));
        release
    }

    fn fullname(&self) -> String {
        format!("{}-{CHART_NAME}", self.name)
    }

    fn sa(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.namespace,
            self.fullname()
        )
    }

    fn install(&self, flags: &[&str]) -> String {
        ok(helm()
            .args(["install", &self.name])
            .arg(chart_dir())
            .args([
                "--namespace",
                &self.namespace,
                "--wait=false",
                "--timeout=2m",
            ])
            .args(flags))
    }

    fn uninstall(&self) {
        ok(helm().args([
            "uninstall",
            &self.name,
            "--namespace",
            &self.namespace,
            "--wait",
            "--timeout=2m",
        ]));
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        // Best effort: the release may already be gone.
        let _ = helm()
            .args([
                "uninstall",
                &self.name,
                "--namespace",
                &self.namespace,
                "--ignore-not-found",
            ])
            .output();
        for ns in std::iter::once(&self.namespace).chain(&self.extra) {
            let _ = kubectl()
                .args([
                    "delete",
                    "namespace",
                    ns,
                    "--ignore-not-found",
                    "--wait=false",
                ])
                .output();
        }
    }
}

fn create_namespace(ns: &str) {
    ok(kubectl().args(["create", "namespace", ns]));
    // Pods are refused until the serviceaccount controller made "default".
    ok(kubectl().args([
        "wait",
        "--for=create",
        "serviceaccount/default",
        "--namespace",
        ns,
        "--timeout=60s",
    ]));
}

/// One access question (what `kubectl auth can-i` asks) and the expected answer.
#[derive(Clone, Debug)]
struct Check {
    verb: String,
    /// The API group ("" for the core group).
    group: String,
    resource: String,
    subresource: Option<String>,
    namespace: Option<String>,
    allowed: bool,
}

impl Check {
    fn new(
        verb: &str,
        group: &str,
        resource: &str,
        namespace: Option<&str>,
        allowed: bool,
    ) -> Self {
        let (resource, subresource) = match resource.split_once('/') {
            Some((r, s)) => (r, Some(s.to_string())),
            None => (resource, None),
        };
        Check {
            verb: verb.into(),
            group: group.into(),
            resource: resource.into(),
            subresource,
            namespace: namespace.map(String::from),
            allowed,
        }
    }
}

/// For every resource in `rules`: the granted verbs allowed, all other verbs denied, in `ns`.
fn rule_checks(rules: &[(&str, &str, &[&str])], ns: &str, granted: bool) -> Vec<Check> {
    let mut out = Vec::new();
    for (group, resource, verbs) in rules {
        for verb in ALL_VERBS {
            out.push(Check::new(
                verb,
                group,
                resource,
                Some(ns),
                granted && verbs.contains(verb),
            ));
        }
    }
    out
}

fn denied_checks(ns: &str) -> Vec<Check> {
    let cluster = CLUSTER_DENIED
        .iter()
        .map(|(verb, group, resource)| Check::new(verb, group, resource, None, false));
    let namespaced = NAMESPACE_DENIED
        .iter()
        .map(|(verb, group, resource)| Check::new(verb, group, resource, Some(ns), false));
    cluster.chain(namespaced).collect()
}

/// The checks whose answer, as `user`, differs from the expected one. Each is a
/// SelfSubjectAccessReview through a client that impersonates `user`: what `kubectl auth can-i
/// --as user` sends, without a kubectl process per question (about 400 a test, which were most
/// of its time and of the CPU `make test` spent in kubectl). Sixteen in flight at a time.
fn mismatches(user: &str, checks: &[Check]) -> Vec<Check> {
    use futures::StreamExt;
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut config = kube::Config::infer()
            .await
            .expect("a kubeconfig (KUBECONFIG)");
        config.auth_info.impersonate = Some(user.to_string());
        config.read_timeout = Some(Duration::from_secs(30));
        let reviews: kube::Api<SelfSubjectAccessReview> =
            kube::Api::all(kube::Client::try_from(config).expect("a client"));
        let answers = futures::stream::iter(checks)
            .map(|check| {
                let reviews = reviews.clone();
                async move {
                    let review = SelfSubjectAccessReview {
                        spec: SelfSubjectAccessReviewSpec {
                            resource_attributes: Some(ResourceAttributes {
                                verb: Some(check.verb.clone()),
                                group: Some(check.group.clone()),
                                resource: Some(check.resource.clone()),
                                subresource: check.subresource.clone(),
                                namespace: check.namespace.clone(),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                        ..Default::default()
                    };
                    let answer = reviews
                        .create(&Default::default(), &review)
                        .await
                        .unwrap_or_else(|e| panic!("access review {check:?} as {user}: {e}"));
                    (check, answer.status.is_some_and(|s| s.allowed))
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        answers
            .into_iter()
            .filter(|(check, allowed)| *allowed != check.allowed)
            .map(|(check, _)| check.clone())
            .collect()
    })
}

/// RBAC changes reach the authorizer through its informers a moment after the write, so the
/// answers are polled until they all match or the deadline passes.
fn assert_permissions(user: &str, checks: &[Check]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut pending = checks.to_vec();
    loop {
        pending = mismatches(user, &pending);
        if pending.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            let lines: Vec<String> = pending
                .iter()
                .map(|c| {
                    format!(
                        "  {} {}{}{} in {}: expected {}",
                        c.verb,
                        c.resource,
                        if c.group.is_empty() {
                            String::new()
                        } else {
                            format!(".{}", c.group)
                        },
                        c.subresource
                            .as_deref()
                            .map(|s| format!("/{s}"))
                            .unwrap_or_default(),
                        c.namespace.as_deref().unwrap_or("(cluster)"),
                        if c.allowed { "yes" } else { "no" }
                    )
                })
                .collect();
            panic!("wrong permissions for {user}:\n{}", lines.join("\n"));
        }
        thread::sleep(Duration::from_millis(200));
    }
}

/// Checks what every installed chart must do in the cluster: CRD established, NOTES shown,
/// Deployment rolled out in a namespace enforcing the restricted Pod Security Standard.
fn assert_installed(release: &Release, notes: &str) {
    assert!(
        notes.contains("--for=condition=Ready pd/") && notes.contains("--from-literal=url="),
        "install notes lack the first steps:\n{notes}"
    );
    ok(kubectl().args([
        "wait",
        "--for=condition=Established",
        &format!("crd/{CRD_NAME}"),
        "--timeout=60s",
    ]));
    // The label is in force: a pod without a restricted securityContext is refused.
    let refused = output(kubectl().args([
        "run",
        "unrestricted",
        "--image=example.invalid/never-pulled:1",
        "--restart=Never",
        "--dry-run=server",
        "--namespace",
        &release.namespace,
    ]));
    assert!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr).contains("PodSecurity"),
        "namespace {} does not enforce the restricted Pod Security Standard",
        release.namespace
    );
    ok(kubectl().args([
        "rollout",
        "status",
        &format!("deployment/{}", release.fullname()),
        "--namespace",
        &release.namespace,
        "--timeout=90s",
    ]));
}

#[test]
fn cluster_install_grants_exactly_the_cluster_wide_rules() {
    require_cluster();
    let release = Release::new("all");
    let ns = release.namespace.as_str();
    // Any other namespace: the ClusterRole applies there too, the lease Role does not. It
    // need not exist for can-i.
    let elsewhere = format!("{ns}-other");

    let notes = release.install(&[]);
    assert_installed(&release, &notes);

    let mut checks = rule_checks(OPERATOR_RULES, ns, true);
    checks.extend(rule_checks(OPERATOR_RULES, &elsewhere, true));
    checks.extend(rule_checks(LEASE_RULES, ns, true));
    checks.extend(rule_checks(LEASE_RULES, &elsewhere, false));
    checks.extend(denied_checks(ns));
    assert_permissions(&release.sa(), &checks);

    release.uninstall();
    let gone = output(kubectl().args(["get", "clusterrole", &release.fullname()]));
    assert!(
        !gone.status.success(),
        "ClusterRole survived helm uninstall"
    );
    let revoked: Vec<Check> = [
        ("get", "", "secrets"),
        ("get", "coordination.k8s.io", "leases"),
    ]
    .iter()
    .map(|(verb, group, resource)| Check::new(verb, group, resource, Some(ns), false))
    .collect();
    assert_permissions(&release.sa(), &revoked);
}

#[test]
fn cluster_install_watching_one_namespace_grants_only_there() {
    require_cluster();
    let mut release = Release::new("one");
    let ns = release.namespace.clone();
    let watched = format!("{ns}-apps");
    // Registered first so that it is deleted even if creating it fails half-way.
    release.extra.push(watched.clone());
    create_namespace(&watched);

    let notes = release.install(&["--set", &format!("watchNamespace={watched}")]);
    assert_installed(&release, &notes);
    let args = ok(kubectl().args([
        "get",
        "deployment",
        &release.fullname(),
        "--namespace",
        &ns,
        "-o",
        "jsonpath={.spec.template.spec.containers[0].args}",
    ]));
    assert!(
        args.contains(&format!("--watch-namespace={watched}")),
        "{args}"
    );

    let mut checks = rule_checks(OPERATOR_RULES, &watched, true);
    // Not even in its own namespace, and nowhere else.
    checks.extend(rule_checks(OPERATOR_RULES, &ns, false));
    checks.extend(rule_checks(OPERATOR_RULES, &format!("{ns}-other"), false));
    checks.extend(rule_checks(LEASE_RULES, &ns, true));
    checks.extend(rule_checks(LEASE_RULES, &watched, false));
    checks.extend(denied_checks(&watched));
    assert_permissions(&release.sa(), &checks);

    release.uninstall();
    let revoked = vec![Check::new(
        "get",
        "",
        "secrets",
        Some(watched.as_str()),
        false,
    )];
    assert_permissions(&release.sa(), &revoked);
}

/// The pack's objects pass the API server's validation against the Prometheus Operator's own
/// CRDs (from its published Go module, written by build-bins.sh next to the binaries).
#[test]
fn cluster_accepts_the_monitoring_pack_in_a_server_side_dry_run() {
    require_cluster();
    let crds = tool("kubectl")
        .parent()
        .unwrap()
        .join("prometheus-operator-crds.yaml");
    assert!(
        crds.is_file(),
        "{} is missing: run tests/e2e/build-bins.sh",
        crds.display()
    );
    ok(kubectl()
        .args(["apply", "--server-side", "--force-conflicts", "-f"])
        .arg(&crds));
    ok(kubectl().args([
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/servicemonitors.monitoring.coreos.com",
        "crd/podmonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
    ]));

    let release = Release::new("mon");
    let ns = release.namespace.as_str();
    let pack: Vec<Value> = render(ns, PACK)
        .into_iter()
        .filter(|d| PACK_KINDS.contains(&str_at(d, "kind")))
        .collect();
    assert_eq!(pack.len(), PACK_KINDS.len(), "{:?}", kinds(&pack));
    let dry_run = |docs: &[Value], file: &str| {
        let path = state_dir().join(format!("{ns}-{file}"));
        std::fs::create_dir_all(state_dir()).unwrap();
        let text: Vec<String> = docs.iter().map(to_yaml).collect();
        std::fs::write(&path, text.join("---\n")).unwrap();
        output(
            kubectl()
                .args([
                    "apply",
                    "--dry-run=server",
                    "--validate=strict",
                    "-n",
                    ns,
                    "-f",
                ])
                .arg(&path),
        )
    };
    let out = dry_run(&pack, "pack.yaml");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.matches("(server dry run)").count(),
        PACK_KINDS.len(),
        "{stdout}"
    );

    // The check can fail: a field the CRD's schema does not know is rejected.
    let mut broken = pack
        .iter()
        .find(|d| str_at(d, "kind") == "PodMonitor")
        .unwrap()
        .clone();
    broken["spec"]["podMetricsEndpoints"][0]["portt"] = Value::from("http");
    let out = dry_run(&[broken], "broken.yaml");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("portt"),
        "{stderr}"
    );
}

/// Issue 27 polish: the chart's README and install notes create the Secret with the key the
/// operator reads by default (`url`), not `DATABASE_URL`.
#[test]
fn the_chart_docs_name_the_secret_key_the_operator_reads() {
    for file in ["README.md", "templates/NOTES.txt"] {
        let text = std::fs::read_to_string(chart_dir().join(file)).unwrap();
        assert!(
            text.contains("--from-literal=url="),
            "{file} creates the Secret with key url"
        );
        assert!(
            !text.contains("DATABASE_URL"),
            "{file} names DATABASE_URL as the Secret key"
        );
    }
}

/// The base64 value at `path` (its last key may hold dots, as `data.tls.crt`), decoded.
fn decoded(v: &Value, path: &str) -> Vec<u8> {
    let text = match path.strip_prefix("data.") {
        Some(key) => at(v, "data").get(key).and_then(Value::as_str),
        None => at(v, path).as_str(),
    }
    .unwrap_or_else(|| panic!("no {path} in:\n{}", to_yaml(v)))
    .to_owned();
    serde_json::from_value::<k8s_openapi::ByteString>(serde_json::Value::String(text))
        .unwrap_or_else(|e| panic!("{path} is not base64: {e}"))
        .0
}

/// Issue 27, admission-time validation: the chart's webhook (off by default) is a
/// ValidatingWebhookConfiguration for PerspectiveDeployments calling the operator pods through
/// a Service, with a caBundle that verifies the certificate the pods mount for the Service's
/// name, which the operator can load.
#[test]
fn renders_the_admission_webhook_with_a_certificate_its_ca_bundle_trusts() {
    use std::sync::Arc;
    use tokio_rustls::rustls::client::danger::ServerCertVerifier;
    use tokio_rustls::rustls::client::WebPkiServerVerifier;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use tokio_rustls::rustls::RootCertStore;

    assert!(!kinds(&render("ops", &[])).contains("ValidatingWebhookConfiguration"));
    let docs = render(
        "ops",
        &[
            "--set",
            "webhook.enabled=true",
            "--set",
            "watchNamespace=shop",
            "--set",
            "networkPolicy.enabled=true",
        ],
    );
    let name = "rel-perspective-operator";
    let config = object(
        &docs,
        "ValidatingWebhookConfiguration",
        &format!("ops-{name}"),
    );
    let hook = at(config, "webhooks.0");
    assert_eq!(str_at(hook, "name"), "validate.perspectives.dev");
    assert_eq!(str_at(hook, "failurePolicy"), "Fail");
    assert_eq!(str_at(hook, "sideEffects"), "None");
    assert_eq!(strings(at(hook, "admissionReviewVersions")), ["v1"]);
    assert_eq!(
        strings(at(hook, "rules.0.resources")),
        ["perspectivedeployments"]
    );
    assert_eq!(
        strings(at(hook, "rules.0.operations")),
        ["CREATE", "UPDATE"]
    );
    assert_eq!(
        at(hook, "namespaceSelector.matchLabels").get("kubernetes.io/metadata.name"),
        Some(&Value::from("shop"))
    );
    let service = format!("{name}-webhook");
    assert_eq!(str_at(hook, "clientConfig.service.name"), service);
    assert_eq!(str_at(hook, "clientConfig.service.namespace"), "ops");
    assert_eq!(
        str_at(hook, "clientConfig.service.path"),
        "/validate-perspectivedeployment"
    );
    let svc = object(&docs, "Service", &service);
    assert_eq!(str_at(svc, "spec.ports.0.targetPort"), "webhook");
    let deployment = object(&docs, "Deployment", name);
    let args = args_of(deployment);
    assert!(
        args.contains(&"--webhook-addr=0.0.0.0:9443".to_owned()),
        "{args:?}"
    );
    let dir = "/etc/perspective-operator/webhook";
    assert!(
        args.contains(&format!("--webhook-cert-dir={dir}")),
        "{args:?}"
    );
    let container = operator_container(deployment);
    assert_eq!(str_at(container, "ports.1.name"), "webhook");
    assert_eq!(str_at(container, "volumeMounts.0.mountPath"), dir);
    let secret_name = format!("{name}-webhook-tls");
    assert_eq!(
        str_at(deployment, "spec.template.spec.volumes.0.secret.secretName"),
        secret_name
    );
    let rules = at(object(&docs, "NetworkPolicy", name), "spec.ingress");
    assert_eq!(str_at(rules, "1.ports.0.port"), "webhook");

    // The caBundle verifies the mounted certificate for the Service's DNS name.
    let secret = object(&docs, "Secret", &secret_name);
    assert_eq!(str_at(secret, "type"), "kubernetes.io/tls");
    let ca = decoded(hook, "clientConfig.caBundle");
    assert_eq!(ca, decoded(secret, "data.ca.crt"));
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(&ca).unwrap())
        .unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .unwrap();
    let crt = decoded(secret, "data.tls.crt");
    let serving = CertificateDer::from_pem_slice(&crt).unwrap();
    for host in [format!("{service}.ops.svc"), format!("{service}.ops")] {
        verifier
            .verify_server_cert(
                &serving,
                &[],
                &ServerName::try_from(host.clone()).unwrap(),
                &[],
                UnixTime::now(),
            )
            .unwrap_or_else(|e| panic!("{host}: {e}"));
    }
    // The operator loads what the pods mount.
    let mounted = tempdir("webhook-tls");
    std::fs::write(mounted.join("tls.crt"), crt).unwrap();
    std::fs::write(mounted.join("tls.key"), decoded(secret, "data.tls.key")).unwrap();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(perspective_operator::webhook::tls::Certificate::load(
            &mounted,
        ))
        .expect("the operator loads the chart's certificate");
}

/// A fresh directory under the system's temp dir.
fn tempdir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("chart-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Issue 27: installed, the webhook's objects are accepted by the API server, and an upgrade
/// keeps the generated CA and certificate (lookup), so the `caBundle` never changes under the
/// pods' mounted certificate. Scoped to the release's own namespace (`watchNamespace`), so the
/// other tests' deployments never reach this webhook.
#[test]
fn cluster_webhook_certificate_survives_an_upgrade() {
    require_cluster();
    let release = Release::new("hook");
    let ns = release.namespace.as_str();
    let flags = [
        "--set".to_owned(),
        "webhook.enabled=true".to_owned(),
        "--set".to_owned(),
        format!("watchNamespace={ns}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    release.install(&flags);
    let config = format!("{ns}-{}", release.fullname());
    let secret = format!("{}-webhook-tls", release.fullname());
    let bundle = || {
        ok(kubectl().args([
            "get",
            "validatingwebhookconfiguration",
            &config,
            "-o",
            "jsonpath={.webhooks[0].clientConfig.caBundle}",
        ]))
    };
    let stored_ca = || {
        ok(kubectl().args([
            "-n",
            ns,
            "get",
            "secret",
            &secret,
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ]))
    };
    let first = bundle();
    assert!(
        !first.trim().is_empty(),
        "no caBundle: {}",
        ok(kubectl().args([
            "get",
            "validatingwebhookconfiguration",
            &config,
            "-o",
            "yaml"
        ]))
    );
    assert_eq!(first, stored_ca());
    ok(helm()
        .args(["upgrade", &release.name])
        .arg(chart_dir())
        .args(["--namespace", ns, "--wait=false", "--timeout=2m"])
        .args(&flags));
    assert_eq!(bundle(), first, "the upgrade replaced the CA");
    assert_eq!(stored_ca(), first);
    release.uninstall();
    let gone = output(kubectl().args(["get", "validatingwebhookconfiguration", &config]));
    assert!(
        !gone.status.success(),
        "the webhook configuration outlived the release"
    );
}
