-- 0012: retiring a stream no longer reads all of its pending work rows.
--
-- cleanup_completed_streams (as in 0006) first deleted the work rows of perspectives no longer
-- subscribed to anything, with a statement that read every pending row of every stream it was
-- given. The settler and claim_work call it for streams that still have work, so a stream with a
-- deep backlog (one hot stream holding tens of thousands of events) paid a read of its whole
-- backlog on every call: measured 20–30 ms per call for 40 000 pending rows. Now those rows are
-- looked for only in streams with no pending work of a subscribed perspective (one index probe
-- per stream, stopping at the first row found), which are the only streams it could retire.
-- Such rows in a busy stream wait until the stream's other work is done; nothing applies them,
-- and they only ever kept the stream from being retired.
CREATE OR REPLACE FUNCTION {{schema}}.cleanup_completed_streams(p_instance_id uuid, p_stream_ids uuid[])
RETURNS SETOF uuid
LANGUAGE plpgsql AS $$
DECLARE
  v_locked uuid[];
  v_idle   uuid[];
BEGIN
  SELECT array_agg(x.stream_id) INTO v_locked
  FROM (SELECT s.stream_id FROM {{schema}}.wh_streams s
        WHERE s.stream_id = ANY (p_stream_ids)
        ORDER BY s.stream_id
        FOR SHARE SKIP LOCKED) x;
  IF v_locked IS NULL THEN
    RETURN;
  END IF;
  -- Work of a perspective no longer subscribed to anything: `migrate` deleted the removed
  -- perspective's rows, but an append in flight when it committed (its trigger had read the old
  -- subscriptions) can add one after. Nothing applies such a row; it would pin its stream.
  v_idle := ARRAY(
    SELECT x.stream_id FROM unnest(v_locked) AS x(stream_id)
    WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                      WHERE w.stream_id = x.stream_id AND w.processed_at IS NULL
                        AND EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_subscriptions s
                                    WHERE s.perspective_name = w.perspective_name)
                      OFFSET 0));
  IF cardinality(v_idle) > 0 THEN
    DELETE FROM {{schema}}.wh_perspective_events w
    WHERE w.stream_id = ANY (v_idle) AND w.processed_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_subscriptions s
                      WHERE s.perspective_name = w.perspective_name);
  END IF;
  -- A new statement, so a new snapshot: it sees every producer that committed before the lock.
  RETURN QUERY
  DELETE FROM {{schema}}.wh_active_streams a
  WHERE a.stream_id = ANY (v_locked)
    AND (a.assigned_instance_id = p_instance_id OR a.assigned_instance_id IS NULL)
    AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                    WHERE w.stream_id = a.stream_id AND w.processed_at IS NULL
                    OFFSET 0)
  RETURNING a.stream_id;
END
$$;
