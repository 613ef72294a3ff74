//! The `idemkey` binary on a three-node MariaDB Galera cluster: one `idemkey serve` per node,
//! each on its node's URL of the same database with the same key secret, over real HTTP on
//! loopback. One cluster for the whole test binary, a fresh database per test; the test that
//! kills a node holds the cluster alone.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{Answer, Api, Backend, TOKEN1, payment};
use idemkey_testkit::GaleraCluster;

/// `idemkey migrate` on the database at `url`, as an operator may run it before the servers
/// start (they can also migrate a fresh database themselves, started together).
async fn migrate(url: &str) {
    let out =
        common::idemkey_cli(vec!["migrate".into(), "--database-url".into(), url.into()]).await;
    assert!(out.contains("migrations are up to date"), "{out}");
}

/// Three `serve` processes, one per node, started together on a fresh database (their
/// migrations and key secret race too, under the migration lock the whole cluster sees),
/// 200 keys × 16 identical requests spread over them. Certification lets one attempt of a
/// key commit; a loser on another node is answered from the winner's record, and payments
/// of other keys never conflict with it. Exactly 200 payments (read causally), one execution
/// per key, every answer the winner's 201 byte for byte, no 409, no 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_keys_sixteen_requests_through_three_serves_on_three_nodes() {
    let shared = GaleraCluster::shared().await.read().await;
    let nodes = tokio::task::block_in_place(|| shared.fresh_database());
    common::race_across_three_processes(Backend::galera(nodes)).await;
}

/// A payment's reference is taken once per tenant on the whole cluster, by the unique index
/// that gives a payment without a reference no certification key: a second payment naming
/// it, under another key through another node's server, is 409 `payment-reference-used`
/// naming the first; another tenant's payment may use it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_is_taken_once_per_tenant_across_nodes() {
    let shared = GaleraCluster::shared().await.read().await;
    let nodes = tokio::task::block_in_place(|| shared.fresh_database());
    migrate(&nodes[0]).await;
    let backend = Backend::galera(nodes);
    let (a, b) = futures::join!(backend.start(&[]), backend.start(&[]));
    let body = serde_json::json!({
        "amount": 500, "currency": "EUR", "customer": "c1", "reference": "invoice-1",
    })
    .to_string();
    let first = a.api().pay_ok(TOKEN1, "ref-first", &body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = b.api().pay_ok(TOKEN1, "ref-again", &body).await;
    again.assert_problem(409, "payment-reference-used");
    assert_eq!(
        again.json()["payment_id"],
        first.json()["id"],
        "{}",
        again.text()
    );
    let other = b.api().pay_ok(common::TOKEN2, "ref-other", &body).await;
    assert_eq!(other.status, 201, "{}", other.text());
}

/// How a client's payment went.
enum Paid {
    /// Acknowledged: a 201.
    Acknowledged(Answer),
    /// Its server could not take it (503, or no answer): the client moves on.
    Move(String),
}

/// One attempt of a payment, retried on the same server while the key is in flight
/// (bounded); any answer but a 201, a 409 request-in-flight or a 503 fails the test.
async fn pay(api: &Api, key: &str, body: &str) -> Paid {
    for _ in 0..100 {
        match api.pay(TOKEN1, key, body).await {
            Ok(answer) if answer.status == 201 => return Paid::Acknowledged(answer),
            Ok(answer) if answer.status == 409 => {
                answer.assert_in_flight();
                tokio::task::yield_now().await;
            }
            Ok(answer) if answer.status == 503 => {
                let problem = answer.problem_type();
                assert!(
                    problem.ends_with(":store-unavailable") || problem.ends_with(":store-busy"),
                    "key {key}: {}",
                    answer.text()
                );
                return Paid::Move(format!("503 {problem}"));
            }
            Ok(answer) => panic!("key {key}: unexpected {} {}", answer.status, answer.text()),
            Err(e) => return Paid::Move(e.to_string()),
        }
    }
    panic!("key {key}: still in flight after 100 attempts");
}

/// The payment id an acknowledged answer names.
fn payment_id(answer: &Answer) -> String {
    answer.json()["id"]
        .as_str()
        .expect("a payment id")
        .to_owned()
}

/// Node 2's mariadbd killed with SIGKILL while nine clients pay 270 keys through the three
/// `serve` processes, one per node, each key after the other. A client whose server answers
/// 503 (its node gone, or its transaction rolled back as the node left) or fails to answer
/// sends the same key and body to the next server whose node runs. Serve 2 keeps running
/// while its node is down, answering 503 `store-unavailable`, and takes payments again once
/// the node has rejoined. Every acknowledged payment is on the survivors and, after the
/// rejoin, on node 2, each key's once; every key is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_under_load_loses_no_acknowledged_payment() {
    const CLIENTS: usize = 9;
    const KEYS_EACH: usize = 30;
    const KEYS: usize = CLIENTS * KEYS_EACH;
    let mut cluster = GaleraCluster::shared().await.write().await;
    let nodes = tokio::task::block_in_place(|| cluster.fresh_database());
    migrate(&nodes[0]).await;
    let backend = Backend::galera(nodes.clone());
    let args = ["--max-connections", "8"];
    let (a, b, c) = futures::join!(
        backend.start(&args),
        backend.start(&args),
        backend.start(&args)
    );
    let apis = Arc::new([a.api(), b.api(), c.api()]);
    // The kill waits for a third of the keys to be acknowledged.
    let (acked_tx, mut acked_rx) = tokio::sync::mpsc::unbounded_channel::<Answer>();
    let alive = Arc::new(Mutex::new([true; 3]));
    let moved = Arc::new(AtomicUsize::new(0));
    // Nine clients, three on each server, each paying its keys one after another.
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (apis, acked, alive, moved) =
                (apis.clone(), acked_tx.clone(), alive.clone(), moved.clone());
            tokio::spawn(async move {
                let mut server = client % 3;
                for k in client * KEYS_EACH..(client + 1) * KEYS_EACH {
                    let (key, body) = (format!("kill-{k}"), payment(100 + k as i64, "kill"));
                    let mut answered = false;
                    for _ in 0..20 {
                        match pay(&apis[server], &key, &body).await {
                            Paid::Acknowledged(answer) => {
                                let _ = acked.send(answer);
                                answered = true;
                                break;
                            }
                            Paid::Move(why) => {
                                moved.fetch_add(1, Ordering::Relaxed);
                                let alive = *alive.lock().expect("alive");
                                let next = (1..=3).map(|d| (server + d) % 3).find(|&n| alive[n]);
                                println!("{key}: {why} from serve {server}, sent to {next:?}");
                                server = next.expect("a server whose node runs");
                            }
                        }
                    }
                    assert!(answered, "{key}: no server acknowledged it");
                }
            })
        })
        .collect();
    drop(acked_tx);
    let mut acked = Vec::new();
    while acked.len() < KEYS / 3 {
        acked.push(acked_rx.recv().await.expect("an acknowledgement"));
    }
    alive.lock().expect("alive")[2] = false;
    tokio::task::block_in_place(|| cluster.kill9(2));
    println!(
        "node 2 killed with {} of {KEYS} keys acknowledged",
        acked.len()
    );
    for client in clients {
        client
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    }
    while let Some(answer) = acked_rx.recv().await {
        acked.push(answer);
    }
    println!(
        "{} retries moved to another server",
        moved.load(Ordering::Relaxed)
    );
    assert_eq!(acked.len(), KEYS, "every key acknowledged");
    let first_hand = acked.iter().filter(|a| !a.replayed()).count();
    println!("{first_hand} keys acknowledged first-hand, the rest replayed");
    let acknowledged: BTreeSet<String> = acked.iter().map(payment_id).collect();
    assert_eq!(acknowledged.len(), KEYS, "one payment per key");

    // Serve 2 runs on, its node gone: nothing of a new key runs.
    let down = apis[2]
        .pay_ok(TOKEN1, "while-down", &payment(1, "down"))
        .await;
    down.assert_problem(503, "store-unavailable");
    assert!(down.header("retry-after").is_some(), "{}", down.text());

    // The survivors hold every acknowledged payment, each once, and nothing else.
    let holds = |snapshot: common::Snapshot, n: usize, node: usize| {
        snapshot.assert_consistent(n);
        let payments: BTreeSet<String> = snapshot.payments.into_iter().collect();
        assert!(
            payments.is_superset(&acknowledged),
            "node {node}: acknowledged payments missing"
        );
    };
    holds(backend.snapshot().await, KEYS, 0);
    holds(
        Backend::mysql_at(nodes[1].clone()).snapshot().await,
        KEYS,
        1,
    );

    tokio::task::block_in_place(|| cluster.restart(2));
    // Serve 2 takes payments again once its node has rejoined.
    let after = apis[2]
        .pay_until_created(TOKEN1, "after-rejoin", &payment(2, "after the rejoin"))
        .await;
    assert!(!after.replayed(), "{}", after.text());
    holds(
        Backend::mysql_at(nodes[2].clone()).snapshot().await,
        KEYS + 1,
        2,
    );
    holds(backend.snapshot().await, KEYS + 1, 0);
}
