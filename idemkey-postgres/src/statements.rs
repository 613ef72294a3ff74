//! Statement text and SQLSTATEs the store's claims and completions share.

use std::time::Duration;

use idemkey_core::{Members, NewRecord, RecordId, StoredResponse, Timestamp};

use crate::literal::{Bind, Sql};

/// SQLSTATE `idemkey_expect_owned` raises (migration 0005): the completion matched no row
/// carrying the owner's token.
pub(crate) const NOT_OWNED: &str = "IK001";

/// SQLSTATE 23505 unique_violation.
pub(crate) const UNIQUE_VIOLATION: &str = "23505";

/// SQLSTATE 26000 invalid_sql_statement_name: the connection has not prepared the
/// statement (yet).
pub(crate) const UNDEFINED_PREPARED: &str = "26000";

/// SQLSTATE 42P05 duplicate_prepared_statement: the connection has prepared the statement
/// already.
pub(crate) const DUPLICATE_PREPARED: &str = "42P05";

/// The two statements [`PgStore::begin_claim`](idemkey_core::Store::begin_claim) and
/// [`PgStore::complete_and_commit`](idemkey_core::Store::complete_and_commit) send with
/// `BEGIN` and `COMMIT`, prepared once per connection (in the message of its first claim),
/// so the server plans them once, not on every call. The completion is guarded by
/// `idemkey_expect_owned` (migration 0005): it fails, and so skips the `COMMIT` sent after it,
/// unless it matched the owner's row.
pub(crate) const PREPARE: &str = "\
PREPARE idemkey_claim_v3 (text, bytea, text, bytea, bytea, text, bigint, bigint, bigint, bytea, \
                          bytea, bigint, bigint) AS
    INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint, fingerprint_parts, state,
                                 token, lease_expires_at, created_at, updated_at, expires_at,
                                 sealed_key, fingerprint_members, first_sent)
    VALUES ($1, $2, $3, $4, $5, $6, $13, $7, $8, $8, $9, $10, $11, $12);
PREPARE idemkey_complete_v1 (text, bytea, text, bigint, integer, bytea, bytea, bigint) AS
    WITH done AS (
        UPDATE idemkey_records
           SET state = 'completed', token = token + 1, lease_expires_at = NULL,
               response_status = $5, response_headers = $6, response_body = $7,
               updated_at = $8
         WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4
        RETURNING 1
    )
    SELECT idemkey_expect_owned(count(*)) FROM done";

/// The statements of grouped writes ([`GroupWriter`](idemkey_sqlx::group::GroupWriter)),
/// prepared once per connection (in the message of its first group), as [`PREPARE`]'s are.
/// The reservation takes its rows as arrays, a column each, and inserts them in their
/// order; a completion is one row's (see `complete_group` in `group.rs`). Each returns the
/// keys it wrote. Each answers without rows.
pub(crate) const PREPARE_GROUP: [&str; 2] = [
    "PREPARE idemkey_reserve_group_v2 (text[], bytea[], text[], bytea[], bytea[], text[], bigint[],
                                  bigint[], bigint[], bytea[], bytea[], bigint[], bigint[]) AS
    INSERT INTO idemkey_records (tenant, key_hash, route, fingerprint, fingerprint_parts, state,
                                 token, lease_expires_at, created_at, updated_at, expires_at,
                                 sealed_key, fingerprint_members, first_sent)
    SELECT tenant, key_hash, route, fingerprint, parts, state, token, lease, created, created,
           expires, sealed, members, first_sent
      FROM unnest($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
           WITH ORDINALITY AS r (tenant, key_hash, route, fingerprint, parts, state, lease,
                                 created, expires, sealed, members, first_sent, token, n)
     ORDER BY n
    ON CONFLICT (tenant, key_hash, route) DO NOTHING
    RETURNING tenant, key_hash, route",
    "PREPARE idemkey_complete_row_v1 (text, bytea, text, bigint, integer, bytea, bytea, bigint) AS
    UPDATE idemkey_records
       SET state = 'completed', token = token + 1, lease_expires_at = NULL,
           response_status = $5, response_headers = $6, response_body = $7, updated_at = $8
     WHERE tenant = $1 AND key_hash = $2 AND route = $3 AND token = $4
    RETURNING tenant, key_hash, route",
];

/// The SQLSTATE of a database error.
pub(crate) fn code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Appends to a message that begins a transaction the statement that makes the
/// transaction's statements wait at most `wait` for a lock (then fail with SQLSTATE 55P03,
/// read as "busy"). Transaction-local, so it holds behind a pooler in transaction mode; a
/// `SET`, not a `SELECT set_config(…)`, so the server plans nothing and sends no row.
pub(crate) fn set_lock_wait(sql: &mut Sql, wait: Duration) {
    sql.push("; SET LOCAL lock_timeout = '")
        .int(wait.as_millis().max(1).try_into().unwrap_or(i64::MAX))
        .push("ms'");
}

/// A new record's values, in the order every statement that writes one takes them (the
/// claim's `INSERT`, the prepared `idemkey_claim_v3`, the replace, the grouped reservation):
/// tenant, key hash, route, fingerprint, its parts, state, lease, creation time, expiry,
/// sealed key, fingerprint members, first sent.
pub(crate) fn bind_record<B: Bind>(b: B, r: &NewRecord) -> B {
    b.bind_id(&r.id)
        .bind(&r.fingerprint.digest[..])
        .bind(r.fingerprint.parts.to_bytes())
        .bind(r.state.as_str())
        .bind(r.lease_expires_at.map(Timestamp::as_millis))
        .bind(r.now.as_millis())
        .bind(r.expires_at.as_millis())
        .bind(r.sealed_key.as_deref())
        .bind(r.fingerprint.members.as_ref().map(Members::to_bytes))
        .bind(r.first_sent.map(Timestamp::as_millis))
}

/// A new record's values as the statements that insert one take them (the claim's `INSERT`,
/// the prepared `idemkey_claim_v3`, the grouped reservation): [`bind_record`]'s, then the
/// token the record starts at.
pub(crate) fn bind_new_record<B: Bind>(b: B, r: &NewRecord) -> B {
    bind_record(b, r).bind(r.token)
}

/// A completion's values, in the order every statement that stores one takes them (the
/// plain `UPDATE`, the prepared `idemkey_complete_v1`, a row of the grouped completion): the
/// record's identity, the owner's token, the response's status, headers and body, when it
/// was written.
pub(crate) fn bind_completion<B: Bind>(
    b: B,
    id: &RecordId,
    token: i64,
    response: &StoredResponse,
    now: Timestamp,
) -> B {
    b.bind_id(id)
        .bind(token)
        .bind(i32::from(response.status))
        .bind(response.encode_headers())
        .bind(&response.body[..])
        .bind(now.as_millis())
}
