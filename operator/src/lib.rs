//! perspective-operator: turns `PerspectiveDeployment` resources into a migration Job and a
//! worker StatefulSet, and reports readiness, lag and dead letters as status.
//!
//! - [`crd`]: the custom resource (spec embeds the worker's config types) and its CRD YAML;
//!   [`reference`]: the Markdown reference generated from it (`docs/reference/crd.md`)
//! - [`validate`]: spec checks beyond the CRD schema, each naming its field; [`pod_policy`]:
//!   what a deployment's author may set on its pods
//! - [`labels`]: names, labels and selectors of the children
//! - builders of the desired children, pure functions: [`config_map`], [`migration_job`],
//!   [`workers`] (StatefulSet, headless Service, PodDisruptionBudget), with [`pod`] shared
//! - [`action_job`]: day-2 actions asked for by annotation (replay or discard dead letters,
//!   rebuild) and the Job that carries one out, pure
//! - [`reconcile`]: the pipeline, one module per step: resolve → dereference → validate → build
//!   → apply (server-side apply; the migration retry a pure decision) → action → update_status
//! - [`status`]: status computed from observations, one builder per condition
//!   (`status::condition::{ready, degraded, migrations_applied, progressing, …}`), the printer
//!   columns' words (`status::summary`), condition transitions
//! - [`lag`]: lag / dead letters read from the deployment's database (`store::status`, read-only)
//! - [`events`]: Kubernetes Events about a deployment, each with the text of what happened
//! - [`controller`]: watches and runs the reconciler; [`leader`]: Lease-based leader election
//! - [`plugin`]: the `kubectl pd` plugin (status, dead letters, rebuild, logs) over the API
//! - [`webhook`]: the validating admission webhook (the same checks, at `kubectl apply`)
//! - [`metrics`]: reconcile metrics, served with the worker's `/metrics` `/livez` `/readyz`

pub mod action_job;
pub mod config_map;
pub mod controller;
pub mod crd;
pub mod events;
pub mod labels;
pub mod lag;
pub mod leader;
pub mod metrics;
pub mod migration_job;
pub mod plugin;
pub mod pod;
pub mod pod_policy;
pub mod reconcile;
pub mod reference;
pub mod status;
pub mod validate;
pub mod webhook;
pub mod workers;
