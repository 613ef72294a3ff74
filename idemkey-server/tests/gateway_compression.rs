//! `idemkey gateway` in front of an upstream that compresses its answers (an axum app with
//! tower-http's `CompressionLayer`, gzip and br, on loopback), and in front of answers too
//! large to store.
//!
//! A keyed request retried with any `Accept-Encoding` is a replay, never a mismatch; the
//! replay comes in a coding the retry accepts (the stored one, or none) and decodes to the
//! first answer's JSON. An answer over `--max-stored-response` is 500 `response-too-large`,
//! and the operation, which the upstream did carry out, is left indeterminate.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_compression::tokio::bufread::{BrotliDecoder, GzipDecoder};
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

/// The compressing upstream: `POST /v1/orders/{lines}`.
fn upstream() -> (String, Effects) {
    let effects = Effects::default();
    let app = Router::new()
        .route("/v1/orders/{lines}", post(create))
        .layer(CompressionLayer::new())
        .with_state(effects.clone());
    (format!("http://{}", serve_on_own_thread(app)), effects)
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
