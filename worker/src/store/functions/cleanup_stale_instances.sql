-- cleanup_stale_instances(caller, stale seconds): abandon the instances (other than the caller)
-- silent for longer than p_stale_seconds: delete them, release their streams (a stream belongs
-- to its owner only while the owner heartbeats; wh_active_streams keeps no lease of its own) and
-- their work-row leases, and ring the doorbell ('orphan') so live workers re-claim at once.
-- Returns how many instances were abandoned. Called by every worker's heartbeat task.

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
