//! The webhook sink: an HTTP `POST` per message.

use std::time::Duration;

use idemkey_core::outbox::Message;

use crate::{DeliveryError, Sink, envelope};

/// Delivers each message as `POST <url>` with `Content-Type: application/json`, the header
/// `Idempotency-Key: <message id>` and the [`envelope`] as body. Any 2xx is an
/// acknowledgement; any other status, a time-out or a connection error is a failure the
/// relay retries. A receiver behind idemkey's own layer deduplicates redeliveries by the
/// key.
#[derive(Debug, Clone)]
pub struct WebhookSink {
    client: reqwest::Client,
    url: reqwest::Url,
}

impl WebhookSink {
    /// How long one delivery may take, answer included.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

    /// A sink posting to `url` (`http://` or `https://`).
    pub fn new(url: &str) -> Result<Self, DeliveryError> {
        Self::with_timeout(url, Self::DEFAULT_TIMEOUT)
    }

    /// A sink posting to `url`, each delivery bounded by `timeout`.
    pub fn with_timeout(url: &str, timeout: Duration) -> Result<Self, DeliveryError> {
        let url = reqwest::Url::parse(url)
            .map_err(|e| DeliveryError(format!("invalid webhook URL {url:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(DeliveryError(format!(
                "invalid webhook URL {url}: the scheme must be http or https"
            )));
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| DeliveryError(format!("cannot build the HTTP client: {e}")))?;
        Ok(Self { client, url })
    }

    /// Where messages go.
    pub fn url(&self) -> &str {
        self.url.as_str()
    }
}

impl Sink for WebhookSink {
    async fn deliver(&self, message: &Message) -> Result<(), DeliveryError> {
        let response = self
            .client
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("Idempotency-Key", &message.id)
            .body(envelope(message))
            .send()
            .await
            .map_err(|e| DeliveryError(format!("POST {}: {e}", self.url)))?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(DeliveryError(format!(
                "POST {} answered {status}",
                self.url
            )))
        }
    }
}
