//! `IdempotencyMiddleware` in a `reqwest_middleware` client, against scripted servers.

mod support;

use std::sync::Arc;
use std::time::Duration;

use idemkey_client::problem::types;
use idemkey_client::{Error, IdempotencyInfo, IdempotencyMiddleware, Operation};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use support::{ManualClock, ScriptedServer, fast, flaky_server, http, reply};

/// A client whose waits take no time.
fn client() -> ClientWithMiddleware {
    client_on(&ManualClock::new())
}

/// A client with the fast policy on `clock`.
fn client_on(clock: &Arc<ManualClock>) -> ClientWithMiddleware {
    ClientBuilder::new(http())
        .with(IdempotencyMiddleware::with_policy(fast()).with_clock(clock.clone()))
        .build()
}

fn info(response: &reqwest::Response) -> IdempotencyInfo {
    response
        .extensions()
        .get::<IdempotencyInfo>()
        .expect("the middleware reports what it did")
        .clone()
}

#[tokio::test]
async fn the_default_middleware_adds_one_key_and_reuses_it() {
    let server = ScriptedServer::start(vec![
        reply(503),
        reply(500),
        reply(201).body("first"),
        reply(201).body("second"),
    ])
    .await;
    let clock = ManualClock::new();
    let client = ClientBuilder::new(http())
        .with(IdempotencyMiddleware::default().with_clock(clock.clone()))
        .build();

    let response = client
        .post(server.url("/v1/payments"))
        .json(&serde_json::json!({"amount": 500}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let first = info(&response);
    assert_eq!(first.attempts(), 3);
    assert!(!first.replayed());
    assert_eq!(response.text().await.unwrap(), "first");

    let response = client
        .post(server.url("/v1/payments"))
        .json(&serde_json::json!({"amount": 500}))
        .send()
        .await
        .unwrap();
    let second = info(&response);
    assert_eq!(second.attempts(), 1);

    let key = |i: &IdempotencyInfo| Some(i.key().to_owned());
    assert_eq!(
        server.keys(),
        [key(&first), key(&first), key(&first), key(&second)]
    );
    assert_ne!(first.key(), second.key());
    assert_eq!(
        uuid::Uuid::parse_str(first.key())
            .unwrap()
            .get_version_num(),
        4
    );
    assert!(server.seen().iter().all(|s| s.keys == 1));
    // The default policy's backoff: caps of 100 ms, then 200 ms.
    let sleeps = clock.sleeps();
    assert_eq!(sleeps.len(), 2);
    assert!(sleeps[0] <= Duration::from_millis(100), "{sleeps:?}");
    assert!(sleeps[1] <= Duration::from_millis(200), "{sleeps:?}");
}

#[tokio::test]
async fn the_callers_key_is_kept() {
    let server = ScriptedServer::start(vec![reply(503), reply(201)]).await;
    let response = client()
        .post(server.url("/x"))
        .header("idempotency-key", "\"quoted-key-1\"")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(info(&response).attempts(), 2);
    let key = Some("\"quoted-key-1\"".to_owned());
    assert_eq!(server.keys(), [key.clone(), key]);
}

#[tokio::test]
async fn an_operation_in_the_extensions_names_the_key() {
    let server = ScriptedServer::start(vec![
        reply(503),
        reply(201).header("idempotency-key-expires", "Mon, 30 Nov 2099 17:35:35 GMT"),
    ])
    .await;
    let op = Operation::with_key("order-7").unwrap();
    let response = client()
        .post(server.url("/x"))
        .with_extension(op.clone())
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(info(&response).key(), "order-7");
    let key = Some("order-7".to_owned());
    assert_eq!(server.keys(), [key.clone(), key]);
    assert!(op.expires_at().is_some(), "the operation learnt the expiry");
    assert!(op.first_attempt_at().is_some());
}

#[tokio::test]
async fn key_reused_is_a_typed_error_and_not_retried() {
    let server =
        ScriptedServer::start(vec![reply(422).problem(types::KEY_REUSED), reply(201)]).await;
    let error = client()
        .post(server.url("/x"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let ours = Error::from_middleware(&error).expect("our error");
    assert!(
        matches!(ours, Error::Problem { attempts: 1, .. }),
        "{ours:?}"
    );
    assert!(ours.problem().unwrap().is(types::KEY_REUSED));
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn outcome_unknown_and_bad_request_are_not_retried() {
    for (status, kind) in [(409, types::OUTCOME_UNKNOWN), (400, types::KEY_MISSING)] {
        let server = ScriptedServer::start(vec![reply(status).problem(kind), reply(201)]).await;
        let error = client()
            .post(server.url("/x"))
            .body("{}")
            .send()
            .await
            .unwrap_err();
        let ours = Error::from_middleware(&error).expect("our error");
        assert!(ours.problem().unwrap().is(kind));
        assert_eq!(ours.attempts(), 1);
        assert_eq!(server.seen().len(), 1);
    }
}

#[tokio::test]
async fn request_in_flight_is_retried_and_a_business_409_comes_back_readable() {
    let server = ScriptedServer::start(vec![
        reply(409)
            .problem(types::REQUEST_IN_FLIGHT)
            .header("retry-after", "0"),
        reply(409)
            .problem("urn:example:problem:already-shipped")
            .header("location", "/v1/orders/7"),
    ])
    .await;
    let url = server.url("/v1/orders");
    let response = client().post(&url).body("{}").send().await.unwrap();
    assert_eq!(response.status(), 409);
    assert_eq!(response.url().as_str(), url);
    assert_eq!(response.headers()["location"], "/v1/orders/7");
    assert_eq!(info(&response).attempts(), 2);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["type"], "urn:example:problem:already-shipped");
    let keys = server.keys();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);
}

#[tokio::test]
async fn a_replayed_503_is_handed_over_as_the_answer() {
    let server = ScriptedServer::start(vec![
        reply(503)
            .header("idempotent-replayed", "true")
            .body("stored"),
        reply(201),
    ])
    .await;
    let response = client()
        .post(server.url("/x"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    let info = info(&response);
    assert_eq!(info.attempts(), 1);
    assert!(info.replayed());
    assert_eq!(response.text().await.unwrap(), "stored");
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn upstream_outcome_unknown_is_not_retried() {
    let server = ScriptedServer::start(vec![
        reply(504).problem(types::UPSTREAM_OUTCOME_UNKNOWN),
        reply(201),
    ])
    .await;
    let error = client()
        .post(server.url("/x"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let ours = Error::from_middleware(&error).expect("our error");
    assert!(ours.problem().unwrap().is(types::UPSTREAM_OUTCOME_UNKNOWN));
    assert_eq!(ours.attempts(), 1);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn a_connection_closed_before_any_response_is_retried_with_the_same_key() {
    let (url, keys) = flaky_server(1).await;
    let response = client()
        .post(format!("{url}/x"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let info = info(&response);
    assert_eq!(info.attempts(), 2);
    let key = Some(info.key().to_owned());
    assert_eq!(*keys.lock().unwrap(), [key.clone(), key]);
}

#[tokio::test]
async fn retry_after_is_waited_on_the_clock() {
    let server = ScriptedServer::start(vec![
        reply(409)
            .problem(types::REQUEST_IN_FLIGHT)
            .header("retry-after", "2"),
        reply(201),
    ])
    .await;
    let clock = ManualClock::new();
    let response = client_on(&clock)
        .post(server.url("/x"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(info(&response).attempts(), 2);
    assert_eq!(clock.sleeps(), [Duration::from_secs(2)]);
}

#[tokio::test]
async fn the_retention_horizon_stops_retries() {
    let server = ScriptedServer::start(vec![
        reply(503)
            .header("retry-after", "30")
            .expires_in(Duration::from_secs(1)),
    ])
    .await;
    let clock = ManualClock::new();
    let error = client_on(&clock)
        .post(server.url("/x"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let ours = Error::from_middleware(&error).expect("our error");
    assert!(
        matches!(ours, Error::RetentionHorizon { attempts: 1, .. }),
        "{ours:?}"
    );
    assert_eq!(clock.sleeps(), []);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn safe_methods_are_passed_on_untouched() {
    let server = ScriptedServer::start(vec![reply(503), reply(200)]).await;
    let response = client().get(server.url("/x")).send().await.unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.extensions().get::<IdempotencyInfo>().is_none());
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "GET");
    assert_eq!(seen[0].key, None);
}
