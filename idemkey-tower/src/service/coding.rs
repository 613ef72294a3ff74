//! Content codings: which codings a retry accepts, a stored body decoded for a retry that
//! does not accept the coding it was stored in, and a request body decoded for its
//! fingerprint.
//!
//! A stored body is kept as the handler (or the upstream) sent it, compressed or not, with
//! the `Content-Encoding` that describes it. A retry whose `Accept-Encoding` takes every
//! coding of the body gets it byte for byte; any other retry gets it decoded (gzip, deflate
//! with or without its zlib wrapper, br, zstd), so that every attempt decodes to the same
//! content. A request without `Accept-Encoding` is taken to want the identity form, as
//! compressing servers take it.
//!
//! Decoding is bounded: a body may decode to at most [`DECODED_FACTOR`] times the limit on
//! its encoded bytes (the stored-answer limit for answers, the request limit for requests),
//! so a small body that inflates without end (a decompression bomb) costs that much work and
//! memory, no more. A stored body that does not decode within the bound, or at all (a
//! truncated gzip, say), is replayed as stored, whole, with its `Content-Encoding`: it is
//! decoded into memory before any byte is sent, so a retry never gets a stream cut halfway.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use async_compression::tokio::bufread::{
    BrotliDecoder, DeflateDecoder, GzipDecoder, ZlibDecoder, ZstdDecoder,
};
use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, header};
use tokio::io::{AsyncRead, ReadBuf};

/// How many times the limit on its encoded bytes a body may decode to.
pub(super) const DECODED_FACTOR: usize = 16;

/// A content coding the layer can decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coding {
    Gzip,
    Deflate,
    Br,
    Zstd,
}

impl Coding {
    fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "gzip" | "x-gzip" => Some(Self::Gzip),
            "deflate" => Some(Self::Deflate),
            "br" => Some(Self::Br),
            "zstd" => Some(Self::Zstd),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Gzip => "gzip",
            Self::Deflate => "deflate",
            Self::Br => "br",
            Self::Zstd => "zstd",
        }
    }
}

/// Why a body does not decode.
#[derive(Debug, thiserror::Error)]
pub(super) enum Undecodable {
    /// A coding the layer does not decode.
    #[error("the content coding {0:?} is not one this server decodes")]
    Unknown(String),
    /// The bytes are not in the coding named (corrupt, truncated).
    #[error("the body does not decode as {coding}: {source}")]
    Corrupt {
        coding: &'static str,
        #[source]
        source: io::Error,
    },
    /// It decodes to more than the bound.
    #[error("the body decodes to more than {0} bytes")]
    TooLarge(usize),
}

/// The bound on what a body whose encoded bytes are limited to `limit` may decode to.
pub(super) fn decoded_limit(limit: usize) -> usize {
    limit.saturating_mul(DECODED_FACTOR)
}

/// The codings applied to a body with `headers`, in the order applied (`identity` left
/// out); `Err` names the first one the layer does not decode.
fn codings(headers: &HeaderMap) -> Result<Vec<Coding>, Undecodable> {
    let mut codings = Vec::new();
    for value in headers.get_all(header::CONTENT_ENCODING) {
        let unknown = || Undecodable::Unknown(String::from_utf8_lossy(value.as_bytes()).into());
        let text = value.to_str().map_err(|_| unknown())?;
        for name in text.split(',').map(str::trim) {
            if name.is_empty() || name.eq_ignore_ascii_case("identity") {
                continue;
            }
            let coding = Coding::parse(name).ok_or_else(|| Undecodable::Unknown(name.into()))?;
            codings.push(coding);
        }
    }
    Ok(codings)
}

/// The `Content-Encoding` fields of `headers` as one list, for a log line.
pub(super) fn named(headers: &HeaderMap) -> String {
    let fields = headers.get_all(header::CONTENT_ENCODING).iter();
    let names: Vec<_> = fields
        .map(|v| String::from_utf8_lossy(v.as_bytes()))
        .collect();
    names.join(", ")
}

/// Whether `body` opens with a zlib header (RFC 1950: method 8 with a window of at most
/// 32 KiB, and a check that makes the first two bytes a multiple of 31). `deflate` names the
/// zlib format, yet many servers send raw DEFLATE under it; this tells them apart as
/// browsers do.
fn zlib_wrapped(body: &[u8]) -> bool {
    matches!(body, [cmf, flg, ..]
        if cmf & 0x0f == 8 && cmf >> 4 <= 7 && (u16::from(*cmf) << 8 | u16::from(*flg)) % 31 == 0)
}

/// Decodes `body`, to which `codings` were applied in order, handing the decoded bytes to
/// `out` as they come: at most `limit` of them, and of each intermediate coding as many.
fn decode(
    body: &[u8],
    codings: &[Coding],
    limit: usize,
    out: &mut dyn FnMut(&[u8]),
) -> Result<(), Undecodable> {
    // The codings were applied in the order listed: the last one is undone first.
    match codings.split_last() {
        None => {
            out(body);
            Ok(())
        }
        Some((&last, [])) => decode_one(body, last, limit, out),
        Some((&last, earlier)) => {
            let mut inner = Vec::new();
            decode_one(body, last, limit, &mut |chunk| {
                inner.extend_from_slice(chunk)
            })?;
            decode(&inner, earlier, limit, out)
        }
    }
}

/// Undoes one `coding` of `body`, handing at most `limit` decoded bytes to `out`.
fn decode_one(
    body: &[u8],
    coding: Coding,
    limit: usize,
    out: &mut dyn FnMut(&[u8]),
) -> Result<(), Undecodable> {
    if body.is_empty() {
        // Nothing to decode (a 204, say, that names a coding all the same).
        return Ok(());
    }
    let corrupt = |source| Undecodable::Corrupt {
        coding: coding.name(),
        source,
    };
    let mut decoder: Pin<Box<dyn AsyncRead + '_>> = match coding {
        Coding::Gzip => Box::pin(GzipDecoder::new(body)),
        Coding::Deflate if zlib_wrapped(body) => Box::pin(ZlibDecoder::new(body)),
        Coding::Deflate => Box::pin(DeflateDecoder::new(body)),
        Coding::Br => Box::pin(BrotliDecoder::new(body)),
        Coding::Zstd => Box::pin(ZstdDecoder::new(body)),
    };
    // The body is in memory: the decoder never waits, so it is driven here, without a
    // runtime, and its work is bounded by `limit`.
    let mut cx = Context::from_waker(Waker::noop());
    let mut chunk = vec![0; 16 * 1024];
    let mut decoded = 0usize;
    loop {
        let mut buf = ReadBuf::new(&mut chunk);
        match decoder.as_mut().poll_read(&mut cx, &mut buf) {
            Poll::Ready(Ok(())) if buf.filled().is_empty() => return Ok(()),
            Poll::Ready(Ok(())) => {
                decoded = decoded.saturating_add(buf.filled().len());
                if decoded > limit {
                    return Err(Undecodable::TooLarge(limit));
                }
                out(buf.filled());
            }
            Poll::Ready(Err(e)) => return Err(corrupt(e)),
            Poll::Pending => {
                return Err(corrupt(io::Error::other(
                    "the decoder waited on a body held in memory",
                )));
            }
        }
    }
}

/// Whether a stored body with `headers` decodes as its `Content-Encoding` says, within the
/// bound for a stored-answer limit of `limit`: what a retry that does not take its coding
/// will get. The decoded bytes are not kept. A coding the layer does not decode is not
/// checked: such a body is always replayed as stored.
pub(super) fn check_stored(
    headers: &HeaderMap,
    body: &[u8],
    limit: usize,
) -> Result<(), Undecodable> {
    match codings(headers) {
        Ok(codings) => decode(body, &codings, decoded_limit(limit), &mut |_| {}),
        Err(_) => Ok(()),
    }
}

/// A request body with `headers`, decoded as its `Content-Encoding` says (as it is when it
/// names none), within the bound for a request limit of `limit`: what its fingerprint is of.
pub(super) fn request_content(
    headers: &HeaderMap,
    body: &Bytes,
    limit: usize,
) -> Result<Bytes, Undecodable> {
    let codings = codings(headers)?;
    if codings.is_empty() {
        return Ok(body.clone());
    }
    let mut plain = Vec::new();
    decode(body, &codings, decoded_limit(limit), &mut |chunk| {
        plain.extend_from_slice(chunk)
    })?;
    Ok(plain.into())
}

/// The items of a comma-separated list over every field of `values`.
fn items(values: &[HeaderValue]) -> impl Iterator<Item = &str> {
    values
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|item| !item.is_empty())
}

/// Whether `accept` (the request's `Accept-Encoding` fields) takes `coding`: named, or
/// covered by `*`, with a quality above zero (RFC 9110, section 12.5.3). A coding named with
/// `q=0` is refused even where `*` would take it.
fn accepts(accept: &[HeaderValue], coding: &str) -> bool {
    // `x-gzip` is another name of `gzip`.
    let canonical = |name: &str| {
        if name.eq_ignore_ascii_case("x-gzip") {
            "gzip".to_owned()
        } else {
            name.to_ascii_lowercase()
        }
    };
    let coding = canonical(coding);
    let mut wildcard = false;
    for item in items(accept) {
        let mut parts = item.split(';');
        let name = canonical(parts.next().unwrap_or_default().trim());
        let weight = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .and_then(|(_, q)| q.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        if name == coding {
            return weight > 0.0;
        }
        if name == "*" {
            wildcard = weight > 0.0;
        }
    }
    wildcard
}

/// The stored `body` with its replayed `headers`, as a retry with `accept` may receive it;
/// `limit` is the stored-answer limit, which bounds the decoding.
///
/// As stored when the body carries no coding, or `accept` takes every coding it carries, or
/// one of its codings is not one the layer decodes, or it does not decode within the bound
/// (nothing better can be sent: a warning says so). Otherwise decoded whole before anything
/// is sent: without `Content-Encoding` or a length, and without a strong `ETag`, which names
/// the encoded bytes only (a weak one names the content and is kept).
pub(super) fn for_retry(
    headers: &mut HeaderMap,
    body: Vec<u8>,
    accept: &[HeaderValue],
    limit: usize,
) -> Body {
    let Ok(codings) = codings(headers) else {
        return Body::from(body);
    };
    if codings.iter().all(|c| accepts(accept, c.name())) {
        return Body::from(body);
    }
    let mut plain = Vec::new();
    if let Err(error) = decode(&body, &codings, decoded_limit(limit), &mut |chunk| {
        plain.extend_from_slice(chunk)
    }) {
        tracing::warn!(
            %error,
            content_encoding = named(headers),
            "a stored answer does not decode as its Content-Encoding says: replayed as stored, \
             in that coding, to a retry that does not accept it"
        );
        return Body::from(body);
    }
    headers.remove(header::CONTENT_ENCODING);
    headers.remove(header::CONTENT_LENGTH);
    if headers
        .get(header::ETAG)
        .is_some_and(|tag| !tag.as_bytes().starts_with(b"W/"))
    {
        headers.remove(header::ETAG);
    }
    Body::from(plain)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accept(values: &[&'static str]) -> Vec<HeaderValue> {
        values.iter().map(|v| HeaderValue::from_static(v)).collect()
    }

    #[test]
    fn reads_accept_encoding_as_rfc_9110_does() {
        assert!(accepts(&accept(&["gzip, deflate, br"]), "gzip"));
        assert!(accepts(&accept(&["deflate", "GZIP;q=0.5"]), "gzip"));
        assert!(accepts(&accept(&["x-gzip"]), "gzip"));
        assert!(accepts(&accept(&["gzip"]), "x-gzip"));
        assert!(accepts(&accept(&["*"]), "br"));
        assert!(!accepts(&accept(&[]), "gzip"));
        assert!(!accepts(&accept(&[""]), "gzip"));
        assert!(!accepts(&accept(&["identity"]), "gzip"));
        assert!(!accepts(&accept(&["br"]), "gzip"));
        assert!(!accepts(&accept(&["gzip;q=0"]), "gzip"));
        assert!(!accepts(&accept(&["*, gzip; q=0.000"]), "gzip"));
        assert!(!accepts(&accept(&["*;q=0"]), "br"));
    }

    #[test]
    fn reads_content_encoding_in_the_order_applied() {
        let mut headers = HeaderMap::new();
        for value in ["identity, gzip", "BR", ""] {
            headers.append(header::CONTENT_ENCODING, HeaderValue::from_static(value));
        }
        let read = codings(&headers).unwrap();
        assert_eq!(read, [Coding::Gzip, Coding::Br]);
        headers.append(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("compress"),
        );
        assert!(matches!(codings(&headers), Err(Undecodable::Unknown(c)) if c == "compress"));
    }

    #[test]
    fn names_to_a_client_exactly_the_codings_it_decodes() {
        let listed: Vec<&str> = crate::problem::DECODED_CODINGS.split(", ").collect();
        let decoded = [Coding::Gzip, Coding::Deflate, Coding::Br, Coding::Zstd];
        assert_eq!(listed, decoded.map(Coding::name));
        assert!(listed.iter().all(|name| Coding::parse(name).is_some()));
    }

    #[test]
    fn tells_zlib_deflate_from_raw_deflate() {
        // What zlib writes at its levels, and what a raw stream opens with.
        for zlib in [
            [0x78, 0x01],
            [0x78, 0x5e],
            [0x78, 0x9c],
            [0x78, 0xda],
            [0x08, 0x1d],
        ] {
            assert!(zlib_wrapped(&zlib), "{zlib:02x?}");
        }
        for raw in [
            &[0xed, 0x9c][..],
            &[0x4b, 0x4c],
            &[0x01, 0x00],
            &[0x78],
            &[],
        ] {
            assert!(!zlib_wrapped(raw), "{raw:02x?}");
        }
    }

    #[test]
    fn keeps_what_it_cannot_decode_and_what_is_accepted() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("compress"),
        );
        headers.insert(header::ETAG, HeaderValue::from_static("\"a\""));
        let _ = for_retry(&mut headers, b"x".to_vec(), &[], 1024);
        assert_eq!(headers[header::CONTENT_ENCODING], "compress");
        assert_eq!(headers[header::ETAG], "\"a\"");
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let _ = for_retry(&mut headers, b"x".to_vec(), &accept(&["gzip"]), 1024);
        assert_eq!(headers[header::CONTENT_ENCODING], "gzip");
        assert_eq!(headers[header::ETAG], "\"a\"");
    }

    #[test]
    fn drops_the_coding_and_a_strong_etag_when_it_decodes() {
        for (etag, kept) in [("\"a\"", false), ("W/\"a\"", true)] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
            headers.insert(header::ETAG, HeaderValue::from_static(etag));
            let _ = for_retry(&mut headers, Vec::new(), &accept(&["gzip"]), 1024);
            assert!(headers.get(header::CONTENT_ENCODING).is_none());
            assert_eq!(headers.get(header::ETAG).is_some(), kept, "{etag}");
        }
    }
}
