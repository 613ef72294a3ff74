//! The inbox on a JetStream pull consumer: handle, commit, then acknowledge.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Message as JsMessage};
use futures::StreamExt;
use futures::future::BoxFuture;
use idemkey_core::Store;

use crate::{Handled, Inbox};

/// The consumer could not start (or go on) reading messages.
#[derive(Debug, thiserror::Error)]
#[error("cannot read messages from the JetStream consumer")]
pub struct ConsumeError(#[source] pub async_nats::Error);

/// How long JetStream waits before it delivers again a message whose handling failed.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// The id a JetStream message is handled under: its `Nats-Msg-Id` header, else the `id` of
/// its payload when that is an outbox [`envelope`](crate::envelope) (a JSON object with a
/// string `id`). `None` when it has neither.
pub fn jetstream_message_id(message: &async_nats::Message) -> Option<String> {
    if let Some(id) = message
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
    {
        return Some(id.as_str().to_owned());
    }
    #[derive(serde::Deserialize)]
    struct Envelope {
        id: String,
    }
    serde_json::from_slice::<Envelope>(&message.payload)
        .ok()
        .map(|e| e.id)
}

/// Handles every message of `consumer` through `inbox` with `handler`, acknowledging each
/// only after its effect and its record committed; see [`consume_jetstream_with`].
pub async fn consume_jetstream<S, E, F>(
    consumer: &PullConsumer,
    inbox: &Inbox<S>,
    handler: F,
) -> Result<(), ConsumeError>
where
    S: Store,
    E: std::fmt::Display,
    F: for<'c> FnMut(&'c mut S::Connection, &'c JsMessage) -> BoxFuture<'c, Result<(), E>>,
{
    consume_jetstream_with(consumer, inbox, handler, |_, _| Box::pin(async {})).await
}

/// Handles every message of `consumer` through `inbox`: for each, the id is
/// [`jetstream_message_id`]; the inbox claims it, runs `handler` on its transaction with the
/// message, completes the record and commits; then `after_commit` runs (an extension point:
/// metrics, or a test that stops the consumer exactly there), and then the message is
/// acknowledged. A redelivered message whose record is completed runs nothing and is
/// acknowledged.
///
/// A message that fails (the handler, the store, another consumer holding it) is
/// acknowledged negatively, to be delivered again a second later; a message without an id is
/// terminated (JetStream will not deliver it again) and logged, since it can never be
/// deduplicated. Runs until the consumer's message stream ends; an error only when it
/// cannot be read at all.
///
/// Set the consumer's `ack_wait` longer than a message takes to handle: a message still
/// being handled when it passes is delivered to another instance, whose claim waits for the
/// first and then finds it handled.
pub async fn consume_jetstream_with<S, E, F, A>(
    consumer: &PullConsumer,
    inbox: &Inbox<S>,
    mut handler: F,
    mut after_commit: A,
) -> Result<(), ConsumeError>
where
    S: Store,
    E: std::fmt::Display,
    F: for<'c> FnMut(&'c mut S::Connection, &'c JsMessage) -> BoxFuture<'c, Result<(), E>>,
    A: for<'m> FnMut(&'m JsMessage, Handled<()>) -> BoxFuture<'m, ()>,
{
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| ConsumeError(e.into()))?;
    while let Some(next) = messages.next().await {
        let message = match next {
            Ok(message) => message,
            Err(e) => {
                // Missed heartbeats, a reconnect: the stream goes on.
                tracing::warn!(error = %e, "reading from the JetStream consumer");
                continue;
            }
        };
        let Some(id) = jetstream_message_id(&message) else {
            tracing::error!(
                subject = %message.subject,
                "a JetStream message without Nats-Msg-Id or envelope id cannot be deduplicated; terminated"
            );
            acknowledge(&message, AckKind::Term).await;
            continue;
        };
        match handle(inbox, &id, &message, &mut handler).await {
            Ok(handled) => {
                after_commit(&message, handled).await;
                acknowledge(&message, AckKind::Ack).await;
            }
            Err(e) => {
                tracing::warn!(message = %id, error = %e, "handling a JetStream message failed; it will be delivered again");
                acknowledge(&message, AckKind::Nak(Some(RETRY_DELAY))).await;
            }
        }
    }
    Ok(())
}

/// One message through the inbox; the error as text.
async fn handle<S, E, F>(
    inbox: &Inbox<S>,
    id: &str,
    message: &JsMessage,
    handler: &mut F,
) -> Result<Handled<()>, String>
where
    S: Store,
    E: std::fmt::Display,
    F: for<'c> FnMut(&'c mut S::Connection, &'c JsMessage) -> BoxFuture<'c, Result<(), E>>,
{
    let begun = inbox.begin::<std::convert::Infallible>(id).await;
    let mut claimed = match begun.map_err(|e| error_chain(&e))? {
        Handled::Ran(claimed) => claimed,
        Handled::Duplicate => return Ok(Handled::Duplicate),
    };
    handler(&mut *claimed, message)
        .await
        .map_err(|e| format!("the handler failed: {e}"))?;
    claimed.commit().await.map_err(|e| error_chain(&e))?;
    Ok(Handled::Ran(()))
}

async fn acknowledge(message: &JsMessage, kind: AckKind) {
    if let Err(e) = message.ack_with(kind).await {
        // Not acknowledged: JetStream delivers it again after `ack_wait`, and the inbox
        // finds it handled.
        tracing::warn!(error = %e, "acknowledging a JetStream message failed");
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
