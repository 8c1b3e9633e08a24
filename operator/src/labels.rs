//! Names and labels of the objects a `PerspectiveDeployment` owns.
//!
//! Every child carries `app.kubernetes.io/instance=<pd name>` and a `component`, so the
//! operator finds its children (and garbage) with label selectors instead of name guessing.

use std::collections::BTreeMap;

/// Field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "perspective-operator";
/// Label keys.
pub const NAME: &str = "app.kubernetes.io/name";
pub const INSTANCE: &str = "app.kubernetes.io/instance";
pub const COMPONENT: &str = "app.kubernetes.io/component";
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Annotations on children.
pub const CONFIG_HASH: &str = "perspectives.dev/config-hash";
pub const MIGRATION_HASH: &str = "perspectives.dev/migration-hash";
/// Annotations on a deployment asking for a day-2 action (see the action Job module): the value is a
/// perspective, or `all` for the dead-letter and switch actions. The operator removes each once done.
pub const REPLAY_DEAD_LETTERS: &str = "perspectives.dev/replay-dead-letters";
pub const DISCARD_DEAD_LETTERS: &str = "perspectives.dev/discard-dead-letters";
pub const REBUILD: &str = "perspectives.dev/rebuild";
/// Day-2 action: the blue/green switch of a perspective (or `all`) as the owner role.
pub const SWITCH: &str = "perspectives.dev/switch";
/// Annotations on an action Job: the deployment's annotation it carries out, its value, and
/// that its outcome was reported.
pub const ACTION: &str = "perspectives.dev/action";
/// On an action Job the operator started without an annotation (a switch for workers whose role
/// may not make it).
pub const ACTION_BY_OPERATOR: &str = "perspectives.dev/action-by-operator";
pub const ACTION_TARGET: &str = "perspectives.dev/action-target";
pub const ACTION_REPORTED: &str = "perspectives.dev/action-reported";

/// The longest `PerspectiveDeployment` name: child names append up to 23 characters
/// (`-migrate-` plus a 12-character hash) and must stay valid label values (63).
pub const MAX_NAME_LEN: usize = 40;

/// Components (values of `app.kubernetes.io/component`).
pub const WORKER: &str = "worker";
pub const MIGRATION: &str = "migration";
pub const CONFIG: &str = "config";
pub const ACTION_JOB: &str = "action";

/// Labels of one component of deployment `instance`.
pub fn labels(instance: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME.to_owned(), "perspective-worker".to_owned()),
        (INSTANCE.to_owned(), instance.to_owned()),
        (COMPONENT.to_owned(), component.to_owned()),
        (MANAGED_BY.to_owned(), FIELD_MANAGER.to_owned()),
    ])
}

/// The immutable selector of the worker pods (a subset of their labels).
pub fn worker_selector(instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (INSTANCE.to_owned(), instance.to_owned()),
        (COMPONENT.to_owned(), WORKER.to_owned()),
    ])
}

/// The labels every worker pod of every deployment carries and no other pod does (migration
/// pods are `component=migration`): the chart's worker PodMonitor selects on exactly these, so
/// one monitor finds the workers of all deployments.
pub fn all_workers_selector() -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME.to_owned(), "perspective-worker".to_owned()),
        (COMPONENT.to_owned(), WORKER.to_owned()),
    ])
}

/// `key=value,...` form of a label map, for list calls and the scale subresource.
pub fn selector_string(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Selector of all children of `instance` with `component`.
pub fn component_selector(instance: &str, component: &str) -> String {
    format!("{INSTANCE}={instance},{COMPONENT}={component},{MANAGED_BY}={FIELD_MANAGER}")
}

/// Name of the worker StatefulSet and PodDisruptionBudget.
pub fn workers_name(instance: &str) -> String {
    instance.to_owned()
}

/// Name of the headless Service of the worker pods.
pub fn service_name(instance: &str) -> String {
    format!("{instance}-workers")
}

/// Name of the ConfigMap holding the config with hash `config_hash`.
pub fn config_map_name(instance: &str, config_hash: &str) -> String {
    format!("{instance}-config-{}", &config_hash[..12])
}

/// Name of the migration Job for migration target `migration_hash`.
pub fn migration_job_name(instance: &str, migration_hash: &str) -> String {
    format!("{instance}-migrate-{}", &migration_hash[..12])
}

/// Name of an action Job: `verb` (`replay`, `discard`, `rebuild`) and a 12-character id.
pub fn action_job_name(instance: &str, verb: &str, id: &str) -> String {
    format!("{instance}-{verb}-{}", &id[..12])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_children_names_are_valid_label_values() {
        let name = "a".repeat(MAX_NAME_LEN);
        let hash = "0123456789abcdef".repeat(4);
        assert!(migration_job_name(&name, &hash).len() <= 63);
        assert!(config_map_name(&name, &hash).len() <= 63);
        for verb in ["replay", "discard", "rebuild"] {
            assert!(action_job_name(&name, verb, &hash).len() <= 63);
        }
        // StatefulSet pods get `controller-revision-hash: <sts>-<10 chars>`.
        assert!(workers_name(&name).len() + 11 <= 63);
    }
}
