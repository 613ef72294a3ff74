# Sourced by scripts that start servers beside a throwaway PostgreSQL (scripts/lib/pg.sh).
#
#   work_dir NAME     a fresh $WORK (/tmp/idemkey-NAME.XXXXXX, readable by the postgres user)
#                     and an empty PIDS; on exit, every PID in PIDS is killed, PostgreSQL is
#                     stopped and $WORK is removed
#   work_copy_of BINARY
#                     copies BINARY into $WORK and sets BIN to the copy, so a build sharing
#                     the target directory cannot replace it mid-run
#   until_listening LOG [TENTHS]
#                     waits until a server started with its output in LOG says it is
#                     "listening" (up to TENTHS tenths of a second, default 100)
#   bench_serve URL BINARY
#                     starts BINARY's `idemkey serve` on database URL, as the benchmarks
#                     load it (API key bench=tok_bench, 64 connections), on a free loopback
#                     port (free_port, scripts/lib/pg.sh); waits until it listens (fails
#                     with its log if it does not) and sets SERVER_PID, SERVER_URL and
#                     SERVER_LOG
#   bench_database STORE NAME
#                     a fresh database NAME for STORE (sqlite: a file in $WORK; postgres: on
#                     the server start_pg started); sets DB_URL, and DB_ARGS to the
#                     `idemkey bench` arguments that read its CPU (--database-pid, none for
#                     SQLite)
#   run_header CMD NOTE
#                     prints the date, the machine, the commit and CMD, and how long the run
#                     took ($took seconds, then NOTE), for a report's first lines
#   idemkey_bin       sets IDEMKEY_BIN to the `idemkey` the caller named in it, else builds
#                     this checkout's release binary and names that

idemkey_bin() {
  if [ -z "${IDEMKEY_BIN:-}" ]; then
    cargo build --release -q -p idemkey-server
    IDEMKEY_BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/idemkey
  fi
}

work_dir() {
  WORK=$(mktemp -d "/tmp/idemkey-$1.XXXXXX")
  chmod 755 "$WORK"
  PIDS=()
  trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; stop_pg; rm -rf "$WORK"' EXIT
}

work_copy_of() {
  cp "$1" "$WORK/idemkey"
  BIN=$WORK/idemkey
}

until_listening() {
  for _ in $(seq "${2:-100}"); do
    grep -qs "listening" "$1" && return 0
    sleep 0.1
  done
}

bench_serve() {
  local port
  port=$(free_port)
  SERVER_LOG=$WORK/serve-$port.log
  "$2" serve --listen "127.0.0.1:$port" --database-url "$1" --api-key bench=tok_bench \
    --key-secret bench-secret-0123456789abcdef0123456789 --max-connections 64 >"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  PIDS+=("$SERVER_PID")
  until_listening "$SERVER_LOG"
  grep -qs listening "$SERVER_LOG" || { cat "$SERVER_LOG" >&2; return 1; }
  SERVER_URL="http://127.0.0.1:$port"
}

bench_database() {
  if [ "$1" = postgres ]; then
    "$PGBIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U postgres "$2"
    DB_URL="postgres://postgres@127.0.0.1:$PGPORT/$2"
    DB_ARGS=(--database-pid "$PG_PID")
  else
    DB_URL="sqlite:$WORK/$2.db"
    DB_ARGS=()
  fi
}

run_header() {
  local cpu mem commit
  cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
  mem=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
  commit=$(git rev-parse --short HEAD)
  git diff --quiet HEAD -- . 2>/dev/null || commit="$commit (with uncommitted changes)"
  echo "date:     $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "machine:  $(nproc) cores ($cpu), $mem RAM, $(uname -sr)"
  echo "commit:   $commit"
  echo "command:  $1"
  echo "took:     ${took} s $2"
}
