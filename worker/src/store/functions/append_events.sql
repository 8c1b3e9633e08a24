-- append_events(stream, expected version, events): append several events to one stream with
-- optimistic concurrency, all or none; part of the producer contract.
--   p_expected_version: the version the caller last saw (0 for a new stream), or NULL to append
--   whatever the current version is.
--   p_events: JSON array of {"event_type": text, "event_data"?: object, "metadata"?: object,
--   "scope"?: object, "event_id"?: uuid}; anything else is refused (SQLSTATE 22023) naming the
--   first bad element.
-- It inserts through the same trigger as any producer (ids, versions, work rows, NOTIFY), passing
-- the expected versions, so a stale expected version raises SQLSTATE WH409 naming the stream, the
-- expected and the actual version. Returns each event's id and version.
-- It runs as its owner (SECURITY DEFINER, with a fixed search_path): a producer needs USAGE on
-- the schema and EXECUTE on this function (granted to nobody by default: `migrate` revokes it
-- from PUBLIC), or INSERT on wh_event_store for plain INSERTs, and no other right.

CREATE OR REPLACE FUNCTION {{schema}}.append_events(p_stream_id uuid, p_expected_version bigint, p_events jsonb)
RETURNS TABLE (event_id uuid, stream_version bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
