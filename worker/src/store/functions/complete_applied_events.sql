-- complete_applied_events(work ids, debug): the completion flush's retirement of work rows the
-- worker applied earlier, in another transaction: delete them (in debug mode, stamp them with
-- processed_at), but only those the cursor proves applied — a row whose stream_version is at or
-- below its (stream, perspective) cursor. Returns how many.
--
-- Why the fence: a work id is an identity value, and a failover to a promoted standby issues
-- again the values of the WAL it never received. A completion held in memory and retried
-- against the new primary by id alone could delete a new, unapplied work row that took the
-- same id (or the lost event's own row, replicated without the apply that the old primary
-- committed): that event would never be applied. The cursor moves in the apply's transaction,
-- so it is the proof; a row it does not cover stays for a drain to apply or retire.
--
-- Rows another transaction holds are skipped as in complete_perspective_events(..., p_skip_held
-- => true), for the same reason (waiting for them made deadlock cycles): the plain statement
-- runs with a 10 ms lock_timeout first, and only when that times out are the held rows skipped.
-- A skipped row is at or below its cursor, so the next drain of its stream retires it.

CREATE OR REPLACE FUNCTION {{schema}}.complete_applied_events(
    p_event_work_ids bigint[], p_debug_mode boolean DEFAULT false)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
  v_ids  bigint[] := p_event_work_ids;
  v_n    integer;
  v_wait text := current_setting('lock_timeout');
BEGIN
  FOR v_try IN 1..2 LOOP
    BEGIN
      IF v_try = 1 THEN
        -- (Undone with the subtransaction on a timeout, put back below otherwise.)
        PERFORM set_config('lock_timeout', '10ms', true);
      ELSE
        v_ids := ARRAY(
          SELECT w.event_work_id FROM {{schema}}.wh_perspective_events w
          WHERE w.event_work_id = ANY (p_event_work_ids)
          FOR UPDATE SKIP LOCKED);
      END IF;
      IF p_debug_mode THEN
        UPDATE {{schema}}.wh_perspective_events w
           SET processed_at = now(), instance_id = NULL, lease_expiry = NULL
         WHERE w.event_work_id = ANY (v_ids) AND w.processed_at IS NULL
           AND w.stream_version <= (SELECT c.last_version FROM {{schema}}.wh_perspective_cursors c
                                    WHERE c.stream_id = w.stream_id
                                      AND c.perspective_name = w.perspective_name);
      ELSE
        DELETE FROM {{schema}}.wh_perspective_events w
         WHERE w.event_work_id = ANY (v_ids)
           AND w.stream_version <= (SELECT c.last_version FROM {{schema}}.wh_perspective_cursors c
                                    WHERE c.stream_id = w.stream_id
                                      AND c.perspective_name = w.perspective_name);
      END IF;
      GET DIAGNOSTICS v_n = ROW_COUNT;
      PERFORM set_config('lock_timeout', v_wait, true);
      RETURN v_n;
    EXCEPTION WHEN lock_not_available THEN
      NULL; -- some are held: skip those (second try)
    END;
  END LOOP;
  RETURN 0;
END
$$;
