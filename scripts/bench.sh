#!/usr/bin/env bash
# Reproduces docs/benchmarks.md: builds idemkey in release mode, then for SQLite and for a
# throwaway PostgreSQL (fsync on, default settings) starts `idemkey serve` and runs
# `idemkey bench` in fresh mode (against the unkeyed baseline route, in the same run) and
# replay mode (against the fresh phase of the same run), with the server's CPU per request
# and, for PostgreSQL, the database's (the postmaster and its backends). Loopback only;
# bounded by --requests and --duration.
#
#   scripts/bench.sh [REQUESTS] [CONCURRENCY]
#
# BEFORE=path/to/an/older/idemkey also runs that build's server in the same run (each on its
# own database, loaded by this build's `idemkey bench`), labelled `<store>-before`, so a
# change is measured against what it replaced on the same machine minutes apart.
#
# IDEMKEY_BIN=PATH measures that `idemkey` binary instead of building this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-5000}
CONCURRENCY=${2:-32}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
idemkey_bin
BIN=$IDEMKEY_BIN
work_dir bench

# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh

run_bench() { # $1 = label, then extra `idemkey bench` arguments (--database-pid PID)
  local label=$1; shift
  for mode in fresh replay; do
    "$BIN" bench --url "$SERVER_URL" --token tok_bench --mode "$mode" \
      --requests "$REQUESTS" --concurrency "$CONCURRENCY" --duration 120s \
      --server-pid "$SERVER_PID" "$@" --json >"$OUT/$label-$mode.json"
    echo "== $label $mode"
    python3 - "$OUT/$label-$mode.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
def us(v):
    return "-" if v is None else f"{v:.1f} µs"
for p in r["phases"]:
    print(f'  {p["name"]:<9} {p["requests_per_second"]:>9.1f} req/s  p50 {p["p50_ms"]:.2f} ms  p99 {p["p99_ms"]:.2f} ms  max {p["max_ms"]:.2f} ms'
          f'  cpu/req server {us(p.get("server_cpu_us_per_request"))} database {us(p.get("database_cpu_us_per_request"))}  statuses {p["statuses"]}')
print(f'  ratio {r["ratio"]:.3f}  duplicates {r["effects"]["duplicates"]}  server peak {r["server_peak_rss_kib"]/1024:.1f} MiB')
PY
  done
}

# SQLite
if [ -n "${BEFORE:-}" ]; then
  bench_serve "sqlite:$WORK/before.db" "$BEFORE"
  run_bench sqlite-before
  kill "$SERVER_PID"
fi
bench_serve "sqlite:$WORK/bench.db" "$BIN"
run_bench sqlite
kill "$SERVER_PID"

# PostgreSQL, fsync on: a fresh cluster for each build, so that the second does not run
# on a cluster the first has grown (its checkpoints and autovacuum). PG_PID is the
# postmaster; its children are the backends.
run_postgres() { # $1 = label, $2 = the binary
  start_pg "pg-$1"
  bench_serve "$PG_URL" "$2"
  run_bench "$1" --database-pid "$PG_PID"
  kill "$SERVER_PID"
  wait "$SERVER_PID" 2>/dev/null || true
  stop_pg
}
if [ -n "${BEFORE:-}" ]; then
  run_postgres postgres-before "$BEFORE"
fi
run_postgres postgres "$BIN"
python3 scripts/lib/bench_report.py "$OUT" sqlite-before sqlite postgres-before postgres |
  tee "$OUT/bench.md"
echo "JSON reports and the table (bench.md) in $OUT"

