-- wh_job_advance(perspective): move the perspective's job as far along its life (see
-- wh_job_start) as it can go now; returns its state then ('none' when there is no job, 'busy'
-- when another session is advancing it). Leaving `waiting` snapshots the transactions open once
-- the job is visible and waits for those that appended to this event store to end, then lists
-- the streams with the perspective's events (and how many each, for progress); `queueing` ends
-- when no stream is listed (streams taken by a chunk still in flight are still listed, so it
-- waits for them too).

CREATE OR REPLACE FUNCTION {{schema}}.wh_job_advance(p_perspective text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  j record;
BEGIN
  SELECT * INTO j FROM {{schema}}.wh_perspective_jobs
  WHERE perspective_name = p_perspective FOR UPDATE SKIP LOCKED;
  IF NOT FOUND THEN
    RETURN CASE WHEN EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_jobs
                             WHERE perspective_name = p_perspective)
                THEN 'busy' ELSE 'none' END;
  END IF;
  IF j.state = 'done' THEN
    RETURN 'done';
  END IF;

  IF j.state = 'waiting' THEN
    -- This session sees the job, so the transaction that created it (and the subscriptions it
    -- came with) has committed: the transactions open now are the ones to wait for.
    IF j.wait_for IS NULL THEN
      UPDATE {{schema}}.wh_perspective_jobs SET wait_for = pg_current_snapshot()
      WHERE perspective_name = p_perspective
      RETURNING wait_for INTO j.wait_for;
    END IF;
    -- Only those that appended to this event store (wh_job_blockers). A transaction that has
    -- not appended yet sees the subscriptions when it does (read committed), so its events get
    -- their work rows; transactions of other schemas and databases are not waited for (a long
    -- one used to hold every backfill).
    IF EXISTS (SELECT 1 FROM {{schema}}.wh_job_blockers(j.wait_for)) THEN
      RETURN 'waiting';
    END IF;
    INSERT INTO {{schema}}.wh_perspective_job_streams (perspective_name, stream_id, events)
    SELECT p_perspective, e.stream_id, count(*)
    FROM {{schema}}.wh_event_store e
    JOIN {{schema}}.wh_perspective_subscriptions s
      ON s.event_type = e.event_type AND s.perspective_name = p_perspective
    GROUP BY e.stream_id;
    UPDATE {{schema}}.wh_perspective_jobs
       SET state = 'queueing', started_at = now(),
           (streams_total, events_total) = (SELECT count(*), coalesce(sum(s.events), 0)
                                            FROM {{schema}}.wh_perspective_job_streams s
                                            WHERE s.perspective_name = p_perspective)
    WHERE perspective_name = p_perspective;
    j.state := 'queueing';
  END IF;

  IF j.state = 'queueing' THEN
    -- Streams taken by a chunk still in flight are still listed, so this waits for them too.
    IF EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_job_streams s
               WHERE s.perspective_name = p_perspective) THEN
      RETURN 'queueing';
    END IF;
    UPDATE {{schema}}.wh_perspective_jobs
       SET state = 'applying',
           queued_through = coalesce((SELECT max(w.event_work_id) FROM {{schema}}.wh_perspective_events w), 0)
    WHERE perspective_name = p_perspective
    RETURNING queued_through INTO j.queued_through;
    j.state := 'applying';
  END IF;

  IF EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
             WHERE w.event_work_id <= j.queued_through AND w.perspective_name = p_perspective
               AND w.processed_at IS NULL) THEN
    RETURN 'applying';
  END IF;
  UPDATE {{schema}}.wh_perspective_jobs SET state = 'done', finished_at = now()
  WHERE perspective_name = p_perspective;
  RETURN 'done';
END
$$;
