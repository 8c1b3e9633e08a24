-- 0003: drop what nothing uses, so the schema shows only what the worker relies on.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

-- The compiled apply functions move the cursor in their apply transaction, and custom runners
-- do the same with the worker library's cursor statements; nothing called this.
DROP FUNCTION {{schema}}.complete_perspective_cursor_work(
  uuid, text, bigint, uuid, bigint[], smallint, text, boolean);

-- RewindRequired (32) is never stored: a rewind runs inside the apply transaction that finds
-- the late event, so no cursor waits in that state and this index stayed empty.
DROP INDEX {{schema}}.wh_perspective_cursors_rewind;

-- Failures are counted on the work row (`wh_perspective_events.attempts`), and no stream lock
-- is taken on the cursor: these columns were never written.
ALTER TABLE {{schema}}.wh_perspective_cursors
  DROP COLUMN attempts,
  DROP COLUMN stream_lock_instance_id,
  DROP COLUMN stream_lock_expiry,
  DROP COLUMN stream_lock_reason;
