#!/usr/bin/env bash
# What a key costs: `idemkey serve`'s keyed `POST /v1/payments` (a new key per request)
# against its unkeyed `POST /v1/baseline/payments` (the same handler and effect in one
# transaction, no idempotency), on one server, by two load generators:
#
#   - wrk (Debian's), ROUNDS alternating rounds of SECONDS each route (unkeyed first in odd
#     rounds, keyed first in even ones), CONNECTIONS keep-alive connections, 2 threads,
#     requests from scripts/lib/payments.lua;
#   - `idemkey bench --mode fresh`, ROUNDS runs of REQUESTS (its unkeyed phase, then keyed).
#
# One row per round: req/s of each route, keyed / unkeyed, and CPU µs per request of the
# server (and of PostgreSQL: the postmaster and its backends) read from /proc around each load.
# A response other than 2xx fails the run. Loopback only; every load is bounded in time.
#
#   scripts/bench_overhead.sh BINARY [ROUNDS] [SECONDS] [CONNECTIONS] [REQUESTS]
#
# STORE=postgres (default sqlite) runs the server on a throwaway PostgreSQL (fsync on,
# default settings). WRK=0 or BENCH=0 leaves out that load generator.
set -euo pipefail
cd "$(dirname "$0")/.."
BINARY=$1
ROUNDS=${2:-3}
SECONDS_EACH=${3:-10}
CONNECTIONS=${4:-32}
REQUESTS=${5:-20000}
STORE=${STORE:-sqlite}
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
work_dir overhead
work_copy_of "$BINARY"
command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }

if [ "$STORE" = postgres ]; then start_pg; fi
bench_database "$STORE" overhead
bench_serve "$DB_URL" "$BIN"
pid=$SERVER_PID

server_ticks() { # user + system clock ticks of the server so far (all its threads)
  awk '{print $14 + $15}' "/proc/$pid/stat"
}
db_ticks() { if [ "$STORE" = postgres ]; then pg_ticks; else echo 0; fi; }
HZ=$(getconf CLK_TCK)

wrk_load() { # $1 = path, $2 = KEYED (0/1), $3 = label; prints "req/s server-µs database-µs"
  local out s0 d0 s1 d1 n rate
  s0=$(server_ticks); d0=$(db_ticks)
  out=$(KEYED=$2 RUN="$3-$RANDOM" wrk -t2 -c"$CONNECTIONS" -d"${SECONDS_EACH}s" \
    -s scripts/lib/payments.lua "$SERVER_URL$1")
  s1=$(server_ticks); d1=$(db_ticks)
  if grep -q 'Non-2xx\|Socket errors' <<<"$out"; then
    echo "$out" >&2
    echo "wrk: responses other than 2xx, or socket errors" >&2
    exit 1
  fi
  n=$(awk '/requests in/ {print $1}' <<<"$out")
  rate=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  python3 -c "import sys; n,s,d,hz=map(float,sys.argv[1:5]); print(f'{float(sys.argv[5]):.0f} {(s*1e6/hz)/n:.0f} {(d*1e6/hz)/n:.0f}')" \
    "$n" "$((s1 - s0))" "$((d1 - d0))" "$HZ" "$rate"
}

echo "store: $STORE; wrk -t2 -c$CONNECTIONS, ${SECONDS_EACH} s a route; idemkey bench --concurrency $CONNECTIONS --requests $REQUESTS"
if [ "${WRK:-1}" = 1 ]; then
  for round in $(seq "$ROUNDS"); do
    if [ $((round % 2)) = 1 ]; then
      read -r u us ud < <(wrk_load /v1/baseline/payments 0 "u$round")
      read -r k ks kd < <(wrk_load /v1/payments 1 "k$round")
    else
      read -r k ks kd < <(wrk_load /v1/payments 1 "k$round")
      read -r u us ud < <(wrk_load /v1/baseline/payments 0 "u$round")
    fi
    python3 -c "import sys; k,u=float(sys.argv[1]),float(sys.argv[2]); print(f'wrk round {sys.argv[3]}: keyed {k:.0f} req/s, unkeyed {u:.0f} req/s, keyed / unkeyed {k/u:.2f}; server CPU µs/req keyed {sys.argv[4]} · unkeyed {sys.argv[5]}' + (f'; database {sys.argv[6]} · {sys.argv[7]}' if sys.argv[8] == 'postgres' else ''))" \
      "$k" "$u" "$round" "$ks" "$us" "$kd" "$ud" "$STORE"
  done
fi
if [ "${BENCH:-1}" = 1 ]; then
  for round in $(seq "$ROUNDS"); do
    "$BIN" bench --url "$SERVER_URL" --token tok_bench --mode fresh \
      --requests "$REQUESTS" --concurrency "$CONNECTIONS" --duration 120s \
      --server-pid "$pid" "${DB_ARGS[@]}" --json >"$WORK/bench-$round.json"
    python3 - "$WORK/bench-$round.json" "$round" "$STORE" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
k = next(p for p in r["phases"] if p["name"] == "fresh")
u = next(p for p in r["phases"] if p["name"] == "baseline")
bad = {s: n for s, n in {**k["statuses"], **u["statuses"]}.items() if not 200 <= int(s) < 300}
if bad or (r.get("effects") or {}).get("duplicates"):
    sys.exit(f"idemkey bench: statuses {bad}, effects {r.get('effects')}")
line = (f'idemkey bench round {sys.argv[2]}: keyed {k["requests_per_second"]:.0f} req/s, '
        f'unkeyed {u["requests_per_second"]:.0f} req/s, keyed / unkeyed '
        f'{k["requests_per_second"] / u["requests_per_second"]:.2f}; server CPU µs/req keyed '
        f'{k["server_cpu_us_per_request"]:.0f} · unkeyed {u["server_cpu_us_per_request"]:.0f}')
if sys.argv[3] == "postgres":
    line += f'; database {k["database_cpu_us_per_request"]:.0f} · {u["database_cpu_us_per_request"]:.0f}'
print(line)
PY
  done
fi
