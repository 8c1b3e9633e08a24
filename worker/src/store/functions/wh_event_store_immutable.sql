-- Trigger function that keeps the event store append-only: fired before UPDATE, DELETE and
-- TRUNCATE of wh_event_store (statement triggers), it refuses them with SQLSTATE WH405 and a
-- hint to append a compensating event. The one exception is retention: a DELETE made by
-- wh_delete_applied_events, which marks its transaction with the `perspective.retention`
-- setting naming this schema (so a retention run in one schema opens no other).

CREATE OR REPLACE FUNCTION {{schema}}.wh_event_store_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' AND current_setting('perspective.retention', true) = '{{schema}}' THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION '{{schema}}.wh_event_store is append-only: % is not allowed', TG_OP
    USING ERRCODE = 'WH405',
          HINT = CASE WHEN TG_OP = 'DELETE'
                      THEN 'append a compensating event instead; old applied events may be removed with {{schema}}.wh_delete_applied_events(interval)'
                      ELSE 'append a compensating event instead' END;
END
$$;
