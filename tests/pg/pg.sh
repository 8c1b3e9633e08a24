#!/usr/bin/env bash
# Throwaway PostgreSQL clusters on loopback for tests, benchmarks and the demo.
#
#   tests/pg/pg.sh bindir            print the server bin dir, installing the Debian package
#                                    `postgresql` with apt-get when no server binaries exist
#   tests/pg/pg.sh with CMD [ARG..]  start a fresh cluster on a free 127.0.0.1 port, run CMD with
#                                    DATABASE_URL / TEST_DATABASE_URL set, stop and remove the
#                                    cluster whatever CMD did, exit with CMD's status
#
# Environment: PG_EXTRA_CONF (extra `-c name=value` flags for the server), PG_KEEP=1 (keep the
# data directory for post-mortems; its path is printed).
set -euo pipefail

log() { printf 'pg.sh: %s\n' "$*" >&2; }

find_bindir() {
  local d
  if [ -n "${PG_BINDIR:-}" ] && [ -x "$PG_BINDIR/postgres" ]; then echo "$PG_BINDIR"; return 0; fi
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/postgres" ] && [ -x "$d/initdb" ]; then echo "$d"; return 0; fi
  done
  if command -v pg_config >/dev/null 2>&1; then
    d=$(pg_config --bindir)
    if [ -x "$d/postgres" ] && [ -x "$d/initdb" ]; then echo "$d"; return 0; fi
  fi
  return 1
}

ensure_bindir() {
  if find_bindir; then return 0; fi
  log "no PostgreSQL server binaries found; installing the Debian package 'postgresql'"
  if [ "$(id -u)" != 0 ]; then
    log "not root: install PostgreSQL server packages (e.g. 'sudo apt-get install postgresql') and retry"
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends postgresql postgresql-contrib >&2
  # The package may start a system cluster; tests never use it, so leave it be.
  find_bindir
}

free_port() {
  python3 - <<'EOF'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
EOF
}

# Runs a server-side binary as an unprivileged user: PostgreSQL refuses to run as root.
as_pg() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

cmd_with() {
  # Globals, not locals: the EXIT trap runs after this function has returned.
  local port status=0 url
  PG_DIR_BIN=$(ensure_bindir)
  if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
  fi
  bindir=$PG_DIR_BIN
  dir=$(mktemp -d /tmp/perspective-pg.XXXXXX)
  chmod 755 "$dir"
  [ "$(id -u)" = 0 ] && chown postgres "$dir"
  as_pg "$bindir/initdb" -D "$dir/data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; return 1; }
  local preload=""
  if [ -f "$("$bindir/pg_config" --pkglibdir 2>/dev/null || echo /nonexistent)/pg_stat_statements.so" ]; then
    # Room for every statement of a whole suite (each test schema's statements are entries of
    # their own): with the default 5 000, entries of a quiet test were evicted while the
    # others ran, and its counts went down (engine::an_idle_worker_sends_few_statements).
    preload="-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.max=50000"
  fi
  local started=0
  for _ in 1 2 3 4 5; do
    port=$(free_port)
    # shellcheck disable=SC2086
    if as_pg "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start -o \
        "-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories=$dir -c max_connections=300 \
         -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c shared_buffers=256MB \
         -c max_locks_per_transaction=256 $preload ${PG_EXTRA_CONF:-}" >/dev/null; then
      started=1; break
    fi
    log "start on port $port failed, retrying"; tail -5 "$dir/server.log" >&2 || true
  done
  [ "$started" = 1 ] || { log "could not start PostgreSQL"; cat "$dir/server.log" >&2; return 1; }
  url="postgres://postgres@127.0.0.1:$port/postgres"
  log "PostgreSQL $("$bindir/postgres" --version | awk '{print $3}') on 127.0.0.1:$port (data: $dir/data)"
  cleanup() {
    as_pg "$bindir/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1 || true
    if [ "${PG_KEEP:-0}" = 1 ]; then log "kept $dir"; else rm -rf "$dir"; fi
  }
  trap cleanup EXIT INT TERM
  DATABASE_URL="$url" TEST_DATABASE_URL="$url" PG_BINDIR="$bindir" PGHOST_DIR="$dir" "$@" || status=$?
  return "$status"
}

case "${1:-}" in
  bindir) ensure_bindir ;;
  with) shift; [ $# -gt 0 ] || { log "usage: pg.sh with CMD [ARG...]"; exit 2; }; cmd_with "$@" ;;
  *) log "usage: pg.sh bindir | with CMD [ARG...]"; exit 2 ;;
esac
