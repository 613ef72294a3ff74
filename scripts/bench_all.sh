#!/usr/bin/env bash
# Every figure docs/benchmarks.md shows, in one run on one commit: records the commit, the
# date and the machine in OUT/run.json, builds idemkey in release mode once, then runs each
# benchmark script with that binary and its OUT set to a subdirectory of OUT, each bounded in
# count and time (PHASE_TIMEOUT seconds, default 1800), in the page's order:
#
#   overhead-sqlite, overhead-postgres   scripts/bench_overhead.sh (wrk and `idemkey bench`)
#   bench              scripts/bench.sh: fresh and replay, SQLite and PostgreSQL (the chart)
#   gateway            scripts/bench_gateway.sh (PROXY=path adds idempotent-proxy)
#   mysql              scripts/bench_mysql.sh: MariaDB and a three-node Galera cluster
#   scale              scripts/bench_scale.sh, only with SCALE=1 (tens of minutes, ~14 GB;
#                      bounded by SCALE_TIMEOUT seconds, default 7200)
#   soak-sqlite, soak-postgres   scripts/soak.sh
#   sqlite-record      the sqlite_record example (the record's cost to SQLite alone)
#   pgbench-record, pgbench-grouped-N   scripts/pgbench_record.sh
#   fingerprint        cargo bench -p idemkey-core --bench fingerprint
#   peers              PEERS=path/to/side_by_side.py (a harness outside this repository);
#                      skipped, and said so in the summary, without it
#
# Then it draws OUT/bench.svg (scripts/bench_chart.py) from this run's JSON and writes
# OUT/summary.md (scripts/lib/bench_summary.py): one table per section of the page. A phase
# that fails or runs out of time is recorded as such (OUT/phases.tsv) and the run goes on.
#
#   scripts/bench_all.sh [OUT]        default OUT: target/bench-results/all-COMMIT
#
# QUICK=1 runs every phase with small counts (a smoke run of a few minutes). It refuses to
# run on a tree with uncommitted changes, whose figures would belong to no commit, unless
# ALLOW_DIRTY=1. Needs what the scripts it runs need (docs/benchmarks.md, "How to reproduce").
set -euo pipefail
cd "$(dirname "$0")/.."
# The whole run is one compound command, read before any of it runs: bash reads a script as it
# goes, and an edit to this file during an hour-long run would otherwise change what runs next.
{
COMMIT=$(git rev-parse --short HEAD)
DIRTY=false
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  DIRTY=true
  if [ "${ALLOW_DIRTY:-0}" != 1 ]; then
    echo "the tree has uncommitted changes: commit them, or run with ALLOW_DIRTY=1" >&2
    exit 2
  fi
fi
OUT=${1:-target/bench-results/all-$COMMIT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
QUICK=${QUICK:-0}
PHASE_TIMEOUT=${PHASE_TIMEOUT:-1800}

# Counts: the page's, or a smoke run's.
if [ "$QUICK" = 1 ]; then
  OVERHEAD=(1 2 32 2000) BENCH=(2000 32) GATEWAY=(2000 32 1) MYSQL=(1000 32)
  SOAK_SECONDS=20 SQLITE_RECORD=(1 2000) PGBENCH=(1 2 32) GROUPED=(1 2 32) GROUPS_LIST=(16)
  SCALE_ARGS=(100000 10000 2000 32) CRITERION=(--warm-up-time 0.2 --measurement-time 0.5)
else
  OVERHEAD=(3 10 32 20000) BENCH=(10000 32) GATEWAY=(20000 32 2) MYSQL=(20000 32)
  SOAK_SECONDS=600 SQLITE_RECORD=(3 20000) PGBENCH=(3 10 32) GROUPED=(2 10 32) GROUPS_LIST=(4 16 48)
  SCALE_ARGS=(10000000 100000 20000 32) CRITERION=(--warm-up-time 1 --measurement-time 3)
fi

started=$(date +%s)
echo "== building idemkey (release) at $COMMIT"
cargo build --release -q -p idemkey-server
cargo build --release -q -p idemkey-server --example pg_store_record --example sqlite_record
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
# Copies, so that a build sharing the target directory cannot replace them mid-run.
BINDIR=$(mktemp -d /tmp/idemkey-bench-all.XXXXXX)
chmod 755 "$BINDIR"
trap 'rm -rf "$BINDIR"' EXIT
cp "$TARGET/release/idemkey" "$TARGET/release/examples/pg_store_record" \
  "$TARGET/release/examples/sqlite_record" "$BINDIR/"
export IDEMKEY_BIN=$BINDIR/idemkey STORE_RECORD=$BINDIR/pg_store_record

python3 - "$OUT/run.json" "$COMMIT" "$DIRTY" "$QUICK" <<'PY'
import json, os, platform, re, subprocess, sys, time

def first_line(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), None)
mem_kib = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
pg_bins = sorted(
    (d for d in os.listdir("/usr/lib/postgresql") if d.isdigit()), key=int
) if os.path.isdir("/usr/lib/postgresql") else []
postgres = first_line([f"/usr/lib/postgresql/{pg_bins[-1]}/bin/postgres", "--version"]) if pg_bins else None
mariadb = first_line(["mariadbd", "--version"]) or first_line(["/usr/sbin/mariadbd", "--version"])
json.dump({
    "commit": sys.argv[2],
    "dirty": sys.argv[3] == "true",
    "quick": sys.argv[4] == "1",
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "machine": {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_kib / 1048576, 1),
        "kernel": platform.release(),
        "postgresql": postgres,
        "mariadb": mariadb,
    },
}, open(sys.argv[1], "w"), indent=2)
PY
printf 'phase\tstatus\tseconds\n' >"$OUT/phases.tsv"

# phase NAME COMMAND...: runs COMMAND with OUT=OUT/NAME, its output in OUT/NAME/log.txt,
# bounded by PHASE_TIMEOUT; records its exit status and duration, and goes on either way.
phase() {
  local name=$1 t0 status=0
  shift
  mkdir -p "$OUT/$name"
  echo "== $name: $*"
  t0=$(date +%s)
  OUT=$OUT/$name timeout --signal=TERM --kill-after=30 "$PHASE_TIMEOUT" "$@" \
    >"$OUT/$name/log.txt" 2>&1 || status=$?
  printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" >>"$OUT/phases.tsv"
  if [ "$status" = 0 ]; then
    echo "   done in $(($(date +%s) - t0)) s"
  else
    [ "$status" = 124 ] && status="out of time"
    echo "   FAILED ($status) after $(($(date +%s) - t0)) s; see $OUT/$name/log.txt"
  fi
}
skip() { # NAME REASON
  mkdir -p "$OUT/$1"
  echo "$2" >"$OUT/$1/skipped.txt"
  printf '%s\tskipped\t0\n' "$1" >>"$OUT/phases.tsv"
  echo "== $1: SKIPPED: $2"
}

WRK=1
if ! command -v wrk >/dev/null; then
  WRK=0
  echo "wrk: not installed, so the overhead runs use \`idemkey bench\` only (apt-get install wrk)" |
    tee "$OUT/wrk-missing.txt"
fi
for store in sqlite postgres; do
  phase "overhead-$store" env STORE=$store WRK=$WRK scripts/bench_overhead.sh "$IDEMKEY_BIN" "${OVERHEAD[@]}"
done
phase bench scripts/bench.sh "${BENCH[@]}"
if [ -n "${PEERS:-}" ]; then
  # The harness starts `serve` on PostgreSQL too, which refuses to start without a key secret.
  phase peers env IDEMKEY_KEY_SECRET="${IDEMKEY_KEY_SECRET:-$(openssl rand -hex 32)}" \
    python3 "$PEERS" "$IDEMKEY_BIN" --seconds "$([ "$QUICK" = 1 ] && echo 2 || echo 8)"
else
  skip peers "the peers' harness is outside this repository: PEERS=path/to/side_by_side.py runs it"
fi
phase gateway scripts/bench_gateway.sh "${GATEWAY[@]}"
[ -n "${PROXY:-}" ] || echo "   (idempotent-proxy not run: PROXY=path/to/idempotent-proxy-server runs it beside the gateway)"
phase mysql scripts/bench_mysql.sh "${MYSQL[@]}"
if [ "${SCALE:-0}" = 1 ]; then
  PHASE_TIMEOUT=${SCALE_TIMEOUT:-7200} phase scale scripts/bench_scale.sh "${SCALE_ARGS[@]}"
else
  skip scale "the 10^7-record scale and purge runs take tens of minutes and ~14 GB: SCALE=1 runs them"
fi
for store in sqlite postgres; do
  phase "soak-$store" scripts/soak.sh "$SOAK_SECONDS" "$store"
done
phase sqlite-record "$BINDIR/sqlite_record" "${SQLITE_RECORD[@]}"
phase pgbench-record scripts/pgbench_record.sh "${PGBENCH[@]}"
for group in "${GROUPS_LIST[@]}"; do
  phase "pgbench-grouped-$group" env GROUP="$group" VARIANTS="baseline external_grouped" \
    scripts/pgbench_record.sh "${GROUPED[@]}"
done
phase fingerprint cargo bench -q -p idemkey-core --bench fingerprint -- "${CRITERION[@]}"

echo "== chart and summary"
python3 scripts/bench_chart.py "$OUT/bench" -o "$OUT/bench.svg" --commit "$COMMIT" \
  --date "$(date -u +%Y-%m-%d)" || echo "   no chart: bench produced no reports"
python3 scripts/lib/bench_summary.py "$OUT" >"$OUT/summary.md"
echo "took $(($(date +%s) - started)) s; the figures in $OUT/summary.md"
exit
}
