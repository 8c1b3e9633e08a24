-- 0014: claiming or retiring some streams reads their rows, not whole tables.
--
-- claim_and_fetch_pending_perspective_events (custom runners; as in 0006) joined the streams it
-- was given, crossed with the subscribed perspectives, to wh_perspective_cursors with a plain LEFT
-- JOIN. The planner cannot see how few streams a call lists, and without statistics on the
-- subscriptions it guesses 200 perspectives, so it chose to hash the whole cursor table on every
-- call: one cursor per (stream, perspective) ever applied, so the cost of a claim grew with every
-- stream the deployment had seen (the same join in the compiled wh_drain measured 240 ms per call
-- at 125 000 cursors, against 11 ms as one primary-key probe per pair). Now a LATERAL subquery
-- with LIMIT 1, which the planner cannot flatten back into that join. Likewise, finding which of
-- the listed streams the caller holds filtered every stream it holds through the owner index
-- (27 ms for 250 streams of 100 000 held); now one primary-key probe per listed stream.
-- Otherwise as in 0006.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

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
  -- The listed streams this instance holds: one primary-key probe per stream (see the header).
  SELECT array_agg(DISTINCT x.stream_id) INTO v_owned
  FROM unnest(p_stream_ids) AS x(stream_id)
  WHERE (SELECT a.assigned_instance_id FROM {{schema}}.wh_active_streams a
         WHERE a.stream_id = x.stream_id) = p_instance_id;
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
  -- One primary-key probe per pair (see the header).
  LEFT JOIN LATERAL (SELECT c.last_version FROM {{schema}}.wh_perspective_cursors c
                     WHERE c.stream_id = o.stream_id AND c.perspective_name = sub.perspective_name
                     LIMIT 1) c ON true
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

-- cleanup_completed_streams (as in 0012) is given the streams to retire as an array: from the
-- settler, up to a few thousand at a time. Past a thousand or so ids the planner prices one
-- index probe per id above a sequential scan, and read all of wh_streams (to lock the listed
-- heads) and all of wh_perspective_events (to look for stray rows) to retire them: 25–160 ms per
-- call at 100 000 streams, growing with the tables. complete_perspective_events (as in 0002)
-- likewise read the whole work table to delete a few thousand rows by id (an Instant wh_drain
-- call completes up to 10 000 at once). Neither runs user code, so their statements can simply be
-- told to use the indexes.
ALTER FUNCTION {{schema}}.cleanup_completed_streams(uuid, uuid[]) SET enable_seqscan = off;
ALTER FUNCTION {{schema}}.complete_perspective_events(bigint[], boolean) SET enable_seqscan = off;
