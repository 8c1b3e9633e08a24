{#- Drops every function `schema.name` an older binary created with other argument types or
    other result columns (CREATE OR REPLACE can change neither, and a stale overload would
    linger); the current one is replaced in place and keeps its identity, so a second `migrate`
    changes nothing. Slots: schema, name, args and result as pg_get_function_* print them. #}
DO $wh_drop$ DECLARE f regprocedure; BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
           WHERE p.pronamespace = to_regnamespace('{{ schema }}') AND p.proname = '{{ name }}'
             AND (oidvectortypes(p.proargtypes) <> '{{ args }}'
                  OR pg_get_function_result(p.oid) <> 'TABLE({{ result }})') LOOP
    EXECUTE 'DROP FUNCTION ' || f;
  END LOOP;
END $wh_drop$;
