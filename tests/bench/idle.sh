#!/usr/bin/env bash
# Idle load (issue 28): how many statements an idle worker sends, counted by the database.
#
# One `perspective-worker run` (release build, default options) on an empty schema with one
# perspective; after WARMUP seconds of start-up, every statement of the database that
# pg_stat_statements counts over SECONDS_EACH seconds (claims, heartbeats, the pending gauge,
# the LISTEN probe, pool reconnects), except this script's own reads of pg_stat_statements.
# Goal (#28): at most 0.5 statements a second.
#
#   tests/bench/idle.sh                        (make bench builds the release worker first)
#   SECONDS_EACH=120 tests/bench/idle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

WARMUP=${WARMUP:-15}
SECONDS_EACH=${SECONDS_EACH:-60}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
[ -x "$WORKER" ] || { echo "build the worker first: cargo build --release -p perspective-worker" >&2; exit 1; }

if [ -z "${DATABASE_URL:-}" ]; then
  exec tests/pg/pg.sh with "$0" "$@"
fi

work=$(mktemp -d)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
q() { psql "$DATABASE_URL" -XAtq -v ON_ERROR_STOP=1 "$@"; }
counted() { q -c "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%'"; }

q -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
cat >"$work/idle.yaml" <<Y
schema: idle_bench
perspectives:
  - name: seen
    setup: CREATE TABLE IF NOT EXISTS seen (stream_id uuid PRIMARY KEY)
    handlers:
      Placed: INSERT INTO seen VALUES (:stream_id) ON CONFLICT DO NOTHING
Y
"$WORKER" --config "$work/idle.yaml" migrate >/dev/null 2>"$work/migrate.log"
RUST_LOG=warn "$WORKER" --config "$work/idle.yaml" run --http-addr 127.0.0.1:0 >"$work/worker.log" 2>&1 &
pid=$!
sleep "$WARMUP" # start-up: registration, first claims, pool connections
before=$(counted)
sleep "$SECONDS_EACH" # the measurement itself: nothing to wait for but time
after=$(counted)
n=$(( after - before ))
rate=$(awk -v n="$n" -v s="$SECONDS_EACH" 'BEGIN { printf "%.2f", n / s }')
goal=$(awk -v r="$rate" 'BEGIN { print (r <= 0.5) ? "met" : "missed" }')
echo "idle benchmark: PostgreSQL $(q -c 'show server_version' | cut -d' ' -f1), worker $WORKER"
printf '\n| idle worker | statements | seconds | per second | goal (#28: <= 0.5/s) |\n|---|---|---|---|---|\n'
printf '| 1, default options | %s | %s | %s | %s |\n' "$n" "$SECONDS_EACH" "$rate" "$goal"
