//! The outbox and the inbox against a three-node JetStream cluster, as production runs
//! NATS: a stream with three replicas, a relay and a consumer that know all three servers.
//! One node is killed with `kill -9` and restarted during delivery, then the stream's leader
//! is; every message is in the stream exactly once, by its `Nats-Msg-Id`, and the consumer's
//! effect exists exactly once per message.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use idemkey_core::outbox::{Message, MessageState};
use idemkey_core::{KeyHasher, Store};
use idemkey_outbox::{
    Backoff, DeliveryError, Inbox, NatsConfig, NatsSink, Outgoing, Relay, RelayConfig, RelayTask,
    Sink, consume_jetstream_with, enqueue_on, envelope, jetstream_message_id,
};
use idemkey_postgres::PgStore;
use idemkey_testkit::{CLUSTER_SIZE, NatsCluster, Stop};
use tokio::sync::mpsc;

use support::nats::{message, stream_contents};
use support::{all_messages, fresh_postgres, unsent, until_unsent_at_most};

const SUBJECT: &str = "payments.events";
const STREAM: &str = "PAYMENTS";
/// Messages enqueued, in one transaction, before each of the four steps (a kill, a restart,
/// a kill, a restart).
const CHUNK: usize = 200;
const SECRET: &[u8] = b"a test secret of 32 bytes or more";

/// Short time-outs and quick retries, so that an election costs a few failed attempts; the
/// attempts are bounded so that the whole schedule fits the stream's duplicate window.
fn relay_config() -> RelayConfig {
    RelayConfig {
        name: "relay-cluster".to_owned(),
        batch: 8,
        claim: Duration::from_secs(4),
        delivery_timeout: Duration::from_secs(2),
        max_attempts: 25,
        backoff: Backoff {
            first: Duration::from_millis(50),
            max: Duration::from_secs(1),
        },
        poll: Duration::from_millis(10),
        ..RelayConfig::default()
    }
}

/// The operator's stream: three replicas, the default two-minute duplicate window.
fn stream_config() -> stream::Config {
    stream::Config {
        name: STREAM.into(),
        subjects: vec![SUBJECT.into()],
        num_replicas: CLUSTER_SIZE,
        duplicate_window: NatsConfig::DEFAULT_DUPLICATE_WINDOW,
        ..Default::default()
    }
}

/// A client of all the cluster's servers, named (so the test can see which node it is on).
async fn connect(cluster: &NatsCluster, name: &str) -> async_nats::Client {
    let servers: Vec<async_nats::ServerAddr> = cluster
        .urls()
        .split(',')
        .map(|url| url.parse().unwrap())
        .collect();
    async_nats::ConnectOptions::new()
        .name(name)
        .connect(servers)
        .await
        .unwrap()
}

/// Enqueues `n` messages of type `kind` in one transaction, so that the relay sees them all
/// at once, each in a group of its own.
async fn enqueue_chunk(store: &PgStore, kind: &str, n: usize) -> Vec<String> {
    let mut tx = store.begin().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let message = Outgoing::new(kind, &serde_json::json!({ "n": i })).unwrap();
        let id = enqueue_on::<PgStore>(&mut tx, &format!("{kind}-{i}"), message)
            .await
            .unwrap();
        ids.push(id);
    }
    store.commit(tx).await.unwrap();
    ids
}

/// The [`NatsSink`], keeping the text of every failed delivery.
struct Recording {
    sink: NatsSink,
    failures: Mutex<Vec<String>>,
}

impl Sink for Recording {
    async fn deliver(&self, message: &Message) -> Result<(), DeliveryError> {
        let delivered = self.sink.deliver(message).await;
        if let Err(e) = &delivered {
            self.failures.lock().unwrap().push(e.0.clone());
        }
        delivered
    }
}

/// The stream's cluster info, from whichever server answers; `None` while none does (an
/// election in progress).
async fn cluster_info(js: &jetstream::Context) -> Option<stream::ClusterInfo> {
    let mut stream = js.get_stream(STREAM).await.ok()?;
    stream.info().await.ok()?.cluster.clone()
}

/// Waits until the stream has a leader and every replica is current; answers the leader.
async fn until_replicas_current(js: &jetstream::Context, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(info) = cluster_info(js).await
            && let Some(leader) = &info.leader
            && info.replicas.len() == CLUSTER_SIZE - 1
            && info
                .replicas
                .iter()
                .all(|peer| peer.current && !peer.offline)
        {
            return leader.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the stream's replicas are not all current after 60 s: {:?}",
            cluster_info(js).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the relay has delivered at least one more of the messages now unsent.
async fn until_delivery_started(store: &PgStore, relay: &RelayTask, what: &str) {
    let now = unsent(store).await;
    assert!(now > 0, "{what}: nothing to deliver");
    until_unsent_at_most(
        store,
        now - 1,
        Duration::from_secs(60),
        what,
        Some(relay.rounds()),
    )
    .await;
}

/// The server that leads the consumer `billing`, if one does.
async fn consumer_leader(js: &jetstream::Context) -> Option<String> {
    let stream = js.get_stream(STREAM).await.ok()?;
    stream.consumer_info("billing").await.ok()?.cluster?.leader
}

/// Kills node `i` with SIGKILL, off the runtime's threads.
async fn kill(cluster: NatsCluster, i: usize) -> NatsCluster {
    tokio::task::spawn_blocking(move || {
        let mut cluster = cluster;
        cluster.stop(i, Stop::Kill);
        cluster
    })
    .await
    .unwrap()
}

/// Starts node `i` again, off the runtime's threads.
async fn restart(cluster: NatsCluster, i: usize) -> NatsCluster {
    tokio::task::spawn_blocking(move || {
        let mut cluster = cluster;
        cluster.restart(i);
        cluster
    })
    .await
    .unwrap()
}

/// One node killed and restarted, then the stream's leader killed and restarted, while a
/// relay publishes 600 messages and an inbox consumer handles them: the stream holds each
/// message once, and the consumer's effect exists once per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replicated_stream_and_the_inbox_keep_every_message_once_through_node_and_leader_kills() {
    let started = Instant::now();
    let cluster = tokio::task::spawn_blocking(NatsCluster::start)
        .await
        .unwrap();
    let (store, _) = fresh_postgres().await;
    let admin = jetstream::new(connect(&cluster, "test-admin").await);
    admin.create_stream(stream_config()).await.unwrap();
    let config = relay_config();
    assert!(
        config.redelivery_horizon() <= stream_config().duplicate_window,
        "the relay may redeliver {:?} after a first publish, past the duplicate window",
        config.redelivery_horizon()
    );
    admin
        .get_stream(STREAM)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some("billing".into()),
            ack_wait: Duration::from_secs(2),
            ..Default::default()
        })
        .await
        .unwrap();

    // The relay: the sink as `--outbox-nats` makes it, from the list of all three servers.
    let sink = NatsSink::connect_with(
        &cluster.urls(),
        NatsConfig {
            create_stream: None,
            ack_timeout: Duration::from_millis(1500),
            ..NatsConfig::new(SUBJECT)
        },
    )
    .await
    .unwrap();
    assert_eq!(sink.stream().await, STREAM);
    let sink = Arc::new(Recording {
        sink,
        failures: Mutex::new(Vec::new()),
    });

    // The consumer: an inbox on a durable pull consumer, reporting each commit.
    let consumer_js = jetstream::new(connect(&cluster, "idemkey-inbox").await);
    let consumer: jetstream::consumer::PullConsumer = consumer_js
        .get_stream(STREAM)
        .await
        .unwrap()
        .get_consumer("billing")
        .await
        .unwrap();
    let inbox = Inbox::new(store.clone(), KeyHasher::new(SECRET), "billing", "payments");
    let (committed, mut commits) = mpsc::unbounded_channel::<(String, bool)>();
    let consuming = tokio::spawn(async move {
        consume_jetstream_with(
            &consumer,
            &inbox,
            |conn, message| {
                let id = jetstream_message_id(message).unwrap();
                Box::pin(async move {
                    sqlx::query("INSERT INTO effects (label) VALUES ($1)")
                        .bind(id)
                        .execute(conn)
                        .await
                        .map(|_| ())
                })
            },
            move |message, handled| {
                let id = jetstream_message_id(message).unwrap();
                let _ = committed.send((id, handled.ran()));
                Box::pin(async {})
            },
        )
        .await
    });

    // 1. A node that is not the stream's leader (the relay's own, if it can be) is killed as
    //    soon as delivery started; with it down the relay delivers the rest; it comes back
    //    during the delivery of more.
    let leader = until_replicas_current(&admin, "at the start").await;
    let on =
        |name: &str| (0..CLUSTER_SIZE).find(|&i| cluster.client_names(i).iter().any(|c| c == name));
    let relay_node = on("idemkey-outbox");
    let inbox_node = on("idemkey-inbox");
    let leader_node = cluster.index_of(&leader).unwrap();
    let victim = relay_node
        .filter(|&i| i != leader_node)
        .or(inbox_node.filter(|&i| i != leader_node))
        .unwrap_or((leader_node + 1) % CLUSTER_SIZE);
    let victim_name = cluster.name(victim).to_owned();
    let mut ids = enqueue_chunk(&store, "payment.succeeded", CHUNK).await;
    let relay = Relay::new(store.clone(), sink.clone())
        .config(config)
        .spawn();
    until_delivery_started(&store, &relay, "before the node kill").await;
    let cluster = kill(cluster, victim).await;
    let at_node_kill = unsent(&store).await;
    until_unsent_at_most(
        &store,
        0,
        Duration::from_secs(60),
        "with a node down",
        Some(relay.rounds()),
    )
    .await;
    ids.extend(enqueue_chunk(&store, "payment.refunded", CHUNK).await);
    until_delivery_started(&store, &relay, "before the node's restart").await;
    let at_node_restart = unsent(&store).await;
    let cluster = restart(cluster, victim).await;
    let leader = until_replicas_current(&admin, "after the node's restart").await;
    let consumer_leader = consumer_leader(&admin).await;

    // 2. The same with the stream's leader.
    ids.extend(enqueue_chunk(&store, "payment.captured", CHUNK).await);
    until_delivery_started(&store, &relay, "before the leader kill").await;
    let leader_node = cluster.index_of(&leader).unwrap();
    let cluster = kill(cluster, leader_node).await;
    let at_leader_kill = unsent(&store).await;
    until_unsent_at_most(
        &store,
        0,
        Duration::from_secs(60),
        "with the leader down",
        Some(relay.rounds()),
    )
    .await;
    let new_leader = cluster_info(&admin).await.and_then(|info| info.leader);
    ids.extend(enqueue_chunk(&store, "payment.settled", CHUNK).await);
    until_delivery_started(&store, &relay, "before the leader's restart").await;
    let at_leader_restart = unsent(&store).await;
    let cluster = restart(cluster, leader_node).await;
    until_unsent_at_most(
        &store,
        0,
        Duration::from_secs(60),
        "after the leader's restart",
        Some(relay.rounds()),
    )
    .await;
    let rounds = *relay.rounds().borrow();
    relay.shutdown().await;
    until_replicas_current(&admin, "after the leader's restart").await;

    // Every message sent, and handled by the consumer.
    let n = ids.len();
    let expected: HashSet<&str> = ids.iter().map(String::as_str).collect();
    let mut ran = HashSet::new();
    let mut duplicates = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while ran.len() < n {
        match tokio::time::timeout_at(deadline, commits.recv()).await {
            Ok(Some((id, true))) => assert!(ran.insert(id.clone()), "{id} ran twice"),
            Ok(Some((_, false))) => duplicates += 1,
            Ok(None) => panic!("the consumer stopped: {:?}", consuming.await),
            Err(_) => panic!(
                "the consumer handled {} of {n} messages within 60 s after the relay",
                ran.len()
            ),
        }
    }
    let messages = all_messages(&store).await;
    assert_eq!(messages.len(), n);
    assert!(messages.iter().all(|m| m.state == MessageState::Sent));
    let failures = sink.failures.lock().unwrap().clone();
    let errors: HashSet<&str> = failures.iter().map(String::as_str).collect();

    let contents = stream_contents(&admin, STREAM).await;
    let distinct: HashSet<&str> = contents.iter().map(|(id, _)| id.as_str()).collect();
    let bytes: HashMap<&str, Vec<u8>> = messages
        .iter()
        .map(|m| (m.id.as_str(), envelope(m)))
        .collect();
    for (id, payload) in &contents {
        assert_eq!(
            bytes.get(id.as_str()),
            Some(payload),
            "the stream holds a message {id:?} of other bytes or no outbox message"
        );
    }
    let repeated: Vec<(String, i64)> =
        sqlx::query_as("SELECT label, COUNT(*) FROM effects GROUP BY label HAVING COUNT(*) <> 1")
            .fetch_all(store.pool())
            .await
            .unwrap();
    let effect_rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .unwrap();
    consuming.abort();

    // Every message again, as a relay that never heard its acknowledgements would: the stream,
    // led by another server since, still knows each id.
    let mut republished_duplicates = 0;
    for message in &messages {
        if sink.sink.publish(message).await.unwrap().duplicate {
            republished_duplicates += 1;
        }
    }
    let after_republish = stream_contents(&admin, STREAM).await.len();
    println!(
        "{n} messages through a 3-node cluster: node {victim_name} (relay on {:?}, inbox on {:?}) killed with \
         {at_node_kill} unsent, back with {at_node_restart} unsent; stream leader {leader} \
         (consumer leader {consumer_leader:?}) killed with {at_leader_kill} unsent, new leader \
         {new_leader:?}, back with {at_leader_restart} unsent; relay rounds {rounds:?}; \
         {} failed deliveries: {errors:?}; stream {} messages, {} distinct ids; consumer ran {}, \
         {duplicates} redeliveries found handled; {effect_rows} effect rows; {n} republished: {republished_duplicates} duplicates, stream \
         then {after_republish}; {:?}",
        relay_node.map(|i| cluster.name(i).to_owned()),
        inbox_node.map(|i| cluster.name(i).to_owned()),
        failures.len(),
        contents.len(),
        distinct.len(),
        ran.len(),
        started.elapsed(),
    );
    for (at, unsent) in [
        ("the node's kill", at_node_kill),
        ("the node's restart", at_node_restart),
        ("the leader's kill", at_leader_kill),
        ("the leader's restart", at_leader_restart),
    ] {
        assert!(unsent > 0, "everything was delivered before {at}");
    }
    assert!(
        !errors
            .iter()
            .any(|e| e.contains("no JetStream stream captures")),
        "a delivery said the stream was missing while it had no leader: {errors:?}"
    );
    assert!(
        new_leader.as_ref().is_some_and(|new| *new != leader),
        "the stream kept its killed leader {leader}: {new_leader:?}"
    );
    assert_eq!(contents.len(), n, "one copy per message in the stream");
    assert_eq!(distinct, expected, "every message, by its id");
    let ran: HashSet<&str> = ran.iter().map(String::as_str).collect();
    assert_eq!(ran, expected, "the consumer handled every message");
    assert_eq!(repeated, [], "an effect other than once");
    assert_eq!(effect_rows, n as i64);
    assert_eq!(
        republished_duplicates, n,
        "the stream dropped every redelivery"
    );
    assert_eq!(after_republish, n);
    drop(cluster);
}

/// A stream with one replica, on a server that is killed: the stream has no leader, so
/// deliveries fail, saying so (not that no stream captures the subject), in bounded time;
/// once the server is back, the message is delivered, and stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaderless_stream_fails_deliveries_saying_so_and_takes_them_once_it_is_back() {
    let cluster = tokio::task::spawn_blocking(NatsCluster::start)
        .await
        .unwrap();
    let admin = jetstream::new(connect(&cluster, "test-admin").await);
    admin
        .create_stream(stream::Config {
            num_replicas: 1,
            ..stream_config()
        })
        .await
        .unwrap();
    let placed = cluster_info(&admin)
        .await
        .and_then(|info| info.leader)
        .expect("the stream has a server");
    let placed = cluster.index_of(&placed).unwrap();
    // The sink reaches the cluster through the two other servers.
    let others: Vec<String> = (0..CLUSTER_SIZE)
        .filter(|&i| i != placed)
        .map(|i| cluster.url(i))
        .collect();
    let ack_timeout = Duration::from_millis(1500);
    let sink = NatsSink::connect_with(
        &others.join(","),
        NatsConfig {
            create_stream: None,
            ack_timeout,
            ..NatsConfig::new(SUBJECT)
        },
    )
    .await
    .unwrap();
    let cluster = kill(cluster, placed).await;
    // If that server led the cluster's JetStream layer too, the other two elect a new
    // leader, which the sink's stream look-up needs.
    let deadline = Instant::now() + Duration::from_secs(30);
    while admin.stream_by_subject(SUBJECT).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "no JetStream leader 30 s after the kill"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let message = message("msg_leaderless");
    let started = Instant::now();
    let failed = sink.deliver(&message).await.unwrap_err();
    let took = started.elapsed();
    println!("delivery to a stream whose only server is down: {took:?}: {failed}");
    assert!(
        failed.0.contains("has no leader to store the message"),
        "{failed}"
    );
    assert!(failed.0.contains(STREAM), "{failed}");

    let cluster = restart(cluster, placed).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let published = loop {
        match sink.publish(&message).await {
            Ok(published) => break published,
            Err(e) => assert!(
                Instant::now() < deadline,
                "not delivered 30 s after the server came back: {e}"
            ),
        }
    };
    assert_eq!(
        (published.stream.as_str(), published.duplicate),
        (STREAM, false)
    );
    assert!(sink.publish(&message).await.unwrap().duplicate);
    let contents = stream_contents(&admin, STREAM).await;
    assert_eq!(contents, [(message.id.clone(), envelope(&message))]);
    drop(cluster);
}
