-- 0005: a stream belongs to its owner for as long as the owner heartbeats, so
-- wh_active_streams keeps no lease: its lease_expiry and last_activity_at columns were written on
-- every claim and read by nothing. claim_work loses its lease argument; the functions that
-- release streams stop clearing the column.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

DROP FUNCTION {{schema}}.claim_work(uuid, integer, integer, double precision);

-- The only polled query (as in 0002, without the lease).
CREATE FUNCTION {{schema}}.claim_work(
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
                OFFSET 0)
  ORDER BY a.created_at
  LIMIT p_max_streams;
END
$$;

-- As in 0002, without the stream lease.
CREATE OR REPLACE FUNCTION {{schema}}.cleanup_stale_instances(p_instance_id uuid, p_stale_seconds double precision)
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
  UPDATE {{schema}}.wh_active_streams SET assigned_instance_id = NULL
  WHERE assigned_instance_id = ANY (v_dead);
  UPDATE {{schema}}.wh_perspective_events SET instance_id = NULL, lease_expiry = NULL
  WHERE instance_id = ANY (v_dead) AND processed_at IS NULL;
  PERFORM pg_notify('{{schema}}_work', 'orphan');
  RETURN cardinality(v_dead);
END
$$;

-- As in 0002, without the stream lease.
CREATE OR REPLACE FUNCTION {{schema}}.deregister_instance(p_instance_id uuid)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM {{schema}}.cleanup_completed_streams(p_instance_id, ARRAY(
    SELECT a.stream_id FROM {{schema}}.wh_active_streams a WHERE a.assigned_instance_id = p_instance_id));
  UPDATE {{schema}}.wh_active_streams SET assigned_instance_id = NULL
  WHERE assigned_instance_id = p_instance_id;
  UPDATE {{schema}}.wh_perspective_events SET instance_id = NULL, lease_expiry = NULL
  WHERE instance_id = p_instance_id AND processed_at IS NULL;
  DELETE FROM {{schema}}.wh_service_instances WHERE instance_id = p_instance_id;
  PERFORM pg_notify('{{schema}}_work', 'orphan');
END
$$;

ALTER TABLE {{schema}}.wh_active_streams
  DROP COLUMN lease_expiry,
  DROP COLUMN last_activity_at;
