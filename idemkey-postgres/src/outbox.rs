//! The outbox's SQL on PostgreSQL. Several relays may share one database: a claim skips the
//! rows another relay is claiming (`FOR UPDATE SKIP LOCKED`).
//!
//! The statements only: the Rust that binds and maps them is shared by every store
//! ([`idemkey_sqlx::impl_outbox_store`]).

use crate::PgStore;
use crate::literal;
use crate::store::error;

/// The outbox statements, in the dialect of PostgreSQL. Their values are numbered in the
/// order [`idemkey_sqlx::impl_outbox_store`] binds them; written into the text
/// (`crate::literal`), they make the same statements whatever their numbers.
pub(crate) struct Sql;

impl Sql {
    const ENQUEUE: &'static str = "\
        INSERT INTO idemkey_outbox (id, grp, kind, data, created_at, next_attempt_at) \
        VALUES ($1, $2, $3, $4, $5, $5)";
    const CLAIM_DUE: &'static str = "\
        UPDATE idemkey_outbox SET claimed_by = $1, claimed_until = $3, \
        attempts = attempts + 1 \
        WHERE seq IN ( \
        SELECT m.seq FROM idemkey_outbox m \
        WHERE m.state = 'pending' AND m.next_attempt_at <= $2 \
        AND (m.claimed_until IS NULL OR m.claimed_until <= $2) \
        AND NOT EXISTS (SELECT 1 FROM idemkey_outbox e \
        WHERE e.grp = m.grp AND e.seq < m.seq AND e.state = 'pending') \
        ORDER BY m.seq LIMIT $4 FOR UPDATE SKIP LOCKED) \
        RETURNING *";
    const MARK_SENT: &'static str = "\
        UPDATE idemkey_outbox SET state = 'sent', sent_at = $1, claimed_by = NULL, \
        claimed_until = NULL, last_error = NULL \
        WHERE id = $2 AND claimed_by = $3 AND state = 'pending'";
    const MARK_FAILED: &'static str = "\
        UPDATE idemkey_outbox SET \
        state = CASE WHEN $1::BIGINT IS NULL THEN 'dead' ELSE 'pending' END, \
        next_attempt_at = COALESCE($2, next_attempt_at), \
        claimed_by = NULL, claimed_until = NULL, last_error = $3 \
        WHERE id = $4 AND claimed_by = $5 AND state = 'pending'";
    const MESSAGES: &'static str = "\
        SELECT * FROM idemkey_outbox WHERE ($1::TEXT IS NULL OR state = $1) \
        ORDER BY seq DESC LIMIT $2";
    const MESSAGE: &'static str = "\
        SELECT * FROM idemkey_outbox WHERE id = $1";
    const REQUEUE: &'static str = "\
        UPDATE idemkey_outbox SET state = 'pending', attempts = 0, next_attempt_at = $1, \
        claimed_by = NULL, claimed_until = NULL \
        WHERE id = $2 AND state = 'dead'";
    const REMOVE_DEAD: &'static str = "\
        DELETE FROM idemkey_outbox WHERE id = $1 AND state = 'dead'";
    const PURGE_SENT: &'static str = "\
        DELETE FROM idemkey_outbox WHERE seq IN (SELECT seq FROM idemkey_outbox \
        WHERE state = 'sent' AND sent_at < $1 LIMIT $2)";
    const STATS: &'static str = "\
        SELECT \
        (SELECT count(*)::BIGINT FROM idemkey_outbox WHERE state = 'pending'), \
        (SELECT count(*)::BIGINT FROM idemkey_outbox WHERE state = 'dead'), \
        (SELECT min(created_at) FROM idemkey_outbox WHERE state = 'pending')";
    const APPEND_AUDIT: &'static str = "\
        INSERT INTO idemkey_outbox_audit (message_id, at, actor, action, detail) \
        VALUES ($1, $2, $3, $4, $5)";
    const AUDIT: &'static str = "\
        SELECT message_id, at, actor, action, detail FROM idemkey_outbox_audit \
        WHERE message_id = $1 ORDER BY seq";
}

// Each statement goes as one simple-query message with its values written in
// (`crate::literal`), as the store's own do.
idemkey_sqlx::impl_outbox_store!(
    PgStore,
    sqlx::postgres::PgConnection,
    Sql,
    error,
    literal::query,
    literal::query_as
);
