# Sourced by scripts/bench.sh and scripts/retry_storm.sh: a throwaway PostgreSQL (fsync on,
# default settings) under $WORK, on loopback, run as the `postgres` user when root.
#
#   free_port              prints a free TCP port on 127.0.0.1
#   start_pg [NAME]        initdb + start in $WORK/NAME (default pg); sets PGBIN, AS_PG,
#                          PGDATA_DIR, PGPORT, PG_PID (the postmaster) and PG_URL (…/postgres)
#   stop_pg                stops it (for the caller's EXIT trap; quiet when not started)
#   pg_ticks               CPU clock ticks (user + system) the server has used so far: the
#                          postmaster with its reaped children, and its live children

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_pg() {
  PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  AS_PG=""
  [ "$(id -u)" = 0 ] && AS_PG="runuser -u postgres --"
  PGDATA_DIR=$WORK/${1:-pg}
  mkdir -p "$PGDATA_DIR"
  [ -n "$AS_PG" ] && chown postgres "$WORK" "$PGDATA_DIR"
  $AS_PG "$PGBIN/initdb" -D "$PGDATA_DIR" -A trust -U postgres -E UTF8 --no-locale >/dev/null
  PGPORT=$(free_port)
  $AS_PG "$PGBIN/pg_ctl" -D "$PGDATA_DIR" -l "$WORK/pg.log" -w \
    -o "-p $PGPORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$WORK -c max_connections=200" start >/dev/null
  PG_PID=$(head -1 "$PGDATA_DIR/postmaster.pid")
  PG_URL="postgres://postgres@127.0.0.1:$PGPORT/postgres"
}

stop_pg() {
  if [ -n "${PGDATA_DIR:-}" ]; then
    $AS_PG "$PGBIN/pg_ctl" -D "$PGDATA_DIR" -m fast stop >/dev/null 2>&1 || true
  fi
}

pg_ticks() {
  local t c
  t=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$PG_PID/stat")
  for c in $(pgrep -P "$PG_PID"); do
    t=$((t + $(awk '{print $14 + $15}' "/proc/$c/stat" 2>/dev/null || echo 0)))
  done
  echo "$t"
}
