-- 0019: the append-only guard checks each deleted event itself. Before, a DELETE went through
-- whenever its transaction carried the `perspective.retention` setting that
-- wh_delete_applied_events sets, and any session can set it: `SET LOCAL perspective.retention`
-- and a DELETE removed an event whose dead letter was still waiting for a replay. Now a second
-- DELETE trigger runs for each row, and wh_event_store_immutable (worker/src/store/functions/)
-- refuses there an event that something still needs, whoever deletes it. (The statement
-- trigger stays: a DELETE without the setting is refused even when it matches no row.)
-- Template: `{{schema}}` is the deployment's schema (see 0001).

CREATE TRIGGER wh_event_store_retention_guard
  BEFORE DELETE ON {{schema}}.wh_event_store
  FOR EACH ROW EXECUTE FUNCTION {{schema}}.wh_event_store_immutable();
