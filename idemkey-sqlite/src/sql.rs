//! The SQL of the SQLite stores, one statement per `Store` method: `SqliteStore` runs it
//! through sqlx, `RusqliteStore` through rusqlite, with the same `?N` parameters, built once
//! (`params.rs`). A record's values are `?1`–`?12` of both `INSERT` and `REPLACE`; `?13` is
//! the token the `INSERT` starts the record at, and the token `REPLACE` finds.

pub(crate) const INSERT: &str = "INSERT INTO idemkey_records
                 (tenant, key_hash, route, fingerprint, fingerprint_parts, state, token,
                  lease_expires_at, created_at, updated_at, expires_at, sealed_key,
                  fingerprint_members, first_sent)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?13, ?7, ?8, ?8, ?9, ?10, ?11, ?12)
             ON CONFLICT (tenant, key_hash, route) DO NOTHING
             RETURNING token";

pub(crate) const FETCH: &str =
    "SELECT * FROM idemkey_records WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3";

pub(crate) const REPLACE: &str = "UPDATE idemkey_records
                SET fingerprint = ?4, fingerprint_parts = ?5, state = ?6, token = token + 1,
                    lease_expires_at = ?7, response_status = NULL, response_headers = NULL,
                    response_body = NULL, created_at = ?8, updated_at = ?8, expires_at = ?9,
                    sealed_key = ?10, fingerprint_members = ?11, first_sent = ?12
              WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3 AND token = ?13
             RETURNING token";

pub(crate) const RENEW: &str = "UPDATE idemkey_records SET lease_expires_at = ?5, updated_at = ?6
              WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3 AND token = ?4";

pub(crate) const MARK_EXECUTING: &str = "UPDATE idemkey_records
                SET state = 'executing', lease_expires_at = ?5, updated_at = ?6
              WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3 AND token = ?4";

pub(crate) const MARK_INDETERMINATE: &str = "UPDATE idemkey_records
                SET state = 'indeterminate', lease_expires_at = NULL, updated_at = ?5
              WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3 AND token = ?4";

pub(crate) const RELEASE: &str = "DELETE FROM idemkey_records
              WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3 AND token = ?4";

pub(crate) const LIST: &str = "SELECT * FROM idemkey_records
              WHERE (?1 IS NULL OR tenant = ?1)
                AND (?2 IS NULL OR state = ?2)
                AND (?3 IS NULL OR created_at < ?3)
              ORDER BY created_at DESC
              LIMIT ?4";

pub(crate) const FIND_BY_KEY: &str =
    "SELECT * FROM idemkey_records WHERE tenant = ?1 AND key_hash = ?2
              ORDER BY created_at";

pub(crate) const EVICT: &str =
    "DELETE FROM idemkey_records WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3";

pub(crate) const PURGE_BATCH: &str = "DELETE FROM idemkey_records WHERE rowid IN
                (SELECT rowid FROM idemkey_records
                  WHERE expires_at <= ?1 AND expires_at >= ?2
                  ORDER BY expires_at
                  LIMIT ?3)
             RETURNING expires_at";

pub(crate) const APPEND_AUDIT: &str =
    "INSERT INTO idemkey_audit (tenant, key_hash, route, at, actor, action, detail)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";

pub(crate) const AUDIT: &str =
    "SELECT tenant, key_hash, route, at, actor, action, detail FROM idemkey_audit
              WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3
              ORDER BY id";

pub(crate) const TRIM_EVICTIONS: &str = "DELETE FROM idemkey_evictions WHERE at < ?1";

pub(crate) const NOTE_EVICTION: &str =
    "INSERT INTO idemkey_evictions (record_digest, at) VALUES (?1, ?2)";

/// The completion, `?1`–`?8` built by `params::completion`: alone in
/// [`complete`](idemkey_core::Store::complete), with its guard and `COMMIT` in
/// [`COMPLETE_AND_COMMIT`](crate::batch::COMPLETE_AND_COMMIT).
macro_rules! complete_sql {
    () => {
        "UPDATE idemkey_records
   SET state = 'completed', token = token + 1, lease_expires_at = NULL,
       response_status = ?5, response_headers = ?6, response_body = ?7, updated_at = ?8
 WHERE tenant = ?1 AND key_hash = ?2 AND route = ?3 AND token = ?4"
    };
}
pub(crate) use complete_sql;

pub(crate) const COMPLETE: &str = complete_sql!();
