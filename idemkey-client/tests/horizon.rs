//! The client against a server that never settles, for the whole retry horizon: every
//! attempt gets, in turn, 503 `store-unavailable` with `Retry-After`, 409
//! `request-in-flight` with `Retry-After`, or a connection reset before any answer. The
//! client must send one key (the same, once per request) on every attempt of the one
//! operation, keep every attempt clear of the key's retention horizon, and stop there with
//! [`Error::RetentionHorizon`], whose message says so and which keeps the last failure.
//!
//! The waits run on a manual clock (no real time passes); the server is a raw TCP server on
//! loopback, so a reset is a real RST.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idemkey_client::{Error, Failure, IdempotentClient, Operation, RetryPolicy};
use support::{ManualClock, http};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the server saw: the `Idempotency-Key` fields of each attempt.
type Seen = Arc<Mutex<Vec<Vec<String>>>>;

/// A server that answers attempt `n` with 503 (n % 3 == 0), 409 in flight (1) or a reset
/// (2). With `expires_in`, its 409 advertises `Idempotency-Key-Expires` that far from now
/// (as an external-mode server does).
async fn never_settles(expires_in: Option<Duration>) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/payments", listener.local_addr().unwrap());
    let seen: Seen = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let log = log.clone();
            tokio::spawn(async move {
                // One request per connection: each answer says `connection: close`.
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if socket.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let keys: Vec<String> = head
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .filter(|(n, _)| n.trim().eq_ignore_ascii_case("idempotency-key"))
                    .map(|(_, v)| v.trim().to_owned())
                    .collect();
                let n = {
                    let mut log = log.lock().unwrap();
                    log.push(keys);
                    log.len() - 1
                };
                if n % 3 == 2 {
                    // The body is still unread: closing now sends a reset.
                    drop(socket);
                    return;
                }
                let length: usize = head
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
                    .and_then(|(_, v)| v.trim().parse().ok())
                    .unwrap_or(0);
                let mut body = vec![0u8; length];
                if socket.read_exact(&mut body).await.is_err() {
                    return;
                }
                let answer = if n % 3 == 0 {
                    problem(503, "store-unavailable", None)
                } else {
                    problem(409, "request-in-flight", expires_in)
                };
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (url, seen)
}

fn problem(status: u16, name: &str, expires_in: Option<Duration>) -> String {
    let body = format!(
        r#"{{"type":"urn:idemkey:problem:{name}","title":"t","status":{status},"detail":"scripted"}}"#
    );
    let expires = expires_in
        .map(|d| {
            format!(
                "idempotency-key-expires: {}\r\n",
                httpdate::fmt_http_date(SystemTime::now() + d)
            )
        })
        .unwrap_or_default();
    format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\n\
         {expires}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// A client on `clock` that would go on for a day and a thousand attempts: only the
/// horizon stops it.
fn client(clock: &Arc<ManualClock>, retention: Duration) -> IdempotentClient {
    let policy = RetryPolicy::new()
        .with_initial_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(50))
        .with_max_attempts(1000)
        .with_max_elapsed(Duration::from_secs(24 * 3600))
        .with_retention(retention)
        .with_expiry_margin(Duration::from_secs(1));
    IdempotentClient::with_policy(http(), policy).with_clock(clock.clone())
}

/// Asserts one key field per attempt, the operation's, on all `attempts` of them.
fn assert_one_key(seen: &Seen, op: &Operation, attempts: u32) {
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.len(),
        attempts as usize,
        "every attempt reached the server"
    );
    for (n, keys) in seen.iter().enumerate() {
        assert_eq!(
            keys,
            &[op.key().to_owned()],
            "attempt {n}: one field, the same key"
        );
    }
}

#[tokio::test]
async fn stops_at_the_configured_retention_with_one_key_throughout() {
    let (url, seen) = never_settles(None).await;
    let clock = ManualClock::new();
    let started = clock.time();
    let op = Operation::new();
    let error = client(&clock, Duration::from_secs(30))
        .post_json(&op, &url, &serde_json::json!({"amount": 1}))
        .await
        .unwrap_err();
    let Error::RetentionHorizon {
        attempts,
        horizon,
        last,
    } = &error
    else {
        panic!("expected the retention horizon, got {error:?}");
    };
    assert_eq!(*horizon, started + Duration::from_secs(30));
    assert_eq!(op.first_attempt_at(), Some(started));
    // Every wait was honoured, and the last attempt started at least the margin before the
    // horizon: 503 and 409 ask for 1 s each, a reset backs off at most 50 ms.
    let waited: Duration = clock.sleeps().iter().sum();
    assert!(
        waited + Duration::from_secs(1) < Duration::from_secs(30),
        "{waited:?}"
    );
    // Three attempts per cycle of 2 s and a little: cycles start at 0, 2+, … 28+ s.
    assert!(
        (40..=46).contains(attempts),
        "about three attempts per 2 s for 29 s: {attempts}"
    );
    assert_one_key(&seen, &op, *attempts);
    assert!(last.is_some(), "the last failure is kept");
    let message = error.to_string();
    assert!(
        message.contains("retention horizon") && message.contains(&attempts.to_string()),
        "a clear message: {message}"
    );
    assert!(std::error::Error::source(&error).is_some());
    // One line for scripts/chaos.sh's table.
    eprintln!(
        "CHAOS-ROW|client: 503, 409 in flight and resets for the whole horizon|1|1|-|-|-|-|\
         {attempts} attempts over {:.1} s (manual clock) against a 30 s horizon, every one \
         with the one key; stopped with: {message}",
        waited.as_secs_f64()
    );
}

#[tokio::test]
async fn stops_at_the_advertised_expiry_when_it_comes_first() {
    let (url, seen) = never_settles(Some(Duration::from_secs(12))).await;
    let clock = ManualClock::new();
    let op = Operation::new();
    let error = client(&clock, Duration::from_secs(24 * 3600))
        .post_json(&op, &url, &serde_json::json!({"amount": 1}))
        .await
        .unwrap_err();
    let Error::RetentionHorizon {
        attempts, horizon, ..
    } = &error
    else {
        panic!("expected the retention horizon, got {error:?}");
    };
    assert_eq!(
        Some(*horizon),
        op.expires_at(),
        "the server's word, not a day"
    );
    let waited: Duration = clock.sleeps().iter().sum();
    assert!(
        clock.time() + Duration::from_secs(1) < *horizon,
        "the last attempt started the margin before the advertised expiry"
    );
    assert!(
        waited < Duration::from_secs(12),
        "stopped within the advertised 12 s: {waited:?}"
    );
    assert!(*attempts >= 6, "{attempts}");
    assert_one_key(&seen, &op, *attempts);
}

#[tokio::test]
async fn a_reset_on_every_attempt_is_the_last_failure_at_the_horizon() {
    // Only resets: the horizon still stops the client, and the failure it keeps is the
    // transport error.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/payments", listener.local_addr().unwrap());
    let count = Arc::new(Mutex::new(0u32));
    let counted = count.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut byte = [0u8; 1];
            let _ = socket.read(&mut byte).await;
            *counted.lock().unwrap() += 1;
            drop(socket);
        }
    });
    let clock = ManualClock::new();
    let policy = RetryPolicy::new()
        .with_initial_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(2))
        .with_max_attempts(1000)
        .with_max_elapsed(Duration::from_secs(3600))
        .with_retention(Duration::from_secs(20))
        .with_expiry_margin(Duration::from_secs(1));
    let client = IdempotentClient::with_policy(http(), policy).with_clock(clock.clone());
    let error = client
        .post_json(&Operation::new(), &url, &serde_json::json!({"amount": 1}))
        .await
        .unwrap_err();
    let Error::RetentionHorizon {
        attempts,
        last: Some(last),
        ..
    } = &error
    else {
        panic!("expected the retention horizon with a last failure, got {error:?}");
    };
    assert!(matches!(**last, Failure::Transport(_)), "{last:?}");
    assert_eq!(*count.lock().unwrap(), *attempts);
    assert!(*attempts > 5, "{attempts}");
}
