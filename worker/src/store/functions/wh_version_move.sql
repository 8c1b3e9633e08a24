-- wh_version_move(from schema, to schema, relations): move the named relations of a blue/green
-- version between schemas (wh_version_switch), each with the ALTER its kind takes. A name that
-- is not there is skipped (a table the user dropped).

CREATE OR REPLACE FUNCTION {{schema}}.wh_version_move(p_from text, p_to text, p_relations text[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  v_rel record;
BEGIN
  FOR v_rel IN
    SELECT c.relname, c.relkind FROM pg_class c
    WHERE c.relnamespace = to_regnamespace(p_from) AND c.relname = ANY (p_relations)
      AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
    ORDER BY c.relname
  LOOP
    EXECUTE format('ALTER %s %I.%I SET SCHEMA %I',
                   CASE v_rel.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                                      WHEN 'f' THEN 'FOREIGN TABLE' WHEN 'S' THEN 'SEQUENCE'
                                      ELSE 'TABLE' END,
                   p_from, v_rel.relname, p_to);
  END LOOP;
END
$$;
