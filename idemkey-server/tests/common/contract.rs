//! Contract scenarios: the answers the API promises for keys, tenants, bodies and expiry.

use std::time::Duration;

use serde_json::json;

use super::*;

/// Mismatch → 422 key-reused naming `body`; no key → 400 key-missing; malformed keys
/// (empty, quoted empty, 256 characters, a comma, two fields) → 400 key-invalid; none of
/// them creates a payment, and a 255-character key is accepted.
pub(crate) async fn contract_key_reuse_and_invalid_keys(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let first = api.pay_ok(TOKEN1, "k-reuse", &payment(500, "a")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    // The structured-field spelling of the same key is the same key.
    let quoted = api
        .post_raw(
            Some(TOKEN1),
            &[b"\"k-reuse\"".as_slice()],
            payment(500, "a"),
        )
        .await
        .expect("request");
    assert_eq!(quoted.status, 201, "{}", quoted.text());
    assert!(quoted.replayed(), "\"k-reuse\" is k-reuse");
    assert_eq!(quoted.body, first.body);
    for (other, pointer) in [
        (payment(501, "a"), "/amount"),
        (payment(500, "b"), "/description"),
    ] {
        let reused = api.pay_ok(TOKEN1, "k-reuse", &other).await;
        reused.assert_problem(422, "key-reused");
        let differs = reused.json()["differs"].clone();
        assert!(
            differs
                .as_array()
                .is_some_and(|d| d.iter().any(|p| p == "body")),
            "differs: {differs}"
        );
        assert_eq!(reused.json()["pointer"], pointer, "{}", reused.text());
        assert_eq!(
            reused.header("idempotency-key-expires"),
            first.header("idempotency-key-expires"),
            "the 422 tells the record's expiry"
        );
    }

    // The query is part of the request too.
    let query = api
        .post(
            "/v1/payments?note=1",
            "application/json",
            Some(TOKEN1),
            &[b"k-reuse".as_slice()],
            payment(500, "a"),
        )
        .await
        .expect("request");
    query.assert_problem(422, "key-reused");
    assert_eq!(
        query.json()["differs"],
        json!(["query"]),
        "{}",
        query.text()
    );

    let missing = api
        .post_raw(Some(TOKEN1), &[], payment(500, "no key"))
        .await
        .expect("request");
    missing.assert_problem(400, "key-missing");

    let long = "a".repeat(256);
    let invalid: [(&str, Vec<&[u8]>); 7] = [
        ("empty value", vec![b"".as_slice()]),
        ("empty quoted string", vec![b"\"\"".as_slice()]),
        ("only spaces", vec![b"   ".as_slice()]),
        (
            "an unterminated quoted string",
            vec![b"\"k-open".as_slice()],
        ),
        ("256 characters", vec![long.as_bytes()]),
        ("a comma", vec![b"a,b".as_slice()]),
        ("two fields", vec![b"k-one".as_slice(), b"k-two".as_slice()]),
    ];
    for (what, keys) in invalid {
        let answer = api
            .post_raw(Some(TOKEN1), &keys, payment(500, what))
            .await
            .expect("request");
        assert_eq!(answer.status, 400, "{what}: {}", answer.text());
        assert_eq!(
            answer.problem_type(),
            "urn:idemkey:problem:key-invalid",
            "{what}"
        );
    }
    assert_eq!(
        api.total(TOKEN1).await,
        1,
        "no refused request made a payment"
    );
    // The two keys of the two-field request were not claimed either.
    for key in ["k-one", "k-two", "a"] {
        let answer = api.get(&status_path(key), Some(TOKEN1)).await;
        answer.assert_problem(404, "key-not-found");
    }

    let longest = "b".repeat(255);
    let ok = api.pay_ok(TOKEN1, &longest, &payment(500, "longest")).await;
    assert_eq!(ok.status, 201, "a 255-character key: {}", ok.text());
    assert_eq!(api.total(TOKEN1).await, 2);
    assert_eq!(api.total(TOKEN2).await, 0);
    let outcome = |name: &str| format!("idemkey_requests_total{{outcome=\"{name}\"}}");
    assert_eq!(api.metric(&outcome("executed")).await, 2);
    assert_eq!(api.metric(&outcome("replayed")).await, 1);
    assert_eq!(api.metric(&outcome("mismatched")).await, 3);
    assert_eq!(api.metric(&outcome("rejected")).await, 8);
    assert_eq!(api.metric("idemkey_attempts_total").await, 14);
    backend.snapshot().await.assert_consistent(2);
}

/// The same key from tenants t1 and t2 makes two payments, one each.
pub(crate) async fn contract_tenants_are_separate(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(500, "shared");
    let one = api.pay_ok(TOKEN1, "k-shared", &body).await;
    let two = api.pay_ok(TOKEN2, "k-shared", &body).await;
    assert_eq!(one.status, 201, "{}", one.text());
    assert_eq!(two.status, 201, "{}", two.text());
    assert!(!one.replayed() && !two.replayed(), "each tenant executes");
    assert_ne!(one.json()["id"], two.json()["id"]);
    assert_eq!(api.total(TOKEN1).await, 1);
    assert_eq!(api.total(TOKEN2).await, 1);
    // Each tenant sees only its own payment.
    let id1 = one.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        api.get(&format!("/v1/payments/{id1}"), Some(TOKEN1))
            .await
            .status,
        200
    );
    assert_eq!(
        api.get(&format!("/v1/payments/{id1}"), Some(TOKEN2))
            .await
            .status,
        404
    );
    // And each replays its own.
    let again = api.pay_ok(TOKEN2, "k-shared", &body).await;
    assert!(again.replayed());
    assert_eq!(again.body, two.body);
    backend.snapshot().await.assert_consistent(2);
}

/// A declined payment (402) is stored and replayed byte for byte; no payment exists.
pub(crate) async fn contract_declined_is_stored_and_replayed(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(2_000_000, "too much");
    let declined = api.pay_ok(TOKEN1, "k-declined", &body).await;
    declined.assert_problem(402, "payment-declined");
    assert!(!declined.replayed());
    assert_expires_in(&declined, Duration::from_secs(24 * 3600));
    let again = api.pay_ok(TOKEN1, "k-declined", &body).await;
    assert_eq!(again.status, 402);
    assert!(again.replayed(), "the decline is replayed");
    assert_eq!(again.body, declined.body, "byte for byte");
    assert_eq!(
        again.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(api.total(TOKEN1).await, 0, "no payment");
    let status = api.get(&status_path("k-declined"), Some(TOKEN1)).await;
    assert_eq!(status.status, 200, "{}", status.text());
    let record = &status.json()["records"][0];
    assert_eq!(record["state"], "completed");
    assert_eq!(record["response_status"], 402);
    let snapshot = backend.snapshot().await;
    assert_eq!(snapshot.completed(), 1);
    assert_eq!(snapshot.records.len(), 1);
    assert_eq!(snapshot.payments.len(), 0);
    assert_eq!(snapshot.ledger.len(), 0);
}

/// `--retention 2s`: replayed at once, executed again after 3 s; the purge deletes an
/// expired record nobody retried.
pub(crate) async fn contract_retention_expiry(backend: Backend) {
    let server = backend
        .start(&["--retention", "2s", "--purge-interval", "1s"])
        .await;
    let api = server.api();
    let body = payment(500, "short-lived");
    let first = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_expires_in(&first, Duration::from_secs(2));
    // Never retried: the purge deletes it once expired.
    let forgotten = api
        .pay_ok(TOKEN1, "k-forgotten", &payment(600, "forgotten"))
        .await;
    assert_eq!(forgotten.status, 201, "{}", forgotten.text());
    let replay = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert!(replay.replayed(), "within retention: replayed");
    assert_eq!(replay.body, first.body);
    // The server's clock is its own: poll, bounded, until the record has expired.
    let mut expired = api.get(&status_path("k-retention"), Some(TOKEN1)).await;
    for _ in 0..RETRY_ATTEMPTS {
        if expired.status == 404 {
            break;
        }
        tokio::time::sleep(RETRY_PAUSE).await;
        expired = api.get(&status_path("k-retention"), Some(TOKEN1)).await;
    }
    expired.assert_problem(404, "key-not-found");
    let second = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert_eq!(second.status, 201, "{}", second.text());
    assert!(!second.replayed(), "after retention: executed again");
    assert_ne!(second.json()["id"], first.json()["id"]);
    assert_eq!(api.total(TOKEN1).await, 3, "payments");
    let again = api.pay_ok(TOKEN1, "k-retention", &body).await;
    assert!(again.replayed());
    assert_eq!(again.body, second.body, "the new outcome is replayed");
    assert_eq!(api.total(TOKEN1).await, 3, "payments");

    // The purge (every second) deletes the expired record of k-forgotten; the record of
    // k-retention was taken over and lives on.
    let mut records = usize::MAX;
    for _ in 0..RETRY_ATTEMPTS {
        records = backend.snapshot().await.records.len();
        if records == 1 {
            break;
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
    assert_eq!(records, 1, "the expired record is purged");
    assert!(api.metric("idemkey_purged_total").await >= 1);
    assert_eq!(api.total(TOKEN1).await, 3, "purging keeps the payments");
}

/// Bodies that differ only in member order, whitespace, number spelling or string escapes
/// are the same request: replayed, one payment.
pub(crate) async fn contract_equivalent_bodies_replay(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let key = "k-equivalent";
    let first = api
        .pay_ok(
            TOKEN1,
            key,
            r#"{"amount":500,"currency":"EUR","customer":"c1","description":"eq"}"#,
        )
        .await;
    assert_eq!(first.status, 201, "{}", first.text());
    let variants = [
        r#"{"description":"eq","customer":"c1","currency":"EUR","amount":500}"#,
        "{\n  \"amount\" : 500 ,\n\t\"currency\": \"EUR\",  \"customer\":\"c1\",\r\n \"description\":\"eq\"\n}\n",
        r#"{"amount":500.0,"currency":"EUR","customer":"c1","description":"eq"}"#,
        r#"{"amount":5e2,"currency":"EUR","customer":"c1","description":"eq"}"#,
        r#"{"amount":5E+2,"currency":"EUR","customer":"c1","description":"eq"}"#,
        r#"{"amount":500,"currency":"\u0045UR","customer":"c\u0031","description":"eq"}"#,
    ];
    for body in variants {
        let answer = api.pay_ok(TOKEN1, key, body).await;
        assert_eq!(answer.status, 201, "{body}: {}", answer.text());
        assert!(answer.replayed(), "{body}: replayed");
        assert_eq!(answer.body, first.body, "{body}");
    }
    let charset = api
        .post(
            PAYMENTS,
            "application/json; charset=utf-8",
            Some(TOKEN1),
            &[key.as_bytes()],
            variants[0],
        )
        .await
        .expect("request");
    assert!(
        charset.replayed(),
        "a media type parameter: {}",
        charset.text()
    );
    assert_eq!(charset.body, first.body);
    // The media type is part of the request.
    let text = api
        .post(
            PAYMENTS,
            "text/plain",
            Some(TOKEN1),
            &[key.as_bytes()],
            r#"{"amount":500,"currency":"EUR","customer":"c1","description":"eq"}"#,
        )
        .await
        .expect("request");
    text.assert_problem(422, "key-reused");
    // A real difference is still one.
    let different = api
        .pay_ok(
            TOKEN1,
            key,
            r#"{"amount":501,"currency":"EUR","customer":"c1","description":"eq"}"#,
        )
        .await;
    different.assert_problem(422, "key-reused");
    assert_eq!(api.total(TOKEN1).await, 1, "payments");
}

/// A body over 1 MiB → 413, and a body the handler refuses (400) → rolled back: in both
/// cases the key stays free and the corrected request executes.
///
/// The 413 is answered before the body is read, and the connection is then closed with the
/// rest of the body unread: the kernel resets it, and now and then the client gets
/// `IncompleteMessage` instead of the 413 (often with bodies of several MiB, seldom with
/// 1.2 MB under load). Such lost answers are retried ([`Api::pay_answered`]); the
/// connection itself is checked by [`oversized_body_connection`].
pub(crate) async fn contract_refused_bodies_leave_the_key_free(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    // Over-limit requests on connections of their own: see `oversized_body_connection`.
    let big = Api::without_keep_alive(server.base());

    let huge = payment(500, &"x".repeat(1_200_000));
    let too_large = big.pay_answered(TOKEN1, "k-large", &huge).await;
    too_large.assert_problem(413, "request-too-large");
    // The limit is 1 MiB exactly: one byte more is refused by the layer, 1 MiB reaches the
    // handler (which refuses a 1 MiB description with 400, not stored).
    const MIB: usize = 1024 * 1024;
    let padding = MIB - payment(500, "").len();
    let at_limit = payment(500, &"y".repeat(padding));
    assert_eq!(at_limit.len(), MIB);
    let answer = big.pay_ok(TOKEN1, "k-large", &at_limit).await;
    answer.assert_problem(400, "invalid-request");
    let over = payment(500, &"y".repeat(padding + 1));
    let answer = big.pay_answered(TOKEN1, "k-large", &over).await;
    answer.assert_problem(413, "request-too-large");
    let ok = api.pay_ok(TOKEN1, "k-large", &payment(500, "small")).await;
    assert_eq!(ok.status, 201, "the key is free: {}", ok.text());
    assert!(!ok.replayed());

    let invalid = r#"{"amount":"x","currency":"EUR","customer":"c1"}"#;
    let refused = api.pay_ok(TOKEN1, "k-invalid", invalid).await;
    refused.assert_problem(400, "invalid-request");
    let refused_again = api.pay_ok(TOKEN1, "k-invalid", invalid).await;
    refused_again.assert_problem(400, "invalid-request");
    assert!(!refused_again.replayed(), "a 400 is not stored");
    let fixed = api
        .pay_ok(TOKEN1, "k-invalid", &payment(500, "fixed"))
        .await;
    assert_eq!(fixed.status, 201, "the key is free: {}", fixed.text());
    assert!(!fixed.replayed());

    assert_eq!(api.total(TOKEN1).await, 2, "payments");
    backend.snapshot().await.assert_consistent(2);
}

/// 401 without (or with an unknown) token, and the key stays free; the status resource
/// shows a used key as completed and answers 404 for an unknown key (and for another
/// tenant's key); `/metrics` counts the replay.
pub(crate) async fn contract_auth_status_and_metrics(backend: Backend) {
    let server = backend.start(&[]).await;
    let api = server.api();
    let body = payment(500, "auth");

    for token in [None, Some("nope")] {
        let answer = api
            .post_raw(token, &[b"k-auth".as_slice()], body.clone())
            .await
            .expect("request");
        answer.assert_problem(401, "unauthorized");
        api.get("/v1/payments", token)
            .await
            .assert_problem(401, "unauthorized");
        api.get(&status_path("k-auth"), token)
            .await
            .assert_problem(401, "unauthorized");
    }
    // `/healthz` gives the database a second; a loaded machine (a pooler opening its first
    // server connection for this database) may need a second try.
    let mut health = api.get("/healthz", None).await;
    for _ in 0..10 {
        if health.status == 200 {
            break;
        }
        health = api.get("/healthz", None).await;
    }
    assert_eq!(health.status, 200, "{}", health.text());

    let first = api.pay_ok(TOKEN1, "k-auth", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed(), "the 401s did not use the key");
    let location = first.header("location").expect("Location").to_owned();
    let fetched = api.get(&location, Some(TOKEN1)).await;
    assert_eq!(fetched.status, 200);
    assert_eq!(fetched.json(), first.json(), "Location names the payment");

    let status = api.get(&status_path("k-auth"), Some(TOKEN1)).await;
    assert_eq!(status.status, 200, "{}", status.text());
    let records = status.json()["records"].clone();
    assert_eq!(records.as_array().map(Vec::len), Some(1), "{records}");
    assert_eq!(records[0]["state"], "completed");
    assert_eq!(records[0]["route"], "POST /v1/payments");
    assert_eq!(records[0]["response_status"], 201);
    api.get(&status_path("k-unknown"), Some(TOKEN1))
        .await
        .assert_problem(404, "key-not-found");
    // Any key character survives the status resource's URL.
    let odd = "a/b?c#d%e&f=g+h:i";
    let created = api.pay_ok(TOKEN1, odd, &payment(700, "odd")).await;
    assert_eq!(created.status, 201, "{}", created.text());
    let status = api.get(&status_path(odd), Some(TOKEN1)).await;
    assert_eq!(status.status, 200, "{}", status.text());
    assert_eq!(status.json()["records"][0]["state"], "completed");
    api.get(&status_path("k-auth"), Some(TOKEN2))
        .await
        .assert_problem(404, "key-not-found");

    let replay = api.pay_ok(TOKEN1, "k-auth", &body).await;
    assert!(replay.replayed());
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"replayed\"}")
            .await,
        1
    );
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"executed\"}")
            .await,
        2
    );
    assert_eq!(api.metric("idemkey_attempts_total").await, 3);
    assert_eq!(api.total(TOKEN1).await, 2);
}
