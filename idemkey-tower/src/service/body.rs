//! Request bodies: read whole, bounded, and their content.

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, header};
use http_body_util::BodyExt;

use super::coding::{self, Undecodable};
use crate::IdempotencyRejection;

/// How much of an over-limit body is read and discarded before the 413, so the client,
/// still sending, gets the answer instead of a reset connection.
const DRAIN_LIMIT: usize = 4 * 1024 * 1024;

/// Reads a request body of at most `limit` bytes: 413 `request-too-large` past it (an
/// over-limit body is drained up to 4 MiB beyond the limit first, so a client still sending
/// gets the answer), 400 `request-unreadable` when it cannot be read.
pub(super) async fn read_body(
    headers: &HeaderMap,
    mut body: Body,
    limit: usize,
) -> Result<bytes::Bytes, IdempotencyRejection> {
    let too_large = IdempotencyRejection::RequestTooLarge { limit };
    let drain_cap = limit.saturating_add(DRAIN_LIMIT);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > drain_cap as u64) {
        return Err(too_large);
    }
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| IdempotencyRejection::RequestUnreadable)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen > drain_cap {
            return Err(too_large);
        }
        if seen <= limit {
            buf.extend_from_slice(&data);
        }
    }
    if seen > limit {
        return Err(too_large);
    }
    Ok(buf.freeze())
}

/// The content of a request body read within `limit`, which its fingerprint is of: decoded
/// when its `Content-Encoding` names a coding, to at most 16 times `limit` (past it: 413
/// `request-too-large`); 415 `encoding-unsupported` for a coding the layer does not decode,
/// 400 `request-undecodable` for a body that does not decode.
pub(super) fn content(
    headers: &HeaderMap,
    body: &Bytes,
    limit: usize,
) -> Result<Bytes, IdempotencyRejection> {
    coding::request_content(headers, body, limit).map_err(|e| match e {
        Undecodable::Unknown(coding) => IdempotencyRejection::EncodingUnsupported { coding },
        Undecodable::TooLarge(limit) => IdempotencyRejection::RequestTooLarge { limit },
        Undecodable::Corrupt { coding, source } => IdempotencyRejection::RequestUndecodable {
            reason: format!("{coding}: {source}"),
        },
    })
}
