//! Where messages go, and their wire form.

use std::future::Future;

use idemkey_core::outbox::Message;

/// Why a delivery failed. Every failure is retried (with backoff) until the message's
/// attempts run out; the text is kept on the message as `last_error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DeliveryError(pub String);

/// A destination for messages. `deliver` returns `Ok` only once the destination has
/// acknowledged the message; anything else (an error, a time-out) means "maybe not
/// delivered", and the relay delivers it again, with the same id and bytes.
pub trait Sink: Send + Sync + 'static {
    /// Delivers one message and waits for its acknowledgement.
    fn deliver(&self, message: &Message) -> impl Future<Output = Result<(), DeliveryError>> + Send;
}

impl<K: Sink> Sink for std::sync::Arc<K> {
    fn deliver(&self, message: &Message) -> impl Future<Output = Result<(), DeliveryError>> + Send {
        (**self).deliver(message)
    }
}

/// The message as sinks send it: `{"id","type","created_at","data"}`, with `data` the
/// stored JSON text byte for byte and `created_at` in RFC 3339 (UTC, milliseconds). The
/// same message always gives the same bytes.
pub fn envelope(message: &Message) -> Vec<u8> {
    let created_at = humantime::format_rfc3339_millis(message.created_at.to_system_time());
    let quoted = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    format!(
        r#"{{"id":{},"type":{},"created_at":{},"data":{}}}"#,
        quoted(&message.id),
        quoted(&message.kind),
        quoted(&created_at.to_string()),
        message.data
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use idemkey_core::Timestamp;
    use idemkey_core::outbox::MessageState;

    use super::*;

    #[test]
    fn the_envelope_keeps_the_payload_bytes_and_is_stable() {
        let message = Message {
            seq: 1,
            id: "msg_1".into(),
            group: "g".into(),
            kind: "payment.succeeded".into(),
            data: r#"{"b":1, "a":"\u00e9"}"#.into(),
            created_at: Timestamp(1_700_000_000_123),
            state: MessageState::Pending,
            attempts: 0,
            next_attempt_at: Timestamp(0),
            claimed_by: None,
            claimed_until: None,
            last_error: None,
            sent_at: None,
        };
        let body = envelope(&message);
        assert_eq!(
            String::from_utf8(body.clone()).unwrap(),
            r#"{"id":"msg_1","type":"payment.succeeded","created_at":"2023-11-14T22:13:20.123Z","data":{"b":1, "a":"\u00e9"}}"#
        );
        assert_eq!(envelope(&message), body);
        let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(parsed["data"]["a"], "é");
    }
}
