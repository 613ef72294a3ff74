#!/usr/bin/env bash
# Reproduces docs/benchmarks.md's MariaDB and Galera table: builds idemkey in release mode, then
# starts throwaway servers through the test kit (`idemkey-testkit`'s throwaway_mariadb
# example: MariaDB from the installed packages, on loopback, commits written to the OS but not
# synced) and runs `idemkey serve` on them, loaded by `idemkey bench`:
#
#   mariadb         one MariaDB server: fresh mode (against the unkeyed baseline route, in the
#                   same run) and replay mode (against the fresh phase of the same run), with
#                   the server's CPU per request and mariadbd's;
#   galera-one      a three-node Galera cluster, one serve on node 0: the same two runs
#                   (database CPU: node 0's mariadbd only);
#   galera-three    the same cluster, one serve per node, loaded at once by three fresh-mode
#                   runs, their rates summed: whether write throughput grows with the nodes
#                   (database CPU: the three nodes, per request of the three runs), with the
#                   time Galera's flow control paused replication and the certification
#                   failures meanwhile; their payments are counted together, once each.
#
# Loopback only; each load bounded by --requests and --duration. Needs mariadb-server,
# galera-4 and rsync (docs/guide/getting-started.md). About 3 minutes on 2 cores.
#
#   scripts/bench_mysql.sh [REQUESTS] [CONCURRENCY]
#
# IDEMKEY_BIN=PATH measures that `idemkey` binary instead of building this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-20000}
CONCURRENCY=${2:-32}
OUT=${OUT:-target/bench-results}
mkdir -p "$OUT"
started=$(date +%s)
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
idemkey_bin
cargo build -q -p idemkey-testkit --example throwaway_mariadb
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
work_dir bench-mysql
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh
work_copy_of "$IDEMKEY_BIN"
cp "$TARGET/debug/examples/throwaway_mariadb" "$WORK/throwaway_mariadb"

# start_mariadb [--galera N]: the kit's servers, held until stop_mariadb (or this script's
# end closes the example's standard input); sets DB_URLS and DB_PIDS, one per server.
start_mariadb() {
  local count=${2:-1} url pid
  coproc KIT { "$WORK/throwaway_mariadb" "$@"; }
  MARIADB_PID=$KIT_PID
  PIDS+=("$MARIADB_PID")
  DB_URLS=() DB_PIDS=()
  for _ in $(seq "$count"); do
    if ! read -r url pid <&"${KIT[0]}"; then
      echo "bench_mysql.sh: the throwaway MariaDB ($*) did not start: its error is above" >&2
      exit 1
    fi
    DB_URLS+=("$url") DB_PIDS+=("$pid")
  done
}

stop_mariadb() {
  kill "$MARIADB_PID"
  wait "$MARIADB_PID" || true
}

# wsrep_status URL: the Galera counters that tell why writes on several nodes go no faster
# (`name<TAB>value` lines), read with the `mariadb` client as the URL's user.
wsrep_status() {
  local rest=${1#mysql://} user password port
  user=${rest%%:*} rest=${rest#*:}
  password=${rest%%@*} rest=${rest#*@}
  port=${rest%%/*} port=${port##*:}
  MYSQL_PWD=$password mariadb --no-defaults --protocol=TCP --host=127.0.0.1 --port="$port" \
    --user="$user" --batch --skip-column-names --execute "SHOW GLOBAL STATUS WHERE Variable_name IN
      ('wsrep_flow_control_paused_ns', 'wsrep_local_cert_failures', 'wsrep_local_bf_aborts')"
}

# bench LABEL MODE SERVER_URL SERVER_PID DATABASE_PID [ARGUMENTS]: one `idemkey bench` run,
# its JSON in $OUT/LABEL-MODE.json.
bench() {
  local label=$1 mode=$2 url=$3 server=$4 database=$5
  shift 5
  "$BIN" bench --url "$url" --token tok_bench --mode "$mode" \
    --requests "$REQUESTS" --concurrency "$CONCURRENCY" --duration 120s \
    --server-pid "$server" --database-pid "$database" "$@" --json >"$OUT/$label-$mode.json"
}

# One server.
start_mariadb
bench_serve "${DB_URLS[0]}" "$BIN"
for mode in fresh replay; do
  bench mariadb "$mode" "$SERVER_URL" "$SERVER_PID" "${DB_PIDS[0]}"
done
kill "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
stop_mariadb

# Three nodes: one serve on node 0, then one on each node, loaded at once.
start_mariadb --galera 3
bench_serve "${DB_URLS[0]}" "$BIN"
for mode in fresh replay; do
  bench galera-one "$mode" "$SERVER_URL" "$SERVER_PID" "${DB_PIDS[0]}"
done
SERVE_URLS=("$SERVER_URL") SERVE_PIDS=("$SERVER_PID")
for i in 1 2; do
  bench_serve "${DB_URLS[$i]}" "$BIN"
  SERVE_URLS+=("$SERVER_URL") SERVE_PIDS+=("$SERVER_PID")
done
# The three runs share one database, so each would count the others' payments as its own
# duplicates: they count none, and the payments made are checked against their sum below.
payments() { curl -sf -H "Authorization: Bearer tok_bench" "${SERVE_URLS[0]}/v1/payments?limit=1"; }
before=$(payments)
for i in 0 1 2; do wsrep_status "${DB_URLS[$i]}" >"$WORK/wsrep-before-$i"; done
loads_started=$(date +%s%N)
LOADS=()
for i in 0 1 2; do
  bench "galera-three-node$i" fresh "${SERVE_URLS[$i]}" "${SERVE_PIDS[$i]}" "${DB_PIDS[$i]}" \
    --effects-path "" &
  LOADS+=("$!")
done
for p in "${LOADS[@]}"; do wait "$p"; done
loads_took=$(($(date +%s%N) - loads_started))
for i in 0 1 2; do wsrep_status "${DB_URLS[$i]}" >"$WORK/wsrep-after-$i"; done
after=$(payments)
kill "${SERVE_PIDS[@]}"
wait "${SERVE_PIDS[@]}" 2>/dev/null || true
stop_mariadb
took=$(($(date +%s) - started))

{
  run_header "scripts/bench_mysql.sh $REQUESTS $CONCURRENCY" ""
  echo
  python3 scripts/lib/bench_report.py "$OUT" mariadb galera-one
  echo
  python3 - "$OUT" "$before" "$after" "$WORK" "$loads_took" <<'PY'
import json, os, sys
out, work, loads_took = sys.argv[1], sys.argv[4], int(sys.argv[5]) / 1e9
made = json.loads(sys.argv[3])["total"] - json.loads(sys.argv[2])["total"]
load = lambda label: json.load(open(os.path.join(out, f"{label}.json")))
phase = lambda run, name: next(p for p in run["phases"] if p["name"] == name)
for label in ("mariadb-fresh", "mariadb-replay", "galera-one-fresh", "galera-one-replay"):
    if load(label)["effects"]["duplicates"] != 0:
        sys.exit(f"bench_mysql.sh: {label} made a payment twice")
runs = [load(f"galera-three-node{i}-fresh") for i in range(3)]
def summed(name):
    phases = [phase(run, name) for run in runs]
    n = sum(p["requests"] for p in phases)
    rate = sum(p["requests_per_second"] for p in phases)
    cpu = lambda key: sum(p[key] * p["requests"] for p in phases) / n
    rates = " + ".join(f"{p['requests_per_second']:.0f}" for p in phases)
    return (f"{rate:.0f} req/s ({rates}), p99 {max(p['p99_ms'] for p in phases):.1f} ms,"
            f" CPU µs/req server {cpu('server_cpu_us_per_request'):.0f}"
            f" database {cpu('database_cpu_us_per_request'):.0f}"), rate
keyed, keyed_rate = summed("fresh")
unkeyed, unkeyed_rate = summed("baseline")
one = {name: phase(load("galera-one-fresh"), name)["requests_per_second"] for name in ("baseline", "fresh")}
# Each 2xx made one payment, but for a replay.
expected = sum(sum(n for status, n in p["statuses"].items() if status.startswith("2")) - p["replayed"]
               for run in runs for p in run["phases"])
print("galera-three: three serves, one per node, loaded at once; rates summed")
print(f"  unkeyed {unkeyed}")
print(f"  keyed   {keyed}")
print(f"  keyed / unkeyed {keyed_rate / unkeyed_rate:.3f}; three serves / one (galera-one):"
      f' unkeyed {unkeyed_rate / one["baseline"]:.2f}, keyed {keyed_rate / one["fresh"]:.2f}')
def wsrep(when, i):
    lines = open(os.path.join(work, f"wsrep-{when}-{i}")).read().split("\n")
    return {name: int(value) for name, value in (l.split("\t") for l in lines if l)}
grew = lambda name, i: wsrep("after", i)[name] - wsrep("before", i)[name]
paused = grew("wsrep_flow_control_paused_ns", 0) / 1e9
print(f"  flow control paused replication {paused:.1f} s of the loads' {loads_took:.1f} s;"
      f' certification failures {sum(grew("wsrep_local_cert_failures", i) for i in range(3))},'
      f' brute-force aborts {sum(grew("wsrep_local_bf_aborts", i) for i in range(3))}')
print(f"  payments: {made} made, {expected} expected")
if made != expected:
    sys.exit("bench_mysql.sh: the three runs made a payment twice, or lost one")
PY
} | tee "$OUT/bench_mysql.md"
echo "JSON reports and the summary (bench_mysql.md) in $OUT"
