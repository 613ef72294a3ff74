//! Chaos through `idemkey gateway` on PostgreSQL, with the real client (one
//! [`Operation`], one key, for every attempt of a logical transfer) and a counting upstream:
//!
//! - `kill -9` of the gateway before the request left, after it left and before the
//!   answer, and after the answer and before the record was completed: after a restart a
//!   retry with the same key gets exactly one upstream effect, or 409 `outcome-unknown`
//!   where the outcome is unknown; the reconciler and `idemkey keys resolve` settle those;
//! - an upstream slower than the lease: renewal keeps the owner, other gateways answer 409
//!   `request-in-flight` and never take over.
//!
//! Each prints a `CHAOS-ROW|…` line.

mod common;

use std::time::{Duration, Instant};

use common::gateway::{Gateway, Upstream, keys};
use common::load::{self, OpResult};
use idemkey_client::{IdempotentClient, Operation, RetryPolicy};
use serde_json::Value;

/// Bound on waiting for an external process (a lease to lapse, the reconciler's round).
const DEADLINE: Duration = Duration::from_secs(30);

/// The gateway's scope route for our requests (`--route "POST /v1/*"`).
const ROUTE: &str = "POST /v1/*";

/// A client that tries once: the attempt through a gateway that is killed under it.
fn one_attempt() -> IdempotentClient {
    load::client(RetryPolicy::new().with_max_attempts(1))
}

/// A fresh PostgreSQL database whose server notices a dead client within 100 ms even
/// while the session waits for a lock (`client_connection_check_interval`), as a production
/// server may be configured to.
async fn database() -> (String, tempfile::TempDir) {
    let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
        .await
        .expect("a database");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect");
    sqlx::query(
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET client_connection_check_interval \
         = %L', current_database(), '100ms'); END $$",
    )
    .execute(&pool)
    .await
    .expect("set client_connection_check_interval");
    pool.close().await;
    (url, tempfile::tempdir().expect("temporary directory"))
}

/// The state of the record of `key`, read from the database.
async fn state(url: &str) -> Vec<String> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .expect("connect");
    let states = sqlx::query_scalar("SELECT state FROM idemkey_records ORDER BY created_at")
        .fetch_all(&pool)
        .await
        .expect("read states");
    pool.close().await;
    states
}

/// The problem type of a refusal, or the outcome's status.
fn outcome(result: &OpResult) -> String {
    match &result.outcome {
        Ok((status, replayed, attempts, _)) => {
            format!("{status} (replayed {replayed}, {attempts} attempts)")
        }
        Err(e) => e.clone(),
    }
}

/// Polls the status resource (bounded) until the record of `key` is in `state`.
async fn until_state(gateway: &str, key: &str, wanted: &str) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let answer = http
            .get(format!("{gateway}/idempotency/v1/keys/{key}"))
            .bearer_auth(common::TOKEN1)
            .send()
            .await
            .expect("GET the status resource");
        if answer.status() == 200 {
            let body: Value = answer.json().await.expect("JSON");
            if body["records"][0]["state"] == wanted {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{key} never became {wanted}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `kill -9` before the request left (the gateway waits after its reservation, a hidden
/// test aid), with the point of no return in a write of its own: nothing reached the
/// upstream; after the lease lapses, the client's retry with the same key through a new
/// gateway takes over and executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_request_left_executes_once_after_the_lease() {
    let upstream = Upstream::start();
    let (url, dir) = database().await;
    let lease = ["--lease", "1s", "--route", ROUTE];
    let mut first = Gateway::start(
        &url,
        &upstream.base,
        dir.path(),
        &[
            &lease[..],
            &["--point-of-no-return", "separate"],
            &["--simulate-delay-before-forward", "60000"],
        ]
        .concat(),
    )
    .await;
    let op = Operation::new();
    let pending = {
        let (base, op) = (first.base.clone(), op.clone());
        tokio::spawn(async move { load::pay(&one_attempt(), &base, "tok1", 0, op).await })
    };
    until_state(&first.base, op.key(), "reserved").await;
    first.kill9();
    let lost = pending.await.expect("the first attempt");
    assert!(lost.outcome.is_err(), "its answer was lost: {lost:?}");
    assert_eq!(upstream.received(op.key()), 0, "nothing was sent");

    let second = Gateway::start(&url, &upstream.base, dir.path(), &lease).await;
    let started = Instant::now();
    let client = load::client(load::patient_policy());
    let retried = load::pay(&client, &second.base, "tok1", 0, op.clone()).await;
    let took = started.elapsed();
    let (status, replayed, attempts, _) = retried.outcome.clone().expect("executed");
    assert_eq!((status, replayed), (201, false), "taken over and executed");
    assert_eq!(upstream.effects(op.key()), 1);
    let again = load::pay(&client, &second.base, "tok1", 0, op.clone()).await;
    assert!(matches!(again.outcome, Ok((201, true, 1, _))), "{again:?}");
    assert_eq!(upstream.effects(op.key()), 1);
    load::row(&load::Row {
        scenario: "gateway kill -9 before the request left (`--point-of-no-return separate`)",
        ops: 1,
        failed: 0,
        duplicates: (upstream.effects(op.key()) as usize).saturating_sub(1),
        recovery: Some(took),
        notes: format!(
            "nothing reached the upstream; the client's retry through a new gateway waited \
             (in-flight wait) until the 1 s lease lapsed, took over and executed: {attempts} \
             attempt(s), {:.2} s; upstream effects 1",
            took.as_secs_f64()
        ),
        ..load::Row::default()
    });
}

/// `kill -9` after the request left and before the answer, for two operations: one the
/// upstream did (its effect, then a slow answer), one it did not (it took the request and
/// dropped it). After the lease, retries get 409 `outcome-unknown` and never reach the
/// upstream; `idemkey keys list --state indeterminate` shows both; the reconciler then
/// completes the first from the upstream's own record and releases the second (404):
/// retries replay the first and execute the second, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_request_left_is_unknown_until_reconciled() {
    let upstream = Upstream::start();
    let (url, dir) = database().await;
    let lease = ["--lease", "1s", "--route", ROUTE];
    let mut first = Gateway::start(&url, &upstream.base, dir.path(), &lease).await;
    let (done, not_done) = (Operation::new(), Operation::new());
    let release_done = upstream.hold(done.key(), true);
    let release_not_done = upstream.hold(not_done.key(), false);
    let pending: Vec<_> = [(0, &done), (1, &not_done)]
        .into_iter()
        .map(|(i, op)| {
            let (base, op) = (first.base.clone(), op.clone());
            tokio::spawn(async move { load::pay(&one_attempt(), &base, "tok1", i, op).await })
        })
        .collect();
    upstream
        .until("both requests arrived", |l| {
            l.received.get(done.key()) == Some(&1) && l.received.get(not_done.key()) == Some(&1)
        })
        .await;
    first.kill9();
    for p in pending {
        assert!(p.await.expect("attempt").outcome.is_err(), "answer lost");
    }

    let second = Gateway::start(&url, &upstream.base, dir.path(), &lease).await;
    let client = load::client(load::patient_policy());
    let started = Instant::now();
    for (i, op) in [(0, &done), (1, &not_done)] {
        let retried = load::pay(&client, &second.base, "tok1", i, op.clone()).await;
        let error = retried.outcome.clone().expect_err("not re-executed");
        assert!(error.contains("outcome-unknown"), "{error}");
    }
    let unknown_after = started.elapsed();
    assert_eq!(upstream.received(done.key()), 1, "never sent again");
    assert_eq!(upstream.received(not_done.key()), 1, "never sent again");
    let (ok, listed, err) = keys(&url, &["list", "--state", "indeterminate", "--json"]).await;
    assert!(ok, "{err}");
    assert_eq!(listed.matches("\"indeterminate\"").count(), 2, "{listed}");
    drop(second);
    // The upstream's late answers go nowhere.
    release_done.notify_one();
    release_not_done.notify_one();

    let reconciling = Gateway::start(
        &url,
        &upstream.base,
        dir.path(),
        &[
            &lease[..],
            &[
                "--reconcile-url",
                &upstream.reconcile_url(),
                "--reconcile-interval",
                "200ms",
            ],
        ]
        .concat(),
    )
    .await;
    let resolving = Instant::now();
    until_state(&reconciling.base, done.key(), "completed").await;
    let replayed = load::pay(&client, &reconciling.base, "tok1", 0, done.clone()).await;
    let (status, was_replayed, _, id) = replayed.outcome.clone().expect("replayed");
    assert_eq!(
        (status, was_replayed),
        (200, true),
        "the reconciler's answer"
    );
    assert_eq!(
        Some(id.as_str()),
        upstream
            .transfer(done.key())
            .as_ref()
            .and_then(|t| t["id"].as_str())
    );
    let executed = load::pay(&client, &reconciling.base, "tok1", 1, not_done.clone()).await;
    assert!(
        matches!(executed.outcome, Ok((201, false, _, _))),
        "released, then executed: {}",
        outcome(&executed)
    );
    let resolved = resolving.elapsed();
    assert_eq!(upstream.effects(done.key()), 1);
    assert_eq!(upstream.effects(not_done.key()), 1);
    let (ok, shown, err) = keys(&url, &["show", "--tenant", "t1", done.key()]).await;
    assert!(ok, "{err}");
    assert!(shown.contains("\"actor\": \"reconciler\""), "{shown}");
    load::row(&load::Row {
        scenario: "gateway kill -9 after the request left, before the answer",
        ops: 2,
        failed: 2,
        duplicates: 0,
        recovery: Some(resolved),
        notes: format!(
            "both retries: 409 outcome-unknown ({:.2} s, after the lease), never re-sent; \
             keys list showed 2 indeterminate; the reconciler completed the one done (200, \
             replayed) and released the one not done (executed once on retry) in {:.2} s; \
             upstream effects 1 + 1",
            unknown_after.as_secs_f64(),
            resolved.as_secs_f64()
        ),
        ..load::Row::default()
    });
}

/// `kill -9` after the upstream answered and before the record was completed: a test
/// session holds the record's row lock, so the gateway's `UPDATE … state = 'completed'`
/// waits; the gateway is killed while it waits (seen in `pg_stat_activity`), and its
/// session ends with it. The record stays `executing`: after the lease, retries get 409
/// `outcome-unknown`; an operator resolves it with `idemkey keys resolve --completed` from
/// the upstream's record, and retries replay that. One upstream effect throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_answer_before_the_record_is_settled_by_the_operator() {
    let upstream = Upstream::start();
    let (url, dir) = database().await;
    let lease = ["--lease", "1s", "--route", ROUTE];
    let mut first = Gateway::start(&url, &upstream.base, dir.path(), &lease).await;
    let op = Operation::new();
    let release = upstream.hold(op.key(), true);
    let pending = {
        let (base, op) = (first.base.clone(), op.clone());
        tokio::spawn(async move { load::pay(&one_attempt(), &base, "tok1", 0, op).await })
    };
    upstream
        .until("the request arrived", |l| l.received.contains_key(op.key()))
        .await;

    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("connect");
    let mut blocker = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM idemkey_records FOR UPDATE")
        .execute(&mut *blocker)
        .await
        .expect("lock the record");
    release.notify_one();
    upstream
        .until("the upstream answered", |l| {
            l.answered.contains_key(op.key())
        })
        .await;
    let waiting_complete = "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND query LIKE '%state = ''completed''%'";
    let deadline = Instant::now() + DEADLINE;
    loop {
        let n: i64 = sqlx::query_scalar(waiting_complete)
            .fetch_one(&pool)
            .await
            .expect("pg_stat_activity");
        if n == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the completion never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill9();
    // Its session notices the dead client (client_connection_check_interval) and ends.
    loop {
        let n: i64 = sqlx::query_scalar(waiting_complete)
            .fetch_one(&pool)
            .await
            .expect("pg_stat_activity");
        if n == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dead gateway's session lingers"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    blocker.rollback().await.expect("release the lock");
    pool.close().await;
    assert!(
        pending.await.expect("attempt").outcome.is_err(),
        "answer lost"
    );
    assert_eq!(
        state(&url).await,
        ["executing"],
        "the completion never landed"
    );

    let second = Gateway::start(&url, &upstream.base, dir.path(), &lease).await;
    let client = load::client(load::patient_policy());
    let retried = load::pay(&client, &second.base, "tok1", 0, op.clone()).await;
    let error = retried.outcome.clone().expect_err("not re-executed");
    assert!(error.contains("outcome-unknown"), "{error}");
    assert_eq!(upstream.received(op.key()), 1, "never sent again");

    let transfer = upstream.transfer(op.key()).expect("the upstream's record");
    let (ok, out, err) = keys(
        &url,
        &[
            "resolve",
            "--tenant",
            "t1",
            "--route",
            ROUTE,
            op.key(),
            "--completed",
            "--status",
            "201",
            "--body",
            &transfer.to_string(),
            "--note",
            "found in the upstream's ledger",
        ],
    )
    .await;
    assert!(ok, "{out}{err}");
    let replayed = load::pay(&client, &second.base, "tok1", 0, op.clone()).await;
    let (status, was_replayed, _, id) = replayed.outcome.clone().expect("replayed");
    assert_eq!((status, was_replayed), (201, true));
    assert_eq!(Some(id.as_str()), transfer["id"].as_str());
    assert_eq!(upstream.effects(op.key()), 1);
    let (ok, shown, err) = keys(&url, &["show", "--tenant", "t1", op.key()]).await;
    assert!(ok, "{err}");
    assert!(shown.contains("\"actor\": \"operator:alice\""), "{shown}");
    load::row(&load::Row {
        scenario: "gateway kill -9 after the answer, before the record was completed",
        ops: 1,
        failed: 1,
        duplicates: 0,
        notes: "the completion waited on a row lock and died with the gateway: record left \
                executing, retry got 409 outcome-unknown after the lease, never re-sent; \
                `idemkey keys resolve --completed` settled it, retries replay; upstream \
                effects 1"
            .to_owned(),
        ..load::Row::default()
    });
}

/// An upstream slower than the lease (0.6 s, renewed every 0.2 s): while it works, the
/// owner keeps renewing (the record's `updated_at` moves), and a second gateway on the same
/// database answers each retry 409 `request-in-flight`: no takeover, nothing sent twice.
/// Once the upstream answers, the owner completes and retries replay; one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_slower_than_the_lease_keeps_its_owner() {
    let upstream = Upstream::start();
    let (url, dir) = database().await;
    let flags = [
        "--lease",
        "600ms",
        "--route",
        ROUTE,
        "--in-flight",
        "reject",
    ];
    let owner = Gateway::start(&url, &upstream.base, dir.path(), &flags).await;
    let other = Gateway::start(&url, &upstream.base, dir.path(), &flags).await;
    let op = Operation::new();
    let release = upstream.hold(op.key(), true);
    let pending = {
        let (base, op) = (owner.base.clone(), op.clone());
        tokio::spawn(async move { load::pay(&one_attempt(), &base, "tok1", 0, op).await })
    };
    upstream
        .until("the request arrived", |l| l.received.contains_key(op.key()))
        .await;
    let held = Instant::now();

    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut renewals = 0;
    let mut last = String::new();
    let mut refused = 0;
    let deadline = Instant::now() + DEADLINE;
    while renewals < 8 {
        let status: Value = http
            .get(format!("{}/idempotency/v1/keys/{}", other.base, op.key()))
            .bearer_auth("tok1")
            .send()
            .await
            .expect("status")
            .json()
            .await
            .expect("JSON");
        assert_eq!(status["records"][0]["state"], "executing", "{status}");
        let updated = status["records"][0]["updated_at"].to_string();
        if !last.is_empty() && updated != last {
            renewals += 1;
        }
        last = updated;
        let retry = http
            .post(format!("{}/v1/payments", other.base))
            .bearer_auth("tok1")
            .header("idempotency-key", op.key())
            .json(&load::body(0))
            .send()
            .await
            .expect("retry");
        assert_eq!(retry.status(), 409, "in flight, not taken over");
        let problem: Value = retry.json().await.expect("JSON");
        assert_eq!(problem["type"], "urn:idemkey:problem:request-in-flight");
        refused += 1;
        assert!(Instant::now() < deadline, "the lease was not renewed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let slow_for = held.elapsed();
    assert!(
        slow_for > Duration::from_millis(1200),
        "{slow_for:?}: longer than two leases"
    );
    assert_eq!(upstream.received(op.key()), 1, "sent once");
    release.notify_one();
    let first = pending.await.expect("the owner's answer");
    assert!(
        matches!(first.outcome, Ok((201, false, 1, _))),
        "{}",
        outcome(&first)
    );
    let client = load::client(load::patient_policy());
    let again = load::pay(&client, &other.base, "tok1", 0, op.clone()).await;
    assert!(matches!(again.outcome, Ok((201, true, 1, _))), "{again:?}");
    assert_eq!(upstream.effects(op.key()), 1);
    load::row(&load::Row {
        scenario: "gateway: upstream slower than the lease",
        ops: 1,
        failed: 0,
        duplicates: 0,
        notes: format!(
            "upstream held {:.2} s against a 0.6 s lease: {renewals} renewals seen, {refused} \
             retries through a second gateway all 409 request-in-flight; owner completed, \
             retries replay; upstream effects 1",
            slow_for.as_secs_f64()
        ),
        ..load::Row::default()
    });
}
