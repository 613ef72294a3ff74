//! The outbox on [`RusqliteStore`]: the statements and their Rust of `outbox.rs`, run
//! through rusqlite's adapter (`driver.rs`).

use idemkey_core::outbox::{
    Message, MessageFilter, NewMessage, OutboxAuditEntry, OutboxStats, OutboxStore,
};
use idemkey_core::{StoreError, Timestamp};
use rusqlite::Connection;

use crate::RusqliteStore;
use crate::outbox;

impl OutboxStore for RusqliteStore {
    async fn enqueue(conn: &mut Connection, m: &NewMessage) -> Result<(), StoreError> {
        outbox::enqueue(conn, m).await
    }

    async fn claim_due(
        &self,
        conn: &mut Connection,
        relay: &str,
        now: Timestamp,
        until: Timestamp,
        limit: u32,
    ) -> Result<Vec<Message>, StoreError> {
        outbox::claim_due(conn, relay, now, until, limit).await
    }

    async fn mark_sent(
        &self,
        conn: &mut Connection,
        id: &str,
        relay: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        outbox::mark_sent(conn, id, relay, now).await
    }

    async fn mark_failed(
        &self,
        conn: &mut Connection,
        id: &str,
        relay: &str,
        next_attempt_at: Option<Timestamp>,
        failure: &str,
    ) -> Result<bool, StoreError> {
        outbox::mark_failed(conn, id, relay, next_attempt_at, failure).await
    }

    async fn messages(
        &self,
        conn: &mut Connection,
        filter: &MessageFilter,
    ) -> Result<Vec<Message>, StoreError> {
        outbox::messages(conn, filter).await
    }

    async fn message(
        &self,
        conn: &mut Connection,
        id: &str,
    ) -> Result<Option<Message>, StoreError> {
        outbox::message(conn, id).await
    }

    async fn requeue(
        &self,
        conn: &mut Connection,
        id: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        outbox::requeue(conn, id, now).await
    }

    async fn remove_dead(&self, conn: &mut Connection, id: &str) -> Result<bool, StoreError> {
        outbox::remove_dead(conn, id).await
    }

    async fn purge_sent(
        &self,
        conn: &mut Connection,
        before: Timestamp,
        batch: u32,
    ) -> Result<u64, StoreError> {
        outbox::purge_sent(conn, before, batch).await
    }

    async fn outbox_stats(&self, conn: &mut Connection) -> Result<OutboxStats, StoreError> {
        outbox::outbox_stats(conn).await
    }

    async fn append_outbox_audit(
        &self,
        conn: &mut Connection,
        e: &OutboxAuditEntry,
    ) -> Result<(), StoreError> {
        outbox::append_outbox_audit(conn, e).await
    }

    async fn outbox_audit(
        &self,
        conn: &mut Connection,
        id: &str,
    ) -> Result<Vec<OutboxAuditEntry>, StoreError> {
        outbox::outbox_audit(conn, id).await
    }
}
