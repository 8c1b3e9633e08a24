-- wh_version_switch(perspective, live, next, live home, next home): the data half of a
-- blue/green switch, in the caller's transaction (which holds the schema's `migrate` lock and has
-- checked that the next version caught up; see store/versions.rs). The caller then installs the
-- next version's functions under the perspective's name and records it.
--
-- Names first: the live version becomes `<name>__v<live>` (its pending work is dropped, as it
-- stops applying; its cursors and dead letters are kept for a rollback), the next one takes the
-- perspective's name in work rows, cursors, subscriptions and dead letters. Appliers of either
-- wait on the cursor rows (and give up after their lock_timeout).
--
-- Then the tables: every relation of both versions is locked ACCESS EXCLUSIVE (in name order,
-- under the caller's lock_timeout), the live version's move to its home schema and the next
-- version's from its home into the deployment schema (ALTER … SET SCHEMA: indexes, constraints,
-- triggers and owned sequences go with their table; views keep pointing at the tables they read,
-- by oid). A reader of `<schema>.<table>` waits for the commit and then reads the next version's
-- table: never a missing, empty or half-built one.
-- The privileges granted on a live table are granted on the table that takes its name.
-- Returns the relations archived and moved in.

CREATE OR REPLACE FUNCTION {{schema}}.wh_version_switch(
    p_perspective text, p_live integer, p_next integer, p_live_home text, p_next_home text)
RETURNS TABLE (o_archived text[], o_moved_in text[])
LANGUAGE plpgsql AS $$
DECLARE
  v_live_name text := p_perspective || '__v' || p_live;
  v_next_name text := p_perspective || '__v' || p_next;
  v_new       text[];
  v_old       text[];
  v_rel       record;
BEGIN
  -- The next version's relations: all of its home's, except sequences a column owns (they move
  -- with their table).
  SELECT coalesce(array_agg(c.relname::text ORDER BY c.relname), '{}') INTO v_new
  FROM pg_class c
  WHERE c.relnamespace = to_regnamespace(p_next_home)
    AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
    AND NOT (c.relkind = 'S' AND EXISTS (
      SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
        AND d.deptype IN ('a', 'i')));
  -- The live version's: as recorded, else (built in place) those named like the next version's.
  SELECT v.relations INTO v_old FROM {{schema}}.wh_perspective_versions v
  WHERE v.perspective_name = p_perspective AND v.version = p_live;
  IF v_old IS NULL THEN
    SELECT coalesce(array_agg(c.relname::text ORDER BY c.relname), '{}') INTO v_old
    FROM pg_class c
    WHERE c.relnamespace = '{{schema}}'::regnamespace AND c.relname = ANY (v_new);
  END IF;

  -- No applier of any perspective writes a cursor until the commit (they give up after their
  -- lock_timeout and retry): the old version stops, the new one takes its name, no cursor of
  -- either is written in between. Readers of the cursors are not held up.
  LOCK TABLE {{schema}}.wh_perspective_cursors IN EXCLUSIVE MODE;
  DELETE FROM {{schema}}.wh_perspective_events WHERE perspective_name = p_perspective;
  DELETE FROM {{schema}}.wh_perspective_subscriptions WHERE perspective_name = p_perspective;
  UPDATE {{schema}}.wh_perspective_cursors SET perspective_name = v_live_name
  WHERE perspective_name = p_perspective;
  UPDATE {{schema}}.wh_dead_letters SET perspective_name = v_live_name
  WHERE perspective_name = p_perspective;
  -- Producers still append under the old subscriptions until the commit: an event can get a
  -- row of the perspective's name after the DELETE above, beside its row of the next version.
  -- One row of the pair is enough (the next version's cursors decide what is applied).
  PERFORM {{schema}}.wh_version_adopt_work(v_next_name, p_perspective);
  UPDATE {{schema}}.wh_perspective_subscriptions SET perspective_name = p_perspective
  WHERE perspective_name = v_next_name;
  UPDATE {{schema}}.wh_perspective_cursors SET perspective_name = p_perspective
  WHERE perspective_name = v_next_name;
  UPDATE {{schema}}.wh_dead_letters SET perspective_name = p_perspective
  WHERE perspective_name = v_next_name;
  DELETE FROM {{schema}}.wh_perspective_job_streams
  WHERE perspective_name IN (p_perspective, v_next_name);
  DELETE FROM {{schema}}.wh_perspective_jobs WHERE perspective_name IN (p_perspective, v_next_name);

  FOR v_rel IN
    SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f')
      AND ((n.nspname = '{{schema}}' AND c.relname = ANY (v_old))
           OR (n.nspname = p_next_home AND c.relname = ANY (v_new)))
    ORDER BY c.relname, n.nspname
  LOOP
    EXECUTE format('LOCK TABLE %I.%I IN ACCESS EXCLUSIVE MODE', v_rel.nspname, v_rel.relname);
  END LOOP;
  EXECUTE format('CREATE SCHEMA IF NOT EXISTS %I', p_live_home);
  PERFORM {{schema}}.wh_version_move('{{schema}}', p_live_home, v_old);
  PERFORM {{schema}}.wh_version_move(p_next_home, '{{schema}}', v_new);

  -- Whoever could read or write a live table can do the same with the table that takes its name.
  FOR v_rel IN
    SELECT c.relname, a.privilege_type, a.grantee
    FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
    WHERE c.relnamespace = to_regnamespace(p_live_home) AND c.relname = ANY (v_new)
      AND a.grantee <> c.relowner
  LOOP
    EXECUTE format('GRANT %s ON {{schema}}.%I TO %s', v_rel.privilege_type, v_rel.relname,
                   CASE WHEN v_rel.grantee = 0 THEN 'PUBLIC'
                        ELSE quote_ident(pg_get_userbyid(v_rel.grantee)) END);
  END LOOP;

  UPDATE {{schema}}.wh_perspective_versions
  SET state = 'kept', relations = v_old, switched_at = now()
  WHERE perspective_name = p_perspective AND version = p_live;
  UPDATE {{schema}}.wh_perspective_versions
  SET state = 'live', relations = v_new, switched_at = now()
  WHERE perspective_name = p_perspective AND version = p_next;
  RETURN QUERY SELECT v_old, v_new;
END
$$;
