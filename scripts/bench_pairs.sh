#!/usr/bin/env bash
# Alternating pairs of two builds: for each pair, `idemkey serve` of BEFORE and of AFTER
# (BEFORE first in odd pairs, AFTER first in even ones: the first run of a pair tends to be
# the faster), each on a fresh database, loaded by AFTER's `idemkey bench --mode fresh` (the
# unkeyed baseline phase, then fresh keys). One row per run: fresh req/s, the server's CPU µs
# per fresh request, p99, fresh / baseline, the baseline's req/s and server CPU, the
# database's CPU per fresh request (PostgreSQL), and the server's context switches per
# request (voluntary + involuntary, all its threads, from /proc, over both phases).
# Loopback only; bounded by --requests and --duration.
#
#   scripts/bench_pairs.sh BEFORE AFTER [PAIRS] [REQUESTS] [CONCURRENCY]
#
# MODE=replay loads `--mode replay` instead (fresh keys, then the same keys again): the row
# then shows the replay phase, and replay / fresh in place of fresh / baseline.
# BEFORE and AFTER are paths to `idemkey` release binaries. STORE=postgres (default sqlite)
# runs them on a throwaway PostgreSQL (fsync on, default settings), a fresh database of one
# cluster per run.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1
AFTER=$2
PAIRS=${3:-4}
REQUESTS=${4:-10000}
CONCURRENCY=${5:-32}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
work_dir pairs
STORE=${STORE:-sqlite}
MODE=${MODE:-fresh}
if [ "$STORE" = postgres ]; then
  start_pg
fi

switches() { # $1 = pid: context switches of all its threads so far
  cat /proc/"$1"/task/*/status | awk '/ctxt_switches/ {n += $2} END {print n}'
}

run() { # $1 = label, $2 = binary
  local pid before
  bench_database "$STORE" "${1//-/_}"
  bench_serve "$DB_URL" "$2"
  pid=$SERVER_PID
  before=$(switches "$pid")
  "$AFTER" bench --url "$SERVER_URL" --token tok_bench --mode "$MODE" \
    --requests "$REQUESTS" --concurrency "$CONCURRENCY" --duration 120s \
    --server-pid "$pid" "${DB_ARGS[@]}" --json >"$OUT/pairs-$1.json"
  echo "$(($(switches "$pid") - before))" >"$OUT/pairs-$1.switches"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  python3 - "$1" "$OUT/pairs-$1.json" "$OUT/pairs-$1.switches" "$MODE" <<'PY'
import json, sys
label, path, switches, mode = sys.argv[1], sys.argv[2], int(open(sys.argv[3]).read()), sys.argv[4]
r = json.load(open(path))
if mode == "replay":  # the replay phase, against the fresh phase before it
    fresh = next(p for p in r["phases"] if p["name"] == "replay")
    base = next(p for p in r["phases"] if p["name"] == "fresh")
else:
    fresh = next(p for p in r["phases"] if p["name"] == "fresh")
    base = next(p for p in r["phases"] if p["name"] == "baseline")
total = sum(p["requests"] for p in r["phases"])
db = fresh.get("database_cpu_us_per_request")
print(f'{label:<12} {fresh["requests_per_second"]:7.0f} req/s · '
      f'{fresh["server_cpu_us_per_request"]:4.0f} µs · p99 {fresh["p99_ms"]:5.1f} ms · '
      f'/ {base["name"]} {fresh["requests_per_second"] / base["requests_per_second"]:.2f} '
      f'({base["requests_per_second"]:.0f} req/s, {base["server_cpu_us_per_request"]:.0f} µs) · '
      + (f'database {db:.0f} µs · ' if db is not None else '')
      + f'{switches / total:4.1f} switches/req · {fresh["statuses"]} · '
      f'duplicates {(r.get("effects") or {}).get("duplicates")}')
PY
}

for pair in $(seq "$PAIRS"); do
  if [ $((pair % 2)) = 1 ]; then
    run "before-$pair" "$BEFORE"
    run "after-$pair" "$AFTER"
  else
    run "after-$pair" "$AFTER"
    run "before-$pair" "$BEFORE"
  fi
done
