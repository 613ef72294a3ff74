//! The outbox's SQL on MySQL and MariaDB, and its claim. Several relays may share one
//! database: a claim skips the rows another relay is claiming (`FOR UPDATE SKIP LOCKED`).
//!
//! The statements and the claim only: the Rust that binds and maps them is shared by every
//! sqlx store ([`idemkey_sqlx::impl_outbox_store`]).

use idemkey_core::{StoreError, Timestamp};
use idemkey_sqlx::MessageRow;
use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, Connection};

use crate::MySqlStore;
use crate::codes::{DEADLOCK, error, error_number};

/// The outbox statements, in the dialect of MySQL: `?` parameters, each bound once, in the
/// order of [`idemkey_sqlx::impl_outbox_store`]'s table.
pub(crate) struct Sql;

impl Sql {
    /// The first due time is the enqueue time: a value list may name a column it set before.
    const ENQUEUE: &'static str = "\
        INSERT INTO idemkey_outbox (id, grp, kind, data, created_at, next_attempt_at) \
        VALUES (?, ?, ?, ?, ?, created_at)";
    /// The claim's first step: the seqs of due messages, first of their group, locked. Rows
    /// another transaction holds are skipped, not waited on; the group's subquery is a plain
    /// read, which sees an earlier message another relay is claiming.
    const DUE: &'static str = "\
        SELECT m.seq FROM idemkey_outbox m \
        WHERE m.state = 'pending' AND m.next_attempt_at <= ? \
        AND (m.claimed_until IS NULL OR m.claimed_until <= ?) \
        AND NOT EXISTS (SELECT 1 FROM idemkey_outbox e \
        WHERE e.grp = m.grp AND e.seq < m.seq AND e.state = 'pending') \
        ORDER BY m.seq LIMIT ? FOR UPDATE SKIP LOCKED";
    /// The claim of the locked rows: the relay and the claim's end, then the seqs.
    const CLAIM: &'static str = "\
        UPDATE idemkey_outbox SET claimed_by = ?, claimed_until = ?, \
        attempts = attempts + 1 WHERE seq IN ";
    /// The claimed rows, read back by the transaction that wrote them.
    const CLAIMED: &'static str = "SELECT * FROM idemkey_outbox WHERE seq IN ";
    const MARK_SENT: &'static str = "\
        UPDATE idemkey_outbox SET state = 'sent', sent_at = ?, claimed_by = NULL, \
        claimed_until = NULL, last_error = NULL \
        WHERE id = ? AND claimed_by = ? AND state = 'pending'";
    const MARK_FAILED: &'static str = "\
        UPDATE idemkey_outbox SET \
        state = IF(? IS NULL, 'dead', 'pending'), \
        next_attempt_at = COALESCE(?, next_attempt_at), \
        claimed_by = NULL, claimed_until = NULL, last_error = ? \
        WHERE id = ? AND claimed_by = ? AND state = 'pending'";
    const MESSAGES: &'static str = "\
        SELECT * FROM idemkey_outbox WHERE state = COALESCE(?, state) \
        ORDER BY seq DESC LIMIT ?";
    const MESSAGE: &'static str = "\
        SELECT * FROM idemkey_outbox WHERE id = ?";
    const REQUEUE: &'static str = "\
        UPDATE idemkey_outbox SET state = 'pending', attempts = 0, next_attempt_at = ?, \
        claimed_by = NULL, claimed_until = NULL \
        WHERE id = ? AND state = 'dead'";
    const REMOVE_DEAD: &'static str = "\
        DELETE FROM idemkey_outbox WHERE id = ? AND state = 'dead'";
    const PURGE_SENT: &'static str = "\
        DELETE FROM idemkey_outbox WHERE state = 'sent' AND sent_at < ? \
        ORDER BY seq LIMIT ?";
    const STATS: &'static str = "\
        SELECT \
        (SELECT count(*) FROM idemkey_outbox WHERE state = 'pending'), \
        (SELECT count(*) FROM idemkey_outbox WHERE state = 'dead'), \
        (SELECT min(created_at) FROM idemkey_outbox WHERE state = 'pending')";
    const APPEND_AUDIT: &'static str = "\
        INSERT INTO idemkey_outbox_audit (message_id, at, actor, action, detail) \
        VALUES (?, ?, ?, ?, ?)";
    const AUDIT: &'static str = "\
        SELECT message_id, at, actor, action, detail FROM idemkey_outbox_audit \
        WHERE message_id = ? ORDER BY seq";
}

/// The claim, without `UPDATE … RETURNING`: in one transaction, the due rows locked
/// ([`Sql::DUE`]), claimed, and read back. A transaction InnoDB rolled back as a deadlock's
/// victim (1213), or that a Galera cluster refused at its commit because a relay on another
/// node claimed the same rows first (1213 too), claimed nothing: an empty round, never an
/// error, and the messages stay for the winner or the next round.
async fn claim_due(
    conn: &mut MySqlConnection,
    relay: &str,
    now: Timestamp,
    until: Timestamp,
    limit: u32,
) -> Result<Vec<MessageRow>, StoreError> {
    match claim(conn, relay, now, until, limit).await {
        Err(e) if error_number(&e) == Some(DEADLOCK) => Ok(Vec::new()),
        claimed => claimed.map_err(error),
    }
}

/// The claim's transaction: committed when every step succeeded, otherwise rolled back at
/// once, so that no row it locked stays locked until the connection's next statement (a
/// 1213 has rolled it back already; another error may have ended only its statement).
async fn claim(
    conn: &mut MySqlConnection,
    relay: &str,
    now: Timestamp,
    until: Timestamp,
    limit: u32,
) -> Result<Vec<MessageRow>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    match claim_on(&mut tx, relay, now, until, limit).await {
        Ok(rows) => {
            tx.commit().await?;
            Ok(rows)
        }
        Err(e) => {
            // The claim's own error says what went wrong; a rollback that fails too means
            // the session is gone, and its transaction with it.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

async fn claim_on(
    tx: &mut MySqlConnection,
    relay: &str,
    now: Timestamp,
    until: Timestamp,
    limit: u32,
) -> Result<Vec<MessageRow>, sqlx::Error> {
    let due: Vec<i64> = sqlx::query_scalar(Sql::DUE)
        .bind(now.as_millis())
        .bind(now.as_millis())
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
    if due.is_empty() {
        return Ok(Vec::new());
    }
    // As many placeholders as seqs: the text depends on their count only, never on a value.
    let seqs = format!("({})", vec!["?"; due.len()].join(", "));
    let mut update = sqlx::query(AssertSqlSafe(format!("{}{seqs}", Sql::CLAIM)))
        .bind(relay)
        .bind(until.as_millis());
    let mut claimed = sqlx::query_as(AssertSqlSafe(format!("{}{seqs}", Sql::CLAIMED)));
    for seq in &due {
        update = update.bind(*seq);
        claimed = claimed.bind(*seq);
    }
    update.execute(&mut *tx).await?;
    claimed.fetch_all(&mut *tx).await
}

idemkey_sqlx::impl_outbox_store!(MySqlStore, MySqlConnection, Sql, error, claim = claim_due);
