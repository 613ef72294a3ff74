#!/usr/bin/env bash
# The chaos suite's longer variants, and one table row per scenario.
#
# Runs the chaos tests (idemkey-server/tests/chaos_*.rs, gateway_bad_input.rs,
# slow_clients.rs and idemkey-client/tests/horizon.rs) one at a time with larger figures, then
# scripts/failover.sh and scripts/retry_storm.sh, collects the
# `CHAOS-ROW|…` line each scenario prints, and prints them as a Markdown table with the date,
# the machine, the commit and the command (its columns: docs/reliability.md, "The chaos suite").
#
#   CHAOS_OPS=3000          logical payments per load scenario (CI: 300 / 150 / 20)
#   CHAOS_ITERATIONS=3      PostgreSQL restarts per restart scenario (CI: 1)
#   IDEMKEY_FUZZ_CASES=20000  random requests through the gateway (CI: 1000)
#   CHAOS_SLOW_SOCKETS=300  slow and idle sockets held against serve (CI: 60)
#   CHAOS_LOG=path          where the full test output goes (default: a temporary file)
#   CHAOS_FAILOVER=1        also run scripts/failover.sh (installs pg_auto_failover when
#                           missing; a few minutes); 0 skips it
#
# Needs what `cargo test --workspace` needs (README, "Requirements"): the PostgreSQL server
# binaries; the restart scenarios start servers of their own. Exits non-zero if any scenario
# failed; the table then shows only the scenarios that got to print their row.
set -euo pipefail
cd "$(dirname "$0")/.."

export CHAOS_OPS=${CHAOS_OPS:-3000}
export CHAOS_ITERATIONS=${CHAOS_ITERATIONS:-3}
export IDEMKEY_FUZZ_CASES=${IDEMKEY_FUZZ_CASES:-20000}
export CHAOS_SLOW_SOCKETS=${CHAOS_SLOW_SOCKETS:-300}
LOG=${CHAOS_LOG:-$(mktemp -t idemkey-chaos.XXXXXX)}
: >"$LOG"

server_tests=(chaos_postgres chaos_pgbouncer chaos_sqlite chaos_gateway gateway_bad_input slow_clients)
build_args=()
for t in "${server_tests[@]}"; do build_args+=(--test "$t"); done
echo "building the chaos tests…" >&2
cargo test -q -p idemkey-server "${build_args[@]}" --no-run 2>>"$LOG"
cargo test -q -p idemkey-client --test horizon --no-run 2>>"$LOG"

status=0
started=$(date +%s)
run() { # $1 = package, $2 = test target
  echo "running $2…" >&2
  if ! cargo test -q -p "$1" --test "$2" -- --nocapture --test-threads=1 >>"$LOG" 2>&1; then
    echo "FAILED: $2 (see $LOG)" >&2
    status=1
  fi
}
for t in "${server_tests[@]}"; do run idemkey-server "$t"; done
run idemkey-client horizon
if [[ ${CHAOS_FAILOVER:-1} == 1 ]]; then
  echo "running the failover (pg_auto_failover; CHAOS_FAILOVER=0 skips it)…" >&2
  if ! FAILOVER_RAW_ROWS=1 FAILOVER_OPS=$CHAOS_OPS scripts/failover.sh >>"$LOG" 2>&1; then
    echo "FAILED: scripts/failover.sh (see $LOG)" >&2
    status=1
  fi
fi
echo "running the retry storm…" >&2
if ! BIN=$PWD/target/debug/idemkey scripts/retry_storm.sh >>"$LOG" 2>&1; then
  echo "FAILED: scripts/retry_storm.sh (see $LOG)" >&2
  status=1
fi
took=$(($(date +%s) - started))

# shellcheck source=lib/work.sh
. scripts/lib/work.sh
run_header "CHAOS_OPS=$CHAOS_OPS CHAOS_ITERATIONS=$CHAOS_ITERATIONS IDEMKEY_FUZZ_CASES=$IDEMKEY_FUZZ_CASES CHAOS_SLOW_SOCKETS=$CHAOS_SLOW_SOCKETS scripts/chaos.sh" "(debug build, tests one at a time); full output: $LOG"
echo
echo "| scenario | logical ops | client-visible failures | duplicates | records without effect | effects without record | time to recover | notes |"
echo "|---|---|---|---|---|---|---|---|"
grep -a -o 'CHAOS-ROW|.*' "$LOG" | cut -d'|' -f2- | sed 's/^/| /; s/$/ |/'
echo
grep -a -E '^test result:' "$LOG" | awk '{p += $4; f += $6} END {printf "tests: %d passed, %d failed\n", p, f}'
exit "$status"
