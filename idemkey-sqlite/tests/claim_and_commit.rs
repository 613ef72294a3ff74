//! `SqliteStore::begin_claim` (`BEGIN IMMEDIATE` and the claim's `INSERT` in one call to
//! SQLite) and `SqliteStore::complete_and_commit` (the guarded completion and `COMMIT` in
//! one call), on a real database file: sqlx still counts the transaction (a handler's
//! `begin()` on it is a savepoint, dropping it rolls back), a completion that matches no row
//! commits nothing, a busy writer answers `Busy`, and a claim or a completion cut short at
//! any point leaves nothing half done and the writer usable. Coordinated with barriers and
//! channels, never with sleeps.

mod common;

use std::future::Future;
use std::pin::pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    CommitError, Record, RecordId, RecordState, Store, StoreError, StoredResponse, Timestamp,
};
use idemkey_sqlite::SqliteStore;

use common::{claim, write_effect};
use idemkey_testkit::conformance::{begin_owned, claim_at, record_id};
use sqlx::Connection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions};
use tokio::sync::Barrier;

struct Db {
    store: SqliteStore,
    url: String,
    _dir: tempfile::TempDir,
}

/// A store from `SqliteStore::connect_with_busy_timeout` (its own writer connection).
async fn own(busy_timeout: Duration) -> Db {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite:{}", dir.path().join("claim.db").display());
    let store = SqliteStore::connect_with_busy_timeout(&url, busy_timeout)
        .await
        .expect("connect");
    prepare(store, url, dir).await
}

/// A store made with `SqliteStore::new` on a pool (each transaction's connection from it).
async fn pooled() -> Db {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite:{}", dir.path().join("claim.db").display());
    let options = SqliteConnectOptions::from_str(&url)
        .expect("url")
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool");
    prepare(SqliteStore::new(pool), url, dir).await
}

async fn prepare(store: SqliteStore, url: String, dir: tempfile::TempDir) -> Db {
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    Db {
        store,
        url,
        _dir: dir,
    }
}

impl Db {
    /// Turns SQLite's busy handler off on the connection the store's transactions run on
    /// (the store's own writer): from now on, a `BEGIN IMMEDIATE` on it that met a write
    /// lock left held would fail at once with `SQLITE_BUSY`.
    async fn without_busy_handler(&self) {
        let mut tx = self.store.begin().await.expect("begin");
        sqlx::query("PRAGMA busy_timeout = 0")
            .execute(&mut *tx)
            .await
            .expect("pragma");
        self.store.commit(tx).await.expect("commit");
    }

    async fn effects(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT label FROM effects ORDER BY label")
            .fetch_all(self.store.pool())
            .await
            .expect("effects")
    }

    async fn record(&self, id: &RecordId) -> Option<Record> {
        let mut conn = self.store.acquire().await.expect("acquire");
        self.store.fetch(&mut conn, id).await.expect("fetch")
    }

    /// Claims `claim` as the layer does; when it owns the key, writes an effect labelled
    /// `label` and stores `body` with the commit. Returns what the claim answered.
    async fn run(&self, claim: &Claim, label: &str) -> ClaimOutcome {
        let store = &self.store;
        let (tx, outcome) = protocol::begin_claim(store, claim, None)
            .await
            .expect("claim");
        match (&outcome, tx) {
            (ClaimOutcome::Owned { token, .. }, Some(mut tx)) => {
                write_effect(&mut tx, label).await;
                store
                    .complete_and_commit(tx, &claim.id, *token, &response(label), claim.now)
                    .await
                    .expect("complete and commit");
            }
            (_, Some(tx)) => store.commit(tx).await.expect("commit"),
            (_, None) => {}
        }
        outcome
    }
}

fn claim_in(tenant: &str, route: &str, key: &str) -> Claim {
    claim_at(&record_id(tenant, route, key), 1, Timestamp::now())
}

fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: body.as_bytes().to_vec(),
    }
}

/// Claims a fresh key with [`Store::begin_claim`]: the transaction and the owner's token.
/// sqlx counts the claim's transaction, so a handler's own `begin()` on it is a savepoint:
/// rolling the savepoint back keeps the claim and the rest of the effect. On both kinds of
/// store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_begun_on_the_claims_is_a_savepoint() {
    for db in [own(SqliteStore::DEFAULT_BUSY_TIMEOUT).await, pooled().await] {
        let store = &db.store;
        let claim = claim("k-savepoint");
        let (mut tx, token) = begin_owned(store, &claim).await;
        {
            let mut inner = (*tx).begin().await.expect("savepoint");
            write_effect(&mut inner, "inner").await;
            inner.rollback().await.expect("roll back to the savepoint");
        }
        {
            let mut inner = (*tx).begin().await.expect("savepoint");
            write_effect(&mut inner, "inner-kept").await;
            inner.commit().await.expect("release the savepoint");
        }
        {
            // Dropped: rolled back to the savepoint, as sqlx's own transactions are.
            let mut inner = (*tx).begin().await.expect("savepoint");
            write_effect(&mut inner, "inner-dropped").await;
        }
        write_effect(&mut tx, "outer").await;
        store
            .complete_and_commit(tx, &claim.id, token, &response("{}"), claim.now)
            .await
            .expect("complete and commit");
        assert_eq!(db.effects().await, ["inner-kept", "outer"]);
        let again = db.run(&claim, "again").await;
        assert!(matches!(again, ClaimOutcome::Replay { .. }), "{again:?}");
    }
}

/// Dropping the claim's transaction rolls back the claim and the effect, for a fresh key
/// and for a taken one (whose transaction the failed `INSERT` left open and sqlx was told
/// to count); the writer is free after each (with SQLite's busy handler off, a lock left
/// held would fail the next claim).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_claims_transaction_rolls_it_back() {
    let db = own(SqliteStore::DEFAULT_BUSY_TIMEOUT).await;
    db.without_busy_handler().await;
    let store = &db.store;

    let fresh = claim("k-dropped");
    let (mut tx, _) = begin_owned(store, &fresh).await;
    write_effect(&mut tx, "dropped").await;
    drop(tx);
    assert_eq!(db.record(&fresh.id).await, None);

    let taken = claim("k-taken");
    assert!(matches!(
        db.run(&taken, "taken").await,
        ClaimOutcome::Owned { .. }
    ));
    let (tx, outcome) = protocol::begin_claim(store, &taken, None)
        .await
        .expect("claim");
    assert!(
        matches!(outcome, ClaimOutcome::Replay { .. }),
        "{outcome:?}"
    );
    let mut tx = tx.expect("the claim's transaction");
    write_effect(&mut tx, "taken-dropped").await;
    drop(tx);

    let after = db.run(&claim("k-after"), "after").await;
    assert!(matches!(after, ClaimOutcome::Owned { .. }), "{after:?}");
    let again = db.run(&fresh, "dropped-again").await;
    assert!(matches!(again, ClaimOutcome::Owned { .. }), "{again:?}");
    assert_eq!(db.effects().await, ["after", "dropped-again", "taken"]);
}

/// A completion that matches no row carrying the token (another owner took the record)
/// commits nothing: `Fenced`, and the claim and the effect are rolled back; the guard's
/// table is left empty; the writer is free and the next completion commits. The first
/// completion on a connection (the one that creates the guard's table, rolled back with it
/// here) and a later one alike, on both kinds of store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_completion_commits_nothing() {
    let stores = [
        (own(SqliteStore::DEFAULT_BUSY_TIMEOUT).await, true),
        (pooled().await, false),
    ];
    for (db, own_writer) in stores {
        let store = &db.store;
        for round in 0..2 {
            let fenced = claim(&format!("k-fenced-{round}"));
            let (mut tx, token) = begin_owned(store, &fenced).await;
            write_effect(&mut tx, "fenced").await;
            let refused = store
                .complete_and_commit(tx, &fenced.id, token + 1, &response("{}"), fenced.now)
                .await;
            assert!(matches!(refused, Err(CommitError::Fenced)), "{refused:?}");
            assert_eq!(db.record(&fenced.id).await, None);

            // Another owner's completion: the row no longer carries the token.
            let stolen = claim(&format!("k-stolen-{round}"));
            let (mut tx, token) = begin_owned(store, &stolen).await;
            write_effect(&mut tx, "stolen").await;
            sqlx::query("UPDATE idemkey_records SET token = token + 5")
                .execute(&mut *tx)
                .await
                .expect("another owner");
            let refused = store
                .complete_and_commit(tx, &stolen.id, token, &response("{}"), stolen.now)
                .await;
            assert!(matches!(refused, Err(CommitError::Fenced)), "{refused:?}");
            assert_eq!(db.record(&stolen.id).await, None);

            let next = claim(&format!("k-next-{round}"));
            assert!(matches!(
                db.run(&next, &format!("next-{round}")).await,
                ClaimOutcome::Owned { .. }
            ));
            let record = db.record(&next.id).await.expect("completed");
            assert_eq!(record.state, RecordState::Completed);
        }
        assert_eq!(db.effects().await, ["next-0", "next-1"]);
        if !own_writer {
            // The pool's connections differ from one transaction to the next.
            continue;
        }
        let mut tx = store.begin().await.expect("begin");
        let guarded: i64 = sqlx::query_scalar("SELECT count(*) FROM temp.idemkey_fence")
            .fetch_one(&mut *tx)
            .await
            .expect("the guard's table, on the connection that completed");
        assert_eq!(guarded, 0, "the guard keeps no row");
        store.commit(tx).await.expect("commit");
    }
}

/// Another process holds SQLite's write lock past the busy time-out: the claim answers
/// `Busy` (503 store-busy, not "in flight"), with no transaction left; once the lock is
/// released the same writer claims. A claim that waits past the busy time-out in the
/// store's queue answers `Busy` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_writer_answers_busy() {
    let db = own(Duration::from_millis(50)).await;
    let store = &db.store;
    assert!(matches!(
        db.run(&claim("k-warm"), "warm").await,
        ClaimOutcome::Owned { .. }
    ));

    let mut holder = SqliteConnection::connect(&db.url)
        .await
        .expect("another connection");
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .expect("take the write lock");
    let busy = protocol::begin_claim(store, &claim("k-busy"), None).await;
    assert!(
        matches!(busy, Err(protocol::Error::Store(StoreError::Busy(_)))),
        "{busy:?}"
    );
    sqlx::query("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("release the lock");

    let (queued, _) = begin_owned(store, &claim("k-queued")).await;
    let waited = protocol::begin_claim(store, &claim("k-busy"), None).await;
    assert!(
        matches!(waited, Err(protocol::Error::Store(StoreError::Busy(_)))),
        "{waited:?}"
    );
    drop(queued);

    let after = db.run(&claim("k-busy"), "busy").await;
    assert!(matches!(after, ClaimOutcome::Owned { .. }), "{after:?}");
    assert_eq!(db.effects().await, ["busy", "warm"]);
}

/// Text that a C string cannot carry (a NUL) and text that needs quoting are claimed,
/// replayed and refused on a mismatch as given: the first goes step by step, the second
/// in the one call, written out as a literal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_with_a_nul_or_quotes_is_claimed_as_given() {
    let db = own(SqliteStore::DEFAULT_BUSY_TIMEOUT).await;
    for (tenant, route) in [("t\0nul", "/v1/a\0b"), ("t'1''", "/v1/it's")] {
        let first = claim_in(tenant, route, "k-text");
        assert!(matches!(
            db.run(&first, tenant).await,
            ClaimOutcome::Owned { .. }
        ));
        let again = db.run(&first, "again").await;
        assert!(
            matches!(&again, ClaimOutcome::Replay { response, .. } if response.body == tenant.as_bytes()),
            "{again:?}"
        );
        let mut other = first.clone();
        other.fingerprint.digest = [2; 32];
        other.fingerprint.parts.body = [2; 8];
        let mismatch = db.run(&other, "other").await;
        assert!(
            matches!(mismatch, ClaimOutcome::Mismatch { .. }),
            "{mismatch:?}"
        );
        let record = db.record(&first.id).await.expect("record");
        assert_eq!(record.id, first.id);
    }
    assert_eq!(db.effects().await.len(), 2);
}

/// Polls `future` `polls` times (yielding to the runtime in between, so that the
/// connection's worker thread can answer), then drops it if it has not finished.
async fn cut_short<F: Future>(future: F, polls: usize) -> Option<F::Output> {
    let mut future = pin!(future);
    for _ in 0..polls {
        if let Poll::Ready(output) = futures::poll!(future.as_mut()) {
            return Some(output);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// A claim, or a completion, whose future is dropped after any number of polls (the client
/// went away) leaves nothing half done: a key is either completed with its effect, or free
/// without one (a completion already handed to SQLite may still commit after its future is
/// dropped, as sqlx's `COMMIT` may); and the writer is usable after it (sqlx never counts a
/// transaction that SQLite does not have open, nor the reverse: a connection whose state is
/// not known is closed, and the next transaction opens another). On both kinds of store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_completions_cut_short_leave_nothing_half_done() {
    for db in [own(SqliteStore::DEFAULT_BUSY_TIMEOUT).await, pooled().await] {
        let store = &db.store;
        let mut keys = Vec::new();
        for polls in 0..24 {
            // The claim cut short.
            let key = format!("k-claim-{polls:02}");
            let claimed = cut_short(protocol::begin_claim(store, &claim(&key), None), polls).await;
            if let Some(claimed) = claimed {
                let (tx, outcome) = claimed.expect("claim");
                assert!(matches!(outcome, ClaimOutcome::Owned { .. }), "{outcome:?}");
                let mut tx = tx.expect("owned");
                write_effect(&mut tx, &key).await;
                drop(tx);
            }
            keys.push(key);

            // The completion cut short.
            let key = format!("k-complete-{polls:02}");
            let completing = claim(&key);
            let (mut tx, token) = begin_owned(store, &completing).await;
            write_effect(&mut tx, &key).await;
            let done = cut_short(
                store.complete_and_commit(
                    tx,
                    &completing.id,
                    token,
                    &response(&key),
                    completing.now,
                ),
                polls,
            )
            .await;
            if let Some(done) = done {
                done.expect("complete and commit");
            }
            keys.push(key);

            // The next transaction waits for whatever the last one left to end.
            let key = format!("k-next-{polls:02}");
            assert!(matches!(
                db.run(&claim(&key), &key).await,
                ClaimOutcome::Owned { .. }
            ));
            keys.push(key);
        }
        let effects = db.effects().await;
        let mut completed = 0;
        for key in &keys {
            let effect = effects.contains(key);
            match db.record(&claim(key).id).await {
                Some(record) => {
                    assert_eq!(record.state, RecordState::Completed, "{key}");
                    assert!(effect, "{key}: a record without its effect");
                    completed += 1;
                }
                None => assert!(!effect, "{key}: an effect without its record"),
            }
        }
        assert_eq!(effects.len(), completed);
        assert!(completed >= 24, "every k-next completed");
    }
}

/// 32 claimants of one fresh key, released at once: one owns it and commits its effect, the
/// others (whose `INSERT` the key refused, in the claim's one call) replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_of_32_claimants_owns_a_key_the_others_replay() {
    const CLAIMANTS: usize = 32;
    let db = Arc::new(own(SqliteStore::DEFAULT_BUSY_TIMEOUT).await);
    let barrier = Arc::new(Barrier::new(CLAIMANTS));
    let tasks: Vec<_> = (0..CLAIMANTS)
        .map(|i| {
            let (db, barrier) = (db.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                db.run(&claim("k-raced"), &format!("raced-{i}")).await
            })
        })
        .collect();
    let mut owners = 0;
    for task in tasks {
        match task.await.expect("task") {
            ClaimOutcome::Owned { .. } => owners += 1,
            ClaimOutcome::Replay { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(owners, 1);
    assert_eq!(db.effects().await.len(), 1);
}
