//! The outbox end to end: `idemkey serve --outbox-webhook` emits one `payment.succeeded`
//! per succeeded payment, through `kill -9` at random points under load; `idemkey outbox …`
//! lists, shows, retries and drops dead messages (audited); `idemkey relay` delivers in a
//! process of its own.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{Backend, Kind, TOKEN1, payment};
use tokio::sync::mpsc;

/// Deliveries: `(Idempotency-Key, body)`.
type Deliveries = Vec<(String, Vec<u8>)>;

/// Every delivery the receiver got.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Deliveries>>,
}

impl Receiver {
    /// Listens on loopback; returns the webhook URL.
    async fn start(&self) -> String {
        async fn hook(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
            let key = headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            r.got.lock().unwrap().push((key, body.to_vec()));
            StatusCode::NO_CONTENT
        }
        let app = Router::new()
            .route("/hooks", post(hook))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/hooks")
    }

    fn deliveries(&self) -> Deliveries {
        self.got.lock().unwrap().clone()
    }
}

/// One outbox row: id, type, state, data (JSON text).
type Row = (String, String, String, String);

/// The outbox and the payments, read directly from the database.
async fn read_outbox(backend: &Backend) -> (Vec<Row>, Vec<String>) {
    let outbox = "SELECT id, kind, state, data FROM idemkey_outbox ORDER BY seq";
    let payments = "SELECT id FROM payments";
    match backend.kind() {
        Kind::Sqlite => {
            let pool = sqlx::SqlitePool::connect(backend.url()).await.unwrap();
            let rows = sqlx::query_as(outbox).fetch_all(&pool).await.unwrap();
            let ids = sqlx::query_scalar(payments).fetch_all(&pool).await.unwrap();
            pool.close().await;
            (rows, ids)
        }
        Kind::Postgres => {
            let pool = sqlx::PgPool::connect(backend.direct_url()).await.unwrap();
            let rows = sqlx::query_as(outbox).fetch_all(&pool).await.unwrap();
            let ids = sqlx::query_scalar(payments).fetch_all(&pool).await.unwrap();
            pool.close().await;
            (rows, ids)
        }
        Kind::MySql => {
            let pool = sqlx::MySqlPool::connect(backend.url()).await.unwrap();
            let rows = sqlx::query_as(outbox).fetch_all(&pool).await.unwrap();
            let ids = sqlx::query_scalar(payments).fetch_all(&pool).await.unwrap();
            pool.close().await;
            (rows, ids)
        }
    }
}

/// Waits (bounded) until no message is pending; returns the outbox and the payments.
/// The delivery errors the outbox keeps, as stored.
async fn stored_errors(backend: &Backend) -> Vec<String> {
    let sql = "SELECT last_error FROM idemkey_outbox WHERE last_error IS NOT NULL";
    match backend.kind() {
        Kind::Sqlite => {
            let pool = sqlx::SqlitePool::connect(backend.url()).await.unwrap();
            let errors = sqlx::query_scalar(sql).fetch_all(&pool).await.unwrap();
            pool.close().await;
            errors
        }
        Kind::Postgres => {
            let pool = sqlx::PgPool::connect(backend.url()).await.unwrap();
            let errors = sqlx::query_scalar(sql).fetch_all(&pool).await.unwrap();
            pool.close().await;
            errors
        }
        Kind::MySql => {
            let pool = sqlx::MySqlPool::connect(backend.url()).await.unwrap();
            let errors = sqlx::query_scalar(sql).fetch_all(&pool).await.unwrap();
            pool.close().await;
            errors
        }
    }
}

async fn until_delivered(backend: &Backend) -> (Vec<Row>, Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (rows, payments) = read_outbox(backend).await;
        let pending = rows.iter().filter(|r| r.2 == "pending").count();
        if pending == 0 {
            return (rows, payments);
        }
        assert!(
            Instant::now() < deadline,
            "{pending} messages still pending"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Payments of three kinds (succeeded, declined, invalid) sent by 16 clients; `serve` is
/// killed with `kill -9` three times at random points (after a random number of answers)
/// and restarted; every logical operation is retried with its key until it has its answer.
/// Then: every succeeded payment has exactly one message id, no message names a payment
/// that does not exist, declined and invalid requests emitted nothing, the receiver got
/// every message at least once, and every delivery of a message carried the same bytes,
/// whose `data` is the payment exactly as `GET /v1/payments/{id}` answers it.
async fn kill9_under_load_one_message_per_payment(backend: Backend) {
    const OPS: usize = 150;
    const KILLS: usize = 3;
    let receiver = Receiver::default();
    let webhook = receiver.start().await;
    // A killed relay's claims lapse after 3 × 1 s.
    let flags = [
        "--outbox-webhook",
        webhook.as_str(),
        "--outbox-delivery-timeout",
        "1s",
    ];
    // Operation k: succeeded, declined (over the limit) or invalid (400), by k mod 5.
    let body = |k: usize| match k % 5 {
        3 => payment(2_000_000 + k as i64, &format!("declined {k}")),
        4 => format!(r#"{{"amount":-1,"currency":"EUR","customer":"c{k}"}}"#),
        _ => payment(100 + k as i64, &format!("op {k}")),
    };
    let mut answered: BTreeMap<usize, (u16, Vec<u8>)> = BTreeMap::new();
    // Where the kills fall changes from run to run; the seed is printed to replay one.
    let mut seed = std::env::var("OUTBOX_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos() as u64
                | 1
        });
    eprintln!("kill points from OUTBOX_KILL_SEED={seed}");
    let mut rounds = 0;
    while answered.len() < OPS {
        rounds += 1;
        assert!(
            rounds <= KILLS + 20,
            "operations left unanswered: {}",
            OPS - answered.len()
        );
        let mut server = backend.start(&flags).await;
        let api = server.api();
        let todo: Vec<usize> = (0..OPS).filter(|k| !answered.contains_key(k)).collect();
        // Kill after a random share of this round's answers (none for the last round).
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let kill_after = (rounds <= KILLS).then(|| 1 + (seed as usize) % (todo.len() / 2).max(1));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let gate = Arc::new(tokio::sync::Semaphore::new(16));
        for k in todo {
            let (api, tx, gate, body) = (api.clone(), tx.clone(), gate.clone(), body(k));
            tokio::spawn(async move {
                let _permit = gate.acquire().await.unwrap();
                let answer = api.pay(TOKEN1, &format!("op-{k}"), &body).await;
                let _ = tx.send((k, answer.ok().map(|a| (a.status, a.body))));
            });
        }
        drop(tx);
        let mut this_round = 0;
        while let Some((k, answer)) = rx.recv().await {
            if let Some((status, body)) = answer
                && matches!(status, 201 | 400 | 402)
            {
                answered.insert(k, (status, body));
                this_round += 1;
            }
            if kill_after.is_some_and(|n| this_round >= n) {
                server.kill9();
                break;
            }
        }
        eprintln!(
            "round {rounds}: {this_round} answers, kill after {kill_after:?}, {} of {OPS} answered",
            answered.len()
        );
        if answered.len() == OPS {
            // Let the relay of the last server finish.
            let (rows, _) = until_delivered(&backend).await;
            assert!(rows.iter().all(|r| r.2 == "sent"));
            drop(server);
        }
    }
    assert!(rounds > KILLS, "every kill happened");

    let (rows, payments) = until_delivered(&backend).await;
    let succeeded: BTreeSet<String> = answered
        .values()
        .filter(|(status, _)| *status == 201)
        .map(|(_, body)| {
            let v: serde_json::Value = serde_json::from_slice(body).unwrap();
            v["id"].as_str().unwrap().to_owned()
        })
        .collect();
    let payments: BTreeSet<String> = payments.into_iter().collect();
    assert_eq!(
        succeeded, payments,
        "the answered payments are the stored ones"
    );
    assert_eq!(succeeded.len(), OPS * 3 / 5);
    let mut per_payment: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for row in &rows {
        assert_eq!(row.1, "payment.succeeded");
        assert_eq!(row.2, "sent");
        let data: serde_json::Value = serde_json::from_str(&row.3).unwrap();
        per_payment
            .entry(data["id"].as_str().unwrap().to_owned())
            .or_default()
            .push(row);
    }
    let named: BTreeSet<String> = per_payment.keys().cloned().collect();
    assert_eq!(
        named, payments,
        "a message per payment, none for anything else"
    );
    assert!(
        per_payment.values().all(|m| m.len() == 1),
        "exactly one message id per payment"
    );

    // The receiver: every message at least once, each redelivery byte-identical.
    let deliveries = receiver.deliveries();
    let mut bodies: BTreeMap<&str, BTreeSet<&[u8]>> = BTreeMap::new();
    for (key, body) in &deliveries {
        bodies.entry(key).or_default().insert(body);
    }
    for row in &rows {
        let got = bodies
            .get(row.0.as_str())
            .unwrap_or_else(|| panic!("message {} never reached the receiver", row.0));
        assert_eq!(got.len(), 1, "message {}: deliveries differ", row.0);
        let envelope: serde_json::Value =
            serde_json::from_slice(got.iter().next().unwrap()).unwrap();
        assert_eq!(envelope["id"], row.0.as_str());
        assert_eq!(envelope["type"], "payment.succeeded");
    }
    assert_eq!(bodies.len(), rows.len(), "nothing else was delivered");

    // `data` is the payment exactly as the API answers it.
    let server = backend.start(&[]).await;
    let api = server.api();
    for row in rows.iter().take(10) {
        let data: serde_json::Value = serde_json::from_str(&row.3).unwrap();
        let id = data["id"].as_str().unwrap();
        let got = api.get(&format!("/v1/payments/{id}"), Some(TOKEN1)).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.text(), row.3, "data of {}", row.0);
    }
    eprintln!(
        "{OPS} operations, {} payments, {} messages, {} deliveries, {rounds} server runs",
        payments.len(),
        rows.len(),
        deliveries.len()
    );
}

/// Runs `idemkey` with `args`; returns (success, stdout, stderr).
fn cli(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(args)
        .env_remove("IDEMKEY_DATABASE_URL")
        .env_remove("IDEMKEY_OUTBOX_WEBHOOK")
        .stdin(Stdio::null())
        .output()
        .expect("run idemkey");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A webhook nobody listens on, one attempt per message: the payment's message dies, the
/// operator sees it (`list`, `show`, `/metrics`), retries it (audited), and `idemkey relay`
/// then delivers it to a receiver that is up; `drop` removes a dead message, and both
/// commands refuse messages that are not dead.
async fn operator_commands_and_the_relay_process(backend: Backend) {
    // A port that refuses connections: bound, then closed.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    // A webhook URL carries its token (here in the path and the query): it is never
    // printed, logged or stored.
    let dead_hook = format!("http://{closed}/hooks/path-s3cret?token=query-s3cret");
    let server = backend
        .start(&["--outbox-webhook", &dead_hook, "--outbox-max-attempts", "1"])
        .await;
    let api = server.api();
    for k in 0..2 {
        let answer = api
            .pay_ok(TOKEN1, &format!("dead-{k}"), &payment(100 + k, "x"))
            .await;
        assert_eq!(answer.status, 201);
    }
    let url = backend.url();
    let deadline = Instant::now() + Duration::from_secs(30);
    let ids: Vec<String> = loop {
        let (ok, out, err) = cli(&[
            "outbox",
            "list",
            "--database-url",
            url,
            "--state",
            "dead",
            "--json",
        ]);
        assert!(ok, "{err}");
        let ids: Vec<String> = out
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        if ids.len() == 2 {
            break ids;
        }
        assert!(Instant::now() < deadline, "not dead yet: {out}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The gauges are read every few seconds.
    let deadline = Instant::now() + Duration::from_secs(30);
    while api.metric("idemkey_outbox_dead").await != 2 {
        assert!(
            Instant::now() < deadline,
            "idemkey_outbox_dead never reached 2"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        api.metric("idemkey_outbox_deliveries_total{outcome=\"dead\"}")
            .await
            >= 2
    );
    let printed = format!("{}\n{}", server.stdout().join("\n"), server.log());
    assert!(printed.contains("outbox delivery failed"), "{printed}");
    assert!(!printed.contains("s3cret"), "{printed}");
    drop(server);

    let (ok, table, _) = cli(&["outbox", "list", "--database-url", url]);
    assert!(ok);
    assert!(
        table.contains(&ids[0]) && table.contains("dead") && table.contains("(2 messages)"),
        "{table}"
    );
    assert!(!table.contains("s3cret"), "{table}");
    let (ok, shown, _) = cli(&["outbox", "show", "--database-url", url, &ids[0]]);
    assert!(ok);
    assert!(!shown.contains("s3cret"), "{shown}");
    let stored = stored_errors(&backend).await;
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert!(stored.iter().all(|e| !e.contains("s3cret")), "{stored:?}");
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["state"], "dead");
    assert_eq!(shown["attempts"], 1);
    assert!(
        shown["last_error"]
            .as_str()
            .unwrap()
            .contains(&closed.to_string()),
        "{shown}"
    );
    assert_eq!(shown["delivered_as"]["id"], ids[0].as_str());
    assert!(shown["delivered_as"]["data"]["amount"].as_i64().is_some());

    let (ok, out, err) = cli(&[
        "outbox",
        "retry",
        "--database-url",
        url,
        "--note",
        "hook is back",
        &ids[0],
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("pending again"), "{out}");
    let (ok, _, err) = cli(&["outbox", "retry", "--database-url", url, &ids[0]]);
    assert!(!ok && err.contains("is pending, not dead"), "{err}");
    let (ok, _, err) = cli(&["outbox", "drop", "--database-url", url, "msg_missing"]);
    assert!(
        !ok && err.contains("no outbox message msg_missing"),
        "{err}"
    );
    let (ok, out, err) = cli(&[
        "outbox",
        "drop",
        "--database-url",
        url,
        "--note",
        "never mind",
        &ids[1],
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("dropped"), "{out}");
    let (ok, _, err) = cli(&["outbox", "show", "--database-url", url, &ids[1]]);
    assert!(!ok && err.contains("no outbox message"), "{err}");
    let (_, shown, _) = cli(&["outbox", "show", "--database-url", url, &ids[0]]);
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["state"], "pending");
    assert_eq!(shown["attempts"], 0);
    assert_eq!(shown["audit"][0]["action"], "retried");
    assert_eq!(shown["audit"][0]["detail"], "hook is back");
    assert!(
        shown["audit"][0]["actor"]
            .as_str()
            .unwrap()
            .starts_with("operator:")
    );

    // `idemkey relay` delivers the retried message to a receiver that is up.
    let receiver = Receiver::default();
    let hook = receiver.start().await;
    let mut relay = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args(["relay", "--database-url", url, "--outbox-webhook", &hook])
        // Each backend's test runs its relay at once: each its own port.
        .args(["--listen", "127.0.0.1:0"])
        .env_remove("IDEMKEY_DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start idemkey relay");
    let deadline = Instant::now() + Duration::from_secs(30);
    while receiver.deliveries().is_empty() {
        assert!(Instant::now() < deadline, "the relay delivered nothing");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (rows, _) = until_delivered(&backend).await;
    let _ = relay.kill();
    let _ = relay.wait();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].2, "sent");
    let deliveries = receiver.deliveries();
    assert!(
        deliveries.iter().all(|(key, _)| key == &ids[0]),
        "{deliveries:?}"
    );

    let (ok, _, err) = cli(&["relay", "--database-url", url]);
    assert!(!ok && err.contains("nowhere to deliver"), "{err}");
}

/// `serve --outbox-nats` starts while NATS is down (payments succeed and their messages
/// wait), and once NATS is up the relay publishes each to JetStream with `Nats-Msg-Id`: the
/// stream it created holds exactly one copy per message, the envelope's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_publishes_to_jetstream_and_starts_while_nats_is_down() {
    const N: usize = 20;
    let backend = Backend::sqlite().await;
    let mut nats = tokio::task::spawn_blocking(idemkey_testkit::NatsServer::start)
        .await
        .unwrap();
    let nats_url = nats.url();
    nats.stop(idemkey_testkit::Stop::Graceful);
    let server = backend
        .start(&[
            "--outbox-nats",
            &nats_url,
            "--outbox-subject",
            "payments.events",
            "--outbox-delivery-timeout",
            "2s",
            "--outbox-max-backoff",
            "1s",
        ])
        .await;
    let api = server.api();
    for k in 0..N {
        let answer = api
            .pay_ok(
                TOKEN1,
                &format!("nats-{k}"),
                &payment(100 + k as i64, "nats"),
            )
            .await;
        assert_eq!(answer.status, 201, "{}", answer.text());
    }
    let (rows, _) = read_outbox(&backend).await;
    assert_eq!(rows.len(), N);
    assert!(
        rows.iter().all(|r| r.2 == "pending"),
        "NATS is down: nothing sent"
    );
    let mut nats = tokio::task::spawn_blocking(move || {
        nats.restart();
        nats
    })
    .await
    .unwrap();
    let (rows, _) = until_delivered(&backend).await;
    assert!(rows.iter().all(|r| r.2 == "sent"));

    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream("OUTBOX_PAYMENTS_EVENTS").await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    assert_eq!(state.messages, N as u64, "one copy per message");
    let mut ids = BTreeSet::new();
    for seq in state.first_sequence..=state.last_sequence {
        let message = stream.get_raw_message(seq).await.unwrap();
        let id = message
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|v| v.as_str().to_owned())
            .expect("Nats-Msg-Id");
        let envelope: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(envelope["id"], id.as_str());
        assert_eq!(envelope["type"], "payment.succeeded");
        ids.insert(id);
    }
    let expected: BTreeSet<String> = rows.into_iter().map(|r| r.0).collect();
    assert_eq!(ids, expected);
    drop(server);
    nats.stop(idemkey_testkit::Stop::Graceful);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_kill9_under_load_one_message_per_payment() {
    kill9_under_load_one_message_per_payment(Backend::sqlite().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill9_under_load_one_message_per_payment() {
    kill9_under_load_one_message_per_payment(Backend::postgres().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_operator_commands_and_the_relay_process() {
    operator_commands_and_the_relay_process(Backend::sqlite().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_operator_commands_and_the_relay_process() {
    operator_commands_and_the_relay_process(Backend::postgres().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_kill9_under_load_one_message_per_payment() {
    kill9_under_load_one_message_per_payment(Backend::mysql().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_operator_commands_and_the_relay_process() {
    operator_commands_and_the_relay_process(Backend::mysql().await).await;
}

/// `--outbox-nats` takes one server or a comma-separated list of them; a list with a server
/// that cannot be parsed is refused at start, naming the flag, instead of failing every
/// delivery later.
#[test]
fn relay_refuses_an_invalid_nats_server_list_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("relay.db").display());
    let (ok, _, err) = cli(&["migrate", "--database-url", &url]);
    assert!(ok, "{err}");
    let mut relay = Command::new(env!("CARGO_BIN_EXE_idemkey"))
        .args([
            "relay",
            "--database-url",
            &url,
            "--outbox-subject",
            "payments.events",
        ])
        .args([
            "--outbox-nats",
            "nats://127.0.0.1:4222,nats://127.0.0.1:99999",
        ])
        .env_remove("IDEMKEY_DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start idemkey relay");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = relay.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = relay.kill();
            let _ = relay.wait();
            panic!("idemkey relay started with an invalid server list");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut relay.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("--outbox-nats: invalid NATS URL"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_kill9_under_load_one_message_per_payment() {
    kill9_under_load_one_message_per_payment(Backend::postgres_through_pgbouncer().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_operator_commands_and_the_relay_process() {
    operator_commands_and_the_relay_process(Backend::postgres_through_pgbouncer().await).await;
}
