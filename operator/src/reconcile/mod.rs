//! The reconcile pipeline of one `PerspectiveDeployment`, one step per module:
//!
//! 1. [`resolve`] the spec (image, config and its hash, migration target) — pure;
//! 2. [`dereference`] what it refers to and what exists: the database Secret, the current
//!    migration Job, the worker StatefulSet, and (once migrated) the database's view;
//! 3. [`validate`] — the spec and the Secret; an invalid spec changes no child and is reported
//!    as `Degraded`, never as an error loop, and nothing changes while `spec.paused` is set;
//! 4. [`build`] the desired children with the pure builders, once [`ownership`] found no
//!    object of their names that this deployment does not control;
//! 5. [`apply`] them with server-side apply, gated: the StatefulSet takes a new template only
//!    after that template's migration Job succeeded; a failed Job, or a succeeded one whose
//!    schema has gone from the database, runs again as [`migration_retry`] decides (pure);
//! 6. [`action`]: day-2 actions asked for by annotation, each through a short Job;
//! 7. [`update_status`]: compute and write the status ([`crate::status::compute`]), and Events
//!    on change ([`announcements`]: what users wait for).
//!
//! [`context`] holds what all reconciles share, [`error`] why one could not finish.

pub mod action;
pub mod announcements;
pub mod apply;
pub mod build;
pub mod context;
pub mod dereference;
pub mod error;
pub mod migration_retry;
pub mod ownership;
pub mod resolve;
pub mod update_status;
pub mod validate;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use tracing::{debug, warn};

use crate::crd::PerspectiveDeployment;
use apply::Outcome;
pub use context::{Context, Options};
use dereference::Found;
pub use error::{describe, one_line, Error};
use migration_retry::{Failures, Recreations};
use resolve::Resolved;

/// Reconciles one deployment; the controller calls this for every change and on requeue.
pub async fn reconcile(pd: Arc<PerspectiveDeployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&pd, &ctx).await;
    ctx.metrics
        .observe_reconcile(started.elapsed(), result.as_ref().err().map(Error::reason));
    result
}

/// How soon a reconcile that met a newer copy of its deployment runs again.
const STALE_RETRY: Duration = Duration::from_millis(500);

/// What the controller does after a failed reconcile: log (the one line about it), retry soon.
pub fn error_policy(pd: Arc<PerspectiveDeployment>, error: &Error, _ctx: Arc<Context>) -> Action {
    if matches!(error, Error::Stale) {
        // Routine: the watch brings the newer copy within moments.
        debug!(
            namespace = pd.namespace().unwrap_or_default(),
            name = pd.name_any(),
            "{error}; reconciling again"
        );
        return Action::requeue(STALE_RETRY);
    }
    warn!(
        namespace = pd.namespace().unwrap_or_default(),
        name = pd.name_any(),
        error = %error,
        "reconcile failed; retrying in 5 s"
    );
    Action::requeue(Duration::from_secs(5))
}

/// The pipeline: resolve → dereference → validate → build → apply → action → update_status.
async fn reconcile_inner(pd: &PerspectiveDeployment, ctx: &Context) -> Result<Action, Error> {
    let namespace = pd
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    if pd.meta().deletion_timestamp.is_some() {
        // Children go with the owner references; the database schema stays (documented).
        ctx.lag
            .forget(&format!("{namespace}/{}", pd.name_any()))
            .await;
        return Ok(Action::await_change());
    }
    let previous = pd.status.clone().unwrap_or_default();
    let resolved = Resolved::new(pd, &namespace, &ctx.options);
    let found = dereference::dereference(&ctx.client, pd, &resolved).await?;
    let validated = validate::validate(pd, &resolved, &found, &ctx.options);

    let Found {
        database_url,
        job,
        statefulset,
        ..
    } = found;
    let database =
        dereference::read_database(ctx, pd, &resolved, &previous, job.as_ref(), database_url).await;
    let mut outcome = Outcome {
        job,
        statefulset,
        failures: Failures::carried(&previous, &resolved.target),
        recreations: Recreations::carried(&previous, &resolved.target),
        database,
        requeue: validated.requeue_within(ctx.options.status_interval),
        rejected: None,
        last_action: previous.last_action.clone(),
        resource_version: pd.resource_version(),
    };
    if validated.may_apply() {
        let uid = pd
            .metadata
            .uid
            .as_deref()
            .ok_or(Error::MissingField("metadata.uid"))?;
        let foreign = ownership::foreign_children(&ctx.client, &resolved, uid).await?;
        if !foreign.is_empty() {
            // Nothing is written, and nothing of the neighbour's counts as ours in the status.
            outcome.rejected = Some(ownership::foreign_message(&foreign));
            outcome.job = None;
            outcome.statefulset = None;
        }
    }
    if validated.may_apply() && outcome.rejected.is_none() {
        let children = build::children(
            &pd.spec,
            &resolved,
            outcome.job.as_ref(),
            outcome.statefulset.as_ref(),
        );
        apply::apply(ctx, pd, &resolved, &previous, children, &mut outcome).await?;
        if outcome.rejected.is_none() {
            action::act(ctx, pd, &resolved, &mut outcome).await?;
        }
    }
    let requeue =
        update_status::update_status(ctx, pd, &resolved, &previous, validated, outcome).await?;
    Ok(Action::requeue(requeue))
}
