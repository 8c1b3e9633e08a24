-- wh_settled_without_retry(instance, streams): of the streams cleanup_completed_streams could not
-- retire, those another drain would not change: the instance does not hold them (retired
-- already, by an earlier call or by claim_work, or another instance's), or all their pending work
-- waits for a backfill to take the stream (wh_backfill_gated: a blue/green build, a perspective
-- added with history). A drain cannot apply gated work, so draining such a stream again only costs
-- a wh_drain and a settle call each time (thousands a second at a blue/green bump beside live
-- load). The job's chunk that takes the stream queues or applies its work and rings the doorbell
-- (wh_job_requeue_streams), so the next claim retires the stream or offers what arrived since.
--
-- Index probes per stream: the work-row probes are scalar subqueries with LIMIT 1, because
-- PostgreSQL may run an EXISTS as a hashed subplan over every pending row of the schema, asking
-- the gate of each (110 ms a call at 30 000 rows). jit = off: the planner, guessing hundreds of
-- rows per stream before the work table's statistics catch up, put a few dozen streams past
-- jit_above_cost, and JIT took 100 ms for a statement that runs in 2 (auto_explain,
-- tests/bench/crossstream.sh). It runs no user code.

CREATE OR REPLACE FUNCTION {{schema}}.wh_settled_without_retry(p_instance_id uuid, p_stream_ids uuid[])
RETURNS SETOF uuid
LANGUAGE sql STABLE
SET jit = off
AS $$
  SELECT x.stream_id FROM unnest(p_stream_ids) AS x(stream_id)
  WHERE (SELECT a.assigned_instance_id FROM {{schema}}.wh_active_streams a
         WHERE a.stream_id = x.stream_id) IS DISTINCT FROM p_instance_id
     OR ((SELECT 1 FROM {{schema}}.wh_perspective_events w
          WHERE w.stream_id = x.stream_id AND w.processed_at IS NULL LIMIT 1) IS NOT NULL
         AND (SELECT 1 FROM {{schema}}.wh_perspective_events w
              WHERE w.stream_id = x.stream_id AND w.processed_at IS NULL
                AND NOT {{schema}}.wh_backfill_gated(w.perspective_name, w.stream_id)
              LIMIT 1) IS NULL)
$$;
