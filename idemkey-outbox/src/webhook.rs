//! The webhook sink: an HTTP `POST` per message.

use std::time::Duration;

use idemkey_core::outbox::Message;

use crate::{DeliveryError, Sink, envelope};

/// Delivers each message as `POST <url>` with `Content-Type: application/json`, the header
/// `Idempotency-Key: <message id>` and the [`envelope`] as body. Any 2xx is an
/// acknowledgement; any other status, a time-out or a connection error is a failure the
/// relay retries. A receiver behind idemkey's own layer deduplicates redeliveries by the
/// key.
///
/// A webhook URL often carries its token (in the path or the query), so what the sink
/// prints of it — in its errors, which the relay logs and stores on the message, and in
/// `Debug` — is [`redact_sink_url`]'s origin only.
#[derive(Clone)]
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
        let shown = redact_sink_url(url);
        let url = reqwest::Url::parse(url)
            .map_err(|e| DeliveryError(format!("invalid webhook URL {shown:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(DeliveryError(format!(
                "invalid webhook URL {shown:?}: the scheme must be http or https"
            )));
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| DeliveryError(format!("cannot build the HTTP client: {e}")))?;
        Ok(Self { client, url })
    }

    /// Where messages go, token included: print [`redacted_url`](Self::redacted_url).
    pub fn url(&self) -> &str {
        self.url.as_str()
    }

    /// Where messages go, as it may be printed: the URL's origin.
    pub fn redacted_url(&self) -> String {
        redact_sink_url(self.url.as_str())
    }
}

impl std::fmt::Debug for WebhookSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSink")
            .field("url", &self.redacted_url())
            .finish_non_exhaustive()
    }
}

/// A sink's URL as it may be printed: its scheme and host (and port), then `/…` where a
/// path or a query followed; the user information is dropped. Webhook URLs are secrets as a
/// whole: many services put the token in the path.
///
/// ```
/// use idemkey_outbox::redact_sink_url;
///
/// assert_eq!(
///     redact_sink_url("https://user:pw@hooks.example.com:8443/services/T0/B0/s3cret?token=t"),
///     "https://hooks.example.com:8443/…"
/// );
/// assert_eq!(redact_sink_url("http://127.0.0.1:9000"), "http://127.0.0.1:9000");
/// ```
pub fn redact_sink_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "***".to_owned();
    };
    // The user information ends at the last `@` before the query: a password with a `/`
    // in it is dropped whole (a path with an `@` shows a wrong host, never a secret).
    let before_query = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    let rest = match before_query.rfind('@') {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let more = if rest[end..].trim_start_matches('/').is_empty() {
        ""
    } else {
        "/…"
    };
    format!("{scheme}://{}{more}", &rest[..end])
}

/// `text` with every URL in it shown as [`redact_sink_url`] shows it: for delivery errors
/// written by any sink, or by an older version that kept the whole URL.
pub fn redact_sink_urls(text: &str) -> String {
    let is_scheme = |c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.');
    let ends_url = |c: char| c.is_whitespace() || matches!(c, '(' | ')' | '<' | '>' | '"' | '\'');
    let mut shown = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let start = rest[..i].rfind(|c| !is_scheme(c)).map_or(0, |j| j + 1);
        let end = rest[i..].find(ends_url).map_or(rest.len(), |j| i + j);
        // Punctuation after a URL belongs to the sentence.
        let end = start
            + rest[start..end]
                .trim_end_matches([':', ',', ';', '.'])
                .len();
        shown.push_str(&rest[..start]);
        shown.push_str(&redact_sink_url(&rest[start..end]));
        rest = &rest[end..];
    }
    shown.push_str(rest);
    shown
}

/// A reqwest error and its causes, without the URL reqwest puts in its message.
fn without_url(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    // A cause may quote the URL too.
    redact_sink_urls(&text)
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
            .map_err(|e| {
                DeliveryError(format!("POST {}: {}", self.redacted_url(), without_url(e)))
            })?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(DeliveryError(format!(
                "POST {} answered {status}",
                self.redacted_url()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shows_only_the_origin_of_a_sink_url() {
        for (url, shown) in [
            ("https://h.example/hook/s3cret", "https://h.example/…"),
            ("https://h.example/?token=s3cret", "https://h.example/…"),
            ("https://h.example/", "https://h.example"),
            ("http://u:s3cret@h:80/p", "http://h:80/…"),
            ("http://u:s3/cr@et@h/p", "http://h/…"),
            ("h.example/s3cret", "***"),
        ] {
            assert_eq!(redact_sink_url(url), shown, "{url}");
        }
    }

    #[test]
    fn redacts_every_url_in_a_text() {
        assert_eq!(
            redact_sink_urls(
                "POST https://h/hook/s3cret?token=s3cret: error sending request for url \
                 (https://h/hook/s3cret?token=s3cret), then nats://u:s3cret@n:4222."
            ),
            "POST https://h/…: error sending request for url (https://h/…), then nats://n:4222."
        );
        assert_eq!(redact_sink_urls("no url here"), "no url here");
    }

    #[test]
    fn debug_hides_the_url() {
        let sink = WebhookSink::new("https://h.example/hook/s3cret").unwrap();
        assert!(!format!("{sink:?}").contains("s3cret"), "{sink:?}");
        let err = WebhookSink::new("ftp://h.example/hook/s3cret").unwrap_err();
        assert!(!err.0.contains("s3cret"), "{err}");
    }
}
