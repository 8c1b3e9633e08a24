#!/usr/bin/env bash
# Blue/green benchmark (issue 29): a version bump with `rebuild: blueGreen` builds the new
# version beside the live one while the live one serves; how fast is the build, and what does it
# cost the live version's latency?
#
# Workload: STREAMS streams × PER_STREAM events of type A (default 10 000 × 100 = 1 000 000, as
# backfill.sh and issue 28's "during a 1 000 000-event backfill"; at 100 000 the build lasts
# about 5 s, and the rollout and the job's start, about a second, weigh as much as the build), one
# perspective `c1` (`rebuild: blueGreen`) doing one upsert per A event (a per-stream counter) and
# recording, per live event L, the time from its append (`created_at`) to its apply. One worker
# process (release build, default options).
#   steady   c1 version 1 is subscribed from the start; the worker runs idle; the history is
#            appended in one transaction; timed from that commit until every event is applied.
#            The perspective's steady-state apply rate on the same data.
#   quiet    the history is applied by version 1; then `migrate` raises c1 to version 2 (a new
#            column: a shape change), a worker with the new config starts and the old one stops
#            (a rollout), and it builds version 2 beside version 1 and switches; timed from
#            migrate's commit (the new worker's start-up included) until version 2 is live. No
#            other load.
#   busy     the same, with PRODUCERS pgbench connections appending L events to 1 000 other
#            streams at LIVE_RATE events/s from LEAD seconds before the bump until the switch:
#            the build rate under live load (version 2 applies the history and every L event
#            stored before the switch, so those count), and the p50 / p99 append → applied latency of the
#            live L events applied by version 1 during the build (read from its archived table
#            after the switch), against the same before the bump.
# Every counter of version 2 must end at exactly PER_STREAM, and version 2 must have applied
# every L event once.
#
#   tests/bench/bluegreen.sh                        (make bench builds the release worker first)
#   STREAMS=1000 PER_STREAM=100 tests/bench/bluegreen.sh   (100 000 events, the size before 2026-12-03)
#   RUST_LOG=perspective_worker=debug KEEP_LOG=/tmp/bg.log tests/bench/bluegreen.sh  (workers' log)
#   SERIES=1 tests/bench/bluegreen.sh               (also, on stderr, per second of the busy
#                                                    build: L events appended, p50, p99 in ms;
#                                                    the rollout's times; the first 3 s in tenths)
set -euo pipefail
cd "$(dirname "$0")/../.."

STREAMS=${STREAMS:-10000}
PER_STREAM=${PER_STREAM:-100}
PRODUCERS=${PRODUCERS:-4}
LIVE_RATE=${LIVE_RATE:-500}
LEAD=${LEAD:-5}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
[ -x "$WORKER" ] || { echo "build the worker first: cargo build --release -p perspective-worker" >&2; exit 1; }

if [ -z "${DATABASE_URL:-}" ]; then
  exec tests/pg/pg.sh with "$0" "$@"
fi

work=$(mktemp -d)
pid=
load=
cleanup() {
  if [ -n "${KEEP_LOG:-}" ]; then cp "$work/worker.log" "$KEEP_LOG" 2>/dev/null || true; fi
  if [ -n "$load" ]; then kill -TERM "$load" 2>/dev/null || true; fi
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
q() { psql "$DATABASE_URL" -XAtq -v ON_ERROR_STOP=1 "$@"; }
now() { date +%s.%N; }
EVENTS=$(( STREAMS * PER_STREAM ))

config() { # schema version -> file; version 2 adds a column (a shape change)
  local f="$work/$1-$2.yaml" extra=""
  [ "$2" = 2 ] && extra=", v2 boolean NOT NULL DEFAULT true"
  printf '%s\n' "schema: $1" "perspectives:" \
    "  - name: c1" \
    "    version: $2" \
    "    rebuild: blueGreen" \
    "    setup: |" \
    "      CREATE TABLE IF NOT EXISTS c1 (stream_id uuid PRIMARY KEY, n bigint NOT NULL, last bigint NOT NULL$extra);" \
    "      CREATE TABLE IF NOT EXISTS c1_lat (event_id uuid PRIMARY KEY, appended_at timestamptz NOT NULL, latency_ms float8 NOT NULL);" \
    "    handlers:" \
    "      A: INSERT INTO c1 AS c (stream_id, n, last) VALUES (:stream_id, 1, :stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last" \
    "      L: INSERT INTO c1_lat VALUES (:event_id, :created_at, extract(epoch FROM clock_timestamp() - :created_at) * 1000)" >"$f"
  echo "$f"
}

append_history() { # schema
  q -c "INSERT INTO $1.wh_event_store (stream_id, event_type)
        SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, 'A'
        FROM generate_series(1, $PER_STREAM) v, generate_series(1, $STREAMS) s ORDER BY s, v"
}

start_worker() { # config; sets $pid and $port (its HTTP endpoints)
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  RUST_LOG=${RUST_LOG:-warn} "$WORKER" --config "$1" run --http-addr "127.0.0.1:$port" >>"$work/worker.log" 2>&1 &
  pid=$!
}

await_ready() { # port: the worker's /readyz answers 200 (schema verified, first claim done)
  for _ in $(seq 400); do
    curl -sf "http://127.0.0.1:$1/readyz" >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "bench: the worker on port $1 did not become ready:" >&2
  cat "$work/worker.log" >&2
  exit 1
}

stop_worker() {
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
  pid=
}

await_registered() { # schema
  for _ in $(seq 200); do
    [ "$(q -c "SELECT count(*) FROM $1.wh_service_instances")" = 1 ] && return 0
    sleep 0.05
  done
  echo "bench: the worker did not start:" >&2
  cat "$work/worker.log" >&2
  exit 1
}

# One session polls server-side, committing around every sleep (see backfill.sh).
await_applied() { # schema: every A event applied to c1 (version 1), nothing pending
  q -c "SET statement_timeout = '1800s'" -c "DO \$\$ BEGIN
    WHILE (SELECT coalesce(sum(n), 0) FROM $1.c1) < $EVENTS
          OR EXISTS (SELECT 1 FROM $1.wh_perspective_jobs WHERE state <> 'done')
          OR EXISTS (SELECT 1 FROM $1.wh_perspective_events WHERE processed_at IS NULL) LOOP
      COMMIT; PERFORM pg_sleep(0.01); COMMIT; -- no snapshot held while waiting
    END LOOP;
  END \$\$"
}

await_switched() { # schema: version 2 of c1 is live
  q -c "SET statement_timeout = '1800s'" -c "DO \$\$ BEGIN
    WHILE NOT EXISTS (SELECT 1 FROM $1.wh_perspective_versions
                      WHERE perspective_name = 'c1' AND version = 2 AND state = 'live') LOOP
      COMMIT; PERFORM pg_sleep(0.01); COMMIT; -- no snapshot held while waiting
    END LOOP;
  END \$\$"
}

check() { # schema: version 2 (live) counted every A event once, and applied every L event once
  local bad
  bad=$(q -c "SELECT (SELECT count(*) FROM $1.c1 WHERE n <> $PER_STREAM) + $STREAMS - (SELECT count(*) FROM $1.c1)")
  [ "$bad" = 0 ] || { echo "bench: $1 applied some events more or less than once ($bad streams)" >&2; exit 1; }
  [ "$(q -c "SELECT count(*) FROM $1.c1 WHERE NOT v2")" = 0 ] || { echo "bench: $1.c1 is not version 2's table" >&2; exit 1; }
  bad=$(q -c "SELECT (SELECT count(*) FROM $1.wh_event_store WHERE event_type = 'L') - (SELECT count(*) FROM $1.c1_lat)")
  [ "$bad" = 0 ] || { echo "bench: $1: version 2 missed $bad live events" >&2; exit 1; }
}

producers() { # schema seconds -> runs pgbench at LIVE_RATE in the background ($load)
  printf '%s\n' '\set s random(1, 1000)' \
    "INSERT INTO $1.wh_event_store (stream_id, event_type) VALUES (('00000000-0000-7000-9000-' || lpad(to_hex(:s), 12, '0'))::uuid, 'L');" \
    >"$work/append.sql"
  pgbench "$DATABASE_URL" -n -f "$work/append.sql" -c "$PRODUCERS" -j 2 -T "$2" -R "$LIVE_RATE" >"$work/pgbench.out" 2>&1 &
  load=$!
}

latency() { # table from to (epoch seconds) -> "p50 p99 count" in ms of the L events appended then
  q -F' ' -c "SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ms)::numeric, 1),
                     round(percentile_cont(0.99) WITHIN GROUP (ORDER BY latency_ms)::numeric, 1), count(*)
              FROM $1 WHERE appended_at BETWEEN to_timestamp($2) AND to_timestamp($3)"
}

bump() { # schema: migrate raises c1 to version 2 (blue/green), then the worker rolls to the new
  # config (only workers with it run the build), as a pod rollout does: the new worker is ready
  # (its /readyz, a pod's readiness probe) before the old one stops, so version 1 never goes
  # unserved.
  "$WORKER" --config "$(config "$1" 2)" migrate >"$work/migrate.out" 2>>"$work/migrate.log"
  t0=$(now) # sets the caller's start
  grep -q "building c1 version 2" "$work/migrate.out" || { echo "bench: migrate did not start a blue/green build:" >&2; cat "$work/migrate.out" >&2; exit 1; }
  local old=$pid
  start_worker "$work/$1-2.yaml"
  await_ready "$port"
  t_ready=$(now)
  local new=$pid
  pid=$old
  stop_worker
  t_stopped=$(now)
  pid=$new
}

prepare() { # schema: version 1 live with the history applied, a worker running
  "$WORKER" --config "$(config "$1" 1)" migrate >/dev/null 2>>"$work/migrate.log"
  append_history "$1"
  start_worker "$work/$1-1.yaml"
  await_registered "$1"
  await_applied "$1"
  q -c "VACUUM ANALYZE $1.wh_event_store" >/dev/null
}

echo "blue/green benchmark: PostgreSQL $(q -c 'show server_version' | cut -d' ' -f1), fsync=$(q -c 'show fsync'), synchronous_commit=$(q -c 'show synchronous_commit'), $(nproc) cores; $STREAMS streams x $PER_STREAM events = $EVENTS events; 1 worker; live load $LIVE_RATE events/s from $PRODUCERS connections"

# Steady state: version 1 subscribed from the start.
s=bench_bg_steady
"$WORKER" --config "$(config $s 1)" migrate >/dev/null 2>>"$work/migrate.log"
start_worker "$work/$s-1.yaml"
await_registered $s
sleep 0.3
append_history $s
t0=$(now)
await_applied $s
t1=$(now)
stop_worker
steady=$(awk -v n=$EVENTS -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", n / (b - a) }')
steady_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE" >/dev/null

# Quiet: the bump with no other load.
s=bench_bg_quiet
prepare $s
bump $s
await_switched $s
t1=$(now)
stop_worker
check $s
quiet=$(awk -v n=$EVENTS -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", n / (b - a) }')
quiet_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s, ${s}_c1_v1, ${s}_c1_v2 CASCADE" >/dev/null

# Busy: live load from LEAD seconds before the bump until the switch.
s=bench_bg_busy
prepare $s
producers $s 3600
sleep 1
l0=$(now)
sleep "$LEAD"
bump $s
await_switched $s
t1=$(now)
kill -TERM "$load" 2>/dev/null || true
wait "$load" 2>/dev/null || true
load=
await_applied $s
stop_worker
check $s
# Version 2 applies the history and every live event stored before the switch.
live_events=$(q -c "SELECT count(*) FROM $s.wh_event_store WHERE event_type = 'L' AND created_at <= to_timestamp($t1)")
built=$(( EVENTS + live_events ))
busy=$(awk -v n=$built -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", n / (b - a) }')
busy_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
# Version 1's table, archived by the switch, holds what it applied before and during the build.
read -r before_p50 before_p99 before_n <<<"$(latency "${s}_c1_v1.c1_lat" "$l0" "$t0")"
read -r during_p50 during_p99 during_n <<<"$(latency "${s}_c1_v1.c1_lat" "$t0" "$t1")"
if [ -n "${SERIES:-}" ]; then # per second of the build: L events appended, p50 / p99 of version 1
  q -F' ' -c "SELECT floor(extract(epoch FROM appended_at) - $t0)::int AS s, count(*),
                     round(percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ms)::numeric),
                     round(percentile_cont(0.99) WITHIN GROUP (ORDER BY latency_ms)::numeric)
              FROM ${s}_c1_v1.c1_lat WHERE appended_at BETWEEN to_timestamp($t0) AND to_timestamp($t1)
              GROUP BY 1 ORDER BY 1" >&2
  # When the rollout happened, and the first 3 s in tenths: appended, p50, max in ms.
  echo "the new worker was ready at $(awk -v a="$t0" -v b="$t_ready" 'BEGIN { printf "%.2f", b - a }') s, the old one stopped at $(awk -v a="$t0" -v b="$t_stopped" 'BEGIN { printf "%.2f", b - a }') s" >&2
  q -F' ' -c "SELECT round(floor((extract(epoch FROM appended_at) - $t0) * 10)::numeric / 10, 1), count(*),
                     round(percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ms)::numeric),
                     round(max(latency_ms)::numeric)
              FROM ${s}_c1_v1.c1_lat WHERE appended_at BETWEEN to_timestamp($t0) AND to_timestamp($t0 + 3)
              GROUP BY 1 ORDER BY 1" >&2
fi
reached=$(awk -v n="$during_n" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", n / (b - a) }')

pct() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f%%", a * 100 / b }'; }
printf '| figure | value |\n|---|---|\n'
printf '| steady-state apply of %d events by version 1 (append commit → all applied) | %s ev/s (%s s) |\n' "$EVENTS" "$steady" "$steady_s"
printf '| blue/green build of version 2, no other load (migrate commit → switched) | %s ev/s (%s s) |\n' "$quiet" "$quiet_s"
printf '| build / steady state, no other load (goal ≥ 70%%) | **%s** |\n' "$(pct "$quiet" "$steady")"
printf '| blue/green build of version 2 beside %s live events/s (migrate commit → switched; %s history + %s live events) | %s ev/s (%s s) |\n' "$LIVE_RATE" "$EVENTS" "$live_events" "$busy" "$busy_s"
printf '| build under live load / steady state (goal ≥ 70%%) | **%s** |\n' "$(pct "$busy" "$steady")"
printf '| version 1, live events append → applied, during the build (%s events, %s/s reached) | p50 %s ms, p99 %s ms |\n' "$during_n" "$reached" "$during_p50" "$during_p99"
printf '| version 1, live events append → applied, the %s s before the bump (%s events) | p50 %s ms, p99 %s ms |\n' "$LEAD" "$before_n" "$before_p50" "$before_p99"
