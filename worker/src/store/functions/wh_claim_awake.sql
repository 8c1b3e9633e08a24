-- wh_claim_awake(instance, awake): whether the instance's claim loop runs at its pace without a
-- doorbell (`wh_service_instances.awake`). Returns the state the instance is in now.
--   - Awake: at once. A producer that then sees every live worker awake does not ring; the
--     worker claims again within its pace, which is when a doorbell would have made it claim.
--   - Asleep: only in a moment when no producer is between a stream's first pending row and its
--     commit (each holds this lock, shared, from its trigger's look at the instances to the end
--     of its commit): otherwise the worker stays awake, returns true, and tries again after its
--     next claim. Called in a transaction of its own, so the state is committed, and the lock
--     released, when it returns. A producer that looked before, saw the worker awake and did
--     not ring, has committed by then: the claim the worker makes next, before it waits, takes
--     its stream. One that looks after sees the worker asleep and rings.
-- A caller not registered yet (no instance row) is asleep, as any instance that never says
-- otherwise.

CREATE OR REPLACE FUNCTION {{schema}}.wh_claim_awake(p_instance_id uuid, p_awake boolean)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
  IF p_awake THEN
    UPDATE {{schema}}.wh_service_instances SET awake = true
     WHERE instance_id = p_instance_id AND NOT awake;
    RETURN EXISTS (SELECT 1 FROM {{schema}}.wh_service_instances WHERE instance_id = p_instance_id);
  END IF;
  IF NOT EXISTS (SELECT 1 FROM {{schema}}.wh_service_instances
                 WHERE instance_id = p_instance_id AND awake) THEN
    RETURN false;
  END IF;
  IF NOT pg_try_advisory_xact_lock(hashtextextended('{{schema}}.wh_doorbell', 0)) THEN
    RETURN true;
  END IF;
  UPDATE {{schema}}.wh_service_instances SET awake = false WHERE instance_id = p_instance_id;
  RETURN false;
END
$$;
