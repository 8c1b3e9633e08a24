-- wh_job_blockers(wait_for): the transactions a job in `waiting` waits for (see wh_job_advance):
-- those open when it took its snapshot, still in progress, that appended to this event store
-- (they hold its ROW EXCLUSIVE lock until they end; their transaction id lock and that relation
-- lock share a virtual transaction). Transactions of other schemas and databases are not among
-- them. With each one's backend (pid), application and user, and since when it is open (NULL
-- unless the caller may see that session's activity: pg_read_all_stats or the same role), so
-- that `status` can name what a job waits for.

CREATE OR REPLACE FUNCTION {{schema}}.wh_job_blockers(p_wait_for pg_snapshot)
RETURNS TABLE (pid integer, application_name text, usename text, xact_start timestamptz)
LANGUAGE sql STABLE AS $$
  SELECT DISTINCT t.pid, a.application_name, a.usename::text, a.xact_start
  FROM pg_snapshot_xip(p_wait_for) x
  JOIN pg_locks t ON t.locktype = 'transactionid' AND t.granted
                 AND t.transactionid = x::text::xid
  JOIN pg_locks r ON r.virtualtransaction = t.virtualtransaction
                 AND r.locktype = 'relation'
                 AND r.relation = '{{schema}}.wh_event_store'::regclass
                 AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  LEFT JOIN pg_stat_activity a ON a.pid = t.pid
  WHERE pg_xact_status(x) = 'in progress'
$$;
