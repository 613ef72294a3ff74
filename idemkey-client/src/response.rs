//! The server's final answer to an operation.

use std::time::SystemTime;

use bytes::Bytes;
use reqwest::header::HeaderMap;
use reqwest::{StatusCode, Url, Version};
use serde::de::DeserializeOwned;

/// What the client learnt while executing an operation.
///
/// [`IdempotencyMiddleware`](crate::IdempotencyMiddleware) puts one in the extensions of each
/// response it returns (`response.extensions().get::<IdempotencyInfo>()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyInfo {
    pub(crate) key: String,
    pub(crate) attempts: u32,
    pub(crate) replayed: bool,
    pub(crate) expires_at: Option<SystemTime>,
}

impl IdempotencyInfo {
    /// The idempotency key sent on every attempt.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How many attempts this call made (1 when the first one was answered).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the answer was a replay of a stored outcome (`Idempotent-Replayed: true`).
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// The last `Idempotency-Key-Expires` the server advertised: do not retry after it.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.expires_at
    }
}

/// The server's answer to an operation, read in full.
///
/// Any status the client does not retry or turn into an [`Error`](crate::Error) is the
/// server's final answer: 2xx, 3xx, 401, 402, 404, a business 409…
#[derive(Debug, Clone)]
pub struct IdempotentResponse {
    pub(crate) status: StatusCode,
    pub(crate) version: Version,
    pub(crate) url: Url,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) extensions: http::Extensions,
    pub(crate) info: IdempotencyInfo,
}

impl IdempotentResponse {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The HTTP version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The URL of the request that was answered.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The response headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body, as received.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The body, taken.
    pub fn into_body(self) -> Bytes {
        self.body
    }

    /// The body as UTF-8 text.
    pub fn text(&self) -> Result<&str, std::str::Utf8Error> {
        std::str::from_utf8(&self.body)
    }

    /// The body parsed as JSON.
    pub fn json<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_slice(&self.body)
    }

    /// Whether the answer was a replay of a stored outcome (`Idempotent-Replayed: true`).
    pub fn is_replayed(&self) -> bool {
        self.info.replayed
    }

    /// How many attempts this call made.
    pub fn attempts(&self) -> u32 {
        self.info.attempts
    }

    /// The idempotency key used.
    pub fn key(&self) -> &str {
        &self.info.key
    }

    /// The last `Idempotency-Key-Expires` the server advertised.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.info.expires_at
    }

    /// All of the above idempotency facts.
    pub fn info(&self) -> &IdempotencyInfo {
        &self.info
    }
}
