# Sourced by tests/bench/latency.sh and tests/bench/rollout.sh: the schema their live load writes
# to, and the wait for it to drain. The caller defines q (psql on $DATABASE_URL) and $work.

# live_config schema [handler] -> file: two perspectives, orders_seen and audit_seen, each
# recording per `Placed` event when it was appended (:created_at, the appending transaction's
# start) and when it was applied (clock_timestamp()), both by the database's clock; `handler`
# (e.g. "Backlog: SELECT 1") is added to both.
live_config() {
  local f="$work/$1.yaml" p
  {
    echo "schema: $1"
    echo "perspectives:"
    for p in orders_seen audit_seen; do
      cat <<Y
  - name: $p
    setup: CREATE TABLE IF NOT EXISTS $p (event_id uuid PRIMARY KEY, appended_at timestamptz NOT NULL, applied_at timestamptz NOT NULL)
    handlers:
      Placed: INSERT INTO $p VALUES (:event_id, :created_at, clock_timestamp())
Y
      if [ -n "${2:-}" ]; then echo "      $2"; fi
    done
  } >"$f"
  echo "$f"
}

# await_drained schema: returns once no work row is left unprocessed; fails after 60 s.
await_drained() {
  for _ in $(seq 600); do
    [ "$(q -c "SELECT count(*) FROM $1.wh_perspective_events WHERE processed_at IS NULL")" = 0 ] && return 0
    sleep 0.1
  done
  echo "$(basename "$0" .sh): $1 did not drain within 60 s" >&2
  return 1
}
