-- claim_work(instance, max streams, stale seconds, offered, offered ids): the only polled
-- query. Returns at once when no stream has work. Otherwise takes ownership of up to
-- p_max_streams of the oldest unowned streams in this instance's partition share
-- (`partition_number % live_instances = rank`; the caller always counts itself live, so a late
-- heartbeat never makes it claim everything) and, while some owner is silent, of that owner's
-- streams too (a takeover, until the heartbeats abandon it), skipping rows other claimers hold;
-- then returns the oldest streams it holds that have due work and that the caller has not
-- queued or in flight. Held streams are re-offered on every poll, so a lost in-process signal
-- costs one poll, never a stranded stream.
--
-- Shaped for breadth (100 000 active streams): each step reads what it returns through an index
-- in age order (wh_active_streams_unowned, wh_active_streams_owner_age) and stops there; the few
-- distinct owners are found by skipping through the owner index. Before, a claim sorted every
-- active stream by age, probed each held stream twice and asked wh_backfill_gated once per
-- pending row: ~200 ms a claim.
--   - enable_sort = off: the planner cannot know how many streams the partition filter (a modulo
--     by the number of live instances) keeps, guesses very few, and would rather sort every
--     unowned stream by age than read them in age order through the index and stop. Every query
--     here has an index that yields its order, but the ranking of the (few) live instances,
--     whose sort the setting only makes look expensive: so jit = off too, or that cost would have
--     each call JIT-compile its queries (~200 ms). It runs no user code.
--   - p_offered_ids (the streams the caller has queued or in flight, or whose applied rows wait
--     for its flush) are not returned: they are the oldest it holds, and with a wide backlog a claim returned only them, so the worker
--     re-offered them in a tight loop while the rest waited. Passed over by a hash lookup, they
--     cost no probe of their pending work: at 100 000 one-event streams the listing probed
--     about 1 600 held streams a claim to return 600 new ones (issue 28). An older worker passes
--     only their number, p_offered (defaulting to 0, so a three-argument call keeps working
--     too), and gets that many more of the oldest it holds instead. What is taken and retired
--     per claim stays p_max_streams.
--   - Held streams with nothing pending (left by an instance that stopped before retiring them)
--     are retired among the p_max_streams oldest it holds, so their next event rings the
--     doorbell again; but only when the claim took no new stream and the caller has nothing
--     queued or in flight, or one time in ten. While claims take new streams (a backlog, or live
--     appends) the oldest held streams are the ones being drained, all with work; and while the
--     caller drains, its settler retires what it drained. The look was a third of a backlog's
--     claims, and 0.4 of a live claim's 1.3 ms at 1 000 events/s; at breadth, once the unowned
--     streams were all taken, it retired ahead of the settler in 6 ms a claim (issue 28).
--   - The backfill gate is asked only while a backfill waits or queues, once per held stream and
--     backfilling perspective.

CREATE OR REPLACE FUNCTION {{schema}}.claim_work(
    p_instance_id uuid, p_max_streams integer, p_stale_seconds double precision,
    p_offered integer DEFAULT 0, p_offered_ids uuid[] DEFAULT NULL)
RETURNS TABLE (stream_id uuid)
LANGUAGE plpgsql
SET enable_sort = off
SET jit = off
AS $$
DECLARE
  v_rank   integer;
  v_count  integer;
  v_stale  uuid[];
  v_claimed integer;
  v_backfilling text[];
  -- Streams returned at most, and whether the caller has any queued or in flight.
  v_limit  integer := p_max_streams
                      + CASE WHEN p_offered_ids IS NULL THEN greatest(p_offered, 0) ELSE 0 END;
  v_busy   boolean := coalesce(cardinality(p_offered_ids), greatest(p_offered, 0)) > 0;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {{schema}}.wh_active_streams) THEN
    RETURN;
  END IF;

  -- The caller always counts itself live, so a late heartbeat never makes it claim everything.
  -- A peer that is stopping (hand_over_streams marked it) has no share: it claims no more.
  SELECT r.rank, r.cnt INTO v_rank, v_count
  FROM (
    SELECT l.id, (row_number() OVER (ORDER BY l.id) - 1)::integer AS rank, (count(*) OVER ())::integer AS cnt
    FROM (
      SELECT i.instance_id AS id FROM {{schema}}.wh_service_instances i
      WHERE i.last_heartbeat_at >= now() - make_interval(secs => p_stale_seconds)
        AND i.stopping_since IS NULL
      UNION
      SELECT p_instance_id
    ) l
  ) r
  WHERE r.id = p_instance_id;

  -- Other owners that are not live (silent past p_stale_seconds, or gone): their streams are
  -- candidates too. The owners are few; skip from one to the next through the owner index.
  WITH RECURSIVE owners(id) AS (
    (SELECT a.assigned_instance_id FROM {{schema}}.wh_active_streams a
     WHERE a.assigned_instance_id IS NOT NULL ORDER BY 1 LIMIT 1)
    UNION ALL
    SELECT (SELECT a.assigned_instance_id FROM {{schema}}.wh_active_streams a
            WHERE a.assigned_instance_id > o.id ORDER BY 1 LIMIT 1)
    FROM owners o WHERE o.id IS NOT NULL
  )
  SELECT array_agg(o.id) INTO v_stale FROM owners o
  WHERE o.id IS NOT NULL AND o.id <> p_instance_id
    AND NOT EXISTS (SELECT 1 FROM {{schema}}.wh_service_instances i
                    WHERE i.instance_id = o.id
                      AND i.last_heartbeat_at >= now() - make_interval(secs => p_stale_seconds));

  -- The oldest candidates of this instance's partition share.
  IF v_stale IS NULL THEN
    -- Updated by their row address, not looked up again by key. A row another session changed
    -- after this statement's snapshot is locked in its new version, which the snapshot does
    -- not see: it is left unassigned, like one SKIP LOCKED passes over.
    UPDATE {{schema}}.wh_active_streams a
       SET assigned_instance_id = p_instance_id
    WHERE a.ctid = ANY (ARRAY(
      SELECT c.ctid
      FROM {{schema}}.wh_active_streams c
      WHERE c.assigned_instance_id IS NULL
        AND c.partition_number % v_count = v_rank
      ORDER BY c.created_at
      LIMIT p_max_streams
      FOR UPDATE OF c SKIP LOCKED));
    GET DIAGNOSTICS v_claimed = ROW_COUNT;
  ELSE
    -- A takeover (until the heartbeats abandon the silent owners and release their streams):
    -- the oldest of each kind, then the oldest of both, locked (those another session has
    -- locked meanwhile are left to it).
    WITH candidates AS (
      SELECT a.stream_id
      FROM {{schema}}.wh_active_streams a
      WHERE a.stream_id IN (
              SELECT u.stream_id FROM (
                (SELECT n.stream_id, n.created_at FROM {{schema}}.wh_active_streams n
                 WHERE n.assigned_instance_id IS NULL AND n.partition_number % v_count = v_rank
                 ORDER BY n.created_at LIMIT p_max_streams)
                UNION ALL
                (SELECT s.stream_id, s.created_at FROM {{schema}}.wh_active_streams s
                 WHERE s.assigned_instance_id = ANY (v_stale) AND s.partition_number % v_count = v_rank
                 ORDER BY s.created_at LIMIT p_max_streams)
              ) u
              ORDER BY u.created_at LIMIT p_max_streams)
        AND (a.assigned_instance_id IS NULL OR a.assigned_instance_id = ANY (v_stale))
      FOR UPDATE OF a SKIP LOCKED
    )
    UPDATE {{schema}}.wh_active_streams a
       SET assigned_instance_id = p_instance_id
    FROM candidates c
    WHERE a.stream_id = c.stream_id;
    GET DIAGNOSTICS v_claimed = ROW_COUNT;
  END IF;

  -- Streams this instance holds with nothing pending (left behind by an instance that stopped
  -- before retiring them): retire them, so their next event rings the doorbell again. Among
  -- the p_max_streams oldest it holds, the ones this claim looks at: one further back gets
  -- there as the older ones are drained and retired. Not while claims take new streams (a
  -- backlog, or live appends): the oldest held streams are then the ones being drained, all
  -- with work, and looking cost a probe each; nor while the caller drains (its settler retires
  -- what it drained). A held stream needs no retiring to be drained (the query below finds its
  -- work); one claim in ten still looks, so new streams that never stop coming do not stop it.
  IF (v_claimed = 0 AND NOT v_busy) OR random() < 0.1 THEN
    PERFORM {{schema}}.cleanup_completed_streams(p_instance_id, ARRAY(
      SELECT h.stream_id
      FROM (SELECT a.stream_id FROM {{schema}}.wh_active_streams a
            WHERE a.assigned_instance_id = p_instance_id
            ORDER BY a.created_at LIMIT p_max_streams) h
      WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                        WHERE w.stream_id = h.stream_id AND w.processed_at IS NULL
                        OFFSET 0)));
  END IF;

  -- The oldest held streams with due work that the caller has not queued or in flight (an
  -- older caller: p_offered more of them). A NOT IN over a subquery is looked up in a hash
  -- of it, so the caller's streams are passed over before their work is probed. Only while a
  -- backfill waits or queues can it hold work back (see wh_backfill_gated); otherwise the gate
  -- is not asked.
  v_backfilling := ARRAY(SELECT j.perspective_name FROM {{schema}}.wh_perspective_jobs j
                         WHERE j.kind = 'backfill' AND j.state IN ('waiting', 'queueing'));
  IF cardinality(v_backfilling) > 0 THEN
    -- The gate is asked once per held stream and backfilling perspective, not per pending row:
    -- a stream whose live events wait behind the gate can hold many rows, and the held streams
    -- are all looked at on every claim.
    RETURN QUERY
    SELECT a.stream_id
    FROM {{schema}}.wh_active_streams a
    WHERE a.assigned_instance_id = p_instance_id
      AND (p_offered_ids IS NULL
           OR a.stream_id NOT IN (SELECT o.id FROM unnest(p_offered_ids) AS o(id)))
      -- OFFSET 0 keeps this a per-stream index probe; flattened into a join, stale statistics
      -- can turn it into repeated scans of the whole work table.
      AND (EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                   WHERE w.stream_id = a.stream_id AND w.processed_at IS NULL
                     AND (w.scheduled_for IS NULL OR w.scheduled_for <= now())
                     AND w.perspective_name <> ALL (v_backfilling)
                   OFFSET 0)
           OR EXISTS (SELECT 1 FROM unnest(v_backfilling) AS b(name)
                      WHERE NOT {{schema}}.wh_backfill_gated(b.name, a.stream_id)
                        AND EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                                    WHERE w.stream_id = a.stream_id AND w.perspective_name = b.name
                                      AND w.processed_at IS NULL
                                      AND (w.scheduled_for IS NULL OR w.scheduled_for <= now())
                                    OFFSET 0)))
    ORDER BY a.created_at
    LIMIT v_limit;
  ELSE
    RETURN QUERY
    SELECT a.stream_id
    FROM {{schema}}.wh_active_streams a
    WHERE a.assigned_instance_id = p_instance_id
      AND (p_offered_ids IS NULL
           OR a.stream_id NOT IN (SELECT o.id FROM unnest(p_offered_ids) AS o(id)))
      AND EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
                  WHERE w.stream_id = a.stream_id AND w.processed_at IS NULL
                    AND (w.scheduled_for IS NULL OR w.scheduled_for <= now())
                  OFFSET 0)
    ORDER BY a.created_at
    LIMIT v_limit;
  END IF;
END
$$;
