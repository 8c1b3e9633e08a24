#!/usr/bin/env bash
# Cross-stream read models: rows that many streams share (issue 24, DESIGN §12.2).
#
# 3 `perspective-worker run` processes (release build, default options) drain the same events
# into three read-model sets, one set per schema, side by side in alternating rounds:
#   per-stream   one perspective, one row per stream (an order summary)
#   +customer    the same, plus a per-customer aggregate (CUSTOMERS rows that every stream of
#                that customer updates)
#   +global      both, plus a single global counter row that every event updates
# Two ways of arriving:
#   backlog      all STREAMS x PER_STREAM events appended in one transaction, then drained
#   live         PRODUCERS pgbench connections append the same events one per transaction
#                while the workers run; timed from the first append to the last apply
# Reported per set: applies/s (applies = events x perspectives), its ratio to the per-stream
# set's applies/s in the same round (median of per-round ratios), PostgreSQL deadlocks during
# the run (pg_stat_database), dead letters, Failed cursors, work rows with attempts > 0, and
# whether every aggregate is exact. A set that does not drain within TIMEOUT seconds is
# reported as such, with the figures so far.
#
# Sequencing (DESIGN §12.2) of the shared-row perspectives: CUSTOMER_SEQ (key: by
# :data->>'customer', the default; serial; stream) and GLOBAL_SEQ (serial, the default; stream).
#
# HANDLERS (batch, the default; event; all-batch) is the form of the shared-row perspectives'
# handlers: batch handlers read the run of events as :events and write each shared row once
# per run (README, "Batch handlers"); event handlers write it once per event. The per-stream
# perspective has an event handler, except with all-batch (a batch handler grouping by stream).
#
# Axon Framework 4.13 beside it (AXON=1, the default; backlog only): tests/bench/axon/ drains
# the same backlog into the same read models in the same PostgreSQL, right after each of the
# engine's sets, in a JVM warmed up by a drain of the same size. AXON_LAYOUT: expert (the
# default: per-aggregate sequencing with 4 segments for orders, a property sequencing policy on
# the customer for customer_stats, one segment for global_stats) or recommended (Axon's default
# layout for all three). AXON_BATCH: the processors' batch size (100). AXON_PROCESSOR: pooled
# (PooledStreamingEventProcessor, the default) or tracking. Needs mvn and java;
# AXON=0 leaves Axon out.
#
#   tests/bench/crossstream.sh            (make bench builds the release worker first)
#   HANDLERS=event tests/bench/crossstream.sh   (the shared rows written once per event)
#   CUSTOMER_SEQ=stream GLOBAL_SEQ=stream tests/bench/crossstream.sh   (everything in parallel)
#   STREAMS=3000 PER_STREAM=10 CUSTOMERS=100 ROUNDS=3 MODES="backlog live" tests/bench/crossstream.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

STREAMS=${STREAMS:-3000}
PER_STREAM=${PER_STREAM:-10}
CUSTOMERS=${CUSTOMERS:-100}
ROUNDS=${ROUNDS:-2}
WORKERS=${WORKERS:-3}
PRODUCERS=${PRODUCERS:-4}
TIMEOUT=${TIMEOUT:-90}
MODES=${MODES:-backlog live}
CUSTOMER_SEQ=${CUSTOMER_SEQ:-key}
GLOBAL_SEQ=${GLOBAL_SEQ:-serial}
HANDLERS=${HANDLERS:-batch}
AXON=${AXON:-1}
AXON_LAYOUT=${AXON_LAYOUT:-expert}
AXON_BATCH=${AXON_BATCH:-100}
AXON_PROCESSOR=${AXON_PROCESSOR:-pooled}
case $AXON_PROCESSOR in pooled|tracking) ;; *) echo "AXON_PROCESSOR must be pooled or tracking, not $AXON_PROCESSOR" >&2; exit 2 ;; esac
case $AXON in 0|1) ;; *) echo "AXON must be 0 or 1, not $AXON" >&2; exit 2 ;; esac
case $AXON_LAYOUT in expert|recommended) ;; *) echo "AXON_LAYOUT must be expert or recommended, not $AXON_LAYOUT" >&2; exit 2 ;; esac
if [ "$AXON" = 1 ] && ! { command -v mvn && command -v java; } >/dev/null; then
  echo "AXON=1 runs Axon Framework beside the engine and needs mvn and java; AXON=0 leaves it out" >&2
  exit 2
fi
case $HANDLERS in batch|event|all-batch) ;; *) echo "HANDLERS must be batch, event or all-batch, not $HANDLERS" >&2; exit 2 ;; esac
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
[ -x "$WORKER" ] || { echo "build the worker first: cargo build --release -p perspective-worker" >&2; exit 1; }

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
EVENTS=$(( STREAMS * PER_STREAM ))
SETS=(per-stream +customer +global)

sequencing_yaml() { # mode
  case $1 in
    stream) ;;
    serial) echo "    sequencing: serial" ;;
    key) printf '    sequencing: key\n    sequencingKey: ":data->>'"'customer'\"\n" ;;
    *) echo "unknown sequencing $1" >&2; exit 2 ;;
  esac
}

shared_handler() { # perspective: its OrderLine handler in the form HANDLERS says
  case $1:${HANDLERS/all-batch/batch} in
    customer_stats:event) cat <<'Y'
      OrderLine: |
        INSERT INTO customer_stats AS c VALUES (:data->>'customer', 1, (:data->>'total')::numeric)
        ON CONFLICT (customer) DO UPDATE SET lines = c.lines + 1, total = c.total + excluded.total
Y
    ;;
    customer_stats:batch) cat <<'Y'
      OrderLine: |
        INSERT INTO customer_stats AS c
        SELECT data->>'customer', count(*), sum((data->>'total')::numeric) FROM :events GROUP BY 1
        ON CONFLICT (customer) DO UPDATE SET lines = c.lines + excluded.lines, total = c.total + excluded.total
Y
    ;;
    global_stats:event) cat <<'Y'
      OrderLine: |
        INSERT INTO global_stats AS g VALUES (1, 1) ON CONFLICT (id) DO UPDATE SET lines = g.lines + 1
Y
    ;;
    global_stats:batch) cat <<'Y'
      OrderLine: |
        INSERT INTO global_stats AS g SELECT 1, count(*) FROM :events
        ON CONFLICT (id) DO UPDATE SET lines = g.lines + excluded.lines
Y
    ;;
  esac
}

perspective_yaml() { # name
  case $1 in
    orders) cat <<'Y'
  - name: orders
    setup: CREATE TABLE IF NOT EXISTS orders (order_id uuid PRIMARY KEY, customer text NOT NULL, lines bigint NOT NULL, total numeric NOT NULL)
    handlers:
Y
      if [ "$HANDLERS" = all-batch ]; then cat <<'Y'
      OrderLine: |
        INSERT INTO orders AS o
        SELECT stream_id, min(data->>'customer'), count(*), sum((data->>'total')::numeric) FROM :events GROUP BY 1
        ON CONFLICT (order_id) DO UPDATE SET lines = o.lines + excluded.lines, total = o.total + excluded.total
Y
      else cat <<'Y'
      OrderLine: |
        INSERT INTO orders AS o VALUES (:stream_id, :data->>'customer', 1, (:data->>'total')::numeric)
        ON CONFLICT (order_id) DO UPDATE SET lines = o.lines + 1, total = o.total + excluded.total
Y
      fi
    ;;
    customer_stats) cat <<Y
  - name: customer_stats
$(sequencing_yaml "$CUSTOMER_SEQ")
    setup: CREATE TABLE IF NOT EXISTS customer_stats (customer text PRIMARY KEY, lines bigint NOT NULL, total numeric NOT NULL)
    handlers:
$(shared_handler customer_stats)
Y
    ;;
    global_stats) cat <<Y
  - name: global_stats
$(sequencing_yaml "$GLOBAL_SEQ")
    setup: CREATE TABLE IF NOT EXISTS global_stats (id int PRIMARY KEY, lines bigint NOT NULL)
    handlers:
$(shared_handler global_stats)
Y
    ;;
  esac
}

perspectives_of() { # set index -> perspective names
  case $1 in 0) echo orders ;; 1) echo orders customer_stats ;; 2) echo orders customer_stats global_stats ;; esac
}

config() { # schema set -> file
  { echo "schema: $1"; echo "perspectives:"
    for p in $(perspectives_of "$2"); do perspective_yaml "$p"; done
  } >"$work/$1.yaml"
  echo "$work/$1.yaml"
}

# Event i of stream s: customer s % CUSTOMERS, total i.
events_sql() { # schema
  echo "INSERT INTO $1.wh_event_store (stream_id, event_type, event_data)
        SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, 'OrderLine',
               jsonb_build_object('customer', 'c' || (s % $CUSTOMERS), 'total', v)
        FROM generate_series(1, $PER_STREAM) v, generate_series(1, $STREAMS) s ORDER BY s, v"
}

deadlocks() { q -c "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"; }

# Polls server-side until no work row is left and every cursor reached its head, or TIMEOUT.
await_drained() { # schema -> 0 drained, 1 timed out
  q -c "SET statement_timeout = '$(( TIMEOUT + 5 ))s'" -c "DO \$\$ DECLARE t0 timestamptz := clock_timestamp(); BEGIN
    LOOP
      EXIT WHEN NOT EXISTS (SELECT 1 FROM $1.wh_perspective_events WHERE processed_at IS NULL)
        AND NOT EXISTS (SELECT 1 FROM $1.wh_perspective_cursors c JOIN $1.wh_streams s USING (stream_id)
                        WHERE c.last_version < s.version AND c.status & 4 = 0);
      IF clock_timestamp() - t0 > interval '$TIMEOUT seconds' THEN RAISE EXCEPTION 'timeout'; END IF;
      COMMIT; PERFORM pg_sleep(0.01); COMMIT; -- no snapshot held while waiting
    END LOOP;
  END \$\$" >/dev/null 2>&1
}

# "exact" when every model row matches what the store holds, else what differs.
exactness() { # schema set
  local s=$1 bad
  bad=$(q -c "SELECT count(*) FROM (SELECT stream_id, count(*) n, sum((event_data->>'total')::numeric) t
                FROM $s.wh_event_store GROUP BY 1) e FULL JOIN $s.orders o ON o.order_id = e.stream_id
              WHERE o.lines IS DISTINCT FROM e.n OR o.total IS DISTINCT FROM e.t")
  [ "$bad" = 0 ] || { echo "orders: $bad rows wrong"; return; }
  if [ "$2" -ge 1 ]; then
    bad=$(q -c "SELECT count(*) FROM (SELECT event_data->>'customer' c, count(*) n, sum((event_data->>'total')::numeric) t
                  FROM $s.wh_event_store GROUP BY 1) e FULL JOIN $s.customer_stats x ON x.customer = e.c
                WHERE x.lines IS DISTINCT FROM e.n OR x.total IS DISTINCT FROM e.t")
    [ "$bad" = 0 ] || { echo "customer_stats: $bad rows wrong"; return; }
  fi
  if [ "$2" -ge 2 ]; then
    bad=$(q -c "SELECT coalesce((SELECT lines FROM $s.global_stats WHERE id = 1), 0) <> (SELECT count(*) FROM $s.wh_event_store)")
    [ "$bad" = f ] || { echo "global_stats wrong"; return; }
  fi
  echo exact
}

start_workers() { # config
  pids=()
  for _ in $(seq "$WORKERS"); do
    RUST_LOG=warn "$WORKER" --config "$1" run --http-addr 127.0.0.1:0 >>"$work/worker.log" 2>&1 &
    pids+=($!)
  done
}

stop_workers() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
}

run_set() { # mode round set -> "applies/s deadlocks dead_letters failed attempted exactness drained"
  local mode=$1 s="x_$1_$2_$3" set=$3 cfg t0 t1 d0 d1 ok=drained n
  cfg=$(config "$s" "$set")
  "$WORKER" --config "$cfg" migrate >/dev/null 2>>"$work/migrate.log"
  n=$(perspectives_of "$set" | wc -w)
  start_workers "$cfg"
  for _ in $(seq 200); do
    [ "$(q -c "SELECT count(*) FROM $s.wh_service_instances")" = "$WORKERS" ] && break
    sleep 0.05
  done
  d0=$(deadlocks)
  if [ "$mode" = backlog ]; then
    q -c "$(events_sql "$s")"
    t0=$(now)
  else
    # One event per transaction, PRODUCERS connections, streams dealt round-robin.
    cat >"$work/live.sql" <<SQL
\set s random(1, $STREAMS)
INSERT INTO $s.wh_event_store (stream_id, event_type, event_data)
VALUES (('00000000-0000-7000-8000-' || lpad(to_hex(:s), 12, '0'))::uuid, 'OrderLine',
        jsonb_build_object('customer', 'c' || (:s % $CUSTOMERS), 'total', 1));
SQL
    t0=$(now)
    pgbench "$DATABASE_URL" -n -f "$work/live.sql" -c "$PRODUCERS" -j 2 -t $(( EVENTS / PRODUCERS )) >/dev/null 2>&1
  fi
  await_drained "$s" || ok=timeout
  t1=$(now)
  d1=$(deadlocks)
  stop_workers
  local events dl failed attempted exact
  events=$(q -c "SELECT count(*) FROM $s.wh_event_store")
  dl=$(q -c "SELECT count(*) FROM $s.wh_dead_letters")
  failed=$(q -c "SELECT count(*) FROM $s.wh_perspective_cursors WHERE status & 4 <> 0")
  attempted=$(q -c "SELECT count(*) FROM $s.wh_perspective_events WHERE attempts > 0")
  exact=$(exactness "$s" "$set" | tr ' ' '_')
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE" >/dev/null
  awk -v e="$events" -v n="$n" -v a="$t0" -v b="$t1" -v d=$(( d1 - d0 )) -v dl="$dl" -v f="$failed" \
      -v at="$attempted" -v x="$exact" -v ok="$ok" \
    'BEGIN { printf "%.0f %d %d %d %d %s %s\n", e * n / (b - a), d, dl, f, at, (x == "exact" ? "exact" : "WRONG:" x), ok }' | tr -s ' ' ' '
}

# Axon's harness, compiled outside the repository; prints its classpath.
axon_build() {
  local out=$HOME/.cache/perspective-operator/axon-bench
  mkdir -p "$out"
  mvn -q -B -f tests/bench/axon/pom.xml compile dependency:build-classpath \
      -Dmdep.outputFile="$out/classpath.txt" >"$work/mvn.log" 2>&1 \
    || { echo "could not build tests/bench/axon:" >&2; cat "$work/mvn.log" >&2; exit 1; }
  echo "$(cat "$out/classpath.txt"):$out/classes"
}

# DATABASE_URL (postgres://user[:password]@host:port/db) as a JDBC URL.
jdbc_url() {
  local u=${DATABASE_URL#*://} creds user pass
  creds=${u%%@*}; user=${creds%%:*}; pass=
  [ "$creds" != "$user" ] && pass="&password=${creds#*:}"
  echo "jdbc:postgresql://${u#*@}?user=$user$pass"
}

run_axon() { # mode round set -> "applies/s deadlocks handler_failures exactness drained"
  local s="axon_$1_$2_$3"
  JDBC_URL=$(jdbc_url) AXON_SCHEMA=$s SET=$3 LAYOUT=$AXON_LAYOUT BATCH=$AXON_BATCH PROCESSOR=$AXON_PROCESSOR STREAMS=$STREAMS \
    PER_STREAM=$PER_STREAM CUSTOMERS=$CUSTOMERS TIMEOUT=$TIMEOUT \
    java -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "$axon_cp" bench.AxonCrossStream 2>>"$work/axon.log" \
    || { echo "Axon's run failed:" >&2; tail -20 "$work/axon.log" >&2; exit 1; }
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE" -c "DROP SCHEMA IF EXISTS ${s}_warmup CASCADE" >/dev/null
}

median() { sort -g | awk '{a[NR]=$1} END{print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

axon_cp=
if [ "$AXON" = 1 ]; then axon_cp=$(axon_build); fi

echo "cross-stream benchmark: PostgreSQL $(q -c 'show server_version' | cut -d' ' -f1), fsync=$(q -c 'show fsync'), $(nproc) cores; $WORKERS workers (default options), $STREAMS streams x $PER_STREAM events over $CUSTOMERS customers; shared rows: customer $CUSTOMER_SEQ, global $GLOBAL_SEQ, $HANDLERS handlers; $ROUNDS rounds, medians"
for mode in $MODES; do
  for r in $(seq "$ROUNDS"); do
    for i in "${!SETS[@]}"; do
      run_set "$mode" "$r" "$i" >>"$work/$mode.$i"
      if [ "$AXON" = 1 ] && [ "$mode" = backlog ]; then
        run_axon "$mode" "$r" "$i" >>"$work/$mode.axon$i"
        paste -d' ' <(tail -1 "$work/$mode.$i") <(tail -1 "$work/$mode.axon$i") \
          | awk '{ printf "%.4f\n", $1 * 100 / $8 }' >>"$work/$mode.vsaxon$i"
      fi
    done
    # This round's ratios against its own per-stream run.
    base=$(tail -1 "$work/$mode.0" | cut -d' ' -f1)
    for i in "${!SETS[@]}"; do
      awk -v b="$base" '{ v = $1 } END { printf "%.4f\n", v * 100 / b }' "$work/$mode.$i" >>"$work/$mode.ratio$i"
    done
  done
  printf '\n%s:\n\n| read models | applies/s | vs per-stream (median of rounds; min–max) | deadlocks | dead letters | Failed cursors | rows with attempts | models | drained |\n|---|---|---|---|---|---|---|---|---|\n' "$mode"
  for i in "${!SETS[@]}"; do
    f="$work/$mode.$i"
    printf '| %s | %.0f | %.0f%% (%.0f–%.0f%%) | %s | %s | %s | %s | %s | %s |\n' "${SETS[$i]}" \
      "$(cut -d' ' -f1 "$f" | median)" "$(median <"$work/$mode.ratio$i")" \
      "$(sort -g "$work/$mode.ratio$i" | head -1)" "$(sort -g "$work/$mode.ratio$i" | tail -1)" \
      "$(cut -d' ' -f2 "$f" | paste -sd/)" "$(cut -d' ' -f3 "$f" | paste -sd/)" \
      "$(cut -d' ' -f4 "$f" | paste -sd/)" "$(cut -d' ' -f5 "$f" | paste -sd/)" \
      "$(cut -d' ' -f6 "$f" | sort -u | paste -sd,)" "$(cut -d' ' -f7 "$f" | sort -u | paste -sd,)"
  done
  if [ -s "$work/$mode.axon0" ]; then
    printf '\nAxon Framework 4.13 beside it (%s layout, %s processors, batch size %s), each right after the same set:\n\n| read models | Axon applies/s | engine vs Axon (median of rounds; min–max) | deadlocks | handler failures | models | drained |\n|---|---|---|---|---|---|---|\n' "$AXON_LAYOUT" "$AXON_PROCESSOR" "$AXON_BATCH"
    for i in "${!SETS[@]}"; do
      f="$work/$mode.axon$i"
      printf '| %s | %.0f | %.0f%% (%.0f–%.0f%%) | %s | %s | %s | %s |\n' "${SETS[$i]}" \
        "$(cut -d' ' -f1 "$f" | median)" "$(median <"$work/$mode.vsaxon$i")" \
        "$(sort -g "$work/$mode.vsaxon$i" | head -1)" "$(sort -g "$work/$mode.vsaxon$i" | tail -1)" \
        "$(cut -d' ' -f2 "$f" | paste -sd/)" "$(cut -d' ' -f3 "$f" | paste -sd/)" \
        "$(cut -d' ' -f4 "$f" | sort -u | paste -sd,)" "$(cut -d' ' -f5 "$f" | sort -u | paste -sd,)"
    done
  fi
done
