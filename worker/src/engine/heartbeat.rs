//! Heartbeats in `wh_service_instances`, abandoning instances that stopped heartbeating, and
//! the pending-events and lag gauges.

use std::sync::Arc;
use std::time::Duration;

use super::Shared;
use crate::store::instances::InstanceInfo;

/// The heartbeat task.
pub(crate) struct Heartbeat {
    shared: Arc<Shared>,
    /// Who this instance is, as recorded with each heartbeat.
    instance: InstanceInfo,
}

impl Heartbeat {
    pub(crate) fn new(shared: Arc<Shared>, service_name: &str) -> Self {
        let instance = InstanceInfo {
            instance_id: shared.instance_id,
            service_name: service_name.to_string(),
            host_name: std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()),
            process_id: std::process::id() as i32,
            metadata: serde_json::to_value(&shared.config.worker.instance_metadata)
                .unwrap_or_default(),
        };
        Heartbeat { shared, instance }
    }

    /// One heartbeat plus a stale-instance sweep. Returns how many instances were abandoned.
    pub(crate) async fn beat(&self) -> Result<i32, sqlx::Error> {
        let shared = &self.shared;
        shared.store.record_heartbeat(&self.instance).await?;
        let abandoned = shared
            .store
            .cleanup_stale_instances(
                shared.instance_id,
                shared
                    .config
                    .worker
                    .abandon_stale_instance_threshold_seconds as f64,
            )
            .await?;
        // Lag per perspective for /metrics (one small aggregate per heartbeat).
        let pending = shared.store.pending_per_perspective().await?;
        for p in &shared.config.perspectives {
            let (n, age) = pending
                .iter()
                .find(|(name, _, _)| *name == p.name)
                .map_or((0, 0.0), |(_, n, age)| (*n, *age));
            let label = [p.name.as_str()];
            shared
                .metrics
                .pending_events
                .with_label_values(&label)
                .set(n);
            shared
                .metrics
                .lag_seconds
                .with_label_values(&label)
                .set(age);
        }
        if abandoned > 0 {
            tracing::warn!(
                abandoned,
                "abandoned silent worker instances; their streams are up for grabs"
            );
            shared.hooks.request_immediate_poll();
        }
        Ok(abandoned)
    }

    pub(crate) async fn run(self) {
        let every =
            Duration::from_secs(self.shared.config.worker.heartbeat_interval_seconds.max(1) as u64);
        loop {
            tokio::select! {
                _ = self.shared.shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            if let Err(e) = self.beat().await {
                tracing::warn!(error = %crate::db::describe_error(&e, None), "heartbeat failed");
            }
        }
    }
}
