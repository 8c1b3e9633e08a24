//! What a deployment refers to and what of it already exists: the database URL from the
//! Secret its spec names, the current migration target's Job and the worker StatefulSet.
//! Reads only.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::Client;

use super::error::Error;
use super::resolve::Resolved;
use crate::crd::{DatabaseSpec, PerspectiveDeployment};
use crate::labels;
use crate::migration_job::{self, JobState};

/// What was read for one reconcile.
#[derive(Debug, Clone)]
pub struct Found {
    /// The database URL, when the Secret holds one.
    pub database_url: Option<String>,
    /// Why there is none: the Secret or its key is missing (reported as `SecretMissing`).
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
        read_database_url(client, namespace, &pd.spec.database).await?;
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

/// The database URL from the Secret named in the spec, or why there is none: a missing Secret
/// or key is reported (`SecretMissing`) and looked at again soon, not a reconcile error.
async fn read_database_url(
    client: &Client,
    namespace: &str,
    database: &DatabaseSpec,
) -> Result<(Option<String>, Option<String>), Error> {
    let secret_ref = &database.secret_ref;
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
