-- hand_over_streams(instance, keep, stale seconds): the first step of a graceful stop. It marks the
-- instance stopping (`stopping_since`): claims then leave it out of the share of unowned streams
-- (their new streams go to the peers at once, not after the deregistration), and its in-flight
-- wh_drain calls take no further pair. Every stream the instance holds, except `keep` (those it is
-- draining now), goes at once to one of its live peers that are not stopping themselves: the one
-- its partition falls to among them (`partition_number % peers = rank`, the claim's share), or to
-- nobody (unowned) when no peer is live. The doorbell ('orphan') makes the peers recount the live
-- workers and claim, and a claim re-offers every stream its caller holds, so their pending events
-- are applied while this instance finishes its in-flight drains and flushes. Before, they waited
-- for deregister_instance at the end of the stop; and released to nobody while this instance still
-- counted as live, half of them would have waited anyway, outside the only peer's share.
-- Held streams with nothing pending are retired first (cleanup_completed_streams), as the
-- deregistration would retire them: handed over, to nobody when no peer is live, such a stream
-- kept its active row, so the next event on it rang no doorbell and waited for a claim's poll.
-- Returns how many streams were handed over.
--
-- Rows another session has locked (a settle retiring them, a producer's trigger) are skipped,
-- not waited for: deregister_instance gives back whatever is left. A drain of a handed-over
-- stream still running here is harmless: a drain applies only the streams it owns when it
-- starts, and the cursor lock serialises every applier of a (stream, perspective).

CREATE OR REPLACE FUNCTION {{schema}}.hand_over_streams(
    p_instance_id uuid, p_keep uuid[], p_stale_seconds double precision)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  v_peers uuid[];
  v_moved integer;
  v_marked integer;
BEGIN
  UPDATE {{schema}}.wh_service_instances
     SET stopping_since = now()
   WHERE instance_id = p_instance_id AND stopping_since IS NULL;
  GET DIAGNOSTICS v_marked = ROW_COUNT;
  PERFORM {{schema}}.cleanup_completed_streams(p_instance_id, ARRAY(
    SELECT h.stream_id FROM {{schema}}.wh_active_streams h
    WHERE h.assigned_instance_id = p_instance_id
      AND h.stream_id <> ALL (coalesce(p_keep, '{}'))));
  v_peers := ARRAY(
    SELECT i.instance_id FROM {{schema}}.wh_service_instances i
    WHERE i.instance_id <> p_instance_id AND i.stopping_since IS NULL
      AND i.last_heartbeat_at >= now() - make_interval(secs => p_stale_seconds)
    ORDER BY i.instance_id);
  UPDATE {{schema}}.wh_active_streams a
     SET assigned_instance_id = v_peers[1 + a.partition_number % nullif(cardinality(v_peers), 0)]
  WHERE a.stream_id IN (SELECT h.stream_id FROM {{schema}}.wh_active_streams h
                        WHERE h.assigned_instance_id = p_instance_id
                          AND h.stream_id <> ALL (coalesce(p_keep, '{}'))
                        FOR UPDATE SKIP LOCKED)
    AND a.assigned_instance_id = p_instance_id;
  GET DIAGNOSTICS v_moved = ROW_COUNT;
  -- Also when nothing moved: the peers recount the live workers (their share of the drain).
  IF v_moved > 0 OR v_marked > 0 THEN
    PERFORM pg_notify('{{schema}}_work', 'orphan');
  END IF;
  RETURN v_moved;
END
$$;
