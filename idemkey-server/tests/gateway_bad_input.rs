//! Bad input at volume through `idemkey gateway` over real HTTP (the layer's own fuzz is
//! `idemkey-tower/tests/bad_input.rs`): random methods, paths, header sets (hop-by-hop
//! ones, upgrades, unknown ones, bytes outside ASCII), keys, tokens, content types, body
//! sizes, JSON nesting depths and invalid UTF-8, in front of a healthy counting upstream on
//! a healthy SQLite store. Whatever comes in: the gateway never dies or panics, never
//! answers 5xx (the store and the upstream are healthy: no answer may blame them), its own
//! 4xx are problem+json of the contract's types, and no record is left without its response
//! once the request has ended. `IDEMKEY_FUZZ_CASES` sets the number of cases (1000 here).

mod common;

use std::time::Duration;

use common::gateway::{Gateway, Upstream};
use proptest::prelude::*;
use reqwest::Method;
use reqwest::header::{HeaderName, HeaderValue};

/// A JSON document nested `depth` levels deep, arrays and objects by turns.
fn nested(depth: usize, leaf: &str) -> String {
    let mut s = String::new();
    for i in 0..depth {
        s.push_str(if i % 2 == 0 { "{\"a\":" } else { "[" });
    }
    s.push_str(leaf);
    for i in (0..depth).rev() {
        s.push(if i % 2 == 0 { '}' } else { ']' });
    }
    s
}

fn method() -> impl Strategy<Value = Method> {
    prop_oneof![
        4 => Just(Method::POST),
        1 => Just(Method::PUT),
        1 => Just(Method::PATCH),
        1 => Just(Method::DELETE),
        1 => Just(Method::GET),
        1 => Just(Method::OPTIONS),
        1 => Just(Method::from_bytes(b"FROB").unwrap()),
    ]
}

fn path() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("/v1/transfers".to_owned()),
        1 => Just("/v1/a/b".to_owned()),
        1 => Just("/opt/x".to_owned()),
        1 => Just("/plain".to_owned()),
        1 => Just("/healthz".to_owned()),
        1 => "[a-zA-Z0-9%-]{1,20}".prop_map(|k| format!("/idempotency/v1/keys/{k}")),
        1 => "[a-z0-9%/._-]{0,30}".prop_map(|p| format!("/v1/{p}")),
    ]
}

/// Raw key values: well-formed, quoted, empty, overlong, forbidden characters, arbitrary
/// bytes (non-UTF-8 included). A small alphabet makes keys repeat, so replays and
/// mismatches happen too.
fn key_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => "[a-c][0-9]".prop_map(String::into_bytes),
        1 => "[a-zA-Z0-9-]{1,40}".prop_map(String::into_bytes),
        1 => "[a-c]{1,3}".prop_map(|k| format!("\"{k}\"").into_bytes()),
        1 => Just(Vec::new()),
        1 => Just(vec![b'k'; 300]),
        1 => Just(b"a,b".to_vec()),
        1 => Just(b"\"unterminated".to_vec()),
        1 => proptest::collection::vec(any::<u8>(), 1..40),
    ]
}

fn token() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        6 => Just(Some(b"Bearer tok1".to_vec())),
        1 => Just(None),
        1 => Just(Some(b"Bearer nope".to_vec())),
        1 => Just(Some(b"Basic dG9rMQ==".to_vec())),
        1 => proptest::collection::vec(any::<u8>(), 0..20).prop_map(Some),
    ]
}

fn content_type() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        Just(Some(b"application/json".to_vec())),
        Just(Some(b"application/json; charset=utf-8".to_vec())),
        Just(Some(b"application/x-www-form-urlencoded".to_vec())),
        Just(Some(b"text/plain".to_vec())),
        Just(Some(b"multipart/form-data; boundary=x".to_vec())),
        Just(Some(b"application/json;;;==".to_vec())),
        proptest::collection::vec(any::<u8>(), 0..30).prop_map(Some),
    ]
}

/// Extra headers: hop-by-hop ones (which the gateway must not forward), an upgrade, an
/// expectation, unknown names, values with bytes outside ASCII.
fn extra_header() -> impl Strategy<Value = (String, Vec<u8>)> {
    let names = prop_oneof![
        Just("connection"),
        Just("keep-alive"),
        Just("te"),
        Just("trailer"),
        Just("upgrade"),
        Just("proxy-authorization"),
        Just("x-forwarded-for"),
        Just("accept"),
        Just("accept-encoding"),
        Just("content-encoding"),
        Just("expect"),
        Just("host"),
        Just("idempotent-replayed"),
        Just("idempotency-key-expires"),
        Just("x-random"),
    ];
    let values = prop_oneof![
        Just(b"close".to_vec()),
        Just(b"keep-alive, x-random".to_vec()),
        Just(b"upgrade".to_vec()),
        Just(b"websocket".to_vec()),
        Just(b"trailers".to_vec()),
        Just(b"gzip".to_vec()),
        Just(b"100-continue".to_vec()),
        Just(b"true".to_vec()),
        "[ -~]{0,40}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..40),
    ];
    (names, values).prop_map(|(n, v)| (n.to_owned(), v))
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        (0usize..300, "[0-9]{1,5}").prop_map(|(d, leaf)| nested(d, &leaf).into_bytes()),
        "\\{\"amount\":[0-9]{1,3}\\}".prop_map(String::into_bytes),
        "[a-z]=[a-z0-9%&=+]{0,30}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..512),
        // Over the 64 KiB limit.
        (64 * 1024 + 1..80 * 1024usize).prop_map(|n| vec![b'x'; n]),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    method: Method,
    path: String,
    query: Option<String>,
    keys: Vec<Vec<u8>>,
    token: Option<Vec<u8>>,
    content_type: Option<Vec<u8>>,
    extra: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            method(),
            path(),
            proptest::option::of("[a-z]{1,3}=[a-z0-9%+]{0,8}"),
        ),
        proptest::collection::vec(key_value(), 0..3),
        token(),
        content_type(),
        proptest::collection::vec(extra_header(), 0..4),
        body(),
    )
        .prop_map(
            |((method, path, query), keys, token, content_type, extra, body)| Case {
                method,
                path,
                query,
                keys,
                token,
                content_type,
                extra,
                body,
            },
        )
}

struct Setup {
    gateway: Gateway,
    http: reqwest::Client,
    pool: sqlx::SqlitePool,
    _upstream: Upstream,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite:{}", dir.path().join("gateway.db").display());
    let gateway = Gateway::start(
        &url,
        &upstream.base,
        dir.path(),
        &[
            "--route",
            "* /v1/*",
            "--optional-route",
            "POST /opt/*",
            "--max-request-body",
            "64KiB",
        ],
    )
    .await;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("open the gateway's database");
    // A connection per request: a case with `Connection: close` (or a 413, which closes)
    // must not make the next case fail on a pooled connection the gateway closed.
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    Setup {
        gateway,
        http,
        pool,
        _upstream: upstream,
        _dir: dir,
    }
}

/// The problem types the gateway may answer with a 5xx when its store or its upstream
/// fails; neither does here.
const HEALTHY: &str = "the store and the upstream are healthy";

async fn check(setup: &Setup, case: &Case) -> Result<(), TestCaseError> {
    let url = match &case.query {
        Some(q) => format!("{}{}?{q}", setup.gateway.base, case.path),
        None => format!("{}{}", setup.gateway.base, case.path),
    };
    let mut request = setup.http.request(case.method.clone(), url);
    // Values reqwest refuses to send never reach a server; they are left out.
    for key in &case.keys {
        if let Ok(v) = HeaderValue::from_bytes(key) {
            request = request.header("idempotency-key", v);
        }
    }
    if let Some(v) = case
        .token
        .as_deref()
        .and_then(|t| HeaderValue::from_bytes(t).ok())
    {
        request = request.header("authorization", v);
    }
    if let Some(v) = case
        .content_type
        .as_deref()
        .and_then(|t| HeaderValue::from_bytes(t).ok())
    {
        request = request.header("content-type", v);
    }
    for (name, value) in &case.extra {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            request = request.header(n, v);
        }
    }
    let oversized = case.body.len() > 64 * 1024;
    let response = match request.body(case.body.clone()).send().await {
        Ok(response) => response,
        // An over-limit body is answered 413 before it is read, with `Connection: close`:
        // the client may see the connection reset instead (as with `serve`).
        Err(_) if oversized => return Ok(()),
        // A hop-by-hop header the client itself acts on (an upgrade, `Expect`) may end the
        // exchange on the client's side; the gateway must still be alive (checked after).
        Err(e)
            if case
                .extra
                .iter()
                .any(|(n, _)| n == "expect" || n == "upgrade") =>
        {
            let _ = e;
            return Ok(());
        }
        Err(e) => return Err(TestCaseError::fail(format!("{e:?} for {case:?}"))),
    };
    let status = response.status();
    let is_problem = response
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = response.bytes().await.unwrap_or_default();
    prop_assert!(
        !status.is_server_error(),
        "{status} ({HEALTHY}) for {case:?}: {}",
        String::from_utf8_lossy(&body)
    );
    // The upstream answers 201 to everything: a 4xx is the gateway's own (a 405 too, on the
    // paths the gateway serves itself, `/healthz` and the status resource).
    if status.is_client_error() {
        prop_assert!(is_problem, "{status} without problem+json for {case:?}");
        let problem: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| TestCaseError::fail(format!("{status}: not JSON ({e}) for {case:?}")))?;
        prop_assert!(
            problem["type"]
                .as_str()
                .is_some_and(|t| t.starts_with("urn:idemkey:problem:")),
            "{problem}"
        );
    }
    // No record without its response once the request has ended.
    let unfinished: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idemkey_records WHERE state <> 'completed' OR response_status IS NULL",
    )
    .fetch_one(&setup.pool)
    .await
    .expect("read the records");
    prop_assert_eq!(
        unfinished,
        0,
        "a record without its response after {:?}",
        case
    );
    Ok(())
}

#[test]
fn bad_input_through_the_gateway_never_kills_it_never_5xx_never_leaves_a_half_record() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut setup = runtime.block_on(setup());
    let cases: u32 = std::env::var("IDEMKEY_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let started = std::time::Instant::now();
    let result = runner.run(&case(), |case| runtime.block_on(check(&setup, &case)));
    let took = started.elapsed();
    assert!(
        setup.gateway.running(),
        "the gateway died:\n{}",
        setup.gateway.log_text()
    );
    let log = setup.gateway.log_text();
    assert!(!log.contains("panicked"), "the gateway panicked:\n{log}");
    let health = runtime.block_on(async {
        setup
            .http
            .get(format!("{}/healthz", setup.gateway.base))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    assert_eq!(health.ok(), Some(200), "the gateway still answers");
    result.unwrap();
    let records: i64 = runtime.block_on(async {
        sqlx::query_scalar("SELECT COUNT(*) FROM idemkey_records")
            .fetch_one(&setup.pool)
            .await
            .expect("count")
    });
    common::load::row(&common::load::Row {
        scenario: "gateway bad input (property-based, real HTTP)",
        ops: cases as usize,
        notes: format!(
            "{cases} random requests in {:.1} s: no panic, no 5xx, every 4xx problem+json, \
             no record without its response ({records} completed records)",
            took.as_secs_f64()
        ),
        ..common::load::Row::default()
    });
    setup.gateway.kill9();
}

/// Found by the fuzz above: a status-resource key whose percent-encoding does not decode to
/// UTF-8 (`%A0`) got axum's plain-text 400 instead of a problem. It is a malformed key:
/// 400 `key-invalid` naming the byte, as in the header. Other malformed keys there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_key_in_the_status_path_is_a_key_invalid_problem() {
    let setup = setup().await;
    for (segment, position) in [("%A0", 0), ("ab%FFcd", 2), ("a%2Cb", 1), ("a%20b", 1)] {
        let answer = setup
            .http
            .get(format!(
                "{}/idempotency/v1/keys/{segment}",
                setup.gateway.base
            ))
            .bearer_auth("tok1")
            .send()
            .await
            .expect("GET");
        assert_eq!(answer.status(), 400, "{segment}");
        assert_eq!(
            answer.headers().get("content-type").map(|v| v.as_bytes()),
            Some(&b"application/problem+json"[..]),
            "{segment}"
        );
        let problem: serde_json::Value = answer.json().await.expect("JSON");
        assert_eq!(
            problem["type"], "urn:idemkey:problem:key-invalid",
            "{segment}"
        );
        assert!(
            problem["detail"]
                .as_str()
                .is_some_and(|d| d.contains(&format!("position {position}"))),
            "{segment}: {problem}"
        );
    }
}

/// Found by the fuzz above (with a pooled client): a request refused for its key (two
/// `Idempotency-Key` fields) was answered before its body was read, without `Connection:
/// close`; the server then closed the connection, and the client's next request on it was
/// reset. On one TCP connection: such a request with a 200 kB body, then `GET /healthz`:
/// both must be answered, unless the first answer said `Connection: close`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_refused_over_an_unread_body_leaves_the_connection_usable() {
    use std::io::{Read, Write};

    let setup = setup().await;
    let address = setup
        .gateway
        .base
        .strip_prefix("http://")
        .expect("http")
        .to_owned();
    for keys in ["idempotency-key: a\r\nidempotency-key: b\r\n", ""] {
        let address = address.clone();
        let answers = tokio::task::spawn_blocking(move || {
            let mut socket = std::net::TcpStream::connect(&address).expect("connect");
            socket
                .set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let body = vec![b'x'; 200_000];
            let head = format!(
                "POST /v1/transfers HTTP/1.1\r\nhost: x\r\nauthorization: Bearer tok1\r\n{keys}\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            socket.write_all(head.as_bytes()).expect("head");
            let _ = socket.write_all(&body);
            let first = read_response(&mut socket);
            let close = first
                .as_deref()
                .is_ok_and(|r| r.to_ascii_lowercase().contains("connection: close"));
            let second = if close {
                None
            } else {
                let _ = socket.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n");
                Some(read_response(&mut socket))
            };
            (first, second)
        })
        .await
        .expect("the raw client");
        let (first, second) = answers;
        let first = first.unwrap_or_else(|e| panic!("no answer to the refused request: {e}"));
        assert!(first.starts_with("HTTP/1.1 4"), "{first}");
        if let Some(second) = second {
            let second = second.unwrap_or_else(|e| {
                panic!("the connection was closed without saying so after: {first}\n({e})")
            });
            assert!(second.starts_with("HTTP/1.1 200"), "{second}");
        }
    }

    /// One HTTP/1.1 response (head and `content-length` body), as text.
    fn read_response(socket: &mut std::net::TcpStream) -> Result<String, String> {
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            match socket.read(&mut byte) {
                Ok(0) => return Err(format!("closed after {} bytes", buf.len())),
                Ok(_) => buf.push(byte[0]),
                Err(e) => return Err(e.to_string()),
            }
        }
        let head = String::from_utf8_lossy(&buf).into_owned();
        let length: usize = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; length];
        socket.read_exact(&mut body).map_err(|e| e.to_string())?;
        Ok(head + &String::from_utf8_lossy(&body))
    }
}
