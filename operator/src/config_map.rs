//! The ConfigMap holding the worker config rendered from the spec.
//!
//! Its name carries the config hash: a changed config is a new ConfigMap, so pods still running
//! the previous template (for example while a migration Job runs) keep reading the config they
//! were migrated for, and the new hash in the pod template rolls the pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use perspective_worker::config::Config;
use sha2::{Digest, Sha256};

use crate::labels;

/// File name of the config inside the ConfigMap and the pods.
pub const CONFIG_FILE: &str = "config.yaml";
/// Where pods mount the ConfigMap.
pub const CONFIG_DIR: &str = "/etc/perspective";

/// The config as the worker reads it, and its SHA-256 (hex).
pub fn render(config: &Config) -> (String, String) {
    let yaml = serde_yaml::to_string(config).expect("a config serializes");
    let hash = hex::encode(Sha256::digest(yaml.as_bytes()));
    (yaml, hash)
}

/// The desired ConfigMap for deployment `instance`.
pub fn build(instance: &str, namespace: &str, config: &Config) -> ConfigMap {
    let (yaml, hash) = render(config);
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(labels::config_map_name(instance, &hash)),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels::labels(instance, labels::CONFIG)),
            annotations: Some(BTreeMap::from([(labels::CONFIG_HASH.to_owned(), hash)])),
            ..ObjectMeta::default()
        },
        // Immutable: a changed config is a new ConfigMap, never an edit of a mounted one.
        immutable: Some(true),
        data: Some(BTreeMap::from([(CONFIG_FILE.to_owned(), yaml)])),
        ..ConfigMap::default()
    }
}
