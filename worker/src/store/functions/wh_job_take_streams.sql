-- wh_job_take_streams(perspective, max streams): take up to p_max_streams listed streams of the
-- perspective's job that no other session holds, and lock each like a rebuild must until the
-- caller's transaction ends: its head row in wh_streams (as a producer does: no append, and no
-- retirement of the stream, can interleave) and its cursor (created first when missing, so no
-- apply can start on it). Returns the streams, in order (locks are taken in stream order).

CREATE OR REPLACE FUNCTION {{schema}}.wh_job_take_streams(p_perspective text, p_max_streams integer)
RETURNS SETOF uuid
LANGUAGE plpgsql AS $$
DECLARE
  v_streams uuid[];
BEGIN
  SELECT array_agg(t.stream_id ORDER BY t.stream_id) INTO v_streams
  FROM (SELECT s.stream_id FROM {{schema}}.wh_perspective_job_streams s
        WHERE s.perspective_name = p_perspective
        ORDER BY s.stream_id
        LIMIT p_max_streams
        FOR UPDATE SKIP LOCKED) t;
  IF v_streams IS NULL THEN
    RETURN;
  END IF;
  PERFORM 1 FROM {{schema}}.wh_streams s
  WHERE s.stream_id = ANY (v_streams) ORDER BY s.stream_id FOR UPDATE;
  INSERT INTO {{schema}}.wh_perspective_cursors (stream_id, perspective_name)
  SELECT x, p_perspective FROM unnest(v_streams) AS x ORDER BY 1
  ON CONFLICT DO NOTHING;
  PERFORM 1 FROM {{schema}}.wh_perspective_cursors c
  WHERE c.stream_id = ANY (v_streams) AND c.perspective_name = p_perspective
  ORDER BY c.stream_id FOR UPDATE;
  RETURN QUERY SELECT unnest(v_streams);
END
$$;
