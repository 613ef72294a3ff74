//! The outbox on every store: messages commit with the effect, the relay delivers each at
//! least once with a stable id and bytes, backs off, gives up into `dead`, keeps a group's
//! order; several relays on one PostgreSQL or MariaDB never deliver one message twice at once; a lossy
//! webhook receiver behind idemkey's own layer records each message exactly once.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idemkey_core::outbox::{Message, MessageFilter, MessageState, OutboxAuditEntry, OutboxStore};
use idemkey_core::{Clock, KeyHasher, Sleep, Timestamp};
use idemkey_mysql::MySqlStore;
use idemkey_outbox::{
    Backoff, DeliveryError, Outgoing, Relay, RelayConfig, Sink, WebhookSink, enqueue, enqueue_on,
    envelope,
};
use idemkey_postgres::PgStore;
use idemkey_sqlite::{RusqliteStore, SqliteStore};
use idemkey_tower::{IdempotencyLayer, Tx};
use tower::ServiceExt;

use support::{Fresh, all_messages, enqueue_many};

/// A clock the test moves by hand.
#[derive(Debug, Default)]
struct ManualClock(AtomicI64);

impl ManualClock {
    fn at(ms: i64) -> Arc<Self> {
        Arc::new(Self(AtomicI64::new(ms)))
    }
    fn advance(&self, d: Duration) {
        self.0.fetch_add(d.as_millis() as i64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }

    /// A wait moves the time forward and takes none.
    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        self.advance(duration);
        Box::pin(std::future::ready(()))
    }
}

fn fast(name: &str) -> RelayConfig {
    RelayConfig {
        name: name.to_owned(),
        batch: 32,
        backoff: Backoff {
            first: Duration::from_millis(5),
            max: Duration::from_millis(40),
        },
        poll: Duration::from_millis(10),
        max_attempts: 1000,
        ..RelayConfig::default()
    }
}

/// A sink that records every delivery and fails the ones its rule says.
#[derive(Default)]
struct Recorder {
    deliveries: Mutex<Deliveries>,
    in_flight: Mutex<HashSet<String>>,
    concurrent_doubles: AtomicI64,
    fail: Mutex<HashMap<String, u32>>,
}

impl Recorder {
    fn fail_next(&self, id: &str, times: u32) {
        self.fail.lock().unwrap().insert(id.to_owned(), times);
    }
    fn ids(&self) -> Vec<String> {
        self.deliveries
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| id.clone())
            .collect()
    }
}

impl Sink for Recorder {
    async fn deliver(&self, message: &Message) -> Result<(), DeliveryError> {
        if !self.in_flight.lock().unwrap().insert(message.id.clone()) {
            self.concurrent_doubles.fetch_add(1, Ordering::SeqCst);
        }
        // Let other relays run while this delivery is "on the wire".
        tokio::task::yield_now().await;
        self.deliveries
            .lock()
            .unwrap()
            .push((message.id.clone(), envelope(message)));
        self.in_flight.lock().unwrap().remove(&message.id);
        let mut fail = self.fail.lock().unwrap();
        match fail.get_mut(&message.id) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Err(DeliveryError("refused by the test".into()))
            }
            _ => Ok(()),
        }
    }
}

/// Messages written by a handler behind the layer commit with its effect: a replay writes
/// none, a rolled-back attempt leaves none, and a request's messages share its record's
/// operation id.
async fn messages_commit_with_the_effect_or_not_at_all<S: Fresh>() {
    let (store, _guard) = S::fresh().await;
    async fn handler<S: OutboxStore>(mut tx: Tx<S>, body: Bytes) -> Response {
        let fail = body.as_ref() == b"fail";
        for kind in ["first", "second"] {
            enqueue(
                &mut tx,
                Outgoing::new(kind, &serde_json::json!({})).unwrap(),
            )
            .await
            .unwrap();
        }
        if fail {
            (StatusCode::INTERNAL_SERVER_ERROR, "failed").into_response()
        } else {
            (StatusCode::CREATED, "made").into_response()
        }
    }
    let app = Router::new()
        .route("/things", post(handler::<S>))
        .layer(IdempotencyLayer::new(
            store.clone(),
            KeyHasher::new(b"outbox-test"),
        ));
    let call = |key: &'static str, body: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/things")
                .header("Idempotency-Key", key)
                .body(axum::body::Body::from(body))
                .unwrap();
            app.oneshot(request).await.unwrap().status()
        }
    };
    assert_eq!(call("k-1", "ok").await, StatusCode::CREATED);
    assert_eq!(call("k-1", "ok").await, StatusCode::CREATED, "the replay");
    assert_eq!(call("k-2", "fail").await, StatusCode::INTERNAL_SERVER_ERROR);
    let messages = all_messages(&store).await;
    assert_eq!(messages.len(), 2, "{messages:?}");
    assert_eq!(messages[0].group, messages[1].group);
    assert_eq!(messages[0].group.len(), 64, "the record's digest, in hex");
    let mut kinds: Vec<_> = messages.iter().map(|m| m.kind.as_str()).collect();
    kinds.sort();
    assert_eq!(kinds, ["first", "second"]);
    assert!(messages.iter().all(|m| m.state == MessageState::Pending));
}

/// Failed deliveries back off (no claim before the wait), die after the last attempt, and
/// an operator's requeue makes a dead message deliverable again.
async fn failures_back_off_then_die<S: Fresh>() {
    let (store, _guard) = S::fresh().await;
    let ids = enqueue_many(&store, "thing.happened", 1).await;
    let clock = ManualClock::at(Timestamp::now().as_millis());
    let sink = Arc::new(Recorder::default());
    sink.fail_next(&ids[0], u32::MAX);
    let relay = Relay::new(store.clone(), sink.clone())
        .config(RelayConfig {
            max_attempts: 3,
            backoff: Backoff {
                first: Duration::from_secs(10),
                max: Duration::from_secs(60),
            },
            ..fast("r1")
        })
        .clock(clock.clone());
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.claimed, round.failed), (1, 1));
    assert_eq!(relay.run_once().await.unwrap().claimed, 0, "backing off");
    clock.advance(Duration::from_secs(10));
    assert_eq!(relay.run_once().await.unwrap().failed, 1, "second attempt");
    clock.advance(Duration::from_secs(20));
    let round = relay.run_once().await.unwrap();
    assert_eq!(round.dead, 1, "third and last attempt");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(
        relay.run_once().await.unwrap().claimed,
        0,
        "dead stays dead"
    );
    let mut conn = store.acquire().await.unwrap();
    let dead = store.message(&mut conn, &ids[0]).await.unwrap().unwrap();
    assert_eq!((dead.state, dead.attempts), (MessageState::Dead, 3));
    assert_eq!(dead.last_error.as_deref(), Some("refused by the test"));
    assert!(
        store
            .requeue(&mut conn, &ids[0], clock.now())
            .await
            .unwrap()
    );
    drop(conn);
    sink.fail_next(&ids[0], 0);
    assert_eq!(relay.run_once().await.unwrap().sent, 1);
    assert_eq!(sink.ids().len(), 4);
    let mut conn = store.acquire().await.unwrap();
    assert!(
        !store.remove_dead(&mut conn, &ids[0]).await.unwrap(),
        "sent, not dead"
    );
}

/// A group's second message is not delivered before its first is sent.
async fn a_group_is_delivered_in_order<S: Fresh>() {
    let (store, _guard) = S::fresh().await;
    let mut tx = store.begin().await.unwrap();
    let mut ids = Vec::new();
    for n in 0..3 {
        let message = Outgoing::new("step", &serde_json::json!({ "n": n })).unwrap();
        ids.push(
            enqueue_on::<S>(&mut tx, "one-operation", message)
                .await
                .unwrap(),
        );
    }
    store.commit(tx).await.unwrap();
    let clock = ManualClock::at(Timestamp::now().as_millis());
    let sink = Arc::new(Recorder::default());
    sink.fail_next(&ids[0], 1);
    let relay = Relay::new(store.clone(), sink.clone())
        .config(fast("r1"))
        .clock(clock.clone());
    assert_eq!(relay.run_once().await.unwrap().claimed, 1);
    assert_eq!(
        relay.run_once().await.unwrap().claimed,
        0,
        "the first is backing off"
    );
    for _ in 0..3 {
        clock.advance(Duration::from_secs(1));
        assert_eq!(relay.run_once().await.unwrap().sent, 1);
    }
    assert_eq!(sink.ids(), [&*ids[0], &ids[0], &ids[1], &ids[2]]);
}

/// What an operator sees and does: counts of pending and dead messages, messages by state,
/// the purge of sent ones (only those sent before its time, at most a batch), the audit
/// trail, and the removal of a dead message (only a dead one).
async fn stats_purge_and_audit<S: Fresh>() {
    let (store, _guard) = S::fresh().await;
    let ids = enqueue_many(&store, "thing.happened", 4).await;
    let mut conn = store.acquire().await.unwrap();
    let stats = store.outbox_stats(&mut conn).await.unwrap();
    let oldest = all_messages(&store).await.last().unwrap().created_at;
    assert_eq!((stats.pending, stats.dead), (4, 0));
    assert_eq!(stats.oldest_pending, Some(oldest));
    let now = Timestamp::now();
    let claimed = store
        .claim_due(&mut conn, "r1", now, now.plus(Duration::from_secs(60)), 10)
        .await
        .unwrap();
    let claimed: Vec<_> = claimed.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(claimed, ids.iter().map(String::as_str).collect::<Vec<_>>());
    for id in &ids[..2] {
        assert!(store.mark_sent(&mut conn, id, "r1", now).await.unwrap());
    }
    assert!(
        store
            .mark_failed(&mut conn, &ids[2], "r1", None, "gone")
            .await
            .unwrap()
    );
    let later = now.plus(Duration::from_secs(5));
    assert!(
        store
            .mark_failed(&mut conn, &ids[3], "r1", Some(later), "busy")
            .await
            .unwrap()
    );
    let again = store.message(&mut conn, &ids[3]).await.unwrap().unwrap();
    assert_eq!(again.state, MessageState::Pending);
    assert_eq!((again.next_attempt_at, again.claimed_by), (later, None));
    let stats = store.outbox_stats(&mut conn).await.unwrap();
    assert_eq!((stats.pending, stats.dead), (1, 1));
    let in_state = |state| MessageFilter {
        state: Some(state),
        limit: 0,
    };
    let sent = store
        .messages(&mut conn, &in_state(MessageState::Sent))
        .await
        .unwrap();
    let sent: Vec<_> = sent.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(sent, [&*ids[1], &ids[0]], "newest first");
    let dead = store
        .messages(&mut conn, &in_state(MessageState::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].last_error.as_deref(), Some("gone"));

    assert_eq!(store.purge_sent(&mut conn, now, 10).await.unwrap(), 0);
    let after = now.plus(Duration::from_millis(1));
    assert_eq!(store.purge_sent(&mut conn, after, 1).await.unwrap(), 1);
    assert_eq!(store.purge_sent(&mut conn, after, 10).await.unwrap(), 1);
    assert!(store.message(&mut conn, &ids[0]).await.unwrap().is_none());

    let entry = OutboxAuditEntry {
        message_id: ids[2].clone(),
        at: now,
        actor: "operator:ann".into(),
        action: "dropped".into(),
        detail: "a note".into(),
    };
    store.append_outbox_audit(&mut conn, &entry).await.unwrap();
    assert_eq!(
        store.outbox_audit(&mut conn, &ids[2]).await.unwrap(),
        [entry]
    );
    assert!(
        !store.remove_dead(&mut conn, &ids[3]).await.unwrap(),
        "pending"
    );
    assert!(store.remove_dead(&mut conn, &ids[2]).await.unwrap());
    assert!(store.message(&mut conn, &ids[2]).await.unwrap().is_none());
}

/// `relays` relays deliver `n` messages: each at least once, none twice at the same time.
async fn relays_share_the_work<S: Fresh>(relays: usize, n: usize) {
    let (store, _guard) = S::fresh().await;
    let ids = enqueue_many(&store, "thing.happened", n).await;
    let sink = Arc::new(Recorder::default());
    let tasks: Vec<_> = (0..relays)
        .map(|r| {
            Relay::new(store.clone(), sink.clone())
                .config(fast(&format!("relay-{r}")))
                .spawn()
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let sent = all_messages(&store)
            .await
            .iter()
            .filter(|m| m.state == MessageState::Sent)
            .count();
        if sent == n {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {sent} of {n} sent"
        );
        let mut rounds = tasks[0].rounds();
        let _ = tokio::time::timeout(Duration::from_millis(200), rounds.changed()).await;
    }
    let mut totals = Vec::new();
    for task in tasks {
        totals.push(*task.rounds().borrow());
        task.shutdown().await;
    }
    let delivered: HashSet<String> = sink.ids().into_iter().collect();
    assert_eq!(
        delivered,
        ids.iter().cloned().collect::<HashSet<_>>(),
        "every message"
    );
    let doubles = sink.concurrent_doubles.load(Ordering::SeqCst);
    let deliveries = sink.ids().len();
    println!(
        "{relays} relays, {n} messages: {deliveries} deliveries, {doubles} concurrent doubles, rounds {totals:?}"
    );
    assert_eq!(doubles, 0, "a message delivered by two relays at once");
    assert_eq!(deliveries, n, "no failure, so no redelivery");
    if relays > 1 {
        assert!(
            totals.iter().filter(|t| t.sent > 0).count() > 1,
            "the relays shared the work: {totals:?}"
        );
    }
}

/// Deliveries as they arrived: the `Idempotency-Key` and the body.
type Deliveries = Vec<(String, Vec<u8>)>;

/// What the receiving service saw.
#[derive(Clone, Default)]
struct Received {
    raw: Arc<Mutex<Deliveries>>,
}

/// A receiver built on idemkey's own layer (its own SQLite database), behind a proxy that
/// loses 30 % of its answers: the relay redelivers with the same id and bytes, and the
/// receiver records each message exactly once.
async fn lossy_receiver_records_each_message_once<S: Fresh>() {
    const N: usize = 150;
    let (store, _guard) = S::fresh().await;
    let ids = enqueue_many(&store, "thing.happened", N).await;

    let (receiver_db, _receiver_guard) = SqliteStore::fresh().await;
    async fn hook(headers: HeaderMap, mut tx: Tx<SqliteStore>) -> StatusCode {
        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
        sqlx::query("INSERT INTO effects (label) VALUES (?1)")
            .bind(&key)
            .execute(&mut *tx)
            .await
            .unwrap();
        StatusCode::NO_CONTENT
    }
    /// Logs every delivery that reaches the receiving service, before its layer.
    async fn log(
        State(received): State<Received>,
        request: Request<axum::body::Body>,
        next: Next,
    ) -> Response {
        let (parts, body) = request.into_parts();
        let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        let key = parts.headers["idempotency-key"]
            .to_str()
            .unwrap()
            .to_owned();
        received.raw.lock().unwrap().push((key, body.to_vec()));
        next.run(Request::from_parts(parts, axum::body::Body::from(body)))
            .await
    }
    let received = Received::default();
    let app = Router::new()
        .route("/hooks", post(hook))
        .layer(IdempotencyLayer::new(
            receiver_db.clone(),
            KeyHasher::new(b"receiver"),
        ))
        .layer(from_fn_with_state(received.clone(), log));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let receiver_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let proxy = idemkey_fault_proxy::FaultProxy::start(
        receiver_addr,
        idemkey_fault_proxy::FaultConfig {
            lose_response: 0.3,
            seed: Some(7),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let sink = WebhookSink::new(&format!("{}/hooks", proxy.url())).unwrap();
    let task = Relay::new(store.clone(), sink).config(fast("r1")).spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut rounds = task.rounds();
    while rounds.borrow().sent < N {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            *rounds.borrow()
        );
        let _ = tokio::time::timeout(Duration::from_secs(1), rounds.changed()).await;
    }
    task.shutdown().await;

    let messages = all_messages(&store).await;
    assert!(messages.iter().all(|m| m.state == MessageState::Sent));
    let stored: HashMap<&str, Vec<u8>> = messages
        .iter()
        .map(|m| (m.id.as_str(), envelope(m)))
        .collect();
    let raw = received.raw.lock().unwrap().clone();
    for (key, body) in &raw {
        assert_eq!(
            &stored[key.as_str()],
            body,
            "a redelivery changed its bytes"
        );
        let parsed: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(parsed["id"], key.as_str(), "the key is the message id");
    }
    let lost = proxy.stats().responses_lost;
    assert!(lost > 0, "the proxy lost no answer");
    let effects: Vec<String> = sqlx::query_scalar("SELECT label FROM effects")
        .fetch_all(receiver_db.pool())
        .await
        .unwrap();
    let distinct: HashSet<&String> = effects.iter().collect();
    assert_eq!(effects.len(), N, "one effect per message at the receiver");
    assert_eq!(distinct, ids.iter().collect::<HashSet<_>>());
    println!(
        "{N} messages, {} deliveries reached the receiver, {lost} answers lost, {} effects",
        raw.len(),
        effects.len()
    );
    assert!(raw.len() > N, "redeliveries reached the receiver");
    let keys: HashSet<&String> = raw.iter().map(|(key, _)| key).collect();
    assert_eq!(keys.len(), N);
}

macro_rules! on_every_store {
    ($($name:ident $(($($arg:expr),*))?),* $(,)?) => {
        mod sqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name::<SqliteStore>($($($arg),*)?).await })*
        }
        mod rusqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name::<RusqliteStore>($($($arg),*)?).await })*
        }
        mod postgres {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name::<PgStore>($($($arg),*)?).await })*
        }
        mod mysql {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name::<MySqlStore>($($($arg),*)?).await })*
        }
    };
}

on_every_store!(
    messages_commit_with_the_effect_or_not_at_all,
    failures_back_off_then_die,
    a_group_is_delivered_in_order,
    stats_purge_and_audit,
    lossy_receiver_records_each_message_once,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_relay_on_sqlite_delivers_every_message() {
    relays_share_the_work::<SqliteStore>(1, 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_relay_on_rusqlite_delivers_every_message() {
    relays_share_the_work::<RusqliteStore>(1, 300).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_relays_on_one_postgres_deliver_1000_messages_never_twice_at_once() {
    relays_share_the_work::<PgStore>(3, 1000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_relays_on_one_mariadb_deliver_1000_messages_never_twice_at_once() {
    relays_share_the_work::<MySqlStore>(3, 1000).await;
}
