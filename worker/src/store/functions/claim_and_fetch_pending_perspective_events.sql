-- claim_and_fetch_pending_perspective_events(instance, streams, ...): for custom runners (the
-- compiled SQL perspectives are drained by wh_drain), claim and fetch in one round trip the
-- pending work of the listed streams this instance owns: rows above their (stream, perspective)
-- cursor, in version order, p_per_pair per pair at most and p_max_rows in all (shallowest first),
-- stopping at the first row of a pair that is not available (scheduled for a retry later, or
-- leased by another live instance), so nothing is ever handed out behind an earlier event. Pairs
-- a backfill holds back (wh_backfill_gated) are skipped. Rows at or below their cursor were
-- already applied (by an instance that died before its completion flush, or by this one with its
-- flush pending) and are retired here, so they never pin a stream. The rows are leased;
-- `attempts` grows each time a row is leased afresh (not when this instance's live lease is
-- renewed), which is what dead-lettering counts. Returns the rows with their events (payloads
-- optional), ordered for applying.
--
-- Each lookup is a per-key probe, so a call reads the rows of the streams it lists, not whole
-- tables: the planner cannot see how few streams a call lists, and without statistics on the
-- subscriptions it guesses 200 perspectives, so a plain join to wh_perspective_cursors made it
-- hash the whole cursor table on every call (one cursor per pair ever applied: the same join in
-- wh_drain measured 240 ms per call at 125 000 cursors, against 11 ms as one primary-key probe
-- per pair); a LATERAL ... LIMIT 1 cannot be flattened back into that join. Likewise the listed
-- streams the caller holds are found by one primary-key probe per listed stream (filtering every
-- stream it holds through the owner index took 27 ms for 250 of 100 000). Each pair's rows are
-- read through the (stream_id, perspective_name, stream_version) index with a LATERAL ... LIMIT,
-- a shape the planner keeps even when statistics are stale (a table that just grew from empty is
-- exactly when a worker gets busy).

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
