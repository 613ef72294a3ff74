//! The conformance suite on PostgreSQL: each test on a fresh database of a throwaway
//! server (or of the server `DATABASE_URL` names).

use std::time::Duration;

use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    Fingerprint, FingerprintSpec, IdempotencyKey, Inserted, KeyHasher, NewRecord, RecordState,
    RequestParts, Scope, Store, StoredResponse, Timestamp,
};
use idemkey_postgres::PgStore;
use idemkey_testkit::Harness;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

struct PgHarness {
    store: PgStore,
    url: String,
}

impl PgHarness {
    async fn new() -> Self {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .expect("fresh database");
        // Room for every claimant of the 64-way race to hold its own transaction.
        let store = PgStore::connect(&url, 80).await.expect("connect");
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Self { store, url }
    }
}

impl Harness for PgHarness {
    type Store = PgStore;

    fn store(&self) -> &PgStore {
        &self.store
    }

    async fn write_effect(&self, conn: &mut PgConnection, label: &str) {
        sqlx::query("INSERT INTO effects (label) VALUES ($1)")
            .bind(label)
            .execute(conn)
            .await
            .expect("effect");
    }

    async fn count_effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(self.store.pool())
            .await
            .expect("count")
    }

    async fn sever(&self, mut tx: <PgStore as Store>::Transaction) {
        // The server kills the owner's backend mid-transaction, as if its client crashed.
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .expect("pid");
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(self.store.pool())
            .await
            .expect("terminate");
        assert!(killed, "the owner's backend was terminated");
        drop(tx);
    }
}

idemkey_testkit::conformance_tests!(PgHarness::new());

fn test_claim(key: &[u8]) -> Claim {
    let key = IdempotencyKey::parse(key).expect("key");
    Claim {
        id: KeyHasher::new(b"secret").record_id(&Scope::new("t1", "POST", "/v1/payments"), &key),
        fingerprint: json_fingerprint(b"{}"),
        now: Timestamp::now(),
        retention: Duration::from_secs(3600),
        sealed_key: None,
    }
}

fn json_fingerprint(body: &[u8]) -> Fingerprint {
    idemkey_core::fingerprint(
        &RequestParts {
            method: "POST",
            route: "/v1/payments",
            path_params: &[],
            query: None,
            content_type: Some("application/json"),
            body,
        },
        &FingerprintSpec::default(),
    )
}

fn created() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: Vec::new(),
        body: b"{}".to_vec(),
    }
}

/// A claim that waited on the owner's uncommitted row cannot see the row in its own
/// statement once the owner commits (the statement's snapshot predates the commit): the
/// insert answers `Conflict`, and the protocol's separate read finds the completed record
/// and replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_that_waited_on_the_owner_reads_the_record_after_it() {
    let h = PgHarness::new().await;
    let store = h.store.clone();
    let claim = test_claim(b"waited-on");
    let mut owner = store.begin().await.expect("begin");
    let outcome = protocol::claim(&store, &mut owner, &claim)
        .await
        .expect("claim");
    let ClaimOutcome::Owned { token, .. } = outcome else {
        panic!("{outcome:?}")
    };
    h.write_effect(&mut owner, "waited-on").await;
    protocol::complete(&store, &mut owner, &claim.id, token, &created())
        .await
        .expect("complete");

    let waiter = {
        let (store, claim) = (store.clone(), claim.clone());
        tokio::spawn(async move {
            let mut tx = store.begin().await.expect("begin");
            let new = NewRecord {
                id: claim.id.clone(),
                fingerprint: claim.fingerprint.clone(),
                state: RecordState::Executing,
                lease_expires_at: None,
                now: claim.now,
                expires_at: claim.now.plus(claim.retention),
                sealed_key: None,
            };
            let inserted = store.insert(&mut tx, &new).await.expect("insert");
            let outcome = protocol::claim(&store, &mut tx, &claim)
                .await
                .expect("claim");
            store.commit(tx).await.expect("commit");
            (inserted, outcome)
        })
    };
    // The waiter's insert is blocked on the owner's row: wait until the server says so.
    let mut admin = PgConnection::connect(&h.url)
        .await
        .expect("admin connection");
    loop {
        let blocked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&mut admin)
        .await
        .expect("pg_stat_activity");
        if blocked > 0 {
            break;
        }
    }
    store.commit(owner).await.expect("commit");

    let (inserted, outcome) = waiter.await.expect("waiter");
    assert_eq!(inserted, Inserted::Conflict);
    assert!(
        matches!(&outcome, ClaimOutcome::Replay { response, .. } if *response == created()),
        "{outcome:?}"
    );
    assert_eq!(h.count_effects().await, 1);
}

/// The pool hands out connections without pinging them. After the server ended every
/// session of the pool while they sat idle (a restart, an administrator), the next
/// transaction still starts, on a live connection, and its claim goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_survives_terminated_idle_connections() {
    let h = PgHarness::new().await;
    let store = &h.store;
    // Three connections, opened at once, then put back idle.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(store.acquire().await.expect("acquire"));
    }
    for conn in &mut held {
        // What dropping it does in a spawned task, done here so the test knows when.
        conn.return_to_pool().await;
    }
    drop(held);
    assert!(store.pool().num_idle() >= 3, "three idle connections");

    let mut admin = PgConnection::connect(&h.url)
        .await
        .expect("admin connection");
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut admin)
    .await
    .expect("terminate");
    assert!(terminated.len() >= 3, "{terminated:?}");
    assert!(
        terminated.iter().all(|&t| t),
        "every backend ended: {terminated:?}"
    );

    let claim = test_claim(b"after-terminate");
    let mut tx = store.begin().await.expect("begin on a live connection");
    let outcome = protocol::claim(store, &mut tx, &claim)
        .await
        .expect("claim");
    let ClaimOutcome::Owned { token, .. } = outcome else {
        panic!("{outcome:?}")
    };
    h.write_effect(&mut tx, "after-terminate").await;
    protocol::complete(store, &mut tx, &claim.id, token, &created())
        .await
        .expect("complete");
    store.commit(tx).await.expect("commit");
    assert_eq!(h.count_effects().await, 1);
}
