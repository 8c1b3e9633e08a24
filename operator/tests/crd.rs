//! The committed CRD (`crds/`) and the chart's copy are exactly what the Rust types generate.

use std::path::Path;

use kube::CustomResourceExt;
use perspective_operator::crd::{crd_yaml, PerspectiveDeployment};
use serde_json::Value;

fn repo_file(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

#[test]
fn committed_crd_matches_the_rust_types() {
    let committed = repo_file("crds/perspectivedeployment.yaml");
    assert!(
        committed == crd_yaml(),
        "crds/perspectivedeployment.yaml is out of date with operator/src/crd.rs: \
         run `cargo run -p perspective-operator -- crd > crds/perspectivedeployment.yaml` \
         and copy it to charts/perspective-operator/crds/"
    );
}

#[test]
fn crd_schema_is_structural() {
    let crd: serde_json::Value = serde_yaml::from_str(&crd_yaml()).unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut problems = Vec::new();
    walk(schema, "openAPIV3Schema", &mut problems);
    assert!(
        problems.is_empty(),
        "non-structural schema parts: {problems:#?}"
    );
    let version = &crd["spec"]["versions"][0];
    assert_eq!(crd["spec"]["names"]["shortNames"][0], "pd");
    assert!(version["subresources"]["status"].is_object());
    assert_eq!(
        version["subresources"]["scale"]["specReplicasPath"],
        ".spec.replicas"
    );
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for wanted in ["Ready", "Replicas", "Lag", "Phase", "DeadLetters", "Age"] {
        assert!(
            columns.contains(&wanted),
            "printer column {wanted} missing: {columns:?}"
        );
    }
    // Bounds the Rust types declare reach the API server (schemars writes some as floats).
    let perspective = &schema["properties"]["spec"]["properties"]["perspectives"]["items"];
    assert_eq!(perspective["properties"]["version"]["minimum"], 1);
    assert_eq!(perspective["properties"]["version"]["default"], 1);
    let status_perspective = &schema["properties"]["status"]["properties"]["perspectives"]["items"];
    assert_eq!(
        status_perspective["properties"]["phase"]["enum"],
        serde_json::json!(["Live", "Backfilling", "Rebuilding", "Building", "Switching"])
    );
    assert!(status_perspective["properties"]["nextVersion"].is_object());
    assert!(status_perspective["properties"]["progress"]["properties"]["etaSeconds"].is_object());
    let conditions = &schema["properties"]["status"]["properties"]["conditions"];
    assert_eq!(conditions["x-kubernetes-list-type"], "map");
    assert_eq!(conditions["x-kubernetes-list-map-keys"][0], "type");
}

/// Structural-schema rules the API server enforces, checked here so a violation names its path.
fn walk(schema: &serde_json::Value, path: &str, problems: &mut Vec<String>) {
    let Some(map) = schema.as_object() else {
        return;
    };
    for forbidden in ["anyOf", "oneOf", "allOf", "not", "$ref"] {
        if map.contains_key(forbidden) {
            problems.push(format!("{path}: has {forbidden}"));
        }
    }
    let typed = map.contains_key("type")
        || map.contains_key("x-kubernetes-int-or-string")
        || map.contains_key("x-kubernetes-preserve-unknown-fields");
    if !typed {
        problems.push(format!("{path}: no type"));
    }
    if map.get("additionalProperties") == Some(&serde_json::Value::Bool(false)) {
        problems.push(format!("{path}: additionalProperties: false"));
    }
    if let Some(format) = map.get("format").and_then(|f| f.as_str()) {
        if format.starts_with("uint") {
            problems.push(format!("{path}: format {format} unknown to the API server"));
        }
    }
    if let Some(props) = map.get("properties").and_then(|p| p.as_object()) {
        for (name, sub) in props {
            walk(sub, &format!("{path}.{name}"), problems);
        }
    }
    if let Some(items) = map.get("items") {
        walk(items, &format!("{path}[]"), problems);
    }
    if let Some(extra) = map.get("additionalProperties").filter(|v| v.is_object()) {
        walk(extra, &format!("{path}{{}}"), problems);
    }
}

#[test]
fn example_deployment_is_valid_and_matches_the_worker_example() {
    let example: perspective_operator::crd::PerspectiveDeployment =
        serde_yaml::from_str(&repo_file("examples/shop-deployment.yaml"))
            .expect("examples/shop-deployment.yaml parses as a PerspectiveDeployment");
    let problems = perspective_operator::validate::problems("shop", &example.spec);
    assert!(problems.is_empty(), "{problems:#?}");
    let worker = perspective_worker::config::Config::from_yaml_str(
        &repo_file("examples/shop.yaml"),
        "examples/shop.yaml",
    )
    .unwrap();
    assert_eq!(
        example.spec.worker_config(),
        worker,
        "the example's spec drifted from examples/shop.yaml"
    );
}

/// Issue 13: every bound the Rust types declare (schemars `range` attributes, unsigned and
/// 32-bit types) reaches the generated CRD as an integer, so the API server enforces it: a lost
/// bound (`backoffLimit: -1` accepted, then every Job apply refused) fails here.
#[test]
fn every_declared_integer_bound_is_in_the_crd() {
    let raw = serde_json::to_value(PerspectiveDeployment::crd()).unwrap();
    let raw = &raw["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let generated: Value = serde_yaml::from_str(&crd_yaml()).unwrap();
    let generated = &generated["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut checked = Vec::new();
    let mut problems = Vec::new();
    compare_bounds(raw, generated, "", &mut checked, &mut problems);
    assert!(problems.is_empty(), "bounds lost or wrong: {problems:#?}");

    // The bounds the issue found lost, and a sample of the worker's options, by name: this
    // fails too if an attribute is dropped from the Rust types.
    let declared = [
        (".spec.replicas", Some(0), Some(i64::from(i32::MAX))),
        (
            ".spec.migrations.backoffLimit",
            Some(0),
            Some(i64::from(i32::MAX)),
        ),
        (".spec.migrations.activeDeadlineSeconds", Some(1), None),
        (".spec.terminationGracePeriodSeconds", Some(1), None),
        (
            ".spec.perspectives[].version",
            Some(1),
            Some(i64::from(u32::MAX)),
        ),
        // Issue 26, finding 6: every numeric option has an upper bound of its own.
        (".spec.worker.perspectiveBatchSize", Some(1), Some(10_000)),
        (
            ".spec.worker.maxConcurrentDrainConsumers",
            Some(1),
            Some(64),
        ),
        (
            ".spec.worker.heartbeatIntervalSeconds",
            Some(1),
            Some(3_600),
        ),
        (
            ".spec.worker.failureRetryBaseMilliseconds",
            Some(1),
            Some(86_400_000),
        ),
        (
            ".spec.worker.retryOptions.maxBackoffSeconds",
            Some(0),
            Some(86_400),
        ),
        (
            ".spec.claimWorker.pollingIntervalMilliseconds",
            Some(1),
            Some(3_600_000),
        ),
    ];
    for (path, min, max) in declared {
        let found = checked
            .iter()
            .find(|(p, _, _)| p == path)
            .unwrap_or_else(|| panic!("{path}: no bounded integer there"));
        assert_eq!((found.1, found.2), (min, max), "{path}");
    }
}

/// Walks `raw` (schemars' output) and `generated` (the CRD) side by side: at each integer, the
/// generated bounds are the declared ones narrowed to the type's range, written as integers.
fn compare_bounds(
    raw: &Value,
    generated: &Value,
    path: &str,
    checked: &mut Vec<(String, Option<i64>, Option<i64>)>,
    problems: &mut Vec<String>,
) {
    if generated.is_null() {
        problems.push(format!("{path}: missing from the CRD"));
        return;
    }
    if raw["type"] == "integer" {
        let (type_min, type_max) = match raw["format"].as_str() {
            Some("int32") => (Some(i64::from(i32::MIN)), Some(i64::from(i32::MAX))),
            Some("uint32") => (Some(0), Some(i64::from(u32::MAX))),
            Some("uint64") | Some("uint") => (Some(0), Some((1 << 53) - 1)),
            _ => (None, None),
        };
        let declared = |key: &str| raw[key].as_f64().map(|b| b as i64);
        let want_min = max_opt(declared("minimum"), type_min);
        let want_max = min_opt(declared("maximum"), type_max);
        let mut got = [None, None];
        for (i, (key, want)) in [("minimum", want_min), ("maximum", want_max)]
            .into_iter()
            .enumerate()
        {
            let value = &generated[key];
            if !(value.is_null() || value.is_i64() || value.is_u64()) {
                problems.push(format!(
                    "{path}.{key}: {value} is not written as an integer"
                ));
            }
            got[i] = value.as_i64();
            if got[i] != want {
                problems.push(format!("{path}.{key}: {:?}, declared {want:?}", got[i]));
            }
        }
        if want_min.is_some() || want_max.is_some() {
            checked.push((path.to_owned(), got[0], got[1]));
        }
    }
    if let Some(props) = raw["properties"].as_object() {
        for (name, sub) in props {
            let sub_path = format!("{path}.{name}");
            compare_bounds(
                sub,
                &generated["properties"][name],
                &sub_path,
                checked,
                problems,
            );
        }
    }
    if raw["items"].is_object() {
        compare_bounds(
            &raw["items"],
            &generated["items"],
            &format!("{path}[]"),
            checked,
            problems,
        );
    }
    if raw["additionalProperties"].is_object() {
        compare_bounds(
            &raw["additionalProperties"],
            &generated["additionalProperties"],
            &format!("{path}{{}}"),
            checked,
            problems,
        );
    }
}

fn max_opt(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

fn min_opt(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Issue 26, finding 3: every list, map and string an author can make large is bounded in the
/// CRD (the API server refuses more), and a CEL rule bounds the perspectives' text in total.
/// (The memory of an operator facing many maximum-size deployments is not measured here: too
/// slow for `make test`.)
#[test]
fn finding_3_the_crd_bounds_the_size_of_a_deployment() {
    use perspective_operator::crd::{
        MAX_HANDLERS, MAX_PERSPECTIVES, MAX_PERSPECTIVES_TEXT, MAX_POD_ENTRIES, MAX_SQL_LEN,
    };
    let crd: Value = serde_yaml::from_str(&crd_yaml()).unwrap();
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let field = |name: &str| &spec["properties"][name];
    let perspective = &field("perspectives")["items"]["properties"];
    assert_eq!(field("perspectives")["maxItems"], MAX_PERSPECTIVES);
    assert_eq!(perspective["setup"]["maxLength"], MAX_SQL_LEN);
    assert_eq!(perspective["reset"]["maxLength"], MAX_SQL_LEN);
    assert_eq!(perspective["handlers"]["maxProperties"], MAX_HANDLERS);
    assert_eq!(
        perspective["handlers"]["additionalProperties"]["maxLength"],
        MAX_SQL_LEN
    );
    assert_eq!(perspective["sequencingKey"]["maxLength"], 4096);
    for list in ["tolerations", "imagePullSecrets"] {
        assert_eq!(field(list)["maxItems"], MAX_POD_ENTRIES, "{list}");
    }
    for map in ["nodeSelector", "podAnnotations"] {
        assert_eq!(field(map)["maxProperties"], MAX_POD_ENTRIES, "{map}");
        assert_eq!(
            field(map)["additionalProperties"]["maxLength"],
            4096,
            "{map}"
        );
    }
    assert_eq!(field("image")["maxLength"], 1024);
    assert_eq!(field("priorityClassName")["maxLength"], 253);
    assert_eq!(field("serviceAccountName")["maxLength"], 253);
    let rule = spec["x-kubernetes-validations"][0]["rule"]
        .as_str()
        .unwrap();
    assert!(
        rule.ends_with(&format!("<= {MAX_PERSPECTIVES_TEXT}")),
        "the CEL rule's bound is MAX_PERSPECTIVES_TEXT: {rule}"
    );
    // A quarter of the worker's config limit: the rendered config always loads.
    assert!(
        MAX_PERSPECTIVES_TEXT as usize * 4
            <= perspective_worker::config::yaml_limits::MAX_CONFIG_BYTES
    );
}

/// Issue 27 polish: `kubectl explain pd` opens with what the resource is (not kube's
/// "Auto-generated derived type…"), and `kubectl get pd -o wide` adds the image, the migration
/// and the workers.
#[test]
fn explain_describes_the_resource_and_wide_output_adds_columns() {
    let crd: Value = serde_yaml::from_str(&crd_yaml()).unwrap();
    let version = &crd["spec"]["versions"][0];
    let description = version["schema"]["openAPIV3Schema"]["description"]
        .as_str()
        .unwrap();
    assert!(
        description.starts_with("A set of perspectives (read models)"),
        "{description}"
    );
    let wide: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["priority"].as_i64() == Some(1))
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        wide,
        ["Image", "Migration", "Migrated", "Workers", "Database"]
    );
    let _ = PerspectiveDeployment::crd();
}

/// `docs/reference/crd.md` is what the types generate: a changed field description, bound or
/// default without regenerating it fails here.
#[test]
fn committed_reference_matches_the_rust_types() {
    let committed = repo_file("docs/reference/crd.md");
    assert!(
        committed == perspective_operator::reference::crd_reference(),
        "docs/reference/crd.md is out of date with operator/src/crd.rs: run \
         `cargo run -p perspective-operator -- crd-reference > docs/reference/crd.md`"
    );
}
