//! Race scenarios: many concurrent requests per key, on one server or three.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::future::join_all;
use tokio::sync::Semaphore;

use super::*;

/// The per-key result of a race.
#[derive(Debug, Default)]
struct RaceCounts {
    created: usize,
    in_flight: usize,
}

/// Checks the answers of a race, grouped by key: every answer is a 201 (or, when
/// `allow_in_flight`, a 409 request-in-flight with Retry-After); per key, exactly one 201
/// executed (no `idempotent-replayed: true`) and every 201 has the same body and Location.
/// Returns the executed answer of each key.
fn check_race(
    results: Vec<(usize, Result<Answer, reqwest::Error>)>,
    keys: usize,
    allow_in_flight: bool,
    window: (SystemTime, SystemTime),
) -> (RaceCounts, Vec<Answer>) {
    let mut by_key: Vec<Vec<Answer>> = vec![Vec::new(); keys];
    let mut errors = Vec::new();
    for (k, result) in results {
        match result {
            Ok(answer) => by_key[k].push(answer),
            Err(e) => errors.push(format!("key {k}: {e}")),
        }
    }
    assert!(
        errors.is_empty(),
        "{} transport errors, e.g. {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
    let mut counts = RaceCounts::default();
    let mut executed = Vec::with_capacity(keys);
    for (k, answers) in by_key.iter().enumerate() {
        let mut created = Vec::new();
        for answer in answers {
            match answer.status {
                201 => created.push(answer),
                409 if allow_in_flight => {
                    answer.assert_in_flight();
                    counts.in_flight += 1;
                }
                // SQLite's single write lock not granted in time: nothing ran.
                503 if allow_in_flight => {
                    answer.assert_problem(503, "store-busy");
                    assert!(answer.header("retry-after").is_some(), "key {k}");
                    counts.in_flight += 1;
                }
                other => panic!("key {k}: unexpected {other}: {}", answer.text()),
            }
        }
        counts.created += created.len();
        let fresh: Vec<&&Answer> = created.iter().filter(|a| !a.replayed()).collect();
        assert_eq!(
            fresh.len(),
            1,
            "key {k}: exactly one 201 must lack `idempotent-replayed: true` ({} answers, {} created)",
            answers.len(),
            created.len()
        );
        let first = fresh[0];
        assert!(first.header("idempotent-replayed").is_none());
        assert_expiry(first, window.0, window.1, Duration::from_secs(24 * 3600));
        for answer in &created {
            assert_eq!(
                answer.body, first.body,
                "key {k}: every 201 has the same body"
            );
            assert_eq!(
                answer.header("location"),
                first.header("location"),
                "key {k}: Location is replayed"
            );
            assert_eq!(answer.header("content-type"), Some("application/json"));
            assert_eq!(
                answer.header("idempotency-key-expires"),
                first.header("idempotency-key-expires"),
                "key {k}: one record, one expiry"
            );
        }
        executed.push((*first).clone());
    }
    (counts, executed)
}

/// Runs `copies` concurrent identical requests for each of `keys` keys, at most `limit` at
/// once, spread round-robin over `apis`; returns `(key index, answer)` and when it ran.
async fn race(
    apis: &[Api],
    keys: usize,
    copies: usize,
    limit: usize,
    key: impl Fn(usize) -> String,
    body: impl Fn(usize) -> String,
) -> (
    Vec<(usize, Result<Answer, reqwest::Error>)>,
    (SystemTime, SystemTime),
) {
    let semaphore = Arc::new(Semaphore::new(limit));
    let requests = (0..keys)
        .flat_map(|k| (0..copies).map(move |c| (k, c)))
        .map(|(k, c)| {
            let api = apis[(k * copies + c) % apis.len()].clone();
            let semaphore = semaphore.clone();
            let key = key(k);
            let body = body(k);
            async move {
                let _permit = semaphore.acquire().await.expect("semaphore");
                (k, api.pay(TOKEN1, &key, &body).await)
            }
        });
    let from = SystemTime::now();
    let results = join_all(requests).await;
    (results, (from, SystemTime::now()))
}

/// 200 keys × 16 concurrent identical requests on one server (`--simulate-latency 20`):
/// exactly 200 payments, one execution per key, identical bodies. PostgreSQL: no 409 under
/// the default `wait` policy. SQLite serializes writers, so a loser may time out on the
/// write lock and, past its busy time-out, answer 503 store-busy: counted, allowed.
pub(crate) async fn race_200_keys_16_concurrent(backend: Backend) {
    const KEYS: usize = 200;
    const COPIES: usize = 16;
    let server = backend.start(&["--simulate-latency", "20"]).await;
    let api = server.api();
    let started = Instant::now();
    let (results, window) = race(
        std::slice::from_ref(&api),
        KEYS,
        COPIES,
        256,
        |k| format!("race-{k}"),
        |k| payment(100 + k as i64, &format!("race {k}")),
    )
    .await;
    let elapsed = started.elapsed();
    let allow_in_flight = backend.kind() == Kind::Sqlite;
    let (counts, _) = check_race(results, KEYS, allow_in_flight, window);
    eprintln!(
        "race {KEYS}x{COPIES} on {:?}: {} created, {} x 409 in {elapsed:?}",
        backend.kind(),
        counts.created,
        counts.in_flight
    );
    assert_eq!(counts.created + counts.in_flight, KEYS * COPIES);
    assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"executed\"}")
            .await,
        KEYS as u64
    );
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"replayed\"}")
            .await,
        (counts.created - KEYS) as u64
    );
    assert_eq!(
        api.metric("idemkey_requests_total{outcome=\"in_flight\"}")
            .await,
        counts.in_flight as u64
    );
    assert_eq!(
        api.metric("idemkey_attempts_total").await,
        (KEYS * COPIES) as u64
    );
    backend.snapshot().await.assert_consistent(KEYS);
}

/// `--in-flight reject --simulate-latency 200`, 20 keys × 8 concurrent: exactly 20 payments;
/// every other answer is a replay or a 409 request-in-flight with Retry-After; afterwards
/// every key replays its 201.
///
/// On SQLite, `reject` cannot answer at once: the claim waits for SQLite's single write lock
/// (`BEGIN IMMEDIATE`, up to the 5 s busy time-out), so a loser usually replays after the
/// owner commits. Only correctness is required there.
pub(crate) async fn race_reject_policy(backend: Backend) {
    const KEYS: usize = 20;
    const COPIES: usize = 8;
    let server = backend
        .start(&["--in-flight", "reject", "--simulate-latency", "200"])
        .await;
    let api = server.api();
    let key = |k: usize| format!("reject-{k}");
    let body = |k: usize| payment(1000 + k as i64, &format!("reject {k}"));
    let (results, window) = race(
        std::slice::from_ref(&api),
        KEYS,
        COPIES,
        KEYS * COPIES,
        key,
        body,
    )
    .await;
    let (counts, executed) = check_race(results, KEYS, true, window);
    eprintln!(
        "reject {KEYS}x{COPIES} on {:?}: {} created, {} x 409",
        backend.kind(),
        counts.created,
        counts.in_flight
    );
    assert_eq!(counts.created + counts.in_flight, KEYS * COPIES);
    if backend.kind() == Kind::Postgres {
        assert!(
            counts.in_flight > 0,
            "PostgreSQL under `reject`: concurrent copies answer 409 at once"
        );
    }
    assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    for (k, first) in executed.iter().enumerate() {
        let again = api.pay_until_created(TOKEN1, &key(k), &body(k)).await;
        assert!(again.replayed(), "key {k}: the retry replays");
        assert_eq!(
            again.body, first.body,
            "key {k}: the retry replays the body"
        );
    }
    assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    backend.snapshot().await.assert_consistent(KEYS);
}

/// Three `idemkey serve` processes on one database (started together, so their migrations
/// and the shared key-hashing secret race too; on a cluster, each on its own node), 200 keys
/// × 16 requests spread round-robin over them: exactly 200 payments, identical bodies per
/// key, no 409, no 5xx; over the three, 200 executions and every other request a replay.
pub(crate) async fn race_across_three_processes(backend: Backend) {
    const KEYS: usize = 200;
    const COPIES: usize = 16;
    let args = ["--simulate-latency", "20"];
    let (a, b, c) = futures::join!(
        backend.start(&args),
        backend.start(&args),
        backend.start(&args)
    );
    let apis = [a.api(), b.api(), c.api()];
    let started = Instant::now();
    let (results, window) = race(
        &apis,
        KEYS,
        COPIES,
        256,
        |k| format!("multi-{k}"),
        |k| payment(100 + k as i64, &format!("multi {k}")),
    )
    .await;
    let elapsed = started.elapsed();
    let (counts, _) = check_race(results, KEYS, false, window);
    eprintln!(
        "race {KEYS}x{COPIES} over 3 processes: {} created in {elapsed:?}",
        counts.created
    );
    assert_eq!(counts.created, KEYS * COPIES);
    for api in &apis {
        assert_eq!(api.total(TOKEN1).await, KEYS as i64, "payments");
    }
    let mut sums = [0; 3];
    for api in &apis {
        for (sum, series) in sums.iter_mut().zip([
            "idemkey_requests_total{outcome=\"executed\"}",
            "idemkey_requests_total{outcome=\"replayed\"}",
            "idemkey_attempts_total",
        ]) {
            *sum += api.metric(series).await;
        }
    }
    let [executed, replayed, attempts] = sums;
    assert_eq!(executed, KEYS as u64, "executions over the three processes");
    assert_eq!(replayed, (KEYS * (COPIES - 1)) as u64, "replays");
    assert_eq!(attempts, (KEYS * COPIES) as u64, "attempts");
    backend.snapshot().await.assert_consistent(KEYS);
}
