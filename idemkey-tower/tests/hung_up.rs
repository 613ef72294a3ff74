//! A client that hangs up once its key is reserved, in external mode: the server drops the
//! layer's future (hyper does, on the client's end of stream) while the reservation's write
//! is committed but not yet answered. The reservation and its owner's exchange run to the
//! end all the same: the retry gets the one stored answer, never a wait for the lease. In
//! local mode the claim goes with the client (its transaction rolls back).
//!
//! The store is a real SQLite store behind a wrapper that holds the first claim, once made
//! (a reservation committed; in local mode, a claim in its open transaction), until the
//! test lets it answer, and says whether it answered or was dropped on the way. The clock
//! is the test's and never moves: a lease never lapses here.

mod support;
#[path = "support/watched.rs"]
mod watched;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{Request, StatusCode};
use idemkey_core::{KeyHasher, ListFilter, RecordState, Store, StoreAdmin};
use idemkey_sqlite::SqliteStore;
use idemkey_tower::{External, IdempotencyLayer, InFlightPolicy, REPLAYED_HEADER, Tx};
use support::ManualClock;
use tokio::sync::{Notify, Semaphore, mpsc};
use tower::ServiceExt;
use watched::{Call, Watch, Watched};

/// What became of the held reservation's call.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    /// It answered whoever called it.
    Answered,
    /// It was dropped before it could answer: whoever called it is gone.
    Dropped,
}

/// Holds the first reservation once committed, and the stored outcomes.
#[derive(Debug)]
struct Hold {
    armed: AtomicBool,
    /// Told once the held claim is made.
    committed: Notify,
    /// The held reservation answers once this has a permit.
    answer: Semaphore,
    fate: mpsc::UnboundedSender<Fate>,
    /// Told once an owner's outcome is stored.
    completed: Notify,
}

impl Hold {
    /// Holds the first reservation when `armed`; `Fate`s go to the receiver.
    fn new(armed: bool) -> (Arc<Self>, mpsc::UnboundedReceiver<Fate>) {
        let (fate, fates) = mpsc::unbounded_channel();
        let hold = Self {
            armed: AtomicBool::new(armed),
            committed: Notify::new(),
            answer: Semaphore::new(0),
            fate,
            completed: Notify::new(),
        };
        (Arc::new(hold), fates)
    }

    /// Holds the first claim's answer (a committed reservation, or a claim in its open
    /// transaction) until the test lets it go; later ones go at once.
    async fn held(&self) {
        if !self.armed.swap(false, Ordering::SeqCst) {
            return;
        }
        let mut fate = FateGuard(&self.fate, false);
        self.committed.notify_one();
        self.answer.acquire().await.expect("open").forget();
        fate.1 = true;
    }
}

/// Sends [`Fate::Dropped`] unless defused: dropped with the call it guards.
struct FateGuard<'a>(&'a mpsc::UnboundedSender<Fate>, bool);

impl Drop for FateGuard<'_> {
    fn drop(&mut self) {
        let fate = if self.1 {
            Fate::Answered
        } else {
            Fate::Dropped
        };
        let _ = self.0.send(fate);
    }
}

/// The store's first claim waits, made, for the test before it answers; stored outcomes
/// are told.
impl Watch for Arc<Hold> {
    async fn after(&self, call: Call) {
        match call {
            Call::InsertAutocommit | Call::BeginClaim => self.held().await,
            Call::CompleteAutocommit => self.completed.notify_one(),
            Call::Insert | Call::Fetch => {}
        }
    }
}

type HeldStore = Watched<SqliteStore, Arc<Hold>>;

/// The other service: counts its calls; with body `hold`, a call waits for a permit after
/// its effect.
#[derive(Clone)]
struct Bank {
    calls: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    proceed: Arc<Semaphore>,
}

impl Default for Bank {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            entered: Arc::default(),
            proceed: Arc::new(Semaphore::new(0)),
        }
    }
}

/// The same service in local mode: its effect would go in the claim's transaction.
async fn local_transfer(State(bank): State<Bank>, _tx: Tx<HeldStore>) -> Response {
    let n = bank.calls.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("{{\"transfer\":{n}}}")).into_response()
}

async fn transfer(State(bank): State<Bank>, op: External<HeldStore>, body: Bytes) -> Response {
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

struct Setup {
    _dir: tempfile::TempDir,
    clock: Arc<ManualClock>,
    sqlite: SqliteStore,
    hold: Arc<Hold>,
    fate: mpsc::UnboundedReceiver<Fate>,
    bank: Bank,
    app: Router,
}

/// External mode with a 10 s lease on a clock that never moves; the first reservation is
/// held when `armed`.
async fn setup(policy: InFlightPolicy, armed: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let sqlite = SqliteStore::connect(&url).await.unwrap();
    sqlite.migrate().await.unwrap();
    let (hold, fate) = Hold::new(armed);
    let bank = Bank::default();
    let clock = ManualClock::new();
    let app = instance(&sqlite, &hold, &bank, policy, clock.clone());
    Setup {
        _dir: dir,
        clock,
        sqlite,
        hold,
        fate,
        bank,
        app,
    }
}

/// One instance (a process): a layer of its own (turns and replay cache) over `sqlite`.
fn instance(
    sqlite: &SqliteStore,
    hold: &Arc<Hold>,
    bank: &Bank,
    policy: InFlightPolicy,
    clock: Arc<ManualClock>,
) -> Router {
    let store = Watched {
        inner: sqlite.clone(),
        watch: hold.clone(),
    };
    let layer = IdempotencyLayer::new(store, KeyHasher::new(b"a test secret of 32 bytes or more"))
        .external(Duration::from_secs(10))
        .in_flight(policy)
        .clock(clock);
    Router::new()
        .route("/transfers", post(transfer).layer(layer))
        .with_state(bank.clone())
}

fn request(body: &'static str) -> Request<Body> {
    Request::post("/transfers")
        .header("idempotency-key", "one-key")
        .body(Body::from(body))
        .unwrap()
}

async fn send(app: &Router, body: &'static str) -> (StatusCode, bool, String) {
    let response = app.clone().oneshot(request(body)).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key(REPLAYED_HEADER);
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        replayed,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

impl Setup {
    /// Sends a request and drops it once its claim is made (in external mode: the
    /// reservation committed), before the claim answers (the client hangs up; the server
    /// drops the layer's future); then lets the claim answer, and says whether anyone was
    /// still there to take it.
    async fn hang_up_once_claimed(&mut self, body: &'static str) -> Fate {
        let mut first = Box::pin(self.app.clone().oneshot(request(body)));
        tokio::select! {
            biased;
            () = self.hold.committed.notified() => {}
            answer = &mut first => panic!("answered before its claim: {answer:?}"),
        }
        drop(first);
        self.hold.answer.add_permits(1);
        self.fate.recv().await.expect("the reservation's fate")
    }

    async fn states(&self) -> Vec<RecordState> {
        let mut conn = self.sqlite.acquire().await.unwrap();
        let records = (self.sqlite.list(&mut conn, &ListFilter::default()).await).unwrap();
        records.into_iter().map(|r| r.state).collect()
    }
}

/// Under the default `wait`, the retry waits in memory for the departed attempt's owner,
/// and replays its stored answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_whose_client_hung_up_is_owned_to_the_end() {
    let mut s = setup(InFlightPolicy::default(), true).await;
    assert_eq!(
        s.hang_up_once_claimed("go").await,
        Fate::Answered,
        "the reservation was dropped with the client: its key is left reserved, owned by nobody"
    );
    let (status, replayed, text) = send(&s.app, "go").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true), "{text}");
    assert_eq!(text, r#"{"transfer":1}"#);
    assert_eq!(s.states().await, [RecordState::Completed]);
    // Nothing of it waits for the lease: past it, the same answer.
    s.clock.advance(Duration::from_secs(10));
    let (status, replayed, later) = send(&s.app, "go").await;
    assert_eq!((status, replayed, later), (StatusCode::CREATED, true, text));
    assert_eq!(s.bank.calls.load(Ordering::SeqCst), 1);
}

/// Under `reject`, a retry while the departed attempt's owner still works gets 409 at
/// once, and the stored answer once the owner is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_reject_the_retry_is_in_flight_then_replays() {
    let mut s = setup(InFlightPolicy::Reject, true).await;
    assert_eq!(
        s.hang_up_once_claimed("hold").await,
        Fate::Answered,
        "the reservation was dropped with the client: its key is left reserved, owned by nobody"
    );
    s.bank.entered.notified().await;
    let (status, replayed, text) = send(&s.app, "hold").await;
    assert_eq!((status, replayed), (StatusCode::CONFLICT, false), "{text}");
    assert!(text.contains("request-in-flight"), "{text}");
    let completed = s.hold.completed.notified();
    s.bank.proceed.add_permits(1);
    completed.await;
    let (status, replayed, text) = send(&s.app, "hold").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true), "{text}");
    assert_eq!(text, r#"{"transfer":1}"#);
    assert_eq!(s.bank.calls.load(Ordering::SeqCst), 1);
    assert_eq!(s.states().await, [RecordState::Completed]);
}

/// A client that leaves while its attempt waits for another process's owner: that wait
/// ends with it, so the next attempt of the key in this process is not held behind it.
/// The test's clock never moves, so a wait that went on would never end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_another_process_ends_when_its_client_leaves() {
    let s = setup(InFlightPolicy::default(), false).await;
    let owner = {
        let app = s.app.clone();
        tokio::spawn(async move { send(&app, "hold").await })
    };
    s.bank.entered.notified().await;
    // Another process: its own layer, hold and clock.
    let (hold, _fates) = Hold::new(false);
    let clock = ManualClock::new();
    let other = instance(
        &s.sqlite,
        &hold,
        &s.bank,
        InFlightPolicy::default(),
        clock.clone(),
    );
    let mut leaving = Box::pin(other.clone().oneshot(request("hold")));
    tokio::select! {
        biased;
        () = clock.sleeping(1) => {}
        answer = &mut leaving => panic!("answered while the owner works: {answer:?}"),
    }
    drop(leaving); // found the key in flight and polls it: the client leaves
    s.bank.proceed.add_permits(1);
    let (status, replayed, text) = owner.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{text}");
    let next = tokio::time::timeout(Duration::from_secs(30), send(&other, "hold"))
        .await
        .expect("the next attempt waited behind a client that had left");
    assert_eq!(
        (next.0, next.1, next.2.as_str()),
        (StatusCode::CREATED, true, r#"{"transfer":1}"#)
    );
    assert_eq!(s.bank.calls.load(Ordering::SeqCst), 1);
}

/// Local mode has nothing to strand: a claim is made in the transaction that the handler's
/// effect and the answer are written in, so a client that hangs up once its key is claimed
/// takes the claim with it (rolled back), and the retry runs afresh at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_local_mode_a_claim_whose_client_hung_up_is_rolled_back() {
    let mut s = setup(InFlightPolicy::default(), true).await;
    let layer = IdempotencyLayer::new(
        Watched {
            inner: s.sqlite.clone(),
            watch: s.hold.clone(),
        },
        KeyHasher::new(b"a test secret of 32 bytes or more"),
    )
    .clock(s.clock.clone());
    s.app = Router::new()
        .route("/transfers", post(local_transfer).layer(layer))
        .with_state(s.bank.clone());
    assert_eq!(s.hang_up_once_claimed("go").await, Fate::Dropped);
    let (status, replayed, text) = send(&s.app, "go").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{text}");
    assert_eq!(text, r#"{"transfer":1}"#);
    assert_eq!(s.bank.calls.load(Ordering::SeqCst), 1);
    assert_eq!(s.states().await, [RecordState::Completed]);
}
