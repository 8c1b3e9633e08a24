#!/usr/bin/env bash
# Latency under load (issue 28): how long an event takes from its append to its apply while a
# busy service appends at a fixed rate — the tail a read-your-writes client sees.
#
# For each WORKERS count and each RATE: a fresh schema with 2 perspectives, WORKERS
# `perspective-worker run` processes (release build, default options), and PRODUCERS pgbench
# connections appending single-event transactions at RATE events/s in total for SECONDS
# seconds, spread over STREAMS streams. Durable commits: the throwaway PostgreSQL runs with
# fsync, synchronous_commit and full_page_writes on (tests/pg/pg.sh's defaults turn them off).
# Each handler records clock_timestamp() when it applies an event; the latency of an apply is
# that minus the event's created_at (the appending transaction's start), both by the database's
# clock. Reported per run: the rate reached, p50, p99, max and the worst one-second p99 (the p99
# of the applies of events appended in each second, the worst second), over both perspectives'
# applies, with the goals of issue 28 (1 000 events/s, 1 worker: p50 <= 10 ms, p99 <= 25 ms; 3
# workers no worse).
#
#   tests/bench/latency.sh                       (make bench builds the release worker first)
#   RATES="1000" WORKERS_LIST="1 3" SECONDS_EACH=30 tests/bench/latency.sh
#   STREAMS=10 RATES=1000 tests/bench/latency.sh (hot streams, also in make bench: each stream
#                                                 stays active, so its producers ring no doorbell)
#
# The latency during a 1 000 000-event backfill is measured by tests/bench/backfill.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."

RATES=${RATES:-500 1000 2000}
WORKERS_LIST=${WORKERS_LIST:-1 3}
SECONDS_EACH=${SECONDS_EACH:-30}
PRODUCERS=${PRODUCERS:-8}
STREAMS=${STREAMS:-10000}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
[ -x "$WORKER" ] || { echo "build the worker first: cargo build --release -p perspective-worker" >&2; exit 1; }

if [ -z "${DATABASE_URL:-}" ]; then
  # Durable commits: later -c flags win over pg.sh's fsync=off and synchronous_commit=off.
  export PG_EXTRA_CONF="${PG_EXTRA_CONF:-} -c fsync=on -c synchronous_commit=on -c full_page_writes=on"
  exec tests/pg/pg.sh with "$0" "$@"
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
q() { psql "$DATABASE_URL" -XAtq -v ON_ERROR_STOP=1 "$@"; }

# The live load's schema (live_config) and await_drained.
source tests/bench/live-load.sh

run() { # workers rate -> "achieved p50 p99 max worst_second_p99"
  local n=$1 rate=$2 s="lat_${1}_${2}" cfg
  cfg=$(live_config "$s")
  "$WORKER" --config "$cfg" migrate >/dev/null 2>>"$work/migrate.log"
  pids=()
  for _ in $(seq "$n"); do
    RUST_LOG=warn "$WORKER" --config "$cfg" run --http-addr 127.0.0.1:0 >>"$work/worker.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 200); do
    [ "$(q -c "SELECT count(*) FROM $s.wh_service_instances")" = "$n" ] && break
    sleep 0.05
  done
  cat >"$work/append.sql" <<SQL
\set s random(1, $STREAMS)
INSERT INTO $s.wh_event_store (stream_id, event_type, event_data)
VALUES (('00000000-0000-7000-8000-' || lpad(to_hex(:s), 12, '0'))::uuid, 'Placed', '{"total": 1}');
SQL
  pgbench "$DATABASE_URL" -n -f "$work/append.sql" -c "$PRODUCERS" -j 2 -T "$SECONDS_EACH" -R "$rate" >/dev/null 2>&1
  await_drained "$s"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
  q -F' ' -c "WITH l AS (
                SELECT appended_at, extract(epoch FROM applied_at - appended_at) * 1000 AS ms FROM $s.orders_seen
                UNION ALL
                SELECT appended_at, extract(epoch FROM applied_at - appended_at) * 1000 FROM $s.audit_seen),
              per_second AS (
                SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99 FROM l
                GROUP BY date_trunc('second', appended_at))
              SELECT round((SELECT count(*) FROM $s.wh_event_store) / $SECONDS_EACH.0),
                     round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1),
                     round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1),
                     round(max(ms)::numeric, 1),
                     round((SELECT max(p99) FROM per_second)::numeric, 1)
              FROM l"
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE" >/dev/null
}

echo "latency benchmark: PostgreSQL $(q -c 'show server_version' | cut -d' ' -f1), fsync=$(q -c 'show fsync'), synchronous_commit=$(q -c 'show synchronous_commit'), $(nproc) cores; $PRODUCERS producers, $STREAMS streams, 2 perspectives, ${SECONDS_EACH} s per run, worker $WORKER"
printf '\n| workers | target events/s | reached | p50 ms | p99 ms | max ms | worst 1-s p99 ms | goal (#28, at 1 000/s) |\n|---|---|---|---|---|---|---|---|\n'
for n in $WORKERS_LIST; do
  for rate in $RATES; do
    read -r reached p50 p99 max worst <<<"$(run "$n" "$rate")"
    goal="—"
    if [ "$rate" = 1000 ]; then
      goal=$(awk -v a="$p50" -v b="$p99" 'BEGIN { print (a <= 10 && b <= 25) ? "met" : "missed" }')
    fi
    printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$n" "$rate" "$reached" "$p50" "$p99" "$max" "$worst" "$goal"
  done
done
