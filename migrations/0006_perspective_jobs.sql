-- 0006: perspective jobs. A perspective new to a schema is backfilled from the event store; one
-- whose `version` changed is rebuilt (so is one named by `perspective-worker rebuild`). Workers
-- run the jobs, several at once, a chunk of streams per transaction. Also: the cleanup of
-- drained streams drops work rows a removed perspective's in-flight append left behind.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

-- What each perspective was compiled from, besides the definition hash: the declared version (a
-- change rebuilds it) and a hash of its handlers and ordering (a change without a new version
-- is reported by migrate: existing rows were built by the old handlers).
ALTER TABLE {{schema}}.wh_perspectives
  ADD COLUMN version integer NOT NULL DEFAULT 1,
  ADD COLUMN handlers_hash text;

-- One job per perspective at most. Its life:
--   waiting   until every transaction open when the job became visible has ended: an append
--             whose trigger read the subscriptions before they included the perspective has no
--             work row for it, and must be committed before the streams are listed;
--   queueing  its streams are listed in wh_perspective_job_streams; workers take them a chunk at
--             a time and queue each stream's history (wh_job_requeue_streams);
--   applying  every stream is queued; the job is done once no work row of the perspective at
--             or below queued_through is pending;
--   done      kept (with its figures and finished_at) until the perspective's next job or its
--             removal.
-- A backfill holds back the perspective's live work on a stream until that stream is queued
-- (wh_backfill_gated), so nothing is applied before an older event of its stream. A rebuild
-- needs no such gate: each stream's `reset` discards whatever was applied before.
CREATE TABLE {{schema}}.wh_perspective_jobs (
  perspective_name text        PRIMARY KEY,
  kind             text        NOT NULL CHECK (kind IN ('backfill', 'rebuild')),
  state            text        NOT NULL DEFAULT 'waiting'
                               CHECK (state IN ('waiting', 'queueing', 'applying', 'done')),
  wait_for         pg_snapshot,
  streams_total    bigint,
  events_total     bigint,
  queued_through   bigint,
  created_at       timestamptz NOT NULL DEFAULT now(),
  started_at       timestamptz,
  finished_at      timestamptz
);

-- Streams of a queueing job not queued yet, with the number of the perspective's events each
-- held when it was listed (for progress).
CREATE TABLE {{schema}}.wh_perspective_job_streams (
  perspective_name text   NOT NULL,
  stream_id        uuid   NOT NULL,
  events           bigint NOT NULL,
  PRIMARY KEY (perspective_name, stream_id)
);

-- Whether a backfill holds back p_perspective's work on p_stream_id: while its job waits (any
-- stream may still be listed) and while the stream is listed but not queued.
CREATE FUNCTION {{schema}}.wh_backfill_gated(p_perspective text, p_stream_id uuid)
RETURNS boolean
LANGUAGE sql STABLE AS $$
  SELECT EXISTS (
    SELECT 1 FROM {{schema}}.wh_perspective_jobs j
    WHERE j.perspective_name = p_perspective AND j.kind = 'backfill'
      AND (j.state = 'waiting'
           OR EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_job_streams s
                      WHERE s.perspective_name = p_perspective AND s.stream_id = p_stream_id)))
$$;

-- Start (or restart) p_perspective's job. A rebuild replaces a backfill in progress: its reset
-- of each stream makes the backfill's gate unnecessary. Rings the doorbell.
CREATE FUNCTION {{schema}}.wh_job_start(p_perspective text, p_kind text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM {{schema}}.wh_perspective_job_streams WHERE perspective_name = p_perspective;
  INSERT INTO {{schema}}.wh_perspective_jobs (perspective_name, kind)
  VALUES (p_perspective, p_kind)
  ON CONFLICT (perspective_name) DO UPDATE
    SET kind = excluded.kind, state = 'waiting', wait_for = NULL, streams_total = NULL,
        events_total = NULL, queued_through = NULL, created_at = now(), started_at = NULL,
        finished_at = NULL;
  PERFORM pg_notify('{{schema}}_work', 'jobs');
END
$$;

-- Move p_perspective's job as far along as it can go now; returns its state then ('none' when
-- there is no job, 'busy' when another session is advancing it).
CREATE FUNCTION {{schema}}.wh_job_advance(p_perspective text)
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
    IF EXISTS (SELECT 1 FROM pg_snapshot_xip(j.wait_for) x
               WHERE pg_xact_status(x) = 'in progress') THEN
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

-- Take up to p_max_streams listed streams of p_perspective's job that no other session holds,
-- and lock each like a rebuild must: its head row (as a producer does: no append, and no
-- retirement of the stream, can interleave) and its cursor (created first when missing, so no
-- apply can start on it). Until the caller's transaction ends. Returns the streams, in order.
CREATE FUNCTION {{schema}}.wh_job_take_streams(p_perspective text, p_max_streams integer)
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

-- Catch up streams taken by wh_job_take_streams (after their `reset`, for a rebuild): their
-- cursors and pending work for the perspective go, and they leave the job's list (which lifts a
-- backfill's gate in the same commit). Then either every stored event of a subscribed type is
-- queued again (ringing the doorbell) for the workers to apply, or, with p_apply, each stream's
-- history is applied here, through the perspective's compiled apply function, in the same
-- commit (a rebuilt stream is never seen reset but not yet replayed), without work rows: what
-- an apply leaves (a failing event and what follows it) is queued for the workers' usual
-- retries. Returns the rows queued and the events applied.
CREATE FUNCTION {{schema}}.wh_job_requeue_streams(
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
BEGIN
  IF p_apply THEN
    SELECT p.apply_function INTO v_function FROM {{schema}}.wh_perspectives p
    WHERE p.perspective_name = p_perspective;
    -- Work ids are only completed, so placeholders do (there are no rows to delete).
    v_call := format('SELECT o_applied FROM {{schema}}.%I($1, array_fill(0::bigint, ARRAY[cardinality($2)]), $2, $3, true, $4, false, $5, $6, false, true, false)',
                     v_function);
  END IF;
  DELETE FROM {{schema}}.wh_perspective_cursors
  WHERE stream_id = ANY (p_stream_ids) AND perspective_name = p_perspective;
  DELETE FROM {{schema}}.wh_perspective_events
  WHERE stream_id = ANY (p_stream_ids) AND perspective_name = p_perspective;
  FOREACH v_stream IN ARRAY p_stream_ids LOOP
    IF v_function IS NULL THEN
      v_queued := v_queued + {{schema}}.wh_queue_stream(v_stream, p_perspective);
      CONTINUE;
    END IF;
    SELECT array_agg(e.event_id ORDER BY e.stream_version), array_agg(e.stream_version ORDER BY e.stream_version)
      INTO v_events, v_versions
    FROM {{schema}}.wh_event_store e
    JOIN {{schema}}.wh_perspective_subscriptions s
      ON s.event_type = e.event_type AND s.perspective_name = p_perspective
    WHERE e.stream_id = v_stream;
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
  RETURN QUERY SELECT v_queued, v_applied;
END
$$;

-- claim_work (as in 0005) re-offers a held stream only for work no backfill holds back.
CREATE OR REPLACE FUNCTION {{schema}}.claim_work(
    p_instance_id uuid, p_max_streams integer, p_stale_seconds double precision)
RETURNS TABLE (stream_id uuid)
LANGUAGE plpgsql AS $$
DECLARE
  v_rank  integer;
  v_count integer;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {{schema}}.wh_active_streams) THEN
    RETURN;
  END IF;

  -- The caller always counts itself live, so a late heartbeat never makes it claim everything.
  SELECT r.rank, r.cnt INTO v_rank, v_count
  FROM (
    SELECT l.id, (row_number() OVER (ORDER BY l.id) - 1)::integer AS rank, (count(*) OVER ())::integer AS cnt
    FROM (
      SELECT i.instance_id AS id FROM {{schema}}.wh_service_instances i
      WHERE i.last_heartbeat_at >= now() - make_interval(secs => p_stale_seconds)
      UNION
      SELECT p_instance_id
    ) l
  ) r
  WHERE r.id = p_instance_id;

  WITH candidates AS (
    SELECT a.stream_id
    FROM {{schema}}.wh_active_streams a
    WHERE a.assigned_instance_id IS DISTINCT FROM p_instance_id
      AND a.partition_number % v_count = v_rank
      AND (a.assigned_instance_id IS NULL
           OR NOT EXISTS (SELECT 1 FROM {{schema}}.wh_service_instances i
                          WHERE i.instance_id = a.assigned_instance_id
                            AND i.last_heartbeat_at >= now() - make_interval(secs => p_stale_seconds)))
    ORDER BY a.created_at
    LIMIT p_max_streams
    FOR UPDATE OF a SKIP LOCKED
  )
  UPDATE {{schema}}.wh_active_streams a
     SET assigned_instance_id = p_instance_id
  FROM candidates c
  WHERE a.stream_id = c.stream_id;

  -- Streams this instance holds with nothing pending (left behind by an instance that stopped
  -- before retiring them): retire them, so their next event rings the doorbell again.
  PERFORM {{schema}}.cleanup_completed_streams(p_instance_id, ARRAY(
    SELECT a.stream_id FROM {{schema}}.wh_active_streams a
    WHERE a.assigned_instance_id = p_instance_id
      AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                      WHERE w.stream_id = a.stream_id AND w.processed_at IS NULL
                      OFFSET 0)));

  RETURN QUERY
  SELECT a.stream_id
  FROM {{schema}}.wh_active_streams a
  WHERE a.assigned_instance_id = p_instance_id
    -- OFFSET 0 keeps this a per-stream index probe; flattened into a join, stale statistics
    -- can turn it into repeated scans of the whole work table.
    AND EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                WHERE w.stream_id = a.stream_id AND w.processed_at IS NULL
                  AND (w.scheduled_for IS NULL OR w.scheduled_for <= now())
                  AND NOT {{schema}}.wh_backfill_gated(w.perspective_name, w.stream_id)
                OFFSET 0)
  ORDER BY a.created_at
  LIMIT p_max_streams;
END
$$;

-- claim_and_fetch_pending_perspective_events (as in 0002) skips pairs a backfill holds back.
CREATE OR REPLACE FUNCTION {{schema}}.claim_and_fetch_pending_perspective_events(
    p_instance_id uuid, p_stream_ids uuid[], p_lease_seconds integer, p_max_rows integer,
    p_per_pair integer DEFAULT 100, p_debug_mode boolean DEFAULT false, p_with_payloads boolean DEFAULT true)
RETURNS TABLE (event_work_id bigint, stream_id uuid, perspective_name text, event_id uuid,
               stream_version bigint, attempts integer, error text, event_type text, event_data jsonb,
               metadata jsonb, scope jsonb, created_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
  v_owned        uuid[];
  v_pair_streams uuid[];
  v_pair_names   text[];
  v_pair_last    bigint[];
BEGIN
  SELECT array_agg(a.stream_id) INTO v_owned
  FROM {{schema}}.wh_active_streams a
  WHERE a.stream_id = ANY (p_stream_ids) AND a.assigned_instance_id = p_instance_id;
  IF v_owned IS NULL THEN
    RETURN;
  END IF;

  -- Every (stream, perspective) to look at, with its cursor. Each pair is then read through the
  -- (stream_id, perspective_name, stream_version) index with a LATERAL ... LIMIT, a shape the
  -- planner keeps even when the statistics are stale (a table that just grew from empty is
  -- exactly when a worker gets busy).
  SELECT array_agg(o.stream_id), array_agg(sub.perspective_name), array_agg(coalesce(c.last_version, 0))
    INTO v_pair_streams, v_pair_names, v_pair_last
  FROM unnest(v_owned) AS o(stream_id)
  CROSS JOIN (SELECT DISTINCT s.perspective_name FROM {{schema}}.wh_perspective_subscriptions s) sub
  LEFT JOIN {{schema}}.wh_perspective_cursors c
         ON c.stream_id = o.stream_id AND c.perspective_name = sub.perspective_name
  WHERE NOT {{schema}}.wh_backfill_gated(sub.perspective_name, o.stream_id);
  IF v_pair_streams IS NULL THEN
    RETURN;
  END IF;

  -- Rows at or below their cursor are already applied: by an instance that died before its
  -- completion flush, or by this one with its flush still pending. Retire them here, so they
  -- never hold a stream in wh_active_streams.
  PERFORM {{schema}}.complete_perspective_events(ARRAY(
    SELECT d.event_work_id
    FROM unnest(v_pair_streams, v_pair_names, v_pair_last) AS p(stream_id, perspective_name, last_version)
    CROSS JOIN LATERAL (
      SELECT w.event_work_id FROM {{schema}}.wh_perspective_events w
      WHERE w.stream_id = p.stream_id AND w.perspective_name = p.perspective_name
        AND w.stream_version <= p.last_version AND w.processed_at IS NULL
      OFFSET 0
    ) d
  ), p_debug_mode);

  RETURN QUERY
  WITH window_rows AS (
    -- The first p_per_pair pending rows above each cursor, cut at the first row that is not
    -- available (scheduled for a retry later, or leased by another live instance).
    SELECT x.event_work_id, x.stream_id, x.perspective_name, x.depth
    FROM unnest(v_pair_streams, v_pair_names, v_pair_last) AS p(stream_id, perspective_name, last_version)
    CROSS JOIN LATERAL (
      SELECT h.event_work_id, h.stream_id, h.perspective_name,
             row_number() OVER (ORDER BY h.stream_version) AS depth,
             bool_or(h.unavailable) OVER (ORDER BY h.stream_version ROWS UNBOUNDED PRECEDING) AS fenced
      FROM (
        SELECT w.event_work_id, w.stream_id, w.perspective_name, w.stream_version,
               (coalesce(w.scheduled_for > now(), false)
                OR (w.instance_id IS NOT NULL AND w.instance_id <> p_instance_id AND w.lease_expiry > now()
                    AND EXISTS (SELECT 1 FROM {{schema}}.wh_service_instances i WHERE i.instance_id = w.instance_id))
               ) AS unavailable
        FROM {{schema}}.wh_perspective_events w
        WHERE w.stream_id = p.stream_id AND w.perspective_name = p.perspective_name
          AND w.stream_version > p.last_version AND w.processed_at IS NULL
        ORDER BY w.stream_version
        LIMIT p_per_pair
      ) h
    ) x
    WHERE NOT x.fenced
  ),
  eligible AS (
    -- The shallowest first across pairs, p_max_rows in all.
    SELECT r.event_work_id FROM window_rows r
    ORDER BY r.depth, r.stream_id, r.perspective_name
    LIMIT p_max_rows
  ),
  -- Lease them (the UPDATE takes the row locks; the stream is ours, so nobody else is after
  -- these rows but a completion deleting them, which it is fine to wait for).
  leased AS (
    UPDATE {{schema}}.wh_perspective_events w
       SET attempts = CASE WHEN w.instance_id = p_instance_id AND w.lease_expiry > now()
                           THEN w.attempts ELSE w.attempts + 1 END,
           instance_id = p_instance_id,
           lease_expiry = now() + make_interval(secs => p_lease_seconds)
    FROM eligible l
    WHERE w.event_work_id = l.event_work_id
    RETURNING w.event_work_id, w.stream_id, w.perspective_name, w.event_id, w.stream_version,
              w.attempts, w.error
  )
  SELECT l.event_work_id, l.stream_id, l.perspective_name, l.event_id, l.stream_version, l.attempts,
         l.error, e.event_type,
         CASE WHEN p_with_payloads THEN e.event_data ELSE 'null'::jsonb END,
         CASE WHEN p_with_payloads THEN e.metadata ELSE 'null'::jsonb END,
         CASE WHEN p_with_payloads THEN e.scope ELSE 'null'::jsonb END,
         e.created_at
  FROM leased l
  JOIN {{schema}}.wh_event_store e ON e.event_id = l.event_id
  ORDER BY l.stream_id, l.perspective_name, l.stream_version;
END
$$;

-- cleanup_completed_streams (as in 0002) first drops work rows of removed perspectives.
CREATE OR REPLACE FUNCTION {{schema}}.cleanup_completed_streams(p_instance_id uuid, p_stream_ids uuid[])
RETURNS SETOF uuid
LANGUAGE plpgsql AS $$
DECLARE
  v_locked uuid[];
BEGIN
  SELECT array_agg(x.stream_id) INTO v_locked
  FROM (SELECT s.stream_id FROM {{schema}}.wh_streams s
        WHERE s.stream_id = ANY (p_stream_ids)
        ORDER BY s.stream_id
        FOR SHARE SKIP LOCKED) x;
  IF v_locked IS NULL THEN
    RETURN;
  END IF;
  -- Work of a perspective no longer subscribed to anything: `migrate` deleted the removed
  -- perspective's rows, but an append in flight when it committed (its trigger had read the old
  -- subscriptions) can add one after. Nothing applies such a row; it would pin its stream.
  DELETE FROM {{schema}}.wh_perspective_events w
  WHERE w.stream_id = ANY (v_locked) AND w.processed_at IS NULL
    AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_subscriptions s
                    WHERE s.perspective_name = w.perspective_name);
  -- A new statement, so a new snapshot: it sees every producer that committed before the lock.
  RETURN QUERY
  DELETE FROM {{schema}}.wh_active_streams a
  WHERE a.stream_id = ANY (v_locked)
    AND (a.assigned_instance_id = p_instance_id OR a.assigned_instance_id IS NULL)
    AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                    WHERE w.stream_id = a.stream_id AND w.processed_at IS NULL
                    OFFSET 0)
  RETURNING a.stream_id;
END
$$;
