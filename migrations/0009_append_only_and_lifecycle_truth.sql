-- 0009: the event store refuses DELETE and TRUNCATE as it refuses UPDATE, except for the
-- documented retention function; and an event dead-lettered in one perspective is not "applied
-- by every perspective" (no `<schema>_applied` NOTIFY, no PostAllPerspectives/PostLifecycle, no
-- orphan replay) until its dead letter is replayed.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

-- As in 0001, except for a DELETE made by wh_delete_applied_events (which marks its
-- transaction through the `perspective.retention` setting, naming this schema).
CREATE OR REPLACE FUNCTION {{schema}}.wh_event_store_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' AND current_setting('perspective.retention', true) = '{{schema}}' THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION '{{schema}}.wh_event_store is append-only: % is not allowed', TG_OP
    USING ERRCODE = 'WH405',
          HINT = CASE WHEN TG_OP = 'DELETE'
                      THEN 'append a compensating event instead; old applied events may be removed with {{schema}}.wh_delete_applied_events(interval)'
                      ELSE 'append a compensating event instead' END;
END
$$;

CREATE TRIGGER wh_event_store_no_delete
  BEFORE DELETE ON {{schema}}.wh_event_store
  FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.wh_event_store_immutable();
CREATE TRIGGER wh_event_store_no_truncate
  BEFORE TRUNCATE ON {{schema}}.wh_event_store
  FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.wh_event_store_immutable();

-- Retention: deletes events created more than p_older_than ago that nothing still needs — no
-- pending work row and no dead letter waiting for a replay (a replay reads the event from the
-- store). Returns how many it deleted. Deliberate and irreversible: a rebuild, a backfill of a
-- new perspective and an eventId rewind replay only the events that are left.
CREATE FUNCTION {{schema}}.wh_delete_applied_events(p_older_than interval)
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

CREATE INDEX wh_dead_letters_event ON {{schema}}.wh_dead_letters (stream_id, stream_version);

-- As in 0004, and a perspective has applied a version only if its latest dead letter for it
-- (if any) was replayed: its cursor moves past a dead-lettered event, which was never applied.
-- A replayed one counts even when the cursor never passed it (a stream's last event).
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
