//! What the JetStream test files share.

use async_nats::jetstream;
use idemkey_core::Timestamp;
use idemkey_core::outbox::{Message, MessageState};

/// The stream's messages, in order: `(Nats-Msg-Id, payload)`.
pub(crate) async fn stream_contents(js: &jetstream::Context, name: &str) -> Vec<(String, Vec<u8>)> {
    let mut stream = js.get_stream(name).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut contents = Vec::new();
    if state.messages == 0 {
        return contents;
    }
    for seq in state.first_sequence..=state.last_sequence {
        let message = stream.get_raw_message(seq).await.unwrap();
        let id = message
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        contents.push((id, message.payload.to_vec()));
    }
    assert_eq!(contents.len() as u64, state.messages, "a gap in the stream");
    contents
}

/// A pending message `id`, as the relay hands it to a sink.
pub(crate) fn message(id: &str) -> Message {
    Message {
        seq: 1,
        id: id.into(),
        group: "g".into(),
        kind: "payment.succeeded".into(),
        data: r#"{"amount":500}"#.into(),
        created_at: Timestamp::now(),
        state: MessageState::Pending,
        attempts: 1,
        next_attempt_at: Timestamp(0),
        claimed_by: None,
        claimed_until: None,
        last_error: None,
        sent_at: None,
    }
}
