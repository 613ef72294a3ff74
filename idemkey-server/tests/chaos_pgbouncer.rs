//! Chaos behind PgBouncer in transaction pooling mode, with load from the real client
//! (`idemkey-client`: one key per logical payment, retried by the client with that key):
//! the pooler is killed with `SIGKILL` under load and started again on the same port.
//!
//! A killed pooler breaks every client connection at once, and closes its server
//! connections, so PostgreSQL rolls back each transaction it carried: a claim and its
//! payment together, never one without the other. The scenario asserts that nothing is
//! duplicated or orphaned (payments, ledger rows and idempotency records read back from the
//! database directly), that every operation the client reported successful exists exactly
//! once, and prints one `CHAOS-ROW|…` line with its figures (`scripts/chaos.sh` runs the
//! longer variant and collects it).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::load::{self, Audit, Progress};
use common::{Backend, TOKEN1};
use idemkey_testkit::PgBouncer;

/// `ops` logical payments (8 at a time, on two `serve` processes), the pooler killed and
/// restarted once a third of them are done (per round); then every operation the client
/// gave up on is retried with its own key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_killed_under_load_loses_and_duplicates_nothing() {
    let ops = load::scaled(300);
    let rounds = load::iterations(1);
    let pgbouncer =
        tokio::task::spawn_blocking(|| PgBouncer::start(&idemkey_testkit::postgres_url(), 20))
            .await
            .expect("pgbouncer");
    let backend = Backend::postgres_through(&pgbouncer).await;
    let pgbouncer = Arc::new(Mutex::new(pgbouncer));
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
            let (progress, pgbouncer) = (progress.clone(), pgbouncer.clone());
            tokio::spawn(async move {
                progress.until(ops / 3).await;
                let at = Instant::now();
                tokio::task::spawn_blocking(move || {
                    let mut pgbouncer = pgbouncer.lock().expect("pgbouncer");
                    pgbouncer.kill();
                    pgbouncer.restart();
                })
                .await
                .expect("kill and restart pgbouncer");
                (at, at.elapsed())
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
    let before = Audit::postgres(backend.direct_url()).await;
    before.assert_exactly_once(&results);
    let fixed = load::retry_failed(&client, &bases[0], TOKEN1, &mut results).await;
    assert_eq!(
        fixed,
        failed.len(),
        "every failed operation succeeds on retry"
    );
    let audit = Audit::postgres(backend.direct_url()).await;
    audit.assert_exactly_once(&results);
    audit.assert_all(ops * rounds);
    let (attempts, retried) = load::attempts(&results);
    let stall = stalls.iter().max().copied();
    let restart = restarts.iter().max().copied().unwrap_or_default();
    load::row(&load::row_of(
        "PgBouncer (transaction mode) killed -9 and restarted under load",
        &results,
        failed.len(),
        &audit,
        stall,
        format!(
            "{rounds} kill(s), kill -9 and restart took up to {:.2} s; {attempts} attempts, \
             {retried} operations retried by the client; records = payments = ledger = {}; \
             client-visible failures: {failed:?}",
            restart.as_secs_f64(),
            audit.payments
        ),
    ));
}
