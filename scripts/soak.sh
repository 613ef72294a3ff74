#!/usr/bin/env bash
# Soak (not CI): DURATION of mixed load against one `idemkey serve`, sampling the server's
# resident memory (VmRSS, /proc/PID/status) every INTERVAL seconds. Loopback only; stops by
# itself: the load is a sequence of `idemkey bench --mode mixed` runs, each bounded by
# --requests and --duration, none started past the deadline.
#
#   scripts/soak.sh [DURATION_SECONDS] [STORE]        defaults: 600 sqlite (or postgres)
#
# The mix: 40 % replays of completed keys, 10 % the same keys with another body (422),
# 10 % unkeyed requests, 40 % new keys, 32 clients; each run first makes its warm-up keys.
# Warm-up is the first WARMUP seconds (default: 3/10 of the duration, 180 s of 600): by
# then the replay cache (100 000 entries by default) and the pools have filled. The verdict
# compares the last minute's median VmRSS with the median of the minute after warm-up:
# growth <= 10 % is the target. Samples: $OUT/soak-STORE.csv (seconds, VmRSS KiB).
# IDEMKEY_BIN=PATH measures that `idemkey` binary instead of building this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-600}
STORE=${2:-sqlite}
INTERVAL=${INTERVAL:-5}
WARMUP=${WARMUP:-$((DURATION * 3 / 10))}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
idemkey_bin
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh
work_dir soak
work_copy_of "$IDEMKEY_BIN"


case $STORE in
  sqlite) URL=sqlite:$WORK/soak.db ;;
  postgres) start_pg; URL=$PG_URL ;;
  *) echo "store: sqlite or postgres" >&2; exit 2 ;;
esac
PORT=$(free_port)
"$BIN" serve --listen "127.0.0.1:$PORT" --database-url "$URL" --api-key bench=tok_bench \
  --key-secret bench-secret-0123456789abcdef0123456789 --max-connections 64 >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
PIDS+=("$SERVER_PID")
until_listening "$WORK/serve.log"

CSV=$OUT/soak-$STORE.csv
START=$(date +%s)
DEADLINE=$((START + DURATION))
echo "seconds,vmrss_kib" >"$CSV"
(
  while [ "$(date +%s)" -lt "$DEADLINE" ]; do
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$SERVER_PID/status")
    echo "$(($(date +%s) - START)),$rss" >>"$CSV"
    sleep "$INTERVAL"
  done
) &
SAMPLER_PID=$!
PIDS+=("$SAMPLER_PID")

runs=0 requests=0 statuses=""
while :; do
  left=$((DEADLINE - $(date +%s)))
  [ "$left" -le 5 ] && break
  runs=$((runs + 1))
  "$BIN" bench --url "http://127.0.0.1:$PORT" --token tok_bench --mode mixed \
    --requests 20000 --concurrency 32 --duration "${left}s" --replay-ratio 0.4 \
    --mismatch-ratio 0.1 --unkeyed-ratio 0.1 --json >"$WORK/run.json"
  line=$(python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
n = sum(p["requests"] for p in r["phases"])
s = {}
for p in r["phases"]:
    for k, v in p["statuses"].items():
        s[k] = s.get(k, 0) + v
m = [p for p in r["phases"] if p["name"] == "mixed"][0]
rps, p99 = m["requests_per_second"], m["p99_ms"]
print(n, ",".join(f"{k}:{v}" for k, v in sorted(s.items())), f"{rps:.0f}", f"{p99:.1f}", r["effects"]["duplicates"])
' "$WORK/run.json")
  read -r n st rps p99 dup <<<"$line"
  requests=$((requests + n))
  echo "[$(date +%T)] run $runs: $n requests ($st), mixed $rps req/s, p99 $p99 ms, duplicates $dup, VmRSS $(tail -1 "$CSV" | cut -d, -f2) KiB" >&2
done
wait "$SAMPLER_PID" || true
kill "$SERVER_PID"
wait "$SERVER_PID" || true

python3 - "$CSV" "$WARMUP" "$DURATION" "$STORE" "$runs" "$requests" <<'PY'
import csv, statistics, sys
path, warmup, duration, store, runs, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
rows = [(int(r["seconds"]), int(r["vmrss_kib"])) for r in csv.DictReader(open(path))]
after = [kib for s, kib in rows if warmup <= s < warmup + 60]
last = [kib for s, kib in rows if s >= duration - 60]
start, end = statistics.median(after), statistics.median(last)
growth = (end - start) / start * 100
peak = max(kib for _, kib in rows)
print(f"soak, {store}: {duration} s, {runs} bench runs, {requests} requests, {len(rows)} samples")
print(f"| VmRSS at 10 s | median {warmup}–{warmup + 60} s (after warm-up) | median of the last minute | growth after warm-up | peak | target ≤ 10 % |")
print("|---|---|---|---|---|---|")
first = next((kib for s, kib in rows if s >= 10), rows[0][1])
print(f"| {first / 1024:.1f} MiB | {start / 1024:.1f} MiB | {end / 1024:.1f} MiB | {growth:+.1f} % | {peak / 1024:.1f} MiB | {'met' if growth <= 10 else '**not met**'} |")
PY
