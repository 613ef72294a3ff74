//! Crash and shutdown scenarios: `kill -9` and `SIGTERM` with requests in flight.

use std::time::{Duration, Instant};

use super::*;

/// 50 requests with distinct keys inside their transactions (`--simulate-latency 1500`), then
/// `kill -9`: every request fails, nothing is committed; a restarted server executes every
/// retry once, and a second retry replays it.
pub(crate) async fn crash_kill9_then_retry(backend: Backend) {
    const N: usize = 50;
    let mut server = backend.start(&["--simulate-latency", "1500"]).await;
    let api = server.api();
    let key = |k: usize| format!("crash-{k}");
    let body = |k: usize| payment(500 + k as i64, &format!("crash {k}"));
    let started = Instant::now();
    let tasks: Vec<_> = (0..N)
        .map(|k| {
            let api = api.clone();
            let (key, body) = (key(k), body(k));
            tokio::spawn(async move { api.pay(TOKEN1, &key, &body).await })
        })
        .collect();
    // Kill only once requests sit inside their transactions (the handler sleeps 1.5 s there
    // before its commit); the check below that every request failed confirms that none had
    // committed.
    let mut open = 0;
    while open == 0 && started.elapsed() < Duration::from_millis(1400) {
        open = backend.open_transactions().await;
        if open == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(
        open > 0,
        "no request reached its transaction before the kill"
    );
    eprintln!("kill -9 with {open} open transactions");
    server.kill9();
    let killed_at = started.elapsed();
    let mut failed = 0;
    for task in tasks {
        match task.await.expect("request task") {
            Err(_) => failed += 1,
            Ok(answer) => panic!(
                "answered {} before the kill at {killed_at:?}: {}",
                answer.status,
                answer.text()
            ),
        }
    }
    assert_eq!(failed, N, "every request in flight fails with the server");

    // Nothing of the interrupted transactions survives: no record, no payment.
    backend.snapshot().await.assert_consistent(0);

    let server = backend.start(&[]).await;
    let api = server.api();
    let mut first = Vec::with_capacity(N);
    for k in 0..N {
        let answer = api.pay_until_created(TOKEN1, &key(k), &body(k)).await;
        assert!(
            !answer.replayed(),
            "key {k}: nothing was committed, so the retry executes"
        );
        first.push(answer);
    }
    for (k, first) in first.iter().enumerate() {
        let again = api.pay_ok(TOKEN1, &key(k), &body(k)).await;
        assert_eq!(again.status, 201, "key {k}: {}", again.text());
        assert!(again.replayed(), "key {k}: the second retry replays");
        assert_eq!(again.body, first.body, "key {k}: the same payment");
    }
    assert_eq!(api.total(TOKEN1).await, N as i64, "payments");
    backend.snapshot().await.assert_consistent(N);
}

/// `--simulate-latency 1000`, 10 requests, SIGTERM once they have reached the server: every
/// request gets its answer (201; on SQLite, whose writers queue behind one lock, possibly
/// 409 request-in-flight), the process exits 0, the payments are exactly the 201s, and
/// retries of the 10 keys end with exactly 10 payments.
pub(crate) async fn graceful_shutdown_sigterm(backend: Backend) {
    const N: usize = 10;
    let mut server = backend.start(&["--simulate-latency", "1000"]).await;
    let api = server.api();
    let key = |k: usize| format!("term-{k}");
    let body = |k: usize| payment(700 + k as i64, &format!("term {k}"));
    let tasks: Vec<_> = (0..N)
        .map(|k| {
            let api = api.clone();
            let (key, body) = (key(k), body(k));
            tokio::spawn(async move { api.pay(TOKEN1, &key, &body).await })
        })
        .collect();
    // Every request must be in the server (its attempt counted) before the signal.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let attempts = api.metric("idemkey_attempts_total").await;
        if attempts >= N as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {attempts} requests reached the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.sigterm();
    let mut answers = Vec::with_capacity(N);
    for (k, task) in tasks.into_iter().enumerate() {
        let answer = task
            .await
            .expect("request task")
            .unwrap_or_else(|e| panic!("key {k}: the request in flight was dropped: {e}"));
        answers.push(answer);
    }
    let status = server.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(
        status.code(),
        Some(0),
        "exit status {status:?}; log:\n{}",
        server.log_tail()
    );
    let stdout = server.stdout();
    assert!(
        stdout.iter().any(|l| l == "idemkey stopped"),
        "stdout: {stdout:?}"
    );
    let mut created = 0;
    for (k, answer) in answers.iter().enumerate() {
        match answer.status {
            201 => {
                assert!(!answer.replayed(), "key {k}");
                created += 1;
            }
            // SQLite serializes the writers; those that waited past its busy time-out
            // were told so and ran nothing.
            503 if backend.kind() == Kind::Sqlite => {
                answer.assert_problem(503, "store-busy");
                assert!(answer.header("retry-after").is_some(), "key {k}");
            }
            other => panic!("key {k}: unexpected {other}: {}", answer.text()),
        }
    }
    eprintln!("SIGTERM on {:?}: {created} of {N} created", backend.kind());
    if backend.kind() == Kind::Postgres {
        assert_eq!(created, N, "every request in flight completes");
    } else {
        assert!(created >= 1, "the request in flight completes");
    }
    backend.snapshot().await.assert_consistent(created);

    let server = backend.start(&[]).await;
    let api = server.api();
    assert_eq!(api.total(TOKEN1).await, created as i64, "payments == 201s");
    for (k, before) in answers.iter().enumerate() {
        let again = api.pay_until_created(TOKEN1, &key(k), &body(k)).await;
        if before.status == 201 {
            assert!(again.replayed(), "key {k}: replays");
            assert_eq!(again.body, before.body, "key {k}: the same payment");
        } else {
            assert!(!again.replayed(), "key {k}: executes now");
        }
    }
    assert_eq!(api.total(TOKEN1).await, N as i64, "payments");
    backend.snapshot().await.assert_consistent(N);
}
