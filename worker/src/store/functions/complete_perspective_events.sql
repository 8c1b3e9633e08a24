-- complete_perspective_events(work ids, debug, skip held): retire applied work rows: delete
-- them, or in debug mode keep them stamped with processed_at. Returns how many.
--
-- p_skip_held is for completions that can meet rows another transaction holds: the completion
-- flush's rows can be locked at the same time by a drain retiring the rows at or below its
-- cursor, by a rebuild re-queueing the stream's history, or by another flush, each taking the
-- rows of many streams in its own order, so waiting made deadlock cycles (flush <-> wh_drain <->
-- wh_job_requeue_streams): a second lost to deadlock_timeout, then one side rolled back. A row
-- another transaction holds is being deleted by it, or, if that one rolls back, is at or below
-- its cursor and retired by the next drain of its stream; so such a completion skips it. Locking
-- the rows first (FOR UPDATE SKIP LOCKED) on every call cost the Batched engine 15-25% of its
-- rate (an extra write per row), so it first tries the plain statement with a 10 ms lock_timeout
-- (far below deadlock_timeout, so it never stays in a cycle) and skips the held rows only when
-- that times out. Completions under the pair's cursor lock (a drain's own applied rows) keep the
-- plain delete: nothing they wait for waits on them.
--
-- enable_seqscan = off: an Instant wh_drain call completes up to 10 000 ids at once, and past a
-- thousand or so ids the planner prices one index probe per id above a sequential scan of the
-- whole work table. It runs no user code, so its statements can simply be told to use the index.

CREATE OR REPLACE FUNCTION {{schema}}.complete_perspective_events(
    p_event_work_ids bigint[], p_debug_mode boolean DEFAULT false, p_skip_held boolean DEFAULT false)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
  v_ids  bigint[] := p_event_work_ids;
  v_n    integer;
  v_wait text := current_setting('lock_timeout');
BEGIN
  IF p_skip_held THEN
    BEGIN
      -- (Undone with the subtransaction on a timeout, put back below otherwise.)
      PERFORM set_config('lock_timeout', '10ms', true);
      IF p_debug_mode THEN
        UPDATE {{schema}}.wh_perspective_events
           SET processed_at = now(), instance_id = NULL, lease_expiry = NULL
         WHERE event_work_id = ANY (v_ids) AND processed_at IS NULL;
      ELSE
        DELETE FROM {{schema}}.wh_perspective_events WHERE event_work_id = ANY (v_ids);
      END IF;
      GET DIAGNOSTICS v_n = ROW_COUNT;
      PERFORM set_config('lock_timeout', v_wait, true);
      RETURN v_n;
    EXCEPTION WHEN lock_not_available THEN
      NULL; -- some are held: skip those
    END;
    v_ids := ARRAY(
      SELECT w.event_work_id FROM {{schema}}.wh_perspective_events w
      WHERE w.event_work_id = ANY (p_event_work_ids)
      FOR UPDATE SKIP LOCKED);
  END IF;
  IF p_debug_mode THEN
    UPDATE {{schema}}.wh_perspective_events
       SET processed_at = now(), instance_id = NULL, lease_expiry = NULL
     WHERE event_work_id = ANY (v_ids) AND processed_at IS NULL;
  ELSE
    DELETE FROM {{schema}}.wh_perspective_events WHERE event_work_id = ANY (v_ids);
  END IF;
  GET DIAGNOSTICS v_n = ROW_COUNT;
  RETURN v_n;
END
$$;
