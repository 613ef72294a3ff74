//! HTTP helpers: the [`Api`] client of one server, its [`Answer`]s, and assertions on them.

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};

use super::*;

/// An answer, read whole.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    /// The body as JSON.
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "answer {} is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header's value as text.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Whether `idempotent-replayed: true` is present.
    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The problem `type` of a problem+json answer.
    pub(crate) fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "status {}: {}",
            self.status,
            self.text()
        );
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }

    /// The body as text, for messages.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts a problem answer with this status and type name.
    #[track_caller]
    pub(crate) fn assert_problem(&self, status: u16, name: &str) {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(self.problem_type(), format!("urn:idemkey:problem:{name}"));
    }

    /// Asserts a `409 request-in-flight` with a `Retry-After` of at least one second.
    #[track_caller]
    pub(crate) fn assert_in_flight(&self) {
        self.assert_problem(409, "request-in-flight");
        let retry_after: u64 = self
            .header("retry-after")
            .expect("409 carries Retry-After")
            .parse()
            .expect("Retry-After in seconds");
        assert!(retry_after >= 1, "Retry-After {retry_after}");
    }
}

/// A client of one server.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    /// A client of the server at `base`.
    pub(crate) fn new(base: &str) -> Self {
        Self::with(base, reqwest::Client::builder())
    }

    /// A client that opens a new connection for every request.
    pub(crate) fn without_keep_alive(base: &str) -> Self {
        Self::with(base, reqwest::Client::builder().pool_max_idle_per_host(0))
    }

    fn with(base: &str, builder: reqwest::ClientBuilder) -> Self {
        let client = builder
            .no_proxy()
            .timeout(CLIENT_TIMEOUT)
            .build()
            .expect("http client");
        Self {
            client,
            base: base.to_owned(),
        }
    }

    /// `POST /v1/payments` with a JSON `body`, `Authorization: Bearer token` (if any) and
    /// one `Idempotency-Key` field per item of `keys`, each sent as is.
    pub(crate) async fn post_raw(
        &self,
        token: Option<&str>,
        keys: &[&[u8]],
        body: impl Into<reqwest::Body>,
    ) -> Result<Answer, reqwest::Error> {
        self.post(PAYMENTS, "application/json", token, keys, body)
            .await
    }

    /// `POST path` with `Content-Type: content_type`, `Authorization: Bearer token` (if
    /// any) and one `Idempotency-Key` field per item of `keys`, each sent as is.
    pub(crate) async fn post(
        &self,
        path: &str,
        content_type: &'static str,
        token: Option<&str>,
        keys: &[&[u8]],
        body: impl Into<reqwest::Body>,
    ) -> Result<Answer, reqwest::Error> {
        let mut headers = HeaderMap::new();
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static(content_type),
        );
        if let Some(token) = token {
            headers.insert(
                reqwest::header::AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {token}")).expect("token"),
            );
        }
        for key in keys {
            headers.append(
                HeaderName::from_static("idempotency-key"),
                HeaderValue::from_bytes(key).expect("a sendable header value"),
            );
        }
        let response = self
            .client
            .post(format!("{}{path}", self.base))
            .headers(headers)
            .body(body)
            .send()
            .await?;
        read(response).await
    }

    /// `POST /v1/payments` as `token` with key `key`.
    pub(crate) async fn pay(
        &self,
        token: &str,
        key: &str,
        body: &str,
    ) -> Result<Answer, reqwest::Error> {
        self.post_raw(Some(token), &[key.as_bytes()], body.to_owned())
            .await
    }

    /// Like [`pay`](Self::pay), panicking on a transport error.
    pub(crate) async fn pay_ok(&self, token: &str, key: &str, body: &str) -> Answer {
        self.pay(token, key, body)
            .await
            .unwrap_or_else(|e| panic!("POST {PAYMENTS} with key {key:?}: {e:?}"))
    }

    /// Like [`pay`](Self::pay), retrying (bounded) only when the connection fails before an
    /// answer arrives. The layer answers 413 to a declared over-limit body without reading
    /// it and the connection is then closed with unread data, so the client may see a TCP
    /// reset instead of the 413 (see [`contract_refused_bodies_leave_the_key_free`]).
    pub(crate) async fn pay_answered(&self, token: &str, key: &str, body: &str) -> Answer {
        let mut errors = Vec::new();
        for _ in 0..10 {
            match self.pay(token, key, body).await {
                Ok(answer) => {
                    if !errors.is_empty() {
                        eprintln!(
                            "key {key}: answered after {} lost answers: {errors:?}",
                            errors.len()
                        );
                    }
                    return answer;
                }
                Err(e) => errors.push(format!("{e:?}")),
            }
        }
        panic!("key {key}: no answer in 10 attempts: {errors:?}");
    }

    /// `GET path` with an optional bearer token.
    pub(crate) async fn get(&self, path: &str, token: Option<&str>) -> Answer {
        let mut request = self.client.get(format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        read(response)
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// The tenant's payment count (`total` of `GET /v1/payments?limit=1`).
    pub(crate) async fn total(&self, token: &str) -> i64 {
        let answer = self.get("/v1/payments?limit=1", Some(token)).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        answer.json()["total"].as_i64().expect("total")
    }

    /// A counter of `/metrics`, by its full series name (e.g.
    /// `idemkey_requests_total{outcome="replayed"}`).
    pub(crate) async fn metric(&self, series: &str) -> u64 {
        let answer = self.get("/metrics", None).await;
        assert_eq!(answer.status, 200);
        let text = answer.text();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in /metrics:\n{text}"))
            .trim()
            .parse()
            .expect("a counter")
    }

    /// Retries `POST /v1/payments` (bounded) until it answers 201; 409, 503 and transport
    /// errors are retried, anything else fails the test.
    pub(crate) async fn pay_until_created(&self, token: &str, key: &str, body: &str) -> Answer {
        let mut last = String::new();
        for _ in 0..RETRY_ATTEMPTS {
            match self.pay(token, key, body).await {
                Ok(answer) if answer.status == 201 => return answer,
                Ok(answer) if matches!(answer.status, 409 | 503) => {
                    last = format!("{} {}", answer.status, answer.text());
                }
                Ok(answer) => panic!("key {key}: unexpected {} {}", answer.status, answer.text()),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        panic!("key {key}: no 201 after {RETRY_ATTEMPTS} attempts; last: {last}");
    }
}

async fn read(response: reqwest::Response) -> Result<Answer, reqwest::Error> {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await?.to_vec();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// Asserts that `idempotency-key-expires` is an HTTP date `retention` from now (give or
/// take the header's one-second precision and the test's own delays).
#[track_caller]
pub(crate) fn assert_expires_in(answer: &Answer, retention: Duration) {
    let now = SystemTime::now();
    assert_expiry(answer, now - Duration::from_secs(5), now, retention);
}

/// Asserts that `idempotency-key-expires` is `retention` after a claim made between `from`
/// and `to` (to the header's one-second precision).
#[track_caller]
pub(crate) fn assert_expiry(
    answer: &Answer,
    from: SystemTime,
    to: SystemTime,
    retention: Duration,
) {
    let value = answer
        .header("idempotency-key-expires")
        .expect("idempotency-key-expires");
    let at = httpdate::parse_http_date(value).expect("an HTTP date");
    let second = Duration::from_secs(1);
    assert!(
        at + second >= from + retention && at <= to + retention + second,
        "idempotency-key-expires {value} is not {retention:?} after a claim between {} and {}",
        httpdate::fmt_http_date(from),
        httpdate::fmt_http_date(to),
    );
}

/// A payment request body.
pub(crate) fn payment(amount: i64, description: &str) -> String {
    json!({
        "amount": amount,
        "currency": "EUR",
        "customer": "c1",
        "description": description,
    })
    .to_string()
}

/// The status resource of `key` (percent-encoded).
pub(crate) fn status_path(key: &str) -> String {
    let mut path = String::from("/idempotency/v1/keys/");
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            path.push(b as char);
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    path
}
