//! The outbox's SQL on SQLite. One writer at a time: one relay per database.

use idemkey_core::outbox::{
    Message, MessageFilter, NewMessage, OutboxAuditEntry, OutboxStats, OutboxStore,
};
use idemkey_core::{MessageRow, OutboxAuditRow, StoreError, Timestamp};
use sqlx::sqlite::SqliteConnection;

use crate::SqliteStore;
use crate::store::error;

fn messages(rows: Vec<MessageRow>) -> Result<Vec<Message>, StoreError> {
    rows.into_iter().map(Message::try_from).collect()
}

impl OutboxStore for SqliteStore {
    async fn enqueue(conn: &mut SqliteConnection, message: &NewMessage) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO idemkey_outbox (id, grp, kind, data, created_at, next_attempt_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?5)",
        )
        .bind(&message.id)
        .bind(&message.group)
        .bind(&message.kind)
        .bind(&message.data)
        .bind(message.created_at.as_millis())
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(())
    }

    async fn claim_due(
        &self,
        conn: &mut SqliteConnection,
        relay: &str,
        now: Timestamp,
        until: Timestamp,
        limit: u32,
    ) -> Result<Vec<Message>, StoreError> {
        let rows: Vec<MessageRow> = sqlx::query_as(
            "UPDATE idemkey_outbox SET claimed_by = ?1, claimed_until = ?3, \
                 attempts = attempts + 1 \
             WHERE seq IN ( \
                 SELECT m.seq FROM idemkey_outbox m \
                 WHERE m.state = 'pending' AND m.next_attempt_at <= ?2 \
                   AND (m.claimed_until IS NULL OR m.claimed_until <= ?2) \
                   AND NOT EXISTS (SELECT 1 FROM idemkey_outbox e \
                       WHERE e.grp = m.grp AND e.seq < m.seq AND e.state = 'pending') \
                 ORDER BY m.seq LIMIT ?4) \
             RETURNING *",
        )
        .bind(relay)
        .bind(now.as_millis())
        .bind(until.as_millis())
        .bind(i64::from(limit))
        .fetch_all(conn)
        .await
        .map_err(error)?;
        let mut claimed = messages(rows)?;
        claimed.sort_by_key(|m| m.seq);
        Ok(claimed)
    }

    async fn mark_sent(
        &self,
        conn: &mut SqliteConnection,
        id: &str,
        relay: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE idemkey_outbox SET state = 'sent', sent_at = ?3, claimed_by = NULL, \
                 claimed_until = NULL, last_error = NULL \
             WHERE id = ?1 AND claimed_by = ?2 AND state = 'pending'",
        )
        .bind(id)
        .bind(relay)
        .bind(now.as_millis())
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn mark_failed(
        &self,
        conn: &mut SqliteConnection,
        id: &str,
        relay: &str,
        next_attempt_at: Option<Timestamp>,
        failure: &str,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE idemkey_outbox SET \
                 state = CASE WHEN ?3 IS NULL THEN 'dead' ELSE 'pending' END, \
                 next_attempt_at = COALESCE(?3, next_attempt_at), \
                 claimed_by = NULL, claimed_until = NULL, last_error = ?4 \
             WHERE id = ?1 AND claimed_by = ?2 AND state = 'pending'",
        )
        .bind(id)
        .bind(relay)
        .bind(next_attempt_at.map(Timestamp::as_millis))
        .bind(failure)
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn messages(
        &self,
        conn: &mut SqliteConnection,
        filter: &MessageFilter,
    ) -> Result<Vec<Message>, StoreError> {
        let rows: Vec<MessageRow> = sqlx::query_as(
            "SELECT * FROM idemkey_outbox WHERE (?1 IS NULL OR state = ?1) \
             ORDER BY seq DESC LIMIT ?2",
        )
        .bind(filter.state.map(|s| s.as_str()))
        .bind(filter.effective_limit())
        .fetch_all(conn)
        .await
        .map_err(error)?;
        messages(rows)
    }

    async fn message(
        &self,
        conn: &mut SqliteConnection,
        id: &str,
    ) -> Result<Option<Message>, StoreError> {
        let row: Option<MessageRow> = sqlx::query_as("SELECT * FROM idemkey_outbox WHERE id = ?1")
            .bind(id)
            .fetch_optional(conn)
            .await
            .map_err(error)?;
        row.map(Message::try_from).transpose()
    }

    async fn requeue(
        &self,
        conn: &mut SqliteConnection,
        id: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE idemkey_outbox SET state = 'pending', attempts = 0, next_attempt_at = ?2, \
                 claimed_by = NULL, claimed_until = NULL \
             WHERE id = ?1 AND state = 'dead'",
        )
        .bind(id)
        .bind(now.as_millis())
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn remove_dead(&self, conn: &mut SqliteConnection, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM idemkey_outbox WHERE id = ?1 AND state = 'dead'")
            .bind(id)
            .execute(conn)
            .await
            .map_err(error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_sent(
        &self,
        conn: &mut SqliteConnection,
        before: Timestamp,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM idemkey_outbox WHERE seq IN (SELECT seq FROM idemkey_outbox \
                 WHERE state = 'sent' AND sent_at < ?1 LIMIT ?2)",
        )
        .bind(before.as_millis())
        .bind(i64::from(batch))
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(done.rows_affected())
    }

    async fn outbox_stats(&self, conn: &mut SqliteConnection) -> Result<OutboxStats, StoreError> {
        let (pending, dead, oldest): (i64, i64, Option<i64>) = sqlx::query_as(
            "SELECT \
                 (SELECT count(*) FROM idemkey_outbox WHERE state = 'pending'), \
                 (SELECT count(*) FROM idemkey_outbox WHERE state = 'dead'), \
                 (SELECT min(created_at) FROM idemkey_outbox WHERE state = 'pending')",
        )
        .fetch_one(conn)
        .await
        .map_err(error)?;
        Ok(OutboxStats {
            pending: pending.max(0) as u64,
            dead: dead.max(0) as u64,
            oldest_pending: oldest.map(Timestamp),
        })
    }

    async fn append_outbox_audit(
        &self,
        conn: &mut SqliteConnection,
        entry: &OutboxAuditEntry,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO idemkey_outbox_audit (message_id, at, actor, action, detail) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
        )
        .bind(&entry.message_id)
        .bind(entry.at.as_millis())
        .bind(&entry.actor)
        .bind(&entry.action)
        .bind(&entry.detail)
        .execute(conn)
        .await
        .map_err(error)?;
        Ok(())
    }

    async fn outbox_audit(
        &self,
        conn: &mut SqliteConnection,
        id: &str,
    ) -> Result<Vec<OutboxAuditEntry>, StoreError> {
        let rows: Vec<OutboxAuditRow> = sqlx::query_as(
            "SELECT message_id, at, actor, action, detail FROM idemkey_outbox_audit \
             WHERE message_id = ?1 ORDER BY seq",
        )
        .bind(id)
        .fetch_all(conn)
        .await
        .map_err(error)?;
        Ok(rows.into_iter().map(OutboxAuditEntry::from).collect())
    }
}
