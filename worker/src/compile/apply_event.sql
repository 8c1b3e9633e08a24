{#- Applies event v_i: binds the parameters its handler uses (every assignment costs, per
    event), sets the event's identity for row-level security and current_setting(), and runs
    the handler of its type. A batch handler (one that reads :events) runs once for the run of
    events from v_i to v_j: the consecutive events of its type, at most up to run_to (otherwise
    v_j is v_i; without batch handlers v_j is not used and the callers' loops step by one); the identity set is the run's when all its events share it, else '' (each
    event's is in :events). The caller goes on at v_j + 1. Slots: uses, handlers (event_type,
    statements), batch_types (the batch handlers' types as SQL literals, '' for none), run_to,
    run_streams (the run's stream ids, an array expression over v_i..v_j). #}
{% if batch_types %}
      v_j := v_i;
      v_run_user := a_users[v_i];
      v_run_tenant := a_tenants[v_i];
      IF a_types[v_i] IN ({{ batch_types }}) THEN
        WHILE v_j < {{ run_to }} AND a_types[v_j + 1] = a_types[v_i] LOOP
          v_j := v_j + 1;
          IF a_users[v_j] <> v_run_user THEN
            v_run_user := '';
          END IF;
          IF a_tenants[v_j] <> v_run_tenant THEN
            v_run_tenant := '';
          END IF;
        END LOOP;
        _wh_run_streams := {{ run_streams }};
      END IF;
{% endif %}
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
{% set user = "v_run_user" if batch_types else "a_users[v_i]" %}
{% set tenant = "v_run_tenant" if batch_types else "a_tenants[v_i]" %}
      IF v_set_user IS DISTINCT FROM {{ user }} THEN
        v_set_user := set_config('perspective.user_id', {{ user }}, true);
      END IF;
      IF v_set_tenant IS DISTINCT FROM {{ tenant }} THEN
        v_set_tenant := set_config('perspective.tenant_id', {{ tenant }}, true);
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
