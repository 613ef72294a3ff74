//! # idemkey-outbox
//!
//! idemkey makes a request happen once at the database. This crate carries that guarantee
//! one boundary further (docs/guide/outbox.md):
//!
//! - a handler [`enqueue`]s messages on the same [`Tx`](idemkey_tower::Tx) it writes its
//!   effect on, so a message is committed with the effect and the idempotency record, or not
//!   at all, and a replayed request enqueues nothing;
//! - a [`Relay`] delivers each message at least once to a [`Sink`] ([`WebhookSink`], or
//!   NATS JetStream with [`NatsSink`]), marking it sent only after the sink acknowledged,
//!   retrying with backoff and jitter, and moving it to `dead` after
//!   [`RelayConfig::max_attempts`];
//! - every delivery of one message carries the same id and the same bytes
//!   ([`envelope`]), which the receiver deduplicates on;
//! - on the receiving side, an [`Inbox`] runs a consumer's handler for each message with
//!   the message id as the idempotency key, the handler's effect and the record in one
//!   transaction, so the consumer acknowledges after the commit and a redelivery runs
//!   nothing; [`consume_jetstream`] does that for a JetStream pull consumer.
//!
//! ```no_run
//! use idemkey_outbox::{Outgoing, enqueue};
//! use idemkey_sqlite::SqliteStore;
//! use idemkey_tower::Tx;
//!
//! async fn create_order(mut tx: Tx<SqliteStore>) -> Result<&'static str, String> {
//!     sqlx::query("INSERT INTO orders (item) VALUES ('book')")
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|e| e.to_string())?;
//!     let message = Outgoing::new("order.created", &serde_json::json!({ "item": "book" }))
//!         .map_err(|e| e.to_string())?;
//!     enqueue(&mut tx, message).await.map_err(|e| e.to_string())?;
//!     Ok("created")
//! }
//! ```
//!
//! The NATS parts ([`NatsSink`], [`consume_jetstream`]) are behind the default feature
//! `nats`.
//!
//! The store primitives are [`OutboxStore`]'s, implemented by `idemkey-sqlite` and
//! `idemkey-postgres` next to their idempotency SQL.

#[cfg(feature = "nats")]
mod consume;
mod enqueue;
mod inbox;
mod metrics;
#[cfg(feature = "nats")]
mod nats;
mod relay;
mod sink;
mod webhook;

pub use idemkey_core::outbox::{
    Message, MessageFilter, MessageState, NewMessage, OutboxAuditEntry, OutboxStats, OutboxStore,
};

#[cfg(feature = "nats")]
pub use self::consume::{
    ConsumeError, consume_jetstream, consume_jetstream_with, jetstream_message_id,
};
pub use self::enqueue::{Outgoing, enqueue, enqueue_on, new_message_id};
pub use self::inbox::{Claimed, Handled, Inbox, InboxError};
pub use self::metrics::OutboxMetrics;
#[cfg(feature = "nats")]
pub use self::nats::{NatsConfig, NatsSink, Published};
pub use self::relay::{Backoff, Relay, RelayConfig, RelayTask, Round};
pub use self::sink::{DeliveryError, Sink, envelope};
pub use self::webhook::{WebhookSink, redact_sink_url, redact_sink_urls};
