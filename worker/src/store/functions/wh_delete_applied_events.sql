-- wh_delete_applied_events(older than): retention, the one way to delete from the append-only
-- event store. Deletes the events created more than p_older_than ago that nothing still needs: no
-- pending work row and no dead letter waiting for a replay (a replay reads the event from the
-- store). Returns how many it deleted. It marks its transaction through the
-- `perspective.retention` setting (naming this schema), which wh_event_store_immutable lets
-- through. Deliberate and irreversible: a rebuild, a backfill of a new perspective and an eventId
-- rewind replay only the events that are left.

CREATE OR REPLACE FUNCTION {{schema}}.wh_delete_applied_events(p_older_than interval)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
  v_n bigint;
BEGIN
  IF p_older_than IS NULL OR p_older_than < interval '0' THEN
    RAISE EXCEPTION 'wh_delete_applied_events: the age must be a non-negative interval, got %',
        coalesce(p_older_than::text, 'NULL') USING ERRCODE = '22023';
  END IF;
  PERFORM set_config('perspective.retention', '{{schema}}', true);
  DELETE FROM {{schema}}.wh_event_store e
  WHERE e.created_at < now() - p_older_than
    AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                    WHERE w.stream_id = e.stream_id AND w.stream_version = e.stream_version
                      AND w.processed_at IS NULL)
    AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_dead_letters d
                    WHERE d.event_id = e.event_id AND d.recovery_status = 'pending');
  GET DIAGNOSTICS v_n = ROW_COUNT;
  PERFORM set_config('perspective.retention', '', true);
  RETURN v_n;
END
$$;
