#!/usr/bin/env bash
# Breadth against the tables (issue 28): what a one-event stream costs on the engine's tables as
# they are, on the proposed ones (docs/design/breadth-tables.md), and for the handlers alone.
# VARIANTS are hand-written ceilings (tests/bench/breadth-ceilings.sql), no worker: each drains
# the breadth case's two shapes — WIDE streams × 1 event and WIDE/DEEP_PER streams × DEEP_PER
# events, two counter perspectives — with 4 pgbench connections, CEIL_APPLIES applies per call.
# ENGINES adds worker builds to the same rounds, each as NAME=BINARY:COMPLETION (Batched or
# Instant): one worker of that build (started on a fresh schema before the append) drains the
# shape, timed from the append's commit until no work row is left — completions included,
# whatever the build writes to its cursors. That prices a table change tried in a build against
# main's build beside it.
#
# The ceilings start on rows as fresh as the engine's (the first reader of a new row pays for its
# hint bits, the planner has no statistics yet), as `scale.sh`'s ceiling does; VACUUM=1 runs
# VACUUM ANALYZE on the queue's tables first, which prices the tables' rows alone.
#
# Everything alternates over ROUNDS rounds on one throwaway cluster; the figures are medians of
# the per-round values (applies/s, wide vs deep). Every run checks that each counter ends at
# exactly its stream's event count, and that no work row (except for `handlers`, which has no
# queue) and no active stream (except for `handlers` and `work-rows-only`) is left.
#
#   tests/bench/breadth-tables.sh                        (3 rounds at 100 000 streams, ~6 min)
#   WIDE=20000 ROUNDS=1 tests/bench/breadth-tables.sh    (a quick check of the script)
#   VARIANTS="current lazy-cursor" VACUUM=1 tests/bench/breadth-tables.sh
#   VARIANTS= ENGINES="main=/tmp/main-worker:Instant proto=/tmp/proto-worker:Instant" tests/bench/breadth-tables.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

WIDE=${WIDE:-100000}
DEEP_PER=${DEEP_PER:-100}
ROUNDS=${ROUNDS:-3}
CEIL_APPLIES=${CEIL_APPLIES:-1000}
VARIANTS=${VARIANTS-current lazy-cursor work-rows-only handlers}
ENGINES=${ENGINES:-}
VACUUM=${VACUUM:-0}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
[ -x "$WORKER" ] || { echo "build the worker first (it migrates the schemas): cargo build --release -p perspective-worker" >&2; exit 1; }
for v in $VARIANTS; do
  case $v in current | lazy-cursor | work-rows-only | handlers) ;;
    *) echo "breadth-tables: unknown variant '$v' in VARIANTS (current, lazy-cursor, work-rows-only, handlers)" >&2; exit 2;;
  esac
done
for e in $ENGINES; do
  case $e in [a-z]*=*:Batched | [a-z]*=*:Instant) ;;
    *) echo "breadth-tables: '$e' in ENGINES is not NAME=BINARY:Batched or NAME=BINARY:Instant" >&2; exit 2;;
  esac
  b=${e#*=}; b=${b%:*}
  [ -x "$b" ] || { echo "breadth-tables: '$b' (in ENGINES, for ${e%%=*}) is not an executable worker" >&2; exit 2; }
done

if [ -z "${DATABASE_URL:-}" ]; then
  exec tests/pg/pg.sh with "$0" "$@"
fi

work=$(mktemp -d)
wpid=
trap '[ -z "$wpid" ] || kill -TERM "$wpid" 2>/dev/null; wait; rm -rf "$work"' EXIT
q() { psql "$DATABASE_URL" -XAtq -v ON_ERROR_STOP=1 "$@"; }
started=$(date +%s)
log() { printf '[%4ds] %s\n' $(( $(date +%s) - started )) "$*" >&2; }
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

migrate() { # schema [worker completion]
  { echo "schema: $1"
    echo "worker: { completionStrategy: ${3:-Batched} }"
    echo "perspectives:"
    for i in 1 2; do
      echo "  - name: c$i"
      echo "    setup: CREATE TABLE IF NOT EXISTS c$i (stream_id uuid PRIMARY KEY, n bigint NOT NULL, last bigint NOT NULL)"
      echo "    handlers:"
      echo "      A: INSERT INTO c$i AS c VALUES (:stream_id, 1, :stream_version) ON CONFLICT (stream_id) DO UPDATE SET n = c.n + 1, last = excluded.last"
    done; } >"$work/$1.yaml"
  "${2:-$WORKER}" --config "$work/$1.yaml" migrate >/dev/null 2>>"$work/migrate.log" ||
    { cat "$work/migrate.log" >&2; exit 1; }
}

shape_size() { # shape -> "streams per"
  if [ "$1" = deep ]; then echo "$(( WIDE / DEEP_PER )) $DEEP_PER"; else echo "$WIDE 1"; fi
}

append() { # schema streams per: one transaction, streams in order (as the breadth case); prints
  # the commit's time (epoch seconds, server clock)
  q -c "INSERT INTO $1.wh_event_store (stream_id, event_type, metadata)
        SELECT ('b0000000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, 'A', '{\"user_id\": \"bench\"}'
        FROM generate_series(1, $2) s, generate_series(1, $3) v ORDER BY s, v" \
    -c "SELECT extract(epoch FROM clock_timestamp())"
}

check_and_drop() { # schema what
  local bad
  bad=$(q -c "SELECT count(*) FROM $1.wh_streams h FULL JOIN $1.c1 a USING (stream_id) FULL JOIN $1.c2 b USING (stream_id)
              WHERE a.n IS DISTINCT FROM h.version OR b.n IS DISTINCT FROM h.version")
  [ "$bad" = 0 ] || { echo "breadth-tables: $2 applied some events more or less than once ($bad streams)" >&2; exit 1; }
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA $1 CASCADE"
}

rate() { awk -v n="$1" -v a="$2" -v b="$3" 'BEGIN { printf "%.0f", n / (b - a) }'; }

run_ceiling() { # variant shape -> applies/s
  local v=$1 s=bt_${1//-/_}_$2 streams per k calls t0 t1 left
  read -r streams per < <(shape_size "$2")
  k=$(( CEIL_APPLIES / (per * 2) )); [ "$k" -ge 1 ] || k=1
  calls=$(( (streams + k - 1) / k ))
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA IF EXISTS $s CASCADE"
  migrate "$s"
  append "$s" "$streams" "$per" >/dev/null
  sed "s/@schema@/$s/g" tests/bench/breadth-ceilings.sql | q
  q -c "INSERT INTO $s.bench_order SELECT row_number() OVER (ORDER BY stream_id), stream_id FROM $s.wh_streams"
  [ "$VACUUM" = 0 ] ||
    q -c "VACUUM ANALYZE $s.wh_event_store, $s.wh_perspective_events, $s.wh_active_streams, $s.wh_perspective_cursors, $s.bench_order"
  echo "SELECT $s.bench_drain_${v//-/_}($k);" >"$work/call.sql"
  t0=$(q -c "SELECT extract(epoch FROM clock_timestamp())")
  # Calls that find nothing left return at once; a few spare ones per connection absorb the
  # streams skipped while locked by another connection near the end.
  pgbench "$DATABASE_URL" -n -f "$work/call.sql" -c 4 -j 2 -t $(( calls / 4 + 4 )) >"$work/pgbench.log" 2>&1 ||
    { cat "$work/pgbench.log" >&2; exit 1; }
  t1=$(q -c "SELECT extract(epoch FROM clock_timestamp())")
  if [ "$v" != handlers ]; then
    left=$(q -c "SELECT count(*) FROM $s.wh_perspective_events")
    [ "$v" = work-rows-only ] || left=$(( left + $(q -c "SELECT count(*) FROM $s.wh_active_streams") ))
    [ "$left" = 0 ] || { echo "breadth-tables: $v on $2 left $left work rows or active streams" >&2; exit 1; }
  fi
  check_and_drop "$s" "$v on $2"
  rate $(( streams * per * 2 )) "$t0" "$t1"
}

run_engine() { # name=binary:completion shape -> applies/s
  local name=${1%%=*} bin=${1#*=} comp s streams per t1 done
  comp=${bin##*:}; bin=${bin%:*}; s=bt_e_${name//[^a-z0-9]/_}_$2
  read -r streams per < <(shape_size "$2")
  q -c "SET client_min_messages = warning" -c "DROP SCHEMA IF EXISTS $s CASCADE"
  migrate "$s" "$bin" "$comp"
  RUST_LOG=warn "$bin" --config "$work/$s.yaml" run --http-addr 127.0.0.1:0 >"$work/worker-$s.log" 2>&1 &
  wpid=$!
  for _ in $(seq 400); do
    [ "$(q -c "SELECT count(*) FROM $s.wh_service_instances")" -ge 1 ] && break
    kill -0 "$wpid" 2>/dev/null || { echo "breadth-tables: the worker $bin stopped:" >&2; cat "$work/worker-$s.log" >&2; exit 1; }
    sleep 0.05
  done
  t1=$(append "$s" "$streams" "$per" | tail -1)
  done=$(q -c "CALL public.bench_tables_await('$s', '30 min', NULL)")
  kill -TERM "$wpid"; wait "$wpid" 2>/dev/null || true; wpid=
  log "$name on $2: $(q -c "SELECT count(*) FROM $s.wh_perspective_cursors") cursor rows written"
  check_and_drop "$s" "$name on $2"
  rate $(( streams * per * 2 )) "$t1" "$done"
}

# Waits until the schema has no work row left. Polled server-side, sleeping 10× as long as each
# look took (a few percent of the machine at most), committing between looks so that no snapshot
# holds back the pruning of the deleted work rows.
q <<'SQL'
SET client_min_messages = warning;
CREATE OR REPLACE PROCEDURE public.bench_tables_await(p_schema text, p_timeout interval, INOUT done_at double precision)
LANGUAGE plpgsql AS $$
DECLARE v_deadline timestamptz := clock_timestamp() + p_timeout; v_t0 timestamptz; v_more boolean;
BEGIN
  LOOP
    v_t0 := clock_timestamp();
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I.wh_perspective_events)', p_schema) INTO v_more;
    EXIT WHEN NOT v_more;
    IF clock_timestamp() > v_deadline THEN
      RAISE EXCEPTION 'breadth-tables: %: work rows left after %', p_schema, p_timeout;
    END IF;
    COMMIT;
    PERFORM pg_sleep(greatest(0.005, 10 * extract(epoch FROM clock_timestamp() - v_t0)));
    COMMIT;
  END LOOP;
  done_at := extract(epoch FROM clock_timestamp());
END
$$;
SQL

all="$VARIANTS"; for e in $ENGINES; do all="$all engine:$e"; done
log "breadth against the tables: $WIDE streams × 1 vs $(( WIDE / DEEP_PER )) × $DEEP_PER, 2 perspectives, $ROUNDS rounds of:$(for v in $all; do printf ' %s' "${v%%=*}"; done)"
for r in $(seq "$ROUNDS"); do
  # Alternate the order of the variants (and of the shapes) from round to round.
  order=$all; shapes="deep wide"
  if [ $(( r % 2 )) = 0 ]; then order=$(echo "$all" | tr ' ' '\n' | tac | tr '\n' ' '); shapes="wide deep"; fi
  for v in $order; do
    name=${v%%=*}
    for shape in $shapes; do
      case $v in engine:*) rate_=$(run_engine "${v#engine:}" "$shape");; *) rate_=$(run_ceiling "$v" "$shape");; esac
      echo "$rate_" >>"$work/$name-$shape"
      log "round $r: $name, $shape: $rate_ applies/s"
    done
    paste "$work/$name-wide" "$work/$name-deep" | tail -1 | awk '{ printf "%.1f\n", $1 * 100 / $2 }' >>"$work/$name-ratio"
  done
done

echo
echo "| variant | wide applies/s | deep applies/s | wide vs deep: median (rounds) |"
echo "|---|---|---|---|"
for v in $all; do
  name=${v%%=*}
  printf '| %s | %s | %s | %s%% (%s%%) |\n' "$name" "$(median <"$work/$name-wide")" "$(median <"$work/$name-deep")" \
    "$(median <"$work/$name-ratio")" "$(paste -sd, "$work/$name-ratio" | sed 's/,/%, /g')"
done
