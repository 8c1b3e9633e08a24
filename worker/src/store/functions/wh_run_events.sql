-- wh_run_events(...): the events of a batch handler's run as a relation, what the handler's
-- `:events` reads. The apply functions pass the run's slices of their per-event arrays; the
-- result has one row per event, in the order given (ordinal from 1), its columns named like the
-- per-event parameters. user_id and tenant_id arrive as '' for none (the apply functions' form)
-- and leave as NULL, as :user_id and :tenant_id do. A plain SQL function: the planner inlines it
-- into the handler's statement.

CREATE OR REPLACE FUNCTION {{schema}}.wh_run_events(
    p_stream_ids uuid[], p_event_ids uuid[], p_versions bigint[], p_types text[],
    p_data jsonb[], p_metadata jsonb[], p_scope jsonb[], p_created timestamptz[],
    p_users text[], p_tenants text[])
RETURNS TABLE (stream_id uuid, event_id uuid, stream_version bigint, event_type text,
               data jsonb, metadata jsonb, scope jsonb, created_at timestamptz,
               user_id text, tenant_id text, ordinal bigint)
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT x.s, x.e, x.v, x.t, x.d, x.m, x.sc, x.c, nullif(x.u, ''), nullif(x.tn, ''), x.o
  FROM unnest(p_stream_ids, p_event_ids, p_versions, p_types, p_data, p_metadata, p_scope,
              p_created, p_users, p_tenants)
       WITH ORDINALITY AS x(s, e, v, t, d, m, sc, c, u, tn, o)
$$;
