//! What every reconcile shares: the client, the Event publisher, the metrics, the operator's
//! options and the database readers.

use std::sync::Arc;
use std::time::Duration;

use kube::{Client, Resource, ResourceExt};
use tracing::warn;

use super::error::describe;
use crate::crd::PerspectiveDeployment;
use crate::events::{self, Event};
use crate::lag::LagReader;
use crate::metrics::OperatorMetrics;
use crate::pod_policy::PodPolicy;

/// Operator-wide settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// Worker image of deployments that do not name one.
    pub default_worker_image: String,
    /// How often status (lag) is refreshed when nothing else happens.
    pub status_interval: Duration,
    /// Delay before a failed migration Job runs again, doubled per failure (20 × at most); the
    /// same for reruns after the schema had gone (the first one immediate).
    pub migration_retry_base: Duration,
    /// Worker images must start with one of these (`--allowed-image-prefix`); empty: any image.
    pub allowed_image_prefixes: Vec<String>,
    /// Priority classes and service accounts a deployment may name.
    pub pod_policy: PodPolicy,
    /// Pods get AppArmor `RuntimeDefault` (`--apparmor-runtime-default`; kubelet refuses such
    /// pods on nodes without AppArmor).
    pub app_armor_runtime_default: bool,
}

impl Options {
    /// The worker image `spec` runs: its own, else the operator's default.
    pub fn image_of(&self, spec: &crate::crd::PerspectiveDeploymentSpec) -> String {
        spec.image
            .clone()
            .unwrap_or_else(|| self.default_worker_image.clone())
    }
}

/// Shared state of all reconciles.
pub struct Context {
    pub client: Client,
    pub events: events::Publisher,
    pub metrics: Arc<OperatorMetrics>,
    pub options: Options,
    pub lag: LagReader,
}

impl Context {
    /// Publishes a Kubernetes Event about `pd`; a failure to publish is logged, never fatal.
    pub async fn publish(&self, pd: &PerspectiveDeployment, event: Event) {
        if let Err(e) = self.events.publish(&event, &pd.object_ref(&())).await {
            warn!(
                namespace = pd.namespace().unwrap_or_default(),
                name = %pd.name_any(),
                error = %describe(&e),
                reason = event.reason,
                "could not publish event"
            );
        }
    }
}
