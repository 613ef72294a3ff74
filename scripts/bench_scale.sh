#!/usr/bin/env bash
# The "At scale" figures of docs/benchmarks.md: for SQLite and a throwaway PostgreSQL
# (fsync on, default settings), loopback only, every load bounded by --requests and
# --duration.
#
# Scale run: two databases, one holding SMALL records and one LARGE, bulk-loaded by SQL
# (scripts/lib/bulk.sh: valid completed records of other keys, most in the bench tenant).
# ROUNDS times, alternately on each, a server is started and
#   idemkey bench --mode replay --run-id R      fresh keys, then replays (the replay cache)
# then it is restarted (an empty cache) and the same command replays those keys from the
# database ("db replay"). Ratios LARGE/SMALL of fresh and replay req/s, p99 and server CPU per
# request come from the median of the rounds.
#
# Purge under load (PURGE=1, the default): LARGE expired records are loaded beside the large
# database's live ones, a server starts with --purge-interval 1s (its first round starts at
# once and deletes them in paced batches of at most 1000) and the same fresh load runs while it purges; once
# the server logs the round's end, the same load runs again without a purge, on the same
# server (and the scale run's large database is a second reference). Target: p99 with purge
# <= 2x p99 without.
#
#   scripts/bench_scale.sh [LARGE] [SMALL] [REQUESTS] [CONCURRENCY]
#
# Defaults: 10000000 100000 20000 32. STORES="sqlite postgres" picks the stores, ROUNDS=2,
# PURGE=0 skips the purge run, PURGE_WAIT=1800 bounds the wait for the purge's end (seconds;
# past it, the reference without a purge is the scale run's large server only).
# BULK_ORDER=written loads rows in the order records are written (rows that expire together
# share pages) instead of the default scrambled order (scripts/lib/bulk.sh); ROUNDS=0 runs
# the purge part alone. IDEMKEY_BIN=PATH measures that `idemkey` binary (another build, for
# a before/after pair) instead of building this checkout.
# Needs ~7 GB of disk per 10^7 records (twice that for the purge run); each database is
# deleted as soon as it is measured. Figures: $OUT/scale.md (OUT=target/bench-results).
set -euo pipefail
cd "$(dirname "$0")/.."
LARGE=${1:-10000000}
SMALL=${2:-100000}
REQUESTS=${3:-20000}
CONCURRENCY=${4:-32}
STORES=${STORES:-sqlite postgres}
ROUNDS=${ROUNDS:-2}
PURGE=${PURGE:-1}
PURGE_WAIT=${PURGE_WAIT:-1800}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
idemkey_bin
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh
work_dir scale
work_copy_of "$IDEMKEY_BIN"
"$BIN" bench --help | grep -q -- --run-id || { echo "$IDEMKEY_BIN has no \`bench --run-id\`: too old a build" >&2; exit 1; }

# shellcheck source=lib/bulk.sh
. scripts/lib/bulk.sh

log() { echo "[$(date +%T)] $*" >&2; }

serve() { # $1 = database URL, then extra `serve` arguments; waits until it listens
  local url=$1; shift
  local port; port=$(free_port)
  SERVER_LOG=$WORK/serve-$port.log
  "$BIN" serve --listen "127.0.0.1:$port" --database-url "$url" --api-key bench=tok_bench \
    --key-secret bench-secret-0123456789abcdef0123456789 --max-connections 64 "$@" >"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  PIDS+=("$SERVER_PID")
  until_listening "$SERVER_LOG" 600
  SERVER_URL="http://127.0.0.1:$port"
}

stop() {
  kill "$SERVER_PID"
  wait "$SERVER_PID" || true
  SERVER_PID=""
}

bench() { # $1 = report file, then extra `idemkey bench` arguments
  local file=$1; shift
  "$BIN" bench --url "$SERVER_URL" --token tok_bench --mode replay --requests "$REQUESTS" \
    --concurrency "$CONCURRENCY" --duration 120s --server-pid "$SERVER_PID" "$@" \
    --json >"$file"
}

expired_left() { # $1 = store, $2 = database: expired records not yet purged
  local now; now=$(date +%s%3N)
  local sql="SELECT count(*) FROM idemkey_records WHERE expires_at <= $now"
  case $1 in
    sqlite) sqlite3 "$2" "$sql" ;;
    postgres) psql -qtA "$2" -c "$sql" ;;
  esac
}

for store in $STORES; do
  DBPID_ARGS=()
  case $store in
    sqlite)
      SMALL_URL=sqlite:$WORK/small.db LARGE_URL=sqlite:$WORK/large.db
      LARGE_DB=$WORK/large.db ;;
    postgres)
      start_pg
      for db in small large; do "$PGBIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U postgres $db; done
      SMALL_URL=postgres://postgres@127.0.0.1:$PGPORT/small
      LARGE_URL=postgres://postgres@127.0.0.1:$PGPORT/large
      LARGE_DB=$LARGE_URL
      DBPID_ARGS=(--database-pid "$PG_PID") ;;
  esac
  for size in small large; do
    url=${SMALL_URL}; count=$SMALL
    [ $size = large ] && url=$LARGE_URL count=$LARGE
    "$BIN" migrate --database-url "$url" >/dev/null
    log "$store: loading $count live records"
    start=$(date +%s)
    case $store in
      sqlite) bulk_sqlite "${url#sqlite:}" "$count" live ;;
      postgres) bulk_pg "$url" "$count" live; psql -q "$url" -c CHECKPOINT ;;
    esac
    log "$store: loaded $count in $(($(date +%s) - start)) s"
  done

  for round in $(seq "$ROUNDS"); do
    for size in small large; do
      url=${SMALL_URL}
      [ $size = large ] && url=$LARGE_URL
      id=scale-$store-$size-$round-$RANDOM
      log "$store $size round $round"
      serve "$url"
      bench "$OUT/scale-$store-$size-$round.json" --run-id "$id" "${DBPID_ARGS[@]}"
      stop
      serve "$url"
      bench "$OUT/scale-$store-$size-$round-db.json" --run-id "$id" "${DBPID_ARGS[@]}"
      stop
    done
  done
  case $store in
    sqlite) rm -f "$WORK"/small.db* ;;
    postgres) "$PGBIN/dropdb" -h 127.0.0.1 -p "$PGPORT" -U postgres small ;;
  esac

  if [ "$PURGE" = 1 ]; then
    log "$store: loading $LARGE expired records beside the live ones"
    case $store in
      sqlite) bulk_sqlite "$LARGE_DB" "$LARGE" expired ;;
      postgres) bulk_pg "$LARGE_URL" "$LARGE" expired; psql -q "$LARGE_URL" -c CHECKPOINT ;;
    esac
    serve "$LARGE_URL" --purge-interval 1s
    purge_started=$(date +%s)
    log "$store: purging; fresh load while it runs"
    n=0
    while ! grep -q "purged expired" "$SERVER_LOG" && [ $n -lt 3 ]; do
      n=$((n + 1))
      bench "$OUT/purge-$store-with-$n.json" "${DBPID_ARGS[@]}"
      left=$(expired_left "$store" "$LARGE_DB")
      python3 - "$OUT/purge-$store-with-$n.json" "$left" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
r["expired_left_after"] = int(sys.argv[2])
json.dump(r, open(sys.argv[1], "w"), indent=1)
PY
      log "$store: $left expired records left after load $n"
    done
    finished=false
    for _ in $(seq "$PURGE_WAIT"); do
      grep -q "purged expired" "$SERVER_LOG" && finished=true && break
      sleep 1
    done
    purge_seconds=$(($(date +%s) - purge_started))
    echo "{\"store\": \"$store\", \"purge_seconds\": $purge_seconds, \"expired\": $LARGE, \"finished\": $finished}" \
      >"$OUT/purge-$store-summary.json"
    if $finished; then
      grep "purged expired" "$SERVER_LOG" | head -1 >&2
      log "$store: the same load without a purge"
      for n in 1 2; do bench "$OUT/purge-$store-without-$n.json" "${DBPID_ARGS[@]}"; done
    else
      log "$store: the purge did not end within ${PURGE_WAIT}s; the scale run is the reference"
    fi
    stop
  fi
  case $store in
    sqlite) rm -f "$WORK"/large.db* ;;
    postgres) stop_pg; rm -rf "$WORK/pg"; PGDATA_DIR="" ;;
  esac
done

python3 scripts/lib/scale_report.py "$OUT" "$LARGE" "$SMALL" "$STORES" | tee "$OUT/scale.md"
