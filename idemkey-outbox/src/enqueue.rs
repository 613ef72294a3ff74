//! Writing messages in the transaction of their effect.

use idemkey_core::outbox::{NewMessage, OutboxStore};
use idemkey_core::{StoreError, Timestamp};
use idemkey_tower::Tx;
use rand::RngCore;
use serde::Serialize;

/// A message to enqueue: its type and its payload, serialized once, here, so every
/// delivery carries the same bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    kind: String,
    data: String,
}

impl Outgoing {
    /// A message of type `kind` (e.g. `payment.succeeded`) whose `data` is `data` as JSON.
    pub fn new(kind: impl Into<String>, data: &impl Serialize) -> Result<Self, serde_json::Error> {
        Ok(Self {
            kind: kind.into(),
            data: serde_json::to_string(data)?,
        })
    }

    /// A message whose `data` is the JSON text `json`, kept byte for byte (it must be valid
    /// JSON: the envelope embeds it as is).
    pub fn from_json_text(
        kind: impl Into<String>,
        json: String,
    ) -> Result<Self, serde_json::Error> {
        serde_json::from_str::<serde::de::IgnoredAny>(&json)?;
        Ok(Self {
            kind: kind.into(),
            data: json,
        })
    }

    /// The message type.
    pub fn kind(&self) -> &str {
        &self.kind
    }
}

/// A new message id: `msg_` and 32 hex digits of randomness. It is stored with the message,
/// so every redelivery carries it.
pub fn new_message_id() -> String {
    let mut bytes = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut bytes);
    format!("msg_{}", hex::encode(bytes))
}

/// Enqueues `message` on the handler's transaction: it commits with the effect and the
/// idempotency record, or not at all. Messages of one request are delivered in the order
/// they were enqueued (their group is [`Tx::operation_id`]). Returns the message's id.
pub async fn enqueue<S: OutboxStore>(
    tx: &mut Tx<S>,
    message: Outgoing,
) -> Result<String, StoreError> {
    let group = tx.operation_id().to_owned();
    enqueue_on::<S>(&mut *tx, &group, message).await
}

/// Enqueues `message` on `conn` (a transaction of the store's, outside the HTTP layer: an
/// inbox handler, a job), in `group`: messages of one group are delivered in the order they
/// were enqueued. Returns the message's id.
pub async fn enqueue_on<S: OutboxStore>(
    conn: &mut S::Connection,
    group: &str,
    message: Outgoing,
) -> Result<String, StoreError> {
    let new = NewMessage {
        id: new_message_id(),
        group: group.to_owned(),
        kind: message.kind,
        data: message.data,
        created_at: Timestamp::now(),
    };
    S::enqueue(conn, &new).await?;
    Ok(new.id)
}
