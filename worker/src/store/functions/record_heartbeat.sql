-- record_heartbeat(instance, ...): register a worker instance, or refresh its heartbeat (and
-- metadata, process id). An instance is live while its heartbeat is younger than the stale
-- threshold the callers pass; claim_work ranks the live ones to share out unowned streams.

CREATE OR REPLACE FUNCTION {{schema}}.record_heartbeat(
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
