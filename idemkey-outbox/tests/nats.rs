//! The outbox on NATS JetStream, against a real `nats-server -js` and a real PostgreSQL:
//!
//! - relays crash (one `kill -9`ed in a child process, one dropped mid-round) and NATS is
//!   killed and restarted during delivery, and the stream still holds exactly one copy of
//!   each message;
//! - a consumer `kill -9`ed between its commit and its acknowledgement gets the message
//!   again, runs nothing for it, and its effect exists once;
//! - the sink publishes into the operator's stream and creates one only when none captures
//!   its subject; its errors say what is wrong.
//!
//! The child processes are this test binary again, running [`child_process`] with
//! `IDEMKEY_TEST_CHILD` set.

mod support;

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use idemkey_core::KeyHasher;
use idemkey_core::outbox::{Message, MessageState};
use idemkey_outbox::{
    Backoff, DeliveryError, Inbox, NatsConfig, NatsSink, Relay, RelayConfig, Sink,
    consume_jetstream_with, envelope, jetstream_message_id,
};
use idemkey_postgres::PgStore;
use idemkey_testkit::{NatsServer, Stop};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use support::nats::{message, stream_contents};
use support::{all_messages, enqueue_many, fresh_postgres, unsent, until_unsent_at_most};

const CHILD_ENV: &str = "IDEMKEY_TEST_CHILD";
const SUBJECT: &str = "payments.events";

/// Starts a throwaway NATS server off the runtime's threads.
async fn start_nats() -> NatsServer {
    tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
}

fn sink_config() -> NatsConfig {
    NatsConfig {
        ack_timeout: Duration::from_secs(1),
        ..NatsConfig::new(SUBJECT)
    }
}

/// Small rounds (so a crash lands mid-way), short claims (so a dead relay's messages come
/// back soon), quick retries.
fn relay_config(name: &str) -> RelayConfig {
    RelayConfig {
        name: name.to_owned(),
        batch: 4,
        claim: Duration::from_secs(3),
        delivery_timeout: Duration::from_secs(2),
        max_attempts: 1000,
        backoff: Backoff {
            first: Duration::from_millis(50),
            max: Duration::from_millis(500),
        },
        poll: Duration::from_millis(10),
        ..RelayConfig::default()
    }
}

/// A [`NatsSink`] that counts JetStream's acknowledgements, and how many were duplicates.
struct Counting {
    sink: Arc<NatsSink>,
    acks: AtomicU64,
    duplicates: AtomicU64,
}

impl Sink for Counting {
    async fn deliver(&self, message: &Message) -> Result<(), DeliveryError> {
        let published = self.sink.publish(message).await?;
        self.acks.fetch_add(1, Ordering::SeqCst);
        if published.duplicate {
            self.duplicates.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

async fn stream_names(js: &jetstream::Context) -> Vec<String> {
    let mut names: Vec<String> = js.stream_names().map(|name| name.unwrap()).collect().await;
    names.sort();
    names
}

/// A child process running [`child_process`] as `role`, its stdout lines on a channel.
struct ChildProcess {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
}

impl ChildProcess {
    fn spawn(role: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["child_process", "--exact", "--ignored", "--nocapture"])
            .env(CHILD_ENV, role)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    /// The first line that starts with `prefix`; fails after `within`.
    async fn line(&mut self, prefix: &str, within: Duration) -> String {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) if line.starts_with(prefix) => return line,
                Ok(Some(_)) => {}
                Ok(None) => panic!("the child exited before printing {prefix:?}"),
                Err(_) => panic!("the child printed no {prefix:?} within {within:?}"),
            }
        }
    }

    /// `kill -9`, and waits until it is gone.
    async fn kill_9(mut self) {
        self.child.start_kill().unwrap();
        let status = self.child.wait().await.unwrap();
        assert!(!status.success(), "{status}");
    }
}

/// Relays crash and NATS restarts while 300 messages are delivered: the stream ends with
/// exactly one copy of each, and every message is `sent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_holds_one_copy_per_message_after_relay_crashes_and_a_nats_restart() {
    const N: usize = 300;
    let started = Instant::now();
    let mut nats = start_nats().await;
    let (store, database_url) = fresh_postgres().await;
    let ids = enqueue_many(&store, "payment.succeeded", N).await;
    let sink = Arc::new(
        NatsSink::connect_with(&nats.url(), sink_config())
            .await
            .unwrap(),
    );
    let stream = sink.stream().await;

    // Relay A, a process of its own, is killed with SIGKILL mid-way.
    let nats_url = nats.url();
    let mut relay_a = ChildProcess::spawn(
        "relay",
        &[("DATABASE_URL", &database_url), ("NATS_URL", &nats_url)],
    );
    relay_a.line("RELAY READY", Duration::from_secs(60)).await;
    until_unsent_at_most(
        &store,
        (N - N / 5) as u64,
        Duration::from_secs(60),
        "relay A",
        None,
    )
    .await;
    relay_a.kill_9().await;
    let after_a = unsent(&store).await;
    assert!(
        after_a > 0,
        "relay A delivered everything before it was killed"
    );

    // Relay B, in this process; NATS is killed and restarted under it, then B is dropped.
    let counting = |sink: &Arc<NatsSink>| {
        Arc::new(Counting {
            sink: sink.clone(),
            acks: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
        })
    };
    let b_sink = counting(&sink);
    let relay_b = Relay::new(store.clone(), b_sink.clone())
        .config(relay_config("relay-b"))
        .spawn();
    until_unsent_at_most(
        &store,
        (N / 2) as u64,
        Duration::from_secs(60),
        "relay B",
        Some(relay_b.rounds()),
    )
    .await;
    let outage = Instant::now();
    let failed_before = relay_b.rounds().borrow().failed;
    nats = tokio::task::spawn_blocking(move || {
        nats.stop(Stop::Kill);
        nats
    })
    .await
    .unwrap();
    // NATS stays down until relay B has seen deliveries fail.
    let mut rounds = relay_b.rounds();
    let deadline = Instant::now() + Duration::from_secs(30);
    while rounds.borrow().failed == failed_before {
        assert!(
            Instant::now() < deadline,
            "no delivery failed while NATS was down"
        );
        let _ = tokio::time::timeout(Duration::from_millis(200), rounds.changed()).await;
    }
    nats = tokio::task::spawn_blocking(move || {
        nats.restart();
        nats
    })
    .await
    .unwrap();
    let restarted_in = outage.elapsed();
    let at_restart = unsent(&store).await;
    assert!(
        at_restart > 0,
        "everything was delivered before NATS went down"
    );
    until_unsent_at_most(
        &store,
        (N / 4) as u64,
        Duration::from_secs(60),
        "relay B after the restart",
        Some(relay_b.rounds()),
    )
    .await;
    let b_failed = relay_b.rounds().borrow().failed;
    drop(relay_b);
    let after_b = unsent(&store).await;
    assert!(
        after_b > 0,
        "relay B delivered everything before it was dropped"
    );

    // Relay C finishes, taking over B's claims once they run out.
    let c_sink = counting(&sink);
    let relay_c = Relay::new(store.clone(), c_sink.clone())
        .config(relay_config("relay-c"))
        .spawn();
    until_unsent_at_most(
        &store,
        0,
        Duration::from_secs(120),
        "relay C",
        Some(relay_c.rounds()),
    )
    .await;
    relay_c.shutdown().await;

    let messages = all_messages(&store).await;
    assert_eq!(messages.len(), N);
    assert!(messages.iter().all(|m| m.state == MessageState::Sent));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    let contents = stream_contents(&js, &stream).await;
    let distinct: HashSet<&str> = contents.iter().map(|(id, _)| id.as_str()).collect();
    let expected: HashSet<&str> = ids.iter().map(String::as_str).collect();
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

    // Every message again, as a relay that never heard its acknowledgements would: the
    // stream, recovered from its store after the kill, still knows each id.
    let mut republished_duplicates = 0;
    for message in &messages {
        if sink.publish(message).await.unwrap().duplicate {
            republished_duplicates += 1;
        }
    }
    let after_republish = stream_contents(&js, &stream).await.len();

    println!(
        "{N} messages: relay A killed with {after_a} unsent; NATS killed with {at_restart} \
         unsent, back {restarted_in:?} later ({b_failed} failed deliveries); relay B dropped \
         with {after_b} unsent; \
         acknowledgements B {} ({} duplicates), C {} ({} duplicates); stream: {} messages, \
         {} distinct ids; {N} republished: {republished_duplicates} duplicates, stream then \
         {after_republish}; {:?}",
        b_sink.acks.load(Ordering::SeqCst),
        b_sink.duplicates.load(Ordering::SeqCst),
        c_sink.acks.load(Ordering::SeqCst),
        c_sink.duplicates.load(Ordering::SeqCst),
        contents.len(),
        distinct.len(),
        started.elapsed(),
    );
    assert_eq!(contents.len(), N, "one copy per message in the stream");
    assert_eq!(distinct, expected, "every message, by its id");
    assert_eq!(
        republished_duplicates, N,
        "the stream dropped every redelivery"
    );
    assert_eq!(after_republish, N);
}

/// A consumer killed with SIGKILL after its commit and before its acknowledgement: JetStream
/// delivers the message again, the inbox runs nothing for it, and the effect exists once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_between_commit_and_ack_gets_the_message_again_and_runs_nothing() {
    let nats = start_nats().await;
    let (store, database_url) = fresh_postgres().await;
    let ids = enqueue_many(&store, "payment.succeeded", 1).await;
    let id = &ids[0];
    let sink = NatsSink::connect_with(&nats.url(), sink_config())
        .await
        .unwrap();
    let stream_name = sink.stream().await;
    let round = Relay::new(store.clone(), sink)
        .config(relay_config("relay"))
        .run_once()
        .await
        .unwrap();
    assert_eq!(round.sent, 1);

    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    let stream = js.get_stream(&stream_name).await.unwrap();
    let mut consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("billing".into()),
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .unwrap();

    let env = [
        ("DATABASE_URL", database_url.as_str()),
        ("NATS_URL", &nats.url()),
        ("STREAM", &stream_name),
        ("CONSUMER", "billing"),
    ];
    let mut first = ChildProcess::spawn("consumer-blocking", &env);
    let committed = first.line("COMMITTED", Duration::from_secs(60)).await;
    assert_eq!(committed, format!("COMMITTED {id} ran=true delivered=1"));
    assert_eq!(effects(&store, id).await, 1, "the first delivery committed");
    first.kill_9().await;
    let killed = Instant::now();

    let mut second = ChildProcess::spawn("consumer", &env);
    let again = second.line("COMMITTED", Duration::from_secs(60)).await;
    let redelivered_after = killed.elapsed();
    assert_eq!(
        again,
        format!("COMMITTED {id} ran=false delivered=2"),
        "the redelivery runs nothing"
    );
    // The second consumer acknowledged it: nothing pending, nothing awaiting an ack.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = consumer.info().await.unwrap();
        if info.num_ack_pending == 0 && info.num_pending == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "never acknowledged: {info:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rows = effects(&store, id).await;
    second.kill_9().await;
    println!(
        "consumer killed between commit and ack: redelivered {redelivered_after:?} later \
         (delivery 2), ran nothing, acknowledged; effect rows for the message: {rows}"
    );
    assert_eq!(rows, 1, "the effect exists exactly once");
}

async fn effects(store: &PgStore, label: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE label = $1")
        .bind(label)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// With an operator's stream that captures the subject (by a wildcard), the sink publishes
/// into it, creates no stream, and a second publish of one message is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_publishes_into_the_operators_stream_and_creates_none() {
    let nats = start_nats().await;
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(jetstream::stream::Config {
        name: "PAYMENTS".into(),
        subjects: vec!["payments.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    // A list of servers, the first of them down.
    let servers = format!("nats://127.0.0.1:1, {}", nats.url());
    let sink = NatsSink::connect(&servers, SUBJECT).await.unwrap();
    assert_eq!(sink.stream().await, "PAYMENTS");
    let message = message("msg_owned");
    let first = sink.publish(&message).await.unwrap();
    let second = sink.publish(&message).await.unwrap();
    assert_eq!(
        (first.stream.as_str(), first.duplicate),
        ("PAYMENTS", false)
    );
    assert!(second.duplicate, "{second:?}");
    assert_eq!(second.sequence, first.sequence);
    sink.deliver(&message).await.unwrap();
    assert_eq!(
        stream_names(&js).await,
        ["PAYMENTS"],
        "the sink created a stream"
    );
    let contents = stream_contents(&js, "PAYMENTS").await;
    assert_eq!(contents, [("msg_owned".to_owned(), envelope(&message))]);
}

/// With no stream capturing the subject, the sink creates its configured one (and again
/// after the operator deleted it); with creation off, it refuses to start and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_creates_a_stream_only_when_none_captures_its_subject() {
    let nats = start_nats().await;
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let refused = NatsSink::connect_with(
        &nats.url(),
        NatsConfig {
            create_stream: None,
            ..NatsConfig::new(SUBJECT)
        },
    )
    .await
    .unwrap_err();
    assert!(
        refused
            .0
            .contains("no JetStream stream captures the subject"),
        "{refused}"
    );
    assert!(stream_names(&js).await.is_empty());

    let sink = NatsSink::connect(&nats.url(), SUBJECT).await.unwrap();
    let created = NatsConfig::default_stream_name(SUBJECT);
    assert_eq!(sink.stream().await, created);
    assert_eq!(stream_names(&js).await, [created.as_str()]);
    let info = js
        .get_stream(&created)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.config.subjects, [SUBJECT]);
    assert_eq!(
        info.config.duplicate_window,
        NatsConfig::DEFAULT_DUPLICATE_WINDOW
    );
    sink.deliver(&message("msg_1")).await.unwrap();
    assert_eq!(stream_contents(&js, &created).await.len(), 1);

    js.delete_stream(&created).await.unwrap();
    sink.deliver(&message("msg_2")).await.unwrap();
    assert_eq!(stream_names(&js).await, [created.as_str()]);
    let ids: Vec<String> = stream_contents(&js, &created)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids, ["msg_2"]);
}

/// An unreachable server, a server that goes away, an invalid URL: each a clear error, in
/// bounded time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_reports_connection_failures_and_missing_acknowledgements() {
    let mut nats = start_nats().await;
    let sink = NatsSink::connect_with(&nats.url(), sink_config())
        .await
        .unwrap();
    nats = tokio::task::spawn_blocking(move || {
        nats.stop(Stop::Kill);
        nats
    })
    .await
    .unwrap();
    let started = Instant::now();
    let failed = sink.deliver(&message("msg_lost")).await.unwrap_err();
    let took = started.elapsed();
    assert!(
        failed.0.contains("no acknowledgement from JetStream")
            || failed.0.contains("connection to NATS was lost"),
        "{failed}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    let unreachable = NatsSink::connect_with(&nats.url(), sink_config())
        .await
        .unwrap_err();
    assert!(
        unreachable
            .0
            .starts_with("cannot connect to NATS at nats://127.0.0.1:"),
        "{unreachable}"
    );
    let invalid = NatsSink::connect("nats://127.0.0.1:99999", SUBJECT)
        .await
        .unwrap_err();
    assert!(invalid.0.starts_with("invalid NATS URL"), "{invalid}");
    println!("NATS down: delivery failed after {took:?}: {failed}; connect: {unreachable}");
}

/// The child processes' entry point (ignored unless run by the tests above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the crash tests; they run it"]
async fn child_process() {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap();
    let store = PgStore::connect(&var("DATABASE_URL"), 8).await.unwrap();
    match role.as_str() {
        "relay" => {
            let sink = NatsSink::connect_with(&var("NATS_URL"), sink_config())
                .await
                .unwrap();
            let _task = Relay::new(store, sink)
                .config(relay_config(&format!("relay-{}", std::process::id())))
                .spawn();
            println!("RELAY READY");
            std::future::pending::<()>().await;
        }
        "consumer" | "consumer-blocking" => {
            let block = role == "consumer-blocking";
            let client = async_nats::connect(var("NATS_URL")).await.unwrap();
            let js = jetstream::new(client);
            let stream = js.get_stream(var("STREAM")).await.unwrap();
            let consumer: jetstream::consumer::PullConsumer =
                stream.get_consumer(&var("CONSUMER")).await.unwrap();
            let inbox = Inbox::new(store, KeyHasher::new(b"consumer"), "billing", "payments");
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
                |message, handled| {
                    Box::pin(async move {
                        let delivered = message.info().unwrap().delivered;
                        let id = jetstream_message_id(message).unwrap();
                        println!("COMMITTED {id} ran={} delivered={delivered}", handled.ran());
                        if block {
                            // Killed here: committed, not acknowledged.
                            std::future::pending::<()>().await;
                        }
                    })
                },
            )
            .await
            .unwrap();
        }
        other => panic!("unknown child role {other:?}"),
    }
}
