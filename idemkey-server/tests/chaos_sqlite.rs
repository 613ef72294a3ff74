//! Chaos on SQLite: the database full, the database read-only, and another process holding
//! the write lock for longer than the wait bound. Each fault must give a clear answer
//! (problem+json 503 with a readable detail and `Retry-After`), leave nothing half-written
//! (no payment without its ledger row or its record, no record without its payment;
//! `PRAGMA integrity_check` passes), and the service must be back once the fault is gone:
//! the client's retries with the same keys then settle every operation exactly once.
//!
//! The lock scenario runs the `idemkey serve` binary; the other process is this test, which
//! holds `BEGIN IMMEDIATE` on the same file. A full or read-only database cannot be made
//! for a running server from outside: `PRAGMA max_page_count` and `query_only` hold per
//! connection, and as root (these tests may run as root) file permissions do not stop a
//! write, nor do they reach a file already open. So those run the same payments API
//! (`idemkey_server::app`) in this process, with the real client over loopback HTTP, once
//! on each SQLite store: `RusqliteStore` (what `serve` runs), whose writer connection is
//! given the fault, and `SqliteStore`, on a pool whose connections take it when they are
//! handed out (`max_page_count` clamped to the file's size: SQLITE_FULL; `query_only`:
//! SQLITE_READONLY).

mod common;

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use common::load::{self, Audit, OpResult};
use common::{Answer, Api, Backend, TOKEN1};
use idemkey_client::Operation;
use idemkey_core::Store;
use idemkey_server::{ApiKeys, AppConfig, AppDb, KeySecrets, app};
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use idemkey_tower::{InFlightPolicy, Metrics};
use sqlx::Connection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};

/// Asserts a clear store answer: 503, problem+json of a store type, `Retry-After`, and a
/// detail a person can read.
#[track_caller]
fn assert_clear_503(answer: &Answer, types: &[&str]) {
    assert_eq!(answer.status, 503, "{}", answer.text());
    let kind = answer.problem_type();
    assert!(
        types
            .iter()
            .any(|t| kind == format!("urn:idemkey:problem:{t}")),
        "{kind}: {}",
        answer.text()
    );
    assert!(answer.header("retry-after").is_some(), "{}", answer.text());
    let detail = answer.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(detail.len() > 10, "a readable detail: {}", answer.text());
}

/// `PRAGMA integrity_check` of the file at `url`.
async fn integrity(url: &str) -> String {
    let mut conn = SqliteConnection::connect(url).await.expect("open the file");
    let check: String = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_one(&mut conn)
        .await
        .expect("integrity_check");
    conn.close().await.ok();
    check
}

/// Another process holds SQLite's write lock (`BEGIN IMMEDIATE`) for longer than serve's
/// wait bound (`--wait-timeout 1s`): each write waits its bound and gets 503 `store-busy`
/// with `Retry-After`; reads and `/healthz` still answer; a payment the client keeps
/// retrying meanwhile succeeds once the lock is released, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lock_held_past_the_wait_bound_is_503_store_busy_then_served() {
    let backend = Backend::sqlite().await;
    let server = backend.start(&["--wait-timeout", "1s"]).await;
    let api = server.api();
    let client = load::client(load::patient_policy());
    let base = server.base().to_owned();
    let warm = load::pay(&client, &base, TOKEN1, 0, Operation::new()).await;
    assert!(warm.succeeded(), "{:?}", warm.outcome);

    let mut holder = SqliteConnection::connect(backend.url())
        .await
        .expect("another connection to the file");
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .expect("take the write lock");
    let held = Instant::now();

    // Refused clearly, after the wait bound, and nothing ran.
    let started = Instant::now();
    let busy = api
        .pay_ok(TOKEN1, "locked-out", &common::payment(700, "locked"))
        .await;
    let waited = started.elapsed();
    assert_clear_503(&busy, &["store-busy"]);
    assert!(
        waited >= Duration::from_millis(900),
        "waited its bound: {waited:?}"
    );
    assert_eq!(api.get("/healthz", None).await.status, 200, "reads go on");
    assert_eq!(api.total(TOKEN1).await, 1, "reads go on");

    // A payment the client retries while the lock is held: release once it was refused.
    let refusals = api
        .metric("idemkey_requests_total{outcome=\"store_error\"}")
        .await;
    let pending = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move { load::pay(&client, &base, TOKEN1, 1, Operation::new()).await })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while api
        .metric("idemkey_requests_total{outcome=\"store_error\"}")
        .await
        <= refusals
    {
        assert!(
            Instant::now() < deadline,
            "the retried payment was never refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("release the lock");
    let held_for = held.elapsed();
    let released = Instant::now();
    let paid = pending.await.expect("the payment task");
    let recovered = released.elapsed();
    let (status, replayed, attempts, _) = paid.outcome.clone().expect("served after the lock");
    assert_eq!(status, 201);
    assert!(!replayed);
    assert!(attempts >= 2, "refused at least once: {attempts}");
    let after = api
        .pay_ok(TOKEN1, "locked-out", &common::payment(700, "locked"))
        .await;
    assert_eq!(
        after.status,
        201,
        "the refused key is free: {}",
        after.text()
    );
    assert!(!after.replayed());

    let results = [warm, paid];
    let audit = Audit::sqlite(backend.url()).await;
    audit.assert_exactly_once(&results);
    audit.assert_all(3);
    assert_eq!(integrity(backend.url()).await, "ok");
    load::row(&load::Row {
        scenario: "SQLite write lock held past the wait bound",
        ops: 3,
        failed: 0,
        duplicates: audit.duplicates,
        records_without_effect: audit.records_without_effect,
        effects_without_record: audit.effects_without_record,
        recovery: Some(recovered),
        notes: format!(
            "lock held {:.2} s by another connection; a write waited {:.2} s, then 503 \
             store-busy; reads and /healthz answered; the client's payment took {attempts} \
             attempts and succeeded {:.2} s after the release",
            held_for.as_secs_f64(),
            waited.as_secs_f64(),
            recovered.as_secs_f64()
        ),
    });
}

/// No fault.
const NONE: u8 = 0;
/// Every connection handed out may not grow the file (SQLITE_FULL once a page is needed).
const FULL: u8 = 1;
/// Every connection handed out is read-only (SQLITE_READONLY on the first write).
const READ_ONLY: u8 = 2;

/// The pragmas that put `fault` on a connection (or take any fault off it).
fn pragmas(fault: u8) -> [&'static str; 2] {
    [
        // Below the file's size, max_page_count is clamped to it: no page may be added.
        if fault == FULL {
            "PRAGMA max_page_count = 1"
        } else {
            "PRAGMA max_page_count = 1073741823"
        },
        if fault == READ_ONLY {
            "PRAGMA query_only = 1"
        } else {
            "PRAGMA query_only = 0"
        },
    ]
}

/// Puts the current fault on a connection about to be used.
async fn apply(conn: &mut SqliteConnection, fault: u8) -> Result<(), sqlx::Error> {
    for pragma in pragmas(fault) {
        sqlx::query(pragma).execute(&mut *conn).await?;
    }
    Ok(())
}

/// Which SQLite store the payments API runs on.
#[derive(Clone, Copy)]
enum On {
    /// `SqliteStore` on a pool whose connections take the fault when handed out.
    Sqlx,
    /// `RusqliteStore` (what `serve` runs), whose writer connection is given the fault.
    Rusqlite,
}

/// Turns a fault on and off for a [`faulty_server`].
enum Faults {
    Pool(Arc<AtomicU8>),
    Writer(RusqliteStore),
}

impl Faults {
    async fn set(&self, fault: u8) {
        match self {
            Faults::Pool(current) => current.store(fault, Ordering::SeqCst),
            Faults::Writer(store) => {
                // The writer is the connection every write transaction runs on; the
                // pragmas hold on it until it is closed.
                let writer = store.acquire_for_write().await.expect("the writer");
                for pragma in pragmas(fault) {
                    writer.execute_batch(pragma).expect(pragma);
                }
            }
        }
    }
}

/// The payments API on a SQLite file whose writes take the fault of `Faults`, served on
/// loopback; returns its base URL, the file's URL and the switch.
async fn faulty_server(dir: &std::path::Path, on: On) -> (String, String, Faults) {
    let url = format!("sqlite:{}", dir.join("faulty.db").display());
    let config = AppConfig {
        api_keys: ApiKeys::new([("t1".to_owned(), TOKEN1.to_owned())]).unwrap(),
        simulate_latency: Duration::ZERO,
        retention: Duration::from_secs(24 * 3600),
        in_flight: InFlightPolicy::default(),
        first_sent: Default::default(),
        clock: Arc::new(idemkey_tower::SystemClock),
        outbox: None,
    };
    let secrets = KeySecrets::new(&b"chaos sqlite secret"[..], None);
    let (router, faults) = match on {
        On::Sqlx => {
            let fault = Arc::new(AtomicU8::new(NONE));
            let store = faulty_pool(&url, fault.clone()).await;
            store.migrate_all().await.expect("migrations");
            let router = app(store, &secrets, Metrics::new(), &config);
            (router, Faults::Pool(fault))
        }
        On::Rusqlite => {
            let store = RusqliteStore::open(dir.join("faulty.db")).expect("open the file");
            store.migrate_all().await.expect("migrations");
            let router = app(store.clone(), &secrets, Metrics::new(), &config);
            (router, Faults::Writer(store))
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    (base, url, faults)
}

/// A `SqliteStore` on a pool whose connections take `fault` when handed out.
async fn faulty_pool(url: &str, fault: Arc<AtomicU8>) -> SqliteStore {
    let options = SqliteConnectOptions::from_str(url)
        .expect("a SQLite URL")
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(5));
    let (on_connect, on_acquire) = (fault.clone(), fault);
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .after_connect(move |conn, _| {
            let fault = on_connect.load(Ordering::SeqCst);
            Box::pin(async move { apply(conn, fault).await })
        })
        .before_acquire(move |conn, _| {
            let fault = on_acquire.load(Ordering::SeqCst);
            Box::pin(async move { apply(conn, fault).await.map(|()| true) })
        })
        .connect_with(options)
        .await
        .expect("open the SQLite file");
    SqliteStore::new(pool)
}

/// Runs a SQLite fault: some payments before it, then payments sent once each (no retry)
/// while it lasts, until `refused` of them were refused (bounded); then the fault goes and
/// the client retries every operation with its own key. Returns the figures.
async fn sqlite_fault(name: &str, fault_kind: u8, on: On) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let (base, url, fault) = faulty_server(dir.path(), on).await;
    let api = Api::new(&base);
    let client = load::client(load::patient_policy());
    let bases = [base.clone()];
    let before = load::payments(
        &client,
        &bases,
        TOKEN1,
        0..20,
        4,
        &load::Progress::default(),
    )
    .await;
    assert!(before.iter().all(OpResult::succeeded));

    fault.set(fault_kind).await;
    let started = Instant::now();
    let wanted = (load::scaled(100) / 20).max(5);
    let mut refused = Vec::new();
    let mut during = Vec::new();
    let mut index = 20;
    while refused.len() < wanted {
        assert!(
            index < 2020,
            "{name}: fewer than {wanted} refusals in 2000 payments"
        );
        let op = Operation::new();
        let answer = api
            .pay_ok(TOKEN1, op.key(), &load::body(index).to_string())
            .await;
        match answer.status {
            201 => {}
            _ => {
                assert_clear_503(&answer, &["store-unavailable", "store-busy"]);
                refused.push(
                    answer.json()["detail"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                );
            }
        }
        during.push((index, op, answer));
        index += 1;
    }
    assert_eq!(
        api.get("/healthz", None).await.status,
        200,
        "{name}: the database still answers reads"
    );
    let lasted = started.elapsed();
    // Nothing half-written while the fault lasts.
    let mid = Audit::sqlite(&url).await;
    assert_eq!(mid.duplicates, 0);
    assert_eq!(mid.records_without_effect, 0, "{name}: {mid:?}");
    assert_eq!(mid.effects_without_record, 0, "{name}: {mid:?}");
    let created_during = during.iter().filter(|(_, _, a)| a.status == 201).count();
    assert_eq!(
        mid.payments,
        20 + created_during,
        "{name}: refused writes left nothing"
    );

    fault.set(NONE).await;
    let healed = Instant::now();
    let mut results = before;
    for (index, op, _) in during {
        results.push(load::pay(&client, &base, TOKEN1, index, op).await);
    }
    let recovered = healed.elapsed();
    assert!(
        results.iter().all(OpResult::succeeded),
        "{name}: service back after the fault"
    );
    let audit = Audit::sqlite(&url).await;
    audit.assert_exactly_once(&results);
    audit.assert_all(results.len());
    assert_eq!(integrity(&url).await, "ok");
    load::row(&load::Row {
        scenario: name,
        ops: results.len(),
        failed: refused.len(),
        duplicates: audit.duplicates,
        records_without_effect: audit.records_without_effect,
        effects_without_record: audit.effects_without_record,
        recovery: Some(recovered),
        notes: format!(
            "{} payments while the fault lasted ({:.2} s): {} created, {} refused with 503 \
             ({:?}); afterwards every operation retried with its key: records = payments = \
             ledger = {}; integrity_check ok",
            index - 20,
            lasted.as_secs_f64(),
            created_during,
            refused.len(),
            refused.first().map(String::as_str).unwrap_or_default(),
            audit.payments
        ),
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_database_refuses_clearly_and_leaves_nothing_half_written() {
    sqlite_fault("SQLite database full (max_page_count)", FULL, On::Sqlx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_refuses_clearly_and_leaves_nothing_half_written() {
    sqlite_fault(
        "SQLite database read-only (query_only)",
        READ_ONLY,
        On::Sqlx,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_database_refuses_clearly_and_leaves_nothing_half_written_on_rusqlite() {
    sqlite_fault(
        "RusqliteStore database full (max_page_count)",
        FULL,
        On::Rusqlite,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_refuses_clearly_and_leaves_nothing_half_written_on_rusqlite() {
    sqlite_fault(
        "RusqliteStore database read-only (query_only)",
        READ_ONLY,
        On::Rusqlite,
    )
    .await;
}

/// The database fills up at the payment's own insert, after the claim found room: the
/// handler's write fails, and the answer is a 503 that says the database is full (it was a
/// 500 `internal-error` before), with nothing written; once there is room the retry with the
/// same key executes once.
///
/// Made deterministic with free pages and a trigger: a deleted 1 MiB row leaves free pages
/// for the claim's small insert, and a trigger on `payments` inserts 8 MiB, more than there
/// is room for once no page may be added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_full_at_the_payments_own_insert_is_a_503_that_says_so() {
    full_at_the_payments_own_insert(On::Sqlx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_full_at_the_payments_own_insert_is_a_503_that_says_so_on_rusqlite() {
    full_at_the_payments_own_insert(On::Rusqlite).await;
}

async fn full_at_the_payments_own_insert(on: On) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let (base, url, fault) = faulty_server(dir.path(), on).await;
    let api = Api::new(&base);
    let mut other = SqliteConnection::connect(&url)
        .await
        .expect("open the file");
    for statement in [
        "CREATE TABLE filler (b BLOB)",
        "INSERT INTO filler VALUES (zeroblob(1048576))",
        "DELETE FROM filler",
        "CREATE TRIGGER fill AFTER INSERT ON payments BEGIN \
         INSERT INTO filler VALUES (zeroblob(8388608)); END",
    ] {
        sqlx::query(statement)
            .execute(&mut other)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    fault.set(FULL).await;
    let body = load::body(0).to_string();
    let full = api.pay_ok(TOKEN1, "full-at-payment", &body).await;
    assert_clear_503(&full, &["store-unavailable"]);
    assert!(
        full.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("the database is full")),
        "{}",
        full.text()
    );
    let mid = Audit::sqlite(&url).await;
    assert_eq!(
        (mid.records(), mid.payments, mid.ledger),
        (0, 0, 0),
        "nothing written"
    );

    sqlx::query("DROP TRIGGER fill")
        .execute(&mut other)
        .await
        .expect("drop the trigger");
    fault.set(NONE).await;
    let paid = api.pay_ok(TOKEN1, "full-at-payment", &body).await;
    assert_eq!(paid.status, 201, "{}", paid.text());
    assert!(!paid.replayed(), "the refused attempt left the key free");
    let audit = Audit::sqlite(&url).await;
    audit.assert_all(1);
    assert_eq!(integrity(&url).await, "ok");
}
