-- wh_job_requeue_streams(perspective, streams, apply, ...): catch up streams taken by
-- wh_job_take_streams (after their `reset`, for a rebuild): their cursors and pending work for
-- the perspective go, and they leave the job's list (which lifts a backfill's gate in the same
-- commit). Then either every stored event of a subscribed type is queued again (wh_queue_stream,
-- ringing the doorbell) for the workers to apply, or, with p_apply, each stream's history is
-- applied here, through the perspective's compiled apply function, in the same commit (a rebuilt
-- stream is never seen reset but not yet replayed), without work rows: all streams in one call of
-- its batch function, or, when that fails, stream by stream, where what an apply leaves (a
-- failing event and what follows it) is queued for the workers' usual retries. It rings the
-- doorbell when a worker holds one of the streams (see below). Returns the rows
-- queued and the events applied. A job that keeps cursors (a kept blue/green version catching
-- up for a rollback) keeps them and applies only the events after them.

CREATE OR REPLACE FUNCTION {{schema}}.wh_job_requeue_streams(
    p_perspective text, p_stream_ids uuid[], p_apply boolean DEFAULT false,
    p_debug boolean DEFAULT false, p_retry_base_ms double precision DEFAULT 1000,
    p_retry_max_ms double precision DEFAULT 300000)
RETURNS TABLE (o_queued bigint, o_applied bigint)
LANGUAGE plpgsql AS $$
DECLARE
  v_stream   uuid;
  v_queued   bigint := 0;
  v_applied  bigint := 0;
  v_n        integer;
  v_function text;
  v_call     text;
  v_events   uuid[];
  v_versions bigint[];
  v_keep     boolean;
  v_batch    text;
  b_streams  uuid[];
  b_events   uuid[];
  b_versions bigint[];
  v_cancelled integer;
  v_batched  boolean := false;
BEGIN
  SELECT coalesce(bool_or(j.keep_cursors), false) INTO v_keep FROM {{schema}}.wh_perspective_jobs j
  WHERE j.perspective_name = p_perspective;
  IF p_apply THEN
    SELECT p.apply_function INTO v_function FROM {{schema}}.wh_perspectives p
    WHERE p.perspective_name = p_perspective;
    -- Work ids are only completed, so placeholders do (there are no rows to delete).
    v_call := format('SELECT o_applied FROM {{schema}}.%I($1, array_fill(0::bigint, ARRAY[cardinality($2)]), $2, $3, true, $4, false, $5, $6, false, true, false)',
                     v_function);
    -- Its batch function (compile/batch_function.sql) is named as it is, with its own prefix
    -- (store::names).
    v_batch := 'wh_batch_' || substr(v_function, length('wh_apply_') + 1);
  END IF;
  IF NOT v_keep THEN
    DELETE FROM {{schema}}.wh_perspective_cursors
    WHERE stream_id = ANY (p_stream_ids) AND perspective_name = p_perspective;
  END IF;
  DELETE FROM {{schema}}.wh_perspective_events
  WHERE stream_id = ANY (p_stream_ids) AND perspective_name = p_perspective;
  IF v_function IS NOT NULL AND NOT v_keep THEN
    -- Every stream's history at once, through the batch function: one read of the events and
    -- one loop, not an apply call per stream (a listed stream with a few events cost as much
    -- as one with a hundred). The cursors were deleted above; they are written in one
    -- statement. If anything fails it is undone, and the streams are applied one by one below,
    -- which isolates the failing event.
    SELECT array_agg(e.stream_id ORDER BY x.k, e.stream_version),
           array_agg(e.event_id ORDER BY x.k, e.stream_version),
           array_agg(e.stream_version ORDER BY x.k, e.stream_version)
      INTO b_streams, b_events, b_versions
    FROM unnest(p_stream_ids) WITH ORDINALITY AS x(s, k)
    JOIN {{schema}}.wh_event_store e ON e.stream_id = x.s
    JOIN {{schema}}.wh_perspective_subscriptions s
      ON s.event_type = e.event_type AND s.perspective_name = p_perspective;
    IF b_events IS NULL THEN
      v_batched := true;
    ELSE
      BEGIN
        EXECUTE format('SELECT o_applied, o_cancelled FROM {{schema}}.%I($1, $2, $3, NULL::timestamptz)', v_batch)
          INTO v_n, v_cancelled USING b_streams, b_events, b_versions;
        IF v_cancelled IS NULL THEN
          INSERT INTO {{schema}}.wh_perspective_cursors
              (stream_id, perspective_name, last_version, last_event_id, status, processed_at)
          SELECT DISTINCT ON (x.s) x.s, p_perspective, x.v, x.e, 2 /* Completed */, now()
          FROM unnest(b_streams, b_versions, b_events) AS x(s, v, e)
          ORDER BY x.s, x.v DESC;
          v_applied := v_n;
        ELSE
          -- A handler ran past the statement timeout (nothing was applied): the workers apply
          -- these streams with their own timeouts, retries and dead letters.
          FOREACH v_stream IN ARRAY p_stream_ids LOOP
            v_queued := v_queued + {{schema}}.wh_queue_stream(v_stream, p_perspective);
          END LOOP;
        END IF;
        v_batched := true;
      EXCEPTION WHEN OTHERS THEN
        v_batched := false;
      END;
    END IF;
  END IF;
  FOREACH v_stream IN ARRAY p_stream_ids LOOP
    EXIT WHEN v_batched;
    IF v_function IS NULL THEN
      v_queued := v_queued + {{schema}}.wh_queue_stream(v_stream, p_perspective);
      CONTINUE;
    END IF;
    SELECT array_agg(e.event_id ORDER BY e.stream_version), array_agg(e.stream_version ORDER BY e.stream_version)
      INTO v_events, v_versions
    FROM {{schema}}.wh_event_store e
    JOIN {{schema}}.wh_perspective_subscriptions s
      ON s.event_type = e.event_type AND s.perspective_name = p_perspective
    WHERE e.stream_id = v_stream
      AND (NOT v_keep OR e.stream_version > coalesce(
            (SELECT c.last_version FROM {{schema}}.wh_perspective_cursors c
             WHERE c.stream_id = v_stream AND c.perspective_name = p_perspective), 0));
    IF v_events IS NULL THEN
      CONTINUE;
    END IF;
    EXECUTE v_call INTO v_n
      USING v_stream, v_events, v_versions, p_debug, p_retry_base_ms, p_retry_max_ms;
    v_applied := v_applied + v_n;
    IF v_n < cardinality(v_events) THEN
      -- The whole history: rows at or below the cursor are retired as applied by the workers.
      v_queued := v_queued + {{schema}}.wh_queue_stream(v_stream, p_perspective);
    END IF;
  END LOOP;
  DELETE FROM {{schema}}.wh_perspective_job_streams
  WHERE perspective_name = p_perspective AND stream_id = ANY (p_stream_ids);
  -- A worker may hold one of these streams with nothing but the gated work this chunk replaced
  -- (its settler leaves such a stream held and does not drain it again: engine::drain::
  -- completion), and a producer rings only for a stream nobody holds. Ring, so that its next
  -- claim retires the stream or offers what arrived since, now rather than at the safety-net poll.
  IF EXISTS (SELECT 1 FROM {{schema}}.wh_active_streams a
             WHERE a.stream_id = ANY (p_stream_ids) AND a.assigned_instance_id IS NOT NULL) THEN
    PERFORM pg_notify('{{schema}}_work', '');
  END IF;
  RETURN QUERY SELECT v_queued, v_applied;
END
$$;
