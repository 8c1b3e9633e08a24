//! What a deployment refers to and what of it already exists: the database URLs from the
//! Secrets its spec names, the current migration target's Job and the worker StatefulSet; then
//! the database's view of its schema ([`read_database`]). Reads only.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::Client;
use tracing::debug;

use perspective_worker::store::status::Status as DbStatus;

use super::context::Context;
use super::error::Error;
use super::resolve::Resolved;
use crate::crd::{
    DatabaseRole, DatabaseSpec, PerspectiveDeployment, PerspectiveDeploymentStatus, SecretKeyRef,
};
use crate::labels;
use crate::migration_job::{self, JobState};
use crate::status::observed::DatabaseProblem;

/// What was read for one reconcile.
#[derive(Debug, Clone)]
pub struct Found {
    /// The database URL of the operator's status queries, when every role's Secret holds one.
    pub database_url: Option<String>,
    /// Why there is none: a role's Secret or its key is missing (reported as `SecretMissing`).
    pub secret_problem: Option<String>,
    /// The state of the current target's migration Job, if it exists.
    pub job: Option<JobState>,
    /// The worker StatefulSet, if it exists.
    pub statefulset: Option<StatefulSet>,
}

/// Reads the Secret, the current migration Job and the StatefulSet of `pd`.
pub async fn dereference(
    client: &Client,
    pd: &PerspectiveDeployment,
    resolved: &Resolved,
) -> Result<Found, Error> {
    let namespace = &resolved.namespace;
    let (database_url, secret_problem) =
        read_database_urls(client, namespace, &pd.spec.database).await?;
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let job = jobs
        .get_opt(&resolved.target.job_name)
        .await?
        .map(|job| migration_job::state(&job));
    let statefulset = statefulsets
        .get_opt(&labels::workers_name(&resolved.name))
        .await?;
    Ok(Found {
        database_url,
        secret_problem,
        job,
        statefulset,
    })
}

/// The database's view of the deployment's schema, once something was migrated (the current
/// target's Job succeeded, or the status records an earlier target): `Err` says why it could
/// not be read. `None` before the first migration (no schema is expected yet) or without a URL.
pub async fn read_database(
    ctx: &Context,
    pd: &PerspectiveDeployment,
    r: &Resolved,
    previous: &PerspectiveDeploymentStatus,
    job: Option<&JobState>,
    url: Option<String>,
) -> Option<Result<DbStatus, DatabaseProblem>> {
    let migrated = job == Some(&JobState::Succeeded) || previous.migrated_hash.is_some();
    let url = url.filter(|_| migrated)?;
    let spec = &pd.spec;
    let names: Vec<String> = spec.perspectives.iter().map(|p| p.name.clone()).collect();
    let stale_after = f64::from(spec.worker.abandon_stale_instance_threshold_seconds);
    Some(
        ctx.lag
            .read(&r.key, &url, &spec.schema, &names, stale_after)
            .await,
    )
}

/// Why a deployment has no database URL, in its status and Events: the same words whether the
/// Secret or only its key is missing, after the spec field naming it.
const SECRET_MISSING: &str = "the Secret it names is missing or has no value under its key \
     (looked at again every few seconds)";

/// The message for the Secret named at `field` (e.g. `spec.database.secretRef`).
pub fn secret_missing(field: &str) -> String {
    format!("{field}: {SECRET_MISSING}")
}

/// The status queries' database URL, or why the deployment has none: every role's Secret
/// (migration Job, workers, status) must hold a URL, since a pod without its Secret never
/// starts; a missing Secret or key is reported (`SecretMissing`, naming each field) and looked
/// at again soon, not a reconcile error.
async fn read_database_urls(
    client: &Client,
    namespace: &str,
    database: &DatabaseSpec,
) -> Result<(Option<String>, Option<String>), Error> {
    let mut missing: Vec<&str> = Vec::new();
    let mut status_url = None;
    // Each distinct Secret is read once (by default all three roles share `secretRef`).
    let mut read: Vec<(&SecretKeyRef, Option<String>)> = Vec::new();
    for role in DatabaseRole::ALL {
        let (secret_ref, field) = database.secret_for(role);
        if secret_ref.name.is_empty() {
            // An invalid spec (validate says so).
            return Ok((None, None));
        }
        let url = match read.iter().find(|(r, _)| *r == secret_ref) {
            Some((_, url)) => url.clone(),
            None => {
                let url = read_url(client, namespace, secret_ref).await?;
                read.push((secret_ref, url.clone()));
                url
            }
        };
        match url {
            Some(url) if role == DatabaseRole::Status => status_url = Some(url),
            Some(_) => {}
            None if !missing.contains(&field) => missing.push(field),
            None => {}
        }
    }
    if missing.is_empty() {
        return Ok((status_url, None));
    }
    let problem = missing
        .iter()
        .map(|field| secret_missing(field))
        .collect::<Vec<_>>()
        .join("; ");
    Ok((None, Some(problem)))
}

/// The URL under `secret_ref`'s key, if its Secret exists and holds one.
async fn read_url(
    client: &Client,
    namespace: &str,
    secret_ref: &SecretKeyRef,
) -> Result<Option<String>, Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret = secrets.get_opt(&secret_ref.name).await?;
    let value = secret.as_ref().and_then(|secret| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(&secret_ref.key))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .or_else(|| {
                secret
                    .string_data
                    .as_ref()
                    .and_then(|d| d.get(&secret_ref.key).cloned())
            })
    });
    match value {
        Some(url) if !url.trim().is_empty() => Ok(Some(url.trim().to_owned())),
        _ => {
            // Which of the two is for the operator's log: the status says neither, so that it
            // tells no one who cannot read Secrets which ones exist and what keys they hold.
            debug!(
                namespace,
                secret = %secret_ref.name,
                key = %secret_ref.key,
                exists = secret.is_some(),
                "database Secret missing or without its key"
            );
            Ok(None)
        }
    }
}
