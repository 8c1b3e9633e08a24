-- wh_job_take_streams(perspective, max streams): take up to p_max_streams listed streams of the
-- perspective's job that no other session holds, and lock each like a rebuild must until the
-- caller's transaction ends: its head row in wh_streams (as a producer does: no append, and no
-- retirement of the stream, can interleave) and its cursor (created first when missing, so no
-- apply can start on it). Returns the streams, in order (locks are taken in stream order).
--
-- Listed streams that are active (have work pending) go first: live events on a listed stream
-- wait behind the backfill's gate (wh_backfill_gated) until its chunk commits, so a stream with
-- live traffic taken last kept its events waiting, and every claim re-read its gated rows, for
-- the whole job. At most 2 048 active streams are looked at per call, so a take stays
-- cheap beside 100 000 active streams (where those past the cap keep the listing's order).

CREATE OR REPLACE FUNCTION {{schema}}.wh_job_take_streams(p_perspective text, p_max_streams integer)
RETURNS SETOF uuid
LANGUAGE plpgsql AS $$
DECLARE
  v_streams uuid[];
BEGIN
  SELECT coalesce(array_agg(t.stream_id), '{}') INTO v_streams
  FROM (SELECT s.stream_id FROM {{schema}}.wh_perspective_job_streams s
        WHERE s.perspective_name = p_perspective
          AND s.stream_id IN (SELECT a.stream_id FROM {{schema}}.wh_active_streams a LIMIT 2048)
        LIMIT p_max_streams
        FOR UPDATE SKIP LOCKED) t;
  IF cardinality(v_streams) < p_max_streams THEN
    SELECT v_streams || coalesce(array_agg(t.stream_id), '{}') INTO v_streams
    FROM (SELECT s.stream_id FROM {{schema}}.wh_perspective_job_streams s
          WHERE s.perspective_name = p_perspective AND s.stream_id <> ALL (v_streams)
          ORDER BY s.stream_id
          LIMIT p_max_streams - cardinality(v_streams)
          FOR UPDATE SKIP LOCKED) t;
  END IF;
  IF cardinality(v_streams) = 0 THEN
    RETURN;
  END IF;
  v_streams := ARRAY(SELECT x FROM unnest(v_streams) AS x ORDER BY x);
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
