#!/usr/bin/env bash
# Scale benchmark (`make bench-scale`): how the cost grows with history, breadth, fan-out, a hot
# stream and churn. Every figure compares a scaled case with a small base case measured in the
# same run, on the same throwaway cluster (default settings apart from those of tests/pg/pg.sh:
# fsync off, 256 MB shared_buffers; autovacuum as shipped).
#
#   breadth  WIDE streams × 1 event vs WIDE/DEEP_PER streams × DEEP_PER events (same total), one
#            worker each, started fresh, ROUNDS alternating rounds: applies/s (medians),
#            claim_work p50/p99 (the worker's histogram, claims made during the drains, all
#            rounds), worker peak RSS; and a hand-written ceiling of each shape (see
#            ceiling_breadth), to tell the engine's cost from the tables'.
#   fan-out  2, 10 and 30 counter perspectives on one event type, FANOUT_STREAMS × 100 events:
#            append cost per event (one bulk INSERT, timed) and total applies/s.
#   hot      HOT_OTHERS streams × 100 events, alone and beside one stream holding as many events
#            as all the others together: the others' applies/s, and the hot stream's.
#   churn    CHURN_EVENTS events flow through one worker: a producer appends CHURN_BATCH events
#            per transaction (CHURN_DEPTH per stream, round robin over CHURN_STREAMS streams)
#            while no more than CHURN_BACKLOG applies are pending; sizes of the work table and of
#            wh_active_streams sampled every 0.5 s; applies/s of the first and last 10%.
#   history  the churned schema (CHURN_EVENTS applied events) against an empty one, same live
#            workload, alternating: applies/s (400 new streams × 100 events, appended in one
#            transaction, timed until applied and completed) and appends/s (pgbench, APPENDERS
#            connections, one event per transaction, APPEND_SECONDS, no worker running).
#
# Every case checks that each counter ends at exactly its stream's event count. The result table
# (figure, goal, met) is printed and, unless RECORD=0, appended to docs/benchmarks-history.md
# (the dated runs; BENCHMARKS.md holds the current figures, updated by hand) with the command,
# date and commit.
#
#   make bench-scale                      (builds the release worker first)
#   QUICK=1 RECORD=0 tests/bench/scale.sh (every case at a small size: checks the script, ~2 min)
#   CASES="breadth hot" tests/bench/scale.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "${QUICK:-0}" = 1 ]; then
  : "${WIDE:=5000}" "${DEEP_PER:=50}" "${FANOUT_STREAMS:=20}" "${HOT_OTHERS:=50}" \
    "${CHURN_EVENTS:=200000}" "${CHURN_STREAMS:=2000}" "${APPEND_SECONDS:=2}"
fi
WIDE=${WIDE:-100000}
DEEP_PER=${DEEP_PER:-100}
FANOUT=${FANOUT:-2 10 30}
FANOUT_STREAMS=${FANOUT_STREAMS:-200}
HOT_OTHERS=${HOT_OTHERS:-500}
CHURN_EVENTS=${CHURN_EVENTS:-5000000}
CHURN_STREAMS=${CHURN_STREAMS:-10000}
CHURN_DEPTH=${CHURN_DEPTH:-20}
CHURN_BATCH=${CHURN_BATCH:-1000}
CHURN_BACKLOG=${CHURN_BACKLOG:-100000}
ROUNDS=${ROUNDS:-3}
APPENDERS=${APPENDERS:-4}
APPEND_SECONDS=${APPEND_SECONDS:-5}
CEIL_APPLIES=${CEIL_APPLIES:-1000}
CASES=${CASES:-breadth fanout hot churn history}
RECORD=${RECORD:-1}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
[ -x "$WORKER" ] || { echo "build the worker first: cargo build --release -p perspective-worker" >&2; exit 1; }
case " $CASES " in *" history "*) case " $CASES " in *" churn "*) ;; *)
  echo "bench-scale: the history case measures the schema the churn case filled; add churn to CASES" >&2; exit 2;;
esac;; esac

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
trap 'echo "bench-scale: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
set -E
q() { psql "$DATABASE_URL" -XAtq -v ON_ERROR_STOP=1 "$@"; }
started=$(date +%s)
log() { printf '[%4ds] %s\n' $(( $(date +%s) - started )) "$*" >&2; }
pct() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", a * 100 / b }'; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }
results=$work/results
# result FIGURE VALUE GOAL MET
result() { printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" >>"$results"; log "$1: $2 ($3: $4)"; }
verdict() { if ge "$1" "$2"; then echo met; else echo "**missed**"; fi; }

config() { # schema perspectives -> file: N counter perspectives, all on event type A
  local f=$work/$1.yaml i
  { echo "schema: $1"; echo "perspectives:"
    for i in $(seq "$2"); do cat <<EOF
  - name: c$i
    setup: CREATE TABLE IF NOT EXISTS c$i (stream_id uuid PRIMARY KEY, n bigint NOT NULL, last bigint NOT NULL)
    handlers:
      A: INSERT INTO c$i AS c VALUES (:stream_id, 1, :stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last
EOF
    done; } >"$f"
  echo "$f"
}

migrate() { # schema perspectives
  "$WORKER" --config "$(config "$1" "$2")" migrate >/dev/null 2>>"$work/migrate.log"
}

# Starts one worker on the schema; sets WPID and WPORT (its metrics endpoint). Returns once it has
# registered.
start_worker() { # schema
  local logf=$work/worker-$1.log
  RUST_LOG=warn,perspective_worker::engine::http=info "$WORKER" --config "$work/$1.yaml" run --http-addr 127.0.0.1:0 >"$logf" 2>&1 &
  WPID=$!
  pids+=("$WPID")
  WPORT=
  for _ in $(seq 400); do
    WPORT=$(grep -o 'http://127.0.0.1:[0-9]*' "$logf" | head -1 | sed 's/.*://' || true)
    [ -n "$WPORT" ] && [ "$(q -c "SELECT count(*) FROM $1.wh_service_instances")" -ge 1 ] && break
    sleep 0.05
  done
  [ -n "$WPORT" ] || { echo "bench-scale: the worker on $1 did not start:" >&2; cat "$logf" >&2; exit 1; }
  sleep 0.3 # its first, empty claim
}

stop_worker() { # pid -> prints its peak RSS in KiB
  local rss
  rss=$(awk '/VmHWM/ {print $2}' "/proc/$1/status")
  kill -TERM "$1"
  wait "$1" 2>/dev/null || true
  echo "$rss"
}

claim_buckets() { # port -> "le cumulative-count" lines of perspective_claim_duration_seconds
  curl -sf "http://127.0.0.1:$1/metrics" | awk -F'[{}" ]+' '/^perspective_claim_duration_seconds_bucket/ {
    for (i = 1; i <= NF; i++) if ($i == "le=") le = $(i + 1); print le, $NF }' | sed 's/+Inf/inf/'
}

# quantile Q of the claims between two snapshots, in ms, interpolated within its bucket (as
# Prometheus' histogram_quantile does); prints "value count"
claim_quantile() { # before after q
  join <(sort "$1") <(sort "$2") | sort -g | awk -v q="$3" '
    { le[NR] = $1; c[NR] = $3 - $2 } END {
      total = c[NR]; if (total == 0) { print "0 0"; exit }
      rank = q * total; prev_le = 0; prev_c = 0
      for (i = 1; i <= NR; i++) {
        if (c[i] >= rank) {
          if (le[i] == "inf") { printf "%.1f %d\n", prev_le * 1000, total; exit }
          printf "%.1f %d\n", (prev_le + (le[i] - prev_le) * (rank - prev_c) / (c[i] - prev_c)) * 1000, total; exit
        }
        prev_le = le[i]; prev_c = c[i]
      } }'
}

# The waits run server-side in one session and sleep 10× as long as each check took, so they
# cost the machine at most a few percent whatever the size of the tables. Every session that
# waits commits before and after each sleep: one holding a snapshot would stop PostgreSQL from
# pruning and vacuuming dead row versions for as long as it waits.
q -c "SET client_min_messages = warning" -c "CREATE SCHEMA IF NOT EXISTS bench" >/dev/null
q <<'EOF'
SET client_min_messages = warning;
-- Epoch seconds at which the schema's cursors reached p_expect applies in total (optionally: the
-- streams other than p_hot, and p_hot alone), then waited until no work row is left unprocessed.
-- A procedure that commits after every check and every sleep: a statement that waited in one
-- snapshot would hold back the xmin horizon, so that no dead row version (a counter updated
-- many times, a deleted work row) could be pruned or vacuumed while the engine is measured.
CREATE OR REPLACE PROCEDURE bench.await_applied(p_schema text, p_expect bigint, p_hot uuid DEFAULT NULL,
    p_hot_expect bigint DEFAULT 0, p_timeout interval DEFAULT '20 min',
    INOUT others_at double precision DEFAULT NULL, INOUT hot_at double precision DEFAULT NULL,
    INOUT completed_at double precision DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
  v_deadline timestamptz := clock_timestamp() + p_timeout;
  v_t0 timestamptz;
  v_took double precision;
  v_sum bigint;
  v_hot bigint;
  v_more boolean;
BEGIN
  LOOP
    v_t0 := clock_timestamp();
    EXECUTE format('SELECT coalesce(sum(last_version) FILTER (WHERE stream_id IS DISTINCT FROM $1), 0),
                           coalesce(sum(last_version) FILTER (WHERE stream_id = $1), 0)
                    FROM %I.wh_perspective_cursors', p_schema) INTO v_sum, v_hot USING p_hot;
    IF others_at IS NULL AND v_sum >= p_expect THEN others_at := extract(epoch FROM clock_timestamp()); END IF;
    IF hot_at IS NULL AND v_hot >= p_hot_expect THEN hot_at := extract(epoch FROM clock_timestamp()); END IF;
    EXIT WHEN others_at IS NOT NULL AND hot_at IS NOT NULL;
    IF clock_timestamp() > v_deadline THEN
      RAISE EXCEPTION 'bench: %: % of % applies after %', p_schema, v_sum + v_hot, p_expect + p_hot_expect, p_timeout;
    END IF;
    v_took := extract(epoch FROM clock_timestamp() - v_t0);
    COMMIT;
    PERFORM pg_sleep(greatest(0.005, 10 * v_took));
    COMMIT;
  END LOOP;
  LOOP
    v_t0 := clock_timestamp();
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I.wh_perspective_events WHERE processed_at IS NULL)', p_schema) INTO v_more;
    EXIT WHEN NOT v_more;
    IF clock_timestamp() > v_deadline THEN
      RAISE EXCEPTION 'bench: %: work rows left unprocessed after %', p_schema, p_timeout;
    END IF;
    v_took := extract(epoch FROM clock_timestamp() - v_t0);
    COMMIT;
    PERFORM pg_sleep(greatest(0.005, 10 * v_took));
    COMMIT;
  END LOOP;
  completed_at := extract(epoch FROM clock_timestamp());
END
$$;
-- Every counter of the schema's perspectives equals its stream's event count.
CREATE OR REPLACE FUNCTION bench.check(p_schema text, p_perspectives integer) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE v_bad bigint := 0; v bigint; i integer;
BEGIN
  FOR i IN 1 .. p_perspectives LOOP
    EXECUTE format('SELECT count(*) FROM %I.wh_streams s FULL JOIN %I.c%s c USING (stream_id)
                    WHERE c.n IS DISTINCT FROM s.version', p_schema, p_schema, i) INTO v;
    v_bad := v_bad + v;
  END LOOP;
  RETURN v_bad;
END
$$;
CREATE TABLE IF NOT EXISTS bench.samples (t double precision, applied bigint, work_bytes bigint, active_bytes bigint,
  appended bigint, updated_bytes bigint, store_bytes bigint);
CREATE TABLE IF NOT EXISTS bench.flags (name text PRIMARY KEY);
EOF

check() { # schema perspectives
  local bad; bad=$(q -c "SELECT bench.check('$1', $2)")
  [ "$bad" = 0 ] || { echo "bench-scale: $1 applied some events more or less than once ($bad counters wrong)" >&2; exit 1; }
}

# Appends STREAMS × PER events of type A in one transaction, to stream ids PREFIX-<n> for n in
# FIRST .. FIRST+STREAMS-1; prints "start commit" (epoch seconds, server clock).
append_block() { # schema prefix first streams per
  q -c "SELECT extract(epoch FROM clock_timestamp())" \
    -c "INSERT INTO $1.wh_event_store (stream_id, event_type, metadata)
        SELECT ('$2-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, 'A', '{\"user_id\": \"bench\"}'
        FROM generate_series($3, $3 + $4 - 1) s, generate_series(1, $5) v ORDER BY s, v" \
    -c "SELECT extract(epoch FROM clock_timestamp())" | tr '\n' ' '; echo
}

rate() { awk -v n="$1" -v a="$2" -v b="$3" 'BEGIN { printf "%.0f", n / (b - a) }'; }

# --- breadth ----------------------------------------------------------------------------------
# The hand-written ceiling of one shape, on a schema whose events are appended and no worker runs:
# 4 pgbench connections each call `bench_drain_current` (tests/bench/breadth-ceilings.sql, where
# the other variants of tests/bench/breadth-tables.sh live too), which claims, applies, completes
# and retires the oldest active streams worth CEIL_APPLIES applies in one transaction: the work
# per stream and per event any engine on these tables has to do, without the engine. Prints
# applies/s.
ceiling_breadth() { # schema streams per
  local s=$1 k=$(( CEIL_APPLIES / ($3 * 2) )) calls t0 t1
  [ "$k" -ge 1 ] || k=1
  calls=$(( ($2 + k - 1) / k ))
  sed "s/@schema@/$s/g" tests/bench/breadth-ceilings.sql | q
  echo "SELECT $s.bench_drain_current($k);" >"$work/ceiling.sql"
  t0=$(q -c "SELECT extract(epoch FROM clock_timestamp())")
  # Calls that find nothing left return at once; a few spare ones per connection absorb the
  # streams skipped while locked by another connection near the end.
  pgbench "$DATABASE_URL" -n -f "$work/ceiling.sql" -c 4 -j 2 -t $(( calls / 4 + 4 )) >"$work/pgbench.log" 2>&1 ||
    { cat "$work/pgbench.log" >&2; exit 1; }
  t1=$(q -c "SELECT extract(epoch FROM clock_timestamp())")
  [ "$(q -c "SELECT (SELECT count(*) FROM $s.wh_perspective_events) + (SELECT count(*) FROM $s.wh_active_streams)")" = 0 ] ||
    { echo "bench-scale: the breadth ceiling left work behind on $s" >&2; exit 1; }
  rate $(( $2 * $3 * 2 )) "$t0" "$t1"
}

case_breadth() {
  local deep_streams=$(( WIDE / DEEP_PER )) applies=$(( WIDE * 2 ))
  log "breadth: $WIDE streams × 1 event vs $deep_streams streams × $DEEP_PER events, 2 perspectives ($applies applies each), $ROUNDS rounds"
  local r shape s streams per t0 t1 done rate_ rss p50 p99 n
  for r in $(seq "$ROUNDS"); do
    for shape in deep wide; do
      s=br_${shape}_$r
      if [ $shape = deep ]; then streams=$deep_streams per=$DEEP_PER; else streams=$WIDE per=1; fi
      migrate $s 2
      start_worker $s
      claim_buckets "$WPORT" >"$work/claims-$s-0"
      read -r t0 t1 < <(append_block $s b0000000 1 "$streams" "$per")
      read -r _ _ done < <(q -F' ' -c "CALL bench.await_applied('$s', $applies)")
      claim_buckets "$WPORT" >"$work/claims-$s-1"
      rss=$(stop_worker "$WPID")
      check $s 2
      rate_=$(rate "$applies" "$t1" "$done")
      echo "$rate_" >>"$work/breadth-$shape"
      echo "$rss" >>"$work/breadth-$shape-rss"
      # The claims of every round, as one histogram: per-bucket counts added up.
      join <(sort "$work/claims-$s-0") <(sort "$work/claims-$s-1") | awk '{ print $1, $3 - $2 }' >>"$work/claims-$shape"
      read -r p50 n < <(claim_quantile "$work/claims-$s-0" "$work/claims-$s-1" 0.5)
      read -r p99 _ < <(claim_quantile "$work/claims-$s-0" "$work/claims-$s-1" 0.99)
      log "breadth $shape (round $r): $rate_ applies/s, $n claims, claim_work p50 $p50 ms p99 $p99 ms, RSS $(( rss / 1024 )) MiB"
      q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE"
      s=br_ceil_${shape}_$r
      migrate $s 2
      append_block $s b0000000 1 "$streams" "$per" >/dev/null
      rate_=$(ceiling_breadth $s "$streams" "$per")
      check $s 2
      echo "$rate_" >>"$work/breadth-ceil-$shape"
      log "breadth $shape (round $r), hand-written ceiling: $rate_ applies/s"
      q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE"
    done
  done
  local deep wide cdeep cwide
  deep=$(median <"$work/breadth-deep"); wide=$(median <"$work/breadth-wide")
  cdeep=$(median <"$work/breadth-ceil-deep"); cwide=$(median <"$work/breadth-ceil-wide")
  result "breadth: applies/s, $WIDE streams × 1 vs $deep_streams × $DEEP_PER (medians of $ROUNDS rounds)" "$wide vs $deep = $(pct "$wide" "$deep")% (rounds: $(paste -d/ "$work/breadth-wide" "$work/breadth-deep" | awk -F/ '{ printf "%s%.0f%%", (NR > 1 ? ", " : ""), $1 * 100 / $2 }'))" "≥ 50%" "$(verdict "$(pct "$wide" "$deep")" 50)"
  result "breadth: hand-written ceiling ($CEIL_APPLIES applies per call, 4 connections), applies/s, wide vs deep" "$cwide vs $cdeep = $(pct "$cwide" "$cdeep")% (rounds: $(paste -d/ "$work/breadth-ceil-wide" "$work/breadth-ceil-deep" | awk -F/ '{ printf "%s%.0f%%", (NR > 1 ? ", " : ""), $1 * 100 / $2 }'))" "(reported)" "-"
  result "breadth: engine vs the ceiling, wide; deep" "$(pct "$wide" "$cwide")%; $(pct "$deep" "$cdeep")%" "(reported)" "-"
  for shape in wide deep; do
    # Summed per-bucket counts against an all-zero "before".
    awk '{ c[$1] += $2 } END { for (le in c) print le, c[le] }' "$work/claims-$shape" >"$work/claims-$shape-sum"
    awk '{ print $1, 0 }' "$work/claims-$shape-sum" >"$work/claims-$shape-zero"
    read -r p50 n < <(claim_quantile "$work/claims-$shape-zero" "$work/claims-$shape-sum" 0.5)
    read -r p99 _ < <(claim_quantile "$work/claims-$shape-zero" "$work/claims-$shape-sum" 0.99)
    if [ $shape = wide ]; then
      result "breadth: claim_work p50 / p99, $WIDE streams × 1 ($n claims)" "$p50 / $p99 ms" "p99 ≤ 20 ms" "$(verdict 20 "$p99")"
    else
      result "breadth: claim_work p50 / p99, $deep_streams streams × $DEEP_PER ($n claims)" "$p50 / $p99 ms" "p99 ≤ 20 ms" "$(verdict 20 "$p99")"
    fi
  done
  rss=$(sort -n "$work/breadth-wide-rss" | tail -1)
  result "breadth: worker peak RSS, $WIDE streams × 1 (highest of $ROUNDS rounds)" "$(( rss / 1024 )) MiB" "≤ 64 MiB" "$(verdict 65536 "$rss")"
}

# --- fan-out ----------------------------------------------------------------------------------
case_fanout() {
  local events=$(( FANOUT_STREAMS * 100 )) k r s t0 t1 done
  log "fan-out: perspectives $FANOUT on one event type, $FANOUT_STREAMS streams × 100 events, $ROUNDS rounds"
  for r in $(seq "$ROUNDS"); do
    for k in $FANOUT; do
      s=fo_${k}_$r
      migrate $s "$k"
      start_worker $s
      read -r t0 t1 < <(append_block $s f0000000 1 "$FANOUT_STREAMS" 100)
      read -r _ _ done < <(q -F' ' -c "CALL bench.await_applied('$s', $(( events * k )))")
      stop_worker "$WPID" >/dev/null
      check $s "$k"
      rate $(( events * k )) "$t1" "$done" >>"$work/fo-rate-$k"; echo >>"$work/fo-rate-$k"
      awk -v a="$t0" -v b="$t1" -v n="$events" 'BEGIN { printf "%.1f\n", (b - a) * 1e6 / n }' >>"$work/fo-append-$k"
      q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE"
      log "fan-out $k (round $r): $(tail -1 "$work/fo-rate-$k") applies/s, append $(tail -1 "$work/fo-append-$k") µs/event"
    done
  done
  local base; base=$(median <"$work/fo-rate-${FANOUT%% *}")
  for k in $FANOUT; do
    local m a; m=$(median <"$work/fo-rate-$k"); a=$(median <"$work/fo-append-$k")
    if [ "$k" = "${FANOUT%% *}" ]; then
      result "fan-out: $k perspectives, applies/s; append cost" "$m; $a µs/event" "(base)" "-"
    else
      local goal=-; [ "$k" = "${FANOUT##* }" ] && goal="≥ 80%"
      result "fan-out: $k perspectives, applies/s vs $base with ${FANOUT%% *}; append cost" "$m = $(pct "$m" "$base")%; $a µs/event" "$goal" \
        "$([ "$goal" = - ] && echo - || verdict "$(pct "$m" "$base")" 80)"
    fi
  done
}

median() { sort -g | awk 'NF {a[++n]=$1} END{print (n%2 ? a[(n+1)/2] : (a[n/2]+a[n/2+1])/2)}'; }

# --- hot stream -------------------------------------------------------------------------------
case_hot() {
  local others=$(( HOT_OTHERS * 100 )) hot=c0ffee00-0000-7000-8000-000000000000 r s t0 t1 oat hat
  log "hot stream: $HOT_OTHERS streams × 100 events, alone and beside one stream of $others events, $ROUNDS rounds"
  for r in $(seq "$ROUNDS"); do
    for s in hot_base_$r hot_mix_$r; do
      migrate $s 2
      start_worker $s
      if [ "${s#hot_mix}" != "$s" ]; then
        read -r t0 t1 < <(q -c "SELECT extract(epoch FROM clock_timestamp())" \
          -c "INSERT INTO $s.wh_event_store (stream_id, event_type, metadata)
              SELECT stream_id, 'A', '{}' FROM (
                SELECT ('a0000000-0000-7000-8000-' || lpad(to_hex(x), 12, '0'))::uuid AS stream_id, x, v
                FROM generate_series(1, $HOT_OTHERS) x, generate_series(1, 100) v
                UNION ALL
                SELECT '$hot'::uuid, 0, v FROM generate_series(1, $others) v) e
              ORDER BY v, x" \
          -c "SELECT extract(epoch FROM clock_timestamp())" | tr '\n' ' '; echo)
        read -r oat hat _ < <(q -F' ' -c "CALL bench.await_applied('$s', $(( others * 2 )), '$hot', $(( others * 2 )))")
        rate $(( others * 2 )) "$t1" "$hat" >>"$work/hot-hot"; echo >>"$work/hot-hot"
        rate $(( others * 2 )) "$t1" "$oat" >>"$work/hot-mix"; echo >>"$work/hot-mix"
      else
        read -r t0 t1 < <(append_block $s a0000000 1 "$HOT_OTHERS" 100)
        read -r oat _ _ < <(q -F' ' -c "CALL bench.await_applied('$s', $(( others * 2 )))")
        rate $(( others * 2 )) "$t1" "$oat" >>"$work/hot-base"; echo >>"$work/hot-base"
      fi
      stop_worker "$WPID" >/dev/null
      check $s 2
      q -c "SET client_min_messages = warning" -c "DROP SCHEMA $s CASCADE"
    done
    log "hot (round $r): others alone $(tail -1 "$work/hot-base"), beside the hot stream $(tail -1 "$work/hot-mix"); hot stream $(tail -1 "$work/hot-hot") applies/s"
  done
  local base mix hotr
  base=$(median <"$work/hot-base"); mix=$(median <"$work/hot-mix"); hotr=$(median <"$work/hot-hot")
  result "hot stream: the other streams' applies/s beside it vs alone" "$mix vs $base = $(pct "$mix" "$base")%" "≥ 70%" "$(verdict "$(pct "$mix" "$base")" 70)"
  result "hot stream: its own applies/s ($others events, 2 perspectives)" "$hotr" "(reported)" "-"
}

# --- churn ------------------------------------------------------------------------------------
case_churn() {
  local s=churn applies=$(( CHURN_EVENTS * 2 )) per_batch=$(( CHURN_BATCH / CHURN_DEPTH ))
  log "churn: $CHURN_EVENTS events through one worker ($CHURN_BATCH per transaction, $CHURN_DEPTH per stream, $CHURN_STREAMS streams, ≤ $CHURN_BACKLOG applies pending)"
  migrate $s 2
  start_worker $s
  CHURN_PID=$WPID
  q -c "TRUNCATE bench.samples, bench.flags"
  # The producer: one session, a commit per batch, paused while the backlog is full.
  q -c "DO \$\$
    DECLARE v_appended bigint := 0; v_next integer := 0; v_applied bigint;
    BEGIN
      LOOP
        EXIT WHEN EXISTS (SELECT 1 FROM bench.flags WHERE name = 'done');
        SELECT coalesce(sum(last_version), 0) INTO v_applied FROM $s.wh_perspective_cursors;
        IF v_appended * 2 - v_applied > $CHURN_BACKLOG THEN
          COMMIT; -- no snapshot held while waiting (it would keep dead rows from being vacuumed)
          PERFORM pg_sleep(0.01);
          COMMIT;
          CONTINUE;
        END IF;
        INSERT INTO $s.wh_event_store (stream_id, event_type, metadata)
        SELECT ('c0000000-0000-7000-8000-' || lpad(to_hex((v_next + i) % $CHURN_STREAMS), 12, '0'))::uuid, 'A', '{}'
        FROM generate_series(0, $per_batch - 1) i, generate_series(1, $CHURN_DEPTH) v ORDER BY i, v;
        v_appended := v_appended + $CHURN_BATCH;
        v_next := (v_next + $per_batch) % $CHURN_STREAMS;
        COMMIT;
      END LOOP;
    END \$\$" &
  local producer=$!
  # The monitor: applies and sizes every 0.5 s until CHURN_EVENTS × 2 applies.
  q -c "DO \$\$
    DECLARE v_applied bigint := 0;
    BEGIN
      WHILE v_applied < $applies LOOP
        SELECT coalesce(sum(last_version), 0) INTO v_applied FROM $s.wh_perspective_cursors;
        INSERT INTO bench.samples VALUES (extract(epoch FROM clock_timestamp()), v_applied,
          pg_total_relation_size('$s.wh_perspective_events'), pg_total_relation_size('$s.wh_active_streams'),
          (SELECT coalesce(sum(version), 0) * 2 FROM $s.wh_streams),
          pg_total_relation_size('$s.wh_streams') + pg_total_relation_size('$s.wh_perspective_cursors')
            + pg_total_relation_size('$s.c1') + pg_total_relation_size('$s.c2'),
          pg_total_relation_size('$s.wh_event_store'));
        COMMIT;
        IF v_applied < $applies THEN PERFORM pg_sleep(0.5); COMMIT; END IF;
      END LOOP;
      INSERT INTO bench.flags VALUES ('done');
    END \$\$" &
  local monitor=$!
  local last=0 now_
  while kill -0 "$monitor" 2>/dev/null; do
    sleep 5
    now_=$(q -c "SELECT coalesce(max(applied), 0) FROM bench.samples")
    if [ $(( now_ * 10 / applies )) -gt $(( last * 10 / applies )) ]; then
      log "churn: $(( now_ * 100 / applies ))% ($now_ of $applies applies)"
    fi
    last=$now_
  done
  wait "$monitor"; wait "$producer"
  # What the producer appended beyond the measured 5 M drains, then the final sizes.
  local total; total=$(q -c "SELECT sum(version) * 2 FROM $s.wh_streams")
  q -c "CALL bench.await_applied('$s', $total)" >/dev/null
  check $s 2
  local first last10 work_end active_end peak1 peak2 rows_end
  # Time at which the applies crossed 10%, 90% and 100%, interpolated between samples.
  read -r first last10 < <(q -F' ' -c "SELECT t, applied FROM bench.samples ORDER BY t" | awk -v n="$applies" '
    function cross(f,  x) { x = f * n; if (!(f in at) && pa < x && a >= x) at[f] = pt + (t - pt) * (x - pa) / (a - pa) }
    NR == 1 { t0 = $1 }
    { t = $1; a = $2; if (NR > 1) { cross(0.1); cross(0.9); cross(1.0) } pt = t; pa = a }
    END { printf "%.0f %.0f\n", 0.1 * n / (at[0.1] - t0), 0.1 * n / (at[1.0] - at[0.9]) }')
  read -r peak1 peak2 < <(q -F' ' -c "
    SELECT max(work_bytes + active_bytes) FILTER (WHERE applied <= $applies / 2),
           max(work_bytes + active_bytes) FILTER (WHERE applied > $applies / 2) FROM bench.samples")
  read -r work_end active_end rows_end < <(q -F' ' -c "
    SELECT pg_total_relation_size('$s.wh_perspective_events'), pg_total_relation_size('$s.wh_active_streams'),
           (SELECT count(*) FROM $s.wh_perspective_events)")
  # Whether the engine or the producer set the pace (applies pending: the producer keeps up to
  # CHURN_BACKLOG), and what grew: the tables updated in place (stream heads, cursors, the
  # counters) and the event store.
  local pending1 pending2 upd1 upd2 store1 store2
  read -r pending1 pending2 upd1 upd2 store1 store2 < <(q -F' ' -c "
    SELECT round(avg(appended - applied) FILTER (WHERE applied <= $applies / 10)),
           round(avg(appended - applied) FILTER (WHERE applied >= $applies / 10 * 9)),
           max(updated_bytes) FILTER (WHERE applied <= $applies / 10),
           max(updated_bytes) FILTER (WHERE applied >= $applies / 10 * 9),
           max(store_bytes) FILTER (WHERE applied <= $applies / 10),
           max(store_bytes) FILTER (WHERE applied >= $applies / 10 * 9) FROM bench.samples")
  local mib='{ printf "%.1f MiB", $1 / 1048576 }' vacuums
  vacuums=$(q -F' ' -c "SELECT string_agg(relname || ' ' || vacuum_count || ' by the worker, ' || autovacuum_count || ' by autovacuum', '; ')
                        FROM pg_stat_user_tables WHERE schemaname = '$s' AND relname IN ('wh_perspective_events', 'wh_active_streams')")
  result "churn: applies/s in the last 10% vs the first 10% ($CHURN_EVENTS events)" "$last10 vs $first = $(pct "$last10" "$first")%" "≥ 90%" "$(verdict "$(pct "$last10" "$first")" 90)"
  result "churn: wh_perspective_events + wh_active_streams, peak in the second half vs the first" \
    "$(echo "$peak2" | awk "$mib") vs $(echo "$peak1" | awk "$mib")" "bounded (≤ 150%)" "$(verdict "$(awk -v a="$peak1" -v b="$peak2" 'BEGIN { print a * 1.5 - b }')" 0)"
  result "churn: applies pending (mean), first vs last 10%" "$pending1 vs $pending2 (the producer keeps ≤ $CHURN_BACKLOG)" "(reported)" "-"
  result "churn: stream heads + cursors + the 2 counter tables; the event store; first vs last 10%" \
    "$(echo "$upd1" | awk "$mib") vs $(echo "$upd2" | awk "$mib"); $(echo "$store1" | awk "$mib") vs $(echo "$store2" | awk "$mib")" "(reported)" "-"
  result "churn: sizes at the end (heap + indexes)" "wh_perspective_events $(echo "$work_end" | awk "$mib") ($rows_end rows), wh_active_streams $(echo "$active_end" | awk "$mib"); vacuums: $vacuums" "(reported)" "-"
}

# --- history ----------------------------------------------------------------------------------
case_history() {
  local full=churn empty=hist_empty live_streams=400 r s t0 t1 done tps
  local history; history=$(q -c "SELECT count(*) FROM $full.wh_event_store")
  log "history: $history applied events vs an empty store: $ROUNDS alternating rounds of $live_streams new streams × 100 events, then appends"
  migrate $empty 2
  start_worker $empty
  local empty_pid=$WPID
  for r in $(seq "$ROUNDS"); do
    for s in $empty $full; do
      read -r t0 t1 < <(append_block $s "d000000$r" 1 "$live_streams" 100)
      read -r _ _ done < <(q -F' ' -c "CALL bench.await_applied('$s', $(q -c "SELECT sum(version) * 2 FROM $s.wh_streams"))")
      rate $(( live_streams * 200 )) "$t1" "$done" >>"$work/hist-apply-$s"; echo >>"$work/hist-apply-$s"
    done
    log "history apply (round $r): empty $(tail -1 "$work/hist-apply-$empty"), with history $(tail -1 "$work/hist-apply-$full") applies/s"
  done
  check $empty 2; check $full 2
  stop_worker "$empty_pid" >/dev/null; stop_worker "$CHURN_PID" >/dev/null
  pids=()
  for r in $(seq "$ROUNDS"); do
    for s in $empty $full; do
      printf '%s\n' '\set n random(1, 1000)' \
        "INSERT INTO $s.wh_event_store (stream_id, event_type) VALUES (('e0000000-0000-7000-8000-' || lpad(to_hex(:n), 12, '0'))::uuid, 'A');" >"$work/append.sql"
      tps=$(pgbench "$DATABASE_URL" -n -f "$work/append.sql" -c "$APPENDERS" -j 2 -T "$APPEND_SECONDS" 2>/dev/null | awk '/^tps/ {print int($3)}')
      echo "$tps" >>"$work/hist-append-$s"
    done
    log "history append (round $r): empty $(tail -1 "$work/hist-append-$empty"), with history $(tail -1 "$work/hist-append-$full") events/s"
  done
  local ae af pe pf
  ae=$(median <"$work/hist-apply-$empty"); af=$(median <"$work/hist-apply-$full")
  pe=$(median <"$work/hist-append-$empty"); pf=$(median <"$work/hist-append-$full")
  result "history: applies/s with $history applied events vs an empty store" "$af vs $ae = $(pct "$af" "$ae")%" "≥ 90%" "$(verdict "$(pct "$af" "$ae")" 90)"
  result "history: appends/s ($APPENDERS connections) with $history events vs an empty store" "$pf vs $pe = $(pct "$pf" "$pe")%" "≥ 90%" "$(verdict "$(pct "$pf" "$pe")" 90)"
}

log "bench-scale: PostgreSQL $(q -c 'show server_version' | cut -d' ' -f1), $(nproc) cores, autovacuum $(q -c 'show autovacuum') (naptime $(q -c 'show autovacuum_naptime')); cases: $CASES"
for c in $CASES; do "case_$c"; done

table=$work/table
{ echo "| figure | value | goal | met |"; echo "|---|---|---|---|"; cat "$results"; } >"$table"
echo
cat "$table"
if [ "$RECORD" = 1 ]; then
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -z "$(git status --porcelain 2>/dev/null | grep -v '^?? ' | grep -v docs/benchmarks-history.md)" ] || commit="$commit (with uncommitted changes)"
  {
    echo
    echo "### \`make bench-scale\`, $(date -u '+%Y-%m-%d %H:%M') UTC, commit $commit"
    echo
    echo "Command: \`make bench-scale\`$( [ "${QUICK:-0}" = 1 ] && echo ' (QUICK=1)'); cases: $CASES; $(( $(date +%s) - started )) s on $(nproc) cores."
    echo
    cat "$table"
  } >>docs/benchmarks-history.md
  log "appended to docs/benchmarks-history.md"
fi
