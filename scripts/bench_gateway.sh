#!/usr/bin/env bash
# `idemkey gateway` under load, with its CPU per request (and PostgreSQL's): for SQLite and a
# throwaway PostgreSQL (fsync on), starts an upstream, the gateway in front of it, and runs
# `idemkey bench` in fresh and replay mode through it. Loopback only; bounded by --requests
# and --duration. For before/after (BEFORE), and for the CPU a request costs each process
# beside idempotent-proxy's (PROXY).
#
#   scripts/bench_gateway.sh [REQUESTS] [CONCURRENCY] [ROUNDS]
#
# The upstream is this build's `idemkey serve`, its unkeyed POST /v1/baseline/payments (the
# payment and its ledger entry in one SQLite transaction, no idempotency), so the gateway's
# figures include an upstream that commits each effect. UPSTREAM=path runs another upstream
# instead: a program listening on HOST:PORT from its environment that answers POST /payments
# (EFFECT_DELAY_MS=0 and INJECT_SESSION=0 are set for it).
# BEFORE=path/to/an/older/idemkey runs that build's gateway too, alternating with this
# build's ROUNDS times (default 2), each on a fresh database; labels `<store>-before`.
# STORES=postgres (or sqlite) runs one store only.
# PROXY=path/to/idempotent-proxy-server also runs idempotent-proxy (ldclabs, the other Rust
# idempotency proxy) with a throwaway Redis (redis-server, no persistence) before the same
# upstream, after the gateway in each round; its "store" CPU is Redis's.
# IDEMKEY_BIN=PATH measures that `idemkey` binary instead of building this checkout.
# Reports: $OUT/gateway-LABEL-ROUND-MODE.json (OUT=target/bench-results).
#
# (`idemkey bench`'s fresh mode first runs an unkeyed baseline phase; it goes to the same
# route without a key, so that phase only measures the gateway's pass-through.)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-6000}
CONCURRENCY=${2:-32}
ROUNDS=${3:-2}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
idemkey_bin
BIN=$IDEMKEY_BIN
work_dir bench-gateway
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh
start_pg

if [ -n "${UPSTREAM:-}" ]; then
  [ -x "$UPSTREAM" ] || { echo "no upstream at $UPSTREAM" >&2; exit 2; }
  UP_PORT=$(free_port)
  UP_PATH=/payments
  EFFECT_DELAY_MS=0 INJECT_SESSION=0 PORT=$UP_PORT HOST=127.0.0.1 "$UPSTREAM" >"$WORK/upstream.log" 2>&1 &
  PIDS+=("$!")
else
  bench_serve "sqlite:$WORK/upstream.db" "$BIN"
  UP_PORT=${SERVER_URL##*:}
  UP_PATH=/v1/baseline/payments
fi

load() { # $1 = label, $2 = port, $3 = the proxy's pid, $4 = path, then extra `idemkey bench` arguments
  local label=$1 port=$2 pid=$3 path=$4; shift 4
  for mode in fresh replay; do
    "$BIN" bench --url "http://127.0.0.1:$port" --token tok_bench --mode "$mode" --path "$path" \
      --baseline-path "$path" --effects-path "" --requests "$REQUESTS" \
      --concurrency "$CONCURRENCY" --duration 120s --server-pid "$pid" "$@" --json \
      >"$OUT/gateway-$label-$ROUND-$mode.json"
    python3 - "$OUT/gateway-$label-$ROUND-$mode.json" "$label" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p = r["phases"][-1]
us = lambda v: "-" if v is None else f"{v:.0f} µs"
print(f'{sys.argv[2]:<16} {p["name"]:<7} {p["requests_per_second"]:>8.0f} req/s  p99 {p["p99_ms"]:6.1f} ms'
      f'  cpu/req proxy {us(p.get("server_cpu_us_per_request"))} store {us(p.get("database_cpu_us_per_request"))}'
      f'  statuses {p["statuses"]}')
PY
  done
}

run() { # $1 = label, $2 = binary, $3 = database URL, then extra `idemkey bench` arguments
  local label=$1 bin=$2 db=$3; shift 3
  local port; port=$(free_port)
  "$bin" gateway --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$UP_PORT" \
    --database-url "$db" --key-secret bench-secret-of-at-least-32-bytes --optional-route "POST $UP_PATH" \
    --api-key bench=tok_bench \
    >"$WORK/gateway-$port.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  until_listening "$WORK/gateway-$port.log"
  load "$label" "$port" "$pid" "$UP_PATH" "$@"
  kill "$pid"
}

proxy() { # idempotent-proxy ($PROXY) and a throwaway Redis (no persistence), before the upstream
  local port redis_port redis pid
  port=$(free_port)
  redis_port=$(free_port)
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    >"$WORK/redis-$redis_port.log" 2>&1 &
  redis=$!
  touch "$WORK/.env" # idempotent-proxy refuses to start without one
  (cd "$WORK" && SERVER_ADDR=127.0.0.1:$port URL_UP=http://127.0.0.1:$UP_PORT$UP_PATH \
    REDIS_URL=redis://127.0.0.1:$redis_port exec "$PROXY") >"$WORK/proxy-$port.log" 2>&1 &
  pid=$!
  PIDS+=("$redis" "$pid")
  for _ in $(seq 100); do
    (: </dev/tcp/127.0.0.1/"$port") 2>/dev/null && break
    sleep 0.1
  done
  load idempotent-proxy "$port" "$pid" /URL_UP --database-pid "$redis"
  kill "$pid" "$redis"
}

one() { # $1 = store, $2 = before|after, $3 = round
  local label=$1 bin=$BIN
  [ "$2" = before ] && { label=$1-before; bin=$BEFORE; }
  bench_database "$1" "$2_$3"
  run "$label" "$bin" "$DB_URL" "${DB_ARGS[@]}"
}

# With BEFORE, the two builds alternate which runs first (the first run of a pair tends to be
# the faster): BEFORE first in odd rounds, this build first in even ones.
for n in $(seq "$ROUNDS"); do
  ROUND=$n
  for store in ${STORES:-sqlite postgres}; do
    if [ -z "${BEFORE:-}" ]; then
      one "$store" after "$n"
    elif [ $((n % 2)) = 1 ]; then
      one "$store" before "$n"
      one "$store" after "$n"
    else
      one "$store" after "$n"
      one "$store" before "$n"
    fi
  done
  if [ -n "${PROXY:-}" ]; then proxy; fi
done
echo "JSON reports in $OUT"
