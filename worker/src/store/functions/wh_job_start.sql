-- wh_job_start(perspective, kind): start (or restart) the perspective's backfill or rebuild job,
-- in the `waiting` state, and ring the doorbell ('jobs'). A rebuild replaces a backfill in
-- progress: its reset of each stream makes the backfill's gate unnecessary. A job's life:
--   waiting   until every transaction open when the job became visible has ended: an append
--             whose trigger read the subscriptions before they included the perspective has no
--             work row for it, and must be committed before the streams are listed;
--   queueing  its streams are listed in wh_perspective_job_streams; workers take them a chunk at
--             a time (wh_job_take_streams) and queue each stream's history
--             (wh_job_requeue_streams);
--   applying  every stream is queued; the job is done once no work row of the perspective at
--             or below queued_through is pending;
--   done      kept (with its figures and finished_at) until the perspective's next job or its
--             removal.

CREATE OR REPLACE FUNCTION {{schema}}.wh_job_start(p_perspective text, p_kind text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM {{schema}}.wh_perspective_job_streams WHERE perspective_name = p_perspective;
  INSERT INTO {{schema}}.wh_perspective_jobs (perspective_name, kind)
  VALUES (p_perspective, p_kind)
  ON CONFLICT (perspective_name) DO UPDATE
    SET kind = excluded.kind, state = 'waiting', wait_for = NULL, streams_total = NULL,
        events_total = NULL, queued_through = NULL, created_at = now(), started_at = NULL,
        finished_at = NULL, keep_cursors = false;
  PERFORM pg_notify('{{schema}}_work', 'jobs');
END
$$;
