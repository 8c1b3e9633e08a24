{#- The variables the handlers' parameters are bound to (apply_event.sql sets them per event),
    declared by the apply and batch functions, and the run a batch handler reads as :events
    (events v_i..v_j, their streams, the identity they share; only with batch handlers). Slots:
    stream_init (how the stream id starts), batch_types. #}
  _wh_stream_id      uuid{{ stream_init }};
  _wh_event_id       uuid;
  _wh_stream_version bigint;
  _wh_event_type     text;
  _wh_data           jsonb;
  _wh_metadata       jsonb;
  _wh_scope          jsonb;
  _wh_created_at     timestamptz;
  _wh_user_id        text;
  _wh_tenant_id      text;
{% if batch_types %}
  v_j                integer;
  _wh_run_streams    uuid[];
  v_run_user         text;
  v_run_tenant       text;
{% endif %}
