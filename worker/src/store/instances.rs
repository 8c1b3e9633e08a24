//! Liveness of worker instances in `wh_service_instances`.

use uuid::Uuid;

use super::Store;

const RECORD_HEARTBEAT: &str = "SELECT {schema}.record_heartbeat($1, $2, $3, $4, $5)";
const CLEANUP_STALE_INSTANCES: &str = "SELECT {schema}.cleanup_stale_instances($1, $2)";
const DEREGISTER_INSTANCE: &str = "SELECT {schema}.deregister_instance($1)";

/// Who an instance is, as recorded with each heartbeat.
#[derive(Debug, Clone)]
pub struct InstanceInfo {
    pub instance_id: Uuid,
    pub service_name: String,
    pub host_name: String,
    pub process_id: i32,
    pub metadata: serde_json::Value,
}

impl Store {
    /// Register the instance or refresh its heartbeat.
    pub async fn record_heartbeat(&self, info: &InstanceInfo) -> Result<(), sqlx::Error> {
        sqlx::query(&self.sql(RECORD_HEARTBEAT))
            .bind(info.instance_id)
            .bind(&info.service_name)
            .bind(&info.host_name)
            .bind(info.process_id)
            .bind(&info.metadata)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Abandon instances (other than `instance_id`) silent for longer than `stale_seconds`:
    /// their streams and leases are released and the doorbell rings. Returns how many.
    pub async fn cleanup_stale_instances(
        &self,
        instance_id: Uuid,
        stale_seconds: f64,
    ) -> Result<i32, sqlx::Error> {
        sqlx::query_scalar(&self.sql(CLEANUP_STALE_INSTANCES))
            .bind(instance_id)
            .bind(stale_seconds)
            .fetch_one(self.pool())
            .await
    }

    /// Graceful shutdown: retire drained streams, give back the rest, leave.
    pub async fn deregister_instance(&self, instance_id: Uuid) -> Result<(), sqlx::Error> {
        sqlx::query(&self.sql(DEREGISTER_INSTANCE))
            .bind(instance_id)
            .execute(self.pool())
            .await?;
        Ok(())
    }
}
