//! The `PerspectiveDeployment` custom resource (`perspectives.dev/v1alpha1`, short name `pd`).
//!
//! The spec embeds the worker's own config types (`schema`, `perspectives`, `worker`,
//! `claimWorker` are the fields of [`perspective_worker::config::Config`]), so the CRD and the
//! worker's YAML can never drift apart; the rest of the spec says how to run the workers.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, ResourceRequirements, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::core::crd::merge_crds;
use kube::{CustomResource, CustomResourceExt};
use perspective_worker::config::{
    ClaimWorkerOptions, Config, PerspectiveConfig, WorkerOptions, SCHEMA_PATTERN,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the CRD.
pub const GROUP: &str = "perspectives.dev";

/// At most this many perspectives in one deployment.
pub const MAX_PERSPECTIVES: u32 = 100;
/// At most this many handlers in one perspective.
pub const MAX_HANDLERS: u32 = 100;
/// At most this many characters in one `setup`, `reset` or handler.
pub const MAX_SQL_LEN: u32 = 65_536;
/// At most this many characters in all perspectives' `setup`, `reset`, handlers and event
/// types together: a quarter of the worker's 1 MiB config limit, so that the rendered config
/// always loads, and a bound on what the operator caches per deployment.
pub const MAX_PERSPECTIVES_TEXT: u32 = 262_144;
/// At most this many entries in `nodeSelector`, `podAnnotations`, `tolerations` and
/// `imagePullSecrets`.
pub const MAX_POD_ENTRIES: u32 = 64;

/// The CEL rule bounding [`MAX_PERSPECTIVES_TEXT`] (`sum()` is Kubernetes' list library).
const TEXT_RULE: &str = "self.perspectives.map(p, (has(p.setup) ? size(p.setup) : 0) + \
     (has(p.reset) ? size(p.reset) : 0) + p.handlers.map(k, size(k) + size(p.handlers[k])).sum())\
     .sum() <= 262144";

/// CEL: perspective names are unique (the worker's check, at `kubectl apply`).
const UNIQUE_NAMES_RULE: &str =
    "self.perspectives.all(p, self.perspectives.exists_one(q, q.name == p.name))";
// (A messageExpression naming the duplicate exceeds the API server's CEL cost budget.)

/// CEL rules of one perspective: the worker's `sequencingKey` checks that need no SQL parser
/// (the webhook runs the rest), worded as the worker words them.
fn perspective_rules() -> serde_json::Value {
    serde_json::json!([{
        "rule": "!has(self.sequencing) || self.sequencing != 'key' || has(self.sequencingKey)",
        "message": "sequencing: key needs a sequencingKey, an SQL expression over the event's \
                    parameters (e.g. :data->>'customer')",
        "fieldPath": ".sequencingKey",
    }, {
        "rule": "!has(self.sequencingKey) || (has(self.sequencing) && self.sequencing == 'key')",
        "message": "sequencingKey is used only with sequencing: key",
        "messageExpression": "'sequencingKey is used only with sequencing: key (this perspective \
                              has sequencing: ' + (has(self.sequencing) ? self.sequencing : \
                              'stream') + ')'",
        "fieldPath": ".sequencingKey",
    }])
}

// Every list, map and string of the spec is bounded (issue 26, finding 3): the operator caches
// every deployment whole, so one namespace's many large objects must not exhaust it.
/// Desired state of a perspective deployment: the worker config plus how to run it.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "perspectives.dev",
    version = "v1alpha1",
    kind = "PerspectiveDeployment",
    plural = "perspectivedeployments",
    shortname = "pd",
    category = "all",
    namespaced,
    status = "PerspectiveDeploymentStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.summary"}"#,
    printcolumn = r#"{"name":"Replicas","type":"string","jsonPath":".status.replicasSummary"}"#,
    printcolumn = r#"{"name":"Pending","type":"integer","jsonPath":".status.pendingEvents"}"#,
    printcolumn = r#"{"name":"Lag","type":"string","jsonPath":".status.lag"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"DeadLetters","type":"integer","jsonPath":".status.deadLetters"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Image","type":"string","priority":1,"jsonPath":".status.image"}"#,
    printcolumn = r#"{"name":"Migration","type":"string","priority":1,"jsonPath":".status.migrationJob"}"#,
    printcolumn = r#"{"name":"Migrated","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"MigrationsApplied\")].status"}"#,
    printcolumn = r#"{"name":"Workers","type":"integer","priority":1,"jsonPath":".status.liveInstances"}"#,
    printcolumn = r#"{"name":"Database","type":"string","priority":1,"jsonPath":".status.database"}"#,
    doc = "A set of perspectives (read models) materialized from a PostgreSQL event store, and the \
           workers that keep them up to date: the operator runs a migration Job for each new spec, \
           then a StatefulSet of perspective workers. Status: Ready (the workers apply events), \
           Progressing, Degraded, MigrationsApplied."
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": TEXT_RULE,
    "message": "spec.perspectives: setup, reset, handlers and event types total more than 262144 characters",
    "fieldPath": ".perspectives",
}, {
    "rule": UNIQUE_NAMES_RULE,
    "message": "duplicate perspective name: each perspective needs a name of its own",
    "fieldPath": ".perspectives",
}]))]
pub struct PerspectiveDeploymentSpec {
    /// PostgreSQL schema holding this deployment's event store, work tables and models (lower-case, at most 40 characters).
    #[schemars(pattern(SCHEMA_PATTERN))]
    pub schema: String,
    /// The perspectives (read models) to keep up to date; at least one.
    #[schemars(length(min = 1, max = MAX_PERSPECTIVES), transform = bound_perspective)]
    pub perspectives: Vec<PerspectiveConfig>,
    /// Tuning of the perspective worker that applies events; every field has a default.
    #[serde(default)]
    pub worker: WorkerOptions,
    /// Tuning of the claim worker that polls for new work; every field has a default.
    #[serde(default)]
    pub claim_worker: ClaimWorkerOptions,

    /// Worker image (runs `perspective-worker`); defaults to the operator's --default-worker-image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub image: Option<String>,
    /// Image pull policy of the worker and migration containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Secrets for pulling the worker image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_POD_ENTRIES))]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
    /// Number of worker pods (default 1); `kubectl scale pd/NAME --replicas=N` sets it.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0))]
    pub replicas: i32,
    /// Stop changing the deployment's children (ConfigMap, Job, StatefulSet...); status is still reported.
    #[serde(default)]
    pub paused: bool,
    /// Where the database is: a Secret holding the PostgreSQL URL (never the URL itself).
    pub database: DatabaseSpec,
    /// How the migration Job runs.
    #[serde(default)]
    pub migrations: MigrationsSpec,
    /// Compute resources of each worker container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Node selector of the worker and migration pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = MAX_POD_ENTRIES), transform = bound_values)]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Tolerations of the worker and migration pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_POD_ENTRIES))]
    pub tolerations: Option<Vec<Toleration>>,
    /// Affinity of the worker pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Priority class of the worker pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub priority_class_name: Option<String>,
    /// Service account of the worker and migration pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub service_account_name: Option<String>,
    /// Extra annotations on the worker pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = MAX_POD_ENTRIES), transform = bound_values)]
    pub pod_annotations: Option<BTreeMap<String, String>>,
    /// Seconds a worker gets after SIGTERM to finish in-flight work and deregister (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub termination_grace_period_seconds: Option<i64>,
}

/// Bounds the worker's perspective type where the deployment embeds it: the length of
/// `setup`, `reset` and each handler, and the number of handlers; adds its CEL rules.
fn bound_perspective(schema: &mut schemars::Schema) {
    let Some(items) = schema
        .get_mut("items")
        .and_then(serde_json::Value::as_object_mut)
    else {
        return;
    };
    items.insert("x-kubernetes-validations".into(), perspective_rules());
    let Some(fields) = items
        .get_mut("properties")
        .and_then(serde_json::Value::as_object_mut)
    else {
        return;
    };
    // The pattern allows 63 characters; CEL's cost estimate needs the bound spelled out.
    if let Some(name) = fields
        .get_mut("name")
        .and_then(serde_json::Value::as_object_mut)
    {
        name.insert("maxLength".into(), 63.into());
    }
    for sql in ["setup", "reset"] {
        if let Some(field) = fields
            .get_mut(sql)
            .and_then(serde_json::Value::as_object_mut)
        {
            field.insert("maxLength".into(), MAX_SQL_LEN.into());
        }
    }
    if let Some(handlers) = fields
        .get_mut("handlers")
        .and_then(serde_json::Value::as_object_mut)
    {
        handlers.insert("maxProperties".into(), MAX_HANDLERS.into());
        if let Some(value) = handlers
            .get_mut("additionalProperties")
            .and_then(serde_json::Value::as_object_mut)
        {
            value.insert("maxLength".into(), MAX_SQL_LEN.into());
        }
    }
}

/// Bounds each value of a string map (labels and annotations: at most 4096 characters).
fn bound_values(schema: &mut schemars::Schema) {
    if let Some(value) = schema
        .get_mut("additionalProperties")
        .and_then(serde_json::Value::as_object_mut)
    {
        value.insert("maxLength".into(), 4096.into());
    }
}

fn default_replicas() -> i32 {
    1
}

impl PerspectiveDeploymentSpec {
    /// The worker config this spec describes (what the ConfigMap holds).
    pub fn worker_config(&self) -> Config {
        Config {
            schema: self.schema.clone(),
            perspectives: self.perspectives.clone(),
            worker: self.worker.clone(),
            claim_worker: self.claim_worker.clone(),
        }
    }
}

/// Database connection of the deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseSpec {
    /// Secret (in the deployment's namespace) and key holding the PostgreSQL URL; used by every
    /// role below that names no Secret of its own.
    pub secret_ref: SecretKeyRef,
    /// Secret of the migration Job (`perspective-worker migrate`): the schema owner's URL, who
    /// creates the schema and the perspectives' tables (default `secretRef`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_secret_ref: Option<SecretKeyRef>,
    /// Secret of the worker pods (`perspective-worker run`): a role granted with
    /// `perspective-worker grants worker ROLE`, so that handlers need not run as the schema
    /// owner (default `secretRef`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_secret_ref: Option<SecretKeyRef>,
    /// Secret of the operator's own status queries (lag, instances): a read-only role granted
    /// with `perspective-worker grants reader ROLE` is enough (default `secretRef`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_secret_ref: Option<SecretKeyRef>,
}

/// Who uses a database Secret: each may have its own (`spec.database.*SecretRef`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseRole {
    /// The migration Job.
    Migration,
    /// The worker pods.
    Worker,
    /// The operator's status queries.
    Status,
}

impl DatabaseRole {
    /// Every role, in the order a missing Secret is reported.
    pub const ALL: [DatabaseRole; 3] = [Self::Migration, Self::Worker, Self::Status];
}

impl DatabaseSpec {
    /// The Secret `role` uses and the spec field naming it (`spec.database.secretRef` when the
    /// role names none of its own).
    pub fn secret_for(&self, role: DatabaseRole) -> (&SecretKeyRef, &'static str) {
        let (own, field) = match role {
            DatabaseRole::Migration => (
                &self.migration_secret_ref,
                "spec.database.migrationSecretRef",
            ),
            DatabaseRole::Worker => (&self.worker_secret_ref, "spec.database.workerSecretRef"),
            DatabaseRole::Status => (&self.status_secret_ref, "spec.database.statusSecretRef"),
        };
        match own {
            Some(secret) => (secret, field),
            None => (&self.secret_ref, "spec.database.secretRef"),
        }
    }
}

/// A key of a Secret in the same namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Secret name.
    pub name: String,
    /// Key within the Secret (default `url`).
    #[serde(default = "default_secret_key")]
    pub key: String,
}

fn default_secret_key() -> String {
    "url".to_owned()
}

/// Settings of the migration Job (`perspective-worker migrate`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct MigrationsSpec {
    /// Pod retries of one migration Job before it counts as failed (default 2).
    #[schemars(range(min = 0))]
    pub backoff_limit: i32,
    /// Seconds a migration Job may run before it is failed (default 600).
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: i64,
}

impl Default for MigrationsSpec {
    fn default() -> Self {
        Self {
            backoff_limit: 2,
            active_deadline_seconds: 600,
        }
    }
}

/// Observed state, written by the operator.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PerspectiveDeploymentStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// What the deployment is doing, in a word or two, for `kubectl get`: `Ready`, `Paused`,
    /// `Migrating`, `Backfilling 61%`, `RollingOut`, `Degraded: EventsFailing`, or the reason
    /// it is not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Ready, MigrationsApplied, Progressing, Degraded, ReconciliationPaused.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Worker pods that exist (the scale subresource's status replicas).
    #[serde(default)]
    pub replicas: i32,
    /// Worker pods that are ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// `ready/desired`, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas_summary: Option<String>,
    /// Label selector of the worker pods (for the scale subresource).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The migration Job of the current spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_job: Option<String>,
    /// Failed runs of the current migration Job (retried with backoff).
    #[serde(default)]
    pub migration_failures: i32,
    /// When the current migration Job last failed (to count each failure once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_migration_failure: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Hash of the last target the migrations succeeded for (what the worker pods run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrated_hash: Option<String>,
    /// The worker image of the current spec (`spec.image`, or the operator's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The perspectives of that target as `schema.name`, so that one removed from the spec is
    /// announced (an Event `PerspectiveRemoved`) once the migration that removes it succeeded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub migrated_perspectives: Vec<String>,
    /// What the operator's last read of the database found: `Reachable`, `Unreachable` or
    /// `SchemaMissing` (absent before the first migration). While it is not `Reachable` the
    /// figures read from the database (`pendingEvents`, `oldestPendingSeconds`, `deadLetters`,
    /// `liveInstances`, `perspectives`) are absent and `lag` and `phase` say `Unknown`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database: Option<DatabaseState>,
    /// Times the current migration Job ran again because the schema had gone from the
    /// database (each rerun waits longer after the previous one, like a failed migration).
    #[serde(default)]
    pub schema_recreations: i32,
    /// When the current migration Job last ran again because the schema had gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_schema_recreation: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Events not yet applied, over all perspectives (a catch-up's remaining events included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_events: Option<i64>,
    /// Age of the oldest unapplied event in seconds, over all perspectives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_seconds: Option<i64>,
    /// `oldestPendingSeconds` for `kubectl get` (e.g. `0s`, `42s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<String>,
    /// Dead letters waiting for replay, over all perspectives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letters: Option<i64>,
    /// `Live` when every perspective is live, else each catching-up one's phase and percent
    /// (e.g. `Backfilling 61%`), for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Worker instances with a recent heartbeat in the database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_instances: Option<i64>,
    /// Per perspective lag and failures, read from the database.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub perspectives: Vec<PerspectiveLag>,
    /// The last day-2 action asked for by annotation (replay or discard dead letters, rebuild,
    /// switch), or a switch the operator started for workers whose role may not make it: what,
    /// its Job, and how it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_action: Option<LastAction>,
}

/// A day-2 action asked for by an annotation on the deployment (see `docs/day-two.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastAction {
    /// The annotation that asked for it, e.g. `perspectives.dev/replay-dead-letters`
    /// (`perspectives.dev/switch` for a switch the operator started by itself).
    pub annotation: String,
    /// Its value: a perspective, or `all`.
    pub target: String,
    /// `Running`, `Succeeded`, `Failed`, or `Refused` (a bad value: no Job ran).
    pub phase: ActionPhase,
    /// The Job that carries it out (absent when refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// When the operator took it up.
    pub started_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// What happened, or why it was refused or failed.
    #[serde(default)]
    pub message: String,
}

/// Where a [`LastAction`] stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ActionPhase {
    #[default]
    Running,
    Succeeded,
    Failed,
    Refused,
}

impl ActionPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            ActionPhase::Running => "Running",
            ActionPhase::Succeeded => "Succeeded",
            ActionPhase::Failed => "Failed",
            ActionPhase::Refused => "Refused",
        }
    }
}

/// One pending dead letter of a perspective, as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSample {
    /// The dead letter's id (`perspective-worker dead-letters list`).
    pub id: i64,
    pub event_type: String,
    pub stream_id: String,
    /// The handler's error, cut to 200 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the event first failed.
    pub first_failed_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
}

/// What the operator's last read of a deployment's database found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DatabaseState {
    /// Status was read from the deployment's schema.
    Reachable,
    /// Connecting or reading failed (`Degraded` says what failed).
    Unreachable,
    /// The database answers but the deployment's schema has no migration history; the
    /// migration Job runs again.
    SchemaMissing,
}

/// Lag and failures of one perspective.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PerspectiveLag {
    /// Perspective name.
    pub name: String,
    /// Events not yet applied: its work rows, or while it backfills or rebuilds what the
    /// catch-up still has to apply (streams not queued yet included).
    pub pending_events: i64,
    /// Age of the oldest unapplied event in seconds (absent when nothing is pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_seconds: Option<i64>,
    /// Streams whose last apply failed and are waiting for a retry.
    pub failed_streams: i64,
    /// Dead letters waiting for replay.
    pub dead_letters: i64,
    /// The newest (at most 3) of those dead letters, newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub newest_dead_letters: Vec<DeadLetterSample>,
    /// Live, or catching up on history (Backfilling when new, Rebuilding after a version change).
    #[serde(default)]
    pub phase: PerspectivePhase,
    /// While catching up: how far it is and the time left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<PerspectiveProgress>,
    /// The version serving readers (absent until migrated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
    /// While Building or Switching (`rebuild: blueGreen`): the version built beside the serving
    /// one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_version: Option<i64>,
    /// Whether `nextVersion` is a kept version caught up from where it stopped (a rollback).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rollback: bool,
    /// Lock conflicts between its appliers (deadlocks, serialization failures, lock waits over
    /// 100 ms) over the last minute, summed over the live workers' heartbeats. Each is retried,
    /// never failed; from 10 a minute the contention counts as persistent: `Degraded`
    /// (`LockContention`) and a Warning Event name it (see the perspective's `sequencing`).
    #[serde(default)]
    pub lock_conflicts_per_minute: i64,
}

/// Where a perspective is in its life (the worker's [`perspective_worker::store::catchup::progress::Phase`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PerspectivePhase {
    /// Applying events as they are appended.
    #[default]
    Live,
    /// New to the schema: its history is being applied.
    Backfilling,
    /// Its version changed (or `rebuild` ran): each stream is reset and replayed.
    Rebuilding,
    /// Its version changed with `rebuild: blueGreen`: the new version is built beside the live
    /// one, which serves meanwhile.
    Building,
    /// The new version is built and switches once caught up; the old one serves until then.
    Switching,
}

impl From<perspective_worker::store::catchup::progress::Phase> for PerspectivePhase {
    fn from(phase: perspective_worker::store::catchup::progress::Phase) -> Self {
        use perspective_worker::store::catchup::progress::Phase;
        match phase {
            Phase::Live => PerspectivePhase::Live,
            Phase::Backfilling => PerspectivePhase::Backfilling,
            Phase::Rebuilding => PerspectivePhase::Rebuilding,
            Phase::Building => PerspectivePhase::Building,
            Phase::Switching => PerspectivePhase::Switching,
        }
    }
}

impl PerspectivePhase {
    pub fn as_str(self) -> &'static str {
        match self {
            PerspectivePhase::Live => "Live",
            PerspectivePhase::Backfilling => "Backfilling",
            PerspectivePhase::Rebuilding => "Rebuilding",
            PerspectivePhase::Building => "Building",
            PerspectivePhase::Switching => "Switching",
        }
    }
}

/// How far a catch-up (backfill or rebuild) is (the worker's
/// [`perspective_worker::store::catchup::progress::Progress`], in whole numbers).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PerspectiveProgress {
    /// `waiting` (for transactions older than the job), `queueing` (streams) or `applying`.
    pub step: String,
    /// Streams whose history is queued.
    pub streams_done: i64,
    /// Streams with history to apply.
    pub streams_total: i64,
    /// Events still to apply.
    pub events_remaining: i64,
    /// Events of the history when the job listed the streams.
    pub events_total: i64,
    /// Share of the history applied, 0–100 (rounded down).
    pub percent: i64,
    /// Estimated seconds left at the rate so far (absent until something was applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<i64>,
}

impl From<&perspective_worker::store::catchup::progress::Progress> for PerspectiveProgress {
    fn from(p: &perspective_worker::store::catchup::progress::Progress) -> Self {
        PerspectiveProgress {
            step: p.step.clone(),
            streams_done: p.streams_done,
            streams_total: p.streams_total,
            events_remaining: p.events_remaining,
            events_total: p.events_total,
            percent: p.percent.floor() as i64,
            eta_seconds: p.eta_seconds.map(|s| s.round() as i64),
        }
    }
}

/// The CRD as YAML, as `perspective-operator crd` prints it and `crds/` holds it.
pub fn crd_yaml() -> String {
    // merge_crds checks that the one version is consistent; kept so adding v1beta1 is one line.
    let crd = merge_crds(vec![PerspectiveDeployment::crd()], "v1alpha1")
        .expect("a single-version CRD always merges");
    let mut crd = serde_json::to_value(crd).expect("a CRD serializes");
    kubernetes_int_formats(&mut crd);
    let mut yaml = String::from(
        "# Generated by `perspective-operator crd` from operator/src/crd.rs; do not edit.\n",
    );
    yaml.push_str(&serde_yaml::to_string(&crd).expect("a CRD serializes"));
    yaml
}

/// The API server knows `int32`/`int64` only; schemars writes `uint32`/`uint64` for the worker's
/// unsigned options. Every integer also gets the bounds of its Rust type, so a value the API
/// server accepts always deserializes: one object that does not would break the operator's
/// watch of all of them.
fn kubernetes_int_formats(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            let bounds: Option<(i64, i64)> = match map.get("format").and_then(|f| f.as_str()) {
                Some("uint32") => Some((0, i64::from(u32::MAX))),
                // 2^53 - 1: larger bounds do not survive the API server's float parsing of schemas.
                Some("uint64") | Some("uint") => Some((0, (1_i64 << 53) - 1)),
                Some("int32") => Some((i64::from(i32::MIN), i64::from(i32::MAX))),
                _ => None,
            };
            if bounds.is_none() && map.get("type").and_then(|t| t.as_str()) == Some("integer") {
                // An int64: no bounds added, but a declared one must be an integer too.
                for key in ["minimum", "maximum"] {
                    if let Some(b) = map.get(key).and_then(|v| v.as_f64()) {
                        map.insert(key.into(), (b as i64).into());
                    }
                }
            }
            if let Some((min, max)) = bounds {
                let format = if max > i64::from(i32::MAX) {
                    "int64"
                } else {
                    "int32"
                };
                map.insert("format".into(), format.into());
                // schemars may write a bound as a float (`1.0`): read it as one.
                let bound = |key: &str| map.get(key).and_then(|v| v.as_f64()).map(|b| b as i64);
                let lower = bound("minimum").map_or(min, |m| m.max(min));
                let upper = bound("maximum").map_or(max, |m| m.min(max));
                map.insert("minimum".into(), lower.into());
                map.insert("maximum".into(), upper.into());
            }
            map.values_mut().for_each(kubernetes_int_formats);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(kubernetes_int_formats),
        _ => {}
    }
}
