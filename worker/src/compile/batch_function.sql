{#- A perspective's batch function, for wh_drain's set-based path (drain.sql): applies the events
    of many shallow (stream, perspective) pairs in one loop, in the order given (each pair's
    events in version order). It applies only: wh_drain holds the pairs' cursor locks, checked
    their windows (no rewind, no failure pending, every row available) and moves the cursors
    and completes the rows afterwards, in one statement each. An error raises (wh_drain then
    applies the pairs one by one, isolating it), except a handler cancelled by the statement
    timeout (worker.handlerTimeoutMilliseconds), which returns the index of the event it was
    running (not to be run again) with the error. Past p_stop_at no event but the first starts:
    o_applied is the prefix applied. Drop overloads of an older shape, then CREATE OR REPLACE.
    Slots: schema, function, tag (a dollar quote not in the body), and those of apply_event.sql. #}
{% set args = "uuid[], uuid[], bigint[], timestamp with time zone" %}
{% set result = "o_applied integer, o_cancelled integer, o_error text" %}
{% with name = function %}{% include "drop_older_overloads.sql" %}{% endwith %}
CREATE OR REPLACE FUNCTION {{ schema }}.{{ function }}(
    p_stream_ids uuid[], p_event_ids uuid[], p_versions bigint[], p_stop_at timestamptz)
RETURNS TABLE ({{ result }})
LANGUAGE plpgsql
-- Handler SQL names its tables as `setup` created them; resolve them the same way whoever calls.
SET search_path TO {{ schema }}, public
AS {{ tag }}
#variable_conflict use_column
DECLARE
{% with stream_init = "" %}{% include "handler_variables.sql" %}{% endwith %}
  -- Local copies: PL/pgSQL keeps local arrays expanded, so a[i] is O(1).
  a_streams   uuid[]   := p_stream_ids;
  a_event_ids uuid[]   := p_event_ids;
  a_versions  bigint[] := p_versions;
  a_types     text[];
  a_data      jsonb[];
  a_metadata  jsonb[];
  a_scope     jsonb[];
  a_created   timestamptz[];
  a_users     text[];
  a_tenants   text[];
  v_n         integer := coalesce(cardinality(p_versions), 0);
  v_i         integer;
  v_running   integer;
  -- What perspective.user_id / tenant_id are currently set to in this transaction (NULL: unknown).
  v_set_user   text;
  v_set_tenant text;
BEGIN
  -- The events, by (stream, version) through the store's unique index, in the order given.
  -- One index probe per event, forced by the LATERAL ... LIMIT 1 (the pair is unique anyway):
  -- as a join, a custom plan of a store of tens of thousands of events hashed all of it
  -- (12 ms for 340 events at 30 000, against 1.3 ms probing).
  SELECT {%+ with order_by = "x.i" %}{% include "event_arrays.sql" %}{% endwith %}
    INTO a_types, a_data, a_metadata, a_scope, a_created, a_users, a_tenants
  FROM unnest(a_streams, a_versions) WITH ORDINALITY AS x(stream_id, stream_version, i)
  CROSS JOIN LATERAL (SELECT * FROM {{ schema }}.wh_event_store e0
                      WHERE e0.stream_id = x.stream_id AND e0.stream_version = x.stream_version
                      LIMIT 1) e;
  IF coalesce(array_length(a_types, 1), 0) <> v_n THEN
    RAISE EXCEPTION 'events are missing from {{ schema }}.wh_event_store' USING ERRCODE = 'WH404';
  END IF;
  BEGIN
{% if batch_types %}
    -- (A WHILE loop: a batch handler's run moves v_i past its last event.)
    v_i := 1;
    WHILE v_i <= v_n LOOP
{% else %}
    FOR v_i IN 1..v_n LOOP
{% endif %}
      IF v_i > 1 AND clock_timestamp() >= p_stop_at THEN
        RETURN QUERY SELECT v_i - 1, NULL::integer, NULL::text;
        RETURN;
      END IF;
      v_running := v_i;
      _wh_stream_id := a_streams[v_i];
{% with run_to = "v_n", run_streams = "a_streams[v_i:v_j]" %}{% include "apply_event.sql" %}{% endwith %}
{% if batch_types %}
      v_i := v_j + 1;
{% endif %}
    END LOOP;
  EXCEPTION WHEN query_canceled THEN
    RETURN QUERY SELECT 0, v_running, SQLERRM;
    RETURN;
  END;
  RETURN QUERY SELECT v_n, NULL::integer, NULL::text;
END
{{ tag }}
