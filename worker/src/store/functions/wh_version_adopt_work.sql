-- wh_version_adopt_work(from, to): the work rows of perspective `from` become rows of `to`,
-- except those whose event `to` already has a row for (kept as they are: one is enough). Used
-- by the blue/green switch (the next version's rows take the perspective's name) and after it,
-- for rows that producers in flight at the switch created under the next version's internal
-- name (their trigger read the subscriptions before the switch committed).

CREATE OR REPLACE FUNCTION {{schema}}.wh_version_adopt_work(p_from text, p_to text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
  v_n bigint;
BEGIN
  WITH moved AS (
    DELETE FROM {{schema}}.wh_perspective_events WHERE perspective_name = p_from
    RETURNING stream_id, event_id, stream_version, partition_number, attempts, scheduled_for,
              error, processed_at, created_at)
  INSERT INTO {{schema}}.wh_perspective_events
    (stream_id, perspective_name, event_id, stream_version, partition_number, attempts,
     scheduled_for, error, processed_at, created_at)
  SELECT stream_id, p_to, event_id, stream_version, partition_number, attempts, scheduled_for,
         error, processed_at, created_at
  FROM moved
  ON CONFLICT DO NOTHING;
  GET DIAGNOSTICS v_n = ROW_COUNT;
  RETURN v_n;
END
$$;
