//! The outbox's store primitives: messages written in the transaction of the effect they
//! announce, then delivered by a relay (`idemkey-outbox`).
//!
//! A message is committed with the effect and the idempotency record, or not at all. Its
//! id is chosen when it is enqueued and stored, so every redelivery carries the same id and
//! the same bytes. Messages of one *group* (the operation that wrote them) are delivered in
//! the order they were enqueued: a message is not claimed while an earlier message of its
//! group is still pending.
//!
//! Like [`Store`], an [`OutboxStore`] holds only SQL; every decision (backoff, when a
//! message is dead, the message's wire form) is made in `idemkey-outbox`.

use std::future::Future;

use crate::{Store, StoreError, Timestamp};

/// Where a message is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageState {
    /// Waiting to be delivered (or being delivered by the relay that claimed it).
    Pending,
    /// The sink acknowledged it.
    Sent,
    /// Every attempt failed; it waits for an operator (`idemkey outbox retry|drop`).
    Dead,
}

impl MessageState {
    /// The name stored in the `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Sent => "sent",
            Self::Dead => "dead",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(Self::Pending),
            "sent" => Some(Self::Sent),
            "dead" => Some(Self::Dead),
            _ => None,
        }
    }
}

/// A message to enqueue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    /// Unique per message, stable across redeliveries.
    pub id: String,
    /// The operation that wrote it; messages of one group are delivered in order.
    pub group: String,
    /// The message type, e.g. `payment.succeeded`.
    pub kind: String,
    /// The payload, JSON text, kept byte for byte.
    pub data: String,
    /// When it was enqueued.
    pub created_at: Timestamp,
}

/// A stored message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The order of enqueueing.
    pub seq: i64,
    /// Unique per message, stable across redeliveries.
    pub id: String,
    /// The operation that wrote it.
    pub group: String,
    /// The message type.
    pub kind: String,
    /// The payload, JSON text.
    pub data: String,
    /// When it was enqueued.
    pub created_at: Timestamp,
    /// Pending, sent or dead.
    pub state: MessageState,
    /// Delivery attempts begun (a claim counts as one).
    pub attempts: u32,
    /// Not claimed again before this time.
    pub next_attempt_at: Timestamp,
    /// The relay delivering it now, if any.
    pub claimed_by: Option<String>,
    /// Until when that relay's claim holds.
    pub claimed_until: Option<Timestamp>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When the sink acknowledged it.
    pub sent_at: Option<Timestamp>,
}

/// Filters for [`OutboxStore::messages`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessageFilter {
    /// Only messages in this state.
    pub state: Option<MessageState>,
    /// At most this many, newest first (0 means 100).
    pub limit: u32,
}

impl MessageFilter {
    /// The effective row limit.
    pub fn effective_limit(&self) -> i64 {
        if self.limit == 0 {
            100
        } else {
            i64::from(self.limit)
        }
    }
}

/// How much is waiting, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxStats {
    /// Pending messages.
    pub pending: u64,
    /// Dead messages.
    pub dead: u64,
    /// When the oldest pending message was enqueued.
    pub oldest_pending: Option<Timestamp>,
}

/// An operator's action on a message (`idemkey outbox retry|drop`), kept in
/// `idemkey_outbox_audit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxAuditEntry {
    /// The message.
    pub message_id: String,
    /// When.
    pub at: Timestamp,
    /// Who: `operator:<user>`.
    pub actor: String,
    /// `retried`, `dropped`.
    pub action: String,
    /// The operator's note.
    pub detail: String,
}

/// The SQL primitives of an outbox, on the same database (and connection type) as the
/// idempotency records.
///
/// Writes after a claim name the relay that claimed the message, and do nothing (return
/// `false`) when another relay holds it now.
pub trait OutboxStore: Store {
    /// Inserts `message` on `conn`, normally the transaction that writes its effect.
    fn enqueue(
        conn: &mut Self::Connection,
        message: &NewMessage,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Claims up to `limit` due messages for `relay` until `until`, oldest first: pending,
    /// due at `now`, not claimed by a live claim, and first of their group among the
    /// pending. Each claimed message's `attempts` is raised by one. Several relays may call
    /// this at once: no message is handed to two of them while a claim holds.
    fn claim_due(
        &self,
        conn: &mut Self::Connection,
        relay: &str,
        now: Timestamp,
        until: Timestamp,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Message>, StoreError>> + Send;

    /// Marks the message sent, if `relay` still holds it.
    fn mark_sent(
        &self,
        conn: &mut Self::Connection,
        id: &str,
        relay: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Releases `relay`'s claim after a failed attempt: the message is due again at
    /// `next_attempt_at`, or dead when `next_attempt_at` is `None`.
    fn mark_failed(
        &self,
        conn: &mut Self::Connection,
        id: &str,
        relay: &str,
        next_attempt_at: Option<Timestamp>,
        error: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Messages matching `filter`, newest first.
    fn messages(
        &self,
        conn: &mut Self::Connection,
        filter: &MessageFilter,
    ) -> impl Future<Output = Result<Vec<Message>, StoreError>> + Send;

    /// One message.
    fn message(
        &self,
        conn: &mut Self::Connection,
        id: &str,
    ) -> impl Future<Output = Result<Option<Message>, StoreError>> + Send;

    /// Makes a dead message pending again, due at `now`, with its attempts reset.
    fn requeue(
        &self,
        conn: &mut Self::Connection,
        id: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes a dead message.
    fn remove_dead(
        &self,
        conn: &mut Self::Connection,
        id: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes at most `batch` messages sent before `before`. Returns how many.
    fn purge_sent(
        &self,
        conn: &mut Self::Connection,
        before: Timestamp,
        batch: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts of pending and dead messages.
    fn outbox_stats(
        &self,
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<OutboxStats, StoreError>> + Send;

    /// Appends an operator's action to the outbox audit trail.
    fn append_outbox_audit(
        &self,
        conn: &mut Self::Connection,
        entry: &OutboxAuditEntry,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The audit trail of one message, oldest first.
    fn outbox_audit(
        &self,
        conn: &mut Self::Connection,
        id: &str,
    ) -> impl Future<Output = Result<Vec<OutboxAuditEntry>, StoreError>> + Send;
}
