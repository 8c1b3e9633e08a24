//! Runs the reconciler: watches `PerspectiveDeployment`s (reacting to spec changes, not to its
//! own status writes) and the StatefulSets and Jobs they own, until shutdown.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Controller;
use kube::runtime::{predicates, reflector, watcher, Predicate, WatchStreamExt};
use kube::Client;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::crd::PerspectiveDeployment;
use crate::labels;
use crate::reconcile::{describe, error_policy, one_line, reconcile, Context};

/// A hash of the day-2 action annotations (`crate::action_job`), so that setting one triggers a
/// reconcile at once although it leaves the generation as it was.
fn action_annotations(pd: &PerspectiveDeployment) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let annotations = pd.metadata.annotations.as_ref()?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for action in crate::action_job::Action::ALL {
        annotations.get(action.annotation()).hash(&mut hasher);
    }
    Some(hasher.finish())
}

/// Which namespace to watch; `None` watches all.
pub fn deployments_api(client: Client, namespace: Option<&str>) -> Api<PerspectiveDeployment> {
    match namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    }
}

/// Fails with a clear message when the CRD is not installed or not readable.
pub async fn check_crd(api: &Api<PerspectiveDeployment>) -> anyhow::Result<()> {
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => anyhow::bail!(
            "the PerspectiveDeployment CRD is not installed: run `kubectl apply --server-side -f crds/` \
             (or `perspective-operator crd | kubectl apply --server-side -f -`)"
        ),
        Err(e) => Err(anyhow::anyhow!(
            "cannot list PerspectiveDeployments: {}",
            describe(&e)
        )),
    }
}

/// Reconciles until `shutdown` fires; in-flight reconciles finish first.
pub async fn run(ctx: Arc<Context>, namespace: Option<String>, shutdown: CancellationToken) {
    let client = ctx.client.clone();
    let pds = deployments_api(client.clone(), namespace.as_deref());
    let (reader, writer) = reflector::store();
    ctx.metrics.export_deployments(reader.clone());
    // Status writes bump resourceVersion but not generation: filtering on generation keeps the
    // operator from reacting to its own status patches. Lag refreshes come from requeues.
    let trigger = watcher(pds, watcher::Config::default())
        .default_backoff()
        .modify(slim)
        .reflect(writer)
        .applied_objects()
        .predicate_filter(
            predicates::generation.combine(action_annotations),
            Default::default(),
        );
    let children = watcher::Config::default().labels(&format!(
        "{}={}",
        labels::MANAGED_BY,
        labels::FIELD_MANAGER
    ));
    let (sts, jobs): (Api<StatefulSet>, Api<Job>) = match &namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client, ns),
        ),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    Controller::for_stream(trigger, reader)
        .owns(sts, children.clone())
        .owns(jobs, children)
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => {
                    debug!(
                        namespace = object.namespace.as_deref().unwrap_or_default(),
                        name = %object.name,
                        "reconciled"
                    )
                }
                // A failed reconcile was logged by `error_policy`, with the object's fields.
                Err(kube::runtime::controller::Error::ReconcilerFailed(_, object)) => {
                    debug!(
                        namespace = object.namespace.as_deref().unwrap_or_default(),
                        name = %object.name,
                        "reconcile failed"
                    )
                }
                Err(e) => warn!(error = %one_line(&e), "controller"),
            }
        })
        .await;
}

/// The annotations of a `PerspectiveDeployment` the operator reads (its own domain's).
const OWN_ANNOTATIONS: &str = "perspectives.dev/";

/// What the cache keeps of a `PerspectiveDeployment`: no `managedFields` and none of the
/// annotations but the operator's own. A CR author could otherwise make every cached object up
/// to 256 KiB of annotations (the API server's bound) larger than its spec, which the CRD
/// bounds; in a cluster-wide operator, one namespace's objects would cost every tenant memory.
pub fn slim(pd: &mut PerspectiveDeployment) {
    pd.metadata.managed_fields = None;
    if let Some(annotations) = pd.metadata.annotations.as_mut() {
        annotations.retain(|key, _| key.starts_with(OWN_ANNOTATIONS));
    }
}

/// What a log line says about the namespaces watched: the one given, or `*` for all (never
/// `None`, which reads like a namespace of that name).
pub fn scope(watch_namespace: Option<&str>) -> &str {
    watch_namespace.unwrap_or("*")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    #[test]
    fn the_cache_drops_managed_fields_and_foreign_annotations() {
        let mut pd: PerspectiveDeployment = serde_json::from_value(serde_json::json!({
            "apiVersion": "perspectives.dev/v1alpha1",
            "kind": "PerspectiveDeployment",
            "metadata": {
                "name": "shop",
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "x".repeat(1000),
                    "perspectives.dev/rebuild": "orders",
                },
            },
            "spec": {"schema": "shop", "database": {"secretRef": {"name": "db"}},
                     "perspectives": [{"name": "p", "handlers": {"A": "SELECT 1"}}]},
        }))
        .unwrap();
        pd.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        let spec = serde_json::to_value(&pd.spec).unwrap();
        slim(&mut pd);
        assert_eq!(pd.metadata.managed_fields, None);
        assert_eq!(
            pd.metadata
                .annotations
                .unwrap()
                .into_iter()
                .collect::<Vec<_>>(),
            [("perspectives.dev/rebuild".to_owned(), "orders".to_owned())]
        );
        assert_eq!(
            serde_json::to_value(&pd.spec).unwrap(),
            spec,
            "the spec is kept"
        );
    }

    #[test]
    fn the_watched_scope_is_never_none() {
        assert_eq!(super::scope(Some("shop")), "shop");
        assert_eq!(super::scope(None), "*");
    }
}
