//! Liveness of worker instances in `wh_service_instances`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::Store;

// The subqueries read the rows as they were before the heartbeat (one statement, one snapshot;
// the function's write is not visible to them): the previous heartbeat's age, whether a peer is
// silent past the stale threshold ($6), so that the sweep runs only then (an idle worker's
// statements are few: issue 28), and how many peers are live (within it, and not stopping:
// hand_over_streams).
const RECORD_HEARTBEAT: &str =
    "SELECT (SELECT extract(epoch FROM now() - i.last_heartbeat_at)::float8
                                  FROM {schema}.wh_service_instances i WHERE i.instance_id = $1),
                                 EXISTS (SELECT 1 FROM {schema}.wh_service_instances i
                                         WHERE i.instance_id <> $1
                                           AND i.last_heartbeat_at < now() - make_interval(secs => $6)),
                                 (SELECT count(*) FROM {schema}.wh_service_instances i
                                  WHERE i.instance_id <> $1 AND i.stopping_since IS NULL
                                    AND i.last_heartbeat_at >= now() - make_interval(secs => $6)),
                                 {schema}.record_heartbeat($1, $2, $3, $4, $5)::text";
const CLEANUP_STALE_INSTANCES: &str = "SELECT {schema}.cleanup_stale_instances($1, $2)";
const DEREGISTER_INSTANCE: &str = "SELECT {schema}.deregister_instance($1)";
const HAND_OVER_STREAMS: &str = "SELECT {schema}.hand_over_streams($1, $2, $3)";

/// The key of `wh_service_instances.metadata` under which each heartbeat publishes the
/// instance's lock conflicts with other appliers over the last minute, by perspective (only
/// those that had any; `"*"`: whole `wh_drain` calls), e.g. `{"contention": {"customer_stats":
/// {"perMinute": 40, "sqlstate": "55P03"}}}`. The other keys are the config's
/// `worker.instanceMetadata`, which therefore may not use this one (validation says so).
pub use crate::config::CONTENTION_METADATA_KEY;

/// One perspective's lock conflicts over the last minute, as published in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LockConflicts {
    /// How many applies met one (each is retried).
    pub per_minute: u64,
    /// The SQLSTATE most of them had: 40P01, 40001 or 55P03.
    pub sqlstate: String,
}

/// What a heartbeat found, before it was recorded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heartbeat {
    /// The previous heartbeat's age in seconds (`None`: the instance was not registered).
    pub previous_age: Option<f64>,
    /// Whether another instance was silent past the stale threshold (a sweep would abandon it).
    pub stale_peers: bool,
    /// Other instances live by the stale threshold and not stopping.
    pub live_peers: i64,
}

/// Who an instance is, as recorded with each heartbeat.
#[derive(Debug, Clone)]
pub struct InstanceInfo {
    pub instance_id: Uuid,
    pub service_name: String,
    pub host_name: String,
    pub process_id: i32,
    pub metadata: serde_json::Value,
}

/// The metadata one heartbeat records: the config's `instance` key/values, plus
/// [`CONTENTION_METADATA_KEY`] when `conflicts` has any.
pub fn heartbeat_metadata(
    instance: &BTreeMap<String, String>,
    conflicts: &BTreeMap<String, LockConflicts>,
) -> serde_json::Value {
    let mut map: serde_json::Map<String, serde_json::Value> = instance
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    if !conflicts.is_empty() {
        map.insert(
            CONTENTION_METADATA_KEY.to_owned(),
            serde_json::to_value(conflicts).unwrap_or_default(),
        );
    }
    serde_json::Value::Object(map)
}

impl Store {
    /// Register the instance or refresh its heartbeat. Returns the age in seconds the
    /// previous heartbeat had, by the server's clock (`None`: the instance was not registered:
    /// new, deregistered, or abandoned by a peer's sweep).
    pub async fn record_heartbeat(
        &self,
        info: &InstanceInfo,
        stale_seconds: f64,
    ) -> Result<Heartbeat, sqlx::Error> {
        let mut c = self.quick_conn("record_heartbeat").await?;
        let (previous_age, stale_peers, live_peers, _): (Option<f64>, bool, i64, Option<String>) =
            c.deadline()
                .run(
                    sqlx::query_as(&self.sql(RECORD_HEARTBEAT))
                        .bind(info.instance_id)
                        .bind(&info.service_name)
                        .bind(&info.host_name)
                        .bind(info.process_id)
                        .bind(&info.metadata)
                        .bind(stale_seconds)
                        .fetch_one(&mut *c),
                )
                .await?;
        Ok(Heartbeat {
            previous_age,
            stale_peers,
            live_peers,
        })
    }

    /// Abandon instances (other than `instance_id`) silent for longer than `stale_seconds`:
    /// their streams and leases are released and the doorbell rings. Returns how many.
    pub async fn cleanup_stale_instances(
        &self,
        instance_id: Uuid,
        stale_seconds: f64,
    ) -> Result<i32, sqlx::Error> {
        let mut c = self.quick_conn("cleanup_stale_instances").await?;
        c.deadline()
            .run(
                sqlx::query_scalar(&self.sql(CLEANUP_STALE_INSTANCES))
                    .bind(instance_id)
                    .bind(stale_seconds)
                    .fetch_one(&mut *c),
            )
            .await
    }

    /// First step of a graceful shutdown: the streams this instance holds, except `keep` (being
    /// drained), go to its live peers at once; how many did.
    pub async fn hand_over_streams(
        &self,
        instance_id: Uuid,
        keep: &[Uuid],
        stale_seconds: f64,
    ) -> Result<i32, sqlx::Error> {
        let mut c = self.quick_conn("hand_over_streams").await?;
        c.deadline()
            .run(
                sqlx::query_scalar(&self.sql(HAND_OVER_STREAMS))
                    .bind(instance_id)
                    .bind(keep)
                    .bind(stale_seconds)
                    .fetch_one(&mut *c),
            )
            .await
    }

    /// Graceful shutdown: retire drained streams, give back the rest, leave.
    pub async fn deregister_instance(&self, instance_id: Uuid) -> Result<(), sqlx::Error> {
        let mut c = self.quick_conn("deregister_instance").await?;
        c.deadline()
            .run(
                sqlx::query(&self.sql(DEREGISTER_INSTANCE))
                    .bind(instance_id)
                    .execute(&mut *c),
            )
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metadata_keeps_the_configs_keys_and_adds_the_conflicts_when_any() {
        let zone = BTreeMap::from([("zone".to_owned(), "eu-1".to_owned())]);
        assert_eq!(
            heartbeat_metadata(&zone, &BTreeMap::new()),
            serde_json::json!({"zone": "eu-1"})
        );
        let conflicts = BTreeMap::from([(
            "customer_stats".to_owned(),
            LockConflicts {
                per_minute: 40,
                sqlstate: "40P01".into(),
            },
        )]);
        assert_eq!(
            heartbeat_metadata(&zone, &conflicts),
            serde_json::json!({
                "zone": "eu-1",
                "contention": {"customer_stats": {"perMinute": 40, "sqlstate": "40P01"}}
            })
        );
    }
}
