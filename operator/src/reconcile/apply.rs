//! Applying the desired children with server-side apply (one field manager, controller owner
//! references): the ConfigMap, the migration Job as [`migration_retry`] decides (created,
//! retried, announced), the Service, the PodDisruptionBudget and the StatefulSet; then deleting
//! superseded migration Jobs and ConfigMaps no template reads. A child the API server refuses
//! ends the step and is reported (`ChildRejected`), not retried as an error.

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PropagationPolicy};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use tracing::info;

use super::announcements;
use super::build::Children;
use super::context::Context;
use super::error::{is_rejection, Error};
use super::migration_retry::{self, Failures, Known, Next, Recreations, Retry};
use super::ownership;
use super::resolve::Resolved;
use crate::crd::{PerspectiveDeployment, PerspectiveDeploymentStatus};
use crate::events::{Event, EventType};
use crate::labels::{self, FIELD_MANAGER};
use crate::migration_job::JobState;
use crate::status::observed::DatabaseProblem;
use crate::workers;
use perspective_worker::store::status::Status as DbStatus;

/// What the status is computed from besides the verdict: what was found, as the apply step
/// left it.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The current target's Job (`Running` once created).
    pub job: Option<JobState>,
    /// The StatefulSet as found, or as applied.
    pub statefulset: Option<StatefulSet>,
    /// The current target's failures, this reconcile's counted.
    pub failures: Failures,
    /// The current target's reruns because the schema had gone, this reconcile's counted.
    pub recreations: Recreations,
    /// The database's view, read before the apply step (`None`: not read, nothing migrated).
    pub database: Option<Result<DbStatus, DatabaseProblem>>,
    /// When to reconcile again.
    pub requeue: Duration,
    /// The API server's refusal of a child, naming it.
    pub rejected: Option<String>,
    /// The last day-2 action (status `lastAction`), as the action step left it.
    pub last_action: Option<crate::crd::LastAction>,
    /// The deployment's version the status is computed from: the cached copy's, advanced by
    /// this reconcile's own writes to the deployment. The status write is conditional on it.
    pub resource_version: Option<String>,
}

/// One deployment's apply step.
struct Step<'a> {
    ctx: &'a Context,
    pd: &'a PerspectiveDeployment,
    r: &'a Resolved,
    owner: OwnerReference,
}

/// Applies `children` and records what changed in `outcome`; a refused child is recorded
/// there too, other API errors end the reconcile.
pub async fn apply(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    r: &Resolved,
    previous: &PerspectiveDeploymentStatus,
    children: Children,
    outcome: &mut Outcome,
) -> Result<(), Error> {
    let owner = pd
        .controller_owner_ref(&())
        .ok_or(Error::MissingField("metadata.uid"))?;
    let step = Step { ctx, pd, r, owner };
    match step.all(previous, children, outcome).await {
        Ok(()) => Ok(()),
        Err(e @ Error::Rejected { .. }) => {
            outcome.rejected = Some(e.to_string());
            Ok(())
        }
        Err(e) => Err(e),
    }
}

impl Step<'_> {
    async fn all(
        &self,
        previous: &PerspectiveDeploymentStatus,
        children: Children,
        outcome: &mut Outcome,
    ) -> Result<(), Error> {
        if let Some(job) = &children.job {
            // Checked before anything is created, so a Job the API server refuses leaves no
            // ConfigMap behind.
            self.apply_with(job.clone(), true).await?;
        }
        self.apply(children.config_map).await?;
        self.migration(previous, children.job, outcome).await?;
        self.delete_superseded_jobs().await?;
        self.apply(children.service).await?;
        self.apply(children.disruption_budget).await?;
        if let Some(desired) = children.statefulset {
            outcome.statefulset = Some(self.apply(desired).await?);
        }
        let running_config = outcome
            .statefulset
            .as_ref()
            .and_then(|s| s.spec.as_ref())
            .and_then(|s| workers::template_config_map(&s.template));
        self.delete_unused_config_maps(running_config).await
    }

    /// Creates, retries or announces the current target's Job, as [`migration_retry`] says.
    async fn migration(
        &self,
        previous: &PerspectiveDeploymentStatus,
        job: Option<Job>,
        outcome: &mut Outcome,
    ) -> Result<(), Error> {
        let schema_missing = matches!(
            outcome.database,
            Some(Err(DatabaseProblem::SchemaMissing(_)))
        );
        let known = Known {
            failures: &outcome.failures,
            recreations: &outcome.recreations,
            target: &self.r.target,
            migrated_hash: previous.migrated_hash.as_deref(),
            schema_missing,
            now: Timestamp::now(),
            base: self.ctx.options.migration_retry_base,
        };
        match migration_retry::next(outcome.job.as_ref(), &known) {
            Next::SchemaMissing {
                recreations,
                retry: Retry::Now,
            } => {
                self.rerun_for_missing_schema(recreations.count).await?;
                outcome.recreations = recreations;
                outcome.job = None;
                outcome.requeue = Duration::from_secs(1);
            }
            Next::SchemaMissing {
                retry: Retry::In(wait),
                ..
            } => outcome.requeue = outcome.requeue.min(wait),
            Next::Create => {
                let job = job.expect("built when there was no Job");
                self.create_job(job).await?;
                outcome.job = Some(JobState::Running);
            }
            Next::Failed {
                failures,
                newly_counted,
                retry,
            } => {
                outcome.failures = failures;
                if newly_counted {
                    self.announce_failure(outcome).await;
                }
                match retry {
                    Retry::Now => {
                        self.rerun(outcome.failures.count).await?;
                        outcome.requeue = Duration::from_secs(1);
                    }
                    Retry::In(wait) => outcome.requeue = outcome.requeue.min(wait),
                }
            }
            Next::Succeeded { announce: true } => {
                let note = format!("migration Job {} completed", self.r.target.job_name);
                self.announce(
                    EventType::Normal,
                    "MigrationSucceeded",
                    note,
                    self.job_ref(),
                )
                .await;
                self.announce_removed(previous).await;
            }
            Next::Succeeded { announce: false } | Next::Wait => {}
        }
        Ok(())
    }

    /// A `PerspectiveRemoved` Event for each perspective the migration that just succeeded
    /// removed (in the previously migrated target, not in this spec).
    async fn announce_removed(&self, previous: &PerspectiveDeploymentStatus) {
        let configured = announcements::qualified(&self.pd.spec);
        for name in
            announcements::removed_perspectives(&previous.migrated_perspectives, &configured)
        {
            info!(namespace = %self.r.namespace, name = %self.r.name, perspective = %name, "perspective removed; its tables were kept");
            let mut event = announcements::removed(&name, &self.r.target.job_name);
            event.related = Some(self.job_ref());
            self.ctx.publish(self.pd, event).await;
        }
    }

    /// Creates the current target's migration Job.
    async fn create_job(&self, job: Job) -> Result<(), Error> {
        let job_name = &self.r.target.job_name;
        let job = self.apply(job).await?;
        info!(namespace = %self.r.namespace, name = %self.r.name, job = %job_name, "migration Job created");
        let note = format!("created migration Job {job_name}");
        self.announce(
            EventType::Normal,
            "MigrationStarted",
            note,
            job.object_ref(&()),
        )
        .await;
        Ok(())
    }

    /// A Warning Event about the failure `outcome` counted last, with the Job's message.
    async fn announce_failure(&self, outcome: &Outcome) {
        let message = match &outcome.job {
            Some(JobState::Failed { message, .. }) => message.as_str(),
            _ => "",
        };
        let note = format!(
            "migration Job {} failed (failure {}): {message}",
            self.r.target.job_name, outcome.failures.count
        );
        self.announce(EventType::Warning, "MigrationFailed", note, self.job_ref())
            .await;
    }

    /// Deletes the failed Job so that it runs again: same target, same name, created anew by
    /// the next reconcile.
    async fn rerun(&self, failures: i32) -> Result<(), Error> {
        let job_name = &self.r.target.job_name;
        let jobs: Api<Job> = self.api();
        jobs.delete(job_name, &background()).await?;
        let note =
            format!("deleted failed migration Job {job_name} to run it again (failure {failures})");
        self.announce(EventType::Normal, "MigrationRetrying", note, self.job_ref())
            .await;
        Ok(())
    }

    /// Deletes the succeeded Job whose schema has gone, so that the next reconcile creates it
    /// anew: same target, same name.
    async fn rerun_for_missing_schema(&self, reruns: i32) -> Result<(), Error> {
        let job_name = &self.r.target.job_name;
        let jobs: Api<Job> = self.api();
        delete_ignoring_gone(&jobs, job_name).await?;
        info!(namespace = %self.r.namespace, name = %self.r.name, job = %job_name, reruns, "schema missing from the database; running the migration again");
        let note = format!(
            "schema {} has gone from the database: deleted migration Job {job_name} to run it \
             again (rerun {reruns})",
            self.pd.spec.schema
        );
        self.announce(EventType::Normal, "MigrationRerun", note, self.job_ref())
            .await;
        Ok(())
    }

    /// An Event about the deployment, related to `related` (the migration Job).
    async fn announce(
        &self,
        type_: EventType,
        reason: &'static str,
        note: String,
        related: ObjectReference,
    ) {
        let event = Event {
            type_,
            reason,
            note,
            related: Some(related),
        };
        self.ctx.publish(self.pd, event).await;
    }

    /// A reference to the current target's Job, the `related` object of migration Events.
    fn job_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("batch/v1".to_owned()),
            kind: Some("Job".to_owned()),
            namespace: Some(self.r.namespace.clone()),
            name: Some(self.r.target.job_name.clone()),
            ..ObjectReference::default()
        }
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.ctx.client.clone(), &self.r.namespace)
    }

    /// Server-side apply of `object` with the operator's field manager, owned by the deployment.
    async fn apply<K>(&self, object: K) -> Result<K, Error>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + Serialize
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        self.apply_with(object, false).await
    }

    /// [`Self::apply`], or with `dry_run` only checked by the API server. A refusal of the
    /// object itself is [`Error::Rejected`], naming the object and carrying the server's
    /// message.
    async fn apply_with<K>(&self, mut object: K, dry_run: bool) -> Result<K, Error>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + Serialize
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        object.meta_mut().owner_references = Some(vec![self.owner.clone()]);
        let name = object.name_any();
        let api: Api<K> = self.api();
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

    /// Whether this deployment controls the object of `meta`: labels anyone can set, so an
    /// object is deleted only when it is the deployment's own ([`ownership`]).
    fn controls(&self, meta: &kube::api::ObjectMeta) -> bool {
        ownership::controlled_by(meta, &self.owner.uid)
    }

    /// Deletes migration Jobs of earlier targets: a new target supersedes them.
    async fn delete_superseded_jobs(&self) -> Result<(), Error> {
        let jobs: Api<Job> = self.api();
        let selector = labels::component_selector(&self.r.name, labels::MIGRATION);
        for job in jobs
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
        {
            let name = job.name_any();
            if name != self.r.target.job_name
                && job.meta().deletion_timestamp.is_none()
                && self.controls(job.meta())
            {
                info!(namespace = %self.r.namespace, name = %self.r.name, job = %name, "deleting superseded migration Job");
                delete_ignoring_gone(&jobs, &name).await?;
            }
        }
        Ok(())
    }

    /// Deletes config ConfigMaps that neither the desired nor the running template reads.
    async fn delete_unused_config_maps(&self, running: Option<String>) -> Result<(), Error> {
        let api: Api<ConfigMap> = self.api();
        let selector = labels::component_selector(&self.r.name, labels::CONFIG);
        for cm in api
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
        {
            let name = cm.name_any();
            if name != self.r.config_map_name
                && Some(&name) != running.as_ref()
                && self.controls(cm.meta())
            {
                delete_ignoring_gone(&api, &name).await?;
            }
        }
        Ok(())
    }
}

fn background() -> DeleteParams {
    DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    }
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
