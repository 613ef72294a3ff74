//! Operator commands, lock waits, and oversized bodies on one connection.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::*;

/// How late past the replay cache's bound an eviction may still be replayed (the time to
/// send one request).
const BOUND_MARGIN: Duration = Duration::from_secs(2);

/// The operator commands on the servers' database, while a server runs: `migrate`, `keys
/// list`, `keys show` (which needs the key-hashing secret the server keeps in the database)
/// and `keys evict`, after which the key executes again.
pub(crate) async fn operator_keys_commands(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(500, "operator");
    let first = api.pay_ok(TOKEN1, "k-operator", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let declined = api
        .pay_ok(TOKEN2, "k-operator", &payment(5_000_000, "declined"))
        .await;
    assert_eq!(declined.status, 402, "{}", declined.text());

    let db = |args: &[&str]| -> Vec<String> {
        args.iter()
            .copied()
            .chain(["--database-url", backend.url()])
            .map(str::to_owned)
            .collect()
    };

    let out = idemkey_cli(db(&["migrate"])).await;
    assert!(out.contains("migrations are up to date"), "{out}");

    let out = idemkey_cli(db(&["keys", "list", "--json"])).await;
    let listed: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(listed.len(), 2, "{out}");
    let mut seen: Vec<(String, String, u64)> = listed
        .iter()
        .map(|r| {
            (
                r["tenant"].as_str().unwrap_or_default().to_owned(),
                r["state"].as_str().unwrap_or_default().to_owned(),
                r["response_status"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("t1".to_owned(), "completed".to_owned(), 201),
            ("t2".to_owned(), "completed".to_owned(), 402),
        ]
    );
    let out = idemkey_cli(db(&["keys", "list", "--json", "--tenant", "t2"])).await;
    assert_eq!(out.lines().count(), 1, "{out}");

    let out = idemkey_cli(db(&["keys", "show", "--tenant", "t1", "k-operator"])).await;
    let shown: Value = serde_json::from_str(&out).expect("keys show prints JSON");
    assert_eq!(shown["state"], "completed", "{out}");
    assert_eq!(shown["response_status"], 201, "{out}");
    assert_eq!(shown["route"], "POST /v1/payments", "{out}");

    let out = idemkey_cli(db(&[
        "keys",
        "evict",
        "--tenant",
        "t1",
        "--route",
        "POST /v1/payments",
        "k-operator",
    ]))
    .await;
    assert!(out.starts_with("evicted "), "{out}");
    api.get(&status_path("k-operator"), Some(TOKEN1))
        .await
        .assert_problem(404, "key-not-found");
    // The server may answer the key from its replay cache until the eviction reaches it: on
    // PostgreSQL its notice comes within milliseconds, on SQLite the cache's bound (5 s)
    // passes. Past the bound plus a margin, a replay is a failure.
    let deadline = Instant::now() + idemkey_tower::REPLAY_CACHE_UNNOTIFIED_BOUND + BOUND_MARGIN;
    let again = loop {
        let again = api.pay_ok(TOKEN1, "k-operator", &body).await;
        assert_eq!(again.status, 201, "{}", again.text());
        if !again.replayed() {
            break again;
        }
        assert_eq!(
            again.body, first.body,
            "a replay from memory is the evicted answer"
        );
        assert!(
            Instant::now() < deadline,
            "an evicted key executes again within the replay cache's bound"
        );
    };
    assert_ne!(again.json()["id"], first.json()["id"]);
    assert_eq!(api.total(TOKEN1).await, 2, "payments");
    // Tenant t2's record was left alone.
    let replay = api
        .pay_ok(TOKEN2, "k-operator", &payment(5_000_000, "declined"))
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, declined.body);
}

/// A request whose key nobody else uses, sent while a request with another key sits in its
/// transaction longer than the store's lock wait (5 s): whatever it gets, it must not be told
/// that *its* key is in flight (`409 request-in-flight`, "a request with this
/// Idempotency-Key is still being processed"). PostgreSQL claims distinct keys
/// independently (201). SQLite has one write lock for the whole database: the honest
/// answers are a 201 after the wait, or `503 store-busy` with Retry-After.
pub(crate) async fn lock_wait_behind_another_key(backend: Backend) {
    let server = backend.start(&["--simulate-latency", "5600"]).await;
    let api = server.api();
    let holder = {
        let api = api.clone();
        tokio::spawn(async move { api.pay(TOKEN1, "k-holder", &payment(500, "holder")).await })
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    while api.metric("idemkey_attempts_total").await < 1 {
        assert!(Instant::now() < deadline, "the holder never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The holder's transaction is open (on SQLite, it holds the write lock) before the
    // bystander comes.
    while backend.open_transactions().await < 1 {
        assert!(
            Instant::now() < deadline,
            "the holder never opened its transaction"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let bystander = api
        .pay_ok(TOKEN1, "k-bystander", &payment(600, "bystander"))
        .await;
    let holder = holder.await.expect("task").expect("the holder's answer");
    assert_eq!(holder.status, 201, "{}", holder.text());
    match bystander.status {
        201 => assert!(!bystander.replayed()),
        503 => {
            bystander.assert_problem(503, "store-busy");
            assert!(bystander.header("retry-after").is_some());
        }
        _ => panic!(
            "k-bystander was never in flight, yet the answer was {} {}",
            bystander.status,
            bystander.text()
        ),
    }
}

/// An over-limit body (declared `Content-Length` > 1 MiB) is answered 413 before it is read.
/// The server must then either keep the connection usable (read and discard the rest) or
/// say `Connection: close` (RFC 9112 §9.3, §9.6): a client that gets a 413 without it keeps
/// the connection in its pool, and its next request on it fails with "connection closed
/// before message completed" (reqwest/hyper: `IncompleteMessage`). Checked on a raw socket:
/// the 413 must arrive, and the next request on the same connection must be answered unless
/// the 413 said `Connection: close`.
pub(crate) async fn oversized_body_connection(backend: Backend) {
    let server = backend.start(&[]).await;
    let address = server
        .base()
        .strip_prefix("http://")
        .expect("an http URL")
        .to_owned();
    let body = payment(500, &"x".repeat(1_200_000));
    let outcome = tokio::task::spawn_blocking(move || raw_oversized_then_next(&address, &body))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    match outcome {
        Ok(()) => {}
        Err(problem) => panic!("{problem}"),
    }
    // Nothing was claimed.
    let api = server.api();
    let ok = api.pay_ok(TOKEN1, "k-raw", &payment(500, "small")).await;
    assert_eq!(ok.status, 201, "{}", ok.text());
    assert!(!ok.replayed());
}

/// On one TCP connection: an over-limit POST, its answer, then `GET /healthz`.
fn raw_oversized_then_next(address: &str, body: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let head = format!(
        "POST {PAYMENTS} HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {TOKEN1}\r\n\
         Idempotency-Key: k-raw\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    // The server may stop reading at any point: write from another thread, ignore errors.
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    let request = [head.into_bytes(), body.as_bytes().to_vec()].concat();
    let sender = std::thread::spawn(move || writer.write_all(&request).map_err(|e| e.to_string()));
    let first = read_response(&mut stream)
        .map_err(|e| format!("the 413 was lost ({e}): the connection was reset"))?;
    let sent = sender.join().expect("writer thread");
    if !first.starts_with("HTTP/1.1 413") {
        return Err(format!("expected a 413, got: {first}"));
    }
    if first
        .to_ascii_lowercase()
        .lines()
        .any(|l| l.trim() == "connection: close")
    {
        return Ok(());
    }
    let next = format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\n");
    let reused = stream
        .write_all(next.as_bytes())
        .map_err(|e| e.to_string())
        .and_then(|()| read_response(&mut stream));
    match reused {
        Ok(second) if second.starts_with("HTTP/1.1 200") => Ok(()),
        Ok(second) => Err(format!("the next request on the connection got: {second}")),
        Err(e) => {
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest);
            Err(format!(
                "the 413 did not say `Connection: close`, yet the server closed the \
                 connection: the next request on it failed ({e}); body upload: {sent:?}; \
                 413 head:\n{first}"
            ))
        }
    }
}

/// Reads one HTTP/1.1 response (head and `Content-Length` body) as text.
fn read_response(stream: &mut std::net::TcpStream) -> Result<String, String> {
    use std::io::Read;
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&data[..end]).into_owned();
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            if data.len() >= end + 4 + length {
                return Ok(String::from_utf8_lossy(&data[..end + 4 + length]).into_owned());
            }
        }
        match stream.read(&mut buf) {
            Ok(0) => return Err(format!("end of stream after {} bytes", data.len())),
            Ok(n) => data.extend_from_slice(&buf[..n]),
            Err(e) => return Err(e.to_string()),
        }
    }
}
