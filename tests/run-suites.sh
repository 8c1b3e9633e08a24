#!/usr/bin/env bash
# `make test`'s three suites, side by side (each on its own throwaway PostgreSQL):
#   worker     every perspective-worker test (PostgreSQL only)
#   operator   the operator's tests against a loopback control plane with kwok nodes
#              (tests named real_node::* skipped)
#   real-node  the operator's real_node scenarios against a control plane with a real kubelet
#              node (containerd, runc, the CNI bridge; see tests/e2e/with-control-plane.sh)
# Run one after the other they took 9 minutes warm; most of the operator suites' time is
# waiting on the control plane and the node, which the worker suite fills. Each suite's output
# is printed whole when it ends (so the three do not interleave); the exit status is non-zero
# when any suite failed, and names it.
#
#   tests/run-suites.sh                      (make test builds every test first)
#   SUITES="worker operator" tests/run-suites.sh
set -uo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
PG=tests/pg/pg.sh
SUITES=${SUITES:-worker operator real-node}
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait; rm -rf "$logs"' EXIT

suite() { # name
  case $1 in
    worker) $PG with "$CARGO" test -p perspective-worker ;;
    operator) $PG with tests/e2e/with-control-plane.sh "$CARGO" test -p perspective-operator -- --skip real_node:: ;;
    real-node) $PG with tests/e2e/with-control-plane.sh --real-node "$CARGO" test -p perspective-operator --test real_node ;;
    *) echo "unknown suite $1" >&2; return 2 ;;
  esac
}

started=$(date +%s)
for name in $SUITES; do
  ( suite "$name" >"$logs/$name.log" 2>&1; echo $? >"$logs/$name.rc" ) &
done
echo "run-suites: $SUITES side by side; each one's output follows when it ends"
pending=" $SUITES "
status=0
while [ -n "${pending// /}" ]; do
  for name in $pending; do
    [ -f "$logs/$name.rc" ] || continue
    rc=$(cat "$logs/$name.rc")
    echo "=== suite $name: exit $rc after $(( $(date +%s) - started )) s"
    cat "$logs/$name.log"
    echo "=== end of suite $name (exit $rc)"
    [ "$rc" = 0 ] || { status=1; failed="${failed:-} $name"; }
    pending=${pending/ $name / }
  done
  sleep 1
done
[ "$status" = 0 ] && echo "run-suites: all passed in $(( $(date +%s) - started )) s" \
  || echo "run-suites: FAILED:${failed}" >&2
exit "$status"
