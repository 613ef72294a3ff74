//! The writer queue, raced on a real database file: the store's write transactions take
//! turns in memory, so they never need SQLite's busy handler, and a transaction that ends
//! without a commit (dropped, panicked, cancelled) is rolled back and lets the next one in.
//! Coordinated with barriers and `Notify`, never with sleeps.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idemkey_core::protocol::{self, ClaimOutcome};
use idemkey_core::{RecordId, Store, StoreError, StoredResponse};
use idemkey_sqlite::SqliteStore;

use common::{claim, write_effect};
use tokio::sync::{Barrier, Notify};

async fn store_with_busy_timeout(busy_timeout: Duration) -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite:{}", dir.path().join("writer.db").display());
    let store = SqliteStore::connect_with_busy_timeout(&url, busy_timeout)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    (dir, store)
}

/// Turns SQLite's busy handler off on the store's writer connection (the setting is the
/// connection's, not the transaction's): from now on, a `BEGIN IMMEDIATE` on it that met
/// another holder of the write lock would fail at once with `SQLITE_BUSY`.
async fn without_busy_handler(store: &SqliteStore) {
    let mut tx = store.begin().await.expect("begin");
    sqlx::query("PRAGMA busy_timeout = 0")
        .execute(&mut *tx)
        .await
        .expect("pragma");
    store.commit(tx).await.expect("commit");
}

async fn effects(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .expect("count")
}

async fn record(store: &SqliteStore, id: &RecordId) -> Option<idemkey_core::Record> {
    let mut conn = store.acquire().await.expect("acquire");
    store.fetch(&mut conn, id).await.expect("fetch")
}

/// Claims, writes an effect, completes and commits: a fresh keyed request in local mode.
async fn run_fresh(store: &SqliteStore, key: &str) -> Result<(), StoreError> {
    let claim = claim(key);
    let mut tx = store.begin().await?;
    let ClaimOutcome::Owned { token, .. } = protocol::claim(store, &mut tx, &claim)
        .await
        .expect("claim")
    else {
        panic!("{key} is fresh");
    };
    write_effect(&mut tx, key).await;
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: key.as_bytes().to_vec(),
    };
    protocol::complete(store, &mut tx, &claim.id, token, &response, claim.now)
        .await
        .expect("complete");
    store.commit(tx).await
}

/// 64 writers released at once, with SQLite's busy handler off: every one commits, because
/// they wait for their turn in the store's queue and never meet each other in SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_take_turns_without_sqlite_busy() {
    const WRITERS: usize = 64;
    let (_dir, store) = store_with_busy_timeout(SqliteStore::DEFAULT_BUSY_TIMEOUT).await;
    without_busy_handler(&store).await;
    let barrier = Arc::new(Barrier::new(WRITERS));
    let tasks: Vec<_> = (0..WRITERS)
        .map(|i| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                run_fresh(&store, &format!("key-{i}")).await
            })
        })
        .collect();
    for task in tasks {
        task.await
            .expect("task")
            .expect("no writer meets SQLITE_BUSY");
    }
    assert_eq!(effects(&store).await, WRITERS as i64);
    for i in 0..WRITERS {
        let id = claim(&format!("key-{i}")).id;
        let record = record(&store, &id).await.expect("record");
        assert_eq!(record.state, idemkey_core::RecordState::Completed);
    }
}

/// A transaction that ends without a commit (dropped, panicked in its task, cancelled while
/// waiting) is rolled back, claim and effect alike, and the next transaction gets the writer
/// (with SQLite's busy handler off, it would fail if the lock were still held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncommitted_transactions_roll_back_and_free_the_writer() {
    let (_dir, store) = store_with_busy_timeout(SqliteStore::DEFAULT_BUSY_TIMEOUT).await;
    without_busy_handler(&store).await;

    // Dropped.
    let dropped = claim("k-dropped");
    let mut tx = store.begin().await.expect("begin");
    protocol::claim(&store, &mut tx, &dropped)
        .await
        .expect("claim");
    write_effect(&mut tx, "k-dropped").await;
    drop(tx);

    // Panicked while holding it.
    let panicked = tokio::spawn({
        let store = store.clone();
        async move {
            let mut tx = store.begin().await.expect("begin");
            protocol::claim(&store, &mut tx, &claim("k-panicked"))
                .await
                .expect("claim");
            write_effect(&mut tx, "k-panicked").await;
            panic!("the handler panics with the transaction open");
        }
    });
    assert!(panicked.await.expect_err("it panicked").is_panic());

    // Cancelled (the client went away) while it held the writer.
    let holding = Arc::new(Notify::new());
    let cancelled = tokio::spawn({
        let (store, holding) = (store.clone(), holding.clone());
        async move {
            let mut tx = store.begin().await.expect("begin");
            protocol::claim(&store, &mut tx, &claim("k-cancelled"))
                .await
                .expect("claim");
            write_effect(&mut tx, "k-cancelled").await;
            holding.notify_one();
            std::future::pending::<()>().await;
            drop(tx);
        }
    });
    holding.notified().await;
    cancelled.abort();
    assert!(cancelled.await.expect_err("cancelled").is_cancelled());

    run_fresh(&store, "k-after")
        .await
        .expect("the writer is free");
    assert_eq!(effects(&store).await, 1, "only the committed effect stays");
    for key in ["k-dropped", "k-panicked", "k-cancelled"] {
        assert_eq!(
            record(&store, &claim(key).id).await,
            None,
            "{key} left no record"
        );
    }
    // The keys are free again: each runs afresh.
    for key in ["k-dropped", "k-panicked", "k-cancelled"] {
        run_fresh(&store, key).await.expect("fresh again");
    }
    assert_eq!(effects(&store).await, 4);
}

/// A transaction that cannot get the writer within the busy time-out answers `Busy`, as
/// SQLite's `SQLITE_BUSY` did; the holder is unaffected and the writer is free after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_past_the_busy_timeout_answers_busy() {
    let (_dir, store) = store_with_busy_timeout(Duration::from_millis(50)).await;
    let mut holder = store.begin().await.expect("begin");
    write_effect(&mut holder, "holder").await;
    let waited = store.begin().await;
    assert!(matches!(waited, Err(StoreError::Busy(_))), "{waited:?}");
    store.commit(holder).await.expect("commit");
    run_fresh(&store, "k-next")
        .await
        .expect("the writer is free");
    assert_eq!(effects(&store).await, 2);
}

/// Autocommit writes on pooled connections (the application's own, from `acquire`) are
/// outside the queue: they wait for a queued transaction in SQLite's busy handler, and both
/// commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autocommit_writes_still_wait_for_the_writer_in_sqlite() {
    let (_dir, store) = store_with_busy_timeout(SqliteStore::DEFAULT_BUSY_TIMEOUT).await;
    let started = Arc::new(Barrier::new(2));
    let mut tx = store.begin().await.expect("begin");
    write_effect(&mut tx, "queued").await;
    let autocommit = tokio::spawn({
        let (store, started) = (store.clone(), started.clone());
        async move {
            let mut conn = store.acquire().await.expect("acquire");
            started.wait().await;
            write_effect(&mut conn, "autocommit").await;
        }
    });
    started.wait().await;
    store.commit(tx).await.expect("commit");
    autocommit.await.expect("autocommit write");
    assert_eq!(effects(&store).await, 2);
}

/// External mode's autocommit writes (the reservation, the lease's completion) take the
/// writer in turn (`acquire_for_write`), like transactions: 32 reservations completed
/// through their leases, raced with 32 local-mode transactions, all go through with SQLite's
/// busy handler off on every connection of the store, pooled ones included. On pooled
/// connections they would meet each other in SQLite and fail with `SQLITE_BUSY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_writes_queue_with_transactions() {
    const EACH: usize = 32;
    let (_dir, store) = store_with_busy_timeout(SqliteStore::DEFAULT_BUSY_TIMEOUT).await;
    without_busy_handler(&store).await;
    // Every pooled connection at once (the pool's 8), each with its busy handler off.
    let mut pooled = Vec::new();
    for _ in 0..8 {
        let mut conn = store.acquire().await.expect("acquire");
        sqlx::query("PRAGMA busy_timeout = 0")
            .execute(&mut *conn)
            .await
            .expect("pragma");
        pooled.push(conn);
    }
    drop(pooled);

    let lease = Duration::from_secs(30);
    let barrier = Arc::new(Barrier::new(2 * EACH));
    let external = (0..EACH).map(|i| {
        let (store, barrier) = (store.clone(), barrier.clone());
        tokio::spawn(async move {
            let claim = claim(&format!("ext-{i}"));
            barrier.wait().await;
            let reserved = protocol::reserve(&store, &claim, lease).await;
            let Ok(ClaimOutcome::Owned { token, .. }) = reserved else {
                panic!("ext-{i} is fresh: {reserved:?}");
            };
            let owner = protocol::Lease::new(store.clone(), claim.id.clone(), token, lease);
            owner
                .point_of_no_return()
                .await
                .expect("point of no return");
            let response = StoredResponse {
                status: 201,
                headers: vec![],
                body: b"sent".to_vec(),
            };
            owner.complete(&response).await.expect("complete");
        })
    });
    let local = (0..EACH).map(|i| {
        let (store, barrier) = (store.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            run_fresh(&store, &format!("local-{i}"))
                .await
                .expect("no writer meets SQLITE_BUSY");
        })
    });
    let tasks: Vec<_> = external.chain(local).collect();
    for task in tasks {
        task.await.expect("every write goes through");
    }
    assert_eq!(effects(&store).await, EACH as i64);
    for i in 0..EACH {
        let record = record(&store, &claim(&format!("ext-{i}")).id)
            .await
            .expect("record");
        assert_eq!(record.state, idemkey_core::RecordState::Completed);
    }
}

/// A group of external-mode writes is one statement in one turn of the writer. When another
/// process holds SQLite's write lock past the busy time-out, that statement wrote nothing
/// and every writer of the group is answered busy by it (not made to wait again, one after
/// the other); once the lock is free, the same group inserts every row, and a second group
/// of the same keys finds them taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_reservations_answers_each_writer() {
    use idemkey_core::{Inserted, NewRecord, RecordState};
    use idemkey_sqlx::group::GroupWriter;
    use sqlx::Connection;

    let (dir, store) = store_with_busy_timeout(Duration::from_millis(50)).await;
    let new_record = |key: &str| {
        let claim = claim(key);
        NewRecord {
            id: claim.id,
            fingerprint: claim.fingerprint,
            state: RecordState::Executing,
            token: idemkey_core::fresh_token(),
            lease_expires_at: Some(claim.now.plus(Duration::from_secs(30))),
            now: claim.now,
            expires_at: claim.now.plus(claim.retention),
            sealed_key: None,
            first_sent: None,
        }
    };
    let group = || vec![new_record("g-1"), new_record("g-2"), new_record("g-3")];

    // Another process's writer, outside the store's queue.
    let url = format!("sqlite:{}", dir.path().join("writer.db").display());
    let mut other = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("connect");
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .expect("take the write lock");
    let answers = store.insert_group(group()).await;
    assert_eq!(answers.len(), 3);
    for answer in &answers {
        let Err(StoreError::Busy(source)) = answer else {
            panic!("busy: {answers:?}");
        };
        assert!(
            source.to_string().contains("a group of 3 writes"),
            "answered by the group's statement: {source}"
        );
    }
    sqlx::query("ROLLBACK")
        .execute(&mut other)
        .await
        .expect("free the write lock");
    for r in group() {
        assert!(record(&store, &r.id).await.is_none(), "nothing written");
    }

    let answers = store.insert_group(group()).await;
    assert!(
        answers.iter().all(|a| matches!(a, Ok(Inserted::Owned))),
        "{answers:?}"
    );
    let again = store.insert_group(group()).await;
    assert!(
        again.iter().all(|a| matches!(a, Ok(Inserted::Conflict))),
        "{again:?}"
    );
}
