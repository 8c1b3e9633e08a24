-- wh_applied_by_all(stream, versions, types): of the events p_versions of p_stream_id (with
-- their types p_types), the versions that every perspective subscribed to the event's type has
-- applied: its cursor is at or past the event, unless its latest dead letter for that event was
-- not replayed (the cursor moves past a dead-lettered event, which was never applied); a replayed
-- one counts even when the cursor never passed it (a stream's last event). The one definition of
-- "applied by every perspective": the compiled apply functions use it for the lifecycle stages and
-- the `<schema>_applied` NOTIFY; startup reconciliation and dead-letter replay use it too.

CREATE OR REPLACE FUNCTION {{schema}}.wh_applied_by_all(p_stream_id uuid, p_versions bigint[], p_types text[])
RETURNS SETOF bigint
LANGUAGE sql STABLE AS $$
  SELECT x.version FROM unnest(p_versions, p_types) AS x(version, type)
  WHERE NOT EXISTS (
    SELECT 1 FROM {{schema}}.wh_perspective_subscriptions s
    LEFT JOIN {{schema}}.wh_perspective_cursors c
           ON c.stream_id = p_stream_id AND c.perspective_name = s.perspective_name
    LEFT JOIN LATERAL (
      SELECT d.recovery_status = 'replayed' AS replayed FROM {{schema}}.wh_dead_letters d
      WHERE d.stream_id = p_stream_id AND d.stream_version = x.version
        AND d.perspective_name = s.perspective_name
      ORDER BY d.dead_letter_id DESC LIMIT 1) d ON true
    WHERE s.event_type = x.type
      AND CASE WHEN d.replayed IS NULL THEN coalesce(c.last_version, 0) < x.version
               ELSE NOT d.replayed END)
$$;
