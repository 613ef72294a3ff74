//! Chaos on PostgreSQL, each scenario with load from the real client (`idemkey-client`: one
//! key per logical payment, retried by the client with that key):
//!
//! - the database is down when `idemkey serve` starts, and goes away later;
//! - `pg_ctl restart -m fast` and `-m immediate` (crash recovery) under load;
//! - the connection cut right around a `COMMIT` (before it left, after it left, after the
//!   server answered it), so the server cannot know whether it committed.
//!
//! Each scenario asserts that nothing is duplicated or orphaned (payments, ledger rows and
//! idempotency records read back from the database), that every operation the client
//! reported successful exists exactly once, and prints one `CHAOS-ROW|…` line with its
//! figures (`scripts/chaos.sh` runs the longer variants and collects them).
//!
//! The restart scenarios run on a PostgreSQL server of their own (`common::cluster`); the
//! COMMIT scenario puts `idemkey_testkit::PgFaultProxy` between `serve` and the shared
//! test server.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::PgCluster;
use common::load::{self, Audit, Progress};
use common::{Backend, TOKEN1};
use idemkey_client::Operation;
use idemkey_testkit::{CommitCut, PgFaultProxy};

/// How long a condition on an external process may take to show.
const DEADLINE: Duration = Duration::from_secs(60);

/// A new cluster, initialised (not started), off the async threads.
async fn cluster() -> Arc<PgCluster> {
    Arc::new(
        tokio::task::spawn_blocking(PgCluster::init)
            .await
            .expect("initdb"),
    )
}

/// Runs a blocking `pg_ctl` step off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// Polls `GET /healthz` (bounded) until it answers `status`; returns how long that took.
async fn until_health(api: &common::Api, status: u16) -> Duration {
    let started = Instant::now();
    loop {
        let answer = api.get("/healthz", None).await;
        if answer.status == status {
            if status == 503 {
                answer.assert_problem(503, "store-unavailable");
                assert_eq!(answer.header("retry-after"), Some("1"));
            }
            return started.elapsed();
        }
        assert!(
            started.elapsed() < DEADLINE,
            "/healthz never answered {status}: {} {}",
            answer.status,
            answer.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `serve` started while PostgreSQL is down: it listens, answers `/healthz` and payments
/// with 503 problem+json (never exits), and once PostgreSQL is up it migrates and serves by
/// itself. Later, PostgreSQL stopped under it: `/healthz` turns 503, and 200 again once it is
/// back; a payment sent during the outage by the client succeeds once, after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_starts_without_postgres_and_recovers_by_itself() {
    let cluster = cluster().await;
    let backend = Backend::postgres_at(cluster.url("postgres"));
    let server = backend.start(&["--max-connections", "4"]).await;
    let api = server.api();

    let health = api.get("/healthz", None).await;
    health.assert_problem(503, "store-unavailable");
    assert_eq!(health.header("retry-after"), Some("1"));
    assert!(
        health.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("cannot reach its database")),
        "{}",
        health.text()
    );
    let refused = api
        .pay_ok(TOKEN1, "before-postgres", &common::payment(500, "early"))
        .await;
    refused.assert_problem(503, "store-unavailable");

    let up = Instant::now();
    blocking({
        let cluster = cluster.clone();
        move || cluster.start()
    })
    .await;
    let pg_ready = up.elapsed();
    let serving = until_health(&api, 200).await;
    let first = api
        .pay_ok(TOKEN1, "before-postgres", &common::payment(500, "early"))
        .await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed(), "nothing ran before the database was up");
    let again = api
        .pay_ok(TOKEN1, "before-postgres", &common::payment(500, "early"))
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);

    // Later: the database goes away under a running server, and comes back.
    blocking({
        let cluster = cluster.clone();
        move || cluster.stop("fast")
    })
    .await;
    let noticed = until_health(&api, 503).await;
    let attempts_before = api.metric("idemkey_attempts_total").await;
    let client = load::client(load::patient_policy());
    let op = Operation::new();
    let pending = {
        let (client, base, op) = (client.clone(), server.base().to_owned(), op.clone());
        tokio::spawn(async move { load::pay(&client, &base, TOKEN1, 1, op).await })
    };
    // Its first attempt has reached the server (and fails, or waits for the database).
    let deadline = Instant::now() + DEADLINE;
    while api.metric("idemkey_attempts_total").await <= attempts_before {
        assert!(
            Instant::now() < deadline,
            "the payment never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let down = Instant::now();
    blocking({
        let cluster = cluster.clone();
        move || cluster.start()
    })
    .await;
    let back = until_health(&api, 200).await;
    let paid = pending.await.expect("the payment task");
    let recovered = down.elapsed();
    let (status, replayed, attempts, _) = paid.outcome.clone().expect("the payment succeeds");
    assert_eq!(status, 201);
    assert!(!replayed, "executed once, after the outage");
    let audit = Audit::postgres(backend.url()).await;
    audit.assert_exactly_once(std::slice::from_ref(&paid));
    // `early` (the first payment) and `op-1`.
    audit.assert_all(2);
    assert!(
        server
            .stdout()
            .iter()
            .any(|l| l.starts_with("idemkey listening on")),
        "serve announced itself"
    );

    load::row(&load::Row {
        scenario: "PostgreSQL down when serve starts",
        ops: 2,
        failed: 0,
        duplicates: audit.duplicates,
        records_without_effect: audit.records_without_effect,
        effects_without_record: audit.effects_without_record,
        recovery: Some(serving),
        notes: format!(
            "/healthz 503 until PostgreSQL was up (pg_ctl start {:.2} s), 200 {:.2} s after; \
             stopped later: 503 after {:.2} s, 200 {:.2} s after the restart; a payment sent \
             during the outage succeeded once after {attempts} attempts, {:.2} s",
            pg_ready.as_secs_f64(),
            serving.as_secs_f64(),
            noticed.as_secs_f64(),
            back.as_secs_f64(),
            recovered.as_secs_f64(),
        ),
    });
}

/// `pg_ctl restart -m MODE` under load: `ops` logical payments (8 at a time, on two `serve`
/// processes), the restart once a third of them are done; then every operation the client
/// gave up on is retried with its own key. Asserts no duplicate, no orphan, and every
/// operation exactly once.
async fn restart_under_load(mode: &'static str) {
    let ops = load::scaled(300);
    let rounds = load::iterations(1);
    let cluster = cluster().await;
    blocking({
        let cluster = cluster.clone();
        move || {
            cluster.start();
            cluster.create_database("chaos");
        }
    })
    .await;
    let backend = Backend::postgres_at(cluster.url("chaos"));
    let servers = [
        backend.start(&["--max-connections", "8"]).await,
        backend.start(&["--max-connections", "8"]).await,
    ];
    let bases: Vec<String> = servers.iter().map(|s| s.base().to_owned()).collect();
    let client = load::client(load::patient_policy());

    let mut results = Vec::new();
    let mut restarts = Vec::new();
    let mut stalls = Vec::new();
    for round in 0..rounds {
        let progress = Progress::default();
        let range = round * ops..(round + 1) * ops;
        let fault = {
            let (progress, cluster) = (progress.clone(), cluster.clone());
            tokio::spawn(async move {
                progress.until(ops / 3).await;
                let at = Instant::now();
                let took = blocking(move || cluster.restart(mode)).await;
                (at, took)
            })
        };
        let mut round_results = load::payments(&client, &bases, TOKEN1, range, 8, &progress).await;
        let (fault_at, took) = fault.await.expect("the restart");
        restarts.push(took);
        stalls.push(load::longest_stall(&round_results, fault_at));
        results.append(&mut round_results);
    }
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.succeeded())
        .map(|r| format!("op-{}: {:?}", r.index, r.outcome))
        .collect();
    let before = Audit::postgres(backend.url()).await;
    before.assert_exactly_once(&results);
    let fixed = load::retry_failed(&client, &bases[0], TOKEN1, &mut results).await;
    assert_eq!(
        fixed,
        failed.len(),
        "every failed operation succeeds on retry"
    );
    let audit = Audit::postgres(backend.url()).await;
    audit.assert_exactly_once(&results);
    audit.assert_all(ops * rounds);
    let (attempts, retried) = load::attempts(&results);
    let stall = stalls.iter().max().copied();
    let restart = restarts.iter().max().copied().unwrap_or_default();
    load::row(&load::row_of(
        &format!("PostgreSQL restart -m {mode} under load"),
        &results,
        failed.len(),
        &audit,
        stall,
        format!(
            "{rounds} restart(s), pg_ctl restart took up to {:.2} s; {attempts} attempts, \
             {retried} operations retried by the client; records = payments = ledger = {}; \
             client-visible failures: {failed:?}",
            restart.as_secs_f64(),
            audit.payments
        ),
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_fast_under_load_loses_and_duplicates_nothing() {
    restart_under_load("fast").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_immediate_under_load_loses_and_duplicates_nothing() {
    restart_under_load("immediate").await;
}

/// The address of the test PostgreSQL server in `url`, and the URL through `proxy`.
fn through(url: &str, proxy: SocketAddr) -> (SocketAddr, String) {
    let rest = url.split_once("://").expect("a URL").1;
    let (authority, path) = rest.split_once('/').expect("a database name");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let server: SocketAddr = host_port.parse().expect("host:port of the test server");
    let user = authority.rsplit_once('@').map_or("", |(u, _)| u);
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    let proxied = format!("postgres://{user}@{proxy}/{path}?sslmode=disable");
    (server, proxied)
}

/// The connection between `serve` and PostgreSQL cut right around a `COMMIT`: before it left
/// (the server rolls back), right after it left (the server commits, nobody hears), after
/// the server's answer (committed for sure, the answer withheld). In each case the first
/// attempt gets 503 `store-unavailable`, and the client's retry with the same key settles
/// it exactly once: executed afresh when nothing committed, replayed when it did. Then
/// under load, with cuts of every kind armed: every payment exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_cut_off_is_settled_by_the_retry_exactly_once() {
    let url = blocking(idemkey_testkit::fresh_database_url).await;
    let (postgres, _) = through(&url, "127.0.0.1:1".parse().unwrap());
    let probe = PgFaultProxy::start(postgres)
        .await
        .expect("the proxy starts");
    let (_, proxied) = through(&url, probe.addr());
    let backend = Backend::postgres_at(proxied);
    // The purge commits too (each batch is a transaction): let its first round, which runs
    // at start, end before a cut is armed, and no other round run during the test.
    let server = backend
        .start(&["--max-connections", "4", "--purge-interval", "1h"])
        .await;
    let api = server.api();
    let deadline = Instant::now() + DEADLINE;
    while api.metric("idemkey_purge_rounds_total").await < 1 {
        assert!(
            Instant::now() < deadline,
            "the purge's first round never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = load::client(load::patient_policy());
    let base = [server.base().to_owned()];

    let mut cut = 0;
    let mut single = Vec::new();
    for (index, how) in [
        CommitCut::BeforeSend,
        CommitCut::AfterSend,
        CommitCut::AfterReply,
    ]
    .into_iter()
    .enumerate()
    {
        probe.cut_commits(how, 1);
        let result = load::pay(&client, &base[0], TOKEN1, index, Operation::new()).await;
        cut += 1;
        assert!(
            probe.until_cut(cut, Duration::from_secs(10)).await,
            "{how:?}: no COMMIT was cut"
        );
        let (status, replayed, attempts, _) = result.outcome.clone().expect("settled");
        assert_eq!(status, 201, "{how:?}");
        assert!(attempts >= 2, "{how:?}: the first attempt lost its COMMIT");
        match how {
            CommitCut::BeforeSend => assert!(!replayed, "nothing committed: run afresh"),
            CommitCut::AfterReply => assert!(replayed, "committed: the retry replays"),
            _ => {}
        }
        single.push(format!("{how:?}: {attempts} attempts, replayed {replayed}"));
        let audit = Audit::postgres(&url).await;
        audit.assert_exactly_once(std::slice::from_ref(&result));
        audit.assert_all(index + 1);
    }

    // Under load: 8 at a time, a cut of each kind in turn until `cuts` were made.
    let ops = load::scaled(150);
    let cuts = (ops / 10).max(3) as u64;
    let progress = Progress::default();
    let cutter = {
        let (progress, probe) = (progress.clone(), &probe);
        async move {
            let kinds = [
                CommitCut::BeforeSend,
                CommitCut::AfterSend,
                CommitCut::AfterReply,
            ];
            for i in 0..cuts {
                probe.cut_commits(kinds[(i % 3) as usize], 1);
                tokio::select! {
                    done = probe.until_cut(cut + i + 1, DEADLINE) => assert!(done, "no cut"),
                    () = progress.until(ops) => return i,
                }
            }
            cuts
        }
    };
    let (mut results, made) = tokio::join!(
        load::payments(&client, &base, TOKEN1, 3..3 + ops, 8, &progress),
        cutter
    );
    probe.cut_commits(CommitCut::AfterSend, 0);
    let failed = results.iter().filter(|r| !r.succeeded()).count();
    let fixed = load::retry_failed(&client, &base[0], TOKEN1, &mut results).await;
    assert_eq!(fixed, failed);
    let audit = Audit::postgres(&url).await;
    audit.assert_exactly_once(&results);
    audit.assert_all(3 + ops);
    assert!(made >= cuts.min(3), "only {made} cuts were made under load");
    let (attempts, retried) = load::attempts(&results);
    load::row(&load::row_of(
        "connection cut around COMMIT",
        &results,
        failed,
        &audit,
        None,
        format!(
            "{} COMMITs cut under load (before sending, after sending, after the answer, in \
             turn) + 3 alone ({}); {attempts} attempts, {retried} operations retried; \
             records = payments = ledger = {}",
            made,
            single.join("; "),
            audit.payments
        ),
    ));
}
