//! The committed CRD (`crds/`) and the chart's copy are exactly what the Rust types generate.

use std::path::Path;

use perspective_operator::crd::crd_yaml;

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
        serde_json::json!(["Live", "Backfilling", "Rebuilding"])
    );
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
