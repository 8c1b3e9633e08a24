-- 0016: the completions that can meet rows another transaction holds skip them instead of
-- waiting.
--
-- The rows the completion flush deletes (or stamps, in debug mode) can be locked at the same
-- time by a drain retiring the rows at or below its cursor, by a rebuild re-queueing the
-- stream's history, or by another flush. Each of those takes the rows of many streams in its
-- own order, so waiting made deadlock cycles (flush ↔ wh_drain ↔ wh_job_requeue_streams): a
-- second lost to deadlock_timeout, then one side rolled back and retried. A row another
-- transaction holds is being deleted by it, or, if that one rolls back, is at or below its
-- cursor and retired by the next drain of its stream; so such a completion skips it
-- (p_skip_held). Locking the rows first (FOR UPDATE SKIP LOCKED) on every call cost the Batched
-- engine 15-25% of its rate (an extra write per row), so it first tries the plain delete with a
-- 10 ms lock_timeout — far below deadlock_timeout, so it never stays in a cycle — and only when
-- that times out skips the held rows. Completions under the pair's cursor lock (a drain's own
-- applied rows) keep the plain delete: nothing they wait for waits on them. Otherwise as in
-- 0002 (with 0014's enable_seqscan = off: the ids are probed by key, however many).
-- Template: `{{schema}}` is the deployment's schema (see 0001).

-- The two-argument form becomes the three-argument one with a default: callers are unchanged.
DROP FUNCTION {{schema}}.complete_perspective_events(bigint[], boolean);
CREATE FUNCTION {{schema}}.complete_perspective_events(
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
