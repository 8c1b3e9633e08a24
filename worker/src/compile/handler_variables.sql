{#- The variables the handlers' parameters are bound to (apply_event.sql sets them per event),
    declared by the apply and batch functions. Slot: stream_init (how the stream id starts). #}
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
