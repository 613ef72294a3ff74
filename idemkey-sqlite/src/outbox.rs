//! The outbox on SQLite: its SQL, and the Rust that binds and maps it, written once over a
//! [`Driver`] for both stores (their `OutboxStore` impls, in `forward.rs`, call it). One
//! writer at a time: one relay per database.

use idemkey_core::outbox::{Message, MessageFilter, NewMessage, OutboxAuditEntry, OutboxStats};
use idemkey_core::{StoreError, Timestamp};
use idemkey_sqlx::{MessageRow, OutboxAuditRow};

use crate::driver::Driver;
use crate::params::Value;

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

pub(crate) async fn enqueue(conn: &mut impl Driver, m: &NewMessage) -> Result<(), StoreError> {
    let params = [
        Value::Text(&m.id),
        Value::Text(&m.group),
        Value::Text(&m.kind),
        Value::Text(&m.data),
        Value::Int(m.created_at.as_millis()),
    ];
    conn.execute(Sql::ENQUEUE, params).await?;
    Ok(())
}

pub(crate) async fn claim_due(
    conn: &mut impl Driver,
    relay: &str,
    now: Timestamp,
    until: Timestamp,
    limit: u32,
) -> Result<Vec<Message>, StoreError> {
    let params = [
        Value::Text(relay),
        Value::Int(now.as_millis()),
        Value::Int(until.as_millis()),
        Value::Int(i64::from(limit)),
    ];
    let mut claimed = messages_of(conn.fetch_all(Sql::CLAIM_DUE, params).await?)?;
    claimed.sort_by_key(|m| m.seq);
    Ok(claimed)
}

pub(crate) async fn mark_sent(
    conn: &mut impl Driver,
    id: &str,
    relay: &str,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let params = [
        Value::Text(id),
        Value::Text(relay),
        Value::Int(now.as_millis()),
    ];
    Ok(conn.execute(Sql::MARK_SENT, params).await? == 1)
}

pub(crate) async fn mark_failed(
    conn: &mut impl Driver,
    id: &str,
    relay: &str,
    next_attempt_at: Option<Timestamp>,
    failure: &str,
) -> Result<bool, StoreError> {
    let params = [
        Value::Text(id),
        Value::Text(relay),
        next_attempt_at.map_or(Value::Null, |t| Value::Int(t.as_millis())),
        Value::Text(failure),
    ];
    Ok(conn.execute(Sql::MARK_FAILED, params).await? == 1)
}

pub(crate) async fn messages(
    conn: &mut impl Driver,
    filter: &MessageFilter,
) -> Result<Vec<Message>, StoreError> {
    let params = [
        filter
            .state
            .map_or(Value::Null, |s| Value::Text(s.as_str())),
        Value::Int(filter.effective_limit()),
    ];
    messages_of(conn.fetch_all(Sql::MESSAGES, params).await?)
}

fn messages_of(rows: Vec<MessageRow>) -> Result<Vec<Message>, StoreError> {
    rows.into_iter().map(Message::try_from).collect()
}

pub(crate) async fn message(
    conn: &mut impl Driver,
    id: &str,
) -> Result<Option<Message>, StoreError> {
    let row: Option<MessageRow> = conn.fetch_optional(Sql::MESSAGE, [Value::Text(id)]).await?;
    row.map(Message::try_from).transpose()
}

pub(crate) async fn requeue(
    conn: &mut impl Driver,
    id: &str,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let params = [Value::Text(id), Value::Int(now.as_millis())];
    Ok(conn.execute(Sql::REQUEUE, params).await? == 1)
}

pub(crate) async fn remove_dead(conn: &mut impl Driver, id: &str) -> Result<bool, StoreError> {
    Ok(conn.execute(Sql::REMOVE_DEAD, [Value::Text(id)]).await? == 1)
}

pub(crate) async fn purge_sent(
    conn: &mut impl Driver,
    before: Timestamp,
    batch: u32,
) -> Result<u64, StoreError> {
    let params = [Value::Int(before.as_millis()), Value::Int(i64::from(batch))];
    conn.execute(Sql::PURGE_SENT, params).await
}

pub(crate) async fn outbox_stats(conn: &mut impl Driver) -> Result<OutboxStats, StoreError> {
    let row: Option<(i64, i64, Option<i64>)> = conn.fetch_optional(Sql::STATS, []).await?;
    let (pending, dead, oldest) =
        row.ok_or_else(|| StoreError::Corrupt("the outbox's counts returned no row".into()))?;
    Ok(OutboxStats {
        pending: pending.max(0) as u64,
        dead: dead.max(0) as u64,
        oldest_pending: oldest.map(Timestamp),
    })
}

pub(crate) async fn append_outbox_audit(
    conn: &mut impl Driver,
    e: &OutboxAuditEntry,
) -> Result<(), StoreError> {
    let params = [
        Value::Text(&e.message_id),
        Value::Int(e.at.as_millis()),
        Value::Text(&e.actor),
        Value::Text(&e.action),
        Value::Text(&e.detail),
    ];
    conn.execute(Sql::APPEND_AUDIT, params).await?;
    Ok(())
}

pub(crate) async fn outbox_audit(
    conn: &mut impl Driver,
    id: &str,
) -> Result<Vec<OutboxAuditEntry>, StoreError> {
    let rows: Vec<OutboxAuditRow> = conn.fetch_all(Sql::AUDIT, [Value::Text(id)]).await?;
    Ok(rows.into_iter().map(OutboxAuditEntry::from).collect())
}
