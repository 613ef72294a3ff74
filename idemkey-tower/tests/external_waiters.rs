//! Duplicates of a request in flight in external mode wait for it in memory, as in local
//! mode: one store read for the owner, none for the duplicates of this process, however
//! many. Duplicates that reach another instance (another layer, with its own turns and
//! cache, as another process has) still find the outcome through the store.
//!
//! The store is a real SQLite store behind a wrapper that counts the calls that read a
//! record (claims and fetches): the bound is on reads, not on time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::{
    Begun, CommitError, EvictionNotices, Inserted, KeyHasher, NewRecord, Record, RecordId, Store,
    StoreError, StoredResponse, Timestamp,
};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{External, IdempotencyLayer, Metrics, REPLAYED_HEADER};
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

/// A store that counts the calls that read a record: the claim's inserts and fetches.
#[derive(Debug, Clone)]
struct Counting<S> {
    inner: S,
    reads: Arc<AtomicUsize>,
}

impl<S> Counting<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            reads: Arc::default(),
        }
    }

    fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }

    fn read(&self) {
        self.reads.fetch_add(1, Ordering::SeqCst);
    }
}

impl<S: Store> Store for Counting<S> {
    type Connection = S::Connection;
    type Transaction = S::Transaction;
    type PooledConnection = S::PooledConnection;

    async fn begin(&self) -> Result<Self::Transaction, StoreError> {
        self.inner.begin().await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }

    async fn limit_lock_wait(
        &self,
        conn: &mut Self::Connection,
        wait: Duration,
    ) -> Result<(), StoreError> {
        self.inner.limit_lock_wait(conn, wait).await
    }

    async fn acquire(&self) -> Result<Self::PooledConnection, StoreError> {
        self.inner.acquire().await
    }

    async fn acquire_for_write(&self) -> Result<Self::PooledConnection, StoreError> {
        self.inner.acquire_for_write().await
    }

    async fn insert_autocommit(&self, record: &NewRecord) -> Result<Inserted, StoreError> {
        self.read();
        self.inner.insert_autocommit(record).await
    }

    async fn complete_autocommit(
        &self,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner
            .complete_autocommit(id, token, response, now)
            .await
    }

    async fn insert(
        &self,
        conn: &mut Self::Connection,
        record: &NewRecord,
    ) -> Result<Inserted, StoreError> {
        self.read();
        self.inner.insert(conn, record).await
    }

    async fn begin_claim(
        &self,
        record: &NewRecord,
        lock_wait: Option<Duration>,
    ) -> Result<Begun<Self::Transaction>, StoreError> {
        self.read();
        self.inner.begin_claim(record, lock_wait).await
    }

    async fn complete_and_commit(
        &self,
        tx: Self::Transaction,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<(), CommitError> {
        self.inner
            .complete_and_commit(tx, id, token, response, now)
            .await
    }

    async fn fetch(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
    ) -> Result<Option<Record>, StoreError> {
        self.read();
        self.inner.fetch(conn, id).await
    }

    async fn replace(
        &self,
        conn: &mut Self::Connection,
        record: &NewRecord,
        token: i64,
    ) -> Result<Option<i64>, StoreError> {
        self.inner.replace(conn, record, token).await
    }

    async fn complete(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.complete(conn, id, token, response, now).await
    }

    async fn renew(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.renew(conn, id, token, lease_until, now).await
    }

    async fn mark_executing(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        lease_until: Timestamp,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner
            .mark_executing(conn, id, token, lease_until, now)
            .await
    }

    async fn mark_indeterminate(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.mark_indeterminate(conn, id, token, now).await
    }

    async fn release(
        &self,
        conn: &mut Self::Connection,
        id: &RecordId,
        token: i64,
    ) -> Result<bool, StoreError> {
        self.inner.release(conn, id, token).await
    }

    fn eviction_notices(&self) -> Option<EvictionNotices> {
        self.inner.eviction_notices()
    }
}

type CountingStore = Counting<SqliteStore>;

/// The other service: counts its calls; the first is held until the test lets it go.
#[derive(Clone)]
struct Bank {
    calls: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    proceed: Arc<Semaphore>,
}

async fn transfer(State(bank): State<Bank>, op: External<CountingStore>, body: Bytes) -> Response {
    if let Err(rejection) = op.point_of_no_return().await {
        return rejection.into_response();
    }
    let n = bank.calls.fetch_add(1, Ordering::SeqCst) + 1;
    if body.as_ref() == b"hold" {
        bank.entered.notify_one();
        bank.proceed.acquire().await.expect("open").forget();
    }
    (StatusCode::CREATED, format!("{{\"transfer\":{n}}}")).into_response()
}

/// One instance: a layer of its own (turns and replay cache) over the shared database.
fn instance(store: CountingStore, bank: &Bank, metrics: &Metrics) -> Router {
    let layer = IdempotencyLayer::new(store, KeyHasher::new(b"a test secret of 32 bytes or more"))
        .external(Duration::from_secs(10))
        .metrics(metrics.clone());
    Router::new()
        .route("/transfers", post(transfer).layer(layer))
        .with_state(bank.clone())
}

async fn send(app: &Router, body: &'static str) -> (StatusCode, bool, Bytes) {
    let request = Request::post("/transfers")
        .header("idempotency-key", "one-key")
        .body(Body::from(body))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key(REPLAYED_HEADER);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, replayed, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_in_flight_wait_in_memory_and_read_the_store_once() {
    const DUPLICATES: usize = 100;
    const ELSEWHERE: usize = 5;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let sqlite = SqliteStore::connect(&url).await.unwrap();
    sqlite.migrate().await.unwrap();
    let (here, there) = (Counting::new(sqlite.clone()), Counting::new(sqlite));
    let bank = Bank {
        calls: Arc::default(),
        entered: Arc::default(),
        proceed: Arc::new(Semaphore::new(0)),
    };
    let (metrics_here, metrics_there) = (Metrics::new(), Metrics::new());
    let app_here = instance(here.clone(), &bank, &metrics_here);
    let app_there = instance(there.clone(), &bank, &metrics_there);

    let owner = {
        let app = app_here.clone();
        tokio::spawn(async move { send(&app, "hold").await })
    };
    bank.entered.notified().await;
    let owner_reads = here.reads();
    let spawn = |app: &Router, n| {
        (0..n)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move { send(&app, "hold").await })
            })
            .collect::<Vec<_>>()
    };
    let duplicates = spawn(&app_here, DUPLICATES);
    let elsewhere = spawn(&app_there, ELSEWHERE);
    // Until every duplicate here waits in memory (or, were they polling the store, until
    // they have read it once each), and the other instance has found the reservation
    // (bounded: they give up after the 5 s in-flight wait, which fails the assertions).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    while !((metrics_here.waiting_in_process() == DUPLICATES as u64
        || here.reads() >= owner_reads + DUPLICATES)
        && there.reads() >= 1)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {DUPLICATES} duplicates waiting in memory, {} reads elsewhere",
            metrics_here.waiting_in_process(),
            there.reads()
        );
        tokio::task::yield_now().await;
    }

    bank.proceed.add_permits(1);
    let (status, replayed, first) = owner.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed);
    for duplicate in duplicates.into_iter().chain(elsewhere) {
        let (status, replayed, body) = duplicate.await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(replayed, "answered with the stored outcome");
        assert_eq!(body, first);
    }
    assert_eq!(
        here.reads(),
        owner_reads,
        "the duplicates of this instance never read the store"
    );
    assert_eq!(metrics_here.waiting_in_process(), 0);
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1, "one call went out");
}
