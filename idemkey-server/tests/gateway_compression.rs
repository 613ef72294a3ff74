//! `idemkey gateway` in front of an upstream that compresses its answers (an axum app with
//! tower-http's `CompressionLayer`, gzip and br, on loopback), and in front of answers too
//! large to store.
//!
//! A keyed request retried with any `Accept-Encoding` is a replay, never a mismatch; the
//! replay comes in a coding the retry accepts (the stored one, or none) and decodes to the
//! first answer's JSON. An answer over `--max-stored-response` is 500 `response-too-large`,
//! and the operation, which the upstream did carry out, is left indeterminate.
//!
//! Upstreams that compress as servers in the wild do: raw DEFLATE under `deflate` is decoded
//! for a retry like the zlib form; a truncated gzip body is replayed whole, as stored, with
//! its coding, and counted in `idemkey_undecodable_responses_total`. A request body the
//! client compresses anew on retry (another gzip header) is the same request.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_compression::tokio::bufread::{BrotliDecoder, DeflateEncoder, GzipDecoder, GzipEncoder};
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;
use tower_http::compression::CompressionLayer;

use common::gateway::{Gateway, serve_on_own_thread};

const TOKEN: &str = "tok1";

/// Effects per key.
type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// Counts one effect per `Idempotency-Key` and answers 201 with `lines` lines of JSON
/// naming the effect (a second execution would show), with a strong `ETag`.
async fn create(
    State(effects): State<Effects>,
    Path(lines): Path<usize>,
    headers: HeaderMap,
) -> Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let n = {
        let mut effects = effects.lock().unwrap();
        let n = effects.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    let items: Vec<Value> = (0..lines)
        .map(|i| json!({ "line": i, "sku": "abc-123" }))
        .collect();
    let body = json!({ "key": key, "effect": n, "items": items }).to_string();
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::ETAG, format!("\"{key}-{n}\"")),
        ],
        body,
    )
        .into_response()
}

/// The compressing upstream: `POST /v1/orders/{lines}`; and `POST /v1/encoded/{kind}`,
/// answering [`document`] as raw DEFLATE under `deflate` (`raw-deflate`) or as gzip cut in
/// half (`truncated-gzip`), whatever the request's `Accept-Encoding`.
fn upstream() -> (String, Effects) {
    let effects = Effects::default();
    let app = Router::new()
        .route("/v1/orders/{lines}", post(create))
        .layer(CompressionLayer::new())
        .route("/v1/encoded/{kind}", post(encoded))
        .with_state(effects.clone());
    (format!("http://{}", serve_on_own_thread(app)), effects)
}

/// The JSON document the `/v1/encoded` routes answer.
fn document() -> Vec<u8> {
    let items: Vec<Value> = (0..200).map(|i| json!({ "line": i })).collect();
    json!({ "items": items }).to_string().into_bytes()
}

async fn compressed(plain: &[u8], gzip: bool) -> Vec<u8> {
    let mut out = Vec::new();
    if gzip {
        GzipEncoder::new(plain).read_to_end(&mut out).await.unwrap();
    } else {
        DeflateEncoder::new(plain)
            .read_to_end(&mut out)
            .await
            .unwrap();
    }
    out
}

/// The stored bytes `POST /v1/encoded/{kind}` answers, and their coding.
async fn encoded_body(kind: &str) -> (&'static str, Vec<u8>) {
    match kind {
        "raw-deflate" => ("deflate", compressed(&document(), false).await),
        _ => {
            let mut gzip = compressed(&document(), true).await;
            gzip.truncate(gzip.len() / 2);
            ("gzip", gzip)
        }
    }
}

/// Counts one effect per key and answers 201 with the body of `kind`.
async fn encoded(
    State(effects): State<Effects>,
    Path(kind): Path<String>,
    headers: HeaderMap,
) -> Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    *effects.lock().unwrap().entry(key).or_default() += 1;
    let (coding, body) = encoded_body(&kind).await;
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CONTENT_ENCODING, coding),
        ],
        body,
    )
        .into_response()
}

async fn gateway(upstream: &str, dir: &tempfile::TempDir) -> Gateway {
    let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
    Gateway::start(&url, upstream, dir.path(), &[]).await
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body decoded as its `Content-Encoding` says, as JSON.
    async fn decoded(&self) -> Value {
        let mut plain = Vec::new();
        let body = &self.body[..];
        match self.header("content-encoding") {
            None => plain.extend_from_slice(body),
            Some("gzip") => {
                GzipDecoder::new(body)
                    .read_to_end(&mut plain)
                    .await
                    .unwrap();
            }
            Some("br") => {
                BrotliDecoder::new(body)
                    .read_to_end(&mut plain)
                    .await
                    .unwrap();
            }
            Some(other) => panic!("unexpected coding {other}"),
        }
        serde_json::from_slice(&plain)
            .unwrap_or_else(|e| panic!("not JSON once decoded ({e}): {:?}", self.headers))
    }
}

/// `POST /v1/orders/{lines}` with `key`, and `Accept-Encoding: accept` when given, through
/// a client that neither asks for a coding nor decodes one on its own.
async fn order(gateway: &Gateway, key: &str, lines: usize, accept: Option<&str>) -> Answer {
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut request = client
        .post(format!("{}/v1/orders/{lines}", gateway.base))
        .bearer_auth(TOKEN)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"sku":"abc-123"}"#);
    if let Some(accept) = accept {
        request = request.header("accept-encoding", accept);
    }
    let response = request.send().await.expect("POST");
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.bytes().await.expect("body").to_vec(),
    }
}

/// Whether a request with `accept` takes an answer in `coding`.
fn takes(accept: Option<&str>, coding: Option<&str>) -> bool {
    match coding {
        None => true,
        Some(coding) => accept.is_some_and(|a| a.split(',').any(|c| c.trim() == coding)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_of_compressed_answers_decode_to_the_first_answer() {
    let (base, effects) = upstream();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&base, &dir).await;
    let accepts = [Some("gzip"), Some("br"), Some("gzip, br"), None];
    for (n, first_accept) in accepts.into_iter().enumerate() {
        let key = format!("order-{n}");
        let first = order(&gw, &key, 50, first_accept).await;
        assert_eq!(first.status, 201, "{}", first.text());
        let coding = first.header("content-encoding").map(str::to_owned);
        assert_eq!(
            coding.is_some(),
            first_accept.is_some(),
            "the upstream compresses"
        );
        let original = first.decoded().await;
        assert_eq!(original["effect"], 1);
        for retry_accept in accepts {
            let what = format!("first {first_accept:?}, retry {retry_accept:?}");
            let replay = order(&gw, &key, 50, retry_accept).await;
            assert_eq!(replay.status, 201, "{what}: {}", replay.text());
            assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{what}");
            let replay_coding = replay.header("content-encoding");
            assert!(
                takes(retry_accept, replay_coding),
                "{what}: sent in {replay_coding:?}"
            );
            assert_eq!(replay.decoded().await, original, "{what}");
            if replay_coding == coding.as_deref() {
                assert_eq!(replay.body, first.body, "{what}: byte for byte");
                assert_eq!(replay.header("etag"), first.header("etag"), "{what}");
            } else {
                // Decoded for this retry: the strong ETag named the encoded bytes.
                assert!(!takes(retry_accept, coding.as_deref()), "{what}");
                assert_eq!(replay.header("etag"), None, "{what}");
            }
            if coding.is_some() {
                assert_eq!(replay.header("vary"), first.header("vary"), "{what}");
            }
        }
        assert_eq!(effects.lock().unwrap()[&key], 1, "{key}: executed once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_to_store_is_response_too_large_and_unknown() {
    let (base, effects) = upstream();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&base, &dir).await;
    // About 2 MiB of JSON, over the default 1 MiB limit when it is not compressed.
    let lines = 60_000;

    let first = order(&gw, "large", lines, None).await;
    assert_eq!(first.status, 500, "{}", first.text());
    assert_eq!(
        first.header("content-type"),
        Some("application/problem+json")
    );
    let problem: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:response-too-large");
    assert_eq!(problem["status_url"], "/idempotency/v1/keys/large");
    assert_eq!(
        first.header("link"),
        Some("</idempotency/v1/keys/large>; rel=\"status\"")
    );
    assert!(first.header("idempotency-key-expires").is_some());

    // The upstream did the work: never sent again, and the record says the outcome is unknown.
    let retry = order(&gw, "large", lines, None).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    let problem: Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:outcome-unknown");
    assert_eq!(effects.lock().unwrap()["large"], 1);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let status: Value = client
        .get(format!("{}/idempotency/v1/keys/large", gw.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["records"][0]["state"], "indeterminate", "{status}");

    // The limit is on the stored bytes: compressed, the same answer fits, and a retry that
    // takes no coding gets it whole, decoded.
    let compressed = order(&gw, "large-gzip", lines, Some("gzip")).await;
    assert_eq!(compressed.status, 201, "{}", compressed.text());
    assert_eq!(compressed.header("content-encoding"), Some("gzip"));
    let plain = order(&gw, "large-gzip", lines, None).await;
    assert_eq!(plain.status, 201);
    assert_eq!(plain.header("idempotent-replayed"), Some("true"));
    assert_eq!(plain.header("content-encoding"), None);
    assert!(plain.body.len() > 1 << 20, "{} bytes", plain.body.len());
    assert_eq!(plain.decoded().await, compressed.decoded().await);
    assert_eq!(effects.lock().unwrap()["large-gzip"], 1);
}

/// `POST path` with `key`, `Accept-Encoding: accept` when given, and `body` in
/// `Content-Encoding: coding` when given.
async fn post_to(
    gateway: &Gateway,
    path: &str,
    key: &str,
    accept: Option<&str>,
    coding: Option<&str>,
    body: Vec<u8>,
) -> Answer {
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut request = client
        .post(format!("{}{path}", gateway.base))
        .bearer_auth(TOKEN)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body);
    if let Some(accept) = accept {
        request = request.header("accept-encoding", accept);
    }
    if let Some(coding) = coding {
        request = request.header("content-encoding", coding);
    }
    let response = request.send().await.expect("POST");
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.bytes().await.expect("the whole body").to_vec(),
    }
}

/// The gateway's `idemkey_undecodable_responses_total`.
async fn undecodable(gateway: &Gateway) -> String {
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let text = client
        .get(format!("{}/metrics", gateway.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with("idemkey_undecodable_responses_total "))
        .unwrap_or("idemkey_undecodable_responses_total missing")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_deflate_answer_is_decoded_for_a_retry() {
    let (base, effects) = upstream();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&base, &dir).await;
    let (_, stored) = encoded_body("raw-deflate").await;
    let first = post_to(
        &gw,
        "/v1/encoded/raw-deflate",
        "raw",
        None,
        None,
        b"{}".into(),
    )
    .await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.header("content-encoding"), Some("deflate"));
    assert_eq!(first.body, stored);
    for accept in [None, Some("gzip")] {
        let retry = post_to(
            &gw,
            "/v1/encoded/raw-deflate",
            "raw",
            accept,
            None,
            b"{}".into(),
        )
        .await;
        assert_eq!(retry.status, 201, "{accept:?}: {}", retry.text());
        assert_eq!(retry.header("idempotent-replayed"), Some("true"));
        assert_eq!(retry.header("content-encoding"), None, "{accept:?}");
        assert_eq!(retry.body, document(), "{accept:?}");
    }
    assert_eq!(effects.lock().unwrap()["raw"], 1);
    assert_eq!(
        undecodable(&gw).await,
        "idemkey_undecodable_responses_total 0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_gzip_answer_is_replayed_whole_as_stored() {
    let (base, effects) = upstream();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&base, &dir).await;
    let (_, stored) = encoded_body("truncated-gzip").await;
    let path = "/v1/encoded/truncated-gzip";
    let first = post_to(&gw, path, "cut", Some("gzip"), None, b"{}".into()).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.body, stored);
    assert_eq!(
        undecodable(&gw).await,
        "idemkey_undecodable_responses_total 1"
    );
    for accept in [None, Some("br"), Some("gzip")] {
        // A cut stream would fail `bytes()`: the whole stored body comes, in its coding.
        let retry = post_to(&gw, path, "cut", accept, None, b"{}".into()).await;
        assert_eq!(retry.status, 201, "{accept:?}: {}", retry.text());
        assert_eq!(retry.header("idempotent-replayed"), Some("true"));
        assert_eq!(retry.header("content-encoding"), Some("gzip"), "{accept:?}");
        assert_eq!(retry.body, stored, "{accept:?}");
    }
    assert_eq!(effects.lock().unwrap()["cut"], 1);
    assert_eq!(
        undecodable(&gw).await,
        "idemkey_undecodable_responses_total 1"
    );
}

/// `body` in gzip with `mtime` in its header: the same content, other bytes.
async fn gzip_at(body: &[u8], mtime: u32) -> Vec<u8> {
    let mut out = compressed(body, true).await;
    // RFC 1952: MTIME is bytes 4 to 7; without FHCRC nothing else covers them.
    out[4..8].copy_from_slice(&mtime.to_le_bytes());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_compressed_anew_on_retry_is_the_same_request() {
    let (base, effects) = upstream();
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&base, &dir).await;
    let path = "/v1/orders/3";
    let order = br#"{"sku":"abc-123"}"#;
    let first = post_to(&gw, path, "gz", None, Some("gzip"), gzip_at(order, 1).await).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = post_to(&gw, path, "gz", None, Some("gzip"), gzip_at(order, 2).await).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(effects.lock().unwrap()["gz"], 1);

    let other = gzip_at(br#"{"sku":"xyz-999"}"#, 1).await;
    let reused = post_to(&gw, path, "gz", None, Some("gzip"), other).await;
    assert_eq!(reused.status, 422, "{}", reused.text());
    let problem: Value = serde_json::from_slice(&reused.body).unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:key-reused");

    let unknown = post_to(&gw, path, "lzw", None, Some("compress"), b"x".into()).await;
    assert_eq!(unknown.status, 415, "{}", unknown.text());
    assert_eq!(
        unknown.header("accept-encoding"),
        Some("gzip, deflate, br, zstd")
    );
    let problem: Value = serde_json::from_slice(&unknown.body).unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:encoding-unsupported");
    let corrupt = post_to(&gw, path, "bad", None, Some("gzip"), b"not gzip".into()).await;
    assert_eq!(corrupt.status, 400, "{}", corrupt.text());
    let problem: Value = serde_json::from_slice(&corrupt.body).unwrap();
    assert_eq!(problem["type"], "urn:idemkey:problem:request-undecodable");
    assert_eq!(effects.lock().unwrap().get("lzw"), None);
    assert_eq!(effects.lock().unwrap().get("bad"), None);
}
