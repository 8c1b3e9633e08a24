-- compute_partition(stream, count): the stream's stable partition number, 0..count-1. Stored on
-- work rows and wh_active_streams by the insert trigger and wh_queue_stream; claim_work spreads
-- unowned streams over the live instances by `partition_number % live_instances = rank`.
-- IMMUTABLE: the same stream always maps to the same partition.

CREATE OR REPLACE FUNCTION {{schema}}.compute_partition(p_stream_id uuid, p_partition_count integer DEFAULT 10000)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT ((uuid_hash(p_stream_id)::bigint + 2147483648) % p_partition_count)::integer
$$;
