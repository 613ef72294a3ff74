//! The layer's error answers: `application/problem+json` (RFC 9457), one stable `type` each.
//!
//! Every case names its problem type here, next to its definition; the type's status, title
//! and retry answer are declared once in [`idemkey_core::problem`] ([`problem::CONTRACT`]),
//! which `docs/guide/contract.md` is checked against. The gateway's own answers are the
//! gateway's, in `idemkey-server`.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use idemkey_core::problem::{self, ProblemType};
use idemkey_core::{FirstSentError, KeyError, Mismatch, Timestamp};

pub use idemkey_core::problem::{PROBLEM_JSON, PROBLEM_TYPE_PREFIX};

/// The content codings the layer decodes, as `Accept-Encoding` names them.
pub(crate) const DECODED_CODINGS: &str = "gzip, deflate, br, zstd";

/// An error answered by the idempotency layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// The route requires a key and the request had none.
    #[error("this request requires an Idempotency-Key header")]
    KeyMissing,
    /// The key header was malformed.
    #[error("{0}")]
    KeyInvalid(KeyError),
    /// The request body exceeded the route's limit.
    #[error("the request body is larger than {limit} bytes")]
    RequestTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request body could not be read.
    #[error("the request body could not be read")]
    RequestUnreadable,
    /// The request body is in a content coding the layer does not decode (415, with
    /// `Accept-Encoding` naming those it does).
    #[error(
        "the request body is in the content coding {coding:?}, which this server does not decode; it decodes {DECODED_CODINGS}"
    )]
    EncodingUnsupported {
        /// The coding named by `Content-Encoding`.
        coding: String,
    },
    /// The request body does not decode as its `Content-Encoding` says.
    #[error("the request body does not decode as its Content-Encoding says ({reason})")]
    RequestUndecodable {
        /// What the decoder found.
        reason: String,
    },
    /// `Repeatability-First-Sent` is missing where the route requires it, malformed, or
    /// further ahead than the clock-skew allowance.
    #[error("{0}")]
    FirstSent(FirstSentError),
    /// The first attempt was sent longer ago than the retention less the clock-skew margin,
    /// and no live record answers it: it is not run. The problem carries `first_sent`,
    /// `retention_secs` and `margin_secs`.
    #[error(
        "the first attempt of this request was sent more than the retention ({} s) less a margin of {} s ago, and no record of it is kept: it may have been executed already, so it was not executed again",
        retention.as_secs(),
        margin.as_secs_f64()
    )]
    FirstSentExpired {
        /// The first attempt's time the request stated.
        first_sent: Timestamp,
        /// The route's retention.
        retention: Duration,
        /// The clock-skew margin taken off it.
        margin: Duration,
    },
    /// The key was already used with a different request: the problem names the parts that
    /// differ (`differs`) and, for a JSON body, the first member that differs (`pointer`).
    #[error("this Idempotency-Key was used with a different request ({0})")]
    KeyReused(Mismatch),
    /// The first attempt with this key is still running.
    #[error("a request with this Idempotency-Key is still being processed")]
    InFlight {
        /// When to try again.
        retry_after: Duration,
    },
    /// The outcome of the first attempt is unknown and it will not be re-executed.
    #[error(
        "the outcome of the request with this Idempotency-Key is unknown; it will not be retried automatically"
    )]
    OutcomeUnknown {
        /// The status resource of the key.
        status_url: String,
    },
    /// The idempotency store could not be reached; nothing was executed.
    #[error("the idempotency store is unavailable; the request was not executed")]
    StoreUnavailable {
        /// When to try again.
        retry_after: Duration,
    },
    /// The store failed while committing: the request may or may not have been executed. A
    /// retry with the same key learns which (it replays the stored outcome, or executes).
    #[error(
        "the idempotency store failed while committing; the request may have been executed: retry with the same Idempotency-Key to learn its outcome"
    )]
    CommitUnknown {
        /// When to try again.
        retry_after: Duration,
    },
    /// The store did not grant its lock in time (SQLite: the single write lock, held by any
    /// request); nothing was executed.
    #[error("the idempotency store is busy; the request was not executed")]
    StoreBusy {
        /// When to try again.
        retry_after: Duration,
    },
    /// The answer was too large to store. In one local transaction, its effect was rolled
    /// back (`status_url` is `None`). After a call out (external mode, the gateway), the call
    /// may have taken effect: the operation is left indeterminate, never re-executed on its
    /// own, and `status_url` names its status resource.
    #[error(
        "the response was larger than {limit} bytes and could not be stored; {}",
        if .status_url.is_some() {
            "the request was sent on and may have taken effect: its outcome is unknown and it will not be retried automatically"
        } else {
            "nothing was executed"
        }
    )]
    ResponseTooLarge {
        /// The limit in bytes.
        limit: usize,
        /// The status resource of the key, when the operation was left indeterminate.
        status_url: Option<String>,
    },
    /// The handler panicked; its effect was rolled back.
    #[error("the request failed; nothing was executed")]
    Internal,
    /// The handler asked for a [`Tx`](crate::Tx) where the layer gives none (the layer is not
    /// installed on the route, or the transaction was extracted twice).
    #[error("no idempotency transaction for this handler: is the layer installed on this route?")]
    TransactionUnavailable,
    /// No such key for this caller (status resource).
    #[error("no idempotency record for this key")]
    KeyNotFound,
}

impl IdempotencyRejection {
    /// The problem type of this answer: its `type`, status and title, and whether a client
    /// may retry it with the same key.
    pub fn problem(&self) -> &'static ProblemType {
        match self {
            Self::KeyMissing => &problem::KEY_MISSING,
            Self::KeyInvalid(_) => &problem::KEY_INVALID,
            Self::RequestTooLarge { .. } => &problem::REQUEST_TOO_LARGE,
            Self::RequestUnreadable => &problem::REQUEST_UNREADABLE,
            Self::EncodingUnsupported { .. } => &problem::ENCODING_UNSUPPORTED,
            Self::RequestUndecodable { .. } => &problem::REQUEST_UNDECODABLE,
            Self::FirstSent(FirstSentError::Missing) => &problem::FIRST_SENT_MISSING,
            Self::FirstSent(_) => &problem::FIRST_SENT_INVALID,
            Self::FirstSentExpired { .. } => &problem::FIRST_SENT_EXPIRED,
            Self::KeyReused(_) => &problem::KEY_REUSED,
            Self::InFlight { .. } => &problem::REQUEST_IN_FLIGHT,
            Self::OutcomeUnknown { .. } => &problem::OUTCOME_UNKNOWN,
            Self::StoreUnavailable { .. } | Self::CommitUnknown { .. } => {
                &problem::STORE_UNAVAILABLE
            }
            Self::StoreBusy { .. } => &problem::STORE_BUSY,
            Self::ResponseTooLarge { .. } => &problem::RESPONSE_TOO_LARGE,
            Self::Internal => &problem::INTERNAL_ERROR,
            Self::TransactionUnavailable => &problem::TRANSACTION_UNAVAILABLE,
            Self::KeyNotFound => &problem::KEY_NOT_FOUND,
        }
    }

    /// The HTTP status of this answer.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.problem().status)
            .expect("every registered problem type has a valid status")
    }

    /// The problem type's name (the part after [`PROBLEM_TYPE_PREFIX`]).
    pub fn type_name(&self) -> &'static str {
        self.problem().name
    }
}

impl IntoResponse for IdempotencyRejection {
    fn into_response(self) -> Response {
        let mut more = serde_json::Map::new();
        let mut retry_after = None;
        let mut status_url = None;
        match &self {
            Self::KeyReused(m) => {
                more.insert("differs".into(), serde_json::json!(m.parts()));
                if let Some(pointer) = &m.pointer {
                    more.insert("pointer".into(), serde_json::json!(pointer));
                }
            }
            Self::FirstSentExpired {
                first_sent,
                retention,
                margin,
            } => {
                more.insert(
                    "first_sent".into(),
                    serde_json::json!(idemkey_core::http_date(*first_sent)),
                );
                more.insert(
                    "retention_secs".into(),
                    serde_json::json!(retention.as_secs()),
                );
                more.insert(
                    "margin_secs".into(),
                    serde_json::json!(margin.as_secs_f64()),
                );
            }
            Self::InFlight { retry_after: r }
            | Self::StoreUnavailable { retry_after: r }
            | Self::CommitUnknown { retry_after: r }
            | Self::StoreBusy { retry_after: r } => {
                retry_after = Some(r.as_secs().max(1));
            }
            Self::OutcomeUnknown { status_url: url }
            | Self::ResponseTooLarge {
                status_url: Some(url),
                ..
            } => status_url = Some(url.as_str()),
            _ => {}
        }
        let mut response = problem_response(
            self.problem(),
            self.to_string(),
            more,
            retry_after,
            status_url,
        );
        if matches!(self, Self::RequestTooLarge { .. }) {
            // The body may not have been read to its end: the connection cannot carry
            // another request.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if matches!(self, Self::EncodingUnsupported { .. }) {
            // RFC 9110, section 15.5.16: the codings a request body may be in.
            response.headers_mut().insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static(DECODED_CODINGS),
            );
        }
        response
    }
}

/// An `application/problem+json` answer of `problem`: its `type`, `title`, `status` and
/// `detail`, then the members `more`; `retry_after` (seconds) sets `Retry-After`, and
/// `status_url` adds the `status_url` member and a `Link` to it (`rel="status"`). The
/// layer's rejections, the gateway's and the reference server's are all written by it.
pub fn problem_response(
    problem: &ProblemType,
    detail: String,
    more: serde_json::Map<String, serde_json::Value>,
    retry_after: Option<u64>,
    status_url: Option<&str>,
) -> Response {
    let status = StatusCode::from_u16(problem.status)
        .expect("every registered problem type has a valid status");
    let mut body = more;
    body.insert("type".into(), serde_json::json!(problem.uri));
    body.insert("title".into(), serde_json::json!(problem.title));
    body.insert("status".into(), serde_json::json!(status.as_u16()));
    body.insert("detail".into(), serde_json::json!(detail));
    if let Some(url) = status_url {
        body.insert("status_url".into(), serde_json::json!(url));
    }
    let mut response = (status, serde_json::Value::Object(body).to_string()).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(secs) = retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if let Some(link) =
        status_url.and_then(|url| HeaderValue::from_str(&format!("<{url}>; rel=\"status\"")).ok())
    {
        headers.insert(header::LINK, link);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_registered_status_is_an_http_status() {
        // What `status()` relies on.
        for p in problem::ALL {
            assert!(StatusCode::from_u16(p.status).is_ok(), "{}", p.name);
        }
    }
}
