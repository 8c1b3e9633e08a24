{#- Lifecycle (p_notify_applied): the ids of the events this call applied (PostPerspective is due
    for them), and of those every subscribed perspective has now applied, each announced with
    pg_notify on `<schema>_applied` (PostAllPerspectives). Slots: schema, applied_channel. #}
    IF p_notify_applied AND v_applied > 0 THEN
      IF v_rewound THEN
        -- The group's new events (the replay, in event-id order, re-applied older ones too).
        SELECT coalesce(array_agg(x.id ORDER BY x.version), '{}') INTO v_applied_ids
        FROM unnest(a_event_ids, a_versions) AS x(id, version)
        WHERE x.version > v_last0 AND x.version <= v_new_last;
      ELSE
        v_applied_ids := a_event_ids[v_start:v_last_i];
      END IF;
      -- Serialise this check per stream, so of two perspectives finishing the same event at the
      -- same time the second one sees the first one's cursor (it runs after that commit).
      PERFORM pg_advisory_xact_lock(hashtext('{{ schema }}.wh_applied'), hashtext(p_stream_id::text));
      -- This perspective's cursor has moved already (in this transaction).
      SELECT coalesce(array_agg(x.id ORDER BY x.version), '{}') INTO v_completed
      FROM unnest(a_event_ids, a_versions) AS x(id, version)
      WHERE x.version > v_last0 AND x.version <= v_new_last
        AND x.version IN (SELECT v FROM {{ schema }}.wh_applied_by_all(p_stream_id, a_versions, a_types) AS v);
      PERFORM pg_notify({{ applied_channel | literal }}, c::text) FROM unnest(v_completed) AS c;
    END IF;
