{#- The per-event columns read from wh_event_store, one array each, in `order_by` order (the
    group's version order, or event-id order for a rewind's replay; empty: the order the rows
    come in, which the caller then checks). Columns no handler uses are not copied: every array
    element costs. Slots: order_by, reads (uses, and every column when a batch handler reads
    :events). #}
{% set order = (" ORDER BY " ~ order_by) if order_by else "" %}
{#- An event's identity `key` (user_id, tenant_id): metadata's value, else scope's, and only a
    JSON string counts (a number or a nested object is no identity); '' when neither has one. #}
{% macro identity(key) -%}
coalesce(CASE WHEN jsonb_typeof(e.metadata -> '{{ key }}') = 'string' THEN e.metadata ->> '{{ key }}' END,
                            CASE WHEN jsonb_typeof(e.scope -> '{{ key }}') = 'string' THEN e.scope ->> '{{ key }}' END, '')
{%- endmacro %}
array_agg(e.event_type{{ order }}),
{% if reads.data %}
         array_agg(e.event_data{{ order }}),
{% else %}
         NULL::jsonb[],
{% endif %}
{% if reads.metadata %}
         array_agg(e.metadata{{ order }}),
{% else %}
         NULL::jsonb[],
{% endif %}
{% if reads.scope %}
         array_agg(e.scope{{ order }}),
{% else %}
         NULL::jsonb[],
{% endif %}
{% if reads.created_at %}
         array_agg(e.created_at{{ order }}),
{% else %}
         NULL::timestamptz[],
{% endif %}
         array_agg({{ identity("user_id") }}{{ order }}),
         array_agg({{ identity("tenant_id") }}{{ order }})
