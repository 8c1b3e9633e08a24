-- Hand-written ceilings of the breadth case (tests/bench/scale.sh, tests/bench/breadth-tables.sh),
-- installed on a schema whose events are appended and on which no worker runs. `@schema@` is
-- replaced by the schema's name. Each function is called by 4 pgbench connections, p_streams
-- streams per call, until nothing is left, and returns the applies it made. The counters `c1`,
-- `c2` are the breadth case's two perspectives (one row per stream: an insert for its first
-- event, an update for the others).

-- `current`: the engine's tables as they are. It locks the oldest active streams worth the call's
-- applies, applies their events in stream order, writes their cursors, deletes their work rows
-- and retires them: claim, apply, completion and retirement in one transaction per call. That is
-- the work per stream and per event any engine on these tables has to do, without the engine: no
-- assignment kept between transactions, no locks against producers, no failure handling.
CREATE FUNCTION @schema@.bench_drain_current(p_streams integer) RETURNS integer LANGUAGE plpgsql AS $f$
DECLARE v_streams uuid[]; r record; v_n integer := 0;
BEGIN
  v_streams := ARRAY(SELECT a.stream_id FROM @schema@.wh_active_streams a WHERE a.assigned_instance_id IS NULL
                     ORDER BY a.created_at LIMIT p_streams FOR UPDATE SKIP LOCKED);
  IF cardinality(v_streams) = 0 THEN RETURN 0; END IF;
  FOR r IN SELECT w.perspective_name, w.stream_id, w.stream_version FROM @schema@.wh_perspective_events w
           WHERE w.stream_id = ANY (v_streams) ORDER BY w.perspective_name, w.stream_id, w.stream_version LOOP
    IF r.perspective_name = 'c1' THEN
      INSERT INTO @schema@.c1 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    ELSE
      INSERT INTO @schema@.c2 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    END IF;
    v_n := v_n + 1;
  END LOOP;
  INSERT INTO @schema@.wh_perspective_cursors AS c (stream_id, perspective_name, last_version, status)
  SELECT w.stream_id, w.perspective_name, max(w.stream_version), 2 FROM @schema@.wh_perspective_events w
  WHERE w.stream_id = ANY (v_streams) GROUP BY 1, 2
  ON CONFLICT (stream_id, perspective_name) DO UPDATE SET last_version = excluded.last_version, status = 2;
  DELETE FROM @schema@.wh_perspective_events w WHERE w.stream_id = ANY (v_streams);
  DELETE FROM @schema@.wh_active_streams a WHERE a.stream_id = ANY (v_streams);
  RETURN v_n;
END
$f$;

-- `lazy-cursor`: the proposed table change (docs/design/breadth-tables.md). A pair without a
-- cursor row has applied every event of its stream below its oldest pending work row; a cursor
-- row is written only for a pair that must hold more (a failure, `ordering: eventId`'s last event
-- id, a rewind, progress whose work rows are kept). The window is therefore read against the
-- cursor if there is one (an index probe that finds nothing here), cursors that exist are moved,
-- and none is created: a one-event stream costs its work rows, its active row and the model, not
-- a cursor per perspective. Completion stays in the apply transaction (it must: the work rows
-- are the progress).
CREATE FUNCTION @schema@.bench_drain_lazy_cursor(p_streams integer) RETURNS integer LANGUAGE plpgsql AS $f$
DECLARE v_streams uuid[]; r record; v_n integer := 0;
BEGIN
  v_streams := ARRAY(SELECT a.stream_id FROM @schema@.wh_active_streams a WHERE a.assigned_instance_id IS NULL
                     ORDER BY a.created_at LIMIT p_streams FOR UPDATE SKIP LOCKED);
  IF cardinality(v_streams) = 0 THEN RETURN 0; END IF;
  FOR r IN SELECT w.perspective_name, w.stream_id, w.stream_version FROM @schema@.wh_perspective_events w
           LEFT JOIN @schema@.wh_perspective_cursors c ON c.stream_id = w.stream_id AND c.perspective_name = w.perspective_name
           WHERE w.stream_id = ANY (v_streams) AND w.stream_version > coalesce(c.last_version, 0)
           ORDER BY w.perspective_name, w.stream_id, w.stream_version LOOP
    IF r.perspective_name = 'c1' THEN
      INSERT INTO @schema@.c1 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    ELSE
      INSERT INTO @schema@.c2 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    END IF;
    v_n := v_n + 1;
  END LOOP;
  UPDATE @schema@.wh_perspective_cursors c SET last_version = m.v, status = 2
  FROM (SELECT w.stream_id, w.perspective_name, max(w.stream_version) AS v FROM @schema@.wh_perspective_events w
        WHERE w.stream_id = ANY (v_streams) GROUP BY 1, 2) m
  WHERE c.stream_id = m.stream_id AND c.perspective_name = m.perspective_name;
  DELETE FROM @schema@.wh_perspective_events w WHERE w.stream_id = ANY (v_streams);
  DELETE FROM @schema@.wh_active_streams a WHERE a.stream_id = ANY (v_streams);
  RETURN v_n;
END
$f$;

-- `handlers`: the user's own work and nothing of a queue: the same counters written in the same
-- order from the events of the next streams (numbered in @schema@.bench_order, taken through a
-- sequence), reading the event store instead of work rows. No claim, cursor, completion or
-- retirement: the floor under every engine on any tables.
CREATE TABLE @schema@.bench_order (n bigint PRIMARY KEY, stream_id uuid NOT NULL);
CREATE SEQUENCE @schema@.bench_next;
CREATE FUNCTION @schema@.bench_drain_handlers(p_streams integer) RETURNS integer LANGUAGE plpgsql AS $f$
DECLARE v_first bigint; v_streams uuid[]; r record; v_n integer := 0;
BEGIN
  v_first := (nextval('@schema@.bench_next') - 1) * p_streams + 1;
  v_streams := ARRAY(SELECT o.stream_id FROM @schema@.bench_order o WHERE o.n BETWEEN v_first AND v_first + p_streams - 1);
  IF cardinality(v_streams) = 0 THEN RETURN 0; END IF;
  FOR r IN SELECT p.perspective_name, e.stream_id, e.stream_version FROM @schema@.wh_event_store e
           CROSS JOIN (VALUES ('c1'), ('c2')) p(perspective_name)
           WHERE e.stream_id = ANY (v_streams) ORDER BY p.perspective_name, e.stream_id, e.stream_version LOOP
    IF r.perspective_name = 'c1' THEN
      INSERT INTO @schema@.c1 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    ELSE
      INSERT INTO @schema@.c2 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    END IF;
    v_n := v_n + 1;
  END LOOP;
  RETURN v_n;
END
$f$;

-- `work-rows-only`: a diagnostic, not a proposal: `lazy-cursor` without the active stream rows
-- (the next streams are taken through the sequence, as `handlers` does). Beside `lazy-cursor` it
-- prices the active row of a one-event stream; beside `handlers`, the work rows.
CREATE FUNCTION @schema@.bench_drain_work_rows_only(p_streams integer) RETURNS integer LANGUAGE plpgsql AS $f$
DECLARE v_first bigint; v_streams uuid[]; r record; v_n integer := 0;
BEGIN
  v_first := (nextval('@schema@.bench_next') - 1) * p_streams + 1;
  v_streams := ARRAY(SELECT o.stream_id FROM @schema@.bench_order o WHERE o.n BETWEEN v_first AND v_first + p_streams - 1);
  IF cardinality(v_streams) = 0 THEN RETURN 0; END IF;
  FOR r IN SELECT w.perspective_name, w.stream_id, w.stream_version FROM @schema@.wh_perspective_events w
           LEFT JOIN @schema@.wh_perspective_cursors c ON c.stream_id = w.stream_id AND c.perspective_name = w.perspective_name
           WHERE w.stream_id = ANY (v_streams) AND w.stream_version > coalesce(c.last_version, 0)
           ORDER BY w.perspective_name, w.stream_id, w.stream_version LOOP
    IF r.perspective_name = 'c1' THEN
      INSERT INTO @schema@.c1 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    ELSE
      INSERT INTO @schema@.c2 AS c VALUES (r.stream_id, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    END IF;
    v_n := v_n + 1;
  END LOOP;
  DELETE FROM @schema@.wh_perspective_events w WHERE w.stream_id = ANY (v_streams);
  RETURN v_n;
END
$f$;
