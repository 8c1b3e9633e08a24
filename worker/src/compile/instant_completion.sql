{#- completionStrategy Instant (p_instant): the group's done work rows are completed inside the
    apply transaction instead of in batches after it commits. Slots: schema. #}
    IF p_instant AND cardinality(v_done) > 0 THEN
      PERFORM {{ schema }}.complete_perspective_events(v_done, p_debug);
    END IF;
