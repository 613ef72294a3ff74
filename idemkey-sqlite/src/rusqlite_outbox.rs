//! The outbox on [`RusqliteStore`]: `SqliteStore`'s outbox statements (`outbox.rs`), run
//! through rusqlite with the same parameters.

use idemkey_core::outbox::{
    Message, MessageFilter, NewMessage, OutboxAuditEntry, OutboxStats, OutboxStore,
};
use idemkey_core::{StoreError, Timestamp};
use idemkey_sqlx::{MessageRow, OutboxAuditRow};
use rusqlite::{Connection, OptionalExtension, Row, params};

use crate::RusqliteStore;
use crate::outbox::Sql;
use crate::rusqlite_store::{changed, error};

fn message(row: &Row<'_>) -> rusqlite::Result<MessageRow> {
    Ok(MessageRow {
        seq: row.get("seq")?,
        id: row.get("id")?,
        grp: row.get("grp")?,
        kind: row.get("kind")?,
        data: row.get("data")?,
        created_at: row.get("created_at")?,
        state: row.get("state")?,
        attempts: row.get("attempts")?,
        next_attempt_at: row.get("next_attempt_at")?,
        claimed_by: row.get("claimed_by")?,
        claimed_until: row.get("claimed_until")?,
        last_error: row.get("last_error")?,
        sent_at: row.get("sent_at")?,
    })
}

fn messages(
    conn: &Connection,
    statement: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<Message>, StoreError> {
    let rows = conn
        .prepare_cached(statement)
        .and_then(|mut s| {
            s.query_map(params, message)?
                .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map_err(error)?;
    rows.into_iter().map(Message::try_from).collect()
}

impl OutboxStore for RusqliteStore {
    async fn enqueue(conn: &mut Connection, m: &NewMessage) -> Result<(), StoreError> {
        changed(
            conn,
            Sql::ENQUEUE,
            params![m.id, m.group, m.kind, m.data, m.created_at.as_millis()],
        )?;
        Ok(())
    }

    async fn claim_due(
        &self,
        conn: &mut Connection,
        relay: &str,
        now: Timestamp,
        until: Timestamp,
        limit: u32,
    ) -> Result<Vec<Message>, StoreError> {
        let mut claimed = messages(
            conn,
            Sql::CLAIM_DUE,
            params![relay, now.as_millis(), until.as_millis(), i64::from(limit)],
        )?;
        claimed.sort_by_key(|m| m.seq);
        Ok(claimed)
    }

    async fn mark_sent(
        &self,
        conn: &mut Connection,
        id: &str,
        relay: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        Ok(changed(conn, Sql::MARK_SENT, params![id, relay, now.as_millis()])? == 1)
    }

    async fn mark_failed(
        &self,
        conn: &mut Connection,
        id: &str,
        relay: &str,
        next_attempt_at: Option<Timestamp>,
        failure: &str,
    ) -> Result<bool, StoreError> {
        let next = next_attempt_at.map(Timestamp::as_millis);
        Ok(changed(conn, Sql::MARK_FAILED, params![id, relay, next, failure])? == 1)
    }

    async fn messages(
        &self,
        conn: &mut Connection,
        filter: &MessageFilter,
    ) -> Result<Vec<Message>, StoreError> {
        messages(
            conn,
            Sql::MESSAGES,
            params![filter.state.map(|s| s.as_str()), filter.effective_limit()],
        )
    }

    async fn message(
        &self,
        conn: &mut Connection,
        id: &str,
    ) -> Result<Option<Message>, StoreError> {
        conn.prepare_cached(Sql::MESSAGE)
            .and_then(|mut s| s.query_row(params![id], message).optional())
            .map_err(error)?
            .map(Message::try_from)
            .transpose()
    }

    async fn requeue(
        &self,
        conn: &mut Connection,
        id: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        Ok(changed(conn, Sql::REQUEUE, params![id, now.as_millis()])? == 1)
    }

    async fn remove_dead(&self, conn: &mut Connection, id: &str) -> Result<bool, StoreError> {
        Ok(changed(conn, Sql::REMOVE_DEAD, params![id])? == 1)
    }

    async fn purge_sent(
        &self,
        conn: &mut Connection,
        before: Timestamp,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let gone = changed(
            conn,
            Sql::PURGE_SENT,
            params![before.as_millis(), i64::from(batch)],
        )?;
        Ok(gone as u64)
    }

    async fn outbox_stats(&self, conn: &mut Connection) -> Result<OutboxStats, StoreError> {
        let (pending, dead, oldest): (i64, i64, Option<i64>) = conn
            .prepare_cached(Sql::STATS)
            .and_then(|mut s| s.query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))))
            .map_err(error)?;
        Ok(OutboxStats {
            pending: pending.max(0) as u64,
            dead: dead.max(0) as u64,
            oldest_pending: oldest.map(Timestamp),
        })
    }

    async fn append_outbox_audit(
        &self,
        conn: &mut Connection,
        e: &OutboxAuditEntry,
    ) -> Result<(), StoreError> {
        changed(
            conn,
            Sql::APPEND_AUDIT,
            params![e.message_id, e.at.as_millis(), e.actor, e.action, e.detail],
        )?;
        Ok(())
    }

    async fn outbox_audit(
        &self,
        conn: &mut Connection,
        id: &str,
    ) -> Result<Vec<OutboxAuditEntry>, StoreError> {
        let rows = conn
            .prepare_cached(Sql::AUDIT)
            .and_then(|mut s| {
                s.query_map(params![id], |r| {
                    Ok(OutboxAuditRow {
                        message_id: r.get(0)?,
                        at: r.get(1)?,
                        actor: r.get(2)?,
                        action: r.get(3)?,
                        detail: r.get(4)?,
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(error)?;
        Ok(rows.into_iter().map(OutboxAuditEntry::from).collect())
    }
}
