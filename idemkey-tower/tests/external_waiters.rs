//! Duplicates of a request in flight in external mode wait for it in memory, as in local
//! mode: one store read for the owner, none for the duplicates of this process, however
//! many. Duplicates that reach another instance (another layer, with its own turns and
//! cache, as another process has) still find the outcome through the store.
//!
//! The store is a real SQLite store behind a wrapper that counts the calls that read a
//! record (claims and fetches): the bound is on reads, not on time.

#[path = "support/watched.rs"]
mod watched;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::KeyHasher;
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{External, IdempotencyLayer, Metrics, REPLAYED_HEADER};
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;
use watched::{Call, Watch, Watched};

/// Counts the store's calls that read a record: the claim's inserts and fetches.
#[derive(Debug, Clone, Default)]
struct Reads(Arc<AtomicUsize>);

impl Reads {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Watch for Reads {
    fn before(&self, call: Call) {
        if call != Call::CompleteAutocommit {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

type CountingStore = Watched<SqliteStore, Reads>;

/// `store`, its reads counted.
fn counting(store: SqliteStore) -> CountingStore {
    Watched {
        inner: store,
        watch: Reads::default(),
    }
}

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
    let (here, there) = (counting(sqlite.clone()), counting(sqlite));
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
    let owner_reads = here.watch.count();
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
        || here.watch.count() >= owner_reads + DUPLICATES)
        && there.watch.count() >= 1)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {DUPLICATES} duplicates waiting in memory, {} reads elsewhere",
            metrics_here.waiting_in_process(),
            there.watch.count()
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
        here.watch.count(),
        owner_reads,
        "the duplicates of this instance never read the store"
    );
    assert_eq!(metrics_here.waiting_in_process(), 0);
    assert_eq!(bank.calls.load(Ordering::SeqCst), 1, "one call went out");
}
