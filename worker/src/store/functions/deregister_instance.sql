-- deregister_instance(instance): graceful shutdown. Retire the instance's drained streams
-- (cleanup_completed_streams), give back the rest and its work-row leases, delete the instance
-- and ring the doorbell ('orphan') so the remaining workers take its streams at once.

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
