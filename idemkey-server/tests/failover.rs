//! PostgreSQL failover under load: the load and the audit of `scripts/failover.sh`.
//!
//! Not run by `cargo test` (it is `#[ignore]`d: it needs a pg_auto_failover cluster, which CI
//! does not have). The script sets the cluster up, puts `scripts/pg_primary_proxy.py` in front
//! of it, starts `idemkey serve` on the proxy and runs this test with `--ignored` and:
//!
//! - `FAILOVER_SERVE_URL`: the server; `FAILOVER_DATABASE_URL`: the database through the
//!   proxy (the primary of the moment, read for the audit);
//! - `FAILOVER_MONITOR_URL`: the pg_auto_failover monitor, asked for the primary;
//! - `FAILOVER_KILL_COMMAND`: a shell command that kills the primary's node;
//! - `FAILOVER_OPS` (default 3000), `FAILOVER_CONCURRENCY` (default 8), `FAILOVER_NOTES`
//!   (added to the row).
//!
//! `ops` logical payments (one key each, the real client retrying with that key), the
//! primary killed once a third are done, the load going on through the failover. Then every
//! operation the client gave up on is retried with its key until it is answered, and every
//! operation is sent once more with its key: an operation whose record survived is replayed
//! (same payment), one whose record and payment an asynchronous failover lost together is
//! executed again, once. Asserts records = payments = ledger rows = `ops` on the new primary,
//! no duplicate, no orphan, every operation's final answer naming its one payment, and that
//! the operations re-created are exactly the acknowledged ones whose payment was missing after
//! the failover. Prints one `CHAOS-ROW|…` line.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::TOKEN1;
use common::load::{self, Audit, Progress};
use sqlx::{Connection, PgConnection};

/// How long the monitor may take to promote the standby.
const PROMOTION_BOUND: Duration = Duration::from_secs(60);

/// How many rounds of "retry every unanswered operation with its key" the test allows.
const RETRY_ROUNDS: usize = 10;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run scripts/failover.sh"))
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// The primary's name as the monitor sees it, or `None` (no primary, or no answer).
async fn primary(monitor: &str) -> Option<String> {
    let mut conn = tokio::time::timeout(Duration::from_secs(2), PgConnection::connect(monitor))
        .await
        .ok()?
        .ok()?;
    let name: Option<String> =
        sqlx::query_scalar("SELECT primary_name::text FROM pgautofailover.get_primary()")
            .fetch_optional(&mut conn)
            .await
            .ok()
            .flatten();
    let _ = conn.close().await;
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a pg_auto_failover cluster: run scripts/failover.sh"]
async fn primary_killed_under_load() {
    let base = env("FAILOVER_SERVE_URL");
    let database = env("FAILOVER_DATABASE_URL");
    let monitor = env("FAILOVER_MONITOR_URL");
    let kill = env("FAILOVER_KILL_COMMAND");
    let notes = std::env::var("FAILOVER_NOTES").unwrap_or_default();
    let ops = env_number("FAILOVER_OPS", 3000);
    let concurrency = env_number("FAILOVER_CONCURRENCY", 8);

    let old = primary(&monitor)
        .await
        .expect("the monitor names a primary");
    let client = load::client(load::patient_policy());
    let bases = [base.clone()];
    let progress = Progress::default();

    let fault = {
        let (progress, monitor, old) = (progress.clone(), monitor.clone(), old.clone());
        tokio::spawn(async move {
            progress.until(ops / 3).await;
            let killed_at = Instant::now();
            let status = tokio::task::spawn_blocking(move || {
                std::process::Command::new("sh")
                    .args(["-c", &kill])
                    .status()
            })
            .await
            .expect("the kill task")
            .expect("run the kill command");
            assert!(status.success(), "the kill command failed: {status}");
            loop {
                if let Some(name) = primary(&monitor).await
                    && name != old
                {
                    return (killed_at, Instant::now(), name);
                }
                assert!(
                    killed_at.elapsed() < PROMOTION_BOUND,
                    "the standby was not promoted within {PROMOTION_BOUND:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut results = load::payments(&client, &bases, TOKEN1, 0..ops, concurrency, &progress).await;
    let (killed_at, promoted_at, new) = fault.await.expect("the failover");
    let promotion = promoted_at - killed_at;
    // The first payment answered after the promotion was seen: the service is back.
    let recovered = results
        .iter()
        .filter(|r| r.succeeded() && r.done_at >= promoted_at)
        .map(|r| r.done_at)
        .min()
        .map(|at| at - killed_at);
    let stall = load::longest_stall(&results, killed_at);
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.succeeded())
        .map(|r| format!("op-{}: {:?}", r.index, r.outcome))
        .collect();
    let (attempts, retried) = load::attempts(&results);

    // Every operation the client gave up on, retried with its key until it is answered.
    let mut rounds = 0;
    while results.iter().any(|r| !r.succeeded()) {
        assert!(
            rounds < RETRY_ROUNDS,
            "operations still unanswered after {RETRY_ROUNDS} rounds of retries: {:?}",
            results
                .iter()
                .filter(|r| !r.succeeded())
                .map(|r| format!("op-{}: {:?}", r.index, r.outcome))
                .collect::<Vec<_>>()
        );
        load::retry_failed(&client, &base, TOKEN1, &mut results).await;
        rounds += 1;
    }

    // What the new primary holds, against what the client was told.
    let after_failover = Audit::postgres(&database).await;
    let held: BTreeSet<&String> = after_failover.by_op.values().flatten().collect();
    let told = |r: &load::OpResult| match &r.outcome {
        Ok((_, _, _, id)) => id.clone(),
        Err(e) => panic!("op-{} unanswered: {e}", r.index),
    };
    let lost: BTreeSet<usize> = results
        .iter()
        .filter(|r| !held.contains(&told(r)))
        .map(|r| r.index)
        .collect();
    assert_eq!(after_failover.duplicates, 0, "{after_failover:?}");
    assert_eq!(
        after_failover.records_without_effect, 0,
        "records without effect"
    );
    assert_eq!(
        after_failover.effects_without_record, 0,
        "effects without record"
    );

    // Every operation sent once more with its key: replayed if its record survived, executed
    // again (once) if the failover lost it.
    let mut verify = Vec::with_capacity(results.len());
    for r in &results {
        let mut again = load::pay(&client, &base, TOKEN1, r.index, r.op.clone()).await;
        for _ in 0..RETRY_ROUNDS {
            if again.succeeded() {
                break;
            }
            again = load::pay(&client, &base, TOKEN1, r.index, r.op.clone()).await;
        }
        assert!(again.succeeded(), "op-{}: {:?}", r.index, again.outcome);
        verify.push(again);
    }
    let mut recreated = BTreeSet::new();
    for (first, again) in results.iter().zip(&verify) {
        let Ok((_, replayed, _, id)) = &again.outcome else {
            unreachable!()
        };
        if lost.contains(&first.index) {
            assert!(!replayed, "op-{}: lost, yet replayed", first.index);
            assert_ne!(
                *id,
                told(first),
                "op-{}: lost, yet the same id",
                first.index
            );
            recreated.insert(first.index);
        } else {
            assert!(
                replayed,
                "op-{}: its record survived: a replay",
                first.index
            );
            assert_eq!(
                *id,
                told(first),
                "op-{}: the replay names its payment",
                first.index
            );
        }
    }
    assert_eq!(
        recreated, lost,
        "the lost operations, and only they, were re-created"
    );

    let audit = Audit::postgres(&database).await;
    audit.assert_exactly_once(&verify);
    audit.assert_all(ops);

    eprintln!(
        "failover: {old} killed, {new} promoted after {:.2} s; {} operations lost by the \
         failover and re-created once: {:?}",
        promotion.as_secs_f64(),
        lost.len(),
        lost.iter().take(20).collect::<Vec<_>>()
    );
    load::row(&load::row_of(
        "PostgreSQL failover (pg_auto_failover, primary killed) under load",
        &results,
        failed.len(),
        &audit,
        recovered,
        format!(
            "{old} (primary) killed with its keeper after {} payments; {new} promoted {:.2} s \
             after the kill, first payment answered after the promotion {}; longest time \
             without a payment {:.2} s; {attempts} attempts, {retried} operations retried by \
             the client, {} failed and retried again with their keys; acknowledged then lost \
             by the failover (record and payment together): {}, each re-created once when \
             sent again with its key; records = payments = ledger = {}; {notes}",
            ops / 3,
            promotion.as_secs_f64(),
            recovered.map_or_else(
                || "never".to_owned(),
                |d| format!("{:.2} s after the kill", d.as_secs_f64())
            ),
            stall.as_secs_f64(),
            failed.len(),
            lost.len(),
            audit.payments,
        ),
    ));
}
