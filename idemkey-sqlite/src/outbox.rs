//! The outbox's SQL on SQLite. One writer at a time: one relay per database.
//!
//! The statements only: the Rust that binds and maps them is shared by every store
//! ([`idemkey_sqlx::impl_outbox_store`]).

use crate::SqliteStore;
use crate::store::error;

/// The outbox statements, in the dialect of SQLite.
pub(crate) struct Sql;

impl Sql {
    pub(crate) const ENQUEUE: &'static str = "\
        INSERT INTO idemkey_outbox (id, grp, kind, data, created_at, next_attempt_at) \
        VALUES (?1, ?2, ?3, ?4, ?5, ?5)";
    pub(crate) const CLAIM_DUE: &'static str = "\
        UPDATE idemkey_outbox SET claimed_by = ?1, claimed_until = ?3, \
        attempts = attempts + 1 \
        WHERE seq IN ( \
        SELECT m.seq FROM idemkey_outbox m \
        WHERE m.state = 'pending' AND m.next_attempt_at <= ?2 \
        AND (m.claimed_until IS NULL OR m.claimed_until <= ?2) \
        AND NOT EXISTS (SELECT 1 FROM idemkey_outbox e \
        WHERE e.grp = m.grp AND e.seq < m.seq AND e.state = 'pending') \
        ORDER BY m.seq LIMIT ?4) \
        RETURNING *";
    pub(crate) const MARK_SENT: &'static str = "\
        UPDATE idemkey_outbox SET state = 'sent', sent_at = ?3, claimed_by = NULL, \
        claimed_until = NULL, last_error = NULL \
        WHERE id = ?1 AND claimed_by = ?2 AND state = 'pending'";
    pub(crate) const MARK_FAILED: &'static str = "\
        UPDATE idemkey_outbox SET \
        state = CASE WHEN ?3 IS NULL THEN 'dead' ELSE 'pending' END, \
        next_attempt_at = COALESCE(?3, next_attempt_at), \
        claimed_by = NULL, claimed_until = NULL, last_error = ?4 \
        WHERE id = ?1 AND claimed_by = ?2 AND state = 'pending'";
    pub(crate) const MESSAGES: &'static str = "\
        SELECT * FROM idemkey_outbox WHERE (?1 IS NULL OR state = ?1) \
        ORDER BY seq DESC LIMIT ?2";
    pub(crate) const MESSAGE: &'static str = "\
        SELECT * FROM idemkey_outbox WHERE id = ?1";
    pub(crate) const REQUEUE: &'static str = "\
        UPDATE idemkey_outbox SET state = 'pending', attempts = 0, next_attempt_at = ?2, \
        claimed_by = NULL, claimed_until = NULL \
        WHERE id = ?1 AND state = 'dead'";
    pub(crate) const REMOVE_DEAD: &'static str = "\
        DELETE FROM idemkey_outbox WHERE id = ?1 AND state = 'dead'";
    pub(crate) const PURGE_SENT: &'static str = "\
        DELETE FROM idemkey_outbox WHERE seq IN (SELECT seq FROM idemkey_outbox \
        WHERE state = 'sent' AND sent_at < ?1 LIMIT ?2)";
    pub(crate) const STATS: &'static str = "\
        SELECT \
        (SELECT count(*) FROM idemkey_outbox WHERE state = 'pending'), \
        (SELECT count(*) FROM idemkey_outbox WHERE state = 'dead'), \
        (SELECT min(created_at) FROM idemkey_outbox WHERE state = 'pending')";
    pub(crate) const APPEND_AUDIT: &'static str = "\
        INSERT INTO idemkey_outbox_audit (message_id, at, actor, action, detail) \
        VALUES (?1, ?2, ?3, ?4, ?5)";
    pub(crate) const AUDIT: &'static str = "\
        SELECT message_id, at, actor, action, detail FROM idemkey_outbox_audit \
        WHERE message_id = ?1 ORDER BY seq";
}

idemkey_sqlx::impl_outbox_store!(SqliteStore, sqlx::sqlite::SqliteConnection, Sql, error);
