//! `IdempotentClient` against scripted servers.

mod support;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use idemkey_client::problem::types;
use idemkey_client::{Error, Failure, IdempotentClient, Operation, RetryPolicy, Timestamp};
use support::{ManualClock, ScriptedServer, fast, flaky_server, http, reply};

/// A client whose waits take no time.
fn client() -> IdempotentClient {
    client_on(&ManualClock::new())
}

/// A client with the fast policy on `clock`.
fn client_on(clock: &Arc<ManualClock>) -> IdempotentClient {
    with_policy(clock, fast())
}

fn with_policy(clock: &Arc<ManualClock>, policy: RetryPolicy) -> IdempotentClient {
    IdempotentClient::with_policy(http(), policy).with_clock(clock.clone())
}

fn payment() -> serde_json::Value {
    serde_json::json!({"amount": 500, "currency": "EUR", "customer": "c1"})
}

#[tokio::test]
async fn same_key_on_every_attempt_and_a_new_key_per_operation() {
    let server = ScriptedServer::start(vec![
        reply(503),
        reply(503),
        reply(201).body("first"),
        reply(503),
        reply(201).body("second"),
    ])
    .await;
    let client = client();

    let first = Operation::new();
    let response = client
        .post_json(&first, server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(response.attempts(), 3);
    assert_eq!(response.key(), first.key());
    assert_eq!(response.text().unwrap(), "first");

    let second = Operation::new();
    let response = client
        .post_json(&second, server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.attempts(), 2);
    assert_eq!(response.text().unwrap(), "second");

    let seen = server.seen();
    assert_eq!(seen.len(), 5);
    for s in &seen {
        assert_eq!(s.keys, 1, "exactly one Idempotency-Key field per request");
        assert_eq!(s.body, seen[0].body, "the same body bytes on every attempt");
    }
    let keys = server.keys();
    let first_key = Some(first.key().to_owned());
    let second_key = Some(second.key().to_owned());
    assert_eq!(
        keys,
        [&first_key, &first_key, &first_key, &second_key, &second_key].map(Clone::clone)
    );
    assert_ne!(first.key(), second.key());
    let uuid = uuid::Uuid::parse_str(first.key()).unwrap();
    assert_eq!(uuid.get_version_num(), 4);
}

#[tokio::test]
async fn retries_503_and_500_then_succeeds() {
    let expires = SystemTime::UNIX_EPOCH + Duration::from_secs(4_000_000_000);
    let server = ScriptedServer::start(vec![
        reply(503).problem(types::STORE_UNAVAILABLE),
        reply(500).problem(types::INTERNAL_ERROR),
        reply(201)
            .header("content-type", "application/json")
            .header("idempotent-replayed", "true")
            .header("idempotency-key-expires", httpdate::fmt_http_date(expires))
            .body(r#"{"id":"pay_1"}"#),
    ])
    .await;
    let op = Operation::new();
    let response = client()
        .post_json(&op, server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(response.attempts(), 3);
    assert!(response.is_replayed());
    assert_eq!(response.expires_at(), Some(expires));
    assert_eq!(op.expires_at(), Some(expires));
    assert_eq!(
        response.json::<serde_json::Value>().unwrap(),
        serde_json::json!({"id": "pay_1"})
    );
    assert_eq!(server.seen().len(), 3);
}

#[tokio::test]
async fn a_first_answer_is_not_a_replay() {
    let server = ScriptedServer::start(vec![reply(201).body("{}")]).await;
    let response = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert!(!response.is_replayed());
    assert_eq!(response.attempts(), 1);
    assert_eq!(response.expires_at(), None);
}

#[tokio::test]
async fn too_many_requests_429_is_retried() {
    let server = ScriptedServer::start(vec![
        reply(429).header("retry-after", "0"),
        reply(200).body("ok"),
    ])
    .await;
    let clock = ManualClock::new();
    let response = client_on(&clock)
        .post_json(&Operation::new(), server.url("/x"), &payment())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.attempts(), 2);
    assert_eq!(clock.sleeps(), [Duration::ZERO]);
}

#[tokio::test]
async fn retry_after_seconds_is_honoured() {
    let server = ScriptedServer::start(vec![
        reply(503).header("retry-after", "2"),
        reply(201).body("ok"),
    ])
    .await;
    let clock = ManualClock::new();
    let response = client_on(&clock)
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.attempts(), 2);
    assert_eq!(clock.sleeps(), [Duration::from_secs(2)]);
}

#[tokio::test]
async fn retry_after_http_date_is_honoured() {
    let clock = ManualClock::new();
    let at = httpdate::fmt_http_date(clock.time() + Duration::from_secs(3));
    let server = ScriptedServer::start(vec![
        reply(503).header("retry-after", at),
        reply(201).body("ok"),
    ])
    .await;
    let response = client_on(&clock)
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.attempts(), 2);
    assert_eq!(clock.sleeps(), [Duration::from_secs(3)]);
}

#[tokio::test]
async fn the_system_clock_is_the_default() {
    let server = ScriptedServer::start(vec![
        reply(503).header("retry-after", "0"),
        reply(201).body("ok"),
    ])
    .await;
    let op = Operation::new();
    // The clock counts whole milliseconds.
    let before = Timestamp::now().to_system_time();
    let response = IdempotentClient::new(http())
        .post_json(&op, server.url("/x"), &payment())
        .await
        .unwrap();
    assert_eq!(response.attempts(), 2);
    assert!(op.first_attempt_at().unwrap() >= before);
}

#[tokio::test]
async fn without_retry_after_the_waits_are_jittered_backoff() {
    let server = ScriptedServer::start(vec![reply(503), reply(503), reply(503), reply(201)]).await;
    let clock = ManualClock::new();
    let response = client_on(&clock)
        .post_json(&Operation::new(), server.url("/x"), &payment())
        .await
        .unwrap();
    assert_eq!(response.attempts(), 4);
    let sleeps = clock.sleeps();
    assert_eq!(sleeps.len(), 3);
    // fast(): caps of 10 ms, 20 ms, 40 ms.
    for (sleep, cap) in sleeps.iter().zip([10, 20, 40]) {
        assert!(*sleep <= Duration::from_millis(cap), "{sleeps:?}");
    }
}

#[tokio::test]
async fn key_reused_422_is_not_retried() {
    let server = ScriptedServer::start(vec![
        reply(422).problem(types::KEY_REUSED),
        reply(201).body("must not be reached"),
    ])
    .await;
    let error = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap_err();
    let Error::Problem { problem, attempts } = &error else {
        panic!("expected a problem, got {error:?}");
    };
    assert_eq!(*attempts, 1);
    assert!(problem.is(types::KEY_REUSED));
    assert_eq!(problem.http_status, 422);
    assert_eq!(problem.status, Some(422));
    assert_eq!(problem.title.as_deref(), Some("scripted problem"));
    assert_eq!(
        problem.detail.as_deref(),
        Some("scripted urn:idemkey:problem:key-reused")
    );
    let raw: serde_json::Value = serde_json::from_slice(&problem.body).unwrap();
    assert_eq!(raw["type"], types::KEY_REUSED);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn outcome_unknown_409_is_not_retried() {
    let server = ScriptedServer::start(vec![
        reply(409)
            .problem(types::OUTCOME_UNKNOWN)
            .header("link", "</idempotency/v1/keys/k>; rel=\"status\""),
        reply(201).body("must not be reached"),
    ])
    .await;
    let error = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap_err();
    assert_eq!(error.attempts(), 1);
    let problem = error.problem().expect("a problem");
    assert!(problem.is(types::OUTCOME_UNKNOWN));
    assert_eq!(problem.http_status, 409);
    assert!(problem.headers.contains_key("link"));
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn request_in_flight_409_is_retried() {
    let server = ScriptedServer::start(vec![
        reply(409)
            .problem(types::REQUEST_IN_FLIGHT)
            .header("retry-after", "0"),
        reply(201).body("done"),
    ])
    .await;
    let op = Operation::new();
    let response = client()
        .post_json(&op, server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(response.attempts(), 2);
    let key = Some(op.key().to_owned());
    assert_eq!(server.keys(), [key.clone(), key]);
}

#[tokio::test]
async fn a_business_409_is_the_final_answer() {
    let server = ScriptedServer::start(vec![
        reply(409).problem("urn:example:problem:already-shipped"),
        reply(201).body("must not be reached"),
    ])
    .await;
    let response = client()
        .post_json(&Operation::new(), server.url("/v1/orders"), &payment())
        .await
        .unwrap();
    assert_eq!(response.status(), 409);
    assert_eq!(response.attempts(), 1);
    let body: serde_json::Value = response.json().unwrap();
    assert_eq!(body["type"], "urn:example:problem:already-shipped");
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn bad_request_400_is_not_retried() {
    let server = ScriptedServer::start(vec![
        reply(400).problem(types::KEY_INVALID),
        reply(201).body("must not be reached"),
    ])
    .await;
    let error = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::Problem { attempts: 1, .. }),
        "{error:?}"
    );
    assert!(error.problem().unwrap().is(types::KEY_INVALID));
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn a_400_that_is_not_problem_json_is_still_a_problem() {
    let server = ScriptedServer::start(vec![reply(400).body("bad request")]).await;
    let error = client()
        .post_json(&Operation::new(), server.url("/x"), &payment())
        .await
        .unwrap_err();
    let problem = error.problem().expect("a problem");
    assert!(problem.is(types::ABOUT_BLANK));
    assert_eq!(&problem.body[..], b"bad request");
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn request_unreadable_400_is_retried() {
    // The contract: "the body could not be read — yes, same key".
    let server = ScriptedServer::start(vec![
        reply(400).problem(types::REQUEST_UNREADABLE),
        reply(201).body("ok"),
    ])
    .await;
    let response = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.attempts(), 2);
}

#[tokio::test]
async fn transaction_unavailable_500_is_not_retried() {
    let server = ScriptedServer::start(vec![
        reply(500).problem(types::TRANSACTION_UNAVAILABLE),
        reply(201).body("must not be reached"),
    ])
    .await;
    let error = client()
        .post_json(&Operation::new(), server.url("/x"), &payment())
        .await
        .unwrap_err();
    assert!(error.problem().unwrap().is(types::TRANSACTION_UNAVAILABLE));
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn upstream_outcome_unknown_504_is_not_retried() {
    // A 5xx, but the operation may have happened: retrying cannot change the answer.
    let server = ScriptedServer::start(vec![
        reply(504)
            .problem(types::UPSTREAM_OUTCOME_UNKNOWN)
            .header("link", "</idempotency/v1/keys/k>; rel=\"status\""),
        reply(201).body("must not be reached"),
    ])
    .await;
    let error = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap_err();
    let Error::Problem { problem, attempts } = &error else {
        panic!("expected a problem, got {error:?}");
    };
    assert_eq!(*attempts, 1);
    assert!(problem.is(types::UPSTREAM_OUTCOME_UNKNOWN));
    assert_eq!(problem.http_status, 504);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn response_too_large_500_is_not_retried() {
    // The same response would be too large to store again.
    let server = ScriptedServer::start(vec![
        reply(500).problem(types::RESPONSE_TOO_LARGE),
        reply(201).body("must not be reached"),
    ])
    .await;
    let error = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::Problem { attempts: 1, .. }),
        "{error:?}"
    );
    assert!(error.problem().unwrap().is(types::RESPONSE_TOO_LARGE));
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn a_replayed_500_is_the_final_answer() {
    // The stored outcome: another attempt would get it again.
    let server = ScriptedServer::start(vec![
        reply(500)
            .problem(types::INTERNAL_ERROR)
            .header("idempotent-replayed", "true"),
        reply(201).body("must not be reached"),
    ])
    .await;
    let response = client()
        .post_json(&Operation::new(), server.url("/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.status(), 500);
    assert_eq!(response.attempts(), 1);
    assert!(response.is_replayed());
    let body: serde_json::Value = response.json().unwrap();
    assert_eq!(body["type"], types::INTERNAL_ERROR);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn a_connection_closed_before_any_response_is_retried_with_the_same_key() {
    let (url, keys) = flaky_server(2).await;
    let op = Operation::new();
    let response = client()
        .post_json(&op, format!("{url}/v1/payments"), &payment())
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(response.text().unwrap(), "created");
    assert_eq!(response.attempts(), 3);
    let key = Some(op.key().to_owned());
    assert_eq!(*keys.lock().unwrap(), [key.clone(), key.clone(), key]);
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_given_up() {
    // Bind then drop a listener: nothing listens on that port any more.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let client = with_policy(&ManualClock::new(), fast().with_max_attempts(3));
    let error = client
        .post_json(
            &Operation::new(),
            format!("http://127.0.0.1:{port}/x"),
            &payment(),
        )
        .await
        .unwrap_err();
    let Error::GaveUp { last, attempts, .. } = &error else {
        panic!("expected to give up, got {error:?}");
    };
    assert_eq!(*attempts, 3);
    assert!(matches!(**last, Failure::Transport(ref e) if e.is_connect()));
    assert!(std::error::Error::source(&error).is_some());
}

#[tokio::test]
async fn gives_up_after_max_attempts() {
    let server = ScriptedServer::start(vec![reply(503).body("busy")]).await;
    let clock = ManualClock::new();
    let client = with_policy(&clock, fast().with_max_attempts(4));
    let error = client
        .post_json(&Operation::new(), server.url("/x"), &payment())
        .await
        .unwrap_err();
    let Error::GaveUp { last, attempts, .. } = &error else {
        panic!("expected to give up, got {error:?}");
    };
    assert_eq!(*attempts, 4);
    let Failure::Response(last) = &**last else {
        panic!("expected a response, got {last:?}");
    };
    assert_eq!(last.status(), 503);
    assert_eq!(last.text().unwrap(), "busy");
    assert_eq!(server.seen().len(), 4);
    assert_eq!(clock.sleeps().len(), 3, "no wait after the last attempt");
}

#[tokio::test]
async fn gives_up_when_retry_after_exceeds_the_time_allowed() {
    let server = ScriptedServer::start(vec![reply(503).header("retry-after", "120")]).await;
    let clock = ManualClock::new();
    let error = client_on(&clock)
        .post_json(&Operation::new(), server.url("/x"), &payment())
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::GaveUp { attempts: 1, .. }),
        "{error:?}"
    );
    // Not waiting two minutes for nothing.
    assert_eq!(clock.sleeps(), []);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn the_time_allowed_counts_the_waits() {
    // 60 s allowed, 25 s asked each time: attempts at 0 s, 25 s and 50 s; one more would
    // start at 75 s.
    let server = ScriptedServer::start(vec![reply(503).header("retry-after", "25")]).await;
    let clock = ManualClock::new();
    let error = client_on(&clock)
        .post_json(&Operation::new(), server.url("/x"), &payment())
        .await
        .unwrap_err();
    let Error::GaveUp {
        attempts, elapsed, ..
    } = &error
    else {
        panic!("expected to give up, got {error:?}");
    };
    assert_eq!(*attempts, 3);
    assert_eq!(*elapsed, Duration::from_secs(50));
    assert_eq!(clock.sleeps(), [Duration::from_secs(25); 2]);
    assert_eq!(server.seen().len(), 3);
}

#[tokio::test]
async fn the_advertised_expiry_stops_retries() {
    // Expires in ~2 s, asks to come back in 30 s: that attempt would be after the horizon.
    // (No margin: the horizon itself decides.)
    let server = ScriptedServer::start(vec![
        reply(503)
            .header("retry-after", "30")
            .expires_in(Duration::from_secs(2)),
    ])
    .await;
    let op = Operation::new();
    let clock = ManualClock::new();
    let client = with_policy(&clock, fast().with_expiry_margin(Duration::ZERO));
    let error = client
        .post_json(&op, server.url("/v1/payments"), &payment())
        .await
        .unwrap_err();
    let Error::RetentionHorizon {
        attempts, horizon, ..
    } = &error
    else {
        panic!("expected the retention horizon, got {error:?}");
    };
    assert_eq!(*attempts, 1);
    assert_eq!(Some(*horizon), op.expires_at());
    assert_eq!(clock.sleeps(), [], "waited for the Retry-After");
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn the_configured_retention_stops_retries() {
    let server = ScriptedServer::start(vec![reply(503).header("retry-after", "3")]).await;
    let policy = fast()
        .with_retention(Duration::from_secs(2))
        .with_expiry_margin(Duration::ZERO);
    let clock = ManualClock::new();
    let op = Operation::new();
    let error = with_policy(&clock, policy)
        .post_json(&op, server.url("/x"), &payment())
        .await
        .unwrap_err();
    let Error::RetentionHorizon {
        attempts: 1,
        horizon,
        ..
    } = error
    else {
        panic!("expected the retention horizon, got {error:?}");
    };
    assert_eq!(op.first_attempt_at(), Some(clock.time()));
    assert_eq!(horizon, clock.time() + Duration::from_secs(2));
    assert_eq!(clock.sleeps(), []);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn a_resumed_operation_past_its_retention_sends_nothing() {
    let server = ScriptedServer::start(vec![reply(201).body("ok")]).await;
    let clock = ManualClock::new();
    let op = Operation::resume(
        "order-42-payment",
        clock.time() - Duration::from_secs(25 * 60 * 60),
    )
    .unwrap();
    let error = with_policy(&clock, RetryPolicy::default())
        .post_json(&op, server.url("/x"), &payment())
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::RetentionHorizon {
                attempts: 0,
                last: None,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(server.seen().is_empty());
}

#[tokio::test]
async fn a_caller_key_survives_across_calls() {
    let server = ScriptedServer::start(vec![
        reply(503),
        reply(201).body("ok"),
        reply(201).header("idempotent-replayed", "true").body("ok"),
    ])
    .await;
    let client = with_policy(&ManualClock::new(), RetryPolicy::default());
    let op = Operation::with_key("order-42-payment").unwrap();
    let first = client
        .post_json(&op, server.url("/x"), &payment())
        .await
        .unwrap();
    let first_attempt_at = op.first_attempt_at().unwrap();
    // As after a restart: the persisted key and first attempt time.
    let resumed = Operation::resume(op.key(), first_attempt_at).unwrap();
    let second = client
        .post_json(&resumed, server.url("/x"), &payment())
        .await
        .unwrap();
    assert!(!first.is_replayed());
    assert!(second.is_replayed());
    assert_eq!(resumed.first_attempt_at(), Some(first_attempt_at));
    let key = Some("order-42-payment".to_owned());
    assert_eq!(server.keys(), [key.clone(), key.clone(), key]);
}

#[tokio::test]
async fn the_operation_key_replaces_a_key_in_the_request() {
    let server = ScriptedServer::start(vec![reply(201)]).await;
    let client = client();
    let op = Operation::new();
    let request = client
        .inner()
        .post(server.url("/x"))
        .header("idempotency-key", "per-call-request-id")
        .body("{}");
    client.send(&op, request).await.unwrap();
    let seen = server.seen();
    assert_eq!(seen[0].keys, 1);
    assert_eq!(seen[0].key.as_deref(), Some(op.key()));
}

#[tokio::test]
async fn a_streaming_body_is_refused_before_sending() {
    let server = ScriptedServer::start(vec![reply(201)]).await;
    let client = client();
    let body = reqwest::Body::wrap(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")));
    let request = client.inner().post(server.url("/x")).body(body);
    let error = client.send(&Operation::new(), request).await.unwrap_err();
    assert!(matches!(error, Error::NotCloneable), "{error:?}");
    assert!(server.seen().is_empty());
}

#[tokio::test]
async fn a_bad_url_is_a_build_error() {
    let error = client()
        .post_json(&Operation::new(), "not a url", &payment())
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Build(_)), "{error:?}");
}

#[test]
fn the_default_policy_is_documented() {
    let p = RetryPolicy::default();
    assert_eq!(p.initial_delay(), Duration::from_millis(100));
    assert_eq!(p.multiplier(), 2.0);
    assert_eq!(p.max_delay(), Duration::from_secs(5));
    assert_eq!(p.max_attempts(), 10);
    assert_eq!(p.max_elapsed(), Duration::from_secs(60));
    assert_eq!(p.retention(), Duration::from_secs(24 * 60 * 60));
    assert_eq!(p.expiry_margin(), Duration::from_secs(1));
    assert_eq!(p.attempt_timeout(), None);
}
