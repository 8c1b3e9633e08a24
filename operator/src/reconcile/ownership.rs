//! The operator never modifies, adopts or deletes an object it does not control: before any
//! child is written, every name the deployment's children take is looked up, and one that
//! exists without this deployment as its controller (an owner reference with `controller:
//! true` and the deployment's uid) stops the apply step (`Degraded=ChildRejected`, naming it).
//! A name taken by a neighbour's object would otherwise be rewritten by the server-side apply
//! and garbage-collected with the deployment.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ObjectMeta};
use kube::core::NamespaceResourceScope;
use kube::{Client, Resource};

use super::error::Error;
use super::resolve::Resolved;
use crate::labels;

/// Whether `meta` names `uid` as its controller.
pub fn controlled_by(meta: &ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// The `ChildRejected` message for objects (`Kind name`) that exist but are not controlled by
/// this deployment.
pub fn foreign_message(foreign: &[String]) -> String {
    format!(
        "{} already exist{} and {} not controlled by this PerspectiveDeployment: the operator \
         never modifies or adopts an object it does not control; rename the deployment or \
         remove {}",
        foreign.join(", "),
        if foreign.len() == 1 { "s" } else { "" },
        if foreign.len() == 1 { "is" } else { "are" },
        if foreign.len() == 1 { "it" } else { "them" },
    )
}

/// The children's names that exist in the namespace but are not controlled by `uid`, as
/// `Kind name`, in the order the apply step writes them.
pub async fn foreign_children(
    client: &Client,
    r: &Resolved,
    uid: &str,
) -> Result<Vec<String>, Error> {
    let workers = labels::workers_name(&r.name);
    let mut found = Vec::new();
    found.extend(not_ours::<Job>(client, r, &r.target.job_name, uid).await?);
    found.extend(not_ours::<ConfigMap>(client, r, &r.config_map_name, uid).await?);
    let service = labels::service_name(&r.name);
    found.extend(not_ours::<Service>(client, r, &service, uid).await?);
    found.extend(not_ours::<PodDisruptionBudget>(client, r, &workers, uid).await?);
    found.extend(not_ours::<StatefulSet>(client, r, &workers, uid).await?);
    Ok(found)
}

/// `Kind name` if object `name` of kind `K` exists and is not controlled by `uid`.
async fn not_ours<K>(
    client: &Client,
    r: &Resolved,
    name: &str,
    uid: &str,
) -> Result<Option<String>, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), &r.namespace);
    Ok(api
        .get_metadata_opt(name)
        .await?
        .filter(|found| !controlled_by(&found.metadata, uid))
        .map(|_| format!("{} {name}", K::kind(&()))))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    use super::*;

    fn owned(uid: &str, controller: Option<bool>) -> ObjectMeta {
        ObjectMeta {
            owner_references: Some(vec![OwnerReference {
                uid: uid.into(),
                controller,
                ..OwnerReference::default()
            }]),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn only_a_controller_reference_with_the_deployments_uid_is_control() {
        assert!(controlled_by(&owned("u1", Some(true)), "u1"));
        assert!(
            !controlled_by(&owned("u2", Some(true)), "u1"),
            "another owner"
        );
        assert!(
            !controlled_by(&owned("u1", None), "u1"),
            "owner, not controller"
        );
        assert!(!controlled_by(&owned("u1", Some(false)), "u1"));
        assert!(!controlled_by(&ObjectMeta::default(), "u1"), "no owner");
    }

    #[test]
    fn the_message_names_every_foreign_object() {
        assert_eq!(
            foreign_message(&["PodDisruptionBudget victim".into()]),
            "PodDisruptionBudget victim already exists and is not controlled by this \
             PerspectiveDeployment: the operator never modifies or adopts an object it does not \
             control; rename the deployment or remove it"
        );
        let two = foreign_message(&["Service victim-workers".into(), "StatefulSet victim".into()]);
        assert!(
            two.starts_with("Service victim-workers, StatefulSet victim already exist and are"),
            "{two}"
        );
    }
}
