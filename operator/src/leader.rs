//! Lease-based leader election, so two or more operator replicas are safe: only the holder of
//! the `coordination.k8s.io` Lease reconciles. Losing the lease ends the process (as client-go
//! controllers do): a restarted replica rejoins the election with clean state, and a stale
//! leader never keeps writing next to a new one.
//!
//! A stopped leader releases the Lease; a standby notices within [`RELEASE_POLL`] (it reads the
//! Lease that often) and takes it at once, rather than when the lease it last read would have
//! expired (`kube-lease-manager` sleeps until then: up to `--lease-seconds`).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::reconcile::one_line;

/// Election settings.
#[derive(Debug, Clone)]
pub struct Election {
    pub lease_name: String,
    pub namespace: String,
    /// This replica's identity in the Lease (its pod name).
    pub identity: String,
    /// Seconds a lease stays valid without renewal; a killed leader is replaced after this.
    pub lease_seconds: u64,
}

/// Leadership held by this process.
pub struct Leadership {
    /// Cancelled when the lease is lost.
    pub lost: CancellationToken,
    stop: CancellationToken,
    manager: Arc<LeaseManager>,
    renewer: JoinHandle<()>,
}

/// How often a standby reads the Lease to see whether its holder released it.
pub const RELEASE_POLL: Duration = Duration::from_secs(1);

/// Waits until this replica holds the lease; `None` if `shutdown` fired first.
pub async fn acquire(
    client: Client,
    election: &Election,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Leadership>> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), &election.namespace);
    info!(lease = %election.lease_name, identity = %election.identity, "waiting for leadership");
    let manager = 'elected: loop {
        // A fresh manager reads the Lease first, so a released one is taken at once.
        let manager = LeaseManagerBuilder::new(client.clone(), &election.lease_name)
            .with_namespace(&election.namespace)
            .with_identity(&election.identity)
            .with_duration(election.lease_seconds)
            .with_grace(election.lease_seconds.div_ceil(3).max(1))
            .build()
            .await?;
        loop {
            tokio::select! {
                held = manager.changed() => if held? { break 'elected manager },
                _ = released(&leases, &election.lease_name) => continue 'elected,
                _ = shutdown.cancelled() => return Ok(None),
            }
        }
    };
    let manager = Arc::new(manager);
    info!(lease = %election.lease_name, identity = %election.identity, "became the leader");
    let lost = CancellationToken::new();
    let stop = CancellationToken::new();
    // `changed()` renews the lease while it runs and returns when the state changes.
    let renewer = tokio::spawn({
        let (manager, lost, stop) = (manager.clone(), lost.clone(), stop.clone());
        async move {
            loop {
                tokio::select! {
                    held = manager.changed() => match held {
                        Ok(true) => continue,
                        Ok(false) => warn!("lost the leader lease"),
                        Err(e) => warn!(error = %one_line(&e), "cannot renew the leader lease"),
                    },
                    _ = stop.cancelled() => return,
                }
                lost.cancel();
                return;
            }
        }
    });
    Ok(Some(Leadership {
        lost,
        stop,
        manager,
        renewer,
    }))
}

/// Returns once Lease `name` exists without a holder (released), reading it every
/// [`RELEASE_POLL`].
async fn released(leases: &Api<Lease>, name: &str) {
    loop {
        tokio::time::sleep(RELEASE_POLL).await;
        match leases.get_opt(name).await {
            Ok(Some(lease))
                if lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.as_ref())
                    .is_none() =>
            {
                return
            }
            Ok(_) => {}
            Err(e) => warn!(error = %one_line(&e), lease = name, "cannot read the leader lease"),
        }
    }
}

impl Leadership {
    /// Gives the lease up, so a standby takes over at once instead of after its expiry.
    pub async fn release(self) {
        self.stop.cancel();
        let _ = self.renewer.await;
        match tokio::time::timeout(Duration::from_secs(5), self.manager.release()).await {
            Ok(Ok(())) => info!("released the leader lease"),
            Ok(Err(e)) => warn!(error = %one_line(&e), "could not release the leader lease"),
            Err(_) => warn!("timed out releasing the leader lease"),
        }
    }
}
