//! RFC 9457 problem details.

use std::fmt;

use bytes::Bytes;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderMap};
use serde_json::{Map, Value};

/// The stable problem `type` values of the idemkey contract (`docs/guide/contract.md`).
///
/// Each is the [`uri`](idemkey_core::problem::ProblemType::uri) of the problem type of the same
/// name in [`idemkey_core::problem`], where its status, title and whether the client retries
/// it are declared: the contract's and the gateway's ([`idemkey_core::problem::ALL`]).
pub mod types {
    use idemkey_core::problem as registry;

    /// [`KEY_MISSING`](registry::KEY_MISSING): the route requires an `Idempotency-Key`.
    pub const KEY_MISSING: &str = registry::KEY_MISSING.uri;
    /// [`KEY_INVALID`](registry::KEY_INVALID): the key is malformed, or the header appears more
    /// than once.
    pub const KEY_INVALID: &str = registry::KEY_INVALID.uri;
    /// [`REQUEST_TOO_LARGE`](registry::REQUEST_TOO_LARGE): the body is over the route's limit.
    pub const REQUEST_TOO_LARGE: &str = registry::REQUEST_TOO_LARGE.uri;
    /// [`REQUEST_UNREADABLE`](registry::REQUEST_UNREADABLE): the body could not be read; nothing
    /// ran.
    pub const REQUEST_UNREADABLE: &str = registry::REQUEST_UNREADABLE.uri;
    /// [`KEY_REUSED`](registry::KEY_REUSED): the key was used with a different request.
    pub const KEY_REUSED: &str = registry::KEY_REUSED.uri;
    /// [`REQUEST_IN_FLIGHT`](registry::REQUEST_IN_FLIGHT): the first attempt is still running.
    pub const REQUEST_IN_FLIGHT: &str = registry::REQUEST_IN_FLIGHT.uri;
    /// [`OUTCOME_UNKNOWN`](registry::OUTCOME_UNKNOWN): the outcome of the first attempt is unknown
    /// until it is resolved.
    pub const OUTCOME_UNKNOWN: &str = registry::OUTCOME_UNKNOWN.uri;
    /// [`STORE_UNAVAILABLE`](registry::STORE_UNAVAILABLE): the idempotency store is unreachable;
    /// nothing ran.
    pub const STORE_UNAVAILABLE: &str = registry::STORE_UNAVAILABLE.uri;
    /// [`STORE_BUSY`](registry::STORE_BUSY): the store did not grant its lock in time; nothing ran.
    pub const STORE_BUSY: &str = registry::STORE_BUSY.uri;
    /// [`RESPONSE_TOO_LARGE`](registry::RESPONSE_TOO_LARGE): the response was too large to store;
    /// its effect was rolled back, or, after a call out (the gateway), the outcome is unknown.
    pub const RESPONSE_TOO_LARGE: &str = registry::RESPONSE_TOO_LARGE.uri;
    /// [`INTERNAL_ERROR`](registry::INTERNAL_ERROR): the handler failed; its effect was rolled
    /// back.
    pub const INTERNAL_ERROR: &str = registry::INTERNAL_ERROR.uri;
    /// [`TRANSACTION_UNAVAILABLE`](registry::TRANSACTION_UNAVAILABLE): server misconfiguration: no
    /// idempotency transaction for the handler.
    pub const TRANSACTION_UNAVAILABLE: &str = registry::TRANSACTION_UNAVAILABLE.uri;
    /// [`KEY_NOT_FOUND`](registry::KEY_NOT_FOUND): the status resource has no record of the key.
    pub const KEY_NOT_FOUND: &str = registry::KEY_NOT_FOUND.uri;
    /// [`UPSTREAM_UNAVAILABLE`](registry::UPSTREAM_UNAVAILABLE): gateway: the upstream could not be
    /// reached; nothing was sent.
    pub const UPSTREAM_UNAVAILABLE: &str = registry::UPSTREAM_UNAVAILABLE.uri;
    /// [`UPSTREAM_OUTCOME_UNKNOWN`](registry::UPSTREAM_OUTCOME_UNKNOWN): gateway: sent upstream, no
    /// complete answer came back.
    pub const UPSTREAM_OUTCOME_UNKNOWN: &str = registry::UPSTREAM_OUTCOME_UNKNOWN.uri;
    /// [`UPSTREAM_FAILED`](registry::UPSTREAM_FAILED): gateway, request without a key: no complete
    /// answer came back.
    pub const UPSTREAM_FAILED: &str = registry::UPSTREAM_FAILED.uri;
    /// [`SERVER_OVERLOADED`](registry::SERVER_OVERLOADED): the server is at its limit of client
    /// connections; nothing ran.
    pub const SERVER_OVERLOADED: &str = registry::SERVER_OVERLOADED.uri;
    /// [`FIRST_SENT_EXPIRED`](registry::FIRST_SENT_EXPIRED): the first attempt is older than
    /// the server's retention and no record of it is kept; it was not run again.
    pub const FIRST_SENT_EXPIRED: &str = registry::FIRST_SENT_EXPIRED.uri;
    /// The RFC 9457 default when a problem names no type.
    pub const ABOUT_BLANK: &str = "about:blank";
}

/// An error answer from the server, as RFC 9457 problem details, with the raw response.
///
/// A body that is not a JSON object still makes a `Problem`: its type is `about:blank` and
/// every member is `None`; [`body`](Self::body) keeps what was sent.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Problem {
    /// The problem `type` (`about:blank` when absent).
    pub problem_type: String,
    /// The `title` member.
    pub title: Option<String>,
    /// The `status` member (the HTTP status is [`http_status`](Self::http_status)).
    pub status: Option<u16>,
    /// The `detail` member.
    pub detail: Option<String>,
    /// The `instance` member.
    pub instance: Option<String>,
    /// Every other member (e.g. `differs`, `status_url`).
    pub extensions: Map<String, Value>,
    /// The HTTP status of the response.
    pub http_status: StatusCode,
    /// The response headers (e.g. `Link` for `outcome-unknown`).
    pub headers: HeaderMap,
    /// The raw response body.
    pub body: Bytes,
}

impl Problem {
    /// Reads problem details from a response. Members of the wrong JSON type are ignored, as
    /// RFC 9457 asks.
    pub(crate) fn parse(http_status: StatusCode, headers: HeaderMap, body: Bytes) -> Self {
        let mut members = if is_json(&headers) {
            match serde_json::from_slice::<Value>(&body) {
                Ok(Value::Object(map)) => map,
                _ => Map::new(),
            }
        } else {
            Map::new()
        };
        let mut text = |name: &str| match members.remove(name) {
            Some(Value::String(s)) => Some(s),
            Some(other) => {
                members.insert(name.to_owned(), other);
                None
            }
            None => None,
        };
        let problem_type = text("type").unwrap_or_else(|| types::ABOUT_BLANK.to_owned());
        let title = text("title");
        let detail = text("detail");
        let instance = text("instance");
        let status = match members.get("status").and_then(Value::as_u64) {
            Some(n) => {
                members.remove("status");
                u16::try_from(n).ok()
            }
            None => None,
        };
        Self {
            problem_type,
            title,
            status,
            detail,
            instance,
            extensions: members,
            http_status,
            headers,
            body,
        }
    }

    /// Whether this problem has the given `type`.
    pub fn is(&self, problem_type: &str) -> bool {
        self.problem_type == problem_type
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.http_status.as_u16(), self.problem_type)?;
        if let Some(detail) = self.detail.as_ref().or(self.title.as_ref()) {
            write!(f, ": {detail}")?;
        }
        Ok(())
    }
}

/// Whether a response says its body is JSON (`application/json`, `application/problem+json`…).
pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|essence| {
            let essence = essence.trim().to_ascii_lowercase();
            essence == "application/json" || essence.ends_with("+json")
        })
        .unwrap_or(false)
}

/// The problem `type` of a JSON body, if it has one.
pub(crate) fn problem_type(headers: &HeaderMap, body: &[u8]) -> Option<String> {
    if !is_json(headers) {
        return None;
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(mut map)) => match map.remove("type") {
            Some(Value::String(s)) => Some(s),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn problem_json() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h
    }

    #[test]
    fn parses_members_and_keeps_extensions() {
        let body = Bytes::from_static(
            br#"{"type":"urn:idemkey:problem:key-reused","title":"T","status":422,"detail":"D","differs":["body"]}"#,
        );
        let p = Problem::parse(
            StatusCode::UNPROCESSABLE_ENTITY,
            problem_json(),
            body.clone(),
        );
        assert!(p.is(types::KEY_REUSED));
        assert_eq!(p.title.as_deref(), Some("T"));
        assert_eq!(p.status, Some(422));
        assert_eq!(p.detail.as_deref(), Some("D"));
        assert_eq!(p.extensions["differs"], serde_json::json!(["body"]));
        assert_eq!(p.body, body);
    }

    #[test]
    fn tolerates_bodies_that_are_not_problems() {
        let p = Problem::parse(
            StatusCode::BAD_REQUEST,
            HeaderMap::new(),
            Bytes::from_static(b"nope"),
        );
        assert!(p.is(types::ABOUT_BLANK));
        assert_eq!(p.status, None);
        let p = Problem::parse(
            StatusCode::BAD_REQUEST,
            problem_json(),
            Bytes::from_static(br#"{"type":7,"status":"x"}"#),
        );
        assert!(p.is(types::ABOUT_BLANK));
        assert_eq!(p.status, None);
        assert_eq!(p.extensions["type"], serde_json::json!(7));
    }
}
