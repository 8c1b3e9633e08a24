-- 0022: whether a worker claims at its pace without waiting for the doorbell (`awake`). Under
-- load the claim loop of every worker runs at the deployment's doorbell pace anyway, and a
-- NOTIFY costs its producer PostgreSQL's global notify lock, held from before its commit record
-- to the end of its commit (the WAL flush, with durable commits): producers that ring serialise
-- their commits. So while every live worker is awake, a stream's empty -> non-empty edge does
-- not ring; a worker goes back to sleep only in a moment no producer is between that edge and
-- its commit, and claims once more before it waits (wh_claim_awake.sql, the trigger).
-- false (asleep, the default and what a worker that never says otherwise is): producers ring.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

ALTER TABLE {{schema}}.wh_service_instances ADD COLUMN awake boolean NOT NULL DEFAULT false;
