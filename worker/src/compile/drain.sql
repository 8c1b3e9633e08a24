{#- `<schema>.wh_drain`: claims and applies, in one call and one transaction, the pending work of
    the listed streams this instance owns. Per (stream, perspective): the window above the
    cursor (cut at the first unavailable row), the head row dead-lettered once it has failed
    p_max_attempts times, the rest handed to the perspective's apply function. No row leases
    are written: the rows are applied in the same transaction that selects them, under the
    cursor lock; failures count `attempts` instead. One row per pair out, with the versions of the
    rows taken (a dead-lettered head first) and when each row was created (latency, logs), in
    seconds since the Unix epoch: the worker reads the call's result as text, where a
    timestamptz is formatted by the server and parsed by the worker, 80 000 times a deep call.
    Each pair runs in its own subtransaction: an error outside the apply function's per-event
    subtransactions (an event missing from the store, a lock or statement timeout, a deadlock,
    a serialization failure) undoes that pair only, and is recorded on it like a failing
    handler (the pair's head row: error, attempts, backoff; the cursor Failed), so the other
    pairs of the call commit and the failing one is retried with backoff, then dead-lettered.
    Contention is the exception: a deadlock, serialization failure or lock timeout (other
    appliers hold rows the pair's handlers write, taken in another order) undoes the pair's
    subtransaction, releasing its locks, and records nothing (no error, attempts, backoff or
    Failed cursor, so never a dead letter); the pair is returned with o_contended_sqlstate and
    o_more, and the worker drains it again after a short delay. What the apply function's slow
    path applied before meeting it stays (see apply_body.sql). The call then applies no further
    pair (they are returned not reached, with o_more) and commits: it holds the rows of the pairs
    it applied until then, and going on would make it wait for, and conflict with, the other
    appliers again while holding them (each deadlock costs the waiters deadlock_timeout). For
    the same reason the call waits at most lock_timeout_ms for any lock (a shorter lock_timeout
    of the session is kept): a longer wait is given up as contention.
    Once the caller's worker has begun a graceful stop (hand_over_streams sets its instance's
    stopping_since), the per-pair path takes no further pair either: they are returned not
    reached, with o_more, and the stop hands them to a live peer rather than making the peer wait
    for the whole call (a catch-up's calls run for hundreds of milliseconds).
    Shallow pairs (few pending rows, none failed or leased, no rewind) are applied set-based
    first, all of them in one subtransaction: one statement each for the window, the cursor
    locks, the cursor moves and the completion, and one loop over all their events per
    perspective (its batch function, batch_function.sql). That removes the per-pair statements,
    which dominate when streams are shallow. The caller asks for it (p_shallow_rows > 0) only
    when its last calls found shallow streams: the probe of every pair that picks the shallow
    ones is wasted on deep pairs, which otherwise run exactly the per-pair path. If anything in
    it fails, it is undone and its pairs take the per-pair path below, which isolates the
    failure (a handler cancelled by the statement timeout is recorded on its row directly: its
    timer is spent); contention there is no exception (nothing is recorded by the fallback
    itself, and the per-pair path treats contention as above).
    Sequencing (DESIGN §12.2, sequencing.rs): p_perspectives names the perspectives the call
    applies (NULL: all); the worker applies stream-, key- and each serial-sequenced perspective
    in calls of their own. A call with key or serial perspectives first takes, without waiting, the advisory lock of each key of its pairs' pending rows
    (serial: one lock for the perspective) that no other applier holds, as many keys as its row
    budget covers, from a random one on (so that calls side by side share the keys out); a
    pair with a key another applier holds is busy: not applied, returned with o_more and
    o_contended_sqlstate = sequencing_busy, for the worker to retry soon (it is no conflict:
    not counted as one); a pair with a key past the budget is returned with o_more only. Waiting in line instead kept every waiter's snapshot open, so nobody
    could prune the versions of the shared rows the holder kept updating, and each update
    walked more of them. A row that arrived after the keys were taken is applied only if its
    key's lock can be had at once (else the pair is contention, 55P03): events with the same key
    are never applied concurrently. The locks are transaction-scoped: released at commit.
    Slots: schema, perspectives (name, function, batch, lock: the sequenced ones' lock slot SQL),
    sequenced (the sequenced perspectives: name, class, slot, from_store), keyed_names,
    sequencing_busy, key_slots, event_id_perspectives (names of the
    perspectives ordered by event id, whose windows are checked for a rewind) and
    event_id_ordering (whether there are any), compiled_perspectives (all names), cursor_completed,
    cursor_failed, lock_timeout_ms, retry_delay (the backoff after a failure of the head row, see
    store::failure::retry_delay_sql). #}
{#- Whether the pair has due work past `version` (one index probe). #}
{% macro due_after(version) -%}
EXISTS (SELECT 1 FROM {{ schema }}.wh_perspective_events w
                       WHERE w.stream_id = r.stream_id AND w.perspective_name = r.perspective_name
                         AND w.stream_version > {{ version }} AND w.processed_at IS NULL
                         AND (w.scheduled_for IS NULL OR w.scheduled_for <= now()))
{%- endmacro %}
{#- The pairs of the owned streams with the subscribed perspectives the call applies (`x`,
    `sub`), and whether each perspective has a backfill job. #}
{% macro owned_pairs() -%}
FROM unnest(v_owned) AS x(stream_id)
      CROSS JOIN (SELECT s.perspective_name,
                         EXISTS (SELECT 1 FROM {{ schema }}.wh_perspective_jobs j
                                 WHERE j.perspective_name = s.perspective_name AND j.kind = 'backfill') AS backfill
                  FROM {{ schema }}.wh_perspective_subscriptions s
                  WHERE p_perspectives IS NULL OR s.perspective_name = ANY (p_perspectives)
                  GROUP BY s.perspective_name) sub
{%- endmacro %}
{#- Which of those pairs are listed: a backfill holds the perspective back on a stream until the
    stream's history is queued (asked only while the perspective has a backfill job: a call per
    pair otherwise), and busy sequenced pairs are left out. #}
{% macro pair_filter() -%}
WHERE NOT (sub.backfill AND {{ schema }}.wh_backfill_gated(sub.perspective_name, x.stream_id))
  {%- if sequenced %}
        AND (x.stream_id, sub.perspective_name) NOT IN (SELECT * FROM unnest(v_busy_streams, v_busy_names))
  {%- endif %}
{%- endmacro %}
{#- The cursor of the pair (x.stream_id, sub.perspective_name), if any: one primary-key probe per
    pair. As a plain LEFT JOIN the planner, which cannot see how few streams a call lists (and
    without statistics on the subscriptions guesses 200 perspectives), hashed the whole cursor
    table on every call: 240 ms per call at 125 000 cursors, growing with every stream ever
    applied. LIMIT keeps the subquery from being flattened back into that join. #}
{% macro cursor_of_pair(columns) -%}
LEFT JOIN LATERAL (SELECT {{ columns }} FROM {{ schema }}.wh_perspective_cursors c
                         WHERE c.stream_id = x.stream_id AND c.perspective_name = sub.perspective_name
                         LIMIT 1) c ON true
{%- endmacro %}
{#- The pair's window (see where it is used): its rows' ids, event ids, versions, attempts and
    creation times (epoch seconds), one array each in the order `order` gives them (empty: the
    order the rows come in), which of them this call may not apply yet (v_fence), and the
    cursor it follows. With `check`, also the versions sorted, into v_sorted. #}
{% macro pair_window(order, check=false) -%}
{% set check_into = ", v_sorted" if check else "" %}
{% set check = ",\n             array_agg(h.stream_version ORDER BY h.stream_version)" if check else "" %}
      WITH cur AS (
        SELECT coalesce((SELECT c.last_version FROM {{ schema }}.wh_perspective_cursors c
                         WHERE c.stream_id = r.stream_id AND c.perspective_name = r.perspective_name), 0) AS v)
      SELECT array_agg(h.event_work_id{{ order }}), array_agg(h.event_id{{ order }}),
             array_agg(h.stream_version{{ order }}), array_agg(h.attempts{{ order }}),
             array_agg(date_part('epoch', h.created_at){{ order }}), array_agg(h.unavailable{{ order }}), (SELECT cur.v FROM cur){{ check }}
        INTO v_ids, v_events, v_versions, v_attempts, v_created, v_fence, v_last{{ check_into }}
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
      ) h;
{%- endmacro %}
{#- Retire the pair's rows at or below its cursor: applied already (completion pending or lost).
    The cursor is read in the same statement as the rows (one snapshot: a rebuild committing in
    between cannot pair its new rows with the old cursor). After the pair's apply, work rows are
    then locked after the cursor row, in the order `rebuild` takes them. A pair that applied
    nothing (an empty window, or one whose only due row was dead-lettered) holds no cursor lock:
    its rows join `v_late`, retired at the end of the call (see there). `below`, when given, also
    bounds the versions (see where it is used). #}
{% macro retire(below=none, late=false) -%}
    v_retire := ARRAY(
      SELECT w.event_work_id FROM {{ schema }}.wh_perspective_events w
      WHERE w.stream_id = r.stream_id AND w.perspective_name = r.perspective_name
        AND w.stream_version <= (SELECT c.last_version FROM {{ schema }}.wh_perspective_cursors c
                                 WHERE c.stream_id = r.stream_id AND c.perspective_name = r.perspective_name)
        {{- "\n        AND w.stream_version <= " ~ below if below is not none else "" }}
        AND w.processed_at IS NULL
      OFFSET 0);
  {%- if late %}
    v_late := v_late || v_retire;
  {%- else %}
    IF cardinality(v_retire) > 0 THEN
      PERFORM {{ schema }}.complete_perspective_events(v_retire, p_debug);
    END IF;
  {%- endif %}
{%- endmacro %}
{#- The keyed pre-pass (see the header), with each key slot computed by `slot_attr` of the
    sequenced perspectives: fast_slot (the expression inline) or slot (its key function). #}
{% macro take_keys(slot_attr) -%}
-- The keys of the keyed pairs' pending rows (see the header): each taken if free, as many as
    -- the call's row budget covers, starting from a random slot so that calls side by side
    -- take different keys rather than all of them. A pair with a key another applier holds is
    -- busy; one with a key past the budget is not reached (later, at once).
    -- Index probes per stream and per row (OFFSET 0 and LIMIT 1 keep the planner from joining
    -- the tables whole): as joins, custom plans hashed the work table and the store for a few
    -- dozen streams (7.8 ms against 2 ms for 40 streams of 3 000).
    WITH keyed AS MATERIALIZED (
    {% for p in sequenced if p.from_store %}
      {{ "" if loop.first else "UNION ALL " }}SELECT x.s AS stream_id, x.perspective_name, {{ p.class }} AS class, {{ p[slot_attr] }} AS slot
      FROM unnest(v_owned) AS mine(stream_id)
      CROSS JOIN LATERAL (SELECT w.stream_id AS s, w.stream_version AS v, w.perspective_name
                          FROM {{ schema }}.wh_perspective_events w
                          WHERE w.stream_id = mine.stream_id AND w.perspective_name = {{ p.name|literal }}
                            AND w.processed_at IS NULL OFFSET 0) x
      {{ p.join }}
      WHERE p_perspectives IS NULL OR {{ p.name|literal }} = ANY (p_perspectives)
    {% endfor %}
    ), slots AS MATERIALIZED (
      SELECT k.class, k.slot,
             sum(k.n) OVER (ORDER BY (k.slot + v_offset) % {{ key_slots }}, k.class ROWS UNBOUNDED PRECEDING) - k.n AS before
      FROM (SELECT y.class, y.slot, count(*) AS n FROM keyed y GROUP BY 1, 2) k
    ), taken AS MATERIALIZED (
      SELECT t.class, t.slot, CASE WHEN t.before < v_budget THEN pg_try_advisory_xact_lock(t.class, t.slot) END AS got
      FROM slots t
    )
    SELECT array_agg(busy.stream_id), array_agg(busy.perspective_name), array_agg(busy.state)
      INTO v_busy_streams, v_busy_names, v_busy_states
    FROM (SELECT y.stream_id, y.perspective_name,
                 CASE WHEN bool_or(t.got IS FALSE) THEN {{ sequencing_busy|literal }} END AS state
          FROM keyed y JOIN taken t ON t.class = y.class AND t.slot = y.slot
          GROUP BY 1, 2 HAVING NOT bool_and(coalesce(t.got, false))) busy;
{%- endmacro %}
{% set args = "uuid, uuid[], integer, integer, boolean, boolean, double precision, double precision, boolean, integer, integer, integer, text[]" %}
{% set result = "o_stream_id uuid, o_perspective text, o_rows integer, o_applied integer, o_last_version bigint, o_failed_work_id bigint, o_error text, o_done_work_ids bigint[], o_dead_lettered bigint[], o_versions bigint[], o_created_epoch double precision[], o_rewound boolean, o_completed_event_ids uuid[], o_more boolean, o_applied_event_ids uuid[], o_contended_sqlstate text" %}
{% with name = "wh_drain" %}{% include "drop_older_overloads.sql" %}{% endwith %}
CREATE OR REPLACE FUNCTION {{ schema }}.wh_drain(
    p_instance_id uuid, p_stream_ids uuid[], p_per_pair integer, p_max_rows integer,
    p_instant boolean, p_debug boolean, p_retry_base_ms double precision, p_retry_max_ms double precision,
    p_notify_applied boolean, p_max_attempts integer, p_handler_timeout_ms integer, p_shallow_rows integer,
    p_perspectives text[] DEFAULT NULL)
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
  v_sorted   bigint[];
  -- Which rows of the window this call may not apply yet, and the first of them.
  v_fence    boolean[];
  v_cut      integer;
  v_created  double precision[];
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
  -- A pair with at most this many pending rows (retired ones included) may be shallow; 0: the
  -- caller expects deep streams, and every pair takes the per-pair path without a probe.
  v_shallow_rows integer := least(coalesce(p_shallow_rows, 0), p_per_pair);
  -- The shallow pairs, by (perspective, stream): stream, perspective, cursor as read (NULL: no
  -- cursor; its last event, status, error and processed_at), where its window starts in the f_ arrays and how many rows it has,
  -- how many this call applied, and whether due work is left.
  s_streams  uuid[];
  s_names    text[];
  s_last     bigint[];
  s_event    uuid[];
  s_status   smallint[];
  s_error    text[];
  s_at       timestamptz[];
  s_from     integer[];
  s_n        integer[];
  s_applied  integer[];
  s_more     boolean[];
  -- Their windows, one element per row, pair after pair.
  f_ids      bigint[];
  f_events   uuid[];
  f_streams  uuid[];
  f_versions bigint[];
  f_created  double precision[];
  -- Per perspective with shallow pairs: its rows in the f_ arrays (from, to), and the end of
  -- what its batch function applied.
  g_names    text[];
  g_from     integer[];
  g_to       integer[];
  g_end      integer[] := '{}';
  -- Work rows at or below the cursor: of the shallow pairs, and of pairs with nothing else.
  v_retired  bigint[];
  v_retired_only bigint[];
  v_late     bigint[] := '{}';
  -- The other pairs, for the per-pair path: stream, perspective, cursor.
  x_streams  uuid[];
  x_names    text[];
  x_last     bigint[];
  v_fallback boolean := false;
  v_shallow_ok boolean := false;
  b          record;
  v_j        integer;
  v_k        integer;
  v_cancel_i integer;
  v_cancel_err text;
  v_partial  boolean := false;
  v_jit      text;
  -- A pair met a lock conflict: no further pair is applied in this call (see the header).
  v_conflict boolean := false;
  -- The caller's worker began a graceful stop (hand_over_streams marked its instance): no
  -- further pair either; those not reached go to a live peer. Looked up at most every 5 ms.
  v_stopping boolean := false;
  v_look_at  timestamptz := statement_timestamp();
  -- Sequenced pairs with a key another applier holds: not applied in this call.
  v_busy_streams uuid[];
  v_busy_names text[];
  v_busy_serial text[] := '{}';
  v_busy_states text[];
  -- Where this call starts taking key slots (see the keys below).
  v_offset integer := floor(random() * {{ key_slots }})::integer;
BEGIN
  -- The listed streams this instance holds: one primary-key probe per stream. (Given both
  -- conditions, the planner would pick the owner index and filter every stream this instance
  -- holds, the more the wider the backlog.)
  SELECT array_agg(DISTINCT x.stream_id) INTO v_owned
  FROM unnest(p_stream_ids) AS x(stream_id)
  WHERE (SELECT a.assigned_instance_id FROM {{ schema }}.wh_active_streams a
         WHERE a.stream_id = x.stream_id) = p_instance_id;
  IF v_owned IS NULL THEN
    RETURN;
  END IF;
  -- Contention (see the header): no lock wait longer than this, for the rest of the call.
  -- (SHOW's form, '0', '50ms' or '2s', reads as an interval; pg_settings costs a millisecond.)
  IF extract(epoch FROM current_setting('lock_timeout')::interval) * 1000
       NOT BETWEEN 1 AND {{ lock_timeout_ms }} THEN
    PERFORM set_config('lock_timeout', '{{ lock_timeout_ms }}ms', true);
  END IF;
{% if sequenced %}
  IF true THEN
  {% for p in sequenced if not p.from_store %}
    -- {{ p.name }} is serial: one lock; while another applier holds it, its pairs are busy.
    IF (p_perspectives IS NULL OR {{ p.name|literal }} = ANY (p_perspectives))
       AND NOT pg_try_advisory_xact_lock({{ p.class }}, {{ p.slot }}) THEN
      v_busy_serial := v_busy_serial || {{ p.name|literal }}::text;
    END IF;
  {% endfor %}
  {% if sequenced|selectattr("from_store")|list %}
    IF p_perspectives IS NULL OR p_perspectives && {{ keyed_names }} THEN
      BEGIN
        {{ take_keys("fast_slot") }}
      EXCEPTION WHEN OTHERS THEN
        -- A key raised an error on some event (bad data): again through the key functions,
        -- which give such an event the empty key's slot (sequencing.rs). The keys taken
        -- above were released with the subtransaction.
        {{ take_keys("slot") }}
      END;
    END IF;
  {% endif %}
    IF cardinality(v_busy_serial) > 0 THEN
      -- The busy serial perspectives' pairs with pending rows: one index probe per pair.
      SELECT coalesce(v_busy_streams, '{}') || array_agg(x.s), coalesce(v_busy_names, '{}') || array_agg(p.name),
             coalesce(v_busy_states, '{}') || array_agg({{ sequencing_busy|literal }}::text)
        INTO v_busy_streams, v_busy_names, v_busy_states
      FROM unnest(v_owned) AS x(s), unnest(v_busy_serial) AS p(name)
      -- (OFFSET 0 keeps it a probe per pair: flattened, the planner hashed the whole table.)
      WHERE EXISTS (SELECT 1 FROM {{ schema }}.wh_perspective_events w
                    WHERE w.stream_id = x.s AND w.perspective_name = p.name AND w.processed_at IS NULL
                    OFFSET 0);
    END IF;
  END IF;
{% endif %}
  IF v_shallow_rows = 0 THEN
    -- Deep streams expected: every pair takes the per-pair path. Listing the pairs is costed
    -- like the set-based probe below (hundreds of guessed perspectives), past jit_above_cost:
    -- JIT compiled it on every call, 40-110 ms. Off for this statement only; the windows keep
    -- the server's setting.
    v_jit := current_setting('jit');
    PERFORM set_config('jit', 'off', true);
    SELECT array_agg(y.stream_id), array_agg(y.perspective_name), array_agg(y.last_version)
      INTO x_streams, x_names, x_last
    FROM (
      SELECT x.stream_id, sub.perspective_name, coalesce(c.last_version, 0) AS last_version
      {{ owned_pairs() }}
      {{ cursor_of_pair("c.last_version") }}
      {{ pair_filter() }}
      ORDER BY 1, 2) y;
    PERFORM set_config('jit', v_jit, true);
  ELSE
    -- This probe is costed for hundreds of perspectives (a cross join of the streams with the
    -- subscriptions), past jit_above_cost: JIT compiled it on every call, 200 ms each, longer
    -- than the whole set-based apply. Off for the rest of the call (its transaction); the
    -- per-pair path of deep calls keeps the server's setting (JIT helps its long windows).
    PERFORM set_config('jit', 'off', true);
    -- Every pair's pending rows, up to v_shallow_rows + 1 of them, with its cursor (one
    -- snapshot, as the per-pair window): which pairs are shallow, which have only rows to retire,
    -- and which take the per-pair path.
    WITH pair AS (
      SELECT x.stream_id, sub.perspective_name, c.last_version, c.last_event_id, c.status, c.error, c.processed_at
      {{ owned_pairs() }}
      {{ cursor_of_pair("c.last_version, c.last_event_id, c.status, c.error, c.processed_at") }}
      {{ pair_filter() }}
    ), pairs AS MATERIALIZED (
      SELECT p.*, w.*,
             w.n_all <= v_shallow_rows AND w.n_above > 0 AND w.plain
               -- (a perspective without a compiled function is skipped by the per-pair path)
               AND p.perspective_name = ANY ({{ compiled_perspectives }})
               -- Lifecycle is reported pair by pair; a max of 0 attempts dead-letters any row.
               AND NOT p_notify_applied AND (p_max_attempts IS NULL OR p_max_attempts > 0) AS shallow_ok
      FROM pair p
      CROSS JOIN LATERAL (
        -- (The aggregates read the rows in version order, as the subquery sorted them.)
        SELECT count(*)::integer AS n_all, (count(*) FILTER (WHERE v.above))::integer AS n_above,
               coalesce(bool_and(v.plain) FILTER (WHERE v.above), false) AS plain,
               array_agg(v.event_work_id) FILTER (WHERE v.above) AS ids,
               array_agg(v.event_id) FILTER (WHERE v.above) AS events,
               array_agg(v.stream_version) FILTER (WHERE v.above) AS versions,
               array_agg(date_part('epoch', v.created_at)) FILTER (WHERE v.above) AS created,
               array_agg(v.event_work_id) FILTER (WHERE NOT v.above) AS retire
        FROM (
          SELECT q.event_work_id, q.event_id, q.stream_version, q.created_at,
                 q.stream_version > coalesce(p.last_version, 0) AS above,
                 -- No failure pending, not scheduled, not leased (else the per-pair path decides).
                 (q.attempts = 0 AND q.scheduled_for IS NULL AND q.instance_id IS NULL
                  -- ordering eventId: no event older (by id) than the one before it (rewind_detect.sql).
                  AND (p.perspective_name <> ALL ({{ event_id_perspectives }})
                       OR coalesce(q.event_id > CASE WHEN q.prev_version > coalesce(p.last_version, 0) THEN q.prev_event
                                                     ELSE p.last_event_id END, true))) AS plain
          FROM (
  {% if event_id_ordering %}
            SELECT w0.*, lag(w0.stream_version) OVER (ORDER BY w0.stream_version) AS prev_version,
                   lag(w0.event_id) OVER (ORDER BY w0.stream_version) AS prev_event
  {% else %}
            SELECT w0.*, NULL::bigint AS prev_version, NULL::uuid AS prev_event
  {% endif %}
            FROM (SELECT w1.event_work_id, w1.event_id, w1.stream_version, w1.created_at, w1.attempts,
                         w1.scheduled_for, w1.instance_id
                  FROM {{ schema }}.wh_perspective_events w1
                  WHERE w1.stream_id = p.stream_id AND w1.perspective_name = p.perspective_name
                    AND w1.processed_at IS NULL
                  ORDER BY w1.stream_version
                  LIMIT v_shallow_rows + 1) w0) q) v) w
      WHERE w.n_all > 0
    ), sized AS MATERIALIZED (
      -- Shallow pairs within the call's row budget, in pair order.
      SELECT y.*, y.shallow_ok AND sum(y.n_above) FILTER (WHERE y.shallow_ok)
                                     OVER (ORDER BY y.stream_id, y.perspective_name) <= v_budget AS shallow,
             y.n_above = 0 AND y.n_all <= v_shallow_rows AS retire_only
      FROM pairs y
    ), shallow AS MATERIALIZED (
      SELECT h.*, sum(h.n_above) OVER (ORDER BY h.perspective_name, h.stream_id) - h.n_above + 1 AS f_from
      FROM sized h WHERE h.shallow
    )
    -- (Each aggregate below reads a subquery sorted once, rather than sorting by itself.)
    SELECT t1.*, t2.*, t3.*, t4.*, t5.*
    FROM (SELECT array_agg(h.stream_id), array_agg(h.perspective_name), array_agg(h.last_version),
                 array_agg(h.last_event_id), array_agg(h.status), array_agg(h.error), array_agg(h.processed_at),
                 array_agg(h.f_from), array_agg(h.n_above)
          FROM (SELECT * FROM shallow ORDER BY perspective_name, stream_id) h) t1,
         (SELECT array_agg(g.perspective_name), array_agg(g.f_from), array_agg(g.f_to)
          FROM (SELECT h.perspective_name, min(h.f_from) AS f_from, max(h.f_from + h.n_above - 1) AS f_to
                FROM shallow h GROUP BY h.perspective_name ORDER BY h.perspective_name) g) t2,
         -- The windows' rows, pair after pair (each unnested in the order of the sorted pairs).
         (SELECT array_agg(u.id), array_agg(u.event), array_agg(h.stream_id), array_agg(u.version), array_agg(u.created)
          FROM (SELECT * FROM shallow ORDER BY perspective_name, stream_id) h
          CROSS JOIN LATERAL unnest(h.ids, h.events, h.versions, h.created) AS u(id, event, version, created)) t3,
         -- Rows to retire: those of shallow pairs, and of pairs with nothing else pending.
         (SELECT array_agg(u.id) FILTER (WHERE y.shallow), array_agg(u.id) FILTER (WHERE y.retire_only)
          FROM sized y CROSS JOIN LATERAL unnest(y.retire) AS u(id)
          WHERE y.retire IS NOT NULL AND (y.shallow OR y.retire_only)) t4,
         (SELECT array_agg(y.stream_id), array_agg(y.perspective_name), array_agg(coalesce(y.last_version, 0))
          FROM (SELECT * FROM sized y WHERE NOT y.shallow AND NOT y.retire_only
                ORDER BY y.stream_id, y.perspective_name) y) t5
      INTO s_streams, s_names, s_last, s_event, s_status, s_error, s_at, s_from, s_n, g_names, g_from, g_to,
           f_ids, f_events, f_streams, f_versions, f_created, v_retired, v_retired_only, x_streams, x_names, x_last;
  END IF;

  -- As the per-pair path retires an empty window's pair: without its cursor lock, so last.
  v_late := v_late || v_retired_only;
  IF s_streams IS NOT NULL THEN
    BEGIN
      -- The cursors move to the end of their windows first: the writes take their row locks
      -- before anything is applied (existing cursors in (stream, perspective) order, as the
      -- per-pair path locks them, then the new ones), and nothing else in this transaction
      -- reads them. Each must still be where its window was read from; what is not applied
      -- below is put back.
      UPDATE {{ schema }}.wh_perspective_cursors c
         SET last_version = f_versions[x.f + x.n - 1], last_event_id = f_events[x.f + x.n - 1],
             status = {{ cursor_completed }}, error = NULL, processed_at = now()
        FROM (SELECT * FROM unnest(s_streams, s_names, s_last, s_event, s_from, s_n) AS y(s, p, l, e, f, n)
              WHERE y.l IS NOT NULL ORDER BY y.s, y.p) x
       WHERE c.stream_id = x.s AND c.perspective_name = x.p
         AND c.last_version = x.l AND c.last_event_id IS NOT DISTINCT FROM x.e;
      GET DIAGNOSTICS v_k = ROW_COUNT;
      INSERT INTO {{ schema }}.wh_perspective_cursors AS c
          (stream_id, perspective_name, last_version, last_event_id, status, processed_at)
      SELECT x.s, x.p, f_versions[x.f + x.n - 1], f_events[x.f + x.n - 1], {{ cursor_completed }}, now()
      FROM unnest(s_streams, s_names, s_last, s_from, s_n) AS x(s, p, l, f, n)
      -- (No ON CONFLICT: a cursor created since is a unique violation, which undoes this.)
      WHERE x.l IS NULL ORDER BY 1, 2;
      GET DIAGNOSTICS v_j = ROW_COUNT;
      -- A rebuild that committed since replaced the cursor or the rows (see the apply function's
      -- p_contiguous): the per-pair path reads them again.
      IF v_k + v_j <> cardinality(s_streams)
         OR (SELECT count(*) FROM {{ schema }}.wh_perspective_events w
             WHERE w.event_work_id = ANY (f_ids) AND w.processed_at IS NULL) <> cardinality(f_ids) THEN
        RAISE EXCEPTION 'shallow pairs moved under wh_drain' USING ERRCODE = 'WH409';
      END IF;
      FOR v_j IN 1..cardinality(g_names) LOOP
        -- Past the handler-timeout budget, no perspective starts (its pairs are not reached).
        IF clock_timestamp() >= v_stop_at THEN
          g_end := g_end || (g_from[v_j] - 1);
          CONTINUE;
        END IF;
  {% for p in perspectives %}
        {{ "IF" if loop.first else "ELSIF" }} g_names[v_j] = {{ p.name|literal }} THEN
    {% if p.lock %}
          IF EXISTS (SELECT 1 FROM unnest(f_streams[g_from[v_j]:g_to[v_j]], f_versions[g_from[v_j]:g_to[v_j]]) AS x(s, v)
                     {{ p.lock.join }} WHERE NOT pg_try_advisory_xact_lock({{ p.lock.class }}, {{ p.lock.slot }})) THEN
            RAISE EXCEPTION 'a sequencing key of {{ p.name }} is held by another applier' USING ERRCODE = 'lock_not_available';
          END IF;
    {% endif %}
          SELECT * INTO b FROM {{ schema }}.{{ p.batch }}(f_streams[g_from[v_j]:g_to[v_j]],
                                f_events[g_from[v_j]:g_to[v_j]], f_versions[g_from[v_j]:g_to[v_j]], v_stop_at);
  {% endfor %}
        END IF;
        IF b.o_cancelled IS NOT NULL THEN
          v_cancel_i := g_from[v_j] + b.o_cancelled - 1;
          v_cancel_err := b.o_error;
          RAISE EXCEPTION '%', v_cancel_err USING ERRCODE = 'WH408';
        END IF;
        g_end := g_end || (g_from[v_j] + b.o_applied - 1);
        v_partial := v_partial OR g_end[v_j] < g_to[v_j];
      END LOOP;
      IF NOT v_partial THEN
        s_applied := s_n;
        IF p_instant THEN
          PERFORM {{ schema }}.complete_perspective_events(f_ids, p_debug);
        END IF;
      ELSE
        -- Past the handler-timeout budget: rows applied per pair are its window up to the end
        -- of what its perspective applied; the cursors of the others go back.
        SELECT array_agg(greatest(0, least(x.n, g.e - x.f + 1)) ORDER BY x.k) INTO s_applied
        FROM unnest(s_names, s_from, s_n) WITH ORDINALITY AS x(p, f, n, k)
        JOIN unnest(g_names, g_end) AS g(p, e) ON g.p = x.p;
        UPDATE {{ schema }}.wh_perspective_cursors c
           SET last_version = CASE WHEN x.a > 0 THEN f_versions[x.f + x.a - 1] ELSE x.l END,
               last_event_id = CASE WHEN x.a > 0 THEN f_events[x.f + x.a - 1] ELSE x.e END,
               status = CASE WHEN x.a > 0 THEN c.status ELSE x.st END,
               error = CASE WHEN x.a > 0 THEN c.error ELSE x.er END,
               processed_at = CASE WHEN x.a > 0 THEN c.processed_at ELSE x.at END
          FROM unnest(s_streams, s_names, s_last, s_event, s_status, s_error, s_at, s_from, s_n, s_applied)
               AS x(s, p, l, e, st, er, at, f, n, a)
         WHERE x.a < x.n AND (x.a > 0 OR x.l IS NOT NULL) AND c.stream_id = x.s AND c.perspective_name = x.p;
        DELETE FROM {{ schema }}.wh_perspective_cursors c
         USING unnest(s_streams, s_names, s_last, s_applied) AS x(s, p, l, a)
         WHERE x.a = 0 AND x.l IS NULL AND c.stream_id = x.s AND c.perspective_name = x.p;
        IF p_instant THEN
          PERFORM {{ schema }}.complete_perspective_events(ARRAY(
            SELECT f_ids[i] FROM unnest(s_from, s_applied) AS x(f, a), generate_series(x.f, x.f + x.a - 1) AS i), p_debug);
        END IF;
      END IF;
      IF v_retired IS NOT NULL THEN
        PERFORM {{ schema }}.complete_perspective_events(v_retired, p_debug);
      END IF;
      -- A new statement, so a new snapshot: also sees rows appended while this call ran.
      SELECT array_agg(x.a < x.n OR EXISTS (
               SELECT 1 FROM {{ schema }}.wh_perspective_events w
               WHERE w.stream_id = x.s AND w.perspective_name = x.p
                 AND w.stream_version > f_versions[x.f + x.n - 1] AND w.processed_at IS NULL
                 AND (w.scheduled_for IS NULL OR w.scheduled_for <= now())) ORDER BY x.k)
        INTO s_more
      FROM unnest(s_streams, s_names, s_from, s_n, s_applied) WITH ORDINALITY AS x(s, p, f, n, a, k);
      v_shallow_ok := true;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
      -- Undone: the per-pair path applies these pairs, and isolates what failed (but for a
      -- cancelled handler, below).
      v_fallback := true;
    END;
  END IF;
  IF v_shallow_ok THEN
    v_budget := v_budget - cardinality(f_ids);
    RETURN QUERY
      SELECT x.s, x.p::text, CASE WHEN x.a > 0 THEN x.n ELSE 0 END, x.a,
             CASE WHEN x.a > 0 THEN f_versions[x.f + x.a - 1] ELSE coalesce(x.l, 0) END, NULL::bigint, NULL::text,
             f_ids[x.f:x.f + x.a - 1], '{}'::bigint[],
             CASE WHEN x.a > 0 THEN f_versions[x.f:x.f + x.n - 1] ELSE '{}' END,
             CASE WHEN x.a > 0 THEN f_created[x.f:x.f + x.n - 1] ELSE '{}' END,
             false, '{}'::uuid[], x.m, '{}'::uuid[], NULL::text
      FROM unnest(s_streams, s_names, s_last, s_from, s_n, s_applied, s_more) AS x(s, p, l, f, n, a, m);
  ELSIF v_cancel_i IS NOT NULL THEN
    -- A handler was cancelled (the statement timeout, or shutdown): everything above is undone,
    -- and the cancelled event must not run again in this call (the call's timer is spent). Its
    -- row carries the failure (retried with backoff, then dead-lettered); the other pairs take
    -- the per-pair path, which leaves them for the next call past the handler-timeout budget.
    SELECT x.k INTO v_k FROM unnest(s_from, s_n) WITH ORDINALITY AS x(f, n, k)
    WHERE v_cancel_i BETWEEN x.f AND x.f + x.n - 1;
    v_failed := NULL;
    BEGIN
      UPDATE {{ schema }}.wh_perspective_events w
         SET error = v_cancel_err, instance_id = NULL, lease_expiry = NULL, attempts = w.attempts + 1,
             scheduled_for = clock_timestamp() + {{ retry_delay }}
       WHERE w.event_work_id = f_ids[v_cancel_i]
      RETURNING w.event_work_id INTO v_failed;
      INSERT INTO {{ schema }}.wh_perspective_cursors AS c (stream_id, perspective_name, status, error, processed_at)
      VALUES (s_streams[v_k], s_names[v_k], {{ cursor_failed }}, v_cancel_err, now())
      ON CONFLICT (stream_id, perspective_name) DO UPDATE
        SET status = {{ cursor_failed }}, error = excluded.error, processed_at = now();
    EXCEPTION WHEN OTHERS OR query_canceled THEN
      v_cancel_err := v_cancel_err || ' (recording the failure failed too: ' || SQLERRM || ')';
      v_failed := NULL;
    END;
    RETURN QUERY
      SELECT s_streams[v_k], s_names[v_k], s_n[v_k], 0, coalesce(s_last[v_k], 0), v_failed, v_cancel_err,
             '{}'::bigint[], '{}'::bigint[], '{}'::bigint[], '{}'::float8[], false, '{}'::uuid[],
             false, '{}'::uuid[], NULL::text;
  END IF;

  FOR r IN
    SELECT x.stream_id, x.perspective_name, x.last_version
    FROM unnest(x_streams, x_names, x_last) AS x(stream_id, perspective_name, last_version)
    UNION ALL
    SELECT x.stream_id, x.perspective_name, coalesce(x.last_version, 0)
    FROM unnest(s_streams, s_names, s_last) WITH ORDINALITY AS x(stream_id, perspective_name, last_version, k)
    WHERE v_fallback AND (v_cancel_i IS NULL OR x.k <> v_k)
    ORDER BY 1, 2
  LOOP
    IF NOT v_stopping AND clock_timestamp() >= v_look_at THEN
      v_stopping := EXISTS (SELECT 1 FROM {{ schema }}.wh_service_instances i
                            WHERE i.instance_id = p_instance_id AND i.stopping_since IS NOT NULL);
      v_look_at := clock_timestamp() + interval '5 milliseconds';
    END IF;
    IF v_budget <= 0 OR clock_timestamp() >= v_stop_at OR v_conflict OR v_stopping THEN
      -- Not reached in this call: say so, so the worker comes back for it.
      RETURN QUERY SELECT r.stream_id, r.perspective_name::text, 0, 0, r.last_version, NULL::bigint, NULL::text,
                          '{}'::bigint[], '{}'::bigint[], '{}'::bigint[], '{}'::float8[], false, '{}'::uuid[], true,
                          '{}'::uuid[], NULL::text;
      CONTINUE;
    END IF;
    v_ids := NULL;
    BEGIN
      -- The window above the cursor, the cursor read in the same statement (one snapshot; the
      -- loop's value is from the loop's older snapshot). The apply function checks, under the
      -- cursor lock, that no rebuild replaced the window since.
      -- The rows come in version order (the LIMIT's ORDER BY), and the aggregates of one query
      -- see them in the same order, so they are aggregated without an ORDER BY each
      -- (PostgreSQL 15 sorts each aggregate's input on its own). That order is checked against
      -- the versions sorted (one sort of bigints rather than six of the rows); should it ever
      -- differ, the window is read again with every aggregate sorted.
      {{ pair_window("", check=true) }}
      IF v_versions IS DISTINCT FROM v_sorted THEN
        {{ pair_window(" ORDER BY h.stream_version")|indent(2) }}
      END IF;
      -- The window ends before its first row this call may not apply (scheduled for later, or
      -- leased by another live instance): the rows behind it wait for it. (Cut here rather than
      -- by a window function in the statement: 58 against 95 µs a pair, measured.)
      v_cut := array_position(v_fence, true);
      IF v_cut = 1 THEN
        v_ids := NULL;
      ELSIF v_cut IS NOT NULL THEN
        v_ids := v_ids[:v_cut - 1];
        v_events := v_events[:v_cut - 1];
        v_versions := v_versions[:v_cut - 1];
        v_attempts := v_attempts[:v_cut - 1];
        v_created := v_created[:v_cut - 1];
      END IF;
      IF v_ids IS NULL THEN
        {{ retire(late=true) }}
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
        {{ retire(late=true) }}
        RETURN QUERY SELECT r.stream_id, r.perspective_name::text, 0, 0, v_last, NULL::bigint, NULL::text,
                            '{}'::bigint[], v_dead, v_window, v_created, false, '{}'::uuid[],
                            {{ due_after("v_last") }}, '{}'::uuid[], NULL::text;
        CONTINUE;
      END IF;
      v_budget := v_budget - array_length(v_ids, 1);
  {% for p in perspectives %}
      {{ "IF" if loop.first else "ELSIF" }} r.perspective_name = {{ p.name|literal }} THEN
    {% if p.lock %}
        IF EXISTS (SELECT 1 FROM (SELECT r.stream_id AS s, u.v FROM unnest(v_versions) AS u(v)) x
                   {{ p.lock.join }} WHERE NOT pg_try_advisory_xact_lock({{ p.lock.class }}, {{ p.lock.slot }})) THEN
          RAISE EXCEPTION 'a sequencing key of {{ p.name }} is held by another applier' USING ERRCODE = 'lock_not_available';
        END IF;
    {% endif %}
        SELECT * INTO o FROM {{ schema }}.{{ p.function }}(r.stream_id, v_ids, v_events, v_versions, p_instant, p_debug, false,
                                          p_retry_base_ms, p_retry_max_ms, p_notify_applied, true, true, v_stop_at);
  {% endfor %}
      ELSE
        CONTINUE;
      END IF;
      v_conflict := o.o_contended_sqlstate IS NOT NULL;
      IF o.o_contended_sqlstate IS NOT NULL AND o.o_applied = 0 THEN
        -- Contention before anything applied: undo the whole pair (its cursor lock too), below.
        RAISE EXCEPTION 'lock conflict while applying' USING ERRCODE = o.o_contended_sqlstate;
      END IF;
      -- Rows left at or below the cursor the window followed (a completion lost, or not yet
      -- flushed). Above it, the pending rows up to the new cursor are the window's own, now the
      -- group's done ids (a stream's appends commit in version order, so none sorts between
      -- them): only versions up to that cursor are looked at, none for a pair's first window,
      -- rather than every row just applied. (Rows a concurrent applier's cursor moved past are
      -- its own to complete; any left are retired by a later call's empty window.)
      IF v_last > 0 THEN
        {{ retire(below="v_last")|indent(2) }}
      END IF;
      -- A new statement, so a new snapshot: also sees rows appended while this call ran.
      -- (After contention the rest is due again at once.)
      v_more := o.o_contended_sqlstate IS NOT NULL OR {{ due_after("coalesce(o.o_last_version, v_last)") }};
      RETURN QUERY SELECT r.stream_id, r.perspective_name::text, array_length(v_ids, 1), o.o_applied, o.o_last_version,
                          o.o_failed_work_id, o.o_error, o.o_done_work_ids, v_dead, v_window, v_created, o.o_rewound,
                          o.o_completed_event_ids, v_more, o.o_applied_event_ids, o.o_contended_sqlstate;
    EXCEPTION WHEN deadlock_detected OR serialization_failure OR lock_not_available THEN
      -- Contention: everything this pair did in this call is undone and its locks released.
      -- Nothing is recorded; the pair is due again at once (more), for the worker to retry soon.
      v_conflict := true;
      RETURN QUERY SELECT r.stream_id, r.perspective_name::text, 0, 0, r.last_version, NULL::bigint, NULL::text,
                          '{}'::bigint[], '{}'::bigint[], '{}'::bigint[], '{}'::float8[], false, '{}'::uuid[], true,
                          '{}'::uuid[], SQLSTATE::text;
    WHEN OTHERS OR query_canceled THEN
      IF SQLSTATE = '42883' AND to_regproc(CASE r.perspective_name
  {% for p in perspectives %}
           WHEN {{ p.name|literal }} THEN {{ (schema ~ "." ~ p.function)|literal }}
  {% endfor %}
         END) IS NULL THEN
        -- The perspective's own apply function is gone: a blue/green switch dropped it while this
        -- (older) wh_drain ran. Not the event's fault: nothing is recorded, the pair is due again
        -- soon, and the wh_drain compiled by the switch applies it under the version that
        -- serves. (A handler calling a missing function of its own still fails below.)
        v_conflict := true;
        RETURN QUERY SELECT r.stream_id, r.perspective_name::text, 0, 0, r.last_version, NULL::bigint, NULL::text,
                            '{}'::bigint[], '{}'::bigint[], '{}'::bigint[], '{}'::float8[], false, '{}'::uuid[], true,
                            '{}'::uuid[], {{ switched_away|literal }};
        CONTINUE;
      END IF;
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
                          r.last_version, v_failed, v_err, '{}'::bigint[], '{}'::bigint[], '{}'::bigint[], '{}'::float8[],
                          false, '{}'::uuid[], false, '{}'::uuid[], NULL::text;
    END;
  END LOOP;

  -- Sequenced pairs left out (see the header): busy ones for the worker to retry soon, the
  -- others (past the budget) at once.
  RETURN QUERY SELECT busy.s, busy.p::text, 0, 0, NULL::bigint, NULL::bigint, NULL::text, '{}'::bigint[], '{}'::bigint[],
                      '{}'::bigint[], '{}'::float8[], false, '{}'::uuid[], true, '{}'::uuid[], busy.st
               FROM unnest(v_busy_streams, v_busy_names, v_busy_states) AS busy(s, p, st);

  -- Last, the rows of pairs that applied nothing (empty windows, dead-letter moves): retired without the
  -- pair's cursor lock, so never before a cursor lock this call still takes. A job chunk holds
  -- its streams' cursors and then deletes their rows; retiring one of those rows and then
  -- waiting for another of its cursors was a deadlock. Now the retire comes after every other
  -- wait, and waits at most 10 ms for rows others hold before skipping them.
  IF cardinality(v_late) > 0 THEN
    BEGIN
      PERFORM {{ schema }}.complete_perspective_events(v_late, p_debug, p_skip_held => true);
    EXCEPTION WHEN OTHERS THEN
      NULL; -- (left to the next call)
    END;
  END IF;
END
$wh_drain$
