#!/usr/bin/env bash
# A retry storm on one key must not slow anyone else (docs/reliability.md). Starts a throwaway
# PostgreSQL and `idemkey serve --simulate-latency MS` (each payment waits that long inside
# its transaction), then times five fresh payments of tenant B alone, and again while 150
# duplicates of one payment of tenant A are in flight. Prints both and their ratio.
# Loopback only; bounded (one storm).
#
#   scripts/retry_storm.sh [LATENCY_MS] [DUPLICATES]
#
# BIN=path/to/idemkey uses that build instead of building this one in release mode; it needs
# the `simulate` feature (as `cargo test` builds it) for --simulate-latency.
set -euo pipefail
cd "$(dirname "$0")/.."
LATENCY=${1:-4000}
DUPLICATES=${2:-150}
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p idemkey-server --features simulate
  BIN=$PWD/target/release/idemkey
fi
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
work_dir storm
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh

start_pg

PORT=$(free_port)
"$BIN" serve --listen "127.0.0.1:$PORT" --database-url "$PG_URL" \
  --api-key a=tok_a --api-key b=tok_b --key-secret storm-secret-0123456789abcdef0123456789 --simulate-latency "$LATENCY" \
  >"$WORK/serve.log" 2>&1 &
PIDS+=($!)
until_listening "$WORK/serve.log"
URL="http://127.0.0.1:$PORT/v1/payments"

pay() { # $1 token, $2 key, $3 customer; prints "status seconds"
  curl -s -o /dev/null -w '%{http_code} %{time_total}\n' -X POST "$URL" \
    -H "Authorization: Bearer $1" -H "Idempotency-Key: $2" -H 'Content-Type: application/json' \
    -d "{\"amount\":100,\"currency\":\"EUR\",\"customer\":\"$3\"}"
}
five_of_b() { # $1 label
  for i in 1 2 3 4 5; do pay tok_b "$1-$i" b & done | sort -k2 -n | tail -1
}

alone=$(five_of_b alone)
STORM=()
for _ in $(seq "$DUPLICATES"); do pay tok_a storm-key a >>"$WORK/storm.txt" & STORM+=($!); done
sleep 0.5 # let the storm arrive before the five
during=$(five_of_b during)
wait "${STORM[@]}"
# Payments of tenant a: the storm's one operation must have made exactly one.
total_a=$(curl -s -H "Authorization: Bearer tok_a" "$URL?limit=1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["total"])')
python3 - "$alone" "$during" "$WORK/storm.txt" "$LATENCY" "$DUPLICATES" "$total_a" <<'PY'
import sys
alone, during, storm, latency, dups, total_a = sys.argv[1:7]
duplicates = int(total_a) - 1
a = float(alone.split()[1]); d = float(during.split()[1])
statuses = {}
for line in open(storm):
    s = line.split()[0]
    statuses[s] = statuses.get(s, 0) + 1
print(f"--simulate-latency {latency}: five fresh payments of tenant b, slowest: alone {a:.2f} s ({alone.split()[0]}), "
      f"during a storm of {dups} duplicates on one key of tenant a {d:.2f} s ({during.split()[0]}); ratio {d / a:.2f}")
print(f"the storm's answers: {statuses}")
ok = (statuses == {"201": int(dups)} and alone.split()[0] == "201" and during.split()[0] == "201"
      and duplicates == 0)
# The row scripts/chaos.sh collects (columns as in docs/reliability.md).
print(f"CHAOS-ROW|retry storm: {dups} duplicates of one payment in flight, five fresh payments of another tenant"
      f"|6|{0 if ok else 'see notes'}|{duplicates}|-|-|-|--simulate-latency {latency}: the five took {a:.2f} s alone and {d:.2f} s during the storm, "
      f"ratio {d / a:.2f} (target <= 1.2); the storm's answers {statuses}")
sys.exit(0 if ok else 1)
PY
