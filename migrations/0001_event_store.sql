-- 0001: event store, producer path and the tables every later part stands on.
--
-- Template: `{{schema}}` is replaced by the deployment's schema name (validated as
-- [a-z_][a-z0-9_]*) before this runs. Every object is schema-qualified, so the functions and
-- triggers behave the same whatever the caller's search_path is, without paying for a
-- per-call `SET search_path`.

-- UUIDv7 (RFC 9562): 48-bit unix-millisecond timestamp, version 7, random rest. Sorts by time.
CREATE FUNCTION {{schema}}.wh_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$;

-- Stable stream -> partition mapping; unowned streams are spread over live workers by
-- `partition_number % live_instances = rank`.
CREATE FUNCTION {{schema}}.compute_partition(p_stream_id uuid, p_partition_count integer DEFAULT 10000)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT ((uuid_hash(p_stream_id)::bigint + 2147483648) % p_partition_count)::integer
$$;

-- Per-stream head. Its row lock, taken when an event is appended and held until commit, is what
-- makes stream versions follow commit order: a second writer of the same stream waits, then
-- gets the next version.
CREATE TABLE {{schema}}.wh_streams (
  stream_id  uuid        PRIMARY KEY,
  version    bigint      NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {{schema}}.wh_event_store (
  -- Filled with a UUIDv7 by the insert trigger when the caller leaves it out (see below).
  event_id       uuid        NOT NULL,
  stream_id      uuid        NOT NULL,
  stream_version bigint      NOT NULL,
  event_type     text        NOT NULL CHECK (event_type <> ''),
  event_data     jsonb       NOT NULL DEFAULT '{}',
  metadata       jsonb       NOT NULL DEFAULT '{}',
  scope          jsonb       NOT NULL DEFAULT '{}',
  created_at     timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT wh_event_store_pkey PRIMARY KEY (event_id),
  CONSTRAINT wh_event_store_stream_version_key UNIQUE (stream_id, stream_version)
);

-- Which perspective handles which event type. Written by `perspective-worker migrate`.
CREATE TABLE {{schema}}.wh_perspective_subscriptions (
  event_type       text        NOT NULL,
  perspective_name text        NOT NULL,
  created_at       timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (event_type, perspective_name)
);

-- Work rows: one per (stream, perspective, event), created in the appending transaction and
-- deleted (or stamped, in debug mode) once applied. Kept narrow and lightly indexed: producers
-- pay for every index here on every append. Workers find work through wh_active_streams and
-- then read a stream's rows in version order through uq_perspective_event. (Keyed by
-- stream_version rather than event_id: within a stream the two identify the same event, and the
-- version order is what the apply path range-scans.)
CREATE TABLE {{schema}}.wh_perspective_events (
  event_work_id    bigint      GENERATED ALWAYS AS IDENTITY (CACHE 64) PRIMARY KEY,
  stream_id        uuid        NOT NULL,
  perspective_name text        NOT NULL,
  event_id         uuid        NOT NULL,
  stream_version   bigint      NOT NULL,
  partition_number integer     NOT NULL,
  instance_id      uuid,
  lease_expiry     timestamptz,
  attempts         integer     NOT NULL DEFAULT 0,
  scheduled_for    timestamptz,
  error            text,
  processed_at     timestamptz,
  created_at       timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT uq_perspective_event UNIQUE (stream_id, perspective_name, stream_version)
)
-- Leasing a row rewrites it; free space on its page lets that be a HOT update (no index
-- insertions), which halves the cost of claiming a backlog.
WITH (fillfactor = 60);

-- Position of each (stream, perspective): advanced in the same transaction that changes the
-- read model, so it is the durable exactly-once floor.
CREATE TABLE {{schema}}.wh_perspective_cursors (
  stream_id               uuid        NOT NULL,
  perspective_name        text        NOT NULL,
  last_version            bigint      NOT NULL DEFAULT 0,
  last_event_id           uuid,
  -- flags: None 0, Processing 1, Completed 2, Failed 4, CatchingUp 8, RewindRequired 32
  status                  smallint    NOT NULL DEFAULT 0,
  error                   text,
  attempts                integer     NOT NULL DEFAULT 0,
  processed_at            timestamptz NOT NULL DEFAULT now(),
  rewind_trigger_event_id uuid,
  rewind_flagged_at       timestamptz,
  rewind_first_flagged_at timestamptz,
  stream_lock_instance_id uuid,
  stream_lock_expiry      timestamptz,
  stream_lock_reason      text,
  PRIMARY KEY (stream_id, perspective_name)
);
CREATE INDEX wh_perspective_cursors_failed ON {{schema}}.wh_perspective_cursors (perspective_name)
  WHERE (status & 4) <> 0;
CREATE INDEX wh_perspective_cursors_rewind ON {{schema}}.wh_perspective_cursors (perspective_name)
  WHERE (status & 32) <> 0;

-- Streams with work not yet completed, and who owns them. A producer inserts the row when it
-- creates a stream's first pending work (the empty -> non-empty edge, which is also when it
-- rings the doorbell); workers pin, take over and finally delete it once the stream is drained.
--
-- Deleting it must not lose a wake-up: a producer that saw the row (so did not ring) may commit
-- new work just after a worker found the stream empty. Workers therefore delete only streams
-- whose wh_streams row they could lock (`FOR SHARE SKIP LOCKED`: a producer of that stream holds
-- the row lock until it commits), and check for pending work in a statement after taking that
-- lock. A locked stream has a producer in flight and keeps its row; a producer arriving later
-- waits for the worker's transaction, finds the row gone, re-inserts it and rings.
CREATE TABLE {{schema}}.wh_active_streams (
  stream_id            uuid        PRIMARY KEY,
  partition_number     integer     NOT NULL,
  assigned_instance_id uuid,
  lease_expiry         timestamptz,
  created_at           timestamptz NOT NULL DEFAULT now(),
  last_activity_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX wh_active_streams_assigned ON {{schema}}.wh_active_streams (assigned_instance_id)
  WHERE assigned_instance_id IS NOT NULL;

CREATE TABLE {{schema}}.wh_service_instances (
  instance_id       uuid        PRIMARY KEY,
  service_name      text        NOT NULL,
  host_name         text        NOT NULL,
  process_id        integer     NOT NULL,
  started_at        timestamptz NOT NULL DEFAULT now(),
  last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
  metadata          jsonb       NOT NULL DEFAULT '{}'
);

-- Poison work: the work row's coordinates plus a snapshot of the event, so the row can be
-- inspected and replayed even if the event store is pruned.
CREATE TABLE {{schema}}.wh_dead_letters (
  dead_letter_id   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  event_work_id    bigint      NOT NULL,
  stream_id        uuid        NOT NULL,
  perspective_name text        NOT NULL,
  event_id         uuid        NOT NULL,
  stream_version   bigint      NOT NULL,
  event_type       text        NOT NULL,
  event            jsonb       NOT NULL,
  error            text,
  attempts         integer     NOT NULL,
  first_failed_at  timestamptz,
  dead_lettered_at timestamptz NOT NULL DEFAULT now(),
  dead_lettered_by uuid,
  recovery_status  text        NOT NULL DEFAULT 'pending'
                   CHECK (recovery_status IN ('pending', 'replayed', 'discarded')),
  recovered_at     timestamptz,
  replay_count     integer     NOT NULL DEFAULT 0
);
CREATE INDEX wh_dead_letters_pending ON {{schema}}.wh_dead_letters (perspective_name)
  WHERE recovery_status = 'pending';

-- PostLifecycle fired for this event (used to reconcile orphaned lifecycles after a crash).
CREATE TABLE {{schema}}.wh_lifecycle_completions (
  event_id     uuid        PRIMARY KEY,
  instance_id  uuid,
  completed_at timestamptz NOT NULL DEFAULT now()
);

-- The producer path, one BEFORE ROW trigger so a single-event append costs one PL/pgSQL call:
--   1. give the event a UUIDv7 id, or, when the caller supplied one, refuse it if it already
--      exists (also under ON CONFLICT DO NOTHING, which would otherwise skip the row after this
--      trigger had created its work). Generated ids cannot collide, so only supplied ids pay for
--      the probe;
--   2. assign stream_version under the wh_streams row lock (commit order, gapless); a caller
--      that supplies stream_version gets it checked (optimistic concurrency for plain INSERTs);
--   3. fan out one work row per subscribed perspective;
--   4. on the stream's empty -> non-empty edge, pin it in wh_active_streams and NOTIFY
--      `<schema>_work` (PostgreSQL folds identical notifications, so at most one per
--      transaction, and none for transactions that roll back).
CREATE FUNCTION {{schema}}.wh_event_store_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
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
      PERFORM pg_notify('{{schema}}_work', '');
    END IF;
  END IF;

  RETURN NEW;
END
$$;

CREATE TRIGGER wh_event_store_before_insert
  BEFORE INSERT ON {{schema}}.wh_event_store
  FOR EACH ROW EXECUTE FUNCTION {{schema}}.wh_event_store_before_insert();

-- History is append-only: versions, ids and payloads of stored events never change.
CREATE FUNCTION {{schema}}.wh_event_store_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION '{{schema}}.wh_event_store is append-only: % is not allowed', TG_OP
    USING ERRCODE = 'WH405',
          HINT = 'append a compensating event instead';
END
$$;

CREATE TRIGGER wh_event_store_immutable
  BEFORE UPDATE ON {{schema}}.wh_event_store
  FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.wh_event_store_immutable();

-- Append several events to one stream with optimistic concurrency.
--   p_expected_version: the version the caller last saw (0 for a new stream), or NULL to append
--   whatever the current version is.
--   p_events: JSON array of {"event_type": text, "event_data"?: object, "metadata"?: object,
--   "scope"?: object, "event_id"?: uuid}.
-- All events are written or none; a stale expected version raises SQLSTATE WH409 naming the
-- stream, the expected and the actual version.
CREATE FUNCTION {{schema}}.append_events(p_stream_id uuid, p_expected_version bigint, p_events jsonb)
RETURNS TABLE (event_id uuid, stream_version bigint)
LANGUAGE plpgsql AS $$
DECLARE
  v_bad record;
BEGIN
  IF p_stream_id IS NULL THEN
    RAISE EXCEPTION 'append_events: stream_id must not be null' USING ERRCODE = '22004';
  END IF;
  IF jsonb_typeof(p_events) IS DISTINCT FROM 'array' THEN
    RAISE EXCEPTION 'append_events: events must be a JSON array, got %', coalesce(jsonb_typeof(p_events), 'null')
      USING ERRCODE = '22023';
  END IF;
  SELECT x.ord, x.ev INTO v_bad
  FROM jsonb_array_elements(p_events) WITH ORDINALITY AS x(ev, ord)
  WHERE jsonb_typeof(x.ev) <> 'object'
     OR jsonb_typeof(x.ev -> 'event_type') IS DISTINCT FROM 'string'
     OR x.ev ->> 'event_type' = ''
     OR EXISTS (SELECT 1 FROM jsonb_object_keys(x.ev) k
                WHERE k NOT IN ('event_type', 'event_data', 'metadata', 'scope', 'event_id'))
  ORDER BY x.ord LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'append_events: event % of % is not an object with a non-empty "event_type" and only the keys event_type, event_data, metadata, scope, event_id: %',
        v_bad.ord, jsonb_array_length(p_events), left(v_bad.ev::text, 200)
      USING ERRCODE = '22023';
  END IF;

  RETURN QUERY
  INSERT INTO {{schema}}.wh_event_store AS e
      (event_id, stream_id, stream_version, event_type, event_data, metadata, scope)
  SELECT (x.ev ->> 'event_id')::uuid,
         p_stream_id,
         p_expected_version + x.ord,
         x.ev ->> 'event_type',
         coalesce(x.ev -> 'event_data', '{}'),
         coalesce(x.ev -> 'metadata', '{}'),
         coalesce(x.ev -> 'scope', '{}')
  FROM jsonb_array_elements(p_events) WITH ORDINALITY AS x(ev, ord)
  ORDER BY x.ord
  RETURNING e.event_id, e.stream_version;
END
$$;
