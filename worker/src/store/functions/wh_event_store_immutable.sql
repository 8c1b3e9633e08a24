-- Trigger function that keeps the event store append-only. Fired before UPDATE, DELETE and
-- TRUNCATE of wh_event_store (statement triggers), it refuses them with SQLSTATE WH405 and a hint
-- to append a compensating event; fired again before DELETE for each row (its second trigger), it
-- lets through only retention (wh_delete_applied_events), and only events nothing still needs:
--   * the transaction must carry the `perspective.retention` setting naming this schema (set by
--     wh_delete_applied_events), so a plain DELETE is refused as append-only;
--   * that setting is no proof (any session can set it), so each event is checked here as well:
--     no pending work row and no dead letter waiting for a replay (a replay reads the event from
--     the store). An event that fails the check is refused, naming it.

CREATE OR REPLACE FUNCTION {{schema}}.wh_event_store_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' AND current_setting('perspective.retention', true) = '{{schema}}' THEN
    IF TG_LEVEL = 'STATEMENT' THEN
      RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM {{schema}}.wh_perspective_events w
               WHERE w.stream_id = OLD.stream_id AND w.stream_version = OLD.stream_version
                 AND w.processed_at IS NULL)
       OR EXISTS (SELECT 1 FROM {{schema}}.wh_dead_letters d
                  WHERE d.event_id = OLD.event_id AND d.recovery_status = 'pending') THEN
      RAISE EXCEPTION 'event % (stream %, version %) is still needed: it has pending work or a dead letter waiting for a replay',
          OLD.event_id, OLD.stream_id, OLD.stream_version
        USING ERRCODE = 'WH405',
              HINT = 'retention deletes only applied events; use {{schema}}.wh_delete_applied_events(interval)';
    END IF;
    RETURN OLD;
  END IF;
  RAISE EXCEPTION '{{schema}}.wh_event_store is append-only: % is not allowed', TG_OP
    USING ERRCODE = 'WH405',
          HINT = CASE WHEN TG_OP = 'DELETE'
                      THEN 'append a compensating event instead; old applied events may be removed with {{schema}}.wh_delete_applied_events(interval)'
                      ELSE 'append a compensating event instead' END;
END
$$;
