{#- Failure isolation: the fast path failed, so the group is replayed event by event (a batch
    handler's run is one event here), each in its own subtransaction, to commit the good prefix and stop at the failing event (v_failed,
    v_err), or at an event that meets contention (v_contended: not a failure, nothing recorded;
    the prefix stays). A rewind's replay is all or nothing and never comes here, nor does a
    fast path stopped by contention. Slots: those of apply_event.sql. #}
  -- Slow path: event by event, to keep the good prefix and isolate the failing event.
  IF NOT v_ok AND NOT v_rewound AND v_contended IS NULL THEN
    v_applied := 0;
    v_last_i := NULL;
    FOR v_i IN v_start..v_end LOOP
      IF v_cancelled IS NULL AND v_i > v_start AND clock_timestamp() >= p_stop_at THEN
        -- Past wh_drain's handler-timeout budget: the rest waits for the next call. (After a
        -- cancellation the call's timer is spent: replay the prefix and fail the cancelled one.)
        EXIT;
      END IF;
      IF v_i = v_cancelled THEN
        -- Cancelled on the fast path (the call's timer is spent): not run again.
        v_failed := v_i;
        v_err := v_cancel_err;
        EXIT;
      END IF;
      BEGIN
{% filter indent(2, true) %}
{% with run_to = "v_i", run_streams = "ARRAY[p_stream_id]" %}{% include "apply_event.sql" %}{% endwith %}
{% endfilter +%}
      EXCEPTION WHEN deadlock_detected OR serialization_failure OR lock_not_available THEN
        v_contended := SQLSTATE;
        v_set_user := NULL;
        v_set_tenant := NULL;
      WHEN OTHERS OR query_canceled THEN
        v_failed := v_i;
        v_err := SQLERRM;
        v_set_user := NULL;
        v_set_tenant := NULL;
      END;
      EXIT WHEN v_failed IS NOT NULL OR v_contended IS NOT NULL;
      v_applied := v_applied + 1;
      v_last_i := v_i;
    END LOOP;
  END IF;
