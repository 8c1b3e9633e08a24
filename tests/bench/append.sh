#!/usr/bin/env bash
# Append-path benchmark: what producers pay for version assignment, fan-out and the doorbell.
#
# Runs, side by side on one throwaway cluster, pgbench with
#   plain  INSERT into a table of the same shape as wh_event_store (same columns, defaults,
#          primary key and (stream_id, stream_version) unique index) with no triggers; the
#          version comes from a sequence
#   store  INSERT into <schema>.wh_event_store: stream_version under the per-stream lock, one
#          work row for each of 2 subscribed perspectives, active-stream pin and NOTIFY on the
#          empty->non-empty edge
# in four scenarios: `hot` (1000 existing streams: the steady state), `new` (a new stream per
# event: every transaction is an edge, so every transaction NOTIFYs, as while a worker waits for
# doorbells), `new-awake` (the same appends while the one registered worker is awake, as a
# worker is under load: the edges do not ring; the worker is an instance row marked awake, so
# that no worker competes for the 2 cores) and `new-live` (the same appends with a real worker
# running and applying them, which goes awake under such load; it shares the 2 cores with the
# producers, and sits idle beside the plain INSERTs), at 1 and 8 connections.
# Rounds alternate plain/store so machine drift hits both; the median of ROUNDS is reported.
#
#   tests/bench/append.sh              (make bench builds the worker first)
#   DURATION=10 ROUNDS=3 DURABLE=1 tests/bench/append.sh
# DURABLE=1 runs the server with fsync and synchronous_commit on (default: off, as in tests,
# which makes commits cheap and so shows the trigger overhead at its largest).
set -euo pipefail
cd "$(dirname "$0")/../.."

DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CLIENTS=${CLIENTS:-"1 8"}
SCENARIOS=${SCENARIOS:-"hot new new-awake new-live"}
WORKER=${WORKER:-${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}/release/perspective-worker}
[ -x "$WORKER" ] || { echo "build the worker first: cargo build --release -p perspective-worker" >&2; exit 1; }

if [ "${DURABLE:-0}" = 1 ]; then
  export PG_EXTRA_CONF="-c fsync=on -c synchronous_commit=on"
fi

if [ -z "${DATABASE_URL:-}" ]; then
  exec tests/pg/pg.sh with "$0" "$@"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cat >"$work/bench.yaml" <<'EOF'
schema: bench
perspectives:
  - name: order_summary
    handlers:
      OrderPlaced: SELECT :stream_id
  - name: customer_stats
    handlers:
      OrderPlaced: SELECT :stream_id
EOF
"$WORKER" --config "$work/bench.yaml" migrate >/dev/null

psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 <<'EOF'
CREATE TABLE bench.plain_events (
  event_id       uuid        NOT NULL DEFAULT bench.wh_uuid_v7(),
  stream_id      uuid        NOT NULL,
  stream_version bigint      NOT NULL,
  event_type     text        NOT NULL CHECK (event_type <> ''),
  event_data     jsonb       NOT NULL DEFAULT '{}',
  metadata       jsonb       NOT NULL DEFAULT '{}',
  scope          jsonb       NOT NULL DEFAULT '{}',
  created_at     timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (event_id),
  UNIQUE (stream_id, stream_version)
);
CREATE SEQUENCE bench.plain_version;
-- Pre-create the hot streams in both so the steady state is measured.
INSERT INTO bench.wh_event_store (stream_id, event_type)
SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, 'OrderPlaced' FROM generate_series(1, 1000) s;
INSERT INTO bench.plain_events (stream_id, stream_version, event_type)
SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid, nextval('bench.plain_version'), 'OrderPlaced'
FROM generate_series(1, 1000) s;
EOF

hot_stream="('00000000-0000-7000-8000-' || lpad(to_hex(:s), 12, '0'))::uuid"
payload="'OrderPlaced', '{\"total\": 42, \"customer\": \"c-1\"}', '{\"user_id\": \"u-1\"}', '{\"tenant_id\": \"t-1\"}'"
cat >"$work/plain-hot.sql" <<EOF
\set s random(1, 1000)
INSERT INTO bench.plain_events (stream_id, stream_version, event_type, event_data, metadata, scope)
VALUES ($hot_stream, nextval('bench.plain_version'), $payload);
EOF
cat >"$work/store-hot.sql" <<EOF
\set s random(1, 1000)
INSERT INTO bench.wh_event_store (stream_id, event_type, event_data, metadata, scope)
VALUES ($hot_stream, $payload);
EOF
cat >"$work/plain-new.sql" <<EOF
INSERT INTO bench.plain_events (stream_id, stream_version, event_type, event_data, metadata, scope)
VALUES (gen_random_uuid(), 1, $payload);
EOF
cat >"$work/store-new.sql" <<EOF
INSERT INTO bench.wh_event_store (stream_id, event_type, event_data, metadata, scope)
VALUES (gen_random_uuid(), $payload);
EOF
for v in new-awake new-live; do
  cp "$work/plain-new.sql" "$work/plain-$v.sql"
  cp "$work/store-new.sql" "$work/store-$v.sql"
done
worker_pid=
start_worker() { # a real worker on the bench schema, ready once its instance row is there
  "$WORKER" --config "$work/bench.yaml" run --http-addr 127.0.0.1:0 >"$work/worker.log" 2>&1 &
  worker_pid=$!
  for _ in $(seq 200); do
    [ "$(psql "$DATABASE_URL" -XAtc 'SELECT count(*) FROM bench.wh_service_instances')" = 1 ] && return
    sleep 0.1
  done
  echo "the worker did not register in 20 s:" >&2; cat "$work/worker.log" >&2; exit 1
}
stop_worker() { kill -TERM "$worker_pid"; wait "$worker_pid" || true; worker_pid=; }
trap '[ -n "$worker_pid" ] && kill -TERM "$worker_pid" 2>/dev/null; rm -rf "$work"' EXIT

tps() { # script clients
  pgbench "$DATABASE_URL" -n -f "$1" -c "$2" -j "$(( $2 < 2 ? 1 : 2 ))" -T "$DURATION" 2>&1 \
    | awk '/^tps = /{print $3; exit}'
}
median() { sort -g | awk '{a[NR]=$1} END{print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

echo "append-path benchmark: PostgreSQL $(psql "$DATABASE_URL" -XAtc 'show server_version'), fsync=$(psql "$DATABASE_URL" -XAtc 'show fsync'), synchronous_commit=$(psql "$DATABASE_URL" -XAtc 'show synchronous_commit'), $(nproc) cores, ${DURATION}s x ${ROUNDS} rounds, median events/s"
printf '| scenario | connections | plain INSERT ev/s | wh_event_store ev/s | ratio |\n|---|---|---|---|---|\n'
for scenario in $SCENARIOS; do
  for c in $CLIENTS; do
    # new-awake: one worker registered and awake (wh_claim_awake); otherwise none is registered.
    q_awake="DELETE FROM bench.wh_service_instances"
    if [ "$scenario" = new-awake ]; then
      q_awake="$q_awake; INSERT INTO bench.wh_service_instances (instance_id, service_name, host_name, process_id, awake)
               VALUES (gen_random_uuid(), 'bench', 'bench', 0, true)"
    fi
    psql "$DATABASE_URL" -XAtq -c "$q_awake"
    [ "$scenario" = new-live ] && start_worker
    : >"$work/p"; : >"$work/s"
    for _ in $(seq "$ROUNDS"); do
      tps "$work/plain-$scenario.sql" "$c" >>"$work/p"
      tps "$work/store-$scenario.sql" "$c" >>"$work/s"
      # Keep the queue from growing without bound between rounds (no worker is running, but in
      # new-live, where this only clears what the worker did not apply yet).
      psql "$DATABASE_URL" -XAtq -c "TRUNCATE bench.wh_perspective_events" \
        -c "DELETE FROM bench.wh_active_streams WHERE stream_id NOT IN (SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid FROM generate_series(1, 1000) s)"
      psql "$DATABASE_URL" -XAtq -c "VACUUM ANALYZE bench.wh_perspective_events" -c "VACUUM ANALYZE bench.wh_streams"
    done
    [ "$scenario" = new-live ] && stop_worker
    p=$(median <"$work/p"); s=$(median <"$work/s")
    printf '| %s | %s | %.0f | %.0f | %.0f%% |\n' "$scenario" "$c" "$p" "$s" "$(awk -v s="$s" -v p="$p" 'BEGIN { print s * 100 / p }')"
  done
done
