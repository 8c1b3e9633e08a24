{#- Applies event v_i: binds the parameters its handler uses (every assignment costs, per
    event), sets the event's identity for row-level security and current_setting(), and runs
    the handler of its type. Slots: uses, handlers (event_type, statements). #}
{% if uses.event_id %}
      _wh_event_id := a_event_ids[v_i];
{% endif %}
{% if uses.stream_version %}
      _wh_stream_version := a_versions[v_i];
{% endif %}
{% if uses.event_type %}
      _wh_event_type := a_types[v_i];
{% endif %}
{% if uses.data %}
      _wh_data := a_data[v_i];
{% endif %}
{% if uses.metadata %}
      _wh_metadata := a_metadata[v_i];
{% endif %}
{% if uses.scope %}
      _wh_scope := a_scope[v_i];
{% endif %}
{% if uses.created_at %}
      _wh_created_at := a_created[v_i];
{% endif %}
      -- Consecutive events usually share an identity: set it only when it changes.
      IF v_set_user IS DISTINCT FROM a_users[v_i] THEN
        v_set_user := set_config('perspective.user_id', a_users[v_i], true);
      END IF;
      IF v_set_tenant IS DISTINCT FROM a_tenants[v_i] THEN
        v_set_tenant := set_config('perspective.tenant_id', a_tenants[v_i], true);
      END IF;
{% if uses.user_id %}
      _wh_user_id := nullif(a_users[v_i], '');
{% endif %}
{% if uses.tenant_id %}
      _wh_tenant_id := nullif(a_tenants[v_i], '');
{% endif %}
{% for handler in handlers %}
      {{ "IF" if loop.first else "ELSIF" }} a_types[v_i] = {{ handler.event_type|literal }} THEN
{% for statement in handler.statements %}
        {{ statement|indent(8) }};
{% endfor %}
{% endfor %}
      END IF;
