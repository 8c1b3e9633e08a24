{#- ordering: eventId. A group holding an event older (by id) than the last one applied, or out
    of id order, rewinds the stream: the event arrays are replaced by all of the stream's
    handled events up to the group's end, in event-id order, to be replayed from scratch in the
    same transaction. With sequencing: key, the replay applies earlier events again whose keys
    wh_drain did not lock (it locks those of the pending rows): their locks are taken here, or,
    while another applier holds one, the pair is given up as contention (55P03) and retried,
    so that events of one key are never applied concurrently (see drain.sql).
    Slots: schema, handled_types, uses, lock (sequencing.rs; none for sequencing: stream). #}
  IF NOT p_force THEN
    v_prev := v_last_event;
    FOR v_i IN 1..v_n LOOP
      CONTINUE WHEN a_versions[v_i] <= v_last;
      IF v_prev IS NOT NULL AND a_event_ids[v_i] < v_prev THEN
        v_rewound := true;
        v_trigger := a_event_ids[v_i];
        EXIT;
      END IF;
      v_prev := a_event_ids[v_i];
    END LOOP;
  END IF;
  IF v_rewound THEN
    SELECT array_agg(e.event_id ORDER BY e.event_id), array_agg(e.stream_version ORDER BY e.event_id),
           {%+ filter indent(2) %}{% with order_by = "e.event_id" %}{% include "event_arrays.sql" %}{% endwith %}{% endfilter +%}
      INTO a_event_ids, a_versions, a_types, a_data, a_metadata, a_scope, a_created, a_users, a_tenants
    FROM {{ schema }}.wh_event_store e
    WHERE e.stream_id = p_stream_id AND e.stream_version <= g_versions[v_n]
      AND e.event_type IN ({{ handled_types|map("literal")|join(", ") }});
    v_n := coalesce(array_length(a_event_ids, 1), 0);
    v_last := 0;
{% if lock and lock.from_store %}
    IF EXISTS (SELECT 1 FROM (SELECT p_stream_id AS s, u.v FROM unnest(a_versions) AS u(v)) x
               {{ lock.join }} WHERE NOT pg_try_advisory_xact_lock({{ lock.class }}, {{ lock.slot }})) THEN
      RAISE EXCEPTION 'a sequencing key of {{ perspective }} is held by another applier (rewind)' USING ERRCODE = 'lock_not_available';
    END IF;
{% endif %}
  END IF;
