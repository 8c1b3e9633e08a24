#!/usr/bin/env bash
# `make demo`: runs inside tests/pg/pg.sh, which provides a throwaway PostgreSQL as DATABASE_URL.
#   examples/demo.sh path/to/perspective-worker
set -euo pipefail
cd "$(dirname "$0")/.."
worker=${1:?usage: examples/demo.sh path/to/perspective-worker}
export PERSPECTIVE_CONFIG=examples/shop.yaml RUST_LOG=${RUST_LOG:-warn}
psql_() { psql "$DATABASE_URL" -X -q -P pager=off "$@"; }

echo "== 1. migrate: schema 'shop', subscriptions, perspective setup, handler checks"
"$worker" migrate
echo
echo "== 2. append the sample events (examples/shop-events.jsonl)"
"$worker" append --file examples/shop-events.jsonl
echo
echo "== 3. a producer needs nothing but SQL: one more event through psql"
psql_ -c "INSERT INTO shop.wh_event_store (stream_id, event_type, event_data, metadata)
          VALUES ('0190f5c2-6c1a-7000-8000-000000000002', 'OrderShipped', '{\"carrier\": \"UPS\"}', '{\"user_id\": \"u-ops\"}')"
echo
echo "== 4. the event store: stream versions assigned in commit order"
psql_ -c "SELECT stream_id, stream_version, event_type, event_data FROM shop.wh_event_store ORDER BY stream_id, stream_version"
echo "== 5. the work rows created in the same transactions, one per subscribed perspective"
psql_ -c "SELECT perspective_name, stream_id, stream_version, partition_number FROM shop.wh_perspective_events ORDER BY perspective_name, stream_id, stream_version"
echo "== 6. status"
"$worker" status
echo
echo "The engine that applies these work rows to order_summary and customer_stats is not built yet;"
echo "until it is, the read-model tables stay empty:"
psql_ -c "SELECT (SELECT count(*) FROM shop.order_summary) AS order_summary_rows, (SELECT count(*) FROM shop.customer_stats) AS customer_stats_rows"
