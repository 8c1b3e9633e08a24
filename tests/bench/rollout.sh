#!/usr/bin/env bash
# Latency across a rolling update (issue 28): what a busy service's events wait while a
# Deployment replaces its worker pod — the new worker starts, becomes ready, and the old one gets
# SIGTERM and stops.
#
# Per run: a fresh schema with 2 perspectives (as tests/bench/latency.sh: each handler records
# clock_timestamp() when it applies an event), worker A running, PRODUCERS pgbench connections
# appending single-event transactions at RATE events/s over STREAMS streams for SECONDS seconds.
# After LEAD seconds a backlog of BACKLOG events (100 per stream, on streams of their own) is
# appended in one transaction, so that A is draining when the rollout comes, as during a
# catch-up; a moment later worker B starts, and once its /readyz answers 200 (the pod's readiness
# probe), A gets SIGTERM. Reported per run: how long A took to stop, and the p50 / p99 / max
# append → applied latency of the live events appended from 1 s before the SIGTERM to 2 s after
# it (both perspectives' applies), against the same figures over the LEAD seconds before.
#
# BUILDS lists worker builds as NAME=BINARY (default: WORKER as "worker"); runs alternate
# between them over ROUNDS rounds, and each build's medians over its runs are reported last.
# Durable commits, as tests/bench/latency.sh. ROLLOUT=0 is the baseline: the same load and
# backlog, and A goes on alone (its "stop" is 0 ms; the window is the same).
#
#   tests/bench/rollout.sh
#   BUILDS="main=/tmp/main-worker new=/tmp/new-worker" ROUNDS=3 tests/bench/rollout.sh
#   KEEP_LOGS=/tmp/rollout-logs WORKER_LOG=perspective_worker=debug ROUNDS=1 tests/bench/rollout.sh
#                                   (the workers' logs, per run; WORKER_LOG is their RUST_LOG)
set -euo pipefail
cd "$(dirname "$0")/../.."

RATE=${RATE:-500}
SECONDS_EACH=${SECONDS_EACH:-10}
LEAD=${LEAD:-4}
BACKLOG=${BACKLOG:-20000}
PRODUCERS=${PRODUCERS:-8}
STREAMS=${STREAMS:-2000}
ROUNDS=${ROUNDS:-3}
ROLLOUT=${ROLLOUT:-1}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
BUILDS=${BUILDS:-worker=$WORKER}
for b in $BUILDS; do
  case $b in [a-z]*=*) ;; *) echo "rollout: '$b' in BUILDS is not NAME=BINARY" >&2; exit 2;; esac
  [ -x "${b#*=}" ] || { echo "rollout: '${b#*=}' (in BUILDS, for ${b%%=*}) is not an executable worker; build it: cargo build --release -p perspective-worker" >&2; exit 2; }
done
[ "$(( LEAD + 4 ))" -le "$SECONDS_EACH" ] || { echo "rollout: SECONDS_EACH must be at least LEAD + 4" >&2; exit 2; }

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
  if [ -n "${KEEP_LOGS:-}" ]; then mkdir -p "$KEEP_LOGS" && cp "$work"/*.log "$KEEP_LOGS"/ 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
q() { psql "$DATABASE_URL" -XAtq -v ON_ERROR_STOP=1 "$@"; }
now() { date +%s.%N; }
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# The live load's schema (live_config) and await_drained.
source tests/bench/live-load.sh

start_worker() { # binary config log -> pid (in $started)
  RUST_LOG=${WORKER_LOG:-info} "$1" --config "$2" run --http-addr 127.0.0.1:0 >"$3" 2>&1 &
  started=$!
  pids+=("$started")
}

await_ready() { # log: until the worker's /readyz answers 200 (10 s at most)
  local addr="" i
  for i in $(seq 200); do
    addr=$(grep -o 'HTTP endpoints on http://[0-9.:]*' "$1" | head -1 | sed 's|.*http://||') || true
    if [ -n "$addr" ] && curl -fs "http://$addr/readyz" >/dev/null 2>&1; then return 0; fi
    sleep 0.05
  done
  echo "rollout: the new worker was not ready within 10 s" >&2
  return 1
}


run() { # name binary round -> "stop_ms before_p50 before_p99 p50 p99 max n"
  local name=$1 bin=$2 s="roll_$1_$3" cfg a b t_start t_term t_gone
  cfg=$(live_config "$s" "Backlog: SELECT 1")
  "$bin" --config "$cfg" migrate >/dev/null 2>>"$work/migrate.log"
  start_worker "$bin" "$cfg" "$work/$s.a.log"; a=$started
  await_ready "$work/$s.a.log"
  cat >"$work/append.sql" <<SQL
\set s random(1, $STREAMS)
INSERT INTO $s.wh_event_store (stream_id, event_type, event_data)
VALUES (('00000000-0000-7000-8000-' || lpad(to_hex(:s), 12, '0'))::uuid, 'Placed', '{"total": 1}');
SQL
  t_start=$(now)
  pgbench "$DATABASE_URL" -n -f "$work/append.sql" -c "$PRODUCERS" -j 2 -T "$SECONDS_EACH" -R "$RATE" >/dev/null 2>&1 &
  local load=$!
  sleep "$LEAD"
  if [ "$BACKLOG" -gt 0 ]; then
    q -c "INSERT INTO $s.wh_event_store (stream_id, event_type)
          SELECT ('00000000-0000-7000-9000-' || lpad(to_hex(g / 100), 12, '0'))::uuid, 'Backlog'
          FROM generate_series(0, $BACKLOG - 1) g ORDER BY g"
  fi
  if [ "$ROLLOUT" = 1 ]; then
    start_worker "$bin" "$cfg" "$work/$s.b.log"; b=$started
    await_ready "$work/$s.b.log"
    t_term=$(now)
    kill -TERM "$a"
    wait "$a" 2>/dev/null || true
    t_gone=$(now)
  else # the baseline: the same load and backlog, no rollout (A goes on alone)
    sleep 0.3
    t_term=$(now); t_gone=$t_term; b=$a
  fi
  wait "$load"
  await_drained "$s"
  kill -TERM "$b"
  wait "$b" 2>/dev/null || true
  pids=()
  q -F' ' -c "WITH l AS (
                SELECT appended_at, extract(epoch FROM applied_at - appended_at) * 1000 AS ms FROM $s.orders_seen
                UNION ALL
                SELECT appended_at, extract(epoch FROM applied_at - appended_at) * 1000 FROM $s.audit_seen),
              before AS (SELECT ms FROM l WHERE appended_at BETWEEN to_timestamp($t_start) AND to_timestamp($t_start + $LEAD)),
              around AS (SELECT ms FROM l WHERE appended_at BETWEEN to_timestamp($t_term - 1) AND to_timestamp($t_term + 2))
              SELECT round(($t_gone - $t_term) * 1000),
                     (SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1) FROM before),
                     (SELECT round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1) FROM before),
                     round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1),
                     round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1),
                     round(max(ms)::numeric, 1), count(*)
              FROM around"
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE" >/dev/null
}

echo "rollout benchmark: PostgreSQL $(q -c 'show server_version' | cut -d' ' -f1), fsync=$(q -c 'show fsync'), synchronous_commit=$(q -c 'show synchronous_commit'), $(nproc) cores; $PRODUCERS producers at $RATE events/s over $STREAMS streams, 2 perspectives, a backlog of $BACKLOG events $LEAD s in, then the rollout; $ROUNDS rounds"
printf '\n| build | round | old worker stopped in ms | before: p50 / p99 ms | around the SIGTERM (-1 s..+2 s): p50 / p99 / max ms | applies |\n|---|---|---|---|---|---|\n'
for r in $(seq "$ROUNDS"); do
  for b in $BUILDS; do
    name=${b%%=*}
    read -r stop bp50 bp99 p50 p99 max n <<<"$(run "$name" "${b#*=}" "$r")"
    printf '| %s | %s | %s | %s / %s | %s / %s / %s | %s |\n' "$name" "$r" "$stop" "$bp50" "$bp99" "$p50" "$p99" "$max" "$n"
    echo "$stop $p99 $max" >>"$work/$name.runs"
  done
done
printf '\n| build | median stop ms | median p99 around the SIGTERM | median max |\n|---|---|---|---|\n'
for b in $BUILDS; do
  name=${b%%=*}
  printf '| %s | %s | %s | %s |\n' "$name" "$(cut -d' ' -f1 "$work/$name.runs" | median)" \
    "$(cut -d' ' -f2 "$work/$name.runs" | median)" "$(cut -d' ' -f3 "$work/$name.runs" | median)"
done
