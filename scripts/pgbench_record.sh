#!/usr/bin/env bash
# What the idempotency record costs PostgreSQL, without idemkey's HTTP server: pgbench (or,
# for sqlx_*, serve's own code) runs the statements of one fresh payment several ways, in
# rounds (every other one in reverse order), on a throwaway PostgreSQL (fsync on, default
# settings), and prints requests per second, the database's CPU µs per request (the
# postmaster, its reaped backends and its live children, from /proc) and each variant's ratio
# to the baseline of the same round. A request is one transaction of the script, except in
# external_grouped (GROUP of them).
#
#   baseline  BEGIN | the payment and its ledger entry | COMMIT   (serve's unkeyed route)
#   claim     BEGIN + the claim's INSERT | the payment | the completing UPDATE + COMMIT
#             (prepared, pipelined: what the statements themselves cost)
#   deferred  BEGIN + an advisory lock + a SELECT of the record | the payment |
#             the completed record's INSERT + COMMIT  (a claim by lock, measured, not built)
#   floor     BEGIN | the payment | the completed record's INSERT + COMMIT  (no claim at all:
#             not a protocol, the least any record written with the effect can cost)
#   sqlx_baseline, sqlx_keyed  serve's unkeyed and keyed routes on PostgreSQL, their own
#             code and messages without the HTTP server (PgStore through sqlx, CLIENTS
#             tasks, a pool connection each: idemkey-server/examples/pg_store_record.rs):
#             what the database allows the messages serve sends, as claim does for the
#             statements bound and pipelined
#   external  the gateway's two durable writes, one record each: the claim's INSERT | the
#             completing UPDATE, each committed alone (no payment: the effect is upstream's)
#   external_grouped  (only when named in VARIANTS) the same writes as the gateway groups
#             them on PostgreSQL: one client (one group at a time), each group one message,
#             one transaction: the reservation of GROUP new records (default 16) and the
#             completions of the GROUP before, as idemkey-postgres/src/group.rs sends them:
#             statements prepared once per connection, EXECUTEd with literal arguments
#
# "|" separates round trips; "+" statements sent in one flight (pgbench's pipeline). The
# statements mirror the store's and the server's SQL (idemkey-postgres/src/store.rs and
# statements.rs, idemkey-server/src/db.rs). Their values have the sizes of a record
# `idemkey serve` writes for `idemkey bench --mode fresh` (read from one: fingerprint parts
# 24 bytes, members 81, response headers 89, body 175, no sealed key).
# Loopback only; each run is bounded by its seconds.
#
#   scripts/pgbench_record.sh [ROUNDS] [SECONDS] [CLIENTS]
#
# VARIANTS="baseline external …" runs those only (the first is the ratios' baseline).
# STORE_RECORD=PATH runs that pg_store_record example binary instead of building it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SECONDS_EACH=${2:-10}
CLIENTS=${3:-32}
# shellcheck source=lib/pg.sh
. scripts/lib/pg.sh
# shellcheck source=lib/work.sh
. scripts/lib/work.sh
work_dir pgbench
start_pg
PSQL=("$PGBIN/psql" -q -X -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres)
for m in idemkey-postgres/migrations/*.sql idemkey-server/migrations/postgres/*.sql; do
  "${PSQL[@]}" -f "$m" >/dev/null
done

KEY="int8send(:k) || '\\x0102030405060708091011121314151617181920212223'::bytea"
ID="tenant = 'bench' AND key_hash = $KEY AND route = 'POST /v1/payments'"
B32="'\\x0102030405060708091011121314151617181920212223242526272829303132'::bytea"
PARTS="'\\x$(printf '%048d' 1)'::bytea"
SEALED=NULL
MEMBERS="'\\x$(printf '%0162d' 4)'::bytea"
HEADERS="'\\x$(printf '%0178d' 5)'::bytea"
BODY_JSON='{"id":"pay_00fcf0c6aa09412a9620df83","amount":100,"currency":"EUR","customer":"bench-0","description":"load test","status":"succeeded","created_at":"2026-12-03T05:56:21.413Z"}'
BODY="convert_to('$BODY_JSON', 'UTF8')"
COLUMNS="tenant, key_hash, route, fingerprint, fingerprint_parts, state, token, lease_expires_at,
  created_at, updated_at, expires_at, sealed_key, fingerprint_members"
CLAIM="INSERT INTO idemkey_records ($COLUMNS) VALUES ('bench', $KEY, 'POST /v1/payments',
  $B32, $PARTS, 'executing', 1, 1800000000000, 1700000000000, 1700000000000, 1700086400000,
  $SEALED, $MEMBERS);"
COMPLETE="WITH done AS (UPDATE idemkey_records SET state = 'completed', token = token + 1,
  lease_expires_at = NULL, response_status = 201, response_headers = $HEADERS,
  response_body = $BODY, updated_at = 1700000000001 WHERE $ID AND token = 1 RETURNING 1)
  SELECT idemkey_expect_owned(count(*)) FROM done;"
COMPLETED="INSERT INTO idemkey_records ($COLUMNS, response_status, response_headers,
  response_body) VALUES ('bench', $KEY, 'POST /v1/payments', $B32, $PARTS, 'completed',
  2, NULL, 1700000000000, 1700000000001, 1700086400000, $SEALED, $MEMBERS, 201, $HEADERS,
  $BODY) ON CONFLICT DO NOTHING;"
PAYMENT="WITH payment AS (INSERT INTO payments (id, tenant, amount, currency, customer,
  description, status, created_at) VALUES ('pay_' || :p || '_' || :k, 'bench', 100,
  'EUR', 'bench-0', 'load test', 'succeeded', '2026-12-03T05:56:21.413Z')
  RETURNING id, tenant, amount, currency, created_at)
  INSERT INTO ledger_entries (payment_id, tenant, amount, currency, created_at)
  SELECT id, tenant, amount, currency, created_at FROM payment;"

# The gateway's grouped writes, GROUP records a group (the statements of
# idemkey-postgres/src/statements.rs's PREPARE_GROUP, prepared once per connection): the
# reservations as one EXECUTE of arrays, a column each, each completion an EXECUTE of its own.
GROUP=${GROUP:-16}
# Values as the gateway writes them, literals, but for the key: the group's :q (19 digits;
# pgbench writes no variable into a literal), the row's number and a filler, as hex; the
# body's bytes as hex.
GKEY="('\\x' || :q || '0ROW010203040506070809101112131415161718192021')::bytea"
GBODY="'\\x$(printf '%s' "$BODY_JSON" | od -An -tx1 | tr -d ' \n')'::bytea"
column() { # $1 = a row's value (ROW: the row's number): GROUP rows' values, an array
  local out="" g
  for g in $(seq "$GROUP"); do out+="${1//ROW/$(printf %02x "$g")}, "; done
  echo "ARRAY[${out%, }]"
}
GROUP_PREPARED="PREPARE ik_reserve_group (text[], bytea[], text[], bytea[], bytea[], text[],
  bigint[], bigint[], bigint[], bytea[], bytea[], bigint[]) AS INSERT INTO idemkey_records
  ($COLUMNS, first_sent) SELECT tenant, key_hash, route, fingerprint, parts, state, 1, lease,
  created, created, expires, sealed, members, first_sent FROM unnest(\$1, \$2, \$3, \$4, \$5,
  \$6, \$7, \$8, \$9, \$10, \$11, \$12) WITH ORDINALITY AS r (tenant, key_hash, route,
  fingerprint, parts, state, lease, created, expires, sealed, members, first_sent, n)
  ORDER BY n ON CONFLICT (tenant, key_hash, route) DO NOTHING RETURNING tenant, key_hash, route\;
PREPARE ik_complete_row (text, bytea, text, bigint, integer, bytea, bytea, bigint) AS
  UPDATE idemkey_records SET state = 'completed', token = token + 1, lease_expires_at = NULL,
  response_status = \$5, response_headers = \$6, response_body = \$7, updated_at = \$8
  WHERE tenant = \$1 AND key_hash = \$2 AND route = \$3 AND token = \$4
  RETURNING tenant, key_hash, route;"
GROUP_CLAIM="EXECUTE ik_reserve_group($(column "'bench'")::text[], $(column "$GKEY")::bytea[],
  $(column "'POST /v1/payments'")::text[], $(column "$B32")::bytea[], $(column "$PARTS")::bytea[],
  $(column "'executing'")::text[], $(column 1800000000000)::bigint[],
  $(column 1700000000000)::bigint[], $(column 1700086400000)::bigint[], $(column NULL)::bytea[],
  $(column "$MEMBERS")::bytea[], $(column NULL)::bigint[]);"
GROUP_COMPLETE=$(for g in $(seq "$GROUP"); do
  printf "EXECUTE ik_complete_row('bench', %s, 'POST /v1/payments', 1, 201, %s, %s, 1700000000001)\\; " \
    "${GKEY//ROW/$(printf %02x "$g")}" "$HEADERS" "$GBODY"
done)
GROUP_COMPLETE="${GROUP_COMPLETE%\\; };"

flight() { # statements, one per argument: one round trip
  if [ $# -gt 1 ]; then echo '\startpipeline'; fi
  # pgbench reads one statement per line
  for s in "$@"; do echo "$s" | tr '\n' ' '; echo; done
  if [ $# -gt 1 ]; then echo '\endpipeline'; fi
}
script() { # $1 = variant
  echo '\set k random(1, 9000000000000000000)'
  echo '\set p random(1, 9000000000000000000)'
  case $1 in
    baseline) flight "BEGIN;"; flight "$PAYMENT"; flight "COMMIT;" ;;
    claim) flight "BEGIN;" "$CLAIM"; flight "$PAYMENT"; flight "$COMPLETE" "COMMIT;" ;;
    deferred)
      flight "BEGIN;" "SELECT pg_advisory_xact_lock(:k);" "SELECT * FROM idemkey_records WHERE $ID;"
      flight "$PAYMENT"; flight "$COMPLETED" "COMMIT;" ;;
    floor) flight "BEGIN;"; flight "$PAYMENT"; flight "$COMPLETED" "COMMIT;" ;;
    external) flight "$CLAIM"; flight "$COMPLETE" ;;
    external_grouped)
      # the keys of this group are completed by the next one (the first completes none)
      echo '\set q random(1000000000000000000, 8999999999999999999)'
      echo '\if :prepared = 0'; echo '\set previous 1000000000000000000'; echo '\set prepared 1'
      flight "$GROUP_PREPARED"; echo '\endif'
      flight "${GROUP_CLAIM%;}\; ${GROUP_COMPLETE//:q/:previous}"; echo '\set previous :q' ;;
  esac
}
read -r -a VARIANTS <<<"${VARIANTS:-baseline claim deferred floor sqlx_baseline sqlx_keyed external}"
for v in "${VARIANTS[@]}"; do
  case $v in sqlx_*) ;; *) script "$v" >"$WORK/$v.sql" ;; esac
done
if [[ " ${VARIANTS[*]}" == *" sqlx_"* ]]; then
  if [ -z "${STORE_RECORD:-}" ]; then
    cargo build --release -q -p idemkey-server --example pg_store_record
    STORE_RECORD=${CARGO_TARGET_DIR:-$PWD/target}/release/examples/pg_store_record
  fi
fi

TICK=$(getconf CLK_TCK)
echo "round variant requests/s db_cpu_us_per_request ratio_to_baseline"
for r in $(seq "$ROUNDS"); do
  # even rounds run the variants in reverse, so that none always follows the same one
  order=("${VARIANTS[@]}")
  if [ $((r % 2)) = 0 ]; then
    order=()
    for ((i = ${#VARIANTS[@]} - 1; i >= 0; i--)); do order+=("${VARIANTS[i]}"); done
  fi
  declare -A RPS=() CPU=()
  for v in "${order[@]}"; do
    before=$(pg_ticks)
    mode=prepared clients=$CLIENTS per=1
    # the gateway's writer: one group at a time, GROUP requests a transaction
    [ "$v" = external_grouped ] && { mode=simple clients=1 per=$GROUP; }
    case $v in
      sqlx_*) load=("$STORE_RECORD" "$PG_URL" "${v#sqlx_}" "$SECONDS_EACH" "$CLIENTS") ;;
      *) load=("$PGBIN/pgbench" -h 127.0.0.1 -p "$PGPORT" -U postgres -n -M "$mode" -D prepared=0
        -c "$clients" -j 2 -T "$SECONDS_EACH" -f "$WORK/$v.sql" postgres) ;;
    esac
    out=$("${load[@]}" 2>&1) || {
      echo "$out" >&2
      exit 1
    }
    case $v in
      sqlx_*) # "N requests, R req/s"
        tx=$(echo "$out" | awk '/requests,/ {print $1}')
        rps=$(echo "$out" | awk '/requests,/ {print $3}') ;;
      *)
        tx=$(echo "$out" | awk '/actually processed/ {split($NF, a, "/"); print a[1]}')
        rps=$(echo "$out" | awk -v per="$per" '/^tps/ {printf "%.0f", $3 * per}') ;;
    esac
    sleep 1 # the backends exit and are reaped into the postmaster's children's time
    after=$(pg_ticks)
    RPS[$v]=$rps
    CPU[$v]=$(((after - before) * 1000000 / TICK / tx / per))
  done
  for v in "${VARIANTS[@]}"; do
    echo "$r $v ${RPS[$v]} ${CPU[$v]} $(echo "${RPS[$v]} ${RPS[${VARIANTS[0]}]}" | awk '{printf "%.2f", $1 / $2}')"
  done
done
