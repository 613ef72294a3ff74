//! What InnoDB does differently from the other stores' databases, each shown on a real
//! MariaDB server: the snapshot of REPEATABLE READ, deadlocks between claims of one key,
//! the lock wait in whole seconds, collations that fold text, and strict mode.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{MySqlHarness, one_at_a_time};
use idemkey_core::protocol::{self, Claim, ClaimOutcome};
use idemkey_core::{IdempotencyKey, KeyHasher, Scope, Store, Timestamp};
use idemkey_mysql::{MigrationError, MySqlStore};
use idemkey_testkit::Harness;
use idemkey_testkit::conformance::{begin_owned, json_fp, response, run_once_on};
use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::mysql::MySqlPool;

fn claim_of(tenant: &str, key: &str) -> Claim {
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    Claim {
        id: KeyHasher::new(b"secret").record_id(&Scope::new(tenant, "POST", "/v1/payments"), &key),
        fingerprint: json_fp("{}"),
        now: Timestamp::now(),
        retention: Duration::from_secs(3600),
        sealed_key: None,
        first_sent: None,
    }
}

/// Waits until `n` transactions wait for a lock (under [`one_at_a_time`]).
async fn until_waiting(h: &MySqlHarness, n: usize) {
    while h.lock_waits().await < n {
        tokio::task::yield_now().await;
    }
}

/// A claim on a transaction of the caller's that read something first, as a handler may:
/// under REPEATABLE READ that read fixed the transaction's snapshot. Returns the outcome; an
/// owner writes its effect and completes, as `run_once_on` does.
async fn claim_after_a_read(h: &MySqlHarness, claim: &Claim, label: &str) -> ClaimOutcome {
    let store = &h.store;
    let mut tx = store.begin().await.expect("begin");
    let _: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&mut *tx)
        .await
        .expect("read");
    let outcome = protocol::claim(store, &mut tx, claim).await.expect("claim");
    if let ClaimOutcome::Owned { token, .. } = outcome {
        h.write_effect(&mut tx, label).await;
        protocol::complete(store, &mut tx, &claim.id, token, &response("{}"), claim.now)
            .await
            .expect("complete");
    }
    store.commit(tx).await.expect("commit");
    outcome
}

/// 32 claims of one key wait on its owner's uncommitted row, half on the layer's path and
/// half on transactions whose snapshot predates the owner's commit. Once the owner commits,
/// every one of them replays the owner's response: the claim reads the record that took the
/// key with a locking read, which sees the latest committed row, not the snapshot's. One
/// effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_loser_of_a_race_replays_the_winners_record() {
    const LOSERS: usize = 32;
    let _alone = one_at_a_time().await;
    let h = Arc::new(MySqlHarness::new().await);
    let claim = claim_of("t1", "raced");
    let (mut owner, token) = begin_owned(&h.store, &claim).await;
    let losers: Vec<_> = (0..LOSERS)
        .map(|i| {
            let (h, claim) = (h.clone(), claim.clone());
            tokio::spawn(async move {
                if i % 2 == 0 {
                    run_once_on(&*h, &h.store, &claim, "loser", "{\"loser\":true}").await
                } else {
                    claim_after_a_read(&h, &claim, "loser").await
                }
            })
        })
        .collect();
    until_waiting(&h, LOSERS).await;
    h.write_effect(&mut owner, "winner").await;
    let stored = response("{\"winner\":true}");
    h.store
        .complete_and_commit(owner, &claim.id, token, &stored, claim.now)
        .await
        .expect("complete and commit");
    for loser in losers {
        let outcome = loser.await.expect("loser");
        assert!(
            matches!(&outcome, ClaimOutcome::Replay { response, .. } if *response == stored),
            "{outcome:?}"
        );
    }
    assert_eq!(h.count_effects().await, 1);
}

/// Two claims wait on an owner that then rolls back: each holds a shared lock on the key
/// from its duplicate check and both go on to insert, a deadlock InnoDB breaks by rolling
/// back one of them whole (error 1213). That is a lost race: the victim begins again, waits
/// on the claim that won, and replays its record. One owner, one effect, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadlock_between_claims_is_a_lost_race() {
    let _alone = one_at_a_time().await;
    let h = Arc::new(MySqlHarness::new().await);
    let before = h.deadlocks().await;
    let claim = claim_of("t1", "deadlocked");
    let (owner, _) = begin_owned(&h.store, &claim).await;
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let (h, claim) = (h.clone(), claim.clone());
            tokio::spawn(async move {
                let body = format!("{{\"waiter\":{i}}}");
                run_once_on(&*h, &h.store, &claim, "waiter", &body).await
            })
        })
        .collect();
    until_waiting(&h, 2).await;
    owner.rollback().await.expect("roll back");
    let mut owned = 0;
    let mut replayed = 0;
    for waiter in waiters {
        match waiter.await.expect("waiter") {
            ClaimOutcome::Owned { .. } => owned += 1,
            ClaimOutcome::Replay { .. } => replayed += 1,
            other => panic!("a deadlock's victim replays the winner: {other:?}"),
        }
    }
    assert_eq!((owned, replayed), (1, 1));
    assert_eq!(h.count_effects().await, 1);
    assert!(
        h.deadlocks().await > before,
        "InnoDB broke a deadlock between the two claims"
    );
}

/// A claim told to wait at most 1 ms for the owner's row waits InnoDB's least, 1 s, and
/// answers "in flight" (error 1205, busy), with no transaction left open. The wait does not
/// outlast the claim: the store's next transaction on the same connection waits its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_claim_on_a_held_key_is_in_flight_and_its_wait_ends_with_it() {
    let _alone = one_at_a_time().await;
    let h = MySqlHarness::new().await;
    let claim = claim_of("t1", "held");
    let (mut owner, token) = begin_owned(&h.store, &claim).await;
    h.write_effect(&mut owner, "held").await;
    // One connection, so the next transaction is on the one the bounded claim used.
    let single = MySqlStore::connect(&h.url, 1).await.expect("connect");
    let (tx, waited) = protocol::begin_claim(&single, &claim, Some(Duration::from_millis(1)))
        .await
        .expect("claim");
    assert!(tx.is_none(), "no transaction for an in-flight answer");
    assert!(
        matches!(waited, ClaimOutcome::InFlight { .. }),
        "{waited:?}"
    );
    let mut next = single.begin().await.expect("begin");
    let wait: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(&mut *next)
        .await
        .expect("lock wait");
    assert_eq!(wait, MySqlStore::DEFAULT_LOCK_WAIT.as_secs());
    drop(next);
    h.store
        .complete_and_commit(owner, &claim.id, token, &response("{}"), claim.now)
        .await
        .expect("complete and commit");
    let again = run_once_on(&h, &h.store, &claim, "again", "{}").await;
    assert!(matches!(again, ClaimOutcome::Replay { .. }), "{again:?}");
    assert_eq!(h.count_effects().await, 1);
}

/// Routes (and tenants) that differ only in case or trailing spaces are different
/// identities: each claim of the same key owns its own record. A text collation would take
/// them for one (`_ci` folds case; MariaDB's `utf8mb4_bin` ignores trailing spaces) and
/// answer one route with another's record. (The key hash covers the tenant, not the route.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identities_are_compared_byte_for_byte() {
    let h = MySqlHarness::new().await;
    let scopes = [
        ("acme", "/v1/payments"),
        ("acme", "/v1/Payments"),
        ("acme", "/v1/payments "),
        ("Acme ", "/v1/payments"),
    ];
    for (tenant, route) in scopes {
        let key = IdempotencyKey::parse(b"same").expect("key");
        let claim = Claim {
            id: KeyHasher::new(b"secret").record_id(&Scope::new(tenant, "POST", route), &key),
            ..claim_of(tenant, "same")
        };
        let outcome = run_once_on(&h, &h.store, &claim, route, "{}").await;
        assert!(
            matches!(outcome, ClaimOutcome::Owned { .. }),
            "{tenant:?} {route:?}: {outcome:?}"
        );
    }
    assert_eq!(h.count_effects().await, 4);
}

/// On a server whose `sql_mode` is not strict, the store's connections still are: a
/// tenant longer than its column is an error of the claim, not a row cut to fit (where
/// `INSERT IGNORE`, or a lax session, would claim the key of the tenant's first 255 bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_too_long_is_refused_on_a_lax_server() {
    let h = MySqlHarness::new().await;
    sqlx::query("SET GLOBAL sql_mode = ''")
        .execute(&h.admin)
        .await
        .expect("lax server");
    let store = MySqlStore::connect(&h.url, 2).await;
    sqlx::query("SET GLOBAL sql_mode = DEFAULT")
        .execute(&h.admin)
        .await
        .expect("strict again");
    let store = store.expect("connect");
    let long = "t".repeat(300);
    let refused = protocol::begin_claim(&store, &claim_of(&long, "long"), None).await;
    assert!(
        matches!(refused, Err(protocol::Error::Store(_))),
        "{refused:?}"
    );
    let fine = run_once_on(&h, &store, &claim_of(&long[..255], "long"), "fine", "{}").await;
    assert!(matches!(fine, ClaimOutcome::Owned { .. }), "{fine:?}");
}

/// A stored response travels in one packet: one larger than the server's
/// `max_allowed_packet` is refused (error 1153, the server closes the connection), the
/// completion fails before its `COMMIT`, and nothing of the owner's is kept: the key is free
/// for a retry, which owns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_larger_than_max_allowed_packet_commits_nothing() {
    let h = MySqlHarness::new().await;
    let before: u64 = sqlx::query_scalar("SELECT @@GLOBAL.max_allowed_packet")
        .fetch_one(&h.admin)
        .await
        .expect("max_allowed_packet");
    sqlx::query("SET GLOBAL max_allowed_packet = 1048576")
        .execute(&h.admin)
        .await
        .expect("a small packet");
    let store = MySqlStore::connect(&h.url, 2).await;
    sqlx::query("SET GLOBAL max_allowed_packet = ?")
        .bind(before)
        .execute(&h.admin)
        .await
        .expect("the packet as it was");
    let store = store.expect("connect");
    let claim = claim_of("t1", "too-large");
    let (mut tx, token) = begin_owned(&store, &claim).await;
    h.write_effect(&mut tx, "too-large").await;
    let mut large = response("{}");
    large.body = vec![b' '; 2 * 1024 * 1024];
    let refused = store
        .complete_and_commit(tx, &claim.id, token, &large, claim.now)
        .await;
    assert!(
        matches!(refused, Err(idemkey_core::CommitError::NotCommitted(_))),
        "{refused:?}"
    );
    assert_eq!(h.count_effects().await, 0);
    let retry = run_once_on(&h, &h.store, &claim, "retry", "{}").await;
    assert!(matches!(retry, ClaimOutcome::Owned { .. }), "{retry:?}");
    assert_eq!(h.count_effects().await, 1);
}

/// Processes starting at once on a fresh database each run the migrations, one after
/// another under the database's migration lock: every run succeeds and each migration is
/// applied once (sqlx's own lock, whose answer it does not read, let them run together and
/// the others stop on a migration found half applied).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stores_migrating_one_fresh_database_at_once_all_succeed() {
    const PROCESSES: usize = 4;
    let url = tokio::task::spawn_blocking(|| {
        let server = common::server();
        server
            .query("CREATE DATABASE fresh_migrations")
            .expect("create database");
        let base = server.url();
        let (server_url, _) = base.rsplit_once('/').expect("a database in the URL");
        format!("{server_url}/fresh_migrations")
    })
    .await
    .expect("fresh database");
    let barrier = Arc::new(tokio::sync::Barrier::new(PROCESSES));
    let mut runs = Vec::new();
    for _ in 0..PROCESSES {
        let store = MySqlStore::connect(&url, 2).await.expect("connect");
        let barrier = barrier.clone();
        runs.push(tokio::spawn(async move {
            barrier.wait().await;
            store.migrate().await
        }));
    }
    for run in runs {
        run.await.expect("the run").expect("every run succeeds");
    }
    let store = MySqlStore::connect(&url, 1).await.expect("connect");
    common::assert_migrated(store.pool(), "three stores at once").await;
}

/// Waits until a session waits for the named lock of [`GATE`].
async fn until_at_the_gate(admin: &MySqlPool) {
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.processlist WHERE info = ?",
        )
        .bind(GATE)
        .fetch_one(admin)
        .await
        .expect("the process list");
        if waiting > 0 {
            return;
        }
        tokio::task::yield_now().await;
    }
}

/// A migration of the application's that waits for a named lock the test holds (named
/// locks are the server's: no other test takes this one).
const GATE: &str = "DO GET_LOCK('pitfalls_migration_gate', 600)";

/// When the migration lock lapses, in the database's seconds.
async fn lock_expiry(admin: &MySqlPool) -> i64 {
    sqlx::query_scalar("SELECT expires_at FROM idemkey_migration_lock WHERE id = 1")
        .fetch_one(admin)
        .await
        .expect("the lock's row")
}

/// A process running the migrations renews the lock's lease while it runs. Killed, it
/// leaves the lock's row behind, its lease running for a minute; on the server it ran on,
/// its connection is gone with it, and the next run takes the lock over at once. While it
/// lived, a run waited for it and gave up when its wait ended. (Lasts a renewal, 20 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_migration_lock_is_renewed_and_taken_over_at_once_when_its_process_is_gone() {
    let url = tokio::task::spawn_blocking(|| common::server().fresh_database())
        .await
        .expect("fresh database");
    let admin = MySqlPool::connect(&url).await.expect("admin");
    let mut gate = admin.acquire().await.expect("gate");
    let closed: i64 = sqlx::query_scalar("SELECT GET_LOCK('pitfalls_migration_gate', 0)")
        .fetch_one(&mut *gate)
        .await
        .expect("gate");
    assert_eq!(closed, 1);
    let store = MySqlStore::connect(&url, 2).await.expect("connect");
    let running = tokio::spawn({
        let store = store.clone();
        async move {
            let gated = Migrator::with_migrations(vec![Migration::new(
                1,
                "waits at the gate".into(),
                MigrationType::Simple,
                GATE.into_sql_str(),
                false,
            )]);
            store.migrate_with(&[&MySqlStore::migrator(), &gated]).await
        }
    });
    until_at_the_gate(&admin).await;
    let waited = store
        .clone()
        .with_migration_wait(Duration::from_millis(200))
        .migrate()
        .await;
    assert!(
        matches!(waited, Err(MigrationError::Locked(wait)) if wait == Duration::from_millis(200)),
        "{waited:?}"
    );
    // Renewed before the lease lapses, polled as the database's clock moves.
    let taken = lock_expiry(&admin).await;
    let mut polls = tokio::time::interval(Duration::from_millis(200));
    for _ in 0..MySqlStore::MIGRATION_LEASE.as_millis() / 200 {
        polls.tick().await;
        if lock_expiry(&admin).await > taken {
            break;
        }
    }
    assert!(lock_expiry(&admin).await > taken, "the lease renewed");
    // The process dies: its run is dropped, its connection closes once the server has ended
    // the statement it ran.
    running.abort();
    assert!(running.await.expect_err("aborted").is_cancelled());
    sqlx::query("DO RELEASE_LOCK('pitfalls_migration_gate')")
        .execute(&mut *gate)
        .await
        .expect("open the gate");
    // Half the lease: the lock is taken over, not waited out.
    let taken_over = store
        .with_migration_wait(MySqlStore::MIGRATION_LEASE / 2)
        .migrate()
        .await;
    assert!(taken_over.is_ok(), "{taken_over:?}");
    assert_eq!(lock_rows(&admin).await, 0, "the lock released");
}

/// The migration lock's rows.
async fn lock_rows(admin: &MySqlPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idemkey_migration_lock")
        .fetch_one(admin)
        .await
        .expect("the lock's table")
}

/// A migration lock held from another node (a Galera cluster's) is waited for, however its
/// holder's connection looks from here, until its lease lapses: then it is taken over at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_lock_held_elsewhere_is_waited_for_until_it_lapses() {
    let h = MySqlHarness::new().await;
    sqlx::query(
        "INSERT INTO idemkey_migration_lock (id, holder, node, connection, expires_at)
         VALUES (1, 'elsewhere', 'another-node:3306', 7, UNIX_TIMESTAMP() + 3600)",
    )
    .execute(&h.admin)
    .await
    .expect("a lock held elsewhere");
    let waited = h
        .store
        .clone()
        .with_migration_wait(Duration::from_millis(200))
        .migrate()
        .await;
    assert!(
        matches!(waited, Err(MigrationError::Locked(_))),
        "{waited:?}"
    );
    assert_eq!(lock_rows(&h.admin).await, 1, "the lock left alone");
    sqlx::query("UPDATE idemkey_migration_lock SET expires_at = UNIX_TIMESTAMP() - 1")
        .execute(&h.admin)
        .await
        .expect("the lease lapses");
    let taken_over = h
        .store
        .clone()
        .with_migration_wait(Duration::ZERO)
        .migrate()
        .await;
    assert!(taken_over.is_ok(), "{taken_over:?}");
    assert_eq!(lock_rows(&h.admin).await, 0, "the lock released");
}
