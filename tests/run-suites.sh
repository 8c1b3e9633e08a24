#!/usr/bin/env bash
# Runs every test of the workspace except the real node's (tests named real_node::*), in
# STREAMS concurrent `cargo test` invocations against the one PostgreSQL and the one kwok
# control plane the caller started (make test: tests/pg/pg.sh with
# tests/e2e/with-control-plane.sh tests/run-suites.sh).
#
# Most of the suites' time is waiting (for engines, timers, the control plane), not CPU, and
# `cargo test` runs its test binaries one after another: three streams took 214 s where one
# takes well over 330 s. The binaries are dealt to the streams longest first (their durations,
# below); a test file not listed goes to the stream with the least work, so none is ever left
# out. Each binary still runs its own tests as `cargo test` does. Output goes to one log per
# stream, printed whole when the stream fails; the `test result` lines of all, with each job's
# seconds, are printed at the end.
#
#   tests/run-suites.sh                 (needs TEST_DATABASE_URL and KUBECONFIG, see make test)
#   STREAMS=1 tests/run-suites.sh       (one stream: as `cargo test --workspace` would)
set -uo pipefail
cd "$(dirname "$0")/.."

CARGO=${CARGO:-cargo}
STREAMS=${STREAMS:-3}
dir=$(mktemp -d "${TMPDIR:-/tmp}/perspective-suites.XXXXXX")
trap 'rm -rf "$dir"' EXIT

# Seconds each job took in warm three-stream runs on the project machine (2026-12-02; the chart
# suite 2026-12-07, once its RBAC checks were API calls rather than kubectl processes), to
# balance the streams. (Running the control-plane suites 4 tests at a time was faster alone but
# slower and flaky beside the other streams in CI: libtest's default, one per core, it is.)
declare -A SECONDS_OF=(
  [op-e2e]=180 [op-chart]=12 [op-units]=11 [op-pod_runner]=9 [op-monitoring]=3 [op-crd]=2
  [op-builders]=2 [op-real_node]=2 [op-doc]=3 [engine]=92 [backfill]=43 [process]=39 [scale]=36
  [failures]=34 [options]=28 [failover]=40 [sequencing_lifecycle]=25 [partition]=25
  [worker-units]=24 [contention]=23 [migrate]=22 [connections]=19 [sequencing_failures]=19
  [claim]=16 [producer]=13 [sequencing]=13 [rebuild]=12 [statistics]=7 [truth]=6 [embedded]=5
  [blue_green]=20 [batch_handlers]=4 [roles]=3 [cli]=2 [worker-doc]=1
)

# The jobs: the operator's unit and doc tests and each of its test files (the real-node binary
# runs with every real-node test skipped), the worker's unit tests and doc tests, and each
# worker test file.
jobs=(op-units op-doc worker-units worker-doc)
for f in operator/tests/*.rs; do
  jobs+=("op-$(basename "$f" .rs)")
done
for f in worker/tests/*.rs; do
  jobs+=("$(basename "$f" .rs)")
done

args_of() {
  case "$1" in
    op-units) echo "-p perspective-operator --lib --bins" ;;
    op-doc) echo "-p perspective-operator --doc" ;;
    op-real_node) echo "-p perspective-operator --test real_node -- --skip real_node::" ;;
    op-*) echo "-p perspective-operator --test ${1#op-}" ;;
    worker-units) echo "-p perspective-worker --lib --bins" ;;
    worker-doc) echo "-p perspective-worker --doc" ;;
    *) echo "-p perspective-worker --test $1" ;;
  esac
}

# Deal the jobs, longest first, each to the stream with the least work so far.
mapfile -t sorted < <(for j in "${jobs[@]}"; do echo "${SECONDS_OF[$j]:-2} $j"; done | sort -rn -k1,1 | awk '{print $2}')
declare -a load streams_jobs
for ((s = 0; s < STREAMS; s++)); do load[s]=0; streams_jobs[s]=""; done
for j in "${sorted[@]}"; do
  best=0
  for ((s = 1; s < STREAMS; s++)); do ((load[s] < load[best])) && best=$s; done
  load[best]=$((load[best] + ${SECONDS_OF[$j]:-2}))
  streams_jobs[best]+="$j "
done

run_stream() { # index, jobs...
  local s=$1 rc=0
  shift
  for j in "$@"; do
    # shellcheck disable=SC2046
    local t0=$SECONDS
    # shellcheck disable=SC2046
    $CARGO test $(args_of "$j") >"$dir/$s.job" 2>&1 || rc=1
    { echo "=== cargo test $(args_of "$j")  ($((SECONDS - t0)) s)"; cat "$dir/$s.job"; } >>"$dir/$s.log"
  done
  echo "$rc" >"$dir/$s.rc"
}

started=$(date +%s)
for ((s = 0; s < STREAMS; s++)); do
  echo "[run-suites] stream $s (~${load[s]} s): ${streams_jobs[s]}"
  # shellcheck disable=SC2086
  run_stream "$s" ${streams_jobs[s]} &
done
wait

status=0
for ((s = 0; s < STREAMS; s++)); do
  if [[ "$(cat "$dir/$s.rc" 2>/dev/null)" != 0 ]]; then
    status=1
    echo "[run-suites] stream $s FAILED; its whole log:"
    cat "$dir/$s.log"
  fi
done
echo "[run-suites] results:"
for ((s = 0; s < STREAMS; s++)); do
  grep -E "^(=== cargo test|test result:)|^test .* FAILED$" "$dir/$s.log" | sed "s/^/  [$s] /"
done
echo "[run-suites] $([[ $status == 0 ]] && echo passed || echo FAILED) in $(($(date +%s) - started)) s"
exit "$status"
