//! Content codings of stored answers: which codings a retry accepts, and a stored body
//! decoded for a retry that does not accept the coding it was stored in.
//!
//! A stored body is kept as the handler (or the upstream) sent it, compressed or not, with
//! the `Content-Encoding` that describes it. A retry whose `Accept-Encoding` takes every
//! coding of the body gets it byte for byte; any other retry gets it decoded (gzip, deflate,
//! br, zstd), so that every attempt decodes to the same content. A request without
//! `Accept-Encoding` is taken to want the identity form, as compressing servers take it.

use std::pin::Pin;

use async_compression::tokio::bufread::{BrotliDecoder, GzipDecoder, ZlibDecoder, ZstdDecoder};
use axum::body::Body;
use http::{HeaderMap, HeaderValue, header};
use tokio::io::{AsyncRead, BufReader};
use tokio_util::io::ReaderStream;

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
}

type Reader = Pin<Box<dyn AsyncRead + Send>>;

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

/// The stored `body` with its replayed `headers`, as a retry with `accept` may receive it.
///
/// As stored when the body carries no coding, or `accept` takes every coding it carries, or
/// one of its codings is not one the layer decodes (nothing better can be sent). Otherwise
/// decoded, as it streams out: without `Content-Encoding` or a length, and without a strong
/// `ETag`, which names the encoded bytes only (a weak one names the content and is kept).
pub(super) fn for_retry(headers: &mut HeaderMap, body: Vec<u8>, accept: &[HeaderValue]) -> Body {
    let stored: Vec<HeaderValue> = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .cloned()
        .collect();
    let applied: Vec<&str> = items(&stored)
        .filter(|c| !c.eq_ignore_ascii_case("identity"))
        .collect();
    if applied.iter().all(|c| accepts(accept, c)) {
        return Body::from(body);
    }
    let Some(codings) = applied
        .iter()
        .map(|c| Coding::parse(c))
        .collect::<Option<Vec<_>>>()
    else {
        return Body::from(body);
    };
    headers.remove(header::CONTENT_ENCODING);
    headers.remove(header::CONTENT_LENGTH);
    if headers
        .get(header::ETAG)
        .is_some_and(|tag| !tag.as_bytes().starts_with(b"W/"))
    {
        headers.remove(header::ETAG);
    }
    if body.is_empty() {
        // Nothing to decode (a 204, say, that names a coding all the same).
        return Body::empty();
    }
    // The codings were applied in the order listed: the last one is undone first.
    let mut reader: Reader = Box::pin(std::io::Cursor::new(body));
    for coding in codings.into_iter().rev() {
        let inner = BufReader::new(reader);
        reader = match coding {
            Coding::Gzip => Box::pin(GzipDecoder::new(inner)),
            Coding::Deflate => Box::pin(ZlibDecoder::new(inner)),
            Coding::Br => Box::pin(BrotliDecoder::new(inner)),
            Coding::Zstd => Box::pin(ZstdDecoder::new(inner)),
        };
    }
    Body::from_stream(ReaderStream::new(reader))
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
    fn keeps_what_it_cannot_decode_and_what_is_accepted() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("compress"),
        );
        headers.insert(header::ETAG, HeaderValue::from_static("\"a\""));
        let _ = for_retry(&mut headers, b"x".to_vec(), &[]);
        assert_eq!(headers[header::CONTENT_ENCODING], "compress");
        assert_eq!(headers[header::ETAG], "\"a\"");
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let _ = for_retry(&mut headers, b"x".to_vec(), &accept(&["gzip"]));
        assert_eq!(headers[header::CONTENT_ENCODING], "gzip");
        assert_eq!(headers[header::ETAG], "\"a\"");
    }

    #[test]
    fn drops_the_coding_and_a_strong_etag_when_it_decodes() {
        for (etag, kept) in [("\"a\"", false), ("W/\"a\"", true)] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
            headers.insert(header::ETAG, HeaderValue::from_static(etag));
            let _ = for_retry(&mut headers, Vec::new(), &accept(&["gzip"]));
            assert!(headers.get(header::CONTENT_ENCODING).is_none());
            assert_eq!(headers.get(header::ETAG).is_some(), kept, "{etag}");
        }
    }
}
