//! The action step: day-2 actions asked for by annotation on the deployment
//! ([`crate::action_job`]), one at a time, each through a short Job.
//!
//! A finished action Job is reported once (status `lastAction`, an Event), its annotation
//! removed if it still holds the value the Job ran for (changed meanwhile: the new value runs
//! next), and the Job marked reported; it stays for its log until the next action starts.
//! While an action Job runs, or the current spec's migration has not succeeded, nothing new
//! starts. A bad value is refused without a Job: reported, and its annotation removed.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};
use tracing::info;

use super::apply::Outcome;
use super::context::Context;
use super::error::Error;
use super::ownership::controlled_by;
use super::resolve::Resolved;
use crate::action_job::{self, Request};
use crate::crd::{ActionPhase, LastAction, PerspectiveDeployment};
use crate::events::{Event, EventType};
use crate::labels;
use crate::migration_job::{self, JobState};
use crate::pod;

/// What the status and Events add about a Job the operator started by itself.
fn by_operator_note(job: &Job) -> &'static str {
    if job.annotations().contains_key(labels::ACTION_BY_OPERATOR) {
        " (started by the operator: the workers run as spec.database.workerSecretRef's role, \
         which may not switch)"
    } else {
        ""
    }
}

/// How soon to look again while an action Job runs.
const WHILE_RUNNING: Duration = Duration::from_secs(2);

/// One deployment's action step.
struct Step<'a> {
    ctx: &'a Context,
    pd: &'a PerspectiveDeployment,
    r: &'a Resolved,
    jobs: Api<Job>,
}

/// Reports finished action Jobs and starts the next asked-for action, recording it in
/// `outcome.last_action`.
pub async fn act(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    r: &Resolved,
    outcome: &mut Outcome,
) -> Result<(), Error> {
    let step = Step {
        ctx,
        pd,
        r,
        jobs: Api::namespaced(ctx.client.clone(), &r.namespace),
    };
    let uid = pd
        .metadata
        .uid
        .as_deref()
        .ok_or(Error::MissingField("metadata.uid"))?;
    let selector = labels::component_selector(&r.name, labels::ACTION_JOB);
    let jobs: Vec<Job> = step
        .jobs
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .into_iter()
        .filter(|j| controlled_by(j.meta(), uid) && j.meta().deletion_timestamp.is_none())
        .collect();
    for job in &jobs {
        step.report_if_finished(job, outcome).await?;
    }
    step.notice_a_vanished_job(&jobs, outcome);
    if jobs
        .iter()
        .any(|j| migration_job::state(j) == JobState::Running)
    {
        outcome.requeue = outcome.requeue.min(WHILE_RUNNING);
        return Ok(());
    }
    if outcome.job != Some(JobState::Succeeded) {
        return Ok(()); // The current spec migrates first; the annotation waits.
    }
    step.take_up(&jobs, outcome).await
}

impl Step<'_> {
    /// Starts the action the annotations ask for, or refuses a bad value.
    async fn take_up(&self, jobs: &[Job], outcome: &mut Outcome) -> Result<(), Error> {
        let names: Vec<String> = self
            .pd
            .spec
            .perspectives
            .iter()
            .map(|p| p.name.clone())
            .collect();
        let cached = self.pd.metadata.annotations.clone().unwrap_or_default();
        if action_job::requested(&cached, &names).is_none() {
            return self.switch_for_the_workers(jobs, outcome).await;
        }
        // Read afresh: the cached copy may still carry an annotation just removed (by this
        // reconcile, or by one whose writes the cache has not seen; then it is stale).
        let pds: Api<PerspectiveDeployment> =
            Api::namespaced(self.ctx.client.clone(), &self.r.namespace);
        let fresh = pds.get(&self.r.name).await?;
        if fresh.resource_version() != outcome.resource_version {
            return Err(Error::Stale);
        }
        let annotations = fresh.metadata.annotations.unwrap_or_default();
        match action_job::requested(&annotations, &names) {
            None => Ok(()),
            Some(Err(refusal)) => {
                let now = Time(Timestamp::now());
                outcome.last_action = Some(LastAction {
                    annotation: refusal.action.annotation().to_owned(),
                    target: refusal.value.clone(),
                    phase: ActionPhase::Refused,
                    job: None,
                    started_at: now.clone(),
                    finished_at: Some(now),
                    message: refusal.message.clone(),
                });
                self.remove_annotation(refusal.action.annotation(), &refusal.value, outcome)
                    .await?;
                self.publish(EventType::Warning, "ActionRefused", refusal.message, None)
                    .await;
                Ok(())
            }
            Some(Ok(request)) => {
                self.start(&request, jobs, false, outcome).await?;
                outcome.requeue = outcome.requeue.min(WHILE_RUNNING);
                Ok(())
            }
        }
    }

    /// With nothing asked for: the switch the workers' role may not make, started by the
    /// operator ([`action_job::auto_switch`]).
    async fn switch_for_the_workers(
        &self,
        jobs: &[Job],
        outcome: &mut Outcome,
    ) -> Result<(), Error> {
        let Some(request) =
            action_job::auto_switch(&self.pd.spec, self.pd.status.as_ref(), Timestamp::now())
        else {
            return Ok(());
        };
        self.start(&request, jobs, true, outcome).await?;
        outcome.requeue = outcome.requeue.min(WHILE_RUNNING);
        Ok(())
    }

    /// Deletes earlier action Jobs, creates `request`'s, and announces it; `by_operator`: no
    /// annotation asked for it.
    async fn start(
        &self,
        request: &Request,
        earlier: &[Job],
        by_operator: bool,
        outcome: &mut Outcome,
    ) -> Result<(), Error> {
        for job in earlier {
            match self.jobs.delete(&job.name_any(), &background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        let now = Timestamp::now();
        let id = hex::encode(Sha256::digest(format!(
            "{}\0{}\0{}",
            request.action.annotation(),
            request.target,
            now.as_nanosecond()
        )));
        let name = labels::action_job_name(&self.r.name, request.action.verb(), &id);
        let mut job = action_job::build(
            &self.r.name,
            &self.r.namespace,
            &self.pd.spec,
            &self.r.image,
            &self.r.config_map_name,
            request,
            &name,
        );
        if let Some(pod_spec) = job.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
            pod::harden(pod_spec, self.r.app_armor_runtime_default);
        }
        job.metadata.owner_references = self.pd.controller_owner_ref(&()).map(|o| vec![o]);
        if by_operator {
            job.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(labels::ACTION_BY_OPERATOR.to_owned(), "true".to_owned());
        }
        let job = self.jobs.create(&PostParams::default(), &job).await?;
        let note = format!(
            "{} {}: started Job {name}{}",
            request.action.annotation(),
            request.target,
            by_operator_note(&job)
        );
        info!(namespace = %self.r.namespace, name = %self.r.name, job = %name, "{note}");
        outcome.last_action = Some(LastAction {
            annotation: request.action.annotation().to_owned(),
            target: request.target.clone(),
            phase: ActionPhase::Running,
            job: Some(name),
            started_at: started_at(&job),
            finished_at: None,
            message: note.clone(),
        });
        self.publish(
            EventType::Normal,
            "ActionStarted",
            note,
            Some(job.object_ref(&())),
        )
        .await;
        Ok(())
    }

    /// Reports `job` once it has finished and was not reported yet.
    async fn report_if_finished(&self, job: &Job, outcome: &mut Outcome) -> Result<(), Error> {
        let state = migration_job::state(job);
        let Some(request) = action_job::request_of(job).filter(|_| state != JobState::Running)
        else {
            return Ok(());
        };
        let name = job.name_any();
        let reported = job.annotations().contains_key(labels::ACTION_REPORTED);
        let shown_running = outcome.last_action.as_ref().is_some_and(|a| {
            a.job.as_deref() == Some(name.as_str()) && a.phase == ActionPhase::Running
        });
        if reported && !shown_running {
            return Ok(());
        }
        let message = action_job::outcome_message(&request, &name, &state) + by_operator_note(job);
        let (phase, type_, reason) = match state {
            JobState::Succeeded => (ActionPhase::Succeeded, EventType::Normal, "ActionSucceeded"),
            _ => (ActionPhase::Failed, EventType::Warning, "ActionFailed"),
        };
        outcome.last_action = Some(LastAction {
            annotation: request.action.annotation().to_owned(),
            target: request.target.clone(),
            phase,
            job: Some(name.clone()),
            started_at: started_at(job),
            finished_at: Some(Time(Timestamp::now())),
            message: message.clone(),
        });
        if reported {
            return Ok(()); // Reported before; only the status write had not happened.
        }
        self.remove_annotation(request.action.annotation(), &request.target, outcome)
            .await?;
        self.publish(type_, reason, message, Some(job.object_ref(&())))
            .await;
        let mark = json!({"metadata": {"annotations": {labels::ACTION_REPORTED: "true"}}});
        self.jobs
            .patch(&name, &PatchParams::default(), &Patch::Merge(&mark))
            .await?;
        Ok(())
    }

    /// A running action whose Job has gone (deleted by hand) failed.
    fn notice_a_vanished_job(&self, jobs: &[Job], outcome: &mut Outcome) {
        let Some(last) = outcome.last_action.as_mut() else {
            return;
        };
        let gone = last.phase == ActionPhase::Running
            && last
                .job
                .as_ref()
                .is_some_and(|name| !jobs.iter().any(|j| j.name_any() == *name));
        if gone {
            last.phase = ActionPhase::Failed;
            last.finished_at = Some(Time(Timestamp::now()));
            last.message = format!(
                "Job {} was deleted before it finished",
                last.job.as_deref().unwrap_or_default()
            );
        }
    }

    /// Removes annotation `key` from the deployment if it still says `value` (compared
    /// trimmed), conditional on the version the status is computed from
    /// (`outcome.resource_version`), which it advances. A deployment changed since (our last
    /// status write not yet in the cache, or a user's edit) is [`Error::Stale`]: nothing is
    /// removed or reported from this reconcile's stale view; the next one does it.
    async fn remove_annotation(
        &self,
        key: &str,
        value: &str,
        outcome: &mut Outcome,
    ) -> Result<(), Error> {
        if self.pd.annotations().get(key).map(|v| v.trim()) != Some(value.trim()) {
            return Ok(()); // Removed or changed since: the new value runs next.
        }
        let pds: Api<PerspectiveDeployment> =
            Api::namespaced(self.ctx.client.clone(), &self.r.namespace);
        let patch = json!({"metadata": {
            "resourceVersion": outcome.resource_version,
            "annotations": {key: null},
        }});
        match pds
            .patch(&self.r.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(pd) => {
                outcome.resource_version = pd.resource_version();
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::Stale),
            Err(e) => Err(e.into()),
        }
    }

    async fn publish(
        &self,
        type_: EventType,
        reason: &'static str,
        note: String,
        related: Option<ObjectReference>,
    ) {
        let event = Event {
            type_,
            reason,
            note,
            related,
        };
        self.ctx.publish(self.pd, event).await;
    }
}

/// When an action Job was created: when its action started.
fn started_at(job: &Job) -> Time {
    job.metadata
        .creation_timestamp
        .clone()
        .unwrap_or(Time(Timestamp::now()))
}

fn background() -> kube::api::DeleteParams {
    kube::api::DeleteParams {
        propagation_policy: Some(kube::api::PropagationPolicy::Background),
        ..Default::default()
    }
}
