//! The MySQL store on a three-node MariaDB Galera cluster: the conformance suite, and the
//! races of claimants spread over the nodes, where certification arbitrates at `COMMIT`
//! (error 1213 for the loser) and `SELECT … FOR UPDATE` locks on one node only. One cluster
//! for the whole test binary, a fresh database per test; the test that kills a node holds
//! the cluster alone.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    CommitError, IdempotencyKey, KeyHasher, Scope, Store, StoreError, StoredResponse, Timestamp,
};
use idemkey_mysql::MySqlStore;
use idemkey_testkit::conformance::{json_fp, response};
use idemkey_testkit::{GaleraCluster, Harness};
use idemkey_tower::{IdempotencyLayer, REPLAYED_HEADER, Tx};
use sqlx::mysql::{MySqlConnection, MySqlPool};
use tokio::sync::RwLockReadGuard;

struct GaleraHarness {
    /// The store on node 0, the one the conformance suite runs on.
    store: MySqlStore,
    /// The fresh database's URL on each node.
    urls: Vec<String>,
    /// A pool of its own on node 0 for the harness's checks, its reads causal.
    admin: MySqlPool,
    /// Keeps a node from being killed under the test (`None`: the test holds the cluster).
    _shared: Option<RwLockReadGuard<'static, GaleraCluster>>,
}

impl GaleraHarness {
    /// A migrated store on node 0 of a fresh database, sharing the cluster.
    async fn new() -> Self {
        let shared = GaleraCluster::shared().await.read().await;
        let urls = tokio::task::block_in_place(|| shared.fresh_database());
        Self::on(urls, Some(shared)).await
    }

    async fn on(
        urls: Vec<String>,
        shared: Option<RwLockReadGuard<'static, GaleraCluster>>,
    ) -> Self {
        // Room for every claimant of the 64-way race to hold its own transaction.
        let store = MySqlStore::connect(&urls[0], 80).await.expect("connect");
        store.migrate().await.expect("migrate");
        let admin = causal(&urls[0]).await;
        // Galera replicates a table with a primary key row by row.
        sqlx::query(
            "CREATE TABLE effects (id BIGINT AUTO_INCREMENT PRIMARY KEY,
                                   label VARCHAR(255) NOT NULL) ENGINE = InnoDB",
        )
        .execute(&admin)
        .await
        .expect("effects table");
        Self {
            store,
            urls,
            admin,
            _shared: shared,
        }
    }

    /// A store on node `i` of the same database.
    async fn store_on(&self, i: usize, connections: u32) -> MySqlStore {
        MySqlStore::connect(&self.urls[i], connections)
            .await
            .expect("connect")
    }

    /// Effects per label.
    async fn effects_by_label(&self, pool: &MySqlPool) -> HashMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>("SELECT label, COUNT(*) FROM effects GROUP BY label")
            .fetch_all(pool)
            .await
            .expect("effects")
            .into_iter()
            .collect()
    }
}

/// A pool on `url` whose reads wait for the node to have applied every write the cluster
/// ordered before them (`wsrep_sync_wait = 1`).
async fn causal(url: &str) -> MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(conn, "SET SESSION wsrep_sync_wait = 1").await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect("causal pool")
}

impl Harness for GaleraHarness {
    type Store = MySqlStore;

    fn store(&self) -> &MySqlStore {
        &self.store
    }

    async fn write_effect(&self, conn: &mut MySqlConnection, label: &str) {
        common::write_effect(conn, label).await;
    }

    async fn count_effects(&self) -> i64 {
        common::count_effects(&self.admin).await
    }

    async fn sever(&self, tx: <MySqlStore as Store>::Transaction) {
        common::sever(&self.admin, tx).await;
    }
}

mod conformance {
    use super::GaleraHarness;

    idemkey_testkit::conformance_tests!(GaleraHarness::new());
}

fn claim_of(key: &str) -> Claim {
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    Claim {
        id: KeyHasher::new(b"secret").record_id(&Scope::new("t1", "POST", "/v1/payments"), &key),
        fingerprint: json_fp("{}"),
        now: Timestamp::now(),
        retention: Duration::from_secs(3600),
        sealed_key: None,
        first_sent: None,
    }
}

/// One attempt in local mode as the layer runs it: the claim, an effect labelled `label` on
/// its transaction and the answer stored with the commit. An attempt whose commit lost to
/// another's (nothing committed, the key taken) answers as a retry would: the record read
/// again. `Ok(None)`: this attempt's effect and answer committed. `Err`: what a client
/// would have been answered with an error.
async fn attempt(
    store: &MySqlStore,
    claim: &Claim,
    label: &str,
    body: &StoredResponse,
) -> Result<Option<ClaimOutcome>, String> {
    let (tx, outcome) = protocol::begin_claim(store, claim, None)
        .await
        .map_err(|e| format!("claim: {e:?}"))?;
    let (token, mut tx) = match (outcome, tx) {
        (ClaimOutcome::Owned { token, .. }, Some(tx)) => (token, tx),
        (other, tx) => {
            if let Some(tx) = tx {
                store.commit(tx).await.map_err(|e| format!("{e:?}"))?;
            }
            return Ok(Some(other));
        }
    };
    let effect = sqlx::query("INSERT INTO effects (label) VALUES (?)")
        .bind(label)
        .execute(&mut *tx)
        .await;
    let failed = match effect {
        // The handler's own statement failed: its answer would be a 500, not stored.
        Err(e) => format!("effect: {e:?}"),
        Ok(_) => match store
            .complete_and_commit(tx, &claim.id, token, body, claim.now)
            .await
        {
            Ok(()) => return Ok(None),
            Err(e @ CommitError::NotCommitted(StoreError::Busy(_))) => format!("{e:?}"),
            Err(e) => return Err(format!("complete and commit: {e:?}")),
        },
    };
    // As the layer does: the record another attempt committed answers, if there is one.
    protocol::lookup(store, &claim.id, &claim.fingerprint, None, claim.now)
        .await
        .map_err(|e| format!("lookup: {e:?}"))?
        .map(Some)
        .ok_or(failed)
}

/// Attempts `claim` until it is answered with the stored response, at most `rounds` times:
/// whether this claimant's own attempt was the one that committed, and its errors.
async fn until_answered(
    store: &MySqlStore,
    claim: &Claim,
    label: &str,
    body: &StoredResponse,
    rounds: usize,
) -> Result<bool, String> {
    for _ in 0..rounds {
        match attempt(store, claim, label, body).await? {
            None => return Ok(true),
            Some(ClaimOutcome::Replay { response, .. }) if response == *body => return Ok(false),
            Some(ClaimOutcome::InFlight { .. }) => tokio::task::yield_now().await,
            Some(other) => return Err(format!("answered {other:?}")),
        }
    }
    Err(format!("still in flight after {rounds} attempts"))
}

/// 48 claimants of one key, 16 on each node, each with an effect in the claim's
/// transaction: certification lets one commit, every other attempt either waited on it (same
/// node) or failed at `COMMIT` with 1213 and read the winner's record. One effect, every
/// claimant answered with the winner's response, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claimants_of_one_key_on_three_nodes_run_it_once() {
    let h = GaleraHarness::new().await;
    let mut stores = Vec::new();
    for i in 0..3 {
        stores.push(h.store_on(i, 20).await);
    }
    let body = response("{\"paid\":true}");
    for round in 0..5 {
        let claim = claim_of(&format!("one-key-{round}"));
        let barrier = Arc::new(tokio::sync::Barrier::new(48));
        let tasks: Vec<_> = (0..48)
            .map(|i| {
                let (store, claim, body) = (stores[i % 3].clone(), claim.clone(), body.clone());
                let barrier = barrier.clone();
                let label = format!("one-key-{round}");
                tokio::spawn(async move {
                    barrier.wait().await;
                    until_answered(&store, &claim, &label, &body, 1000).await
                })
            })
            .collect();
        let mut winners = 0;
        for task in tasks {
            match task.await.expect("claimant") {
                Ok(won) => winners += usize::from(won),
                Err(e) => panic!("round {round}: a claimant was answered with an error: {e}"),
            }
        }
        assert_eq!(winners, 1, "round {round}");
    }
    let effects = h.effects_by_label(&h.admin).await;
    assert_eq!(effects.len(), 5, "{effects:?}");
    assert!(effects.values().all(|&n| n == 1), "{effects:?}");
}

/// The handler: an effect row on the claim's transaction; a failed statement is a 500.
async fn pay(mut tx: Tx<MySqlStore>) -> (StatusCode, &'static str) {
    match sqlx::query("INSERT INTO effects (label) VALUES ('paid')")
        .execute(&mut *tx)
        .await
    {
        Ok(_) => (StatusCode::CREATED, "{\"paid\":true}"),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "{}"),
    }
}

/// The same through the layer over HTTP on loopback: one server per node, 16 clients of
/// one key on each, retrying while the key is in flight. Every client gets the winner's
/// 201, one of them first-hand; one effect; no other status.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_of_one_key_on_three_servers_get_one_answer() {
    let h = GaleraHarness::new().await;
    let mut urls = Vec::new();
    let mut servers = Vec::new();
    for i in 0..3 {
        let layer = IdempotencyLayer::new(h.store_on(i, 20).await, KeyHasher::new(b"secret"));
        let app = Router::new().route("/pay", post(layer.handler(pay)));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("loopback");
        urls.push(format!(
            "http://{}/pay",
            listener.local_addr().expect("address")
        ));
        servers.push(tokio::spawn(
            async move { axum::serve(listener, app).await },
        ));
    }
    let client = reqwest::Client::new();
    for round in 0..5 {
        let barrier = Arc::new(tokio::sync::Barrier::new(48));
        let tasks: Vec<_> = (0..48)
            .map(|i| {
                let (client, url, barrier) = (client.clone(), urls[i % 3].clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    for _ in 0..1000 {
                        let answer = client
                            .post(&url)
                            .header("idempotency-key", format!("pay-{round}"))
                            .header("content-type", "application/json")
                            .body("{}")
                            .send()
                            .await
                            .expect("send");
                        let (status, replayed) = (
                            answer.status(),
                            answer.headers().contains_key(REPLAYED_HEADER),
                        );
                        let body = answer.text().await.expect("body");
                        if status != reqwest::StatusCode::CONFLICT {
                            return (status, replayed, body);
                        }
                    }
                    panic!("still in flight after 1000 attempts");
                })
            })
            .collect();
        let mut first_hand = 0;
        for task in tasks {
            let (status, replayed, body) = task.await.expect("client");
            assert_eq!(
                status,
                reqwest::StatusCode::CREATED,
                "round {round}: {body}"
            );
            assert_eq!(body, "{\"paid\":true}");
            first_hand += usize::from(!replayed);
        }
        assert_eq!(first_hand, 1, "round {round}");
    }
    assert_eq!(h.count_effects().await, 5);
    for server in servers {
        server.abort();
    }
}

/// 200 keys, 16 claimants each, spread over the three nodes: 200 effects, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_keys_sixteen_claimants_over_three_nodes() {
    let h = GaleraHarness::new().await;
    let mut stores = Vec::new();
    for i in 0..3 {
        stores.push(h.store_on(i, 24).await);
    }
    let started = Instant::now();
    let body = response("{\"paid\":true}");
    let tasks: Vec<_> = (0..200 * 16)
        .map(|n| {
            let (key, claimant) = (n / 16, n % 16);
            let store = stores[(key + claimant) % 3].clone();
            let body = body.clone();
            tokio::spawn(async move {
                let label = format!("k{key}");
                until_answered(&store, &claim_of(&label), &label, &body, 1000).await
            })
        })
        .collect();
    let mut winners = 0;
    for task in tasks {
        match task.await.expect("claimant") {
            Ok(won) => winners += usize::from(won),
            Err(e) => panic!("a claimant was answered with an error: {e}"),
        }
    }
    println!("3200 claims over three nodes in {:?}", started.elapsed());
    assert_eq!(winners, 200);
    let effects = h.effects_by_label(&h.admin).await;
    assert_eq!(effects.len(), 200);
    assert!(effects.values().all(|&n| n == 1), "{effects:?}");
}

/// External mode: 48 reservations of one key, 16 on each node, each an autocommit
/// `INSERT`. Those that lose certification (1213) are begun again and find the winner's
/// record: one owner, every other reservation in flight, none an error, so only one
/// would forward.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reservations_of_one_key_on_three_nodes_have_one_owner() {
    let h = GaleraHarness::new().await;
    let mut stores = Vec::new();
    for i in 0..3 {
        stores.push(h.store_on(i, 20).await);
    }
    for round in 0..5 {
        let claim = claim_of(&format!("reserved-{round}"));
        let barrier = Arc::new(tokio::sync::Barrier::new(48));
        let tasks: Vec<_> = (0..48)
            .map(|i| {
                let (store, claim, barrier) =
                    (stores[i % 3].clone(), claim.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    protocol::reserve(&store, &claim, Duration::from_secs(60)).await
                })
            })
            .collect();
        let mut owners = 0;
        for task in tasks {
            match task.await.expect("reserver") {
                Ok(ClaimOutcome::Owned { .. }) => owners += 1,
                Ok(ClaimOutcome::InFlight { .. }) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(owners, 1, "round {round}");
    }
}

/// Three processes starting at once on three nodes of a fresh database, five times over: each
/// runs the migrations, one after another under a lock the whole cluster sees, and each run
/// succeeds; every migration is applied once, whole. (A node's own named lock let two nodes
/// run migration 1 at once, and one of them failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stores_on_three_nodes_migrating_one_fresh_database_at_once_all_succeed() {
    let shared = GaleraCluster::shared().await.read().await;
    for round in 0..5 {
        let urls = tokio::task::block_in_place(|| shared.fresh_database());
        let barrier = Arc::new(tokio::sync::Barrier::new(urls.len()));
        let mut runs = Vec::new();
        for url in &urls {
            let store = MySqlStore::connect(url, 2).await.expect("connect");
            let barrier = barrier.clone();
            runs.push(tokio::spawn(async move {
                barrier.wait().await;
                store.migrate().await
            }));
        }
        for (node, run) in runs.into_iter().enumerate() {
            if let Err(e) = run.await.expect("the run") {
                panic!("round {round}: the run on node {node} failed: {e}");
            }
        }
        common::assert_migrated(&causal(&urls[2]).await, &format!("round {round}")).await;
    }
}

/// Whether `e` is an answer a client retries, on the next node that runs: its node is gone
/// (503 store-unavailable, or the commit's outcome unknown), or its transaction was rolled
/// back by the cluster as the node left and nothing took the key (503 store-busy).
fn retried(e: &str) -> bool {
    ["Unavailable", "Unknown", "Io", "PoolTimedOut", "Busy"]
        .iter()
        .any(|answer| e.contains(answer))
}

/// Node 2 killed with SIGKILL while nine clients claim 270 keys on all three nodes, each
/// moving to the next node when its node is gone. Every acknowledged claim (its completion
/// committed) is on the survivors and, once node 2 has rejoined, on node 2; no key ran
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_killed_under_load_loses_no_acknowledged_claim() {
    const CLIENTS: usize = 9;
    const KEYS_EACH: usize = 30;
    const KEYS: usize = CLIENTS * KEYS_EACH;
    let mut cluster = GaleraCluster::shared().await.write().await;
    let urls = tokio::task::block_in_place(|| cluster.fresh_database());
    let h = GaleraHarness::on(urls, None).await;
    let mut stores = Vec::new();
    for i in 0..3 {
        stores.push(h.store_on(i, 8).await);
    }
    let stores = Arc::new(stores);
    let body = response("{\"paid\":true}");
    // The kill waits for a third of the keys to be acknowledged.
    let (acked_tx, mut acked_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let alive = Arc::new(std::sync::Mutex::new([true; 3]));
    let moved = Arc::new(AtomicUsize::new(0));
    // Nine clients, three on each node, each claiming its keys one after another.
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (stores, body, acked, alive, moved) = (
                stores.clone(),
                body.clone(),
                acked_tx.clone(),
                alive.clone(),
                moved.clone(),
            );
            tokio::spawn(async move {
                let mut node = client % 3;
                let mut won = 0;
                for key in client * KEYS_EACH..(client + 1) * KEYS_EACH {
                    let label = format!("k{key}");
                    let claim = claim_of(&label);
                    let mut answered = false;
                    for _ in 0..100 {
                        match until_answered(&stores[node], &claim, &label, &body, 1000).await {
                            Ok(first_hand) => {
                                won += usize::from(first_hand);
                                let _ = acked.send(key);
                                answered = true;
                                break;
                            }
                            Err(e) if retried(&e) => {
                                // Retry on the next node that runs.
                                moved.fetch_add(1, Ordering::Relaxed);
                                let alive = *alive.lock().expect("alive");
                                node = (1..=3)
                                    .map(|d| (node + d) % 3)
                                    .find(|&n| alive[n])
                                    .unwrap_or(0);
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    if !answered {
                        return Err(format!("no node answered for {label}"));
                    }
                }
                Ok(won)
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
    let mut winners = 0;
    for task in tasks {
        match task.await.expect("client") {
            Ok(won) => winners += won,
            Err(e) => panic!("a client was answered with an error: {e}"),
        }
    }
    println!(
        "{} retries moved to another node",
        moved.load(Ordering::Relaxed)
    );
    while let Some(key) = acked_rx.recv().await {
        acked.push(key);
    }
    assert_eq!(acked.len(), KEYS);
    println!("{winners} keys acknowledged first-hand, the rest replayed");
    assert!(winners <= KEYS);
    let survivor = causal(&h.urls[1]).await;
    for pool in [&h.admin, &survivor] {
        let effects = h.effects_by_label(pool).await;
        assert_eq!(effects.len(), KEYS, "{effects:?}");
        assert!(effects.values().all(|&n| n == 1), "{effects:?}");
    }
    tokio::task::block_in_place(|| cluster.restart(2));
    let rejoined = causal(&h.urls[2]).await;
    let effects = h.effects_by_label(&rejoined).await;
    assert_eq!(effects.len(), KEYS, "{effects:?}");
    assert!(effects.values().all(|&n| n == 1), "{effects:?}");
    let records: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idemkey_records")
        .fetch_one(&rejoined)
        .await
        .expect("records");
    assert_eq!(records, KEYS as i64);
}
