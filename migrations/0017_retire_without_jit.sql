-- 0017: retiring streams runs without JIT.
--
-- The settler calls cleanup_completed_streams with a batch of streams, and its probe asks each
-- one whether any work is left (one row answers). Without column statistics on the work table
-- (the engine's own VACUUM sets its row count; autovacuum's ANALYZE comes later) the planner
-- guesses 200 distinct streams, costs each probe as reading a thousand rows, and a batch of a
-- thousand streams lands past jit_above_cost: JIT compiled the statement on every call, 200 to
-- 380 ms for a statement that runs in milliseconds (breadth benchmark, auto_explain). It runs
-- no user code, as claim_work (0010), which has had jit = off since.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

ALTER FUNCTION {{schema}}.cleanup_completed_streams(uuid, uuid[]) SET jit = off;
