//! Stored responses: what is kept of an answer, how it is replayed, and the answers to a
//! claim this attempt did not win.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use idemkey_core::protocol::ClaimOutcome;
use idemkey_core::{IdempotencyKey, StoredResponse, Timestamp};

use super::coding;
use crate::layer::{Config, STATUS_PATH};
use crate::{IdempotencyRejection, Outcome, RETRY_AFTER};

/// The header added to replayed responses.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The header that tells until when the key's outcome is kept (an HTTP date).
pub const EXPIRES_HEADER: &str = "idempotency-key-expires";

/// A handler's answer, read whole so that it can be stored and still be sent.
pub(super) struct Captured {
    head: http::response::Parts,
    body: Bytes,
    /// What is stored and replayed.
    pub(super) stored: StoredResponse,
}

impl Captured {
    /// The answer to send: with `Idempotency-Key-Expires` when it was stored.
    pub(super) fn into_response(mut self, stored_until: Option<Timestamp>) -> Response {
        if let Some(expires_at) = stored_until {
            add_expiry(&mut self.head.headers, expires_at);
        }
        Response::from_parts(self.head, Body::from(self.body))
    }
}

/// Reads the handler's answer for storing, in both modes: its status, the allowlisted headers
/// and the body, at most the route's limit (past it: 500 `response-too-large`).
///
/// A body in a coding the layer decodes is decoded once, into nothing, within the bound
/// ([`coding::check_stored`]): one that does not decode is stored all the same, and replayed
/// as stored to every retry, which a warning and `idemkey_undecodable_responses_total` say.
pub(super) async fn capture_outcome(
    response: Response,
    config: &Config,
) -> Result<Captured, IdempotencyRejection> {
    let (head, body) = response.into_parts();
    let limit = config.max_stored_response;
    let body = axum::body::to_bytes(body, limit).await.map_err(|_| {
        IdempotencyRejection::ResponseTooLarge {
            limit,
            status_url: None,
        }
    })?;
    if let Err(error) = coding::check_stored(&head.headers, &body, limit) {
        config.metrics.undecodable_response();
        tracing::warn!(
            %error,
            content_encoding = coding::named(&head.headers),
            status = head.status.as_u16(),
            "an answer does not decode as its Content-Encoding says: it is stored as sent, \
             and a retry that does not accept that coding gets it as stored all the same"
        );
    }
    let stored = StoredResponse {
        status: head.status.as_u16(),
        headers: config.stored_headers_of(&head.headers),
        body: body.to_vec(),
    };
    Ok(Captured { head, body, stored })
}

/// The headers that are stored and replayed: `Content-Type`, `Content-Encoding` (the body is
/// stored as it was sent, compressed or not, and is never replayed without the coding that
/// describes it), `Vary`, `Location`, `ETag`, and the route's own (`extra`).
pub fn stored_headers(headers: &HeaderMap, extra: &[HeaderName]) -> Vec<(String, Vec<u8>)> {
    let base = [
        header::CONTENT_TYPE,
        header::CONTENT_ENCODING,
        header::VARY,
        header::LOCATION,
        header::ETAG,
    ];
    base.iter()
        .chain(extra)
        .flat_map(|name| {
            headers
                .get_all(name)
                .iter()
                .map(move |v| (name.as_str().to_owned(), v.as_bytes().to_vec()))
        })
        .collect()
}

/// The answer to a claim this attempt did not win: a replay, 422 `key-reused`, 409
/// `request-in-flight` (with `Retry-After` from the owner's lease) or 409 `outcome-unknown`,
/// with the metrics outcome it counts as. Each answer given because a record was read carries
/// that record's `Idempotency-Key-Expires`; an in-flight answer without a record in hand (the
/// store's lock was not granted in time) carries none. A replay is sent in a coding that
/// `accept` (the retry's `Accept-Encoding` fields) takes when its body decodes within the
/// bound for the stored-answer limit `limit`.
pub(super) fn answer_claim(
    outcome: ClaimOutcome,
    key: &IdempotencyKey,
    now: Timestamp,
    accept: &[HeaderValue],
    limit: usize,
) -> (Outcome, Response) {
    let (outcome, mut response, expires_at) = match outcome {
        ClaimOutcome::Replay {
            response,
            expires_at,
            ..
        } => {
            let response = replay(response, expires_at, accept, limit);
            return (Outcome::Replayed, response);
        }
        ClaimOutcome::Mismatch {
            mismatch,
            expires_at,
        } => (
            Outcome::Mismatched,
            IdempotencyRejection::KeyReused(mismatch).into_response(),
            Some(expires_at),
        ),
        ClaimOutcome::InFlight {
            lease_expires_at,
            expires_at,
        } => {
            let retry_after = lease_expires_at
                .map(|t| now.until(t))
                .filter(|d| !d.is_zero())
                .unwrap_or(RETRY_AFTER);
            (
                Outcome::InFlight,
                IdempotencyRejection::InFlight { retry_after }.into_response(),
                expires_at,
            )
        }
        ClaimOutcome::OutcomeUnknown { expires_at } => (
            Outcome::Indeterminate,
            IdempotencyRejection::OutcomeUnknown {
                status_url: status_url(key),
            }
            .into_response(),
            Some(expires_at),
        ),
        ClaimOutcome::Owned { .. } => (
            Outcome::StoreError,
            IdempotencyRejection::Internal.into_response(),
            None,
        ),
    };
    if let Some(expires_at) = expires_at {
        add_expiry(response.headers_mut(), expires_at);
    }
    (outcome, response)
}

/// A replay of `stored`: its status, headers and body byte for byte (decoded when `accept`
/// does not take its coding: [`coding::for_retry`]), with `Idempotent-Replayed: true` and
/// `Idempotency-Key-Expires`.
fn replay(
    stored: StoredResponse,
    expires_at: Timestamp,
    accept: &[HeaderValue],
    limit: usize,
) -> Response {
    let mut headers = HeaderMap::new();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    let body = coding::for_retry(&mut headers, stored.body, accept, limit);
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    add_expiry(&mut headers, expires_at);
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    *response.headers_mut() = headers;
    response
}

/// Adds `Idempotency-Key-Expires: <HTTP date>` to a keyed response.
pub(super) fn add_expiry(headers: &mut HeaderMap, expires_at: Timestamp) {
    let at = expires_at.to_system_time();
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(at)) {
        headers.insert(EXPIRES_HEADER, value);
    }
}

/// The status resource URL of `key` (percent-encoded).
pub(crate) fn status_url(key: &IdempotencyKey) -> String {
    let mut url = format!("{STATUS_PATH}/");
    for b in key.as_str().bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            url.push(b as char);
        } else {
            url.push_str(&format!("%{b:02X}"));
        }
    }
    url
}
