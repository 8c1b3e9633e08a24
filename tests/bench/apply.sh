#!/usr/bin/env bash
# Apply-path benchmark: the engine end to end (claim, fetch, apply, complete) against a
# hand-written ceiling, side by side on one throwaway cluster.
#
# Workload: STREAMS streams × PER_STREAM events, 2 perspectives each doing one upsert per event
# (a per-stream counter), so 2 × STREAMS × PER_STREAM applies.
#   ceiling  pre-claimed work; 4 pgbench connections each repeatedly call one server-side
#            PL/pgSQL function that takes the next (stream, perspective) pair (SKIP LOCKED),
#            applies its ≤ 100 events with the same upsert, upserts the cursor and deletes the
#            work rows — one round trip per group, no claiming, no engine.
#   engine   N `perspective-worker run` processes (release build) already running and idle,
#            with C drain consumers each (the default 4; also 1, to show scale-out where one
#            worker alone leaves the database idle; drainConsumersPerDeployment is set to
#            N x C, so that each runs C: its default, 4, gives 3 workers 1 each, the 3 x 1 variant); all events are appended in one
#            transaction; timed from that commit until every cursor is at its stream's head and
#            no work row is left unprocessed (claim, fetch, apply and complete included; the
#            retirement of drained streams goes on afterwards).
# Rounds alternate so machine drift hits every variant; medians are reported.
#
# After the table, the single-connection server cost: one `wh_drain` call over every stream
# (Instant, so it deletes its work rows as the ceiling does) against the ceiling function called
# once per group in one statement, each in a transaction that is rolled back (so both see the
# same data every time), alternating, fastest of ROUNDS.
# Nothing runs beside them, so this ratio is what the database does per apply, without the
# machine's noise, the engine's process or its concurrency. The same call Batched follows (its
# completion flush is not in it, so it is a lower bound on Batched's server cost).
#
# With BUILDS, each round runs every engine variant (and the server cost) once per build, in
# the order given, beside the same ceiling: builds compared side by side, on the same drift.
# VARIANTS picks engine variants (comma-separated "engine WORKERS STRATEGY CONSUMERS").
#
#   tests/bench/apply.sh            (make bench builds the release worker first)
#   STREAMS=400 PER_STREAM=100 ROUNDS=3 tests/bench/apply.sh
#   SERVER_COST_ONLY=1 ROUNDS=6 tests/bench/apply.sh     (only the single-connection part)
#   BUILDS="main=/tmp/main-worker new=/tmp/new-worker" VARIANTS="engine 1 Batched 4,engine 3 Batched 4" \
#     ROUNDS=8 tests/bench/apply.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

STREAMS=${STREAMS:-400}
PER_STREAM=${PER_STREAM:-100}
ROUNDS=${ROUNDS:-3}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
# The builds compared: name=path pairs; by default one unnamed build, WORKER.
declare -A build_path=()
build_names=("")
if [ -n "${BUILDS:-}" ]; then
  build_names=()
  for b in $BUILDS; do
    case $b in [a-z0-9]*=?*) ;; *) echo "BUILDS: not name=path with a name of [a-z0-9]: '$b'" >&2; exit 1;; esac
    case ${b%%=*} in *[!a-z0-9]*) echo "BUILDS: a build's name is [a-z0-9]+ (got '${b%%=*}')" >&2; exit 1;; esac
    build_names+=("${b%%=*}"); build_path["${b%%=*}"]=${b#*=}
  done
fi
# (The ceiling's schemas are migrated with the first build.)
[ -z "${build_names[0]}" ] || WORKER=${build_path[${build_names[0]}]}
worker_of() { # build name (empty: WORKER) -> its binary
  if [ -n "$1" ]; then echo "${build_path[$1]}"; else echo "$WORKER"; fi
}
for b in "${build_names[@]}"; do
  [ -x "$(worker_of "$b")" ] || { echo "build the worker first: cargo build --release -p perspective-worker (not executable: $(worker_of "$b"))" >&2; exit 1; }
done

if [ -z "${DATABASE_URL:-}" ]; then
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
now() { date +%s.%N; }
APPLIES=$(( STREAMS * PER_STREAM * 2 ))

config() { # schema strategy [drain consumers per worker] [workers] -> file
  cat >"$work/$1.yaml" <<EOF
schema: $1
perspectives:
  - name: c1
    setup: CREATE TABLE IF NOT EXISTS c1 (stream_id uuid PRIMARY KEY, n bigint NOT NULL, last bigint NOT NULL)
    handlers:
      A: INSERT INTO c1 AS c VALUES (:stream_id, 1, :stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last
  - name: c2
    setup: CREATE TABLE IF NOT EXISTS c2 (stream_id uuid PRIMARY KEY, n bigint NOT NULL, last bigint NOT NULL)
    handlers:
      A: INSERT INTO c2 AS c VALUES (:stream_id, 1, :stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last
worker:
  completionStrategy: $2
  maxConcurrentDrainConsumers: ${3:-4}
  drainConsumersPerDeployment: $(( ${3:-4} * ${4:-1} ))
EOF
  echo "$work/$1.yaml"
}

append_all() { # schema
  q -c "INSERT INTO $1.wh_event_store (stream_id, event_type, metadata)
        SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, 'A', '{\"user_id\": \"bench\"}'
        FROM generate_series(1, $PER_STREAM) v, generate_series(1, $STREAMS) s ORDER BY s, v"
}

# The wait must not steal the CPU it is timing (a psql process and a new backend every few
# milliseconds would): one session polls server-side, first the cursors (a few hundred rows) until
# all have reached their heads, then the work table until no row is left unprocessed. It commits
# around every sleep: a session waiting in one snapshot would hold back the xmin horizon, so no
# dead row version (the counters are updated 100 times per stream) could be pruned meanwhile.
await_drained() { # schema: returns once everything is applied and completed (5 min at most)
  q -c "SET statement_timeout = '300s'" -c "DO \$\$ BEGIN
    WHILE (SELECT coalesce(sum(last_version), 0) FROM $1.wh_perspective_cursors) < $(( 2 * STREAMS * PER_STREAM )) LOOP
      COMMIT; PERFORM pg_sleep(0.005); COMMIT; -- no snapshot held while waiting
    END LOOP;
    WHILE EXISTS (SELECT 1 FROM $1.wh_perspective_events WHERE processed_at IS NULL) LOOP
      COMMIT; PERFORM pg_sleep(0.005); COMMIT; -- no snapshot held while waiting
    END LOOP;
  END \$\$"
}

drained() { # schema -> 0 when everything is applied and completed
  [ "$(q -c "SELECT (SELECT count(*) FROM $1.wh_perspective_events WHERE processed_at IS NULL)
                   + (SELECT count(*) FROM $1.wh_perspective_cursors c JOIN $1.wh_streams s USING (stream_id) WHERE c.last_version < s.version)
                   + (SELECT $STREAMS * 2 - count(*) FROM $1.wh_perspective_cursors)")" = 0 ]
}

check() { # schema: every counter must equal PER_STREAM
  local bad
  bad=$(q -c "SELECT count(*) FROM (SELECT n FROM $1.c1 UNION ALL SELECT n FROM $1.c2) x WHERE n <> $PER_STREAM")
  [ "$bad" = 0 ] || { echo "bench: $1 applied some events more or less than once ($bad streams)" >&2; exit 1; }
}

create_ceiling() { # schema: the hand-written apply function and its queue of pairs
  local s=$1
  q <<EOF
CREATE TABLE $s.bench_pairs AS
  SELECT DISTINCT stream_id, perspective_name FROM $s.wh_perspective_events;
ALTER TABLE $s.bench_pairs ADD PRIMARY KEY (stream_id, perspective_name);
CREATE FUNCTION $s.bench_apply_next() RETURNS integer LANGUAGE plpgsql AS \$f\$
DECLARE
  v_stream uuid; v_p text; r record; v_last bigint := 0; v_ids bigint[] := '{}'; v_n integer := 0;
BEGIN
  DELETE FROM $s.bench_pairs WHERE (stream_id, perspective_name) =
    (SELECT stream_id, perspective_name FROM $s.bench_pairs LIMIT 1 FOR UPDATE SKIP LOCKED)
  RETURNING stream_id, perspective_name INTO v_stream, v_p;
  IF v_stream IS NULL THEN RETURN 0; END IF;
  FOR r IN SELECT w.event_work_id, w.stream_version FROM $s.wh_perspective_events w
           WHERE w.stream_id = v_stream AND w.perspective_name = v_p ORDER BY w.stream_version LIMIT 100 LOOP
    IF v_p = 'c1' THEN
      INSERT INTO $s.c1 AS c VALUES (v_stream, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    ELSE
      INSERT INTO $s.c2 AS c VALUES (v_stream, 1, r.stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last;
    END IF;
    v_last := r.stream_version; v_ids := v_ids || r.event_work_id; v_n := v_n + 1;
  END LOOP;
  INSERT INTO $s.wh_perspective_cursors AS c (stream_id, perspective_name, last_version, status)
  VALUES (v_stream, v_p, v_last, 2)
  ON CONFLICT (stream_id, perspective_name) DO UPDATE SET last_version = excluded.last_version, status = 2;
  DELETE FROM $s.wh_perspective_events WHERE event_work_id = ANY (v_ids);
  IF EXISTS (SELECT 1 FROM $s.wh_perspective_events WHERE stream_id = v_stream AND perspective_name = v_p) THEN
    INSERT INTO $s.bench_pairs VALUES (v_stream, v_p);
  END IF;
  RETURN v_n;
END
\$f\$;
EOF
}

run_ceiling() { # round -> applies/s
  local s="ceil_$1"
  "$WORKER" --config "$(config "$s" Batched)" migrate >/dev/null 2>>"$work/migrate.log"
  append_all "$s"
  create_ceiling "$s"
  echo "SELECT $s.bench_apply_next();" >"$work/ceiling.sql"
  local groups=$(( STREAMS * 2 * ((PER_STREAM + 99) / 100) ))
  local t0 t1
  t0=$(now)
  pgbench "$DATABASE_URL" -n -f "$work/ceiling.sql" -c 4 -j 2 -t $(( groups / 4 + 1 )) >/dev/null 2>&1
  t1=$(now)
  [ "$(q -c "SELECT count(*) FROM $s.wh_perspective_events")" = 0 ] || { echo "bench: ceiling left work behind" >&2; exit 1; }
  check "$s"
  # Later rounds should not run in a cluster filling up with earlier rounds' tables.
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE" >/dev/null
  awk -v n="$APPLIES" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", n / (b - a) }'
}

run_engine() { # round workers strategy consumers [build] -> applies/s ; leaves RSS in $work/rss
  local s="eng_$1_$2_$(echo "$3" | tr 'A-Z' 'a-z')_$4${5:+_$5}"
  local worker; worker=$(worker_of "${5:-}")
  local cfg; cfg=$(config "$s" "$3" "$4" "$2")
  "$worker" --config "$cfg" migrate >/dev/null 2>>"$work/migrate.log"
  pids=()
  for _ in $(seq "$2"); do
    RUST_LOG=warn "$worker" --config "$cfg" run --http-addr 127.0.0.1:0 --max-connections ${MAX_CONNECTIONS:-8} >>"$work/worker.log" 2>&1 &
    pids+=($!)
  done
  # Wait until every worker has registered and made its first claim (idle).
  for _ in $(seq 200); do
    [ "$(q -c "SELECT count(*) FROM $s.wh_service_instances")" = "$2" ] && break
    sleep 0.05
  done
  sleep 0.3
  local t0 t1
  append_all "$s"
  t0=$(now) # the commit: from here on the events are visible and the doorbell has rung
  await_drained "$s"
  t1=$(now)
  drained "$s" || { echo "bench: $s is not drained after the wait" >&2; exit 1; }
  check "$s"
  local rss=0 p
  for p in "${pids[@]}"; do
    rss=$(( rss > $(awk '/VmHWM/ {print $2}' "/proc/$p/status") ? rss : $(awk '/VmHWM/ {print $2}' "/proc/$p/status") ))
    kill -TERM "$p"
  done
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
  # Later rounds should not run in a cluster filling up with earlier rounds' tables.
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE" >/dev/null
  echo "$rss" >"$work/rss"
  awk -v n="$APPLIES" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", n / (b - a) }'
}

median() { sort -g | awk '{a[NR]=$1} END{print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

if [ "${SERVER_COST_ONLY:-0}" != 1 ]; then
echo "apply-path benchmark: PostgreSQL $(q -c 'show server_version' | cut -d' ' -f1), fsync=$(q -c 'show fsync'), $(nproc) cores; $STREAMS streams x $PER_STREAM events x 2 perspectives = $APPLIES applies; $ROUNDS rounds, median applies/s"
# "engine WORKERS STRATEGY CONSUMERS": the default 4 drain consumers per worker, and 1 per worker
# to show scale-out where one worker alone does not keep the database busy.
IFS=, read -ra engines <<<"${VARIANTS:-engine 1 Batched 4,engine 1 Instant 4,engine 3 Batched 4,engine 3 Instant 4,engine 1 Batched 1,engine 3 Batched 1}"
variants=("ceiling")
for v in "${engines[@]}"; do
  read -r word n strat consumers rest <<<"$v"
  case "$word $strat" in "engine Batched" | "engine Instant") ;; *) echo "VARIANTS: not \"engine WORKERS Batched|Instant CONSUMERS\": '$v'" >&2; exit 1;; esac
  [ -z "$rest" ] && [ "$n" -ge 1 ] 2>/dev/null && [ "$consumers" -ge 1 ] 2>/dev/null \
    || { echo "VARIANTS: not \"engine WORKERS Batched|Instant CONSUMERS\": '$v'" >&2; exit 1; }
  for b in "${build_names[@]}"; do variants+=("$v $b"); done
done
for r in $(seq "$ROUNDS"); do
  for i in "${!variants[@]}"; do
    v=${variants[$i]}
    if [ "$v" = ceiling ]; then
      run_ceiling "$r" >>"$work/v$i"
    else
      read -r _ n strat consumers build <<<"$v"
      run_engine "$r" "$n" "$strat" "$consumers" "$build" >>"$work/v$i"
      cat "$work/rss" >>"$work/rss$i"
    fi
    echo >>"$work/v$i"
  done
done
ceiling=$(median <"$work/v0")
# Besides the ratio of the medians, the median of each round's ratio to the ceiling measured
# next to it: machine drift between rounds cancels out of that one.
printf '| variant | applies/s | vs ceiling | median of per-round ratios (min–max) | worker peak RSS |\n|---|---|---|---|---|\n'
printf '| hand-written ceiling (4 connections, 1 call per group) | %.0f | 100%% | 100%% | - |\n' "$ceiling"
for i in $(seq $(( ${#variants[@]} - 1 ))); do
  v=${variants[$i]}; read -r _ n strat consumers build <<<"$v"
  m=$(median <"$work/v$i"); rss=$(sort -g "$work/rss$i" | tail -1)
  paste "$work/v$i" "$work/v0" | awk 'NF == 2 { printf "%.4f\n", $1 * 100 / $2 }' >"$work/ratio$i"
  printf '| engine%s, %s worker(s) × %s drain consumers, %s | %.0f | %.0f%% | %.0f%% (%.0f–%.0f%%) | %.1f MiB |\n' "${build:+ $build}" "$n" "$consumers" "$strat" "$m" \
    "$(awk -v m="$m" -v c="$ceiling" 'BEGIN { print m * 100 / c }')" \
    "$(median <"$work/ratio$i")" "$(sort -g "$work/ratio$i" | head -1)" "$(sort -g "$work/ratio$i" | tail -1)" \
    "$(awk -v r="$rss" 'BEGIN { print r / 1024 }')"
done
fi

# Single-connection server cost (see the header), per build in its own schema.
instance=00000000-0000-0000-0000-000000000001
for b in "${build_names[@]}"; do
  s=server_cost${b:+_$b}
  "$(worker_of "$b")" --config "$(config "$s" Batched)" migrate >/dev/null 2>>"$work/migrate.log"
  append_all "$s"
  q -c "UPDATE $s.wh_active_streams SET assigned_instance_id = '$instance'" -c "VACUUM ANALYZE"
  create_ceiling "$s"
done
timed_ms() { # statement -> ms it took, in a transaction rolled back afterwards
  q -c "VACUUM" # the previous call's rolled-back rows, so that no call pays for another's
  printf '%s\n' "BEGIN;" "SELECT clock_timestamp() AS t0 \\gset" "$1;" \
    "SELECT round(extract(epoch FROM clock_timestamp() - :'t0') * 1000);" "ROLLBACK;" | q | tail -1
}
drain_sql() { # schema p_instant -> the one wh_drain call over every stream
  echo "SELECT count(*) FROM $1.wh_drain('$instance', ARRAY(SELECT stream_id FROM $1.wh_active_streams), 100, $APPLIES, $2, false, 1000, 300000, false, NULL, 30000, 0)"
}
for r in $(seq "$ROUNDS"); do
  for b in "${build_names[@]}"; do
    s=server_cost${b:+_$b}
    timed_ms "SELECT sum($s.bench_apply_next()) FROM generate_series(1, $(( STREAMS * 2 * ((PER_STREAM + 99) / 100) )))" >>"$work/cost_ceiling$b"
    timed_ms "$(drain_sql "$s" true)" >>"$work/cost_engine$b"
    timed_ms "$(drain_sql "$s" false)" >>"$work/cost_batched$b"
  done
done
for b in "${build_names[@]}"; do
  c=$(sort -g "$work/cost_ceiling$b" | head -1); e=$(sort -g "$work/cost_engine$b" | head -1)
  bt=$(sort -g "$work/cost_batched$b" | head -1)
  printf '\nsingle-connection server cost of %d applies%s (fastest of %d, in ms): ceiling %d, engine wh_drain %d (Instant: it deletes its work rows, as the ceiling does) -> ceiling/engine %.0f%%\n' \
    "$APPLIES" "${b:+, build $b}" "$ROUNDS" "$c" "$e" "$(awk -v c="$c" -v e="$e" 'BEGIN { print c * 100 / e }')"
  printf 'the same call Batched (its rows are left to a completion flush, not timed here): %d ms -> ceiling/engine %.0f%%\n' \
    "$bt" "$(awk -v c="$c" -v e="$bt" 'BEGIN { print c * 100 / e }')"
done
