# Sourced by scripts/bench_scale.sh: bulk-loads idempotency records by SQL into a migrated
# database, so that a run meets a table of a given size without making it through the API.
# The rows are valid completed records of other keys: 9 in 10 of the bench tenant (`bench`,
# so live claims land among them in the primary key), the rest of 97 other tenants; key
# hashes and fingerprints are uniform random 32-byte values, like HMAC-SHA256 output; the
# response is a real one's shape (89-byte headers, ~175-byte JSON body).
#
#   bulk_sqlite PATH COUNT live|expired     one transaction, a recursive CTE
#   bulk_pg     URL  COUNT live|expired     INSERT … SELECT … FROM generate_series, the two
#                                           indexes dropped first and rebuilt after
#
# `live` rows were created over the last day and expire within the next (24 h retention);
# `expired` rows expired over the day before now, so the purge deletes every one of them.
#
# BULK_ORDER says where a row's time falls against its place in the table:
#   scrambled (the default)  row i at (i * 7919 ms) mod 24 h: rows that expire together lie
#                            ~10 000 rows apart, so a purge batch touches one page per row
#                            (the worst case for the purge's writes)
#   written                  row i at i / COUNT of the day: the order records are written in,
#                            with one retention for all, so rows that expire together share
#                            pages

# Response headers of a real 201 (content-type, location), as stored.
BULK_HEADERS=000C636F6E74656E742D74797065000000106170706C69636174696F6E2F6A736F6E00086C6F636174696F6E000000292F76312F7061796D656E74732F7061795F663931396330303332393763316563346362313732316435

bulk_offset() { # $1 = row count: the SQL offset of row i in its day, in ms (BULK_ORDER)
  case ${BULK_ORDER:-scrambled} in
    scrambled) echo "(i * 7919) % 86400000" ;;
    written) echo "(i * 86400000 / $1)" ;;
    *) echo "bulk: BULK_ORDER is scrambled or written, not $BULK_ORDER" >&2; return 1 ;;
  esac
}

bulk_created_ms() { # $1 = live|expired: the SQL start of the created_at window, in ms
  local now; now=$(date +%s%3N)
  case $1 in
    live) echo $((now - 86400000)) ;;
    expired) echo $((now - 2 * 86400000 - 60000)) ;;
    *) echo "bulk: live or expired, not $1" >&2; return 1 ;;
  esac
}

bulk_sqlite() {
  local db=$1 count=$2 from at
  from=$(bulk_created_ms "$3") || return 1
  at=$(bulk_offset "$count") || return 1
  # Off for the load only: the server opens the file in WAL mode again.
  sqlite3 "$db" >/dev/null <<SQL
PRAGMA journal_mode = OFF;
PRAGMA synchronous = OFF;
PRAGMA cache_size = -2000000;
BEGIN;
INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint, fingerprint_parts, state,
    token, lease_expires_at, response_status, response_headers, response_body, created_at,
    updated_at, expires_at, sealed_key, fingerprint_members)
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < $count)
SELECT CASE WHEN i % 10 = 0 THEN 'bulk-' || (i % 97) ELSE 'bench' END,
       randomblob(32), 'POST /v1/payments', randomblob(32), randomblob(24), 'completed',
       2, NULL, 201, X'$BULK_HEADERS',
       CAST(printf('{"id":"pay_%024x","amount":%d,"currency":"EUR","customer":"bulk-%d","description":"load test","status":"succeeded","created_at":"2026-01-01T00:00:00.000Z"}',
                   i, 100 + i % 9000, i % 1000) AS BLOB),
       $from + $at, $from + $at + 1, $from + $at + 86400000, NULL, X'01' || randomblob(80)
  FROM n;
COMMIT;
SQL
}

bulk_pg() {
  local url=$1 count=$2 from at
  from=$(bulk_created_ms "$3") || return 1
  at=$(bulk_offset "$count") || return 1
  psql -q -v ON_ERROR_STOP=1 "$url" <<SQL
SET maintenance_work_mem = '1GB';
BEGIN;
ALTER TABLE idemkey_records DROP CONSTRAINT idemkey_records_pkey;
DROP INDEX idemkey_records_expires_at;
INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint, fingerprint_parts, state,
    token, lease_expires_at, response_status, response_headers, response_body, created_at,
    updated_at, expires_at, sealed_key, fingerprint_members)
SELECT CASE WHEN i % 10 = 0 THEN 'bulk-' || (i % 97) ELSE 'bench' END,
       sha256(seed || int8send(i) || '\x01'::bytea), 'POST /v1/payments',
       sha256(seed || int8send(i) || '\x02'::bytea),
       substring(sha256(seed || int8send(i) || '\x03'::bytea) FROM 1 FOR 24), 'completed',
       2, NULL, 201, '\x$BULK_HEADERS'::bytea,
       convert_to(format('{"id":"pay_%s","amount":%s,"currency":"EUR","customer":"bulk-%s","description":"load test","status":"succeeded","created_at":"2026-01-01T00:00:00.000Z"}',
                         lpad(to_hex(i), 24, '0'), 100 + i % 9000, i % 1000), 'UTF8'),
       $from + $at, $from + $at + 1, $from + $at + 86400000, NULL,
       '\x01'::bytea || sha256(seed || int8send(i) || '\x04'::bytea)
           || sha256(seed || int8send(i) || '\x05'::bytea)
           || substring(sha256(seed || int8send(i) || '\x06'::bytea) FROM 1 FOR 16)
  FROM generate_series(1::bigint, $count) AS i,
       (SELECT int8send((random() * 9e18)::bigint) AS seed) AS s;
ALTER TABLE idemkey_records ADD CONSTRAINT idemkey_records_pkey
    PRIMARY KEY (tenant, key_hash, route);
CREATE INDEX idemkey_records_expires_at ON idemkey_records (expires_at);
COMMIT;
VACUUM ANALYZE idemkey_records;
SQL
}
