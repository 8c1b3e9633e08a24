//! The reconcile pipeline of one `PerspectiveDeployment`:
//!
//! 1. fetch and validate — the spec (worker config checks, names) and the database Secret;
//!    an invalid spec changes no child and is reported as `Degraded`, never as an error loop;
//! 2. build the desired children with the pure builders ([`config_map`], [`migration_job`],
//!    [`workers`]);
//! 3. apply them with server-side apply (one field manager, controller owner references),
//!    gated: the StatefulSet takes a new template only after that template's migration Job
//!    succeeded, and nothing changes while `spec.paused` is set;
//! 4. compute and write the status ([`status::compute`]), including lag read from the database.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde_json::json;
use tracing::{info, warn};

use crate::conditions;
use crate::config_map;
use crate::crd::{PerspectiveDeployment, PerspectiveDeploymentStatus};
use crate::events::{self, Event, EventType};
use crate::labels::{self, FIELD_MANAGER};
use crate::lag::LagReader;
use crate::metrics::OperatorMetrics;
use crate::migration_job::{self, JobState};
use crate::status::{self, Observed};
use crate::validate;
use crate::workers;

/// Operator-wide settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// Worker image of deployments that do not name one.
    pub default_worker_image: String,
    /// How often status (lag) is refreshed when nothing else happens.
    pub status_interval: Duration,
    /// Delay before a failed migration Job runs again, doubled per failure (20 × at most).
    pub migration_retry_base: Duration,
    /// Worker images must start with one of these (`--allowed-image-prefix`); empty: any image.
    pub allowed_image_prefixes: Vec<String>,
}

/// Shared state of all reconciles.
pub struct Context {
    pub client: Client,
    pub events: events::Publisher,
    pub metrics: Arc<OperatorMetrics>,
    pub options: Options,
    pub lag: LagReader,
}

/// How soon a deployment whose Secret is missing looks again: recreating the Secret should
/// recover it in seconds, without a watch on Secrets (which would need `list`/`watch` on all of
/// them in the namespace).
pub const SECRET_RECHECK: Duration = Duration::from_secs(3);

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
}

impl Error {
    /// Short label for the failures metric.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(_)) | Error::Rejected { .. } => "api",
            Error::Kube(_) => "transport",
            Error::MissingField(_) => "invalid_object",
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
fn is_rejection(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(s) if [400, 403, 422].contains(&s.code))
}

/// Reconciles one deployment; the controller calls this for every change and on requeue.
pub async fn reconcile(pd: Arc<PerspectiveDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&pd, &ctx).await;
    ctx.metrics
        .observe_reconcile(started.elapsed(), result.as_ref().err().map(Error::reason));
    result
}

/// What the controller does after a failed reconcile: log (the one line about it), retry soon.
pub fn error_policy(pd: Arc<PerspectiveDeployment>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(
        namespace = pd.namespace().unwrap_or_default(),
        name = pd.name_any(),
        error = %error,
        "reconcile failed; retrying in 5 s"
    );
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile_inner(pd: &PerspectiveDeployment, ctx: &Context) -> Result<Action, Error> {
    let namespace = pd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let name = pd.name_any();
    let key = format!("{namespace}/{name}");
    if pd.meta().deletion_timestamp.is_some() {
        // Children go with the owner references; the database schema stays (documented).
        ctx.lag.forget(&key).await;
        return Ok(Action::await_change());
    }
    let spec = &pd.spec;
    let previous = pd.status.clone().unwrap_or_default();
    let client = ctx.client.clone();
    let image = spec
        .image
        .clone()
        .unwrap_or_else(|| ctx.options.default_worker_image.clone());
    let config = spec.worker_config();
    let (_, config_hash) = config_map::render(&config);
    let target = migration_job::target(&name, spec, &image);
    let config_map_name = labels::config_map_name(&name, &config_hash);

    // 1. Validate: the spec, then the Secret it points at.
    let mut problems = validate::problems(&name, spec);
    problems.extend(validate::image_problem(
        &image,
        spec.image.is_none(),
        &ctx.options.allowed_image_prefixes,
    ));
    let (database_url, secret_problem) = read_database_url(&client, &namespace, pd).await?;

    let jobs: Api<Job> = Api::namespaced(client.clone(), &namespace);
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), &namespace);
    let mut job_state = jobs
        .get_opt(&target.job_name)
        .await?
        .map(|job| migration_job::state(&job));
    let mut statefulset = statefulsets.get_opt(&labels::workers_name(&name)).await?;

    // Failures of the current Job: counted once each, retried after a growing delay.
    let same_target = previous.migration_job.as_deref() == Some(target.job_name.as_str());
    let mut migration_failures = if same_target {
        previous.migration_failures
    } else {
        0
    };
    let mut last_failure = if same_target {
        previous.last_migration_failure.clone()
    } else {
        None
    };
    let mut requeue = ctx.options.status_interval;
    if secret_problem.is_some() {
        requeue = requeue.min(SECRET_RECHECK);
    }

    // 2 + 3. Build and apply; a child the API server refuses ends this step and is reported.
    let mut rejected = None;
    if problems.is_empty() && secret_problem.is_none() && !spec.paused {
        let owner = pd
            .controller_owner_ref(&())
            .ok_or(Error::MissingField("metadata.uid"))?;
        let applied = async {
            let new_job = job_state.is_none().then(|| {
                migration_job::build(
                    &name,
                    &namespace,
                    spec,
                    &image,
                    &config_map_name,
                    &target,
                )
            });
            if let Some(job) = &new_job {
                // Checked before anything is created, so a Job the API server refuses leaves
                // no ConfigMap behind.
                apply_with(&client, &namespace, &owner, job.clone(), true).await?;
            }
            apply(
                &client,
                &namespace,
                &owner,
                config_map::build(&name, &namespace, &config),
            )
            .await?;

            match &job_state {
                None => {
                    let job = new_job.expect("built when there was no Job");
                    let job = apply(&client, &namespace, &owner, job).await?;
                    info!(%namespace, %name, job = %target.job_name, "migration Job created");
                    publish(
                        ctx,
                        pd,
                        Event {
                            type_: EventType::Normal,
                            reason: "MigrationStarted",
                            note: format!("created migration Job {}", target.job_name),
                            related: Some(job.object_ref(&())),
                        },
                    )
                    .await;
                    job_state = Some(JobState::Running);
                }
                Some(JobState::Failed { message, at, .. }) => {
                    let at_time = at.map(Time);
                    if last_failure != at_time || migration_failures == 0 {
                        migration_failures += 1;
                        last_failure = at_time;
                        publish(
                            ctx,
                            pd,
                            Event {
                                type_: EventType::Warning,
                                reason: "MigrationFailed",
                                note: format!(
                                    "migration Job {} failed (failure {migration_failures}): {message}",
                                    target.job_name
                                ),
                                related: Some(job_ref(&namespace, &target.job_name)),
                            },
                        )
                        .await;
                    }
                    let delay = migration_job::retry_delay(
                        migration_failures,
                        ctx.options.migration_retry_base,
                    );
                    let failed_at = at.unwrap_or_else(Timestamp::now).as_second();
                    let retry_at = failed_at + delay.as_secs() as i64;
                    let wait = Duration::from_secs(
                        u64::try_from(retry_at - Timestamp::now().as_second()).unwrap_or(0),
                    );
                    if wait.is_zero() {
                        // Same target, same name: the retry is the Job created anew.
                        jobs.delete(&target.job_name, &background()).await?;
                        publish(
                            ctx,
                            pd,
                            Event {
                                type_: EventType::Normal,
                                reason: "MigrationRetrying",
                                note: format!(
                                    "deleted failed migration Job {} to run it again (failure {migration_failures})",
                                    target.job_name
                                ),
                                related: Some(job_ref(&namespace, &target.job_name)),
                            },
                        )
                        .await;
                        requeue = Duration::from_secs(1);
                    } else {
                        requeue = requeue.min(wait);
                    }
                }
                Some(JobState::Succeeded) => {
                    if previous.migrated_hash.as_deref() != Some(target.hash.as_str()) {
                        publish(
                            ctx,
                            pd,
                            Event {
                                type_: EventType::Normal,
                                reason: "MigrationSucceeded",
                                note: format!("migration Job {} completed", target.job_name),
                                related: Some(job_ref(&namespace, &target.job_name)),
                            },
                        )
                        .await;
                    }
                }
                Some(JobState::Running) => {}
            }
            delete_superseded_jobs(&jobs, &namespace, &name, &target.job_name).await?;

            apply(
                &client,
                &namespace,
                &owner,
                workers::service(&name, &namespace),
            )
            .await?;
            apply(
                &client,
                &namespace,
                &owner,
                workers::disruption_budget(&name, &namespace),
            )
            .await?;

            // The StatefulSet takes the new template only once its migration succeeded; until
            // then the running template stays and only the replica count follows the spec.
            let desired = if job_state == Some(JobState::Succeeded) {
                Some(workers::statefulset(
                    &name,
                    &namespace,
                    spec,
                    &image,
                    &config_map_name,
                    &config_hash,
                    &target.hash,
                ))
            } else {
                statefulset
                    .as_ref()
                    .and_then(|sts| sts.spec.as_ref())
                    .filter(|s| s.replicas != Some(spec.replicas))
                    .map(|s| {
                        workers::statefulset_with_template(
                            &name,
                            &namespace,
                            spec.replicas,
                            s.template.clone(),
                        )
                    })
            };
            if let Some(desired) = desired {
                statefulset = Some(apply(&client, &namespace, &owner, desired).await?);
            }

            let running_config = statefulset
                .as_ref()
                .and_then(|s| s.spec.as_ref())
                .and_then(|s| workers::template_config_map(&s.template));
            delete_unused_config_maps(&client, &namespace, &name, &config_map_name, running_config)
                .await
        }
        .await;
        match applied {
            Ok(()) => {}
            Err(e @ Error::Rejected { .. }) => rejected = Some(e.to_string()),
            Err(e) => return Err(e),
        }
    }

    // 4. Status, with the database's view once the schema exists.
    let database = match &database_url {
        Some(url) if job_state == Some(JobState::Succeeded) || previous.migrated_hash.is_some() => {
            let names: Vec<String> = spec.perspectives.iter().map(|p| p.name.clone()).collect();
            Some(
                ctx.lag
                    .read(
                        &key,
                        url,
                        &spec.schema,
                        &names,
                        f64::from(spec.worker.abandon_stale_instance_threshold_seconds),
                    )
                    .await,
            )
        }
        _ => None,
    };
    let observed = Observed {
        instance: name.clone(),
        generation: pd.meta().generation,
        paused: spec.paused,
        problems,
        secret_problem,
        rejected,
        target,
        config_hash,
        job: job_state,
        migration_failures,
        statefulset,
        desired_replicas: spec.replicas,
        database,
    };
    let mut new_status = status::compute(&previous, &observed, Timestamp::now());
    new_status.last_migration_failure = last_failure;

    report_degraded_change(ctx, pd, &previous, &new_status).await;
    if new_status != previous {
        let pds: Api<PerspectiveDeployment> = Api::namespaced(client, &namespace);
        pds.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": new_status })),
        )
        .await?;
    }
    Ok(Action::requeue(requeue))
}

/// The database URL from the Secret named in the spec, or why there is none: a missing Secret
/// or key is reported (`SecretMissing`) and looked at again soon, not a reconcile error.
async fn read_database_url(
    client: &Client,
    namespace: &str,
    pd: &PerspectiveDeployment,
) -> Result<(Option<String>, Option<String>), Error> {
    let secret_ref = &pd.spec.database.secret_ref;
    if secret_ref.name.is_empty() {
        // An invalid spec (validate says so).
        return Ok((None, None));
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let Some(secret) = secrets.get_opt(&secret_ref.name).await? else {
        return Ok((
            None,
            Some(format!(
                "spec.database.secretRef.name: Secret {:?} not found in namespace {namespace:?}",
                secret_ref.name
            )),
        ));
    };
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&secret_ref.key))
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&secret_ref.key).cloned())
        });
    match value {
        Some(url) if !url.trim().is_empty() => Ok((Some(url.trim().to_owned()), None)),
        _ => Ok((
            None,
            Some(format!(
                "spec.database.secretRef.key: Secret {:?} has no key {:?}",
                secret_ref.name, secret_ref.key
            )),
        )),
    }
}

/// Server-side apply of `object` with the operator's field manager, owned by the deployment.
async fn apply<K>(
    client: &Client,
    namespace: &str,
    owner: &OwnerReference,
    object: K,
) -> Result<K, Error>
where
    K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    apply_with(client, namespace, owner, object, false).await
}

/// [`apply`], or with `dry_run` only checked by the API server. A refusal of the object itself
/// is [`Error::Rejected`], naming the object and carrying the server's message.
async fn apply_with<K>(
    client: &Client,
    namespace: &str,
    owner: &OwnerReference,
    mut object: K,
    dry_run: bool,
) -> Result<K, Error>
where
    K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    object.meta_mut().owner_references = Some(vec![owner.clone()]);
    let name = object.name_any();
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    let mut params = PatchParams::apply(FIELD_MANAGER).force();
    params.dry_run = dry_run;
    match api.patch(&name, &params, &Patch::Apply(&object)).await {
        Ok(applied) => Ok(applied),
        Err(e) if is_rejection(&e) => Err(Error::Rejected {
            object: format!("{} {name}", K::kind(&())),
            message: match e {
                kube::Error::Api(s) => s.message,
                other => other.to_string(),
            },
        }),
        Err(e) => Err(e.into()),
    }
}

/// A reference to Job `name`, the `related` object of migration Events.
fn job_ref(namespace: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("batch/v1".to_owned()),
        kind: Some("Job".to_owned()),
        namespace: Some(namespace.to_owned()),
        name: Some(name.to_owned()),
        ..ObjectReference::default()
    }
}

fn background() -> DeleteParams {
    DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    }
}

/// Deletes migration Jobs of earlier targets: a new target supersedes them.
async fn delete_superseded_jobs(
    jobs: &Api<Job>,
    namespace: &str,
    instance: &str,
    current: &str,
) -> Result<(), Error> {
    let selector = labels::component_selector(instance, labels::MIGRATION);
    for job in jobs
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        let name = job.name_any();
        if name != current && job.meta().deletion_timestamp.is_none() {
            info!(%namespace, name = %instance, job = %name, "deleting superseded migration Job");
            delete_ignoring_gone(jobs, &name).await?;
        }
    }
    Ok(())
}

/// Deletes config ConfigMaps that neither the desired nor the running template reads.
async fn delete_unused_config_maps(
    client: &Client,
    namespace: &str,
    instance: &str,
    current: &str,
    running: Option<String>,
) -> Result<(), Error> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let selector = labels::component_selector(instance, labels::CONFIG);
    for cm in api
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        let name = cm.name_any();
        if name != current && Some(&name) != running.as_ref() {
            delete_ignoring_gone(&api, &name).await?;
        }
    }
    Ok(())
}

async fn delete_ignoring_gone<K>(api: &Api<K>, name: &str) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Degraded reasons that say the operator could not do its part; each new message is a Warning
/// Event (the other reasons — a failed migration, failing events — have their own).
const REPORTED_DEGRADED: [&str; 3] = ["InvalidSpec", "SecretMissing", "ChildRejected"];

/// A Warning Event (and a log line) when Degraded turns to one of [`REPORTED_DEGRADED`] or its
/// message changes.
async fn report_degraded_change(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    previous: &PerspectiveDeploymentStatus,
    new: &PerspectiveDeploymentStatus,
) {
    let find = |s: &PerspectiveDeploymentStatus| {
        s.conditions
            .iter()
            .find(|c| {
                c.type_ == conditions::DEGRADED
                    && c.status == "True"
                    && REPORTED_DEGRADED.contains(&c.reason.as_str())
            })
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    if let Some((reason, problem)) = find(new) {
        if find(previous).as_ref() != Some(&(reason.clone(), problem.clone())) {
            let reason = REPORTED_DEGRADED
                .into_iter()
                .find(|r| *r == reason)
                .expect("found among them");
            warn!(
                namespace = pd.namespace().unwrap_or_default(),
                name = %pd.name_any(),
                reason,
                problem = %problem,
                "PerspectiveDeployment degraded"
            );
            let event = Event {
                type_: EventType::Warning,
                reason,
                note: problem,
                related: None,
            };
            publish(ctx, pd, event).await;
        }
    }
}

/// Publishes a Kubernetes Event about `pd`; a failure to publish is logged, never fatal.
async fn publish(ctx: &Context, pd: &PerspectiveDeployment, event: Event) {
    if let Err(e) = ctx.events.publish(&event, &pd.object_ref(&())).await {
        warn!(
            namespace = pd.namespace().unwrap_or_default(),
            name = %pd.name_any(),
            error = %describe(&e),
            reason = event.reason,
            "could not publish event"
        );
    }
}

#[cfg(test)]
mod tests {
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
