//! The producer INSERT used by `perspective-worker append`: plain rows into `wh_event_store`,
//! so the insert trigger assigns versions and fans out work exactly as for any producer.

use sqlx::postgres::PgConnection;
use uuid::Uuid;

use crate::contract::NewEvent;

const INSERT_EVENTS: &str = "INSERT INTO {schema}.wh_event_store
         (event_id, stream_id, stream_version, event_type, event_data, metadata, scope)
     SELECT e.event_id, e.stream_id, e.stream_version,
            e.event_type, e.event_data, e.metadata, e.scope
     FROM unnest($1::uuid[], $2::uuid[], $3::int8[], $4::text[], $5::jsonb[], $6::jsonb[], $7::jsonb[])
          WITH ORDINALITY AS e(event_id, stream_id, stream_version, event_type, event_data, metadata, scope, ord)
     ORDER BY e.ord
     RETURNING event_id, stream_id, stream_version";

/// Insert `events` in order; returns (event_id, stream_id, stream_version) of each.
pub async fn insert_events(
    conn: &mut PgConnection,
    schema: &str,
    events: &[NewEvent],
) -> Result<Vec<(Uuid, Uuid, i64)>, sqlx::Error> {
    let column = |f: fn(&NewEvent) -> serde_json::Value| events.iter().map(f).collect::<Vec<_>>();
    sqlx::query_as(&super::sql(schema, INSERT_EVENTS))
        .bind(events.iter().map(|e| e.event_id).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.stream_id).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.stream_version).collect::<Vec<_>>())
        .bind(
            events
                .iter()
                .map(|e| e.event_type.clone())
                .collect::<Vec<_>>(),
        )
        .bind(column(|e| e.event_data.clone()))
        .bind(column(|e| e.metadata.clone()))
        .bind(column(|e| e.scope.clone()))
        .fetch_all(&mut *conn)
        .await
}
