{#- The per-event columns read from wh_event_store, one array each, in `order_by` order (the
    group's version order, or event-id order for a rewind's replay). Columns no handler uses
    are not copied: every array element costs. Slots: order_by, uses. #}
array_agg(e.event_type ORDER BY {{ order_by }}),
{% if uses.data %}
         array_agg(e.event_data ORDER BY {{ order_by }}),
{% else %}
         NULL::jsonb[],
{% endif %}
{% if uses.metadata %}
         array_agg(e.metadata ORDER BY {{ order_by }}),
{% else %}
         NULL::jsonb[],
{% endif %}
{% if uses.scope %}
         array_agg(e.scope ORDER BY {{ order_by }}),
{% else %}
         NULL::jsonb[],
{% endif %}
{% if uses.created_at %}
         array_agg(e.created_at ORDER BY {{ order_by }}),
{% else %}
         NULL::timestamptz[],
{% endif %}
         array_agg(coalesce(e.metadata ->> 'user_id', e.scope ->> 'user_id', '') ORDER BY {{ order_by }}),
         array_agg(coalesce(e.scope ->> 'tenant_id', e.metadata ->> 'tenant_id', '') ORDER BY {{ order_by }})
