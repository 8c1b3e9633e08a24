-- move_to_dead_letters(instance, work ids): move poison work rows to wh_dead_letters with a
-- snapshot of their event, in one statement, so the stream can continue. The pairs' cursors lose
-- their Failed flag (4) and error: the failure is now the dead letter's (counted, listed and
-- replayed as such); a Failed flag left on a stream whose last event failed would never clear.
-- Idempotent: rows already gone are skipped. Returns the rows moved.

CREATE OR REPLACE FUNCTION {{schema}}.move_to_dead_letters(p_instance_id uuid, p_event_work_ids bigint[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  v_n integer;
BEGIN
  WITH moved AS (
    DELETE FROM {{schema}}.wh_perspective_events w
    WHERE w.event_work_id = ANY (p_event_work_ids)
    RETURNING w.*
  ),
  dead AS (
    INSERT INTO {{schema}}.wh_dead_letters
        (event_work_id, stream_id, perspective_name, event_id, stream_version, event_type, event,
         error, attempts, first_failed_at, dead_lettered_by)
    SELECT m.event_work_id, m.stream_id, m.perspective_name, m.event_id, m.stream_version, e.event_type,
           to_jsonb(e), m.error, m.attempts, m.created_at, p_instance_id
    FROM moved m
    JOIN {{schema}}.wh_event_store e ON e.event_id = m.event_id
    RETURNING stream_id, perspective_name
  ),
  cleared AS (
    UPDATE {{schema}}.wh_perspective_cursors c
       SET status = c.status & ~(4::smallint), error = NULL
    FROM (SELECT DISTINCT d.stream_id, d.perspective_name FROM dead d) p
    WHERE c.stream_id = p.stream_id AND c.perspective_name = p.perspective_name
      AND (c.status & 4) <> 0
  )
  SELECT count(*) INTO v_n FROM dead;
  RETURN v_n;
END
$$;
