-- cleanup_completed_streams(instance, streams): retire drained streams from wh_active_streams
-- without losing a doorbell, and return the streams removed. A producer that saw a stream's row
-- (so did not ring) may commit new work just after a worker found the stream empty; so only
-- streams whose wh_streams row could be share-locked (`FOR SHARE SKIP LOCKED`: a producer in
-- flight holds that row until it commits, and its stream keeps its row) are retired, and only if
-- a later statement (a new snapshot, which sees every producer that committed before the lock)
-- finds no pending work. A producer arriving later waits for this transaction, finds the row
-- gone, re-inserts it and rings. Streams another instance owns are left alone.
--
-- Work rows of a perspective no longer subscribed to anything are deleted first: `migrate`
-- deletes a removed perspective's rows, but an append in flight when it committed (its trigger
-- had read the old subscriptions) can add one after; nothing applies such a row, and it would
-- pin its stream. They are looked for only in the streams with no pending work of a subscribed
-- perspective (one index probe per stream, stopping at the first row found), the only streams it
-- could retire: the settler and claim_work call this for streams that still have work, and
-- reading every pending row of a deep stream cost 20-30 ms per call at 40 000 rows.
--
-- enable_seqscan = off: the settler passes up to a few thousand streams at a time, and past a
-- thousand or so ids the planner prices one index probe per id above a sequential scan, reading
-- all of wh_streams and wh_perspective_events (25-160 ms per call at 100 000 streams, growing
-- with the tables). jit = off: without column statistics on the work table the planner guesses
-- 200 distinct streams, costs each "any work left?" probe as reading a thousand rows, and a batch
-- of a thousand streams lands past jit_above_cost, so JIT compiled the statement on every call
-- (200-380 ms for a statement that runs in milliseconds). It runs no user code.

CREATE OR REPLACE FUNCTION {{schema}}.cleanup_completed_streams(p_instance_id uuid, p_stream_ids uuid[])
RETURNS SETOF uuid
LANGUAGE plpgsql
SET enable_seqscan = off
SET jit = off
AS $$
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
