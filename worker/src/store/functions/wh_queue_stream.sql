-- wh_queue_stream(stream, perspective, after version): queue a stream's stored history for one
-- perspective: a work row for each event past p_after_version whose type the perspective
-- subscribes to (the subscriptions the insert trigger reads for new events), then, if anything
-- was queued, pin the stream in wh_active_streams and ring the doorbell. Rows already queued are
-- kept. Returns the rows queued. Used by backfills and rebuilds (wh_job_requeue_streams).

CREATE OR REPLACE FUNCTION {{schema}}.wh_queue_stream(p_stream_id uuid, p_perspective text, p_after_version bigint DEFAULT 0)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
  v_partition integer := {{schema}}.compute_partition(p_stream_id);
  v_queued    bigint;
BEGIN
  INSERT INTO {{schema}}.wh_perspective_events
      (stream_id, perspective_name, event_id, stream_version, partition_number)
  SELECT e.stream_id, p_perspective, e.event_id, e.stream_version, v_partition
  FROM {{schema}}.wh_event_store e
  JOIN {{schema}}.wh_perspective_subscriptions s
    ON s.event_type = e.event_type AND s.perspective_name = p_perspective
  WHERE e.stream_id = p_stream_id AND e.stream_version > p_after_version
  ORDER BY e.stream_version
  ON CONFLICT DO NOTHING;
  GET DIAGNOSTICS v_queued = ROW_COUNT;
  IF v_queued > 0 THEN
    INSERT INTO {{schema}}.wh_active_streams (stream_id, partition_number)
    VALUES (p_stream_id, v_partition)
    ON CONFLICT (stream_id) DO NOTHING;
    PERFORM pg_notify('{{schema}}_work', '');
  END IF;
  RETURN v_queued;
END
$$;
