{#- ordering: eventId. Before a rewind's replay, the perspective's `reset` removes the stream's
    share of the model, under the triggering event's identity. Slots: reset (the statements). #}
    IF v_rewound THEN
      -- The reset runs under the identity of the event that triggered the rewind (not whatever
      -- an earlier group of this transaction left set).
      SELECT i INTO v_trigger_i FROM generate_subscripts(a_event_ids, 1) AS i WHERE a_event_ids[i] = v_trigger;
      v_set_user := set_config('perspective.user_id', coalesce(a_users[v_trigger_i], ''), true);
      v_set_tenant := set_config('perspective.tenant_id', coalesce(a_tenants[v_trigger_i], ''), true);
{% for statement in reset %}
      {{ statement|indent(6) }};
{% endfor %}
    END IF;
