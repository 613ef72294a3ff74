#!/usr/bin/env bash
# PostgreSQL failover under load (docs/reliability.md). Not part of CI: it needs
# pg_auto_failover (Debian package postgresql-15-auto-failover, installed with apt-get when
# `pg_autoctl` is missing).
#
# In a temporary directory, on 127.0.0.1 and free ports, trust auth on loopback (as the
# `postgres` user when run as root): a pg_auto_failover monitor and two data nodes, a primary
# and a standby with ASYNCHRONOUS replication (the standby has `replication-quorum false`, so
# the primary runs with synchronous_standby_names = ''; checked and printed). In front of
# them, scripts/pg_primary_proxy.py, which forwards every new connection to the primary the
# monitor names (sqlx cannot follow a multi-host URL). `idemkey serve` (release build) talks to
# the proxy. The load is idemkey-server/tests/failover.rs (an #[ignore]d test, run here with
# --ignored): logical payments through the real client, one key each; once a third are done
# it kills the primary's whole node (`kill -9` of its pg_autoctl keeper and postmaster, as a
# machine dying), waits (bounded) for the monitor to promote the standby and keeps the load
# going; every operation is then retried with its key until answered, and every operation is
# sent once more with its key, which re-creates (once) any payment an asynchronous failover
# lost. It reads the new primary and prints one table row (docs/reliability.md's columns).
#
#   scripts/failover.sh                 FAILOVER_OPS=3000 FAILOVER_CONCURRENCY=8
#   FAILOVER_OPS=10000 scripts/failover.sh
#
# The monitor's health checks are shortened (checked every 1 s, a node unhealthy after 5 s,
# the demotion timeout 5 s) so the failover takes seconds, not the defaults' half minute.
# Exits non-zero if the cluster did not come up or fail over in time, or if any operation was
# lost for good, duplicated or orphaned. Everything it started is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export FAILOVER_OPS=${FAILOVER_OPS:-3000}
export FAILOVER_CONCURRENCY=${FAILOVER_CONCURRENCY:-8}
PGBIN=/usr/lib/postgresql/15/bin

if ! command -v pg_autoctl >/dev/null; then
  echo "installing postgresql-15-auto-failover…" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-15-auto-failover >/dev/null
fi

echo "building idemkey (release) and the failover load…" >&2
cargo build --release -q -p idemkey-server
cargo test --release -q -p idemkey-server --test failover --no-run
BIN=$ROOT/target/release/idemkey

WORK=$(mktemp -d /tmp/idemkey-failover.XXXXXX)
chmod 755 "$WORK"
AS_PG=()
if [ "$(id -u)" = 0 ]; then
  chown postgres "$WORK"
  AS_PG=(runuser -u postgres --)
fi
# pg_autoctl keeps its configuration and state under XDG directories: keep them in $WORK.
PGENV=(env "XDG_CONFIG_HOME=$WORK/xdg/config" "XDG_DATA_HOME=$WORK/xdg/data"
  "XDG_RUNTIME_DIR=$WORK/xdg/run" "PG_CONFIG=$PGBIN/pg_config" "PATH=$PGBIN:$PATH")
autoctl() { "${AS_PG[@]}" "${PGENV[@]}" pg_autoctl "$@"; }

GROUPS_STARTED=() # process groups (setsid) of everything started here
cleanup() {
  set +e
  for g in "${GROUPS_STARTED[@]}"; do kill -TERM -- "-$g" 2>/dev/null; done
  sleep 1
  for g in "${GROUPS_STARTED[@]}"; do kill -KILL -- "-$g" 2>/dev/null; done
  for d in monitor node1 node2; do
    [ -f "$WORK/$d/postmaster.pid" ] &&
      "${AS_PG[@]}" "$PGBIN/pg_ctl" -D "$WORK/$d" -m immediate stop >/dev/null 2>&1
  done
  [ -n "${KEEP_WORK:-}" ] && { echo "kept $WORK" >&2; return; }
  rm -rf "$WORK"
}
trap cleanup EXIT
start_group() { # $1 = log file, rest = command; records the group id in LAST_GROUP
  local log=$1
  shift
  setsid "$@" >"$log" 2>&1 </dev/null &
  LAST_GROUP=$!
  GROUPS_STARTED+=("$LAST_GROUP")
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # $1 = seconds, $2 = what, rest = command that succeeds when ready
  local until=$(($(date +%s) + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$until" ]; then
      echo "timed out after $1 s waiting for $what" >&2
      autoctl show state --pgdata "$WORK/monitor" >&2 || true
      exit 1
    fi
    sleep 0.5
  done
}

MON_PORT=$(free_port)
N1_PORT=$(free_port)
N2_PORT=$(free_port)
while [ "$N1_PORT" = "$MON_PORT" ]; do N1_PORT=$(free_port); done
while [ "$N2_PORT" = "$MON_PORT" ] || [ "$N2_PORT" = "$N1_PORT" ]; do N2_PORT=$(free_port); done
PROXY_PORT=$(free_port)
SERVE_PORT=$(free_port)

echo "monitor on 127.0.0.1:$MON_PORT…" >&2
timeout 60 "${AS_PG[@]}" "${PGENV[@]}" pg_autoctl create monitor --pgctl "$PGBIN/pg_ctl" \
  --pgdata "$WORK/monitor" --pgport "$MON_PORT" --hostname 127.0.0.1 --auth trust --no-ssl \
  >"$WORK/monitor-create.log" 2>&1
autoctl config set --pgdata "$WORK/monitor" postgresql.listen_addresses 127.0.0.1 >/dev/null
start_group "$WORK/monitor.log" "${AS_PG[@]}" "${PGENV[@]}" pg_autoctl run --pgdata "$WORK/monitor"
MONITOR_SQL="postgres://postgres@127.0.0.1:$MON_PORT/pg_auto_failover?sslmode=disable"
MONITOR_NODE="postgres://autoctl_node@127.0.0.1:$MON_PORT/pg_auto_failover?sslmode=disable"
wait_for 30 "the monitor" psql -XAtq -d "$MONITOR_SQL" -c 'SELECT 1'
psql -XAtq -d "$MONITOR_SQL" \
  -c "ALTER SYSTEM SET pgautofailover.health_check_period = 1000" \
  -c "ALTER SYSTEM SET pgautofailover.health_check_timeout = 1000" \
  -c "ALTER SYSTEM SET pgautofailover.health_check_max_retries = 1" \
  -c "ALTER SYSTEM SET pgautofailover.health_check_retry_delay = 500" \
  -c "ALTER SYSTEM SET pgautofailover.node_considered_unhealthy_timeout = 5000" \
  -c "ALTER SYSTEM SET pgautofailover.primary_demote_timeout = 5000" \
  -c "SELECT pg_reload_conf()" >/dev/null

state_is() { # $1 = node name, $2 = state (reported and assigned)
  psql -XAtq -d "$MONITOR_SQL" -c "SELECT 1 FROM pgautofailover.node
    WHERE nodename = '$1' AND reportedstate = '$2' AND goalstate = '$2'" | grep -q 1
}
create_node() { # $1 = name, $2 = port, rest = extra options
  local name=$1 port=$2
  shift 2
  start_group "$WORK/$name.log" "${AS_PG[@]}" "${PGENV[@]}" pg_autoctl create postgres \
    --pgctl "$PGBIN/pg_ctl" --pgdata "$WORK/$name" --pgport "$port" --listen 127.0.0.1 \
    --hostname 127.0.0.1 --name "$name" --dbname idemkey --monitor "$MONITOR_NODE" \
    --auth trust --no-ssl "$@" --run
  NODE_GROUP[$name]=$LAST_GROUP
}
declare -A NODE_GROUP
echo "primary node1 on 127.0.0.1:$N1_PORT…" >&2
create_node node1 "$N1_PORT"
wait_for 60 "node1 to be single" state_is node1 single
echo "standby node2 on 127.0.0.1:$N2_PORT (replication-quorum false: asynchronous)…" >&2
create_node node2 "$N2_PORT" --replication-quorum false
wait_for 120 "node2 to be a secondary" state_is node2 secondary
wait_for 60 "node1 to be primary" state_is node1 primary
SYNC_NAMES=$(psql -XAtq -d "postgres://postgres@127.0.0.1:$N1_PORT/idemkey" -c 'SHOW synchronous_standby_names')
NUMBER_SYNC=$(psql -XAtq -d "$MONITOR_SQL" -c "SELECT number_sync_standbys FROM pgautofailover.formation WHERE formationid = 'default'")
echo "replication: number_sync_standbys $NUMBER_SYNC, synchronous_standby_names '$SYNC_NAMES' on node1" >&2
if [ -n "$SYNC_NAMES" ]; then
  echo "expected asynchronous replication (synchronous_standby_names '')" >&2
  exit 1
fi
autoctl show state --pgdata "$WORK/monitor" >&2

echo "proxy on 127.0.0.1:$PROXY_PORT, idemkey serve on 127.0.0.1:$SERVE_PORT…" >&2
start_group "$WORK/proxy.log" python3 "$ROOT/scripts/pg_primary_proxy.py" \
  --listen "127.0.0.1:$PROXY_PORT" --monitor "$MONITOR_SQL"
wait_for 10 "the proxy" grep -q 'primary none -> 127.0.0.1' "$WORK/proxy.log"
DB_URL="postgres://postgres@127.0.0.1:$PROXY_PORT/idemkey"
start_group "$WORK/serve.log" "$BIN" serve --listen "127.0.0.1:$SERVE_PORT" --database-url "$DB_URL" \
  --api-key t1=tok1 --key-secret failover-secret-0123456789abcdef0123456789 --max-connections 16
wait_for 30 "idemkey serve" curl -sf "http://127.0.0.1:$SERVE_PORT/healthz"

N1_POSTMASTER=$(head -1 "$WORK/node1/postmaster.pid")
started=$(date +%s)
export FAILOVER_SERVE_URL="http://127.0.0.1:$SERVE_PORT"
export FAILOVER_DATABASE_URL=$DB_URL
export FAILOVER_MONITOR_URL=$MONITOR_SQL
export FAILOVER_KILL_COMMAND="/bin/kill -KILL -- -${NODE_GROUP[node1]} && { /bin/kill -KILL $N1_POSTMASTER 2>/dev/null; true; }"
export FAILOVER_NOTES="pg_auto_failover 2.0, PostgreSQL 15, async (replication-quorum false, synchronous_standby_names '$SYNC_NAMES', number_sync_standbys $NUMBER_SYNC); monitor checks every 1 s, node unhealthy after 5 s, demote timeout 5 s"
echo "load: $FAILOVER_OPS logical payments, $FAILOVER_CONCURRENCY at a time; node1 killed after a third…" >&2
status=0
timeout 600 cargo test --release -q -p idemkey-server --test failover -- --ignored --nocapture \
  >"$WORK/test.log" 2>&1 || status=$?
took=$(($(date +%s) - started))
grep -a -v '^CHAOS-ROW' "$WORK/test.log" | tail -40 >&2
echo "proxy:" >&2
cat "$WORK/proxy.log" >&2
autoctl show state --pgdata "$WORK/monitor" >&2 || true

# shellcheck source=lib/work.sh
. scripts/lib/work.sh
run_header "FAILOVER_OPS=$FAILOVER_OPS FAILOVER_CONCURRENCY=$FAILOVER_CONCURRENCY scripts/failover.sh" "(load and audit, release build)"
echo
echo "| scenario | logical ops | client-visible failures | duplicates | records without effect | effects without record | time to recover | notes |"
echo "|---|---|---|---|---|---|---|---|"
grep -a -o 'CHAOS-ROW|.*' "$WORK/test.log" | cut -d'|' -f2- | sed 's/^/| /; s/$/ |/'
# scripts/chaos.sh collects the raw rows into its own table.
[ -n "${FAILOVER_RAW_ROWS:-}" ] && { grep -a -o 'CHAOS-ROW|.*' "$WORK/test.log" || true; }
if [ "$status" != 0 ]; then
  echo "FAILED: the failover load or its audit failed (exit $status)" >&2
fi
exit "$status"
