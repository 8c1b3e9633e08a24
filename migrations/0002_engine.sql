-- 0002: the worker side: liveness, claiming, fetching, completion, clean-up, dead letters.
-- Template: `{{schema}}` is the deployment's schema (see 0001).
--
-- Ownership model: a stream with pending work has a row in wh_active_streams; its
-- assigned_instance_id owns all of the stream's work. Unowned streams (and streams of instances
-- whose heartbeat went stale) are taken by the live instance whose rank equals
-- `partition_number % live_instances`. Work rows carry leases (instance_id, lease_expiry) and
-- attempts; the cursor row of a (stream, perspective), locked by the apply function, is what
-- finally guarantees exactly-once, whatever the leases say.

-- Register or refresh a worker instance.
CREATE FUNCTION {{schema}}.record_heartbeat(
    p_instance_id uuid, p_service_name text, p_host_name text, p_process_id integer,
    p_metadata jsonb DEFAULT '{}')
RETURNS void
LANGUAGE sql AS $$
  INSERT INTO {{schema}}.wh_service_instances AS i
      (instance_id, service_name, host_name, process_id, metadata)
  VALUES (p_instance_id, p_service_name, p_host_name, p_process_id, coalesce(p_metadata, '{}'))
  ON CONFLICT (instance_id) DO UPDATE
    SET last_heartbeat_at = now(), metadata = excluded.metadata, process_id = excluded.process_id
$$;

-- Abandon instances silent for longer than p_stale_seconds: delete them, release their streams
-- and work-row leases, and ring the doorbell ('orphan') so live workers re-claim at once.
-- Returns how many were abandoned.
CREATE FUNCTION {{schema}}.cleanup_stale_instances(p_instance_id uuid, p_stale_seconds double precision)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  v_dead uuid[];
BEGIN
  WITH d AS (
    DELETE FROM {{schema}}.wh_service_instances
    WHERE instance_id <> p_instance_id
      AND last_heartbeat_at < now() - make_interval(secs => p_stale_seconds)
    RETURNING instance_id
  )
  SELECT array_agg(instance_id) INTO v_dead FROM d;
  IF v_dead IS NULL THEN
    RETURN 0;
  END IF;
  UPDATE {{schema}}.wh_active_streams SET assigned_instance_id = NULL, lease_expiry = NULL
  WHERE assigned_instance_id = ANY (v_dead);
  UPDATE {{schema}}.wh_perspective_events SET instance_id = NULL, lease_expiry = NULL
  WHERE instance_id = ANY (v_dead) AND processed_at IS NULL;
  PERFORM pg_notify('{{schema}}_work', 'orphan');
  RETURN cardinality(v_dead);
END
$$;

-- Graceful shutdown: retire drained streams, give back the rest and the leases, then leave.
CREATE FUNCTION {{schema}}.deregister_instance(p_instance_id uuid)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM {{schema}}.cleanup_completed_streams(p_instance_id, ARRAY(
    SELECT a.stream_id FROM {{schema}}.wh_active_streams a WHERE a.assigned_instance_id = p_instance_id));
  UPDATE {{schema}}.wh_active_streams SET assigned_instance_id = NULL, lease_expiry = NULL
  WHERE assigned_instance_id = p_instance_id;
  UPDATE {{schema}}.wh_perspective_events SET instance_id = NULL, lease_expiry = NULL
  WHERE instance_id = p_instance_id AND processed_at IS NULL;
  DELETE FROM {{schema}}.wh_service_instances WHERE instance_id = p_instance_id;
  PERFORM pg_notify('{{schema}}_work', 'orphan');
END
$$;

-- The only polled query. Returns at once when no stream has work. Otherwise takes ownership of
-- unowned streams (and streams of dead owners) in this instance's partition share, oldest
-- first, skipping rows other claimers hold, and returns every stream this instance owns that has
-- due work — re-offering held streams on every poll, so a lost in-process signal costs one poll,
-- never a stranded stream.
CREATE FUNCTION {{schema}}.claim_work(
    p_instance_id uuid, p_max_streams integer, p_lease_seconds integer, p_stale_seconds double precision)
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
     SET assigned_instance_id = p_instance_id,
         lease_expiry = now() + make_interval(secs => p_lease_seconds),
         last_activity_at = now()
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
                OFFSET 0)
  ORDER BY a.created_at
  LIMIT p_max_streams;
END
$$;

-- Claim and fetch, in one round trip, the pending work of the listed streams this instance owns:
-- rows above their (stream, perspective) cursor, in version order, stopping at the first row of a
-- pair that is not available (scheduled for a retry later, or leased by another live instance),
-- so nothing is ever handed out behind an earlier event. Leases the rows; `attempts` grows each
-- time a row is leased afresh (not when this instance's live lease is renewed), which is what
-- dead-lettering counts. Returns the rows with their events, ordered for applying.
CREATE FUNCTION {{schema}}.claim_and_fetch_pending_perspective_events(
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
         ON c.stream_id = o.stream_id AND c.perspective_name = sub.perspective_name;
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

-- Retire applied work rows: delete them, or in debug mode keep them stamped with processed_at.
CREATE FUNCTION {{schema}}.complete_perspective_events(p_event_work_ids bigint[], p_debug_mode boolean DEFAULT false)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  v_n integer;
BEGIN
  IF p_debug_mode THEN
    UPDATE {{schema}}.wh_perspective_events
       SET processed_at = now(), instance_id = NULL, lease_expiry = NULL
     WHERE event_work_id = ANY (p_event_work_ids) AND processed_at IS NULL;
  ELSE
    DELETE FROM {{schema}}.wh_perspective_events WHERE event_work_id = ANY (p_event_work_ids);
  END IF;
  GET DIAGNOSTICS v_n = ROW_COUNT;
  RETURN v_n;
END
$$;

-- Record explicitly listed events of one (stream, perspective) as applied and move its cursor
-- to them (never a range: an event not listed is never swallowed). For runners that apply
-- outside the compiled SQL apply functions.
CREATE FUNCTION {{schema}}.complete_perspective_cursor_work(
    p_stream_id uuid, p_perspective_name text, p_last_version bigint, p_last_event_id uuid,
    p_event_work_ids bigint[], p_status smallint, p_error text DEFAULT NULL, p_debug_mode boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO {{schema}}.wh_perspective_cursors AS c
      (stream_id, perspective_name, last_version, last_event_id, status, error, processed_at)
  VALUES (p_stream_id, p_perspective_name, p_last_version, p_last_event_id, p_status, p_error, now())
  ON CONFLICT (stream_id, perspective_name) DO UPDATE
    SET last_version = greatest(c.last_version, excluded.last_version),
        last_event_id = CASE WHEN excluded.last_version >= c.last_version THEN excluded.last_event_id
                             ELSE c.last_event_id END,
        status = excluded.status, error = excluded.error, processed_at = now();
  PERFORM {{schema}}.complete_perspective_events(p_event_work_ids, p_debug_mode);
END
$$;

-- Drop drained streams from wh_active_streams without losing a doorbell (see 0001): only
-- streams whose wh_streams row could be share-locked (no producer in flight) and that, seen
-- after taking that lock, have no pending work. Returns the streams removed.
CREATE FUNCTION {{schema}}.cleanup_completed_streams(p_instance_id uuid, p_stream_ids uuid[])
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

-- Move poison work rows to wh_dead_letters with a snapshot of their event, in one statement, so
-- the stream can continue. Idempotent: rows already gone are skipped. Returns rows moved.
CREATE FUNCTION {{schema}}.move_to_dead_letters(p_instance_id uuid, p_event_work_ids bigint[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  v_n integer;
BEGIN
  WITH moved AS (
    DELETE FROM {{schema}}.wh_perspective_events w
    WHERE w.event_work_id = ANY (p_event_work_ids)
    RETURNING w.*
  )
  INSERT INTO {{schema}}.wh_dead_letters
      (event_work_id, stream_id, perspective_name, event_id, stream_version, event_type, event,
       error, attempts, first_failed_at, dead_lettered_by)
  SELECT m.event_work_id, m.stream_id, m.perspective_name, m.event_id, m.stream_version, e.event_type,
         to_jsonb(e), m.error, m.attempts, m.created_at, p_instance_id
  FROM moved m
  JOIN {{schema}}.wh_event_store e ON e.event_id = m.event_id;
  GET DIAGNOSTICS v_n = ROW_COUNT;
  RETURN v_n;
END
$$;

-- Which definition of each perspective the compiled apply functions were generated from, so a
-- worker can refuse to run handlers that `migrate` has not compiled yet.
CREATE TABLE {{schema}}.wh_perspectives (
  perspective_name text        PRIMARY KEY,
  definition_hash  text        NOT NULL,
  apply_function   text        NOT NULL,
  updated_at       timestamptz NOT NULL DEFAULT now()
);
