-- wh_backfill_gated(perspective, stream): whether a backfill holds back the perspective's live
-- work on the stream: while its job waits (any stream may still be listed) and while the stream
-- is listed but not queued yet, so nothing is applied before an older event of its stream. A
-- rebuild needs no gate: its reset of each stream discards whatever was applied before.
-- Asked by claim_work, claim_and_fetch_pending_perspective_events and wh_drain.

CREATE OR REPLACE FUNCTION {{schema}}.wh_backfill_gated(p_perspective text, p_stream_id uuid)
RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT EXISTS (
    SELECT 1 FROM {{schema}}.wh_perspective_jobs j
    WHERE j.perspective_name = p_perspective AND j.kind = 'backfill'
      AND (j.state = 'waiting'
           OR EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_job_streams s
                      WHERE s.perspective_name = p_perspective AND s.stream_id = p_stream_id)))
$$;
