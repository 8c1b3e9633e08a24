{#- `<schema>.wh_drain`: claims and applies, in one call and one transaction, the pending work of
    the listed streams this instance owns. Per (stream, perspective): the window above the
    cursor (cut at the first unavailable row), the head row dead-lettered once it has failed
    p_max_attempts times, the rest handed to the perspective's apply function. No row leases
    are written: the rows are applied in the same transaction that selects them, under the
    cursor lock; failures count `attempts` instead. One row per pair out, with the versions of the
    rows taken (a dead-lettered head first) and when each row was created (latency, logs).
    Each pair runs in its own subtransaction: an error outside the apply function's per-event
    subtransactions (an event missing from the store, a lock or statement timeout, a deadlock,
    a serialization failure) undoes that pair only, and is recorded on it like a failing
    handler (the pair's head row: error, attempts, backoff; the cursor Failed), so the other
    pairs of the call commit and the failing one is retried with backoff, then dead-lettered.
    Slots: schema, perspectives (name, function), cursor_failed, retry_delay (the backoff after
    a failure of the head row, see store::failure::retry_delay_sql). #}
{#- Whether the pair has due work past `version` (one index probe). #}
{% macro due_after(version) -%}
EXISTS (SELECT 1 FROM {{ schema }}.wh_perspective_events w
                       WHERE w.stream_id = r.stream_id AND w.perspective_name = r.perspective_name
                         AND w.stream_version > {{ version }} AND w.processed_at IS NULL
                         AND (w.scheduled_for IS NULL OR w.scheduled_for <= now()))
{%- endmacro %}
{#- Retire the pair's rows at or below its cursor: applied already (completion pending or lost).
    The cursor is read in the same statement as the rows (one snapshot: a rebuild committing in
    between cannot pair its new rows with the old cursor), and this runs after the pair's apply,
    so work rows are locked after the cursor row, in the order `rebuild` takes them. #}
{% macro retire(except) -%}
    v_retire := ARRAY(
      SELECT w.event_work_id FROM {{ schema }}.wh_perspective_events w
      WHERE w.stream_id = r.stream_id AND w.perspective_name = r.perspective_name
        AND w.stream_version <= (SELECT c.last_version FROM {{ schema }}.wh_perspective_cursors c
                                 WHERE c.stream_id = r.stream_id AND c.perspective_name = r.perspective_name)
        AND w.processed_at IS NULL{{ except }}
      OFFSET 0);
    IF cardinality(v_retire) > 0 THEN
      PERFORM {{ schema }}.complete_perspective_events(v_retire, p_debug);
    END IF;
{%- endmacro %}
{% set args = "uuid, uuid[], integer, integer, boolean, boolean, double precision, double precision, boolean, integer, integer" %}
{% set result = "o_stream_id uuid, o_perspective text, o_rows integer, o_applied integer, o_last_version bigint, o_failed_work_id bigint, o_error text, o_done_work_ids bigint[], o_dead_lettered bigint[], o_versions bigint[], o_created_at timestamp with time zone[], o_rewound boolean, o_completed_event_ids uuid[], o_more boolean, o_applied_event_ids uuid[]" %}
{% with name = "wh_drain" %}{% include "drop_older_overloads.sql" %}{% endwith %}
CREATE OR REPLACE FUNCTION {{ schema }}.wh_drain(
    p_instance_id uuid, p_stream_ids uuid[], p_per_pair integer, p_max_rows integer,
    p_instant boolean, p_debug boolean, p_retry_base_ms double precision, p_retry_max_ms double precision,
    p_notify_applied boolean, p_max_attempts integer, p_handler_timeout_ms integer)
RETURNS TABLE ({{ result }})
LANGUAGE plpgsql AS $wh_drain$
DECLARE
  v_owned    uuid[];
  r          record;
  o          record;
  v_ids      bigint[];
  v_events   uuid[];
  v_versions bigint[];
  v_attempts integer[];
  v_window   bigint[];
  v_created  timestamptz[];
  v_dead     bigint[];
  v_budget   integer := p_max_rows;
  v_retire   bigint[];
  v_last     bigint;
  v_more     boolean;
  v_err      text;
  v_failed   bigint;
  -- worker.handlerTimeoutMilliseconds: no event starts after this; the worker cancels the call
  -- (statement_timeout) at twice the timeout, so each event has at least the timeout to run.
  v_stop_at  timestamptz := statement_timestamp() + make_interval(secs => p_handler_timeout_ms / 1000.0);
BEGIN
  SELECT array_agg(a.stream_id) INTO v_owned
  FROM {{ schema }}.wh_active_streams a
  WHERE a.stream_id = ANY (p_stream_ids) AND a.assigned_instance_id = p_instance_id;
  IF v_owned IS NULL THEN
    RETURN;
  END IF;
  FOR r IN
    SELECT x.stream_id, sub.perspective_name, coalesce(c.last_version, 0) AS last_version
    FROM unnest(v_owned) AS x(stream_id)
    CROSS JOIN (SELECT DISTINCT s.perspective_name FROM {{ schema }}.wh_perspective_subscriptions s) sub
    LEFT JOIN {{ schema }}.wh_perspective_cursors c
           ON c.stream_id = x.stream_id AND c.perspective_name = sub.perspective_name
    -- A backfill holds the perspective back on a stream until the stream's history is queued.
    WHERE NOT {{ schema }}.wh_backfill_gated(sub.perspective_name, x.stream_id)
    ORDER BY 1, 2
  LOOP
    IF v_budget <= 0 OR clock_timestamp() >= v_stop_at THEN
      -- Not reached in this call: say so, so the worker comes back for it.
      RETURN QUERY SELECT r.stream_id, r.perspective_name::text, 0, 0, r.last_version, NULL::bigint, NULL::text,
                          '{}'::bigint[], '{}'::bigint[], '{}'::bigint[], '{}'::timestamptz[], false, '{}'::uuid[], true,
                          '{}'::uuid[];
      CONTINUE;
    END IF;
    v_ids := NULL;
    BEGIN
      -- The window above the cursor, the cursor read in the same statement (one snapshot; the
      -- loop's value is from the loop's older snapshot). The apply function checks, under the
      -- cursor lock, that no rebuild replaced the window since.
      WITH cur AS (
        SELECT coalesce((SELECT c.last_version FROM {{ schema }}.wh_perspective_cursors c
                         WHERE c.stream_id = r.stream_id AND c.perspective_name = r.perspective_name), 0) AS v)
      SELECT array_agg(h.event_work_id ORDER BY h.stream_version), array_agg(h.event_id ORDER BY h.stream_version),
             array_agg(h.stream_version ORDER BY h.stream_version), array_agg(h.attempts ORDER BY h.stream_version),
             array_agg(h.created_at ORDER BY h.stream_version), (SELECT cur.v FROM cur)
        INTO v_ids, v_events, v_versions, v_attempts, v_created, v_last
      FROM (
        SELECT w.*, bool_or(w.unavailable) OVER (ORDER BY w.stream_version ROWS UNBOUNDED PRECEDING) AS fenced
        FROM (
          SELECT w0.event_work_id, w0.event_id, w0.stream_version, w0.attempts, w0.created_at,
                 (coalesce(w0.scheduled_for > now(), false)
                  OR (w0.instance_id IS NOT NULL AND w0.instance_id <> p_instance_id AND w0.lease_expiry > now()
                      AND EXISTS (SELECT 1 FROM {{ schema }}.wh_service_instances i WHERE i.instance_id = w0.instance_id))
                 ) AS unavailable
          FROM {{ schema }}.wh_perspective_events w0
          WHERE w0.stream_id = r.stream_id AND w0.perspective_name = r.perspective_name
            AND w0.stream_version > (SELECT cur.v FROM cur) AND w0.processed_at IS NULL
          ORDER BY w0.stream_version
          LIMIT least(p_per_pair, v_budget)
        ) w
      ) h
      WHERE NOT h.fenced;
      IF v_ids IS NULL THEN
        {{ retire("") }}
        CONTINUE;
      END IF;
      v_window := v_versions;
      v_dead := '{}';
      IF p_max_attempts IS NOT NULL AND v_attempts[1] >= p_max_attempts THEN
        PERFORM {{ schema }}.move_to_dead_letters(p_instance_id, ARRAY[v_ids[1]]);
        v_dead := ARRAY[v_ids[1]];
        v_ids := v_ids[2:];
        v_events := v_events[2:];
        v_versions := v_versions[2:];
      END IF;
      IF coalesce(array_length(v_ids, 1), 0) = 0 THEN
        {{ retire("") }}
        RETURN QUERY SELECT r.stream_id, r.perspective_name::text, 0, 0, v_last, NULL::bigint, NULL::text,
                            '{}'::bigint[], v_dead, v_window, v_created, false, '{}'::uuid[],
                            {{ due_after("v_last") }}, '{}'::uuid[];
        CONTINUE;
      END IF;
      v_budget := v_budget - array_length(v_ids, 1);
  {% for p in perspectives %}
      {{ "IF" if loop.first else "ELSIF" }} r.perspective_name = {{ p.name|literal }} THEN
        SELECT * INTO o FROM {{ schema }}.{{ p.function }}(r.stream_id, v_ids, v_events, v_versions, p_instant, p_debug, false,
                                          p_retry_base_ms, p_retry_max_ms, p_notify_applied, true, true, v_stop_at);
  {% endfor %}
      ELSE
        CONTINUE;
      END IF;
      {{ retire("\n        AND NOT (w.event_work_id = ANY (o.o_done_work_ids))") }}
      -- A new statement, so a new snapshot: also sees rows appended while this call ran.
      v_more := {{ due_after("coalesce(o.o_last_version, v_last)") }};
      RETURN QUERY SELECT r.stream_id, r.perspective_name::text, array_length(v_ids, 1), o.o_applied, o.o_last_version,
                          o.o_failed_work_id, o.o_error, o.o_done_work_ids, v_dead, v_window, v_created, o.o_rewound,
                          o.o_completed_event_ids, v_more, o.o_applied_event_ids;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
      -- Everything this pair did in this call is undone. Record the failure on its head row
      -- (the lowest pending version above the cursor: the row that keeps the pair from
      -- advancing), the way a failing handler is recorded.
      v_err := SQLERRM;
      v_failed := NULL;
      BEGIN
        UPDATE {{ schema }}.wh_perspective_events w
           SET error = v_err, instance_id = NULL, lease_expiry = NULL, attempts = w.attempts + 1,
               scheduled_for = clock_timestamp() + {{ retry_delay }}
         WHERE w.event_work_id = (
                 SELECT h.event_work_id FROM {{ schema }}.wh_perspective_events h
                 WHERE h.stream_id = r.stream_id AND h.perspective_name = r.perspective_name
                   AND h.processed_at IS NULL
                   AND h.stream_version > coalesce((SELECT c.last_version FROM {{ schema }}.wh_perspective_cursors c
                                                    WHERE c.stream_id = r.stream_id
                                                      AND c.perspective_name = r.perspective_name), 0)
                 ORDER BY h.stream_version LIMIT 1)
        RETURNING w.event_work_id INTO v_failed;
        INSERT INTO {{ schema }}.wh_perspective_cursors AS c (stream_id, perspective_name, status, error, processed_at)
        VALUES (r.stream_id, r.perspective_name, {{ cursor_failed }}, v_err, now())
        ON CONFLICT (stream_id, perspective_name) DO UPDATE
          SET status = {{ cursor_failed }}, error = excluded.error, processed_at = now();
      EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- Not even that: say so; the pair is offered again by the next claim.
        v_err := v_err || ' (recording the failure failed too: ' || SQLERRM || ')';
        v_failed := NULL;
      END;
      RETURN QUERY SELECT r.stream_id, r.perspective_name::text, coalesce(array_length(v_ids, 1), 0), 0,
                          r.last_version, v_failed, v_err, '{}'::bigint[], '{}'::bigint[], '{}'::bigint[], '{}'::timestamptz[],
                          false, '{}'::uuid[], false, '{}'::uuid[];
    END;
  END LOOP;
END
$wh_drain$
