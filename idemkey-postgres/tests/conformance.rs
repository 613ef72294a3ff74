//! The conformance suite on PostgreSQL: each test on a fresh database of a throwaway
//! server (or of the server `DATABASE_URL` names), the suite twice: connected to the server
//! directly, and through PgBouncer in transaction pooling mode.

use std::time::Duration;

use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{
    IdempotencyKey, Inserted, KeyHasher, NewRecord, RecordState, Scope, Store, Timestamp,
};
use idemkey_postgres::PgStore;
use idemkey_testkit::Harness;
use idemkey_testkit::conformance::{begin_owned, json_fp, response};
use sqlx::Connection;
use sqlx::postgres::PgConnection;

struct PgHarness {
    store: PgStore,
    /// The database, direct (never through the pooler).
    url: String,
    /// A connection to it for the harness's own checks.
    admin: sqlx::PgPool,
}

impl PgHarness {
    /// A store connected to a fresh database directly.
    async fn new() -> Self {
        Self::connected(false).await
    }

    /// A store connected to a fresh database through PgBouncer in transaction mode.
    async fn through_pgbouncer() -> Self {
        Self::connected(true).await
    }

    async fn connected(pooled: bool) -> Self {
        let url = tokio::task::spawn_blocking(idemkey_testkit::fresh_database_url)
            .await
            .expect("fresh database");
        let store_url = if pooled {
            let direct = url.clone();
            let pooled =
                tokio::task::spawn_blocking(move || idemkey_testkit::pgbouncer_url(&direct))
                    .await
                    .expect("pgbouncer");
            format!("{pooled}?{}=transaction", PgStore::POOLER_PARAMETER)
        } else {
            url.clone()
        };
        // Room for every claimant of the 64-way race to hold its own transaction.
        let store = PgStore::connect(&store_url, 80).await.expect("connect");
        store.migrate().await.expect("migrate");
        let admin = sqlx::PgPool::connect(&url).await.expect("admin");
        sqlx::query("CREATE TABLE effects (label TEXT NOT NULL)")
            .execute(&admin)
            .await
            .expect("effects table");
        Self { store, url, admin }
    }
}

impl Harness for PgHarness {
    type Store = PgStore;

    fn store(&self) -> &PgStore {
        &self.store
    }

    async fn write_effect(&self, conn: &mut PgConnection, label: &str) {
        // Not kept prepared: behind a pooler the next transaction may be on another server
        // connection (docs/guide/operating.md, "Behind a pooler").
        sqlx::query("INSERT INTO effects (label) VALUES ($1)")
            .bind(label)
            .persistent(false)
            .execute(conn)
            .await
            .expect("effect");
    }

    async fn count_effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&self.admin)
            .await
            .expect("count")
    }

    async fn sever(&self, mut tx: <PgStore as Store>::Transaction) {
        // The server kills the owner's backend mid-transaction, as if its client crashed.
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await
            .expect("pid");
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&self.admin)
            .await
            .expect("terminate");
        assert!(killed, "the owner's backend was terminated");
        drop(tx);
    }
}

mod direct {
    use super::PgHarness;

    idemkey_testkit::conformance_tests!(PgHarness::new());
}

mod through_pgbouncer {
    use super::PgHarness;

    idemkey_testkit::conformance_tests!(PgHarness::through_pgbouncer());
}

fn test_claim(key: &[u8]) -> Claim {
    let key = IdempotencyKey::parse(key).expect("key");
    Claim {
        id: KeyHasher::new(b"secret").record_id(&Scope::new("t1", "POST", "/v1/payments"), &key),
        fingerprint: json_fp("{}"),
        now: Timestamp::now(),
        retention: Duration::from_secs(3600),
        sealed_key: None,
        first_sent: None,
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
    let stored = response("{}");
    let mut owner = store.begin().await.expect("begin");
    let outcome = protocol::claim(&store, &mut owner, &claim)
        .await
        .expect("claim");
    let ClaimOutcome::Owned { token, .. } = outcome else {
        panic!("{outcome:?}")
    };
    h.write_effect(&mut owner, "waited-on").await;
    protocol::complete(&store, &mut owner, &claim.id, token, &stored, claim.now)
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
                token: idemkey_core::fresh_token(),
                lease_expires_at: None,
                now: claim.now,
                expires_at: claim.now.plus(claim.retention),
                sealed_key: None,
                first_sent: None,
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
        matches!(&outcome, ClaimOutcome::Replay { response, .. } if *response == stored),
        "{outcome:?}"
    );
    assert_eq!(h.count_effects().await, 1);
}

/// The pool hands out connections without pinging them, nor does the store test those it
/// keeps. After the server ended every session of the pool while they sat idle (a restart,
/// an administrator), the next transaction still starts, on a live connection, and its
/// claim goes through.
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
    // And one the store keeps, out of the pool, after a transaction it committed.
    let tx = store.begin().await.expect("begin");
    store.commit(tx).await.expect("commit");

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

    // The layer's path: `BEGIN` and the claim in one message.
    let claim = test_claim(b"after-terminate");
    let (mut tx, token) = begin_owned(store, &claim).await;
    h.write_effect(&mut tx, "after-terminate").await;
    store
        .complete_and_commit(tx, &claim.id, token, &response("{}"), claim.now)
        .await
        .expect("complete and commit");
    assert_eq!(h.count_effects().await, 1);
}

/// Claims `claim` on the layer's path; when it owns the key, writes `label` and stores a
/// 201 with the commit.
async fn run_pipelined(h: &PgHarness, store: &PgStore, claim: &Claim, label: &str) -> ClaimOutcome {
    idemkey_testkit::conformance::run_once_on(h, store, claim, label, "{}").await
}

/// The claim's transaction begins and ends in messages of several statements, with sqlx
/// told only part of it (`BEGIN` with the claim, `COMMIT; BEGIN` after the completion, a
/// `ROLLBACK` queued on drop). Whatever path each transaction took (committed, dropped,
/// fenced, a replay through the taken key's second message), every connection goes back to
/// the pool out of any transaction, and the next transactions on them are whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_transactions_leave_no_connection_in_a_transaction() {
    let h = PgHarness::new().await;
    let store = PgStore::connect(&h.url, 4).await.expect("connect");
    for round in 0..3 {
        for i in 0..6 {
            let claim = test_claim(format!("committed-{round}-{i}").as_bytes());
            let first = run_pipelined(&h, &store, &claim, "committed").await;
            assert!(matches!(first, ClaimOutcome::Owned { .. }), "{first:?}");
            let again = run_pipelined(&h, &store, &claim, "replayed").await;
            assert!(matches!(again, ClaimOutcome::Replay { .. }), "{again:?}");
        }
        for i in 0..4 {
            let claim = test_claim(format!("dropped-{round}-{i}").as_bytes());
            let (mut tx, _) = begin_owned(&store, &claim).await;
            h.write_effect(&mut tx, "dropped").await;
            drop(tx);
        }
        let claim = test_claim(format!("fenced-{round}").as_bytes());
        let (mut tx, token) = begin_owned(&store, &claim).await;
        h.write_effect(&mut tx, "fenced").await;
        let refused = store
            .complete_and_commit(tx, &claim.id, token + 1, &response("{}"), claim.now)
            .await;
        assert!(
            matches!(refused, Err(idemkey_core::CommitError::Fenced)),
            "{refused:?}"
        );
    }
    // Every connection of the pool, each back from its last use (acquiring waits for that),
    // and each through its first statement: a connection the store kept may carry the
    // `ROLLBACK` of the empty transaction `COMMIT; BEGIN` left, queued for its next message.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut conn = store.acquire().await.expect("acquire");
        sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .expect("first statement");
        held.push(conn);
    }
    let in_transaction: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&mut *held[0])
    .await
    .expect("pg_stat_activity");
    assert_eq!(in_transaction, 0, "no connection was left in a transaction");
    drop(held);
    let labels: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT label FROM effects ORDER BY label")
            .fetch_all(store.pool())
            .await
            .expect("labels");
    assert_eq!(
        labels,
        ["committed"],
        "only committed transactions left effects"
    );
    assert_eq!(h.count_effects().await, 18);
}

/// sqlx counts the claim's transaction, so a handler's own `begin()` on it is a savepoint:
/// rolling the savepoint back keeps the claim and the rest of the effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_begun_on_the_claims_is_a_savepoint() {
    let h = PgHarness::new().await;
    let store = &h.store;
    let claim = test_claim(b"savepoint");
    let (mut tx, token) = begin_owned(store, &claim).await;
    {
        let mut inner = (*tx).begin().await.expect("savepoint");
        h.write_effect(&mut inner, "inner").await;
        inner.rollback().await.expect("roll back to the savepoint");
    }
    {
        let mut inner = (*tx).begin().await.expect("savepoint");
        h.write_effect(&mut inner, "inner-kept").await;
        inner.commit().await.expect("release the savepoint");
    }
    h.write_effect(&mut tx, "outer").await;
    store
        .complete_and_commit(tx, &claim.id, token, &response("{}"), claim.now)
        .await
        .expect("complete and commit");
    let labels: Vec<String> = sqlx::query_scalar("SELECT label FROM effects ORDER BY label")
        .fetch_all(store.pool())
        .await
        .expect("labels");
    assert_eq!(labels, ["inner-kept", "outer"]);
    let again = run_pipelined(&h, store, &claim, "again").await;
    assert!(matches!(again, ClaimOutcome::Replay { .. }), "{again:?}");
}

/// A claim told to wait at most 1 ms for the owner's row answers "in flight" (no
/// transaction is left open for it); once the owner committed, the same claim replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_claim_on_a_held_key_is_in_flight() {
    let h = PgHarness::new().await;
    let store = &h.store;
    let claim = test_claim(b"held");
    let (owner, outcome) = protocol::begin_claim(store, &claim, None)
        .await
        .expect("claim");
    let (ClaimOutcome::Owned { token, .. }, Some(mut owner)) = (outcome.clone(), owner) else {
        panic!("{outcome:?}")
    };
    h.write_effect(&mut owner, "held").await;
    let (tx, waited) = protocol::begin_claim(store, &claim, Some(Duration::from_millis(1)))
        .await
        .expect("claim");
    assert!(tx.is_none(), "no transaction for an in-flight answer");
    assert!(
        matches!(waited, ClaimOutcome::InFlight { .. }),
        "{waited:?}"
    );
    store
        .complete_and_commit(owner, &claim.id, token, &response("{}"), claim.now)
        .await
        .expect("complete and commit");
    let again = run_pipelined(&h, store, &claim, "again").await;
    assert!(matches!(again, ClaimOutcome::Replay { .. }), "{again:?}");
    assert_eq!(h.count_effects().await, 1);
}

/// PostgreSQL text cannot hold NUL: a tenant with one is an error of the claim, with no
/// transaction left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_tenant_is_an_error() {
    let h = PgHarness::new().await;
    let mut claim = test_claim(b"nul");
    claim.id.tenant = "t\0nul".into();
    let refused = protocol::begin_claim(&h.store, &claim, None).await;
    assert!(
        matches!(refused, Err(protocol::Error::Store(_))),
        "{refused:?}"
    );
    let fine = run_pipelined(&h, &h.store, &test_claim(b"after-nul"), "fine").await;
    assert!(matches!(fine, ClaimOutcome::Owned { .. }), "{fine:?}");
}
