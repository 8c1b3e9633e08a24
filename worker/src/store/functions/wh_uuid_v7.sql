-- wh_uuid_v7(): a UUIDv7 (RFC 9562): 48-bit unix-millisecond timestamp, version 7, random rest,
-- so ids sort by time. The default event id, filled by the insert trigger
-- (wh_event_store_before_insert) when the producer leaves event_id out; written in SQL so the
-- server needs no extension.

CREATE OR REPLACE FUNCTION {{schema}}.wh_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$;
