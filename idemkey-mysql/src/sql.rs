//! The store's SQL, one statement per `Store`/`StoreAdmin` method, with `?` parameters in
//! the order of the binds beside them (`store.rs`): MySQL numbers none. Every statement is
//! one both MariaDB (10.6 and later) and MySQL 8 accept.

/// The columns of a record as `idemkey_sqlx::RecordRow` reads them: the tenant and the
/// route are bytes in the table (compared byte for byte, see migration 0001), text here.
macro_rules! select_record {
    () => {
        "SELECT CAST(tenant AS CHAR) AS tenant, key_hash, CAST(route AS CHAR) AS route,
                fingerprint, fingerprint_parts, state, token, lease_expires_at,
                response_status, response_headers, response_body, created_at, updated_at,
                expires_at, sealed_key, fingerprint_members, first_sent
           FROM idemkey_records "
    };
}

/// A record's identity, the last three parameters of a statement that finds one.
macro_rules! by_id {
    () => {
        "tenant = ? AND key_hash = ? AND route = ?"
    };
}

/// The claim: a plain `INSERT`. It owns the key when it inserted the row; a taken key is
/// error 1062. Not `INSERT IGNORE`, which would also turn a value that does not fit (a
/// tenant too long, a NULL) into a warning and a row cut to fit, and not
/// `ON DUPLICATE KEY UPDATE`, whose count of affected rows sqlx's `CLIENT_FOUND_ROWS`
/// makes the same for "inserted" and "found". MySQL 8 has no `INSERT … RETURNING`.
/// Parameters: the identity, the record's values (`values` in `store.rs`), then its token.
pub(crate) const INSERT: &str = "INSERT INTO idemkey_records
        (tenant, key_hash, route, fingerprint, fingerprint_parts, state, lease_expires_at,
         created_at, updated_at, expires_at, sealed_key, fingerprint_members, first_sent, token)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

/// A plain (consistent) read of one record: it never waits on a lock.
pub(crate) const FETCH: &str = concat!(select_record!(), "WHERE ", by_id!());

/// The claim's read of the record that took the key, after its `INSERT` met it (1062): a
/// locking read. Under REPEATABLE READ a plain read answers from the transaction's snapshot,
/// which may predate the winner's commit (when the transaction read anything before the
/// claim, or lost a round of the claim already); a locking read reads the latest committed
/// row. The duplicate-key check left this transaction a shared lock on that row, so this
/// read does not wait. `LOCK IN SHARE MODE`, not `FOR SHARE`: MariaDB knows only the first.
pub(crate) const FETCH_LOCKED: &str =
    concat!(select_record!(), "WHERE ", by_id!(), " LOCK IN SHARE MODE");

/// The takeover: the record's values, then the identity and the token it must still carry.
/// An `UPDATE` reads the latest committed row whatever the snapshot.
pub(crate) const REPLACE: &str = concat!(
    "UPDATE idemkey_records
        SET fingerprint = ?, fingerprint_parts = ?, state = ?, lease_expires_at = ?,
            created_at = ?, updated_at = ?, expires_at = ?, sealed_key = ?,
            fingerprint_members = ?, first_sent = ?, token = token + 1,
            response_status = NULL, response_headers = NULL, response_body = NULL
      WHERE ",
    by_id!(),
    " AND token = ?"
);

// The token-guarded writes below tell "matched" from the count of affected rows: sqlx
// connects with `CLIENT_FOUND_ROWS`, so a row matched but left unchanged (a renewal to the
// same time) counts too.

/// The completion: the response and its time, then the identity and the owner's token.
pub(crate) const COMPLETE: &str = concat!(
    "UPDATE idemkey_records
        SET state = 'completed', token = token + 1, lease_expires_at = NULL,
            response_status = ?, response_headers = ?, response_body = ?, updated_at = ?
      WHERE ",
    by_id!(),
    " AND token = ?"
);

/// The lease and the time, then the identity and the owner's token.
pub(crate) const RENEW: &str = concat!(
    "UPDATE idemkey_records SET lease_expires_at = ?, updated_at = ? WHERE ",
    by_id!(),
    " AND token = ?"
);

/// The lease and the time, then the identity and the owner's token.
pub(crate) const MARK_EXECUTING: &str = concat!(
    "UPDATE idemkey_records SET state = 'executing', lease_expires_at = ?, updated_at = ?
      WHERE ",
    by_id!(),
    " AND token = ?"
);

/// The time, then the identity and the owner's token.
pub(crate) const MARK_INDETERMINATE: &str = concat!(
    "UPDATE idemkey_records SET state = 'indeterminate', lease_expires_at = NULL, updated_at = ?
      WHERE ",
    by_id!(),
    " AND token = ?"
);

/// The identity and the owner's token.
pub(crate) const RELEASE: &str = concat!(
    "DELETE FROM idemkey_records WHERE ",
    by_id!(),
    " AND token = ?"
);

/// Each filter twice (`? IS NULL OR column = ?`), then the limit.
pub(crate) const LIST: &str = concat!(
    select_record!(),
    "WHERE (? IS NULL OR tenant = ?) AND (? IS NULL OR state = ?)
       AND (? IS NULL OR created_at < ?)
     ORDER BY created_at DESC LIMIT ?"
);

pub(crate) const FIND_BY_KEY: &str = concat!(
    select_record!(),
    "WHERE tenant = ? AND key_hash = ? ORDER BY created_at"
);

pub(crate) const EVICT: &str = concat!("DELETE FROM idemkey_records WHERE ", by_id!());

/// A purge batch's rows: now, from, the batch size. In `expires_at` order, from `from` on
/// the index. `SKIP LOCKED` (MariaDB 10.6, MySQL 8.0.1): rows that live traffic holds (a
/// takeover in progress) are left for the next round instead of blocking it. The rows are
/// then deleted by primary key in the same transaction, which holds their locks.
pub(crate) const PURGE_SELECT: &str = "SELECT tenant, key_hash, route, expires_at
       FROM idemkey_records
      WHERE expires_at <= ? AND expires_at >= ?
      ORDER BY expires_at LIMIT ?
        FOR UPDATE SKIP LOCKED";

/// Followed by one `(?, ?, ?)` per row of [`PURGE_SELECT`].
pub(crate) const PURGE_DELETE: &str =
    "DELETE FROM idemkey_records WHERE (tenant, key_hash, route) IN ";

pub(crate) const APPEND_AUDIT: &str =
    "INSERT INTO idemkey_audit (tenant, key_hash, route, at, actor, action, detail)
     VALUES (?, ?, ?, ?, ?, ?, ?)";

pub(crate) const AUDIT: &str = concat!(
    "SELECT CAST(tenant AS CHAR) AS tenant, key_hash, CAST(route AS CHAR) AS route, at,
            actor, action, detail
       FROM idemkey_audit WHERE ",
    by_id!(),
    " ORDER BY id"
);
