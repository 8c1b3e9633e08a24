-- Trigger function of the producer path (BEFORE INSERT FOR EACH ROW on wh_event_store), one
-- trigger so that appending one event costs one PL/pgSQL call:
--   1. give the event a UUIDv7 id, or, when the caller supplied one, refuse it if it already
--      exists (also under ON CONFLICT DO NOTHING, which would otherwise skip the row after this
--      trigger had created its work). Generated ids cannot collide, so only supplied ids pay for
--      the probe;
--   2. assign stream_version under the wh_streams row lock: a second writer of the stream waits
--      for the first to commit, so versions follow commit order with no gaps; a caller that
--      supplies stream_version gets it checked (SQLSTATE WH409: optimistic concurrency for plain
--      INSERTs);
--   3. fan out one work row per perspective subscribed to the event's type (none when nothing
--      subscribes);
--   4. on the stream's empty -> non-empty edge, pin it in wh_active_streams and NOTIFY
--      `<schema>_work` (PostgreSQL folds identical notifications, so at most one per
--      transaction, and none for transactions that roll back), unless every live worker is
--      awake: claiming at its pace under load, without a doorbell (wh_claim_awake.sql).
-- Every name is schema-qualified, so it behaves the same whatever the producer's search_path.
-- It runs as its owner (SECURITY DEFINER, with a fixed search_path), so a producer needs only
-- INSERT on wh_event_store: the stream heads, work rows and active streams it writes are not the
-- producer's to touch (a producer that could write them could stall or gap other streams).

CREATE OR REPLACE FUNCTION {{schema}}.wh_event_store_before_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  v_version   bigint;
  v_partition integer;
BEGIN
  IF NEW.event_id IS NULL THEN
    NEW.event_id := {{schema}}.wh_uuid_v7();
  ELSIF EXISTS (SELECT 1 FROM {{schema}}.wh_event_store e WHERE e.event_id = NEW.event_id) THEN
    RAISE EXCEPTION 'event % already exists in {{schema}}.wh_event_store', NEW.event_id
      USING ERRCODE = 'unique_violation',
            HINT = 'event ids are unique; an event is appended once';
  END IF;

  INSERT INTO {{schema}}.wh_streams AS s (stream_id, version)
  VALUES (NEW.stream_id, 1)
  ON CONFLICT (stream_id) DO UPDATE SET version = s.version + 1
  RETURNING s.version INTO v_version;

  IF NEW.stream_version IS NOT NULL AND NEW.stream_version <> v_version THEN
    RAISE EXCEPTION 'stream %: expected version % but the stream is at version %',
        NEW.stream_id, NEW.stream_version - 1, v_version - 1
      USING ERRCODE = 'WH409',
            HINT = 'another writer appended first; reload the stream and retry';
  END IF;
  NEW.stream_version := v_version;

  v_partition := {{schema}}.compute_partition(NEW.stream_id);
  INSERT INTO {{schema}}.wh_perspective_events
      (stream_id, perspective_name, event_id, stream_version, partition_number)
  SELECT NEW.stream_id, sub.perspective_name, NEW.event_id, v_version, v_partition
  FROM {{schema}}.wh_perspective_subscriptions sub
  WHERE sub.event_type = NEW.event_type;

  IF FOUND THEN
    INSERT INTO {{schema}}.wh_active_streams (stream_id, partition_number)
    VALUES (NEW.stream_id, v_partition)
    ON CONFLICT (stream_id) DO NOTHING;
    IF FOUND THEN
      -- Not while every live worker is awake (wh_claim_awake.sql): each claims at its pace
      -- anyway, and ringing would hold the global notify lock through this commit. The lock,
      -- shared, keeps a worker from going to sleep between this look and the commit. Under
      -- REPEATABLE READ the look would read the transaction's first snapshot, older than the
      -- lock: such a transaction rings.
      PERFORM pg_advisory_xact_lock_shared(hashtextextended('{{schema}}.wh_doorbell', 0));
      IF current_setting('transaction_isolation') <> 'read committed'
         OR NOT coalesce((SELECT bool_and(i.awake) FROM {{schema}}.wh_service_instances i
                          WHERE i.stopping_since IS NULL), false) THEN
        PERFORM pg_notify('{{schema}}_work', '');
      END IF;
    END IF;
  END IF;

  RETURN NEW;
END
$$;
